"""The unit every role sends: JSON-able metadata plus named arrays (never pickle)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Payload:
    """One logical message between roles.

    Attributes:
        meta: JSON-serialisable metadata (str, int, float, bool, None, lists and dicts of them).
        tensors: named numpy arrays; they travel as raw little-endian buffers.
    """

    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def tensor_bytes(self) -> int:
        """Total size of the tensors' buffers in bytes."""
        return sum(int(array.nbytes) for array in self.tensors.values())

"""The unit every role sends: JSON-able metadata plus named arrays (never pickle)."""

from __future__ import annotations

import math
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


Run = tuple[int, int, np.ndarray]
"""Tensors ``start`` to ``stop`` (positions in a mapping's order) as one 1-D view over them."""


class PackedTensors(dict[str, np.ndarray]):
    """Named arrays (a dict) that lie back to back in one buffer, in the dict's order: a
    decoded message's tensors, a fold's mean. ``runs()`` hands out the stretches of one dtype
    as 1-D views, so that elementwise work on a model of many small tensors costs a call per
    stretch, not per tensor.

    Replacing, adding or removing an entry is allowed; it only makes ``runs()`` return None
    from then on (the views would no longer be the dict's arrays). Writing an array's values
    writes the views' too: they alias the same memory.
    """

    __slots__ = ("_packed", "_runs")

    def __init__(self, arrays: dict[str, np.ndarray], runs: list[Run]) -> None:
        """``arrays`` are views of the runs' memory, in order; ``runs`` cover every position
        once, in order (the caller guarantees both: ``pack`` and the decoder do)."""
        super().__init__(arrays)
        self._packed = tuple(arrays.values())
        self._runs = runs

    def runs(self) -> list[Run] | None:
        """The stretches of one dtype as (first position, stop position, 1-D view), in order,
        if the dict still holds exactly the arrays it was made with; None if not."""
        if len(self) != len(self._packed):
            return None
        for held, packed in zip(self.values(), self._packed, strict=True):
            if held is not packed:
                return None
        return self._runs

    @classmethod
    def empty_like(cls, layout: dict[str, tuple[tuple[int, ...], np.dtype]]) -> PackedTensors:
        """New uninitialised arrays of ``layout``'s shapes and dtypes (name: (shape, dtype)),
        one buffer per stretch of names with one dtype."""
        arrays: dict[str, np.ndarray] = {}
        runs: list[Run] = []
        names = list(layout)
        start = 0
        while start < len(names):
            dtype = np.dtype(layout[names[start]][1])
            stop = start
            while stop < len(names) and np.dtype(layout[names[stop]][1]) == dtype:
                stop += 1
            sizes = [math.prod(layout[name][0]) for name in names[start:stop]]
            flat = np.empty(sum(sizes), dtype=dtype)
            offset = 0
            for name, size in zip(names[start:stop], sizes, strict=True):
                arrays[name] = flat[offset : offset + size].reshape(layout[name][0])
                offset += size
            runs.append((start, stop, flat))
            start = stop
        return cls(arrays, runs)

    def __reduce__(self) -> tuple[Any, ...]:  # a copy or pickle is a plain dict
        return (dict, (dict(self),))

"""One model per cluster, kept as rows of a float64 matrix: what clustered servers share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedcore.protocols._base import Weights, check_state_kind
from fedcore.protocols._maths import unflatten


class ClusterModels:
    """Mixin for a server whose state is ``_theta`` (clusters x parameters, float64) shaped
    like ``_like``; ``kind`` names its checkpoint state."""

    kind: str
    _theta: np.ndarray
    _like: Weights

    def global_weights(self) -> Weights:
        """Cluster 0's model (``models()`` has every cluster's)."""
        return unflatten(self._theta[0], self._like)

    def models(self) -> list[Weights]:
        """Every cluster's model, in cluster order."""
        return [unflatten(row, self._like) for row in self._theta]

    def state_dict(self) -> dict[str, Any]:
        """The cluster models."""
        return {"kind": self.kind, "version": 1, "theta": self._theta.copy()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the cluster models; refuses another kind or another shape."""
        check_state_kind(state, self.kind, ["theta"])
        theta = np.asarray(state["theta"], dtype=np.float64)
        if theta.shape != self._theta.shape:
            raise ValueError(
                f"The {self.kind} state holds models of shape {theta.shape}; this run's are "
                f"{self._theta.shape}."
            )
        self._theta = theta.copy()

"""A user's model by import path (``spec.model.kind: Import``) for the integration tests: the
roles fork from a forkserver whose ``sys.path`` holds the repository's root, so
``tests.integration._user_model:mlp`` imports in every role."""

from __future__ import annotations

import math

from torch import nn


def mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Flatten, Linear(n, 16), ReLU, Linear(16, classes)."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(math.prod(input_shape), 16), nn.ReLU(), nn.Linear(16, num_classes)
    )

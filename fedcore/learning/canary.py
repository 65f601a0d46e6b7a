"""Canary clients: clients whose every update is one fixed direction (the canary audit's probes).

A canary (Andrew et al., "One-shot Empirical Privacy Estimation for Federated Learning", ICLR
2024) is a client that holds no data: whatever model it is sent, it reports an update of norm
``scale`` along its own fixed random unit direction. It goes through its protocol's client side
like any client (clipping, quantization, noise shares, masks are the protocol's own), so the
final model's movement along each canary's direction measures what the released model reveals
about one client. ``CanaryLearner`` stands in for ``LocalLearner`` where a protocol asks for
training (``train``: the weights moved by ``+scale·d``) or a gradient (``gradient``:
``-scale·d``, so a descent step also moves the model along ``+d``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from torch import nn

from fedcore.learning.data import ArrayDataset
from fedcore.learning.training import LocalLearner, LocalStats
from fedcore.spec import TrainingSpec

Direction = dict[str, np.ndarray]
"""One array per trainable parameter (float64), of L2 norm 1 over all of them together."""


def trainable_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The shapes of ``model``'s trainable floating-point parameters, by state-dict name."""
    return {
        name: tuple(p.shape)
        for name, p in model.named_parameters(remove_duplicate=False)
        if p.requires_grad and p.dtype.is_floating_point
    }


def random_direction(shapes: Mapping[str, tuple[int, ...]], seed: int, index: int) -> Direction:
    """A uniformly random unit direction over ``shapes``, drawn from ``(seed, index)``."""
    rng = np.random.default_rng([seed, index, 0xCA9A])
    parts = {name: rng.standard_normal(shape) for name, shape in shapes.items()}
    norm = float(np.sqrt(sum(float(np.sum(p * p)) for p in parts.values())))
    return {name: p / norm for name, p in parts.items()}


def along(weights: Mapping[str, np.ndarray], direction: Direction) -> np.ndarray:
    """``weights`` restricted to the direction's parameters, flattened in its order (float64)."""
    return np.concatenate([np.asarray(weights[n], np.float64).ravel() for n in direction])


@dataclass(frozen=True)
class CanaryClients:
    """The canaries a simulation appends after a run's own clients.

    Attributes:
        first: the first canary's client index (the run's own client count): clients
            ``first, first + 1, ...`` are canaries, ``directions[i - first]`` each.
        directions: one unit direction per canary.
        scale: the L2 norm of every canary's update (its protocol's clipping bound, if any).
        examples: the shard size each canary reports (the weight of shard-size averaging).
    """

    first: int
    directions: tuple[Direction, ...]
    scale: float
    examples: int

    @property
    def count(self) -> int:
        """The number of canaries."""
        return len(self.directions)

    def learner(
        self,
        index: int,
        model: nn.Module,
        training: TrainingSpec,
        input_shape: tuple[int, ...],
        num_classes: int,
    ) -> CanaryLearner:
        """The learner of canary client ``index``."""
        return CanaryLearner(
            model,
            training,
            self.directions[index - self.first],
            scale=self.scale,
            examples=self.examples,
            client_index=index,
            input_shape=input_shape,
            num_classes=num_classes,
        )


class CanaryLearner(LocalLearner):
    """A learner whose update is always ``scale`` along ``direction``, whatever it is sent.

    It holds one all-zero example of ``input_shape`` (so protocols that read the shard's
    shapes still can) and reports ``examples`` as its shard size.
    """

    def __init__(
        self,
        model: nn.Module,
        training: TrainingSpec,
        direction: Direction,
        *,
        scale: float,
        examples: int,
        client_index: int,
        input_shape: tuple[int, ...],
        num_classes: int,
    ) -> None:
        blank = ArrayDataset(
            np.zeros((1, *input_shape), np.float32), np.zeros(1, np.int64), num_classes=num_classes
        )
        super().__init__(model, blank, training, seed=0, client_index=client_index)
        if not (np.isfinite(scale) and scale > 0):
            raise ValueError(f"The canary's scale must be positive and finite, got {scale}.")
        self.direction = direction
        self.scale = float(scale)
        self._examples = int(examples)

    @property
    def num_examples(self) -> int:
        return self._examples

    def update(self, sign: float = 1.0) -> Direction:
        """The canary's update ``sign·scale·d`` (float64, the direction's parameters only)."""
        return {name: sign * self.scale * d for name, d in self.direction.items()}

    def train(
        self,
        weights: dict[str, np.ndarray],
        *,
        round: int,
        epochs: int | None = None,
        consume: bool = False,
    ) -> tuple[dict[str, np.ndarray], LocalStats]:
        """``weights`` moved by ``scale·d`` (each array keeps its dtype; never in place)."""
        moved = dict(weights)
        for name, step in self.update().items():
            moved[name] = (np.asarray(weights[name], np.float64) + step).astype(weights[name].dtype)
        return moved, LocalStats(self._examples, 0.0, 1)

    def gradient(
        self, weights: dict[str, np.ndarray], *, round: int
    ) -> tuple[dict[str, np.ndarray], LocalStats]:
        """``-scale·d`` (zeros elsewhere), so that a descent step moves along ``+d``."""
        return self.gradient_at(weights), LocalStats(self._examples, 0.0, 1)

    def gradient_at(self, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The canary's gradient in ``weights``' names, shapes and dtypes."""
        step = self.update(-1.0)
        return {
            name: (step[name] if name in step else np.zeros_like(w)).astype(
                np.asarray(w).dtype, copy=False
            )
            for name, w in weights.items()
        }

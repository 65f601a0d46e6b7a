"""LPPA's maths on flat vectors: the noise, the noise difference, and one DSGT step.

Miao, Li, Zhang, Zhao and Wu, "Lossless Privacy-Preserving Aggregation for Decentralized
Federated Learning" (seed 002; the implementer's digest is
``shared/digests/002_LPPA_decentralized_lossless_aggregation.md``, cited by section).

DSGT, Eqs. (2) and (3) of the paper, implemented literally (digest gap 1)::

    theta_i^{t+1} = sum_j w_ij theta_j^t - lambda * gamma_i^t
    gamma_i^{t+1} = sum_j w_ij gamma_j^t + g_i^{t+1} - g_i^t

with the gradient ``g_i^t`` cached from the step that computed it (gap 2), so that
``sum_i gamma_i^t = sum_i g_i^t`` holds for every t whenever W is column-stochastic and the
trackers start from ``gamma_i^0 = g_i^0 + n_i`` with ``sum_i n_i = 0``.

LPPA's noise is Laplace(beta) per entry, quantised to a fixed-point grid (gap 20): every value
is a multiple of ``2^(e - 24)`` (``2^e <= beta``) and at most ``2^(e + 13)`` in magnitude, so any
sum of up to 2^15 of them is exact in float64 and the noise differences of all clients sum to
exactly zero, in any order. The grid is 2^-24 of the scale, far below the noise itself; the
clip is 2^12 scales out, where a Laplace tail has mass e^-4096.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from fedcore.protocols._base import Weights

GRID_BITS = 24
"""The noise grid is 2^-GRID_BITS of the scale's power of two."""
CLIP_BITS = 13
"""The noise is clipped to 2^CLIP_BITS times the scale's power of two."""


def noise_grid(scale: float) -> tuple[float, float]:
    """Returns (grid, bound) of the quantised Laplace noise of ``scale``."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"The noise scale must be positive and finite, got {scale}.")
    exponent = math.floor(math.log2(scale))
    return math.ldexp(1.0, exponent - GRID_BITS), math.ldexp(1.0, exponent + CLIP_BITS)


def laplace_noise(rng: np.random.Generator, size: int, scale: float) -> np.ndarray:
    """Draws ``size`` Laplace(0, scale) values on the fixed-point grid, as float64."""
    grid, bound = noise_grid(scale)
    raw = np.clip(rng.laplace(0.0, scale, size), -bound, bound)
    return np.round(raw / grid) * grid


def noise_difference(sent: Iterable[np.ndarray], received: Iterable[np.ndarray]) -> np.ndarray:
    """``n_i = sum of the noise sent - sum of the noise received`` (digest 2.3 step 5), float64.

    Exact when every vector is on one noise grid (``laplace_noise``).
    """
    total: np.ndarray | None = None
    for vector in sent:
        total = np.array(vector, dtype=np.float64) if total is None else total + vector
    for vector in received:
        total = -np.asarray(vector, dtype=np.float64) if total is None else total - vector
    if total is None:
        raise ValueError("A client with no links has no noise difference.")
    return total


def mix(
    own: np.ndarray, index: int, received: Mapping[int, np.ndarray], weights: Mapping[int, float]
) -> np.ndarray:
    """``sum_j w_ij x_j`` over itself and its in-neighbours, in float64, in a fixed order.

    Raises:
        ValueError: ``received`` is not exactly the in-neighbours of ``weights``.
    """
    expected = sorted(j for j in weights if j != index)
    if sorted(received) != expected:
        raise ValueError(
            f"Client {index} mixes its in-neighbours {expected}, but got vectors from "
            f"{sorted(received)}."
        )
    total = weights[index] * np.asarray(own, dtype=np.float64)
    for j in expected:
        total += weights[j] * np.asarray(received[j], dtype=np.float64)
    return total


def dsgt_step(
    theta: np.ndarray,
    gamma: np.ndarray,
    index: int,
    thetas: Mapping[int, np.ndarray],
    gammas: Mapping[int, np.ndarray],
    weights: Mapping[int, float],
    step_size: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Eq. (2) and the mixing half of Eq. (3).

    Returns:
        ``theta^{t+1}`` and ``sum_j w_ij gamma_j^t`` (add ``g^{t+1} - g^t`` for Eq. (3)),
        both float64.
    """
    theta_next = mix(theta, index, thetas, weights) - step_size * np.asarray(gamma, np.float64)
    return theta_next, mix(gamma, index, gammas, weights)


# ------------------------------------------------------------------- whole-graph (tests)


def matrix_noise_differences(
    count: int, edges: Sequence[tuple[int, int]], noise: Mapping[tuple[int, int], np.ndarray]
) -> np.ndarray:
    """Every client's noise difference from the noise on each edge ``(sender, receiver)``."""
    size = len(next(iter(noise.values())))
    result = np.zeros((count, size))
    for i in range(count):
        sent = [noise[(a, b)] for a, b in edges if a == i]
        received = [noise[(a, b)] for a, b in edges if b == i]
        if sent or received:
            result[i] = noise_difference(sent, received)
    return result


def matrix_dsgt(
    mixing: np.ndarray,
    theta0: np.ndarray,
    gradient: Callable[[int, np.ndarray, int], np.ndarray],
    *,
    rounds: int,
    step_size: float,
    init_noise: np.ndarray | None = None,
    round_noise: Callable[[int], np.ndarray | None] | None = None,
) -> list[dict[str, np.ndarray]]:
    """Runs DSGT on stacked N x P matrices (the digest's numpy check, for tests and benches).

    Args:
        mixing: the dense N x N matrix W.
        theta0: the N x P starting models.
        gradient: ``gradient(i, theta_i, t) -> g`` for client i at step t.
        rounds: T.
        step_size: lambda.
        init_noise: the N x P matrix added to the initial trackers (None: plain DSGT).
        round_noise: ``round_noise(t) -> N x P or None`` added to the trackers before round t.

    Returns:
        ``[{"theta", "gamma", "grad"} for t = 0..T]``.
    """
    grad = gradient
    count = theta0.shape[0]
    theta = np.array(theta0, dtype=np.float64)
    g = np.stack([grad(i, theta[i], 0) for i in range(count)])
    gamma = g.copy() if init_noise is None else g + init_noise
    history = [{"theta": theta.copy(), "gamma": gamma.copy(), "grad": g.copy()}]
    for t in range(rounds):
        if round_noise is not None and t > 0:
            extra = round_noise(t)
            if extra is not None:
                gamma = gamma + extra
                history[-1]["gamma"] = gamma.copy()
        theta_next = mixing @ theta - step_size * gamma
        g_next = np.stack([grad(i, theta_next[i], t + 1) for i in range(count)])
        gamma = mixing @ gamma + g_next - g
        theta, g = theta_next, g_next
        history.append({"theta": theta.copy(), "gamma": gamma.copy(), "grad": g.copy()})
    return history


def flatten(weights: Weights) -> np.ndarray:
    """All tensors of a model as one vector, in the model's order and dtype."""
    return np.concatenate([np.ravel(value) for value in weights.values()])


def unflatten(vector: np.ndarray, template: Weights) -> Weights:
    """The inverse of ``flatten`` against a template's names, shapes and dtypes."""
    result: Weights = {}
    offset = 0
    for name, value in template.items():
        size = int(np.size(value))
        result[name] = (
            np.asarray(vector[offset : offset + size]).reshape(np.shape(value)).astype(value.dtype)
        )
        offset += size
    if offset != len(vector):
        raise ValueError(f"A vector of {len(vector)} entries does not fit a model of {offset}.")
    return result

"""The learned-distortion maths of seed 003, on flat float64 vectors.

Zhang, Li, Chen, Xia and Yang, "Theoretically Principled Federated Learning for Balancing
Privacy and Utility" (seed 003; the implementer's digest is
``shared/digests/003_principled_privacy_utility_tradeoff.md``, cited by section).

A client's distortion ``delta`` must keep its norm in the shell ``[l, u]``: ``l`` comes from
the privacy budget through the measure's inverse ``g`` (Eq. 12 for PL, the Laplace
calibration for DP), ``u = upperFactor * l`` (the paper's ``2l``). Algorithm 3 moves
``delta`` by M projected gradient steps on the client's loss at ``W + delta``; the
projection onto the (non-convex) shell is the paper's norm scaling and clipping
(Appendix B). The digest's fixes are defaults elsewhere: the start is random at norm ``l``
(G1), and the gradients come from held-out data (G2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np


def random_at_norm(rng: np.random.Generator, size: int, norm: float) -> np.ndarray:
    """A uniformly random direction scaled to ``norm`` (zeros for norm 0)."""
    if norm <= 0:
        return np.zeros(size)
    direction = rng.standard_normal(size)
    return direction * (norm / float(np.linalg.norm(direction)))


def project_shell(
    vector: np.ndarray, lower: float, upper: float, rng: np.random.Generator | None = None
) -> np.ndarray:
    """Projects onto ``{a : lower <= |a| <= upper}`` by norm scaling and clipping.

    Inside the shell the vector is returned unchanged; outside, it is scaled along its own
    direction to the nearer sphere (the closest point of the shell). The zero vector has no
    direction: it goes to a random direction at norm ``lower`` (``rng`` required then).

    Raises:
        ValueError: the bounds are negative or ``lower > upper``.
    """
    if not (0 <= lower <= upper) or not math.isfinite(upper):
        raise ValueError(f"The shell needs 0 <= lower <= upper < inf, got {lower} and {upper}.")
    vector = np.asarray(vector, dtype=np.float64)
    if upper == 0:
        return np.zeros_like(vector)
    norm = float(np.linalg.norm(vector))
    if norm == 0:
        if lower == 0:
            return vector.copy()
        if rng is None:
            raise ValueError("Projecting the zero vector onto a shell needs a random direction.")
        return random_at_norm(rng, vector.size, lower).reshape(vector.shape)
    if norm < lower:
        return vector * (lower / norm)
    if norm > upper:
        return vector * (upper / norm)
    return vector.copy()


def pl_lower_bound(budget: float, a1: float, a2: float) -> float:
    """Eq. (12): the least distortion norm whose leakage ``a1 - a2 * norm`` is <= budget.

    It is ``(a1 - budget) / a2``, clamped at 0 (a budget >= a1 needs no distortion).
    """
    if a2 <= 0:
        raise ValueError(f"a2 must be positive, got {a2}.")
    return max(0.0, (a1 - budget) / a2)


def pl_leakage(norm: float, a1: float, a2: float) -> float:
    """Eq. (11): the affine leakage bound of a distortion of this norm."""
    return a1 - a2 * norm


def dp_l1_sensitivity(
    learning_rate: float, clipping_norm: float, parameters: int, batch: int
) -> float:
    """The L1 sensitivity of one SGD step on a batch mean of clipped gradients.

    Replacing one of ``batch`` examples moves the mean by at most ``2C / B`` in L2 norm, so
    the step ``eta * mean`` by at most ``2 eta C sqrt(P) / B`` in L1 norm (digest G7).
    """
    return 2.0 * learning_rate * clipping_norm * math.sqrt(parameters) / batch


def dp_laplace_scale(
    learning_rate: float, clipping_norm: float, parameters: int, batch: int, epsilon: float
) -> float:
    """The Laplace scale per entry that makes one step epsilon-DP: L1 sensitivity / epsilon."""
    if epsilon <= 0:
        raise ValueError(f"epsilon must be positive, got {epsilon}.")
    return dp_l1_sensitivity(learning_rate, clipping_norm, parameters, batch) / epsilon


@dataclass
class LearnTrace:
    """What the learner did: the objective's gradient norm and the distortion norm per step."""

    gradient_norms: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)


def learn_distortion(
    start: np.ndarray,
    lower: float,
    upper: float,
    gradient: Callable[[np.ndarray], np.ndarray],
    *,
    steps: int,
    step_size: float,
    optimizer: Literal["SGD", "Adam"] = "SGD",
    regularization: float = 0.0,
    rng: np.random.Generator | None = None,
) -> tuple[np.ndarray, LearnTrace]:
    """Algorithm 3: ``steps`` projected gradient steps on the distortion.

    Args:
        start: the first distortion (random at norm ``lower`` by default; zeros as printed).
        lower, upper: the shell.
        gradient: ``delta -> d loss(W + delta) / d delta``.
        steps: M.
        step_size: gamma.
        optimizer: plain projected steps, or Adam's (the paper's experiments).
        regularization: lambda of the objective ``loss - lambda * |delta|``.
        rng: for projecting a zero vector.

    Returns:
        The final distortion (norm in the shell) and the trace.
    """
    # The start is used as given: in the shell for a random start; zero for the paper's
    # printed alpha_1 = 0, whose first step then sets the direction (digest G1).
    delta = np.array(start, dtype=np.float64)
    trace = LearnTrace()
    first = np.zeros_like(delta)
    second = np.zeros_like(delta)
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    for step in range(1, steps + 1):
        g = np.asarray(gradient(delta), dtype=np.float64)
        if regularization:
            norm = float(np.linalg.norm(delta))
            if norm > 0:
                g = g - regularization * delta / norm
        trace.gradient_norms.append(float(np.linalg.norm(g)))
        if optimizer == "Adam":
            first = beta1 * first + (1 - beta1) * g
            second = beta2 * second + (1 - beta2) * g * g
            m_hat = first / (1 - beta1**step)
            v_hat = second / (1 - beta2**step)
            move = m_hat / (np.sqrt(v_hat) + eps)
        else:
            move = g
        delta = project_shell(delta - step_size * move, lower, upper, rng)
        trace.norms.append(float(np.linalg.norm(delta)))
    return delta, trace


def empirical_leakage(estimates: Sequence[np.ndarray], truth: np.ndarray, diameter: float) -> float:
    """Definition E.1: ``(D - mean_i |d_i - d|) / D``, clipped to [0, 1]; 0 without estimates.

    1 is a perfect reconstruction at every attack iteration; 0 is no better than the
    diameter ``D`` of the data.
    """
    if not estimates:
        return 0.0
    if diameter <= 0:
        raise ValueError(f"The data diameter must be positive, got {diameter}.")
    mean_error = float(np.mean([np.linalg.norm(np.asarray(e) - truth) for e in estimates]))
    return float(min(1.0, max(0.0, (diameter - mean_error) / diameter)))


def cap(accuracies: Sequence[float], errors: Sequence[float]) -> float:
    """Calibrated Averaged Performance: ``mean_s(Acc_s * Rerr_s)``, accuracies as fractions.

    The paper's Table 2b, with ``Rerr`` the reconstructions' MSE (digest T5).
    """
    if len(accuracies) != len(errors) or not accuracies:
        raise ValueError("CAP needs one accuracy per recovery error, at least one.")
    return float(np.mean([a * e for a, e in zip(accuracies, errors, strict=True)]))

"""Clipping and Gaussian noise for central DP: small functions, float64 inside, never in place.

The Gaussian mechanism of Dwork and Roth, "The Algorithmic Foundations of Differential
Privacy" (2014), Appendix A, applied to a clipped sum as in McMahan et al., "Learning
Differentially Private Recurrent Language Models", ICLR 2018, https://arxiv.org/abs/1710.06963.
The noise always comes from an explicit ``numpy.random.Generator``: ``noise_generator`` gives a
fresh one seeded from the operating system's CSPRNG (secure) or from (seed, round) (tests).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping

import numpy as np

NOISE_STREAM = 0xD9FA
"""Keeps the DP noise's random stream apart from sampling and local shuffles of the same seed."""


def global_norm(tensors: Mapping[str, np.ndarray]) -> float:
    """Returns the L2 norm of all tensors together, as if concatenated (computed in float64).

    Raises:
        ValueError: a tensor holds NaN or infinite values.
    """
    norms = [
        float(np.linalg.norm(np.asarray(value, dtype=np.float64).ravel()))
        for value in tensors.values()
    ]
    total = float(np.linalg.norm(np.asarray(norms, dtype=np.float64))) if norms else 0.0
    if not math.isfinite(total):
        bad = sorted(name for name, norm in zip(tensors, norms, strict=True) if not norm < math.inf)
        raise ValueError(
            f"The tensors {bad} hold NaN or infinite values (or values too large for a finite "
            f"float64 norm); they have no norm."
        )
    return total


def clip_by_global_norm(
    tensors: Mapping[str, np.ndarray], bound: float
) -> tuple[dict[str, np.ndarray], float]:
    """Scales all tensors together so that their joint L2 norm is at most ``bound``.

    Tensors whose joint norm is above ``bound`` are multiplied by ``bound / norm`` (so the
    result has norm ``bound``, up to rounding); otherwise they are returned unchanged. The
    scaling is computed in float64 and each result keeps its input's dtype.

    Args:
        tensors: the tensors by name (e.g. one client's model update); not changed.
        bound: the clipping norm C; positive and finite.

    Returns:
        New arrays by name, in the input's order, and the input's joint norm before clipping.

    Raises:
        ValueError: ``bound`` is not positive and finite, or a tensor is not finite.
    """
    if not (math.isfinite(bound) and bound > 0):
        raise ValueError(f"The clipping bound must be positive and finite, got {bound}.")
    norm = global_norm(tensors)
    scale = bound / norm if norm > bound else 1.0
    clipped = {
        name: (np.asarray(value, dtype=np.float64) * scale).astype(value.dtype, copy=False)
        if scale != 1.0
        else np.array(value, copy=True)
        for name, value in tensors.items()
    }
    return clipped, norm


def gaussian_noise_like(
    tensors: Mapping[str, np.ndarray], std: float, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Draws i.i.d. N(0, std²) noise of each tensor's shape, in float64.

    The draws follow the mapping's order, one ``rng.normal`` call per tensor, so the same
    generator state and order always give the same noise.

    Args:
        tensors: the shapes to match, by name (only shapes are read).
        std: the standard deviation of every coordinate; non-negative and finite.
        rng: the generator to draw from (its state advances).

    Returns:
        One float64 array per name, in the input's order.

    Raises:
        ValueError: ``std`` is negative or not finite.
    """
    if not (math.isfinite(std) and std >= 0):
        raise ValueError(
            f"The noise standard deviation must be non-negative and finite, got {std}."
        )
    return {
        name: rng.normal(loc=0.0, scale=std, size=np.shape(value)).astype(np.float64, copy=False)
        for name, value in tensors.items()
    }


def noise_generator(
    *, secure: bool, seed: int, round: int, stream: int = NOISE_STREAM
) -> np.random.Generator:
    """Returns a fresh generator for one round's DP noise.

    Args:
        secure: True: a PCG64 generator seeded with 128 bits from the operating system's
            CSPRNG (``secrets``), never reproducible. False: seeded from (seed, round, stream)
            only, so a resumed run draws the same noise as the uninterrupted one; for tests,
            never for a privacy claim (the seed is in the manifest).
        seed: the run's seed (``spec.seed``); ignored when ``secure``.
        round: the round number; ignored when ``secure``.
        stream: a tag that keeps this use of the seed apart from others.

    Raises:
        ValueError: ``seed``, ``round`` or ``stream`` is negative (when not ``secure``).
    """
    if secure:
        return np.random.Generator(np.random.PCG64(secrets.randbits(128)))
    if seed < 0 or round < 0 or stream < 0:
        raise ValueError(
            f"The noise seed, round and stream must be non-negative, got {seed}, {round} and "
            f"{stream}."
        )
    return np.random.default_rng([seed, round, stream])

"""secagg's distributed DP on the client: clip, scale to integers, add a discrete Gaussian.

The plan (granularity, noise, modulus) is ``fedcore.spec._options.secagg_dp.DdpPlan``; here
is what a client does with it, and how the server reads the unmasked sum back.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from fedcore.errors import ProtocolError
from fedcore.spec._options.secagg_dp import DdpPlan


def clip_l2(update: npt.NDArray[np.float64], bound: float) -> npt.NDArray[np.float64]:
    """``update`` scaled by min(1, bound / ||update||_2) (a new array)."""
    norm = float(np.linalg.norm(update))
    return update * (bound / norm) if norm > bound else update.copy()


def discrete_gaussian(rng: np.random.Generator, sigma: float, size: int) -> npt.NDArray[np.int64]:
    """``size`` draws of the discrete Gaussian N_Z(0, sigma^2): P(y) proportional to
    exp(-y^2 / (2 sigma^2)) on the integers, by Canonne, Kamath and Steinke's rejection from a
    discrete Laplace of scale floor(sigma) + 1 (NeurIPS 2020, Algorithm 3), vectorized in
    floating point as TensorFlow Federated's sampler is.

    Raises:
        ProtocolError: sigma is not positive and finite.
    """
    if not (math.isfinite(sigma) and sigma > 0):
        raise ProtocolError(f"A discrete Gaussian needs a positive parameter, not {sigma}.")
    t = math.floor(sigma) + 1
    p = -math.expm1(-1.0 / t)  # a geometric's success probability: 1 - exp(-1/t)
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        wanted = size - filled
        draws = 2 * wanted + 64  # acceptance is above one half
        laplace = rng.geometric(p, draws) - rng.geometric(p, draws)
        gap = np.abs(laplace) - sigma**2 / t
        keep = rng.random(draws) < np.exp(-(gap**2) / (2.0 * sigma**2))
        taken = laplace[keep][:wanted]
        out[filled : filled + taken.size] = taken
        filled += taken.size
    return out


def encode(
    update: npt.NDArray[np.float64],
    plan: DdpPlan,
    *,
    rounding: np.random.Generator,
    noise: np.random.Generator,
) -> npt.NDArray[np.uint64]:
    """A clipped update as this client's masked-input words: round(update / gamma) (unbiased
    randomized rounding, so its L2 norm grows by less than sqrt(d)) plus N_Z(0, sigma^2) noise,
    mod 2^bits (two's complement).

    Raises:
        ProtocolError: the update's norm exceeds the plan's clipping (the caller clips first).
    """
    scaled = update / plan.gamma
    if float(np.linalg.norm(scaled)) > plan.delta2 - math.sqrt(update.size) + 1e-6 * plan.delta2:
        raise ProtocolError("The update is not clipped to the plan's norm.")
    floor = np.floor(scaled)
    integers = (floor + (rounding.random(scaled.shape) < scaled - floor)).astype(np.int64)
    noisy = integers + discrete_gaussian(noise, plan.sigma, integers.size)
    words = noisy.astype(np.uint64)  # two's complement
    return words & np.uint64(2**plan.bits - 1)


def decode_sum(total: npt.NDArray[np.uint64], plan: DdpPlan) -> npt.NDArray[np.float64]:
    """The unmasked sum (mod 2^bits) back to floats: read as signed, times gamma."""
    signed = total.astype(np.int64)
    signed[signed >= 2 ** (plan.bits - 1)] -= 2**plan.bits
    return signed.astype(np.float64) * plan.gamma

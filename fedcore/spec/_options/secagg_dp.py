"""secagg's distributed DP: the plan every party derives from the spec, and its epsilon.

The distributed discrete Gaussian (Kairouz, Liu and Steinke, "The Distributed Discrete
Gaussian Mechanism for Federated Learning with Secure Aggregation", ICML 2021): each client
clips its update to L2 norm C, scales it by 1/gamma, rounds it to integers (unbiased, so its
norm grows by at most sqrt(d)), and adds its own share of discrete Gaussian noise N_Z(0, s^2)
before masking. The server can unmask only sums of at least ``fewest`` clients (the clients
refuse to reveal shares for fewer), so the sum it sees carries at least ``fewest`` shares:
s = z C / (gamma sqrt(fewest)), at least the noise z C of the central mechanism.

Theorem 1 of the paper: for n independent N_Z(0, s^2) vectors in Z^d (s >= 1/2) and
inputs at L2 distance at most Delta, the sum is (alpha, alpha eps^2 / 2)-RDP for every alpha,
i.e. eps^2/2-zCDP, with

    eps = min( sqrt(Delta^2 / (n s^2) + tau d / 2),  Delta / (sqrt(n) s) + tau sqrt(d) ),
    tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 s^2 k / (k + 1)).

A round is accounted as an upper bound of these over the sums the server can unmask
(``fewest`` to ``most`` clients): ``worst_epsilon``. A Gaussian mechanism of multiplier z has
exactly the RDP curve alpha / (2 z^2), so the round is the Gaussian of multiplier 1/eps to an
RDP accountant: the ledger
composes rounds as it does for the other protocols (RDP only: a PLD accountant would assume
the Gaussian's own privacy loss distribution, tighter than what zCDP proves).

Everything here is a pure function of the spec and the member counts (no numpy, no torch),
so validation and every party compute the same plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedcore.errors import ProtocolError

TAIL_SIGMAS = 14.0
"""How far (in standard deviations of the summed noise) the modulus leaves room for the noise
before a sum could wrap: P(|N(0,1)| > 14) < 2^-140 per coordinate."""
MAX_BITS = 62


@dataclass(frozen=True)
class DdpPlan:
    """What the clients and the server of a secagg round with distributed DP use.

    Attributes:
        gamma: the granularity: a coordinate x is sent as about x / gamma.
        delta2: the L2 sensitivity of one client's integer vector: C / gamma + sqrt(d).
        sigma: each client's discrete Gaussian parameter s (integer units).
        fewest: the fewest clients whose sum the server can unmask (the clients enforce it).
        most: the most clients in a sum (the round's sample).
        bits: the masks' modulus 2^bits: room for ``most`` clipped inputs and the noise.
        epsilon: the per-round zCDP parameter eps (rho = eps^2 / 2), the worst over the sums.
    """

    gamma: float
    delta2: float
    sigma: float
    fewest: int
    most: int
    bits: int
    epsilon: float

    @property
    def noise_multiplier(self) -> float:
        """The Gaussian multiplier with the same RDP curve as one round: 1 / eps."""
        return 1.0 / self.epsilon


def ddg_epsilon(delta2: float, sigma: float, summands: int, dims: int) -> float:
    """Theorem 1's eps for ``summands`` discrete Gaussians of parameter ``sigma`` in ``dims``
    dimensions at L2 sensitivity ``delta2`` (see the module docstring).

    Raises:
        ProtocolError: sigma < 1/2 (outside the theorem), or a non-positive count.
    """
    if not sigma >= 0.5:
        raise ProtocolError(f"The discrete Gaussian's parameter {sigma} is below 1/2.")
    if summands < 1 or dims < 1 or not delta2 > 0:
        raise ProtocolError("The sensitivity, summands and dimensions must be positive.")
    tau = _tau(sigma, summands)
    first = math.sqrt(delta2**2 / (summands * sigma**2) + tau * dims / 2.0)
    second = delta2 / (math.sqrt(summands) * sigma) + tau * math.sqrt(dims)
    return min(first, second)


def ddp_plan(
    *,
    clipping_norm: float,
    noise_multiplier: float,
    granularity_bits: int,
    fewest: int,
    most: int,
    dims: int,
) -> DdpPlan:
    """The plan for sums of ``fewest`` to ``most`` clients' ``dims``-dimensional updates.

    gamma = C / 2^(granularity_bits - 1); s = z C / (gamma sqrt(fewest)).

    Raises:
        ProtocolError: the counts or dimensions are not positive, the noise per client falls
            below the theorem's 1/2, or the sums need a modulus beyond 2^62.
    """
    if not (1 <= fewest <= most) or dims < 1:
        raise ProtocolError(
            f"A distributed-DP plan needs 1 <= fewest ({fewest}) <= most ({most}) and "
            f"dims ({dims}) >= 1."
        )
    gamma = clipping_norm / 2 ** (granularity_bits - 1)
    scaled = clipping_norm / gamma
    delta2 = scaled + math.sqrt(dims)
    sigma = noise_multiplier * clipping_norm / (gamma * math.sqrt(fewest))
    if sigma < 0.5:
        raise ProtocolError(
            f"Each client's noise would be a discrete Gaussian of parameter {sigma:.3g}, below "
            "1/2; raise the noise multiplier or quantizationBits."
        )
    # A coordinate of one input is at most C / gamma + 1 in magnitude; the noise of a sum of
    # ``most`` shares is within TAIL_SIGMAS of its std but for odds below 2^-140.
    reach = most * (scaled + 1.0) + TAIL_SIGMAS * sigma * math.sqrt(most)
    bits = max(2, math.ceil(math.log2(2.0 * reach + 1.0)) + 1)  # signed, with a spare bit
    if bits > MAX_BITS:
        raise ProtocolError(
            f"Sums of {most} clients at this granularity and noise need a modulus of 2^{bits}; "
            f"at most 2^{MAX_BITS}: lower quantizationBits or the noise multiplier."
        )
    return DdpPlan(
        gamma, delta2, sigma, fewest, most, bits, worst_epsilon(delta2, sigma, fewest, most, dims)
    )


def worst_epsilon(delta2: float, sigma: float, fewest: int, most: int, dims: int) -> float:
    """An upper bound on ``ddg_epsilon`` over every sum of ``fewest`` to ``most`` shares: each
    part of it takes its worst count (the Delta term is largest at ``fewest``, tau grows with
    the count and is largest at ``most``)."""
    if not sigma >= 0.5:
        raise ProtocolError(f"The discrete Gaussian's parameter {sigma} is below 1/2.")
    tau = _tau(sigma, most)
    first = math.sqrt(delta2**2 / (fewest * sigma**2) + tau * dims / 2.0)
    second = delta2 / (math.sqrt(fewest) * sigma) + tau * math.sqrt(dims)
    return min(first, second)


def _tau(sigma: float, summands: int) -> float:
    """10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1))."""
    return 10.0 * sum(
        math.exp(-2.0 * math.pi**2 * sigma**2 * k / (k + 1)) for k in range(1, summands)
    )

"""Options of ``secagg`` (SecAgg+, Bell et al. 2020) and the choice of its graph parameters.

The parameter maths lives here, beside the options, so that validation can refuse a run whose
clients, dropout rate and corruption rate no sharing graph can serve, without the protocol's
numeric and cryptographic modules (``fedcore.protocols.secagg``, which re-exports it).
"""

from __future__ import annotations

import math
from fractions import Fraction

from pydantic import Field

from fedcore.errors import ProtocolError, SpecIssue
from fedcore.spec._base import SpecModel
from fedcore.spec._clients import ClientsSpec
from fedcore.spec._options.secagg_dp import DdpPlan, ddp_plan


class DistributedDpOptions(SpecModel):
    """secagg's distributed DP (the distributed discrete Gaussian, docs/protocols/secagg.md)."""

    clipping_norm: float = Field(
        1.0,
        gt=0,
        le=1e6,
        description="clippingNorm C: each client clips its whole update (all tensors together) "
        "to this L2 norm. Default 1.0.",
    )
    noise_multiplier: float = Field(
        description="noiseMultiplier z: the sum of the fewest clients the server can unmask "
        "(the quorum) carries discrete Gaussian noise of standard deviation z*C, each client "
        "adding its share. Required.",
        gt=0,
        le=1e4,
    )
    secure_noise: bool = Field(
        True,
        description="secureNoise: each client draws its noise from a generator seeded by the "
        "OS CSPRNG (true, default). false: seeded by (seed, round, client), reproducible, for "
        "tests only: anyone who knows the seed can subtract the noise, so no DP.",
    )


class SecAggOptions(SpecModel):
    """Options of the ``secagg`` protocol (docs/protocols/secagg.md)."""

    clip_range: float = Field(
        8.0,
        gt=0,
        le=1e6,
        description="clipRange c: each coordinate of a client's update (its trained model "
        "minus the model it received) is clipped to [-c, c] before it is quantized. Default "
        "8.0 (Flower's default).",
    )
    quantization_bits: int = Field(
        20,
        ge=1,
        le=40,
        description="quantizationBits: a clipped coordinate is rounded (stochastically, "
        "unbiased) to one of 2^quantizationBits levels over [-c, c]. The masks' modulus is "
        "then the least power of two that the sum of every client's levels cannot wrap. "
        "Default 20.",
    )
    dropout_rate: float = Field(
        0.1,
        ge=0,
        lt=0.5,
        description="dropoutRate: the fraction of a round's clients expected to drop out in "
        "it; the sharing graph's degree and threshold are chosen so that a round with that "
        "many dropouts completes with probability at least 1 - 2^-correctnessBits. Default "
        "0.1.",
    )
    corrupt_rate: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="corruptRate: the fraction of a round's clients that may collude with "
        "the server; the threshold is chosen so that they learn no other client's input "
        "except with probability 2^-securityBits. Default 0.1.",
    )
    security_bits: int = Field(
        40, ge=0, le=128, description="securityBits sigma (Bell et al.). Default 40."
    )
    correctness_bits: int = Field(
        20, ge=0, le=64, description="correctnessBits eta (Bell et al.). Default 20."
    )
    degree: int | None = Field(
        None,
        ge=2,
        le=10_000,
        description="degree overrides the sharing graph's derived degree k: each client shares "
        "with this many others (an even number; the complete graph when it reaches the round's "
        "clients minus one). It must still meet securityBits and correctnessBits at the rates "
        "above, for every round size the run allows: a larger degree buys margin at the cost of "
        "more key agreements per client. Unset (default): the least degree that meets them.",
    )
    threshold: int | None = Field(
        None,
        ge=1,
        le=10_000,
        description="threshold overrides the Shamir threshold t: how many of a client's "
        "neighbours must take part to rebuild its secrets. It must still meet securityBits and "
        "correctnessBits at the rates above. Unset (default): the least threshold that meets "
        "securityBits at the chosen degree.",
    )
    distributed_dp: DistributedDpOptions | None = Field(
        None,
        description="distributedDp adds distributed DP: each client clips its update to L2 norm "
        "clippingNorm, scales it to integers at granularity clippingNorm / "
        "2^(quantizationBits - 1) and adds its share of discrete Gaussian noise before masking, "
        "so the server never sees a sum without the full noise; clipRange is then unused. Unset "
        "(default): no DP is claimed.",
    )

    def dp_plan(self, *, fewest: int, members: int, dims: int) -> DdpPlan | None:
        """The distributed-DP plan for sums of ``fewest`` (capped at ``members``) to ``members``
        clients of ``dims`` coordinates; None without distributed DP.

        Raises:
            ProtocolError: the plan is impossible (``ddp_plan``).
        """
        dp = self.distributed_dp
        if dp is None:
            return None
        return ddp_plan(
            clipping_norm=dp.clipping_norm,
            noise_multiplier=dp.noise_multiplier,
            granularity_bits=self.quantization_bits,
            fewest=min(fewest, members),
            most=members,
            dims=max(dims, 1),
        )

    def graph_parameters(self, n: int) -> tuple[int, int]:
        """(degree, threshold) for a round of ``n`` clients: ``choose_parameters`` at these
        options' rates, bounds and overrides.

        Raises:
            ProtocolError: no graph meets them, naming which bound fails.
        """
        return choose_parameters(
            n,
            self.dropout_rate,
            self.corrupt_rate,
            self.security_bits,
            self.correctness_bits,
            degree=self.degree,
            threshold=self.threshold,
        )

    def fewest_summed(self, clients: ClientsSpec) -> int:
        """The fewest clients whose sum the clients let the server unmask: the quorum of a
        round's sample (at least 2); distributed DP's noise is calibrated for it."""
        sampled = min(clients.sampled_per_round(), clients.count)
        return max(clients.quorum_of(sampled), 2)


def secagg_issues(options: SecAggOptions, clients: ClientsSpec) -> list[SpecIssue]:
    """secagg's preconditions: a round's clients, at the fewest a round may ask (its sample,
    then the quorum on a redo), can be served by a sharing graph at the options' rates."""
    issues: list[SpecIssue] = []
    sampled = min(clients.sampled_per_round(), clients.count)
    for n in sorted({sampled, max(clients.quorum_of(sampled), 2)}):
        try:
            options.graph_parameters(n)
        except ProtocolError as exc:
            field = "dropoutRate"
            if options.threshold is not None:
                field = "threshold"
            elif options.degree is not None:
                field = "degree"
            issues.append(SpecIssue(f"spec.protocol.secagg.{field}", str(exc)))
            break
    try:
        options.dp_plan(fewest=options.fewest_summed(clients), members=max(sampled, 1), dims=1)
    except ProtocolError as exc:
        issues.append(SpecIssue("spec.protocol.secagg.distributedDp", str(exc)))
    if sampled < 2:
        issues.append(
            SpecIssue(
                "spec.clients.perRound",
                f"secagg sums 2 or more clients' inputs each round; {sampled} is sampled.",
            )
        )
    return issues


def _fixed_parameters(
    n: int,
    dropped: int,
    corrupt: int,
    security_bits: int,
    correctness_bits: int,
    degree: int | None,
    threshold: int | None,
) -> tuple[int, int]:
    """``choose_parameters`` with a degree and/or a threshold set by the spec."""
    if degree is not None and (isinstance(degree, bool) or not isinstance(degree, int)):
        raise ProtocolError(f"The degree is an integer, not {degree!r}.")
    if degree is not None and degree < n - 1 and degree % 2:
        raise ProtocolError(
            f"A degree of {degree} is odd: the sharing graph (a Harary graph) needs an even "
            f"degree below n - 1 = {n - 1}."
        )
    degrees = [min(degree, n - 1)] if degree is not None else [*range(2, n - 1, 2), n - 1]
    failed = ""
    for k in degrees:
        if threshold is not None and threshold > k:
            failed = f"a threshold of {threshold} is above the degree {k}"
            continue
        candidates = [threshold] if threshold is not None else range(1, k + 1)
        for t in candidates:
            correctness, security = failure_probabilities(n, k, t, dropped, corrupt)
            if security > 2.0**-security_bits:
                failed = (
                    f"degree {k} and threshold {t} fail the security bound: {security:.3g} > "
                    f"2^-{security_bits}"
                )
                continue
            if correctness > 2.0**-correctness_bits:
                failed = (
                    f"degree {k} and threshold {t} fail the correctness bound: "
                    f"{correctness:.3g} > 2^-{correctness_bits}"
                )
                break  # a higher threshold only fails it more
            return k, t
    raise ProtocolError(
        f"For n = {n} clients ({dropped} dropping, {corrupt} corrupt), {failed or 'no pair fits'}."
    )


def failure_probabilities(
    n: int, degree: int, threshold: int, dropped: int, corrupt: int
) -> tuple[float, float]:
    """Union bounds on SecAgg+'s correctness and security failures, computed exactly.

    With the sharing graph drawn from a uniformly random permutation (``sharing_graph``), one
    node's neighbours are a uniformly random ``k``-subset of the other n - 1 nodes
    (k = min(degree, n - 1)), independent of which nodes drop or are corrupt when those are
    fixed before the seed is known. So its count X of neighbours among K marked others is
    hypergeometric: P[X = x] = C(K, x) C(n - 1 - K, k - x) / C(n - 1, k), summed here in exact
    integers.

    Correctness fails when some node has fewer than t surviving neighbours (its self seed or
    mask key cannot be rebuilt): X > k - t with K = dropped for the n - dropped survivors and
    K = dropped - 1 for the dropped nodes; the bound is the sum over all n nodes.

    Security fails for an honest node when its c corrupt neighbours plus the honest ones the
    server can play off against each other reach the threshold for both its secrets: the
    server, lying about who dropped, asks disjoint honest sets A and B for the self-seed and
    the mask-key shares, so it needs |A| + c >= t and |B| + c >= t with |A| + |B| <= k - c,
    i.e. k + c >= 2t (which c >= t, the corrupt reconstructing alone, implies). With
    K = corrupt the bound is the sum over the n - corrupt honest nodes.

    Args:
        n: the number of clients on the graph, at least 2.
        degree: the graph's degree (even, or at least n - 1 for the complete graph).
        threshold: the Shamir threshold t, 1 to min(degree, n - 1).
        dropped: how many clients drop out in the round, 0 to n.
        corrupt: how many clients the adversary controls, 0 to n.

    Returns:
        (correctness failure, security failure), each a union bound capped at 1.

    Raises:
        ProtocolError: an argument is out of range.
    """
    k = _check_graph_parameters(n, degree)
    if isinstance(threshold, bool) or not isinstance(threshold, int) or not 1 <= threshold <= k:
        raise ProtocolError(f"The threshold lies in 1 to {k}, not {threshold!r}.")
    for name, value in (("dropped", dropped), ("corrupt", corrupt)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= n:
            raise ProtocolError(f"The {name} count lies in 0 to n = {n}, not {value!r}.")
    total = math.comb(n - 1, k)
    correctness = Fraction(_correctness_failures(n, k, threshold, dropped), total)
    security = Fraction(_security_failures(n, k, threshold, corrupt), total)
    return float(min(correctness, Fraction(1))), float(min(security, Fraction(1)))


def choose_parameters(
    n: int,
    dropout_rate: float,
    corrupt_rate: float,
    security_bits: int = 40,
    correctness_bits: int = 20,
    *,
    degree: int | None = None,
    threshold: int | None = None,
) -> tuple[int, int]:
    """The least (degree, threshold) meeting the run's bounds for ``n`` clients.

    ``degree`` and ``threshold``, where given, replace the search: the degree is used as it is
    (the complete graph from n - 1 on; it must be even below that), the threshold too (at most
    the degree), and the pair must meet both bounds, or the call fails saying which bound.

    ``floor(dropout_rate * n)`` clients drop and ``floor(corrupt_rate * n)`` are corrupt (the
    rates read as the decimals they print as). Degrees 2, 4, ... below n - 1 are tried in turn,
    then the complete graph; for each, the least threshold whose security failure
    (``failure_probabilities``) is at most 2^-security_bits, which is also the threshold with
    the least correctness failure, and it is kept when that is at most 2^-correctness_bits. So
    the answer is the least degree that works, with its least secure threshold.

    Raises:
        ProtocolError: a rate is outside [0, 1), 2 dropout_rate + corrupt_rate >= 1 (then no
            graph works for any n), the bits are negative, or n is too small for these rates
            and bounds (not even the complete graph meets them).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ProtocolError(f"SecAgg+ needs 2 clients or more, not {n!r}.")
    rates = {}
    for name, rate in (("dropout", dropout_rate), ("corrupt", corrupt_rate)):
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate < 1:
            raise ProtocolError(f"The {name} rate lies in [0, 1), not {rate!r}.")
        rates[name] = Fraction(str(float(rate)))
    for name, bits in (("security", security_bits), ("correctness", correctness_bits)):
        if isinstance(bits, bool) or not isinstance(bits, int) or bits < 0:
            raise ProtocolError(f"The {name} bits are a non-negative integer, not {bits!r}.")
    if 2 * rates["dropout"] + rates["corrupt"] >= 1:
        raise ProtocolError(
            f"A dropout rate of {dropout_rate} with a corrupt rate of {corrupt_rate} makes "
            "SecAgg+ impossible for any n: it needs 2 * dropout + corrupt < 1 (a threshold both "
            "above half of a neighbourhood plus its corrupt part and below its survivors)."
        )
    dropped = math.floor(rates["dropout"] * n)
    corrupt = math.floor(rates["corrupt"] * n)
    if degree is not None or threshold is not None:
        return _fixed_parameters(
            n, dropped, corrupt, security_bits, correctness_bits, degree, threshold
        )
    for k in [*range(2, n - 1, 2), n - 1]:
        total = math.comb(n - 1, k)
        corrupt_tails = _tails(n - 1, corrupt, k)
        secure = (
            t
            for t in range(1, k + 1)
            if (n - corrupt) * corrupt_tails[_clamp(2 * t - k, k)] << security_bits <= total
        )
        threshold = next(secure, None)
        if threshold is None:
            continue
        failures = _correctness_failures(n, k, threshold, dropped)
        if failures << correctness_bits <= total:
            return k, threshold
    raise ProtocolError(
        f"n = {n} clients is too small for a dropout rate of {dropout_rate} and a corrupt rate "
        f"of {corrupt_rate} at 2^-{security_bits} security and 2^-{correctness_bits} "
        "correctness failure: not even the complete graph meets them."
    )


def _check_graph_parameters(n: int, degree: int) -> int:
    """The effective degree min(degree, n - 1), after checking n and degree."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ProtocolError(f"The graph has 2 clients or more, not {n!r}.")
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ProtocolError(f"The graph's degree is a positive integer, not {degree!r}.")
    if degree < n - 1 and degree % 2:
        raise ProtocolError(f"The graph's degree is even below n - 1 = {n - 1}, not {degree}.")
    return min(degree, n - 1)


def _correctness_failures(n: int, k: int, threshold: int, dropped: int) -> int:
    """C(n - 1, k) times the union bound on a node short of ``threshold`` surviving neighbours:
    more than k - t dropped ones, K = dropped for survivors, dropped - 1 for dropped nodes."""
    at_least = _clamp(k - threshold + 1, k)
    failures = (n - dropped) * _tails(n - 1, dropped, k)[at_least]
    if dropped:
        failures += dropped * _tails(n - 1, dropped - 1, k)[at_least]
    return failures


def _security_failures(n: int, k: int, threshold: int, corrupt: int) -> int:
    """C(n - 1, k) times the union bound over honest nodes on k + c >= 2t, K = corrupt."""
    if corrupt >= n:
        return 0
    return (n - corrupt) * _tails(n - 1, corrupt, k)[_clamp(2 * threshold - k, k)]


def _clamp(at_least: int, draws: int) -> int:
    """An index into ``_tails(..., draws)``: at_least clamped to 0 .. draws + 1."""
    return min(max(at_least, 0), draws + 1)


def _tails(population: int, marked: int, draws: int) -> list[int]:
    """C(population, draws) * P[X >= x] for x = 0 .. draws + 1, X hypergeometric (``draws``
    from ``population`` of which ``marked`` are marked), in exact integers.

    The weights C(marked, x) C(population - marked, draws - x) follow an exact recurrence from
    the support's low end; the tails are their suffix sums.
    """
    weights = [0] * (draws + 1)
    unmarked = population - marked
    low, high = max(0, draws - unmarked), min(draws, marked)
    if low <= high:  # always, as draws <= population
        value = math.comb(marked, low) * math.comb(unmarked, draws - low)
        weights[low] = value
        for x in range(low, high):
            value = value * (marked - x) * (draws - x) // ((x + 1) * (unmarked - draws + x + 1))
            weights[x + 1] = value
    tails = [0] * (draws + 2)
    for x in range(draws, -1, -1):
        tails[x] = tails[x + 1] + weights[x]
    return tails

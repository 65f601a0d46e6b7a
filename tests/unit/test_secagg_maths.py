"""SecAgg+ maths: Shamir sharing, the sharing graph, degree and threshold, fixed point, masks."""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Mapping
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fedcore.errors import ProtocolError
from fedcore.protocols.mpdp.keys import keystream
from fedcore.protocols.secagg import maths
from fedcore.protocols.secagg.maths import (
    FIELD_PRIME,
    SHARE_BYTES,
    Quantization,
    choose_bits,
    choose_parameters,
    combine_shares,
    dequantize_sum,
    expand_mask,
    failure_probabilities,
    mask_input,
    needed_edges,
    quantize,
    sharing_graph,
    split_secret,
    unmask_sum,
)

FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _interpolate(points: Mapping[int, int], z: int) -> int:
    """The test's own Lagrange interpolation over the field (x = holder + 1) at z."""
    total = 0
    for i, yi in points.items():
        term = yi
        for j in points:
            if j != i:
                term = term * (z - (j + 1)) * pow((i + 1) - (j + 1), -1, FIELD_PRIME)
        total += term
    return total % FIELD_PRIME


# ------------------------------------------------------------------------------ Shamir


def test_field_is_the_mersenne_prime_and_holds_a_secret() -> None:
    assert FIELD_PRIME == 2**521 - 1
    assert FIELD_PRIME > 2**256
    assert SHARE_BYTES == 66


def test_every_threshold_subset_recovers_the_secret() -> None:
    secret = os.urandom(32)
    holders = [0, 2, 5, 7, 9]
    shares = split_secret(secret, 3, holders)
    assert sorted(shares) == holders
    assert all(len(share) == SHARE_BYTES for share in shares.values())
    for size in (3, 4, 5):
        for subset in itertools.combinations(holders, size):
            assert combine_shares({h: shares[h] for h in subset}, 3) == secret


@FAST
@given(
    secret=st.binary(min_size=32, max_size=32),
    holders=st.lists(st.integers(0, 10_000), min_size=1, max_size=12, unique=True),
    data=st.data(),
)
def test_shamir_round_trips(secret: bytes, holders: list[int], data: st.DataObject) -> None:
    threshold = data.draw(st.integers(1, len(holders)))
    shares = split_secret(secret, threshold, holders)
    subset = data.draw(st.permutations(holders)).copy()[: data.draw(st.integers(threshold, 12))]
    assert combine_shares({h: shares[h] for h in subset}, threshold) == secret


def test_threshold_minus_one_shares_fit_every_secret() -> None:
    """Any t - 1 shares lie on a polynomial of degree t - 1 through (0, B) for every B: one
    more (fake) share then yields B, so t - 1 shares say nothing of the secret."""
    secret = os.urandom(32)
    shares = split_secret(secret, 4, [1, 3, 4, 8, 11])
    known = {h: int.from_bytes(shares[h], "big") for h in (1, 4, 8)}  # t - 1 = 3 shares
    for candidate in (bytes(32), b"\xff" * 32, os.urandom(32), secret):
        points = dict(known)
        points[-1] = int.from_bytes(candidate, "big")  # x = 0 is holder -1
        fake = _interpolate(points, 12 + 1)  # the share holder 12 would need
        forged = {h: shares[h] for h in known} | {12: fake.to_bytes(SHARE_BYTES, "big")}
        assert combine_shares(forged, 4) == candidate


def test_a_single_share_is_uniform_whatever_the_secret() -> None:
    """With t = 2 a share is secret + a * x for a uniform a: over a small stand-in field the
    share's distribution is the same for every secret (the counting argument)."""
    p = 13
    for x in range(1, p):
        histograms = {s: sorted((s + a * x) % p for a in range(p)) for s in range(p)}
        assert all(h == list(range(p)) for h in histograms.values())


def test_an_altered_share_among_more_than_threshold_is_caught() -> None:
    shares = split_secret(os.urandom(32), 3, [0, 1, 2, 3])
    for victim in shares:
        altered = dict(shares)
        value = (int.from_bytes(altered[victim], "big") + 1) % FIELD_PRIME
        altered[victim] = value.to_bytes(SHARE_BYTES, "big")
        with pytest.raises(ProtocolError, match=re.escape("holders [0, 1, 2, 3]")):
            combine_shares(altered, 3)


def test_a_random_share_among_exactly_threshold_breaks_the_secret_width() -> None:
    shares = split_secret(os.urandom(32), 3, [0, 1, 2])
    shares[1] = (int.from_bytes(os.urandom(66), "big") % FIELD_PRIME).to_bytes(SHARE_BYTES, "big")
    with pytest.raises(ProtocolError, match="32-byte secret"):
        combine_shares(shares, 3)


def test_a_shifted_share_among_exactly_threshold_goes_unseen() -> None:
    """The limit of the width check: +1 on share x = 2 of (1, 2, 3) moves the secret by its
    Lagrange coefficient at 0, (0 - 1)(0 - 3) / ((2 - 1)(2 - 3)) = -3."""
    secret = (2**200).to_bytes(32, "big")
    shares = split_secret(secret, 3, [0, 1, 2])
    shares[1] = ((int.from_bytes(shares[1], "big") + 1) % FIELD_PRIME).to_bytes(SHARE_BYTES, "big")
    assert combine_shares(shares, 3) == (2**200 - 3).to_bytes(32, "big")


def test_malformed_shares_are_refused() -> None:
    shares = split_secret(os.urandom(32), 2, [0, 1, 2])
    with pytest.raises(ProtocolError, match="needs 2 shares, got 1"):
        combine_shares({0: shares[0]}, 2)
    with pytest.raises(ProtocolError, match="holder 1 is not 66 bytes"):
        combine_shares({0: shares[0], 1: shares[1][:-1]}, 2)
    with pytest.raises(ProtocolError, match="holder 1 is not a field element"):
        combine_shares({0: shares[0], 1: FIELD_PRIME.to_bytes(SHARE_BYTES, "big")}, 2)
    with pytest.raises(ProtocolError, match="client index"):
        combine_shares({-1: shares[0], 1: shares[1]}, 2)
    with pytest.raises(ProtocolError, match="holder 1 is not 66 bytes"):
        combine_shares({0: shares[0], 1: "x" * 66}, 2)  # type: ignore[dict-item]
    with pytest.raises(ProtocolError, match="positive integer"):
        combine_shares(shares, 0)


@pytest.mark.parametrize(
    ("secret", "threshold", "holders", "message"),
    [
        (bytes(31), 1, [0], "32 bytes"),
        (bytes(32), 0, [0, 1], "threshold lies in 1"),
        (bytes(32), 3, [0, 1], "threshold lies in 1"),
        (bytes(32), 1, [0, 0], "not distinct"),
        (bytes(32), 1, [-1, 2], "index >= 0"),
        (bytes(32), 1, [], "none"),
        (bytes(32), True, [0, 1], "integer"),
    ],
)
def test_split_refuses_bad_arguments(
    secret: bytes, threshold: int, holders: list[int], message: str
) -> None:
    with pytest.raises(ProtocolError, match=message):
        split_secret(secret, threshold, holders)


def test_shares_are_fresh_each_split() -> None:
    secret = os.urandom(32)
    assert split_secret(secret, 2, [0, 1]) != split_secret(secret, 2, [0, 1])
    assert split_secret(secret, 1, [0, 1]) == {h: secret.rjust(SHARE_BYTES, b"\0") for h in (0, 1)}


# ------------------------------------------------------------------------------ the graph


def _check_graph(graph: dict[int, tuple[int, ...]], clients: list[int], degree: int) -> None:
    assert sorted(graph) == sorted(clients)
    for k, neighbours in graph.items():
        assert k not in neighbours
        assert len(set(neighbours)) == len(neighbours) == degree
        assert set(neighbours) <= set(clients)
        for v in neighbours:
            assert k in graph[v]


@FAST
@given(
    clients=st.lists(st.integers(0, 500), min_size=4, max_size=40, unique=True),
    seed=st.binary(min_size=32, max_size=32),
    data=st.data(),
)
def test_the_graph_is_symmetric_and_regular(
    clients: list[int], seed: bytes, data: st.DataObject
) -> None:
    degree = 2 * data.draw(st.integers(1, (len(clients) - 2) // 2))
    graph = sharing_graph(clients, degree, seed)
    _check_graph(graph, clients, degree)
    assert sharing_graph(list(reversed(clients)), degree, seed) == graph


def test_the_graph_is_a_harary_cycle() -> None:
    """Each node's neighbours are the degree / 2 nodes either side of it on one cycle."""
    clients = list(range(0, 60, 3))
    graph = sharing_graph(clients, 4, b"\x07" * 32)
    ring = [clients[0]]
    # Walk the cycle: the next node is the common neighbour-of-neighbour at distance 1.
    previous = None
    while len(ring) < len(clients):
        here = ring[-1]
        nxt = [
            v
            for v in graph[here]
            if v != previous and len(set(graph[here]) & set(graph[v])) == 2 and v not in ring
        ]
        previous = here
        ring.append(nxt[0])
    for position, k in enumerate(ring):
        count = len(ring)
        expected = {ring[(position + s) % count] for s in (-2, -1, 1, 2)}
        assert set(graph[k]) == expected


def test_the_graph_depends_on_the_seed_only() -> None:
    clients = list(range(30))
    one = sharing_graph(clients, 6, b"\x01" * 32)
    assert sharing_graph(clients, 6, b"\x01" * 32) == one
    assert sharing_graph(clients, 6, b"\x02" * 32) != one


def test_the_graph_is_complete_from_degree_n_minus_one() -> None:
    clients = [3, 5, 8, 13]
    for degree in (3, 4, 9):
        graph = sharing_graph(clients, degree, bytes(32))
        assert graph == {k: tuple(v for v in clients if v != k) for k in clients}
    assert sharing_graph([4], 2, bytes(32)) == {4: ()}
    assert sharing_graph([], 2, bytes(32)) == {}


@pytest.mark.parametrize(
    ("clients", "degree", "seed", "message"),
    [
        (list(range(10)), 3, bytes(32), "even"),
        (list(range(10)), 0, bytes(32), "positive"),
        (list(range(10)), 2, bytes(31), "32 bytes"),
        ([1, 1, 2, 3], 2, bytes(32), "not distinct"),
        ([-1, 1, 2, 3], 2, bytes(32), ">= 0"),
    ],
)
def test_the_graph_refuses_bad_arguments(
    clients: list[int], degree: int, seed: bytes, message: str
) -> None:
    with pytest.raises(ProtocolError, match=message):
        sharing_graph(clients, degree, seed)


def test_draws_below_a_bound_reject_the_biased_top() -> None:
    # 2^64 - 1 lies past the last multiple of 3 below 2^64: it is rejected, 5 gives 5 % 3.
    assert maths._below(iter([2**64 - 1, 5]), 3) == 2
    assert maths._below(iter([2**64 - 2]), 3) == (2**64 - 2) % 3
    assert maths._below(iter([2**64 - 1]), 2**63) == 2**63 - 1


def test_a_permutation_position_is_uniform() -> None:
    """Where the first client lands over many seeds: uniform over the n places (chi-square)."""
    rng = np.random.default_rng(1)
    n, draws = 8, 4000
    counts = np.zeros(n)
    for _ in range(draws):
        order = maths._permutation(rng.bytes(32), list(range(n)))
        counts[order.index(0)] += 1
    chi2 = float(((counts - draws / n) ** 2 / (draws / n)).sum())
    assert chi2 < 30  # 7 degrees of freedom: P[chi2 > 30] < 1e-4


# ------------------------------------------------------------------------------ parameters


def test_failure_probabilities_match_a_hand_computed_case() -> None:
    # n = 20, k = 4, t = 3, 2 dropped, 2 corrupt; a node's neighbours: 4 of the other 19,
    # C(19, 4) = 3876. A survivor fails with both dropped among its 4: C(2,2) C(17,2) = 136;
    # a dropped node (1 other dropped) never has 2. 18 survivors: 18 * 136 / 3876 = 12 / 19.
    # Security: c >= 2t - k = 2 corrupt neighbours, 136 / 3876 each, over 18 honest nodes.
    correctness, security = failure_probabilities(20, 4, 3, 2, 2)
    assert correctness == pytest.approx(12 / 19, rel=1e-12)
    assert security == pytest.approx(12 / 19, rel=1e-12)
    # 3 corrupt, t = 4: c >= 4 is impossible; 3 dropped, t = 4: a survivor fails with one
    # dropped neighbour, 1 - C(16, 4) / C(19, 4) = 1 - 1820 / 3876, over 17 survivors (capped),
    # a dropped node (2 others dropped) with 1 - C(17, 4) / 3876.
    correctness, security = failure_probabilities(20, 4, 4, 3, 3)
    assert security == 0.0
    assert correctness == 1.0
    exact = Fraction(17 * (3876 - 1820) + 3 * (3876 - 2380), 3876)
    assert exact > 1
    # n = 200, 2 dropped, t = 3: 198 survivors fail with both dropped among their 4
    # neighbours: C(197, 2) = 19306 of C(199, 4) = 63391251 subsets.
    correctness, _ = failure_probabilities(200, 4, 3, 2, 0)
    assert correctness == pytest.approx(198 * 19306 / 63391251, rel=1e-12)


def test_a_threshold_at_most_half_the_degree_is_never_secure() -> None:
    assert failure_probabilities(50, 10, 5, 0, 0)[1] == 1.0
    assert failure_probabilities(50, 10, 6, 0, 0)[1] == 0.0


def test_the_complete_graph_is_deterministic() -> None:
    # n = 10, k = 9, 2 dropped: survivors keep 7 neighbours; 2 corrupt: secure iff 9 + 2 < 2t.
    assert failure_probabilities(10, 9, 7, 2, 2) == (0.0, 0.0)
    assert failure_probabilities(10, 9, 8, 2, 2)[0] == 1.0
    assert failure_probabilities(10, 9, 5, 2, 2)[1] == 1.0
    assert failure_probabilities(10, 12, 7, 2, 2) == (0.0, 0.0)  # the degree is capped


def test_failure_probabilities_match_a_monte_carlo_of_graphs() -> None:
    """Over 3000 graphs from random seeds, each node's dropped- and corrupt-neighbour counts
    follow the hypergeometric law the bounds assume, and the bounds hold."""
    rng = np.random.default_rng(7)
    n, k, trials = 16, 6, 3000
    clients = list(range(n))
    dropped = set(range(3))  # fixed before the seed is drawn
    corrupt = set(range(3, 7))
    drop_counts = np.zeros((trials, n), dtype=int)
    corrupt_counts = np.zeros((trials, n), dtype=int)
    for trial in range(trials):
        graph = sharing_graph(clients, k, rng.bytes(32))
        for u in clients:
            drop_counts[trial, u] = len(dropped & set(graph[u]))
            corrupt_counts[trial, u] = len(corrupt & set(graph[u]))
    survivors = [u for u in clients if u not in dropped]
    honest = [u for u in clients if u not in corrupt]

    def pmf(marked: int, x: int) -> float:
        return math.comb(marked, x) * math.comb(n - 1 - marked, k - x) / math.comb(n - 1, k)

    # The whole law of a survivor's dropped-neighbour count, and an honest node's corrupt one.
    for x in range(4):
        assert (drop_counts[:, survivors] == x).mean() == pytest.approx(pmf(3, x), abs=0.01)
    for x in range(5):
        assert (corrupt_counts[:, honest] == x).mean() == pytest.approx(pmf(4, x), abs=0.01)

    # Correctness, t = 4: a node fails with more than k - t = 2 dropped neighbours.
    correctness, _ = failure_probabilities(n, k, 4, 3, 4)
    per_node = (drop_counts[:, survivors] > 2).mean()
    assert per_node * len(survivors) == pytest.approx(correctness, rel=0.1)
    assert (drop_counts > 2).any(axis=1).mean() <= correctness + 0.02
    # Security, t = 5: an honest node falls with c >= 2t - k = 4 corrupt neighbours.
    _, security = failure_probabilities(n, k, 5, 3, 4)
    per_node = (corrupt_counts[:, honest] >= 4).mean()
    assert security == pytest.approx(len(honest) * pmf(4, 4), rel=1e-12)
    assert per_node == pytest.approx(pmf(4, 4), abs=0.004)
    assert (corrupt_counts[:, honest] >= 4).any(axis=1).mean() <= security + 0.02


@pytest.mark.parametrize(
    ("n", "dropout", "corrupt"),
    [(100, 0.1, 0.1), (300, 0.05, 0.2), (1000, 0.1, 0.05), (40, 0.0, 0.0), (12, 0.1, 0.1)],
)
def test_chosen_parameters_meet_the_bounds_and_are_minimal(
    n: int, dropout: float, corrupt: float
) -> None:
    degree, threshold = choose_parameters(n, dropout, corrupt, 40, 20)
    dropped, bad = math.floor(dropout * n), math.floor(corrupt * n)
    correctness, security = failure_probabilities(n, degree, threshold, dropped, bad)
    assert correctness <= 2**-20
    assert security <= 2**-40
    # A lower threshold is insecure; a lower degree works with no threshold.
    if threshold > 1:
        assert failure_probabilities(n, degree, threshold - 1, dropped, bad)[1] > 2**-40
    smaller = degree - 2 if degree % 2 == 0 else max(d for d in range(2, degree, 2))
    if smaller >= 2:
        for t in range(1, smaller + 1):
            c, s = failure_probabilities(n, smaller, t, dropped, bad)
            assert c > 2**-20 or s > 2**-40


def test_a_degree_or_threshold_set_by_the_spec_is_used_when_it_meets_the_bounds() -> None:
    derived = choose_parameters(100, 0.1, 0.1)
    # A larger degree: the least secure threshold for it, both bounds met
    degree, threshold = choose_parameters(100, 0.1, 0.1, degree=48)
    assert degree == 48 and threshold > derived[1]
    correctness, security = failure_probabilities(100, 48, threshold, 10, 10)
    assert correctness <= 2**-20 and security <= 2**-40
    assert failure_probabilities(100, 48, threshold - 1, 10, 10)[1] > 2**-40
    # A larger threshold: the least degree whose correctness it still meets
    degree, threshold = choose_parameters(100, 0.1, 0.1, threshold=derived[1] + 1)
    assert threshold == derived[1] + 1 and degree >= derived[0]
    assert failure_probabilities(100, degree, threshold, 10, 10)[0] <= 2**-20
    assert failure_probabilities(100, degree - 2, threshold, 10, 10)[0] > 2**-20
    # The complete graph past n - 1, with the threshold it needs: k + c < 2t, 9 + 1 < 2 * 6
    assert choose_parameters(10, 0.1, 0.1, degree=50) == (9, 6)


@pytest.mark.parametrize(
    ("degree", "threshold", "message"),
    [
        (31, None, "odd"),
        (None, 3, "fail the security bound"),  # too few shares keep a secret
        (32, 33, "above the degree 32"),
        (32, 31, "fail the correctness bound"),  # 10 dropping leave fewer than 31
    ],
)
def test_a_degree_or_threshold_that_breaks_a_bound_is_refused_naming_it(
    degree: int | None, threshold: int | None, message: str
) -> None:
    with pytest.raises(ProtocolError, match=message):
        choose_parameters(100, 0.1, 0.1, degree=degree, threshold=threshold)


def test_parameters_fall_back_on_the_complete_graph() -> None:
    # n = 8, 2 dropped, 2 corrupt: the complete graph needs 7 + 2 < 2t and t <= 7 - 2.
    assert choose_parameters(8, 0.3, 0.3) == (7, 5)
    assert choose_parameters(12, 0.1, 0.1) == (4, 3)  # 1 dropped, 1 corrupt: never enough
    assert choose_parameters(2, 0.0, 0.0) == (1, 1)


@pytest.mark.parametrize(
    ("n", "dropout", "corrupt", "message"),
    [
        (100, 1.0, 0.0, r"dropout rate lies in \[0, 1\)"),
        (100, 0.1, -0.1, r"corrupt rate lies in \[0, 1\)"),
        (100, 0.4, 0.2, "impossible for any n"),
        (100, 0.0, 1.0, "corrupt rate"),
        (4, 0.25, 0.25, "too small"),
        (1, 0.0, 0.0, "2 clients or more"),
    ],
)
def test_parameters_refuse_impossible_rates(
    n: int, dropout: float, corrupt: float, message: str
) -> None:
    with pytest.raises(ProtocolError, match=message):
        choose_parameters(n, dropout, corrupt)


def test_failure_probabilities_refuse_bad_arguments() -> None:
    with pytest.raises(ProtocolError, match="even"):
        failure_probabilities(10, 3, 2, 0, 0)
    with pytest.raises(ProtocolError, match="threshold"):
        failure_probabilities(10, 4, 5, 0, 0)
    with pytest.raises(ProtocolError, match="dropped count"):
        failure_probabilities(10, 4, 3, 11, 0)
    with pytest.raises(ProtocolError, match="corrupt count"):
        failure_probabilities(10, 4, 3, 0, -1)


# ------------------------------------------------------------------------------ fixed point


def test_quantization_refuses_bad_fields() -> None:
    for clip, levels, bits in [(0.0, 4, 8), (math.inf, 4, 8), (1.0, 1, 8), (1.0, 4, 0)]:
        with pytest.raises(ProtocolError):
            Quantization(clip, levels, bits)
    with pytest.raises(ProtocolError, match="do not fit"):
        Quantization(1.0, 257, 8)
    with pytest.raises(ProtocolError):
        Quantization(1.0, 4, 63)


def test_choose_bits_is_the_least_that_never_wraps() -> None:
    assert choose_bits(1, 2) == 1
    assert choose_bits(1, 256) == 8
    assert choose_bits(2, 256) == 9
    assert choose_bits(3, 3) == 3  # 3 * 2 = 6 < 8
    assert choose_bits(4, 3) == 4  # 4 * 2 = 8 needs 4 bits
    for clients, levels in [(7, 1000), (100, 2**16), (1, 2**61)]:
        bits = choose_bits(clients, levels)
        assert clients * (levels - 1) < 2**bits
        assert clients * (levels - 1) >= 2 ** (bits - 1)
    with pytest.raises(ProtocolError, match="more than 62"):
        choose_bits(4, 2**61)


@FAST
@given(
    values=st.lists(st.floats(-3.0, 3.0), min_size=1, max_size=50),
    clip=st.floats(0.1, 3.0),
    levels=st.integers(2, 5000),
)
def test_nearest_rounding_errs_at_most_half_a_step(
    values: list[float], clip: float, levels: int
) -> None:
    q = Quantization(clip, levels, choose_bits(1, levels))
    array = np.array(values, dtype=np.float64)
    levels_out = quantize(array, q, stochastic=False)
    assert levels_out.dtype == np.uint64
    assert int(levels_out.max()) <= levels - 1
    back = dequantize_sum(levels_out, 1, q)
    target = np.clip(array, -clip, clip)
    assert np.all(np.abs(back - target) <= clip / (levels - 1) * (1 + 1e-9) + 1e-12)


def test_stochastic_rounding_is_unbiased() -> None:
    q = Quantization(1.0, 5, 8)  # step 0.5
    rng = np.random.default_rng(3)
    values = np.array([-0.9, -0.3, 0.1, 0.37, 0.8, 1.0, -1.0], dtype=np.float32)
    draws = 20_000
    total = np.zeros(values.size)
    for _ in range(20):
        batch = np.tile(values, (draws // 20, 1))
        total += dequantize_sum(quantize(batch, q, stochastic=True, rng=rng), 1, q).sum(axis=0)
    mean = total / draws
    # Each draw is off by at most one step (0.5): the standard error is at most 0.25 / sqrt(n).
    assert np.all(np.abs(mean - values.astype(np.float64)) < 5 * 0.25 / math.sqrt(draws))
    # Values on a level never move.
    exact = quantize(np.array([-1.0, -0.5, 0.0, 0.5, 1.0]), q, stochastic=True, rng=rng)
    assert exact.tolist() == [0, 1, 2, 3, 4]


def test_an_integer_grid_round_trips_exactly() -> None:
    q = Quantization(4.0, 9, choose_bits(5, 9))  # step 1: levels are -4 .. 4
    rng = np.random.default_rng(11)
    inputs = rng.integers(-4, 5, size=(5, 100)).astype(np.float32)
    quantized = [quantize(row, q, stochastic=False) for row in inputs]
    total = np.asarray(np.sum(quantized, axis=0, dtype=np.uint64), dtype=np.uint64)
    assert np.array_equal(dequantize_sum(total, 5, q), inputs.sum(axis=0).astype(np.float64))
    stochastic = quantize(inputs[0], q, stochastic=True, rng=rng)
    assert np.array_equal(stochastic, quantized[0])


def test_quantize_refuses_non_finite_values() -> None:
    q = Quantization(1.0, 16, 8)
    with pytest.raises(ProtocolError, match="2 values to quantize are not finite"):
        quantize(np.array([0.0, np.nan, np.inf]), q, stochastic=False)
    with pytest.raises(ProtocolError, match="random generator"):
        quantize(np.zeros(3), q, stochastic=True, rng=None)
    with pytest.raises(ProtocolError, match="real values"):
        quantize(np.array(["a"]), q, stochastic=False)
    assert quantize(np.array([-5.0, 5.0]), q, stochastic=False).tolist() == [0, 15]


def test_dequantize_refuses_a_wrapped_sum() -> None:
    q = Quantization(1.0, 16, 8)
    with pytest.raises(ProtocolError, match="above 30"):
        dequantize_sum(np.array([31], dtype=np.uint64), 2, q)
    with pytest.raises(ProtocolError, match="uint64"):
        dequantize_sum(np.array([3], dtype=np.int64), 2, q)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ masks


def test_expand_mask_is_the_keystream_cut_to_bits() -> None:
    seed = os.urandom(32)
    mask = expand_mask(seed, 101, 20, 5)
    assert mask.dtype == np.uint64 and mask.shape == (101,)
    assert np.array_equal(mask, keystream(seed, 5, 101) & np.uint64(2**20 - 1))
    assert not np.array_equal(mask, expand_mask(seed, 101, 20, 6))
    assert np.array_equal(expand_mask(seed, 101, 62, 1) >> np.uint64(62), np.zeros(101))
    assert expand_mask(seed, 0, 8, 1).shape == (0,)
    with pytest.raises(ProtocolError, match="32 bytes"):
        expand_mask(seed[:31], 3, 8, 1)
    with pytest.raises(ProtocolError, match="mask bits"):
        expand_mask(seed, 3, 63, 1)


def _round(
    clients: list[int],
    degree: int,
    bits: int,
    size: int,
    rng: np.random.Generator,
) -> tuple[
    dict[int, tuple[int, ...]],
    dict[int, np.ndarray],
    dict[int, bytes],
    dict[tuple[int, int], bytes],
    dict[int, np.ndarray],
]:
    """A round's graph, inputs, self seeds, pair seeds (keyed low, high) and uploads."""
    graph = sharing_graph(clients, degree, rng.bytes(32))
    inputs = {u: rng.integers(0, 2**bits, size=size, dtype=np.uint64) for u in clients}
    self_seeds = {u: os.urandom(32) for u in clients}
    pair = {(u, v): os.urandom(32) for u in clients for v in graph[u] if u < v}
    uploads = {
        u: mask_input(
            inputs[u],
            client=u,
            self_seed=self_seeds[u],
            pair_seeds={v: pair[min(u, v), max(u, v)] for v in graph[u]},
            bits=bits,
        )
        for u in clients
    }
    return graph, inputs, self_seeds, pair, uploads


def test_masks_cancel_without_dropouts() -> None:
    rng = np.random.default_rng(5)
    clients = [2, 3, 7, 10, 11, 20]
    graph, inputs, self_seeds, _, uploads = _round(clients, 2, 16, 64, rng)
    for u in clients:
        assert not np.array_equal(uploads[u], inputs[u])
        assert int(uploads[u].max()) < 2**16
    total = unmask_sum(uploads, graph=graph, self_seeds=self_seeds, dropped_pair_seeds={}, bits=16)
    expected = np.sum(list(inputs.values()), axis=0, dtype=np.uint64) & np.uint64(2**16 - 1)
    assert np.array_equal(total, expected)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(3, 14),
    half=st.integers(1, 6),
    bits=st.integers(1, 62),
    size=st.integers(0, 40),
    data=st.data(),
)
def test_unmasking_recovers_the_survivors_sum_exactly(
    n: int, half: int, bits: int, size: int, data: st.DataObject
) -> None:
    """Clients drop before uploading (their pair masks are cancelled with the rebuilt pair
    seeds) or after uploading but before sending shares (their self seeds are rebuilt from the
    shares of the neighbours still there); the result is the survivors' exact sum."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    clients = sorted(data.draw(st.sets(st.integers(0, 99), min_size=n, max_size=n)))
    degree = min(2 * half, n - 1)
    graph, inputs, self_seeds, pair, uploads = _round(clients, degree, bits, size, rng)
    before = set(data.draw(st.sets(st.sampled_from(clients), max_size=n - 1)))
    after = set(data.draw(st.sets(st.sampled_from(clients), max_size=n))) - before
    survivors = [u for u in clients if u not in before]
    responders = set(clients) - before - after
    helpers = {u: [v for v in graph[u] if v in responders] for u in survivors}
    most = min(len(h) for h in helpers.values())
    assume(most >= 1)
    threshold = data.draw(st.integers(1, most))
    # Each client shared its self seed among its neighbours; the server rebuilds each
    # survivor's from the responders' shares (never a dropped client's).
    rebuilt = {}
    for u in survivors:
        shares = split_secret(self_seeds[u], threshold, list(graph[u]))
        rebuilt[u] = combine_shares({v: shares[v] for v in helpers[u]}, threshold)
    edges = needed_edges(graph, survivors, before)
    assert edges == {(u, d) for u in survivors for d in graph[u] if d in before}
    seeds = {(u, d): pair[min(u, d), max(u, d)] for u, d in edges}
    total = unmask_sum(
        {u: uploads[u] for u in survivors},
        graph=graph,
        self_seeds=rebuilt,
        dropped_pair_seeds=seeds,
        bits=bits,
    )
    expected = np.zeros(size, dtype=np.uint64)
    for u in survivors:
        expected = expected + inputs[u]
    assert np.array_equal(total, expected & np.uint64(2**bits - 1))


def test_no_wrap_at_the_chosen_bits() -> None:
    q_levels, clients = 1000, [0, 1, 2, 3, 4, 5, 6]
    bits = choose_bits(len(clients), q_levels)
    q = Quantization(1.0, q_levels, bits)
    rng = np.random.default_rng(9)
    graph = sharing_graph(clients, 2, rng.bytes(32))
    top = quantize(np.full(10, 5.0), q, stochastic=False)  # every client at levels - 1
    assert top.tolist() == [q_levels - 1] * 10
    self_seeds = {u: os.urandom(32) for u in clients}
    pair = {(u, v): os.urandom(32) for u in clients for v in graph[u] if u < v}

    def run(width: int) -> np.ndarray:
        uploads = {
            u: mask_input(
                top,
                client=u,
                self_seed=self_seeds[u],
                pair_seeds={v: pair[min(u, v), max(u, v)] for v in graph[u]},
                bits=width,
            )
            for u in clients
        }
        return unmask_sum(
            uploads, graph=graph, self_seeds=self_seeds, dropped_pair_seeds={}, bits=width
        )

    total = run(bits)
    assert total.tolist() == [len(clients) * (q_levels - 1)] * 10
    assert np.array_equal(dequantize_sum(total, len(clients), q), np.full(10, 7.0))
    assert run(bits - 1).tolist() != total.tolist()  # one bit fewer wraps


def test_unmasking_refuses_missing_or_extra_secrets() -> None:
    rng = np.random.default_rng(13)
    clients = list(range(8))
    graph, _, self_seeds, pair, uploads = _round(clients, 2, 12, 8, rng)
    gone = 3
    survivors = {u: uploads[u] for u in clients if u != gone}
    seeds = {(u, gone): pair[min(u, gone), max(u, gone)] for u in graph[gone]}
    own = {u: self_seeds[u] for u in survivors}
    unmask_sum(survivors, graph=graph, self_seeds=own, dropped_pair_seeds=seeds, bits=12)

    def refused(message: str, **changes: object) -> None:
        arguments: dict[str, object] = {
            "graph": graph,
            "self_seeds": own,
            "dropped_pair_seeds": seeds,
            "bits": 12,
        }
        arguments |= changes
        masked = arguments.pop("masked", survivors)
        with pytest.raises(ProtocolError, match=message):
            unmask_sum(masked, **arguments)  # type: ignore[arg-type]

    first = next(iter(graph[gone]))
    refused(r"self seeds of survivors \[0\]", self_seeds={u: s for u, s in own.items() if u})
    refused(r"Self seeds of clients \[3\]", self_seeds=own | {gone: self_seeds[gone]})
    refused(
        rf"edges \[\({first}, 3\)\] are missing",
        dropped_pair_seeds={e: s for e, s in seeds.items() if e[0] != first},
    )
    refused(r"edges \[\(0, 1\)\]", dropped_pair_seeds=seeds | {(0, 1): os.urandom(32)})
    refused("client 5's masked input is not a uint64", masked=survivors | {5: uploads[5] * 1.0})
    refused("client 5's masked input has words of 12 bits", masked=survivors | {5: uploads[5] << 2})
    refused("different shapes", masked=survivors | {5: uploads[5][:4]})
    refused(r"Clients \[40\] sent masked inputs", masked=survivors | {40: uploads[5]})
    refused("No masked input arrived", masked={})
    with pytest.raises(ProtocolError, match="itself"):
        mask_input(
            uploads[0], client=0, self_seed=os.urandom(32), pair_seeds={0: bytes(32)}, bits=12
        )
    with pytest.raises(ProtocolError, match="quantized input has words"):
        mask_input(
            uploads[0] << np.uint64(12), client=0, self_seed=os.urandom(32), pair_seeds={}, bits=12
        )


def test_masked_inputs_keep_their_shape() -> None:
    rng = np.random.default_rng(17)
    x = rng.integers(0, 256, size=(3, 4), dtype=np.uint64)
    seed, peer = os.urandom(32), os.urandom(32)
    y = mask_input(x, client=1, self_seed=seed, pair_seeds={2: peer}, bits=8)
    z = mask_input(x, client=2, self_seed=seed, pair_seeds={1: peer}, bits=8)
    assert y.shape == (3, 4)
    graph = {1: (2,), 2: (1,)}
    total = unmask_sum(
        {1: y, 2: z}, graph=graph, self_seeds={1: seed, 2: seed}, dropped_pair_seeds={}, bits=8
    )
    assert np.array_equal(total, (x + x) & np.uint64(255))

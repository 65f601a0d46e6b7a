"""ebscfl (digest 004) in one process: the encoded pipeline against its plaintext oracle, the
corrected equations, verification, the KDC's key handling, what the server holds, and the
known leaks kept as regression tests (they assert the leak, so they fail if someone hardens
the scheme and the docs must change)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from fedcore.audit import _ebscfl as leaks
from fedcore.audit._ebscfl import readout
from fedcore.errors import EncodingRejected, MessageRejected, NotReady, ProtocolError
from fedcore.protocols import KeyChannel
from fedcore.protocols.ebscfl import keys as keys_
from fedcore.protocols.ebscfl import maths
from fedcore.protocols.ebscfl.protocol import (
    CLIENT_KEYS,
    OPEN,
    SCORE,
    SCORE_KEYS,
    SERVER_KEYS,
    EbscflKdc,
    EbscflServer,
)
from fedcore.protocols.fedavg import aggregators
from fedcore.simulation import LocalKeyChannel
from fedcore.spec._options import EbscflOptions
from fedcore.transport import Identity, Payload

# ------------------------------------------------------------------------------ helpers


def unit_updates(
    rng: np.random.Generator, g0: np.ndarray, clusters: list[int], negative: tuple[int, ...] = ()
) -> list[np.ndarray]:
    """Unit updates near each client's cluster's g_0 (negatively correlated for ``negative``)."""
    out = []
    for i, c in enumerate(clusters):
        u = g0[c] + 0.7 * rng.standard_normal(g0.shape[1])
        if i in negative:
            u = -g0[c] + 0.2 * rng.standard_normal(g0.shape[1])
        out.append(u / np.linalg.norm(u))
    return out


@dataclass
class Round:
    """One attempt run through the KDC's keys and the server's maths, as the roles do it."""

    material: keys_.KeyMaterial
    uploads: list[np.ndarray]
    server: dict[str, np.ndarray]
    score: list[dict[str, np.ndarray]] = field(default_factory=list)
    alphas: list[np.ndarray] = field(default_factory=list)
    s_matrix: np.ndarray | None = None
    total: float = 0.0
    decode_keys: list[np.ndarray] = field(default_factory=list)
    aggregates: np.ndarray | None = None

    @property
    def geometry(self) -> maths.Geometry:
        return self.material.geometry

    def group_columns(self, group: int) -> slice:
        g = self.geometry
        width = 3 * g.width
        return slice(width * group * g.group, width * (group * g.group + g.group_size(group)))


def run_round(
    units: list[np.ndarray],
    clusters: list[int],
    g0: np.ndarray,
    *,
    segment: int = 1,
    group: int | None = None,
    repaired: bool = False,
    master: bytes = b"k" * 32,
    round_: int = 1,
    nonce: str = "n1",
) -> Round:
    """Encodes, verifies, scores and decodes one attempt with the KDC's derived keys."""
    n, (m, length) = len(units), g0.shape
    geometry = maths.Geometry(length, m, segment, n, group or n)
    material = keys_.KeyMaterial(
        master=master,
        attempt=keys_.Attempt(round_, 1, nonce, tuple(range(n))),
        geometry=geometry,
        g0_units=g0 / np.linalg.norm(g0, axis=1, keepdims=True),
        repaired=repaired,
        zeta_scale=30.0,
    )
    uploads = []
    for p, (unit, c) in enumerate(zip(units, clusters, strict=True)):
        keys = material.client_keys(p)
        uploads.append(
            maths.encode(unit, c, geometry, keys["embedding"], keys["slot"], keys["mask_key"])
        )
    result = Round(material, uploads, material.server_keys())
    k = result.server
    parts = []
    for p, upload in enumerate(uploads):
        score, norm, check = material.score_keys(p)
        group_ = geometry.place(p)[0]
        assert maths.norm_ok(upload, norm)
        assert maths.mask_ok(upload, k["verify"][result.group_columns(group_)], check)
        alpha = maths.score_matrix(upload, score["a"], score["b"], score["p"], score["q"])
        result.score.append(score)
        result.alphas.append(alpha)
        parts.append(maths.srfc_terms(alpha, k["beta"], k["tau1"], k["tau2"], k["tau3"]))
    s_matrix = 0.5 * sum(a + b for a, b in parts)
    result.s_matrix = s_matrix
    result.total = maths.weight_total(s_matrix, k["beta"])
    decoded = np.zeros((geometry.segments, geometry.width))
    if result.total <= 1e-12:  # every update filtered: nothing to decode (the server skips)
        result.aggregates = np.zeros((m, length))
        return result
    for group_ in range(geometry.groups):
        key = maths.weighted_decode_key(
            s_matrix, k["decode"][:, result.group_columns(group_)], result.total
        )
        result.decode_keys.append(key)
        members = material.members(group_)
        decoded += sum(uploads[p] for p in members) @ key.T
    result.aggregates = maths.cluster_aggregates(decoded, k["embedding"], geometry)
    return result


def problem(
    seed: int, *, n: int = 4, m: int = 2, length: int = 40
) -> tuple[np.random.Generator, np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    g0 = rng.standard_normal((m, length))
    return rng, g0 / np.linalg.norm(g0, axis=1, keepdims=True), [i % m for i in range(n)]


def target_of(unit: np.ndarray, geometry: maths.Geometry) -> np.ndarray:
    return maths.segmented(unit, geometry)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return 0.0 if na == 0 or nb == 0 else float(np.vdot(a, b) / (na * nb))


# --------------------------------------------------------------------- corrected maths


def test_mom_blocks_are_row_orthonormal() -> None:
    # Prepare
    rng = np.random.default_rng(0)
    # Execute
    q = maths.orthogonal(rng, 24).reshape(4, 6, 24)
    # Assert: M_i M_j^T = delta_ij I (the row convention of G2)
    for i, j in itertools.product(range(4), repeat=2):
        expected = np.eye(6) if i == j else np.zeros((6, 6))
        np.testing.assert_allclose(q[i] @ q[j].T, expected, atol=1e-12)


@pytest.mark.parametrize("repaired", [False, True], ids=["Faithful", "Repaired"])
@pytest.mark.parametrize(
    ("n", "m", "segment", "group", "length"),
    [
        (2, 1, 2, None, 30),  # flat, one cluster
        (4, 2, 1, None, 40),  # flat (the paper's main text)
        (5, 3, 2, 1, 31),  # layered, one space per client, padding (31 = 15*2 + 1)
        (5, 2, 3, 2, 40),  # layered groups of 2 (the last of 1)
        (3, 2, 1, 3, 25),  # groups as large as the roster: flat again
    ],
)
def test_encoded_pipeline_equals_the_plaintext_robust_clustered_aggregate(
    repaired: bool, n: int, m: int, segment: int, group: int | None, length: int
) -> None:
    if repaired and segment * m < 2:
        pytest.skip("Repaired needs t*m >= 2")
    for seed in range(3):
        # Prepare
        rng, g0, clusters = problem(seed, n=n, m=m, length=length)
        units = unit_updates(rng, g0, clusters, negative=(1,))
        # Execute
        found = run_round(units, clusters, g0, segment=segment, group=group, repaired=repaired)
        expected, scores, total = aggregators.rfca(units, clusters, g0)
        # Assert
        assert found.aggregates is not None
        np.testing.assert_allclose(found.aggregates, expected, rtol=0, atol=1e-9)
        assert found.total == pytest.approx(total, rel=1e-9)
        assert scores[1] < 0


def test_a_negatively_correlated_update_gets_weight_zero() -> None:
    # Prepare: client 1 points away from its cluster's g_0
    rng, g0, clusters = problem(1, n=4, m=2)
    units = unit_updates(rng, g0, clusters, negative=(1,))
    other = list(units)
    other[1] = -g0[clusters[1]]  # another negatively correlated update, strongly so
    without = [u for i, u in enumerate(units) if i != 1]
    # Execute
    first = run_round(units, clusters, g0)
    second = run_round(other, clusters, g0)
    reference, _, total = aggregators.rfca(
        without, [c for i, c in enumerate(clusters) if i != 1], g0
    )
    # Assert: its contribution is exactly nothing, whatever it sent
    assert first.aggregates is not None and second.aggregates is not None
    np.testing.assert_allclose(first.aggregates, reference, atol=1e-9)
    np.testing.assert_allclose(second.aggregates, reference, atol=1e-9)
    assert first.total == pytest.approx(total, rel=1e-9)


def test_every_update_filtered_gives_a_zero_weight_total() -> None:
    # Prepare
    rng, g0, clusters = problem(2, n=3, m=2)
    units = unit_updates(rng, g0, clusters, negative=(0, 1, 2))
    # Execute
    found = run_round(units, clusters, g0, repaired=True)
    # Assert (T11): W is 0 to rounding; the server then keeps its models
    assert abs(found.total) < 1e-9


def test_the_printed_r1_bound_breaks_srfc_and_the_corrected_one_does_not() -> None:
    # Prepare: SRFC alone on scalar scores (Thm 2), printed vs corrected r^(1) (G3)
    errors: dict[bool, float] = {}
    for printed in (True, False):
        worst = 0.0
        for seed in range(20):
            rng = np.random.default_rng(seed)
            n, d = 4, 2
            x = rng.uniform(-1.4, 1.4, n)
            srfc = maths.srfc_keys(
                rng, clients=n, width=d, bound=math.sqrt(2), printed_r1_bound=printed
            )
            s_matrix = 0.0
            for i in range(n):
                p, q = srfc.score_matrices(i)
                alpha = x[i] * p + q
                a, b = maths.srfc_terms(alpha, srfc.beta, srfc.tau1, srfc.tau2, srfc.tau3)
                s_matrix = s_matrix + 0.5 * (a + b)
            total = maths.weight_total(np.asarray(s_matrix), srfc.beta)
            worst = max(worst, abs(total - np.maximum(x, 0).sum()))
        errors[printed] = worst
    # Assert
    assert errors[True] > 1e-2
    assert errors[False] < 1e-9


def test_the_trace_divisor_is_the_block_width_not_l() -> None:
    # Prepare (G4): tr(S beta^T) = d * sum ReLU(w_i); the printed 1/l is off by m when t = l/...
    rng, g0, clusters = problem(3, n=4, m=3, length=12)
    units = unit_updates(rng, g0, clusters)
    # Execute
    found = run_round(units, clusters, g0, segment=2)
    assert found.s_matrix is not None
    trace = float(np.trace(found.s_matrix @ found.server["beta"].T))
    _, _, total = aggregators.rfca(units, clusters, g0)
    # Assert: divisor d = t*m = 6, not the segment length t = 2 (the paper's "l")
    assert trace / 6 == pytest.approx(total, rel=1e-9)
    assert trace / 2 == pytest.approx(3 * total, rel=1e-9)


def test_norm_constant_is_one_plus_the_mask_norms_and_m_plus_2_on_average() -> None:
    # Prepare (G5)
    rng, g0, clusters = problem(4, n=6, m=2, length=400)
    units = unit_updates(rng, g0, clusters)
    # Execute
    found = run_round(units, clusters, g0, group=1)
    norms = [float(np.vdot(u, u)) for u in found.uploads]
    expected = [found.material.summary(p).norm for p in range(6)]
    # Assert: exactly the KDC's per-client constant; m + 2 = 4 on average, not the printed 3
    np.testing.assert_allclose(norms, expected, rtol=1e-12)
    assert np.mean(norms) == pytest.approx(4.0, rel=0.1)


def test_segmentation_and_layout_do_not_change_the_aggregate() -> None:
    # Prepare (T7 and layered == flat)
    rng, g0, clusters = problem(5, n=4, m=2, length=23)
    units = unit_updates(rng, g0, clusters, negative=(2,))
    # Execute
    results = [
        run_round(units, clusters, g0, segment=t, group=xi).aggregates
        for t in (1, 2, 4)
        for xi in (None, 1, 2)
    ]
    # Assert
    for found in results[1:]:
        np.testing.assert_allclose(found, results[0], atol=1e-9)


# ------------------------------------------------------------------------- verification


def verifier(seed: int = 6) -> tuple[Round, list[np.ndarray], np.ndarray, list[int]]:
    rng, g0, clusters = problem(seed, n=3, m=2, length=30)
    units = unit_updates(rng, g0, clusters)
    return run_round(units, clusters, g0, group=1, repaired=True), units, g0, clusters


def passes(found: Round, position: int, upload: np.ndarray) -> bool:
    _, norm, check = found.material.score_keys(position)
    group = found.geometry.place(position)[0]
    verify = found.server["verify"][found.group_columns(group)]
    return maths.norm_ok(upload, norm) and maths.mask_ok(upload, verify, check)


def test_honest_encodings_pass_and_tampered_ones_fail() -> None:
    # Prepare
    found, units, _, clusters = verifier()
    keys = found.material.client_keys(0)
    rng = np.random.default_rng(0)
    honest = found.uploads[0]
    noise = rng.standard_normal(honest.shape)
    unnormalised = maths.encode(
        3 * units[0], clusters[0], found.geometry, keys["embedding"], keys["slot"], keys["mask_key"]
    )
    # Execute / Assert (T8, T9)
    assert passes(found, 0, honest)
    assert not passes(found, 0, honest + 1e-3 * noise / np.linalg.norm(noise))
    assert not passes(found, 0, honest + 0.5 * keys["mask_key"])
    assert not passes(found, 0, 1.01 * honest)
    assert not passes(found, 0, unnormalised)


def test_any_unit_vector_in_the_clients_slot_passes_verification_a_documented_limit() -> None:
    # Prepare (G9): a unit h spread over both cluster blocks
    found, _, _, _ = verifier()
    keys = found.material.client_keys(1)
    g = found.geometry
    rng = np.random.default_rng(1)
    spread = rng.standard_normal((g.segments, g.width))
    spread /= np.linalg.norm(spread)
    # Execute
    forged = spread @ keys["slot"] + keys["mask_key"]
    # Assert: it passes, and it lands in both clusters' aggregates with one score
    assert passes(found, 1, forged)


# ----------------------------------------------------------------------------- the KDC


class Recording(KeyChannel):
    """The server's channel to an in-process KDC that keeps every answer the server got."""

    def __init__(self, kdc: EbscflKdc) -> None:
        self.inner = LocalKeyChannel(kdc, Identity("server"))
        self.answers: list[Payload] = []

    def submit(self, payload: Payload) -> Payload:
        answer = self.inner.submit(payload)
        self.answers.append(answer)
        return answer


def options(**changes: Any) -> EbscflOptions:
    return EbscflOptions(**{"clusters": 2, **changes})


def opened(kdc: EbscflKdc, roster: tuple[int, ...], g0: np.ndarray, round_: int = 1) -> Payload:
    return kdc.accept(
        Identity("server"),
        Payload(
            meta={
                "kind": OPEN,
                "round": round_,
                "attempt": 1,
                "nonce": f"r{round_}",
                "roster": list(roster),
            },
            tensors={"g0": g0},
        ),
    )


def test_the_kdc_hands_each_party_only_its_own_keys() -> None:
    # Prepare
    kdc = EbscflKdc(options=options(), count=4)
    g0 = np.random.default_rng(0).standard_normal((2, 20))
    # Execute
    with pytest.raises(NotReady):
        kdc.issue_keys(1, Identity("client", 0))
    server = opened(kdc, (0, 1, 3), g0)
    client = kdc.issue_keys(1, Identity("client", 1))
    outsider = kdc.issue_keys(1, Identity("client", 2))
    score = kdc.accept(
        Identity("server"), Payload(meta={"kind": SCORE, "round": 1, "attempt": 1, "client": 3})
    )
    # Assert: T13's message audit
    assert sorted(server.tensors) == sorted(SERVER_KEYS)
    assert sorted(client.tensors) == sorted(CLIENT_KEYS) and client.meta["participant"] is True
    assert outsider.tensors == {} and outsider.meta["participant"] is False
    assert sorted(score.tensors) == sorted(SCORE_KEYS)
    assert set(score.meta) == {"norm", "check"}
    with pytest.raises(PermissionError):
        kdc.issue_keys(1, Identity("server"))
    with pytest.raises(PermissionError):
        kdc.accept(Identity("client", 0), Payload(meta={"kind": OPEN}))
    with pytest.raises(PermissionError):
        kdc.issue_keys(1, Identity("client", 4))
    with pytest.raises(MessageRejected):
        opened(kdc, (0,), g0)  # a roster of one: masks cannot sum to zero


@pytest.mark.parametrize("mode", ["Faithful", "Repaired"])
def test_keys_are_refreshed_every_round(mode: str) -> None:
    # Prepare
    kdc = EbscflKdc(options=options(mode=mode), count=3)
    g0 = np.random.default_rng(1).standard_normal((2, 20))
    # Execute
    opened(kdc, (0, 1, 2), g0, round_=1)
    first = kdc.issue_keys(1, Identity("client", 0))
    opened(kdc, (0, 1, 2), g0, round_=2)
    second = kdc.issue_keys(2, Identity("client", 0))
    stale = kdc.issue_keys(1, Identity("client", 0))
    # Assert: ek^1 is fresh every round (T10); the slot key only in Repaired mode
    assert not np.allclose(first.tensors["mask_key"], second.tensors["mask_key"])
    same_slot = np.array_equal(first.tensors["slot"], second.tensors["slot"])
    assert same_slot == (mode == "Faithful")
    assert stale.meta["participant"] is False


def test_a_restored_kdc_serves_exactly_the_keys_it_served_and_its_state_is_small() -> None:
    # Prepare
    kdc = EbscflKdc(options=options(), count=3)
    g0 = np.random.default_rng(2).standard_normal((2, 50))
    server = opened(kdc, (0, 2), g0)
    client = kdc.issue_keys(1, Identity("client", 2))
    state = kdc.state_dict()
    # Execute
    restored = EbscflKdc(options=options(), count=3)
    restored.load_state_dict(state)
    again = restored.issue_keys(1, Identity("client", 2))
    score = restored.accept(
        Identity("server"), Payload(meta={"kind": SCORE, "round": 1, "attempt": 1, "client": 0})
    )
    original = kdc.accept(
        Identity("server"), Payload(meta={"kind": SCORE, "round": 1, "attempt": 1, "client": 0})
    )
    # Assert
    for name in CLIENT_KEYS:
        np.testing.assert_array_equal(again.tensors[name], client.tensors[name])
    for name in SCORE_KEYS:
        np.testing.assert_array_equal(score.tensors[name], original.tensors[name])
    assert set(state) == {"kind", "version", "clients", "master", "g0", "open"}
    assert state["g0"].shape == (2, 50) and len(bytes.fromhex(state["master"])) == 32
    assert sorted(server.tensors) == sorted(SERVER_KEYS)


# ------------------------------------------------------------ what the server holds


def held_by_the_server(found: Round, *, derived: bool) -> dict[str, np.ndarray]:
    """Every matrix the server receives for an attempt (and, with ``derived``, computes)."""
    held = {f"server.{k}": v for k, v in found.server.items()}
    for group in range(found.geometry.groups):  # the server applies dk group by group
        held[f"server.decode[{group}]"] = found.server["decode"][:, found.group_columns(group)]
    for p, score in enumerate(found.score):
        held.update({f"score{p}.{k}": v for k, v in score.items()})
    if derived:
        assert found.s_matrix is not None
        held["S"] = found.s_matrix
        held.update({f"dk'{g}": key for g, key in enumerate(found.decode_keys)})
        held.update({f"alpha{p}": a for p, a in enumerate(found.alphas)})
    return held


def chains(held: dict[str, np.ndarray], width: int, depth: int) -> Iterator[tuple[str, np.ndarray]]:
    """Every way to apply up to ``depth`` held matrices (or their transposes) to an upload row."""
    mats = {k: v for k, v in held.items() if v.ndim == 2}
    mats.update({f"{k}^T": v.T for k, v in held.items() if v.ndim == 2})
    frontier = [(name, m) for name, m in mats.items() if m.shape[0] == width]
    for _ in range(depth):
        nxt: list[tuple[str, np.ndarray]] = []
        for name, m in frontier:
            yield name, m
            nxt.extend((f"{name}.{k}", m @ v) for k, v in mats.items() if v.shape[0] == m.shape[1])
        frontier = nxt


def decodes(
    found: Round, held: dict[str, np.ndarray], units: list[np.ndarray], depth: int = 1
) -> list[str]:
    """The ways the server turns some client's upload into its update (|cosine| > 0.999):
    apply held matrices, then read the clusters' blocks out with A (after beta^T when the
    rows live in the SRFC space, as dk's do)."""
    g = found.geometry
    beta, embedding = found.server["beta"], found.server["embedding"]
    hits = []
    for p, upload in enumerate(found.uploads):
        target = target_of(units[p], g)
        for name, chain in chains(held, upload.shape[1], depth):
            rows = upload @ chain
            if rows.shape[1] == g.srfc_width:
                rows, name = rows @ beta.T, f"{name} then beta^T"
            if rows.shape[1] == g.width:
                blocks = readout(rows, embedding, g)
            elif rows.shape[1] == g.segment:
                blocks = [rows]
            else:
                continue
            if any(abs(cosine(b, target)) > 0.999 for b in blocks):
                hits.append(f"client {p}: {name}")
    return hits


@pytest.mark.parametrize("repaired", [False, True], ids=["Faithful", "Repaired"])
def test_the_server_never_holds_a_key_that_decodes_a_single_client(repaired: bool) -> None:
    # Prepare
    rng, g0, clusters = problem(7, n=3, m=2, length=24)
    units = unit_updates(rng, g0, clusters, negative=(2,))
    found = run_round(units, clusters, g0, group=1, repaired=repaired)
    # Execute: every array it received, and every array it computed, applied to each upload
    given = decodes(found, held_by_the_server(found, derived=False), units)
    derived = decodes(found, held_by_the_server(found, derived=True), units)
    # Assert: nothing the KDC gives decodes; of what the server computes, only Faithful's
    # weighted decode key dk' does, client by client (leak 1; client 2 is filtered, and its
    # dk' part is 0)
    assert given == []
    if repaired:
        assert derived == []
    else:
        assert derived == ["client 0: dk'0^T", "client 1: dk'1^T"]


# ------------------------------------------------------------------ the known leaks


@pytest.mark.parametrize("repaired", [False, True], ids=["Faithful", "Repaired"])
def test_leak1_the_weighted_decode_key_decodes_one_client_unless_repaired(repaired: bool) -> None:
    # Prepare
    rng, g0, clusters = problem(9, n=4, m=2, length=30)
    units = unit_updates(rng, g0, clusters)
    found = run_round(units, clusters, g0, group=1, repaired=repaired)
    _, scores, total = aggregators.rfca(units, clusters, g0)
    # Execute: delta_i dk'_i^T for each client alone
    errors = []
    for p, upload in enumerate(found.uploads):
        rows = upload @ found.decode_keys[p].T
        block = readout(rows, found.server["embedding"], found.geometry)[clusters[p]]
        target = target_of(units[p], found.geometry)
        expected = max(scores[p], 0) / total * target
        errors.append(float(np.abs(block - expected).max() / np.abs(target).max()))
    # Assert: exact in Faithful mode (the leak; a filtered client decodes to 0), masked far
    # beyond the signal when repaired
    if repaired:
        assert min(errors) > 1.0
    else:
        assert max(errors) < 1e-9


def spectral_attack(found: Round, p: int) -> tuple[int, np.ndarray, float] | None:
    """Leaks 2 and 3 (the audit's attack): from alpha_i, dk and beta alone, the client's
    cluster, update and score."""
    group, _ = found.geometry.place(p)
    seen = found.uploads[p] @ found.server["decode"][:, found.group_columns(group)].T
    return leaks.spectral_attack(
        found.alphas[p], seen, found.server["beta"], found.server["embedding"], found.geometry
    )


@pytest.mark.parametrize("repaired", [False, True], ids=["Faithful", "Repaired"])
def test_leak2_and_3_the_score_matrix_reveals_score_update_and_cluster(repaired: bool) -> None:
    # Prepare
    rng, g0, clusters = problem(10, n=4, m=2, length=20)
    units = unit_updates(rng, g0, clusters, negative=(3,))
    found = run_round(units, clusters, g0, group=1, repaired=repaired)
    _, scores, _ = aggregators.rfca(units, clusters, g0)
    products = decodes(found, held_by_the_server(found, derived=False), units, depth=2)
    # Execute / Assert: every client, including the filtered one, in both modes; P_i's column
    # space is span(M_i^T), so even the plain product dk_g^T P_i strips the masks
    for p in range(4):
        assert f"client {p}: server.decode[{p}]^T.score{p}.p then beta^T" in products
        attack = spectral_attack(found, p)
        assert attack is not None
        cluster, update, score = attack
        assert cluster == clusters[p]
        np.testing.assert_allclose(update, units[p], atol=1e-8)
        assert score == pytest.approx(scores[p], rel=1e-6)


@pytest.mark.parametrize("repaired", [False, True], ids=["Faithful", "Repaired"])
def test_leak3c_differencing_two_rounds_isolates_the_slot_only_with_faithful_fixed_keys(
    repaired: bool,
) -> None:
    # Prepare: the same roster two rounds in a row
    rng, g0, clusters = problem(11, n=3, m=2, length=20)
    first = run_round(
        unit_updates(rng, g0, clusters),
        clusters,
        g0,
        group=1,
        repaired=repaired,
        round_=1,
        nonce="a",
    )
    units = unit_updates(rng, g0, clusters)
    second = run_round(units, clusters, g0, group=1, repaired=repaired, round_=2, nonce="b")
    d = second.geometry.width
    # Execute: the column space of alpha^(2) - alpha^(1), then decode as leak 3 does
    difference = second.alphas[0] - first.alphas[0]
    u, sv, _ = np.linalg.svd(difference)
    basis = u[:, :d]
    dk = second.server["decode"][:, second.group_columns(0)]
    rows = (second.uploads[0] @ dk.T @ basis @ basis.T) @ second.server["beta"].T
    block = readout(rows, second.server["embedding"], second.geometry)[clusters[0]]
    similarity = abs(cosine(block.reshape(-1)[:20], units[0]))
    # Assert: rank d and an exact decode with Faithful's fixed keys; not with fresh keys
    if repaired:
        assert np.sum(sv > 1e-9 * sv[0]) > d and similarity < 0.99
    else:
        assert np.sum(sv > 1e-9 * sv[0]) == d and similarity > 1 - 1e-9


@pytest.mark.parametrize("repaired", [False, True], ids=["Faithful", "Repaired"])
def test_leak4_the_segmented_score_extractor_reveals_the_slot_key_unless_repaired(
    repaired: bool,
) -> None:
    # Prepare: a leak of the compression scheme found here (docs/protocols/ebscfl.md): a_i
    # = c G0 A M'_i row by row, and the server knows G0 and A, so s >= d segments determine
    # c M'_i by least squares. Repaired mode masks a_i in the mask slots.
    rng, g0, clusters = problem(12, n=3, m=2, length=30)
    units = unit_updates(rng, g0, clusters)
    found = run_round(units, clusters, g0, group=1, repaired=repaired)
    g = found.geometry
    g0_rows = maths.cluster_rows(g0, g) @ found.server["embedding"]
    # Execute
    for p in range(3):
        key, *_ = np.linalg.lstsq(g0_rows, found.score[p]["a"], rcond=None)
        blocks = readout(found.uploads[p] @ key.T, found.server["embedding"], g)
        similarity = abs(cosine(blocks[clusters[p]], target_of(units[p], g)))
        # Assert: the update up to its sign, in its cluster's block only (Faithful)
        if repaired:
            assert similarity < 0.95
        else:
            assert similarity > 1 - 1e-9
            assert np.linalg.norm(blocks[1 - clusters[p]]) < 1e-9


# ----------------------------------------------------------- the protocol's sides


def test_server_rejects_malformed_uploads_by_kind() -> None:
    # Prepare: a server with synthetic models and root updates, over an in-process KDC
    rng = np.random.default_rng(13)
    initial = {"w": np.zeros((3, 4), dtype=np.float32), "b": np.zeros(3, dtype=np.float32)}
    root = rng.standard_normal((2, 15))
    kdc = EbscflKdc(options=options(), count=3)
    server = EbscflServer(initial, options=options(), models=np.zeros((2, 15)), root_updates=root)
    server.setup(LocalKeyChannel(kdc, Identity("server")))
    plan = server.plan_round(1, [0, 1, 2])
    nonce = plan[0].meta["nonce"]
    keys = kdc.issue_keys(1, Identity("client", 0))
    g = maths.Geometry(15, 2, 1, 3, 1)
    unit = root[0] / np.linalg.norm(root[0])
    good = maths.encode(
        unit, 0, g, keys.tensors["embedding"], keys.tensors["slot"], keys.tensors["mask_key"]
    )

    def upload(delta: np.ndarray, **meta: Any) -> Payload:
        return Payload(meta={"nonce": nonce, "attempt": 1, **meta}, tensors={"delta": delta})

    # Execute / Assert
    with pytest.raises(ProtocolError, match="belongs to attempt"):
        server.check_upload(1, 0, upload(good, attempt=2))
    for bad in (good * 1.5, good[:, :4], np.full_like(good, np.nan), good.astype(np.float32)):
        with pytest.raises(EncodingRejected):
            server.check_upload(1, 0, upload(bad))
    server.check_upload(1, 0, upload(good))
    with pytest.raises(ProtocolError, match="lacks the checked uploads"):
        server.combine(1, {0: upload(good)}, [1, 2])
    with pytest.raises(ProtocolError, match="at least 2"):
        server.plan_round(2, [0])


MANIFEST = """
apiVersion: fedcore.dev/v1alpha1
kind: FederatedRun
metadata: {name: unit-ebscfl}
spec:
  protocol:
    name: ebscfl
    ebscfl: {mode: %(mode)s, clusters: 2, layout: %(layout)s, segmentLength: %(segment)s,
             rootExamples: 60, rootEpochs: 3, globalLearningRate: 0.5}
  model: {kind: MLP, hidden: [8]}
  data: {clusters: {count: 2}}
  clients: {count: 4, quorum: %(quorum)s}
  rounds: 2
  training: {batchSize: 64, optimizer: {kind: SGD, learningRate: 0.1}}
  checkpoint: {everyRounds: 0}
  seed: 4
%(attack)s
"""


MALFORMED = "  attack: {kind: MalformedEncoding, fraction: 0.25, scale: 0.01}"


def ebscfl_run(
    *,
    mode: str = "Repaired",
    layout: str = "Layered",
    segment: int = 1,
    attack: str = "",
    quorum: str = '"100%"',
) -> Any:
    from fedcore.spec import load_manifest

    text = MANIFEST % {
        "mode": mode,
        "layout": layout,
        "segment": segment,
        "attack": attack,
        "quorum": quorum,
    }
    return load_manifest("unit-ebscfl.yaml", text=text)


@pytest.mark.parametrize(
    ("mode", "layout", "segment"),
    [("Faithful", "Flat", 1), ("Repaired", "Layered", 1), ("Repaired", "Layered", 5)],
)
def test_a_protocol_round_moves_each_model_by_the_plaintext_rfca_aggregate(
    mode: str, layout: str, segment: int
) -> None:
    # Prepare: the three sides as the roles run them, over an in-process KDC
    from fedcore.learning.data import client_dataset, dataset_info
    from fedcore.learning.models import build_model, get_weights
    from fedcore.learning.training import LocalLearner
    from fedcore.protocols.ebscfl.protocol import Ebscfl

    run = ebscfl_run(mode=mode, layout=layout, segment=segment)
    spec = run.spec
    protocol = Ebscfl()
    shape, classes = dataset_info(spec)
    initial = get_weights(build_model(spec.model, shape, classes, seed=spec.seed))
    server = protocol.create_server(spec, initial)
    kdc = protocol.create_kdc(spec)
    assert isinstance(server, EbscflServer) and isinstance(kdc, EbscflKdc)
    server.setup(LocalKeyChannel(kdc, Identity("server")))
    clients = {k: protocol.create_client(spec, k) for k in range(4)}
    before = server._theta.copy()  # float64 (the models it sends are in the model's dtype)
    g0 = server._root.copy()
    # Execute
    uploads = {}
    for k, instruction in server.plan_round(1, [0, 1, 2, 3]).items():
        data = client_dataset(spec, k)
        learner = LocalLearner(
            build_model(spec.model, shape, classes, seed=spec.seed),
            data,
            spec.training,
            seed=spec.seed,
            client_index=k,
        )
        keys = kdc.issue_keys(1, Identity("client", k))
        uploads[k] = clients[k].compute_upload(1, instruction, learner, keys)
        server.check_upload(1, k, uploads[k])
    result = server.combine(1, uploads, [])
    after = server._theta.copy()
    # Assert: the clients' own (cluster, unit update), RFCA'd in plaintext
    cached = [clients[k]._cache for k in range(4)]  # type: ignore[attr-defined]
    units = [c[2] for c in cached]
    picks = [c[1] for c in cached]
    expected, _, total = aggregators.rfca(
        units, picks, g0 / np.linalg.norm(g0, axis=1, keepdims=True)
    )
    rate = spec.protocol.ebscfl.global_learning_rate
    step = rate * np.linalg.norm(g0, axis=1)[:, None] * expected
    assert result is not None and result.metrics["weight_total"] == pytest.approx(total, rel=1e-9)
    np.testing.assert_allclose(after - before, step, rtol=0, atol=1e-9)
    assert all(set(u.tensors) == {"delta"} for u in uploads.values())
    assert all(set(u.meta) == {"nonce", "attempt"} for u in uploads.values())


def test_a_malformed_encoding_is_rejected_and_the_simulated_round_completes_without_it() -> None:
    # Prepare: one attacker of four tampers with its encoding
    from fedcore.learning.poisoning import attackers
    from fedcore.simulation import simulate

    run = ebscfl_run(attack=MALFORMED, quorum='"75%"')
    (bad,) = attackers(run.spec)
    # Execute
    result = simulate(run)
    # Assert: each round is redone without it (Redo), and ends with the other three
    assert [h["participants"] for h in result.history] == [3, 3]
    assert bad in range(4)


def test_a_simulated_round_that_cannot_reach_its_quorum_without_a_rejected_client_stops() -> None:
    # Prepare: the attacker's upload is refused every time, and the quorum is all four clients
    from fedcore.errors import RunAborted
    from fedcore.simulation import simulate

    run = ebscfl_run(attack=MALFORMED)
    # Execute / Assert: the round policy stops it as it stops the server role
    with pytest.raises(RunAborted, match="fewer than its quorum of 4 uploads") as caught:
        simulate(run)
    assert caught.value.reason == "QuorumLost" and caught.value.round == 1

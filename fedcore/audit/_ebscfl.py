"""EBS-CFL's known leaks (digest 004 §3.3; docs/protocols/ebscfl.md) as attacks from the server.

The server of a round holds what the KDC gave it (A, beta, tau1-3, the decode keys dk, per
client the factored score extractor a_i, b_i, P_i, Q_i), the root updates g_0 it sent, and
every encoded upload delta_i. From these alone:

* ``ebscfl-decode-key`` (leak 1): with the printed sum of zeta_i = 0 the weighted decode key
  dk' decodes each client on its own: delta_i dk'^T = (ReLU(w_i)/W) g_i_hat A_{c_i}. The
  repair (a traceless Z, Repaired mode) masks it.
* ``ebscfl-spectral`` (leaks 2 and 3): alpha_i = w_i P_i + Q_i; span(M_i^T) is an invariant
  subspace of alpha_i, and projecting delta_i dk^T onto it strips the masks: the unit update
  g_i_hat, its cluster c_i, and the score w_i (a ratio of the two spectra), in both modes.
* ``ebscfl-differencing`` (leak 3c): with Faithful's fixed keys, alpha_i^(t+1) - alpha_i^(t)
  = (w^(t+1) - w^(t)) P_i has column space span(M_i^T) directly; fresh keys defeat it.
* ``ebscfl-segment-solve`` (leak 4): a_i = G0 A M'_i row by row and the server knows G0 and
  A, so s >= d segments give the slot key c M'_i by least squares; Repaired masks a_i.

The maths below is the one ``tests/unit/test_ebscfl.py`` asserts the leaks with. The ground
truth (each client's unit update and cluster) comes from the client's own keys, which only
that client holds: (delta_i - ek^1_i) M'_i^T = g_i_hat A_{c_i}.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np

from fedcore.audit import _figures
from fedcore.audit._attack import Attack, AttackResult, AuditContext
from fedcore.audit._metrics import Estimate, bootstrap_mean, proportion
from fedcore.audit._views import BroadcastModel, PlainView, ProtocolView, UpdateKind
from fedcore.protocols.ebscfl import maths
from fedcore.protocols.ebscfl.protocol import OPEN, SCORE, cluster_name
from fedcore.spec import FederatedRunSpec
from fedcore.transport import Payload

UNIT_TOLERANCE = 1e-6
"""How close to a unit vector in one cluster block a decode must be to count as found."""

# ---------------------------------------------------------------------------------- maths


def readout(rows: np.ndarray, embedding: np.ndarray, geometry: maths.Geometry) -> list[np.ndarray]:
    """Each cluster's block of s x d rows (``rows @ A_j^T``), as s x t."""
    t = geometry.segment
    return [rows @ embedding[j * t : (j + 1) * t].T for j in range(geometry.clusters)]


def invariant_subspaces(alpha: np.ndarray, d: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Orthonormal bases (U1, U2) of pairs of d-dimensional invariant subspaces of alpha, from
    its right and from its left eigenvectors (Repaired mode's padding moves the right ones)."""
    for side in (alpha, alpha.T):
        yield from _subspaces(side, d)


def _subspaces(alpha: np.ndarray, d: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    values, vectors = np.linalg.eig(alpha)
    live = [i for i in range(len(values)) if abs(values[i]) > 1e-9 * np.abs(values).max()]

    def basis(part: tuple[int, ...]) -> np.ndarray:
        span = np.column_stack([vectors[:, part].real, vectors[:, part].imag])
        u, sv, _ = np.linalg.svd(span, full_matrices=False)
        return u[:, sv > 1e-9 * sv[0]]

    for chosen in itertools.combinations(live, d):
        first = basis(chosen)
        if first.shape[1] != d:
            continue
        for other in itertools.combinations([i for i in live if i not in chosen], d):
            second = basis(other)
            if second.shape[1] == d:
                yield first, second


def spectral_attack(
    alpha: np.ndarray,
    seen: np.ndarray,
    beta: np.ndarray,
    embedding: np.ndarray,
    geometry: maths.Geometry,
) -> tuple[int, np.ndarray, float] | None:
    """Leaks 2 and 3: a client's (cluster, unit update, score) from alpha_i and ``seen`` =
    delta_i dk_g^T (s x 2dn), or None when no invariant subspace decodes to a unit vector in
    one cluster block."""
    for u1, u2 in invariant_subspaces(alpha, geometry.width):
        rows = (seen @ u1 @ u1.T) @ beta.T
        blocks = readout(rows, embedding, geometry)
        lengths = [float(np.linalg.norm(b)) for b in blocks]
        j = int(np.argmax(lengths))
        if not (
            abs(lengths[j] - 1) < UNIT_TOLERANCE and sum(lengths) - lengths[j] < UNIT_TOLERANCE
        ):
            continue
        # the score: the other subspace whose spectrum is u1's divided by one ratio (Q_i's,
        # eig R'_i, against u1's, w_i eig R'_i)
        first = np.linalg.eigvals(u1.T @ alpha @ u1)
        second = np.linalg.eigvals(u2.T @ alpha @ u2)
        ratio = float(np.real(first.sum() / second.sum()))
        if all(np.abs(second * ratio - value).min() < UNIT_TOLERANCE for value in first):
            return j, blocks[j].reshape(-1)[: geometry.length], ratio
    return None


def difference_basis(earlier: np.ndarray, later: np.ndarray, d: int) -> tuple[np.ndarray, int]:
    """Leak 3c: the top d left singular vectors of alpha^(t+1) - alpha^(t), and its rank
    (d when the keys stayed fixed: the column space is then span(M_i^T))."""
    u, sv, _ = np.linalg.svd(later - earlier)
    rank = int(np.sum(sv > 1e-9 * sv[0])) if sv.size and sv[0] > 0 else 0
    return u[:, :d], rank


def segment_solve(g0_embedded: np.ndarray, extractor: np.ndarray) -> np.ndarray:
    """Leak 4: the least-squares K with G0 A K = a_i (c M'_i with Faithful's extractor)."""
    key, *_ = np.linalg.lstsq(g0_embedded, extractor, rcond=None)
    return np.asarray(key)


def true_update(
    upload: np.ndarray, keys: Payload, geometry: maths.Geometry
) -> tuple[int, np.ndarray]:
    """The ground truth, from the client's own keys: (cluster, unit update)."""
    rows = (upload - keys.tensors["mask_key"]) @ keys.tensors["slot"].T
    blocks = readout(rows, keys.tensors["embedding"], geometry)
    cluster = int(np.argmax([np.linalg.norm(b) for b in blocks]))
    return cluster, blocks[cluster].reshape(-1)[: geometry.length]


# ------------------------------------------------------------------- the server's round


@dataclass
class ServerRound:
    """What the server held in one recorded round's last attempt, and what it computes."""

    geometry: maths.Geometry
    nonce: str
    roster: tuple[int, ...]
    keys: dict[str, np.ndarray]
    g0: np.ndarray
    uploads: dict[int, np.ndarray]
    score: dict[int, dict[str, np.ndarray]]
    alphas: dict[int, np.ndarray] = field(default_factory=dict)
    s_matrix: np.ndarray | None = None
    total: float = 0.0

    def columns(self, client: int) -> slice:
        """The columns of the client's group in the decode keys."""
        g = self.geometry
        group, _ = g.place(self.roster.index(client))
        width = 3 * g.width
        return slice(width * group * g.group, width * (group * g.group + g.group_size(group)))

    def decode_key(self, client: int) -> np.ndarray:
        """dk of the client's group (2dn x 3d*xi)."""
        return self.keys["decode"][:, self.columns(client)]


def server_round(ctx: AuditContext, round_: int) -> ServerRound | None:
    """The server's side of ``round_`` from the recording (its KDC exchanges and uploads), or
    None when the round's last attempt is not fully recorded."""
    rec = ctx.recording
    uploads = {k: u for k, u in rec.uploads.get(round_, {}).items() if "delta" in u.tensors}
    if not uploads:
        return None
    nonce = next(iter(uploads.values())).meta.get("nonce")
    attempt = next(iter(uploads.values())).meta.get("attempt")
    opened = None
    scores: dict[int, dict[str, np.ndarray]] = {}
    for party, request, answer in rec.exchanges.get(round_, []):
        if party != "server":
            continue
        kind = request.meta.get("kind")
        if kind == OPEN and request.meta.get("nonce") == nonce:
            opened = (request, answer)
        elif kind == SCORE and request.meta.get("attempt") == attempt:
            scores[int(request.meta["client"])] = dict(answer.tensors)
    if opened is None:
        return None
    request, answer = opened
    roster = tuple(int(k) for k in request.meta["roster"])
    if set(roster) - set(uploads) or set(roster) - set(scores):
        return None
    options = ctx.spec.protocol.ebscfl
    g0 = np.asarray(request.tensors["g0"], np.float64)
    n = len(roster)
    geometry = maths.Geometry(
        g0.shape[1],
        options.clusters,
        options.segment_length,
        n,
        n if options.layout == "Flat" else min(options.group_size, n),
    )
    found = ServerRound(
        geometry=geometry,
        nonce=str(nonce),
        roster=roster,
        keys=dict(answer.tensors),
        g0=g0 / np.linalg.norm(g0, axis=1, keepdims=True),
        uploads={k: uploads[k].tensors["delta"] for k in roster},
        score={k: scores[k] for k in roster},
    )
    k = found.keys
    parts = []
    for client in roster:
        s = found.score[client]
        alpha = maths.score_matrix(found.uploads[client], s["a"], s["b"], s["p"], s["q"])
        found.alphas[client] = alpha
        parts.append(maths.srfc_terms(alpha, k["beta"], k["tau1"], k["tau2"], k["tau3"]))
    found.s_matrix = 0.5 * sum(a + b for a, b in parts)
    found.total = maths.weight_total(found.s_matrix, k["beta"])
    return found


# ------------------------------------------------------------------------------ the view


class EbscflView(ProtocolView):
    """ebscfl: the instruction carries the m cluster models ``cluster.<j>.<name>``; the uploads
    are encodings, read only by the ebscfl-* attacks."""

    skips = MappingProxyType(
        {
            "dlg": "the uploads are encodings under keys the server lacks, not gradients (the "
            "ebscfl-* attacks decode them)",
            "inverting-gradients": "the uploads are encodings under keys the server lacks, not "
            "model updates (the ebscfl-* attacks decode them)",
            "differencing-inversion": "each cluster model moves by unit updates weighted by "
            "secret scores (RFCA), so a client cannot remove its own part",
        }
    )

    def __init__(self, spec: FederatedRunSpec) -> None:
        super().__init__(spec)
        self._plain = PlainView(spec)

    def _cluster(self, instruction: Payload, j: int) -> Payload:
        prefix = cluster_name(j, "")
        return Payload(
            tensors={
                n[len(prefix) :]: v for n, v in instruction.tensors.items() if n.startswith(prefix)
            }
        )

    def broadcast(self, instruction: Payload) -> BroadcastModel:
        """Cluster 0's model (``models`` gives every cluster's)."""
        return self._plain.broadcast(self._cluster(instruction, 0))

    def models(self, instruction: Payload) -> list[BroadcastModel]:
        clusters = self.spec.protocol.ebscfl.clusters
        return [self._plain.broadcast(self._cluster(instruction, j)) for j in range(clusters)]

    def server_gradient(
        self, instruction: Payload, upload: Payload
    ) -> tuple[dict[str, np.ndarray], UpdateKind] | None:
        return None

    def first_layer(self, instruction: Payload) -> np.ndarray | None:
        return self._plain.first_layer(self._cluster(instruction, 0))


# ---------------------------------------------------------------------------- the attacks


@dataclass
class _Found:
    """One attacked upload: what the attack recovered beside the truth."""

    cosine: float
    prior: float
    cluster_hit: bool
    cluster: int
    score: float | None = None
    true_score: float = 0.0


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    """|cos| of two vectors (0 when either is 0)."""
    size = float(np.linalg.norm(a) * np.linalg.norm(b))
    return abs(float(np.vdot(a, b))) / size if size > 0 else 0.0


class _EbscflLeak(Attack):
    """What the four leaks share: the server's rounds, the truth, the scoring."""

    view = "server"
    protocols = frozenset({"ebscfl"})
    tag = 0

    def recover(
        self, ctx: AuditContext, found: ServerRound, client: int, round_: int
    ) -> tuple[int, np.ndarray, float | None] | None:
        """(cluster, update, score or None) the server reads off ``client``'s upload."""
        raise NotImplementedError

    def applies(self, ctx: AuditContext, found: ServerRound, client: int, round_: int) -> bool:
        """Whether the server has what the attack needs for this upload."""
        return True

    def run(self, ctx: AuditContext) -> AttackResult:
        rec = ctx.recording
        results: list[_Found] = []
        attacked: list[dict[str, object]] = []
        for round_ in ctx.kept_rounds():
            found = server_round(ctx, round_)
            if found is None:
                continue
            for client in found.roster:
                keys = rec.keys.get(round_, {}).get(f"client-{client}")
                if keys is None or keys.meta.get("nonce") != found.nonce:
                    continue
                if not self.applies(ctx, found, client, round_):
                    continue
                cluster, unit = true_update(found.uploads[client], keys, found.geometry)
                got = self.recover(ctx, found, client, round_)
                if got is None:
                    got_cluster, update, score = -1, np.zeros_like(unit), None
                else:
                    got_cluster, update, score = got
                results.append(
                    _Found(
                        cosine=_cosine(update, unit),
                        prior=_cosine(found.g0[cluster], unit),
                        cluster_hit=got_cluster == cluster,
                        cluster=cluster,
                        score=score,
                        true_score=float(found.g0[cluster] @ unit),
                    )
                )
            attacked.append({"round": round_, "clients": len(found.roster)})
        if not results:
            return self.result(skipped="no recorded round held the server's full view")
        return self._finish(ctx, results, attacked)

    def _finish(
        self, ctx: AuditContext, results: list[_Found], attacked: list[dict[str, object]]
    ) -> AttackResult:
        rng = ctx.rng(self.tag)
        n = len(results)
        cosines = np.array([r.cosine for r in results])
        prior = float(np.mean([r.prior for r in results]))
        clusters = np.bincount([r.cluster for r in results])
        estimates: list[Estimate] = [
            bootstrap_mean("absolute cosine to the unit update", cosines, rng, chance=prior),
            proportion(
                "cluster identity",
                sum(r.cluster_hit for r in results),
                n,
                float(clusters.max() / n),
            ),
            proportion("updates recovered (cosine > 0.999)", int((cosines > 0.999).sum()), n, None),
        ]
        scored = [r for r in results if r.score is not None]
        if scored:
            filtered = np.array([r.true_score <= 0 for r in scored])
            majority = max(float(filtered.mean()), 1 - float(filtered.mean()))
            hits = sum(
                (r.score is not None and r.score <= 0) == (r.true_score <= 0) for r in scored
            )
            estimates.append(
                proportion("filtered or not (sign of w_i)", hits, len(scored), majority)
            )
            errors = np.array([abs((r.score or 0.0) - r.true_score) for r in scored])
            estimates.append(bootstrap_mean("score error |w^ - w|", errors, rng))
        figure = f"{self.name}.png"
        _figures.bars(ctx.figures / figure, estimates[:2], f"{self.title}: ebscfl")
        mode = ctx.spec.protocol.ebscfl.mode
        return self.result(
            verdict=estimates[0],
            estimates=estimates,
            details={
                "mode": mode,
                "rounds": attacked,
                "uploads": n,
                "filtered": sum(r.true_score <= 0 for r in results),
            },
            figures=[str(Path(ctx.figures.name) / figure)],
        )


def _single_block(rows: np.ndarray, found: ServerRound) -> tuple[int, np.ndarray]:
    """The cluster block with the most mass, and its content as a length-l vector."""
    blocks = readout(rows, found.keys["embedding"], found.geometry)
    j = int(np.argmax([np.linalg.norm(b) for b in blocks]))
    return j, blocks[j].reshape(-1)[: found.geometry.length]


class DecodeKeyLeak(_EbscflLeak):
    """Leak 1: each client alone through the weighted decode key dk'."""

    name = "ebscfl-decode-key"
    title = "EBS-CFL weighted decode key (leak 1)"
    tag = 51
    assumes = (
        "The server computes, as the protocol has it do, the SRFC sum S, the weight total W "
        "and each group's weighted decode key dk' = S dk_g / W, and applies dk' to one "
        "client's upload alone instead of to the group's sum. With the printed sum of zeta_i "
        "= 0 (Faithful) that gives (ReLU(w_i)/W) g_i_hat in the client's cluster block "
        "(digest 004 §3.3 (1)); Repaired's traceless Z masks it. Its blind guess is its root "
        "update g_0 of the client's true cluster (given for free)."
    )

    def recover(
        self, ctx: AuditContext, found: ServerRound, client: int, round_: int
    ) -> tuple[int, np.ndarray, float | None] | None:
        if not found.total > 0 or found.s_matrix is None:
            return None
        key = maths.weighted_decode_key(found.s_matrix, found.decode_key(client), found.total)
        cluster, update = _single_block(found.uploads[client] @ key.T, found)
        return cluster, update, None


class SpectralLeak(_EbscflLeak):
    """Leaks 2 and 3: the score matrix's spectrum and invariant subspace."""

    name = "ebscfl-spectral"
    title = "EBS-CFL score-matrix spectrum and subspace (leaks 2, 3)"
    tag = 52
    assumes = (
        "The server computes each client's score matrix alpha_i = w_i P_i + Q_i, as the "
        "protocol has it do, and looks for a d-dimensional invariant subspace U of it (from "
        "its eigenvectors) such that delta_i dk^T U U^T beta^T is a unit vector in a single "
        "cluster block: that block is g_i_hat, and the ratio of the two spectra is w_i, "
        "whose sign says whether the client was filtered (digest 004 §3.3 (2), (3)). Blind "
        "guess: the root update g_0 of the client's true cluster."
    )

    def recover(
        self, ctx: AuditContext, found: ServerRound, client: int, round_: int
    ) -> tuple[int, np.ndarray, float | None] | None:
        seen = found.uploads[client] @ found.decode_key(client).T
        return spectral_attack(
            found.alphas[client], seen, found.keys["beta"], found.keys["embedding"], found.geometry
        )


class DifferencingLeak(_EbscflLeak):
    """Leak 3c: two rounds' score matrices of one client."""

    name = "ebscfl-differencing"
    title = "EBS-CFL score matrices across rounds (leak 3c)"
    tag = 53
    assumes = (
        "The server keeps a client's score matrix from the previous recorded round (the same "
        "roster position) and takes the top d left singular vectors U of alpha_i^(t+1) - "
        "alpha_i^(t); with keys fixed across rounds (Faithful) that is span(M_i^T), and "
        "delta_i dk^T U U^T beta^T is g_i_hat in its cluster's block (digest 004 §3.3 (3)). "
        "Fresh keys every attempt (Repaired) defeat it. Blind guess: the root update g_0 of "
        "the client's true cluster."
    )

    def __init__(self) -> None:
        self._previous: dict[int, ServerRound | None] = {}

    def run(self, ctx: AuditContext) -> AttackResult:
        try:
            return super().run(ctx)
        finally:
            self._previous = {}

    def _earlier(self, ctx: AuditContext, round_: int) -> ServerRound | None:
        if round_ - 1 not in self._previous:
            self._previous[round_ - 1] = (
                server_round(ctx, round_ - 1) if round_ - 1 in ctx.recording.uploads else None
            )
        return self._previous[round_ - 1]

    def applies(self, ctx: AuditContext, found: ServerRound, client: int, round_: int) -> bool:
        """The previous round is recorded with the client at the same roster position."""
        earlier = self._earlier(ctx, round_)
        return (
            earlier is not None
            and client in earlier.roster
            and earlier.roster.index(client) == found.roster.index(client)
        )

    def recover(
        self, ctx: AuditContext, found: ServerRound, client: int, round_: int
    ) -> tuple[int, np.ndarray, float | None] | None:
        earlier = self._earlier(ctx, round_)
        if earlier is None:
            return None
        basis, _ = difference_basis(
            earlier.alphas[client], found.alphas[client], found.geometry.width
        )
        seen = found.uploads[client] @ found.decode_key(client).T
        cluster, update = _single_block((seen @ basis @ basis.T) @ found.keys["beta"].T, found)
        return cluster, update, None


class SegmentSolveLeak(_EbscflLeak):
    """Leak 4: the segmented score extractor determines the slot key."""

    name = "ebscfl-segment-solve"
    title = "EBS-CFL slot key from the score extractor (leak 4)"
    tag = 54
    assumes = (
        "The server solves G0 A K = a_i by least squares for each client's score extractor "
        "a_i (it knows its own root updates G0 and the embedding A): with Faithful's "
        "extractor a_i = G0 A M'_i row by row, K is c M'_i and delta_i K^T is g_i_hat up to "
        "scale and sign in its cluster's block (docs/protocols/ebscfl.md, leak 4). Repaired "
        "adds a part in the mask slots that masks it. Blind guess: the root update g_0 of the "
        "client's true cluster."
    )

    def recover(
        self, ctx: AuditContext, found: ServerRound, client: int, round_: int
    ) -> tuple[int, np.ndarray, float | None] | None:
        g0_embedded = maths.cluster_rows(found.g0, found.geometry) @ found.keys["embedding"]
        key = segment_solve(g0_embedded, found.score[client]["a"])
        cluster, update = _single_block(found.uploads[client] @ key.T, found)
        return cluster, update, None

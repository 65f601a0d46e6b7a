"""EBS-CFL's maths (digest 004): MOM keys, VOMCA encoding and checks, SRFC, the weighted decode.

Everything here is float64 numpy and knows nothing of roles, rounds or wires. Notation follows
the digest; code names differ where the paper overloads a symbol (G19):

* ``length`` l, ``clusters`` m, ``segment`` t, ``segments`` s = ceil(l/t), ``width`` d = t*m;
* ``A``: a d x d orthogonal matrix whose row blocks ``A_c = A[c*t:(c+1)*t]`` embed a segment of
  cluster c (MOM, rows orthonormal: A_j A_k^T = delta_jk I, G2);
* ``encode space`` of a group of xi clients: a 3*d*xi orthogonal matrix whose row blocks
  M'_q (d x 3d*xi) are the slot (q = p), the R'' mask (q = p + xi) and the mu mask
  (q = p + 2*xi) of the client at position p. The flat scheme is one group of all n clients;
  the layered mode (digest 2.9, G14) gives every group its own space;
* ``SRFC`` keys over all n clients of the attempt: M_i (d x 2dn, i < 2n) from one 2dn
  orthogonal matrix, R'_i, zeta_i, R_i = R0_i + R1_i (zero-sum), R2_i, and beta, tau1-3 (Eq. 6).

With the corrections of the digest: the row MOM convention (G2); r^(1) drawn from U(X, 2X) with
X = sqrt(m) >= |w_i| (G3, the printed bound breaks Eq. 25); the trace divisor d, not l (G4);
the norm constant sent per client by the KDC (G5); +R1*R1 in Eq. 25 and |x_i| in Eq. 24 (G6);
the unit-norm g_0 in the score extractor, so w_i is the cosine (G8); the segmented score
extractor with R'_j (G15). The repair of G7 (sum of zeta_i = Z, Z != 0 traceless) is
``zeta_sum_scale > 0``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

NORM_TOLERANCE = 1e-8
"""Relative tolerance of the norm and mask checks (G1: |lhs - rhs| <= tol * max(1, |rhs|))."""


# ------------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class Geometry:
    """The shapes of one attempt's key material.

    Attributes:
        length: l, the number of model parameters (the update's length).
        clusters: m, the number of cluster models.
        segment: t, the segment length.
        clients: n, the attempt's participants.
        group: xi, the clients per encode space (n: the flat scheme; 1: one space per client).
    """

    length: int
    clusters: int
    segment: int
    clients: int
    group: int

    def __post_init__(self) -> None:
        if min(self.length, self.clusters, self.segment, self.clients, self.group) < 1:
            raise ValueError(f"Every dimension of {self} must be at least 1.")
        if self.group > self.clients:
            raise ValueError(f"The group size {self.group} exceeds the {self.clients} clients.")

    @property
    def segments(self) -> int:
        """s = ceil(l / t): the rows of an upload."""
        return -(-self.length // self.segment)

    @property
    def width(self) -> int:
        """d = t * m: the width of a cluster embedding and of an SRFC block."""
        return self.segment * self.clusters

    @property
    def groups(self) -> int:
        """The number of encode spaces."""
        return -(-self.clients // self.group)

    def group_size(self, group: int) -> int:
        """The clients in encode space ``group`` (the last one may be smaller)."""
        return min(self.group, self.clients - group * self.group)

    def place(self, position: int) -> tuple[int, int]:
        """(group, position in the group) of the attempt's ``position``-th client."""
        return divmod(position, self.group)

    def upload_width(self, position: int) -> int:
        """3*d*xi_g: the columns of the upload of the attempt's ``position``-th client."""
        return 3 * self.width * self.group_size(self.place(position)[0])

    @property
    def srfc_width(self) -> int:
        """2dn: the side of the SRFC matrices."""
        return 2 * self.width * self.clients


# ---------------------------------------------------------------------------- primitives


def orthogonal(rng: np.random.Generator, size: int) -> np.ndarray:
    """A Haar-random size x size orthogonal matrix (QR of a Gaussian matrix, signs fixed)."""
    q, r = np.linalg.qr(rng.standard_normal((size, size)))
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)


def signed_square(x: np.ndarray) -> np.ndarray:
    """F(x) = sign(x) x^2, elementwise."""
    return np.sign(x) * (x * x)


def signed_root(x: np.ndarray) -> np.ndarray:
    """F^{-1}(x) = sign(x) sqrt|x|, elementwise."""
    return np.sign(x) * np.sqrt(np.abs(x))


def segmented(vector: np.ndarray, geometry: Geometry) -> np.ndarray:
    """A length-l vector as s x t rows, zero-padded."""
    out = np.zeros(geometry.segments * geometry.segment)
    out[: vector.size] = vector
    return out.reshape(geometry.segments, geometry.segment)


def cluster_rows(per_cluster: np.ndarray, geometry: Geometry) -> np.ndarray:
    """m vectors of length l as s x d rows [v_0 segment k, ..., v_{m-1} segment k]."""
    blocks = [segmented(np.asarray(v, dtype=np.float64), geometry) for v in per_cluster]
    return np.concatenate(blocks, axis=1)


# ------------------------------------------------------------------------------ SRFC keys


@dataclass
class SrfcKeys:
    """The KDC's SRFC material for n clients (Eq. 6) and what the server gets of it.

    Attributes:
        blocks: M_i, i < 2n, each d x 2dn (rows of one orthogonal matrix).
        scales: R'_i, each d x d, invertible and well conditioned (G17).
        zeta: zeta_i, each d x d; their sum is 0 (faithful) or a traceless Z (G7 repair).
        beta: sum of all M_i (server).
        tau1, tau2, tau3: the SRFC keys (server).
    """

    blocks: np.ndarray
    scales: np.ndarray
    zeta: np.ndarray
    beta: np.ndarray
    tau1: np.ndarray
    tau2: np.ndarray
    tau3: np.ndarray

    def score_matrices(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """(P_i, Q_i) = (M_i^T R'_i M_i, M_{i+n}^T R'_i M_{i+n}): alpha_i = w_i P_i + Q_i."""
        n = self.scales.shape[0]
        m_i, m_n, scale = self.blocks[position], self.blocks[position + n], self.scales[position]
        return m_i.T @ scale @ m_i, m_n.T @ scale @ m_n

    def mask_sum(self) -> np.ndarray:
        """sum_i M_{i+n}: maps zeta's half of S onto every mask slot in dk."""
        n = self.scales.shape[0]
        return self.blocks[n:].sum(axis=0)


def srfc_keys(
    rng: np.random.Generator,
    *,
    clients: int,
    width: int,
    bound: float,
    zeta_sum_scale: float = 0.0,
    printed_r1_bound: bool = False,
) -> SrfcKeys:
    """Draws the SRFC keys of Eq. 6 for ``clients`` scores of magnitude at most ``bound``.

    Args:
        rng: the KDC's generator for this key set.
        clients: n.
        width: d, the rows of each M_i.
        bound: X, an upper bound on |w_i| (G3: r^(1) ~ U(X, 2X), r^(2) ~ U(0, 2X^2)).
        zeta_sum_scale: 0 for the printed sum of zeta_i = 0; otherwise the Frobenius norm of
            the traceless Z that the zeta_i sum to (G7, the repair of the single-client decode).
        printed_r1_bound: draw r^(1) from U(0, X) as printed (only to show that it is wrong).
    """
    n, d = clients, width
    side = 2 * d * n
    blocks = orthogonal(rng, side).reshape(2 * n, d, side)
    scales = np.stack([_well_conditioned(rng, d) for _ in range(n)])
    zeta = rng.standard_normal((n, d, d))
    zeta -= zeta.mean(axis=0)
    if zeta_sum_scale > 0:
        z = rng.standard_normal((d, d))
        z -= (np.trace(z) / d) * np.eye(d)
        if d == 1 or not np.any(z):
            raise ValueError("A traceless nonzero Z needs a width d of at least 2.")
        zeta += (zeta_sum_scale / np.linalg.norm(z)) * z / n
    masks = rng.standard_normal((n, d, side))
    masks -= masks.mean(axis=0)  # R_i: sum over i is 0
    own = blocks[:n]
    low, high = (0.0, bound) if printed_r1_bound else (bound, 2 * bound)
    r1 = np.where(own <= 0, rng.uniform(low, high, own.shape), 0.0)
    r2 = np.where(own > 0, rng.uniform(0.0, 2 * bound * bound, own.shape), 0.0)
    r0 = masks - r1
    tau1 = np.zeros((side, side))
    tau2 = np.zeros((side, side))
    tau3 = np.zeros((side, side))
    for i in range(n):
        m_i, m_n = blocks[i], blocks[i + n]
        inverse = np.linalg.inv(scales[i])
        inverse2 = inverse @ inverse
        tau1 += m_i.T @ (inverse @ m_i) + m_n.T @ (inverse @ (r0[i] + zeta[i] @ m_n))
        tau2 += m_i.T @ (inverse2 @ (m_i * m_i)) + m_n.T @ (inverse2 @ (r1[i] * r1[i] + r2[i]))
        tau3 += m_i.T @ (inverse2 @ signed_square(2 * m_i * r1[i])) - m_n.T @ (
            inverse2 @ signed_square(r2[i])
        )
    return SrfcKeys(
        blocks=blocks,
        scales=scales,
        zeta=zeta,
        beta=blocks.sum(axis=0),
        tau1=tau1,
        tau2=tau2,
        tau3=tau3,
    )


def _well_conditioned(rng: np.random.Generator, size: int) -> np.ndarray:
    """R'_i = U diag(U(0.5, 2)) V (G17): tau uses R'^-2, so keep it well conditioned."""
    return orthogonal(rng, size) @ np.diag(rng.uniform(0.5, 2.0, size)) @ orthogonal(rng, size)


# --------------------------------------------------------------------------- encode keys


def encode_space(rng: np.random.Generator, width: int, members: int) -> np.ndarray:
    """The 3*d*xi x 3*d*xi orthogonal matrix of one group; row block q is M'_q (d rows)."""
    return orthogonal(rng, 3 * width * members)


def slot(space: np.ndarray, width: int, block: int) -> np.ndarray:
    """M'_block: rows [block*d, (block+1)*d) of a group's encode space."""
    return space[block * width : (block + 1) * width]


def mask_scales(geometry: Geometry) -> tuple[float, float]:
    """The scales of X_p - X_{p+1} (entries N(0, 1)) that give E||R''_ij||^2 = 1 per cluster
    and E||mu_i||^2 = 1 (the norms of digest 2.2, in expectation)."""
    s, t, d = geometry.segments, geometry.segment, geometry.width
    return 1.0 / math.sqrt(2.0 * s * t), 1.0 / math.sqrt(2.0 * s * d)


def mask_key(
    masks_r: np.ndarray,
    masks_mu: np.ndarray,
    cluster_embedding: np.ndarray,
    space: np.ndarray,
    width: int,
    members: int,
    member: int,
) -> np.ndarray:
    """ek^1 = (sum_j R''_ij A_j) M'_{p+xi} + mu_i M'_{p+2xi}: s x 3d*xi (Eq. 11, segmented).

    ``masks_r`` holds R''_i as s x d rows [R''_i0k, ..., R''_i(m-1)k] (so their A-embedding is
    ``masks_r @ A``); ``masks_mu`` holds mu_i as s x d rows.
    """
    r_slot = slot(space, width, member + members)
    mu_slot = slot(space, width, member + 2 * members)
    return (masks_r @ cluster_embedding) @ r_slot + masks_mu @ mu_slot


def verification_key(
    directions: Sequence[np.ndarray],
    cluster_embedding: np.ndarray,
    space: np.ndarray,
    width: int,
    members: int,
) -> np.ndarray:
    """vk_0 of one group: sum_p V_p (sum_j A_j) M'_{p+xi} (length 3d*xi; Eq. 13, one V per
    client shared by all segments, so the check covers the sum of the segments)."""
    segment = directions[0].size
    stacked = cluster_embedding.reshape(-1, segment, cluster_embedding.shape[1]).sum(axis=0)
    total = np.zeros(space.shape[0])
    for member, v in enumerate(directions):
        total += (v @ stacked) @ slot(space, width, member + members)
    return total


def verification_value(direction: np.ndarray, masks_r: np.ndarray, segment: int) -> float:
    """vk_i = V_i sum_k sum_j R''_ijk^T: what vk_0 . sum_k delta_ik must equal."""
    return float(direction @ masks_r.reshape(masks_r.shape[0], -1, segment).sum(axis=(0, 1)))


def decode_key(
    srfc: SrfcKeys, space: np.ndarray, positions: Sequence[int], width: int
) -> np.ndarray:
    """dk of one group (Eq. 13, per group): sum_{p in g} M_p^T M'_p + (sum_i M_{i+n})^T
    sum_{p in g} (M'_{p+xi} + M'_{p+2xi}); 2dn x 3d*xi."""
    members = len(positions)
    masks = srfc.mask_sum()
    total = np.zeros((srfc.blocks.shape[2], space.shape[0]))
    mask_slots = np.zeros((width, space.shape[0]))
    for member, position in enumerate(positions):
        total += srfc.blocks[position].T @ slot(space, width, member)
        mask_slots += slot(space, width, member + members) + slot(
            space, width, member + 2 * members
        )
    return total + masks.T @ mask_slots


def score_extractor(
    g0_rows: np.ndarray,
    cluster_embedding: np.ndarray,
    mu_first: np.ndarray,
    space: np.ndarray,
    width: int,
    members: int,
    member: int,
) -> tuple[np.ndarray, np.ndarray]:
    """alpha'_i in factored form: (a_i, b_i) with <delta_i, a_i> = w_i and delta_i0 . b_i = 1.

    a_i = G0 A M'_p (s x 3d*xi; row k: the unit g_0 segment k of every cluster, embedded and
    rotated into the client's slot); b_i = mu_i0 M'_{p+2xi} / ||mu_i0||^2 (segment 0 only).
    Then alpha_i = <delta_i, a_i> P_i + (delta_i0 . b_i) Q_i (Eq. 12 and 14, G15).
    """
    a = (g0_rows @ cluster_embedding) @ slot(space, width, member)
    b = mu_first @ slot(space, width, member + 2 * members) / float(mu_first @ mu_first)
    return a, b


def score_mask_parts(
    g0_embedded: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(U, V) = (G0 A C2 + E2, G0 A C3 + E3): the raw mask-slot parts of a Repaired extractor,
    with secret Gaussian C2, C3 (d x d) and noise E2, E3 (uniform, unit variance, scaled to the
    size of G0 A's entries)."""
    s, d = g0_embedded.shape
    scale = float(np.linalg.norm(g0_embedded)) / math.sqrt(s * d)
    parts = []
    for _ in range(2):
        mixing = rng.standard_normal((d, d))
        noise = rng.random(s * d, dtype=np.float32).reshape(s, d).astype(np.float64)
        noise -= 0.5
        noise *= 2 * math.sqrt(3.0) * scale
        noise += g0_embedded @ mixing
        parts.append(noise)
    return parts[0], parts[1]


def score_mask_mix(
    r_embedded: np.ndarray, mu: np.ndarray, u: np.ndarray, v: np.ndarray
) -> tuple[float, float]:
    """Weights (x, y) with x <R''_i A, U> + y <mu_i, V> = 0 and E[x^2] = E[y^2] = 1."""
    tu, tv = float(np.vdot(r_embedded, u)), float(np.vdot(mu, v))
    size = math.hypot(tu, tv)
    if size == 0:
        return 1.0, 1.0
    return math.sqrt(2) * tv / size, -math.sqrt(2) * tu / size


def masked_score_extractor(
    extractor: np.ndarray,
    parts: tuple[np.ndarray, np.ndarray],
    mix: tuple[float, float],
    r_slot: np.ndarray,
    mu_slot: np.ndarray,
) -> np.ndarray:
    """a_i plus x U M'_{p+xi} + y V M'_{p+2xi}: a part in the client's two mask slots whose
    inner product with its masks is 0 (``score_mask_mix``), so <delta_i, a_i> = w_i still.

    The repair of the segment-solve leak (docs/protocols/ebscfl.md, leak 4): a_i = G0 A M'_p
    row by row lets a server that knows G0 and A solve for the slot key M'_p by least squares;
    with this part the solve returns M'_p + x C2 M'_{p+xi} + y C3 M'_{p+2xi} (plus noise),
    whose decode is masked by R''_i and mu_i. It needs the attempt's R'', so only per-attempt
    keys (Repaired mode) can have it.
    """
    u, v = parts
    x, y = mix
    return extractor + (x * u) @ r_slot + (y * v) @ mu_slot


# ------------------------------------------------------------------------------ clients


def encode(
    unit: np.ndarray,
    cluster: int,
    geometry: Geometry,
    cluster_embedding: np.ndarray,
    own_slot: np.ndarray,
    mask_key_: np.ndarray,
) -> np.ndarray:
    """delta_i = (g_i/||g_i||) A_c M'_i + ek^1_i, segmented: s x 3d*xi (digest 2.8 (2))."""
    t = geometry.segment
    rows = segmented(unit, geometry) @ cluster_embedding[cluster * t : (cluster + 1) * t]
    return rows @ own_slot + mask_key_


# ------------------------------------------------------------------------------- server


def norm_ok(upload: np.ndarray, expected: float) -> bool:
    """The norm check: ||delta_i||^2 equals the KDC's constant (G5)."""
    value = float(np.vdot(upload, upload))
    return abs(value - expected) <= NORM_TOLERANCE * max(1.0, abs(expected))


def mask_ok(upload: np.ndarray, key: np.ndarray, expected: float) -> bool:
    """The VOMCA check (Eq. 4): vk_0 . sum_k delta_ik equals vk_i."""
    value = float(key @ upload.sum(axis=0))
    scale = max(1.0, abs(expected), float(np.linalg.norm(key)) * math.sqrt(upload.shape[0]))
    return abs(value - expected) <= NORM_TOLERANCE * scale


def score_matrix(
    upload: np.ndarray, a: np.ndarray, b: np.ndarray, p: np.ndarray, q: np.ndarray
) -> np.ndarray:
    """alpha_i = <delta_i, a_i> P_i + (delta_i0 . b_i) Q_i (Eq. 14; 2dn x 2dn)."""
    return float(np.vdot(upload, a)) * p + float(upload[0] @ b) * q


def srfc_terms(
    alpha: np.ndarray, beta: np.ndarray, tau1: np.ndarray, tau2: np.ndarray, tau3: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One client's two parts of Eq. 9: (beta alpha tau1, F^-1(beta alpha^2 tau2 +
    F^-1(beta alpha^2 tau3))), each d x 2dn; S is half their sum over the clients."""
    first = beta @ alpha
    square = first @ alpha  # beta alpha^2 (alpha^2 is the matrix product, digest 2.2)
    rectified = signed_root(square @ tau2 + signed_root(square @ tau3))
    return first @ tau1, rectified


def weight_total(s: np.ndarray, beta: np.ndarray) -> float:
    """W = tr(S beta^T) / d (Eq. 10 with the divisor of G4)."""
    return float(np.trace(s @ beta.T)) / s.shape[0]


def weighted_decode_key(s: np.ndarray, group_key: np.ndarray, total: float) -> np.ndarray:
    """dk' of one group = S dk_g / W (Eq. 15); d x 3d*xi."""
    return (s @ group_key) / total


def cluster_aggregates(
    decoded: np.ndarray, cluster_embedding: np.ndarray, geometry: Geometry
) -> np.ndarray:
    """g A_j^T for every cluster j (Eq. 17's factor): m x l."""
    t = geometry.segment
    out = np.empty((geometry.clusters, geometry.length))
    for j in range(geometry.clusters):
        rows = decoded @ cluster_embedding[j * t : (j + 1) * t].T
        out[j] = rows.reshape(-1)[: geometry.length]
    return out

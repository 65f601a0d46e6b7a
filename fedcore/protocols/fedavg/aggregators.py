"""Robust aggregation rules over flat update vectors: the baselines of EBS-CFL (digest 004).

Pure numpy, no torch and no protocol state: each rule takes the round's updates (one vector per
client, the same length, widened to float64) and returns one aggregated update. The updates
come as a sequence of vectors or as ``Rows``, which serve them a block of coordinates at a time
(``fedcore.protocols._spill.UploadStore`` keeps a round's uploads in memory or on disk and
serves them so): every rule works block by block, holding K x block values at a time, and
reads the updates only through ``Rows``, so a rule gives the same result, bit for bit, over
vectors in memory or a store whose uploads were spilled. The blocks depend on K alone
(``block_width``). Coordinate-wise rules (mean, median, trimmed mean) compute each coordinate as
``np.mean``/``np.median`` over axis 0 of the stacked updates would (over two or more
coordinates); the sums over coordinates (Krum's distances, FLTrust's dot products and norms)
are numpy sums within a block, added block after block. ``fedavg`` uses them
through ``spec.protocol.fedavg.aggregator`` (``fedcore/protocols/fedavg/robust.py``); ``ebscfl``'s
tests use ``rfca`` as the plaintext oracle of the encoded pipeline.

* ``mean``: the (weighted) mean, FedAvg's rule.
* ``median``: the coordinate-wise median (Yin et al., ICML 2018).
* ``trimmed_mean``: the coordinate-wise mean after dropping the k largest and k smallest
  values, k = floor(trim * n) (Yin et al., ICML 2018).
* ``krum``: the update whose n - f - 2 nearest neighbours are closest in squared L2
  distance (Blanchard et al., NeurIPS 2017).
* ``fltrust``: trust scores ReLU(cos(g_i, g_0)) against the server's own update g_0, each
  update rescaled to ||g_0|| (Cao et al., NDSS 2021).
* ``rfca``: FLTrust per cluster with EBS-CFL's global normaliser over unit updates (digest 004,
  2.7-2.8): for cluster j, sum over clients of cluster j of ReLU(w_i)/W g_i_hat.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from fedcore.errors import ProtocolError

AGGREGATORS = ("Mean", "Median", "TrimmedMean", "Krum", "FLTrust")
"""The names ``spec.protocol.fedavg.aggregator`` accepts."""


def _stack(updates: Sequence[np.ndarray]) -> np.ndarray:
    """The updates as an n x l float64 matrix.

    Raises:
        ProtocolError: no updates, or updates of different lengths.
    """
    if not updates:
        raise ProtocolError("There is nothing to aggregate: no updates were given.")
    sizes = {np.size(u) for u in updates}
    if len(sizes) != 1:
        raise ProtocolError(f"The updates have different lengths {sorted(sizes)}.")
    return np.stack([np.asarray(u, dtype=np.float64).reshape(-1) for u in updates])


@runtime_checkable
class Rows(Protocol):
    """K update vectors of one length, read a block of coordinates at a time.

    ``VectorRows`` serves vectors held in memory; ``fedcore.protocols._spill.StoreRows`` a
    round's uploads kept in memory or on disk. Every rule below reads only through ``rows``,
    so its result depends on the values alone, not on where they are kept."""

    @property
    def count(self) -> int:
        """K, the number of updates."""
        ...

    @property
    def length(self) -> int:
        """The number of coordinates of each update."""
        ...

    def rows(self, start: int, stop: int, select: Sequence[int] | None = None) -> np.ndarray:
        """Coordinates [start, stop) of the updates ``select`` (indices in 0..K-1; None: all,
        in order), one row each, as a new float64 array the caller may overwrite."""
        ...


class VectorRows:
    """Updates held in memory as vectors (each widened to float64 as it is read).

    Raises:
        ProtocolError: no updates, or updates of different lengths.
    """

    def __init__(self, updates: Sequence[np.ndarray]) -> None:
        if not updates:
            raise ProtocolError("There is nothing to aggregate: no updates were given.")
        sizes = {np.size(u) for u in updates}
        if len(sizes) != 1:
            raise ProtocolError(f"The updates have different lengths {sorted(sizes)}.")
        self._flats = [np.asarray(u).reshape(-1) for u in updates]
        self.count = len(updates)
        self.length = sizes.pop()

    def rows(self, start: int, stop: int, select: Sequence[int] | None = None) -> np.ndarray:
        chosen = range(self.count) if select is None else select
        out = np.empty((len(chosen), stop - start), dtype=np.float64)
        for row, index in zip(out, chosen, strict=True):
            np.copyto(row, self._flats[index][start:stop], casting="unsafe")
        return out


ROWS_ELEMENTS = 1 << 19
"""Elements of one K x block float64 array of the blockwise rules (4 MiB): the block is
``ROWS_ELEMENTS // K`` coordinates wide, within [``MIN_BLOCK``, ``MAX_BLOCK``]."""
MIN_BLOCK = 1 << 11
MAX_BLOCK = 1 << 15


def block_width(count: int) -> int:
    """Coordinates per block for K = ``count`` updates (a function of K alone: the blocks, and
    so the order of the sums over coordinates, are the same wherever the updates are kept)."""
    return max(MIN_BLOCK, min(MAX_BLOCK, ROWS_ELEMENTS // max(1, count)))


def blocks(rows: Rows) -> Iterator[tuple[int, int]]:
    """The blocks [start, stop) that cover ``rows``' coordinates, in order."""
    width = block_width(rows.count)
    for start in range(0, rows.length, width):
        yield start, min(start + width, rows.length)


def _sum_rows(block: np.ndarray, out: np.ndarray) -> None:
    """out = ((block[0] + block[1]) + block[2]) + ...: per coordinate, in row order, so that a
    coordinate's sum does not depend on the block it falls in (numpy's own reductions may sum
    a single column pairwise)."""
    np.copyto(out, block[0])
    for row in block[1:]:
        np.add(out, row, out=out)


def _as_rows(updates: Sequence[np.ndarray] | Rows) -> Rows:
    if isinstance(updates, Rows):
        return updates
    return VectorRows(updates)


def mean(
    updates: Sequence[np.ndarray] | Rows, weights: Sequence[float] | None = None
) -> np.ndarray:
    """sum_i w_i g_i / sum_i w_i (uniform when ``weights`` is None).

    Uniform: per coordinate the updates are added in order, then divided by n (what
    ``np.mean(axis=0)`` does over two or more coordinates). Weighted: each update is scaled by
    w_i / sum w and the products are added in order.

    Raises:
        ProtocolError: the weights do not sum to a positive number.
    """
    rows = _as_rows(updates)
    coefficients = None
    if weights is not None:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (rows.count,) or not w.sum() > 0:
            raise ProtocolError(
                f"The mean needs one positive-sum weight per update, got {weights}."
            )
        coefficients = (w / w.sum())[:, None]
    out = np.empty(rows.length)
    for start, stop in blocks(rows):
        block = rows.rows(start, stop)
        target = out[start:stop]
        if coefficients is None:
            _sum_rows(block, target)
            np.divide(target, rows.count, out=target)
        else:
            np.multiply(block, coefficients, out=block)
            _sum_rows(block, target)
    return out


def median(updates: Sequence[np.ndarray] | Rows) -> np.ndarray:
    """The coordinate-wise median (the mean of the two middle values for even n):
    ``np.median(axis=0)`` block by block."""
    rows = _as_rows(updates)
    out = np.empty(rows.length)
    for start, stop in blocks(rows):
        out[start:stop] = np.median(rows.rows(start, stop), axis=0, overwrite_input=True)
    return out


def trimmed_mean(updates: Sequence[np.ndarray] | Rows, trim: float) -> np.ndarray:
    """The coordinate-wise mean without the k = floor(trim * n) largest and smallest values
    (the n - 2k middle values added in ascending order, then divided by n - 2k).

    Raises:
        ProtocolError: ``trim`` is outside [0, 0.5) or leaves nothing to average.
    """
    rows = _as_rows(updates)
    n = rows.count
    k = int(np.floor(trim * n))
    if not 0 <= trim < 0.5 or n - 2 * k < 1:
        raise ProtocolError(f"Trimming {k} of each end of {n} updates leaves none (trim {trim}).")
    out = np.empty(rows.length)
    for start, stop in blocks(rows):
        ordered = rows.rows(start, stop)
        ordered.sort(axis=0)
        target = out[start:stop]
        _sum_rows(ordered[k : n - k], target)
        np.divide(target, n - 2 * k, out=target)
    return out


def squared_distances(updates: Sequence[np.ndarray] | Rows) -> np.ndarray:
    """The n x n squared L2 distances between the updates: per block, each pair's squared
    differences summed (numpy's sum over the block's coordinates), the blocks' sums added in
    order; the diagonal is 0."""
    rows = _as_rows(updates)
    n = rows.count
    distances = np.zeros((n, n))
    for start, stop in blocks(rows):
        block = rows.rows(start, stop)
        for a in range(n - 1):
            differences = block[a + 1 :] - block[a]
            np.multiply(differences, differences, out=differences)
            sums = differences.sum(axis=1)
            distances[a, a + 1 :] += sums
            distances[a + 1 :, a] += sums
    return distances


def krum_scores(updates: Sequence[np.ndarray] | Rows, byzantine: int) -> np.ndarray:
    """Each update's Krum score: the sum of squared distances to its n - f - 2 nearest others.

    Raises:
        ProtocolError: n - f - 2 < 1 (Krum needs n >= f + 3).
    """
    rows = _as_rows(updates)
    n = rows.count
    neighbours = n - byzantine - 2
    if byzantine < 0 or neighbours < 1:
        raise ProtocolError(
            f"Krum with f = {byzantine} Byzantine clients needs at least f + 3 = "
            f"{byzantine + 3} updates, got {n}."
        )
    distances = squared_distances(rows)
    np.fill_diagonal(distances, np.inf)
    return np.sort(distances, axis=1)[:, :neighbours].sum(axis=1)


def krum(updates: Sequence[np.ndarray] | Rows, byzantine: int) -> tuple[int, np.ndarray]:
    """(index, update) of the update with the lowest Krum score (ties: the lowest index)."""
    rows = _as_rows(updates)
    scores = krum_scores(rows, byzantine)
    chosen = int(np.argmin(scores))
    out = np.empty(rows.length)
    for start, stop in blocks(rows):
        out[start:stop] = rows.rows(start, stop, [chosen])[0]
    return chosen, out


def _trust(rows: Rows, g0: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(TS_i = ReLU(cos(g_i, g_0)), ||g_i||, ||g_0||): the dot products and squared norms
    summed per block (numpy's sum), the blocks' sums added in order."""
    if g0.shape != (rows.length,):
        raise ProtocolError(f"The server update has {g0.size} entries, the updates {rows.length}.")
    dots = np.zeros(rows.count)
    squares = np.zeros(rows.count)
    g0_square = 0.0
    for start, stop in blocks(rows):
        block = rows.rows(start, stop)
        g0_block = g0[start:stop]
        dots += (block * g0_block).sum(axis=1)
        np.multiply(block, block, out=block)
        squares += block.sum(axis=1)
        g0_square += float((g0_block * g0_block).sum())
    norms = np.sqrt(squares)
    g0_norm = float(np.sqrt(g0_square))
    products = norms * g0_norm
    cosines = np.divide(dots, products, out=np.zeros(rows.count), where=products > 0)
    return np.maximum(cosines, 0.0), norms, g0_norm


def trust_scores(updates: Sequence[np.ndarray] | Rows, server_update: np.ndarray) -> np.ndarray:
    """FLTrust's TS_i = ReLU(cos(g_i, g_0)) (0 for a zero update)."""
    g0 = np.asarray(server_update, dtype=np.float64).reshape(-1)
    return _trust(_as_rows(updates), g0)[0]


def fltrust_scored(
    updates: Sequence[np.ndarray] | Rows, server_update: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(``fltrust``, ``trust_scores``) from one pass for the scores and one for the sum.

    Raises:
        ProtocolError: the server update's length is not the updates'.
    """
    rows = _as_rows(updates)
    g0 = np.asarray(server_update, dtype=np.float64).reshape(-1)
    scores, norms, g0_norm = _trust(rows, g0)
    total = float(scores.sum())
    out = np.zeros(rows.length)
    if total == 0:
        return out, scores
    positive = norms > 0
    coefficients = (scores / total)[:, None]
    for start, stop in blocks(rows):
        block = rows.rows(start, stop)
        # (g_i ||g_0||) / ||g_i||, 0 for a zero update; then times TS_i / sum TS, added in order
        np.multiply(block, g0_norm, out=block)
        np.divide(block, norms[:, None], out=block, where=positive[:, None])
        block[~positive] = 0.0
        np.multiply(block, coefficients, out=block)
        _sum_rows(block, out[start:stop])
    return out, scores


def fltrust(updates: Sequence[np.ndarray] | Rows, server_update: np.ndarray) -> np.ndarray:
    """sum_i TS_i (||g_0|| / ||g_i||) g_i / sum_i TS_i; zero when every TS_i is 0."""
    return fltrust_scored(updates, server_update)[0]


def rfca(
    units: Sequence[np.ndarray], clusters: Sequence[int], server_units: np.ndarray
) -> tuple[np.ndarray, np.ndarray, float]:
    """EBS-CFL's robust clustered aggregate (the encoded pipeline's plaintext oracle).

    Args:
        units: each client's unit-norm update g_i_hat.
        clusters: each client's cluster c_i.
        server_units: the server's unit update of every cluster (m x l).

    Returns:
        (m x l aggregates, scores w_i = <g_i_hat, g0_hat^{c_i}>, W = sum_i ReLU(w_i)); for
        cluster j the aggregate is sum_{i: c_i = j} ReLU(w_i)/W g_i_hat, all zero when W = 0.
    """
    stacked = _stack(units)
    g0 = np.asarray(server_units, dtype=np.float64)
    m = g0.shape[0]
    if any(not 0 <= c < m for c in clusters) or len(clusters) != len(stacked):
        raise ProtocolError(f"Every client needs a cluster in 0..{m - 1}, got {list(clusters)}.")
    scores = np.einsum("il,il->i", stacked, g0[list(clusters)])
    weights = np.maximum(scores, 0.0)
    total = float(weights.sum())
    out = np.zeros((m, stacked.shape[1]))
    if total > 0:
        for row, c, w in zip(stacked, clusters, weights, strict=True):
            out[c] += (w / total) * row
    return out, scores, total


def aggregate(
    name: str,
    updates: Sequence[np.ndarray] | Rows,
    *,
    weights: Sequence[float] | None = None,
    trim: float = 0.1,
    byzantine: int = 0,
    server_update: np.ndarray | None = None,
) -> np.ndarray:
    """Applies the rule ``name`` (one of ``AGGREGATORS``).

    Raises:
        ProtocolError: an unknown name, FLTrust without a server update, or a rule's own
            precondition.
    """
    if name == "Mean":
        return mean(updates, weights)
    if name == "Median":
        return median(updates)
    if name == "TrimmedMean":
        return trimmed_mean(updates, trim)
    if name == "Krum":
        return krum(updates, byzantine)[1]
    if name == "FLTrust":
        if server_update is None:
            raise ProtocolError("FLTrust needs the server's update on its root data.")
        return fltrust(updates, server_update)
    raise ProtocolError(f"Unknown aggregator {name!r}; known: {', '.join(AGGREGATORS)}.")


__all__ = [
    "AGGREGATORS",
    "Rows",
    "VectorRows",
    "aggregate",
    "block_width",
    "blocks",
    "fltrust",
    "fltrust_scored",
    "krum",
    "krum_scores",
    "mean",
    "median",
    "rfca",
    "squared_distances",
    "trimmed_mean",
    "trust_scores",
]

"""Robust aggregation rules over flat update vectors: the baselines of EBS-CFL (digest 004).

Pure numpy, no torch and no protocol state: each rule takes the round's updates (one float64
vector per client, the same length) and returns one aggregated update. ``fedavg`` uses them
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

from collections.abc import Sequence

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


def mean(updates: Sequence[np.ndarray], weights: Sequence[float] | None = None) -> np.ndarray:
    """sum_i w_i g_i / sum_i w_i (uniform when ``weights`` is None).

    Raises:
        ProtocolError: the weights do not sum to a positive number.
    """
    stacked = _stack(updates)
    if weights is None:
        return stacked.mean(axis=0)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (stacked.shape[0],) or not w.sum() > 0:
        raise ProtocolError(f"The mean needs one positive-sum weight per update, got {weights}.")
    return (w / w.sum()) @ stacked


def median(updates: Sequence[np.ndarray]) -> np.ndarray:
    """The coordinate-wise median (the mean of the two middle values for even n)."""
    return np.median(_stack(updates), axis=0)


def trimmed_mean(updates: Sequence[np.ndarray], trim: float) -> np.ndarray:
    """The coordinate-wise mean without the k = floor(trim * n) largest and smallest values.

    Raises:
        ProtocolError: ``trim`` is outside [0, 0.5) or leaves nothing to average.
    """
    stacked = _stack(updates)
    n = stacked.shape[0]
    k = int(np.floor(trim * n))
    if not 0 <= trim < 0.5 or n - 2 * k < 1:
        raise ProtocolError(f"Trimming {k} of each end of {n} updates leaves none (trim {trim}).")
    ordered = np.sort(stacked, axis=0)
    return ordered[k : n - k].mean(axis=0)


def krum_scores(updates: Sequence[np.ndarray], byzantine: int) -> np.ndarray:
    """Each update's Krum score: the sum of squared distances to its n - f - 2 nearest others.

    Raises:
        ProtocolError: n - f - 2 < 1 (Krum needs n >= f + 3).
    """
    stacked = _stack(updates)
    n = stacked.shape[0]
    neighbours = n - byzantine - 2
    if byzantine < 0 or neighbours < 1:
        raise ProtocolError(
            f"Krum with f = {byzantine} Byzantine clients needs at least f + 3 = "
            f"{byzantine + 3} updates, got {n}."
        )
    squares = (stacked * stacked).sum(axis=1)
    distances = np.maximum(squares[:, None] + squares[None, :] - 2 * stacked @ stacked.T, 0.0)
    np.fill_diagonal(distances, np.inf)
    return np.sort(distances, axis=1)[:, :neighbours].sum(axis=1)


def krum(updates: Sequence[np.ndarray], byzantine: int) -> tuple[int, np.ndarray]:
    """(index, update) of the update with the lowest Krum score (ties: the lowest index)."""
    scores = krum_scores(updates, byzantine)
    chosen = int(np.argmin(scores))
    return chosen, np.asarray(updates[chosen], dtype=np.float64).reshape(-1).copy()


def trust_scores(updates: Sequence[np.ndarray], server_update: np.ndarray) -> np.ndarray:
    """FLTrust's TS_i = ReLU(cos(g_i, g_0)) (0 for a zero update)."""
    stacked = _stack(updates)
    g0 = np.asarray(server_update, dtype=np.float64).reshape(-1)
    norms = np.linalg.norm(stacked, axis=1) * np.linalg.norm(g0)
    cosines = np.divide(stacked @ g0, norms, out=np.zeros(len(stacked)), where=norms > 0)
    return np.maximum(cosines, 0.0)


def fltrust(updates: Sequence[np.ndarray], server_update: np.ndarray) -> np.ndarray:
    """sum_i TS_i (||g_0|| / ||g_i||) g_i / sum_i TS_i; zero when every TS_i is 0."""
    stacked = _stack(updates)
    g0 = np.asarray(server_update, dtype=np.float64).reshape(-1)
    if g0.size != stacked.shape[1]:
        raise ProtocolError(
            f"The server update has {g0.size} entries, the updates {stacked.shape[1]}."
        )
    scores = trust_scores(updates, g0)
    total = float(scores.sum())
    if total == 0:
        return np.zeros(stacked.shape[1])
    norms = np.linalg.norm(stacked, axis=1)
    scaled = np.divide(
        stacked * np.linalg.norm(g0),
        norms[:, None],
        out=np.zeros_like(stacked),
        where=norms[:, None] > 0,
    )
    return (scores / total) @ scaled


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
    updates: Sequence[np.ndarray],
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
    "aggregate",
    "fltrust",
    "krum",
    "krum_scores",
    "mean",
    "median",
    "rfca",
    "trimmed_mean",
    "trust_scores",
]

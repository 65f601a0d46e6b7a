"""Peer graphs of decentralized protocols and their doubly stochastic mixing matrices.

No torch here: the spec's validation (and so the operator) builds the same graph and checks it
before any pod starts. A graph is a set of directed edges ``sender -> receiver``; client ``i``
mixes with weight ``w_ij`` what its in-neighbours ``j`` send it. ``W`` must be doubly
stochastic: row sums 1 give consensus, column sums 1 keep the gradient trackers' sum (the
invariant LPPA rests on, digest 002 section 2.5). It is found by Sinkhorn-Knopp scaling of
``A + I`` (``A[i, j] = 1`` when ``j`` sends to ``i``) or, for undirected graphs, by
Metropolis-Hastings weights. Matrices are kept sparse (one entry per edge plus the diagonal),
so a graph of thousands of clients is checked without an N x N array.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

TopologyKind = Literal["Ring", "KRegular", "Complete", "Edges"]
MixingKind = Literal["Sinkhorn", "Metropolis"]

STOCHASTIC_TOLERANCE = 1e-9
"""How far a row or column sum of W may be from 1 (checked at validation and at start)."""
SINKHORN_TOLERANCE = 1e-12
"""Sinkhorn stops once every row sum is within this of 1 (columns are then exactly scaled)."""
SINKHORN_ITERATIONS = 20_000
"""Sinkhorn gives up after this many sweeps: the support has no doubly stochastic scaling."""
MIN_NEIGHBOURS = 2
"""The fewest distinct neighbours (in or out) a client may have (digest 002, gap 17)."""


class TopologyError(ValueError):
    """A peer graph is unusable; ``field`` names the manifest field at fault."""

    def __init__(self, message: str, *, field: str = "topology") -> None:
        self.field = field
        super().__init__(message)


@dataclass(frozen=True)
class Graph:
    """A directed peer graph over clients ``0..count-1``.

    Attributes:
        count: the number of clients.
        edges: the directed edges ``(sender, receiver)``, sorted, without self-loops or repeats.
    """

    count: int
    edges: tuple[tuple[int, int], ...]
    _out: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _in: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        outs: list[list[int]] = [[] for _ in range(self.count)]
        ins: list[list[int]] = [[] for _ in range(self.count)]
        for sender, receiver in self.edges:
            outs[sender].append(receiver)
            ins[receiver].append(sender)
        object.__setattr__(self, "_out", tuple(tuple(sorted(x)) for x in outs))
        object.__setattr__(self, "_in", tuple(tuple(sorted(x)) for x in ins))

    def out_neighbours(self, index: int) -> tuple[int, ...]:
        """The clients ``index`` sends to, ascending."""
        return self._out[index]

    def in_neighbours(self, index: int) -> tuple[int, ...]:
        """The clients ``index`` receives from, ascending."""
        return self._in[index]

    def neighbours(self, index: int) -> tuple[int, ...]:
        """The distinct clients ``index`` exchanges anything with, ascending."""
        return tuple(sorted(set(self._out[index]) | set(self._in[index])))

    @property
    def undirected(self) -> bool:
        """Whether every edge has its reverse."""
        edges = set(self.edges)
        return all((b, a) in edges for a, b in edges)

    def strongly_connected(self) -> bool:
        """Whether every client reaches every other along the edges."""
        if self.count <= 1:
            return True
        return _reaches_all(self._out, self.count) and _reaches_all(self._in, self.count)


def _reaches_all(adjacency: Sequence[Sequence[int]], count: int) -> bool:
    seen = {0}
    stack = [0]
    while stack:
        for nxt in adjacency[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return len(seen) == count


def build_graph(
    kind: TopologyKind,
    count: int,
    *,
    directed: bool = False,
    degree: int = 4,
    edges: Iterable[Sequence[int]] = (),
) -> Graph:
    """Builds a peer graph.

    Args:
        kind: Ring (each client with its two circle neighbours; directed: ``i -> i+1``),
            KRegular (undirected: ``i`` with ``i +- 1 .. i +- degree/2``; directed:
            ``i -> i+1 .. i+degree``), Complete (every pair), or Edges (the given pairs).
        count: the number of clients.
        directed: whether edges are one-way (Edges: each pair is ``[sender, receiver]``) or
            both ways.
        degree: the degree of KRegular.
        edges: the pairs of kind Edges.

    Raises:
        TopologyError: naming the bad field (``degree``, ``edges[k]``).
    """
    pairs: set[tuple[int, int]] = set()

    def link(a: int, b: int) -> None:
        pairs.add((a, b))
        if not directed:
            pairs.add((b, a))

    if kind == "Ring":
        if count >= 2:
            for i in range(count):
                link(i, (i + 1) % count)
    elif kind == "KRegular":
        if directed:
            if not 1 <= degree <= count - 1:
                raise TopologyError(
                    f"{degree} is not allowed for a directed KRegular graph of {count} clients; "
                    f"allowed: 1 to {count - 1}.",
                    field="degree",
                )
            offsets = range(1, degree + 1)
        else:
            if degree % 2 or not 2 <= degree <= count - 1:
                top = count - 1 if (count - 1) % 2 == 0 else count - 2
                raise TopologyError(
                    f"{degree} is not allowed for an undirected KRegular graph of {count} "
                    f"clients: each client links to the degree/2 nearest on each side of the "
                    f"circle; allowed: an even number from 2 to {max(top, 2)}.",
                    field="degree",
                )
            offsets = range(1, degree // 2 + 1)
        for i in range(count):
            for offset in offsets:
                link(i, (i + offset) % count)
    elif kind == "Complete":
        for i in range(count):
            for j in range(count):
                if i != j:
                    pairs.add((i, j))
    elif kind == "Edges":
        seen: set[tuple[int, int]] = set()
        for k, pair in enumerate(edges):
            where = f"edges[{k}]"
            if len(pair) != 2:
                raise TopologyError(
                    f"{list(pair)!r} is not a pair [sender, receiver].", field=where
                )
            a, b = int(pair[0]), int(pair[1])
            if not (0 <= a < count and 0 <= b < count):
                raise TopologyError(
                    f"{[a, b]!r} names a client outside 0..{count - 1} (spec.clients.count).",
                    field=where,
                )
            if a == b:
                raise TopologyError(
                    f"{[a, b]!r} is a self-loop; a client does not send to itself.", field=where
                )
            key = (a, b) if directed else (min(a, b), max(a, b))
            if key in seen:
                raise TopologyError(f"{[a, b]!r} repeats an earlier edge.", field=where)
            seen.add(key)
            link(a, b)
    else:  # pragma: no cover - the spec's Literal rules this out
        raise TopologyError(f"Unknown topology kind {kind!r}.", field="kind")
    return Graph(count, tuple(sorted(pairs)))


@dataclass(frozen=True)
class MixingMatrix:
    """A sparse doubly stochastic matrix on a graph's support (edges and the diagonal).

    Attributes:
        count: its size.
        rows, cols, values: the entries ``W[rows[k], cols[k]] = values[k]``, row-major sorted.
    """

    count: int
    rows: np.ndarray
    cols: np.ndarray
    values: np.ndarray

    def row(self, index: int) -> dict[int, float]:
        """Client ``index``'s weights ``{j: w_ij}`` (itself and its in-neighbours)."""
        start, stop = np.searchsorted(self.rows, [index, index + 1])
        return {
            int(c): float(v)
            for c, v in zip(self.cols[start:stop], self.values[start:stop], strict=True)
        }

    def dense(self) -> np.ndarray:
        """Returns W as an N x N array (for tests and small graphs)."""
        matrix = np.zeros((self.count, self.count))
        matrix[self.rows, self.cols] = self.values
        return matrix

    def row_sums(self) -> np.ndarray:
        """Every row's sum."""
        return np.bincount(self.rows, self.values, minlength=self.count)

    def col_sums(self) -> np.ndarray:
        """Every column's sum."""
        return np.bincount(self.cols, self.values, minlength=self.count)

    def stochastic_error(self) -> float:
        """The largest distance of a row or column sum from 1."""
        return float(max(np.max(np.abs(self.row_sums() - 1)), np.max(np.abs(self.col_sums() - 1))))


def _support(graph: Graph) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of A + I, row-major sorted: ``W[i, j]`` may be nonzero if ``j -> i``."""
    entries = {(i, i) for i in range(graph.count)}
    entries.update((receiver, sender) for sender, receiver in graph.edges)
    ordered = sorted(entries)
    rows = np.fromiter((r for r, _ in ordered), dtype=np.int64, count=len(ordered))
    cols = np.fromiter((c for _, c in ordered), dtype=np.int64, count=len(ordered))
    return rows, cols


def sinkhorn(graph: Graph) -> MixingMatrix:
    """Scales ``A + I`` to a doubly stochastic matrix by alternate row and column scaling.

    Raises:
        TopologyError: the sweeps did not converge (the support has no doubly stochastic
            scaling, e.g. a graph that is not strongly connected).
    """
    rows, cols = _support(graph)
    values = np.ones(len(rows))
    count = graph.count
    for _ in range(SINKHORN_ITERATIONS):
        values /= np.bincount(rows, values, minlength=count)[rows]
        values /= np.bincount(cols, values, minlength=count)[cols]
        if np.max(np.abs(np.bincount(rows, values, minlength=count) - 1)) <= SINKHORN_TOLERANCE:
            return MixingMatrix(count, rows, cols, values)
    raise TopologyError(
        f"Sinkhorn scaling did not reach a doubly stochastic mixing matrix within "
        f"{SINKHORN_ITERATIONS} sweeps: this graph's support (its edges plus self-loops) has "
        f"none, which needs every edge to lie on a directed cycle (e.g. a strongly connected, "
        f"balanced graph)."
    )


def metropolis(graph: Graph) -> MixingMatrix:
    """Metropolis-Hastings weights ``w_ij = 1 / (1 + max(d_i, d_j))``, ``w_ii = 1 - sum``.

    Raises:
        TopologyError: the graph is directed (the weights need symmetric links).
    """
    if not graph.undirected:
        raise TopologyError(
            "Metropolis weights need an undirected graph (every edge in both directions); "
            "use mixing Sinkhorn for a directed one.",
            field="mixing",
        )
    rows, cols = _support(graph)
    degree = [len(graph.in_neighbours(i)) for i in range(graph.count)]
    values = np.zeros(len(rows))
    off = rows != cols
    values[off] = [
        1.0 / (1 + max(degree[r], degree[c])) for r, c in zip(rows[off], cols[off], strict=True)
    ]
    diagonal = 1.0 - np.bincount(rows, values, minlength=graph.count)
    values[~off] = diagonal[rows[~off]]
    return MixingMatrix(graph.count, rows, cols, values)


def mixing_matrix(graph: Graph, kind: MixingKind = "Sinkhorn") -> MixingMatrix:
    """Returns the graph's mixing matrix, checked to be doubly stochastic and non-negative.

    Raises:
        TopologyError: no such matrix, or (a bug) one that is not doubly stochastic.
    """
    matrix = sinkhorn(graph) if kind == "Sinkhorn" else metropolis(graph)
    error = matrix.stochastic_error()
    if error > STOCHASTIC_TOLERANCE or np.any(matrix.values < 0):
        raise TopologyError(
            f"The {kind} mixing matrix is not doubly stochastic (a row or column sum is "
            f"{error:.2e} away from 1, allowed {STOCHASTIC_TOLERANCE}).",
            field="mixing",
        )
    return matrix


def check_graph(graph: Graph, *, min_neighbours: int = MIN_NEIGHBOURS) -> None:
    """Checks a peer graph for decentralized training: degrees and connectivity.

    Raises:
        TopologyError: a client has fewer than ``min_neighbours`` distinct neighbours, or the
            graph is not strongly connected (consensus would not be reached).
    """
    few = [i for i in range(graph.count) if len(graph.neighbours(i)) < min_neighbours]
    if few:
        shown = ", ".join(
            f"client {i} has {len(graph.neighbours(i))} ({list(graph.neighbours(i))})"
            for i in few[:5]
        )
        more = f" and {len(few) - 5} more" if len(few) > 5 else ""
        raise TopologyError(
            f"every client needs at least {min_neighbours} distinct neighbours, but {shown}"
            f"{more}: a client with a single neighbour is fully exposed to it (that neighbour "
            f"knows every noise term in the client's tracker).",
        )
    if not graph.strongly_connected():
        raise TopologyError(
            "the graph is not strongly connected: some client cannot reach another along the "
            "edges, so the clients' models would never agree."
        )


@dataclass(frozen=True)
class PeerPlan:
    """Everything one client needs of the graph: its links and its row of W.

    Attributes:
        index: the client.
        in_neighbours: who sends to it (whose peer links it accepts).
        out_neighbours: whom it sends to (whose peer servers it dials).
        weights: its row of W, ``{j: w_ij}`` for itself and its in-neighbours.
    """

    index: int
    in_neighbours: tuple[int, ...]
    out_neighbours: tuple[int, ...]
    weights: dict[int, float] = field(default_factory=dict)


def peer_plans(graph: Graph, matrix: MixingMatrix) -> list[PeerPlan]:
    """One plan per client."""
    return [
        PeerPlan(i, graph.in_neighbours(i), graph.out_neighbours(i), matrix.row(i))
        for i in range(graph.count)
    ]


def second_eigenvalue(matrix: MixingMatrix) -> float:
    """The second-largest |eigenvalue| of W: how fast consensus (and LPPA's noise) decays."""
    values = np.sort(np.abs(np.linalg.eigvals(matrix.dense())))[::-1]
    return float(values[1]) if len(values) > 1 else 0.0

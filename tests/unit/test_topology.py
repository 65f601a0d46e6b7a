"""Peer graphs and their mixing matrices: shapes, double stochasticity, and clear refusals."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedcore.errors import SpecError
from fedcore.spec import parse_manifest, peer_graph
from fedcore.spec.topology import (
    Graph,
    TopologyError,
    build_graph,
    check_graph,
    metropolis,
    mixing_matrix,
    peer_plans,
    second_eigenvalue,
    sinkhorn,
)

GRAPHS: list[tuple[str, Graph]] = [
    ("ring", build_graph("Ring", 7)),
    ("directed ring", build_graph("Ring", 6, directed=True)),
    ("4-regular", build_graph("KRegular", 9, degree=4)),
    ("directed 2-regular", build_graph("KRegular", 8, degree=2, directed=True)),
    ("complete", build_graph("Complete", 5)),
    (
        "irregular edges",
        build_graph(
            "Edges",
            6,
            edges=[[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 0], [0, 3], [1, 4], [0, 2]],
        ),
    ),
    (
        "directed edges",
        build_graph(
            "Edges", 4, directed=True, edges=[[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [2, 0]]
        ),
    ),
]


@pytest.mark.parametrize(("name", "graph"), GRAPHS, ids=[n for n, _ in GRAPHS])
def test_sinkhorn_gives_a_doubly_stochastic_matrix_on_the_graphs_support(
    name: str, graph: Graph
) -> None:
    # Execute
    matrix = mixing_matrix(graph, "Sinkhorn")
    dense = matrix.dense()
    # Assert
    np.testing.assert_allclose(dense.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(dense.sum(axis=0), 1.0, rtol=0, atol=1e-12)
    assert np.all(dense >= 0)
    allowed = np.eye(graph.count, dtype=bool)
    for sender, receiver in graph.edges:
        allowed[receiver, sender] = True  # W[i, j] may be nonzero when j sends to i
    assert not np.any(dense[~allowed]), "W has weight outside the edges and the diagonal"
    assert second_eigenvalue(matrix) < 1 - 1e-9, "W must mix: the graph is connected"


def test_graph_kinds_link_what_they_say() -> None:
    # Execute
    ring = build_graph("Ring", 5)
    directed = build_graph("Ring", 5, directed=True)
    regular = build_graph("KRegular", 7, degree=4)
    complete = build_graph("Complete", 4)
    # Assert
    assert ring.neighbours(0) == (1, 4) and ring.out_neighbours(0) == (1, 4)
    assert directed.out_neighbours(0) == (1,) and directed.in_neighbours(0) == (4,)
    assert directed.neighbours(0) == (1, 4)
    assert regular.neighbours(0) == (1, 2, 5, 6)
    assert complete.out_neighbours(2) == (0, 1, 3)
    assert ring.undirected and not directed.undirected


def test_regular_undirected_graphs_get_uniform_weights_and_metropolis_agrees() -> None:
    # Prepare
    graph = build_graph("KRegular", 8, degree=4)
    # Execute
    sink = sinkhorn(graph).dense()
    metro = metropolis(graph).dense()
    # Assert: every row holds itself and 4 neighbours at 1/5.
    np.testing.assert_allclose(sink[sink > 0], 0.2, rtol=0, atol=1e-15)
    np.testing.assert_allclose(sink, metro, rtol=0, atol=1e-15)


def test_metropolis_weights_are_symmetric_and_doubly_stochastic_on_an_irregular_graph() -> None:
    # Prepare
    graph = GRAPHS[5][1]
    # Execute
    dense = metropolis(graph).dense()
    # Assert
    np.testing.assert_allclose(dense, dense.T, rtol=0, atol=0)
    np.testing.assert_allclose(dense.sum(axis=1), 1.0, rtol=0, atol=1e-15)
    assert dense[0, 1] == pytest.approx(1 / (1 + 4))  # degrees 4 and 3


def test_metropolis_refuses_a_directed_graph_naming_the_mixing_field() -> None:
    with pytest.raises(TopologyError, match="undirected") as caught:
        mixing_matrix(build_graph("Ring", 5, directed=True), "Metropolis")
    assert caught.value.field == "mixing"


def test_a_row_stochastic_matrix_is_not_accepted_as_doubly_stochastic() -> None:
    # Prepare: row-normalised A + I on a graph whose in-degrees differ.
    graph = GRAPHS[5][1]
    matrix = sinkhorn(graph)
    rows = matrix.rows
    values = np.ones(len(rows)) / np.bincount(rows)[rows]
    # Execute
    from fedcore.spec.topology import MixingMatrix

    plain = MixingMatrix(graph.count, rows, matrix.cols, values)
    # Assert
    assert np.allclose(plain.row_sums(), 1)
    assert plain.stochastic_error() > 1e-3


@pytest.mark.parametrize(
    ("graph", "names"),
    [
        (build_graph("Edges", 4, edges=[[0, 1], [1, 2], [2, 3]]), "client 0 has 1 ([1])"),
        (build_graph("Edges", 4, edges=[[0, 1], [0, 2], [0, 3]]), "client 1 has 1 ([0])"),
    ],
    ids=["path", "star"],
)
def test_a_client_with_fewer_than_two_neighbours_is_refused_by_name(
    graph: Graph, names: str
) -> None:
    with pytest.raises(TopologyError, match="at least 2 distinct neighbours") as caught:
        check_graph(graph)
    assert names in str(caught.value)


def test_a_graph_that_is_not_strongly_connected_is_refused() -> None:
    # Prepare: two triangles joined by one one-way edge.
    edges = [[0, 1], [1, 2], [2, 0], [3, 4], [4, 5], [5, 3], [2, 3]]
    graph = build_graph("Edges", 6, directed=True, edges=edges)
    # Execute / Assert
    with pytest.raises(TopologyError, match="not strongly connected"):
        check_graph(graph)
    with pytest.raises(TopologyError, match="Sinkhorn scaling did not reach"):
        sinkhorn(graph)


def test_peer_plans_hold_each_clients_links_and_row() -> None:
    # Prepare
    graph = build_graph("Ring", 5, directed=True)
    # Execute
    plans = peer_plans(graph, mixing_matrix(graph))
    # Assert
    assert plans[2].in_neighbours == (1,) and plans[2].out_neighbours == (3,)
    assert plans[2].weights == pytest.approx({1: 0.5, 2: 0.5})


# ------------------------------------------------------------------------ the spec's checks


def lppa_manifest(count: int = 5, **options: Any) -> dict[str, Any]:
    return {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "FederatedRun",
        "metadata": {"name": "peers"},
        "spec": {
            "protocol": {"name": "lppa", "lppa": options},
            "clients": {"count": count},
            "rounds": 2,
        },
    }


def issues_of(document: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_manifest(document)
    return [str(issue) for issue in caught.value.issues]


@pytest.mark.parametrize(
    ("options", "count", "path", "words"),
    [
        (
            {"topology": {"kind": "Edges", "edges": [[0, 1], [1, 2], [2, 3], [3, 4]]}},
            5,
            "spec.protocol.lppa.topology:",
            "client 0 has 1 ([1])",
        ),
        (
            {"topology": {"kind": "KRegular", "degree": 3}},
            6,
            "spec.protocol.lppa.topology.degree:",
            "allowed: an even number from 2 to 4",
        ),
        (
            {"topology": {"kind": "KRegular", "degree": 5, "directed": True}},
            5,
            "spec.protocol.lppa.topology.degree:",
            "allowed: 1 to 4",
        ),
        (
            {"topology": {"kind": "Edges", "edges": [[0, 1], [1, 7]]}},
            5,
            "spec.protocol.lppa.topology.edges[1]:",
            "outside 0..4",
        ),
        (
            {"topology": {"kind": "Edges", "edges": [[0, 1], [2, 2]]}},
            5,
            "spec.protocol.lppa.topology.edges[1]:",
            "self-loop",
        ),
        (
            {"topology": {"kind": "Edges", "edges": [[0, 1], [1, 0]]}},
            5,
            "spec.protocol.lppa.topology.edges[1]:",
            "repeats",
        ),
        (
            {"topology": {"kind": "Ring", "directed": True}, "mixing": "Metropolis"},
            5,
            "spec.protocol.lppa.mixing:",
            "undirected",
        ),
        (
            {"variant": "DSGT", "injection": "EveryRound"},
            5,
            "spec.protocol.lppa.injection:",
            "'EveryRound' applies to variant 'LPPA' only",
        ),
        ({}, 2, "spec.clients.count:", "at least 2 distinct neighbours"),
    ],
    ids=[
        "path",
        "odd-degree",
        "directed-degree",
        "edge-range",
        "self-loop",
        "repeat",
        "metropolis-directed",
        "injection",
        "two-clients",
    ],
)
def test_lppa_manifests_with_unusable_graphs_are_refused_naming_the_field(
    options: dict[str, Any], count: int, path: str, words: str
) -> None:
    issues = issues_of(lppa_manifest(count, **options))
    assert any(issue.startswith(path) and words in issue for issue in issues), issues


def test_lppa_needs_every_client_every_round_and_plain_sgd() -> None:
    # Prepare
    document = lppa_manifest()
    document["spec"]["clients"].update(perRound=4, quorum=3)
    document["spec"]["training"] = {"optimizer": {"kind": "Adam"}}
    # Execute
    issues = issues_of(document)
    # Assert
    assert any(
        i.startswith("spec.clients.perRound: 4 is not allowed for protocol 'lppa'") for i in issues
    )
    assert any(i.startswith("spec.clients.quorum: 3 is not allowed") for i in issues)
    assert any(i.startswith("spec.training.optimizer: lppa takes one") for i in issues)


def test_a_valid_lppa_manifest_gives_every_party_the_same_graph() -> None:
    # Execute
    run = parse_manifest(lppa_manifest(6, topology={"kind": "KRegular", "degree": 4}))
    graph, matrix = peer_graph(run.spec)
    # Assert
    assert graph == build_graph("KRegular", 6, degree=4)
    assert matrix.stochastic_error() < 1e-12
    with pytest.raises(ValueError, match="not decentralized"):
        peer_graph(
            parse_manifest(
                {
                    **lppa_manifest(),
                    "spec": {"protocol": {"name": "fedavg"}, "clients": {"count": 3}, "rounds": 1},
                }
            ).spec
        )

"""The peer graph of a decentralized run, as every party derives it from the spec alone."""

from __future__ import annotations

from fedcore.spec._facts import protocol_facts
from fedcore.spec._options.lppa import lppa_graph
from fedcore.spec._run import FederatedRunSpec
from fedcore.spec.topology import Graph, MixingMatrix, mixing_matrix


def peer_graph(spec: FederatedRunSpec) -> tuple[Graph, MixingMatrix]:
    """Returns the run's peer graph and its mixing matrix (decentralized protocols only).

    Raises:
        ValueError: the protocol is not decentralized (no peer graph).
        TopologyError: the graph is unusable (validation refuses such a manifest first).
    """
    name = spec.protocol.name
    if not protocol_facts(name).decentralized:
        raise ValueError(f"Protocol {name!r} is not decentralized: its clients have no peers.")
    if name == "lppa":
        options = spec.protocol.lppa
        graph = lppa_graph(options, spec.clients.count)
        return graph, mixing_matrix(graph, options.mixing)
    raise ValueError(f"Protocol {name!r} declares no peer graph.")  # pragma: no cover

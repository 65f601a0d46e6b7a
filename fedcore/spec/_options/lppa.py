"""Options of ``lppa``: DSGT over a peer graph with LPPA's zero-sum noise (seed 002)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from fedcore.errors import SpecIssue
from fedcore.spec._base import SpecModel
from fedcore.spec._clients import ClientsSpec
from fedcore.spec._learning import OptimizerSpec
from fedcore.spec.topology import (
    Graph,
    TopologyError,
    build_graph,
    check_graph,
    mixing_matrix,
)

OPTIONS_PATH = "spec.protocol.lppa"


class TopologySpec(SpecModel):
    """The peer graph: who sends model and tracker to whom every round."""

    kind: Literal["Ring", "KRegular", "Complete", "Edges"] = Field(
        "Ring",
        description="kind of graph. Ring (default): each client linked with its two "
        "neighbours on a circle (directed: client i sends to i+1 only). KRegular: each client "
        "linked with the degree/2 nearest on each side (directed: sends to the next degree). "
        "Complete: every pair. Edges: the pairs in edges. Sparse graphs hide more (on a "
        "complete graph every client sees all of a victim's in-neighbours, which exposes its "
        "gradient differences; docs/protocols/lppa.md).",
    )
    directed: bool = Field(
        False,
        description="directed makes every link one-way (Ring, KRegular, and each [sender, "
        "receiver] pair of edges); false (default) links both ways.",
    )
    degree: int = Field(
        4,
        ge=1,
        le=10_000,
        description="degree of a KRegular graph: an even number from 2 to count-1 "
        "(undirected) or 1 to count-1 (directed). Default 4.",
    )
    edges: list[
        Annotated[list[Annotated[int, Field(ge=0, le=10_000)]], Field(min_length=2, max_length=2)]
    ] = Field(
        default_factory=list,
        max_length=1_000_000,
        description="edges lists the links of kind Edges as [a, b] pairs of client indices "
        "(directed: a sends to b). Every client needs at least 2 distinct neighbours and the "
        "graph must be strongly connected.",
    )


class LppaOptions(SpecModel):
    """Options of the ``lppa`` protocol (digest 002; docs/protocols/lppa.md)."""

    topology: TopologySpec = Field(
        default_factory=TopologySpec,
        description="topology is the peer graph. Default: an undirected ring.",
    )
    mixing: Literal["Sinkhorn", "Metropolis"] = Field(
        "Sinkhorn",
        description="mixing builds the doubly stochastic mixing matrix W from the graph. "
        "Sinkhorn (default, as the paper): Sinkhorn-Knopp scaling of the adjacency plus "
        "self-loops. Metropolis: Metropolis-Hastings weights (undirected graphs only).",
    )
    variant: Literal["LPPA", "DSGT", "DPInit", "DPEveryRound"] = Field(
        "LPPA",
        description="variant of the rule. LPPA (default): DSGT whose trackers start with "
        "zero-sum noise exchanged with the neighbours. DSGT: plain gradient tracking, no noise "
        "(the baseline). DPInit: each client adds its own Laplace(noiseScale) noise to its "
        "initial tracker (the paper's Theorem 3 baseline). DPEveryRound: it adds fresh noise "
        "to its tracker before every transmission (the paper's experimental baseline). The DP "
        "variants make no formal DP claim: nothing bounds the gradients' sensitivity.",
    )
    noise_scale: float = Field(
        0.025,
        gt=0,
        le=1e3,
        description="noiseScale beta: the Laplace scale of each noise vector entry (LPPA: per "
        "link; DP variants: per client). Default 0.025, the paper's.",
    )
    injection: Literal["Init", "EveryRound"] = Field(
        "Init",
        description="injection of LPPA's noise. Init (default, the paper's): one noise "
        "exchange before round 1; its effect on the trackers decays as W^t. EveryRound: a "
        "fresh zero-sum exchange every round (one more message per link and round), so later "
        "trackers stay masked too. Only for variant LPPA.",
    )
    secure_noise: bool = Field(
        True,
        description="secureNoise draws the noise from the operating system's CSPRNG (true, "
        "default) or from a generator seeded by spec.seed, the round and the client (false: "
        "reproducible, for tests only, and warned about: anyone who knows the seed can remove "
        "the noise).",
    )


def lppa_graph(options: LppaOptions, count: int) -> Graph:
    """The run's peer graph.

    Raises:
        TopologyError: naming the field at fault.
    """
    topology = options.topology
    return build_graph(
        topology.kind,
        count,
        directed=topology.directed,
        degree=topology.degree,
        edges=topology.edges,
    )


def lppa_issues(
    options: LppaOptions, clients: ClientsSpec, optimizer: OptimizerSpec
) -> list[SpecIssue]:
    """lppa's preconditions: every client each round, plain SGD steps, a usable graph.

    Args:
        options: spec.protocol.lppa.
        clients: spec.clients.
        optimizer: spec.training.optimizer.

    Returns:
        The problems found, each naming its field.
    """
    issues: list[SpecIssue] = []
    count = clients.count
    if clients.sampled_per_round() < count:
        issues.append(
            SpecIssue(
                "spec.clients.perRound",
                f"{clients.per_round!r} is not allowed for protocol 'lppa': every client "
                f"steps with its neighbours every round; allowed: '100%' or {count}.",
            )
        )
    if clients.quorum_of(count) < count:
        issues.append(
            SpecIssue(
                "spec.clients.quorum",
                f"{clients.quorum!r} is not allowed for protocol 'lppa': a client that "
                f"drops out leaves its noise uncancelled and its neighbours waiting, so the run "
                f"fails instead; allowed: '100%' or {count}.",
            )
        )
    if optimizer.kind != "SGD" or optimizer.momentum != 0 or optimizer.weight_decay != 0:
        issues.append(
            SpecIssue(
                "spec.training.optimizer",
                "lppa takes one gradient-tracking step with step size learningRate per round: "
                "kind must be SGD with momentum and weightDecay 0.",
            )
        )
    if options.injection == "EveryRound" and options.variant != "LPPA":
        issues.append(
            SpecIssue(
                f"{OPTIONS_PATH}.injection",
                f"'EveryRound' applies to variant 'LPPA' only, not {options.variant!r}; "
                f"allowed here: 'Init'.",
            )
        )
    if count < 3:
        issues.append(
            SpecIssue(
                "spec.clients.count",
                f"{count} is not allowed for protocol 'lppa': every client needs at least 2 "
                f"distinct neighbours; allowed: 3 or more.",
            )
        )
        return issues
    try:
        graph = lppa_graph(options, count)
        check_graph(graph)
        mixing_matrix(graph, options.mixing)
    except TopologyError as exc:
        where = (
            f"{OPTIONS_PATH}.mixing"
            if exc.field == "mixing"
            else (f"{OPTIONS_PATH}.topology" + ("" if exc.field == "topology" else f".{exc.field}"))
        )
        issues.append(SpecIssue(where, f"{exc}"))
    return issues

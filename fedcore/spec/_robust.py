"""Byzantine-robustness knobs of a run: data clusters, the attack experiment, fedavg's rules.

``spec.data.clusters`` gives the data a ground-truth cluster structure (IFCA's setting);
``spec.attack`` turns a share of the clients into attackers. Both exist for robustness
experiments (examples/digits-ebscfl.yaml, benchmarks/ebscfl.py): an attack is implemented by
the clients themselves, so a production run never sets it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedcore.errors import SpecIssue
from fedcore.spec._base import SpecModel
from fedcore.spec._clients import ClientsSpec
from fedcore.spec._options import FedAvgOptions

UPDATE_ATTACKS = frozenset({"SignFlip", "Scale"})
"""Attacks on the update itself: only protocols that upload a model or an update apply them."""

UPDATE_ATTACK_PROTOCOLS = frozenset({"fedavg", "ebscfl"})
"""The protocols whose clients apply SignFlip and Scale."""


class DataClustersSpec(SpecModel):
    """A ground-truth cluster structure of the clients' data (for clustered protocols)."""

    count: int = Field(
        1,
        ge=1,
        le=64,
        description="count is the number of data clusters: client i belongs to cluster "
        "i mod count, and the held-out split is evaluated once per cluster (a clustered "
        "protocol's models each on the cluster where its loss is lowest). Default 1 (no "
        "clusters). At most the number of classes.",
    )
    transform: Literal["PermuteLabels"] = Field(
        "PermuteLabels",
        description="transform that makes the clusters differ. PermuteLabels (default): "
        "cluster j's labels are shifted, y -> (y + j) mod classes, so no single model fits "
        "two clusters.",
    )


class AttackSpec(SpecModel):
    """Byzantine clients for robustness experiments: an experiment knob, never for production."""

    kind: Literal[
        "LabelFlip",
        "SignFlip",
        "Scale",
        "MalformedEncoding",
        "Overflow",
        "InflateExamples",
        "MisreportEvaluation",
        "DropAfterSharing",
    ] = Field(
        description="kind of attack. LabelFlip: the attackers train on labels y -> classes-1-y. "
        "SignFlip: they upload -scale times their honest update. Scale: scale times it. "
        "MalformedEncoding (ebscfl only): they add noise to their encoded upload, which the "
        "server's verification must reject. Overflow (every protocol but lppa, whose clients "
        "upload no tensors): they set every tensor of their upload to its type's largest "
        "finite value. InflateExamples (fedavg only): they claim scale times their shard's "
        "example count. The server's checks (spec.uploads) must refuse these two. "
        "MisreportEvaluation (spec.evaluation.where Clients or Both): they answer the server's "
        "evaluation requests with more examples right than they scored, which the server must "
        "refuse. DropAfterSharing (secagg only): they advertise and share their keys every "
        "round, then decline to send their masked input, the costliest moment for SecAgg+ to "
        "lose a client (its neighbours must reveal its mask key's shares). Required."
    )
    fraction: float = Field(
        0.2,
        ge=0,
        lt=1,
        description="fraction of the clients that attack: round(fraction * count) of them, "
        "chosen by seed. Default 0.2.",
    )
    scale: float = Field(
        10.0,
        gt=0,
        le=1e6,
        description="scale of SignFlip and Scale (and the noise of MalformedEncoding, relative "
        "to the upload's norm). Default 10.",
    )
    seed: int = Field(
        0,
        ge=0,
        le=2**53 - 1,
        description="seed that picks the attacking clients. Default 0.",
    )


def attack_issues(
    attack: AttackSpec | None, name: str, fedavg: FedAvgOptions, clients: ClientsSpec
) -> list[SpecIssue]:
    """Which protocols can run which attack, and fedavg's aggregator preconditions.

    Args:
        attack: spec.attack.
        name: spec.protocol.name.
        fedavg: spec.protocol.fedavg.
        clients: spec.clients.

    Returns:
        The problems found, each naming its field.
    """
    issues: list[SpecIssue] = []
    if attack is not None:
        if attack.kind in UPDATE_ATTACKS and name not in UPDATE_ATTACK_PROTOCOLS:
            issues.append(
                SpecIssue(
                    "spec.attack.kind",
                    f"{attack.kind!r} is applied by clients that upload a model update, which "
                    f"protocol {name!r} does not; allowed here: 'LabelFlip' (or protocol fedavg "
                    f"or ebscfl).",
                )
            )
        if attack.kind == "InflateExamples" and name != "fedavg":
            issues.append(
                SpecIssue(
                    "spec.attack.kind",
                    f"'InflateExamples' is applied by fedavg's clients; protocol {name!r}'s do "
                    f"not apply it. Allowed here: 'LabelFlip', 'Overflow'"
                    + (", 'SignFlip', 'Scale'." if name in UPDATE_ATTACK_PROTOCOLS else "."),
                )
            )
        if attack.kind == "DropAfterSharing" and name != "secagg":
            issues.append(
                SpecIssue(
                    "spec.attack.kind",
                    f"'DropAfterSharing' drops a client between secagg's stages; protocol "
                    f"{name!r} has none. Allowed here: 'LabelFlip'.",
                )
            )
        if attack.kind == "Overflow" and name == "lppa":
            issues.append(
                SpecIssue(
                    "spec.attack.kind",
                    "'Overflow' sets the tensors of an upload, and lppa's clients upload none "
                    "(their models go to their peers). Allowed here: 'LabelFlip'.",
                )
            )
        if attack.kind == "MalformedEncoding" and name != "ebscfl":
            issues.append(
                SpecIssue(
                    "spec.attack.kind",
                    f"'MalformedEncoding' tampers with ebscfl's encoding; protocol {name!r} has "
                    f"none. Allowed here: 'LabelFlip'"
                    + (", 'SignFlip', 'Scale'." if name in UPDATE_ATTACK_PROTOCOLS else "."),
                )
            )
    if name == "fedavg":
        issues.extend(_fedavg_issues(fedavg, clients))
    return issues


def _fedavg_issues(options: FedAvgOptions, clients: ClientsSpec) -> list[SpecIssue]:
    issues: list[SpecIssue] = []
    sampled = min(clients.sampled_per_round(), clients.count)
    fewest = clients.quorum_of(sampled)
    if options.aggregator == "Krum" and fewest < options.krum_byzantine + 3:
        issues.append(
            SpecIssue(
                "spec.protocol.fedavg.krumByzantine",
                f"{options.krum_byzantine} needs rounds of at least f + 3 = "
                f"{options.krum_byzantine + 3} uploads, but a round may combine only {fewest} "
                f"(spec.clients.quorum); allowed: 0 to {max(0, fewest - 3)}.",
            )
        )
    if options.aggregator == "FLTrust" and options.clusters > 1:
        issues.append(
            SpecIssue(
                "spec.protocol.fedavg.aggregator",
                "'FLTrust' scores every update against one server update, so it runs with "
                "clusters 1 only; allowed with clusters > 1: 'Mean', 'Median', 'TrimmedMean', "
                "'Krum'. (ebscfl is FLTrust per cluster, with the updates hidden.)",
            )
        )
    return issues

"""Options of ``ebscfl``: secure clustered FL with a KDC and Byzantine filtering (seed 004)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedcore.errors import SpecIssue
from fedcore.spec._base import SpecModel
from fedcore.spec._clients import ClientsSpec

MAX_SRFC_SIDE = 4096
"""The widest SRFC matrices allowed: 2*t*m*n (a 4096 x 4096 float64 matrix is 128 MiB)."""


class EbscflOptions(SpecModel):
    """Options of the ``ebscfl`` protocol (digest 004; docs/protocols/ebscfl.md)."""

    mode: Literal["Faithful", "Repaired"] = Field(
        "Repaired",
        description="mode of the protocol. Faithful: as the paper with the digest's corrected "
        "equations: the zeta_i sum to 0, so the server's weighted decode key decodes each "
        "client on its own (a documented leak), and the encode and SRFC keys stay fixed while "
        "the same clients take part (only the R'' masks are fresh each round). Repaired "
        "(default): the zeta_i sum to a traceless Z of norm zetaScale, which masks every "
        "single-client decode and cancels in the aggregate (digest G7), and every key is "
        "fresh each attempt. Both modes leak each client's score and update to a server that "
        "analyses its score matrices (docs/protocols/ebscfl.md).",
    )
    clusters: int = Field(
        2,
        ge=1,
        le=16,
        description="clusters is m, the number of cluster models; each client picks the one "
        "with the lowest loss on its shard and encodes its update into that cluster's hidden "
        "slot. Default 2.",
    )
    layout: Literal["Flat", "Layered"] = Field(
        "Layered",
        description="layout of the encode keys. Flat: one key space for all n clients of a "
        "round, as the paper's main text (an upload has 3*l*m*n numbers: small models and few "
        "clients only). Layered (default): one key space per group of groupSize clients, the "
        "paper's layered aggregation with its key transformation folded into the per-group "
        "decode keys (uploads of 3*l*m*groupSize numbers); the aggregate is the same (tested).",
    )
    group_size: int = Field(
        1,
        ge=1,
        le=10_000,
        description="groupSize is xi, the clients per key space in the Layered layout. Default "
        "1 (each client its own space, the paper's xi_1 = 1). Ignored for Flat.",
    )
    segment_length: int = Field(
        1,
        ge=1,
        le=4096,
        description="segmentLength is t: the update is cut into segments of t numbers that "
        "share one set of keys (the paper's compression scheme). Key and SRFC matrices grow "
        "with t*m; 2*t*m*n must stay at most 4096 (n: the clients per round). Default 1.",
    )
    zeta_scale: float = Field(
        30.0,
        gt=0,
        le=1e6,
        description="zetaScale is the Frobenius norm of Z, the sum of the zeta_i in Repaired "
        "mode: larger masks a single-client decode more. Default 30. Ignored in Faithful mode.",
    )
    root_examples: int = Field(
        100,
        ge=1,
        le=1_000_000,
        description="rootExamples is the size of the server's clean root data set, a seeded "
        "sample of the training split (across the data's clusters), from which the server "
        "computes each cluster's update g_0 once at the start. Default 100.",
    )
    root_epochs: int = Field(
        5,
        ge=1,
        le=1000,
        description="rootEpochs is how many local epochs the server trains each cluster's model "
        "on its root shards to get g_0 (which also warm-starts that cluster's model). "
        "Default 5.",
    )
    global_learning_rate: float = Field(
        1.0,
        gt=0,
        le=100,
        description="globalLearningRate eta_g: cluster j's model moves by eta_g(t) ||g_0^j|| "
        "times its decoded aggregate. Default 1.",
    )
    learning_rate_decay: float = Field(
        0.95,
        gt=0,
        le=1,
        description="learningRateDecay gamma: eta_g(t) = globalLearningRate * gamma^(t-1) for "
        "round t (the paper's unspecified 'dynamic learning rates'). Default 0.95.",
    )


def ebscfl_issues(options: EbscflOptions, clients: ClientsSpec) -> list[SpecIssue]:
    """The preconditions of ``ebscfl``, naming the field at fault.

    Args:
        options: spec.protocol.ebscfl.
        clients: spec.clients.

    Returns:
        The problems found, each naming its field.
    """
    issues: list[SpecIssue] = []
    sampled = min(clients.sampled_per_round(), clients.count)
    fewest = clients.quorum_of(sampled)
    if fewest < 2:
        issues.append(
            SpecIssue(
                "spec.clients.quorum" if sampled >= 2 else "spec.clients.perRound",
                f"ebscfl masks each upload with masks that sum to zero over a round's clients, "
                f"so a round needs at least 2 of them; this spec allows {fewest}. Allowed: a "
                f"perRound and quorum of at least 2.",
            )
        )
    side = 2 * options.segment_length * options.clusters * sampled
    if side > MAX_SRFC_SIDE:
        issues.append(
            SpecIssue(
                "spec.protocol.ebscfl.segmentLength",
                f"{options.segment_length} makes the SRFC matrices 2*t*m*n = "
                f"2*{options.segment_length}*{options.clusters}*{sampled} = {side} wide; at "
                f"most {MAX_SRFC_SIDE} allowed (lower segmentLength, clusters or the clients "
                f"per round).",
            )
        )
    if options.mode == "Repaired" and options.segment_length * options.clusters < 2:
        issues.append(
            SpecIssue(
                "spec.protocol.ebscfl.mode",
                "'Repaired' needs t*m >= 2 (a nonzero traceless Z needs a 2 x 2 block), got "
                f"segmentLength {options.segment_length} and clusters {options.clusters}; "
                "allowed: 'Faithful', or segmentLength * clusters >= 2.",
            )
        )
    return issues

"""Options of ``fedavg``: the weighted model mean, its robust aggregators and IFCA's clusters."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedcore.spec._base import SpecModel


class FedAvgOptions(SpecModel):
    """Options of the ``fedavg`` protocol (McMahan et al., 2017)."""

    weighting: Literal["ShardSize", "Uniform"] = Field(
        "ShardSize",
        description="weighting of each client's model in the mean: ShardSize (default) weighs "
        "by the number of local training examples; Uniform weighs every client alike.",
    )
    aggregator: Literal["Mean", "Median", "TrimmedMean", "Krum", "FLTrust"] = Field(
        "Mean",
        description="aggregator combines the clients' updates (model minus global model). Mean "
        "(default): the weighted mean (plain FedAvg). Median: coordinate-wise median. "
        "TrimmedMean: coordinate-wise mean without the trimFraction largest and smallest. "
        "Krum: the update closest to its n-f-2 nearest others (f = krumByzantine). FLTrust: "
        "updates weighted by ReLU of their cosine with the server's own update on rootExamples "
        "clean examples, each rescaled to its norm (fedcore/protocols/fedavg/aggregators.py).",
    )
    trim_fraction: float = Field(
        0.1,
        ge=0,
        lt=0.5,
        description="trimFraction: the share of updates TrimmedMean drops at each end, per "
        "coordinate (floor(trimFraction * n) each). Default 0.1.",
    )
    krum_byzantine: int = Field(
        0,
        ge=0,
        le=10_000,
        description="krumByzantine is Krum's f, the Byzantine clients it tolerates; rounds need "
        "at least f + 3 uploads. Default 0.",
    )
    root_examples: int = Field(
        100,
        ge=1,
        le=1_000_000,
        description="rootExamples is the size of FLTrust's clean root data set on the server, a "
        "seeded sample of the training split. Default 100. Only for aggregator FLTrust.",
    )
    clusters: int = Field(
        1,
        ge=1,
        le=16,
        description="clusters > 1 runs IFCA (Ghosh et al., NeurIPS 2020), the clustered "
        "baseline: the server keeps that many models, each client trains the one with the "
        "lowest loss on its shard and says which, and each model aggregates its own clients' "
        "updates with the aggregator. Default 1 (plain fedavg).",
    )

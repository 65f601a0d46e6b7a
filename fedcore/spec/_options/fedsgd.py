"""Options of ``fedsgd``: one full-shard gradient per client per round."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedcore.spec._base import SpecModel


class FedSgdOptions(SpecModel):
    """Options of the ``fedsgd`` protocol: one full-shard gradient per client per round."""

    weighting: Literal["ShardSize", "Uniform"] = Field(
        "ShardSize",
        description="weighting of each client's gradient in the mean: ShardSize (default) "
        "weighs by the number of local examples; Uniform weighs every client alike.",
    )

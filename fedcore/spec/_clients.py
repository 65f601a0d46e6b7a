"""How many clients a run has and how many take part in each round (spec.clients)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, PlainValidator, WithJsonSchema

from fedcore.spec._base import SpecModel

PERCENT_PATTERN = r"^(100|[1-9][0-9]?)%$"
"""A share written as a whole percentage from 1% to 100%."""


def _int_or_percent(value: Any) -> int | str:
    """Accepts a count >= 1 or a whole percentage from '1%' to '100%'."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("must be a count (a whole number >= 1) or a percentage like '50%'")
    if isinstance(value, int) and value < 1:
        raise ValueError(f"a count must be at least 1, got {value}")
    if isinstance(value, str) and re.fullmatch(PERCENT_PATTERN, value) is None:
        raise ValueError(
            "must be a count (a whole number >= 1) or a percentage from '1%' to '100%'"
        )
    return value


IntOrPercent = Annotated[
    int | str,
    PlainValidator(_int_or_percent),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [
                {"type": "integer", "minimum": 1},
                {"type": "string", "pattern": PERCENT_PATTERN},
            ],
        }
    ),
]


class ClientsSpec(SpecModel):
    """How many clients there are and how many take part in each round."""

    count: int = Field(
        description="count is the number of clients (one process or pod each). Required; "
        "1 to 10000.",
        ge=1,
        le=10_000,
    )
    per_round: IntOrPercent = Field(
        "100%",
        description="perRound is how many clients are sampled each round: a count (e.g. 5) or "
        "a whole percentage of count (e.g. '50%', rounded up). Sampling is uniform without "
        "replacement; spec.clients.sampling says from what, and so whether a DP protocol's "
        "epsilon may claim amplification from it. Default '100%'.",
    )
    sampling: Literal["Seeded", "Secret"] = Field(
        "Seeded",
        description="sampling is where each round's sample comes from when perRound is below "
        "100%. Seeded (default): from spec.seed and the round, so it is reproducible (a resumed "
        "run and fedcore.simulation draw the same clients) and public: a DP protocol's epsilon "
        "claims no amplification from it. Secret: the server draws it from the operating "
        "system's CSPRNG every round, so it is not reproducible, and a DP protocol's epsilon "
        "claims the amplification of sampling without replacement under replace-one adjacency "
        "(RDP accountant only), a bound against whoever sees the models but not who took part.",
    )
    quorum: IntOrPercent = Field(
        "100%",
        description="quorum is the fewest uploads a round needs: a count or a percentage of "
        "the clients sampled that round (rounded up). With fewer, the protocol's dropout "
        "policy decides. Default '100%'.",
    )

    def sampled_per_round(self) -> int:
        """Returns how many clients each round samples."""
        return resolve_share(self.per_round, self.count)

    def quorum_of(self, sampled: int) -> int:
        """Returns the quorum for a round that sampled ``sampled`` clients."""
        return resolve_share(self.quorum, sampled)


def resolve_share(value: int | str, total: int) -> int:
    """Turns a count or a 'NN%' share of ``total`` into a count (percentages round up)."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(PERCENT_PATTERN, value)
    if match is None:
        raise ValueError(f"{value!r} is neither a count nor a percentage like '50%'")
    percent = int(value[:-1])
    return max(1, -(-total * percent // 100))

"""The privacy budget of protocols that claim differential privacy (spec.privacy)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedcore.spec._base import SpecModel


class PrivacySpec(SpecModel):
    """The privacy budget of protocols that claim differential privacy."""

    target_epsilon: float | None = Field(
        None,
        gt=0,
        description="targetEpsilon is the budget: the run stops with reason BudgetExhausted "
        "before a round would exceed it. Unset: no budget. Only for protocols that claim DP.",
    )
    target_delta: float = Field(
        1e-5, gt=0, lt=1, description="targetDelta of (epsilon, delta)-DP. Default 1e-5."
    )
    accountant: Literal["RDP", "PLD"] = Field(
        "RDP",
        description="accountant that tracks epsilon (dp-accounting). RDP (default) or PLD.",
    )

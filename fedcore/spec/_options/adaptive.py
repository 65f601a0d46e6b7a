"""Options of ``adaptive``: each client's learned distortion under a privacy budget (seed 003)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedcore.errors import SpecIssue
from fedcore.spec._base import SpecModel
from fedcore.spec._learning import OptimizerSpec

OPTIONS_PATH = "spec.protocol.adaptive"


class PlMeasureSpec(SpecModel):
    """The distribution-independent "privacy leakage" measure: leakage = a1 - a2 * ||delta||."""

    budget: float = Field(
        0.98,
        gt=0,
        le=1e6,
        description="budget chi: the most leakage allowed per round. The distortion's norm "
        "must be at least l = (a1 - chi) / a2 (0 when chi >= a1) and at most "
        "upperFactor * l. Smaller is more private. Default 0.98.",
    )
    a1: float = Field(
        1.0,
        gt=0,
        le=1e6,
        description="a1 of the affine leakage bound a1 - a2 * norm: the leakage of an "
        "undistorted upload. Default 1 (the paper's leakage is a share in [0, 1]).",
    )
    a2: float = Field(
        0.0625,
        gt=0,
        le=1e6,
        description="a2 of the affine leakage bound: the leakage removed per unit of "
        "distortion norm, 1/(2D) for data of diameter D. The paper gives no value; the "
        "default 0.0625 is 1/(2*8), 8 being the diameter of digits' 64 features in [0, 1]. "
        "It is an assumption to calibrate with an attack, not a measured bound.",
    )


class DpMeasureSpec(SpecModel):
    """The Laplace mechanism: per-example clipping, then Laplace noise calibrated to epsilon."""

    epsilon: float = Field(
        100.0,
        gt=0,
        le=1e9,
        description="epsilon of one client's upload in one round under the Laplace mechanism "
        "(pure DP, replace-one adjacency on its batch). The noise scale per entry is "
        "b = eta * 2 * C * sqrt(P) / (B * epsilon): the L1 sensitivity of one SGD step on the "
        "mean of B gradients clipped to L2 norm C, P parameters. Only strategy Identical "
        "releases that mechanism (formal_dp true); Learn reshapes the noise with data-dependent "
        "gradients and is reported formal_dp false. Default 100.",
    )
    clipping_norm: float = Field(
        1.0,
        gt=0,
        le=1e6,
        description="clippingNorm C: every example's gradient is scaled to L2 norm at most C "
        "before the batch mean. Default 1.",
    )


class AdaptiveOptions(SpecModel):
    """Options of the ``adaptive`` protocol (digest 003; docs/protocols/adaptive.md)."""

    measure: Literal["PL", "DP"] = Field(
        "PL",
        description="measure of privacy that sets the distortion's lower bound l. PL "
        "(default): the affine leakage bound in pl. DP: the Laplace mechanism in dp; l is the "
        "norm of the Laplace noise drawn.",
    )
    strategy: Literal["Learn", "Identical"] = Field(
        "Learn",
        description="strategy. Learn (default): M projected gradient steps move the "
        "distortion to lower the client's loss while its norm stays in [l, upperFactor * l]. "
        "Identical: the static baseline, random noise of norm l (PL) or the Laplace noise "
        "itself (DP).",
    )
    pl: PlMeasureSpec = Field(
        default_factory=PlMeasureSpec, description="pl holds the PL measure's budget."
    )
    dp: DpMeasureSpec = Field(
        default_factory=DpMeasureSpec, description="dp holds the DP measure's budget."
    )
    steps: int = Field(
        10, ge=1, le=10_000, description="steps M of the distortion learner. Default 10."
    )
    step_size: float = Field(
        0.1,
        gt=0,
        le=1e6,
        description="stepSize gamma of the distortion learner. Default 0.1.",
    )
    optimizer: Literal["SGD", "Adam"] = Field(
        "SGD",
        description="optimizer of the distortion learner. SGD (default): plain projected "
        "gradient steps. Adam: as the paper's experiments (each step moves every entry by "
        "about stepSize, which can overwrite the random start).",
    )
    upper_factor: float = Field(
        2.0,
        ge=1,
        le=1000,
        description="upperFactor: the distortion's norm stays at most upperFactor * l. "
        "Default 2 (the paper's u = 2l).",
    )
    init: Literal["Random", "Zero"] = Field(
        "Random",
        description="init of the learner. Random (default): random noise of norm l (PL) or "
        "the drawn Laplace noise (DP). Zero: the paper's Algorithm 3 as printed; its first "
        "step makes the distortion a rescaled gradient, which hides nothing from a "
        "scale-invariant attack (refused unless allowUnsafe).",
    )
    grad_source: Literal["HeldOut", "PrivateBatch"] = Field(
        "HeldOut",
        description="gradSource of the learner's gradients. HeldOut (default): a batch of "
        "the client's held-out examples, never trained on. PrivateBatch: the round's private "
        "training batch, as the paper; measured to leak more at small l (refused unless "
        "allowUnsafe).",
    )
    held_out_fraction: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="heldOutFraction of each client's shard kept apart for the learner's "
        "gradients (seeded by spec.seed and the client). Default 0.2.",
    )
    regularization: float = Field(
        0.0,
        ge=0,
        le=1e6,
        description="regularization lambda: the learner minimises loss - lambda * ||delta||, "
        "pushing the norm up (the paper's unquantified heuristic). Default 0.",
    )
    allow_unsafe: bool = Field(
        False,
        description="allowUnsafe permits init Zero and gradSource PrivateBatch, the paper's "
        "literal settings that the digest measured to leak (for experiments only).",
    )
    secure_noise: bool = Field(
        True,
        description="secureNoise draws the distortion's random start from the operating "
        "system's CSPRNG (true, default) or from a generator seeded by spec.seed, the round "
        "and the client (false: reproducible, for tests only, and warned about).",
    )


def adaptive_issues(options: AdaptiveOptions, optimizer: OptimizerSpec) -> list[SpecIssue]:
    """adaptive's preconditions: one plain SGD step per round; no unsafe learner by accident.

    Args:
        options: spec.protocol.adaptive.
        optimizer: spec.training.optimizer.

    Returns:
        The problems found, each naming its field.
    """
    issues: list[SpecIssue] = []
    if optimizer.kind != "SGD" or optimizer.momentum != 0 or optimizer.weight_decay != 0:
        issues.append(
            SpecIssue(
                "spec.training.optimizer",
                "adaptive takes one plain SGD step (FedSGD) with learningRate per round: kind "
                "must be SGD with momentum and weightDecay 0.",
            )
        )
    if not options.allow_unsafe:
        if options.init == "Zero":
            issues.append(
                SpecIssue(
                    f"{OPTIONS_PATH}.init",
                    "'Zero' makes the learned distortion a rescaled gradient, which a "
                    "scale-invariant inversion reads through (digest 003, G1); allowed: "
                    "'Random', or set allowUnsafe: true for an experiment.",
                )
            )
        if options.grad_source == "PrivateBatch":
            issues.append(
                SpecIssue(
                    f"{OPTIONS_PATH}.gradSource",
                    "'PrivateBatch' steers the distortion with the very batch it should hide "
                    "(digest 003, G2); allowed: 'HeldOut', or set allowUnsafe: true for an "
                    "experiment.",
                )
            )
    return issues

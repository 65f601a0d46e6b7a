"""The canary audit's section of the audit report (Markdown) and its figure (PNG)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from scipy.stats import norm as gaussian

from fedcore.audit.canary.run import CanaryAudit

FIGURE = "canary-scores.png"
"""The figure's file name, in the report's figure folder."""


def scores_figure(path: Path, audit: CanaryAudit) -> None:
    """Histograms of the inserted and held-out canaries' cosines, with the fitted Gaussians."""
    figure = Figure(figsize=(5.6, 3.4))
    axis = figure.subplots()
    every = np.concatenate([audit.inserted_scores, audit.held_out_scores])
    low, high = float(every.min()), float(every.max())
    pad = 0.05 * (high - low or 1.0)
    bins = [float(b) for b in np.linspace(low - pad, high + pad, 41)]
    grid = np.linspace(low - pad, high + pad, 400)
    groups = (
        ("held out", audit.held_out_scores, audit.estimate.held_out, "#4878a8"),
        ("inserted", audit.inserted_scores, audit.estimate.inserted, "#c03030"),
    )
    for label, scores, (mean, std), colour in groups:
        axis.hist(scores, bins=bins, density=True, alpha=0.45, color=colour, label=label)
        if std > 0:
            axis.plot(grid, gaussian.pdf(grid, mean, std), color=colour, linewidth=1.5)
    axis.set_xlabel("cosine(final model's movement, canary direction)")
    axis.set_ylabel("density")
    claimed = "none" if audit.claimed is None else f"{audit.claimed:.3g}"
    axis.set_title(
        f"canaries: one-shot ε {audit.estimate.epsilon:.3g}, one-run bound "
        f"{audit.bound.epsilon:.3g}, claimed {claimed}",
        fontsize=9,
    )
    axis.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure)
    figure.savefig(path, format="png", dpi=80)


def _epsilon(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if value == float("inf") else f"{value:.3g}"


def section(audit: CanaryAudit, figure: str) -> list[str]:
    """The report's "Canaries" section, as Markdown lines (``figure``: its relative path)."""
    estimate, bound = audit.estimate, audit.bound
    level = f"{bound.confidence:.0%}"
    if audit.verdict == "exceeds claim":
        verdict = (
            f"**The run leaks more than it claims**: the one-run lower bound "
            f"{_epsilon(bound.epsilon)} passes the claimed ε {_epsilon(audit.claimed)} at "
            f"{level} confidence. A correct implementation of the claim stays below it at "
            f"that confidence: look for noise that is not added, or added to the wrong sum."
        )
    elif audit.verdict == "estimate above claim":
        verdict = (
            f"**The estimate lies above the claim**: the one-shot estimate's whole "
            f"{estimate.confidence:.0%} interval [{_epsilon(estimate.low)}, "
            f"{_epsilon(estimate.high)}] is above the claimed ε {_epsilon(audit.claimed)}. "
            f"The one-run lower bound {_epsilon(bound.epsilon)} cannot pass the claim with "
            f"{audit.canaries} canaries (its ceiling is {_epsilon(audit.ceiling)}): run "
            "more canaries to turn the estimate into proof, and look for missing noise."
        )
    elif audit.verdict == "consistent":
        verdict = (
            f"Consistent with the claim: the one-run lower bound {_epsilon(bound.epsilon)} "
            f"does not pass the claimed ε {_epsilon(audit.claimed)} ({level} confidence)."
        )
    else:
        verdict = (
            "The protocol claims no DP for this manifest: the numbers below say what the "
            "final model shows of one client, with no bound to compare them with."
        )
    apart = ""
    if audit.claimed is not None and estimate.epsilon > 0:
        apart = (
            f" How far apart: the claimed ε is {audit.claimed / estimate.epsilon:.2f}x the "
            f"one-shot estimate ({audit.claimed - estimate.epsilon:+.3g})"
            + (
                f" and {audit.claimed / bound.epsilon:.2f}x the lower bound."
                if bound.epsilon > 0
                else "; the lower bound is 0."
            )
        )
    claim = ""
    if audit.claim:
        claim = " The claim: " + "; ".join(f"{k} {v}" for k, v in audit.claim.items()) + "."
    return [
        "## Canaries: a measured ε beside the claimed ε",
        "",
        f"{audit.canaries} canaries, each a client whose update is a fixed random unit "
        f"direction of L2 norm {audit.scale:.4g} ({audit.scale_from}); {audit.inserted} "
        f"inserted at random (probability 1/2) after the run's {audit.clients} clients, "
        f"{audit.canaries - audit.inserted} held out; {audit.per_round} clients sampled per "
        f"round, {audit.rounds} rounds; held-out accuracy with canaries "
        f"{audit.accuracy:.4f}. Each canary's score is the cosine between the final model's "
        f"movement and its direction. δ = {audit.delta:g}.{claim}",
        "",
        verdict + apart,
        "",
        "| ε | value | meaning |",
        "|---|---|---|",
        f"| claimed (accountant) | {_epsilon(audit.claimed)} | an upper bound on what the "
        "released models reveal |",
        f"| one-run lower bound ({level}) | {_epsilon(bound.epsilon)} | {bound.correct} of "
        f"{bound.guesses} membership guesses right (Steinke, Nasr and Jagielski 2023); a "
        f"correct run stays below it with {level} probability |",
        f"| ceiling of that bound | {_epsilon(audit.ceiling)} | the most {audit.canaries} "
        "canaries can show (every guess right) |",
        f"| one-shot estimate [{estimate.confidence:.0%} interval] | "
        f"{_epsilon(estimate.epsilon)} [{_epsilon(estimate.low)}, {_epsilon(estimate.high)}] "
        "| Gaussians fitted to the two groups of scores (Andrew et al. 2024): an estimate "
        "of what this statistic reveals, not a bound |",
        "",
        f"Scores: inserted mean {estimate.inserted[0]:.4g} (sd {estimate.inserted[1]:.4g}), "
        f"held out mean {estimate.held_out[0]:.4g} (sd {estimate.held_out[1]:.4g}).",
        "",
        f"![canary scores]({figure})",
        "",
    ]

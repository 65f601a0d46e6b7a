"""``run_audit``: simulate a run with an attacker attached, run the attacks, write the report."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedcore.audit._attack import (
    AttackResult,
    AuditContext,
    Budget,
    Recording,
    registered_attacks,
)
from fedcore.audit._metrics import Estimate
from fedcore.audit._seeded import audited
from fedcore.audit._views import view_for
from fedcore.audit.canary.report import FIGURE as CANARY_FIGURE
from fedcore.audit.canary.report import scores_figure, section
from fedcore.audit.canary.run import CanaryAudit, check_canaries, run_canary_audit
from fedcore.privacy.sampling import sample_clients
from fedcore.simulation import simulate
from fedcore.spec import FederatedRun

EDGE_ROUNDS = 3
"""The audit records the first and the last this many rounds."""

FIGURES = "figures"
"""The report's figure folder, inside the output folder."""


@dataclass
class AuditReport:
    """What an audit found.

    Attributes:
        name: the run's name.
        protocol: the audited protocol.
        rounds: the rounds simulated.
        accuracy: the final model's held-out accuracy.
        epsilon: the privacy spent, for protocols that claim DP.
        attacker: the client that played the curious client.
        results: one per attack.
        seconds: the audit's wall time.
        markdown: the report's path.
        canary: the canary audit, when one was asked for.
    """

    name: str
    protocol: str
    rounds: int
    accuracy: float
    epsilon: float | None
    attacker: int
    results: list[AttackResult] = field(default_factory=list)
    seconds: float = 0.0
    markdown: Path | None = None
    canary: CanaryAudit | None = None

    def result(self, attack: str) -> AttackResult:
        """The result of the attack named ``attack``."""
        for result in self.results:
            if result.attack == attack:
                return result
        raise KeyError(attack)

    def as_json(self) -> dict[str, Any]:
        """The report as a JSON-able dict."""
        return {
            "name": self.name,
            "protocol": self.protocol,
            "rounds": self.rounds,
            "accuracy": self.accuracy,
            "epsilon": self.epsilon,
            "attacker": self.attacker,
            "seconds": self.seconds,
            "results": [r.as_json() for r in self.results],
            "canary": None if self.canary is None else self.canary.as_json(),
        }


def kept_rounds(last: int) -> set[int]:
    """The rounds the audit records: the first and the last ``EDGE_ROUNDS``."""
    return {t for t in range(1, last + 1) if t <= EDGE_ROUNDS or t > last - EDGE_ROUNDS}


def choose_attacker(run: FederatedRun, rounds: set[int]) -> int:
    """The client sampled in the most recorded rounds (the lowest index among equals)."""
    spec = run.spec
    counts = dict.fromkeys(range(spec.clients.count), 0)
    for t in rounds:
        for k in sample_clients(spec.clients, seed=spec.seed, round=t):
            counts[int(k)] += 1
    return max(counts, key=lambda k: (counts[k], -k))


def run_audit(
    run: FederatedRun,
    out: Path,
    *,
    attacks: Sequence[str] | None = None,
    seed: int = 0,
    rounds: int | None = None,
    budget: Budget | None = None,
    source: str | None = None,
    canaries: int | None = None,
) -> AuditReport:
    """Simulates ``run`` with an attacker attached, runs ``attacks`` and writes the report.

    A secret sample (``spec.clients.sampling: Secret``) is audited as the seeded one
    (:func:`audited`).

    Args:
        run: the manifest to audit.
        out: the report's folder (``report.md``, ``report.json``, ``figures/``).
        attacks: the attacks' names (None: every registered attack).
        seed: the attacker's randomness (dummy inputs, samples, bootstrap, shadow models).
        rounds: simulate only the first ``rounds`` rounds (None: ``spec.rounds``).
        budget: how hard the attacks try.
        source: the manifest's file name, for the report.
        canaries: also run the canary audit with this many canaries (a second simulation,
            ``fedcore.audit.canary``): its ε goes beside the claimed ε in the report.

    Returns:
        The report (also written to ``out``).

    Raises:
        ValueError: an unknown attack name, or a canary audit that cannot run (why).
    """
    started = time.monotonic()
    known = registered_attacks()
    chosen = list(known) if attacks is None else list(attacks)
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise ValueError(f"Unknown attack(s) {', '.join(unknown)}; known: {', '.join(known)}.")
    if canaries is not None:
        check_canaries(run.spec, canaries)
    run = audited(run)
    spec = run.spec
    last = spec.rounds if rounds is None else min(rounds, spec.rounds)
    keep = kept_rounds(last)
    attacker = choose_attacker(run, keep)
    recording = Recording(keep)
    result = simulate(run, rounds=last, observer=recording)
    out.mkdir(parents=True, exist_ok=True)
    ctx = AuditContext(
        run=run,
        recording=recording,
        view=view_for(spec),
        attacker=attacker,
        result=result,
        seed=seed,
        budget=budget or Budget(),
        figures=out / FIGURES,
    )
    report = AuditReport(
        name=run.metadata.name,
        protocol=spec.protocol.name,
        rounds=result.rounds_completed,
        accuracy=result.accuracy,
        epsilon=result.epsilon,
        attacker=attacker,
    )
    silent = None
    if not recording.participants:
        silent = (
            "the simulation showed the observer no message (decentralised protocols do not "
            "show their peer-to-peer messages to an observer yet)"
        )
    for name in chosen:
        attack = known[name]
        reason = silent or attack.skip_reason(ctx)
        report.results.append(
            attack.result(skipped=reason) if reason is not None else attack.run(ctx)
        )
    if canaries is not None:
        report.canary = run_canary_audit(run, canaries=canaries, seed=seed, rounds=rounds)
        scores_figure(out / FIGURES / CANARY_FIGURE, report.canary)
    report.seconds = time.monotonic() - started
    (out / "report.json").write_text(json.dumps(report.as_json(), indent=2) + "\n")
    report.markdown = out / "report.md"
    report.markdown.write_text(markdown(report, ctx, source=source))
    return report


# ---------------------------------------------------------------------------- markdown


def _number(value: float | None) -> str:
    """A number for a table: 3 significant digits, or a dash."""
    if value is None or value != value:
        return "-"
    return f"{value:.3g}"


def _verdict(estimate: Estimate | None) -> str:
    """yes / no / n/a for the summary table."""
    if estimate is None or estimate.beats_chance is None:
        return "n/a"
    return "**yes**" if estimate.beats_chance else "no"


def _interval(estimate: Estimate) -> str:
    """value [low, high]."""
    return f"{_number(estimate.value)} [{_number(estimate.low)}, {_number(estimate.high)}]"


def markdown(report: AuditReport, ctx: AuditContext, *, source: str | None) -> str:
    """The report as Markdown."""
    spec = ctx.spec
    own = len(ctx.shard(report.attacker))
    epsilon = "" if report.epsilon is None else f", epsilon {report.epsilon:.4g}"
    lines = [
        f"# Privacy audit: {report.name} ({report.protocol})",
        "",
        f"`fedcore audit {source or report.name}` simulated {report.rounds} rounds in one "
        f"process (the protocol's own hooks, `fedcore.simulation`) with an attacker attached; "
        f"final held-out accuracy {report.accuracy:.4f}{epsilon}. The curious client is client "
        f"{report.attacker} ({own} examples); recorded rounds "
        f"{', '.join(str(t) for t in ctx.kept_rounds())}; audit seed {ctx.seed}; "
        f"{report.seconds:.1f} s.",
        "",
        "A number **beats blind guessing** when its 95% interval excludes what blind "
        "guessing scores on the same measure (the 'blind guess' column).",
        "",
        "## Summary",
        "",
        "| attack | seat | measure | value [95% CI] | blind guess | beats blind guessing |",
        "|---|---|---|---|---|---|",
    ]
    for r in report.results:
        if r.verdict is None:
            lines.append(f"| {r.title} | {r.view} | skipped: {r.skipped} | | | n/a |")
            continue
        v = r.verdict
        lines.append(
            f"| {r.title} | {r.view} | {v.name} | {_interval(v)} | {_number(v.chance)} | "
            f"{_verdict(v)} |"
        )
    for r in report.results:
        lines += ["", f"## {r.title} (`{r.attack}`)", "", f"Seat: {r.view}. {r.assumes}", ""]
        if r.skipped is not None:
            lines += [f"Skipped: {r.skipped}."]
            continue
        lines += [
            "| measure | value | 95% CI | n | interval | blind guess | beats blind guessing |",
            "|---|---|---|---|---|---|---|",
        ]
        for e in r.estimates:
            lines.append(
                f"| {e.name} | {_number(e.value)} | [{_number(e.low)}, {_number(e.high)}] | "
                f"{e.n} | {e.interval} | {_number(e.chance)} | {_verdict(e)} |"
            )
        lines.append("")
        for figure in r.figures:
            lines += [f"![{r.title}]({figure})", ""]
        details = {k: v for k, v in r.details.items() if k != "why"}
        if details:
            lines += [f"Details: `{json.dumps(details)}`"]
    if report.canary is not None:
        lines += ["", *section(report.canary, f"{FIGURES}/{CANARY_FIGURE}")]
    lines += [
        "",
        "## Setting",
        "",
        f"Protocol `{spec.protocol.name}`, model {spec.model.kind} {list(spec.model.hidden)} "
        f"({spec.model.dtype}), {spec.clients.count} clients ({spec.clients.per_round} per "
        f"round), loss {spec.training.loss}. Budget: {ctx.budget}.",
        "",
    ]
    return "\n".join(lines)

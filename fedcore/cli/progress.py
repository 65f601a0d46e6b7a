"""The progress bar and summary that ``fedcore run`` shows on stderr (rich)."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from fedcore.spec import FederatedRun


def phase_text(event: dict[str, Any]) -> str | None:
    """What a start-up event says the run is doing, in words; None for other events.

    ``starting`` (the runner: certificates, kdc, server, clients), ``connected`` (the server:
    clients connected k/K) and ``joined`` (the server: every client it waited for is there).
    """
    kind = event.get("event")
    if kind == "starting":
        phase = event.get("phase")
        if phase == "certificates":
            return "issuing the run's CA and a certificate per role"
        if phase == "kdc":
            return "starting the KDC"
        if phase == "server":
            return "starting the server (model, held-out data)"
        if phase == "clients":
            clients = event.get("clients", "?")
            processes = event.get("processes", clients)
            where = "" if processes == clients else f" in {processes} processes"
            return f"starting {clients} clients{where} (each loads its data): 0/{clients} connected"
        return f"starting: {phase}"
    if kind == "connected":
        return (
            f"clients connected {event.get('connected', '?')}/{event.get('clients', '?')} "
            f"(data loaded)"
        )
    if kind == "joined":
        return f"{event.get('clients', '?')} clients joined; the rounds begin"
    return None


class RunProgress:
    """A progress bar over rounds that shows the start-up phase, then the latest loss and
    accuracy.

    Until the first round the bar's last column says what the start is doing
    (:func:`phase_text`); each new phase is drawn at once, not at the next refresh tick. On a
    console that is not a terminal rich draws only the final state, once, at the end.

    Args:
        console: where to draw (stderr, so that ``--json`` keeps stdout clean).
        run: the run being followed.
        enabled: draw nothing when false.
    """

    def __init__(self, console: Console, run: FederatedRun, *, enabled: bool = True) -> None:
        self.console = console
        self.enabled = enabled
        self.phase = ""
        """What the start is doing, in words ("" once rounds run)."""
        self._rounds_began = False
        self.progress = Progress(
            TextColumn(f"[bold]{escape(run.metadata.name)}[/] {escape(run.spec.protocol.name)}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                "round  loss {task.fields[loss]}  acc {task.fields[accuracy]}{task.fields[epsilon]}"
            ),
            TimeElapsedColumn(),
            TextColumn("{task.fields[phase]}", markup=False),
            console=console,
            disable=not enabled,
            transient=False,
        )
        self.task = self.progress.add_task(
            "rounds", total=run.spec.rounds, loss="-", accuracy="-", epsilon="", phase=""
        )

    def __enter__(self) -> RunProgress:
        self.progress.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.progress.__exit__(kind, exc, tb)

    def update(self, event: dict[str, Any]) -> None:
        """Shows a start-up phase, or moves the bar on a ``round`` or ``resumed`` event."""
        kind = event.get("event")
        text = phase_text(event)
        if text is not None:
            if not self._rounds_began:  # a client reconnecting later is not a start-up phase
                self._show_phase(text)
        elif kind == "resumed":  # before the clients connect: the start-up goes on
            self.progress.update(self.task, completed=int(event["round"]))
        elif kind == "round":
            self._rounds_began = True
            self.phase = ""
            fields: dict[str, Any] = {"phase": ""}
            if event.get("loss") is not None:
                fields["loss"] = f"{event['loss']:.4f}"
            if event.get("accuracy") is not None:
                fields["accuracy"] = f"{event['accuracy']:.4f}"
            if event.get("epsilon") is not None:
                fields["epsilon"] = f"  ε {event['epsilon']:.3f}"
            self.progress.update(self.task, completed=int(event["round"]), **fields)

    def _show_phase(self, text: str) -> None:
        self.phase = text
        self.progress.update(self.task, phase=text)
        self.progress.refresh()  # draw every phase, however short (a no-op off a terminal)

    def print_summary(self, summary: dict[str, Any], metrics_ports: dict[str, int]) -> None:
        """Prints the final summary table."""
        if not self.enabled:
            return
        table = Table(show_header=False, box=None)
        for key in (
            "phase",
            "reason",
            "rounds",
            "rounds_completed",
            "accuracy",
            "loss",
            "epsilon",
            "wall_seconds",
            "startup_seconds",
            "median_round_seconds",
            "model",
            "workdir",
        ):
            value = summary.get(key)
            table.add_row(key, Text("-" if value is None else str(value)))
        self.console.print(table)

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
            where = ""
            if processes != clients:
                where = f" in {processes} process{'' if processes == 1 else 'es'}"
            why = "each loads its data"
            model, memory = event.get("model_bytes"), event.get("memory_bytes")
            if isinstance(model, int) and isinstance(memory, int):
                why += f"; a {_gigabytes(model)} model, {_gigabytes(memory)} of memory available"
                needed = event.get("needed_bytes")
                if isinstance(needed, int):
                    why += f", about {_gigabytes(needed)} needed: it may run out of memory"
            return f"starting {clients} clients{where} ({why}): 0/{clients} connected"
        return f"starting: {phase}"
    if kind == "connected":
        return (
            f"clients connected {event.get('connected', '?')}/{event.get('clients', '?')} "
            f"(data loaded)"
        )
    if kind == "joined":
        return f"{event.get('clients', '?')} clients joined; the rounds begin"
    return None


def _gigabytes(count: int) -> str:
    """Bytes in GB, as a person reads them: ``4.03 GB``."""
    return f"{count / 1e9:.3g} GB"


def incident_text(event: dict[str, Any], missing_before: frozenset[int]) -> str | None:
    """One line for something that happened to a running run, or None: a role restarted by
    the runner, a round that went without other clients than the round before (or again with
    all), a client that reconnected."""
    kind = event.get("event")
    if kind == "restarted":
        return (
            f"{event.get('role', '?')} exited with code {event.get('exit_code', '?')} without "
            f"reporting a failure; restarted ({event.get('restart', '?')} so far), resuming "
            f"from its latest checkpoint"
        )
    if kind == "connected":
        return f"client {event.get('client', '?')} connected again"
    if kind == "round":
        missing = sorted(int(index) for index in event.get("failures") or [])
        if not missing:
            return f"round {event.get('round')}: every sampled client uploaded again"
        gone = ", ".join(map(str, missing))
        new = sorted(set(missing) - missing_before)
        also = f" (newly: {', '.join(map(str, new))})" if new and missing_before else ""
        return f"round {event.get('round')}: went on without client(s) {gone}{also}"
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
        self._missing: frozenset[int] = frozenset()
        """The clients the last round went without (a line is printed when this changes)."""
        self._restarting = False
        """A role was restarted: its clients' reconnections make one line, at ``joined``."""
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
        """Shows a start-up phase, or moves the bar on a ``round`` or ``resumed`` event; prints
        one line above the bar when a role is restarted, when the clients a round went without
        change, and when a client reconnects after the rounds began (:func:`incident_text`)."""
        kind = event.get("event")
        text = phase_text(event)
        if kind == "round":
            missing = frozenset(int(index) for index in event.get("failures") or [])
            if missing != self._missing:
                self._say(incident_text(event, self._missing))
            self._missing = missing
        elif kind == "restarted":
            self._restarting = True
            self._say(incident_text(event, self._missing))
        elif kind == "joined" and self._restarting:
            self._restarting = False
            self._say(f"{event.get('clients', '?')} clients joined the restarted server")
        elif kind == "connected" and self._rounds_began and not self._restarting:
            self._say(incident_text(event, self._missing))
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

    def _say(self, text: str | None) -> None:
        if text is not None and self.enabled:
            self.progress.console.print(escape(text), highlight=False, soft_wrap=True)

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
            "attempt",
            "events",
            "logs",
        ):
            value = summary.get(key)
            table.add_row(key, Text("-" if value is None else str(value)))
        self.console.print(table)

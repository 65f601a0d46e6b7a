"""The progress bar and summary that ``fedcore run`` shows on stderr (rich)."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedcore.spec import FederatedRun


class RunProgress:
    """A progress bar over rounds that shows the latest loss and accuracy.

    Args:
        console: where to draw (stderr, so that ``--json`` keeps stdout clean).
        run: the run being followed.
        enabled: draw nothing when false.
    """

    def __init__(self, console: Console, run: FederatedRun, *, enabled: bool = True) -> None:
        self.console = console
        self.enabled = enabled
        self.progress = Progress(
            TextColumn(f"[bold]{run.metadata.name}[/] {run.spec.protocol.name}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                "round  loss {task.fields[loss]}  acc {task.fields[accuracy]}{task.fields[epsilon]}"
            ),
            TimeElapsedColumn(),
            console=console,
            disable=not enabled,
            transient=False,
        )
        self.task = self.progress.add_task(
            "rounds", total=run.spec.rounds, loss="-", accuracy="-", epsilon=""
        )

    def __enter__(self) -> RunProgress:
        self.progress.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.progress.__exit__(kind, exc, tb)

    def update(self, event: dict[str, Any]) -> None:
        """Moves the bar on a ``round`` or ``resumed`` event."""
        kind = event.get("event")
        if kind == "resumed":
            self.progress.update(self.task, completed=int(event["round"]))
        elif kind == "round":
            fields: dict[str, Any] = {}
            if event.get("loss") is not None:
                fields["loss"] = f"{event['loss']:.4f}"
            if event.get("accuracy") is not None:
                fields["accuracy"] = f"{event['accuracy']:.4f}"
            if event.get("epsilon") is not None:
                fields["epsilon"] = f"  ε {event['epsilon']:.3f}"
            self.progress.update(self.task, completed=int(event["round"]), **fields)

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
            table.add_row(key, "-" if value is None else str(value))
        self.console.print(table)

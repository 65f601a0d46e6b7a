"""A hold point for fault-injection tests: the server pauses between two rounds on request.

With ``FEDCORE_TEST_HOLD_AFTER_ROUND=r`` and ``FEDCORE_TEST_HOLD_FILE=path`` in its
environment, the server, once round ``r`` is recorded and checkpointed, emits a ``held`` event
and waits while ``path`` exists (at most ``HOLD_LIMIT_SECONDS``). A test does there what must
fall between rounds ``r`` and ``r + 1`` (kill a client or the KDC, and wait until it is gone),
then removes the file: what follows no longer races the end of the run. Without both variables
it does nothing. Only whoever starts the server sets its environment.

``FEDCORE_TEST_HOLD_AFTER_ROUND=r.s`` holds instead once stage ``s`` of round ``r``'s attempt
has settled (multi-stage protocols), before the next stage is asked: a test can then drop a
client between two stages.

Several points, comma-separated (``1.0,2.2,3.3``), hold in turn; each waits while its own file
exists: the path with ``{point}`` replaced by the point (``hold-{point}`` → ``hold-2.2``), so a
test can create every file before the run and release them one by one. A path without
``{point}`` is every point's file.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

from fedcore.errors import RunAborted
from fedcore.observe.events import EventLog

log = logging.getLogger(__name__)

ROUND_VARIABLE = "FEDCORE_TEST_HOLD_AFTER_ROUND"
FILE_VARIABLE = "FEDCORE_TEST_HOLD_FILE"
HOLD_LIMIT_SECONDS = 300.0
"""The longest a hold lasts: a test that never releases it does not hang the run forever."""
POLL_SECONDS = 0.02


class HoldPoint:
    """The holds the environment asks for, if any.

    Args:
        events: where the ``held`` events go.
        environ: the environment to read (default: this process's).

    Raises:
        RunAborted: the round variable is set but is not a list of rounds or round.stage
            points (reason ``InvalidEnvironment``).
    """

    def __init__(self, events: EventLog, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        round_text, path = env.get(ROUND_VARIABLE), env.get(FILE_VARIABLE)
        self._events = events
        self.points: dict[tuple[int, int | None], Path] = {}
        if round_text and path:
            for point in round_text.split(","):
                self.points[_parse(point.strip(), round_text)] = Path(
                    path.replace("{point}", point.strip())
                )

    def after_round(self, round_: int) -> None:
        """Waits while the hold file exists, if ``round_`` is a round to hold after."""
        path = self.points.get((round_, None))
        if path is None:
            return
        self._events.emit("held", round=round_)
        log.info("Held after round %d while %s exists (%s).", round_, path, ROUND_VARIABLE)
        _wait(path)

    def after_stage(self, round_: int, stage: int) -> None:
        """Waits while the hold file exists, if this is a stage of a round to hold after."""
        path = self.points.get((round_, stage))
        if path is None:
            return
        self._events.emit("held", round=round_, stage=stage)
        log.info("Held after round %d stage %d while %s exists.", round_, stage, path)
        _wait(path)


def _parse(point: str, text: str) -> tuple[int, int | None]:
    """``r`` or ``r.s`` as (round, stage or None)."""
    round_part, _, stage_part = point.partition(".")
    if not round_part.isdigit() or int(round_part) < 1 or (stage_part and not stage_part.isdigit()):
        raise RunAborted(
            f"{ROUND_VARIABLE}={text!r} is not a list of round numbers (1 or more) or rounds "
            f"and stages (r.s), comma-separated.",
            reason="InvalidEnvironment",
        )
    return int(round_part), int(stage_part) if stage_part else None


def _wait(path: Path) -> None:
    """Sleeps while ``path`` exists, at most ``HOLD_LIMIT_SECONDS``."""
    deadline = time.monotonic() + HOLD_LIMIT_SECONDS
    while path.exists() and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)

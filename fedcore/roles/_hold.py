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
    """The hold the environment asks for, if any.

    Args:
        events: where the ``held`` event goes.
        environ: the environment to read (default: this process's).

    Raises:
        RunAborted: the round variable is set but not a round number (reason
            ``InvalidEnvironment``).
    """

    def __init__(self, events: EventLog, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        round_text, path = env.get(ROUND_VARIABLE), env.get(FILE_VARIABLE)
        self._events = events
        self.round: int | None = None
        self.path: Path | None = None
        self.stage: int | None = None
        if round_text and path:
            round_part, _, stage_part = round_text.partition(".")
            if (
                not round_part.isdigit()
                or int(round_part) < 1
                or (stage_part and not stage_part.isdigit())
            ):
                raise RunAborted(
                    f"{ROUND_VARIABLE}={round_text!r} is not a round number (1 or more), or a "
                    f"round and a stage (r.s).",
                    reason="InvalidEnvironment",
                )
            self.round, self.path = int(round_part), Path(path)
            self.stage = int(stage_part) if stage_part else None

    def after_round(self, round_: int) -> None:
        """Waits while the hold file exists, if ``round_`` is the round to hold after."""
        if self.path is None or round_ != self.round or self.stage is not None:
            return
        self._events.emit("held", round=round_)
        log.info("Held after round %d while %s exists (%s).", round_, self.path, ROUND_VARIABLE)
        self._wait()

    def after_stage(self, round_: int, stage: int) -> None:
        """Waits while the hold file exists, if this is the stage of the round to hold after."""
        if self.path is None or round_ != self.round or stage != self.stage:
            return
        self._events.emit("held", round=round_, stage=stage)
        log.info("Held after round %d stage %d while %s exists.", round_, stage, self.path)
        self._wait()

    def _wait(self) -> None:
        assert self.path is not None
        deadline = time.monotonic() + HOLD_LIMIT_SECONDS
        while self.path.exists() and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)

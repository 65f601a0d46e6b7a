"""A pod's events, kept in the run's checkpoint store: a replaced pod's history survives it.

On one machine the runner keeps every attempt's events in the run folder's ``events.jsonl``
(append-only). A server pod writes no such file: its folder is an emptyDir that goes with the
pod. There the server keeps its attempt's events in the checkpoint store instead, as
``history/<attempt>.jsonl`` (JSON lines, the same records as ``events.jsonl``), rewritten with
every checkpoint it writes and when the attempt ends (finished, failed, stopped). A pod that is
deleted or killed loses at most the events after its last checkpoint; the next pod resumes from
that checkpoint and starts a file of its own. ``fedcore checkpoint history MANIFEST`` prints
them. The files are not signed (unlike checkpoints): they are a record, and nothing is loaded
from them.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
from typing import Any

from fedcore.checkpoint import ObjectStore
from fedcore.errors import CheckpointError

log = logging.getLogger(__name__)

HISTORY_FOLDER = "history"
"""The store's folder of attempts' event files."""

FLUSH_EVENTS = frozenset({"checkpoint", "finished", "failed", "budget"})
"""Events after which the file is rewritten: what a later reader must not lose."""

MAX_EVENTS = 100_000
"""The most events one attempt's file keeps (the oldest after ``ready`` are dropped first)."""


def attempt_name(now: dt.datetime | None = None) -> str:
    """A name that sorts by start time and tells apart two starts in one second:
    ``20261126T071502Z-<pid>``."""
    moment = (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%dT%H%M%SZ")
    return f"{moment}-{os.getpid()}"


class StoreHistory:
    """An event listener that keeps one attempt's events in the checkpoint store.

    Writing never stops the run: a store that refuses is logged (once per failure) and
    retried at the next flush.
    """

    def __init__(self, store: ObjectStore, attempt: str | None = None) -> None:
        self.store = store.child(HISTORY_FOLDER)
        self.key = f"{attempt or attempt_name()}.jsonl"
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._dirty = False

    def __call__(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._lines.append(json.dumps(event, allow_nan=True))
            if len(self._lines) > MAX_EVENTS:
                del self._lines[1 : len(self._lines) - MAX_EVENTS + 1]
            self._dirty = True
        if event.get("event") in FLUSH_EVENTS:
            self.flush()

    def flush(self) -> None:
        """Rewrites the attempt's file with every event so far (if any came since)."""
        with self._lock:
            if not self._dirty:
                return
            data = ("\n".join(self._lines) + "\n").encode("utf-8")
            self._dirty = False
        try:
            self.store.put(self.key, data)
        except (CheckpointError, OSError) as exc:
            with self._lock:
                self._dirty = True
            where = self.store.url(self.key)
            log.warning("Could not keep this attempt's events in %s: %s", where, exc)

    def close(self) -> None:
        """Writes what is pending."""
        self.flush()


def read_history(store: ObjectStore) -> dict[str, list[dict[str, Any]]]:
    """Every attempt's events in ``store``, by attempt name, oldest attempt first.

    Raises:
        CheckpointError: the store cannot be read.
    """
    folder = store.child(HISTORY_FOLDER)
    attempts: dict[str, list[dict[str, Any]]] = {}
    for key in sorted(folder.list("")):
        if not key.endswith(".jsonl"):
            continue
        text = folder.get(key).decode("utf-8", errors="replace")
        events = []
        for line in text.splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue  # a torn line is skipped, never fatal
        attempts[key.removesuffix(".jsonl")] = events
    return attempts

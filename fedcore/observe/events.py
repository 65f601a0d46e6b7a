"""Progress events: one JSON object per line, appended by a role and tailed by the runner."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class EventListener(Protocol):
    """Something else that follows a role's events, e.g. the Kubernetes status reporter."""

    def __call__(self, event: dict[str, Any]) -> None:
        """Takes one event; must not block for long."""

    def close(self) -> None:
        """Delivers what is pending and stops."""


class EventLog:
    """Appends events to a JSON-lines file (when a path is given) and hands them to listeners.

    A listener that raises is logged and skipped: progress reporting never stops a run.
    """

    def __init__(self, path: Path | None, listeners: Sequence[EventListener] = ()) -> None:
        self._path = path
        self._listeners = list(listeners)
        self._lock = threading.Lock()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def add_listener(self, listener: EventListener) -> None:
        """Hands every later event to ``listener`` too."""
        self._listeners.append(listener)

    def emit(self, event: str, **fields: Any) -> None:
        """Appends ``{"event": event, "time": ..., **fields}`` as one line."""
        record = {"event": event, "time": time.time(), **fields}
        for listener in self._listeners:
            try:
                listener(record)
            except Exception:
                log.warning("An event listener failed on %r.", event, exc_info=True)
        if self._path is None:
            return
        line = json.dumps(record, allow_nan=True)
        with self._lock, self._path.open("a", encoding="utf-8") as handle:
            handle.write(line + "\n")
            handle.flush()

    def close(self) -> None:
        """Closes every listener (each delivers what it still holds)."""
        for listener in self._listeners:
            try:
                listener.close()
            except Exception:
                log.warning("An event listener failed to close.", exc_info=True)


def read_events(path: Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Reads complete lines from ``offset``; returns the events and the new offset."""
    if not path.exists():
        return [], offset
    with path.open("rb") as handle:
        handle.seek(offset)
        data = handle.read()
    end = data.rfind(b"\n") + 1
    events = []
    for line in data[:end].splitlines():
        if line.strip():
            events.append(json.loads(line))
    return events, offset + end

"""Progress events: one JSON object per line, appended by a role and tailed by the runner."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any


class EventLog:
    """Appends events to a JSON-lines file (or drops them when no path is given)."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._lock = threading.Lock()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: str, **fields: Any) -> None:
        """Appends ``{"event": event, "time": ..., **fields}`` as one line."""
        if self._path is None:
            return
        line = json.dumps({"event": event, "time": time.time(), **fields}, allow_nan=True)
        with self._lock, self._path.open("a", encoding="utf-8") as handle:
            handle.write(line + "\n")
            handle.flush()


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

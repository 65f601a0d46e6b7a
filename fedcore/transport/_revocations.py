"""The sites a hub has revoked, as the server and the KDC read them (a file the hub writes)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from fedcore._files import write_atomically
from fedcore.errors import TransportError

__all__ = ["RevokedSites"]


class RevokedSites:
    """The names of revoked sites, re-read whenever the file changes.

    The hub writes the file (``{"revoked": [names]}``) atomically with :meth:`write`; a role
    asks :meth:`names` at every call it admits, which costs one ``stat`` while the file stays
    the same. A missing file means no site is revoked; an unreadable one keeps what was last
    read (never less).

    Args:
        path: the file.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._names: frozenset[str] = frozenset()

    def names(self) -> frozenset[str]:
        """The revoked sites' names as the file says now."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return self._names
        stamp = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            if stamp != self._stamp:
                try:
                    document = json.loads(self.path.read_text(encoding="utf-8"))
                    names = frozenset(str(name) for name in document["revoked"])
                except (OSError, ValueError, KeyError, TypeError):
                    return self._names  # half a change, or a broken file: keep what we had
                self._names = self._names | names  # a revocation is never taken back
                self._stamp = stamp
            return self._names

    @staticmethod
    def write(path: Path, names: frozenset[str] | set[str]) -> None:
        """Writes the revoked sites' names (sorted) to ``path`` atomically.

        Raises:
            TransportError: the file could not be written.
        """
        try:
            write_atomically(
                Path(path),
                json.dumps({"revoked": sorted(names)}, indent=1).encode(),
                mode=0o644,
            )
        except OSError as exc:
            raise TransportError(f"Cannot write the revoked sites to {path}: {exc}.") from exc

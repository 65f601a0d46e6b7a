"""Object stores: the few byte-level operations a checkpoint needs, one class per backend."""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod
from pathlib import Path

from fedcore._files import write_atomically
from fedcore.errors import CheckpointError


class ObjectStore(ABC):
    """A flat namespace of keys (``a/b/c``) holding bytes."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Stores ``data`` under ``key`` atomically: readers see the old object or the new one.

        Raises:
            CheckpointError: the write failed; any previous object under ``key`` is intact.
        """

    @abstractmethod
    def get(self, key: str) -> bytes:
        """Returns the bytes under ``key``.

        Raises:
            CheckpointError: the key does not exist or cannot be read.
        """

    @abstractmethod
    def list(self, prefix: str) -> builtins.list[str]:
        """Returns every key that starts with ``prefix``, sorted."""

    @abstractmethod
    def delete(self, keys: builtins.list[str]) -> None:
        """Deletes ``keys``; missing keys are ignored."""

    @abstractmethod
    def describe(self) -> str:
        """Returns where the store lives, for messages (never a secret)."""


class LocalObjectStore(ObjectStore):
    """Objects as files under a root folder; writes go to a temp file, fsync, then rename."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise CheckpointError(
                f"The object key {key!r} is not a relative path inside the store."
            )
        return self.root / key

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, data)
        except OSError as exc:
            raise CheckpointError(f"Cannot write {path}: {exc}.") from exc

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"Cannot read {path}: {exc}.") from exc

    def list(self, prefix: str) -> builtins.list[str]:
        if not self.root.exists():
            return []
        keys = [
            path.relative_to(self.root).as_posix()
            for path in self.root.rglob("*")
            if path.is_file() and not path.name.startswith(".")
        ]
        return sorted(key for key in keys if key.startswith(prefix))

    def delete(self, keys: builtins.list[str]) -> None:
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            parent = path.parent
            while parent != self.root and parent.exists() and not any(parent.iterdir()):
                parent.rmdir()
                parent = parent.parent

    def describe(self) -> str:
        return f"folder {self.root}"

"""Object stores: the few byte-level operations a checkpoint needs, one class per backend."""

from __future__ import annotations

import builtins
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

from fedcore._files import write_atomically, write_chunks_atomically
from fedcore.errors import CheckpointError


class ObjectStore(ABC):
    """A flat namespace of keys (``a/b/c``) holding bytes."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Stores ``data`` under ``key`` atomically: readers see the old object or the new one.

        Raises:
            CheckpointError: the write failed; any previous object under ``key`` is intact.
        """

    def put_stream(self, key: str, chunks: Iterable[bytes | memoryview]) -> int:
        """Stores the concatenated ``chunks`` under ``key`` as ``put`` does; returns the size.

        Stores override this to avoid holding the whole object in memory.

        Raises:
            CheckpointError: the write failed; any previous object under ``key`` is intact.
        """
        data = b"".join(bytes(chunk) for chunk in chunks)
        self.put(key, data)
        return len(data)

    @abstractmethod
    def get(self, key: str) -> bytes:
        """Returns the bytes under ``key``.

        Raises:
            CheckpointError: the key does not exist or cannot be read.
        """

    def read_exact(self, key: str, size: int) -> bytearray:
        """Returns the object under ``key`` in a new buffer, which must hold ``size`` bytes.

        Stores override this to read straight into the buffer (no second copy).

        Raises:
            CheckpointError: the key does not exist, cannot be read, or has another size.
        """
        data = self.get(key)
        if len(data) != size:
            raise CheckpointError(_size_message(key, len(data), size))
        return bytearray(data)

    @abstractmethod
    def list(self, prefix: str) -> builtins.list[str]:
        """Returns every key that starts with ``prefix``, sorted."""

    @abstractmethod
    def delete(self, keys: builtins.list[str]) -> None:
        """Deletes ``keys``; missing keys are ignored."""

    @abstractmethod
    def describe(self) -> str:
        """Returns where the store lives, for messages (never a secret)."""

    def url(self, key: str) -> str:
        """Returns where ``key`` lives as one string (a path or an ``s3://`` URL)."""
        return f"{self.describe()}/{key}"

    def free_bytes(self) -> int | None:
        """Returns the space left for new objects, when the store can know it (a local disk);
        None when it cannot (S3)."""
        return None

    def temporaries(self, prefix: str) -> builtins.list[str]:
        """Returns the keys under ``prefix`` of writes that never finished (a writer killed
        mid-write leaves them; ``list`` never shows them). Delete them only while nothing
        writes under ``prefix``."""
        return []

    def check(self) -> None:
        """Checks, before a run starts, that the store can be reached with its credentials;
        a remote store overrides it (a local folder is created on first write).

        Raises:
            CheckpointError: naming the store and the reason.
        """
        return None

    @abstractmethod
    def child(self, name: str) -> ObjectStore:
        """Returns the store of the keys under ``name/`` (e.g. the KDC's ``kdc/``)."""


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

    def put_stream(self, key: str, chunks: Iterable[bytes | memoryview]) -> int:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return write_chunks_atomically(path, chunks)
        except OSError as exc:
            raise CheckpointError(f"Cannot write {path}: {exc}.") from exc

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"Cannot read {path}: {exc}.") from exc

    def read_exact(self, key: str, size: int) -> bytearray:
        path = self._path(key)
        try:
            with path.open("rb") as handle:
                found = os.fstat(handle.fileno()).st_size
                if found != size:
                    raise CheckpointError(_size_message(key, found, size))
                buffer = bytearray(size)
                view = memoryview(buffer)
                filled = 0
                while filled < size:
                    count = handle.readinto(view[filled:])
                    if not count:
                        raise CheckpointError(f"{path} ended after {filled} of {size} bytes.")
                    filled += count
                return buffer
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

    def free_bytes(self) -> int | None:
        """The free space of the disk the folder is (or will be) on."""
        where = self.root
        while not where.exists() and where != where.parent:
            where = where.parent
        try:
            return shutil.disk_usage(where).free
        except OSError:
            return None

    def temporaries(self, prefix: str) -> builtins.list[str]:
        """The temporary files of unfinished writes (``.<name>.<random>.tmp``, what
        ``write_chunks_atomically`` writes before its rename)."""
        if not self.root.exists():
            return []
        # Only the folders the prefix can name are walked (not, say, the KDC's kdc/ subtree).
        head, _, start = prefix.rpartition("/")
        base = self.root / head if head else self.root
        if not base.is_dir():
            return []
        keys = [
            path.relative_to(self.root).as_posix()
            for folder in base.glob(f"{start}*")
            for path in ([folder] if folder.is_file() else folder.rglob(".*.tmp"))
            if path.is_file() and path.name.startswith(".") and path.name.endswith(".tmp")
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

    def url(self, key: str) -> str:
        return str(self.root / key)

    def child(self, name: str) -> LocalObjectStore:
        return LocalObjectStore(self._path(name.strip("/")))


def _size_message(key: str, found: int, expected: int) -> str:
    return f"The object {key} has {found} bytes where {expected} were written."

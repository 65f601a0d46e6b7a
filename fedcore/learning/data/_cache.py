"""The machine-wide cache of parsed data sources: a source is parsed once per machine.

Every role of a run loads the same source; parsing it (the MNIST subset's CSV, a folder of
.npz files) in each of them costs CPU and memory in every role. Instead, the first role to need
a source parses it into a folder of the cache, and every role then maps that folder's arrays
read-only: the roles share the page cache, and a client copies only its shard's rows.

Layout: ``$FEDCORE_CACHE_DIR`` (else ``$XDG_CACHE_HOME/fedcore/datasets``, else
``~/.cache/fedcore/datasets``) holds one folder per source, named by a digest of everything
that decides the parse (the source's kind, the version of the library that ships it or the
path, size and modification time of each file, and :data:`FORMAT_VERSION`). A folder holds,
per part of the source (``pool``, ``test``, ``client-<i>``), ``<part>.x.npy`` (float32) and
``<part>.y.npy`` (int64), and ``meta.json`` (the key, each part's rows and label digest, the
input shape, the number of classes), written last.

A folder is built in a temporary folder and renamed into place, under the cache's ``fcntl``
lock (``.lock``), which roles starting together wait on: one parses, the others then read. A
folder is used only when its meta names the same key and format, and every array has the
recorded dtype, shape, exact file size and (labels) digest; otherwise it is rebuilt. When the
cache folder cannot be written, the process parses the source in memory, for itself only, and
logs why: a run never fails because of the cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""The version of the cached layout and of the parses that fill it: raising it (when a parse
changes the arrays it gives) retires every cached folder."""

CACHE_ENV = "FEDCORE_CACHE_DIR"
"""The environment variable that names the cache folder."""

_LOCK = ".lock"
"""The cache folder's lock file: whoever builds or prunes a cached source holds it (reads do
not lock)."""

_STALE_SECONDS = 24 * 3600
"""How old a writer's leftover temporary folder must be before another writer removes it."""

Sink = Callable[[str, np.ndarray, np.ndarray], None]
"""What a parser hands each part of its source to: ``sink(part, x, y)``, once or in several
batches (rows are appended; every batch of a part has the same example shape)."""

Parser = Callable[[Sink], tuple[int, str]]
"""Parses a source, hands every part to the sink, and returns ``(num_classes, where)``."""


class _Parses:
    """How many sources this process has parsed (a cache miss, or no usable cache)."""

    count = 0


def parse_count() -> int:
    """Returns how many sources this process has parsed: each cache miss and each parse done
    in memory because the cache could not be used. A cache hit parses nothing."""
    return _Parses.count


def cache_root() -> Path | None:
    """Returns the cache folder: ``$FEDCORE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/fedcore/datasets``, else ``~/.cache/fedcore/datasets``; None when no
    home folder is known."""
    named = os.environ.get(CACHE_ENV)
    if named:
        return Path(named)
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except (RuntimeError, KeyError):
            return None
    return Path(base) / "fedcore" / "datasets"


@dataclass(frozen=True)
class Stored:
    """A parsed source as one process holds it.

    From the cache, none of its arrays is held: :meth:`features` maps a part's ``x.npy``
    read-only on each call and :meth:`labels` reads its ``y.npy``. Without a cache, ``memory``
    holds every part's arrays (read-only).

    Attributes:
        where: the source, as messages name it.
        num_classes: the number of classes over every part.
        input_shape: the shape of one example.
        rows: each part's number of examples, by part name.
        folder: the cache folder of the source; None when held in memory.
        memory: each part's ``(x, y)`` when held in memory.
    """

    where: str
    num_classes: int
    input_shape: tuple[int, ...]
    rows: Mapping[str, int]
    folder: Path | None = None
    memory: Mapping[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def has(self, part: str) -> bool:
        """Whether the source has the part ``part``."""
        return part in self.rows

    def features(self, part: str) -> np.ndarray:
        """The part's features, read-only: a memory map of the cached file, or the array held
        in memory. Drop it after use, so that the mapping does not stay open."""
        if self.folder is None:
            return self.memory[part][0]
        return np.load(self.folder / f"{part}.x.npy", mmap_mode="r", allow_pickle=False)

    def labels(self, part: str) -> np.ndarray:
        """The part's labels, read-only, in memory (8 bytes a row)."""
        if self.folder is None:
            return self.memory[part][1]
        return _frozen(np.load(self.folder / f"{part}.y.npy", allow_pickle=False))

    def take(self, part: str, rows: np.ndarray | None = None) -> np.ndarray:
        """Returns a copy of the features of ``rows`` of the part (every row when None), in
        that order: an array of its own, which reads only those rows of the cached file."""
        features = self.features(part)
        if rows is None:
            return np.array(features)
        taken = np.empty((len(rows), *features.shape[1:]), dtype=features.dtype)
        np.take(features, rows, axis=0, out=taken)
        return taken


def open_source(name: str, key: Mapping[str, Any], parse: Parser) -> Stored:
    """Returns the source ``name``, from the cache when it holds ``key``, else parsed.

    Args:
        name: the source's cache folder stem (``digits``, ``npz``); the key's digest is added.
        key: everything that decides what ``parse`` gives (JSON-able); the format is added.
        parse: parses the source, handing every part to its sink.

    Raises:
        DataError: what ``parse`` raises, if the source is parsed and cannot be.
    """
    full = json.loads(json.dumps({"format": FORMAT_VERSION, **key}, sort_keys=True))
    digest = hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:20]
    entry = f"{name}-{digest}"
    root = cache_root()
    if root is None:
        log.warning("No home folder for the data cache; parsing %s in memory.", entry)
        return _in_memory(parse)
    found, _ = _read(root / entry, full)
    if found is not None:
        return found
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _locked(root / _LOCK):
            found, problem = _read(root / entry, full)  # built by another process meanwhile?
            if found is not None:
                return found
            if problem is not None:
                log.warning("The cached data %s is unusable (%s); rebuilding it.", entry, problem)
            stored = _write(root, entry, full, parse)
            _prune(root, entry, full)
            return stored
    except OSError as exc:
        log.warning(
            "The data cache %s cannot be used (%s); parsing %s in memory, for this process only.",
            root,
            exc,
            entry,
        )
        return _in_memory(parse)


def _read(folder: Path, key: Mapping[str, Any]) -> tuple[Stored | None, str | None]:
    """Returns the cached source in ``folder`` if it is whole and holds ``key``, else None and
    what is wrong with it (None too when there is no such folder)."""
    try:
        text = (folder / "meta.json").read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"meta.json cannot be read: {exc}"
    try:
        return _verified(folder, json.loads(text), key), None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, str(exc) or type(exc).__name__


def _verified(folder: Path, meta: Any, key: Mapping[str, Any]) -> Stored:
    """Checks a cached folder against its meta and ``key``; raises ValueError naming the
    first difference."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise ValueError("it was written by another format")
    if meta.get("key") != key:
        raise ValueError("its key differs")
    input_shape = tuple(int(size) for size in meta["input_shape"])
    rows: dict[str, int] = {}
    for part, facts in meta["parts"].items():
        count = int(facts["rows"])
        _check_file(folder / f"{part}.x.npy", np.float32, (count, *input_shape))
        labels = _check_file(folder / f"{part}.y.npy", np.int64, (count,))
        if _digest(labels) != facts["y_sha256"]:
            raise ValueError(f"{part}.y.npy does not match its digest")
        rows[part] = count
    return Stored(str(meta["where"]), int(meta["num_classes"]), input_shape, rows, folder)


def _check_file(path: Path, dtype: type[np.generic], shape: tuple[int, ...]) -> np.ndarray:
    """Maps ``path`` and checks its dtype, shape and exact size; returns the map."""
    array = np.load(path, mmap_mode="r", allow_pickle=False)
    if array.dtype != dtype or array.shape != shape:
        raise ValueError(f"{path.name} holds {array.dtype} {array.shape}, not {shape}")
    size = path.stat().st_size
    offset = int(getattr(array, "offset", 0))
    if offset + array.nbytes != size:
        raise ValueError(f"{path.name} has {size} bytes, not {offset + array.nbytes}")
    return array


def _write(root: Path, entry: str, key: Mapping[str, Any], parse: Parser) -> Stored:
    """Parses into a temporary folder and renames it to ``root / entry``; removes the
    temporary folder on any failure."""
    temp = root / f".{entry}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    temp.mkdir()
    try:
        with _PartWriter(temp) as writer:
            num_classes, where = _parse(parse, writer.sink)
            parts = writer.finish()
        shape = writer.input_shape()
        meta = {
            "format": FORMAT_VERSION,
            "key": key,
            "where": where,
            "num_classes": num_classes,
            "input_shape": list(shape),
            "parts": parts,
        }
        (temp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        final = root / entry
        if final.exists():
            _discard(final)
        os.rename(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    rows = {part: int(facts["rows"]) for part, facts in parts.items()}
    return Stored(where, num_classes, shape, rows, final)


class _PartWriter:
    """Writes each part's rows as they come: a parser may hand a part over in many batches
    (a table's row groups, a folder's images), so that no part is ever whole in memory.

    Features go to ``<part>.x.raw`` as they arrive and become ``<part>.x.npy`` (header, then
    the raw bytes copied in blocks) when the parse is over; labels (8 bytes a row) are kept.
    """

    _BLOCK = 16 << 20

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.raw: dict[str, Any] = {}
        self.labels: dict[str, list[np.ndarray]] = {}
        self.rows: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

    def __enter__(self) -> _PartWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.raw.values():
            handle.close()

    def sink(self, part: str, x: np.ndarray, y: np.ndarray) -> None:
        x, y = _typed(x, y)
        shape = tuple(int(size) for size in x.shape[1:])
        known = self.shapes.setdefault(part, shape)
        if known != shape or len(x) != len(y):
            raise ValueError(
                f"part {part!r} got rows of shape {shape} ({len(x)} rows, {len(y)} labels) "
                f"after rows of shape {known}"
            )
        if part not in self.raw:
            self.raw[part] = (self.folder / f"{part}.x.raw").open("wb")
            self.labels[part] = []
            self.rows[part] = 0
        if x.size:
            self.raw[part].write(x.tobytes())
        self.labels[part].append(y)
        self.rows[part] += len(y)

    def input_shape(self) -> tuple[int, ...]:
        return next(iter(self.shapes.values()))

    def finish(self) -> dict[str, dict[str, Any]]:
        """Turns every part's raw features into ``.npy`` files; returns each part's facts."""
        parts: dict[str, dict[str, Any]] = {}
        for part, handle in self.raw.items():
            handle.close()
            raw = self.folder / f"{part}.x.raw"
            shape = (self.rows[part], *self.shapes[part])
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32))}
            with (self.folder / f"{part}.x.npy").open("wb") as out, raw.open("rb") as source:
                np.lib.format.write_array_header_1_0(
                    out, {**header, "fortran_order": False, "shape": shape}
                )
                shutil.copyfileobj(source, out, self._BLOCK)
            raw.unlink()
            labels = np.concatenate(self.labels[part]) if self.labels[part] else np.empty(0)
            labels = labels.astype(np.int64)
            np.save(self.folder / f"{part}.y.npy", labels, allow_pickle=False)
            parts[part] = {"rows": self.rows[part], "y_sha256": _digest(labels)}
        return parts


def _in_memory(parse: Parser) -> Stored:
    """Parses the source into memory, for this process only."""
    pieces: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def sink(part: str, x: np.ndarray, y: np.ndarray) -> None:
        pieces.setdefault(part, []).append(_typed(x, y))

    num_classes, where = _parse(parse, sink)
    held = {
        part: (
            _frozen(np.concatenate([x for x, _ in batches])),
            _frozen(np.concatenate([y for _, y in batches])),
        )
        for part, batches in pieces.items()
    }
    shape = next(iter(held.values()))[0].shape[1:]
    rows = {part: len(y) for part, (_, y) in held.items()}
    return Stored(where, num_classes, tuple(int(s) for s in shape), rows, memory=held)


def _parse(parse: Parser, sink: Sink) -> tuple[int, str]:
    """Runs a parser, counts the parse and logs it."""
    num_classes, where = parse(sink)
    _Parses.count += 1
    log.info("Parsed the data source %s (cache miss).", where)
    return num_classes, where


def _typed(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The arrays as the cache holds them: float32 features and int64 labels, C-ordered."""
    return (
        np.ascontiguousarray(x, dtype=np.float32),
        np.ascontiguousarray(y, dtype=np.int64),
    )


def _digest(labels: np.ndarray) -> str:
    """The SHA-256 of an int64 label array's bytes."""
    return hashlib.sha256(np.ascontiguousarray(labels, dtype=np.int64).tobytes()).hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Holds an exclusive ``flock`` on ``path`` (created if need be); the kernel releases it
    if the process dies."""
    handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)


def _discard(folder: Path) -> None:
    """Moves a cached folder aside, then deletes it (a process that maps its files keeps
    reading them)."""
    aside = folder.with_name(f".{folder.name}.stale-{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(folder, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _prune(root: Path, written: str, key: Mapping[str, Any]) -> None:
    """Removes what no process can use any more: cached folders of an NpzFolder whose folder
    is gone or that ``key`` (the same folder, changed) supersedes, and writers' temporary
    folders left for a day. Called under the lock; never fails."""
    path = key.get("path")
    try:
        children = list(root.iterdir())
    except OSError:
        return
    for child in children:
        try:
            if child.name.startswith("."):
                leftover = ".tmp-" in child.name or ".stale-" in child.name
                if leftover and time.time() - child.stat().st_mtime > _STALE_SECONDS:
                    shutil.rmtree(child, ignore_errors=True)
                continue
            if child.name == written or not child.is_dir():
                continue
            meta = json.loads((child / "meta.json").read_text(encoding="utf-8"))
            source = meta["key"].get("path")
            if source is None or (source != path and Path(source).is_dir()):
                continue
            _discard(child)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue


def _frozen(array: np.ndarray) -> np.ndarray:
    """Marks an array read-only."""
    array.flags.writeable = False
    return array

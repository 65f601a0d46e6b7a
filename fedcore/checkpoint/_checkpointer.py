"""Checkpoints: a state tree split into JSON and tensors, published by a manifest written last.

Layout under the store, per checkpoint::

    round-00000005/state.json           the state tree, tensors replaced by references
    round-00000005/tensors.safetensors  every tensor of the tree (safetensors: no pickle)
    round-00000005/MANIFEST.json        written last: round, run, fingerprint, sha256 per part
    round-00000005/KEEP                 optional: a mark that exempts it from pruning

A checkpoint without a valid manifest (half-written) is never read; one whose parts fail their
checksum, or that belongs to another run, is refused and the previous good one is used. The
tensors are streamed to the store and read back into one buffer, so a checkpoint needs little
memory beyond the state itself. The KDC uses the same format under its own prefix, with
``series="version"`` (its state has versions, not rounds).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedcore.checkpoint._objects import ObjectStore
from fedcore.checkpoint._tensors import TensorFile, read_tensors
from fedcore.errors import CheckpointError

log = logging.getLogger(__name__)

FORMAT = "fedcore-checkpoint"
VERSION = 1
TENSOR_REF = "__tensor__"
PARTS = ("state.json", "tensors.safetensors")
MANIFEST = "MANIFEST.json"
MARK = "KEEP"
"""The object that marks a checkpoint to keep: retention never prunes it."""


@dataclass(frozen=True)
class CheckpointInfo:
    """Where a checkpoint went.

    Attributes:
        round: the last completed round it holds (the state's version for the KDC).
        location: the store and key prefix, for messages and status.
        bytes: the total size of its parts.
        marked: whether it is marked to keep.
    """

    round: int
    location: str
    bytes: int
    marked: bool = False


class Checkpointer:
    """Saves and loads state trees (dicts, lists, JSON scalars and numpy arrays) in a store.

    Retention keeps the ``keep_last`` newest checkpoints, every checkpoint whose number is a
    multiple of ``keep_every`` (0: none), and every marked one (``mark``).

    Args:
        store: where the objects go.
        run: the run's name, recorded and checked on load.
        fingerprint: a digest of the spec fields a resume must not change, checked on load.
        keep_last: how many most recent checkpoints to keep.
        keep_every: keep every checkpoint whose number is a multiple of this (0: off).
        series: the folder name of each checkpoint: ``round`` (server) or ``version`` (KDC).
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        run: str,
        fingerprint: str,
        keep_last: int,
        keep_every: int = 0,
        series: str = "round",
    ) -> None:
        if keep_last < 1 or keep_every < 0:
            raise ValueError("keep_last must be at least 1 and keep_every at least 0.")
        if not re.fullmatch(r"[a-z]+", series):
            raise ValueError(f"series must be lowercase letters, not {series!r}.")
        self.store = store
        self.run = run
        self.fingerprint = fingerprint
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.series = series
        self._key = re.compile(rf"^{series}-(\d{{8}})/(.+)$")

    def _prefix(self, number: int) -> str:
        return f"{self.series}-{number:08d}/"

    def _at(self, number: int) -> str:
        """Names a checkpoint in messages: ``round 5``, ``version 3``."""
        return f"{self.series} {number}"

    # ---------------------------------------------------------------------- writing

    def save(self, round: int, state: Mapping[str, Any]) -> CheckpointInfo:
        """Writes a checkpoint of ``state`` after ``round``, then prunes old ones.

        The parts go first (the tensors streamed), the manifest with their checksums last.

        Raises:
            CheckpointError: the state cannot be checkpointed or a part could not be written;
                earlier checkpoints are intact.
        """
        tree, tensors = split_tensors(state)
        try:
            state_json = json.dumps(tree, allow_nan=False).encode("utf-8")
        except ValueError as exc:
            raise CheckpointError(
                f"The state of {self._at(round)} holds a NaN or infinite number outside a tensor: "
                f"{exc}."
            ) from exc
        layout = TensorFile.of(tensors)
        prefix = self._prefix(round)
        self.store.put(prefix + PARTS[0], state_json)
        digest = hashlib.sha256()

        def hashed() -> Iterator[memoryview]:
            for chunk in layout.chunks():
                digest.update(chunk)
                yield chunk

        written = self.store.put_stream(prefix + PARTS[1], hashed())
        if written != layout.size:
            raise CheckpointError(
                f"The tensors of {self._at(round)} came out as {written} bytes, not {layout.size}."
            )
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "run": self.run,
            "fingerprint": self.fingerprint,
            "round": round,
            "parts": {
                PARTS[0]: {
                    "sha256": hashlib.sha256(state_json).hexdigest(),
                    "bytes": len(state_json),
                },
                PARTS[1]: {"sha256": digest.hexdigest(), "bytes": written},
            },
        }
        self.store.put(prefix + MANIFEST, json.dumps(manifest, indent=1).encode("utf-8"))
        try:
            marked = self._prune(round)
        except CheckpointError as exc:
            log.warning("Pruning old checkpoints failed (retried after the next one): %s", exc)
            marked = False
        return CheckpointInfo(
            round=round,
            location=self.store.url(prefix),
            bytes=len(state_json) + written,
            marked=marked,
        )

    def mark(self, round: int, note: str = "") -> None:
        """Marks the checkpoint of ``round`` to keep: retention never prunes it.

        Raises:
            CheckpointError: there is no published checkpoint of that round.
        """
        if round not in self.rounds():
            raise CheckpointError(
                f"There is no checkpoint of {self._at(round)} in {self.store.describe()} "
                f"to mark (have: {self.rounds() or 'none'})."
            )
        body = {"marked": True, "time": time.time(), "note": note}
        self.store.put(self._prefix(round) + MARK, json.dumps(body).encode("utf-8"))

    def unmark(self, round: int) -> bool:
        """Removes the mark of ``round``; returns whether it was marked."""
        was = self._is_marked(round)
        self.store.delete([self._prefix(round) + MARK])
        return was

    def _is_marked(self, round: int) -> bool:
        return self._prefix(round) + MARK in self.store.list(self._prefix(round))

    # ---------------------------------------------------------------------- reading

    def _numbers(self) -> dict[int, set[str]]:
        """Every checkpoint folder in the store and the names of the objects in it."""
        found: dict[int, set[str]] = {}
        for key in self.store.list(f"{self.series}-"):
            match = self._key.match(key)
            if match:
                found.setdefault(int(match.group(1)), set()).add(match.group(2))
        return found

    def rounds(self) -> list[int]:
        """Returns the rounds that have a published manifest, ascending."""
        return sorted(n for n, names in self._numbers().items() if MANIFEST in names)

    def marked(self) -> list[int]:
        """Returns the published rounds marked to keep, ascending."""
        return sorted(
            n for n, names in self._numbers().items() if MANIFEST in names and MARK in names
        )

    def entries(self) -> list[CheckpointInfo]:
        """Describes every published checkpoint (from its manifest; nothing is verified)."""
        numbers = self._numbers()
        infos = []
        for number in sorted(n for n, names in numbers.items() if MANIFEST in names):
            prefix = self._prefix(number)
            try:
                manifest = json.loads(self.store.get(prefix + MANIFEST))
                size = sum(int(part["bytes"]) for part in manifest["parts"].values())
            except (ValueError, KeyError, TypeError, AttributeError, CheckpointError):
                size = -1
            infos.append(
                CheckpointInfo(
                    round=number,
                    location=self.store.url(prefix),
                    bytes=size,
                    marked=MARK in numbers[number],
                )
            )
        return infos

    def load_latest(self) -> tuple[int, dict[str, Any]] | None:
        """Returns (round, state) of the newest checkpoint that verifies, or None if none does.

        Damaged or foreign checkpoints are skipped with a warning naming why.
        """
        for round in reversed(self.rounds()):
            try:
                return round, self.load(round)
            except CheckpointError as exc:
                log.warning("Skipping the checkpoint of %s %d: %s", self.series, round, exc)
        return None

    def load(self, round: int) -> dict[str, Any]:
        """Returns the state saved after ``round``.

        Raises:
            CheckpointError: the manifest or a part is missing, damaged or from another run.
        """
        prefix = self._prefix(round)
        try:
            manifest = json.loads(self.store.get(prefix + MANIFEST))
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"The manifest of {self._at(round)} is not valid JSON.") from exc
        self._check_manifest(manifest, round)
        entries = manifest["parts"]
        state_json = self.store.get(prefix + PARTS[0])
        self._check_part(PARTS[0], round, state_json, entries[PARTS[0]])
        try:
            buffer = self.store.read_exact(prefix + PARTS[1], int(entries[PARTS[1]]["bytes"]))
        except CheckpointError as exc:
            raise CheckpointError(
                f"The part {PARTS[1]} of {self._at(round)} cannot be read as written: {exc}"
            ) from exc
        self._check_part(PARTS[1], round, buffer, entries[PARTS[1]])
        try:
            tree = json.loads(state_json)
            tensors = read_tensors(buffer, what=f"The part {PARTS[1]} of {self._at(round)}")
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"The checkpoint of {self._at(round)} cannot be decoded: {exc}."
            ) from exc
        result: dict[str, Any] = join_tensors(tree, tensors, copy=False)
        return result

    def _check_part(self, name: str, round: int, data: bytes | bytearray, entry: Any) -> None:
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.get("sha256") or len(data) != entry.get("bytes"):
            raise CheckpointError(
                f"The part {name} of {self._at(round)} fails its checksum (damaged or replaced)."
            )

    def _check_manifest(self, manifest: Any, round: int) -> None:
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"The object at {self._at(round)} is not a fedcore checkpoint.")
        if manifest.get("version") != VERSION:
            raise CheckpointError(
                f"The checkpoint of {self._at(round)} has format version "
                f"{manifest.get('version')!r}; this fedcore reads version {VERSION}."
            )
        if manifest.get("run") != self.run or manifest.get("fingerprint") != self.fingerprint:
            raise CheckpointError(
                f"The checkpoint of {self._at(round)} belongs to run {manifest.get('run')!r} with "
                f"another spec; it is not a checkpoint of this run ({self.run!r})."
            )
        if manifest.get("round") != round:
            raise CheckpointError(
                f"The manifest in the folder of {self._at(round)} says {self.series} "
                f"{manifest.get('round')!r} (moved or replaced)."
            )
        parts = manifest.get("parts")
        if (
            not isinstance(parts, dict)
            or set(parts) != set(PARTS)
            or not all(isinstance(entry, dict) for entry in parts.values())
        ):
            raise CheckpointError(f"The manifest of {self._at(round)} lists the wrong parts.")

    # ---------------------------------------------------------------------- retention

    def _keeps(self, rounds: list[int], marked: set[int]) -> set[int]:
        keep = set(rounds[-self.keep_last :]) | marked
        if self.keep_every:
            keep |= {n for n in rounds if n % self.keep_every == 0}
        return keep

    def _prune(self, newest: int) -> bool:
        """Deletes what retention does not keep, and the leftovers of failed writes older
        than ``newest`` (folders that never got a manifest); returns whether ``newest`` is
        marked."""
        numbers = self._numbers()
        rounds = sorted(n for n, names in numbers.items() if MANIFEST in names)
        marked = {n for n in rounds if MARK in numbers[n]}
        keep = self._keeps(rounds, marked)
        for number in rounds:
            if number in keep:
                continue
            prefix = self._prefix(number)
            # Unpublish first, so a crash mid-prune never leaves a manifest without its parts.
            self.store.delete([prefix + MANIFEST])
            self.store.delete([prefix + name for name in sorted(numbers[number] - {MANIFEST})])
        for number, names in numbers.items():
            if MANIFEST not in names and number < newest:
                self.store.delete([self._prefix(number) + name for name in sorted(names)])
        return newest in marked


def split_tensors(state: Mapping[str, Any]) -> tuple[Any, dict[str, np.ndarray]]:
    """Replaces every array in a state tree by a reference; returns (tree, tensors by path).

    Raises:
        CheckpointError: the tree holds something that is neither JSON nor an array.
    """
    tensors: dict[str, np.ndarray] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, np.ndarray):
            # asarray, not ascontiguousarray: the latter turns a 0-d array into shape (1,).
            tensors[path] = np.asarray(value, order="C")
            return {TENSOR_REF: path}
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, Mapping):
            for key in value:
                if not isinstance(key, str):
                    raise CheckpointError(
                        f"The state key {key!r} at {path or '<root>'} is not a string."
                    )
            return {
                key: walk(item, f"{path}/{key}" if path else key) for key, item in value.items()
            }
        if isinstance(value, list | tuple):
            return [walk(item, f"{path}/{i}") for i, item in enumerate(value)]
        if value is None or isinstance(value, bool | int | float | str):
            return value
        raise CheckpointError(
            f"The state value at {path or '<root>'} is a {type(value).__name__}; only JSON "
            f"values and numpy arrays can be checkpointed."
        )

    return walk(state, ""), tensors


def join_tensors(tree: Any, tensors: Mapping[str, np.ndarray], *, copy: bool = True) -> Any:
    """Inverse of ``split_tensors``; ``copy=False`` puts the given arrays in the tree as they
    are (for arrays the caller owns, e.g. freshly read ones).

    Raises:
        CheckpointError: a reference names a tensor that is not there.
    """
    if isinstance(tree, dict):
        if set(tree) == {TENSOR_REF}:
            path = tree[TENSOR_REF]
            if path not in tensors:
                raise CheckpointError(f"The checkpoint refers to a missing tensor {path!r}.")
            return np.array(tensors[path], copy=True) if copy else tensors[path]
        return {key: join_tensors(value, tensors, copy=copy) for key, value in tree.items()}
    if isinstance(tree, list):
        return [join_tensors(value, tensors, copy=copy) for value in tree]
    return tree

"""Checkpoints: a state tree split into JSON and tensors, published by a manifest written last.

Layout under the store, per checkpoint::

    round-00000005/state.json           the state tree, tensors replaced by references
    round-00000005/tensors.safetensors  every tensor of the tree (safetensors: no pickle)
    round-00000005/MANIFEST.json        written last: round, run, fingerprint, sha256 per part

A checkpoint without a valid manifest (half-written) is never read; one whose parts fail their
checksum, or that belongs to another run, is refused and the previous good one is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors

from fedcore.checkpoint._objects import ObjectStore
from fedcore.errors import CheckpointError

log = logging.getLogger(__name__)

FORMAT = "fedcore-checkpoint"
VERSION = 1
TENSOR_REF = "__tensor__"
_ROUND_DIR = re.compile(r"^round-(\d{8})/MANIFEST\.json$")


@dataclass(frozen=True)
class CheckpointInfo:
    """Where a checkpoint went.

    Attributes:
        round: the last completed round it holds.
        location: the store and key prefix, for messages and status.
        bytes: the total size of its parts.
    """

    round: int
    location: str
    bytes: int


class Checkpointer:
    """Saves and loads state trees (dicts, lists, JSON scalars and numpy arrays) in a store.

    Args:
        store: where the objects go.
        run: the run's name, recorded and checked on load.
        fingerprint: a digest of the spec fields a resume must not change, checked on load.
        keep_last: how many most recent checkpoints to keep.
    """

    def __init__(self, store: ObjectStore, *, run: str, fingerprint: str, keep_last: int) -> None:
        self.store = store
        self.run = run
        self.fingerprint = fingerprint
        self.keep_last = keep_last

    def save(self, round: int, state: Mapping[str, Any]) -> CheckpointInfo:
        """Writes a checkpoint of ``state`` after ``round``, then prunes old ones.

        Raises:
            CheckpointError: a part could not be written; earlier checkpoints are intact.
        """
        tree, tensors = split_tensors(state)
        parts = {
            "state.json": json.dumps(tree, allow_nan=False).encode("utf-8"),
            "tensors.safetensors": save_tensors(tensors) if tensors else save_tensors({}),
        }
        prefix = f"round-{round:08d}/"
        for name, data in parts.items():
            self.store.put(prefix + name, data)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "run": self.run,
            "fingerprint": self.fingerprint,
            "round": round,
            "parts": {
                name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
                for name, data in parts.items()
            },
        }
        self.store.put(prefix + "MANIFEST.json", json.dumps(manifest, indent=1).encode("utf-8"))
        self._prune()
        return CheckpointInfo(
            round=round,
            location=f"{self.store.describe()}/{prefix}",
            bytes=sum(len(data) for data in parts.values()),
        )

    def rounds(self) -> list[int]:
        """Returns the rounds that have a published manifest, ascending."""
        found = []
        for key in self.store.list("round-"):
            match = _ROUND_DIR.match(key)
            if match:
                found.append(int(match.group(1)))
        return sorted(found)

    def load_latest(self) -> tuple[int, dict[str, Any]] | None:
        """Returns (round, state) of the newest checkpoint that verifies, or None if none does.

        Damaged or foreign checkpoints are skipped with a warning naming why.
        """
        for round in reversed(self.rounds()):
            try:
                return round, self.load(round)
            except CheckpointError as exc:
                log.warning("Skipping the checkpoint of round %d: %s", round, exc)
        return None

    def load(self, round: int) -> dict[str, Any]:
        """Returns the state saved after ``round``.

        Raises:
            CheckpointError: the manifest or a part is missing, damaged or from another run.
        """
        prefix = f"round-{round:08d}/"
        try:
            manifest = json.loads(self.store.get(prefix + "MANIFEST.json"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"The manifest of round {round} is not valid JSON.") from exc
        self._check_manifest(manifest, round)
        parts: dict[str, bytes] = {}
        for name, entry in manifest["parts"].items():
            data = self.store.get(prefix + name)
            digest = hashlib.sha256(data).hexdigest()
            if digest != entry.get("sha256") or len(data) != entry.get("bytes"):
                raise CheckpointError(
                    f"The part {name} of round {round} fails its checksum (damaged or replaced)."
                )
            parts[name] = data
        try:
            tree = json.loads(parts["state.json"])
            tensors = load_tensors(parts["tensors.safetensors"])
        except Exception as exc:
            raise CheckpointError(
                f"The checkpoint of round {round} cannot be decoded: {exc}."
            ) from exc
        return join_tensors(tree, tensors)

    def _check_manifest(self, manifest: Any, round: int) -> None:
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"The object at round {round} is not a fedcore checkpoint.")
        if manifest.get("version") != VERSION:
            raise CheckpointError(
                f"The checkpoint of round {round} has format version {manifest.get('version')!r}; "
                f"this fedcore reads version {VERSION}."
            )
        if manifest.get("run") != self.run or manifest.get("fingerprint") != self.fingerprint:
            raise CheckpointError(
                f"The checkpoint of round {round} belongs to run {manifest.get('run')!r} with "
                f"another spec; it is not a checkpoint of this run ({self.run!r})."
            )
        parts = manifest.get("parts")
        if not isinstance(parts, dict) or set(parts) != {"state.json", "tensors.safetensors"}:
            raise CheckpointError(f"The manifest of round {round} lists the wrong parts.")

    def _prune(self) -> None:
        rounds = self.rounds()
        for old in rounds[: max(0, len(rounds) - self.keep_last)]:
            prefix = f"round-{old:08d}/"
            keys = self.store.list(prefix)
            manifest = [k for k in keys if k.endswith("MANIFEST.json")]
            # Unpublish first, so a crash mid-prune never leaves a manifest without its parts.
            self.store.delete(manifest)
            self.store.delete([k for k in keys if k not in manifest])


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


def join_tensors(tree: Any, tensors: Mapping[str, np.ndarray]) -> Any:
    """Inverse of ``split_tensors``.

    Raises:
        CheckpointError: a reference names a tensor that is not there.
    """
    if isinstance(tree, dict):
        if set(tree) == {TENSOR_REF}:
            path = tree[TENSOR_REF]
            if path not in tensors:
                raise CheckpointError(f"The checkpoint refers to a missing tensor {path!r}.")
            return np.array(tensors[path], copy=True)
        return {key: join_tensors(value, tensors) for key, value in tree.items()}
    if isinstance(tree, list):
        return [join_tensors(value, tensors) for value in tree]
    return tree

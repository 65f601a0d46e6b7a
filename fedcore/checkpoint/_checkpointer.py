"""Checkpoints: a state tree split into JSON and tensors, published by a manifest written last.

Layout under the store, per checkpoint::

    round-00000005/state.json           the state tree, tensors replaced by references
    round-00000005/tensors.safetensors  every tensor of the tree (safetensors: no pickle)
    round-00000005/MANIFEST.json        written last: run, fingerprint, round, sha256 per part,
                                        and an HMAC-SHA256 tag over all of it
    round-00000005/KEEP                 optional: a mark that exempts it from pruning
    latest-round.json                   the signed record of the newest checkpoint written

A checkpointer with a key (the server's, the KDC's, a decentralized client's own) signs every
manifest with a key that is not in the store, and after each manifest writes a signed latest
record naming that checkpoint (its round and its manifest's sha256). Loading checks the tag,
then every part's sha256, then (the KDC) decrypts the parts (AES-256-GCM, associated data: run,
fingerprint, series, round, part). ``load_latest`` resumes from the checkpoint the record names
(or the one written right after it, if the writer stopped between the manifest and the record)
and refuses, naming the round and why, when that checkpoint or a newer one fails verification,
is missing, or the record is: an older checkpoint is never taken in its place silently.
``rollback`` takes an older one knowingly. What a writer of the store can still do is documented
in docs/operations.md.

A checkpointer without a key reads and writes the unsigned format of version 1 (every fedcore's
before signed checkpoints; the tools list with it): a checkpoint without a valid manifest
(half-written) is never read, one whose parts fail their checksum or that belongs to another run is
skipped and the previous good one is used. The tensors are streamed to the store and read back
into one buffer, so a checkpoint needs little memory beyond the state itself; encrypted (the
KDC's, a decentralized client's), they are sealed in chunks of 4 MiB as they stream and opened
in place. The KDC uses the same format under its own prefix, with ``series="version"`` (its
state has versions, not rounds).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedcore.checkpoint._keys import NONCE_BYTES, TAG_BYTES, SealKey
from fedcore.checkpoint._objects import ObjectStore
from fedcore.checkpoint._tensors import TensorFile, read_tensors
from fedcore.errors import CheckpointError

log = logging.getLogger(__name__)

FORMAT = "fedcore-checkpoint"
VERSION = 2
"""Signed manifests (a key outside the store)."""
UNSIGNED_VERSION = 1
"""Unsigned manifests: checkpointers without a key, and every fedcore before version 2."""
LATEST_FORMAT = "fedcore-checkpoint-latest"
ENCRYPTION = "AES-256-GCM"
"""Each part one AES-256-GCM message (the KDC's, before 2026-11-27; still read)."""
CHUNKED_ENCRYPTION = "AES-256-GCM-CHUNKS"
"""The state part one AES-256-GCM message, the tensors part a sequence of them, each
``CHUNK_BYTES`` of plaintext (the last shorter), so that a part of any size streams and no
message exceeds what one AES-GCM call takes (2 GiB). What every encrypting writer writes."""
CHUNK_BYTES = 4 << 20
TENSOR_REF = "__tensor__"
PARTS = ("state.json", "tensors.safetensors")
MANIFEST = "MANIFEST.json"
MARK = "KEEP"
"""The object that marks a checkpoint to keep: retention never prunes it."""
MANIFEST_DOMAIN = b"fedcore-checkpoint-manifest"
LATEST_DOMAIN = b"fedcore-checkpoint-latest"


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


@dataclass(frozen=True)
class LatestRecord:
    """The newest checkpoint a keyed writer wrote: its round and its manifest's sha256."""

    round: int
    manifest_sha256: str


class CheckpointShortOfSpace(CheckpointError):
    """The store's disk has less free space than a checkpoint needs; nothing was written."""

    def __init__(self, message: str, *, needed: int, free: int) -> None:
        self.needed = needed
        self.free = free
        super().__init__(message)


SPACE_MARGIN = 1 << 20
"""Bytes a checkpoint is assumed to need beyond its parts (manifest, latest record, the file
system's own blocks)."""


class CheckpointRefused(CheckpointError):
    """A checkpoint (or the latest record) fails verification, is missing, or is not the one to
    resume from; ``round`` names it (None: the latest record), ``reason`` says why."""

    def __init__(self, message: str, *, round: int | None, reason: str) -> None:
        self.round = round
        self.reason = reason
        super().__init__(message)


class Checkpointer:
    """Saves and loads state trees (dicts, lists, JSON scalars and numpy arrays) in a store.

    Retention keeps the ``keep_last`` newest checkpoints, every checkpoint whose number is a
    multiple of ``keep_every`` (0: none), and every marked one (``mark``). With a key, a save
    also deletes the unmarked checkpoints numbered after it: they are left from an earlier run
    in the same store (a run started afresh writes over what was there).

    Args:
        store: where the objects go.
        run: the run's name, recorded and checked on load.
        fingerprint: a digest of the spec fields a resume must not change, checked on load.
        keep_last: how many most recent checkpoints to keep.
        keep_every: keep every checkpoint whose number is a multiple of this (0: off).
        series: the folder name of each checkpoint: ``round`` (server) or ``version`` (KDC).
        key: the 32-byte key that signs (and with ``encrypt``, encrypts) the checkpoints; it
            must not be in the store. None: unsigned checkpoints (format version 1).
        encrypt: encrypt the parts with AES-256-GCM under a key derived from ``key``.
        selector: the options of ``fedcore checkpoint`` that pick these checkpoints, for the
            commands its refusals suggest (default: ``--kdc`` for ``version``, else none).
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
        key: bytes | None = None,
        encrypt: bool = False,
        selector: str | None = None,
    ) -> None:
        if keep_last < 1 or keep_every < 0:
            raise ValueError("keep_last must be at least 1 and keep_every at least 0.")
        if not re.fullmatch(r"[a-z]+", series):
            raise ValueError(f"series must be lowercase letters, not {series!r}.")
        if encrypt and key is None:
            raise ValueError("encrypt needs a key.")
        self.store = store
        self.run = run
        self.fingerprint = fingerprint
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.series = series
        self.latest_name = f"latest-{series}.json"
        self.selector = ("--kdc" if series == "version" else "") if selector is None else selector
        self._seal = None if key is None else SealKey(key, encrypt=encrypt)
        self._head: LatestRecord | None = None
        """The checkpoint this writer last wrote or resumed from (the next one's predecessor)."""
        self._key = re.compile(rf"^{series}-(\d{{8}})/(.+)$")

    @property
    def signed(self) -> bool:
        """Whether this checkpointer signs and verifies its checkpoints (it has a key)."""
        return self._seal is not None

    @property
    def key_id(self) -> str | None:
        """The id of this checkpointer's key (a digest that reveals nothing of it)."""
        return None if self._seal is None else self._seal.key_id

    def _prefix(self, number: int) -> str:
        return f"{self.series}-{number:08d}/"

    def _at(self, number: int) -> str:
        """Names a checkpoint in messages: ``round 5``, ``version 3``."""
        return f"{self.series} {number}"

    def _associated(self, number: int, part: str) -> bytes:
        """The associated data of an encrypted part: what it belongs to."""
        return _canonical(
            {
                "format": FORMAT,
                "run": self.run,
                "fingerprint": self.fingerprint,
                "series": self.series,
                "round": number,
                "part": part,
            }
        )

    # ---------------------------------------------------------------------- writing

    def save(self, round: int, state: Mapping[str, Any]) -> CheckpointInfo:
        """Writes a checkpoint of ``state`` after ``round``, then prunes old ones.

        The parts go first (the tensors streamed, unless encrypted), the manifest with their
        checksums (signed) next, then, with a key, the latest record naming it.

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
        needed = layout.size + len(state_json) + SPACE_MARGIN
        free = self.store.free_bytes()
        if free is not None and free < needed:
            raise CheckpointShortOfSpace(
                f"The checkpoint of {self._at(round)} needs about {needed:,} bytes but "
                f"{self.store.describe()} has {free:,} free; nothing was written.",
                needed=needed,
                free=free,
            )
        try:
            parts = self._write_parts(round, state_json, layout)
        except CheckpointError as exc:
            self._discard(round)
            raise self._explained(exc, round, needed) from exc
        except BaseException:
            self._discard(round)
            raise
        self._publish(round, parts, needed)
        try:
            marked = self._prune(round)
        except CheckpointError as exc:
            log.warning("Pruning old checkpoints failed (retried after the next one): %s", exc)
            marked = False
        return CheckpointInfo(
            round=round,
            location=self.store.url(prefix),
            bytes=sum(int(entry["bytes"]) for entry in parts.values()),
            marked=marked,
        )

    def _discard(self, round: int) -> None:
        """Removes what a failed write of ``round``'s parts left (best effort): the next
        ``--resume`` then finds the checkpoint before it, whole, and nothing half-written."""
        prefix = self._prefix(round)
        try:
            self.store.delete(self.store.list(prefix) + self.store.temporaries(prefix))
        except (CheckpointError, OSError) as exc:
            log.warning("Could not remove the partial checkpoint %s: %s", prefix, exc)

    def _explained(self, exc: CheckpointError, round: int, needed: int) -> CheckpointError:
        """``exc``, said plainly when the disk is full: how much is needed and what to do."""
        cause = exc.__cause__
        if not (isinstance(cause, OSError) and cause.errno == errno.ENOSPC):
            return exc
        free = self.store.free_bytes()
        good = [n for n in self.rounds() if n < round]
        then = (
            f"`fedcore run --resume` continues from {self._at(good[-1])}"
            if good
            else "the run starts again from the beginning"
        )
        return CheckpointError(
            f"{exc} The disk is full: the checkpoint of {self._at(round)} needs about "
            f"{needed:,} bytes, {'an unknown amount' if free is None else f'{free:,} bytes'} "
            f"is free. Its partial files were removed; free space, then {then}."
        )

    def _write_parts(self, round: int, state_json: bytes, layout: TensorFile) -> dict[str, Any]:
        """Writes the state and the tensors of ``round``; returns their manifest entries."""
        prefix = self._prefix(round)
        seal = self._seal
        chunks: Iterator[bytes | memoryview] = layout.chunks()
        expected = layout.size
        if seal is not None and seal.encrypts:
            state_json = seal.encrypt(state_json, self._associated(round, PARTS[0]))
            associated = self._associated(round, PARTS[1])
            chunks = (
                seal.encrypt(block, _chunk_associated(associated, index, last))
                for index, block, last in _blocks(layout.chunks(), CHUNK_BYTES)
            )
            expected = _sealed_size(layout.size, CHUNK_BYTES)
        self.store.put(prefix + PARTS[0], state_json)
        digest = hashlib.sha256()

        def hashed() -> Iterator[bytes | memoryview]:
            for chunk in chunks:
                digest.update(chunk)
                yield chunk

        written = self.store.put_stream(prefix + PARTS[1], hashed())
        if written != expected:
            raise CheckpointError(
                f"The tensors of {self._at(round)} came out as {written} bytes, not {expected}."
            )
        return {
            PARTS[0]: _entry_of(state_json),
            PARTS[1]: {"sha256": digest.hexdigest(), "bytes": written},
        }

    def _publish(self, round: int, parts: dict[str, Any], needed: int) -> None:
        """Writes the manifest of ``round`` (which publishes it) and, with a key, the latest
        record naming it. A manifest that cannot be written leaves nothing of the round."""
        prefix = self._prefix(round)
        seal = self._seal
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "version": UNSIGNED_VERSION if seal is None else VERSION,
            "run": self.run,
            "fingerprint": self.fingerprint,
            "round": round,
            "parts": parts,
        }
        if seal is not None:
            manifest.update(
                series=self.series,
                time=int(time.time()),
                key_id=seal.key_id,
                encryption=CHUNKED_ENCRYPTION if seal.encrypts else None,
                previous=None
                if self._head is None
                else {"round": self._head.round, "manifest_sha256": self._head.manifest_sha256},
            )
            manifest["tag"] = seal.tag(MANIFEST_DOMAIN, _canonical(manifest))
        body = json.dumps(manifest, indent=1).encode("utf-8")
        try:
            self.store.put(prefix + MANIFEST, body)
        except CheckpointError as exc:
            self._discard(round)
            raise self._explained(exc, round, needed) from exc
        if seal is not None:
            record = LatestRecord(round, hashlib.sha256(body).hexdigest())
            self._write_latest(record)
            self._head = record

    def _write_latest(self, record: LatestRecord) -> None:
        assert self._seal is not None
        body: dict[str, Any] = {
            "format": LATEST_FORMAT,
            "version": VERSION,
            "run": self.run,
            "fingerprint": self.fingerprint,
            "series": self.series,
            "round": record.round,
            "manifest_sha256": record.manifest_sha256,
            "key_id": self._seal.key_id,
            "time": int(time.time()),
        }
        body["tag"] = self._seal.tag(LATEST_DOMAIN, _canonical(body))
        self.store.put(self.latest_name, json.dumps(body, indent=1).encode("utf-8"))

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

    def load(self, round: int) -> dict[str, Any]:
        """Returns the state saved after ``round``, verified.

        Raises:
            CheckpointRefused: with a key: the manifest is missing, unsigned, its tag does not
                verify (tampered, or another key), it is of another run, spec or round, a part
                fails its checksum or does not decrypt.
            CheckpointError: without a key: the manifest or a part is missing, damaged, from
                another run, or signed (reading it needs its key).
        """
        if self._seal is None:
            return self._load_unsigned(round)
        state, _ = self._load_signed(round)
        return state

    def load_latest(self) -> tuple[int, dict[str, Any]] | None:
        """Returns (round, state) of the checkpoint to resume from, or None if the store holds
        none (and no latest record).

        With a key: the checkpoint the latest record names, or the one written right after it
        (whose manifest names it as its predecessor); the choice is logged. Without a key: the
        newest checkpoint that verifies; damaged or foreign ones are skipped with a warning.

        Raises:
            CheckpointRefused: with a key: the checkpoint to resume from, or one newer than it,
                fails verification or is missing, or the latest record is missing or fails;
                the message names the round, why, and the newest older one that verifies.
        """
        if self._seal is None:
            for round in reversed(self.rounds()):
                try:
                    return round, self.load(round)
                except CheckpointError as exc:
                    log.warning("Skipping the checkpoint of %s %d: %s", self.series, round, exc)
            return None
        return self._resume()

    def latest_record(self) -> LatestRecord | None:
        """Returns the latest record, verified (None: there is none).

        Raises:
            CheckpointRefused: it cannot be read, is malformed, or its tag does not verify.
        """
        seal = self._seal
        if seal is None:
            raise CheckpointError("Reading the latest record needs the checkpoint key.")
        where = self.store.url(self.latest_name)
        if self.latest_name not in self.store.list(self.latest_name):
            return None

        def refuse(why: str) -> CheckpointRefused:
            return CheckpointRefused(
                f"The latest-{self.series} record {where} is refused: {why}.",
                round=None,
                reason=why,
            )

        try:
            body = json.loads(self.store.get(self.latest_name))
        except CheckpointError as exc:
            raise refuse(f"it cannot be read ({exc})") from exc
        except (ValueError, UnicodeDecodeError) as exc:
            raise refuse("it is not valid JSON (damaged or replaced)") from exc
        if not isinstance(body, dict) or body.get("format") != LATEST_FORMAT:
            raise refuse("it is not a fedcore latest record")
        tag = body.pop("tag", None)
        if not seal.verify(LATEST_DOMAIN, _canonical(body), tag):
            raise refuse(self._tag_failure(body.get("key_id"), "record"))
        if (body.get("run"), body.get("fingerprint"), body.get("series")) != (
            self.run,
            self.fingerprint,
            self.series,
        ):
            raise refuse(
                f"it belongs to run {body.get('run')!r} with another spec or series, not to "
                f"this run ({self.run!r})"
            )
        number, digest = body.get("round"), body.get("manifest_sha256")
        if not isinstance(number, int) or isinstance(number, bool) or not isinstance(digest, str):
            raise refuse("it lacks its round or manifest digest")
        return LatestRecord(number, digest)

    # ------------------------------------------------------------ reading: signed

    def _refuse(self, round: int, why: str) -> CheckpointRefused:
        return CheckpointRefused(
            f"The checkpoint of {self._at(round)} ({self.store.url(self._prefix(round))}) is "
            f"refused: {why}.",
            round=round,
            reason=why,
        )

    def _tag_failure(self, key_id: object, what: str) -> str:
        assert self._seal is not None
        if key_id == self._seal.key_id:
            return f"its {what} tag does not verify: the {what} was tampered with"
        return (
            f"its {what} tag does not verify: it was written with another key (key id "
            f"{key_id!r}; this role's key is {self._seal.key_id}) or tampered with"
        )

    def _manifest(self, round: int) -> tuple[dict[str, Any], str]:
        """Returns the verified manifest of ``round`` and its sha256.

        Raises:
            CheckpointRefused: naming why.
        """
        seal = self._seal
        assert seal is not None
        try:
            body = self.store.get(self._prefix(round) + MANIFEST)
        except CheckpointError as exc:
            raise self._refuse(round, f"its manifest cannot be read ({exc})") from exc
        try:
            manifest = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise self._refuse(
                round, "its manifest is not valid JSON (damaged or replaced)"
            ) from exc
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise self._refuse(round, "it is not a fedcore checkpoint")
        if manifest.get("version") == UNSIGNED_VERSION or "tag" not in manifest:
            raise self._refuse(
                round,
                "it is unsigned (written by a fedcore from before signed checkpoints, or by "
                "someone without the key)",
            )
        if manifest.get("version") != VERSION:
            raise self._refuse(
                round,
                f"it has format version {manifest.get('version')!r}; this fedcore reads "
                f"version {VERSION}",
            )
        tag = manifest.pop("tag")
        if not seal.verify(MANIFEST_DOMAIN, _canonical(manifest), tag):
            raise self._refuse(round, self._tag_failure(manifest.get("key_id"), "manifest"))
        if manifest.get("run") != self.run or manifest.get("fingerprint") != self.fingerprint:
            raise self._refuse(
                round,
                f"it belongs to run {manifest.get('run')!r} with another spec; it is not a "
                f"checkpoint of this run ({self.run!r}) and spec",
            )
        if manifest.get("round") != round or manifest.get("series") != self.series:
            raise self._refuse(
                round,
                f"its manifest says {manifest.get('series')} {manifest.get('round')!r} "
                f"(moved or replaced)",
            )
        if manifest.get("encryption") not in (
            (ENCRYPTION, CHUNKED_ENCRYPTION) if seal.encrypts else (None,)
        ):
            raise self._refuse(
                round, f"it is encrypted as {manifest.get('encryption')!r}, which this role is not"
            )
        parts = manifest.get("parts")
        if (
            not isinstance(parts, dict)
            or set(parts) != set(PARTS)
            or not all(isinstance(entry, dict) for entry in parts.values())
        ):
            raise self._refuse(round, "its manifest lists the wrong parts")
        return manifest, hashlib.sha256(body).hexdigest()

    def _load_signed(self, round: int) -> tuple[dict[str, Any], str]:
        """Returns the verified state of ``round`` and its manifest's sha256.

        Raises:
            CheckpointRefused: naming why.
        """
        seal = self._seal
        assert seal is not None
        manifest, digest = self._manifest(round)
        prefix = self._prefix(round)
        entries = manifest["parts"]
        raw: dict[str, bytearray] = {}
        for name in PARTS:
            try:
                size = int(entries[name]["bytes"])
                raw[name] = self.store.read_exact(prefix + name, size)
            except (CheckpointError, KeyError, TypeError, ValueError) as exc:
                raise self._refuse(
                    round, f"its part {name} cannot be read as written ({exc})"
                ) from exc
            if hashlib.sha256(raw[name]).hexdigest() != entries[name].get("sha256"):
                raise self._refuse(
                    round,
                    f"its part {name} fails its checksum (sha256): the object was replaced or "
                    f"damaged",
                )
        data: dict[str, bytes | bytearray] = dict(raw)
        if seal.encrypts:
            chunked = manifest["encryption"] == CHUNKED_ENCRYPTION
            for name in PARTS:
                associated = self._associated(round, name)
                try:
                    if chunked and name == PARTS[1]:
                        data[name] = _open_chunks(seal, raw[name], associated, CHUNK_BYTES)
                    else:
                        data[name] = seal.decrypt(raw[name], associated)
                except ValueError as exc:
                    raise self._refuse(
                        round, f"its part {name} does not decrypt ({exc}): tampered or another key"
                    ) from exc
        tensors = data[PARTS[1]]
        buffer = tensors if isinstance(tensors, bytearray) else bytearray(tensors)  # no copy
        return self._decode(round, bytes(data[PARTS[0]]), buffer), digest

    def _decode(self, round: int, state_json: bytes, buffer: bytearray) -> dict[str, Any]:
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

    def _resume(self) -> tuple[int, dict[str, Any]] | None:
        """``load_latest`` with a key: see there."""
        rounds = self.rounds()
        try:
            record = self.latest_record()
        except CheckpointRefused as exc:
            raise CheckpointRefused(
                f"{exc} {self._fallback(max(rounds, default=0) + 1)}",
                round=None,
                reason=exc.reason,
            ) from exc
        if record is None:
            if not rounds:
                return None
            newest = rounds[-1]
            try:
                self._manifest(newest)
            except CheckpointRefused as exc:
                if "unsigned" in exc.reason:
                    raise CheckpointRefused(
                        f"The checkpoints in {self.store.describe()} ({self.series}s {rounds}) "
                        f"are unsigned: written by a fedcore from before signed checkpoints (or "
                        f"by someone without the key), so none is resumed from. To take one "
                        f"knowingly, `{self.rollback_command(newest)} --adopt-unsigned` checks "
                        f"its sums and signs it with this role's key; or start afresh without "
                        f"--resume.",
                        round=newest,
                        reason=exc.reason,
                    ) from exc
            raise CheckpointRefused(
                f"{self.store.describe()} holds checkpoints of {self.series}s {rounds} but no "
                f"latest-{self.series} record ({self.latest_name}): it was deleted, and newer "
                f"checkpoints may have been deleted with it, so none is taken silently. "
                f"{self._fallback(newest + 1)}",
                round=None,
                reason="the latest record is missing",
            )
        newer = [n for n in rounds if n > record.round]
        take, why = record.round, "the latest record names it"
        if newer:
            candidate = newer[-1]
            manifest, _ = self._verified_or_refused(candidate)
            previous = manifest.get("previous")
            follows = isinstance(previous, dict) and previous == {
                "round": record.round,
                "manifest_sha256": record.manifest_sha256,
            }
            if len(newer) > 1 or not follows:
                raise CheckpointRefused(
                    f"The checkpoint of {self._at(candidate)} is newer than the latest record "
                    f"({self._at(record.round)}) and does not follow it: it is left from an "
                    f"earlier run in this store, or the record was put back by someone. "
                    f"{self._fallback(candidate, record.round)}",
                    round=candidate,
                    reason="newer than the latest record and not its successor",
                )
            take = candidate
            why = (
                f"it was written right after {self._at(record.round)}, which the latest record "
                f"names (the writer stopped before updating the record)"
            )
        elif record.round not in rounds:
            raise CheckpointRefused(
                f"The latest record names {self._at(record.round)}, but that checkpoint is "
                f"missing from {self.store.describe()} (deleted): an older checkpoint is not "
                f"taken in its place silently. {self._fallback(record.round)}",
                round=record.round,
                reason="the checkpoint the latest record names is missing",
            )
        try:
            state, digest = self._load_signed(take)
        except CheckpointRefused as exc:
            raise CheckpointRefused(
                f"{exc} It is the checkpoint to resume from ({why}); an older one is not taken "
                f"in its place silently. {self._fallback(take)}",
                round=take,
                reason=exc.reason,
            ) from exc
        if take == record.round and digest != record.manifest_sha256:
            raise CheckpointRefused(
                f"The checkpoint of {self._at(take)} is not the one the latest record names: "
                f"its manifest was replaced by another signed one of the same {self.series} "
                f"(an older copy put back). {self._fallback(take)}",
                round=take,
                reason="replaced by another checkpoint of the same round",
            )
        self._head = LatestRecord(take, digest)
        log.info(
            "Taking the checkpoint of %s from %s: %s; it verifies (tag and checksums).",
            self._at(take),
            self.store.describe(),
            why,
        )
        return take, state

    def _verified_or_refused(self, round: int) -> tuple[dict[str, Any], str]:
        try:
            return self._manifest(round)
        except CheckpointRefused as exc:
            raise CheckpointRefused(
                f"{exc} It is the newest checkpoint in the store; an older one is not taken in "
                f"its place silently. {self._fallback(round)}",
                round=round,
                reason=exc.reason,
            ) from exc

    def _fallback(self, below: int, at_most: int | None = None) -> str:
        """Says which older checkpoint verifies and how to take it knowingly."""
        limit = below if at_most is None else min(below, at_most + 1)
        for number in reversed([n for n in self.rounds() if n < limit]):
            try:
                self._load_signed(number)
            except CheckpointError:
                continue
            return (
                f"The newest older checkpoint that verifies is {self._at(number)}: to resume from "
                f"it knowingly, run `{self.rollback_command(number)}` (it deletes every newer "
                f"checkpoint and records {self._at(number)} as the latest), then resume."
            )
        return (
            "No older checkpoint verifies: start afresh without --resume (`fedcore checkpoint "
            "purge` clears the store), or restore the store from a copy."
        )

    def rollback_command(self, number: int) -> str:
        """The command that takes the checkpoint of ``number`` as the latest, knowingly."""
        selector = f" {self.selector}" if self.selector else ""
        return f"fedcore checkpoint rollback <manifest> {number}{selector} --yes"

    def rollback(self, round: int, *, adopt_unsigned: bool = False) -> list[int]:
        """Takes the checkpoint of ``round`` as the latest, knowingly: checks it, deletes every
        checkpoint numbered after it (marked or not, verified or not) and records it as the
        latest. Returns the deleted numbers.

        Args:
            adopt_unsigned: also accept an unsigned checkpoint (from a fedcore before signed
                checkpoints) of this run and spec whose sums check; it is signed (re-encrypted
                for the KDC) with this checkpointer's key.

        Raises:
            CheckpointError: there is no key or no such checkpoint, or it fails verification.
        """
        if self._seal is None:
            raise CheckpointError("A rollback needs the checkpoint key.")
        rounds = self.rounds()
        if round not in rounds:
            raise CheckpointError(
                f"There is no checkpoint of {self._at(round)} in {self.store.describe()} "
                f"(have: {rounds or 'none'})."
            )
        adopted: dict[str, Any] | None = None
        digest = ""
        try:
            _, digest = self._load_signed(round)
        except CheckpointRefused as exc:
            if not (adopt_unsigned and "unsigned" in exc.reason):
                raise
            adopted = self._load_unsigned(round)
        newer = [n for n in rounds if n > round]
        numbers = self._numbers()
        for number in newer:
            prefix = self._prefix(number)
            self.store.delete([prefix + MANIFEST])
            self.store.delete([prefix + name for name in sorted(numbers[number] - {MANIFEST})])
        if adopted is not None:
            self._head = None
            self.save(round, adopted)
        else:
            record = LatestRecord(round, digest)
            self._write_latest(record)
            self._head = record
        log.warning(
            "Rolled back to the checkpoint of %s%s; deleted %s.",
            self._at(round),
            " (adopted unsigned, now signed)" if adopted is not None else "",
            newer or "nothing",
        )
        return newer

    # ---------------------------------------------------------- reading: unsigned

    def _load_unsigned(self, round: int) -> dict[str, Any]:
        """Loads a version-1 (unsigned) checkpoint, checking its run, round and sums.

        Raises:
            CheckpointError: the manifest or a part is missing, damaged, from another run, or
                the checkpoint is signed (reading it needs its key).
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
        return self._decode(round, state_json, buffer)

    def _check_part(self, name: str, round: int, data: bytes | bytearray, entry: Any) -> None:
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.get("sha256") or len(data) != entry.get("bytes"):
            raise CheckpointError(
                f"The part {name} of {self._at(round)} fails its checksum (damaged or replaced)."
            )

    def _check_manifest(self, manifest: Any, round: int) -> None:
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"The object at {self._at(round)} is not a fedcore checkpoint.")
        if manifest.get("version") == VERSION:
            raise CheckpointError(
                f"The checkpoint of {self._at(round)} is signed; reading it needs its key."
            )
        if manifest.get("version") != UNSIGNED_VERSION:
            raise CheckpointError(
                f"The checkpoint of {self._at(round)} has format version "
                f"{manifest.get('version')!r}; this fedcore reads version {UNSIGNED_VERSION} "
                f"without a key."
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

    def sweep(self) -> list[str]:
        """Deletes what interrupted writes of this series left: folders that never got a
        manifest, and temporary files of unfinished writes (also inside published folders).
        Call it only while nothing writes this series (the role that owns it, at its start).
        Returns the keys it deleted."""
        numbers = self._numbers()
        gone = [
            self._prefix(number) + name
            for number, names in sorted(numbers.items())
            if MANIFEST not in names
            for name in sorted(names)
        ]
        gone += self.store.temporaries(f"{self.series}-")
        if gone:
            self.store.delete(gone)
            log.warning(
                "Removed what interrupted checkpoint writes left in %s: %s.",
                self.store.describe(),
                ", ".join(gone),
            )
        return gone

    def _prune(self, newest: int) -> bool:
        """Deletes what retention does not keep, and the leftovers of failed writes older
        than ``newest`` (folders that never got a manifest); with a key, also the unmarked
        checkpoints numbered after ``newest`` (left from an earlier run). Returns whether
        ``newest`` is marked."""
        numbers = self._numbers()
        rounds = sorted(n for n, names in numbers.items() if MANIFEST in names)
        marked = {n for n in rounds if MARK in numbers[n]}
        line = [n for n in rounds if n <= newest] if self._seal is not None else rounds
        keep = set(line[-self.keep_last :]) | marked
        if self.keep_every:
            keep |= {n for n in line if n % self.keep_every == 0}
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
        # A temporary file is not listed, so a folder holding only one is not in numbers.
        # This writer has finished every write of this series by now.
        self.store.delete(self.store.temporaries(f"{self.series}-"))
        return newest in marked


def _canonical(value: Any) -> bytes:
    """The one encoding of a JSON value that tags are computed over."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def _blocks(chunks: Iterator[memoryview], size: int) -> Iterator[tuple[int, bytes, bool]]:
    """``chunks`` cut into blocks of ``size`` bytes (the last shorter, or empty when there is
    nothing): (index, block, whether it is the last). At most one block is held, however
    large a chunk is, and no byte is moved twice within it."""
    pending = bytearray()
    index = 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        at = 0
        while at < len(view):
            if len(pending) == size:  # more follows: this full block is not the last
                yield index, bytes(pending), False
                pending.clear()
                index += 1
            take = min(size - len(pending), len(view) - at)
            pending += view[at : at + take]
            at += take
    yield index, bytes(pending), True


def _chunk_associated(associated: bytes, index: int, last: bool) -> bytes:
    """A chunk's associated data: its part's, its index and whether it is the last, so that
    chunks cannot be reordered, dropped or the part cut short at a chunk's end."""
    return associated + b"\0" + index.to_bytes(8, "big") + (b"\1" if last else b"\0")


def _sealed_size(size: int, chunk: int) -> int:
    """The stored bytes of ``size`` bytes sealed in chunks of ``chunk``: a nonce and a tag
    per chunk, and at least one chunk."""
    count = max(1, -(-size // chunk))
    return size + count * (NONCE_BYTES + TAG_BYTES)


def _open_chunks(seal: SealKey, data: bytearray, associated: bytes, chunk: int) -> bytearray:
    """Decrypts a part sealed in chunks, in place: each chunk's plaintext lands before its
    own ciphertext's start, so the buffer is reused and only one chunk is held apart.

    Raises:
        ValueError: a chunk does not decrypt, or the part's size is not that of sealed chunks.
    """
    stored = chunk + NONCE_BYTES + TAG_BYTES
    view = memoryview(data)
    read = written = index = 0
    try:
        while True:
            end = min(read + stored, len(data))
            if end - read < NONCE_BYTES + TAG_BYTES:
                raise ValueError(f"chunk {index} is cut short")
            last = end == len(data)
            plain = seal.decrypt(view[read:end], _chunk_associated(associated, index, last))
            view[written : written + len(plain)] = plain
            read, written, index = end, written + len(plain), index + 1
            if last:
                break
    finally:
        view.release()
    del data[written:]
    return data


def _entry_of(data: bytes) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


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

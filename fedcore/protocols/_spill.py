"""A round's uploads kept whole, in bounded memory, and read back a block of coordinates at a time.

A robust rule (median, trimmed mean, Krum, FLTrust: ``fedcore.protocols.fedavg.aggregators``)
needs every upload of a round before it can combine any coordinate, so the uploads cannot be
folded into one sum as they arrive (``fedcore.protocols._fold``). ``UploadStore`` keeps them
instead: each upload as one vector over the model's floating-point tensors (in the names'
order, in the widest of their dtypes, so nothing is rounded) and, where the model has others
(integer buffers), a second float64 vector over those. Vectors are held in memory up to a byte
budget; beyond it each upload goes to files of its own in a private folder (``mkdtemp``: mode
0700, files 0600), in numpy's .npy format, and is read back through
``np.load(mmap_mode="r", allow_pickle=False)``: a file that is not a plain numeric array of the
expected dtype and length is refused. The folder is removed by ``close``.

``rows`` serves the coordinates [start, stop) of any subset of the uploads as one
(K, stop - start) float64 array, in the order asked; the coordinates are those of
``fedcore.protocols._maths.flatten`` over the model's names (every tensor, in order), so a
block is what the same slice of the flattened uploads would be. A rule that works block by
block then holds K x block values at a time, never K models.
"""

from __future__ import annotations

import bisect
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedcore.errors import ProtocolError

Tensors = Mapping[str, np.ndarray]

HOLD_BYTES = 256 * 2**20
"""Default bytes of uploads held in memory before they go to disk (``OrderedFold`` and
``UploadStore``)."""

_WRITE_ELEMENTS = 1 << 16
"""Elements converted at a time when a tensor is written in another dtype."""


SPILL_PREFIXES = ("fedcore-fold-", "fedcore-store-")
"""The prefixes of the private folders a fold (``_fold``) and a store (``UploadStore``) make."""


def remove_spilled(parent: str | os.PathLike[str]) -> int:
    """Removes the spill folders inside ``parent`` (a server's run folder, at its start: what a
    process that died mid-round left there, clients' uploads); returns how many it removed."""
    removed = 0
    for path in Path(parent).iterdir() if Path(parent).is_dir() else ():
        if path.is_dir() and not path.is_symlink() and path.name.startswith(SPILL_PREFIXES):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


class SpillFolder:
    """A private folder for spilled uploads: made on first use (``tempfile.mkdtemp``, so mode
    0700, owned by this process's user) inside ``parent`` (None: the system's temporary
    folder), removed with everything in it by ``close`` (idempotent)."""

    def __init__(self, parent: str | os.PathLike[str] | None, *, prefix: str) -> None:
        self._parent = parent
        self._prefix = prefix
        self._path: Path | None = None

    @property
    def path(self) -> Path | None:
        """The folder, or None while nothing was written (or after ``close``)."""
        return self._path

    def file(self, name: str) -> Path:
        """The path of ``name`` inside the folder (made now if it was not yet)."""
        if self._path is None:
            self._path = Path(tempfile.mkdtemp(prefix=self._prefix, dir=self._parent))
        return self._path / name

    def close(self) -> None:
        if self._path is not None:
            shutil.rmtree(self._path, ignore_errors=True)
            self._path = None


@dataclass(frozen=True)
class _Piece:
    """One tensor's place: coordinates [start, stop) of the flattened upload, stored in
    ``part`` (0: the float vector, 1: the others) from ``offset``."""

    start: int
    stop: int
    name: str
    part: int
    offset: int


class UploadStore:
    """Uploads shaped like ``reference``, kept in memory up to ``budget_bytes``, beyond on disk.

    Args:
        reference: the names, shapes and dtypes every upload has (e.g. the global model);
            only its layout is used.
        budget_bytes: how many bytes of uploads to hold in memory; the rest go to disk
            (0: every upload goes to disk).
        spill_dir: where the private folder of spilled uploads is made (None: the system's
            temporary folder).

    ``add`` copies an upload in (or writes it out); ``lend`` keeps a reference to tensors the
    caller holds anyway (the whole uploads ``combine`` is given), without copying them. The
    caller checks an upload's values (finiteness, bounds) before it adds it.
    """

    def __init__(
        self,
        reference: Tensors,
        *,
        budget_bytes: int = HOLD_BYTES,
        spill_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self._folder = SpillFolder(spill_dir, prefix=SPILL_PREFIXES[1])
        self._maps: dict[int, list[np.ndarray]] = {}
        self._layout = {
            name: (np.shape(value), np.asarray(value).dtype) for name, value in reference.items()
        }
        floats = [dt for _, dt in self._layout.values() if np.issubdtype(dt, np.floating)]
        self.dtype = np.result_type(*floats).newbyteorder("=") if floats else np.dtype(np.float64)
        """The dtype of the float vector: the widest of the model's float dtypes."""
        self._part_dtypes = (self.dtype, np.dtype(np.float64))
        self._pieces: list[_Piece] = []
        sizes = [0, 0]
        at = 0
        for name, (shape, dtype) in self._layout.items():
            size = int(np.prod(shape, dtype=np.int64))
            part = 0 if np.issubdtype(dtype, np.floating) else 1
            if size:
                self._pieces.append(_Piece(at, at + size, name, part, sizes[part]))
            sizes[part] += size
            at += size
        self._starts = [piece.start for piece in self._pieces]
        self._part_sizes = tuple(sizes)
        self.length = at
        """Coordinates of an upload (every tensor's elements, in the reference's order)."""
        self.upload_bytes = sum(
            n * dt.itemsize for n, dt in zip(sizes, self._part_dtypes, strict=True)
        )
        """Bytes of one stored upload."""
        self._budget = budget_bytes
        self._held: dict[int, list[np.ndarray]] = {}
        self._lent: dict[int, dict[str, np.ndarray]] = {}
        self._spilled: set[int] = set()
        self.held_bytes = 0
        """Bytes of uploads held in memory now (lent ones are not counted: the caller holds
        them)."""
        self.peak_held_bytes = 0
        """The most bytes of uploads ever held in memory at once."""
        self.spilled_count = 0
        """How many uploads went to disk."""

    # ---------------------------------------------------------------------------- taking

    def __contains__(self, client: object) -> bool:
        return client in self._held or client in self._lent or client in self._spilled

    @property
    def clients(self) -> list[int]:
        """The clients whose uploads are kept, ascending."""
        return sorted([*self._held, *self._lent, *self._spilled])

    @property
    def folder(self) -> Path | None:
        """The private folder of spilled uploads (None while nothing was spilled)."""
        return self._folder.path

    def add(self, client: int, tensors: Tensors) -> None:
        """Keeps a copy of ``client``'s upload: in memory if it fits the budget, else on disk.

        Raises:
            ProtocolError: the client's upload is already kept, or ``tensors`` does not have
                the reference's names, shapes and dtypes.
        """
        flats = self._flats(client, tensors)
        if self.held_bytes + self.upload_bytes <= self._budget:
            parts = [
                np.empty(n, dtype=dt)
                for n, dt in zip(self._part_sizes, self._part_dtypes, strict=True)
            ]
            for piece in self._pieces:
                size = piece.stop - piece.start
                target = parts[piece.part][piece.offset : piece.offset + size]
                np.copyto(target, flats[piece.name], casting="unsafe")
            self._held[client] = parts
            self.held_bytes += self.upload_bytes
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
            return
        written: list[Path] = []
        try:
            for part, (size, dtype) in enumerate(
                zip(self._part_sizes, self._part_dtypes, strict=True)
            ):
                if size:
                    path = self._folder.file(self._file_name(client, part))
                    written.append(path)
                    chunks = (flats[p.name] for p in self._pieces if p.part == part)
                    _write_npy(path, dtype, size, chunks)
        except BaseException:
            for path in written:  # no partial upload is left behind (e.g. the disk is full)
                path.unlink(missing_ok=True)
            raise
        self._spilled.add(client)
        self.spilled_count += 1

    def lend(self, client: int, tensors: Tensors) -> None:
        """Keeps ``client``'s upload by reference (not copied, not counted against the
        budget): for tensors the caller holds until the store is done with them.

        Raises:
            ProtocolError: as ``add``.
        """
        self._lent[client] = self._flats(client, tensors)

    # --------------------------------------------------------------------------- reading

    def tensors(self, client: int) -> dict[str, np.ndarray]:
        """``client``'s upload as tensors shaped as the reference: views of the kept vectors
        (a spilled upload's are memory-mapped), each in its part's dtype (the widest float
        dtype, or float64 for the others), which holds every value exactly.

        Raises:
            ProtocolError: the upload is not kept, or a spilled file cannot be read back.
        """
        lent = self._lent.get(client)
        if lent is not None:
            return {name: lent[name].reshape(shape) for name, (shape, _) in self._layout.items()}
        parts = self._parts(client)
        out: dict[str, np.ndarray] = {}
        for name, (shape, _) in self._layout.items():
            piece = next((p for p in self._pieces if p.name == name), None)
            if piece is None:  # an empty tensor
                out[name] = np.empty(shape, dtype=self._part_dtypes[0])
                continue
            size = piece.stop - piece.start
            out[name] = parts[piece.part][piece.offset : piece.offset + size].reshape(shape)
        return out

    def release(self, client: int) -> None:
        """Forgets ``client``'s upload: its memory, or its mapping and files (a caller that
        reads uploads one at a time so holds one at a time)."""
        if client in self._held:
            del self._held[client]
            self.held_bytes -= self.upload_bytes
        self._lent.pop(client, None)
        self._maps.pop(client, None)
        if client in self._spilled:
            self._spilled.discard(client)
            for part in range(2):
                if self._folder.path is not None:
                    (self._folder.path / self._file_name(client, part)).unlink(missing_ok=True)

    def rows(
        self, start: int, stop: int, clients: Sequence[int], out: np.ndarray | None = None
    ) -> np.ndarray:
        """The coordinates [start, stop) of ``clients``' uploads, one row each in the order
        given, widened to float64 (into ``out`` if given: shape (len(clients), stop - start)).

        Raises:
            ProtocolError: a client's upload is not kept, or a spilled file cannot be read
                back as the array that was written.
        """
        if not 0 <= start <= stop <= self.length:
            raise ValueError(f"[{start}, {stop}) is not a range of the {self.length} coordinates.")
        if out is None:
            out = np.empty((len(clients), stop - start), dtype=np.float64)
        pieces = self._pieces_in(start, stop)
        for row, client in zip(out, clients, strict=True):
            lent = self._lent.get(client)
            parts = None if lent is not None else self._parts(client)
            for piece in pieces:
                a, b = max(start, piece.start), min(stop, piece.stop)
                if lent is not None:
                    source = lent[piece.name][a - piece.start : b - piece.start]
                else:
                    assert parts is not None
                    at = piece.offset + a - piece.start
                    source = parts[piece.part][at : at + b - a]
                np.copyto(row[a - start : b - start], source, casting="unsafe")
        return out

    def view(self, clients: Sequence[int], minus: np.ndarray | None = None) -> StoreRows:
        """``clients``' uploads (less ``minus``, a flat float64 vector, if given) as the rows
        a blockwise rule reads (``aggregators.Rows``)."""
        return StoreRows(self, list(clients), minus)

    # ---------------------------------------------------------------------------- ending

    def close(self) -> None:
        """Forgets every upload and removes the spilled files (idempotent)."""
        self._maps.clear()
        self._held.clear()
        self._lent.clear()
        self._spilled.clear()
        self.held_bytes = 0
        self._folder.close()

    def __enter__(self) -> UploadStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_spilled"):  # not if __init__ failed early
            self.close()

    # --------------------------------------------------------------------------- inside

    def _flats(self, client: int, tensors: Tensors) -> dict[str, np.ndarray]:
        if client in self:
            raise ProtocolError(f"Client {client}'s upload is already kept.")
        if set(tensors) != set(self._layout):
            raise ProtocolError(
                f"Client {client}'s upload has tensors {sorted(tensors)}, not "
                f"{sorted(self._layout)}."
            )
        flats = {}
        for name, (shape, dtype) in self._layout.items():
            value = np.asarray(tensors[name])
            if value.shape != shape or value.dtype != dtype:
                raise ProtocolError(
                    f"Client {client}'s tensor {name!r} is {value.dtype}{list(value.shape)}, "
                    f"not {dtype}{list(shape)}."
                )
            flats[name] = np.ascontiguousarray(value).reshape(-1)
        return flats

    def _pieces_in(self, start: int, stop: int) -> list[_Piece]:
        first = max(0, bisect.bisect_right(self._starts, start) - 1)
        pieces = []
        for piece in self._pieces[first:]:
            if piece.start >= stop:
                break
            if piece.stop > start:
                pieces.append(piece)
        return pieces

    def _parts(self, client: int) -> list[np.ndarray]:
        held = self._held.get(client)
        if held is not None:
            return held
        if client not in self._spilled:
            raise ProtocolError(f"Client {client}'s upload is not kept.")
        maps = self._maps.get(client)
        if maps is None:
            maps = [self._load(client, part) for part in range(2)]
            self._maps[client] = maps
        return maps

    def _load(self, client: int, part: int) -> np.ndarray:
        size, dtype = self._part_sizes[part], self._part_dtypes[part]
        if not size:
            return np.empty(0, dtype=dtype)
        path = self._folder.file(self._file_name(client, part))
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ProtocolError(
                f"Client {client}'s spilled upload cannot be read back from {path}: {exc}"
            ) from exc
        if not isinstance(array, np.ndarray) or array.dtype != dtype or array.shape != (size,):
            raise ProtocolError(
                f"Client {client}'s spilled upload in {path} is not the {dtype}[{size}] "
                f"that was written."
            )
        return array

    @staticmethod
    def _file_name(client: int, part: int) -> str:
        return f"client-{client}.npy" if part == 0 else f"client-{client}.other.npy"


class StoreRows:
    """Some of a store's uploads, less an offset, read a block at a time (``aggregators.Rows``):
    row i of a block is ``flatten(upload of clients[i])[start:stop] - minus[start:stop]``, the
    same operations per element as on the flattened upload, so the same values."""

    def __init__(self, store: UploadStore, clients: list[int], minus: np.ndarray | None) -> None:
        if minus is not None and np.shape(minus) != (store.length,):
            raise ValueError(f"The offset has shape {np.shape(minus)}, not ({store.length},).")
        self._store = store
        self._clients = clients
        self._minus = minus

    @property
    def count(self) -> int:
        return len(self._clients)

    @property
    def length(self) -> int:
        return self._store.length

    def rows(self, start: int, stop: int, select: Sequence[int] | None = None) -> np.ndarray:
        clients = self._clients if select is None else [self._clients[i] for i in select]
        block = self._store.rows(start, stop, clients)
        if self._minus is not None:
            np.subtract(block, self._minus[start:stop], out=block)
        return block


def _write_npy(path: Path, dtype: np.dtype, size: int, chunks: Iterable[np.ndarray]) -> None:
    """Writes the concatenation of ``chunks`` (``size`` elements in all) as a 1-D .npy array of
    ``dtype``, a tensor at a time (converted in slices where its dtype differs), readable only
    by this user; no concatenated copy is made."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        header = {
            "descr": np.lib.format.dtype_to_descr(dtype),
            "fortran_order": False,
            "shape": (size,),
        }
        np.lib.format.write_array_header_1_0(file, header)
        written = 0
        for flat in chunks:
            if flat.dtype == dtype:
                file.write(flat.view(np.uint8).data)
            else:
                for at in range(0, flat.size, _WRITE_ELEMENTS):
                    file.write(flat[at : at + _WRITE_ELEMENTS].astype(dtype).tobytes())
            written += flat.size
        if written != size:
            raise AssertionError(f"Wrote {written} elements of {size}.")

"""Weighted sums folded as uploads arrive, in a fixed order, in bounded memory.

An averaging server used to hold every upload of a round until the round settled, then sum
them: K model-sized copies at once. ``OrderedFold`` takes each upload as it arrives and adds
it into one float64 accumulator, so the uploads' tensors can be let go at once. Floating-point
addition is not associative, so a sum in arrival order would change with the network's timing
and a run would not equal its simulation. The fold therefore adds in ascending client order,
always: an upload that arrives before a lower-indexed client's fate is known waits (in memory
up to ``hold_bytes``, beyond that in a file of its own, written and read back with numpy's
format and no pickle) and is added once every client before it has been added or skipped. The
sum is then bit-identical to adding the same uploads in client order at once, whatever order
they came in: ``weighted_sum`` is exactly that batch path, and the tests check the two agree.

Each element is widened to float64, multiplied by the client's weight and added (a float32
value times an integer weight below 2**29 is exact in float64, so only the additions round).
That arithmetic lives in ``fedcore.protocols._kernels``: a compiled kernel, spread over the usable
cores, for tensors of at least ``_kernels.KERNEL_ELEMENTS`` elements, numpy block by block
(the scratch stays in the CPU's cache) for the rest, with the same bits either way; so is the
mean's division, which writes the model's dtype directly (no float64 temporary of the model).

``on_disk`` (``spec.uploads.storage``: Disk) trades the float64 accumulator, twice a float32
model's bytes, for disk: every upload is written to a file of its own as it is added (its
tensors' bytes, nothing else) and ``mean`` adds the files up a block of coordinates at a time,
each block through the same kernels in the same client order, so the same bits. The fold then
holds one block of sums and a few blocks of uploads, never a model-sized array of its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from fedcore.errors import ProtocolError
from fedcore.protocols._kernels import (
    BLOCK_ELEMENTS,
    FUSED_UPLOADS,
    KERNEL_ELEMENTS,
    divide_into,
    fold_into,
    fold_many_into,
)
from fedcore.protocols._runs import stretches
from fedcore.protocols._spill import HOLD_BYTES, SPILL_PREFIXES, SpillFolder
from fedcore.transport._payload import PackedTensors, Run

Tensors = Mapping[str, np.ndarray]
_Upload = tuple[list[Run], float]
"""An upload to sum: its tensors' runs (in the layout's order) and its weight."""

DISK_BLOCK_ELEMENTS = KERNEL_ELEMENTS
"""Coordinates summed at a time when the uploads are on disk: one float64 block of sums (8 MiB)
and up to ``FUSED_UPLOADS`` blocks of uploads read back, large enough for the compiled kernel."""

_WRITE_BYTES = 64 << 20
"""Bytes written per system call when an upload goes to its file."""


def scratch_elements(arrays: Iterable[np.ndarray]) -> int:
    """Elements of blocked float64 scratch for ``arrays``: ``BLOCK_ELEMENTS``, or the largest
    array's size if smaller (a small model's scratch then stays off the allocator's mmap path,
    which costs a system call and page faults per call)."""
    return scratch_for_sizes(array.size for array in arrays)


def scratch_for_sizes(sizes: Iterable[int]) -> int:
    """``scratch_elements`` for arrays of ``sizes`` elements."""
    return max(1, min(BLOCK_ELEMENTS, max(sizes, default=1)))


class OrderedFold:
    """Sums ``weight_k * tensors_k`` over clients in ascending order, as they arrive.

    Args:
        reference: the names, shapes and dtypes every upload has (e.g. the global model);
            only its layout is used.
        clients: the clients whose uploads may come (the attempt's plan).
        hold_bytes: how many bytes of early uploads to hold in memory; the rest go to disk.
        spill_dir: where the files of early uploads go (a private folder is made inside it);
            None: the system's temporary folder.
        on_disk: every upload goes to a file as it is added, and ``mean`` (or ``sums``) adds
            the files up a block at a time: no model-sized accumulator (see the module).

    Every planned client must be resolved, by ``add`` or ``skip``, before ``sums``. The
    caller checks an upload (names, shapes, finiteness) before it adds it.
    """

    def __init__(
        self,
        reference: Tensors,
        clients: Iterable[int],
        *,
        hold_bytes: int = HOLD_BYTES,
        spill_dir: str | os.PathLike[str] | None = None,
        on_disk: bool = False,
    ) -> None:
        self._layout = {name: (value.shape, value.dtype) for name, value in reference.items()}
        self._sizes = {
            name: int(np.prod(shape, dtype=np.int64)) for name, (shape, _) in self._layout.items()
        }
        self._names = list(self._layout)
        self._size_list = list(self._sizes.values())
        self._order = sorted(set(clients))
        self._position = {client: i for i, client in enumerate(self._order)}
        self._next = 0  # index into _order of the first client not yet added or skipped
        self.on_disk = on_disk
        """Whether every upload goes to a file as it is added (see the module)."""
        self._acc: dict[str, np.ndarray] = {}
        self._acc_runs: list[Run] = []
        if not on_disk:
            # Not zeroed: the first fold writes it (``overwrite``), once instead of zeroed
            # (a pass, where the memory is reused), read and written. One buffer for every
            # tensor: an upload that is one run is summed in one call (``_runs``).
            self._acc, self._acc_runs = self._new_sums()
        self._closed = False
        self._written = on_disk
        """Whether ``_acc`` holds sums (until the first fold, or ``sums`` with none, it is
        uninitialised memory)."""
        self._term = np.empty(scratch_for_sizes(self._sizes.values()), dtype=np.float64)
        # on_disk: each stored upload's weight and its tensors' dtypes (their bytes follow one
        # another in its file, in the layout's order)
        self._stored: dict[int, tuple[float, list[np.dtype]]] = {}
        self._held: dict[int, _Upload] = {}
        self._spilled: dict[int, float] = {}
        self._skipped: set[int] = set()
        self._added: set[int] = set()
        self._hold_bytes = hold_bytes
        self._spill = SpillFolder(spill_dir, prefix=SPILL_PREFIXES[0])
        self.held_bytes = 0
        """Bytes of early uploads held in memory now."""
        self.peak_held_bytes = 0
        """The most bytes of early uploads ever held in memory at once."""
        self.spilled_count = 0
        """How many early uploads went to disk."""
        self.weight_total = 0.0
        """The sum of the weights added so far (in client order)."""

    # ---------------------------------------------------------------------------- taking

    def taken(self, client: int) -> bool:
        """Whether ``client``'s upload was given to ``add``."""
        return client in self._added or client in self._held or client in self._spilled

    def add(self, client: int, tensors: Tensors, weight: float) -> None:
        """Takes ``client``'s upload with its weight; it is summed now or when its turn comes.

        Raises:
            ProtocolError: the client was not planned, was already resolved, the weight is not
                a finite number >= 0, or the tensors do not have the reference's layout.
        """
        group: list[_Upload] = []
        self._take(client, tensors, weight, group)
        self._advance(group)

    def add_all(self, uploads: Mapping[int, Tensors], weights: Mapping[int, float]) -> None:
        """``add`` for each client of ``uploads`` in client order; those whose turns come in
        a row are summed together, a few per pass over the sums (``fold_many_into``: the same
        bits as one at a time).

        Raises:
            ProtocolError: as ``add``.
        """
        group: list[_Upload] = []
        for client in sorted(uploads):
            self._take(client, uploads[client], weights[client], group)
            self._advance(group, fold=False)
        self._advance(group)

    def _take(
        self,
        client: int,
        tensors: Tensors,
        weight: float,
        group: list[_Upload],
    ) -> None:
        """Checks an upload; puts it in ``group`` (to be summed) if its turn has come, else
        holds it (in memory, or on disk) until it does."""
        self._check_open(client)
        _check_weight(client, weight)
        runs = None if self.on_disk else self._packed_runs(client, tensors)
        if runs is None:
            flats = self._flats(client, tensors)
            if self.on_disk:
                self._store(client, flats, float(weight))
                self._added.add(client)
                return
            runs = [(index, index + 1, flats[name]) for index, name in enumerate(self._names)]
        if self._position[client] == self._next:
            group.append((runs, float(weight)))
            self._added.add(client)
            self._next += 1
            return
        size = sum(view.nbytes for _, _, view in runs)
        if self.held_bytes + size <= self._hold_bytes:
            # Copied: the caller's buffers (a decoder's) may be reused once this returns.
            copied = [(start, stop, view.copy()) for start, stop, view in runs]
            self._held[client] = (copied, float(weight))
            self.held_bytes += size
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        else:
            flats = self._flats(client, tensors)
            np.savez(self._spill_file(client), *(flats[name] for name in self._layout))
            self._spilled[client] = float(weight)
            self.spilled_count += 1

    def reweigh(self, client: int, weight: float) -> None:
        """Sets the weight of ``client``'s stored upload (``on_disk`` only: nothing is summed
        before ``mean``), e.g. once the round's claims are known.

        Raises:
            ProtocolError: not ``on_disk``, the client's upload was not added, or the weight
                is not a finite number >= 0.
        """
        if not self.on_disk or client not in self._stored:
            raise ProtocolError(f"Client {client}'s upload is not stored to be weighed later.")
        _check_weight(client, weight)
        self._stored[client] = (float(weight), self._stored[client][1])

    def skip(self, client: int) -> None:
        """Resolves ``client`` without an upload (it failed, or is left out of the sum)."""
        if client in self._held or client in self._spilled:
            raise ProtocolError(f"Client {client}'s upload is waiting for its turn to be summed.")
        self._check_open(client)
        self._skipped.add(client)
        if self.on_disk:
            return
        if self._position[client] == self._next:
            self._next += 1
            self._advance()

    # --------------------------------------------------------------------------- results

    @property
    def planned(self) -> list[int]:
        """The planned clients, ascending."""
        return list(self._order)

    @property
    def added(self) -> list[int]:
        """The clients summed so far, ascending."""
        return sorted(self._added)

    def complete(self) -> bool:
        """Whether every planned client was added or skipped."""
        if self.on_disk:
            return len(self._added) + len(self._skipped) == len(self._order)
        return self._next == len(self._order)

    def sums(self) -> dict[str, np.ndarray]:
        """The float64 sums, shaped as the reference (arrays the fold owns; read-only use).

        Raises:
            ProtocolError: some planned client was never resolved.
        """
        self._check_not_closed()
        if not self.complete():
            missing = [k for k in self._order if not self.taken(k) and k not in self._skipped]
            raise ProtocolError(f"The sum is not complete: clients {missing} were never resolved.")
        if self.on_disk and not self._acc:  # whole float64 sums asked for: read once, kept
            self._acc, self._acc_runs = self._new_sums()

            def keep(name: str, start: int, sums: np.ndarray) -> None:
                self._acc[name][start : start + sums.size] = sums

            self._sum_stored(keep)
        if not self._written:  # every client skipped: the sums are zero
            for acc in self._acc.values():
                acc.fill(0.0)
            self._written = True
        return {name: self._acc[name].reshape(shape) for name, (shape, _) in self._layout.items()}

    def mean(self) -> dict[str, np.ndarray]:
        """The weighted mean, each tensor in the reference's dtype: sums / total weight,
        rounded once to that dtype (new arrays; a 0-d tensor's mean is a 0-d array).

        Raises:
            ProtocolError: the sum is not complete, or the weights sum to 0 (nothing to average).
        """
        self._check_not_closed()
        if self.on_disk and not self._acc:
            return self._mean_stored()
        self.sums()
        self._check_total()
        # (sums / total).astype(dtype), bit for bit, written straight into the result: one
        # buffer per stretch of tensors of one dtype, one call per stretch.
        means = PackedTensors.empty_like(self._layout)
        packed = means.runs()
        assert packed is not None
        for out, sums in stretches(self._size_list, packed, self._acc_runs):
            divide_into(out, sums, self.weight_total, scratch=self._term)
        return means

    def close(self) -> None:
        """Removes the files of early (or, ``on_disk``, all) uploads, if any, and lets go of
        the sums (idempotent)."""
        self._spill.close()
        self._closed = True
        self._acc = {}
        self._acc_runs = []

    def __enter__(self) -> OrderedFold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    # --------------------------------------------------------------------------- inside

    def _check_not_closed(self) -> None:
        if self._closed:
            raise ProtocolError("This sum was closed: its uploads and sums are gone.")

    def _check_open(self, client: int) -> None:
        self._check_not_closed()
        if client not in self._position:
            raise ProtocolError(f"Client {client} was not planned in this attempt.")
        if self.taken(client) or client in self._skipped:
            raise ProtocolError(f"Client {client} was already resolved in this attempt.")

    def _flats(self, client: int, tensors: Tensors) -> dict[str, np.ndarray]:
        if set(tensors) != set(self._layout):
            raise ProtocolError(
                f"Client {client}'s upload has tensors {sorted(tensors)}, not "
                f"{sorted(self._layout)}."
            )
        values = [np.asarray(tensors[name]) for name in self._names]
        self._check_shapes(client, values)
        return {
            name: np.ascontiguousarray(value).reshape(-1)
            for name, value in zip(self._names, values, strict=True)
        }

    def _check_shapes(self, client: int, values: Iterable[np.ndarray]) -> None:
        """Refuses an upload whose tensors (in the layout's order) are not the layout's shapes.

        Raises:
            ProtocolError: naming the first tensor of another shape.
        """
        for (name, (shape, _)), value in zip(self._layout.items(), values, strict=True):
            if value.shape != shape:
                raise ProtocolError(
                    f"Client {client}'s tensor {name!r} has shape {value.shape}, not {shape}."
                )

    def _new_sums(self) -> tuple[dict[str, np.ndarray], list[Run]]:
        """Uninitialised float64 sums for the layout, one buffer: 1-D views by name, runs."""
        flat = np.empty(sum(self._size_list))
        views, offset = {}, 0
        for name, size in self._sizes.items():
            views[name] = flat[offset : offset + size]
            offset += size
        return views, ([(0, len(views), flat)] if views else [])

    def _packed_runs(self, client: int, tensors: Tensors) -> list[Run] | None:
        """The runs an upload's tensors were packed in (a decoded message's), checked against
        the layout, where they are in its order; None where they are not packed so (then
        ``_flats`` checks them and takes them a tensor at a time).

        Raises:
            ProtocolError: a tensor's shape is not the layout's.
        """
        if not isinstance(tensors, PackedTensors) or list(tensors) != self._names:
            return None
        self._check_shapes(client, tensors.values())
        return tensors.runs()

    def _fold(self, runs: list[Run], weight: float) -> None:
        """acc += weight * widen(upload), per stretch of the upload's runs
        (``_kernels.fold_into``: the same operations per element as a whole-tensor float64
        temporary, so the same result)."""
        for flat, acc in self._pairs(runs):
            fold_into(acc, flat, weight, scratch=self._term, overwrite=not self._written)
        self._written = True
        self.weight_total += weight

    def _pairs(self, *uploads: list[Run]) -> list[tuple[np.ndarray, ...]]:
        """Views of ``uploads`` and of the sums over the stretches they share; a tensor each
        where every upload comes a tensor at a time (a plain dict's: no cutting needed)."""
        if all(len(runs) == len(self._names) for runs in uploads):
            views = [[view for _, _, view in runs] for runs in uploads]
            return list(zip(*views, self._acc.values(), strict=True))
        return stretches(self._size_list, *uploads, self._acc_runs)

    def _fold_group(self, group: list[_Upload]) -> None:
        """``_fold`` of each upload of ``group`` in order, several per pass over the sums
        (each element's sum is its own: per element the operations and their order are those
        of one upload at a time)."""
        if len(group) == 1:
            self._fold(*group[0])
        elif group:
            weights = [weight for _, weight in group]
            operands = [runs for runs, _ in group]
            for views in self._pairs(*operands):
                fold_many_into(
                    views[-1],
                    list(views[:-1]),
                    weights,
                    scratch=self._term,
                    overwrite=not self._written,
                )
            self._written = True
            for weight in weights:
                self.weight_total += weight
        group.clear()

    def _advance(self, group: list[_Upload] | None = None, *, fold: bool = True) -> None:
        """Sums the uploads of ``group`` and the waiting ones whose turn has come after them,
        in order (those in memory together); ``fold`` False leaves ``group`` to be summed with
        what may follow."""
        group = [] if group is None else group
        while self._next < len(self._order):
            client = self._order[self._next]
            if client in self._skipped:
                pass
            elif client in self._held:
                runs, weight = self._held.pop(client)
                self.held_bytes -= sum(view.nbytes for _, _, view in runs)
                group.append((runs, weight))
                self._added.add(client)
            elif client in self._spilled:
                self._fold_group(group)  # in order: what comes before it first
                weight = self._spilled.pop(client)
                path = self._spill_file(client)
                with np.load(path, allow_pickle=False) as stored:
                    loaded = [stored[f"arr_{i}"] for i in range(len(self._names))]
                    self._fold([(i, i + 1, flat) for i, flat in enumerate(loaded)], weight)
                path.unlink()
                self._added.add(client)
            else:
                break
            self._next += 1
        if fold:
            self._fold_group(group)

    def _spill_file(self, client: int) -> Path:
        return self._spill.file(f"client-{client}.npz")

    # ---------------------------------------------------------------- uploads on disk

    def _check_total(self) -> None:
        if not self.weight_total > 0:
            raise ProtocolError(
                f"The averaging weights sum to {self.weight_total}; a positive sum is needed."
            )

    def _stored_file(self, client: int) -> Path:
        return self._spill.file(f"client-{client}.bin")

    def _store(self, client: int, flats: Mapping[str, np.ndarray], weight: float) -> None:
        """Writes ``client``'s tensors' bytes, in the layout's order, to a file of its own
        (mode 0600, in the fold's private folder).

        Raises:
            OSError: the file could not be written whole (e.g. the disk is full); nothing of
                it is left, and the client may be added again.
        """
        path = self._stored_file(client)
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "wb", buffering=0) as file:
                for name in self._layout:
                    data = flats[name].data.cast("B")
                    for start in range(0, len(data), _WRITE_BYTES):
                        part = data[start : start + _WRITE_BYTES]
                        while part:
                            written = file.write(part)
                            part = part[written:]
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        self._stored[client] = (weight, [flats[name].dtype for name in self._layout])

    def _total_stored(self) -> None:
        """``weight_total`` of the stored uploads, added in client order as the streamed
        fold adds them."""
        self.weight_total = 0.0
        for client in self._order:
            if client in self._stored:
                self.weight_total += self._stored[client][0]

    def _sum_stored(self, finish: Callable[[str, int, np.ndarray], None]) -> None:
        """Adds the stored uploads up, in client order, a block of each tensor at a time; hands
        ``finish(name, start, sums)`` each block's float64 sums (a scratch array, reused)."""
        clients = [client for client in self._order if client in self._stored]
        weights = [self._stored[client][0] for client in clients]
        self._total_stored()
        largest = max(self._sizes.values(), default=1)
        block = max(1, min(DISK_BLOCK_ELEMENTS, largest))
        sums = np.empty(block)
        buffers: dict[np.dtype, list[np.ndarray]] = {}
        files = [os.open(self._stored_file(client), os.O_RDONLY) for client in clients]
        try:
            offsets = [0] * len(clients)
            for index, name in enumerate(self._layout):
                size = self._sizes[name]
                dtypes = [self._stored[client][1][index] for client in clients]
                for start in range(0, size, block):
                    count = min(block, size - start)
                    acc = sums[:count]
                    if not clients:
                        acc[...] = 0.0
                    for first in range(0, len(clients), FUSED_UPLOADS):
                        group = range(first, min(first + FUSED_UPLOADS, len(clients)))
                        flats = [
                            _read_block(
                                files[k],
                                offsets[k] + start * dtypes[k].itemsize,
                                _buffer(buffers, dtypes[k], j, block)[:count],
                            )
                            for j, k in enumerate(group)
                        ]
                        fold_many_into(
                            acc,
                            flats,
                            weights[first : first + len(flats)],
                            scratch=self._term,
                            overwrite=first == 0,
                        )
                    finish(name, start, acc)
                for k, dtype in enumerate(dtypes):
                    offsets[k] += size * dtype.itemsize
        finally:
            for descriptor in files:
                os.close(descriptor)

    def _mean_stored(self) -> dict[str, np.ndarray]:
        """``mean`` from the stored uploads: each block's sums divided straight into the
        result (``divide_into``, the same bits as the whole sums' division)."""
        means = {
            name: np.empty(shape, dtype=dtype) for name, (shape, dtype) in self._layout.items()
        }

        def divide(name: str, start: int, sums: np.ndarray) -> None:
            out = means[name].reshape(-1)[start : start + sums.size]
            divide_into(out, sums, self.weight_total, scratch=self._term)

        self._total_stored()
        self._check_total()
        self._sum_stored(divide)
        return means


def _check_weight(client: int, weight: float) -> None:
    if not (isinstance(weight, int | float) and np.isfinite(weight) and weight >= 0):
        raise ProtocolError(f"Client {client}'s weight {weight!r} is not a finite number >= 0.")


def _buffer(
    buffers: dict[np.dtype, list[np.ndarray]], dtype: np.dtype, index: int, size: int
) -> np.ndarray:
    """The ``index``-th read buffer of ``dtype`` (made on first use; reused block to block)."""
    kept = buffers.setdefault(dtype, [])
    while len(kept) <= index:
        kept.append(np.empty(size, dtype=dtype))
    return kept[index]


def _read_block(descriptor: int, offset: int, out: np.ndarray) -> np.ndarray:
    """Fills ``out`` with the file's bytes from ``offset`` (``os.preadv``, no copy).

    Raises:
        ProtocolError: the file ended first (a stored upload was cut short).
    """
    view = out.data.cast("B")
    done = 0
    while done < len(view):
        read = os.preadv(descriptor, [view[done:]], offset + done)
        if read == 0:
            raise ProtocolError("A stored upload's file ended before its last tensor.")
        done += read
    return out


def weighted_sum(
    reference: Tensors, uploads: Mapping[int, Tensors], weights: Mapping[int, float]
) -> OrderedFold:
    """The batch path: a fold of every upload at once, in client order (the result a fold
    of the same uploads arriving in any order equals, bit for bit)."""
    fold = OrderedFold(reference, uploads, hold_bytes=0)
    fold.add_all(uploads, weights)
    return fold


def fold_mean(uploads: Sequence[Tensors], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """The weighted mean of ``uploads`` (in that order, as clients 0, 1, ...)."""
    if len(uploads) != len(weights):
        raise ValueError(f"{len(uploads)} uploads but {len(weights)} weights were given.")
    if not uploads:
        raise ProtocolError("There is nothing to average: no uploads were given.")
    indexed = dict(enumerate(uploads))
    with weighted_sum(uploads[0], indexed, dict(enumerate(weights))) as fold:
        return fold.mean()

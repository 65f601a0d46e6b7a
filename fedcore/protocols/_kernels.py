"""The fold's per-element arithmetic, compiled for large arrays, numpy's for the rest.

Two operations, each bit-identical to a plain numpy expression for every input (and a third,
``squared_distance``, the squared L2 distance a server's bounds compare, whose two paths may
differ in their last bits; see there):

* ``fold_into(acc, flat, weight)``: ``acc += weight * flat.astype(np.float64)``, i.e. per
  element the float64 widening of ``flat[i]``, one rounded multiplication by ``weight`` and one
  rounded addition into ``acc[i]`` (what ``OrderedFold`` adds per upload);
* ``divide_into(out, acc, total)``: ``out[...] = (acc / total).astype(out.dtype)``: one
  rounded float64 division, then numpy's cast to the model's dtype.

Arrays of at least ``KERNEL_ELEMENTS`` elements whose dtypes the kernel is compiled for
(float32 or float64 in the machine's byte order, contiguous and aligned) go through a numba
kernel: one pass over memory, spread over half the process's usable cores, instead of numpy's
three passes over a cache-sized block on one core. numba is compiled with ``fastmath`` off, so
LLVM neither contracts the multiplication and addition into a fused multiply-add nor reorders
anything: each element goes through the same two IEEE operations as in numpy, and elements
do not depend on each other, so splitting them over threads changes no bit. The results equal
numpy's bit for bit, NaN, infinities, -0.0 and subnormals included (the tests check it), with
two provisos. When both operands of the addition (or of the multiplication: a NaN weight) are
NaN, which payload survives is not fixed, in numpy either: its SIMD loop keeps the first
operand's and its scalar loop, which takes an array's remainder, may keep the second's; the
kernel may keep either, and the result is a NaN with the same position either way (callers
refuse non-finite uploads before they fold them). And the process must not run with
flush-to-zero: the kernel's worker threads do not inherit the calling thread's floating-point
mode (fedcore never sets it, nor does torch unless ``torch.set_flush_denormal(True)`` is
called).

Everything else (smaller arrays, other dtypes, strided or unaligned or byte-swapped arrays,
and every array when numba cannot be imported, its threading layer cannot start or the kernel
fails to compile) goes through numpy, block by block in a float64 scratch that stays in cache,
never a model-sized temporary. A failure to load or compile is logged once (WARNING) with its
reason; the numpy path gives the same bits, only slower.

numba is imported lazily, the first time an array large enough is folded: importing fedcore,
or folding only arrays below the threshold (every shipped example's model), never imports it,
so a small run's start-up does not pay its import (0.1 s warm, up to 0.5 s cold) nor the
compilation. The
kernels are compiled on first use in each process (each dtype's variant apart: about 0.6 s
for the fold's float32 one and 0.2 s for the division's on a 2-core machine; the first large
fold of a process took about 1 s in all, ``docs/benchmarks.md``), and not cached on disk:
numba's cache is pickled, so a cache folder would hold code the server runs (a writable
``/tmp`` shared with other users would let them plant it), and the pods' root file system is
read-only.

Threads: the kernels run on half the process's usable cores (at least one: the others
receive and check the next uploads meanwhile), counted when they load: its CPU affinity,
capped by the cgroup's CPU quota when there is one (a pod's CPU limit), and by numba's pool
(``NUMBA_NUM_THREADS``, which defaults to the affinity). The environment variable
``FEDCORE_FOLD_THREADS``, read at each call, overrides the count (within numba's pool);
``FEDCORE_FOLD_THREADS=0`` turns the kernels off (numpy only, numba never imported). The
thread count changes no bit: elements are independent. One kernel runs at a time in a
process (a lock), so numba's ``workqueue`` layer, which refuses concurrent launches, is safe
too; the GIL is released while a kernel runs.

Threading layer and fork: numba's default choice (TBB if installed, else OpenMP where the
system has libgomp, else its own ``workqueue``; ``NUMBA_THREADING_LAYER`` picks another).
fedcore's server processes are forked from a forkserver that never folds, so numba is first
imported in the process that uses it. A process forked from one that already loaded the
kernels (GNU OpenMP cannot run in a child forked after it started) uses the numpy path.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

KERNEL_ELEMENTS = 1 << 20
"""Arrays with at least this many elements (4 MiB of float32) go through the compiled kernel.
Per call the kernel beats numpy's blocked path from a few 10**4 elements with OpenMP's thread
launch and from about 2**18 with numba's slowest (``workqueue``); the higher threshold keeps
models whose tensors are all smaller (every shipped example) from paying numba's import and
the compilation, about 1 s once per process, which the kernel repays after about 10 GB of
float32 uploads folded (it saves roughly 0.3 to 0.5 ns per element out of cache)."""

BLOCK_ELEMENTS = 1 << 15
"""Elements per block of the numpy path: 256 KiB of float64 scratch, well inside L2."""

THREADS_ENV = "FEDCORE_FOLD_THREADS"
"""The environment variable that overrides the kernels' thread count (0: numpy only)."""

_FOLD_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
"""The upload dtypes the fold kernel is compiled for (others take the numpy path)."""
_OUT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
"""The model dtypes the division kernel is compiled for."""
_F64 = np.dtype(np.float64)


# --------------------------------------------------------------------------------- API


def fold_into(
    acc: np.ndarray,
    flat: np.ndarray,
    weight: float,
    *,
    scratch: np.ndarray | None = None,
    overwrite: bool = False,
) -> None:
    """``acc += weight * flat.astype(np.float64)``, in place, bit for bit.

    With ``overwrite``, ``acc``'s values are never read: the sum starts from 0.0, as a zeroed
    ``acc``'s would (``0.0 + weight * x``, the same bits, a negative zero included), so ``acc``
    may be uninitialised (``np.empty``). A fresh accumulator is then written once instead of
    zeroed, read and written.

    Args:
        acc: the accumulator: 1-D, float64, C-contiguous, writeable.
        flat: the upload's values: 1-D, C-contiguous, as many as ``acc``; float32 or float64
            take the kernel (when large enough), any dtype numpy casts to float64 with
            ``casting="unsafe"`` takes the numpy path.
        weight: a float (converted with ``float``).
        scratch: float64 scratch of at least one element for the numpy path (its size is the
            block); None: a block is allocated for this call.

    Raises:
        ValueError: ``acc`` is not a 1-D C-contiguous writeable float64 array, ``flat`` does not
            match its length, or the two overlap in memory.
    """
    _check_acc(acc, "acc")
    if flat.ndim != 1 or flat.size != acc.size:
        raise ValueError(f"flat has shape {flat.shape}; {acc.shape} was expected.")
    if np.may_share_memory(acc, flat):
        raise ValueError("flat overlaps acc in memory.")
    weight = float(weight)
    name = "start" if overwrite else "fold"
    if acc.size >= KERNEL_ELEMENTS and flat.dtype in _FOLD_DTYPES and _kernel_ready(flat):
        kernels = _loader.get()
        if kernels is not None and kernels.run(name, acc, flat, weight):
            return
    _fold_numpy(acc, flat, weight, _scratch(scratch, acc.size), overwrite=overwrite)


FUSED_UPLOADS = 8
"""The most uploads ``fold_many_into`` adds in one pass over the accumulator."""
FUSED_SIZES = (2, 4, FUSED_UPLOADS)
"""The group sizes the fused kernel is run with (each a compilation of its own, on first use)."""


def fold_many_into(
    acc: np.ndarray,
    flats: list[np.ndarray],
    weights: list[float],
    *,
    scratch: np.ndarray | None = None,
    overwrite: bool = False,
) -> None:
    """``fold_into(acc, flat, weight)`` for each pair in order, bit for bit, in one pass over
    ``acc`` per ``FUSED_UPLOADS`` uploads: per element the float64 sum stays in a register
    through the same rounded multiplications and additions, in the same order, instead of
    crossing memory once per upload (16 bytes read and written per element and upload, against
    the upload's own 4 in float32). ``overwrite``: as ``fold_into``'s (the first pass starts
    from 0.0 and never reads ``acc``); with no arrays, ``acc`` is then zeroed.

    Raises:
        ValueError: as ``fold_into``, or as many weights as arrays were not given.
    """
    if len(flats) != len(weights):
        raise ValueError(f"{len(flats)} arrays but {len(weights)} weights were given.")
    _check_acc(acc, "acc")
    for flat in flats:
        if flat.ndim != 1 or flat.size != acc.size:
            raise ValueError(f"flat has shape {flat.shape}; {acc.shape} was expected.")
        if np.may_share_memory(acc, flat):
            raise ValueError("flat overlaps acc in memory.")
    start = 0
    fused = (
        acc.size >= KERNEL_ELEMENTS
        and len(flats) > 1
        and len({flat.dtype for flat in flats}) == 1
        and flats[0].dtype in _FOLD_DTYPES
        and _kernel_ready(*flats)
    )
    if fused:
        kernels = _loader.get()
        while kernels is not None and len(flats) - start >= 2:
            left = len(flats) - start
            count = max(size for size in FUSED_SIZES if size <= left)
            # One tuple type for the kernel: read-only views of them all.
            group = tuple(_read_only(flat) for flat in flats[start : start + count])
            factors = tuple(float(w) for w in weights[start : start + count])
            name = "start" if overwrite and start == 0 else "fold"
            if not kernels.run(f"{name}{count}", acc, group, factors):
                break
            start += count
    for flat, weight in zip(flats[start:], weights[start:], strict=True):
        fold_into(acc, flat, weight, scratch=scratch, overwrite=overwrite and start == 0)
        start += 1
    if overwrite and not flats:
        acc.fill(0.0)


def divide_into(
    out: np.ndarray, acc: np.ndarray, total: float, *, scratch: np.ndarray | None = None
) -> None:
    """``out[...] = (acc / total).astype(out.dtype)``, bit for bit, with no temporary of the
    array's size.

    Args:
        out: the result, 1-D, C-contiguous, writeable, as many elements as ``acc``, in the
            model's dtype (float32 or float64 take the kernel when large enough; any dtype
            numpy casts float64 to with ``casting="unsafe"`` takes the numpy path).
        acc: the float64 sums: 1-D, C-contiguous.
        total: the divisor (converted with ``float``; 0 gives numpy's inf and NaN).
        scratch: float64 scratch for the numpy path, as for ``fold_into``.

    Raises:
        ValueError: the arrays are not 1-D and C-contiguous, ``acc`` is not float64, their
            lengths differ, or they overlap in memory.
    """
    _check_acc(acc, "acc", writeable=False)
    if out.ndim != 1 or out.size != acc.size or not out.flags.c_contiguous:
        raise ValueError(f"out must be 1-D, C-contiguous, of shape {acc.shape}; got {out.shape}.")
    if np.may_share_memory(out, acc):
        raise ValueError("out overlaps acc in memory.")
    total = float(total)
    if acc.size >= KERNEL_ELEMENTS and out.dtype in _OUT_DTYPES and _kernel_ready(out, acc):
        kernels = _loader.get()
        if kernels is not None and kernels.run("divide", out, acc, total):
            return
    _divide_numpy(out, acc, total, _scratch(scratch, acc.size))


NORM_BLOCK = 1 << 16
"""Elements per block of ``squared_distance``'s compiled sum: each block is summed on one thread
in a fixed order, and the blocks' sums are added in order, so no thread count changes a bit."""
_SMALL_NORM = 4096
"""Arrays up to this many elements are differenced in one numpy call (casting as it goes)."""


def squared_distance(
    flat: np.ndarray,
    ref: np.ndarray | None = None,
    *,
    scratch: tuple[np.ndarray, np.ndarray] | None = None,
) -> float:
    """The sum over elements of ``(float64(flat) - float64(ref)) ** 2`` (of ``float64(flat) **
    2`` without ``ref``): a squared L2 distance, in float64, NaN or inf if any value is.

    Large float32/float64 arrays take a compiled kernel (one pass reading each input once,
    over the kernels' threads); the rest numpy, block by block in float64 scratch. The two
    paths add in different orders, so their results may differ in the last bits (a bound is
    compared with this sum; nothing is computed from it); neither depends on the thread count.

    Args:
        flat: 1-D, C-contiguous.
        ref: the same length as ``flat``, 1-D, C-contiguous; None: distance to 0.
        scratch: two float64 arrays of at least one element for the numpy path (their size
            is its block); None: allocated for this call.

    Raises:
        ValueError: the arrays are not 1-D and C-contiguous, or their lengths differ.
    """
    arrays = [flat] if ref is None else [flat, ref]
    for array in arrays:
        if array.ndim != 1 or not array.flags.c_contiguous or array.size != flat.size:
            raise ValueError(f"A 1-D C-contiguous array of {flat.size} was expected.")
    if (
        flat.size >= KERNEL_ELEMENTS
        and all(array.dtype in _FOLD_DTYPES for array in arrays)
        and _kernel_ready(*arrays)
    ):
        kernels = _loader.get()
        if kernels is not None:
            blocks = np.empty(-(-flat.size // NORM_BLOCK), dtype=np.float64)
            other = flat if ref is None else ref
            if kernels.run("squares", blocks, flat, other, ref is not None, NORM_BLOCK):
                return float(np.sum(blocks))
    if scratch is None:
        size = max(1, min(BLOCK_ELEMENTS, flat.size))
        scratch = (np.empty(size, dtype=np.float64), np.empty(size, dtype=np.float64))
    return _squares_numpy(flat, ref, *scratch)


def fold_threads() -> int:
    """How many threads the kernels use: ``FEDCORE_FOLD_THREADS`` if set (0: the kernels are
    off), else ``default_threads()``."""
    named = _threads_setting()
    return default_threads() if named is None else named


def default_threads() -> int:
    """Half the usable cores, at least one: a server receives, decodes and checks the next
    uploads on the other cores while it folds (on the 2-core VM of docs/benchmarks.md one
    thread folded at 27% of the copy bandwidth, two at 17%)."""
    return max(1, usable_cores() // 2)


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity), capped by the cgroup's CPU quota
    (rounded up) when one is set: a pod's CPU limit does not narrow its affinity."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)


def kernel_info() -> dict[str, Any]:
    """What the kernels are doing in this process (for logs and benchmarks): ``state`` is
    "not loaded" (numba not imported), "loaded", "off" (``FEDCORE_FOLD_THREADS=0``) or
    "unavailable" (with ``reason``); once loaded also numba's version, its threading layer
    (after the first kernel ran), the threads and the seconds spent importing and compiling."""
    return _loader.info()


# --------------------------------------------------------------------------- numpy path


def _fold_numpy(
    acc: np.ndarray, flat: np.ndarray, weight: float, scratch: np.ndarray, *, overwrite: bool
) -> None:
    """acc += weight * widen(flat), block by block (the same operations per element as a
    whole-array float64 temporary, so the same result); ``overwrite``: acc = 0.0 + ..."""
    block = scratch.size
    for start in range(0, flat.size, block):
        stop = min(start + block, flat.size)
        term = scratch[: stop - start]
        np.copyto(term, flat[start:stop], casting="unsafe")
        np.multiply(term, weight, out=term)
        np.add(0.0 if overwrite else acc[start:stop], term, out=acc[start:stop])


def _divide_numpy(out: np.ndarray, acc: np.ndarray, total: float, scratch: np.ndarray) -> None:
    """out = cast(acc / total), block by block (``astype``'s cast is ``copyto``'s unsafe one)."""
    block = scratch.size
    for start in range(0, acc.size, block):
        stop = min(start + block, acc.size)
        quotient = scratch[: stop - start]
        np.divide(acc[start:stop], total, out=quotient)
        np.copyto(out[start:stop], quotient, casting="unsafe")


def _squares_numpy(
    flat: np.ndarray, ref: np.ndarray | None, acc: np.ndarray, other: np.ndarray
) -> float:
    """``squared_distance`` block by block in float64 scratch that stays in cache: no
    array-sized float64 temporaries, each input read once."""
    total = 0.0
    if flat.size <= min(_SMALL_NORM, acc.size):
        # One call: the same float64 differences, where the calls, not the bytes, cost.
        a = acc[: flat.size]
        if ref is None:
            np.copyto(a, flat, casting="unsafe")
        else:
            np.subtract(flat, ref, out=a, dtype=np.float64)
        return float(np.dot(a, a))
    block = min(acc.size, other.size)
    for start in range(0, flat.size, block):
        stop = min(start + block, flat.size)
        a = acc[: stop - start]
        np.copyto(a, flat[start:stop], casting="unsafe")
        if ref is not None:
            b = other[: stop - start]
            np.copyto(b, ref[start:stop], casting="unsafe")
            np.subtract(a, b, out=a)
        total += float(np.dot(a, a))
    return total


def _scratch(scratch: np.ndarray | None, size: int) -> np.ndarray:
    if scratch is None:
        return np.empty(max(1, min(BLOCK_ELEMENTS, size)), dtype=np.float64)
    if scratch.dtype != _F64 or scratch.ndim != 1 or scratch.size < 1:
        raise ValueError("scratch must be a 1-D float64 array of at least one element.")
    return scratch


def _check_acc(acc: np.ndarray, what: str, *, writeable: bool = True) -> None:
    if acc.dtype != _F64 or acc.ndim != 1 or not acc.flags.c_contiguous:
        raise ValueError(
            f"{what} must be a 1-D C-contiguous float64 array; got {acc.dtype}{list(acc.shape)}."
        )
    if writeable and not acc.flags.writeable:
        raise ValueError(f"{what} is read-only.")


def _read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view of ``array`` (the array itself if it is read-only already)."""
    if not array.flags.writeable:
        return array
    view = array.view()
    view.flags.writeable = False
    return view


def _kernel_ready(*arrays: np.ndarray) -> bool:
    """Whether the arrays suit the compiled kernel: contiguous and aligned (the dtype checks
    already excluded byte-swapped arrays)."""
    return all(a.flags.c_contiguous and a.flags.aligned for a in arrays)


# ------------------------------------------------------------------------------ kernels


def _compile(numba: Any) -> dict[str, Callable[..., None]]:
    """The numba dispatchers (each signature compiles on its first call).

    ``fastmath=False``: no contraction into FMA, no reassociation. ``error_model="numpy"``:
    a division by zero gives inf/NaN as in numpy (the default raises, and its per-element
    check would stop vectorisation). ``nogil``: other threads run while a kernel does."""
    options = {"parallel": True, "fastmath": False, "error_model": "numpy", "nogil": True}

    @numba.njit(**options)
    def fold(acc: np.ndarray, x: np.ndarray, weight: float) -> None:  # pragma: no cover
        for i in numba.prange(acc.size):
            acc[i] += weight * np.float64(x[i])

    @numba.njit(**options)
    def fold_many(acc: np.ndarray, xs: tuple, weights: tuple) -> None:  # pragma: no cover
        # One specialisation per tuple length: the inner loop is unrolled, the sum stays in a
        # register through the uploads in order.
        for i in numba.prange(acc.size):
            a = acc[i]
            for k in range(len(xs)):
                a += weights[k] * np.float64(xs[k][i])
            acc[i] = a

    @numba.njit(**options)
    def start(acc: np.ndarray, x: np.ndarray, weight: float) -> None:  # pragma: no cover
        # 0.0 + term, not term: a zeroed accumulator's bits (-0.0 becomes 0.0). Without
        # fastmath's nsz LLVM keeps the addition.
        for i in numba.prange(acc.size):
            acc[i] = 0.0 + weight * np.float64(x[i])

    @numba.njit(**options)
    def start_many(acc: np.ndarray, xs: tuple, weights: tuple) -> None:  # pragma: no cover
        for i in numba.prange(acc.size):
            a = 0.0
            for k in range(len(xs)):
                a += weights[k] * np.float64(xs[k][i])
            acc[i] = a

    @numba.njit(**options)
    def divide(out: np.ndarray, acc: np.ndarray, total: float) -> None:  # pragma: no cover
        for i in numba.prange(acc.size):
            out[i] = acc[i] / total

    # A block's sum of squares may be reassociated (vectorised) and contracted (FMA): it is
    # compared with a bound, never folded into a result, and its order is fixed per build,
    # whatever the thread count. NaN and inf still propagate (no nnan/ninf).
    reduce = {"fastmath": {"reassoc", "contract"}, "error_model": "numpy", "nogil": True}

    @numba.njit(**reduce)
    def block_distance(x: np.ndarray, ref: np.ndarray) -> float:  # pragma: no cover
        total = 0.0
        for i in range(x.size):
            d = np.float64(x[i]) - np.float64(ref[i])
            total += d * d
        return total

    @numba.njit(**reduce)
    def block_squares(x: np.ndarray) -> float:  # pragma: no cover
        total = 0.0
        for i in range(x.size):
            d = np.float64(x[i])
            total += d * d
        return total

    @numba.njit(**options)
    def squares(
        out: np.ndarray, x: np.ndarray, ref: np.ndarray, differ: bool, block: int
    ) -> None:  # pragma: no cover
        for b in numba.prange(out.size):
            start = b * block
            stop = min(start + block, x.size)
            if differ:
                out[b] = block_distance(x[start:stop], ref[start:stop])
            else:
                out[b] = block_squares(x[start:stop])

    return {
        "fold": fold,
        **{f"fold{count}": fold_many for count in FUSED_SIZES},
        "start": start,
        **{f"start{count}": start_many for count in FUSED_SIZES},
        "divide": divide,
        "squares": squares,
    }


class _Kernels:
    """The loaded kernels of one process, run one at a time."""

    def __init__(self, loader: _Loader, numba: Any, functions: dict[str, Callable[..., None]]):
        self._loader = loader
        self.numba = numba
        self._functions = functions
        self._compiled: set[tuple[str, tuple[str, ...]]] = set()
        self._cores = min(default_threads(), int(numba.config.NUMBA_NUM_THREADS))
        """The default thread count, fixed when the kernels load (numba's pool is too)."""

    def run(self, name: str, *args: Any) -> bool:
        """Runs kernel ``name``; False (logged once, kernels then off) when it cannot be
        compiled or its threading layer cannot start: nothing was written, numpy takes over."""
        named = _threads_setting()
        threads = self._cores if named is None else min(named, self.numba.config.NUMBA_NUM_THREADS)
        if threads < 1:
            return False
        key = (name, tuple(_type_key(a) for a in args))
        with self._loader.lock:
            started = time.perf_counter()
            try:
                self.numba.set_num_threads(threads)  # per calling thread, in numba
                self._functions[name](*args)
            except Exception as error:  # compile or threading-layer failure: numpy takes over
                self._loader.fail(f"the {name} kernel failed to compile or start: {error!r}")
                return False
            self._loader.threads = threads
            if key not in self._compiled:
                self._compiled.add(key)
                self._loader.first_run(name, key[1], time.perf_counter() - started, threads)
        return True


def _type_key(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return value.dtype.name if value.flags.writeable else f"readonly {value.dtype.name}"
    if isinstance(value, tuple):
        return f"({', '.join(_type_key(item) for item in value)})"
    return type(value).__name__


class _Loader:
    """Imports numba and builds the kernels once per process, on first need."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kernels: _Kernels | None = None
        self.failed: str | None = None
        self.numba_version: str | None = None
        self.import_seconds: float | None = None
        self.compile_seconds: dict[str, float] = {}
        self.threads: int | None = None
        """The threads of the last kernel run."""

    def get(self) -> _Kernels | None:
        """The kernels, or None: turned off (``FEDCORE_FOLD_THREADS=0``) or unavailable."""
        if self.failed is not None or _threads_setting() == 0:
            return None
        if self.kernels is None:
            with self.lock:
                if self.kernels is None and self.failed is None:
                    self._load()
        return self.kernels if self.failed is None else None

    def _load(self) -> None:
        started = time.perf_counter()
        try:
            import numba

            functions = _compile(numba)
        except Exception as error:  # ImportError, or a broken numba/llvmlite install
            self.fail(f"numba cannot be used: {error!r}")
            return
        self.import_seconds = time.perf_counter() - started
        self.numba_version = str(numba.__version__)
        self.kernels = _Kernels(self, numba, functions)

    def fail(self, reason: str) -> None:
        """Turns the kernels off in this process, saying why (once)."""
        if self.failed is None:
            self.failed = reason
            log.warning("The fold's compiled kernel is off (%s); numpy folds instead.", reason)

    def first_run(self, name: str, types: tuple[str, ...], seconds: float, threads: int) -> None:
        """Notes a kernel signature's first run (its compilation included)."""
        label = f"{name}({', '.join(types)})"
        self.compile_seconds[label] = seconds
        log.info(
            "Compiled the fold's %s kernel in %.2f s (numba %s, threading layer %s, %d threads).",
            label,
            seconds,
            self.numba_version,
            self.layer(),
            threads,
        )

    def layer(self) -> str | None:
        """numba's threading layer, once a kernel has started it."""
        if self.kernels is None:
            return None
        try:
            return str(self.kernels.numba.threading_layer())
        except ValueError:  # no parallel kernel has run yet
            return None

    def after_fork_in_child(self) -> None:
        """In a forked child: a fresh lock (another thread may have held the parent's), and
        no kernels if the parent had started loading them (GNU OpenMP cannot run in a child
        forked after it started; the numpy path gives the same bits)."""
        loading = self.lock.locked()
        self.lock = threading.Lock()
        if self.kernels is not None or loading:
            self.kernels = None
            self.fail("this process was forked from one that had loaded numba")

    def info(self) -> dict[str, Any]:
        if _threads_setting() == 0:
            return {"state": "off"}
        if self.failed is not None:
            return {"state": "unavailable", "reason": self.failed}
        if self.kernels is None:
            return {"state": "not loaded"}
        return {
            "state": "loaded",
            "numba": self.numba_version,
            "threading_layer": self.layer(),
            "threads": self.threads,
            "import_seconds": self.import_seconds,
            "compile_seconds": dict(self.compile_seconds),
        }


_loader = _Loader()


def _after_fork_in_child() -> None:
    _loader.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


# ------------------------------------------------------------------------------ helpers


def _threads_setting() -> int | None:
    """``FEDCORE_FOLD_THREADS`` as a count >= 0, or None when unset (or not such a count,
    which is logged once)."""
    named = os.environ.get(THREADS_ENV, "").strip()
    if not named:
        return None
    try:
        count = int(named)
    except ValueError:
        count = -1
    if count >= 0:
        return count
    if named not in _BAD_SETTINGS:
        _BAD_SETTINGS.add(named)
        log.warning("%s=%r is not a whole number >= 0; using the default.", THREADS_ENV, named)
    return None


_BAD_SETTINGS: set[str] = set()


@functools.cache
def _cgroup_quota() -> float | None:
    """The cgroup's CPU quota in CPUs (v2 ``cpu.max``, else v1's CFS quota), or None (read
    once per process)."""
    try:
        fields = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except OSError:
        pass
    else:
        try:
            if len(fields) == 2 and fields[0] != "max" and int(fields[1]) > 0:
                return int(fields[0]) / int(fields[1])
        except ValueError:
            pass
        return None
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None

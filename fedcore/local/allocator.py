"""The C allocator's thresholds in a role process: message-sized buffers reused, not remapped.

A role allocates and frees buffers the size of a message for every message it moves: the
body a decoder fills, the bytes an encoded upload is joined into, the copies gRPC makes. glibc's
``malloc`` serves a request above its mmap threshold (128 KiB at first, raised on the fly up
to the largest block freed) with pages of its own and unmaps them on ``free``, and it hands the
heap's free top back to the system once it passes the trim threshold (twice the mmap
threshold). Where two such buffers are alive at once (a client holds its decoded task while it
encodes its upload), the heap top is trimmed at every free and every new buffer faults in fresh
pages: a loop of two 400 KB buffers took 32,535 page faults in 200 turns with the defaults and
98 with the thresholds below (tests/unit/test_allocator.py counts them). In a round's transport
(``benchmarks/exchange.py``, mpdp's 400 KB uploads, 2026-11-28) they took a client process's
CPU per exchange from 836 us to 657 us, and both ends' from 1,657 us to 1,466 us.

``tune_allocator`` sets the mmap threshold to ``MMAP_THRESHOLD_BYTES`` (larger buffers, a big
model's tensors, still get pages of their own and give them back when freed) and the trim
threshold to ``TRIM_THRESHOLD_BYTES``: a process keeps at most that much free memory at its
heap's top. Setting them turns glibc's on-the-fly adjustment off. The settings are process
state, so a role forked from the forkserver keeps them. Where the C library is not glibc, or
the environment sets glibc's own knobs (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
``GLIBC_TUNABLES``: an operator's choice wins), nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 4 << 20
"""Requests up to this size come from the heap (reused once freed): a chunk of a message
(``spec.transport.chunkBytes`` defaults to 4 MiB) and everything smaller."""
TRIM_THRESHOLD_BYTES = 16 << 20
"""The most free memory a process keeps at its heap's top instead of giving it back."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
"""``mallopt`` parameters (glibc's malloc.h)."""
USER_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
"""Environment variables through which the allocator was configured by whoever started us."""

_DONE: list[bool] = []


def tune_allocator() -> bool:
    """Sets glibc malloc's mmap and trim thresholds for this process (once; idempotent).

    Returns:
        Whether they are set: False where the C library has no ``mallopt`` that takes them
        (not glibc) or the environment configures the allocator itself.
    """
    if _DONE:
        return _DONE[0]
    done = False
    if not any(name in os.environ for name in USER_KNOBS):
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
        if mallopt is not None:
            mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
            mallopt.restype = ctypes.c_int
            done = bool(
                mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
            )
        if not done:
            log.debug("The C allocator's thresholds were left as they are (no glibc mallopt).")
    _DONE.append(done)
    return done

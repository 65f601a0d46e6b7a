"""Giving freed memory back to the operating system (glibc's ``malloc_trim``).

torch allocates a large model's gradients and activations from the C heap. glibc serves blocks
under its mmap threshold from the heap, and raises that threshold (up to 32 MiB) each time a
block it had mapped is freed, so a transformer's per-layer tensors end up on the heap; freed,
they stay in the process (its resident memory) until reused. A client that has dropped its
gradients then holds their bytes while it receives the next model: a model's size more than it
needs. ``trim`` hands the freed pages back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_BYTES = 64 * 1024 * 1024
"""Below this many bytes freed, trimming is not worth its walk of the heap."""


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        function = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


def trim(freed_bytes: int) -> bool:
    """Gives the C heap's free pages back to the operating system when about ``freed_bytes``
    were just freed (at least ``TRIM_BYTES``); returns whether it trimmed. A no-op without
    glibc."""
    if freed_bytes < TRIM_BYTES:
        return False
    function = _malloc_trim()
    if function is None:
        return False
    function(0)
    return True

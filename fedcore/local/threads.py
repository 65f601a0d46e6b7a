"""How many threads the maths runs on: torch's pool and the BLAS libraries' (numpy's OpenBLAS).

A matrix product computed with another number of threads can round differently: BLAS kernels
split the work by thread, and on some CPUs (MKL's AVX2 kernels, for one) the split changes the
order of the sums even for a product as small as a digits model's forward pass. So a role
process and ``simulate()`` agree bit for bit only when they run at the same count, and both
default to ``ROLE_THREADS``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

ROLE_THREADS = 1
"""Threads of each role process unless ``fedcore run --threads`` says otherwise; ``simulate()``
runs at this count too."""


_BLAS_LIMIT: list[int] = []
"""The BLAS thread cap this process set for good, if any (kept across a fork, as the libraries'
own settings are: a role forked from the forkserver, which set it, need not find the libraries
again, which costs threadpoolctl a scan of every loaded library)."""


def limit_threads(threads: int) -> None:
    """Caps this process's torch and BLAS threads at ``threads`` for good (a role process:
    many roles share a machine in local runs)."""
    import torch

    count = max(1, threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(count))
    torch.set_num_threads(count)
    if [count] != _BLAS_LIMIT:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=count)
        _BLAS_LIMIT[:] = [count]


@contextmanager
def threads_limited(threads: int) -> Iterator[None]:
    """Runs the block with torch and the BLAS libraries at ``threads`` threads, then restores
    the counts they had."""
    import torch
    from threadpoolctl import threadpool_limits

    count = max(1, threads)
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        with threadpool_limits(limits=count):
            yield
    finally:
        torch.set_num_threads(before)

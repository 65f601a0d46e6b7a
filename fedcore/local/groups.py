"""How the local runner spreads a run's clients over processes (pure functions).

A client per process is what a pod is, and is what ``fedcore run`` does while that pays: every
client then has its own interpreter, and one killed or crashed client is one lost client. Past
``PROCESS_CLIENTS_PER_CORE`` clients per core, processes stop paying on a small machine: each
costs an interpreter's private memory and a wake-up per round, and the scheduler shares the
cores among more processes than it can run. Then clients are grouped (``fedcore clients``,
``fedcore.roles.client_group``), as evenly as possible, into about ``GROUPS_PER_CORE``
processes per core. Decentralized protocols keep a process per client (each serves peer links).
"""

from __future__ import annotations

import math
import os

PROCESS_CLIENTS_PER_CORE = 8
"""Up to this many clients per core, each client has a process of its own (auto)."""
GROUPS_PER_CORE = 2
"""Beyond that, clients share this many processes per core (auto)."""


def clients_per_process(
    clients: int, *, cores: int | None = None, decentralized: bool = False
) -> int:
    """How many clients share one process when the user does not say (``--clients-per-process
    auto``): 1 up to ``PROCESS_CLIENTS_PER_CORE`` clients per core, else enough to make about
    ``GROUPS_PER_CORE`` processes per core."""
    cores = max(1, cores or os.cpu_count() or 1)
    if decentralized or clients <= PROCESS_CLIENTS_PER_CORE * cores:
        return 1
    return math.ceil(clients / (GROUPS_PER_CORE * cores))


def client_groups(clients: int, per_process: int) -> list[list[int]]:
    """Splits client indexes 0..clients-1 into consecutive groups of at most ``per_process``,
    as even as possible (sizes differ by at most one).

    Raises:
        ValueError: ``per_process`` is below 1.
    """
    if per_process < 1:
        raise ValueError(f"Clients per process must be at least 1, got {per_process}.")
    if clients < 1:
        return []
    count = math.ceil(clients / per_process)
    base, extra = divmod(clients, count)
    groups, start = [], 0
    for number in range(count):
        size = base + (1 if number < extra else 0)
        groups.append(list(range(start, start + size)))
        start += size
    return groups


def group_name(indexes: list[int]) -> str:
    """The runner's name (and log file) of a process of clients: ``client-3`` for one,
    ``clients-0-24`` for a group."""
    if len(indexes) == 1:
        return f"client-{indexes[0]}"
    return f"clients-{indexes[0]}-{indexes[-1]}"

"""How the local runner spreads a run's clients over processes (pure functions).

A client per process is what a pod is, and is what ``fedcore run`` does while that pays: every
client then has its own interpreter, and one killed or crashed client is one lost client. Past
``PROCESS_CLIENTS_PER_CORE`` clients per core, processes stop paying on a small machine: each
costs an interpreter's private memory and a wake-up per round, and the scheduler shares the
cores among more processes than it can run. Then clients are grouped (``fedcore clients``,
``fedcore.roles.client_group``), as evenly as possible, into about ``GROUPS_PER_CORE``
processes per core. Decentralized protocols keep a process per client (each serves peer links).

Memory can group them too: a large model is held once by each process of clients (they share
it, ``fedcore.transport.Turn``) and about four times by the server (the model, the float64 sum
of the uploads and the upload being checked), twice where its uploads go to disk
(``spec.uploads.storage``: Disk, or Auto where four would not fit). When the machine's
available memory would not hold the server and a process per group, auto puts more clients in
each process, down to one process of clients.
"""

from __future__ import annotations

import math
import os

PROCESS_CLIENTS_PER_CORE = 8
"""Up to this many clients per core, each client has a process of its own (auto)."""
GROUPS_PER_CORE = 2
"""Beyond that, clients share this many processes per core (auto)."""
PROCESS_BYTES = 300 * 2**20
"""A role process's memory besides its model: the interpreter, torch, gRPC (measured about
0.26 GB for a client, up to 0.55 GB for a server with a tiny model; docs/benchmarks.md)."""
SERVER_MODEL_COPIES = 4.0
"""Model-sized buffers a server holds: the model, the float64 sum (two), the upload it checks."""
SERVER_DISK_MODEL_COPIES = 2.0
"""The same with its uploads on disk (``spec.uploads.storage``): the model and the upload it
checks, then the old model and the new one."""
CLIENT_PROCESS_MODEL_COPIES = 1.3
"""Model-sized buffers a process of clients holds: the model once, plus its activations and a
layer's gradients (measured 1.16x at 1 billion parameters, 1.26x at 101 million)."""
MEMORY_FRACTION = 0.9
"""The share of the available memory auto plans to fill."""


def clients_per_process(
    clients: int,
    *,
    cores: int | None = None,
    decentralized: bool = False,
    model_bytes: int = 0,
    memory_bytes: int | None = None,
    storage: str = "Auto",
) -> int:
    """How many clients share one process when the user does not say (``--clients-per-process
    auto``): 1 up to ``PROCESS_CLIENTS_PER_CORE`` clients per core, else enough to make about
    ``GROUPS_PER_CORE`` processes per core; more where ``memory_bytes`` (None: unknown) would
    not hold the server and every process of clients for a model of ``model_bytes``
    (``planned_bytes``; the server's uploads as ``storage``, ``spec.uploads.storage``, puts
    them), down to all clients in one process. Decentralized protocols: 1."""
    cores = max(1, cores or os.cpu_count() or 1)
    if decentralized:
        return 1
    per_process = 1
    if clients > PROCESS_CLIENTS_PER_CORE * cores:
        per_process = math.ceil(clients / (GROUPS_PER_CORE * cores))
    if memory_bytes is None or clients < 1:
        return per_process
    on_disk = uploads_on_disk(storage, model_bytes, memory_bytes)
    room = MEMORY_FRACTION * memory_bytes - server_bytes(model_bytes, uploads_on_disk=on_disk)
    fitting = max(1, int(room // client_process_bytes(model_bytes)))
    return max(per_process, math.ceil(clients / fitting))


def server_bytes(model_bytes: int, *, uploads_on_disk: bool = False) -> float:
    """What auto plans for the server's memory, for a model of ``model_bytes``."""
    copies = SERVER_DISK_MODEL_COPIES if uploads_on_disk else SERVER_MODEL_COPIES
    return PROCESS_BYTES + copies * model_bytes


def uploads_on_disk(storage: str, model_bytes: int, memory_bytes: int | None) -> bool:
    """Whether a server keeps its uploads on disk (``spec.uploads.storage``): Disk, or Auto
    where ``memory_bytes`` (None: unknown, then Memory) would not hold ``server_bytes`` with
    the uploads in memory."""
    if storage != "Auto":
        return storage == "Disk"
    return memory_bytes is not None and server_bytes(model_bytes) > MEMORY_FRACTION * memory_bytes


def client_process_bytes(model_bytes: int) -> float:
    """What auto plans for one process of clients (one or many), for a model of ``model_bytes``."""
    return PROCESS_BYTES + CLIENT_PROCESS_MODEL_COPIES * model_bytes


def planned_bytes(
    clients: int, per_process: int, model_bytes: int, *, uploads_on_disk: bool = False
) -> float:
    """The memory auto plans for the server and the processes of ``clients`` clients."""
    processes = math.ceil(clients / per_process) if clients > 0 else 0
    server = server_bytes(model_bytes, uploads_on_disk=uploads_on_disk)
    return server + processes * client_process_bytes(model_bytes)


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

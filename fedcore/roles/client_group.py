"""Several client roles in one process, each with its own identity, on one event loop.

One process per client is what a pod is, and what ``fedcore run`` does for small runs. With
hundreds of clients on a few cores, a process each costs every client an interpreter's memory
and the machine a context switch per client and round. A client group runs many clients in one
process instead (``fedcore clients``, chosen by ``fedcore.local.groups``), and keeps what makes
each one a participant of its own: its TLS key and certificate (so the server authenticates
each as itself), its data shard, learner, protocol state, sessions and metrics endpoint. What
they share is the interpreter, the loaded manifest, torch's thread pool and the model's
memory: one network, which every training or scoring call loads with the weights it is given
(a large model is held once per process, not once per client; a client that trained in its
task's arrays uploads them, and the next client's load never writes them).

Every client's session is a coroutine on one asyncio loop (``Client.serve_async``): a message
costs a step of the loop, not a hand-off between a client's threads. Clients of a group
compute one at a time, on the loop's thread (and under one lock, ``Client(compute_lock=...)``,
for what runs beside it: a KDC call waits in a thread of its own): torch's RNG is global to a
process, and a client forks and reseeds it for every training call, so two clients training at
once could draw from each other's stream. So each client computes exactly what it would in its
own process (tested bit for bit); the GIL would have serialized most of that Python-bound work
anyway.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fedcore.errors import FedcoreError
from fedcore.roles._common import RoleConfig, settle_role_process
from fedcore.roles.client import Client
from fedcore.spec import load_manifest, protocol_facts
from fedcore.transport import TlsBundle, Turn

log = logging.getLogger(__name__)

INDEX_FIELD = "{index}"
"""What ``--tls-dir`` of a group names each client's bundle folder by (``pki/client-{index}``)."""


MEMBER: contextvars.ContextVar[str] = contextvars.ContextVar("fedcore_member", default="")
"""The client a log line is about: set in each client's task (and so in the threads it starts
with ``asyncio.to_thread``)."""


class _MemberName(logging.Filter):
    """Gives every record a ``member``: the client it is about, else its thread's name."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.member = MEMBER.get() or record.threadName
        return True


def name_members_in_logs() -> None:
    """Lets the root logger's handlers format ``%(member)s`` (``fedcore clients`` does):
    every client's lines name it, though all run on one thread."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(found, _MemberName) for found in handler.filters):
            handler.addFilter(_MemberName())


@dataclass(frozen=True)
class Member:
    """One client of a group: its index and where its /metrics is served (0: not served)."""

    index: int
    metrics_port: int = 0


class ClientGroupFailed(FedcoreError):
    """Some clients of a group ended with an error (each was logged when it happened)."""


def member_tls_dir(template: Path, index: int) -> Path:
    """The bundle folder of client ``index``: ``template`` with ``{index}`` filled in.

    Raises:
        FedcoreError: the template names no ``{index}`` (every client would share one key).
    """
    text = str(template)
    if INDEX_FIELD not in text:
        raise FedcoreError(
            f"--tls-dir {text!r} of a client group must contain {INDEX_FIELD}: each client "
            f"has its own key and certificate (e.g. pki/client-{INDEX_FIELD})."
        )
    return Path(text.replace(INDEX_FIELD, str(index)))


def run_client_group(
    config: RoleConfig,
    members: list[Member],
    *,
    server: str,
    kdc: str | None,
) -> dict[int, dict[str, Any]]:
    """The ``fedcore clients`` entry point: runs ``members`` as clients of one run, each a
    coroutine on one event loop, until every one has ended; returns each one's summary.

    ``config.tls_dir`` is a template with ``{index}``; ``config.metrics_port`` is unused (each
    member names its own).

    Raises:
        FedcoreError: the group is empty, names a client twice, or the protocol is
            decentralized (its clients serve peer links: one process each).
        ClientGroupFailed: at least one client ended with an error.
    """
    indexes = [member.index for member in members]
    if not indexes or len(set(indexes)) != len(indexes):
        raise FedcoreError(f"A client group needs distinct client indexes, got {indexes}.")
    run = load_manifest(config.manifest)
    if protocol_facts(run.spec.protocol.name).decentralized:
        raise FedcoreError(
            f"Protocol {run.spec.protocol.name!r} is decentralized: its clients serve peer "
            f"links, so each runs in a process of its own (fedcore client)."
        )
    settle_role_process(config.threads)
    name_members_in_logs()
    lock = threading.Lock()
    clients: list[Client] = []
    model = None  # one model for the group: the clients compute one at a time
    turn = Turn()  # and one of them at a time holds a large task's bytes
    for member in members:
        own = replace(
            config,
            tls_dir=member_tls_dir(config.tls_dir, member.index),
            metrics_port=member.metrics_port,
        )
        tls = TlsBundle.load(own.tls_dir)
        token = MEMBER.set(f"client-{member.index}")
        try:
            client = Client(
                run,
                own,
                tls,
                index=member.index,
                server=server,
                kdc=kdc,
                compute_lock=lock,
                model=model,
                turn=turn,
            )
            clients.append(client)
            model = client.learner.model
        finally:
            MEMBER.reset(token)
    results: dict[int, dict[str, Any]] = {}
    failures: dict[int, BaseException] = {}

    async def serve(client: Client) -> None:
        MEMBER.set(f"client-{client.index}")  # this client's task only (its own context)
        try:
            results[client.index] = await client.serve_async()
        except Exception as exc:  # reported for this client; the others go on
            failures[client.index] = exc
            log.debug("Traceback of client %d's failure:", client.index, exc_info=True)
            log.error("Client %d ended: %s: %s", client.index, type(exc).__name__, exc)

    async def serve_all() -> None:
        await asyncio.gather(*(serve(client) for client in clients))

    asyncio.run(serve_all())
    if failures:
        named = ", ".join(f"client {index}" for index in sorted(failures))
        raise ClientGroupFailed(f"{len(failures)} of {len(members)} clients failed: {named}.")
    return results

"""A client's direct links to its graph neighbours: mutual-TLS gRPC sessions, one per edge.

Every client serves a ``Peer`` service on its peer address. For each out-neighbour ``l`` it
dials ``l``'s peer address and opens one long-lived ``Link`` session, over which it pushes
its messages (the paper's "send"); ``l`` accepts the session only if the caller's certificate
names one of ``l``'s in-neighbours (``client-<j>``), and answers ``welcome``. The dialer
checks the callee's certificate against the name ``client-<l>`` (every client certificate of
a decentralized run carries its bare common name as a DNS name), so a message can reach only
the client the graph names, whatever the address says.

A message is stored by (sender, tag) until the protocol takes it. Once a link that carried
anything breaks, or a neighbour's link is refused, every later ``receive`` raises ``PeerLost``
naming that neighbour: the protocol's state assumes the whole graph (digest 002, gap 19).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping

from fedcore.errors import MessageRejected, PeerLost
from fedcore.protocols import PeerChannel
from fedcore.spec.topology import PeerPlan
from fedcore.transport import (
    ClientSession,
    Identity,
    Limits,
    Payload,
    RemoteError,
    RetryPolicy,
    RpcClient,
    RpcServer,
    ServerSession,
    SessionHandler,
    TlsBundle,
)

log = logging.getLogger(__name__)

PEER_SERVICE = "Peer"
LINK_METHOD = "Link"


class PeerMesh(PeerChannel):
    """One client's inbound and outbound peer links.

    Args:
        plan: this client's in- and out-neighbours.
        tls: this client's bundle.
        listen: the ``host:port`` to serve in-neighbours on.
        addresses: each out-neighbour's peer ``host:port``.
        limits: message limits.
        retry: how long (and how) dialing an out-neighbour is retried.
        timeout: how long a receive waits for a message before raising ``PeerLost``.
        on_bytes: called with (sent, received) byte counts.
    """

    def __init__(
        self,
        plan: PeerPlan,
        tls: TlsBundle,
        *,
        listen: str,
        addresses: Mapping[int, str],
        limits: Limits,
        retry: RetryPolicy,
        timeout: float,
        on_bytes: Callable[[int, int], None] | None = None,
    ) -> None:
        missing = sorted(set(plan.out_neighbours) - set(addresses))
        if missing:
            raise PeerLost(
                f"Client {plan.index} has no peer address for its out-neighbours {missing}."
            )
        self._plan = plan
        self._tls = tls
        self._addresses = dict(addresses)
        self._limits = limits
        self._retry = retry
        self._timeout = timeout
        self._forward = on_bytes
        self.bytes_sent = 0
        self.bytes_received = 0
        self._cond = threading.Condition()
        self._inbox: dict[tuple[int, str], Payload] = {}
        self._links: dict[int, ClientSession] = {}
        self._clients: dict[int, RpcClient] = {}
        self._lost: dict[int, str] = {}
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._server = RpcServer(
            listen,
            tls,
            {},
            sessions={LINK_METHOD: _Inbox(self)},
            service=PEER_SERVICE,
            limits=limits,
            max_workers=limits.workers(len(plan.in_neighbours)),
            callers={LINK_METHOD: ["client"]},
            on_bytes=self._count,
        )

    @property
    def index(self) -> int:
        return self._plan.index

    @property
    def port(self) -> int:
        """The port the peer service listens on."""
        return self._server.port

    def _count(self, sent: int, received: int) -> None:
        with self._cond:
            self.bytes_sent += sent
            self.bytes_received += received
        if self._forward is not None:
            self._forward(sent, received)

    # -------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Serves the in-neighbours and starts dialing every out-neighbour (in background)."""
        self._server.start()
        for to in self._plan.out_neighbours:
            thread = threading.Thread(
                target=self._dial, args=(to,), name=f"peer-link-{to}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        """Ends every link and stops serving."""
        with self._cond:
            self._closing = True
            links = list(self._links.values())
            self._cond.notify_all()
        for session in links:
            session.close()
        for client in list(self._clients.values()):
            client.close()
        self._server.stop(grace=0.5)

    def _dial(self, to: int) -> None:
        """Opens the link to ``to``, then watches it until it ends."""
        client = RpcClient(
            self._addresses[to],
            self._tls,
            service=PEER_SERVICE,
            limits=self._limits,
            retry=self._retry,
            peer=Identity("client", to),
            on_bytes=self._count,
        )
        with self._cond:
            self._clients[to] = client
        delays = self._retry.delays(random.Random())
        while True:
            with self._cond:
                if self._closing:
                    return
            session = client.open_session(LINK_METHOD)
            session.send(Payload(meta={"kind": "hello"}))
            try:
                first = session.receive()
            except RemoteError as exc:
                session.close()
                if exc.code in {"UNAVAILABLE", "UNKNOWN", "CANCELLED", "DEADLINE_EXCEEDED"}:
                    delay = next(delays, None)
                    if delay is not None:
                        time.sleep(delay)
                        continue
                    self._lose(
                        to,
                        f"its peer address {self._addresses[to]} stayed unreachable "
                        f"for {self._retry.total_seconds} s ({exc.code})",
                    )
                else:
                    self._lose(to, f"it refused our link: {exc}")
                return
            if first is None or first.meta.get("kind") != "welcome":
                session.close()
                self._lose(to, "it ended our link without a welcome")
                return
            with self._cond:
                self._links[to] = session
                self._cond.notify_all()
            log.info("Peer link to client %d is up.", to)
            break
        try:
            while session.receive() is not None:
                pass
            why = "it ended our link"
        except RemoteError as exc:
            why = f"our link to it failed ({exc.code})"
        self._lose(to, why)

    def _lose(self, peer: int, why: str) -> None:
        """Notes that the link with ``peer`` ended: the next ``send`` or ``receive`` raises
        ``PeerLost`` with ``why``. Logged at INFO: at the end of a run every client closes its
        links, each a few milliseconds apart, before its neighbours have heard that the run is
        over; a loss that matters is reported by the ``PeerLost`` it raises."""
        with self._cond:
            if self._closing:
                return
            self._lost.setdefault(peer, why)
            self._cond.notify_all()
        log.info("The peer link with client %d ended: %s.", peer, why)

    # --------------------------------------------------------------------- channel

    def send(self, to: int, tag: str, payload: Payload) -> None:
        if to not in self._plan.out_neighbours:
            raise PeerLost(f"Client {self.index} has no link to client {to}.", peer=to)
        deadline = time.monotonic() + self._retry.total_seconds
        with self._cond:
            while to not in self._links:
                self._raise_if_lost()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerLost(
                        f"Client {self.index} could not reach client {to} within "
                        f"{self._retry.total_seconds} s.",
                        peer=to,
                    )
                self._cond.wait(left)
            self._raise_if_lost()
            session = self._links[to]
        session.send(
            Payload(
                meta={"kind": "data", "tag": tag, "meta": dict(payload.meta)},
                tensors=payload.tensors,
            )
        )

    def receive(self, sender: int, tag: str) -> Payload:
        if sender not in self._plan.in_neighbours:
            raise PeerLost(f"Client {sender} is not an in-neighbour of client {self.index}.")
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while True:
                self._raise_if_lost()
                found = self._inbox.pop((sender, tag), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerLost(
                        f"Client {self.index} got nothing from its in-neighbour client {sender} "
                        f"for {tag!r} within {self._timeout} s "
                        f"(spec.failurePolicy.roundTimeoutSeconds).",
                        peer=sender,
                    )
                self._cond.wait(left)

    def _raise_if_lost(self) -> None:
        """Raises PeerLost for the first lost neighbour (holding the condition)."""
        if self._lost:
            peer = min(self._lost)
            raise PeerLost(
                f"Client {self.index} lost its neighbour client {peer}: {self._lost[peer]}. "
                f"The run cannot go on without it (its noise and mixing weights are part of "
                f"every neighbour's state).",
                peer=peer,
            )

    # ------------------------------------------------------------- inbound (server)

    def _accept(self, session: ServerSession) -> int:
        peer = session.peer
        if peer.role != "client" or peer.index not in self._plan.in_neighbours:
            raise PermissionError(
                f"{peer.common_name!r} is not an in-neighbour of client-{self.index} in the "
                f"run's peer graph (in-neighbours: {list(self._plan.in_neighbours)})."
            )
        return int(peer.index)

    def _store(self, sender: int, message: Payload) -> None:
        tag = str(message.meta.get("tag", ""))
        inner = message.meta.get("meta")
        with self._cond:
            self._inbox[(sender, tag)] = Payload(
                meta=dict(inner) if isinstance(inner, dict) else {}, tensors=message.tensors
            )
            self._cond.notify_all()


class _Inbox(SessionHandler):
    """The peer service's session handler: one session per in-neighbour."""

    def __init__(self, mesh: PeerMesh) -> None:
        self._mesh = mesh
        self._sessions: dict[int, ServerSession] = {}
        self._lock = threading.Lock()

    def opened(self, session: ServerSession) -> None:
        sender = self._mesh._accept(session)
        with self._lock:
            old = self._sessions.get(sender)
            self._sessions[sender] = session
        if old is not None and old is not session:
            old.close()
        session.send(Payload(meta={"kind": "welcome"}))
        log.info("Peer link from client %d is up.", sender)

    def received(self, session: ServerSession, message: Payload) -> None:
        kind = message.meta.get("kind")
        if kind == "data":
            self._mesh._store(_sender(session), message)
        elif kind != "hello":
            raise MessageRejected(f"A peer sent a message of unknown kind {kind!r}.")

    def closed(self, session: ServerSession) -> None:
        sender = _sender(session)
        with self._lock:
            current = self._sessions.get(sender) is session
            if current:
                del self._sessions[sender]
        if current:
            self._mesh._lose(sender, "its link to us closed")


def _sender(session: ServerSession) -> int:
    """The client index of an accepted session's peer (``opened`` checked it is a client)."""
    index = session.peer.index
    assert index is not None
    return index

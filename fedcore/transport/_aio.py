"""Client sessions on asyncio: many parties' sessions on one thread, no thread per message.

gRPC's synchronous streaming API gives every session a thread that feeds its requests and a
channel thread that wakes the reader, and every message crosses threads (about 200 us of CPU
per message and reply on this project's machine, benchmarks in docs/benchmarks.md). On
``grpc.aio`` a message is a coroutine step on the event loop's thread: the same exchange costs
a third of that, and a process that runs many clients (``fedcore clients``) serves all their
sessions from one loop.

What a session carries and checks is what :class:`~fedcore.transport.ClientSession` carries
and checks: the same chunked codec and size limits, the same channel options, the peer's
certificate checked against the role name of the party we mean to reach, and grpc's failures
turned into :class:`RemoteError` with the status's name. Each ``AsyncRpcClient`` is one
channel with one party's own key and certificate.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import grpc

from fedcore.errors import MessageRejected
from fedcore.transport._codec import Layout, PayloadDecoder, encode_chunks
from fedcore.transport._payload import Payload
from fedcore.transport._rpc import SERVICE_PREFIX, Limits, RemoteError, session_failed
from fedcore.transport._server import INLINE_BYTES
from fedcore.transport._tls import Identity, TlsBundle


class Turn:
    """One large inbound message at a time among the sessions that share it (the clients of a
    group; a lone client has one of its own), and the bytes of the last one for the next.

    A session takes the turn once a message's header announces a body over ``INLINE_BYTES``,
    before it reads the body (gRPC's flow control holds the sender back meanwhile), and gives
    it back when its owner has answered the message (``AsyncClientSession.answered``) or the
    session ends. Waiters are served first come, first served. So a process decodes one large
    model's task at a time, not one per client.

    An owner done with a large message's bytes (a client whose model trained in its task and
    whose upload of them has gone out) may ``offer`` them: the next large message of the same
    layout is then written into them (``PayloadDecoder.land_in``), under the turn, instead of
    into new memory. Used on one event loop.
    """

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._spare: tuple[Layout, bytearray] | None = None

    def offer(self, layout: Layout, buffer: bytearray) -> None:
        """Gives the bytes of a message of ``layout`` for the next one of that layout to be
        written into; nothing else may read or write them from now on."""
        self._spare = (layout, buffer)

    def landing(self, layout: Layout) -> bytearray | None:
        """The bytes offered, if they are for ``layout`` (they are handed out once)."""
        spare, self._spare = self._spare, None
        if spare is not None and spare[0] == layout:
            return spare[1]
        return None

    async def take(self) -> None:
        """Waits for the turn."""
        await self._lock.acquire()

    def give(self) -> None:
        """Gives the turn back."""
        self._lock.release()


class AsyncRpcClient:
    """A mutual-TLS ``grpc.aio`` channel to one peer party, for long-lived sessions.

    Create it inside the event loop that uses it. The peer's certificate must carry the role
    name of ``peer`` (:attr:`Identity.dns_name`), whatever host ``target`` names.

    Args:
        target: ``host:port`` of the peer.
        tls: this party's bundle.
        service: the peer's service name, e.g. ``Server``.
        limits: message limits.
        peer: the party we mean to reach.
        on_bytes: called with (sent, received) byte counts of each message.
    """

    def __init__(
        self,
        target: str,
        tls: TlsBundle,
        *,
        service: str,
        limits: Limits,
        peer: Identity,
        on_bytes: Callable[[int, int], None] | None = None,
    ) -> None:
        options = limits.channel_options()
        options.append(("grpc.ssl_target_name_override", peer.dns_name))
        credentials = grpc.ssl_channel_credentials(
            root_certificates=tls.ca_pem, private_key=tls.key_pem, certificate_chain=tls.cert_pem
        )
        self.peer = peer
        self._target = target
        self._service = service
        self._limits = limits
        self._on_bytes = on_bytes
        self._channel = grpc.aio.secure_channel(target, credentials, options=options)

    def open_session(self, method: str, *, turn: Turn | None = None) -> AsyncClientSession:
        """Opens a long-lived two-way session on ``method`` (no deadline); ``turn``: shared
        with other sessions, which then read one large message at a time."""
        stub = self._channel.stream_stream(f"{SERVICE_PREFIX}{self._service}/{method}")
        return AsyncClientSession(
            stub(),
            self._limits,
            method=method,
            target=self._target,
            on_bytes=self._on_bytes,
            turn=turn,
        )

    async def close(self) -> None:
        """Closes the channel (sessions on it end)."""
        await self._channel.close()


class AsyncClientSession:
    """The client's end of one session: ``send`` writes a message, ``receive`` awaits one."""

    def __init__(
        self,
        call: Any,
        limits: Limits,
        *,
        method: str,
        target: str,
        on_bytes: Callable[[int, int], None] | None = None,
        turn: Turn | None = None,
    ) -> None:
        self._call = call
        self._limits = limits
        self._method = method
        self._target = target
        self._on_bytes = on_bytes
        self._turn = turn
        self._holding = False
        self.last_large: tuple[Layout, bytearray] | None = None
        """The layout and bytes of the last large message received under the turn."""

    def _failed(self, exc: grpc.RpcError) -> RemoteError:
        return session_failed(self._method, self._target, exc)

    async def send(self, payload: Payload) -> None:
        """Writes ``payload`` to the peer (waits while grpc's flow control holds it back).

        A session the peer has already ended takes nothing: the next ``receive`` says how it
        ended.

        Raises:
            RemoteError: the session failed.
        """
        sent = 0
        try:
            for chunk in encode_chunks(payload, chunk_bytes=self._limits.chunk_bytes):
                await self._call.write(chunk)
                sent += len(chunk)
        except grpc.RpcError as exc:
            raise self._failed(exc) from exc
        except asyncio.InvalidStateError:
            return  # ended (or our side finished writing): receive tells how
        if self._on_bytes is not None:
            self._on_bytes(sent, 0)

    async def receive(self) -> Payload | None:
        """Awaits the next whole message; None when the peer ended the session.

        Raises:
            RemoteError: the session failed (peer gone, refused, or it rejected our message).
            MessageRejected: the peer's message was malformed or oversized.
        """
        decoder = PayloadDecoder(max_message_bytes=self._limits.max_message_bytes)
        received = 0
        try:
            while True:
                chunk = await self._call.read()
                if chunk is grpc.aio.EOF:
                    break
                received += len(chunk)
                decoder.feed(chunk)
                announced = decoder.announced
                if (
                    self._turn is not None
                    and not self._holding
                    and announced is not None
                    and announced > INLINE_BYTES
                ):
                    await self._turn.take()  # the body waits, unread, for the turn
                    self._holding = True
                    layout = decoder.layout
                    assert layout is not None
                    spare = self._turn.landing(layout)
                    if spare is not None:
                        decoder.land_in(spare)
                if decoder.complete:
                    if self._on_bytes is not None:
                        self._on_bytes(0, received)
                    payload = decoder.finish()
                    if self._holding:
                        layout = decoder.layout
                        assert layout is not None
                        self.last_large = (layout, decoder.body)
                    return payload
        except grpc.RpcError as exc:
            raise self._failed(exc) from exc
        if received:
            decoder.finish()  # raises: the stream ended inside a message
        # The stream ended: with a status that is not OK it failed.
        code = await self._call.code()
        if code != grpc.StatusCode.OK:
            details = await self._call.details()
            raise session_failed(self._method, self._target, code=code, details=details)
        return None

    async def finish(self, timeout: float) -> None:
        """Ends our side after what was sent and waits up to ``timeout`` seconds for the peer
        to end its side (so that our last message reaches it); then cancels the call."""
        with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
            await self._call.done_writing()

        async def drain() -> None:
            with contextlib.suppress(RemoteError, MessageRejected):
                while await self.receive() is not None:
                    pass

        try:
            await asyncio.wait_for(drain(), timeout)
        except TimeoutError:
            pass
        finally:
            self._call.cancel()

    def answered(self, *, done_with_bytes: bool = False) -> None:
        """The message last received has been answered: the turn it took (a large one, on a
        ``Turn``) goes to the next session waiting; ``done_with_bytes``: its bytes are offered
        to the next large message of the same layout (nothing reads or writes them any more)."""
        large, self.last_large = self.last_large, None
        if self._holding and self._turn is not None:
            if done_with_bytes and large is not None:
                self._turn.offer(*large)
            self._holding = False
            self._turn.give()

    def close(self) -> None:
        """Cancels the call (idempotent) and gives back a turn it holds."""
        self._call.cancel()
        self.answered()

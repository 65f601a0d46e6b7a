"""gRPC over mutual TLS: every call carries one Payload each way as a stream of chunks.

Why the cut sits here: roles only ever call ``RpcClient.call(method, payload, timeout=...)`` and
register ``handler(peer, payload) -> payload`` functions; chunking, size limits, deadlines,
retries with backoff, peer identities and the translation of grpc errors live in the transport
(this module: the limits and the calling side; ``_server``: the serving side; ``_aio``: client
sessions on asyncio) and nowhere else, so a role never sees a grpc type and a protocol never
sees a role.

Every method is served in two forms: a stream of chunks each way, and, for a request that fits
in one chunk, a unary call (service ``<service>.Unary``), which gRPC's Python API makes about
three times cheaper (no thread per call). A response that does not fit in one chunk cannot
travel in the unary form: the server then parks it, and the client asks again in the stream
form, which answers from the park instead of running the handler a second time.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from fedcore.errors import MessageRejected, TransportError
from fedcore.transport._codec import MAX_HEADER_BYTES, PayloadDecoder, decode_chunks, encode_chunks
from fedcore.transport._payload import Payload
from fedcore.transport._tls import Identity, TlsBundle

log = logging.getLogger(__name__)

SERVICE_PREFIX = "/fedcore.v1."
ENVELOPE_BYTES = 64 * 1024
"""Room for gRPC framing on top of one chunk."""

MAX_FRAME_BYTES = 1 << 20
"""The largest HTTP/2 frame either end asks for (gRPC's default is 16 KiB): a model of tens
of KB then crosses as one frame, not several (a tenth less CPU per message on both ends)."""

RECONNECT_BACKOFF_MS = (100, 2_000)
"""A channel's first and largest wait before it dials a peer again (gRPC's defaults are 1 s
and 2 min): a client started beside its server, or left by a restarted one, connects within
a tenth of a second of the server listening, and never waits longer than ``RetryPolicy``'s
own largest backoff."""

UNARY_SERVICE_SUFFIX = ".Unary"
"""Appended to a service's name for the unary form of its methods."""
OVERSIZED_REPLY = "fedcore: the response is over one chunk; ask again in the stream form"
"""The details of the OUT_OF_RANGE status that sends a unary call to the stream form."""
PARK_SECONDS = 120.0
"""How long a parked response waits for its caller to ask again in the stream form."""

SPARE_WORKERS = 4
"""Workers a server keeps beyond every party's share (see ``Limits.workers``)."""


STREAM_WINDOW_BYTES = 8 * 1024 * 1024
"""The HTTP/2 window of each stream, both ways (two 4 MiB chunks)."""

RECEIVE_BYTES = 256 * 1024 * 1024
"""The default room for large session messages on a server (``Limits.receive_bytes``): every
upload of a small model at once, a large model's one at a time, so that a server's memory for
uploads in flight does not grow with the number of clients."""


MIN_RECEIVE_RATE = 1024 * 1024
"""The default of ``Limits.min_receive_rate``: 1 MiB/s (about 8 Mbit/s), below any link a
site would train a large model over; a 4 GB upload at that rate takes about an hour."""


@dataclass(frozen=True)
class Limits:
    """Message limits shared by both ends of a link, and what one party may hold of a server.

    Attributes:
        chunk_bytes: the largest single gRPC message.
        max_message_bytes: the largest logical (reassembled) message.
        keepalive_ms: how often a link with nothing to send pings its peer.
        calls_per_identity: how many calls (sessions included) one identity may have open on
            a server at once; one more is refused at once with RESOURCE_EXHAUSTED.
        hello_seconds: how long a new session may take to deliver its first whole message
            (the hello); one that has not is ended with DEADLINE_EXCEEDED.
        bytes_in_flight: how many bytes of unfinished messages one identity may have a server
            hold at once; None: one largest message (``max_message_bytes`` plus its header).
        receive_bytes: how many bytes of large session messages (bodies over 1 MiB) a server
            receives and handles at once, whoever sends them. A message waits for room before
            its body is read (gRPC's flow control then holds its sender back); one larger than
            this is received alone. None: ``RECEIVE_BYTES``.
        stall_seconds: how long a large message that holds room others wait for may go
            without a byte arriving before its session is ended (a stalled sender cannot hold
            the server's room).
        min_receive_rate: bytes per second a large message that holds room others wait for
            must average, from when it took the room, after a grace of ``stall_seconds``;
            one slower is ended like a stalled one (a trickling sender cannot hold the room
            either). 0: no rate is asked. Alone (nobody waiting), a sender may be as slow
            as it likes.
    """

    chunk_bytes: int = 4 * 1024 * 1024
    max_message_bytes: int = 8 * 1024**3
    keepalive_ms: int = 20_000
    calls_per_identity: int = 4
    hello_seconds: float = 30.0
    bytes_in_flight: int | None = None
    receive_bytes: int | None = None
    stall_seconds: float = 60.0
    min_receive_rate: int = MIN_RECEIVE_RATE

    @property
    def room_bytes(self) -> int:
        """The bytes of large session messages a server receives and handles at once."""
        return RECEIVE_BYTES if self.receive_bytes is None else self.receive_bytes

    @property
    def identity_bytes(self) -> int:
        """The bytes of unfinished messages one identity may have a server hold at once."""
        if self.bytes_in_flight is not None:
            return self.bytes_in_flight
        return self.max_message_bytes + MAX_HEADER_BYTES + 8

    def workers(self, parties: int) -> int:
        """The worker threads a server needs so that no party can starve another.

        A method's handler holds a worker while it runs (sessions hold none). With room for
        every party's ``calls_per_identity``, a party at its limit still leaves every other
        party its own share; a call over the limit is refused before it takes a worker.

        Args:
            parties: how many identities may call this server.

        Returns:
            ``calls_per_identity * parties + SPARE_WORKERS``.
        """
        return self.calls_per_identity * max(parties, 1) + SPARE_WORKERS

    def channel_options(self) -> list[tuple[str, Any]]:
        """Returns the grpc options of both ends: the per-chunk limit, frames, keepalive and
        (a channel's) reconnect backoff.

        A session can sit idle for a whole round (a client training on its GPU); its pings
        keep it alive, and a server must accept them: by default gRPC's server tolerates one
        ping without data every 5 minutes and answers more with GOAWAY "too_many_pings",
        which broke idle sessions after about a minute. So a server accepts pings at half
        the keepalive interval.
        """
        size = self.chunk_bytes + ENVELOPE_BYTES
        return [
            ("grpc.max_send_message_length", size),
            ("grpc.max_receive_message_length", size),
            ("grpc.keepalive_time_ms", self.keepalive_ms),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", self.keepalive_ms // 2),
            ("grpc.http2.max_frame_size", MAX_FRAME_BYTES),
            # A fixed window of two chunks per stream instead of bandwidth-delay probing:
            # with probing, a receiver's HTTP/2 windows grew until a server held tens of MiB
            # of each upload waiting for Limits.receive_bytes' room; without it and with
            # gRPC's default 64 KiB window, 1 GB moved 25-30% slower. With 8 MiB, a waiting
            # sender costs the server about 20 MiB and 1 GB moves as fast as with probing
            # (tests/integration/test_receive_room.py; docs/benchmarks.md, Limits).
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
        ]


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter for calls that failed before reaching a handler.

    Attributes:
        initial_seconds: the first backoff's upper bound.
        max_seconds: the cap of one backoff.
        total_seconds: how long to keep trying before giving up.
    """

    initial_seconds: float = 0.05
    max_seconds: float = 2.0
    total_seconds: float = 300.0

    def delays(self, rng: random.Random) -> Iterator[float]:
        """Yields successive sleep times until the total budget is spent."""
        deadline = time.monotonic() + self.total_seconds
        bound = self.initial_seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            yield min(rng.uniform(0, bound), left)
            bound = min(bound * 2, self.max_seconds)


RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
"""Codes a call is retried on: the peer is not (yet) reachable or is overloaded."""


class RemoteError(TransportError):
    """The peer answered a call with an error status."""

    def __init__(self, message: str, *, method: str, code: str) -> None:
        self.method = method
        self.code = code
        super().__init__(message)


def session_failed(
    method: str,
    target: str,
    exc: grpc.RpcError | None = None,
    *,
    code: grpc.StatusCode | None = None,
    details: str | None = None,
) -> RemoteError:
    """The error of a session that ended with a status other than OK: from ``exc`` (grpc's
    error), or from ``code`` and ``details``."""
    if exc is not None:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else str(exc)
    name = (code or grpc.StatusCode.UNKNOWN).name
    return RemoteError(
        f"The session {method} with {target} failed with {name}: {details}",
        method=method,
        code=name,
    )


_END = object()


def _encode_queued(
    items: queue.SimpleQueue[Any], limits: Limits, on_bytes: Callable[[int, int], None] | None
) -> Iterator[bytes]:
    """Yields the chunks of every queued Payload until the end marker; counts bytes sent."""
    while True:
        item = items.get()
        if item is _END:
            return
        sent = 0
        for chunk in encode_chunks(item, chunk_bytes=limits.chunk_bytes):
            sent += len(chunk)
            yield chunk
        if on_bytes is not None:
            on_bytes(sent, 0)


class RpcClient:
    """A mutual-TLS gRPC client for one peer party.

    The peer's certificate is checked against the role name of the party we mean to reach
    (:attr:`Identity.dns_name`, e.g. ``server.fedcore.invalid``), whatever host or address
    ``target`` names: only that party's certificate carries it, so no other certificate of
    the run (a client's, the KDC's) passes as the server, locally as on Kubernetes.

    Args:
        target: ``host:port`` of the peer.
        tls: this party's bundle (its CA verifies the peer; its certificate identifies us).
        service: the peer's service name, e.g. ``Server`` or ``Kdc``.
        limits: message limits.
        retry: backoff for calls that fail before reaching the peer.
        peer: the party we mean to reach; default: the role the service is named after
            (``Server``: the server, ``Kdc``: the KDC).
        on_bytes: called with (sent, received) byte counts of each call.

    Raises:
        TransportError: ``peer`` is not given and ``service`` names no role.
    """

    def __init__(
        self,
        target: str,
        tls: TlsBundle,
        *,
        service: str,
        limits: Limits,
        retry: RetryPolicy | None = None,
        peer: Identity | None = None,
        on_bytes: Callable[[int, int], None] | None = None,
    ) -> None:
        if peer is None:
            try:
                peer = Identity.parse(service.lower())
            except TransportError as exc:
                raise TransportError(
                    f"The service {service!r} is not named after a role; pass the party to "
                    "reach as peer=Identity(...)."
                ) from exc
        self.peer = peer
        options = limits.channel_options()
        options.append(("grpc.ssl_target_name_override", peer.dns_name))
        credentials = grpc.ssl_channel_credentials(
            root_certificates=tls.ca_pem, private_key=tls.key_pem, certificate_chain=tls.cert_pem
        )
        self._target = target
        self._channel = grpc.secure_channel(target, credentials, options=options)
        self._service = service
        self._limits = limits
        self._retry = retry or RetryPolicy()
        self._rng = random.Random()
        self._stubs: dict[str, Any] = {}
        self._unary_stubs: dict[str, Any] = {}
        self._stream_only: set[str] = set()
        self._lock = threading.Lock()
        self._on_bytes = on_bytes

    def call(self, method: str, payload: Payload, *, timeout: float, retry: bool = True) -> Payload:
        """Sends ``payload`` to ``method`` and returns the peer's response.

        Args:
            method: the method name, e.g. ``Pull``.
            payload: the request.
            timeout: the deadline of one attempt in seconds.
            retry: whether to retry (with backoff) while the peer is unreachable.

        Raises:
            RemoteError: the peer answered with an error status (or retries ran out).
            MessageRejected: the peer's response was malformed or oversized.
        """
        delays = self._retry.delays(self._rng) if retry else iter(())
        while True:
            try:
                return self._call_once(method, payload, timeout=timeout)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
                if code in RETRYABLE:
                    delay = next(delays, None)
                    if delay is not None:
                        time.sleep(delay)
                        continue
                details = exc.details() if hasattr(exc, "details") else str(exc)
                raise RemoteError(
                    f"The call {self._service}.{method} to {self._target} failed with "
                    f"{code.name}: {details}",
                    method=method,
                    code=code.name,
                ) from exc

    def _call_once(self, method: str, payload: Payload, *, timeout: float) -> Payload:
        chunks = encode_chunks(payload, chunk_bytes=self._limits.chunk_bytes)
        head = list(itertools.islice(chunks, 2))
        if len(head) == 1 and method not in self._stream_only:
            try:
                return self._call_unary(method, head[0], timeout=timeout)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                details = exc.details() if hasattr(exc, "details") else None
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    self._stream_only.add(method)  # a peer without the unary form
                elif code != grpc.StatusCode.OUT_OF_RANGE or details != OVERSIZED_REPLY:
                    raise
                # Otherwise the response was parked: the stream form fetches it.
        return self._call_stream(method, itertools.chain(head, chunks), timeout=timeout)

    def _call_unary(self, method: str, request: bytes, *, timeout: float) -> Payload:
        stub = self._stub(method, unary=True)
        response = stub(request, timeout=timeout)
        result = decode_chunks([response], max_message_bytes=self._limits.max_message_bytes)
        if self._on_bytes is not None:
            self._on_bytes(len(request), len(response))
        return result

    def _call_stream(self, method: str, chunks: Iterator[bytes], *, timeout: float) -> Payload:
        stub = self._stub(method)
        sent = 0

        def requests() -> Iterator[bytes]:
            nonlocal sent
            for chunk in chunks:
                sent += len(chunk)
                yield chunk

        decoder = PayloadDecoder(max_message_bytes=self._limits.max_message_bytes)
        received = 0
        for chunk in stub(requests(), timeout=timeout):
            received += len(chunk)
            decoder.feed(chunk)
        result = decoder.finish()
        if self._on_bytes is not None:
            self._on_bytes(sent, received)
        return result

    def open_session(self, method: str) -> ClientSession:
        """Opens a long-lived two-way session on ``method`` (no deadline).

        Raises:
            RemoteError: when the first receive finds the session failed.
        """
        return ClientSession(
            self._stub(method),
            self._limits,
            method=method,
            target=self._target,
            on_bytes=self._on_bytes,
        )

    def _stub(self, method: str, *, unary: bool = False) -> Any:
        with self._lock:
            stubs = self._unary_stubs if unary else self._stubs
            stub = stubs.get(method)
            if stub is None:
                if unary:
                    path = f"{SERVICE_PREFIX}{self._service}{UNARY_SERVICE_SUFFIX}/{method}"
                    stub = self._channel.unary_unary(path)
                else:
                    stub = self._channel.stream_stream(f"{SERVICE_PREFIX}{self._service}/{method}")
                stubs[method] = stub
            return stub

    def close(self) -> None:
        """Closes the channel."""
        self._channel.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class ClientSession:
    """The client's end of one session: ``send`` queues a message, ``receive`` waits for one."""

    def __init__(
        self,
        stub: Any,
        limits: Limits,
        *,
        method: str,
        target: str,
        on_bytes: Callable[[int, int], None] | None = None,
    ) -> None:
        self._limits = limits
        self._method = method
        self._target = target
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._on_bytes = on_bytes
        self._call = stub(self._outbound())
        self._responses = iter(self._call)

    def _outbound(self) -> Iterator[bytes]:
        yield from _encode_queued(self._queue, self._limits, self._on_bytes)

    def send(self, payload: Payload) -> None:
        """Queues ``payload`` for the peer."""
        self._queue.put(payload)

    def receive(self) -> Payload | None:
        """Blocks for the next whole message; returns None when the peer ended the session.

        Raises:
            RemoteError: the session failed (peer gone, refused, or it rejected our message).
            MessageRejected: the peer's message was malformed or oversized.
        """
        decoder = PayloadDecoder(max_message_bytes=self._limits.max_message_bytes)
        received = 0
        try:
            for chunk in self._responses:
                received += len(chunk)
                decoder.feed(chunk)
                if decoder.complete:
                    if self._on_bytes is not None:
                        self._on_bytes(0, received)
                    return decoder.finish()
        except grpc.RpcError as exc:
            raise session_failed(self._method, self._target, exc) from exc
        if received:
            decoder.finish()  # raises: the stream ended inside a message
        return None

    def finish(self, timeout: float) -> None:
        """Ends our side of the session after what was sent, and waits up to ``timeout``
        seconds for the peer to end its side (so that our last message reaches it); then
        cancels the call."""
        self._queue.put(_END)
        watchdog = threading.Timer(timeout, self._call.cancel)
        watchdog.daemon = True
        watchdog.start()
        try:
            with contextlib.suppress(RemoteError, MessageRejected):
                while self.receive() is not None:
                    pass
        finally:
            watchdog.cancel()
            self._call.cancel()

    def close(self) -> None:
        """Ends our side of the session and cancels the call."""
        self._queue.put(_END)
        self._call.cancel()

"""The mutual-TLS gRPC server of every role, on asyncio: calls and long-lived sessions.

The server runs ``grpc.aio`` on an event loop in a thread of its own. A session's messages are
read, decoded, checked and handed to its ``SessionHandler`` on that loop, and what a role sends
(``ServerSession.send``, from any thread) is written by it: a message costs a step of the loop,
not a hand-off between a reader thread, a writer thread and gRPC's own (gRPC's synchronous
server held two threads per session and crossed threads per message). A method handler
(``handler(peer, payload, context) -> payload``) may block, so it runs in a worker thread, as do
the session messages large enough to take a while to handle (``INLINE_BYTES``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import (
    AsyncIterator,
    Callable,
    Collection,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from concurrent import futures
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc

from fedcore.errors import MessageRejected, NotReady, TransportError
from fedcore.transport._codec import PayloadDecoder, decode_chunks, encode_chunks, unviewed
from fedcore.transport._payload import Payload
from fedcore.transport._rpc import (
    OVERSIZED_REPLY,
    PARK_SECONDS,
    SERVICE_PREFIX,
    UNARY_SERVICE_SUFFIX,
    Limits,
)
from fedcore.transport._tls import Identity, TlsBundle

log = logging.getLogger(__name__)

Handler = Callable[[Identity, Payload, "CallContext"], Payload]
"""A method implementation: the caller's identity and request in, the response out."""

INLINE_BYTES = 1 << 20
"""Session messages whose tensors are at most this size are handled on the event loop; a
larger one (a big model's upload, whose checks take a while) in a worker thread, so the loop
goes on serving the other sessions meanwhile."""

T = TypeVar("T")


class CallContext:
    """What a handler may ask about its call: liveness and a cancellation hook."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    def is_active(self) -> bool:
        """Returns whether the call is still open (the caller has not gone, nor has it ended)."""
        return not self._context.done()

    def on_done(self, callback: Callable[[], None]) -> None:
        """Calls ``callback`` once the call ends, however it ends."""
        self._context.add_done_callback(lambda _context: callback())

    def time_remaining(self) -> float | None:
        """Returns the seconds left before the caller's deadline, or None without one."""
        remaining = self._context.time_remaining()
        return None if remaining is None else float(remaining)


class RejectionCounter:
    """Counts rejected inbound messages; roles wire it to a metric.

    The callback gets ``(method, reason, sender)``: the sender is the caller's common name,
    or None when its certificate names no party.
    """

    def __init__(self, callback: Callable[[str, str, str | None], None] | None = None) -> None:
        self._callback = callback

    def __call__(self, method: str, reason: str, sender: str | None = None) -> None:
        if self._callback is not None:
            self._callback(method, reason, sender)


class _Admission:
    """What each identity holds of one server: open calls and bytes of unfinished messages."""

    def __init__(self, limits: Limits) -> None:
        self._calls_cap = limits.calls_per_identity
        self._bytes_cap = limits.identity_bytes
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}
        self._bytes: dict[str, int] = {}

    def enter(self, who: str) -> bool:
        """Takes one call slot of ``who``; False when it already holds all of them."""
        with self._lock:
            held = self._calls.get(who, 0)
            if held >= self._calls_cap:
                return False
            self._calls[who] = held + 1
            return True

    def leave(self, who: str) -> None:
        """Gives back one call slot of ``who``."""
        with self._lock:
            held = self._calls.get(who, 0) - 1
            if held > 0:
                self._calls[who] = held
            else:
                self._calls.pop(who, None)

    def take_bytes(self, who: str, count: int) -> bool:
        """Counts ``count`` more bytes held for ``who``; False (nothing counted) over its cap."""
        with self._lock:
            held = self._bytes.get(who, 0) + count
            if held > self._bytes_cap:
                return False
            self._bytes[who] = held
            return True

    def give_bytes(self, who: str, count: int) -> None:
        """Forgets ``count`` bytes held for ``who`` (its message finished or was dropped)."""
        if not count:
            return
        with self._lock:
            held = self._bytes.get(who, 0) - count
            if held > 0:
                self._bytes[who] = held
            else:
                self._bytes.pop(who, None)


class _Inbound:
    """One call's unfinished inbound message, with its bytes counted against its sender.

    Raises ``_OverLimit`` from ``feed`` when the sender would hold more than its share.
    """

    def __init__(self, admission: _Admission, who: str, max_message_bytes: int) -> None:
        self._admission = admission
        self._who = who
        self._max = max_message_bytes
        self.decoder = PayloadDecoder(max_message_bytes=max_message_bytes)
        self.held = 0
        self.last_body: bytearray | None = None

    def feed(self, chunk: bytes) -> None:
        if not self._admission.take_bytes(self._who, len(chunk)):
            raise _OverLimit(
                f"{self._who} has more bytes of unfinished messages in flight than its share "
                f"allows; this chunk of {len(chunk)} bytes is refused."
            )
        self.held += len(chunk)
        self.decoder.feed(chunk)

    def finish(self) -> Payload:
        """Returns the message and forgets its bytes; the next message starts afresh. The
        bytes of a large one stay in ``last_body`` (for ``_Spare.keep``)."""
        try:
            payload = self.decoder.finish()
            body = self.decoder.body
            self.last_body = body if len(body) > INLINE_BYTES else None
            return payload
        finally:
            self.release()
            self.decoder = PayloadDecoder(max_message_bytes=self._max)

    def land(self, spare: _Spare) -> None:
        """Once a large message's header is in: its body goes into the spare bytes of an
        earlier message of its size, if there are any (``PayloadDecoder.land_in``)."""
        decoder = self.decoder
        announced = decoder.announced
        if (
            announced is not None
            and announced > INLINE_BYTES
            and not decoder.complete
            and not decoder.landed
        ):
            buffer = spare.take(announced)
            if buffer is not None:
                self.decoder.land_in(buffer)

    def release(self) -> None:
        self._admission.give_bytes(self._who, self.held)
        self.held = 0


class _Spare:
    """The bytes of the last large message that nothing views any more, kept for the next of
    the same size: its pages are already the process's, where a new buffer's are faulted in
    and zeroed (about 0.4 s per GB on this project's machine). One at a time; handed out once.
    ``drop`` lets go of them, and nothing is kept again until the next large message arrives
    (a server combining a round drops them, so that they are not held through its peak, even
    if the round's last upload is let go just after). ``keep`` and ``take`` run on the
    server's event loop, ``drop`` on any thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffer: bytearray | None = None
        self._keeping = True

    def keep(self, buffer: bytearray | None) -> None:
        """Keeps ``buffer`` if nothing views it (``unviewed``) and nothing dropped since the
        last large message arrived."""
        if buffer is None or not unviewed(buffer):
            return
        with self._lock:
            if self._keeping:
                self._buffer = buffer

    def take(self, size: int) -> bytearray | None:
        """The kept bytes, if they are ``size`` long (handed out once); a large message of
        ``size`` has arrived."""
        with self._lock:
            self._keeping = True
            buffer = self._buffer
            if buffer is None or len(buffer) != size:
                return None
            self._buffer = None
            return buffer

    def drop(self) -> None:
        """Lets go of the kept bytes; keeps none until the next large message arrives."""
        with self._lock:
            self._buffer = None
            self._keeping = False


class _ReceiveRoom:
    """The bytes of large session messages a server receives and handles at once.

    A large message takes room for its whole announced body before its body is read, and gives
    it back once its handler has returned; one that does not fit waits, first come first
    served, without reading (gRPC's flow control holds its sender back). A message larger than
    the room is let in alone. Used on the server's event loop only.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self.peak = 0
        """The most bytes ever held at once."""
        self._queue: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def waiting(self) -> int:
        """How many messages wait for room."""
        return len(self._queue)

    async def take(self, size: int) -> None:
        """Waits until ``size`` bytes of room are this caller's."""
        if not self._queue and self._fits(size):
            self._grant(size)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (size, future)
        self._queue.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.give(size)  # granted just as the waiter was cancelled
            else:
                with contextlib.suppress(ValueError):
                    self._queue.remove(entry)
                self._wake()
            raise

    def give(self, size: int) -> None:
        """Gives back room taken by ``take``."""
        self.in_use -= size
        self._wake()

    def _fits(self, size: int) -> bool:
        return self.in_use == 0 or self.in_use + size <= self.capacity

    def _grant(self, size: int) -> None:
        self.in_use += size
        self.peak = max(self.peak, self.in_use)

    def _wake(self) -> None:
        while self._queue and self._fits(self._queue[0][0]):
            size, future = self._queue.popleft()
            if future.cancelled():
                continue
            self._grant(size)
            future.set_result(None)


class _Stalled(Exception):
    """A large message held room that others waited for, and its bytes did not come in time
    (none for ``stall_seconds``, or too few for ``min_receive_rate``)."""


@dataclass
class _Hold:
    """Room held by the message being read: how much, since when, what of it has arrived
    since, and when its last chunk did (monotonic seconds)."""

    size: int
    since: float
    received: int = 0
    last: float = 0.0

    def __post_init__(self) -> None:
        self.last = self.last or self.since

    def arrived(self, chunk: int) -> None:
        """Counts a chunk of ``chunk`` bytes that has just arrived."""
        self.received += chunk
        self.last = time.monotonic()

    def due(self, limits: Limits) -> float:
        """When more bytes are due: ``stall_seconds`` after the last chunk, or earlier when
        those so far only keep ``min_receive_rate`` (after a grace of ``stall_seconds``) up to
        then."""
        due = self.last + limits.stall_seconds
        if limits.min_receive_rate > 0:
            kept_until = self.since + limits.stall_seconds
            due = min(due, kept_until + self.received / limits.min_receive_rate)
        return due

    def why(self, limits: Limits, waiting: int) -> str:
        """Why the session is ended, for its sender and the log."""
        held = time.monotonic() - self.since
        return (
            f"A {self.size}-byte message held the server's room for {held:.0f} s and sent "
            f"{self.received} bytes of it (limits.stall_seconds {limits.stall_seconds} s, "
            f"limits.min_receive_rate {limits.min_receive_rate} B/s) while {waiting} other "
            "message(s) waited for that room; the session is closed."
        )


class _OverLimit(Exception):
    """A caller went over its share of a server (calls or bytes in flight)."""


class SessionHandler(ABC):
    """Serves long-lived two-way sessions: one per connected peer, messages both ways.

    ``opened`` is called when a session's first well-formed message has arrived (just before
    ``received`` is called with it) and ``closed`` once it ends, if it was opened; ``received``
    is called once per inbound message, in order (on the server's event loop, or for a large
    message in a worker thread: never two of one session at once). Sending is
    ``session.send``, from any thread. The server keeps one live session per identity: once a
    new one is opened, the previous one of the same identity is closed (and ``closed``
    follows for it). The handler must not block for long: other sessions wait meanwhile.
    """

    @abstractmethod
    def opened(self, session: ServerSession) -> None:
        """A peer connected. Raises PermissionError to refuse it."""

    @abstractmethod
    def received(self, session: ServerSession, message: Payload) -> None:
        """A whole message arrived. Raises MessageRejected to close the session as malformed."""

    @abstractmethod
    def closed(self, session: ServerSession) -> None:
        """The session ended, however it ended (called once)."""


_END = object()


class ServerSession:
    """The server's end of one session; ``send``, ``abort`` and ``close`` may be called from
    any thread."""

    def __init__(
        self,
        peer: Identity,
        limits: Limits,
        loop: asyncio.AbstractEventLoop,
        on_bytes: Callable[[int, int], None] | None = None,
    ) -> None:
        self.peer = peer
        self._limits = limits
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._closed = False
        self._on_bytes = on_bytes
        self.abort_reason: str | None = None
        self.abort_code = grpc.StatusCode.INVALID_ARGUMENT
        self.registered = False
        self.hello_timer: asyncio.TimerHandle | None = None

    @property
    def is_open(self) -> bool:
        """Whether the session can still carry messages."""
        return not self._closed

    def _put(self, item: Any) -> bool:
        """Queues ``item`` for the writer, from the loop's thread or any other."""
        if _running_loop() is self._loop:
            self._queue.put_nowait(item)
            return True
        if not self._loop.is_running():  # the server stopped
            return False
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # its loop is closed
            return False
        return True

    def send(self, payload: Payload) -> bool:
        """Queues ``payload`` for the peer (encoded when written); False if already closed."""
        if self._closed:
            return False
        return self._put(payload)

    @staticmethod
    def send_all(messages: Sequence[tuple[ServerSession, Payload]]) -> list[bool]:
        """``session.send(payload)`` for each pair, in order, waking each session's event loop
        once for them all instead of once per message (a round's tasks go out together).

        Returns:
            For each pair, whether its payload was queued (False: its session was closed or
            its server stopped).
        """
        queued = [not session._closed for session, _ in messages]
        by_loop: dict[asyncio.AbstractEventLoop, list[int]] = {}
        for index, (session, _) in enumerate(messages):
            if queued[index]:
                by_loop.setdefault(session._loop, []).append(index)
        for loop, indices in by_loop.items():
            items = [(messages[i][0]._queue, messages[i][1]) for i in indices]
            if _running_loop() is loop:
                _put_all(items)
                continue
            try:
                if not loop.is_running():
                    raise RuntimeError("stopped")
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the server stopped, its loop closed
                for index in indices:
                    queued[index] = False
        return queued

    def abort(
        self, reason: str, *, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    ) -> None:
        """Ends the session with status ``code`` (INVALID_ARGUMENT by default) and ``reason``."""
        self.abort_reason = reason
        self.abort_code = code
        self.close()

    def close(self) -> None:
        """Ends the session (idempotent)."""
        if not self._closed:
            self._closed = True
            self._put(_END)

    async def write_queued(self, context: grpc.aio.ServicerContext, encoded: _Encoded) -> None:
        """Writes every queued message's chunks until the session closes."""
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            sent = 0
            for chunk in encoded.chunks(item, self._limits.chunk_bytes):
                await context.write(chunk)
                sent += len(chunk)
            # Not held while waiting for the next: a round's task would keep its model alive
            # beside the next round's (2 models on a server; found with tracemalloc).
            del item
            chunk = b""
            if self._on_bytes is not None:
                self._on_bytes(sent, 0)


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    """Queues each item on its queue, in order (on the queues' loop)."""
    for queue, item in items:
        queue.put_nowait(item)


class _Encoded:
    """The chunks of the last message written, kept while the same object is sent again: a
    round's task, sent to every client, is encoded once (on the loop's thread only)."""

    KEEP_BYTES = 16 << 20
    """Messages up to this size are kept encoded; a larger one is encoded as it is written
    (its chunks are never all held at once)."""

    def __init__(self) -> None:
        self._last: tuple[Payload, int, list[bytes]] | None = None

    def chunks(self, payload: Payload, chunk_bytes: int) -> Iterable[bytes]:
        last = self._last
        if last is not None and last[0] is payload and last[1] == chunk_bytes:
            return last[2]
        if payload.tensor_bytes > self.KEEP_BYTES:
            return encode_chunks(payload, chunk_bytes=chunk_bytes)
        chunks = list(encode_chunks(payload, chunk_bytes=chunk_bytes))
        self._last = (payload, chunk_bytes, chunks)
        return chunks


class _FailedBatchOfAGoneCaller(logging.Filter):
    """Demotes to DEBUG gRPC's ERROR "ExecuteBatchError raised in core by servicer method" for
    fedcore's own methods.

    gRPC fails a call's last batch (its final status, after the method returned) once the
    caller has gone: cancelled its call, or its process ended. It drops that failure quietly
    when it has already learnt that the caller closed, and logs it as an error with a
    traceback when the failure reaches it first, which is a race between two completions of
    the same call. At the end of a run whose clients link to each other, every client closes
    its links while its neighbours end theirs, and the race came up now and then (CI, under
    load; tests/integration/test_lppa_run.py). A fedcore method has finished its work when
    this happens, and a caller that goes away mid-call is seen, counted and reported by the
    session code itself.
    """

    PREFIX = f"ExecuteBatchError raised in core by servicer method [{SERVICE_PREFIX}"

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and str(record.msg).startswith(self.PREFIX):
            record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
            record.exc_info, record.exc_text = None, None
        return True


_GRPC_CORE_LOG = logging.getLogger("grpc._cython.cygrpc")
if not any(isinstance(f, _FailedBatchOfAGoneCaller) for f in _GRPC_CORE_LOG.filters):
    _GRPC_CORE_LOG.addFilter(_FailedBatchOfAGoneCaller())


RETIRED_LOOP_SECONDS = 10.0
"""How long a stopped server's event loop stays open before it is closed."""
_retired_loops: collections.deque[tuple[float, asyncio.AbstractEventLoop]] = collections.deque()
_retired_lock = threading.Lock()


def _retire_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Closes ``loop`` (stopped) later: at a later server's stop once it has been retired for
    ``RETIRED_LOOP_SECONDS``, else with the process.

    gRPC's poller hands a stopped server's last completions (the reads its cancelled calls had
    outstanding) to that server's loop with ``call_soon_threadsafe`` for a while after
    ``stop`` returns. On a closed loop that raised "Event loop is closed" in whichever loop ran
    the poller's callback, logged as an error at the end of every run whose clients serve peer
    links; a stopped loop that is still open takes them and never runs them.
    """
    now = time.monotonic()
    with _retired_lock:
        while _retired_loops and now - _retired_loops[0][0] >= RETIRED_LOOP_SECONDS:
            _retired_loops.popleft()[1].close()
        _retired_loops.append((now, loop))


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class RpcServer:
    """A mutual-TLS gRPC server that dispatches chunked Payload calls to handlers.

    Every client must present a certificate signed by the run's CA whose common name parses as
    an ``Identity`` and whose URI name (:attr:`Identity.uri`) agrees with it; others are
    refused during the TLS handshake or with PERMISSION_DENIED. ``callers`` limits a method to
    the roles that may call it. A malformed, truncated or oversized request gets
    INVALID_ARGUMENT (or RESOURCE_EXHAUSTED from grpc for an oversized chunk) and never
    reaches a handler; the server keeps serving.

    No party can starve another (see docs of ``Limits``): each identity may hold at most
    ``limits.calls_per_identity`` calls at once (one more is refused with RESOURCE_EXHAUSTED
    at once), and at most ``limits.identity_bytes`` of unfinished messages; nothing is
    reserved for a message before its bytes arrive. Method handlers run in ``max_workers``
    threads (size it with ``Limits.workers``); sessions hold none. Sessions: at most one live
    session per identity and method. A new one must deliver its hello (first whole message)
    within ``limits.hello_seconds``; then it replaces the previous one, which is ended (its
    peer sees the stream end). Replacing rather than refusing lets a client whose old
    connection died unnoticed (a lost network, a killed process) come back at once, and it
    can only ever displace a session of the same certificate.

    ``gate`` bars a party that holds a valid certificate (a revoked site's client): it is
    asked at every new call or session and before every message is handed over, and a reason
    it returns refuses the call, or ends the session, with PERMISSION_DENIED (counted as
    ``revoked``).
    """

    def __init__(
        self,
        address: str,
        tls: TlsBundle,
        handlers: Mapping[str, Handler],
        *,
        service: str,
        limits: Limits,
        sessions: Mapping[str, SessionHandler] | None = None,
        max_workers: int = 32,
        callers: Mapping[str, Collection[str]] | None = None,
        on_rejected: Callable[[str, str, str | None], None] | None = None,
        on_bytes: Callable[[int, int], None] | None = None,
        gate: Callable[[Identity], str | None] | None = None,
    ) -> None:
        self._gate = gate
        self._service = service
        self._handlers = dict(handlers)
        self._sessions = dict(sessions or {})
        self._limits = limits
        self._callers = {name: frozenset(roles) for name, roles in (callers or {}).items()}
        unknown = sorted(set(self._callers) - set(self._handlers) - set(self._sessions))
        if unknown:
            raise TransportError(f"callers names {unknown}, which this server does not serve.")
        self._rejected = RejectionCounter(on_rejected)
        self._admission = _Admission(limits)
        self.room = _ReceiveRoom(limits.room_bytes)
        self._spare = _Spare()
        """Room for large session messages (``Limits.receive_bytes``); ``room.peak`` is the
        most bytes of them this server held at once."""
        self._live: dict[tuple[str, str], ServerSession] = {}
        self._live_lock = threading.Lock()
        self._on_bytes = on_bytes
        self._parked: dict[tuple[str, str, bytes], tuple[float, list[bytes]]] = {}
        self._parked_lock = threading.Lock()
        self._workers = futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix=f"rpc-{service.lower()}"
        )
        self._max_rpcs = max_workers * 4
        self._encoded = _Encoded()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"rpc-{service.lower()}-loop", daemon=True
        )
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self._stopping = False
        self._loop_stopped = False
        try:
            self.port = self._on_loop(self._listen(address, tls))
        except BaseException:
            self._close_loop()
            raise

    def _on_loop(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs ``coroutine`` on the server's loop and waits for its result.

        Raises:
            RuntimeError: the server's loop was stopped (the server stopped).
        """
        if self._loop_stopped:
            coroutine.close()
            raise RuntimeError(f"The {self._service} server has stopped.")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _listen(self, address: str, tls: TlsBundle) -> int:
        method_handlers = {
            name: grpc.stream_stream_rpc_method_handler(self._wrap(name)) for name in self._handlers
        }
        for name in self._sessions:
            method_handlers[name] = grpc.stream_stream_rpc_method_handler(self._wrap_session(name))
        generic = [
            grpc.method_handlers_generic_handler(f"fedcore.v1.{self._service}", method_handlers)
        ]
        if self._handlers:
            unary = {
                name: grpc.unary_unary_rpc_method_handler(self._wrap_unary(name))
                for name in self._handlers
            }
            generic.append(
                grpc.method_handlers_generic_handler(
                    f"fedcore.v1.{self._service}{UNARY_SERVICE_SUFFIX}", unary
                )
            )
        server = grpc.aio.server(
            handlers=tuple(generic),
            options=self._limits.channel_options(),
            maximum_concurrent_rpcs=self._max_rpcs,
        )
        credentials = grpc.ssl_server_credentials(
            [(tls.key_pem, tls.cert_pem)], root_certificates=tls.ca_pem, require_client_auth=True
        )
        try:
            port = server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            raise TransportError(f"Cannot listen on {address}: {exc}.") from exc
        if port == 0:
            raise TransportError(f"Cannot listen on {address}: the address is not available.")
        self._server = server
        return port

    def start(self) -> None:
        """Starts serving (on the server's own thread)."""
        assert self._server is not None
        self._on_loop(self._server.start())

    def drop_spare(self) -> None:
        """Lets go of the bytes kept from the last large message for the next one of its size
        (``_Spare``): a caller about to need its memory (a server combining a round) calls it.
        """
        self._spare.drop()

    def stop(self, grace: float = 2.0) -> None:
        """Stops serving: ends every live session (after what is queued on it), then gives the
        calls still in flight ``grace`` seconds to finish."""
        if self._stopping:
            return
        self._stopping = True
        if self._server is not None:
            try:
                self._on_loop(self._stop(self._server, grace), timeout=grace + 5)
            except (futures.TimeoutError, RuntimeError):
                log.warning("The %s server did not stop within %s s.", self._service, grace + 5)
        self._close_loop()

    async def _stop(self, server: grpc.aio.Server, grace: float) -> None:
        # A session its peer keeps open would otherwise outlast the grace and be aborted by
        # gRPC ("Aborting method ... due to server stop", a warning on the peer service of
        # every client still linked at the end of an LPPA run): ended here, its call returns.
        with self._live_lock:
            live = list(self._live.values())
        for session in live:
            session.close()
        await server.stop(grace)

    def _close_loop(self) -> None:
        self._loop_stopped = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            _retire_loop(self._loop)
        self._workers.shutdown(wait=False, cancel_futures=True)

    async def _reject(
        self,
        context: grpc.aio.ServicerContext,
        name: str,
        reason: str,
        sender: Identity | None,
        code: grpc.StatusCode,
        message: str,
    ) -> NoReturn:
        """Counts, logs (with the sender) and aborts one refused call; never returns."""
        who = None if sender is None else sender.common_name
        self._rejected(name, reason, who)
        log.warning("Refused a %s call from %s: %s", name, who or "an unknown party", message)
        await context.abort(code, message)
        raise AssertionError("context.abort raises")  # pragma: no cover

    async def _admit(self, context: grpc.aio.ServicerContext, name: str) -> Identity:
        """Checks the caller and takes one of its call slots, given back when the call ends.

        Aborts with PERMISSION_DENIED for a certificate that names no party (or whose names
        disagree) or a role ``name`` does not take calls from, and with RESOURCE_EXHAUSTED
        when the caller already holds all its call slots.
        """
        peer, problem = _peer_identity(context)
        if peer is None:
            await self._reject(
                context,
                name,
                "identity",
                None,
                grpc.StatusCode.PERMISSION_DENIED,
                f"The client certificate names no fedcore identity: {problem}",
            )
        assert peer is not None
        roles = self._callers.get(name)
        if roles is not None and peer.role not in roles:
            await self._reject(
                context,
                name,
                "identity",
                peer,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{self._service}.{name} takes calls from {sorted(roles)} only, not from "
                f"{peer.common_name!r}.",
            )
        barred = None if self._gate is None else self._gate(peer)
        if barred is not None:
            await self._reject(
                context, name, "revoked", peer, grpc.StatusCode.PERMISSION_DENIED, barred
            )
        who = peer.common_name
        if not self._admission.enter(who):
            await self._reject(
                context,
                name,
                "refused",
                peer,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{who} already has {self._limits.calls_per_identity} calls open on this "
                f"server (limits.calls_per_identity); this one is refused.",
            )
        released = threading.Event()

        def release(_context: object = None) -> None:
            if not released.is_set():
                released.set()
                self._admission.leave(who)

        context.add_done_callback(release)
        if context.done():
            release()  # the call already ended
        return peer

    async def _run_handler(
        self, name: str, peer: Identity, request: Payload, context: grpc.aio.ServicerContext
    ) -> Payload:
        """Calls the handler of ``name`` in a worker thread; translates its exceptions into
        statuses (aborts)."""
        handler = self._handlers[name]
        try:
            return await self._loop.run_in_executor(
                self._workers, _handing_over(handler, peer, request, CallContext(context))
            )
        except MessageRejected as exc:
            self._rejected(name, "refused", peer.common_name)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NotReady as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except PermissionError as exc:
            self._rejected(name, "identity", peer.common_name)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except Exception as exc:  # a handler bug must not take the server down
            log.exception("The %s handler failed for %s.", name, peer.common_name)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        raise AssertionError("context.abort raises")  # pragma: no cover

    def _park(self, key: tuple[str, str, bytes], chunks: list[bytes] | None) -> list[bytes] | None:
        """Parks ``chunks`` under ``key``, or (``chunks`` None) takes what is parked there."""
        now = time.monotonic()
        with self._parked_lock:
            for stale in [k for k, (at, _) in self._parked.items() if now - at > PARK_SECONDS]:
                del self._parked[stale]
            if chunks is not None:
                self._parked[key] = (now, chunks)
                return None
            found = self._parked.pop(key, None)
        return None if found is None else found[1]

    def _wrap(
        self, name: str
    ) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], AsyncIterator[bytes]]:
        limits = self._limits

        async def serve(
            requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[bytes]:
            peer = await self._admit(context, name)
            inbound = _Inbound(self._admission, peer.common_name, limits.max_message_bytes)
            received = 0
            first: list[bytes] = []
            try:
                async for chunk in requests:
                    received += len(chunk)
                    if len(first) < 2:
                        first.append(chunk)
                    inbound.feed(chunk)
                    inbound.land(self._spare)
                request = inbound.finish()
            except MessageRejected as exc:
                await self._reject(
                    context, name, "malformed", peer, grpc.StatusCode.INVALID_ARGUMENT, str(exc)
                )
            except _OverLimit as exc:
                await self._reject(
                    context, name, "refused", peer, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
                )
            finally:
                inbound.release()
            parked = None
            if len(first) == 1 and self._parked:
                parked = self._park(_park_key(peer, name, first[0]), None)
            response = None
            if parked is None:
                response = await self._run_handler(name, peer, request, context)
                chunks: Iterable[bytes] = encode_chunks(response, chunk_bytes=limits.chunk_bytes)
            else:
                chunks = parked
            sent = 0
            for chunk in chunks:
                sent += len(chunk)
                yield chunk
            if self._on_bytes is not None:
                self._on_bytes(sent, received)
            del request, response, chunks
            self._spare.keep(inbound.last_body)  # unless the handler kept what it views
            inbound.last_body = None

        return serve

    def _wrap_unary(
        self, name: str
    ) -> Callable[[bytes, grpc.aio.ServicerContext], Coroutine[Any, Any, bytes]]:
        limits = self._limits

        async def serve(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            # One chunk at most (grpc's receive limit), read before the handler starts: the
            # call slot bounds what a party holds here.
            peer = await self._admit(context, name)
            try:
                request = decode_chunks([raw], max_message_bytes=limits.max_message_bytes)
            except MessageRejected as exc:
                await self._reject(
                    context, name, "malformed", peer, grpc.StatusCode.INVALID_ARGUMENT, str(exc)
                )
            response = await self._run_handler(name, peer, request, context)
            chunks = list(encode_chunks(response, chunk_bytes=limits.chunk_bytes))
            if len(chunks) != 1:
                self._park(_park_key(peer, name, raw), chunks)
                await context.abort(grpc.StatusCode.OUT_OF_RANGE, OVERSIZED_REPLY)
            if self._on_bytes is not None:
                self._on_bytes(len(chunks[0]), len(raw))
            return chunks[0]

        return serve

    def _wrap_session(
        self, name: str
    ) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], Coroutine[Any, Any, None]]:
        handler = self._sessions[name]
        limits = self._limits

        async def serve(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
            peer = await self._admit(context, name)
            session = ServerSession(peer, limits, self._loop, on_bytes=self._on_bytes)
            # The call is bounded: the stream says hello in time or ends.
            session.hello_timer = self._loop.call_later(
                limits.hello_seconds, self._hello_late, name, session
            )
            reader = asyncio.ensure_future(self._read_session(name, handler, session, requests))
            try:
                await session.write_queued(context, self._encoded)
            except (grpc.RpcError, asyncio.InvalidStateError, grpc.aio.InternalError):
                pass  # the peer went away (InternalError: gRPC's core failed the write)
            except grpc.aio.BaseError:  # "Server already stopped", under our own stop()
                if not self._stopping:
                    raise
            finally:
                session.hello_timer.cancel()
                session.close()
                reader.cancel()
                self._forget(name, session)
                if session.registered:
                    handler.closed(session)
            if session.abort_reason is not None:
                await context.abort(session.abort_code, session.abort_reason)

        return serve

    def _hello_late(self, name: str, session: ServerSession) -> None:
        """Ends a session that has not delivered its hello within ``limits.hello_seconds``."""
        if session.registered or not session.is_open:
            return
        message = (
            f"The {name} session sent no whole first message within "
            f"{self._limits.hello_seconds} s (limits.hello_seconds); it is closed."
        )
        self._rejected(name, "refused", session.peer.common_name)
        log.warning("Closing a %s session of %s: %s", name, session.peer.common_name, message)
        session.abort(message, code=grpc.StatusCode.DEADLINE_EXCEEDED)

    def _claim(self, name: str, session: ServerSession) -> ServerSession | None:
        """Makes ``session`` the live one of its identity; returns the one it replaces."""
        key = (name, session.peer.common_name)
        with self._live_lock:
            old = self._live.get(key)
            self._live[key] = session
        return None if old is session else old

    def _unclaim(self, name: str, session: ServerSession, old: ServerSession | None) -> None:
        """Undoes ``_claim`` for a session the handler refused."""
        key = (name, session.peer.common_name)
        with self._live_lock:
            if self._live.get(key) is session:
                if old is not None and old.is_open:
                    self._live[key] = old
                else:
                    del self._live[key]

    def _forget(self, name: str, session: ServerSession) -> None:
        key = (name, session.peer.common_name)
        with self._live_lock:
            if self._live.get(key) is session:
                del self._live[key]

    def _register(self, name: str, handler: SessionHandler, session: ServerSession) -> bool:
        """Makes a session that delivered its first whole message the live one of its
        identity (``handler.opened``); False, the session aborted, if the handler refused."""
        # A session counts only once its first message is well formed, so a malformed
        # stream can never displace the peer's working session.
        old = self._claim(name, session)
        try:
            handler.opened(session)
        except PermissionError as exc:
            self._unclaim(name, session, old)
            self._rejected(name, "identity", session.peer.common_name)
            log.warning("Refused the %s session of %s: %s", name, session.peer.common_name, exc)
            session.abort(str(exc), code=grpc.StatusCode.PERMISSION_DENIED)
            return False
        session.registered = True
        if session.hello_timer is not None:
            session.hello_timer.cancel()
        if old is not None:
            # The handler may have closed it already (same identity twice).
            log.warning(
                "A new %s session of %s replaces its previous one, which is closed.",
                name,
                session.peer.common_name,
            )
            old.close()
        return True

    async def _read_session(
        self,
        name: str,
        handler: SessionHandler,
        session: ServerSession,
        requests: AsyncIterator[bytes],
    ) -> None:
        limit = self._limits.max_message_bytes
        who = session.peer.common_name
        inbound = _Inbound(self._admission, who, limit)
        received = 0
        room = 0  # bytes of self.room the message being read holds
        hold: _Hold | None = None
        chunks = aiter(requests)
        try:
            while True:
                try:
                    chunk = await self._next_chunk(chunks, hold)
                except StopAsyncIteration:
                    break
                except grpc.aio.BaseError:  # "Server already stopped", under our own stop()
                    if not self._stopping:
                        raise
                    log.debug("The %s session of %s ended with the server's stop.", name, who)
                    return
                if not session.is_open:
                    return  # ended (replaced, late hello): drop what else arrives
                received += len(chunk)
                inbound.feed(chunk)
                if hold is not None:
                    hold.arrived(len(chunk))
                announced = inbound.decoder.announced
                if not room and announced is not None and announced > INLINE_BYTES:
                    # Room for the whole body before more of it is read: a server holds a
                    # bounded number of large messages however many clients send at once.
                    await self.room.take(announced)
                    room = announced
                    hold = _Hold(announced, time.monotonic())
                    inbound.land(self._spare)
                if not inbound.decoder.complete:
                    continue
                message = inbound.finish()
                if self._on_bytes is not None:
                    self._on_bytes(0, received)
                received = 0
                if not session.registered and not self._register(name, handler, session):
                    return
                barred = None if self._gate is None else self._gate(session.peer)
                if barred is not None:
                    self._rejected(name, "revoked", who)
                    log.warning("Closing the %s session of %s: %s", name, who, barred)
                    session.abort(barred, code=grpc.StatusCode.PERMISSION_DENIED)
                    return
                if announced is not None and announced > INLINE_BYTES:  # its tensors' bytes
                    try:
                        await self._loop.run_in_executor(
                            self._workers, _handing_over(handler.received, session, message)
                        )
                    finally:
                        del message  # the handler has kept what it keeps
                        self.room.give(room)
                        room, hold = 0, None
                        self._spare.keep(inbound.last_body)
                        inbound.last_body = None
                else:
                    handler.received(session, message)
                    if room:  # announced large, decoded small (an empty body never is)
                        self.room.give(room)
                        room, hold = 0, None
            if received:
                inbound.finish()  # raises: the peer half-closed inside a message
        except MessageRejected as exc:
            self._rejected(name, "malformed", who)
            log.warning("Closing the %s session of %s: %s", name, who, exc)
            session.abort(str(exc))
        except _OverLimit as exc:
            self._rejected(name, "refused", who)
            log.warning("Closing the %s session of %s: %s", name, who, exc)
            session.abort(str(exc), code=grpc.StatusCode.RESOURCE_EXHAUSTED)
        except _Stalled as exc:
            self._rejected(name, "refused", who)
            log.warning("Closing the %s session of %s: %s", name, who, exc)
            session.abort(str(exc), code=grpc.StatusCode.DEADLINE_EXCEEDED)
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the peer went away; closed() tells the handler
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a handler bug must not take the server down
            log.exception("The %s session handler failed for %s.", name, who)
            session.abort(f"{type(exc).__name__}: {exc}")
        finally:
            if room:
                self.room.give(room)
            inbound.release()
            session.close()

    async def _next_chunk(self, chunks: AsyncIterator[bytes], hold: _Hold | None) -> bytes:
        """The next chunk of a session. While its message holds room (``hold``) and others
        wait for room, a sender whose bytes are not in by when they are due (``_Hold.due``:
        none for ``limits.stall_seconds``, or too few for ``limits.min_receive_rate``) raises
        ``_Stalled``; with nobody waiting, it may take its time.

        Raises:
            StopAsyncIteration: the stream ended.
        """
        if hold is None:
            return await anext(chunks)
        pending = asyncio.ensure_future(anext(chunks))
        try:
            while True:
                left = hold.due(self._limits) - time.monotonic()
                if left <= 0:
                    if self.room.waiting:
                        raise _Stalled(hold.why(self._limits, self.room.waiting))
                    left = self._limits.stall_seconds  # late, but nobody waits: look again
                done, _ = await asyncio.wait({pending}, timeout=left)
                if done:
                    return pending.result()
        finally:
            if not pending.done():
                pending.cancel()


def _handing_over(function: Callable[..., T], *args: Any) -> Callable[[], T]:
    """``function(*args)`` for a worker thread, which lets go of the arguments as the call
    returns: the executor's work item outlives the call a moment, and a message it still held
    would still view its bytes when the event loop goes on (``_Spare.keep``)."""
    box = list(args)

    def call() -> T:
        given = box.copy()
        box.clear()
        try:
            return function(*given)
        finally:
            given.clear()

    return call


def _park_key(peer: Identity, method: str, request: bytes) -> tuple[str, str, bytes]:
    """Where a response to ``request`` by ``peer`` is parked: the caller, method, request."""
    return peer.common_name, method, hashlib.sha256(request).digest()


def _peer_identity(context: grpc.aio.ServicerContext) -> tuple[Identity | None, str]:
    """Returns the caller's identity, or None and why its certificate names none.

    The common name must parse as an identity and the certificate's URI names must be
    exactly that identity's URI (grpc reads both from the verified certificate).
    """
    auth = context.auth_context()
    names = auth.get("x509_common_name") or []
    if len(names) != 1:
        return None, f"it has {len(names)} common names, expected one."
    try:
        identity = Identity.parse(names[0].decode("utf-8", "replace"))
    except TransportError as exc:
        return None, str(exc)
    uris = [uri.decode("utf-8", "replace") for uri in auth.get("peer_uri") or []]
    if uris != [identity.uri]:
        return None, (
            f"its common name says {identity.common_name!r} but its URI names are {uris}, "
            f"expected exactly [{identity.uri!r}]."
        )
    return identity, ""

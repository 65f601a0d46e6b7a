"""gRPC over mutual TLS: every call carries one Payload each way as a stream of chunks.

Why the cut sits here: roles only ever call ``RpcClient.call(method, payload, timeout=...)`` and
register ``handler(peer, payload) -> payload`` functions; chunking, size limits, deadlines,
retries with backoff, peer identities and the translation of grpc errors live in this module
and nowhere else, so a role never sees a grpc type and a protocol never sees a role.

Every method is served in two forms: a stream of chunks each way, and, for a request that fits
in one chunk, a unary call (service ``<service>.Unary``), which gRPC's Python API makes about
three times cheaper (no thread per call). A response that does not fit in one chunk cannot
travel in the unary form: the server then parks it, and the client asks again in the stream
form, which answers from the park instead of running the handler a second time.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import queue
import random
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from fedcore.errors import MessageRejected, NotReady, TransportError
from fedcore.transport._codec import MAX_HEADER_BYTES, PayloadDecoder, decode_chunks, encode_chunks
from fedcore.transport._payload import Payload
from fedcore.transport._tls import Identity, TlsBundle

log = logging.getLogger(__name__)

SERVICE_PREFIX = "/fedcore.v1."
ENVELOPE_BYTES = 64 * 1024
"""Room for gRPC framing on top of one chunk."""

UNARY_SERVICE_SUFFIX = ".Unary"
"""Appended to a service's name for the unary form of its methods."""
OVERSIZED_REPLY = "fedcore: the response is over one chunk; ask again in the stream form"
"""The details of the OUT_OF_RANGE status that sends a unary call to the stream form."""
PARK_SECONDS = 120.0
"""How long a parked response waits for its caller to ask again in the stream form."""

Handler = Callable[[Identity, Payload, "CallContext"], Payload]
"""A method implementation: the caller's identity and request in, the response out."""


SPARE_WORKERS = 4
"""Workers a server keeps beyond every party's share (see ``Limits.workers``)."""


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
    """

    chunk_bytes: int = 4 * 1024 * 1024
    max_message_bytes: int = 8 * 1024**3
    keepalive_ms: int = 20_000
    calls_per_identity: int = 4
    hello_seconds: float = 30.0
    bytes_in_flight: int | None = None

    @property
    def identity_bytes(self) -> int:
        """The bytes of unfinished messages one identity may have a server hold at once."""
        if self.bytes_in_flight is not None:
            return self.bytes_in_flight
        return self.max_message_bytes + MAX_HEADER_BYTES + 8

    def workers(self, parties: int) -> int:
        """The worker threads a server needs so that no party can starve another.

        gRPC's synchronous server holds one worker per open call. With room for every
        party's ``calls_per_identity``, a party at its limit still leaves every other party
        its own share; a call over the limit is refused as soon as a worker picks it up.

        Args:
            parties: how many identities may call this server.

        Returns:
            ``calls_per_identity * parties + SPARE_WORKERS``.
        """
        return self.calls_per_identity * max(parties, 1) + SPARE_WORKERS

    def channel_options(self) -> list[tuple[str, Any]]:
        """Returns the grpc options of both ends: the per-chunk limit and keepalive.

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


class CallContext:
    """What a handler may ask about its call: liveness and a cancellation hook."""

    def __init__(self, context: grpc.ServicerContext) -> None:
        self._context = context

    def is_active(self) -> bool:
        """Returns whether the caller is still connected."""
        return bool(self._context.is_active())

    def on_done(self, callback: Callable[[], None]) -> None:
        """Calls ``callback`` once the call ends, however it ends."""
        self._context.add_callback(callback)

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

    def feed(self, chunk: bytes) -> None:
        if not self._admission.take_bytes(self._who, len(chunk)):
            raise _OverLimit(
                f"{self._who} has more bytes of unfinished messages in flight than its share "
                f"allows; this chunk of {len(chunk)} bytes is refused."
            )
        self.held += len(chunk)
        self.decoder.feed(chunk)

    def finish(self) -> Payload:
        """Returns the message and forgets its bytes; the next message starts afresh."""
        try:
            return self.decoder.finish()
        finally:
            self.release()
            self.decoder = PayloadDecoder(max_message_bytes=self._max)

    def release(self) -> None:
        self._admission.give_bytes(self._who, self.held)
        self.held = 0


class _OverLimit(Exception):
    """A caller went over its share of a server (calls or bytes in flight)."""


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
    as soon as a worker picks it up, which frees the worker at once), and at most
    ``limits.identity_bytes`` of unfinished messages; nothing is reserved for a message
    before its bytes arrive. Size ``max_workers`` with ``Limits.workers``. Sessions: at most
    one live session per identity and method. A new one must deliver its hello (first whole
    message) within ``limits.hello_seconds``; then it replaces the previous one, which is
    ended (its peer sees the stream end). Replacing rather than refusing lets a client whose
    old connection died unnoticed (a lost network, a killed process) come back at once, and it
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
        self._live: dict[tuple[str, str], ServerSession] = {}
        self._live_lock = threading.Lock()
        self._on_bytes = on_bytes
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
            options=limits.channel_options(),
            maximum_concurrent_rpcs=max_workers * 4,
        )
        self._parked: dict[tuple[str, str, bytes], tuple[float, list[bytes]]] = {}
        self._parked_lock = threading.Lock()
        method_handlers = {
            name: grpc.stream_stream_rpc_method_handler(self._wrap(name)) for name in self._handlers
        }
        for name in self._sessions:
            method_handlers[name] = grpc.stream_stream_rpc_method_handler(self._wrap_session(name))
        generic = [grpc.method_handlers_generic_handler(f"fedcore.v1.{service}", method_handlers)]
        if self._handlers:
            unary = {
                name: grpc.unary_unary_rpc_method_handler(self._wrap_unary(name))
                for name in self._handlers
            }
            generic.append(
                grpc.method_handlers_generic_handler(
                    f"fedcore.v1.{service}{UNARY_SERVICE_SUFFIX}", unary
                )
            )
        self._server.add_generic_rpc_handlers(tuple(generic))
        credentials = grpc.ssl_server_credentials(
            [(tls.key_pem, tls.cert_pem)], root_certificates=tls.ca_pem, require_client_auth=True
        )
        try:
            self.port = self._server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            raise TransportError(f"Cannot listen on {address}: {exc}.") from exc
        if self.port == 0:
            raise TransportError(f"Cannot listen on {address}: the address is not available.")

    def start(self) -> None:
        """Starts serving in background threads."""
        self._server.start()

    def stop(self, grace: float = 2.0) -> None:
        """Stops serving; calls in flight get ``grace`` seconds to finish."""
        self._server.stop(grace).wait(grace + 1)

    def _reject(
        self,
        context: grpc.ServicerContext,
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
        context.abort(code, message)
        raise AssertionError("context.abort raises")  # pragma: no cover

    def _admit(self, context: grpc.ServicerContext, name: str) -> Identity:
        """Checks the caller and takes one of its call slots, given back when the call ends.

        Aborts with PERMISSION_DENIED for a certificate that names no party (or whose names
        disagree) or a role ``name`` does not take calls from, and with RESOURCE_EXHAUSTED
        when the caller already holds all its call slots.
        """
        peer, problem = _peer_identity(context)
        if peer is None:
            self._reject(
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
            self._reject(
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
            self._reject(context, name, "revoked", peer, grpc.StatusCode.PERMISSION_DENIED, barred)
        who = peer.common_name
        if not self._admission.enter(who):
            self._reject(
                context,
                name,
                "refused",
                peer,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{who} already has {self._limits.calls_per_identity} calls open on this "
                f"server (limits.calls_per_identity); this one is refused.",
            )
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self._admission.leave(who)

        if not context.add_callback(release):
            release()  # the call already ended
        return peer

    def _run_handler(
        self, name: str, peer: Identity, request: Payload, context: grpc.ServicerContext
    ) -> Payload:
        """Calls the handler of ``name``; translates its exceptions into statuses (aborts)."""
        try:
            return self._handlers[name](peer, request, CallContext(context))
        except MessageRejected as exc:
            self._rejected(name, "refused", peer.common_name)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NotReady as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except PermissionError as exc:
            self._rejected(name, "identity", peer.common_name)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except Exception as exc:  # a handler bug must not take the server down
            log.exception("The %s handler failed for %s.", name, peer.common_name)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
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
    ) -> Callable[[Iterator[bytes], grpc.ServicerContext], Iterator[bytes]]:
        limits = self._limits

        def serve(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
            peer = self._admit(context, name)
            inbound = _Inbound(self._admission, peer.common_name, limits.max_message_bytes)
            received = 0
            first: list[bytes] = []
            try:
                for chunk in requests:
                    received += len(chunk)
                    if len(first) < 2:
                        first.append(chunk)
                    inbound.feed(chunk)
                request = inbound.finish()
            except MessageRejected as exc:
                self._reject(
                    context, name, "malformed", peer, grpc.StatusCode.INVALID_ARGUMENT, str(exc)
                )
            except _OverLimit as exc:
                self._reject(
                    context, name, "refused", peer, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
                )
            finally:
                inbound.release()
            parked = None
            if len(first) == 1 and self._parked:
                parked = self._park(_park_key(peer, name, first[0]), None)
            if parked is None:
                response = self._run_handler(name, peer, request, context)
                chunks: Iterable[bytes] = encode_chunks(response, chunk_bytes=limits.chunk_bytes)
            else:
                chunks = parked
            sent = 0
            for chunk in chunks:
                sent += len(chunk)
                yield chunk
            if self._on_bytes is not None:
                self._on_bytes(sent, received)

        return serve

    def _wrap_unary(self, name: str) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        limits = self._limits

        def serve(raw: bytes, context: grpc.ServicerContext) -> bytes:
            # One chunk at most (grpc's receive limit), read before the handler starts: the
            # call slot bounds what a party holds here.
            peer = self._admit(context, name)
            try:
                request = decode_chunks([raw], max_message_bytes=limits.max_message_bytes)
            except MessageRejected as exc:
                self._reject(
                    context, name, "malformed", peer, grpc.StatusCode.INVALID_ARGUMENT, str(exc)
                )
            response = self._run_handler(name, peer, request, context)
            chunks = list(encode_chunks(response, chunk_bytes=limits.chunk_bytes))
            if len(chunks) != 1:
                self._park(_park_key(peer, name, raw), chunks)
                context.abort(grpc.StatusCode.OUT_OF_RANGE, OVERSIZED_REPLY)
            if self._on_bytes is not None:
                self._on_bytes(len(chunks[0]), len(raw))
            return chunks[0]

        return serve

    def _wrap_session(
        self, name: str
    ) -> Callable[[Iterator[bytes], grpc.ServicerContext], Iterator[bytes]]:
        handler = self._sessions[name]
        limits = self._limits

        def serve(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
            peer = self._admit(context, name)
            session = ServerSession(peer, limits, on_bytes=self._on_bytes)
            reader = threading.Thread(
                target=self._read_session,
                name=f"{name}-{peer}",
                args=(name, handler, session, requests),
                daemon=True,
            )
            # The worker this stream holds is bounded: the stream says hello in time or ends.
            deadline = threading.Timer(limits.hello_seconds, self._hello_late, (name, session))
            deadline.daemon = True
            session.hello_timer = deadline
            reader.start()
            deadline.start()
            try:
                yield from session.outbound()
            finally:
                deadline.cancel()
                session.close()
                self._forget(name, session)
                if session.registered:
                    handler.closed(session)
            if session.abort_reason is not None:
                context.abort(session.abort_code, session.abort_reason)

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

    def _read_session(
        self, name: str, handler: SessionHandler, session: ServerSession, requests: Iterator[bytes]
    ) -> None:
        limit = self._limits.max_message_bytes
        inbound = _Inbound(self._admission, session.peer.common_name, limit)
        received = 0
        try:
            for chunk in requests:
                if not session.is_open:
                    return  # ended (replaced, late hello): drop what else arrives
                received += len(chunk)
                inbound.feed(chunk)
                if inbound.decoder.complete:
                    message = inbound.finish()
                    if self._on_bytes is not None:
                        self._on_bytes(0, received)
                    received = 0
                    if not session.registered:
                        # A session counts only once its first message is well formed, so a
                        # malformed stream can never displace the peer's working session.
                        old = self._claim(name, session)
                        try:
                            handler.opened(session)
                        except PermissionError as exc:
                            self._unclaim(name, session, old)
                            self._rejected(name, "identity", session.peer.common_name)
                            log.warning(
                                "Refused the %s session of %s: %s",
                                name,
                                session.peer.common_name,
                                exc,
                            )
                            session.abort(str(exc), code=grpc.StatusCode.PERMISSION_DENIED)
                            return
                        session.registered = True
                        if session.hello_timer is not None:
                            session.hello_timer.cancel()
                        if old is not None:
                            # The handler may have closed it already (same identity twice).
                            log.warning(
                                "A new %s session of %s replaces its previous one, which is "
                                "closed.",
                                name,
                                session.peer.common_name,
                            )
                            old.close()
                    barred = None if self._gate is None else self._gate(session.peer)
                    if barred is not None:
                        self._rejected(name, "revoked", session.peer.common_name)
                        log.warning(
                            "Closing the %s session of %s: %s",
                            name,
                            session.peer.common_name,
                            barred,
                        )
                        session.abort(barred, code=grpc.StatusCode.PERMISSION_DENIED)
                        return
                    handler.received(session, message)
            if received:
                inbound.finish()  # raises: the peer half-closed inside a message
        except MessageRejected as exc:
            self._rejected(name, "malformed", session.peer.common_name)
            log.warning("Closing the %s session of %s: %s", name, session.peer.common_name, exc)
            session.abort(str(exc))
        except _OverLimit as exc:
            self._rejected(name, "refused", session.peer.common_name)
            log.warning("Closing the %s session of %s: %s", name, session.peer.common_name, exc)
            session.abort(str(exc), code=grpc.StatusCode.RESOURCE_EXHAUSTED)
        except grpc.RpcError:
            pass  # the peer went away; closed() tells the handler
        except Exception as exc:  # a handler bug must not take the server down
            log.exception("The %s session handler failed for %s.", name, session.peer.common_name)
            session.abort(f"{type(exc).__name__}: {exc}")
        finally:
            inbound.release()
            session.close()


class SessionHandler(ABC):
    """Serves long-lived two-way sessions: one per connected peer, messages both ways.

    ``opened`` is called when a session's first well-formed message has arrived (just before
    ``received`` is called with it) and ``closed`` once it ends, if it was opened; ``received``
    is called once per inbound message, in order, from that session's reader thread. Sending is
    ``session.send``. The server keeps one live session per identity: once a new one is
    opened, the previous one of the same identity is closed (and ``closed`` follows for it).
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
    """The server's end of one session; ``send`` may be called from any thread."""

    def __init__(
        self, peer: Identity, limits: Limits, on_bytes: Callable[[int, int], None] | None = None
    ) -> None:
        self.peer = peer
        self._limits = limits
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._on_bytes = on_bytes
        self.abort_reason: str | None = None
        self.abort_code = grpc.StatusCode.INVALID_ARGUMENT
        self.registered = False
        self.hello_timer: threading.Timer | None = None

    @property
    def is_open(self) -> bool:
        """Whether the session can still carry messages."""
        return not self._closed.is_set()

    def send(self, payload: Payload) -> bool:
        """Queues ``payload`` for the peer (encoded lazily); returns False if already closed."""
        if self._closed.is_set():
            return False
        self._queue.put(payload)
        return True

    def abort(
        self, reason: str, *, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    ) -> None:
        """Ends the session with status ``code`` (INVALID_ARGUMENT by default) and ``reason``."""
        self.abort_reason = reason
        self.abort_code = code
        self.close()

    def close(self) -> None:
        """Ends the session (idempotent)."""
        if not self._closed.is_set():
            self._closed.set()
            self._queue.put(_END)

    def outbound(self) -> Iterator[bytes]:
        """Yields the chunks of every queued message until the session closes."""
        yield from _encode_queued(self._queue, self._limits, self._on_bytes)


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


def _park_key(peer: Identity, method: str, request: bytes) -> tuple[str, str, bytes]:
    """Where a response to ``request`` by ``peer`` is parked: the caller, method, request."""
    return peer.common_name, method, hashlib.sha256(request).digest()


def _peer_identity(context: grpc.ServicerContext) -> tuple[Identity | None, str]:
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
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            details = exc.details() if hasattr(exc, "details") else str(exc)
            raise RemoteError(
                f"The session {self._method} with {self._target} failed with {code.name}: "
                f"{details}",
                method=self._method,
                code=code.name,
            ) from exc
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

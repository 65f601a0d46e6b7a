"""One TCP endpoint for many TLS services, routed by the name a caller asks for (SNI).

A hub exposes one port. Every fedcore caller names the party it means to reach in its TLS
ClientHello (gRPC sends ``grpc.ssl_target_name_override``, e.g. ``server.fedcore.invalid``, as
the server name), so the router reads that name from the first bytes of a connection, without
consuming them and without terminating TLS, and hands the whole connection to the handler of
that name: a TCP splice to a backend (the server, the KDC), a relay to a client that dialed
out (a peer link), or a local TLS service (the hub's own API). The router never holds a key of
the run: what it forwards stays end-to-end mutual TLS between the two parties.

A connection whose first bytes are ``FCTUNNEL <token>\\n`` (not TLS) is the dial-back of a
relay: :class:`TunnelBroker` pairs it with the caller waiting for that token.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from fedcore.errors import TransportError

log = logging.getLogger(__name__)

__all__ = [
    "TUNNEL_PREFIX",
    "ConnectionHandler",
    "SniRouter",
    "TunnelBroker",
    "dial",
    "forward_to",
    "read_server_name",
    "splice",
]

ConnectionHandler = Callable[[socket.socket], None]
"""Takes over one accepted connection (and closes it when done)."""

TUNNEL_PREFIX = b"FCTUNNEL "
_MAX_RECORD = 16_384 + 2_048
"""The largest TLS record a ClientHello may come in (RFC 8446 5.2, with room for padding)."""
_PUMP_BYTES = 65_536


def _parse_client_hello(data: bytes) -> str | None:
    """The host name of a ClientHello's server_name extension, or None when it has none.

    Raises:
        ValueError: ``data`` is not one whole TLS record holding a ClientHello.
    """
    if len(data) < 5 or data[0] != 0x16:
        raise ValueError("not a TLS handshake record")
    length = int.from_bytes(data[3:5], "big")
    body = data[5 : 5 + length]
    if len(body) < length:
        raise ValueError("truncated record")
    if not body or body[0] != 0x01:
        raise ValueError("not a ClientHello")
    hello_length = int.from_bytes(body[1:4], "big")
    hello = body[4 : 4 + hello_length]
    if len(hello) < hello_length:
        raise ValueError("the ClientHello spans more than one record")
    at = 2 + 32  # client_version, random
    at += 1 + hello[at]  # session_id
    at += 2 + int.from_bytes(hello[at : at + 2], "big")  # cipher_suites
    at += 1 + hello[at]  # compression_methods
    if at + 2 > len(hello):
        return None  # no extensions
    end = at + 2 + int.from_bytes(hello[at : at + 2], "big")
    at += 2
    while at + 4 <= min(end, len(hello)):
        kind = int.from_bytes(hello[at : at + 2], "big")
        size = int.from_bytes(hello[at + 2 : at + 4], "big")
        extension = hello[at + 4 : at + 4 + size]
        at += 4 + size
        if kind != 0:
            continue
        names = extension[2:]
        while len(names) >= 3:
            name_type = names[0]
            name_length = int.from_bytes(names[1:3], "big")
            name = names[3 : 3 + name_length]
            if name_type == 0:
                return name.decode("ascii").lower()
            names = names[3 + name_length :]
        return None
    return None


def read_server_name(connection: socket.socket, timeout: float) -> str | bytes | None:
    """Peeks at a new connection's first record and returns what it asks for, consuming nothing.

    Returns:
        The TLS server name (lowercase), the bytes after ``FCTUNNEL `` up to the newline for a
        relay's dial-back (this line *is* consumed), or None for a ClientHello without a name.

    Raises:
        ValueError: the first bytes are neither a ClientHello nor a dial-back, or they did not
            arrive within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ValueError(f"no ClientHello within {timeout:g} s")
        readable, _, _ = select.select([connection], [], [], left)
        if not readable:
            continue
        data = connection.recv(_MAX_RECORD + 5, socket.MSG_PEEK)
        if not data:
            raise ValueError("the connection closed before its ClientHello")
        if data[:1] == TUNNEL_PREFIX[:1]:
            if not TUNNEL_PREFIX.startswith(data[: len(TUNNEL_PREFIX)]):
                raise ValueError("neither TLS nor a dial-back")
            if b"\n" in data:
                line = data[: data.index(b"\n") + 1]
                connection.recv(len(line))  # consume the dial-back line only
                return line[len(TUNNEL_PREFIX) : -1]
            if len(data) > 256:
                raise ValueError("an overlong dial-back line")
        elif len(data) >= 5:
            if data[0] != 0x16:
                raise ValueError("not TLS")
            length = int.from_bytes(data[3:5], "big")
            if length > _MAX_RECORD:
                raise ValueError("an oversized first record")
            if len(data) >= 5 + length:
                return _parse_client_hello(data[: 5 + length])
        time.sleep(0.005)  # wait for more bytes (a peek returns what is there already)


def splice(first: socket.socket, second: socket.socket) -> None:
    """Copies bytes both ways between two connections until both directions end; closes both.

    Each direction runs in its own thread; when one side stops sending, the other side's
    sending half is shut down, so a TLS close travels through.
    """

    def pump(source: socket.socket, target: socket.socket) -> None:
        try:
            while True:
                chunk = source.recv(_PUMP_BYTES)
                if not chunk:
                    break
                target.sendall(chunk)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                target.shutdown(socket.SHUT_WR)

    back = threading.Thread(target=pump, args=(second, first), daemon=True, name="splice")
    back.start()
    try:
        pump(first, second)
        back.join()
    finally:
        first.close()
        second.close()


def _proxy_for(host: str) -> str | None:
    """The HTTPS proxy to reach ``host`` through (``https_proxy``, minus ``no_proxy``)."""
    proxy = os.environ.get("https_proxy") or os.environ.get("HTTPS_PROXY")
    if not proxy:
        return None
    exempt = os.environ.get("no_proxy") or os.environ.get("NO_PROXY") or ""
    for entry in (item.strip().lower() for item in exempt.split(",")):
        if entry and (entry == "*" or host.lower() == entry or host.lower().endswith(f".{entry}")):
            return None
    return proxy


def dial(address: str, *, timeout: float = 10.0) -> socket.socket:
    """Opens a TCP connection to ``host:port``, through the HTTPS proxy when one is set
    (``https_proxy``, honouring ``no_proxy``: HTTP CONNECT, as gRPC does for the run's links).

    Raises:
        TransportError: the address is malformed, or neither it nor the proxy answered.
    """
    host, _, port_text = address.rpartition(":")
    if not host or not port_text.isdigit():
        raise TransportError(f"{address!r} is not a host:port address.")
    host = host.strip("[]")
    proxy = _proxy_for(host)
    try:
        if proxy is None:
            return socket.create_connection((host, int(port_text)), timeout=timeout)
        parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        connection = socket.create_connection(
            (parts.hostname or "", parts.port or 3128), timeout=timeout
        )
    except OSError as exc:
        raise TransportError(f"Cannot connect to {address}: {exc}.") from exc
    try:
        connection.sendall(
            f"CONNECT {host}:{port_text} HTTP/1.1\r\nHost: {host}:{port_text}\r\n\r\n".encode()
        )
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = connection.recv(4096)
            if not chunk or len(answer) > 16_384:
                raise TransportError(f"The proxy {proxy} closed the CONNECT to {address}.")
            answer += chunk
        status_line = answer.split(b"\r\n", 1)[0]
        status = status_line.split()
        if len(status) < 2 or status[1] != b"200":
            raise TransportError(
                f"The proxy {proxy} refused the CONNECT to {address}: "
                f"{status_line.decode('latin-1')}."
            )
    except (OSError, TransportError) as exc:
        connection.close()
        if isinstance(exc, TransportError):
            raise
        raise TransportError(f"Cannot connect to {address} through {proxy}: {exc}.") from exc
    return connection


def forward_to(address: str) -> ConnectionHandler:
    """A handler that splices each connection to the backend at ``address`` (untouched TLS)."""

    def handle(connection: socket.socket) -> None:
        try:
            backend = socket.create_connection(_split(address), timeout=10.0)
        except OSError as exc:
            log.warning("The backend %s is unreachable: %s", address, exc)
            connection.close()
            return
        backend.settimeout(None)
        connection.settimeout(None)
        splice(connection, backend)

    return handle


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass
class _Waiting:
    target: str
    connection: socket.socket
    arrived: threading.Event = field(default_factory=threading.Event)
    back: socket.socket | None = None


class TunnelBroker:
    """Pairs a caller of a party that only dials out with that party's dial-back.

    ``call(target, connection)`` files a request under a fresh 256-bit token, which
    ``requests(owner)`` hands (over the owner's own authenticated channel) to whoever serves
    ``target``; its dial-back sends ``FCTUNNEL <token>`` and is spliced to the caller. A token
    is used once and expires with the wait.

    Args:
        owner_of: who serves a target (e.g. a client's site), None for a target no one serves.
        wait_seconds: how long a caller waits for the dial-back.
    """

    def __init__(
        self, owner_of: Callable[[str], str | None], *, wait_seconds: float = 15.0
    ) -> None:
        self._owner_of = owner_of
        self._wait = wait_seconds
        self._lock = threading.Condition()
        self._pending: dict[str, list[tuple[str, str]]] = {}
        self._waiting: dict[str, _Waiting] = {}
        self.relayed = 0
        """How many connections were relayed."""

    def call(self, target: str, connection: socket.socket) -> None:
        """Relays ``connection`` to ``target``'s dial-back; closes it when none comes in time."""
        owner = self._owner_of(target)
        if owner is None:
            log.warning("Refused a relay to %s, which no site serves.", target)
            connection.close()
            return
        token = secrets.token_hex(32)
        waiting = _Waiting(target, connection)
        with self._lock:
            self._waiting[token] = waiting
            self._pending.setdefault(owner, []).append((token, target))
            self._lock.notify_all()
        arrived = waiting.arrived.wait(self._wait)
        with self._lock:
            self._waiting.pop(token, None)
            entries = self._pending.get(owner, [])
            self._pending[owner] = [entry for entry in entries if entry[0] != token]
        if not arrived or waiting.back is None:
            log.warning("No dial-back from %s for a relay to %s; closed.", owner, target)
            connection.close()
            return
        with self._lock:
            self.relayed += 1
        connection.settimeout(None)
        waiting.back.settimeout(None)
        splice(connection, waiting.back)

    def requests(self, owner: str, timeout: float) -> list[tuple[str, str]]:
        """``(token, target)`` of each relay waiting for ``owner``'s dial-back; waits up to
        ``timeout`` seconds for one."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self._pending.get(owner):
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._lock.wait(left)
            return self._pending.pop(owner)

    def dialed_back(self, token: bytes, connection: socket.socket) -> None:
        """Hands a dial-back to the caller waiting for ``token``; closes a stray one."""
        with self._lock:
            waiting = self._waiting.pop(token.decode("ascii", "replace"), None)
        if waiting is None:
            log.warning("Refused a dial-back with an unknown or expired token.")
            connection.close()
            return
        waiting.back = connection
        waiting.arrived.set()


class SniRouter:
    """Accepts connections on one port and hands each to the handler of the name it asks for.

    Args:
        listen: ``host:port`` to listen on (port 0: any free port).
        route: the handler for a TLS server name, None to refuse the connection.
        broker: where relay dial-backs go (None: refused).
        hello_seconds: how long a connection may take to send its first record.
        on_refused: called with (what it asked for, why) for each refused connection.
        max_connections: how many connections it holds at once (each a thread or two); one
            more is closed at once, refused as ``over its connection limit``.
    """

    def __init__(
        self,
        listen: str,
        route: Callable[[str], ConnectionHandler | None],
        *,
        broker: TunnelBroker | None = None,
        hello_seconds: float = 10.0,
        on_refused: Callable[[str, str], None] | None = None,
        max_connections: int = 4096,
    ) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self._route = route
        self._broker = broker
        self._hello_seconds = hello_seconds
        self._on_refused = on_refused
        host, port = _split(listen)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as exc:
            self._socket.close()
            raise TransportError(f"Cannot listen on {listen}: {exc}.") from exc
        self._socket.listen(512)
        self.port: int = self._socket.getsockname()[1]
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True, name="sni-router")

    def start(self) -> None:
        """Starts accepting in a background thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stops accepting; connections already handed over go on until they end."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()
        self._thread.join(5)

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                connection, peer = self._socket.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self._refuse(connection, peer, "a connection", "over its connection limit")
                continue
            threading.Thread(
                target=self._held, args=(connection, peer), daemon=True, name="sni-conn"
            ).start()

    def _held(self, connection: socket.socket, peer: object) -> None:
        try:
            self._handle(connection, peer)
        finally:
            self._slots.release()

    def _refuse(self, connection: socket.socket, peer: object, asked: str, why: str) -> None:
        log.warning("Refused a connection from %s asking for %s: %s", peer, asked, why)
        if self._on_refused is not None:
            self._on_refused(asked, why)
        connection.close()

    def _handle(self, connection: socket.socket, peer: object) -> None:
        try:
            asked = read_server_name(connection, self._hello_seconds)
        except (ValueError, OSError) as exc:
            self._refuse(connection, peer, "nothing readable", str(exc))
            return
        if isinstance(asked, bytes):
            if self._broker is None:
                self._refuse(connection, peer, "a relay", "this endpoint relays nothing")
                return
            self._broker.dialed_back(asked, connection)
            return
        if asked is None:
            self._refuse(connection, peer, "no name", "its ClientHello names no server")
            return
        handler = self._route(asked)
        if handler is None:
            self._refuse(connection, peer, asked, "no party of this endpoint has that name")
            return
        try:
            handler(connection)
        except Exception:  # one connection's failure never stops the router
            log.exception("The handler for %s failed.", asked)
            connection.close()

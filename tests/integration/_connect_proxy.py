"""An HTTPS (CONNECT) proxy that records every tunnel: where it went and the bytes each way.

Sites set ``https_proxy`` to it, as a site behind a corporate proxy does: everything a site
sends or receives then passes here, so a test can check where the site connects to and what
the wire carries.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass, field


@dataclass
class Tunnel:
    """One CONNECT: its target and the bytes that went up (to the target) and down."""

    target: str
    up: bytearray = field(default_factory=bytearray)
    down: bytearray = field(default_factory=bytearray)


class ConnectProxy:
    """Listens on 127.0.0.1; ``url`` is its ``http://host:port``; ``tunnels`` its records."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.tunnels: list[Tunnel] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def stop(self) -> None:
        self._stopping.set()
        self._listener.close()

    def snapshot(self) -> list[Tunnel]:
        with self._lock:
            return [Tunnel(t.target, bytearray(t.up), bytearray(t.down)) for t in self.tunnels]

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            chunk = connection.recv(4096)
            if not chunk:
                connection.close()
                return
            request += chunk
        head, _, rest = request.partition(b"\r\n\r\n")
        method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        if method != "CONNECT":
            connection.sendall(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
            connection.close()
            return
        host, _, port = target.rpartition(":")
        try:
            upstream = socket.create_connection((host.strip("[]"), int(port)))
        except OSError:
            connection.sendall(b"HTTP/1.1 502 Bad Gateway\r\n\r\n")
            connection.close()
            return
        tunnel = Tunnel(target)
        with self._lock:
            self.tunnels.append(tunnel)
        connection.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if rest:
            tunnel.up += rest
            upstream.sendall(rest)

        def pump(source: socket.socket, sink: socket.socket, record: bytearray) -> None:
            try:
                while chunk := source.recv(65536):
                    with self._lock:
                        record += chunk
                    sink.sendall(chunk)
            except OSError:
                pass
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

        down = threading.Thread(target=pump, args=(upstream, connection, tunnel.down), daemon=True)
        down.start()
        pump(connection, upstream, tunnel.up)
        down.join()
        connection.close()
        upstream.close()

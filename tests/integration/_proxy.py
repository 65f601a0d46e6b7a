"""A TCP relay for one client's link to the server that holds the upload midway.

It forwards both directions byte for byte (TLS stays end to end) until ``stall_after`` bytes
have gone upstream; then it forwards no more upstream bytes and sets ``stalled``, so the server
holds a partial message. ``cut`` then closes every connection, as the kernel does for a
killed process.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class StallingProxy:
    """Relays ``127.0.0.1:<port>`` to ``target`` (set before the first connection).

    Args:
        stall_after: how many client-to-server bytes to forward before holding the rest.
    """

    def __init__(self, stall_after: int) -> None:
        self.stall_after = stall_after
        self.target: tuple[str, int] | None = None
        self.upstream = 0
        self.stalled = threading.Event()
        self._cut = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        """``host:port`` to give the client instead of the server's."""
        return f"127.0.0.1:{self._listener.getsockname()[1]}"

    def _accept(self) -> None:
        while not self._cut.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            assert self.target is not None, "set the target before the client connects"
            server = socket.create_connection(self.target)
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if upstream:
                    with self._lock:
                        room = self.stall_after - self.upstream
                        forward = data[: max(0, room)]
                        self.upstream += len(forward)
                    if forward:
                        sink.sendall(forward)
                    if len(forward) < len(data):
                        self.stalled.set()
                        self._cut.wait()  # read no more from the client: it blocks mid-upload
                        return
                else:
                    sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.close()

    def cut(self) -> None:
        """Closes every connection and the listener."""
        self._cut.set()
        with self._lock:
            sockets = [*self._sockets, self._listener]
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

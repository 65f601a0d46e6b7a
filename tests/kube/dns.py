"""A small cluster DNS server for the fake kubelet's processes: A records from a lookup function.

It answers UDP queries for ``*.cluster.local`` names the way a cluster's DNS does: an A record
(TTL 0, so every dial looks again) when the lookup gives an IPv4 address, NOERROR with no
answer for other record types of an existing name, NXDOMAIN while the lookup says the name
does not exist (yet), SERVFAIL when it cannot tell. Processes reach it by naming it as the
authority of a gRPC target (``dns://127.0.0.1:<port>/<name>:<port>``), which stands in for
the nameserver of a pod's resolv.conf.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
from collections.abc import Callable

LOG = logging.getLogger("fedcore.tests.dns")

TYPE_A = 1
CLASS_IN = 1
NOERROR, SERVFAIL, NXDOMAIN, NOTIMP = 0, 2, 3, 4


class NoSuchName(Exception):
    """The name does not exist (yet): NXDOMAIN."""


def _question(message: bytes) -> tuple[str, int, int, int]:
    """(name, type, class, end offset) of a query's single question; ValueError if malformed."""
    labels: list[str] = []
    offset = 12
    while True:
        length = message[offset]
        if length & 0xC0:
            raise ValueError("a compressed name in a question")
        offset += 1
        if length == 0:
            break
        labels.append(message[offset : offset + length].decode("ascii").lower())
        offset += length
    qtype, qclass = struct.unpack_from("!HH", message, offset)
    return ".".join(labels), qtype, qclass, offset + 4


def answer(query: bytes, lookup: Callable[[str], str]) -> bytes | None:
    """The response to one query (None to drop it, as for a malformed or non-query message).

    ``lookup`` maps a lower-case name without the trailing dot to an IPv4 address, raises
    `NoSuchName` for NXDOMAIN; any other exception answers SERVFAIL.
    """
    if len(query) < 12:
        return None
    ident, flags, qdcount = struct.unpack_from("!HHH", query)
    if flags & 0x8000 or qdcount != 1:
        return None
    try:
        name, qtype, qclass, end = _question(query)
    except (ValueError, IndexError, UnicodeDecodeError, struct.error):
        return None
    records: list[bytes] = []
    opcode = (flags >> 11) & 0xF
    if opcode != 0:
        rcode = NOTIMP
    else:
        try:
            address = lookup(name)
            rcode = NOERROR
            if qtype == TYPE_A and qclass == CLASS_IN:
                # name: a pointer to the question's; TTL 0; 4 bytes of address.
                records.append(
                    struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, 0, 4)
                    + socket.inet_aton(address)
                )
        except NoSuchName:
            rcode = NXDOMAIN
        except Exception:
            LOG.exception("cluster DNS: looking up %s", name)
            rcode = SERVFAIL
    # QR, the opcode, AA, RD as asked, RA; then the rcode.
    reply_flags = 0x8000 | (flags & 0x7800) | 0x0400 | (flags & 0x0100) | 0x0080 | rcode
    header = struct.pack("!HHHHHH", ident, reply_flags, 1, len(records), 0, 0)
    return header + query[12:end] + b"".join(records)


class DnsServer:
    """Serves `answer` on a UDP port of ``host`` (``port``, or a free one) from a thread."""

    def __init__(
        self, lookup: Callable[[str], str], host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self._lookup = lookup
        self.answered: dict[str, str] = {}
        """Each name this server has given an address for, and the last address."""
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind((host, port))
        self._socket.settimeout(0.2)
        self.address = "{}:{}".format(*self._socket.getsockname())
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="cluster-dns", daemon=True)

    def start(self) -> DnsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(2)
        self._socket.close()

    def _record(self, name: str) -> str:
        address = self._lookup(name)
        self.answered[name] = address
        return address

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                query, client = self._socket.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                raise
            reply = answer(query, self._record)
            if reply is not None:
                with contextlib.suppress(OSError):
                    self._socket.sendto(reply, client)

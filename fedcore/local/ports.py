"""Ports for roles that listen on loopback, picked before the role starts.

A port found free by binding port 0 comes from the kernel's ephemeral range, the range every
outgoing connection takes its local port from; in the moment between picking it and the role
binding it, a connection of any process can take it (seen: a client's peer port taken while
eight clients dialled each other and the server). So ports are drawn at random below that
range, checked free, and never handed out twice by one process.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

LOOPBACK = "127.0.0.1"
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10_000
"""The lowest port drawn (well above the registered services most machines run)."""
DEFAULT_EPHEMERAL = (32_768, 60_999)
"""Linux's default ephemeral range, used where the kernel does not say."""

_given: set[int] = set()
_lock = threading.Lock()
_random = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ephemeral ports (Linux's default where it cannot be read)."""
    try:
        low, high = (int(part) for part in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def _candidates() -> range:
    low, high = ephemeral_range()
    if low - LOWEST >= 1_000:
        return range(LOWEST, low)
    return range(high + 1, 65_536)  # an unusual range that starts low: draw above it


def free_port() -> int:
    """Returns a loopback TCP port outside the ephemeral range that is free now and that this
    process has not handed out before.

    Raises:
        OSError: no such port was found in 500 draws.
    """
    candidates = _candidates()
    with _lock:
        for _ in range(500):
            port = _random.choice(candidates)
            if port in _given:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((LOOPBACK, port))
                except OSError:
                    continue
            _given.add(port)
            return port
    raise OSError(f"No free loopback port in {candidates.start}-{candidates.stop - 1}.")


def free_ports(count: int) -> list[int]:
    """Returns ``count`` distinct ports as ``free_port`` does."""
    return [free_port() for _ in range(count)]

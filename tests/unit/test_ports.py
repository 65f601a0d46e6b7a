"""Loopback ports for roles: outside the ephemeral range, free, never handed out twice."""

from __future__ import annotations

import socket

import pytest

from fedcore.local import ports as _ports
from fedcore.local.ports import LOOPBACK, ephemeral_range, free_port, free_ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    # Prepare
    low, _ = ephemeral_range()
    # Execute
    ports = free_ports(200)
    # Assert: none from the range outgoing connections take, none twice, each bindable.
    assert len(set(ports)) == 200
    assert all(1024 <= port < low for port in ports)
    for port in ports[:20]:
        with socket.socket() as sock:
            sock.bind((LOOPBACK, port))


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a window of 20 candidate ports, 10 of them held by listening sockets (as running
    # roles hold them), and nothing handed out yet.
    window = _free_window(20)
    monkeypatch.setattr(_ports, "_candidates", lambda: window)
    monkeypatch.setattr(_ports, "_given", set())
    held = []
    try:
        for port in window[::2]:
            sock = socket.socket()
            sock.bind((LOOPBACK, port))
            sock.listen()
            held.append(sock)
        # Execute
        found = free_ports(10)
        with pytest.raises(OSError, match="No free loopback port"):
            free_port()
    finally:
        for sock in held:
            sock.close()
    # Assert: exactly the ten free ones, each once.
    assert sorted(found) == list(window[1::2])


def _free_window(size: int) -> range:
    """``size`` consecutive ports below the ephemeral range that are all free now."""
    low, _ = ephemeral_range()
    for start in range(20_000, low - size, size):
        window = range(start, start + size)
        try:
            for port in window:
                with socket.socket() as sock:
                    sock.bind((LOOPBACK, port))
        except OSError:
            continue
        return window
    raise AssertionError("no free window of ports")

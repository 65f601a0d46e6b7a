"""A hostile insider with a valid client certificate, against a real run (issue 19, item 2).

Every role is a real process started by ``LocalRun``; the insider uses a certificate of the
run's own PKI (``<workdir>/pki/client-<i>``) and speaks gRPC to the real server.

- Idle streams: before any honest client starts, the insider opens more idle Session streams
  than the server's old worker pool (``2 * count + 8``) held; they used to keep every honest
  client out. Now the insider keeps only its own share (``Limits.calls_per_identity``), the
  rest are refused at once, and the honest clients connect while the share is still held.
- A second session of the same identity: the server keeps one live session per identity, and a
  new one that says hello replaces the old (the documented policy, fedcore/transport/_rpc.py).
  The honest client, whose session was replaced, reconnects and replaces the insider's in turn,
  and the run goes on.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from fedcore.local.runner import LocalRun
from fedcore.observe.events import read_events
from fedcore.spec import load_manifest
from fedcore.transport import Identity, Limits, Payload, RpcClient, TlsBundle
from tests.integration._runs import ServerHold, write_manifest
from tests.integration.test_local_run import wait_for_event

pytestmark = pytest.mark.integration

SESSION = "/fedcore.v1.Server/Session"
WAIT = 120.0
"""Generous bound of every wait: the machine is shared and may be slow."""
SHARE = Limits().calls_per_identity
"""How many calls one identity may hold open on the server."""


class IdleStreams:
    """Session streams that authenticate and then send nothing until closed."""

    def __init__(self, target: str, bundle: TlsBundle, count: int) -> None:
        credentials = grpc.ssl_channel_credentials(bundle.ca_pem, bundle.key_pem, bundle.cert_pem)
        self.channel = grpc.secure_channel(
            target,
            credentials,
            options=[("grpc.ssl_target_name_override", Identity("server").dns_name)],
        )
        self._release = threading.Event()
        self._ended = threading.Semaphore(0)
        self.calls = [self.channel.stream_stream(SESSION)(self._silence()) for _ in range(count)]
        for call in self.calls:
            call.add_done_callback(lambda _: self._ended.release())

    def _silence(self) -> Iterator[bytes]:
        self._release.wait(WAIT * 2)
        return
        yield b""  # a generator that sends nothing

    def wait_ended(self, count: int) -> list[grpc.StatusCode]:
        """Waits (bounded) until ``count`` streams have ended; returns their codes."""
        for _ in range(count):
            assert self._ended.acquire(timeout=WAIT), "an idle stream was never answered"
        return [call.code() for call in self.calls if call.done()]

    def open_count(self) -> int:
        """How many streams the server still holds open."""
        return sum(not call.done() for call in self.calls)

    def close(self) -> None:
        self._release.set()
        for call in self.calls:
            call.cancel()
        self.channel.close()


def events_of(run: LocalRun, kind: str) -> list[dict[str, Any]]:
    return [event for event in read_events(run.events_path, 0)[0] if event["event"] == kind]


def test_idle_streams_of_one_client_do_not_keep_the_others_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: 3 clients; the old pool (2 * 3 + 8 = 14 workers) was full after 14 idle streams.
    # The server holds after round 1 until the insider is done: its rounds take milliseconds,
    # and a run that ended under the attack refused its last streams' connections.
    manifest = write_manifest(
        tmp_path / "run.yaml", rounds=3, clients={"count": 3}, checkpoint={"everyRounds": 0}
    )
    hold = ServerHold(monkeypatch, tmp_path, 1)
    run = LocalRun(load_manifest(manifest), manifest, workdir=tmp_path / "work")
    attack: dict[str, Any] = {}

    def attack_once_ready(event: dict[str, Any]) -> None:
        # Runs when the server is ready; the client processes start beside the server, so
        # client-2's own session may already hold one of its identity's slots.
        if event.get("event") != "ready":
            return
        insider = TlsBundle.load(tmp_path / "work" / "pki" / "client-2")
        idle = IdleStreams(f"127.0.0.1:{event['port']}", insider, 20)
        attack["idle"] = idle
        idle.wait_ended(20 - SHARE)

    # Execute
    try:
        run.start(on_event=attack_once_ready)
        idle: IdleStreams = attack["idle"]
        first = wait_for_event(run, "connected", timeout=WAIT, client=0)
        second = wait_for_event(run, "connected", timeout=WAIT, client=1)
        held_while_honest_connected = idle.open_count()
        refused = [call.code() for call in idle.calls if call.done()]
        why = [
            (i, call.code(), call.details(), call.debug_error_string())
            for i, call in enumerate(idle.calls)
            if call.done() and call.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
        ]
        idle.close()  # the insider stops; its own client process then gets its session
        hold.release()
        result = run.wait()
    finally:
        if "idle" in attack:
            attack["idle"].close()
        run.stop()

    # Assert: the insider got at most its identity's share of calls (less the one its own
    # client process may hold), every other stream was refused at once, and the honest
    # clients connected while it held them
    held = held_while_honest_connected
    assert held in (SHARE - 1, SHARE)
    assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * (20 - held), why
    assert {first["client"], second["client"]} == {0, 1}
    assert result.phase == "Succeeded"
    assert events_of(run, "joined")[0]["clients"] == 3
    # Every refusal is logged with its sender; only client-2 was ever refused (its own client
    # process too, while the insider held its share, until it reconnected)
    server_log = (tmp_path / "work" / "logs" / "server.log").read_text()
    refused = re.findall(r"Refused a Session call from (\S+): (\S+) already has", server_log)
    assert len(refused) >= 20 - SHARE
    assert set(refused) == {("client-2", "client-2")}


def test_a_second_session_of_the_same_client_replaces_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the server holds after round 1, where the insider steps in as client-1
    manifest = write_manifest(
        tmp_path / "run.yaml", rounds=3, clients={"count": 3}, checkpoint={"everyRounds": 0}
    )
    hold = ServerHold(monkeypatch, tmp_path, 1)
    run = LocalRun(load_manifest(manifest), manifest, workdir=tmp_path / "work")
    ended: list[Payload | None] = []
    try:
        run.start()
        ready = wait_for_event(run, "ready", timeout=WAIT)
        wait_for_event(run, "held", timeout=WAIT, round=1)
        insider = TlsBundle.load(tmp_path / "work" / "pki" / "client-1")
        with RpcClient(
            f"127.0.0.1:{ready['port']}", insider, service="Server", limits=Limits()
        ) as client:
            session = client.open_session("Session")
            # Execute: the insider's hello replaces client-1's session; client-1 reconnects and
            # replaces the insider's, which the server then ends
            session.send(Payload(meta={"kind": "hello", "round": 0, "attempt": 0}))
            reader = threading.Thread(target=lambda: ended.append(session.receive()))
            reader.start()
            reader.join(WAIT)
            session.close()
        hold.release()
        result = run.wait()
    finally:
        hold.release()
        run.stop()

    # Assert
    assert ended == [None]  # the insider's session was ended, not failed
    connected = [event["client"] for event in events_of(run, "connected")]
    assert sorted(connected) == [0, 1, 1, 1, 2]  # client-1, the insider, client-1 again
    assert result.phase == "Succeeded"
    server_log = (tmp_path / "work" / "logs" / "server.log").read_text()
    assert server_log.count("A new Session session of client-1 replaces its previous one") == 2

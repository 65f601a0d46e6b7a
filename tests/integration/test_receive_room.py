"""A server's room for large session messages (``Limits.receive_bytes``): real gRPC servers on
127.0.0.1 with mutual TLS; the server's memory is measured in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedcore.transport import (
    Identity,
    Limits,
    Payload,
    RpcClient,
    RpcServer,
    ServerSession,
    SessionHandler,
    TlsBundle,
    decode_chunks,
    encode_chunks,
    issue_run_bundles,
)

pytestmark = pytest.mark.integration

SERVICE = "Test"
SESSION = f"/fedcore.v1.{SERVICE}/Session"
TIMEOUT = 60.0
MiB = 1 << 20


class HoldingSessions(SessionHandler):
    """Answers each message with its checksum after holding it ``hold`` seconds, and records
    how many large messages it held at once and the server's room at each."""

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.server: RpcServer | None = None
        self._lock = threading.Lock()
        self.inside = 0
        self.most_inside = 0
        self.room_seen: list[int] = []

    def opened(self, session: ServerSession) -> None:
        pass

    def received(self, session: ServerSession, message: Payload) -> None:
        with self._lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
            assert self.server is not None
            self.room_seen.append(self.server.room.in_use)
        try:
            time.sleep(self.hold)
            total = float(
                sum(float(array.sum(dtype=np.float64)) for array in message.tensors.values())
            )
            session.send(Payload(meta={"sum": total, **message.meta}))
        finally:
            with self._lock:
                self.inside -= 1

    def closed(self, session: ServerSession) -> None:
        pass


@pytest.fixture(scope="module")
def bundles() -> dict[str, TlsBundle]:
    return issue_run_bundles("room", num_clients=4)[1]


def _server(
    bundles: dict[str, TlsBundle],
    limits: Limits,
    handler: SessionHandler,
    on_rejected: Callable[[str, str, str | None], None] | None = None,
) -> RpcServer:
    server = RpcServer(
        "127.0.0.1:0",
        bundles["server"],
        {},
        service=SERVICE,
        limits=limits,
        sessions={"Session": handler},
        max_workers=limits.workers(4),
        on_rejected=on_rejected,
    )
    server.start()
    return server


def _counting_server(
    bundles: dict[str, TlsBundle], limits: Limits
) -> tuple[RpcServer, list[tuple[str, str, str | None]]]:
    """A server whose sessions answer at once, and the refusals it counts (method, reason,
    sender)."""
    rejected: list[tuple[str, str, str | None]] = []
    handler = HoldingSessions(hold=0.0)
    server = _server(
        bundles,
        limits,
        handler,
        on_rejected=lambda method, reason, sender: rejected.append((method, reason, sender)),
    )
    handler.server = server
    return server, rejected


def _send_all(
    bundles: dict[str, TlsBundle], port: int, limits: Limits, messages: dict[int, list[Payload]]
) -> dict[int, list[Payload | None]]:
    """Each client index sends its messages on a session of its own, all clients at once;
    returns each client's replies."""
    replies: dict[int, list[Payload | None]] = {}
    errors: list[BaseException] = []

    def one(index: int) -> None:
        client = RpcClient(
            f"127.0.0.1:{port}",
            bundles[f"client-{index}"],
            service=SERVICE,
            limits=limits,
            peer=Identity("server"),
        )
        session = client.open_session("Session")
        try:
            for message in messages[index]:
                session.send(message)
            replies[index] = [session.receive() for _ in messages[index]]
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            session.close()
            client.close()

    threads = [threading.Thread(target=one, args=(index,)) for index in messages]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not errors, errors
    return replies


def _message(index: int, number: int, elements: int) -> Payload:
    values = np.arange(elements, dtype=np.float32) * np.float32(index + 1) + np.float32(number)
    return Payload(meta={"client": index, "number": number}, tensors={"w": values})


def _expected_sum(message: Payload) -> float:
    return float(message.tensors["w"].sum(dtype=np.float64))


@pytest.mark.parametrize(
    ("room", "elements", "most_at_once"),
    [
        (3 * MiB, (3 * MiB) // 8, 2),  # 1.5 MiB messages: two fit
        (3 * MiB, MiB // 2, 1),  # 2 MiB messages: one at a time
        (MiB + MiB // 2, MiB // 2, 1),  # a message larger than the room is let in alone
    ],
)
def test_room_bounds_the_large_messages_a_server_holds_at_once(
    bundles: dict[str, TlsBundle], room: int, elements: int, most_at_once: int
) -> None:
    # Prepare: four clients send two large messages each at once; the handler holds each
    limits = Limits(chunk_bytes=256 << 10, max_message_bytes=32 * MiB, receive_bytes=room)
    handler = HoldingSessions(hold=0.15)
    server = _server(bundles, limits, handler)
    handler.server = server
    messages = {i: [_message(i, n, elements) for n in range(2)] for i in range(4)}
    try:
        # Execute
        replies = _send_all(bundles, server.port, limits, messages)
    finally:
        server.stop(grace=1.0)

    # Assert: every message arrived whole; never more room taken than allowed
    for index, sent in messages.items():
        got = replies[index]
        assert [reply.meta["number"] if reply else None for reply in got] == [0, 1]
        assert [reply.meta["sum"] if reply else None for reply in got] == [
            _expected_sum(message) for message in sent
        ]
    body = elements * 4
    assert handler.most_inside == most_at_once
    assert server.room.peak == most_at_once * body
    assert max(handler.room_seen) <= max(room, body)
    assert server.room.in_use == 0 and server.room.waiting == 0


def test_small_messages_do_not_take_room(bundles: dict[str, TlsBundle]) -> None:
    # Prepare: a room of one byte; messages of 64 KiB are under the large-message size
    limits = Limits(chunk_bytes=256 << 10, max_message_bytes=32 * MiB, receive_bytes=1)
    handler = HoldingSessions(hold=0.05)
    server = _server(bundles, limits, handler)
    handler.server = server
    messages = {i: [_message(i, 0, 16 << 10)] for i in range(4)}
    try:
        replies = _send_all(bundles, server.port, limits, messages)
    finally:
        server.stop(grace=1.0)
    assert all(replies[i][0] is not None for i in messages)
    assert server.room.peak == 0


def test_a_stalled_message_loses_the_room_others_wait_for(bundles: dict[str, TlsBundle]) -> None:
    # Prepare: client-0 announces a 4 MiB message, sends its first chunk and stops; client-1's
    # 2 MiB message then waits for the room, until client-0 has been silent for stall_seconds.
    limits = Limits(
        chunk_bytes=256 << 10,
        max_message_bytes=32 * MiB,
        receive_bytes=4 * MiB,
        stall_seconds=1.0,
    )
    server, rejected = _counting_server(bundles, limits)
    stalled = _message(0, 0, MiB)
    first_chunk = next(iter(encode_chunks(stalled, chunk_bytes=256 << 10)))
    release = threading.Event()

    def chunks() -> Iterator[bytes]:
        yield first_chunk
        release.wait(TIMEOUT)  # silent, the stream still open

    bundle = bundles["client-0"]
    channel = grpc.secure_channel(
        f"127.0.0.1:{server.port}",
        grpc.ssl_channel_credentials(bundle.ca_pem, bundle.key_pem, bundle.cert_pem),
        options=[("grpc.ssl_target_name_override", "server.fedcore.invalid")],
    )
    outcome: dict[str, grpc.StatusCode] = {}

    def stall() -> None:
        try:
            list(channel.stream_stream(SESSION)(chunks(), timeout=TIMEOUT))
        except grpc.RpcError as exc:
            outcome["code"] = exc.code()

    staller = threading.Thread(target=stall)
    try:
        staller.start()
        deadline = time.monotonic() + TIMEOUT
        while server.room.in_use == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.room.in_use == 4 * MiB  # the stalled message holds the whole room
        waiting = _message(1, 0, MiB // 2)

        # Execute
        started = time.monotonic()
        replies = _send_all(bundles, server.port, limits, {1: [waiting]})
        waited = time.monotonic() - started
    finally:
        release.set()
        staller.join(TIMEOUT)
        channel.close()
        server.stop(grace=1.0)

    # Assert: the stalled session was ended and counted with its sender; the other went on
    assert outcome.get("code") == grpc.StatusCode.DEADLINE_EXCEEDED
    assert ("Session", "refused", "client-0") in rejected
    reply = replies[1][0]
    assert reply is not None and reply.meta["sum"] == _expected_sum(waiting)
    assert waited >= 0.5  # it did wait for the room (about stall_seconds), not around it
    assert server.room.in_use == 0


class _Trickle:
    """Client-0 sends ``message`` over a raw gRPC session in ``chunk`` byte pieces, one every
    ``every`` seconds (never silent for stall_seconds), and reads the server's reply."""

    def __init__(
        self, bundles: dict[str, TlsBundle], port: int, message: Payload, chunk: int, every: float
    ) -> None:
        self.pieces = list(encode_chunks(message, chunk_bytes=chunk))
        self.every = every
        self.sent = 0
        self.code: grpc.StatusCode | None = None
        self.reply: Payload | None = None
        self._stop = threading.Event()
        bundle = bundles["client-0"]
        self._channel = grpc.secure_channel(
            f"127.0.0.1:{port}",
            grpc.ssl_channel_credentials(bundle.ca_pem, bundle.key_pem, bundle.cert_pem),
            options=[("grpc.ssl_target_name_override", "server.fedcore.invalid")],
        )
        self._thread = threading.Thread(target=self._run)

    def _chunks(self) -> Iterator[bytes]:
        for piece in self.pieces:
            yield piece
            self.sent += 1
            if self._stop.wait(self.every):
                return
        self._stop.wait(TIMEOUT)  # all sent: the stream stays open for the reply

    def _run(self) -> None:
        try:
            for answer in self._channel.stream_stream(SESSION)(self._chunks(), timeout=TIMEOUT):
                self.reply = decode_chunks([answer], max_message_bytes=MiB)
                self._stop.set()
        except grpc.RpcError as exc:
            self.code = exc.code()

    def __enter__(self) -> _Trickle:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT)
        self._channel.close()


TRICKLE_LIMITS = Limits(
    chunk_bytes=64 << 10,
    max_message_bytes=32 * MiB,
    receive_bytes=4 * MiB,
    stall_seconds=1.0,
    min_receive_rate=MiB,
)
"""A chunk of 64 KiB every 0.1 s is 640 KiB/s: never silent for stall_seconds, but below
min_receive_rate."""


def test_a_trickling_message_loses_the_room_others_wait_for(
    bundles: dict[str, TlsBundle],
) -> None:
    # Prepare: client-0 trickles a 4 MiB message (6.4 s at its pace) holding the whole room;
    # client-1's message waits for that room.
    server, rejected = _counting_server(bundles, TRICKLE_LIMITS)
    trickled = _message(0, 0, MiB)
    try:
        with _Trickle(bundles, server.port, trickled, 64 << 10, 0.1) as trickle:
            deadline = time.monotonic() + TIMEOUT
            while server.room.in_use == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.room.in_use == 4 * MiB  # the trickle holds the whole room
            waiting = _message(1, 0, MiB // 2)

            # Execute
            replies = _send_all(bundles, server.port, TRICKLE_LIMITS, {1: [waiting]})
    finally:
        server.stop(grace=1.0)

    # Assert: the trickle was ended before it had sent its message, and counted with its
    # sender; the waiting message was received whole
    assert trickle.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert trickle.reply is None and trickle.sent < len(trickle.pieces)
    assert ("Session", "refused", "client-0") in rejected
    reply = replies[1][0]
    assert reply is not None and reply.meta["sum"] == _expected_sum(waiting)
    assert server.room.in_use == 0


def test_a_slow_message_alone_keeps_the_room(bundles: dict[str, TlsBundle]) -> None:
    # Prepare: the same pace below min_receive_rate, but nobody waits for the room
    handler = HoldingSessions(hold=0.0)
    server = _server(bundles, TRICKLE_LIMITS, handler)
    handler.server = server
    slow = _message(0, 0, 3 * MiB // 8)  # 1.5 MiB: about 2.4 s at 640 KiB/s

    # Execute
    try:
        with _Trickle(bundles, server.port, slow, 64 << 10, 0.1) as trickle:
            deadline = time.monotonic() + TIMEOUT
            while trickle.reply is None and trickle.code is None and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        server.stop(grace=1.0)

    # Assert: received whole, the session not ended
    assert trickle.code is None
    assert trickle.sent == len(trickle.pieces)
    assert trickle.reply is not None and trickle.reply.meta["sum"] == _expected_sum(slow)


class RecordingSessions(SessionHandler):
    """Answers each message with its checksum; records where its tensor's bytes were, and,
    with ``keep``, keeps every message (its arrays view the bytes it arrived in)."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.kept: list[Payload] = []
        self.addresses: list[int] = []

    def opened(self, session: ServerSession) -> None:
        pass

    def received(self, session: ServerSession, message: Payload) -> None:
        self.addresses.append(message.tensors["w"].ctypes.data)
        if self.keep:
            self.kept.append(message)
        session.send(Payload(meta={"sum": _expected_sum(message), **message.meta}))

    def closed(self, session: ServerSession) -> None:
        pass


@pytest.mark.parametrize("keep", [False, True])
def test_a_large_message_lands_in_the_bytes_of_one_nothing_views(
    bundles: dict[str, TlsBundle], keep: bool
) -> None:
    # Prepare: a client sends two 8 MiB messages of one size, one after the other; the
    # handler lets go of each (or keeps them)
    limits = Limits(max_message_bytes=32 * MiB)
    handler = RecordingSessions(keep=keep)
    server = _server(bundles, limits, handler)
    messages = [_message(0, number, 2 * MiB) for number in range(2)]

    # Execute
    try:
        replies = _send_all(bundles, server.port, limits, {0: messages})
    finally:
        server.stop(grace=1.0)

    # Assert: both arrived exact; the second landed in the first's bytes, unless the first
    # was kept: then it has bytes of its own and the first is intact
    sums = [reply.meta["sum"] if reply is not None else None for reply in replies[0]]
    assert sums == [_expected_sum(message) for message in messages]
    first, second = handler.addresses
    if keep:
        assert second != first
        for message, kept in zip(messages, handler.kept, strict=True):
            np.testing.assert_array_equal(kept.tensors["w"], message.tensors["w"])
    else:
        assert second == first


SERVER_SCRIPT = textwrap.dedent(
    """
    import sys, time, json, pathlib
    import numpy as np
    from fedcore.transport import Limits, RpcServer, SessionHandler, Payload, TlsBundle

    folder = pathlib.Path(sys.argv[1])
    room = int(sys.argv[2])
    bundle = TlsBundle.load(folder / "server")

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    class Hold(SessionHandler):
        def opened(self, session): pass
        def closed(self, session): pass
        def received(self, session, message):
            time.sleep(0.3)
            total = float(sum(float(a.sum(dtype=np.float64)) for a in message.tensors.values()))
            session.send(Payload(meta={"sum": total, "hwm": hwm()}))

    limits = Limits(max_message_bytes=256 << 20, receive_bytes=room)
    server = RpcServer("127.0.0.1:0", bundle, {}, service="Test", limits=limits,
                       sessions={"Session": Hold()}, max_workers=limits.workers(4))
    server.start()
    print(json.dumps({"port": server.port, "hwm": hwm()}), flush=True)
    sys.stdin.read()
    server.stop(grace=1.0)
    """
)


def _grown_by_four_uploads(bundles: dict[str, TlsBundle], folder: Path, room: int) -> int:
    """Four clients send a 48 MiB message each at once to a server in a process of its own
    whose room is ``room``; returns how much the server's peak resident memory grew."""
    elements = 12 * MiB  # 48 MiB of float32
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT, str(folder), str(room)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    try:
        assert process.stdout is not None
        started = json.loads(process.stdout.readline())
        limits = Limits(max_message_bytes=256 << 20)
        messages = {i: [_message(i, 0, elements)] for i in range(4)}
        replies = _send_all(bundles, started["port"], limits, messages)
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(TIMEOUT)
    answers = [replies[i][0] for i in messages]
    assert [a.meta["sum"] if a else None for a in answers] == [
        _expected_sum(messages[i][0]) for i in messages
    ]
    return int(max(a.meta["hwm"] for a in answers if a is not None) - started["hwm"])


def test_a_server_holds_one_large_upload_at_a_time_whatever_the_clients(
    bundles: dict[str, TlsBundle], tmp_path: Path
) -> None:
    """With a room of 64 MiB a server receiving four 48 MiB uploads at once grows by about one
    upload and what each waiting sender's HTTP/2 window holds; with a room for all four
    (1 GiB) it grows by the four, side by side in one test."""
    for name in ("server", "client-0", "client-1", "client-2", "client-3"):
        bundles[name].write(tmp_path / name)
    message_bytes = 48 * MiB
    bounded = _grown_by_four_uploads(bundles, tmp_path, 64 * MiB)
    unbounded = _grown_by_four_uploads(bundles, tmp_path, 1 << 30)
    # Measured: 150-195 MiB with the room (about 80 MiB for one upload alone: the message, a
    # chunk in gRPC's buffers and one in the decoder, TLS and threads; each waiting sender
    # about 20-30 MiB: its 8 MiB window, its first chunk, TLS records), 250-270 MiB without.
    assert unbounded >= 4 * message_bytes, f"without the room: {unbounded / MiB:.0f} MiB"
    assert bounded < message_bytes + 32 * MiB + 3 * 40 * MiB, f"{bounded / MiB:.0f} MiB"
    assert unbounded - bounded >= message_bytes, (bounded / MiB, unbounded / MiB)

"""Clients that share a process and a ``Turn`` (a client group): one of them at a time holds a
large task's bytes, and each task lands in the bytes of the one before. A real gRPC server on
127.0.0.1 with mutual TLS sends the tasks; the clients run in a process of their own, whose
peak resident memory is measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from fedcore.transport import (
    Limits,
    Payload,
    RpcServer,
    ServerSession,
    SessionHandler,
    TlsBundle,
    issue_run_bundles,
)

pytestmark = pytest.mark.integration

MiB = 1 << 20
CLIENTS = 4
ROUNDS = 2
TASK_ELEMENTS = 24 * MiB  # 96 MiB of float32: the bound stands well clear of the noise
TIMEOUT = 120.0
LIMITS = Limits(max_message_bytes=256 * MiB)


def _task(round_: int) -> Payload:
    """Round ``round_``'s task, the same layout every round: two tensors, 96 MiB in all."""
    weights = np.arange(TASK_ELEMENTS - 1024, dtype=np.float32) * np.float32(1e-6)
    bias = np.full(1024, round_, dtype=np.float32)
    return Payload(
        meta={"kind": "task", "round": round_}, tensors={"w": weights + round_, "b": bias}
    )


def _expected_sum(round_: int) -> float:
    """What a client's upload must sum to: its task, trained (doubled)."""
    return 2.0 * sum(float(a.sum(dtype=np.float64)) for a in _task(round_).tensors.values())


class Rounds(SessionHandler):
    """Sends every client round 1's task when it says hello and the next round's when its
    upload arrives; records each upload's sum."""

    def __init__(self) -> None:
        self.tasks = {round_: _task(round_) for round_ in range(1, ROUNDS + 1)}
        self.sums: dict[tuple[str, int], float] = {}
        self._lock = threading.Lock()

    def opened(self, session: ServerSession) -> None:
        pass

    def received(self, session: ServerSession, message: Payload) -> None:
        kind = message.meta["kind"]
        if kind == "hello":
            session.send(self.tasks[1])
            return
        round_ = int(message.meta["round"])
        total = sum(float(a.sum(dtype=np.float64)) for a in message.tensors.values())
        with self._lock:
            self.sums[(session.peer.common_name, round_)] = total
        if round_ < ROUNDS:
            session.send(self.tasks[round_ + 1])
        else:
            session.send(Payload(meta={"kind": "done"}))

    def closed(self, session: ServerSession) -> None:
        pass


CLIENTS_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, pathlib, sys
    import numpy as np
    from fedcore.transport import AsyncRpcClient, Identity, Limits, Payload, TlsBundle, Turn

    folder, port, shared = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "shared"
    limits = Limits(max_message_bytes=256 << 20)

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    async def client(index, turn, addresses):
        link = AsyncRpcClient(f"127.0.0.1:{port}", TlsBundle.load(folder / f"client-{index}"),
                              service="Test", limits=limits, peer=Identity("server"))
        session = link.open_session("Session", turn=turn)
        await session.send(Payload(meta={"kind": "hello"}))
        done_with_bytes = False
        while True:
            session.answered(done_with_bytes=done_with_bytes)
            message = await session.receive()
            if message is None or message.meta["kind"] == "done":
                break
            tensors = message.tensors
            for array in tensors.values():
                array *= 2  # trains in the task's bytes
            addresses.append(tensors["w"].ctypes.data)
            await asyncio.sleep(0.05)
            await session.send(Payload(meta={"kind": "upload", "round": message.meta["round"]},
                                       tensors=tensors))
            done_with_bytes = True  # the upload is out: nothing reads the bytes any more
            del message, tensors
        session.close()
        await link.close()

    async def main():
        before = rss("VmRSS:")
        shared_turn = Turn()
        addresses = {i: [] for i in range(4)}
        await asyncio.gather(*(
            client(i, shared_turn if shared else Turn(), addresses[i]) for i in range(4)
        ))
        print(json.dumps({"grown": rss("VmHWM:") - before, "addresses": addresses}))

    asyncio.run(main())
    """
)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, TlsBundle], Path]:
    folder = tmp_path_factory.mktemp("turn")
    issued = issue_run_bundles("turn", num_clients=CLIENTS)[1]
    for index in range(CLIENTS):
        issued[f"client-{index}"].write(folder / f"client-{index}")
    return issued, folder


def _run_clients(bundles: tuple[dict[str, TlsBundle], Path], shared: bool) -> dict:
    """Four clients in one process, with one shared Turn or a Turn each, against a server
    that sends each of them two 96 MiB tasks; returns the process's growth and where each
    task's weights were."""
    issued, folder = bundles
    handler = Rounds()
    server = RpcServer(
        "127.0.0.1:0",
        issued["server"],
        {},
        service="Test",
        limits=LIMITS,
        sessions={"Session": handler},
        max_workers=LIMITS.workers(CLIENTS),
    )
    server.start()
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                CLIENTS_SCRIPT,
                str(folder),
                str(server.port),
                "shared" if shared else "own",
            ],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )
    finally:
        server.stop(grace=1.0)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # Every upload is its task trained, exactly: no task landed in bytes still being sent
    assert handler.sums == {
        (f"client-{i}", round_): _expected_sum(round_)
        for i in range(CLIENTS)
        for round_ in range(1, ROUNDS + 1)
    }
    return result


def test_clients_sharing_a_turn_hold_one_large_task_at_a_time_in_one_buffer(
    bundles: tuple[dict[str, TlsBundle], Path],
) -> None:
    message_bytes = 4 * TASK_ELEMENTS
    shared = _run_clients(bundles, shared=True)
    alone = _run_clients(bundles, shared=False)

    # Assert: with a shared turn, every task of every client landed in one buffer (the first
    # task's bytes); with a turn each, each client reuses its own (four buffers)
    addresses = shared["addresses"]
    assert {len(found) for found in addresses.values()} == {ROUNDS}
    assert len({address for found in addresses.values() for address in found}) == 1
    own = alone["addresses"]
    assert all(len(set(found)) == 1 for found in own.values())
    assert len({found[0] for found in own.values()}) == CLIENTS
    # ... and the process grew by less than two tasks and what the three waiting sessions
    # hold (a first chunk and an 8 MiB window each), against the four tasks at once with a
    # turn each. Measured: 225-270 MiB shared, 530-550 MiB with a turn each (the rest is the
    # uploads' 4 MiB chunks on their way out, and the heap they leave).
    grown, apart = shared["grown"], alone["grown"]
    assert apart >= CLIENTS * message_bytes, f"a turn each: {apart / MiB:.0f} MiB"
    assert grown < 2 * message_bytes + 3 * 40 * MiB, f"shared: {grown / MiB:.0f} MiB"
    assert apart - grown >= 2 * message_bytes, (grown / MiB, apart / MiB)

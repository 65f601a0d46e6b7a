"""The CPU of one model exchange per client and round, by transport stack.

A round of the digits job with K clients moves, per client, one task (the model, 38 KB) from
the server and one upload of the same size back, each on that client's own mutual-TLS
connection. Those costs are per message, not per byte, and with many clients on a 2-core
machine they are most of what a round costs beyond training (docs/benchmarks.md, "Start-up,
memory per role and many clients"). This benchmark measures them alone, with no training,
checks or averaging: a server process and one client process holding K connections on one
event loop (as a group of clients does), R rounds of "the server sends every connection the
model, every client answers with an upload of the same size", on four stacks:

* **raw TCP**: asyncio streams, a 4-byte length before each message (no TLS);
* **raw TLS**: the same over mutual TLS with the run's certificates (each connection its own);
* **raw gRPC + mTLS**: ``grpc.aio``, one bidirectional stream per connection, the encoded
  message as one bytes message each way (what gRPC itself costs);
* **fedcore sessions**: ``RpcServer`` with a ``SessionHandler`` and ``AsyncRpcClient``
  sessions, Payloads encoded and decoded by fedcore's codec (what a round's transport costs).

It reports CPU (user + system, both processes, every thread, read from /proc between the
first and the last measured round) per exchange, split by process, and the median round.

Run: ``python -m benchmarks.exchange [--clients 50] [--rounds 200] [--repeats 3] [--write]``
(``--write`` replaces the exchange section of docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.limits import client_tls_context, server_tls_context  # noqa: E402
from benchmarks.measure import load, machine, process_cpu_seconds  # noqa: E402
from benchmarks.spine import publish  # noqa: E402

BEGIN = "<!-- exchange:begin -->"
END = "<!-- exchange:end -->"
UNTUNED = "fedcore sessions, glibc's default thresholds"
"""fedcore's sessions in processes that leave the C allocator as it comes (what role processes
did before ``fedcore.local.allocator``); every other side's processes settle it as a role's."""
SIDES = ("raw TCP", "raw TLS", "raw gRPC + mTLS", "fedcore sessions", UNTUNED)
WARM_ROUNDS = 20
SERVER_NAME = "server.fedcore.invalid"
"""The server certificate's DNS name (``Identity("server").dns_name``)."""


def digits_model() -> dict[str, np.ndarray]:
    """The digits MLP's tensors (64-128-10, float32): the quickstart's model, 38 KB."""
    rng = np.random.default_rng(0)
    shapes = {"0.weight": (128, 64), "0.bias": (128,), "2.weight": (10, 128), "2.bias": (10,)}
    return {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}


def _payload(round_index: int) -> Any:
    from fedcore.transport import Payload

    return Payload(meta={"round": round_index, "num_examples": 1}, tensors=digits_model())


_PSI: dict[int, dict[str, np.ndarray]] = {}
"""The answer's tensor per size, made once per process: a client computes its upload anyway;
what is measured is the transport."""


def _upload(round_index: int, tensors: dict[str, np.ndarray], upload_bytes: int | None) -> Any:
    """A client's answer: the task's own tensors (``upload_bytes`` None: an upload the size of
    the model, as fedavg's), or one float64 tensor of ``upload_bytes`` (as mpdp's Psi)."""
    from fedcore.transport import Payload

    if upload_bytes is not None:
        if upload_bytes not in _PSI:
            _PSI[upload_bytes] = {"psi": np.ones(upload_bytes // 8)}
        tensors = _PSI[upload_bytes]
    return Payload(meta={"round": round_index, "num_examples": 1}, tensors=tensors)


def _encoded(payload: Any = None) -> bytes:
    """A message as fedcore encodes it (what the raw sides carry); the task by default."""
    from fedcore.transport import Limits, encode_chunks

    payload = _payload(1) if payload is None else payload
    return b"".join(encode_chunks(payload, chunk_bytes=Limits().chunk_bytes))


def _answer(upload_bytes: int | None) -> bytes:
    """The raw sides' encoded answer."""
    return _encoded(_upload(1, digits_model(), upload_bytes))


# ---------------------------------------------------------------------------- the server


class _Rounds:
    """The server's side of the measurement: waits for K connections, then runs rounds of
    ``send_all`` and K answers, telling the parent when the measured rounds start and end."""

    def __init__(self, clients: int, rounds: int, conn: Connection) -> None:
        self.clients = clients
        self.rounds = rounds
        self.conn = conn
        self.times: list[float] = []

    def checkpoint(self, what: str) -> None:
        """Tells the parent (which reads both processes' CPU) and waits for its go."""
        self.conn.send(what)
        self.conn.recv()


async def _serve_streams(tls: bool, bundles: dict[str, Any], folder: Path, run: _Rounds) -> None:
    message = _encoded()
    frame = len(message).to_bytes(4, "little") + message
    answers: asyncio.Queue[int] = asyncio.Queue()
    writers: list[asyncio.StreamWriter] = []
    connected = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        if len(writers) == run.clients:
            connected.set()
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(4), "little")
                await reader.readexactly(size)
                answers.put_nowait(size)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            ended.release()

    ended = asyncio.Semaphore(0)
    context = server_tls_context(folder, bundles["server"]) if tls else None
    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    run.conn.send(server.sockets[0].getsockname()[1])
    await connected.wait()

    async def one_round() -> None:
        for writer in writers:
            writer.write(frame)
        for writer in writers:
            await writer.drain()
        for _ in range(run.clients):
            await answers.get()

    await _rounds(run, one_round)
    for writer in writers:
        writer.close()
    for _ in writers:  # every client saw the end and closed its side: no reader is cut off
        await asyncio.wait_for(ended.acquire(), 30)
    server.close()


async def _rounds(run: _Rounds, one_round: Callable[[], Any]) -> None:
    for index in range(WARM_ROUNDS + run.rounds):
        if index == WARM_ROUNDS:
            run.checkpoint("start")
        started = time.perf_counter()
        await one_round()
        if index >= WARM_ROUNDS:
            run.times.append(time.perf_counter() - started)
    run.checkpoint("done")


async def _serve_grpc(bundles: dict[str, Any], run: _Rounds) -> None:
    import grpc

    from fedcore.transport import Limits

    message = _encoded()
    answers: asyncio.Queue[int] = asyncio.Queue()
    calls: list[Any] = []
    connected = asyncio.Event()
    finished = asyncio.Event()

    async def session(requests: Any, context: Any) -> None:
        calls.append(context)
        if len(calls) == run.clients:
            connected.set()

        async def read() -> None:
            async for request in requests:
                answers.put_nowait(len(request))

        reader = asyncio.ensure_future(read())
        await finished.wait()
        reader.cancel()

    server = grpc.aio.server(options=Limits().channel_options())
    handler = grpc.method_handlers_generic_handler(
        "bench.Exchange", {"Session": grpc.stream_stream_rpc_method_handler(session)}
    )
    server.add_generic_rpc_handlers((handler,))
    bundle = bundles["server"]
    credentials = grpc.ssl_server_credentials(
        [(bundle.key_pem, bundle.cert_pem)],
        root_certificates=bundle.ca_pem,
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    run.conn.send(port)
    await connected.wait()

    async def one_round() -> None:
        await asyncio.gather(*(context.write(message) for context in calls))
        for _ in range(run.clients):
            await answers.get()

    await _rounds(run, one_round)
    finished.set()
    await server.stop(1)


def _serve_fedcore(bundles: dict[str, Any], run: _Rounds) -> None:
    from fedcore.transport import Limits, RpcServer, ServerSession, SessionHandler

    answers = threading.Semaphore(0)
    sessions: list[Any] = []
    connected = threading.Event()

    class Sessions(SessionHandler):
        def opened(self, session: Any) -> None:
            sessions.append(session)

        def received(self, session: Any, message: Any) -> None:
            if message.meta.get("hello"):
                if len(sessions) == run.clients:
                    connected.set()
                return
            answers.release()

        def closed(self, session: Any) -> None:
            pass

    server = RpcServer(
        "127.0.0.1:0",
        bundles["server"],
        {},
        service="Bench",
        limits=Limits(),
        sessions={"Session": Sessions()},
    )
    server.start()
    run.conn.send(server.port)
    connected.wait()
    for index in range(WARM_ROUNDS + run.rounds):
        if index == WARM_ROUNDS:
            run.checkpoint("start")
        started = time.perf_counter()
        task = _payload(index)  # one task per round, sent to every session (encoded once)
        ServerSession.send_all([(session, task) for session in sessions])  # as a server does
        for _ in range(run.clients):
            answers.acquire()
        if index >= WARM_ROUNDS:
            run.times.append(time.perf_counter() - started)
    run.checkpoint("done")
    for session in sessions:
        session.close()
    server.stop(grace=1)


def _server_main(
    side: str, bundles: dict[str, Any], rounds: int, folder: str, conn: Connection
) -> None:
    _settle(side)
    clients = _client_count(bundles)
    run = _Rounds(clients, rounds, conn)
    if side in ("raw TCP", "raw TLS"):
        asyncio.run(_serve_streams(side == "raw TLS", bundles, Path(folder), run))
    elif side == "raw gRPC + mTLS":
        asyncio.run(_serve_grpc(bundles, run))
    else:
        _serve_fedcore(bundles, run)
    conn.send(run.times)


def _settle(side: str) -> None:
    """A process's allocator, as a role process settles it (but for ``UNTUNED``)."""
    from fedcore.local.allocator import tune_allocator

    if side != UNTUNED:
        tune_allocator()


# ---------------------------------------------------------------------------- the clients


async def _client_streams(
    tls: bool, bundles: dict[str, Any], folder: Path, port: int, upload_bytes: int | None
) -> None:
    clients = _client_count(bundles)
    message = _answer(upload_bytes)
    frame = len(message).to_bytes(4, "little") + message

    async def one(index: int) -> None:
        context = (
            client_tls_context(folder, bundles[f"client-{index}"], f"client-{index}")
            if tls
            else None
        )
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname=SERVER_NAME if tls else None
        )
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(4), "little")
                await reader.readexactly(size)
                writer.write(frame)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    await asyncio.gather(*(one(index) for index in range(clients)))


async def _client_grpc(bundles: dict[str, Any], port: int, upload_bytes: int | None) -> None:
    import grpc

    from fedcore.transport import Limits

    clients = _client_count(bundles)
    message = _answer(upload_bytes)

    async def one(index: int) -> None:
        bundle = bundles[f"client-{index}"]
        credentials = grpc.ssl_channel_credentials(
            root_certificates=bundle.ca_pem,
            private_key=bundle.key_pem,
            certificate_chain=bundle.cert_pem,
        )
        options = [*Limits().channel_options(), ("grpc.ssl_target_name_override", SERVER_NAME)]
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options) as channel:
            call = channel.stream_stream("/bench.Exchange/Session")()
            try:
                while True:
                    got = await call.read()
                    if got is grpc.aio.EOF:
                        break
                    await call.write(message)
            except (grpc.RpcError, asyncio.InvalidStateError):
                pass

    await asyncio.gather(*(one(index) for index in range(clients)))


async def _client_fedcore(bundles: dict[str, Any], port: int, upload_bytes: int | None) -> None:
    from fedcore.errors import FedcoreError
    from fedcore.transport import AsyncRpcClient, Identity, Limits, Payload, Turn

    clients = _client_count(bundles)
    turn = Turn()  # one large inbound message at a time, as a group of clients shares it

    async def one(index: int) -> None:
        client = AsyncRpcClient(
            f"127.0.0.1:{port}",
            bundles[f"client-{index}"],
            service="Bench",
            limits=Limits(),
            peer=Identity("server"),
        )
        session = client.open_session("Session", turn=turn)
        await session.send(Payload(meta={"hello": True}))
        try:
            while True:
                task = await session.receive()
                if task is None:
                    break
                await session.send(_upload(task.meta["round"], task.tensors, upload_bytes))
                session.answered()
        except FedcoreError:
            pass
        session.close()
        await client.close()

    await asyncio.gather(*(one(index) for index in range(clients)))


def _client_main(
    side: str, bundles: dict[str, Any], port: int, folder: str, upload_bytes: int | None
) -> None:
    _settle(side)
    if side in ("raw TCP", "raw TLS"):
        asyncio.run(_client_streams(side == "raw TLS", bundles, Path(folder), port, upload_bytes))
    elif side == "raw gRPC + mTLS":
        asyncio.run(_client_grpc(bundles, port, upload_bytes))
    else:
        asyncio.run(_client_fedcore(bundles, port, upload_bytes))


def _client_count(bundles: dict[str, Any]) -> int:
    return sum(name.startswith("client-") for name in bundles)


# ---------------------------------------------------------------------------- the parent

EXCHANGES = 15_000
"""Exchanges measured per run (rounds = EXCHANGES / clients): enough CPU for /proc's 10 ms
ticks to be a small error even on the cheapest side."""
PROTOCOLS_RECORD = ROOT / "docs" / "benchmarks" / "protocols.json"
MPDP_UPLOAD_BYTES = 400_000
"""mpdp's upload per client on the protocols benchmark's job when its record is absent."""


@dataclass(frozen=True)
class Case:
    """One configuration: ``clients`` connections; answers the task's size or ``upload_bytes``."""

    name: str
    clients: int
    upload_bytes: int | None = None

    @property
    def rounds(self) -> int:
        return EXCHANGES // self.clients


def mpdp_upload_bytes() -> int:
    """mpdp's upload per client and round on the protocols benchmark's job: its bytes per
    round (sent and received by the server) per client, less the task (the model it sends)."""
    rows = _protocols_record() or {}
    try:
        fedsgd, mpdp = rows["fedsgd"]["bytes_per_round"], rows["mpdp"]["bytes_per_round"]
    except (KeyError, TypeError):
        return MPDP_UPLOAD_BYTES
    clients = 10
    return int(mpdp / clients - fedsgd / clients / 2)


def cases() -> list[Case]:
    return [
        Case("many clients: 50, each answering an upload of the model's size", 50),
        Case("10 clients, each answering an upload of the model's size", 10),
        Case("10 clients, each answering mpdp's upload", 10, mpdp_upload_bytes()),
    ]


def measure_side(side: str, case: Case, bundles: dict[str, Any], folder: Path) -> dict[str, Any]:
    """One run of ``side``: the CPU of both processes over the measured rounds, per exchange,
    and the rounds' median time."""
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    server = spawn.Process(
        target=_server_main, args=(side, bundles, case.rounds, str(folder), theirs), daemon=True
    )
    server.start()
    port = ours.recv()
    client = spawn.Process(
        target=_client_main,
        args=(side, bundles, port, str(folder), case.upload_bytes),
        daemon=True,
    )
    client.start()
    pids = {"server": server.pid or 0, "client": client.pid or 0}
    if ours.recv() != "start":
        raise RuntimeError(f"{side}: the server did not start its rounds")
    before = {name: process_cpu_seconds(pid) or 0.0 for name, pid in pids.items()}
    ours.send("go")
    if ours.recv() != "done":
        raise RuntimeError(f"{side}: the server did not finish its rounds")
    after = {name: process_cpu_seconds(pid) or 0.0 for name, pid in pids.items()}
    ours.send("go")
    times = ours.recv()
    for process in (server, client):
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
    exchanges = case.rounds * case.clients
    return {
        "server_us": (after["server"] - before["server"]) / exchanges * 1e6,
        "client_us": (after["client"] - before["client"]) / exchanges * 1e6,
        "round_ms": statistics.median(times) * 1e3,
    }


def run(repeats: int, sides: tuple[str, ...] = SIDES) -> dict[str, Any]:
    """Every case, each side of ``sides`` ``repeats`` times in turn (alternating the order)."""
    from fedcore.transport import issue_run_bundles

    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned processes
    start = load()
    measured: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fedcore-exchange-") as folder:
        for case in cases():
            _, bundles = issue_run_bundles("exchange", num_clients=case.clients)
            runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
            for repeat in range(repeats):
                order = sides if repeat % 2 == 0 else tuple(reversed(sides))
                for side in order:
                    runs[side].append(measure_side(side, case, bundles, Path(folder)))
                    print(case.name, "|", side, runs[side][-1], file=sys.stderr)
            upload = _upload(1, digits_model(), case.upload_bytes)
            measured.append(
                {
                    "name": case.name,
                    "clients": case.clients,
                    "rounds": case.rounds,
                    "upload_bytes": len(_encoded(upload)),
                    "runs": runs,
                    "medians": {
                        side: {
                            key: statistics.median(r[key] for r in results) for key in results[0]
                        }
                        for side, results in runs.items()
                    },
                }
            )
    return {
        "machine": machine(),
        "repeats": repeats,
        "task_bytes": len(_encoded()),
        "load_start": start,
        "load_end": load(),
        "cases": measured,
    }


def _cpu(row: dict[str, float]) -> float:
    return row["server_us"] + row["client_us"]


def render(data: dict[str, Any]) -> str:
    lines = [
        BEGIN,
        "## One model exchange per client and round, by transport stack",
        "",
        f"`python -m benchmarks.exchange --write` ({data['machine']}); {data['repeats']} "
        "repeats, the sides in turn; medians. Load average (1/5/15 min) "
        f"{data['load_start']} at the start, {data['load_end']} at the end. A round: the server "
        f"process sends each connection the digits model ({data['task_bytes']:,} bytes "
        "encoded) and each answers with an upload; the clients are one process, their "
        "connections on one event loop (as a group of clients runs), each connection with its "
        "own client certificate. No training, checks or averaging: the transport alone. CPU "
        "is user + system time of each process (every thread) over the measured rounds (after "
        f"{WARM_ROUNDS} warm ones), per exchange (the task and its answer). *raw TCP* and *raw "
        "TLS*: asyncio streams with a length before each message; *raw gRPC + mTLS*: "
        "`grpc.aio`, one bidirectional stream per connection, the encoded message as one gRPC "
        "message; *fedcore sessions*: `RpcServer` sessions and `AsyncRpcClient` sessions, the "
        "Payloads encoded and decoded by fedcore's codec, as a round's task and upload are; "
        f"*{UNTUNED}*: the same in processes that leave the C allocator's thresholds as glibc "
        "sets them (every other side's processes set them as a role process does, "
        "`fedcore.local.allocator`).",
    ]
    for case in data["cases"]:
        medians = case["medians"]
        base = medians["raw TLS"]
        lines += [
            "",
            f"**{case['name']}** ({case['upload_bytes']:,} bytes encoded; {case['rounds']} "
            "rounds).",
            "",
            "| stack | CPU per exchange, server (us) | client (us) | both (us) | x raw TLS "
            "| median round (ms) | x raw TLS |",
            "|---|---|---|---|---|---|---|",
        ]
        for side in SIDES:
            row = medians[side]
            lines.append(
                f"| {side} | {row['server_us']:.0f} | {row['client_us']:.0f} | {_cpu(row):.0f} "
                f"| {_cpu(row) / _cpu(base):.2f}x | {row['round_ms']:.1f} "
                f"| {row['round_ms'] / base['round_ms']:.2f}x |"
            )
    lines += ["", *conclusion(data), END]
    return "\n".join(lines)


def conclusion(data: dict[str, Any]) -> list[str]:
    """What the tables say about the many-clients round and mpdp's runtime."""
    many, small, large = (case["medians"] for case in data["cases"])

    def cpu(side: str) -> float:
        return _cpu(many[side])

    fedcore, grpc = cpu("fedcore sessions"), cpu("raw gRPC + mTLS")
    lines = [
        f"With many clients, an exchange costs {fedcore:.0f} us of CPU over fedcore's "
        f"sessions: mutual TLS {cpu('raw TLS') - cpu('raw TCP'):.0f} us beyond plain TCP "
        f"({cpu('raw TCP'):.0f} us), gRPC {grpc - cpu('raw TLS'):.0f} us more, fedcore's "
        f"sessions {fedcore - grpc:.0f} us more than gRPC alone: its codec (a header of JSON "
        "whose every field is checked, each message copied into a buffer of its own; about "
        "25 us to encode and 30 us to decode the digits model's message in a warm loop), its "
        "limits and admission, the hand-off between the round's thread and the loop, and, "
        "each message taking longer, fewer of gRPC's writes and reads batched together. The "
        "floor trains a digits client in about 0.6 ms on this machine (many clients, above): "
        f"fedcore's transport alone costs {fedcore / 600:.0%} of that per client and round, "
        f"gRPC's own {grpc / 600:.0%}.",
    ]
    record = _protocols_record()
    if record is None:
        return lines
    extra = {side: _cpu(large[side]) - _cpu(small[side]) for side in SIDES}
    cheapest = min(("raw TLS", "raw gRPC + mTLS"), key=lambda side: extra[side])
    fedsgd = record["fedsgd"]
    runtime = (fedsgd["cpu_round"] - fedsgd["maths_round"]) * 1e3
    allowance = 0.3 * runtime / 10 * 1e3
    tuned, untuned = _cpu(large["fedcore sessions"]), _cpu(large[UNTUNED])
    lines += [
        "",
        f"mpdp's upload ({data['cases'][2]['upload_bytes']:,} bytes against the model's "
        f"{data['cases'][1]['upload_bytes']:,}) costs every exchange "
        f"{extra['raw TLS']:.0f} us more over raw mutual TLS (Python's ssl through asyncio, "
        f"which copies through memory buffers), {extra['raw gRPC + mTLS']:.0f} us over gRPC "
        f"and {extra['fedcore sessions']:.0f} us over fedcore's sessions. The target on mpdp's "
        "CPU beyond its own maths (at most 1.3x fedsgd's) allows it "
        f"{allowance:.0f} us per client and round more than fedsgd's runtime ({runtime:.1f} "
        "ms a round of 10 clients, protocols, above), for everything its runtime adds: "
        f"{cheapest}, the cheapest stack measured, takes {extra[cheapest] / allowance:.0%} "
        "of it to move the bytes. Role processes set the C allocator's thresholds "
        "(`fedcore.local.allocator`: a buffer of up to 4 MiB is reused once freed instead of "
        f"unmapped and faulted in again): an exchange of mpdp's upload costs {tuned:.0f} us "
        f"with them against {untuned:.0f} us with glibc's defaults "
        f"({tuned / untuned - 1:+.0%}); with the model-sized upload, "
        f"{_cpu(small['fedcore sessions']):.0f} against {_cpu(small[UNTUNED]):.0f} us.",
    ]
    return lines


def _protocols_record() -> dict[str, Any] | None:
    try:
        rows: dict[str, Any] = json.loads(PROTOCOLS_RECORD.read_text(encoding="utf-8"))["rows"]
    except (OSError, KeyError, ValueError):
        return None
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--sides", nargs="+", choices=SIDES, default=list(SIDES), help="(default: all)"
    )
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    data = run(args.repeats, tuple(args.sides))
    if set(args.sides) != set(SIDES):
        print([case["medians"] for case in data["cases"]])
        return
    publish(render(data), data, "exchange", begin=BEGIN, end=END, write=args.write)


if __name__ == "__main__":
    main()

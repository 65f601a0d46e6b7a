"""Physical limits: aggregation against memory bandwidth, transport against raw loopback.

**Aggregation.** This machine's memory bandwidth is measured the STREAM way with numpy on
1 GiB arrays (copy: read + write bytes per second; one thread, and split over as many threads
as the fold's kernel uses), then fedcore's aggregation (``fedcore.protocols._maths.weighted_mean``:
the fold FedAvg's server runs, ``fedcore.protocols._fold``) averages K=10 float32 uploads of a
100 MB model. Its throughput counts the bytes that must move at least (the K inputs read once,
the result written once) over the wall time, the same accounting as the copy. Target: at least
50% of the copy bandwidth. The fold runs three ways, alternating: with its compiled kernel
(``fedcore.protocols._kernels``, the default: numba, over the usable cores), with the kernel on
one thread (``FEDCORE_FOLD_THREADS=1``) and with the kernel off (``FEDCORE_FOLD_THREADS=0``:
numpy, one thread, what fedcore ran before). The first
kernel call of the process (numba's import and compilation) is timed apart.
``--only aggregation`` measures only this part and, with ``--write``, replaces only its rows
and paragraph in the section (the transport's stay as they are).

**Transport.** A 100 MB and a 1 GB float32 model go one way from a client process to a
server process over loopback, the server acknowledging with a few bytes, on four stacks:

* raw TCP socket (``sendall`` into ``recv_into`` a preallocated buffer): the ceiling;
* raw TLS socket (Python ``ssl``, mutual TLS with the run's certificates);
* raw gRPC over mutual TLS: the same 4 MiB chunks fedcore sends, pre-encoded, streamed to a
  handler that drops them (gRPC and its TLS without fedcore's codec);
* fedcore: ``RpcClient.call`` to an ``RpcServer`` handler (the chunked codec, size limits,
  identity checks, mutual TLS), certificates from ``issue_run_bundles``.

The codec alone (encode to chunks, decode from them, in one process) is timed too, to place
the cost. Target (issue 29): fedcore at least 50% of the raw TLS socket. Sides alternate,
``--repeats`` times; medians. ``--write`` replaces the limits section of docs/benchmarks.md.

Run: ``python -m benchmarks.limits [--repeats 3] [--only aggregation] [--write]``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing as mp
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.measure import load, machine, save_data
from benchmarks.spine import write_section

BEGIN = "<!-- limits:begin -->"
END = "<!-- limits:end -->"
MB = 10**6
GIB = 2**30
CHUNK = 4 * 1024 * 1024
"""fedcore's default chunk (spec.transport.chunkBytes)."""
SIDES = (
    "raw TCP socket",
    "raw TLS socket",
    "raw gRPC, no TLS",
    "raw gRPC + mTLS",
    "fedcore RpcClient.call",
)


# ------------------------------------------------------------------------------ memory


def memory_bandwidth(repeats: int, size: int = GIB, threads: int = 1) -> dict[str, float]:
    """Copy bandwidth of ``size``-byte arrays (read + write bytes per second, as STREAM counts),
    on one thread and split over ``threads`` threads (numpy's copy releases the GIL)."""
    src = np.ones(size // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    bounds = np.linspace(0, src.size, max(1, threads) + 1).astype(int)

    def part(start: int, stop: int) -> None:
        np.copyto(dst[start:stop], src[start:stop])

    def parallel() -> None:
        workers = [
            threading.Thread(target=part, args=(int(a), int(b)))
            for a, b in itertools.pairwise(bounds)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    copies, parallel_copies = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copies.append(2 * size / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        parallel()
        parallel_copies.append(2 * size / (time.perf_counter() - t0))
    return {
        "copy_best": max(copies),
        "copy_median": statistics.median(copies),
        "threads": threads,
        "copy_threads_best": max(parallel_copies),
        "copy_threads_median": statistics.median(parallel_copies),
    }


def per_element(block: int = 1 << 15, number: int = 200) -> dict[str, float]:
    """Nanoseconds per element, in cache, of the numpy path's steps, of the compiled kernel's
    whole fold (one thread; the slope between one block and two, so without the call's
    overhead, which is given apart in microseconds) and of a copy."""
    import timeit

    from fedcore.protocols import _kernels

    x = np.random.default_rng(0).standard_normal(2 * block, dtype=np.float32)
    term, acc, dst = np.empty(block), np.zeros(2 * block), np.empty(block, dtype=np.float32)
    small = x[:block]
    steps = {
        "copy float32": lambda: np.copyto(dst, small),
        "widen float32 to float64": lambda: np.copyto(term, small),
        "widen and scale": lambda: np.multiply(small, 0.1, out=term, dtype=np.float64),
        "add float64": lambda: np.add(acc[:block], term, out=acc[:block]),
    }
    timings = {
        name: min(timeit.repeat(step, number=number, repeat=7)) / number / block * 1e9
        for name, step in steps.items()
    }

    def kernel_seconds(size: int) -> float:
        def step() -> None:
            _kernels.fold_into(acc[:size], x[:size], 0.1)

        step()
        return min(timeit.repeat(step, number=number, repeat=7)) / number

    threshold = _kernels.KERNEL_ELEMENTS
    _kernels.KERNEL_ELEMENTS = 1  # these blocks take the kernel too
    try:
        with fold_kernel(True, threads=1):
            one, two = kernel_seconds(block), kernel_seconds(2 * block)
    finally:
        _kernels.KERNEL_ELEMENTS = threshold
    timings["kernel fold, one thread"] = (two - one) / block * 1e9
    timings["kernel call overhead (us)"] = (one - (two - one)) * 1e6
    return timings


def model(total_bytes: int, tensors: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """A float32 model of about ``total_bytes`` in ``tensors`` tensors."""
    rng = np.random.default_rng(seed)
    per = total_bytes // 4 // tensors
    return {f"layer{i}": rng.standard_normal(per, dtype=np.float32) for i in range(tensors)}


@contextlib.contextmanager
def fold_kernel(enabled: bool, threads: int | None = None) -> Iterator[None]:
    """The fold's compiled kernel on (the default; ``threads``: that many) or off
    (``FEDCORE_FOLD_THREADS=0``: the numpy path, what fedcore folded with before the kernel)."""
    from fedcore.protocols._kernels import THREADS_ENV

    before = os.environ.get(THREADS_ENV)
    if not enabled:
        os.environ[THREADS_ENV] = "0"
    elif threads is not None:
        os.environ[THREADS_ENV] = str(threads)
    else:
        os.environ.pop(THREADS_ENV, None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(THREADS_ENV, None)
        else:
            os.environ[THREADS_ENV] = before


def fold_times(upload: dict[str, np.ndarray], repeats: int) -> tuple[float, float]:
    """Median seconds to fold one upload into a warm float64 accumulator (its pages already
    touched), with the kernel and with numpy: per element, the upload read and the
    accumulator read and written (20 bytes for a float32 model)."""
    from fedcore.protocols._kernels import fold_into

    accs = {name: np.zeros(value.size) for name, value in upload.items()}
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for enabled in (True, False):
            with fold_kernel(enabled):
                t0 = time.perf_counter()
                for name, value in upload.items():
                    fold_into(accs[name], value, 1.5)
                times[enabled].append(time.perf_counter() - t0)
    return statistics.median(times[True]), statistics.median(times[False])


def norm_times(
    upload: dict[str, np.ndarray], model: dict[str, np.ndarray], repeats: int
) -> tuple[float, float]:
    """Median seconds of one upload check's step norm (``step_norm(upload, model)``: every
    value of both read once), with the kernel and with numpy, alternating."""
    from fedcore.protocols._bounds import step_norm

    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for enabled in (True, False):
            with fold_kernel(enabled):
                t0 = time.perf_counter()
                step_norm(upload, model)
                times[enabled].append(time.perf_counter() - t0)
    return statistics.median(times[True]), statistics.median(times[False])


def numba_import_seconds() -> float:
    """Seconds to import numba in a fresh interpreter that already imported numpy (what the
    first large fold of a process pays before compiling)."""
    code = (
        "import time, numpy; t = time.perf_counter(); import numba; print(time.perf_counter() - t)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    return float(done.stdout.strip())


def aggregation(repeats: int, clients: int = 10, size: int = 100 * MB) -> dict[str, Any]:
    """weighted_mean of ``clients`` float32 uploads of ``size`` bytes: bytes moved per second,
    with the compiled kernel and with the numpy path (alternating), and a checked server round.
    """
    from fedcore.protocols._kernels import kernel_info, usable_cores
    from fedcore.protocols._maths import weighted_mean
    from fedcore.protocols.fedavg.protocol import ModelAveragingServer
    from fedcore.transport import Payload

    uploads = [model(size, seed=k) for k in range(clients)]
    sizes = [100.0 + k for k in range(clients)]
    moved = (clients + 1) * sum(v.nbytes for v in uploads[0].values())
    initial = model(size, seed=clients)
    payloads = {
        k: Payload(meta={"num_examples": 100 + k, "loss": 1.0}, tensors=u)
        for k, u in enumerate(uploads)
    }

    server = ModelAveragingServer(initial, weighting="ShardSize")
    server.set_shard_sizes([100 + k for k in range(clients)])

    def checked_round() -> None:
        """What the server runs per round: each upload checked (shape, finiteness, examples,
        step norm), then the mean and the aggregate check."""
        for k, payload in payloads.items():
            server.check_upload(1, k, payload)
        server.combine(1, payloads, failures=[])

    def timed(step: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0

    with fold_kernel(False):
        weighted_mean(uploads, sizes)  # the numpy path, warm
    first = timed(lambda: weighted_mean(uploads, sizes))  # numba imported and compiled here
    info = kernel_info()
    steady = timed(lambda: weighted_mean(uploads, sizes))
    checked_round()
    rates, all_core_rates, numpy_rates, checked = [], [], [], []
    cores = usable_cores()
    for _ in range(repeats):
        rates.append(moved / timed(lambda: weighted_mean(uploads, sizes)))
        with fold_kernel(True, threads=cores):
            all_core_rates.append(moved / timed(lambda: weighted_mean(uploads, sizes)))
        with fold_kernel(False):
            numpy_rates.append(moved / timed(lambda: weighted_mean(uploads, sizes)))
        checked.append(moved / timed(checked_round))
    if info.get("state") != "loaded":
        raise RuntimeError(f"The fold's kernel did not run: {info}")
    fold_seconds, numpy_fold_seconds = fold_times(uploads[0], max(repeats, 5))
    norm_seconds, numpy_norm_seconds = norm_times(uploads[0], initial, max(repeats, 5))
    return {
        "clients": clients,
        "model_bytes": size,
        "best": max(rates),
        "median": statistics.median(rates),
        "cores": cores,
        "all_cores_best": max(all_core_rates),
        "all_cores_median": statistics.median(all_core_rates),
        "numpy_best": max(numpy_rates),
        "numpy_median": statistics.median(numpy_rates),
        "checked_best": max(checked),
        "checked_median": statistics.median(checked),
        "kernel": {
            "threading_layer": kernel_info().get("threading_layer"),
            "threads": kernel_info().get("threads"),
            "first_call_seconds": first,
            "steady_call_seconds": steady,
            "median_call_seconds": moved / statistics.median(rates),
            "fold_seconds": fold_seconds,
            "numpy_fold_seconds": numpy_fold_seconds,
            "norm_seconds": norm_seconds,
            "norm_bytes": sum(v.nbytes for v in uploads[0].values()),
            "numpy_norm_seconds": numpy_norm_seconds,
            "fold_traffic_rate": 20 * sum(v.size for v in uploads[0].values()) / fold_seconds,
            "load_seconds": info.get("import_seconds"),
            "compile_seconds": info.get("compile_seconds"),
            "numba_import_seconds": numba_import_seconds(),
        },
    }


# --------------------------------------------------------------------------- transport


def _bundles(folder: Path) -> tuple[Any, Any]:
    """The run's (server, client-0) TLS bundles, issued by a fresh run CA."""
    from fedcore.transport import issue_run_bundles

    _, bundles = issue_run_bundles("limits", num_clients=1)
    return bundles["server"], bundles["client-0"]


def _write_pems(folder: Path, bundle: Any, name: str) -> tuple[str, str, str]:
    """Writes a bundle's PEMs for the ssl module; returns (cert, key, ca) paths."""
    paths = []
    for suffix, pem in (("crt", bundle.cert_pem), ("key", bundle.key_pem), ("ca", bundle.ca_pem)):
        path = folder / f"{name}.{suffix}"
        path.write_bytes(pem)
        paths.append(str(path))
    return paths[0], paths[1], paths[2]


def server_tls_context(folder: Path, bundle: Any) -> ssl.SSLContext:
    """A raw socket server's mutual-TLS context: the run's server bundle, client certificates
    required and checked against the run's CA (PEMs written under ``folder``)."""
    cert, key, ca = _write_pems(folder, bundle, "server")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.load_verify_locations(ca)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_tls_context(folder: Path, bundle: Any, name: str = "client") -> ssl.SSLContext:
    """A raw socket client's mutual-TLS context: ``bundle``'s certificate, the server checked
    against the run's CA (PEMs written under ``folder`` as ``name``.*)."""
    cert, key, ca = _write_pems(folder, bundle, name)
    context = ssl.create_default_context(cafile=ca)
    context.load_cert_chain(cert, key)
    return context


def _serve(kind: str, bundle: Any, folder: str, nbytes: int, conn: Connection) -> None:
    """The receiving process: serves ``kind`` on loopback, reports its port, runs until told."""
    os.environ["OMP_NUM_THREADS"] = "1"
    if kind in ("raw TCP socket", "raw TLS socket"):
        listener = socket.create_server(("127.0.0.1", 0))
        conn.send(listener.getsockname()[1])
        context = None
        if kind == "raw TLS socket":
            context = server_tls_context(Path(folder), bundle)
        buffer = bytearray(nbytes)
        while True:
            raw, _ = listener.accept()
            sock: socket.socket = (
                context.wrap_socket(raw, server_side=True) if context is not None else raw
            )
            view = memoryview(buffer)
            got = 0
            while got < nbytes:
                n = sock.recv_into(view[got:], min(nbytes - got, 1 << 24))
                if n == 0:
                    break
                got += n
            sock.sendall(b"k")
            sock.close()
        return
    import grpc

    from fedcore.transport import Limits, Payload, RpcServer

    if kind in ("raw gRPC + mTLS", "raw gRPC, no TLS"):
        from concurrent import futures

        def sink(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
            total = 0
            for chunk in requests:
                total += len(chunk)
            yield total.to_bytes(8, "little")

        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4),
            options=Limits().channel_options(),
        )
        handler = grpc.method_handlers_generic_handler(
            "bench.Raw", {"Sink": grpc.stream_stream_rpc_method_handler(sink)}
        )
        server.add_generic_rpc_handlers((handler,))
        if kind == "raw gRPC, no TLS":
            port = server.add_insecure_port("127.0.0.1:0")
        else:
            credentials = grpc.ssl_server_credentials(
                [(bundle.key_pem, bundle.cert_pem)],
                root_certificates=bundle.ca_pem,
                require_client_auth=True,
            )
            port = server.add_secure_port("127.0.0.1:0", credentials)
        server.start()
    else:

        def accept(peer: Any, request: Payload, context: Any) -> Payload:
            size = sum(t.nbytes for t in request.tensors.values())
            return Payload(meta={"bytes": size})

        rpc = RpcServer(
            "127.0.0.1:0",
            bundle,
            {"Sink": accept},
            service="Bench",
            limits=Limits(chunk_bytes=CHUNK),
            max_workers=4,
        )
        rpc.start()
        port = rpc.port
    conn.send(port)
    conn.recv()


def _send_raw(port: int, data: memoryview, context: ssl.SSLContext | None) -> None:
    """Sends ``data`` over a fresh connection and waits for the one-byte ack."""
    with socket.create_connection(("127.0.0.1", port)) as raw:
        sock = (
            context.wrap_socket(raw, server_hostname="server.fedcore.invalid")
            if context is not None
            else raw
        )
        sock.sendall(data)
        if sock.recv(1) != b"k":
            raise RuntimeError("no acknowledgement")


_ENCODED: dict[tuple[int, str], Any] = {}


def _shared_encoding(payload: Any, form: str) -> Any:
    """The payload's encoding as one bytes object (``flat``) or a list of chunks, made once
    per payload and shared by the raw sides: every buffer a sender keeps is memory the
    machine's other buffers compete with (fedcore's receiver allocates its own per message)."""
    from fedcore.transport import encode_chunks

    key = (id(payload), form)
    if key not in _ENCODED:
        if form == "chunks":
            _ENCODED[key] = list(encode_chunks(payload, chunk_bytes=CHUNK))
        else:
            _ENCODED[key] = b"".join(encode_chunks(payload, chunk_bytes=CHUNK))
    return _ENCODED[key]


def transport_once(
    kind: str, port: int, payload: Any, client_bundle: Any, folder: Path
) -> Callable[[], None]:
    """Returns a function that sends ``payload`` once over ``kind`` (connection set up inside)."""
    import grpc

    from fedcore.transport import Identity, Limits, RpcClient

    if kind in ("raw TCP socket", "raw TLS socket"):
        view = memoryview(_shared_encoding(payload, "flat"))
        context = None
        if kind == "raw TLS socket":
            context = client_tls_context(folder, client_bundle)
        return lambda: _send_raw(port, view, context)
    if kind in ("raw gRPC + mTLS", "raw gRPC, no TLS"):
        chunks = _shared_encoding(payload, "chunks")
        credentials = grpc.ssl_channel_credentials(
            root_certificates=client_bundle.ca_pem,
            private_key=client_bundle.key_pem,
            certificate_chain=client_bundle.cert_pem,
        )
        options = [
            *Limits().channel_options(),
            ("grpc.ssl_target_name_override", "server.fedcore.invalid"),
        ]
        secure = kind == "raw gRPC + mTLS"

        def send_grpc() -> None:
            target = f"127.0.0.1:{port}"
            with (
                grpc.secure_channel(target, credentials, options=options)
                if secure
                else grpc.insecure_channel(target, options=options)
            ) as channel:
                stub = channel.stream_stream("/bench.Raw/Sink")
                list(stub(iter(chunks), timeout=600))

        return send_grpc

    def send_fedcore() -> None:
        with RpcClient(
            f"127.0.0.1:{port}",
            client_bundle,
            service="Bench",
            limits=Limits(chunk_bytes=CHUNK),
            peer=Identity("server"),
        ) as client:
            client.call("Sink", payload, timeout=600)

    return send_fedcore


def codec(payload: Any, repeats: int) -> dict[str, float]:
    """Seconds (median) to encode ``payload`` to chunks, and to decode them, in one process."""
    from fedcore.transport import PayloadDecoder, encode_chunks

    encode, decode = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        chunks = list(encode_chunks(payload, chunk_bytes=CHUNK))
        encode.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        decoder = PayloadDecoder(max_message_bytes=8 * GIB)
        for chunk in chunks:
            decoder.feed(chunk)
        decoder.finish()
        decode.append(time.perf_counter() - t0)
        del chunks
    return {"encode": statistics.median(encode), "decode": statistics.median(decode)}


def transport(repeats: int, sizes: tuple[int, ...]) -> dict[str, Any]:
    """Every side for every size; medians of MB/s."""
    from fedcore.transport import Payload

    results: dict[str, Any] = {}
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fedcore-limits-") as tmp:
        server_bundle, client_bundle = _bundles(Path(tmp))
        for size in sizes:
            payload = Payload(meta={"round": 1}, tensors=model(size))
            nbytes = sum(len(c) for c in _encoded_lengths(payload))
            servers: dict[str, tuple[Any, Connection, int]] = {}
            for kind in SIDES:
                parent, child = ctx.Pipe()
                process = ctx.Process(
                    target=_serve, args=(kind, server_bundle, tmp, nbytes, child), daemon=True
                )
                process.start()
                servers[kind] = (process, parent, parent.recv())
            rates: dict[str, list[float]] = {kind: [] for kind in SIDES}
            try:
                senders = {
                    kind: transport_once(kind, servers[kind][2], payload, client_bundle, Path(tmp))
                    for kind in SIDES
                }
                for kind in SIDES:  # warm-up: connections, page faults of the buffers
                    senders[kind]()
                for _ in range(repeats):
                    for kind in SIDES:
                        t0 = time.perf_counter()
                        senders[kind]()
                        rates[kind].append(size / (time.perf_counter() - t0))
            finally:
                for process, parent, _ in servers.values():
                    parent.send("stop")
                    process.join(5)
                    if process.is_alive():
                        process.kill()
            timings = codec(payload, repeats)
            results[str(size)] = {
                "rates": {kind: statistics.median(r) for kind, r in rates.items()},
                "codec": timings,
            }
            print(
                f"transport {size // MB} MB: "
                + ", ".join(
                    f"{k} {v / MB:.0f} MB/s" for k, v in results[str(size)]["rates"].items()
                ),
                file=sys.stderr,
            )
            _ENCODED.clear()
            del payload, senders
    return results


def _encoded_lengths(payload: Any) -> Iterator[bytes]:
    from fedcore.transport import encode_chunks

    return encode_chunks(payload, chunk_bytes=CHUNK)


# ------------------------------------------------------------------------------ report


def render(data: dict[str, Any]) -> str:
    """The docs/benchmarks.md section."""
    lines = [
        BEGIN,
        "## Limits: aggregation against memory bandwidth, transport against raw loopback",
        "",
        f"Measured by `python -m benchmarks.limits --write` ({data['machine']}); "
        f"{data['repeats']} repeats, sides alternating; medians (best in brackets). Load average "
        f"(1/5/15 min) {data['load_start']} at the start, {data['load_end']} at the end.",
        "",
        *render_aggregation(data),
        "",
        "| transport, one way, client process to server process | "
        + " | ".join(f"{int(s) // MB} MB: MB/s" for s in data["transport"])
        + " |",
        "|---|" + "---|" * len(data["transport"]),
    ]
    for kind in SIDES:
        cells = []
        for result in data["transport"].values():
            rate, raw = result["rates"][kind], result["rates"]["raw TCP socket"]
            tls = result["rates"]["raw TLS socket"]
            cells.append(f"{rate / MB:.0f} ({rate / raw:.0%} of raw, {rate / tls:.0%} of raw TLS)")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    codec_cells = [
        f"encode {r['codec']['encode']:.2f} s, decode {r['codec']['decode']:.2f} s "
        f"({int(s) / r['codec']['decode'] / MB:.0f} MB/s)"
        for s, r in data["transport"].items()
    ]
    lines.append("| fedcore codec alone, one process | " + " | ".join(codec_cells) + " |")
    shares = [tls_share(r["rates"]) for r in data["transport"].values()]
    met = all(s >= 0.5 for s in shares)
    lines += [
        "",
        "Transport target (issue 29: at least 50% of a raw loopback TLS socket's throughput, "
        "so that the cost of the encryption itself is not counted against fedcore; the raw TCP "
        "socket is shown beside it): "
        f"**{'met' if met else 'missed'}** ("
        + ", ".join(f"{s:.0%}" for s in shares)
        + "). Each send opens a fresh connection (the handshake is in the time, as it is for "
        "a model's first transfer). " + transport_cause(data),
        END,
    ]
    return "\n".join(lines)


AGG_BEGIN = "<!-- limits-aggregation:begin -->"
AGG_END = "<!-- limits-aggregation:end -->"
"""Inside the limits section: the aggregation's rows and paragraph (``--only aggregation``
replaces only these)."""


def aggregation_share(data: dict[str, Any]) -> float:
    """fedcore's weighted_mean (with the kernel) as a share of the one-thread copy."""
    return float(data["aggregation"]["median"] / data["memory"]["copy_median"])


def render_aggregation(data: dict[str, Any], *, provenance: bool = False) -> list[str]:
    """The aggregation's rows and paragraph, between their markers; with ``provenance``
    (an aggregation-only run), a line saying where and when they were measured."""
    bw, agg = data["memory"], data["aggregation"]
    kernel = agg["kernel"]
    copy = bw["copy_median"]
    share = aggregation_share(data)
    numpy_share = agg["numpy_median"] / copy
    threads = kernel["threads"]
    lines = [AGG_BEGIN]
    if provenance:
        lines += [
            f"Aggregation rows measured by `python -m benchmarks.limits --only aggregation "
            f"--write` ({data['machine']}); {data['repeats']} repeats, the kernel's and numpy's "
            f"rows alternating; medians (best in brackets). Load average (1/5/15 min) "
            f"{data['load_start']} at the start, {data['load_end']} at the end.",
            "",
        ]
    lines += [
        "| aggregation | GB/s | share of copy bandwidth |",
        "|---|---|---|",
        f"| memory copy, numpy, 1 GiB (read + write), one thread | {copy / 1e9:.2f} "
        f"({bw['copy_best'] / 1e9:.2f}) | 100% |",
        f"| memory copy, numpy, 1 GiB, split over {bw['threads']} threads | "
        f"{bw['copy_threads_median'] / 1e9:.2f} ({bw['copy_threads_best'] / 1e9:.2f}) | "
        f"{bw['copy_threads_median'] / copy:.0%} |",
        f"| fedcore weighted_mean, {agg['clients']} x {agg['model_bytes'] // MB} MB float32 "
        f"(inputs read + result written), compiled kernel (numba, {threads} "
        f"thread{'' if threads == 1 else 's'}, "
        f"{kernel['threading_layer']} layer) | {agg['median'] / 1e9:.2f} "
        f"({agg['best'] / 1e9:.2f}) | **{share:.0%}** |",
        f"| the same, compiled kernel on all {agg['cores']} cores "
        f"(`FEDCORE_FOLD_THREADS={agg['cores']}`) | "
        f"{agg['all_cores_median'] / 1e9:.2f} ({agg['all_cores_best'] / 1e9:.2f}) | "
        f"{agg['all_cores_median'] / copy:.0%} |",
        f"| the same, numpy path (kernel off, `FEDCORE_FOLD_THREADS=0`) | "
        f"{agg['numpy_median'] / 1e9:.2f} ({agg['numpy_best'] / 1e9:.2f}) | {numpy_share:.0%} |",
        f"| fedcore server round: {agg['clients']} upload checks (shape, finiteness, example "
        f"count, step norm; docs/security.md) + the server's combine (the uploads summed in "
        f"client order, one pass each) + aggregate check, same bytes counted, kernels | "
        f"{agg['checked_median'] / 1e9:.2f} ({agg['checked_best'] / 1e9:.2f}) "
        f"| {agg['checked_median'] / copy:.0%} |",
        "",
        f"Aggregation target (at least 50% of memory bandwidth): "
        f"**{'met' if share >= 0.5 else 'missed'}** ({share:.0%} of the one-thread copy, "
        f"{agg['median'] / bw['copy_threads_median']:.0%} of the {bw['threads']}-thread one; "
        f"the numpy path {numpy_share:.0%}, the kernel {agg['median'] / agg['numpy_median']:.1f}x "
        "it). " + aggregation_cause(data),
        AGG_END,
    ]
    return lines


def splice_aggregation(text: str, block: list[str]) -> str:
    """``text`` (docs/benchmarks.md) with the limits section's aggregation block replaced by
    ``block``: between its markers, or (a section written before the markers) from its
    aggregation table to the transport table.

    Raises:
        ValueError: the limits section or its aggregation part is not there.
    """
    if BEGIN not in text or END not in text:
        raise ValueError("docs/benchmarks.md has no limits section: run without --only first.")
    head, rest = text.split(BEGIN, 1)
    section, tail = rest.split(END, 1)
    if AGG_BEGIN in section and AGG_END in section:
        before, after = section.split(AGG_BEGIN, 1)
        after = after.split(AGG_END, 1)[1]
    else:
        start = section.find("| aggregation |")
        stop = section.find("| transport")
        if start < 0 or stop < start:
            raise ValueError("The limits section has no aggregation table to replace.")
        before, after = section[:start], "\n\n" + section[stop:]
    return head + BEGIN + before + "\n".join(block) + after + END + tail


def tls_share(rates: dict[str, float]) -> float:
    """fedcore's throughput as a share of the raw TLS socket's (the transport target)."""
    return rates["fedcore RpcClient.call"] / rates["raw TLS socket"]


def aggregation_cause(data: dict[str, Any]) -> str:
    """What bounds the aggregation, from the in-cache timings and the one-upload folds."""
    from fedcore.protocols._kernels import FUSED_UPLOADS

    ns = data["per_element"]
    agg = data["aggregation"]
    kernel = agg["kernel"]
    clients = agg["clients"]
    copy = data["memory"]["copy_median"]
    numpy_step = ns["widen and scale"] + ns["add float64"]
    traffic = kernel["fold_traffic_rate"]
    # Bytes per model element: counted, K x 4 in + 4 out; moved by a fold per upload, K x
    # (4 in + 8 + 8 accumulator) + the mean's 8 in and 4 out.
    cap = (clients + 1) * 4 / (20 * clients + 12) * traffic / copy
    compile_total = sum((kernel["compile_seconds"] or {}).values())
    return (
        "What bounded numpy's path is arithmetic: in cache numpy takes "
        f"{numpy_step:.2f} ns per float32 element to widen, scale and add (three passes over "
        f"a block), the compiled kernel {ns['kernel fold, one thread']:.2f} ns on one thread "
        f"plus {ns['kernel call overhead (us)']:.0f} us per call (one pass, the same two IEEE "
        "operations per element, bit-identical results; fedcore/protocols/_kernels.py). What "
        "bounds the kernel is memory: folding one upload "
        f"into a warm accumulator takes {kernel['fold_seconds'] * 1e3:.1f} ms "
        f"(numpy {kernel['numpy_fold_seconds'] * 1e3:.1f} ms), and it must read the upload "
        "(4 bytes per element) and read and write the float64 accumulator (16 bytes): "
        f"{traffic / 1e9:.1f} GB/s of memory traffic, against the copy's "
        f"{copy / 1e9:.1f}. So a server folding each upload as it arrives, one pass over the "
        "accumulator per upload (bounded memory, docs/architecture.md), moves about 5 bytes "
        f"for each one the accounting counts: near {cap:.0%} of the copy at this traffic "
        "rate, which is where this row stood before 2026-11-27. Since then, uploads that are "
        f"at hand together (this row's {clients}; in a run, those held in memory for their "
        "turn in the fold, added with the one whose arrival makes it come) are added up to "
        f"{FUSED_UPLOADS} at a time in one pass (`fold_many_into`: the sum stays in a register "
        "through the same rounded operations in the same order, so the same bits), which "
        "moves about 1.5 bytes per byte counted. The median call took "
        f"{kernel['median_call_seconds'] * 1e3:.0f} ms; besides the passes, the mean's and "
        "the first touch of the fresh accumulator's and result's pages (a new sum each call, "
        f"as each round). The kernel runs on {kernel['threads']} of the {agg['cores']} cores "
        "by default (half, the rest receiving and checking uploads); on all of them the call "
        f"reaches {agg['all_cores_median'] / 1e9:.1f} GB/s "
        f"({agg['all_cores_median'] / copy:.0%}): memory-bound on one core already, and more "
        "threads touch fresh pages more slowly here. A server that streams its uploads in "
        "client order still folds them one pass each; 50% there would need float32 "
        "accumulation, which the "
        "spec rules out. A process's first large fold imports numba and compiles the kernel: "
        f"that call took {kernel['first_call_seconds']:.2f} s here against "
        f"{kernel['median_call_seconds']:.2f} s after it (numba's import "
        f"{kernel['numba_import_seconds']:.2f} s in a fresh interpreter; compiling and first "
        f"runs {compile_total:.2f} s)." + norm_sentence(kernel)
    )


def norm_sentence(kernel: dict[str, Any]) -> str:
    """What the server round's checks cost, from ``aggregation``'s kernel figures."""
    if "norm_seconds" not in kernel:  # a record from before the norm was timed
        return ""
    return (
        " Each upload check computes its step norm (upload minus model, in float64, every "
        "value of both read once); since 2026-11-27 a large tensor's goes through a compiled "
        "kernel too: each thread sums whole blocks of 64 Ki elements, reassociated so that "
        "it vectorises, and the blocks' sums are added in order, so the thread count changes "
        "no bit (the numpy path may differ from it in the last bits: a bound is compared "
        f"with it, nothing computed from it). One {kernel['norm_bytes'] // MB} MB upload's "
        f"norm took {kernel['norm_seconds'] * 1e3:.1f} ms against numpy's "
        f"{kernel['numpy_norm_seconds'] * 1e3:.1f} ms (the server round's row stood at 5% "
        "before)."
    )


def transport_cause(data: dict[str, Any]) -> str:
    """Where the transport's time goes, from the sides measured."""
    parts = []
    for size, result in data["transport"].items():
        r = result["rates"]
        parts.append(
            f"at {int(size) // MB} MB, gRPC alone reaches "
            f"{r['raw gRPC, no TLS'] / r['raw TCP socket']:.0%} of the raw socket, mutual TLS "
            f"takes gRPC to {r['raw gRPC + mTLS'] / r['raw TCP socket']:.0%}, and fedcore's own "
            f"layer keeps {r['fedcore RpcClient.call'] / r['raw gRPC + mTLS']:.0%} of raw gRPC "
            "+ mTLS"
        )
    return (
        "Where the time goes: "
        + "; ".join(parts)
        + ". So the gap to the raw socket is gRPC's (HTTP/2 framing and flow control, and "
        "Python's grpc handing every 4 MiB chunk over as a new bytes object on both ends) and "
        "the encryption, not fedcore's codec, which encodes by slicing the tensors' buffers and "
        "decodes into one preallocated buffer (its times in one process are in the last row). "
        "Since 2026-11-26 the server side is gRPC's asyncio server (a chunk is fed to the "
        "decoder on its event loop; the handler runs in a worker thread). Since 2026-11-27 "
        "each HTTP/2 stream's window is fixed at 8 MiB (bandwidth-delay probing off, so "
        "that uploads waiting for a server's room do not grow their buffers), which measured "
        "the same at 1 GB as probing and about 8% slower at 100 MB, alternating alone. "
        "Since 2026-11-27 fedcore's receiver writes a large message into the bytes of the "
        "last one of its size that nothing views any more, as the raw sides write into one "
        "buffer they reuse: a fresh buffer's pages are faulted in and zeroed at about 2.8 GB/s "
        "on this VM (0.38 s per GB), which had kept fedcore at 38-40% of raw TLS (693 and 699 "
        "MB/s in the run before). The first message of a size still pays for fresh pages (a "
        "run's first upload of each round: the server lets go of the kept bytes before it "
        "combines a round; a client's first task), and so does the first repeat of each size "
        "here, which the medians leave out."
    )


def run(
    repeats: int = 3, sizes: tuple[int, ...] = (100 * MB, 1000 * MB), only: str | None = None
) -> dict[str, Any]:
    """Measures everything (``only="aggregation"``: the aggregation alone); returns the
    numbers."""
    from fedcore.protocols._kernels import usable_cores

    data: dict[str, Any] = {"machine": machine(), "repeats": repeats, "load_start": load()}
    data["memory"] = memory_bandwidth(max(repeats, 5), threads=usable_cores())
    data["aggregation"] = aggregation(max(repeats, 5))
    data["per_element"] = per_element()
    print(
        f"memory copy {data['memory']['copy_median'] / 1e9:.2f} GB/s, aggregation "
        f"{data['aggregation']['median'] / 1e9:.2f} GB/s (numpy path "
        f"{data['aggregation']['numpy_median'] / 1e9:.2f} GB/s); load {data['load_start']}",
        file=sys.stderr,
    )
    if only != "aggregation":
        data["transport"] = transport(repeats, sizes)
    data["load_end"] = load()
    return data


def write_aggregation(data: dict[str, Any]) -> None:
    """Replaces the aggregation's rows and paragraph in docs/benchmarks.md and its numbers in
    docs/benchmarks/limits.json, keeping the transport's."""
    import json

    from benchmarks.measure import DOC_ASSETS
    from benchmarks.spine import DOC

    block = render_aggregation(data, provenance=True)
    DOC.write_text(splice_aggregation(DOC.read_text(encoding="utf-8"), block), encoding="utf-8")
    path = DOC_ASSETS / "limits.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    keys = ("memory", "aggregation", "per_element")
    saved.update({key: data[key] for key in keys})
    saved["aggregation_measured"] = {
        key: data[key] for key in ("machine", "repeats", "load_start", "load_end")
    }
    save_data("limits", saved)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the measurements, prints the section and (with --write) updates the docs."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes-mb", default="100,1000", help="model sizes in MB")
    parser.add_argument(
        "--only", choices=["aggregation"], default=None, help="measure only this part"
    )
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args(argv)
    sizes = tuple(int(s) * MB for s in args.sizes_mb.split(","))
    data = run(args.repeats, sizes, only=args.only)
    if args.only == "aggregation":
        print("\n".join(render_aggregation(data, provenance=True)))
        if args.write:
            write_aggregation(data)
        return data
    section = render(data)
    print(section)
    if args.write:
        write_section(section, begin=BEGIN, end=END)
        save_data("limits", data)
    return data


if __name__ == "__main__":
    main()

"""Physical limits: aggregation against memory bandwidth, transport against raw loopback.

**Aggregation.** This machine's memory bandwidth is measured the STREAM way with numpy on
1 GiB arrays (copy: read + write bytes per second), then fedcore's
aggregation (``fedcore.protocols._maths.weighted_mean``, what FedAvg's server runs) averages
K=10 float32 uploads of a 100 MB model. Its throughput counts the bytes that must move at
least (the K inputs read once, the result written once) over the wall time, the same
accounting as the copy. Target: at least 50% of the copy bandwidth. One thread throughout
(numpy's element-wise kernels are single-threaded, and so is the aggregation).

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

Run: ``python -m benchmarks.limits [--repeats 3] [--write]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import ssl
import statistics
import sys
import tempfile
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


def memory_bandwidth(repeats: int, size: int = GIB) -> dict[str, float]:
    """Copy bandwidth of ``size``-byte arrays (read + write bytes per second, as STREAM counts)."""
    src = np.ones(size // 8, dtype=np.float64)
    dst = np.empty_like(src)
    copies = []
    np.copyto(dst, src)
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copies.append(2 * size / (time.perf_counter() - t0))
    return {"copy_best": max(copies), "copy_median": statistics.median(copies)}


def per_element(block: int = 1 << 15, number: int = 200) -> dict[str, float]:
    """Nanoseconds per element, in cache, of the steps of weighted_mean and of a copy."""
    import timeit

    x = np.random.default_rng(0).standard_normal(block, dtype=np.float32)
    term, acc, dst = np.empty(block), np.zeros(block), np.empty(block, dtype=np.float32)
    steps = {
        "copy float32": lambda: np.copyto(dst, x),
        "widen float32 to float64": lambda: np.copyto(term, x),
        "widen and scale": lambda: np.multiply(x, 0.1, out=term, dtype=np.float64),
        "add float64": lambda: np.add(acc, term, out=acc),
    }
    return {
        name: min(timeit.repeat(step, number=number, repeat=7)) / number / block * 1e9
        for name, step in steps.items()
    }


def model(total_bytes: int, tensors: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """A float32 model of about ``total_bytes`` in ``tensors`` tensors."""
    rng = np.random.default_rng(seed)
    per = total_bytes // 4 // tensors
    return {f"layer{i}": rng.standard_normal(per, dtype=np.float32) for i in range(tensors)}


def aggregation(repeats: int, clients: int = 10, size: int = 100 * MB) -> dict[str, Any]:
    """weighted_mean of ``clients`` float32 uploads of ``size`` bytes: bytes moved per second."""
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

    weighted_mean(uploads, sizes)
    checked_round()
    rates, checked = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        weighted_mean(uploads, sizes)
        rates.append(moved / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        checked_round()
        checked.append(moved / (time.perf_counter() - t0))
    return {
        "clients": clients,
        "model_bytes": size,
        "best": max(rates),
        "median": statistics.median(rates),
        "checked_best": max(checked),
        "checked_median": statistics.median(checked),
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


def _serve(kind: str, bundle: Any, folder: str, nbytes: int, conn: Connection) -> None:
    """The receiving process: serves ``kind`` on loopback, reports its port, runs until told."""
    os.environ["OMP_NUM_THREADS"] = "1"
    if kind in ("raw TCP socket", "raw TLS socket"):
        listener = socket.create_server(("127.0.0.1", 0))
        conn.send(listener.getsockname()[1])
        context = None
        if kind == "raw TLS socket":
            cert, key, ca = _write_pems(Path(folder), bundle, "server")
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(cert, key)
            context.load_verify_locations(ca)
            context.verify_mode = ssl.CERT_REQUIRED
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


def transport_once(
    kind: str, port: int, payload: Any, client_bundle: Any, folder: Path
) -> Callable[[], None]:
    """Returns a function that sends ``payload`` once over ``kind`` (connection set up inside)."""
    import grpc

    from fedcore.transport import Identity, Limits, RpcClient, encode_chunks

    if kind in ("raw TCP socket", "raw TLS socket"):
        flat = b"".join(encode_chunks(payload, chunk_bytes=CHUNK))
        view = memoryview(flat)
        context = None
        if kind == "raw TLS socket":
            cert, key, ca = _write_pems(folder, client_bundle, "client")
            context = ssl.create_default_context(cafile=ca)
            context.load_cert_chain(cert, key)
        return lambda: _send_raw(port, view, context)
    if kind in ("raw gRPC + mTLS", "raw gRPC, no TLS"):
        chunks = list(encode_chunks(payload, chunk_bytes=CHUNK))
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
            del payload, senders
    return results


def _encoded_lengths(payload: Any) -> Iterator[bytes]:
    from fedcore.transport import encode_chunks

    return encode_chunks(payload, chunk_bytes=CHUNK)


# ------------------------------------------------------------------------------ report


def render(data: dict[str, Any]) -> str:
    """The docs/benchmarks.md section."""
    bw, agg = data["memory"], data["aggregation"]
    agg_share = agg["median"] / bw["copy_median"]
    lines = [
        BEGIN,
        "## Limits: aggregation against memory bandwidth, transport against raw loopback",
        "",
        f"Measured by `python -m benchmarks.limits --write` ({data['machine']}); "
        f"{data['repeats']} repeats, sides alternating; medians (best in brackets). Load average "
        f"(1/5/15 min) {data['load_start']} at the start, {data['load_end']} at the end.",
        "",
        "| aggregation | GB/s | share of copy bandwidth |",
        "|---|---|---|",
        f"| memory copy, numpy, 1 GiB (read + write) | {bw['copy_median'] / 1e9:.2f} "
        f"({bw['copy_best'] / 1e9:.2f}) | 100% |",
        f"| fedcore weighted_mean, {agg['clients']} x {agg['model_bytes'] // MB} MB float32 "
        f"(inputs read + result written) | {agg['median'] / 1e9:.2f} ({agg['best'] / 1e9:.2f}) "
        f"| **{agg_share:.0%}** |",
        f"| fedcore server round: {agg['clients']} upload checks (shape, finiteness, example "
        f"count, step norm; docs/security.md) + weighted_mean + aggregate check, same bytes "
        f"counted | {agg['checked_median'] / 1e9:.2f} ({agg['checked_best'] / 1e9:.2f}) "
        f"| {agg['checked_median'] / bw['copy_median']:.0%} |",
        "",
        f"Aggregation target (at least 50% of memory bandwidth): "
        f"**{'met' if agg_share >= 0.5 else 'missed'}** ({agg_share:.0%}). "
        + aggregation_cause(data),
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


def tls_share(rates: dict[str, float]) -> float:
    """fedcore's throughput as a share of the raw TLS socket's (the transport target)."""
    return rates["fedcore RpcClient.call"] / rates["raw TLS socket"]


def aggregation_cause(data: dict[str, Any]) -> str:
    """What bounds the aggregation, from the in-cache timings of its steps."""
    ns = data["per_element"]
    clients = data["aggregation"]["clients"]
    step = ns["widen and scale"] + ns["add float64"]
    # Bytes that must move per element of the model: K float32 inputs read, one result written.
    bound = (clients + 1) * 4 / (clients * step)
    return (
        "What bounds it is arithmetic, not memory: the spec accumulates in float64, so each "
        "float32 element of each upload is widened, scaled and added. In cache (no memory "
        f"traffic at all) numpy takes {ns['widen and scale']:.2f} ns per element to widen and "
        f"scale (of which {ns['widen float32 to float64']:.2f} ns is the widening alone) and "
        f"{ns['add float64']:.2f} ns to add, against {ns['copy float32']:.2f} ns to copy a "
        f"float32 element; that caps weighted_mean at about {bound:.1f} GB/s on this core, "
        "whatever the memory. weighted_mean now works in cache-sized blocks (inputs read once, "
        "result written once; bit-identical results), which doubled it against the "
        "whole-tensor version that made float64 temporaries of every upload. Reaching 50% "
        "would need the widening vectorised (numpy's float32-to-float64 cast is several times "
        "slower than its float64 arithmetic here), a compiled fused kernel, or float32 "
        "accumulation, which the spec rules out."
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
        "decoder on its event loop; the handler runs in a worker thread)."
    )


def run(repeats: int = 3, sizes: tuple[int, ...] = (100 * MB, 1000 * MB)) -> dict[str, Any]:
    """Measures everything; returns the numbers."""
    data: dict[str, Any] = {"machine": machine(), "repeats": repeats, "load_start": load()}
    data["memory"] = memory_bandwidth(max(repeats, 5))
    data["aggregation"] = aggregation(max(repeats, 5))
    data["per_element"] = per_element()
    print(
        f"memory copy {data['memory']['copy_median'] / 1e9:.2f} GB/s, aggregation "
        f"{data['aggregation']['median'] / 1e9:.2f} GB/s",
        file=sys.stderr,
    )
    data["transport"] = transport(repeats, sizes)
    data["load_end"] = load()
    return data


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the measurements, prints the section and (with --write) updates the docs."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes-mb", default="100,1000", help="model sizes in MB")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args(argv)
    sizes = tuple(int(s) * MB for s in args.sizes_mb.split(","))
    data = run(args.repeats, sizes)
    section = render(data)
    print(section)
    if args.write:
        write_section(section, begin=BEGIN, end=END)
        save_data("limits", data)
    return data


if __name__ == "__main__":
    main()

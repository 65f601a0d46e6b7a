"""Sites: what the hub's endpoint costs a link, and what sites cost a run's start and rounds.

* **Links**: one mutual-TLS link from a client to a party, carrying a bulk transfer (MB/s)
  and small request-answer exchanges (round-trip time): **direct** (TLS on loopback, the
  floor), **spliced** (through the hub's endpoint, routed by its TLS server name: how a site's
  client reaches the server and the KDC), and **relayed** (through the endpoint and the
  callee's site's dial-back: how lppa's peer links cross sites). The raw-socket row is the
  same transfer without TLS, for scale.
* **Runs**: examples/sites/consortium.yaml (three hospitals as three sites, each its own
  processes, keys and policy) against the same four clients run from one place
  (examples/hospitals-tabular.yaml): start-up (launch to the first round) and the median
  round.

``--write`` replaces the sites section of docs/benchmarks.md. Sides alternate per repeat;
medians are reported.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.spine import write_section
from fedcore.sites._api import load_identity
from fedcore.transport import (
    RunCa,
    SniRouter,
    TlsBundle,
    TunnelBroker,
    dial,
    forward_to,
    splice,
)

BEGIN = "<!-- sites:begin -->"
END = "<!-- sites:end -->"
ROOT = Path(__file__).resolve().parents[1]
CHUNK = 256 * 1024
PING = 1024


def _server_context(bundle: TlsBundle) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    load_identity(context, bundle)
    context.load_verify_locations(cadata=bundle.ca_pem.decode())
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def _client_context(bundle: TlsBundle) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=bundle.ca_pem.decode())
    load_identity(context, bundle)
    return context


def _serve_echo(listener: socket.socket, context: ssl.SSLContext | None) -> None:
    """Answers each connection: a bulk upload is acknowledged with one byte, a ping echoed."""
    while True:
        try:
            connection, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_echo, args=(connection, context), daemon=True).start()


def _echo(connection: socket.socket, context: ssl.SSLContext | None) -> None:
    channel: socket.socket = connection
    try:
        if context is not None:
            channel = context.wrap_socket(connection, server_side=True)
        header = _read_exact(channel, 9)
        kind, size = header[:1], int.from_bytes(header[1:], "big")
        if kind == b"B":  # bulk: read size bytes, answer one byte
            left = size
            while left:
                left -= len(channel.recv(min(CHUNK, left)))
            channel.sendall(b"k")
        else:  # pings: size exchanges of PING bytes
            for _ in range(size):
                channel.sendall(_read_exact(channel, PING))
    except OSError:
        pass
    finally:
        channel.close()


def _read_exact(channel: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = channel.recv(count - len(data))
        if not chunk:
            raise OSError("closed")
        data += chunk
    return bytes(data)


def _bulk(connect: Callable[[], socket.socket], size: int) -> float:
    """MB/s of one upload of ``size`` bytes (acknowledged at the end)."""
    channel = connect()
    payload = os.urandom(CHUNK)
    started = time.perf_counter()
    channel.sendall(b"B" + size.to_bytes(8, "big"))
    sent = 0
    while sent < size:
        channel.sendall(payload[: min(CHUNK, size - sent)])
        sent += min(CHUNK, size - sent)
    assert _read_exact(channel, 1) == b"k"
    seconds = time.perf_counter() - started
    channel.close()
    return size / seconds / 1e6


def _pings(connect: Callable[[], socket.socket], count: int) -> float:
    """Median round trip of ``count`` exchanges of 1 KiB, in microseconds."""
    channel = connect()
    channel.sendall(b"P" + count.to_bytes(8, "big"))
    message = os.urandom(PING)
    times = []
    for _ in range(count):
        started = time.perf_counter()
        channel.sendall(message)
        _read_exact(channel, PING)
        times.append(time.perf_counter() - started)
    channel.close()
    return statistics.median(times) * 1e6


class Links:
    """The four ways to reach an echo party: raw, direct TLS, spliced, relayed."""

    def __init__(self) -> None:
        ca = RunCa.generate("bench")
        self.callee = ca.issue("client-2")
        self.caller = ca.issue("client-1")
        self.raw = socket.create_server(("127.0.0.1", 0))
        self.tls = socket.create_server(("127.0.0.1", 0))
        for listener, context in (
            (self.raw, None),
            (self.tls, _server_context(self.callee)),
        ):
            threading.Thread(target=_serve_echo, args=(listener, context), daemon=True).start()
        tls_port = self.tls.getsockname()[1]
        self.broker = TunnelBroker(lambda target: "site" if target.startswith("client-2") else None)

        def route(name: str) -> Any:
            if name == "server.fedcore.invalid":
                return forward_to(f"127.0.0.1:{tls_port}")
            if name.startswith("client-2."):
                return lambda connection: self.broker.call(name, connection)
            return None

        self.router = SniRouter("127.0.0.1:0", route, broker=self.broker)
        self.router.start()
        threading.Thread(target=self._site, args=(tls_port,), daemon=True).start()
        self._context = _client_context(self.caller)

    def _site(self, port: int) -> None:
        """The callee's site: dials back for each relay and splices it to the callee."""
        while True:
            for token, _ in self.broker.requests("site", timeout=60):
                back = dial(f"127.0.0.1:{self.router.port}")
                back.sendall(b"FCTUNNEL " + token.encode() + b"\n")
                local = socket.create_connection(("127.0.0.1", port))
                back.settimeout(None)
                threading.Thread(target=splice, args=(back, local), daemon=True).start()

    def connect(self, side: str) -> socket.socket:
        if side == "raw":
            return socket.create_connection(self.raw.getsockname())
        if side == "direct":
            raw = socket.create_connection(self.tls.getsockname())
            name = "client-2.fedcore.invalid"
        else:
            raw = socket.create_connection(("127.0.0.1", self.router.port))
            name = "server.fedcore.invalid" if side == "spliced" else "client-2.fedcore.invalid"
        context = self._context
        if side == "spliced":  # the callee's certificate names client-2, not the server
            context = _client_context(self.caller)
            context.check_hostname = False
        return context.wrap_socket(raw, server_hostname=name)


def _run(manifest: Path, workdir: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "fedcore", "run", str(manifest), "--workdir", str(workdir),
         "--json", "--quiet"],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--megabytes", type=int, default=256, help="bulk transfer size")
    parser.add_argument("--pings", type=int, default=2000, help="1 KiB round trips")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3, help="repeats of each run")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    links = Links()
    sides = ("raw", "direct", "spliced", "relayed")
    bulk: dict[str, list[float]] = {side: [] for side in sides}
    rtt: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(args.repeats):
        for side in sides:

            def connect(side: str = side) -> socket.socket:
                return links.connect(side)

            bulk[side].append(_bulk(connect, args.megabytes * 2**20))
            rtt[side].append(_pings(connect, args.pings))
    print({side: statistics.median(v) for side, v in bulk.items()})
    print({side: statistics.median(v) for side, v in rtt.items()})
    runs: dict[str, list[dict[str, Any]]] = {"one place": [], "three sites": []}
    manifests = {
        "one place": ROOT / "examples" / "hospitals-tabular.yaml",
        "three sites": ROOT / "examples" / "sites" / "consortium.yaml",
    }
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.runs):
            for side, manifest in manifests.items():
                workdir = Path(tmp) / f"{side.replace(' ', '-')}-{repeat}"
                runs[side].append(_run(manifest, workdir))
                shutil.rmtree(workdir, ignore_errors=True)
                print(side, runs[side][-1]["startup_seconds"], runs[side][-1]["wall_seconds"])
    direct_bulk = statistics.median(bulk["direct"])
    direct_rtt = statistics.median(rtt["direct"])
    lines = [
        BEGIN,
        "## Sites: the hub's endpoint and a consortium's run",
        "",
        f"`python benchmarks/sites.py --write` on {dt.date.today()}, {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}; medians of "
        f"{args.repeats} alternating repeats. One mutual-TLS link (Python's ssl on both ends) "
        f"carries a {args.megabytes} MiB upload and {args.pings:,} exchanges of 1 KiB: "
        f"**direct** on loopback (the floor), **spliced** through the hub's endpoint (routed "
        f"by its TLS server name, TLS untouched: a site's client to the server or the KDC), "
        f"**relayed** through the endpoint and the callee's site's dial-back (lppa's peer "
        f"links across sites). Raw is the same upload over a plain socket.",
        "",
        "| link | upload | vs direct | 1 KiB round trip | vs direct |",
        "|---|---|---|---|---|",
    ]
    for side in sides:
        mbps = statistics.median(bulk[side])
        micro = statistics.median(rtt[side])
        lines.append(
            f"| {side} | {mbps:,.0f} MB/s | {mbps / direct_bulk:.2f}x | {micro:,.0f} us | "
            f"{micro / direct_rtt:.2f}x |"
        )
    one, three = runs["one place"], runs["three sites"]

    def median(side: list[dict[str, Any]], key: str) -> float:
        return float(statistics.median(float(run[key]) for run in side))

    lines += [
        "",
        f"The consortium example (three hospitals, each a site with its own processes, keys "
        f"and policy; DP-FedAvg, 15 rounds) against the same four clients run from one place "
        f"(examples/hospitals-tabular.yaml), {args.runs} alternating runs each. Start-up is "
        f"launch to the first round: for sites it includes each site's join (a fresh key and "
        f"a signed request), its review of the run, its clients' keys and certificates, and "
        f"each site's own start of torch; on this machine the three sites and the hub share "
        f"its {os.cpu_count()} cores, where a real consortium has a machine each.",
        "",
        "| run | start-up | median round | wall |",
        "|---|---|---|---|",
        f"| one place | {median(one, 'startup_seconds'):.1f} s | "
        f"{median(one, 'median_round_seconds') * 1000:.0f} ms | "
        f"{median(one, 'wall_seconds'):.1f} s |",
        f"| three sites | {median(three, 'startup_seconds'):.1f} s "
        f"({median(three, 'startup_seconds') / median(one, 'startup_seconds'):.1f}x) | "
        f"{median(three, 'median_round_seconds') * 1000:.0f} ms "
        f"({median(three, 'median_round_seconds') / median(one, 'median_round_seconds'):.2f}x)"
        f" | {median(three, 'wall_seconds'):.1f} s |",
        END,
    ]
    section = "\n".join(lines)
    print(section)
    if args.write:
        write_section(section, begin=BEGIN, end=END)


if __name__ == "__main__":
    main()

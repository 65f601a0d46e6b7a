"""EBS-CFL's cost and robustness: the encoded pipeline against a plaintext aggregation, and
accuracy with 40% attackers against FedAvg and the coordinate-wise median.

**Scaling** (in one process, the protocol's own classes): for each (n clients, m clusters,
l parameters) the KDC (``EbscflKdc``), n clients' encodings (``_ebscfl_maths.encode``) and the
server (``EbscflServer``: open, check and score every upload, SRFC, weighted decode) run one
round on synthetic unit updates, twice: once timed, once under tracemalloc for the memory
peaks (plus the uploads the server holds) per role and round, next to the plaintext
aggregation of the same updates (``aggregators.rfca``) and the largest difference between the
two aggregates. Local training is left out: it is the same with or without the encoding.

**Accuracy** (``fedcore run --simulate``'s maths, ``fedcore.simulation``): examples/digits-
ebscfl.yaml (digits in 2 label-shifted clusters, Dirichlet non-IID, 10 clients of which 4
attack) under LabelFlip and SignFlip, for ebscfl, fedavg (Mean), fedavg with Median, and IFCA.

``--write`` replaces the ebscfl section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import gc
import os
import platform
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.spine import write_section
from fedcore import aggregators
from fedcore.protocols import KeyChannel
from fedcore.protocols import _ebscfl_maths as maths
from fedcore.protocols.ebscfl import EbscflKdc, EbscflServer
from fedcore.simulation import LocalKeyChannel
from fedcore.spec._options import EbscflOptions
from fedcore.transport import Identity, Payload

BEGIN = "<!-- ebscfl:begin -->"
END = "<!-- ebscfl:end -->"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits-ebscfl.yaml"

SCALING: list[tuple[int, int, int]] = [
    (20, 2, 10_000),
    (20, 2, 100_000),
    (20, 2, 1_000_000),
    (10, 2, 100_000),
    (50, 2, 100_000),
    (100, 2, 100_000),
    (20, 4, 100_000),
    (20, 8, 100_000),
    (100, 2, 1_000_000),
]
"""(n, m, l) of the scaling table: l, then n, then m, then the headline."""
QUICK: list[tuple[int, int, int]] = [(4, 2, 5_000), (8, 2, 20_000), (8, 4, 20_000)]


class TimedChannel(KeyChannel):
    """The server's in-process KDC channel, timing the KDC's side of each call."""

    def __init__(self, kdc: EbscflKdc) -> None:
        self.inner = LocalKeyChannel(kdc, Identity("server"))
        self.seconds = 0.0

    def submit(self, payload: Payload) -> Payload:
        started = time.perf_counter()
        answer = self.inner.submit(payload)
        self.seconds += time.perf_counter() - started
        return answer


def traced(call: Callable[[], Any]) -> tuple[Any, float, int]:
    """(result, seconds, peak bytes traced, 0 when tracemalloc is off) of one call."""
    if not tracemalloc.is_tracing():
        started = time.perf_counter()
        result = call()
        return result, time.perf_counter() - started, 0
    tracemalloc.reset_peak()
    start_bytes = tracemalloc.get_traced_memory()[0]
    started = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - started
    return result, seconds, tracemalloc.get_traced_memory()[1] - start_bytes


def scaling_row(n: int, m: int, length: int, mode: str = "Repaired") -> dict[str, Any]:
    """One round of the encoded pipeline at (n, m, l), and the plaintext aggregate."""
    gc.collect()
    rng = np.random.default_rng([n, m, length])
    options = EbscflOptions(mode=mode, clusters=m, layout="Layered", group_size=1)
    g0 = rng.standard_normal((m, length))
    g0_units = g0 / np.linalg.norm(g0, axis=1, keepdims=True)
    clusters = [i % m for i in range(n)]
    kdc = EbscflKdc(options=options, count=n)
    channel = TimedChannel(kdc)
    like = {"w": np.zeros(length)}
    server = EbscflServer(like, options=options, models=np.zeros((m, length)), root_updates=g0)
    server.setup(channel)
    (plans, open_s, open_b) = traced(lambda: server.plan_round(1, list(range(n))))
    nonce = plans[0].meta["nonce"]
    units: list[np.ndarray] = []
    uploads: dict[int, Payload] = {}
    kdc_client_s = client_s = 0.0
    kdc_client_b = client_b = 0
    geometry = maths.Geometry(length, m, 1, 1, 1)
    for k in range(n):
        unit = g0_units[clusters[k]] + 1.5 * rng.standard_normal(length) / np.sqrt(length)
        if k % 5 == 4:  # every fifth client opposes its cluster's g_0: weight zero
            unit = -unit
        unit /= np.linalg.norm(unit)
        units.append(unit)

        def fetch(k: int = k) -> Payload:
            return kdc.issue_keys(1, Identity("client", k))

        keys, seconds, peak = traced(fetch)
        kdc_client_s += seconds
        kdc_client_b = max(kdc_client_b, peak)
        t = keys.tensors

        def encode(unit: np.ndarray = unit, k: int = k, t: dict[str, np.ndarray] = t) -> Any:
            return maths.encode(
                unit, clusters[k], geometry, t["embedding"], t["slot"], t["mask_key"]
            )

        delta, seconds, peak = traced(encode)
        client_s += seconds
        client_b = max(client_b, peak)
        uploads[k] = Payload(meta={"nonce": nonce, "attempt": 1}, tensors={"delta": delta})
        del keys, t
    held = sum(u.tensors["delta"].nbytes for u in uploads.values())

    def check_all() -> None:
        for k in range(n):
            server.check_upload(1, k, uploads[k])

    _, check_s, check_b = traced(check_all)
    theta = server._theta.copy()
    result, combine_s, combine_b = traced(lambda: server.combine(1, uploads, []))
    decoded = (server._theta - theta) / server._root_norms[:, None]  # eta_g(1) = 1
    plain, plain_s, plain_b = traced(lambda: aggregators.rfca(units, clusters, g0_units))
    uploads.clear()
    return {
        "n": n,
        "m": m,
        "l": length,
        "kdc_s": channel.seconds + kdc_client_s,
        "kdc_client_s": kdc_client_s / n,
        "kdc_peak": max(kdc_client_b, open_b),
        "client_s": client_s / n,
        "client_peak": client_b,
        "upload_bytes": held // n,
        "server_s": open_s + check_s + combine_s - channel.seconds,
        "server_peak": held + max(check_b, combine_b),
        "plain_s": plain_s,
        "plain_peak": sum(u.nbytes for u in units) + plain_b,
        "error": float(np.abs(decoded - plain[0]).max()),
        "weight_total": result.metrics["weight_total"] if result else None,
    }


def render_scaling(rows: list[dict[str, Any]]) -> list[str]:
    mib = 2**20
    lines = [
        "| n | m | l | KDC s/round (per client) | KDC peak MiB | client encode ms | client "
        "peak MiB | upload MiB | server s/round | server peak MiB (uploads held) | plaintext "
        "s | plaintext peak MiB | max abs difference |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n']} | {r['m']} | {r['l']:,} | {r['kdc_s']:.2f} ({r['kdc_client_s']:.3f}) | "
            f"{r['kdc_peak'] / mib:,.0f} | {r['client_s'] * 1000:.1f} | "
            f"{r['client_peak'] / mib:,.0f} | {r['upload_bytes'] / mib:.1f} | "
            f"{r['server_s']:.2f} | {r['server_peak'] / mib:,.0f} "
            f"({r['upload_bytes'] * r['n'] / mib:,.0f}) | {r['plain_s']:.3f} | "
            f"{r['plain_peak'] / mib:,.0f} | {r['error']:.1e} |"
        )
    return lines


# ---------------------------------------------------------------------------- accuracy

ACCURACY: dict[str, dict[str, Any]] = {
    "ebscfl": {"name": "ebscfl"},
    "fedavg": {"name": "fedavg"},
    "median": {"name": "fedavg", "fedavg": {"aggregator": "Median"}},
    "ifca": {"name": "fedavg", "fedavg": {"clusters": 2}},
}
ATTACKS = ("none", "LabelFlip", "SignFlip")


def accuracy_row(protocol: str, attack: str, rounds: int | None) -> dict[str, Any]:
    """One simulated run of the example with ``protocol`` under ``attack``."""
    from fedcore.simulation import simulate
    from fedcore.spec import parse_manifest

    document = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    spec = document["spec"]
    block = copy.deepcopy(ACCURACY[protocol])
    if protocol == "ebscfl":
        block["ebscfl"] = spec["protocol"]["ebscfl"]
    spec["protocol"] = block
    if attack == "none":
        spec.pop("attack", None)
    else:
        spec["attack"] = {**spec["attack"], "kind": attack}
    if rounds is not None:
        spec["rounds"] = rounds
    started = time.perf_counter()
    result = simulate(parse_manifest(document))
    return {
        "protocol": protocol,
        "attack": attack,
        "accuracy": result.accuracy,
        "seconds": time.perf_counter() - started,
    }


def render_accuracy(rows: list[dict[str, Any]]) -> list[str]:
    table: dict[str, dict[str, float]] = {}
    for r in rows:
        table.setdefault(r["protocol"], {})[r["attack"]] = r["accuracy"]
    lines = [
        "| protocol | no attack | 40% LabelFlip | 40% SignFlip (x10) |",
        "|---|---|---|---|",
    ]
    names = {
        "ebscfl": "ebscfl",
        "fedavg": "fedavg (Mean)",
        "median": "fedavg, Median",
        "ifca": "fedavg, IFCA (2 clusters)",
    }
    for protocol, found in table.items():
        cells = [f"{found[a]:.4f}" if a in found else "-" for a in ATTACKS]
        lines.append(f"| {names[protocol]} | " + " | ".join(cells) + " |")
    return lines


# ------------------------------------------------------------------------------- main


def render(scaling: list[dict[str, Any]], accuracy: list[dict[str, Any]], note: str) -> str:
    import torch

    import fedcore

    example = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))["spec"]
    lines = [
        BEGIN,
        "## ebscfl: the encoded pipeline against plaintext, and accuracy under attack",
        "",
        f"Measured {dt.date.today().isoformat()} by `python benchmarks/ebscfl.py --write` on "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, fedcore {fedcore.__version__}. {note}",
        "",
    ]
    if scaling:
        lines += [
            "One round of the protocol's own classes in one process, Repaired mode, Layered "
            "(one key space per client), segment length 1, on synthetic unit updates (every "
            "fifth opposed to its cluster's g_0, so filtered). KDC: every client's keys and "
            "every score extractor the server fetches (in brackets, one client's keys). "
            "Client: the encoding only (training is the same without it). Server: open, "
            "check, score, SRFC and decode, without the KDC's share; its peak counts the "
            "uploads it must hold until the last one is checked. Plaintext: RFCA "
            "(`aggregators.rfca`) on the same unit updates, which it holds. The difference "
            "is the largest entry of the decoded aggregate minus the plaintext one.",
            "",
            *render_scaling(scaling),
            "",
        ]
    if accuracy:
        lines += [
            f"Accuracy: examples/digits-ebscfl.yaml ({example['rounds']} rounds, "
            f"{example['clients']['count']} clients, 2 label-shifted data clusters, "
            "Dirichlet 1.0, 40% attackers chosen by seed) simulated in one process "
            "(the same maths as `fedcore run`), held-out accuracy over both clusters' test "
            "copies (clustered models: each copy scored by its lowest-loss model).",
            "",
            *render_accuracy(accuracy),
            "",
        ]
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=["scaling", "accuracy", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="small sizes only (a smoke test)")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--note", default="", help="a sentence added to the section's header")
    args = parser.parse_args()
    with threadpool_limits(limits=1):  # one BLAS thread: on a shared 2-core box more only spin
        run(args)


def run(args: argparse.Namespace) -> None:
    """Runs the parts ``args`` asks for and prints (or writes) the section."""
    scaling: list[dict[str, Any]] = []
    accuracy: list[dict[str, Any]] = []
    if args.part in {"scaling", "all"}:
        for n, m, length in QUICK if args.quick else SCALING:
            row = scaling_row(n, m, length)  # times, without tracemalloc's overhead
            tracemalloc.start()
            memory = scaling_row(n, m, length)  # memory: the same round again, traced
            tracemalloc.stop()
            row.update(
                {k: memory[k] for k in ("kdc_peak", "client_peak", "server_peak", "plain_peak")}
            )
            print(
                f"n={n} m={m} l={length}: kdc {row['kdc_s']:.2f}s client "
                f"{row['client_s'] * 1000:.1f}ms server {row['server_s']:.2f}s plain "
                f"{row['plain_s']:.3f}s error {row['error']:.1e}",
                file=sys.stderr,
                flush=True,
            )
            scaling.append(row)
    if args.part in {"accuracy", "all"}:
        for protocol in ACCURACY:
            for attack in ATTACKS:
                if protocol == "ifca" and attack != "LabelFlip":
                    continue
                row = accuracy_row(protocol, attack, 3 if args.quick else None)
                print(f"{protocol} {attack}: {row['accuracy']:.4f}", file=sys.stderr, flush=True)
                accuracy.append(row)
    section = render(scaling, accuracy, args.note)
    print(section)
    if args.write:
        write_section(section, begin=BEGIN, end=END)


if __name__ == "__main__":
    main()

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
import functools
import gc
import json
import os
import platform
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.spine import write_section
from fedcore.protocols import KeyChannel
from fedcore.protocols.ebscfl import maths
from fedcore.protocols.ebscfl.protocol import EbscflKdc, EbscflServer
from fedcore.protocols.fedavg import aggregators
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
    (50, 2, 100_000),
    (100, 2, 100_000),
    (20, 4, 100_000),
    (100, 2, 1_000_000),
]
"""(n, m, l) of the scaling table: l, then n, then m, then the headline."""
QUICK: list[tuple[int, int, int]] = [(4, 2, 5_000), (8, 2, 20_000), (8, 4, 20_000)]
HEAVY = 2 * 10**7
"""n*m*l above which a scaling row gets fewer repeats (a round of 100 x 2 x 1M takes ~1.5 min)."""


def repeats_of(n: int, m: int, length: int, asked: int) -> int:
    """``asked`` repeats, 2 above HEAVY and 1 above 2.5 HEAVY (the l = 1M rows)."""
    size = n * m * length
    return asked if size <= HEAVY else min(asked, 2 if size <= 2.5 * HEAVY else 1)


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


def synthetic_updates(
    n: int, m: int, length: int
) -> tuple[np.ndarray, np.ndarray, list[int], list[np.ndarray]]:
    """(g_0, unit g_0, clusters, unit updates) of a seeded synthetic round at (n, m, l): each
    update near its cluster's g_0, every fifth one opposed to it (so filtered)."""
    rng = np.random.default_rng([n, m, length])
    g0 = rng.standard_normal((m, length))
    g0_units = g0 / np.linalg.norm(g0, axis=1, keepdims=True)
    clusters = [i % m for i in range(n)]
    units = []
    for k in range(n):
        unit = g0_units[clusters[k]] + 1.5 * rng.standard_normal(length) / np.sqrt(length)
        if k % 5 == 4:
            unit = -unit
        units.append(unit / np.linalg.norm(unit))
    return g0, g0_units, clusters, units


def encoded_round(
    g0: np.ndarray,
    clusters: list[int],
    units: list[np.ndarray],
    mode: Literal["Faithful", "Repaired"] = "Repaired",
) -> dict[str, Any]:
    """One round of the protocol's classes on ``units``: seconds and traced peaks per role,
    and the decoded per-cluster aggregates (m x l)."""
    gc.collect()
    m, length = g0.shape
    n = len(units)
    options = EbscflOptions(mode=mode, clusters=m, layout="Layered", group_size=1)
    kdc = EbscflKdc(options=options, count=n)
    channel = TimedChannel(kdc)
    like = {"w": np.zeros(length)}
    server = EbscflServer(like, options=options, models=np.zeros((m, length)), root_updates=g0)
    server.setup(channel)
    (plans, open_s, open_b) = traced(lambda: server.plan_round(1, list(range(n))))
    nonce = plans[0].meta["nonce"]
    uploads: dict[int, Payload] = {}
    kdc_client_s = client_s = 0.0
    kdc_client_b = client_b = 0
    geometry = maths.Geometry(length, m, 1, 1, 1)
    for k in range(n):

        def fetch(k: int = k) -> Payload:
            return kdc.issue_keys(1, Identity("client", k))

        keys, seconds, peak = traced(fetch)
        kdc_client_s += seconds
        kdc_client_b = max(kdc_client_b, peak)
        t = keys.tensors

        def encode(k: int = k, t: dict[str, np.ndarray] = t) -> Any:
            return maths.encode(
                units[k], clusters[k], geometry, t["embedding"], t["slot"], t["mask_key"]
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
    uploads.clear()
    return {
        "kdc_s": channel.seconds + kdc_client_s,
        "kdc_client_s": kdc_client_s / n,
        "kdc_peak": max(kdc_client_b, open_b),
        "client_s": client_s / n,
        "client_peak": client_b,
        "upload_bytes": held // n,
        "server_s": open_s + check_s + combine_s - channel.seconds,
        "server_peak": held + max(check_b, combine_b),
        "decoded": (server._theta - theta) / server._root_norms[:, None],  # eta_g(1) = 1
        "weight_total": result.metrics["weight_total"] if result else None,
    }


def plaintext_round(
    clusters: list[int], units: list[np.ndarray], g0_units: np.ndarray
) -> dict[str, Any]:
    """RFCA (``aggregators.rfca``) on the same unit updates, which it holds: seconds, traced
    peak (plus the updates) and the aggregates."""
    gc.collect()
    (aggregate, _, _), seconds, peak = traced(lambda: aggregators.rfca(units, clusters, g0_units))
    return {
        "plain_s": seconds,
        "plain_peak": sum(u.nbytes for u in units) + peak,
        "aggregate": aggregate,
    }


def scaling_row(n: int, m: int, length: int, repeats: int) -> dict[str, Any]:
    """(n, m, l): ``repeats`` rounds of each side, alternating which goes first, then both
    once more under tracemalloc for the memory peaks; medians of the seconds."""
    g0, g0_units, clusters, units = synthetic_updates(n, m, length)
    runs: list[dict[str, Any]] = []
    error = 0.0
    for repeat in range(repeats):
        if repeat % 2:
            plain = plaintext_round(clusters, units, g0_units)
            encoded = encoded_round(g0, clusters, units)
        else:
            encoded = encoded_round(g0, clusters, units)
            plain = plaintext_round(clusters, units, g0_units)
        error = max(error, float(np.abs(encoded.pop("decoded") - plain.pop("aggregate")).max()))
        runs.append({**encoded, **plain})
    tracemalloc.start()
    try:
        encoded = encoded_round(g0, clusters, units)
        memory = {**encoded, **plaintext_round(clusters, units, g0_units)}
    finally:
        tracemalloc.stop()
    row: dict[str, Any] = {"n": n, "m": m, "l": length, "repeats": repeats, "error": error}
    for key in ("kdc_s", "kdc_client_s", "client_s", "server_s", "plain_s"):
        row[key] = float(np.median([r[key] for r in runs]))
    row["ratios"] = [r["server_s"] / r["plain_s"] for r in runs]
    row["ratio"] = float(np.median(row["ratios"]))
    row["upload_bytes"] = runs[0]["upload_bytes"]
    row["weight_total"] = runs[0]["weight_total"]
    row.update({k: memory[k] for k in ("kdc_peak", "client_peak", "server_peak", "plain_peak")})
    return row


def render_scaling(rows: list[dict[str, Any]]) -> list[str]:
    mib = 2**20
    lines = [
        "| n | m | l | repeats | server s/round | plaintext s | server / plaintext (each "
        "repeat) | server peak MiB (uploads held) | plaintext peak MiB | client encode ms "
        "| client peak MiB | upload MiB (x plaintext) | KDC s/round (per client) | KDC peak "
        "MiB | max abs difference |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        each = ", ".join(f"{x:.0f}" for x in r["ratios"])
        lines.append(
            f"| {r['n']} | {r['m']} | {r['l']:,} | {r['repeats']} | {r['server_s']:.2f} | "
            f"{r['plain_s']:.3f} | **{r['ratio']:.0f}x** ({each}) | "
            f"{r['server_peak'] / mib:,.0f} ({r['upload_bytes'] * r['n'] / mib:,.0f}) | "
            f"{r['plain_peak'] / mib:,.0f} | {r['client_s'] * 1000:.1f} | "
            f"{r['client_peak'] / mib:,.0f} | {r['upload_bytes'] / mib:.1f} "
            f"(x{r['upload_bytes'] / (8 * r['l']):.0f}) | {r['kdc_s']:.2f} "
            f"({r['kdc_client_s']:.3f}) | {r['kdc_peak'] / mib:,.0f} | {r['error']:.1e} |"
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
SKIPPED = {("fedavg", "none"), ("median", "none"), *(("ifca", a) for a in ATTACKS)}
"""Cells left out of the default run (each costs a 30-round simulation; ``--all-cells``)."""


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
    rounds = int(spec.get("rounds", 1))
    started = time.perf_counter()
    result = simulate(parse_manifest(document))
    return {
        "protocol": protocol,
        "attack": attack,
        "rounds": rounds,
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
            "(one key space per client, the mode that scales), segment length 1, on synthetic "
            "unit updates (every fifth opposed to its cluster's g_0, so filtered), against "
            "the plaintext aggregation of the same updates: RFCA (`aggregators.rfca`, the "
            "clustered FLTrust that ebscfl computes). Each row runs both sides `repeats` "
            "times, alternating which goes first, and reports medians; the machine is shared "
            "with other work, so read the **ratio** (server over plaintext, same run), not the "
            "absolute seconds. Server: open, check, score, SRFC and decode, without the KDC's "
            "share; its peak (tracemalloc, one more round) counts the uploads it must hold "
            "until the last one is checked. Client: the encoding only (training is the same "
            "without it); the upload is 3*m float64 numbers per parameter. KDC: every "
            "client's keys and every score extractor the server fetches (in brackets, one "
            "client's keys). The difference is the largest entry of the decoded aggregate "
            "minus the plaintext one.",
            "",
            *render_scaling(scaling),
            "",
        ]
    if accuracy:
        lines += [
            f"Accuracy: examples/digits-ebscfl.yaml ({accuracy[0]['rounds']} rounds, "
            f"{example['clients']['count']} clients, 2 label-shifted data clusters, "
            "Dirichlet 1.0, 40% attackers chosen by seed) simulated in one process "
            "(the same maths as `fedcore run`), held-out accuracy over both clusters' test "
            "copies (clustered models: each copy scored by its lowest-loss model), one seed "
            "(0) per cell. A single model cannot fit both label-shifted clusters, so fedavg "
            "and its Median stay near half accuracy even without attackers.",
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
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds per side of each scaling row (default 3)"
    )
    parser.add_argument(
        "--all-cells", action="store_true", help="also fedavg without attack, and IFCA"
    )
    parser.add_argument(
        "--cache",
        type=Path,
        help="a JSON file of finished rows: reused by a rerun, extended as rows finish",
    )
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--note", default="", help="a sentence added to the section's header")
    args = parser.parse_args()
    with threadpool_limits(limits=1):  # one BLAS thread: on a shared 2-core box more only spin
        run(args)


def cached(cache: Path | None, key: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The row ``key`` of the JSON file ``cache`` if there, else ``compute()`` saved there."""
    rows = json.loads(cache.read_text(encoding="utf-8")) if cache and cache.exists() else {}
    if key in rows:
        return dict(rows[key])
    row = compute()
    if cache is not None:
        rows[key] = row
        cache.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return row


def run(args: argparse.Namespace) -> None:
    """Runs the parts ``args`` asks for and prints (or writes) the section."""
    scaling: list[dict[str, Any]] = []
    accuracy: list[dict[str, Any]] = []
    if args.part in {"scaling", "all"}:
        for n, m, length in QUICK if args.quick else SCALING:
            repeats = repeats_of(n, m, length, args.repeats)
            row = cached(
                args.cache,
                f"scaling/{n}/{m}/{length}/{repeats}",
                functools.partial(scaling_row, n, m, length, repeats),
            )
            print(
                f"n={n} m={m} l={length}: kdc {row['kdc_s']:.2f}s client "
                f"{row['client_s'] * 1000:.1f}ms server {row['server_s']:.2f}s plain "
                f"{row['plain_s']:.3f}s ratio {row['ratio']:.1f} error {row['error']:.1e}",
                file=sys.stderr,
                flush=True,
            )
            scaling.append(row)
    if args.part in {"accuracy", "all"}:
        rounds = 3 if args.quick else None
        for protocol in ACCURACY:
            for attack in ATTACKS:
                if (protocol, attack) in SKIPPED and not args.all_cells:
                    continue
                row = cached(
                    args.cache,
                    f"accuracy/{protocol}/{attack}/{rounds}",
                    functools.partial(accuracy_row, protocol, attack, rounds),
                )
                print(f"{protocol} {attack}: {row['accuracy']:.4f}", file=sys.stderr, flush=True)
                accuracy.append(row)
    section = render(scaling, accuracy, args.note)
    print(section)
    if args.write:
        write_section(section, begin=BEGIN, end=END)


if __name__ == "__main__":
    main()

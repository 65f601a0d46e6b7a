"""Secure aggregation (secagg, SecAgg+) against plain averaging, with clients dropping out.

The job is examples/digits-secagg.yaml's (digits, MLP 64-128-ReLU-10, IID shards, one local
epoch) with K clients, R rounds and checkpoints off, run with ``fedcore run`` over mutual TLS on
loopback; for each K, fedavg with Uniform weighting (the plain mean secagg computes) runs beside
it, then secagg with 0%, 10% and 30% of the clients dropping out after sharing their keys in
every round (``spec.attack`` DropAfterSharing: the costliest moment to lose a client, whose mask
key the survivors must then help rebuild). Reported per run: the median round, the server's
bytes per client and round each way (its own counters), every process's peak PSS summed and the
server's own (sampled every 50 ms in the same run: these runs are not timed against a floor),
the degree and threshold the run chose, and whether the final model equals the simulation of
the same manifest bit for bit (the exact sum of the survivors' quantized updates, whoever
dropped).

Then, for the same K, Flower's SecAgg+ on the same job (benchmarks/flower_secagg_app.py:
``SecAggPlusWorkflow`` in ``DefaultWorkflow``, clients behind ``secaggplus_mod``) in Flower's
simulation mode, in the Flower venv that benchmarks/flower.py creates, with fedcore's degree,
threshold, clip range, levels and modulus and the very clients fedcore drops (they share their
keys, then raise instead of sending their masked input, every round). Reported per run: the
median round and its ratio to fedcore's, the protobuf bytes per client and round each way,
the peak PSS of every process and of the driver (the server side), and the largest error of
the round-1 model against the plain mean of the survivors' models (Flower quantizes: not
exact). Each Flower run is capped at ``FLOWER_CAP`` seconds; a capped run reports what it did.

Run: ``python benchmarks/secagg.py [--clients 10,50,100] [--no-flower] [--write]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.flower import (  # noqa: E402
    MIN_AVAILABLE,
    ONE_THREAD,
    flower_python,
    flower_version,
)
from benchmarks.measure import TreeSampler, load, machine, stop_group  # noqa: E402
from benchmarks.spine import publish  # noqa: E402

BEGIN = "<!-- secagg:begin -->"
END = "<!-- secagg:end -->"
CLIENTS = (10, 50, 100)
DROPOUTS = (0.0, 0.1, 0.3)
ROUNDS = 5
FLOWER_CAP = 1200.0
"""Wall-clock seconds one Flower run may take (start-up included) before it is stopped."""
FLOWER_STALL = 300.0
"""A Flower run that finishes no round for this long is stopped (and tried once more)."""
FLOWER_TIMEOUT = 300.0
"""SecAggPlusWorkflow's ``timeout``: how long each stage waits for replies."""
GUARD = 12 * 2**30
"""The memory guard on a Flower run's processes (as benchmarks/flower.py's default)."""


def manifest(folder: Path, clients: int, dropout: float | None) -> Path:
    """secagg at ``dropout`` (None: fedavg, Uniform) with K clients and R rounds."""
    document = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "digits-secagg.yaml").read_text()))
    spec = document["spec"]
    spec["checkpoint"] = {"everyRounds": 0}
    spec["rounds"] = ROUNDS
    spec["clients"] = {"count": clients, "perRound": "100%", "quorum": "60%"}
    if dropout is None:
        spec["protocol"] = {"name": "fedavg", "fedavg": {"weighting": "Uniform"}}
    else:
        spec["protocol"]["secagg"]["dropoutRate"] = max(dropout, 0.1)
        if dropout:
            spec["attack"] = {"kind": "DropAfterSharing", "fraction": dropout, "seed": 0}
    document["metadata"]["name"] = f"secagg-bench-{clients}"
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def run_once(folder: Path, clients: int, dropout: float | None) -> dict[str, Any]:
    """One ``fedcore run``; its rounds, bytes, memory and equality with the simulation."""
    from safetensors.numpy import load_file

    from fedcore.simulation import simulate
    from fedcore.spec import load_manifest

    path = manifest(folder, clients, dropout)
    work = folder / "work"
    command = [sys.executable, "-m", "fedcore", "run", str(path), "--json", "--quiet"]
    command += ["--workdir", str(work), "--clients-per-process", "auto"]
    sampler = TreeSampler(interval=0.05)
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **ONE_THREAD},
        start_new_session=True,
    )
    sampler.add(process.pid)
    sampler.start()
    stdout, stderr = process.communicate(timeout=1800)
    sampler.stop()
    if process.returncode != 0:
        raise RuntimeError(f"K={clients} dropout={dropout}: fedcore run failed:\n{stderr[-3000:]}")
    summary = json.loads(stdout.strip().splitlines()[-1])
    events = [json.loads(line) for line in (work / "events.jsonl").read_text().splitlines()]
    rounds = [e for e in events if e["event"] == "round"]
    released = load_file(str(work / "model.safetensors"))
    simulated = simulate(load_manifest(path)).weights
    server = max(
        (
            size
            for pid, size in sampler.peaks.items()
            if "server.log" in sampler.outputs.get(pid, "")
        ),
        default=0,
    )
    metrics = rounds[-1].get("metrics") or {}
    return {
        "median_round": statistics.median(float(e["seconds"]) for e in rounds),
        "participants": statistics.median(int(e["participants"]) for e in rounds),
        "received_per_client": summary["server_bytes_received"] / ROUNDS / clients,
        "sent_per_client": summary["server_bytes_sent"] / ROUNDS / clients,
        "peak_bytes": sampler.peak,
        "server_bytes": server,
        "degree": metrics.get("degree"),
        "threshold": metrics.get("threshold"),
        "accuracy": summary["accuracy"],
        "equals_simulation": sorted(released) == sorted(simulated)
        and all(np.array_equal(released[k], simulated[k]) for k in simulated),
    }


def flower_settings(folder: Path, clients: int, dropout: float) -> dict[str, Any]:
    """Flower's SecAgg+ parameters for the fedcore run at K=``clients`` and ``dropout``.

    The same clients drop (fedcore's seeded choice of ``spec.attack``); the sharing graph links
    every client to as many others as fedcore's degree k (Flower's ``num_shares`` counts the
    client's own share too, so it is k + 1), with fedcore's threshold t; fedcore's clip range,
    quantization levels and modulus (the least 2^bits that K quantized inputs cannot wrap).
    """
    from fedcore.learning.poisoning import attackers
    from fedcore.protocols.secagg import maths
    from fedcore.spec import load_manifest

    spec = load_manifest(manifest(folder, clients, dropout)).spec
    options = spec.protocol.secagg
    assert options is not None
    degree, threshold = maths.choose_parameters(
        clients,
        options.dropout_rate,
        options.corrupt_rate,
        options.security_bits,
        options.correctness_bits,
    )
    levels = 2**options.quantization_bits
    return {
        "nodes": clients,
        "rounds": ROUNDS,
        "dropping": sorted(attackers(spec)),
        "degree": degree,
        "num_shares": degree + 1,
        "threshold": threshold,
        "clipping_range": float(options.clip_range),
        "quantization_range": levels,
        "modulus_range": 2 ** maths.choose_bits(clients, levels),
        "timeout": FLOWER_TIMEOUT,
    }


def run_flower(python: Path, folder: Path, clients: int, dropout: float) -> dict[str, Any]:
    """Flower's SecAgg+ on the job in simulation mode; a run that stalls (Ray can fail to
    start on a loaded machine) is stopped and tried once more, and the retry is noted."""
    result = run_flower_once(python, folder / "try-1", clients, dropout)
    if result["failure"] is not None and result["failure"].startswith("stalled"):
        first = result["failure"]
        result = run_flower_once(python, folder / "try-2", clients, dropout)
        result["failure"] = (
            f"first try {first}, retried"
            if result["failure"] is None
            else f"{first}; retry: {result['failure']}"
        )
    return result


def run_flower_once(python: Path, folder: Path, clients: int, dropout: float) -> dict[str, Any]:
    """One ``run_simulation`` of benchmarks/flower_secagg_app.py; its rounds, bytes, memory
    and the error of its round-1 aggregate against the plain mean of the survivors' models."""
    app, out = folder / "app", folder / "out"
    app.mkdir(parents=True)
    out.mkdir()
    for name in ("flower_app.py", "flower_secagg_app.py"):
        shutil.copy(ROOT / "benchmarks" / name, app / name)
    settings = {**flower_settings(folder, clients, dropout), "out": str(out)}
    result: dict[str, Any] = {
        "clients": clients,
        "dropout": dropout,
        "num_shares": settings["num_shares"],
        "threshold": settings["threshold"],
        "modulus_bits": settings["modulus_range"].bit_length() - 1,
        "dropping": len(settings["dropping"]),
        "rounds_done": 0,
        "failure": None,
    }
    env = {
        **os.environ,
        **ONE_THREAD,
        "PYTHONPATH": str(app),
        "RAY_DEDUP_LOGS": "0",
        "FLOWER_SECAGG": json.dumps(settings),
    }
    sampler = TreeSampler(interval=0.1, max_bytes=GUARD, min_available=MIN_AVAILABLE)
    log = folder / "flower.log"
    started = time.monotonic()
    with open(log, "wb") as handle:
        process = subprocess.Popen(
            [str(python), "-c", "import flower_secagg_app; flower_secagg_app.simulate()"],
            cwd=app,
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    sampler.add(process.pid)
    sampler.start()
    progress_file = out / "flower.json"
    progress, last = -1, started
    try:
        while process.poll() is None and sampler.tripped is None:
            now = time.monotonic()
            if now - started > FLOWER_CAP:
                result["failure"] = f"stopped at the {FLOWER_CAP:.0f} s cap"
                break
            mark = progress_file.stat().st_mtime_ns if progress_file.exists() else 0
            if mark != progress:
                progress, last = mark, now
            elif now - last > FLOWER_STALL:
                result["failure"] = f"stalled: no round finished in {FLOWER_STALL:.0f} s"
                break
            time.sleep(0.2)
        if sampler.tripped is not None:
            result["failure"] = sampler.tripped
    finally:
        if process.poll() is None:
            stop_group(process)
        sampler.stop()
    result["total"] = time.monotonic() - started
    result["peak_bytes"] = sampler.peak
    result["server_bytes"] = sampler.peaks.get(process.pid, 0)
    if progress_file.exists():
        data = json.loads(progress_file.read_text())
        seconds = data["round_seconds"]
        result["rounds_done"] = len(seconds)
        result["round_seconds"] = seconds
        result["median_round"] = statistics.median(seconds) if seconds else None
        result["accuracy"] = data["accuracy"]
        result["survivors"] = data["survivors"]
        result["participants"] = statistics.median(data["survivors"]) if data["survivors"] else None
    if result["failure"] is None and result["rounds_done"] < ROUNDS:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        result["failure"] = (
            f"exit status {process.returncode} after {result['rounds_done']} rounds: "
            + " / ".join(tail)[-300:]
        )
    result["shamir"] = shamir_cost(python, settings["threshold"], settings["num_shares"])
    result.update(flower_bytes(out, clients, result["rounds_done"]))
    result.update(flower_error(out, clients, settings))
    return result


SHAMIR_COST = """
import json, os, sys, time
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.supercore.primitives.asymmetric import generate_key_pairs, private_key_to_bytes
threshold, num = int(sys.argv[1]), int(sys.argv[2])
key = private_key_to_bytes(generate_key_pairs()[0])
began = time.perf_counter()
shares = create_shares(key, threshold, num)
create_shares(os.urandom(32), threshold, num)
shared = time.perf_counter()
combine_shares(shares)
print(json.dumps({"share": shared - began, "combine": time.perf_counter() - shared}))
"""
"""Times Flower's Shamir code (pycryptodome's, over 16-byte chunks) apart from any run: a
client sharing its two secrets (its mask seed and its private key) among ``num``, and the
server rebuilding one private key from all ``num`` shares."""


def shamir_cost(python: Path, threshold: int, num: int) -> dict[str, float]:
    """Seconds for one client's sharing and one rebuilt secret at (threshold, num)."""
    out = subprocess.run(
        [str(python), "-c", SHAMIR_COST, str(threshold), str(num)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **ONE_THREAD},
    )
    return {k: float(v) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def flower_bytes(out: Path, clients: int, rounds: int) -> dict[str, Any]:
    """Bytes per client and round each way, from the server's side (received: what clients
    answered), summed over the protobuf sizes the clients' ``bytes_mod`` recorded."""
    if not rounds:
        return {"received_per_client": None, "sent_per_client": None}
    received = sent = 0
    for path in out.glob("bytes-*.txt"):
        for line in path.read_text().splitlines():
            round_, to_client, from_client = line.split()
            if int(round_) <= rounds:
                sent += int(to_client)
                received += int(from_client)
    return {
        "received_per_client": received / rounds / clients,
        "sent_per_client": sent / rounds / clients,
    }


def flower_error(out: Path, clients: int, settings: dict[str, Any]) -> dict[str, Any]:
    """The largest absolute difference between Flower's round-1 model and the plain float64
    mean of the survivors' trained models, also in quantization steps (2 clip / levels)."""
    aggregate = out / "aggregate-1.npz"
    survivors = [k for k in range(clients) if k not in set(settings["dropping"])]
    paths = [out / f"trained-{k}.npz" for k in survivors]
    if not aggregate.exists() or not all(p.exists() for p in paths):
        return {"max_error": None, "max_error_steps": None}
    with np.load(aggregate) as handle:
        released = [handle[f"arr_{i}"].astype(np.float64) for i in range(len(handle.files))]
    total = [np.zeros_like(a) for a in released]
    for path in paths:
        with np.load(path) as handle:
            for i, a in enumerate(total):
                a += handle[f"arr_{i}"].astype(np.float64)
    error = max(
        float(np.max(np.abs(r - t / len(paths)))) for r, t in zip(released, total, strict=True)
    )
    step = 2 * settings["clipping_range"] / settings["quantization_range"]
    return {"max_error": error, "max_error_steps": error / step}


def run(clients: tuple[int, ...], *, flower: bool = True) -> dict[str, Any]:
    """fedcore's runs for every K (fedavg, then secagg at each dropout) and, with ``flower``,
    Flower's SecAgg+ at each dropout right after fedcore's runs at the same K."""
    python = flower_python() if flower else None
    data: dict[str, Any] = {
        "machine": machine(),
        "flower": flower_version(python) if python is not None else None,
        "flower_cap": FLOWER_CAP,
        "load_start": load(),
        "rows": [],
        "flower_rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="fedcore-secagg-") as tmp:
        for k in clients:
            for dropout in (None, *DROPOUTS):
                folder = Path(tmp) / f"k{k}-{dropout}"
                folder.mkdir()
                row = {"clients": k, "dropout": dropout, **run_once(folder, k, dropout)}
                data["rows"].append(row)
                print(json.dumps(row), file=sys.stderr)
            if python is None:
                continue
            for dropout in DROPOUTS:
                folder = Path(tmp) / f"flower-k{k}-{dropout}"
                folder.mkdir()
                row = run_flower(python, folder, k, dropout)
                data["flower_rows"].append(row)
                print(json.dumps({"flower": True, **row}), file=sys.stderr)
    data["load_end"] = load()
    return data


def render(data: dict[str, Any]) -> str:
    lines = [
        BEGIN,
        "## Secure aggregation (secagg) with dropouts",
        "",
        f"`python benchmarks/secagg.py --write` ({data['machine']}); one run per row. Load "
        f"average (1/5/15 min) {data['load_start']} at the start, {data['load_end']} at the end. "
        f"The digits job (an MLP of 9,610 weights), {ROUNDS} rounds, every client every round, "
        "quorum 60%, `--clients-per-process auto`, mutual TLS on loopback. fedcore's SecAgg+ "
        "(docs/protocols/secagg.md) beside fedavg with Uniform weighting (the mean secagg "
        "computes, without masks). Dropping: that fraction of the clients shares its keys, "
        "then never sends its masked input, every round. Bytes are the server's counters per "
        "client and round; memory is the peak of the summed PSS of every process, and the "
        "server's own. Exact: the released model equals `simulate()` of the same manifest "
        "bit for bit.",
        "",
        "| clients | protocol | dropping | degree / threshold | survivors | median round (ms) "
        "| vs fedavg | KB per client received / sent | peak memory, all / server (MiB) "
        "| accuracy | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    plain: dict[int, float] = {}
    for row in data["rows"]:
        k = row["clients"]
        if row["dropout"] is None:
            plain[k] = row["median_round"]
        protocol = "fedavg" if row["dropout"] is None else "secagg"
        dropping = "-" if row["dropout"] is None else f"{row['dropout']:.0%}"
        graph = "-" if row["degree"] is None else f"{int(row['degree'])} / {int(row['threshold'])}"
        lines.append(
            f"| {k} | {protocol} | {dropping} | {graph} | {row['participants']:.0f} "
            f"| {row['median_round'] * 1e3:.0f} | {row['median_round'] / plain[k]:.1f}x "
            f"| {row['received_per_client'] / 1e3:.0f} / {row['sent_per_client'] / 1e3:.0f} "
            f"| {row['peak_bytes'] / 2**20:.0f} / {row['server_bytes'] / 2**20:.0f} "
            f"| {row['accuracy']:.4f} | {'yes' if row['equals_simulation'] else 'NO'} |"
        )
    lines += ["", *render_flower(data), END]
    return "\n".join(lines)


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    """Formats a possibly missing number."""
    return "-" if value is None else format(value * scale, spec)


def render_flower(data: dict[str, Any]) -> list[str]:
    """The Flower SecAgg+ part of the section: its table beside fedcore's secagg rows."""
    if data.get("flower") is None:
        return ["Flower's SecAgg+ was not run this time (`--no-flower`)."]
    fedcore = {
        (row["clients"], row["dropout"]): row["median_round"]
        for row in data["rows"]
        if row["dropout"] is not None
    }
    lines = [
        f"### Flower's SecAgg+ on the same job ({data['flower']})",
        "",
        "benchmarks/flower_secagg_app.py: Flower's `SecAggPlusWorkflow` inside "
        "`DefaultWorkflow(fit_workflow=...)` over a legacy `FedAvg`, clients behind "
        "`secaggplus_mod`, run right after fedcore's rows of the same K, in Flower's "
        "**simulation mode** (`run_simulation`, Ray, one CPU per client actor: 2 actors here), "
        "in Flower's own venv, one run per row, capped at "
        f"{data['flower_cap']:.0f} s. The same job and maths as fedcore's (the digits MLP, the "
        "same seeded shards, batch order and initial model, every client every round), with "
        "the plain mean of the survivors (every client reports one example and `max_weight` "
        "is 1). Flower's deployment mode was not run: in it every SuperNode starts a fresh "
        "ClientApp process for every message, and SecAgg+ sends each client 4 messages a "
        "round (400 process starts a round at K=100; plain FedAvg deployment at K=10 already "
        "takes tens of seconds a round, see 'Against Flower and the floor').",
        "",
        "Parameters as fedcore chose: Flower's graph links each client to fedcore's degree k "
        "others, so `num_shares` = k + 1 (Flower counts the share a client keeps); "
        "`reconstruction_threshold` = fedcore's t; `clipping_range` 8, `quantization_range` "
        "2^20 and `modulus_range` 2^bits as fedcore's clip range, levels and modulus; "
        f"`timeout` {FLOWER_TIMEOUT:.0f} s (never reached: drop-outs answer at once). "
        "Dropping: the very clients fedcore's DropAfterSharing picks (its seeded choice) "
        "answer the setup and share-keys stages, then at the collect-masked-vectors stage "
        "train and raise instead of answering, every round; Flower turns the exception into "
        "an error reply, so the workflow counts them as dropped at once (as fedcore's server "
        "counts a declined masked input) and rebuilds their pair masks from their neighbours' "
        "shares in the unmask stage. (Flower's own example drops a client by sleeping past "
        "the workflow's `timeout`, which would add the timeout to every round.)",
        "",
        "Bytes: the protobuf size of every message a client received and answered "
        "(recorded by a client mod; what deployment mode would carry over gRPC, without "
        "gRPC's framing and without TLS), per client and round, received / sent as seen from "
        "the server. Memory: all = every process of the simulation (the driver, Ray's "
        "daemons and actors); server = the driver process alone (the ServerApp, the "
        "in-memory SuperLink state and the simulation engine). Error: the largest absolute "
        "difference between the model Flower's workflow released in round 1 and the float64 "
        "mean of the survivors' trained models, also in quantization steps (16 / 2^20): "
        "Flower rounds each model stochastically to 2^20 levels, so it is approximate; "
        "fedcore's rows are bit for bit its simulation (the exact sum of the survivors' "
        "quantized updates, within one level of the float mean).",
        "",
        "| clients | dropping | num_shares / threshold | survivors | median round (ms) "
        "| fedcore secagg's (ms) | Flower / fedcore | KB per client received / sent "
        "| peak memory, all / server (MiB) | accuracy | max error vs plain mean (steps) "
        "| notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for row in data["flower_rows"]:
        k, dropout = row["clients"], row["dropout"]
        mine = row.get("median_round")
        theirs = fedcore.get((k, dropout))
        ratio = None if mine is None or not theirs else mine / theirs
        if ratio is not None:
            ratios.append(ratio)
        received, sent = row.get("received_per_client"), row.get("sent_per_client")
        traffic = "-" if received is None else f"{received / 1e3:.0f} / {sent / 1e3:.0f}"
        error = "-"
        if row.get("max_error") is not None:
            error = f"{row['max_error']:.1e} ({row['max_error_steps']:.2f})"
        notes = "" if row["failure"] is None else clean(row["failure"])
        if row["failure"] is not None and row["rounds_done"] < ROUNDS:
            notes = f"not run to the end ({row['rounds_done']} of {ROUNDS} rounds): {notes}"
        lines.append(
            f"| {k} | {dropout:.0%} | {row['num_shares']} / {row['threshold']} "
            f"| {fmt(row.get('participants'), '.0f')} | {fmt(mine, '.0f', 1e3)} "
            f"| {fmt(theirs, '.0f', 1e3)} | {'-' if ratio is None else f'{ratio:.1f}x'} "
            f"| {traffic} "
            f"| {row['peak_bytes'] / 2**20:.0f} / {row['server_bytes'] / 2**20:.0f} "
            f"| {fmt(row.get('accuracy'), '.4f')} | {error} | {notes} |"
        )
    if ratios:
        lines += [
            "",
            f"Flower's SecAgg+ round took {min(ratios):.1f}x to {max(ratios):.1f}x fedcore's "
            "secagg round here, though Flower's simulation runs in one driver and two Ray "
            "actors with no network and no TLS, while fedcore's runs are separate processes "
            "over mutual TLS.",
        ]
    timed = {
        (row["num_shares"], row["threshold"]): (row["clients"], row["shamir"])
        for row in data["flower_rows"]
        if row.get("shamir")
    }
    costs = "; ".join(
        f"K={k} ({num} / {threshold}): {cost['share'] * 1e3:.0f} ms and "
        f"{cost['combine'] * 1e3:.0f} ms"
        for (num, threshold), (k, cost) in timed.items()
    )
    if costs:
        lines += [
            "",
            "Where Flower's round goes: each client Shamir-shares its mask seed (32 bytes) and "
            "its private key (a 306-byte encoding) with pycryptodome's Shamir in Python, 16 "
            "bytes at a time; the server, in its one process and one after another, rebuilds "
            "every survivor's seed and every drop-out's key (and regenerates the drop-out's "
            "pair mask with each of its neighbours). Timed apart, one client's sharing of both "
            "secrets and one private key rebuilt from num_shares shares (the seed, 3 chunks to "
            f"the key's 20, costs less): {costs}. So Flower's round grows with num_shares and "
            "with the drop-outs, which is why 30% dropping (fedcore's larger degree) costs it "
            "most.",
        ]
    lines += [
        "",
        "Not the same guarantees: Flower's workflow has four stages, no signatures and no "
        "consistency round (clients reveal shares for whichever lists of survivors and "
        "drop-outs the server sends), and derives its masks from numpy's Mersenne Twister "
        "seeded with 32 bits folded from the agreed key or seed (`pseudo_rand_gen`); "
        "fedcore's six stages add signed adverts, committed nonces, shares signed by their "
        "dealers (a false one bars its sender) and a list of survivors signed under each "
        "client's view of the attempt, with AES-256-CTR masks (docs/protocols/secagg.md). "
        "Flower also sends the "
        "global model as float64 from round 2 on (it dequantizes to float64), about twice "
        "round 1's download.",
        "",
    ]
    return lines


def clean(text: str) -> str:
    """One table cell's worth of a failure message: one line, no pipes."""
    return " ".join(text.replace("|", "/").split())[:300]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", default=",".join(map(str, CLIENTS)))
    parser.add_argument("--no-flower", action="store_true", help="skip Flower's SecAgg+")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    # A SIGTERM unwinds (runs the finally blocks that stop Flower's process groups).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    data = run(tuple(int(k) for k in args.clients.split(",")), flower=not args.no_flower)
    publish(render(data), data, "secagg", begin=BEGIN, end=END, write=args.write)


if __name__ == "__main__":
    main()

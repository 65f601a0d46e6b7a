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

Run: ``python benchmarks/secagg.py [--clients 10,50,100] [--write]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.flower import ONE_THREAD  # noqa: E402
from benchmarks.measure import TreeSampler, load, machine  # noqa: E402
from benchmarks.spine import publish  # noqa: E402

BEGIN = "<!-- secagg:begin -->"
END = "<!-- secagg:end -->"
CLIENTS = (10, 50, 100)
DROPOUTS = (0.0, 0.1, 0.3)
ROUNDS = 5


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


def run(clients: tuple[int, ...]) -> dict[str, Any]:
    data: dict[str, Any] = {"machine": machine(), "load_start": load(), "rows": []}
    with tempfile.TemporaryDirectory(prefix="fedcore-secagg-") as tmp:
        for k in clients:
            for dropout in (None, *DROPOUTS):
                folder = Path(tmp) / f"k{k}-{dropout}"
                folder.mkdir()
                row = {"clients": k, "dropout": dropout, **run_once(folder, k, dropout)}
                data["rows"].append(row)
                print(json.dumps(row), file=sys.stderr)
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
    lines += [
        "",
        "Not measured yet: Flower's SecAgg+ workflow on the same job (issue 21 asks for it).",
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", default=",".join(map(str, CLIENTS)))
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    data = run(tuple(int(k) for k in args.clients.split(",")))
    publish(render(data), data, "secagg", begin=BEGIN, end=END, write=args.write)


if __name__ == "__main__":
    main()

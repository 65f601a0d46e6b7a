"""Scale: rounds of the digits FedAvg job with 10, 100 and 500 clients.

Two ways of running the clients:

* **simulation** (``fedcore.simulation.simulate``, what ``fedcore run --simulate`` runs): every
  client in one process, calling the same protocol hooks in the same order as the roles do
  (plan, local training, upload check, combine, evaluate), with no network;
* **processes** (``fedcore run``): a server and one process per client over mutual TLS on
  loopback, for the client counts given by ``--processes``.

Each count runs in a fresh process, ``--repeats`` times, alternating; the job is
examples/digits-fedavg.yaml with K clients (IID shards of the 1,437 training images: 144 per
client at K=10, 3 at K=500), ``--rounds`` rounds, checkpoints off. Reported: start-up (to the
first round), median round, time per client per round, peak memory, final accuracy.
``--write`` replaces the scale section of docs/benchmarks.md.

Run: ``python -m benchmarks.scale [--clients 10,100,500] [--processes 10] [--write]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from benchmarks.flower import ONE_THREAD, fedcore_manifest, run_fedcore
from benchmarks.measure import ROOT, TreeSampler, load, machine, save_data, wall
from benchmarks.spine import write_section

BEGIN = "<!-- scale:begin -->"
END = "<!-- scale:end -->"

SIMULATE = """
import json, resource, sys
from fedcore.spec import load_manifest
from fedcore.simulation import simulate
result = simulate(load_manifest(sys.argv[1]))
seconds = [entry["seconds"] for entry in result.history]
print(json.dumps({
    "accuracy": result.accuracy,
    "round_seconds": seconds,
    "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
}))
"""


def steady(rounds: list[float]) -> float:
    """The median round after the first (which builds the simulated clients lazily)."""
    return statistics.median(rounds[1:] if len(rounds) > 1 else rounds)


def run_simulated(manifest: Path) -> dict[str, Any]:
    """One simulated run in a fresh process: round times, accuracy, peak memory."""
    sampler = TreeSampler(interval=0.05)
    launched = wall()
    process = subprocess.Popen(
        [sys.executable, "-c", SIMULATE, str(manifest)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **ONE_THREAD},
        start_new_session=True,
    )
    sampler.add(process.pid)
    sampler.start()
    stdout, _ = process.communicate()
    total = wall() - launched
    peak = sampler.stop()
    if process.returncode != 0:
        raise RuntimeError(f"the simulation of {manifest} exited with {process.returncode}")
    data = json.loads(stdout.strip().splitlines()[-1])
    rounds = data["round_seconds"]
    return {
        "startup": total - sum(rounds),
        "first_round": rounds[0],
        "median_round": steady(rounds),
        "total": total,
        "accuracy": data["accuracy"],
        "peak_bytes": peak,
    }


def render(data: dict[str, Any]) -> str:
    """The docs/benchmarks.md section."""
    lines = [
        BEGIN,
        "## Scale: 10, 100 and 500 clients",
        "",
        f"Measured by `python -m benchmarks.scale --write` ({data['machine']}); "
        f"{data['repeats']} repeats per count in simulation, {data['process_repeats']} with "
        f"processes, alternating; medians. Load average (1/5/15 min) {data['load_start']} at "
        f"the start, {data['load_end']} at the end.",
        "",
        f"The digits FedAvg job (examples/digits-fedavg.yaml) with K IID clients, "
        f"{data['rounds']} rounds, checkpoints off. *Simulation* runs every client in one process "
        "through the same protocol hooks, in the same order, as the roles (no network); "
        "*processes* is `fedcore run`: a server and K client processes over mutual TLS on "
        "loopback. Start-up is, with processes, the time to the first round; in simulation, "
        "the command's time outside its rounds (imports, data, the final evaluation). Round 1 "
        "is shown apart: the simulation builds each client's data and model inside it. "
        "Memory is the peak summed PSS of the run's processes.",
        "",
        "| clients | mode | start-up (s) | round 1 (s) | median round after the first (ms) | "
        "per client per round (ms) | total (s) | accuracy | peak memory, PSS (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        m = row["medians"]
        lines.append(
            f"| {row['clients']} | {row['mode']} | {m['startup']:.1f} | {m['first_round']:.2f} | "
            f"{m['median_round'] * 1000:.1f} | {m['median_round'] * 1000 / row['clients']:.2f} | "
            f"{m['total']:.1f} | {m['accuracy']:.4f} | {m['peak_bytes'] / 2**20:.0f} |"
        )
    if data["failures"]:
        lines += ["", *[f"- {failure}" for failure in data["failures"]]]
    lines.append(END)
    return "\n".join(lines)


def log_tail(folder: Path, clients: int, repeat: int) -> str:
    """The last warning of a failed run's server log (the workdir is kept on failure)."""
    log = folder / f"fedcore-k{clients}-{repeat}" / "logs" / "server.log"
    if not log.exists():
        return "none"
    lines = [line for line in log.read_text().splitlines() if "WARNING" in line or "ERROR" in line]
    return (lines[-1] if lines else "no warning")[-200:].replace("|", "/")


def run(
    *,
    clients: tuple[int, ...] = (10, 100, 500),
    processes: tuple[int, ...] = (10,),
    rounds: int = 5,
    repeats: int = 3,
    process_repeats: int = 1,
) -> dict[str, Any]:
    """Runs every count; returns the numbers."""
    data: dict[str, Any] = {
        "machine": machine(),
        "repeats": repeats,
        "process_repeats": process_repeats,
        "rounds": rounds,
        "load_start": load(),
        "rows": [],
        "failures": [],
    }
    keys = ("startup", "first_round", "median_round", "total", "accuracy", "peak_bytes")
    with tempfile.TemporaryDirectory(prefix="fedcore-scale-") as tmp:
        folder = Path(tmp)
        sim: dict[int, list[dict[str, Any]]] = {k: [] for k in clients}
        proc: dict[int, list[dict[str, Any]]] = {k: [] for k in processes}
        for repeat in range(repeats):
            for k in clients:
                manifest = fedcore_manifest(folder, k, rounds)
                spec = yaml.safe_load(manifest.read_text())
                spec["metadata"]["name"] = f"scale-{k}"
                manifest.write_text(yaml.safe_dump(spec))
                sim[k].append(run_simulated(manifest))
                print(f"simulation K={k}: {sim[k][-1]}", file=sys.stderr)
            if repeat < process_repeats:
                for k in processes:
                    measured = run_fedcore(folder, k, rounds, repeat, 900)
                    if measured.failure is not None or measured.median_round is None:
                        data["failures"].append(
                            f"fedcore run with {k} client processes failed "
                            f"({measured.failure}, after {measured.total or 0:.0f} s); "
                            f"its server log: {log_tail(folder, k, repeat)}"
                        )
                        print(data["failures"][-1], file=sys.stderr)
                        continue
                    proc[k].append(
                        {
                            "startup": measured.startup,
                            "first_round": measured.first_round,
                            "median_round": steady(measured.round_seconds),
                            "total": measured.total,
                            "accuracy": measured.accuracy,
                            "peak_bytes": measured.peak_bytes,
                        }
                    )
                    print(f"processes K={k}: {proc[k][-1]}", file=sys.stderr)
        for k in sorted(set(clients) | set(processes)):
            for mode, runs in (("simulation", sim.get(k)), ("processes", proc.get(k))):
                if runs:
                    medians = {key: statistics.median(r[key] for r in runs) for key in keys}
                    data["rows"].append({"clients": k, "mode": mode, "medians": medians})
    data["load_end"] = load()
    return data


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the scale benchmark, prints the section and (with --write) updates the docs."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", default="10,100,500", help="client counts (simulation)")
    parser.add_argument("--processes", default="10", help="client counts as processes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--process-repeats", type=int, default=1)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args(argv)

    def counts(text: str) -> tuple[int, ...]:
        return tuple(int(c) for c in text.split(",") if c)

    data = run(
        clients=counts(args.clients),
        processes=counts(args.processes),
        rounds=args.rounds,
        repeats=args.repeats,
        process_repeats=args.process_repeats,
    )
    section = render(data)
    print(section)
    if args.write:
        write_section(section, begin=BEGIN, end=END)
        save_data("scale", data)
    return data


if __name__ == "__main__":
    main()

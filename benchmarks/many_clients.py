"""Start-up, memory per role and many clients: ``fedcore run`` against the floor, side by side.

The job is examples/digits-fedavg.yaml (digits, MLP 64-128-ReLU-10, IID shards, SGD 0.1, one
local epoch of batch 32, FedAvg by shard size) with K clients and checkpoints off (the floor
takes none), for K = 10, 50 and 200; and, for start-up on every shipped data set, the same job
on the MNIST subset with a CNN (8 and 16 channels) at K = 10 and 50. Inside every repeat the
sides run back to back:

* **floor**: benchmarks/floor.py in a fresh process, one torch thread: the same maths as one
  plain loop. Its start-up is the command's own, from launch to its first round: the
  interpreter, torch, scikit-learn, the data and the model.
* **fedcore**: ``fedcore run`` as a user runs it (``--clients-per-process auto``), from launch to
  its first round: the command, its CA and a certificate per role, the forkserver's imports, the
  server, the data (a fresh per-machine cache: the source is parsed once, by the first role
  that needs it) and every client connected over mutual TLS.
* **fedcore, a process per client** (``--clients-per-process 1``), at K = 50: what grouping
  changes where ``auto`` groups (at K = 10 ``auto`` is a process per client; at K = 200, 200
  processes on 2 cores are what ``auto`` exists to avoid).

Every process runs torch with one thread. Memory is PSS, sampled every 50 ms in one more run
of each side than the timed ones (reading PSS costs CPU beside the run): the peak of the sum
over the side's processes, and each role process's own peak (the server; a client process,
the median and the largest); a role is named by the log file its output goes to. The data a
client holds is its shard (rows x 64 float32 features + a label) and the model it trains
(parameters x 4 bytes twice: weights and gradients); everything else in its PSS is the constant
(its share of the interpreter, torch and gRPC, and its own heap).

Run: ``python -m benchmarks.many_clients [--repeats 3] [--write]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from benchmarks.flower import ONE_THREAD, Measured, run_floor
from benchmarks.measure import ROOT, TreeSampler, load, machine, stop_group, wall
from benchmarks.spine import parse_jobs, publish

BEGIN = "<!-- many-clients:begin -->"
END = "<!-- many-clients:end -->"
JOBS = ((10, 20), (50, 30), (200, 15))
"""(clients K, rounds R) of the digits job."""
START_JOBS = ((10, 3), (50, 3))
"""(clients K, rounds R) of the MNIST-subset job, whose start-up is measured (issue 28 asks it
of every shipped data set); its rounds are not a target."""
TRAIN_EXAMPLES = {"digits": (1437, 64), "mnist": (4000, 784)}
"""Each job's training examples (the 80% not held out) and features per example."""
ONE_PER_PROCESS = (50,)
"""The K at which fedcore also runs with a process per client."""
TARGETS = {
    "startup": {10: 1.25, 50: 1.5},
    "round": {50: 1.5, 200: 2.0},
}
"""Issue 28's targets: start-up and median round as multiples of the floor's."""
MEMORY_TARGET = 4 * 2**30
"""All processes of the K = 200 run within 4 GiB."""
CAP_SECONDS = 600.0


def manifest(folder: Path, clients: int, rounds: int, dataset: str = "digits") -> Path:
    """examples/digits-fedavg.yaml with K clients, R rounds and no checkpoints; for ``mnist``
    on the MNIST subset with the CNN of 8 and 16 channels (the floor's)."""
    document = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "digits-fedavg.yaml").read_text()))
    document["metadata"]["name"] = f"many-{dataset}-k{clients}"
    document["spec"]["clients"]["count"] = clients
    document["spec"]["rounds"] = rounds
    document["spec"]["checkpoint"] = {"everyRounds": 0}
    if dataset == "mnist":
        document["spec"]["data"]["source"] = {"kind": "MNISTSubset"}
        document["spec"]["model"] = {"kind": "CNN", "channels": [8, 16], "activation": "ReLU"}
    path = folder / f"many-{dataset}-k{clients}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def role_of(output: str) -> str | None:
    """``server``, ``client`` or None, from where a process's output goes (its role's log)."""
    name = Path(output).name
    if name == "server.log":
        return "server"
    if name.startswith("client") and name.endswith(".log"):
        return "client"
    return None


def run_fedcore(
    folder: Path, clients: int, rounds: int, per_process: str, *, memory: bool, dataset: str
) -> dict[str, Any]:
    """``fedcore run`` of the job with ``--clients-per-process per_process``, from outside;
    ``memory``: sample every process's PSS (a separate run: sampling costs CPU beside it)."""
    workdir = folder / f"fedcore-{dataset}-k{clients}-{per_process}"
    shutil.rmtree(workdir, ignore_errors=True)
    cache = folder / f"cache-{dataset}-k{clients}-{per_process}"
    shutil.rmtree(cache, ignore_errors=True)
    document = manifest(folder, clients, rounds, dataset)
    command = [sys.executable, "-m", "fedcore", "run", str(document)]
    command += ["--json", "--quiet", "--workdir", str(workdir)]
    command += ["--clients-per-process", per_process]
    sampler = TreeSampler(interval=0.05) if memory else None
    launched = wall()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env={**os.environ, **ONE_THREAD, "FEDCORE_CACHE_DIR": str(cache)},
        start_new_session=True,
    )
    if sampler is not None:
        sampler.add(process.pid)
        sampler.start()
    try:
        stdout, _ = process.communicate(timeout=CAP_SECONDS)
    except subprocess.TimeoutExpired:
        stop_group(process)
        stdout = ""
    peak = None if sampler is None else sampler.stop()
    result: dict[str, Any] = {
        "side": f"fedcore-{per_process}",
        "clients": clients,
        "total": wall() - launched,
        "peak_bytes": peak,
        "failure": None,
    }
    if process.returncode != 0 or not stdout.strip():
        result["failure"] = f"exit status {process.returncode}"
        return result
    summary = json.loads(stdout.strip().splitlines()[-1])
    events = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
    rounds_seen = [event for event in events if event["event"] == "round"]
    first = rounds_seen[0]
    result["startup"] = float(first["time"]) - float(first["seconds"]) - launched
    result["round_seconds"] = [float(event["seconds"]) for event in rounds_seen]
    result["median_round"] = statistics.median(result["round_seconds"])
    result["accuracy"] = summary["accuracy"]
    if sampler is not None:
        per_role: dict[str, list[int]] = {"server": [], "client": []}
        for pid, size in sampler.peaks.items():
            role = role_of(sampler.outputs.get(pid, ""))
            if role is not None:
                per_role[role].append(size)
        result["server_bytes"] = max(per_role["server"], default=0)
        result["client_process_bytes"] = sorted(per_role["client"])
    logs = list((workdir / "logs").glob("*.log"))
    result["client_processes"] = sum(role_of(str(path)) == "client" for path in logs)
    result["parses"] = sum(path.read_text().count("Parsed the data source") for path in logs)
    shutil.rmtree(workdir, ignore_errors=True)
    return result


def floor_side(clients: int, rounds: int, *, memory: bool, dataset: str) -> dict[str, Any]:
    """The floor in a fresh process, as benchmarks/flower.py measures it."""
    measured: Measured = run_floor(clients, rounds, memory=memory, dataset=dataset)
    return {
        "side": "floor",
        "clients": clients,
        "startup": measured.startup,
        "median_round": measured.median_round,
        "round_seconds": measured.round_seconds,
        "total": measured.total,
        "accuracy": measured.accuracy,
        "peak_bytes": measured.peak_bytes if memory else None,
        "failure": measured.failure,
    }


def one_side(
    folder: Path, side: str, clients: int, rounds: int, *, memory: bool, dataset: str
) -> dict[str, Any]:
    """One run of ``side`` (``floor``, ``fedcore-auto`` or ``fedcore-1``)."""
    if side == "floor":
        return floor_side(clients, rounds, memory=memory, dataset=dataset)
    per_process = side.split("-")[1]
    return run_fedcore(folder, clients, rounds, per_process, memory=memory, dataset=dataset)


def shard_and_model_bytes(clients: int, dataset: str = "digits") -> dict[str, int]:
    """What a client of the K-client job must hold: its shard and its model."""
    from fedcore.roles._common import model_parameters
    from fedcore.spec import load_manifest

    with tempfile.TemporaryDirectory() as tmp:
        spec = load_manifest(manifest(Path(tmp), clients, 1, dataset)).spec
    parameters = model_parameters(spec)
    train, features = TRAIN_EXAMPLES[dataset]
    rows = -(-train // clients)
    return {"shard": rows * (features * 4 + 8), "model": parameters * 4 * 2}


def paired(fedcore: list[dict[str, Any]], floor: list[dict[str, Any]], key: str) -> float | None:
    """The median over repeats of fedcore's ``key`` over the floor's in the same repeat."""
    ratios = [
        a[key] / b[key]
        for a, b in zip(fedcore, floor, strict=False)
        if a.get(key) and b.get(key) and not a.get("failure") and not b.get("failure")
    ]
    return statistics.median(ratios) if ratios else None


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [run[key] for run in runs if run.get(key) is not None and not run.get("failure")]
    return statistics.median(values) if values else None


def run(
    *,
    repeats: int = 3,
    jobs: tuple[tuple[int, int], ...] = JOBS,
    start_jobs: tuple[tuple[int, int], ...] = START_JOBS,
) -> dict[str, Any]:
    """Runs every side of every job, alternating; returns the raw runs, medians and ratios."""
    data: dict[str, Any] = {
        "machine": machine(),
        "repeats": repeats,
        "load_start": load(),
        "jobs": [],
    }
    with tempfile.TemporaryDirectory(prefix="fedcore-many-") as tmp:
        folder = Path(tmp)
        every = [("digits", k, r) for k, r in jobs] + [("mnist", k, r) for k, r in start_jobs]
        for dataset, clients, rounds in every:
            sides = ["floor", "fedcore-auto"]
            if clients in ONE_PER_PROCESS and dataset == "digits":
                sides.append("fedcore-1")
            runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
            sampled: dict[str, dict[str, Any]] = {}

            for side in sides:  # memory: a run of its own per side, timed by nobody
                sampled[side] = one_side(
                    folder, side, clients, rounds, memory=True, dataset=dataset
                )
            for repeat in range(repeats):
                for side in sides:
                    runs[side].append(
                        one_side(folder, side, clients, rounds, memory=False, dataset=dataset)
                    )
                print(
                    f"{dataset} K={clients} repeat {repeat + 1}: "
                    + ", ".join(
                        f"{side} start {runs[side][-1].get('startup') or 0:.2f} s, round "
                        f"{(runs[side][-1].get('median_round') or 0) * 1000:.0f} ms"
                        + (f" ({runs[side][-1]['failure']})" if runs[side][-1]["failure"] else "")
                        for side in sides
                    ),
                    file=sys.stderr,
                )
            medians = {
                side: {
                    key: median_of(runs[side], key)
                    for key in ("startup", "median_round", "total", "accuracy")
                }
                for side in sides
            }
            for side in sides:
                memory_run = sampled[side]
                ok = not memory_run.get("failure")
                medians[side]["peak_bytes"] = memory_run.get("peak_bytes") if ok else None
                if side == "floor":
                    continue
                good = [r for r in runs[side] if not r["failure"]]
                sizes = memory_run.get("client_process_bytes") if ok else None
                medians[side]["server_bytes"] = memory_run.get("server_bytes") if ok else None
                medians[side]["client_processes"] = median_of(good, "client_processes")
                medians[side]["client_process_median"] = statistics.median(sizes) if sizes else None
                medians[side]["client_process_max"] = max(sizes) if sizes else None
                medians[side]["parses"] = max(
                    (r["parses"] for r in [*good, memory_run] if "parses" in r), default=None
                )
            data["jobs"].append(
                {
                    "dataset": dataset,
                    "clients": clients,
                    "rounds": rounds,
                    "holds": shard_and_model_bytes(clients, dataset),
                    "runs": runs,
                    "memory_runs": sampled,
                    "medians": medians,
                    "ratios": {
                        f"{side}/floor {key}": paired(runs[side], runs["floor"], key)
                        for side in sides[1:]
                        for key in ("startup", "median_round")
                    },
                }
            )
    data["load_end"] = load()
    return data


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def secs(value: float | None, scale: float = 1.0, spec: str = ".2f") -> str:
    return "-" if value is None else format(value * scale, spec)


def target_rows(data: dict[str, Any]) -> list[str]:
    """The rows of docs/benchmarks.md's targets table."""
    rows = []
    for job in data["jobs"]:
        k = job["clients"]
        dataset = job.get("dataset", "digits")
        job_name = JOB_NAMES[dataset]
        for key in ("startup", "median_round"):
            limit = TARGETS["startup" if key == "startup" else "round"].get(k)
            ratio = job["ratios"].get(f"fedcore-auto/floor {key}")
            if limit is None or ratio is None or (key != "startup" and dataset != "digits"):
                continue
            what = (
                f"fedcore run's start-up (launch to round 1) on the {job_name} at K={k} at "
                f"most {limit}x the floor's"
                if key == "startup"
                else f"fedcore median round on the {job_name} (K={k}, clients grouped as auto "
                f"picks) at most {limit}x the floor"
            )
            rows.append(f"| {what} | {ratio:.2f}x | {'met' if ratio <= limit else 'missed'} |")
        if k == 200:
            peak = job["medians"]["fedcore-auto"]["peak_bytes"]
            if peak is not None:
                rows.append(
                    f"| all processes of the K=200 run within 4 GiB (PSS) | "
                    f"{peak / 2**30:.2f} GiB | {'met' if peak <= MEMORY_TARGET else 'missed'} |"
                )
    return rows


def grouping(data: dict[str, Any]) -> str:
    """What grouping changed at the K where both modes ran, from the measurement."""
    for job in data["jobs"]:
        ratios = job["ratios"]
        alone = ratios.get("fedcore-1/floor median_round")
        grouped = ratios.get("fedcore-auto/floor median_round")
        if alone is None or grouped is None:
            continue
        many = job["medians"]["fedcore-1"].get("client_processes")
        few = job["medians"]["fedcore-auto"].get("client_processes")
        return (
            f"Grouping clients took the client processes from {many:.0f} to {few:.0f} and the "
            f"round from {alone:.2f}x to {grouped:.2f}x the floor at K={job['clients']} (table "
            f"above)"
        )
    return "Grouping clients cuts the processes (table above)"


def bounds(data: dict[str, Any]) -> list[str]:
    """What bounds the missed targets, as measured."""
    return [
        "**What bounds the round with many clients.** The floor trains every client in one loop. "
        "fedcore does the same training in each client and adds, per client and round, one "
        "model sent and one upload received, decoded, checked and averaged, over a gRPC stream "
        "of that client's own mutual-TLS channel. Those costs are per message, not per byte (a "
        "digits model is 36 KB), so the ratio to the floor depends on what the machine's "
        "training costs per client: this VM has been an AMD EPYC on some days and an Intel "
        "Xeon on others (the machine line above says which ran this table). On the AMD "
        "(2026-11-26 and 27) the floor trained a client in about 0.3 ms and fedcore's median "
        "round was 2.49x the floor's at K=50 and 2.28x at K=200; on the Intel (2026-11-28) the "
        "floor takes about 0.6 ms per client, and two runs of this benchmark that day "
        "measured 1.84x and 1.80x at K=50, 1.62x and 1.78x at K=200. "
        f"{grouping(data)}.",
        "",
        "On the AMD, sampled with py-spy on K=50 and K=200 runs (2026-11-26): a client "
        "process's CPU went 52% to training (the floor's work), 17% to gRPC's write of the "
        "upload (TLS and the system call included), 7% each to encoding and decoding, 4% to "
        "reading and 4% to its metrics; the server's 36% to writing the tasks, 25% to checking "
        "the uploads (finiteness, step norm), 13% to decoding, 10% to reading, 4% to averaging. "
        "In all about 1 ms of CPU per client and round (0.75 ms in the client, 0.27 ms in the "
        "server) against the floor's 0.3 ms. The sessions run on asyncio since 2026-11-26 "
        "(docs/architecture.md), which took the K=50 round from 47 to 33 ms and the K=200 round "
        "from 219 to 129 ms measured side by side; before, most of a round was thread "
        "hand-offs. Timed per call inside a K=50 run (2026-11-27, thread CPU time, 4 client "
        "processes of 12-13 clients and the server on 2 cores), the same work cost 1.5-3x what "
        "it costs alone in a warm loop: a client's training step 0.50 ms against 0.31 ms, "
        "loading the weights 56 us against 16-29 us, encoding an upload 42 us against 15 us, "
        "decoding a task 47 us against 15 us. The machine switches contexts about 25,000 times "
        "a second in such a run (each message wakes gRPC's threads and then the event loop, in "
        "5 processes), so each step starts on cold caches. Neither pinning the processes to "
        "cores (31-32 ms against 33 ms) nor fewer, larger client processes (2: 34 ms, 1: 37.5 "
        "ms, against 4: 33 ms) shortened it.",
        "",
        "On the Intel (2026-11-28), over rounds 20 to 220 of a K=50 run: 92-104 ms of CPU per "
        "round for all processes (the server 27 ms, each process of 12-13 clients 16-18 ms) "
        "against the floor's 31 ms, in a round of 53-60 ms, so both cores were busy 1.7 of "
        "them; 700-740 context switches per round. Per call, in thread CPU time: a client's "
        "training 0.86 ms (0.55 ms in a warm loop of 12 clients, the floor's own 0.55 ms), "
        "encoding its upload 75 us, decoding its task 89 us; the server's check and fold of "
        "an upload 145 us (65 us warm), decoding it 81 us. Traced through a round, the "
        "processes of clients had computed their last uploads about 40 ms after the round "
        "opened, but the server took its last one at about 51 ms: the server, one process on "
        "one core, is the round's tail, and its task writes reach the last process of clients "
        "up to 16 ms after the first. Tried there and not kept: spreading the clients over the "
        "processes in turn (client k to process k mod 4, so every process gets a task among "
        "the first four) took 54.6-55.8 ms against 53.1-54.0 ms; lowering the client "
        "processes' priority (nice 5 and 10) did not shorten the tail; gRPC without its event "
        "engine (`GRPC_EXPERIMENTS`) cut the context switches to about 410 per round but not "
        "the round (51.8 against 53.2 ms). The K=50 target would need the CPU per client and "
        "round cut by about a fifth on this machine, and by a third on the AMD. What the "
        "transport alone costs per client and round is measured apart, by layer, in 'One "
        "model exchange per client and round, by transport stack' (`benchmarks/exchange.py`): "
        "with 50 clients on 2026-11-28, 0.58 ms of CPU per exchange over fedcore's sessions "
        "against gRPC's own 0.30 ms and raw mutual TLS's 0.18 ms, so even a transport that "
        "cost what gRPC itself costs would spend half the floor's training per client.",
        "",
        "**Start-up** is bounded by the forkserver's imports on one core (torch, torch._dynamo "
        "for the optimizer, fedcore's roles and its spec's pydantic models: about 1.4 s here, "
        "a third less with the cyclic GC off while importing); the floor imports torch and "
        "scikit-learn but imports torch._dynamo inside its first round, which is why its round 1 "
        "takes longer. Everything else overlaps it: on the other core the command, the "
        "certificates and the data cache's parse; once the forkserver is warm, the server and "
        "the clients start together (about 0.3 s to the first round at K=10).",
    ]


JOB_NAMES = {"digits": "digits job", "mnist": "MNIST-subset job (CNN)"}

LABELS = {
    "floor": "floor (one process)",
    "fedcore-auto": "fedcore run (auto)",
    "fedcore-1": "fedcore run, a process per client",
}


def render(data: dict[str, Any]) -> str:
    """The section of docs/benchmarks.md."""
    lines = [
        BEGIN,
        "## Start-up, memory per role and many clients",
        "",
        f"Measured by `python -m benchmarks.many_clients --write` ({data['machine']}); "
        f"{data['repeats']} repeats, the sides back to back inside each; medians. Load average "
        f"(1/5/15 min) {data['load_start']} at the start, {data['load_end']} at the end.",
        "",
        "The job is examples/digits-fedavg.yaml with K clients and checkpoints off (*digits*), "
        "and, for the start-up of every shipped data set, the same on the MNIST subset with a CNN "
        "of 8 and 16 channels (*mnist*, a few rounds: its rounds are no target). *Start-up* "
        "is from the command's launch to its first round for every side: for the floor, the "
        "interpreter, torch, scikit-learn, data and model; for fedcore, the command, the CA and "
        "certificates, the forkserver's imports, the server, the data (parsed once per machine, "
        "into a fresh cache each run) and every client connected over mutual TLS. *x floor* is "
        "the median over repeats of the ratio to the floor measured just before. Memory is the "
        "peak PSS of all the side's processes, and each role process's own peak, sampled every "
        "50 ms in one more run of each side, apart from the timed ones: reading a process's PSS "
        "costs about 3 ms of CPU, so sampling a dozen processes every 50 ms took most of a core "
        "from the side with the most processes, and slowed it by a quarter to a third.",
        "",
        "| data | K | side | start-up (s) | x floor | median round (ms) | x floor | total (s) "
        "| accuracy | client processes | peak PSS, all (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for job in data["jobs"]:
        k = job["clients"]
        for side, values in job["medians"].items():
            start = job["ratios"].get(f"{side}/floor startup")
            rnd = job["ratios"].get(f"{side}/floor median_round")
            lines.append(
                f"| {job.get('dataset', 'digits')} | {k} | {LABELS[side]} | "
                f"{secs(values['startup'])} | "
                f"{'-' if start is None else f'{start:.2f}x'} | "
                f"{secs(values['median_round'], 1000, '.0f')} | "
                f"{'-' if rnd is None else f'{rnd:.2f}x'} | {secs(values['total'], 1, '.1f')} | "
                f"{secs(values['accuracy'], 1, '.4f')} | "
                f"{values.get('client_processes') or ('-' if side == 'floor' else '?')} | "
                f"{mib(values['peak_bytes'])} |"
            )
    lines += [
        "",
        "Memory per role (PSS, MiB; each process's own peak, in the sampled run). A client "
        "holds its shard and its model; the rest of a client process is the constant: its share "
        "of the interpreter, torch and gRPC mapped from the forkserver, and its own heap.",
        "",
        "| data | K | side | server | client process, median | client process, largest "
        "| clients per process | a client's shard + model (KiB) | parses of the source |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for job in data["jobs"]:
        k = job["clients"]
        holds = job["holds"]
        for side, values in job["medians"].items():
            if side == "floor":
                continue
            processes = values.get("client_processes") or 0
            per = f"{k / processes:.1f}" if processes else "-"
            lines.append(
                f"| {job.get('dataset', 'digits')} | {k} | {LABELS[side]} | "
                f"{mib(values.get('server_bytes'))} | "
                f"{mib(values.get('client_process_median'))} | "
                f"{mib(values.get('client_process_max'))} | {per} | "
                f"{(holds['shard'] + holds['model']) / 1024:.0f} | {values.get('parses')} |"
            )
    lines += ["", *bounds(data), END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the comparison, prints the section and (with --write) updates the docs."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="repeats per side (default 3)")
    parser.add_argument(
        "--jobs",
        default=",".join(f"{k}x{r}" for k, r in JOBS),
        help="KxR pairs, comma-separated (default 10x20,50x30,200x15)",
    )
    parser.add_argument(
        "--start-jobs",
        default=",".join(f"{k}x{r}" for k, r in START_JOBS),
        help="KxR pairs of the MNIST-subset job, measured for start-up (default 10x3,50x3; "
        "empty: none)",
    )
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args(argv)
    data = run(
        repeats=args.repeats, jobs=parse_jobs(args.jobs), start_jobs=parse_jobs(args.start_jobs)
    )
    publish(render(data), data, "many_clients", begin=BEGIN, end=END, write=args.write)
    return data


if __name__ == "__main__":
    main()

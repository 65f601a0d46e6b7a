"""Large models: transformers of 100 million and 1 billion parameters, 4 clients, processes.

The job is fedavg with the example's user model (examples/models/big_transformer.py, built by
``spec.model.importPath``): ``digits_transformer`` (width 1024, 8 layers: about 101 million
parameters, 404 MB in float32) and ``transformer_1b`` (width 2048, 20 layers: about 1.0 billion,
4.0 GB). The data are a few digits per client (an NpzFolder the benchmark writes: 8 training
examples each, 16 held out on the server, one local step of batch 8), so that a round's time is
the data path's (broadcast, upload, checks, aggregation, evaluation) more than training's.
``fedcore run`` starts a server and one process per client over mutual TLS on loopback, with
checkpoints off and the final model released.

Reported per size: the server's bytes per round (its own counters), start-up and the median
round, and every process's peak memory (PSS, sampled every 0.25 s), also as a multiple of the
model's bytes. A memory guard stops a run whose processes pass 21 GiB together
(``--guard-gib``) or that leaves the machine under 1.5 GiB available, and the table says so.

Run: ``python benchmarks/bigmodel.py [--sizes 100m,1b] [--write]``.
"""

from __future__ import annotations

import argparse
import json
import os
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

from benchmarks.measure import TreeSampler, load, machine, stop_group  # noqa: E402
from benchmarks.spine import publish  # noqa: E402

BEGIN = "<!-- bigmodel:begin -->"
END = "<!-- bigmodel:end -->"
MODELS = ROOT / "examples" / "models"
SIZES = {
    "100m": ("big_transformer:digits_transformer", 2),
    "1b": ("big_transformer:transformer_1b", 1),
}
"""Size name: (importPath, rounds)."""
CLIENTS, PER_CLIENT, HELD_OUT = 4, 8, 16
GUARD_BYTES, MIN_AVAILABLE = 21 * 2**30, 3 * 2**29


def write_data(folder: Path) -> Path:
    """Digits (8x8, features /16) for CLIENTS clients and a held-out file, as an NpzFolder."""
    from fedcore.learning.data import load_split
    from fedcore.spec import DataSpec

    train, test = load_split(DataSpec())
    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    for index in range(CLIENTS):
        rows = np.arange(index * PER_CLIENT, (index + 1) * PER_CLIENT)
        np.savez(data / f"client-{index}.npz", x=train.x[rows], y=train.y[rows])
    np.savez(data / "test.npz", x=test.x[:HELD_OUT], y=test.y[:HELD_OUT])
    return data


def manifest(folder: Path, size: str, data: Path, storage: str = "Auto") -> Path:
    """The job for ``size``: fedavg of the user model over the written data, the server's
    uploads kept as ``storage`` says (``spec.uploads.storage``)."""
    import_path, rounds = SIZES[size]
    document = {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "FederatedRun",
        "metadata": {"name": f"bigmodel-{size}"},
        "spec": {
            "protocol": {"name": "fedavg"},
            "model": {"kind": "Import", "importPath": import_path},
            "data": {
                "source": {"kind": "NpzFolder", "path": str(data)},
                "partition": {"kind": "ByFile"},
            },
            "clients": {"count": CLIENTS},
            "rounds": rounds,
            "training": {
                "batchSize": PER_CLIENT,
                "optimizer": {"kind": "SGD", "learningRate": 0.01},
            },
            "checkpoint": {"everyRounds": 0},
            "uploads": {"storage": storage},
            "seed": 0,
        },
    }
    path = folder / f"{size}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def parameters(size: str) -> int:
    """The model's parameter count, built on the meta device (no memory)."""
    import torch

    sys.path.insert(0, str(MODELS))
    import big_transformer

    factory = getattr(big_transformer, SIZES[size][0].split(":")[1])
    with torch.device("meta"):
        model = factory((1, 8, 8), 10)
    return sum(int(t.numel()) for t in model.state_dict().values())


def _role(output: str | None) -> str:
    """A process's role from the log file its output goes to."""
    if output is None:
        return "other"
    name = Path(output).name
    return name[: -len(".log")] if name.endswith(".log") else "command"


def run_one(
    size: str,
    folder: Path,
    guard_bytes: int = GUARD_BYTES,
    per_process: int | str = 1,
    storage: str = "Auto",
) -> dict[str, Any]:
    """One ``fedcore run`` of ``size`` with ``per_process`` clients in a process (a number, or
    ``auto``: as the runner picks, recorded from its start event) and the server's uploads as
    ``storage`` says, sampled; its results and every process's peak."""
    data = write_data(folder)
    path = manifest(folder, size, data, storage)
    work = folder / f"work-{size}"
    paths = [str(MODELS), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    command = [sys.executable, "-m", "fedcore", "run", str(path), "--json", "--quiet"]
    command += ["--workdir", str(work), "--clients-per-process", str(per_process)]
    sampler = TreeSampler(interval=0.25, max_bytes=guard_bytes, min_available=MIN_AVAILABLE)
    started = time.monotonic()
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    sampler.add(process.pid)
    sampler.start()
    tripped = None
    while process.poll() is None:
        if sampler.tripped is not None:
            tripped = sampler.tripped
            stop_group(process, grace=5)
            break
        time.sleep(0.25)
    stdout, stderr = process.communicate()
    wall = time.monotonic() - started
    total = sampler.stop()
    peaks: dict[str, int] = {}
    for pid, peak in sampler.peaks.items():
        role = _role(sampler.outputs.get(pid))
        peaks[role] = max(peaks.get(role, 0), peak)
    result: dict[str, Any] = {}
    lines = stdout.decode().strip().splitlines()
    if lines:
        try:
            result = json.loads(lines[-1])
        except json.JSONDecodeError:
            result = {}
    picked = _picked_per_process(work / "events.jsonl") if per_process == "auto" else None
    server_log = work / "logs" / "server.log"
    on_disk = server_log.exists() and "uploads on disk" in server_log.read_text(errors="replace")
    return {
        "size": size,
        "per_process": per_process if picked is None else f"{picked} (auto)",
        "storage": storage if storage != "Auto" else f"{'Disk' if on_disk else 'Memory'} (auto)",
        "parameters": parameters(size),
        "rounds": SIZES[size][1],
        "wall": wall,
        "peak_total": total,
        "peaks": peaks,
        "tripped": tripped,
        "phase": result.get("phase"),
        "reason": result.get("reason"),
        "startup": result.get("startup_seconds"),
        "median_round": result.get("median_round_seconds"),
        "sent": result.get("server_bytes_sent"),
        "received": result.get("server_bytes_received"),
        "stderr": stderr.decode()[-2000:] if process.returncode else "",
    }


def _picked_per_process(events: Path) -> int | None:
    """Clients per process as the runner's ``starting`` event of its clients says (auto)."""
    if not events.exists():
        return None
    for line in events.read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "starting" and event.get("phase") == "clients":
            return -(-int(event["clients"]) // int(event["processes"]))
    return None


def run(
    sizes: list[str],
    guard_bytes: int = GUARD_BYTES,
    per_process: tuple[int | str, ...] = (1,),
    storages: tuple[str, ...] = ("Auto",),
) -> dict[str, Any]:
    data: dict[str, Any] = {"machine": machine(), "load_start": load(), "runs": []}
    data["kernel_bytes"] = kernel_bytes()
    for size in sizes:
        for count in per_process:
            for storage in storages:
                with tempfile.TemporaryDirectory(prefix=f"fedcore-bigmodel-{size}-") as folder:
                    one = run_one(size, Path(folder), guard_bytes, count, storage)
                    data["runs"].append({**one, "machine": "A"})
                    print(json.dumps(data["runs"][-1], default=str)[:1500], file=sys.stderr)
    data["load_end"] = load()
    return data


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def merge(data: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the runs of ``other`` (another invocation's ``--json-out``, e.g. on a
    machine with the memory for the 1-billion-parameter run) appended, as machine B."""
    runs = [*data["runs"], *({**run, "machine": "B"} for run in other["runs"])]
    return {
        **data,
        "runs": runs,
        "other": {k: other[k] for k in ("machine", "load_start", "load_end")},
    }


def render(data: dict[str, Any]) -> str:
    machines = f"A: {data['machine']}, load average (1/5/15 min) {data['load_start']} at the "
    machines += f"start, {data['load_end']} at the end"
    if "other" in data:
        other = data["other"]
        machines += f"; B: {other['machine']}, load average {other['load_start']} at the start, "
        machines += f"{other['load_end']} at the end"
    lines = [
        BEGIN,
        "## Large models: 100 million and 1 billion parameters",
        "",
        f"`python benchmarks/bigmodel.py --write` (machines {machines}). fedavg of "
        "examples/models/big_transformer.py (a user model by `spec.model.importPath`) with "
        f"{CLIENTS} clients (a process each, or all in one: *per process*) over mutual TLS on "
        f"loopback; {PER_CLIENT} digits "
        f"per client (one local step), {HELD_OUT} held out on the server, checkpoints off. "
        "Bytes are the server's counters per round; memory is each process's peak PSS, and "
        "*x model* divides it by the model's float32 bytes.",
        "",
        "| model | machine | parameters | model (GB) | clients per process | server's uploads "
        "| outcome "
        "| start-up (s) | median round (s) | server sent / received per round (GB) "
        "| server peak (GB) | x model | client process peak, largest (GB) | x model "
        "| all processes (GB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for item in data["runs"]:
        model_bytes = 4 * item["parameters"]
        peaks = item["peaks"]
        clients = [v for k, v in peaks.items() if k.startswith("client")]
        client = max(clients) if clients else None
        server = peaks.get("server")
        rounds = item["rounds"]
        sent = None if item["sent"] is None else item["sent"] / rounds
        received = None if item["received"] is None else item["received"] / rounds
        outcome = item["tripped"] or f"{item['phase']} ({item['reason']})"
        lines.append(
            f"| {item['size']} | {item.get('machine', 'A')} | {item['parameters']:,} "
            f"| {model_bytes / 1e9:.2f} | {item.get('per_process', 1)} "
            f"| {item.get('storage', 'Memory')} | {outcome} "
            f"| {_seconds(item['startup'])} | {_seconds(item['median_round'])} "
            f"| {_gb(sent)} / {_gb(received)} | {_gb(server)} "
            f"| {'-' if server is None else f'{server / model_bytes:.1f}x'} | {_gb(client)} "
            f"| {'-' if client is None else f'{client / model_bytes:.1f}x'} "
            f"| {_gb(item['peak_total'])} |"
        )
    lines += [
        "",
        "Every process's peak (GB): "
        + "; ".join(
            f"{item['size']} ({item.get('machine', 'A')}, "
            f"{item.get('per_process', 1)} per process, uploads "
            f"{item.get('storage', 'Memory')}): "
            + ", ".join(f"{role} {peak / 1e9:.2f}" for role, peak in sorted(item["peaks"].items()))
            for item in data["runs"]
        )
        + ".",
        "",
        "What each role holds (docs/operations.md, 'Large models'): the server the global "
        "model, the float64 sum of the round's uploads (twice a float32 model) and the upload "
        "it is receiving and checking, 4x the model plus the interpreter, torch and gRPC; with "
        "its uploads on disk (*server's uploads* Disk: `spec.uploads.storage`, which Auto "
        "picks where 4x would not fit) the model and the upload it checks, then the old model "
        "and the new one at combine, 2x, for K model-sized files a round on disk; a "
        "client the model once: its task is decoded into the bytes of the task before (the "
        "model's own memory is let go at start), it trains there, stepping each parameter "
        "and dropping its gradient during the backward pass, and uploads those same bytes; "
        "with its activations that is about 1x the model. The clients of one process share "
        "one model and take turns with large tasks, so they hold one model, whatever their "
        "number. " + target_sentence(data) + slope_sentence(data),
        END,
    ]
    return "\n".join(lines)


RESULTS = ROOT / "docs" / "benchmarks" / "bigmodel.json"
"""What ``--write`` last published (run_all's targets table reads it)."""


def target_rows(data: dict[str, Any]) -> list[str]:
    """The targets table's rows for large models: the server's peak against 2x the model plus
    a constant, and the 1-billion-parameter round against this machine's 24 GB."""
    rows = []
    parts = []
    slopes = server_slopes(data)
    for on_disk, label in ((True, "uploads on disk"), (False, "in memory")):
        if on_disk in slopes:
            slope, constant, points = slopes[on_disk]
            parts.append(f"{label}: {slope:.2f}x + {constant / 1e9:.2f} GB ({points})")
    if parts:
        met = True in slopes and slopes[True][0] <= 2.0
        rows.append(
            "| server peak memory at most 2x the model's bytes plus a constant, whatever K "
            "(fedavg, 4 clients; x: the slope of the server's peak over the model's bytes "
            "between the smallest and the largest model measured, the largest peak at each; "
            "with `spec.uploads.storage: Disk`, which Auto picks where 4x would not fit) | "
            f"{'; '.join(parts)} | {'met' if met else 'missed'} |"
        )
    best = best_billion_run(data)
    if best is not None:
        rows.append(
            "| a round with 4 clients at 1B parameters (4 GB in float32) within this machine's "
            f"24 GB | {best['peak_total'] / 1e9:.1f} GB, all processes "
            f"({best.get('per_process', 1)} clients per process) | "
            f"{'met' if best['peak_total'] <= TARGET_BYTES else 'missed'} |"
        )
    return rows


def server_slopes(data: dict[str, Any]) -> dict[bool, tuple[float, float, str]]:
    """Per storage (True: uploads on disk), the server's peak as ``slope x model + constant``
    through the largest peak of the smallest and of the largest model that succeeded on this
    machine (A), with the points as text; a storage measured at one size only is left out."""
    peaks: dict[bool, dict[int, tuple[float, str]]] = {True: {}, False: {}}
    for item in data["runs"]:
        server = item["peaks"].get("server")
        if item["phase"] != "Succeeded" or not server or item.get("machine", "A") != "A":
            continue
        on_disk = str(item.get("storage", "Memory")).startswith("Disk")
        model_bytes = 4 * item["parameters"]
        if server > peaks[on_disk].get(model_bytes, (0.0, ""))[0]:
            peaks[on_disk][model_bytes] = (server, item["size"])
    slopes = {}
    for on_disk, points in peaks.items():
        if len(points) < 2:
            continue
        small, large = min(points), max(points)
        slope = (points[large][0] - points[small][0]) / (large - small)
        constant = points[small][0] - slope * small
        text = ", ".join(
            f"{points[size][0] / 1e9:.2f} GB at {points[size][1]}" for size in (small, large)
        )
        slopes[on_disk] = (slope, constant, text)
    return slopes


def slope_sentence(data: dict[str, Any]) -> str:
    """What the server's peak costs per byte of model, per storage (``server_slopes``)."""
    slopes = server_slopes(data)
    if not slopes:
        return ""
    parts = [
        f"{slope:.2f}x the model's bytes plus {constant / 1e9:.2f} GB {label} ({points})"
        for on_disk, label in ((True, "with its uploads on disk"), (False, "in memory"))
        if on_disk in slopes
        for slope, constant, points in [slopes[on_disk]]
    ]
    return (
        " Between the two models the server's largest peak grows as "
        + " and ".join(parts)
        + ": the constant is the interpreter, torch, gRPC and the compiled kernels"
        + (
            ""
            if data.get("kernel_bytes") is None
            else f" (numba's import and compilation: {data['kernel_bytes'] / 1e9:.2f} GB, "
            "measured alone)"
        )
        + ", with a message's buffers in flight."
    )


KERNEL_PROBE = """
import numpy as np
def pss():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("Pss:"))
from fedcore.protocols import _kernels as k
a, acc = np.ones(1 << 21, np.float32), np.zeros(1 << 21)
before = pss()
k.squared_distance(a, a)
for count in (1, 2, 4, 8):
    k.fold_many_into(acc, [a] * count, [1.0] * count)
k.divide_into(np.empty(1 << 21, np.float32), acc, 2.0)
print(pss() - before)
"""
"""Prints what loading and compiling the server's kernels adds to a process's PSS."""


def kernel_bytes() -> int | None:
    """PSS that numba's import and the server's kernels' compilation add, in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", KERNEL_PROBE],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    return int(lines[-1]) if done.returncode == 0 and lines else None


def best_billion_run(data: dict[str, Any]) -> dict[str, Any] | None:
    """The succeeded 1-billion-parameter run on this machine (A) with the least memory."""
    done = [
        r
        for r in data["runs"]
        if r["size"] == "1b"
        and r.get("machine", "A") == "A"
        and r["phase"] == "Succeeded"
        and r["peak_total"]
    ]
    return min(done, key=lambda r: r["peak_total"]) if done else None


TARGET_BYTES = 24 * 10**9
"""Issue 29's bound for a 1-billion-parameter round with 4 clients: this machine's 24 GB."""


def target_sentence(data: dict[str, Any]) -> str:
    """Whether a 1-billion-parameter round of this invocation fitted in ``TARGET_BYTES``."""
    best = best_billion_run(data)
    if best is None:
        return (
            "The target (a round with 4 clients at 1B parameters within this machine's 24 GB) "
            "was not measured on this machine in this invocation."
        )
    verdict = "met" if best["peak_total"] <= TARGET_BYTES else "missed"
    return (
        f"The target (a round with 4 clients at 1B parameters within this machine's 24 GB) "
        f"is {verdict}: {best['peak_total'] / 1e9:.1f} GB for all processes at once with "
        f"{best.get('per_process', 1)} clients per process. Before 2026-11-27's bounds a "
        "client held the model three times (the model, the task it was sent, the upload "
        "copied out) and each client had a process and a model of its own: the same round "
        "took 58.7 GB (each client 12.6 GB) on a 128 GiB machine, and the 100-million-"
        "parameter one 7.7 GB on this one. In memory the server's float64 sum keeps it "
        "at 4x; with its uploads on disk it holds 2x (docs/operations.md)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="100m,1b", help="comma list of: " + ", ".join(SIZES))
    parser.add_argument(
        "--guard-gib", type=float, default=GUARD_BYTES / 2**30, help="memory guard, all processes"
    )
    parser.add_argument(
        "--per-process",
        default="1,auto",
        help="clients per process to run each size with, comma-separated: numbers, or auto "
        "as fedcore run picks by default (default 1,auto)",
    )
    parser.add_argument(
        "--storage",
        default="Auto,Disk",
        help="spec.uploads.storage values to run each size and per-process count with, "
        "comma-separated (default Auto,Disk)",
    )
    parser.add_argument("--json-out", type=Path, help="also write the numbers to this file")
    parser.add_argument("--from-json", type=Path, help="no run: render this --json-out file")
    parser.add_argument(
        "--merge", type=Path, help="add the runs of another invocation's --json-out (machine B)"
    )
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    sizes = [size for size in args.sizes.split(",") if size]
    if args.from_json is not None:  # render an earlier invocation's numbers
        data = json.loads(args.from_json.read_text())
    else:
        named = [count for count in args.per_process.split(",") if count]
        counts = tuple(count if count == "auto" else int(count) for count in named)
        storages = tuple(value for value in args.storage.split(",") if value)
        data = run(sizes, int(args.guard_gib * 2**30), counts, storages)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(data, indent=1, default=str))
    if args.merge is not None:
        data = merge(data, json.loads(args.merge.read_text()))
    publish(render(data), data, "bigmodel", begin=BEGIN, end=END, write=args.write)
    medians = [r["median_round"] for r in data["runs"] if r["median_round"]]
    if medians:
        print(f"median of the median rounds: {statistics.median(medians):.2f} s", file=sys.stderr)


if __name__ == "__main__":
    main()

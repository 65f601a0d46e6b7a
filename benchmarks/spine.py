"""The runtime spine benchmark: examples/digits-fedavg.yaml end to end against the floor.

Both sides run in this one invocation, alternating, ``--repeats`` times each:

* **floor**: the same maths as a plain single-process loop with no framework
  (``benchmarks/floor.py``);
* **fedcore**: ``fedcore run examples/digits-fedavg.yaml``: a server and 10 client processes
  talking gRPC over mutual TLS on loopback, with checkpoints and metrics on.

It reports start-up time, median round time, total time, accuracy and peak memory (the summed
proportional set size of every process of a side, sampled every 50 ms), the medians over repeats,
and the round-time ratio fedcore/floor. ``--write`` replaces the spine section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "digits-fedavg.yaml"
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN = "<!-- spine:begin -->"
END = "<!-- spine:end -->"


def tree_pss_bytes(root: int) -> int:
    """Returns the summed proportional set size (PSS) of ``root`` and all its descendants.

    PSS splits each shared page among the processes that map it, so forked roles that share
    the forkserver's pages are not counted many times over (as a sum of RSS would).
    """
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/smaps_rollup") as handle:
                for line in handle:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
        stack.extend(children.get(pid, []))
    return total


def run_measured(command: list[str]) -> tuple[dict[str, Any], float, int, float]:
    """Runs ``command``; returns its last-line JSON, wall seconds, peak tree PSS and when it
    was launched (seconds since the epoch)."""
    launched = time.time()
    started = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT
    )
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_pss_bytes(process.pid))
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, _ = process.communicate()
    wall = time.perf_counter() - started
    done.set()
    sampler.join()
    if process.returncode != 0:
        raise RuntimeError(f"{command} exited with {process.returncode}:\n{stdout}")
    return json.loads(stdout.strip().splitlines()[-1]), wall, peak, launched


def measure_floor() -> dict[str, Any]:
    """One run of the floor."""
    result, wall, peak, launched = run_measured(
        [sys.executable, str(ROOT / "benchmarks" / "floor.py")]
    )
    return {
        "startup": result["first_round_began"] - launched,
        "median_round": result["median_round_seconds"],
        "total": wall,
        "accuracy": result["accuracy"],
        "peak_bytes": peak,
    }


def measure_fedcore(workdir: Path) -> dict[str, Any]:
    """One end-to-end run of the example."""
    result, wall, peak, launched = run_measured(
        [
            sys.executable,
            "-m",
            "fedcore",
            "run",
            str(EXAMPLE),
            "--json",
            "--quiet",
            "--workdir",
            str(workdir),
        ]
    )
    events = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
    first = next(event for event in events if event["event"] == "round")
    return {
        "startup": float(first["time"]) - float(first["seconds"]) - launched,
        "median_round": result["median_round_seconds"],
        "total": wall,
        "accuracy": result["accuracy"],
        "peak_bytes": peak,
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians of every measure over repeats."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def render(
    floor: dict[str, float],
    fed: dict[str, float],
    repeats: int,
    raw: dict[str, list[dict[str, Any]]],
) -> str:
    """The markdown section for docs/benchmarks.md."""
    import torch

    import fedcore

    def row(name: str, m: dict[str, float]) -> str:
        return (
            f"| {name} | {m['startup']:.2f} | {m['median_round'] * 1000:.1f} | "
            f"{m['total']:.2f} | {m['accuracy']:.4f} | {m['peak_bytes'] / 2**20:.0f} |"
        )

    ratio = fed["median_round"] / floor["median_round"]
    paired = statistics.median(
        f["median_round"] / b["median_round"]
        for f, b in zip(raw["fedcore"], raw["floor"], strict=True)
    )
    rounds = ", ".join(f"{r['median_round'] * 1000:.1f}" for r in raw["fedcore"])
    floors = ", ".join(f"{r['median_round'] * 1000:.1f}" for r in raw["floor"])
    return "\n".join(
        [
            BEGIN,
            "## Runtime spine: digits-fedavg against the floor",
            "",
            f"Measured {dt.date.today().isoformat()} by `python benchmarks/spine.py --write` on "
            f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}, fedcore {fedcore.__version__}; {repeats} repeats per "
            "side, alternating; medians shown.",
            "",
            "The job is examples/digits-fedavg.yaml: digits (features /16, 80/20 split, seed "
            "0), MLP 64-128-ReLU-10, 10 IID clients, 20 rounds, SGD lr 0.1, one local epoch of "
            "batch 32, FedAvg weighted by shard size, evaluation on the held-out split every "
            "round. The floor is the same maths as one plain loop in one process "
            "(benchmarks/floor.py); fedcore runs a server and 10 client processes over "
            "mutual-TLS gRPC on loopback, with checkpoints every 5 rounds and Prometheus "
            "endpoints on.",
            "",
            "| side | start-up (s) | median round (ms) | total (s) | accuracy | peak memory, all "
            "processes, PSS (MiB) |",
            "|---|---|---|---|---|---|",
            row("floor (one process)", floor),
            row("fedcore run (11 processes, mTLS)", fed),
            "",
            f"**Median round, fedcore / floor: {ratio:.2f}x** as a ratio of the medians, "
            f"**{paired:.2f}x** as the median of the per-repeat ratios (each repeat runs both "
            f"sides back to back; target: at most 1.3x). Per-repeat median rounds in ms: fedcore "
            f"{rounds}; floor {floors}. This machine's speed drifts a lot between runs (see the "
            f"floor's own spread), which is why both statistics are given.",
            "",
            "Start-up is, for both, from the command's launch to its first round: for the floor "
            "the interpreter, torch, scikit-learn, the data and the model (torch._dynamo, which "
            "an optimizer's first step imports, falls in its first round); for fedcore the "
            "command, the CA and certificates, the forkserver's imports (torch._dynamo included), "
            "the server, the data and every client connected. Total is the command's wall time.",
            END,
        ]
    )


def parse_jobs(text: str) -> tuple[tuple[int, int], ...]:
    """``--jobs`` of the benchmarks that run several (clients K, rounds R): ``KxR,KxR``."""
    return tuple((int(k), int(r)) for k, r in (pair.split("x") for pair in text.split(",") if pair))


def publish(
    section: str, data: dict[str, Any], name: str, *, begin: str, end: str, write: bool
) -> None:
    """Prints a benchmark's section; with ``write``, puts it into docs/benchmarks.md and keeps
    its numbers as docs/benchmarks/NAME.json."""
    from benchmarks.measure import save_data

    print(section)
    if write:
        write_section(section, begin=begin, end=end)
        save_data(name, data)


def write_section(section: str, *, begin: str = BEGIN, end: str = END) -> None:
    """Replaces (or appends) the section between ``begin`` and ``end`` in docs/benchmarks.md."""
    text = DOC.read_text(encoding="utf-8") if DOC.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    DOC.write_text(text, encoding="utf-8")


def main() -> None:
    """Runs the comparison and prints (or writes) the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per side (default 3)")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    raw: dict[str, list[dict[str, Any]]] = {"floor": [], "fedcore": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            raw["floor"].append(measure_floor())
            raw["fedcore"].append(measure_fedcore(Path(tmp) / f"run-{repeat}"))
            print(
                f"repeat {repeat + 1}: floor {raw['floor'][-1]['median_round'] * 1000:.1f} ms, "
                f"fedcore {raw['fedcore'][-1]['median_round'] * 1000:.1f} ms per round",
                file=sys.stderr,
            )
    section = render(median_of(raw["floor"]), median_of(raw["fedcore"]), args.repeats, raw)
    print(section)
    if args.write:
        write_section(section)


if __name__ == "__main__":
    main()

"""Protocol overheads: perturb, mpdp and dp-fedavg against fedsgd on the same model and data.

Every protocol runs the same job with ``fedcore run`` (server and 10 client processes over
mutual-TLS gRPC; mpdp adds its KDC): digits, a bias-free ReLU MLP 64-64-10 in float64 with MSE
loss (the model the perturbation protocols require), 10 IID clients, the same rounds and
learning rate. Runs alternate protocol by protocol, ``--repeats`` times; medians are reported
with ratios to fedsgd: median round time, CPU time per round of all the roles together (and of
the server, one client and the KDC), bytes on the wire (the server's sent + received), peak
memory of all processes (PSS), accuracy after the same rounds, and epsilon where the protocol
claims DP. On a machine with fewer cores than processes a round is CPU-bound, so the CPU per
round says what the round time is made of. ``--write`` replaces the protocols section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.measure import cpu_model
from benchmarks.spine import ROOT, tree_pss_bytes, write_section

BEGIN = "<!-- protocols:begin -->"
END = "<!-- protocols:end -->"

BASE: dict[str, Any] = {
    "apiVersion": "fedcore.dev/v1alpha1",
    "kind": "FederatedRun",
    "metadata": {"name": "bench"},
    "spec": {
        "protocol": {"name": "fedsgd"},
        "model": {"kind": "MLP", "hidden": [64], "bias": False, "dtype": "float64"},
        "data": {"source": {"kind": "Digits"}},
        "clients": {"count": 10},
        "rounds": 30,
        "training": {"loss": "MSE", "optimizer": {"kind": "SGD", "learningRate": 2.0}},
        "checkpoint": {"everyRounds": 0},
        "seed": 0,
    },
}

PROTOCOLS: dict[str, dict[str, Any]] = {
    "fedsgd": {"name": "fedsgd", "fedsgd": {"weighting": "Uniform"}},
    "perturb": {"name": "perturb"},
    "perturb m=2": {"name": "perturb", "perturb": {"cells": 2}},
    "mpdp": {"name": "mpdp", "mpdp": {"clientNoiseStd": 0.001, "clippingNorm": 10.0}},
    "mpdp faithful": {
        "name": "mpdp",
        "mpdp": {"clientNoiseStd": 0.001, "clippingNorm": 10.0, "mode": "Faithful"},
    },
    "dp-fedavg": {"name": "dp-fedavg", "dpFedavg": {"clippingNorm": 1.0, "noiseMultiplier": 0.1}},
}
"""Each row's protocol block; mpdp keeps a little DP noise so its whole pipeline runs, and
``perturb m=2`` partitions the 10 outputs into 2 cells (its upload: m+2 = 4 model sizes);
``mpdp faithful`` is the paper's mode (the corrections travel unmasked, in float64), ``mpdp``
the default Hardened mode."""

TARGETS = {
    "perturb": "perturb (m = 10 cells)",
    "perturb m=2": "perturb (m = 2 cells)",
    "mpdp": "mpdp (Hardened)",
    "mpdp faithful": "mpdp (Faithful)",
}
"""The rows issue 4's round-time target applies to, and their names in the targets table."""
TARGETED = tuple(TARGETS)


def slug(row: str) -> str:
    """A row's name as a file name (``perturb m=2`` -> ``perturb-m2``)."""
    return row.replace(" ", "-").replace("=", "")


def manifest_for(protocol: str, folder: Path) -> Path:
    """Writes the benchmark manifest for ``protocol``."""
    manifest = copy.deepcopy(BASE)
    manifest["spec"]["protocol"] = PROTOCOLS[protocol]
    if protocol == "dp-fedavg":
        manifest["spec"]["training"]["optimizer"]["learningRate"] = 0.5
    path = folder / f"{slug(protocol)}.yaml"
    path.write_text(yaml.safe_dump(manifest), encoding="utf-8")
    return path


TICK = os.sysconf("SC_CLK_TCK")
ROLE_LOG = re.compile(r"/logs/(server|kdc|client)(?:-\d+)?\.log$")


def role_pids(workdir: Path) -> dict[int, str]:
    """The role processes of the run in ``workdir``: pid -> server, client or kdc.

    A role is recognised by the log file it holds open (``<workdir>/logs/<role>.log``), which
    works for forked roles too, whose command line is the forkserver's.
    """
    found: dict[int, str] = {}
    prefix = str(workdir)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                target = os.readlink(f"/proc/{entry}/fd/{fd}")
                match = ROLE_LOG.search(target)
                if match and target.startswith(prefix):
                    found[int(entry)] = match.group(1)
                    break
        except OSError:
            continue
    return found


def cpu_seconds(pids: dict[int, str]) -> dict[int, float]:
    """CPU seconds (user + system) so far of each process still alive."""
    found: dict[int, float] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            found[pid] = (int(fields[11]) + int(fields[12])) / TICK
        except (OSError, IndexError, ValueError):
            continue
    return found


def rounds_done(events: Path) -> int:
    """The number of ``round`` events written so far."""
    try:
        with events.open(encoding="utf-8") as handle:
            return sum(1 for line in handle if '"event": "round"' in line)
    except OSError:
        return 0


def run_with_cpu(command: list[str], workdir: Path) -> tuple[dict[str, Any], float, int, dict]:
    """Runs ``command``; returns its last-line JSON, wall seconds, peak tree PSS, and the CPU
    seconds per round of the server, the clients (summed) and the KDC.

    The CPU is read from /proc when the first round event appears and then until a role exits,
    so start-up and shutdown are not counted: per round = difference / rounds in between.
    """
    started = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT
    )
    peak = 0
    roles: dict[int, str] = {}
    marks: dict[str, tuple[int, dict[int, float]]] = {}
    done = threading.Event()

    def sample_memory() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_pss_bytes(process.pid))
            done.wait(0.05)

    def sample_cpu() -> None:
        nonlocal roles
        events = workdir / "events.jsonl"
        while not done.is_set() and rounds_done(events) < 1:
            done.wait(0.01)
        roles = role_pids(workdir)
        marks["first"] = (rounds_done(events), cpu_seconds(roles))
        rounds = int(BASE["spec"]["rounds"])
        while not done.is_set():
            count = rounds_done(events)
            now = cpu_seconds(roles)
            if count >= rounds or len(now) < len(roles):  # the run is finishing
                return
            marks["last"] = (count, now)
            done.wait(0.02)

    samplers = [
        threading.Thread(target=sample_memory, daemon=True),
        threading.Thread(target=sample_cpu, daemon=True),
    ]
    for sampler in samplers:
        sampler.start()
    stdout, _ = process.communicate()
    wall = time.perf_counter() - started
    done.set()
    for sampler in samplers:
        sampler.join()
    if process.returncode != 0:
        raise RuntimeError(f"{command} exited with {process.returncode}:\n{stdout}")
    cpu: dict[str, float] = {}
    if "first" in marks and "last" in marks and marks["last"][0] > marks["first"][0]:
        (first_count, first), (last_count, last) = marks["first"], marks["last"]
        for pid, seconds in last.items():
            if pid in first:
                role = roles[pid]
                cpu[role] = cpu.get(role, 0.0) + seconds - first[pid]
        cpu = {role: value / (last_count - first_count) for role, value in cpu.items()}
    return json.loads(stdout.strip().splitlines()[-1]), wall, peak, cpu


def measure(protocol: str, folder: Path, repeat: int) -> dict[str, Any]:
    """One run of ``protocol``."""
    workdir = folder / f"{slug(protocol)}-{repeat}"
    result, wall, peak, cpu = run_with_cpu(
        [
            sys.executable,
            "-m",
            "fedcore",
            "run",
            str(manifest_for(protocol, folder)),
            "--json",
            "--quiet",
            "--workdir",
            str(workdir),
        ],
        workdir,
    )
    sent = result.get("server_bytes_sent") or 0
    received = result.get("server_bytes_received") or 0
    clients = int(BASE["spec"]["clients"]["count"])
    return {
        "median_round": result["median_round_seconds"],
        "maths_round": maths_round(protocol, folder),
        "cpu_round": sum(cpu.values()) if cpu else None,
        "cpu_server": cpu.get("server"),
        "cpu_client": None if "client" not in cpu else cpu["client"] / clients,
        "cpu_kdc": cpu.get("kdc"),
        "bytes_per_round": (sent + received) / BASE["spec"]["rounds"],
        "peak_bytes": peak,
        "accuracy": result["accuracy"],
        "epsilon": result.get("epsilon"),
        "total": wall,
    }


def maths_round(protocol: str, folder: Path) -> float:
    """The median round of the same job's maths in this process (``fedcore.simulation``).

    ``simulate()`` calls the same protocol hooks as ``fedcore run`` (every client's upload, the
    server's checks, combine and accounting), one after another at the role processes' thread
    count, with no transport, processes or evaluation: what a round costs without the runtime.
    """
    import warnings

    from fedcore.simulation import simulate
    from fedcore.spec import load_manifest

    run = load_manifest(manifest_for(protocol, folder))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. perturb's note on reproducible secrets
        history = simulate(run).history
    return statistics.median(entry["seconds"] for entry in history[1:])


def render(
    medians: dict[str, dict[str, Any]],
    repeats: int,
    date: str | None = None,
    cpu: str | None = None,
) -> str:
    """The markdown section (measured on ``date``, ISO, on the ``cpu`` named; None: today,
    this machine)."""
    import torch

    import fedcore

    base = medians["fedsgd"]
    rows = []
    cpu_rows = []

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f}"

    for protocol, m in medians.items():
        epsilon = "-" if m["epsilon"] is None else f"{m['epsilon']:.3g}"
        cpu_ratio = (
            "-"
            if m["cpu_round"] is None or not base["cpu_round"]
            else f"{m['cpu_round'] / base['cpu_round']:.2f}x"
        )
        low, high = m["ratio_range"]
        rows.append(
            f"| {protocol} | {m['median_round'] * 1000:.1f} | "
            f"{m['median_round'] / base['median_round']:.2f}x | {low:.2f}x to {high:.2f}x | "
            f"{ms(m['cpu_round'])} | {cpu_ratio} | "
            f"{m['bytes_per_round'] / 2**20:.2f} | "
            f"{m['bytes_per_round'] / base['bytes_per_round']:.1f}x | "
            f"{m['peak_bytes'] / 2**20:.0f} | {m['accuracy']:.4f} | {epsilon} |"
        )
        extra = split_extra(m, base)
        cpu_rows.append(
            f"| {protocol} | {ms(m['cpu_server'])} | {ms(m['cpu_client'])} | {ms(m['cpu_kdc'])} "
            f"| {ms(m['maths_round'])} | {m['maths_round'] / base['maths_round']:.2f}x | "
            f"{ms(extra[0] if extra else None)} | {ms(extra[1] if extra else None)} |"
        )
    return "\n".join(
        [
            BEGIN,
            "## Protocol overheads against fedsgd",
            "",
            f"Measured {date or dt.date.today().isoformat()} by `python benchmarks/protocols.py "
            "--write` "
            f"on {platform.machine()} {cpu or cpu_model()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, "
            f"torch {torch.__version__}, fedcore {fedcore.__version__}; {repeats} repeats per "
            "protocol, alternating; medians shown.",
            "",
            "Same job for every protocol: digits, bias-free ReLU MLP 64-64-10 in float64, MSE, 10 "
            "IID clients, 30 rounds, every client every round, `fedcore run` with real processes "
            "over mutual TLS (mpdp also starts its KDC). Bytes are the server's sent plus received "
            "per round. fedsgd weighs clients uniformly, as mpdp's MU_Server does; perturb "
            "weighs by shard size (its model equals shard-size fedsgd to 1e-9, tested), so the "
            "accuracies differ in the third decimal. The DP settings are chosen to show the "
            "protocols' cost, not a useful privacy level: mpdp runs with clientNoiseStd 0.001 "
            "(its noise path on, the accuracy unharmed, so its epsilon is astronomically large) "
            "and dp-fedavg (local epochs like fedavg, learning rate 0.5) with clippingNorm 1 and "
            "noiseMultiplier 0.1. See the protocol pages for accuracy at meaningful budgets. "
            "Their noise is drawn from the operating system's randomness, not from the run's "
            "seed (as DP noise must be), so mpdp's and dp-fedavg's accuracies differ from run "
            "to run in the second or third decimal; the other protocols' are fixed by the seed.",
            "",
            "| protocol | median round (ms) | vs fedsgd | vs fedsgd, each repeat | CPU per "
            "round, all roles (ms) | vs fedsgd | MiB per round | vs fedsgd | peak memory, PSS "
            "(MiB) | accuracy | epsilon (delta 1e-5) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            "CPU per round is user plus system time of every role process between the first "
            "and the last round event (start-up excluded), divided by the rounds in between. Per "
            "role:",
            "",
            "| protocol | server (ms) | one client, mean (ms) | KDC (ms) | maths in one "
            "process (ms) | vs fedsgd | CPU beyond fedsgd's: maths (ms) | CPU beyond fedsgd's: "
            "runtime (ms) |",
            "|---|---|---|---|---|---|---|---|",
            *cpu_rows,
            "",
            "*Maths in one process* is the median round of the same job run by "
            "`fedcore.simulation.simulate` in the benchmark's own process (the same protocol "
            "hooks: every client's upload, the server's checks, combine and privacy "
            "accounting, at one thread as the roles run; no processes, transport or "
            "evaluation). The last two columns split a protocol's CPU per round beyond "
            "fedsgd's into its maths (its maths round less fedsgd's) and the rest: the "
            "runtime's extra work for it (moving its extra bytes through gRPC and TLS) and its "
            "maths running slower among twelve processes on shared caches and cores than alone "
            "in one. dp-fedavg moves fedsgd's bytes, so its runtime column is that second "
            "part alone.",
            "",
            *target_lines(medians),
            END,
        ]
    )


TARGET = 1.5
"""Issue 4's target: perturb's and mpdp's round time at most this many times fedsgd's."""
RUNTIME_TARGET = 1.3
"""Issue 29's second mpdp figure: its CPU per round beyond its own maths in one process at most
this many times fedsgd's (what the runtime adds, whatever the maths costs)."""
RUNTIME_TARGETED = ("mpdp", "mpdp faithful")


def runtime_ratio(row: dict[str, Any], base: dict[str, Any]) -> float:
    """A protocol's CPU per round beyond its own one-process maths, over fedsgd's."""
    return (row["cpu_round"] - row["maths_round"]) / (base["cpu_round"] - base["maths_round"])


def runtime_sentence(medians: dict[str, dict[str, Any]]) -> str:
    """Issue 29's second mpdp figure, per mode."""
    base = medians["fedsgd"]
    parts = []
    for protocol in RUNTIME_TARGETED:
        if protocol in medians:
            row = medians[protocol]
            ratio = runtime_ratio(row, base)
            verdict = "met" if ratio <= RUNTIME_TARGET else "**missed**"
            parts.append(
                f"{protocol} {(row['cpu_round'] - row['maths_round']) * 1000:.1f} ms, "
                f"{ratio:.2f}x ({verdict})"
            )
    if not parts:
        return ""
    return (
        f" Beyond its own maths in one process, a round's CPU (issue 29: mpdp at most "
        f"{RUNTIME_TARGET}x fedsgd's {(base['cpu_round'] - base['maths_round']) * 1000:.1f} ms): "
        + "; ".join(parts)
        + ". That is the runtime moving mpdp's 5.7x bytes through gRPC and TLS, and the maths "
        "running slower among twelve processes than alone. The bytes alone are measured apart "
        "in 'One model exchange per client and round, by transport stack' "
        "(`benchmarks/exchange.py`): on 2026-11-28 mpdp's upload cost an exchange over gRPC "
        "with mutual TLS, without fedcore, 557 us of CPU more than a model-sized one, 107% of "
        "what this target allows mpdp's runtime per client and round, and over fedcore's "
        "sessions 631 us more. The maths itself: since "
        "2026-11-27 the reverse passes take each layer's weight gradients as inputs^T @ deltas, "
        "the orientation BLAS runs about 1.5x faster on a shard's shapes (0.27 ms against "
        "0.39 ms for 144 examples x 12 terms x 64 x 64 in float64); mpdp's maths in one "
        "process measured 15.8 ms a round (Faithful 12.3 ms) the same day before it. The rest "
        "of a client's maths is near its machine bound (measured alone the same day): the AES-CTR "
        "keystreams run at about 8.6 GB/s, and Box-Muller's log, cos and sin at about 5 ns "
        "per draw."
    )


def target_lines(medians: dict[str, dict[str, Any]]) -> list[str]:
    """Whether perturb and mpdp meet the round-time target, and what their rounds carry."""
    base = medians["fedsgd"]
    verdicts = []
    for protocol in TARGETED:
        if protocol in medians:
            ratio = medians[protocol]["median_round"] / base["median_round"]
            verdict = "met" if ratio <= TARGET else f"**missed** by {ratio / TARGET:.2f}x"
            low, high = medians[protocol]["ratio_range"]
            verdicts.append(
                f"{protocol} {ratio:.2f}x ({verdict}; single repeats {low:.2f}x to {high:.2f}x)"
            )

    def upload(protocol: str) -> str:
        if protocol not in medians:
            return "-"
        return f"{medians[protocol]['bytes_per_round'] / base['bytes_per_round']:.1f}x"

    processes = int(BASE["spec"]["clients"]["count"]) + 2  # the clients, the server, a KDC
    cores = os.cpu_count() or 1
    if cores < processes:
        machine = (
            f"On this machine {processes} processes share {cores} cores, so a round costs the "
            "CPU of all its roles, and the CPU columns say where it goes; they vary less "
            "between runs than the round times, which the machine's other work moves (see the "
            "spread of single repeats)." + budget_sentence(medians)
        )
    else:
        machine = (
            f"On this machine ({cores} cores) every role has a core of its own, so a round "
            "takes its critical path: the slowest client's work and upload, then the server's "
            "receipt of every upload and its combine; fedsgd's round is short, so the "
            "protocols' extra work weighs more here than where roles share cores."
        )
    return [
        f"Target: perturb and mpdp at most {TARGET}x fedsgd's round time at equal accuracy: "
        + "; ".join(verdicts)
        + ". "
        + machine
        + " Where it goes: perturb's client runs m+2 reverse passes (here batched into one "
        "matrix product per layer) and uploads m+2 times fedsgd's gradient, less the last "
        "layer once (digest 001, B2; the paper reports no runtime). With the download the "
        f"bytes per round are {upload('perturb')} fedsgd's at m = 10 and "
        f"{upload('perturb m=2')} at m = 2, and moving them is much of the runtime column: a "
        "400 kB message costs about 1 ms of CPU at each end over mutual-TLS gRPC on loopback "
        "beyond a small one's (`benchmarks/limits.py` measures the throughput), ten per "
        "round. m is `spec.protocol.perturb.cells`: the paper bounds a client's naive use of "
        "the model it receives by 1/m, but the audit's least-squares fit recovers the true "
        "model's predictions at any m (docs/audit.md), so a smaller m gives up only that "
        "naive bound. mpdp uploads the same Psi, and its maths is most of its gap: on every "
        "client and round it draws the pairwise masks (an AES-CTR keystream per neighbour "
        "over the fixed-point correction words and over the gradient, the gradient's turned "
        "Gaussian by Box-Muller) and its own Gaussian noise, then computes the clipping norm "
        "bound and the fixed-point encoding." + faithful_sentence(medians) + " "
        "`fedcore run` draws a client's masks ahead, "
        "while the server combines the previous round: that takes them off a round's "
        "critical path where a client has its own cores, not off the CPU where roles share "
        "them. Its KDC is asked once per client and run (the table of public keys is reused, "
        "docs/protocols/mpdp.md). Neither ratio falls as the model grows: the reverse passes, "
        "the masks and the extra bytes scale with the hidden layers as fedsgd's gradient does."
        + runtime_sentence(medians)
    ]


def faithful_sentence(medians: dict[str, dict[str, Any]]) -> str:
    """What mpdp's Faithful mode saves against Hardened (both rows measured), else nothing."""
    if "mpdp" not in medians or "mpdp faithful" not in medians:
        return ""
    hardened = medians["mpdp"]["maths_round"] * 1000
    faithful = medians["mpdp faithful"]["maths_round"] * 1000
    return (
        " In the paper's Faithful mode the corrections travel unmasked, in float64 (the leak "
        "digest 000 calls G6), so a client masks and noises only its gradient, the same bytes "
        f"go on the wire, and the maths in one process takes {faithful:.1f} ms a round "
        f"against Hardened's {hardened:.1f} ms: the reverse passes, the clipping bound and the "
        "gradient's noise and masks remain."
    )


def budget_sentence(medians: dict[str, dict[str, Any]]) -> str:
    """Where roles share cores: the extra CPU the target allows, and what each protocol spends."""
    base = medians["fedsgd"]
    if base["cpu_round"] is None:
        return ""
    parts = []
    for protocol in TARGETED:
        extra = split_extra(medians[protocol], base) if protocol in medians else None
        if extra is not None:
            parts.append(
                f"{protocol} {(extra[0] + extra[1]) * 1000:.1f} ms ({extra[0] * 1000:.1f} ms "
                f"of maths, {extra[1] * 1000:.1f} ms of runtime)"
            )
    allowance = (TARGET - 1) * base["cpu_round"]
    over = []
    for protocol in TARGETED:
        split = split_extra(medians[protocol], base) if protocol in medians else None
        if split is not None and split[0] > allowance:
            over.append((protocol, split[0] / allowance))
    verdict = ""
    if over:
        verdict = (
            " So no runtime, however cheap, could meet the target on this machine for "
            + " or ".join(protocol for protocol, _ in over)
            + ": the maths alone, in one process, already spends more than the allowance ("
            + ", ".join(f"{protocol} {times:.1f}x" for protocol, times in over)
            + ")."
        )
    return (
        f" The target then allows a protocol {allowance * 1000:.1f} ms of CPU per round "
        f"beyond fedsgd's {base['cpu_round'] * 1000:.1f} ms; this run spent "
        + ", ".join(parts)
        + "."
        + verdict
    )


def split_extra(row: dict[str, Any], base: dict[str, Any]) -> tuple[float, float] | None:
    """A protocol's CPU per round beyond fedsgd's, as (its extra maths, the runtime's rest)."""
    if row["cpu_round"] is None or base["cpu_round"] is None:
        return None
    maths = row["maths_round"] - base["maths_round"]
    return maths, row["cpu_round"] - base["cpu_round"] - maths


def _median(values: list[Any]) -> Any:
    """The median of the values that are not None (None if all are)."""
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def main() -> None:
    """Runs every protocol and prints (or writes) the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per protocol (default 3)")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument(
        "--rerender", action="store_true", help="no run: render the last --write's medians"
    )
    args = parser.parse_args()
    if args.rerender:
        record = json.loads(RESULTS.read_text(encoding="utf-8"))
        section = render(record["rows"], record["repeats"], record["date"], record.get("cpu"))
        print(section)
        if args.write:
            write_section(section, begin=BEGIN, end=END)
        return
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in PROTOCOLS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for protocol in PROTOCOLS:
                runs[protocol].append(measure(protocol, Path(tmp), repeat))
                print(
                    f"repeat {repeat + 1} {protocol}: "
                    f"{runs[protocol][-1]['median_round'] * 1000:.1f} ms/round",
                    file=sys.stderr,
                )
    medians = {
        name: {key: _median([r[key] for r in results]) for key in results[0]}
        for name, results in runs.items()
    }
    for name, results in runs.items():
        # Repeat i of every protocol ran in the same pass over the protocols as fedsgd's
        # repeat i: the spread of these ratios is how far one comparison can be trusted.
        ratios = [
            r["median_round"] / base["median_round"]
            for r, base in zip(results, runs["fedsgd"], strict=True)
        ]
        medians[name]["ratio_range"] = [min(ratios), max(ratios)]
    section = render(medians, args.repeats)
    print(section)
    if args.write:
        write_section(section, begin=BEGIN, end=END)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "date": dt.date.today().isoformat(),
            "cpu": cpu_model(),
            "repeats": args.repeats,
            "rows": medians,
        }
        RESULTS.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


RESULTS = ROOT / "docs" / "benchmarks" / "protocols.json"
"""The medians of the last --write run (benchmarks.run_all reads the targets from them)."""


def target_rows(record: dict[str, Any]) -> list[str]:
    """The targets-table rows of issue 4's target, from a ``RESULTS`` record."""
    rows = record["rows"]
    base = rows["fedsgd"]["median_round"]
    found = []
    for protocol, what in TARGETS.items():
        if protocol in rows:
            ratio = rows[protocol]["median_round"] / base
            found.append(
                f"| {what} median round at most {TARGET}x fedsgd's, same job and accuracy | "
                f"{ratio:.2f}x | {'met' if ratio <= TARGET else 'missed'} |"
            )
    for protocol in RUNTIME_TARGETED:
        if protocol in rows and "maths_round" in rows[protocol]:
            ratio = runtime_ratio(rows[protocol], rows["fedsgd"])
            found.append(
                f"| {TARGETS[protocol]} CPU per round beyond its own maths at most "
                f"{RUNTIME_TARGET}x fedsgd's | {ratio:.2f}x | "
                f"{'met' if ratio <= RUNTIME_TARGET else 'missed'} |"
            )
    return found


if __name__ == "__main__":
    main()

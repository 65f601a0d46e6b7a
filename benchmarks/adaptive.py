"""Learned protection (adaptive) against no distortion and against its static Identical
baseline: accuracy, round time and bytes, and a leakage proxy.

Accuracy, the issue's grid: digits and the 5,000-image MNIST subset, IID and Dirichlet(0.5),
5 and 20 clients; MLP with 32 hidden units, FedSGD with one SGD step of 0.5 on a private
minibatch of 32 per client and round, ``--rounds`` rounds, ``--seeds`` seeds, in one process
(``fedcore.simulation``: the protocol hooks of ``fedcore run``). Arms: no distortion (PL budget
chi = a1, so l = 0: plain FedSGD on the same batches), PL at chi 0.96 (l = 0.64) with
Identical and Learn, and DP at epsilon 400 per round with Identical (the Laplace mechanism,
formal_dp) and Learn. Then tighter budgets on digits (4 IID clients): PL chi 0.9 and 0.8, DP
epsilon 100 and 25, Identical against Learn.

Round time and bytes: ``fedcore run`` with real processes, digits IID, 5 and 20 clients, no
distortion and PL Learn alternating, ``--repeats`` runs each: the median round time, its ratio
to no distortion's, and the server's bytes per round.

Leakage proxy (digest 003, T12): a linear model with a bias and batches of one example, where
an undistorted upload gives the example exactly (``x = dW[y] / db[y]``); the median relative
error of that estimate over 200 uploads per learner, at the same norm bound l (higher hides
more). ``--write`` replaces the adaptive section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import functools
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._runs import Cache, add_common_arguments, timed_medians
from benchmarks.spine import write_section

BEGIN = "<!-- adaptive:begin -->"
END = "<!-- adaptive:end -->"
PL_BUDGETS = [0.9, 0.8]
DP_EPSILONS = [100.0, 25.0]
"""The sweep's tighter budgets (the grid has PL 0.96 and DP 400)."""
SOURCES = ("Digits", "MNISTSubset")
ARMS: dict[str, dict[str, Any]] = {
    "none": {"measure": "PL", "strategy": "Identical", "pl": {"budget": 1.0}},
    "PL Identical": {"measure": "PL", "strategy": "Identical", "pl": {"budget": 0.96}},
    "PL Learn": {"measure": "PL", "strategy": "Learn", "pl": {"budget": 0.96}},
    "DP Identical": {"measure": "DP", "strategy": "Identical", "dp": {"epsilon": 400.0}},
    "DP Learn": {"measure": "DP", "strategy": "Learn", "dp": {"epsilon": 400.0}},
}
"""The grid's arms: "none" is PL at chi = a1 = 1, so l = u = 0 and no distortion."""

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


def manifest(
    options: dict[str, Any],
    *,
    seed: int,
    source: str = "Digits",
    partition: str = "IID",
    clients: int = 4,
    rounds: int = 100,
) -> dict[str, Any]:
    """One benchmark job as a manifest document."""
    document = copy.deepcopy(BASE)
    spec = document["spec"]
    spec["protocol"]["adaptive"].update(copy.deepcopy(options))
    spec["data"]["source"]["kind"] = source
    if partition != "IID":
        # Every client keeps at least 10 rows, so its held-out share is never empty.
        spec["data"]["partition"] = {"kind": "Dirichlet", "alpha": 0.5, "minExamples": 10}
    spec["clients"]["count"] = clients
    spec["rounds"] = rounds
    spec["seed"] = seed
    return document


def run_accuracy(document: dict[str, Any]) -> float:
    """One simulated run's final held-out accuracy."""
    from fedcore.simulation import simulate
    from fedcore.spec import parse_manifest

    return simulate(parse_manifest(document)).accuracy


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def grid_rows(
    seeds: int, rounds: int, cache: Cache, sources: tuple[str, ...], counts: tuple[int, ...]
) -> list[dict[str, Any]]:
    """Every arm on every (source, partition, clients)."""
    rows = []
    for source in sources:
        for partition in ("IID", "Dirichlet"):
            for clients in counts:
                row: dict[str, Any] = {"source": source, "partition": partition, "clients": clients}
                started = time.perf_counter()
                for arm, options in ARMS.items():
                    values = [
                        cache.get(
                            f"grid|{source}|{partition}|{clients}|{arm}|{seed}|{rounds}",
                            functools.partial(
                                run_accuracy,
                                manifest(
                                    options,
                                    seed=seed,
                                    source=source,
                                    partition=partition,
                                    clients=clients,
                                    rounds=rounds,
                                ),
                            ),
                        )
                        for seed in range(seeds)
                    ]
                    row[arm] = mean_std(values)
                rows.append(row)
                print(
                    f"{source} {partition} {clients}: "
                    + ", ".join(f"{arm} {row[arm][0]:.3f}" for arm in ARMS)
                    + f" ({time.perf_counter() - started:.0f} s)",
                    file=sys.stderr,
                )
    return rows


def sweep_rows(seeds: int, rounds: int, cache: Cache) -> list[dict[str, Any]]:
    """Identical and Learn at tighter PL budgets and DP epsilons, digits, 4 clients."""
    rows = []
    settings: list[tuple[str, float, dict[str, Any]]] = [
        ("PL", chi, {"measure": "PL", "pl": {"budget": chi}}) for chi in PL_BUDGETS
    ]
    settings += [("DP", eps, {"measure": "DP", "dp": {"epsilon": eps}}) for eps in DP_EPSILONS]
    for measure, budget, options in settings:
        row: dict[str, Any] = {"measure": measure, "budget": budget}
        for strategy in ("Identical", "Learn"):
            values = [
                cache.get(
                    f"sweep|{measure}|{budget}|{strategy}|{s}|{rounds}",
                    functools.partial(
                        run_accuracy,
                        manifest({**options, "strategy": strategy}, seed=s, rounds=rounds),
                    ),
                )
                for s in range(seeds)
            ]
            row[strategy] = mean_std(values)
        rows.append(row)
        print(
            f"{measure} {budget}: {row['Identical'][0]:.3f} vs {row['Learn'][0]:.3f}",
            file=sys.stderr,
        )
    return rows


def timing_rows(
    counts: tuple[int, ...], rounds: int, repeats: int, cache: Cache
) -> list[dict[str, Any]]:
    """No distortion and PL Learn over processes, alternating; medians and the ratio."""
    documents = {}
    for clients in counts:
        for arm in ("none", "PL Learn"):
            document = manifest(ARMS[arm], seed=0, clients=clients, rounds=rounds)
            document["spec"]["evaluation"]["everyRounds"] = rounds
            documents[(arm, clients)] = document
    return timed_medians(documents, repeats, cache, baseline="none")


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


def render(
    grid: list[dict[str, Any]],
    sweep: list[dict[str, Any]],
    timing: list[dict[str, Any]],
    leakage: list[dict[str, Any]],
    args: argparse.Namespace,
) -> str:
    """The markdown section."""
    import torch

    import fedcore

    def cell(value: tuple[float, float]) -> str:
        return f"{value[0]:.3f} ± {value[1]:.3f}"

    grid_lines = [
        f"| {r['source']} | {'IID' if r['partition'] == 'IID' else 'Dirichlet(0.5)'} | "
        f"{r['clients']} | " + " | ".join(cell(r[arm]) for arm in ARMS) + " |"
        for r in grid
    ]
    sweep_lines = []
    for row in sweep:
        if row["measure"] == "PL":
            bound = f"chi {row['budget']} (l = {(1 - row['budget']) / 0.0625:.2f})"
        else:
            bound = f"epsilon {row['budget']:g} per round"
        sweep_lines.append(
            f"| {row['measure']} | {bound} | {cell(row['Identical'])} | {cell(row['Learn'])} | "
            f"{'true' if row['measure'] == 'DP' else 'false'} | false |"
        )
    time_lines = [
        f"| {t['arm']} | {t['count']} | {t['median_round'] * 1000:.0f} | {t['ratio']:.2f} | "
        f"{t['server_bytes'] / 1024:.1f} | {t['accuracy']:.3f} |"
        for t in timing
    ]
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
            "## Learned protection (adaptive) against no distortion and Identical",
            "",
            f"Measured {dt.date.today().isoformat()} by `python -m benchmarks.adaptive --write` "
            f"on {platform.machine()}, {os.cpu_count()} cores (shared, busy), Python "
            f"{platform.python_version()}, torch {torch.__version__}, "
            f"fedcore {fedcore.__version__}.",
            "",
            f"**Accuracy** after {args.rounds} rounds, mean ± std over {args.seeds} seeds (few "
            "rounds and seeds: the whole benchmark has to fit in about 20 minutes on the shared "
            "cores): the held-out accuracy of the global model. MLP with 32 hidden units, "
            "FedSGD with one SGD step of 0.5 on a private minibatch of 32 per client and round, "
            "in one process (the protocol hooks of `fedcore run`). *none*: PL with chi = a1, so "
            "l = 0 (plain FedSGD on the same batches). *PL*: chi 0.96, a1 = 1, a2 = 0.0625, so "
            "l = 0.64. *DP*: epsilon 400 per round, per-example clipping to 1, Laplace noise per "
            "entry of scale 2 * 0.5 * 1 * sqrt(P) / (32 * 400) (P = 2,410 parameters on digits, "
            "25,450 on MNIST). *Identical* is the paper's static baseline (DP Identical is the "
            "Laplace mechanism, formal_dp true); *Learn*: 10 projected SGD steps of 0.1 on a "
            "held-out batch of the client's own examples, from a random start, the norm kept in "
            "[l, 2l] (formal_dp false). Dirichlet(0.5) partitions keep at least 10 examples per "
            "client.",
            "",
            "| data | partition | clients | " + " | ".join(ARMS) + " |",
            "|---|---|---|" + "---|" * len(ARMS),
            *grid_lines,
            "",
            f"**Tighter budgets** on digits, 4 IID clients, {args.rounds} rounds, mean ± std over "
            f"{args.seeds} seeds, the rest as above; the last two columns say which uploads are "
            "formally DP.",
            "",
            "| measure | budget | Identical | Learn | Identical formal_dp | Learn formal_dp |",
            "|---|---|---|---|---|---|",
            *sweep_lines,
            "",
            "**Round time and bytes** with `fedcore run` (a server and one process per client, "
            "mutual TLS on loopback, 2 shared cores for all of them), digits IID, "
            f"{args.timing_rounds} rounds, no distortion and PL Learn alternating, "
            f"{args.repeats} runs each, medians: the round time and its ratio to no "
            "distortion's (Learn adds 10 forward and backward passes per client and round); the "
            "server's bytes per round, both directions (the same for both: one model each way "
            "per client); the final accuracy.",
            "",
            "| arm | clients | median round (ms) | / none | server KiB per round | accuracy |",
            "|---|---|---|---|---|---|",
            *time_lines,
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
    parser.add_argument(
        "--rounds", type=int, default=40, help="rounds of the accuracy jobs (default 40)"
    )
    parser.add_argument(
        "--timing-rounds", type=int, default=15, help="rounds of the timed runs (default 15)"
    )
    parser.add_argument(
        "--clients",
        type=int,
        nargs="+",
        default=[5, 20],
        help="client counts of the grid and the timed runs (default 5 20)",
    )
    add_common_arguments(parser, SOURCES)
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    import torch

    torch.set_num_threads(1)
    cache = Cache(args.cache)
    leakage = leakage_rows()
    timing = timing_rows(tuple(args.clients), args.timing_rounds, args.repeats, cache)
    sweep = sweep_rows(args.seeds, args.rounds, cache)
    grid = grid_rows(args.seeds, args.rounds, cache, tuple(args.sources), tuple(args.clients))
    section = render(grid, sweep, timing, leakage, args)
    print(section)
    if args.write:
        write_section(section, begin=BEGIN, end=END)


if __name__ == "__main__":
    main()

"""LPPA against plain DSGT and the two DP baselines: accuracy, round time, bytes, privacy proxies.

Accuracy: every variant runs the same job in one process (``fedcore.simulation.peer``: the client
code of ``fedcore run``, each client a thread, peer messages in memory) on digits and on the
5,000-image MNIST subset, IID and Dirichlet(0.5), with 5 peers on the complete graph (the
paper's setting) and 20 peers on a 4-regular graph; an MLP with 64 hidden units, one minibatch
of 64 per round, step 0.1, Laplace scale 0.025 (the paper's), ``--seeds`` seeds. Reported:
the mean over clients of each client's own held-out accuracy after the last round (what the
coordinator reports), mean and standard deviation over seeds, and the worst client.

Round time and bytes: ``fedcore run`` with real processes (a coordinator and one process per
client, peer links over mutual TLS on loopback), digits IID, 5 and 20 peers, DSGT and LPPA
alternating, ``--repeats`` runs each: the median round time and its ratio to DSGT's, the peer
bytes every client sent per round (the clients report them as scalars), against the server's
bytes per round.

Privacy proxies (numpy, seconds): how fast the noise in the trackers fades (``|W^t E|`` over
``|E|``) on each graph, and the analytic inversion of a single-example logistic-regression
gradient (``x = g_w / g_b``) from the initial tracker an out-neighbour receives, after it
removes the noise it knows (digest 002, B3 and B5).

``--write`` replaces the lppa section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._runs import Cache, add_common_arguments, timed_medians
from benchmarks.spine import write_section

BEGIN = "<!-- lppa:begin -->"
END = "<!-- lppa:end -->"
VARIANTS = ["DSGT", "LPPA", "DPInit", "DPEveryRound"]
TOPOLOGIES = {5: {"kind": "Complete"}, 20: {"kind": "KRegular", "degree": 4}}
SOURCES = ("Digits", "MNISTSubset")

BASE: dict[str, Any] = {
    "apiVersion": "fedcore.dev/v1alpha1",
    "kind": "FederatedRun",
    "metadata": {"name": "bench-lppa"},
    "spec": {
        "protocol": {"name": "lppa", "lppa": {"noiseScale": 0.025}},
        "model": {"kind": "MLP", "hidden": [64]},
        "data": {"source": {"kind": "Digits"}, "partition": {"kind": "IID"}},
        "clients": {"count": 5},
        "rounds": 100,
        "training": {"batchSize": 64, "optimizer": {"kind": "SGD", "learningRate": 0.1}},
        "evaluation": {"everyRounds": 0},
        "checkpoint": {"everyRounds": 0},
        "seed": 0,
    },
}


def manifest(
    *, variant: str, source: str, partition: str, peers: int, seed: int, rounds: int
) -> dict[str, Any]:
    """One benchmark job as a manifest document."""
    document = copy.deepcopy(BASE)
    spec = document["spec"]
    spec["protocol"]["lppa"].update(variant=variant, topology=TOPOLOGIES[peers])
    spec["data"]["source"]["kind"] = source
    spec["data"]["partition"] = (
        {"kind": "IID"} if partition == "IID" else {"kind": "Dirichlet", "alpha": 0.5}
    )
    spec["clients"]["count"] = peers
    spec["rounds"] = rounds
    spec["seed"] = seed
    return document


# ------------------------------------------------------------------------------ accuracy


def accuracy_table(
    seeds: int, rounds: int, cache: Cache, sources: tuple[str, ...], peers_list: tuple[int, ...]
) -> list[dict[str, Any]]:
    """Runs every (data, partition, peers, variant) for every seed in one process."""
    import torch

    from fedcore.simulation.peer import simulate_decentralized
    from fedcore.spec import parse_manifest

    torch.set_num_threads(1)
    rows = []
    for source in sources:
        for partition in ("IID", "Dirichlet"):
            for peers in peers_list:
                for variant in VARIANTS:
                    means, worst = [], []
                    started = time.perf_counter()
                    for seed in range(seeds):
                        document = manifest(
                            variant=variant,
                            source=source,
                            partition=partition,
                            peers=peers,
                            seed=seed,
                            rounds=rounds,
                        )

                        def one(document: dict[str, Any] = document) -> dict[str, float]:
                            result = simulate_decentralized(parse_manifest(document))
                            return dict(result.history[-1]["metrics"])

                        key = f"accuracy|{source}|{partition}|{peers}|{variant}|{seed}|{rounds}"
                        accuracies = cache.get(key, one)
                        means.append(accuracies["accuracy"])
                        worst.append(accuracies["accuracy_min"])
                    rows.append(
                        {
                            "source": source,
                            "partition": partition,
                            "peers": peers,
                            "variant": variant,
                            "mean": statistics.mean(means),
                            "std": statistics.stdev(means) if len(means) > 1 else 0.0,
                            "worst": min(worst),
                        }
                    )
                    print(
                        f"{source} {partition} {peers} {variant}: "
                        f"{statistics.mean(means):.4f} ({time.perf_counter() - started:.0f} s)",
                        file=sys.stderr,
                    )
    return rows


# --------------------------------------------------------------------- time and bytes


def timing_table(
    peers_list: tuple[int, ...], rounds: int, repeats: int, cache: Cache
) -> list[dict[str, Any]]:
    """DSGT and LPPA over processes, alternating, ``repeats`` times; medians and the ratio."""
    documents = {}
    for peers in peers_list:
        for variant in ("DSGT", "LPPA"):
            document = manifest(
                variant=variant,
                source="Digits",
                partition="IID",
                peers=peers,
                seed=0,
                rounds=rounds,
            )
            document["spec"]["evaluation"]["everyRounds"] = rounds
            documents[(variant, peers)] = document
    return timed_medians(documents, repeats, cache, baseline="DSGT")


def expected_bytes(peers: int) -> float:
    """theta and gamma, float32, to each out-neighbour: 2 * degree * P * 4 bytes."""
    parameters = 64 * 64 + 64 + 64 * 10 + 10
    degree = {5: 4, 20: 4}[peers]
    return 2 * degree * parameters * 4


# ------------------------------------------------------------------- privacy proxies


def decay_table() -> list[dict[str, Any]]:
    """rho(W), |W^t E| / |E| at t = 1, 5, 10, and the rounds until it is below 1e-3."""
    from fedcore.protocols.lppa.maths import laplace_noise, matrix_noise_differences
    from fedcore.spec.topology import build_graph, mixing_matrix, second_eigenvalue

    rows = []
    for name, count, kind, options in (
        ("complete", 5, "Complete", {}),
        ("ring", 5, "Ring", {}),
        ("directed ring", 5, "Ring", {"directed": True}),
        ("4-regular", 20, "KRegular", {"degree": 4}),
        ("ring", 20, "Ring", {}),
        ("complete", 20, "Complete", {}),
    ):
        graph = build_graph(kind, count, **options)  # type: ignore[arg-type]
        matrix = mixing_matrix(graph)
        dense = matrix.dense()
        rng = np.random.default_rng(0)
        noise = {edge: laplace_noise(rng, 200, 0.025) for edge in graph.edges}
        e = matrix_noise_differences(count, graph.edges, noise)
        norms = [np.linalg.norm(e)]
        current = e
        for _ in range(400):
            current = dense @ current
            norms.append(np.linalg.norm(current))
        ratio = np.asarray(norms) / norms[0]
        below = int(np.argmax(ratio < 1e-3)) if np.any(ratio < 1e-3) else None
        # The fewest noise terms a neighbour does not know, over (victim, neighbour) pairs.
        unknown = min(
            sum(1 for a, b in graph.edges if i in (a, b) and j not in (a, b))
            for i in range(count)
            for j in graph.neighbours(i)
        )
        rows.append(
            {
                "graph": name,
                "peers": count,
                "rho": second_eigenvalue(matrix),
                "t1": ratio[1],
                "t5": ratio[5],
                "t10": ratio[10],
                "below": below,
                "unknown": unknown,
            }
        )
    return rows


def inversion_table(trials: int = 400) -> list[dict[str, Any]]:
    """Median MSE of x = g_w / g_b from the tracker an out-neighbour receives (digest B3)."""
    from fedcore.protocols.lppa.maths import laplace_noise
    from fedcore.spec.topology import build_graph

    rng = np.random.default_rng(1)
    size, beta = 784, 0.025
    rows = []
    cases = (
        ("DSGT", None),
        ("DP", None),
        ("LPPA, directed ring", build_graph("Ring", 5, directed=True)),
        ("LPPA, ring", build_graph("Ring", 5)),
        ("LPPA, complete (5)", build_graph("Complete", 5)),
    )
    for name, graph in cases:
        errors = []
        for _ in range(trials):
            x = rng.uniform(0, 1, size)
            w, b = rng.normal(scale=0.01, size=size), 0.0
            p = 1 / (1 + np.exp(-(x @ w + b)))
            gradient = np.concatenate([(p - 1.0) * x, [p - 1.0]])  # label 1
            if name == "DSGT":
                seen = gradient
            elif name == "DP":
                seen = gradient + laplace_noise(rng, size + 1, beta)
            else:
                assert graph is not None
                victim = 0
                adversary = graph.out_neighbours(victim)[0]
                noise = {e: laplace_noise(rng, size + 1, beta) for e in graph.edges}
                unknown = np.zeros(size + 1)
                for (a, c), value in noise.items():
                    if victim in (a, c) and adversary not in (a, c):
                        unknown += value if a == victim else -value
                seen = gradient + unknown
            estimate = seen[:size] / seen[size]
            errors.append(float(np.mean((estimate - x) ** 2)))
        rows.append({"case": name, "mse": float(np.median(errors))})
    return rows


# ----------------------------------------------------------------------------- render


def render(
    accuracy: list[dict[str, Any]],
    timing: list[dict[str, Any]],
    decay: list[dict[str, Any]],
    inversion: list[dict[str, Any]],
    seeds: int,
    rounds: int,
    timing_rounds: int,
    repeats: int,
) -> str:
    """The markdown section."""
    import torch

    import fedcore

    acc_rows = []
    keys = sorted(
        {(r["source"], r["partition"], r["peers"]) for r in accuracy},
        key=lambda k: (k[0] != "Digits", k[1] != "IID", k[2]),
    )
    for source, partition, peers in keys:
        cells = []
        for variant in VARIANTS:
            found = next(
                r
                for r in accuracy
                if (r["source"], r["partition"], r["peers"], r["variant"])
                == (source, partition, peers, variant)
            )
            cells.append(f"{found['mean']:.3f} ± {found['std']:.3f} ({found['worst']:.2f})")
        label = "IID" if partition == "IID" else "Dirichlet(0.5)"
        graph = "complete" if peers == 5 else "4-regular"
        acc_rows.append(f"| {source} | {label} | {peers} ({graph}) | " + " | ".join(cells) + " |")
    time_rows = [
        f"| {t['arm']} | {t['count']} | {t['median_round'] * 1000:.0f} | {t['ratio']:.2f} | "
        f"{t['peer_bytes'] / t['count'] / 1024:.1f} | {expected_bytes(t['count']) / 1024:.1f} | "
        f"{t['server_bytes'] / 1024:.2f} | {t['accuracy']:.3f} |"
        for t in timing
    ]
    decay_rows = [
        f"| {d['graph']} | {d['peers']} | {d['rho']:.3f} | {d['t1']:.3g} | {d['t5']:.3g} | "
        f"{d['t10']:.3g} | {d['below'] if d['below'] is not None else '> 400'} | "
        f"{d['unknown']} |"
        for d in decay
    ]
    inversion_rows = [f"| {r['case']} | {r['mse']:.3g} |" for r in inversion]
    return "\n".join(
        [
            BEGIN,
            "## LPPA against DSGT and the DP baselines",
            "",
            f"Measured {dt.date.today().isoformat()} by `python -m benchmarks.lppa --write` on "
            f"{platform.machine()}, {os.cpu_count()} cores (shared, busy), Python "
            f"{platform.python_version()}, torch {torch.__version__}, "
            f"fedcore {fedcore.__version__}.",
            "",
            f"**Accuracy** after {rounds} rounds (the paper's count), {seeds} seeds (few: the "
            "whole benchmark has to fit in about 20 minutes on the shared cores): the mean over "
            "clients of each "
            "client's own held-out accuracy (what the coordinator reports), as mean ± std over "
            "seeds, and in brackets the worst client of any seed. One process per job (the "
            "client code of `fedcore run`, each client a thread, peer messages in memory; the "
            "same maths as over processes, bit for bit, tested). MLP 64 hidden units, float32, "
            "one minibatch of "
            "64 per round, step 0.1, Laplace scale 0.025 (the paper's); 5 peers on the complete "
            "graph (the paper's setting), 20 on a 4-regular graph; Sinkhorn mixing. DPInit adds "
            "each client's own Laplace noise to its first tracker, DPEveryRound before every "
            "transmission (digest 002, gap 8).",
            "",
            "| data | partition | peers | DSGT | LPPA | DPInit | DPEveryRound |",
            "|---|---|---|---|---|---|---|",
            *acc_rows,
            "",
            "**Round time and bytes** with `fedcore run` (a coordinator and one process per "
            "client, peer links over mutual TLS on loopback, 2 shared cores for all of them), "
            f"digits IID, {timing_rounds} rounds, DSGT and LPPA alternating, {repeats} runs "
            "each, medians: the round time and its ratio to DSGT's; the peer bytes one client "
            "sends per round (as the clients report them) against theta and gamma to each of its "
            "4 out-neighbours in float32 (the expected payload); the coordinator's bytes per "
            "round, both directions (scalars only); the final accuracy.",
            "",
            "| variant | peers | median round (ms) | / DSGT | peer KiB sent per client and round | "
            "payload KiB | coordinator KiB per round | accuracy |",
            "|---|---|---|---|---|---|---|---|",
            *time_rows,
            "",
            "**How fast the noise fades** (digest leak 4): |W^t E| / |E| for LPPA's initial noise "
            "E on each graph (Sinkhorn W), rho the second-largest |eigenvalue| of W; and the "
            "fewest "
            "noise terms in a client's tracker that one of its neighbours does not know (each "
            "link's noise is known to both its ends; leak 1).",
            "",
            "| graph | peers | rho(W) | t = 1 | t = 5 | t = 10 | rounds to < 1e-3 | "
            "unknown terms (min) |",
            "|---|---|---|---|---|---|---|---|",
            *decay_rows,
            "",
            "**Inverting a gradient** (digest B3): a single example x in [0, 1]^784 through "
            "logistic regression with a bias, so x = g_w / g_b exactly; the adversary is an "
            "out-neighbour that removes the noise terms it knows from the victim's first tracker. "
            "Median MSE of its estimate over 400 examples (higher hides more).",
            "",
            "| tracker seen | median MSE |",
            "|---|---|",
            *inversion_rows,
            END,
        ]
    )


def main() -> None:
    """Runs the benchmark and prints (or writes) the section."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=2, help="seeds per job (default 2)")
    parser.add_argument("--rounds", type=int, default=50, help="rounds per job (default 50)")
    parser.add_argument(
        "--timing-rounds",
        type=int,
        default=20,
        help="rounds of the timed fedcore runs (default 20)",
    )
    parser.add_argument(
        "--peers",
        type=int,
        nargs="+",
        default=[5, 20],
        choices=sorted(TOPOLOGIES),
        help="peer counts (default 5 20)",
    )
    add_common_arguments(parser, SOURCES)
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    cache = Cache(args.cache)
    decay = decay_table()
    inversion = inversion_table()
    timing = timing_table(tuple(args.peers), args.timing_rounds, args.repeats, cache)
    accuracy = accuracy_table(
        args.seeds, args.rounds, cache, tuple(args.sources), tuple(args.peers)
    )
    section = render(
        accuracy,
        timing,
        decay,
        inversion,
        args.seeds,
        args.rounds,
        args.timing_rounds,
        args.repeats,
    )
    print(section)
    if args.write:
        write_section(section, begin=BEGIN, end=END)


if __name__ == "__main__":
    main()

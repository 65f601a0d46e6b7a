"""The audit's mechanism settings: each attack where the digests say it works, per protocol.

The example manifests give each client about 144 digits, which no inversion here undoes; the
digests' leaks are about small steps. This script audits the small settings the unit tests
use (tests/unit/test_audit.py), every randomness seeded, and prints one Markdown table per
setting; docs/audit.md and the protocol pages quote them.

* ``one-digit``: every client holds one digit (ByFile), MLP 64-32-10, 3 rounds, for fedsgd,
  perturb, mpdp (Faithful and Hardened, default noise) and dp-fedavg (noise multiplier 5,
  epsilon about 1.4, and 1e-9 as the control).
* ``membership``: 2 clients share 500 MNIST images (4,500 held out), MLP 784-64-10, 2 rounds of
  20 local epochs, fedavg and dp-fedavg (clipping 0.5, noise multiplier 3).
* ``ebscfl``: 4 clients on digits, 2 cluster models, MLP 64-4-10, 3 rounds, Faithful and
  Repaired (the four leaks of digest 004, as tests/unit/test_audit_leaks.py).
* ``lppa``: 3 clients of one digit each on a directed ring (DSGT, LPPA at noise 0.025 and 1)
  and 5 on the complete graph (LPPA at 0.025): the neighbour attack of digest 002.

Usage: ``python benchmarks/audit.py --out /tmp/audit [--figures docs/audit] [--only TEXT]``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcore.audit import AuditReport, run_audit
from fedcore.spec import FederatedRun, parse_manifest

LOSSLESS = {"kind": "MLP", "hidden": [32], "bias": False, "dtype": "float64"}
PLAIN = {"kind": "MLP", "hidden": [32], "dtype": "float64"}


def manifest(spec: dict[str, Any]) -> FederatedRun:
    """A FederatedRun of ``spec``."""
    return parse_manifest(
        {
            "apiVersion": "fedcore.dev/v1alpha1",
            "kind": "FederatedRun",
            "metadata": {"name": "audit-bench"},
            "spec": {"seed": 0, **spec},
        }
    )


def one_digit(
    folder: Path,
    clients: int,
    protocol: dict[str, Any],
    model: dict[str, Any],
    *,
    loss: str = "MSE",
    rate: float = 0.5,
) -> FederatedRun:
    """Clients of one digit each (ByFile) and 200 held-out digits, 3 rounds."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    order = np.random.default_rng(0).permutation(len(y))
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(clients):
        np.savez(folder / f"client-{k}.npz", x=x[order[k : k + 1]], y=y[order[k : k + 1]])
    np.savez(folder / "test.npz", x=x[order[-200:]], y=y[order[-200:]])
    return manifest(
        {
            "protocol": protocol,
            "model": model,
            "data": {
                "source": {"kind": "NpzFolder", "path": str(folder)},
                "partition": {"kind": "ByFile"},
            },
            "clients": {"count": clients},
            "rounds": 3,
            "training": {
                "localEpochs": 1,
                "batchSize": 1,
                "loss": loss,
                "optimizer": {"kind": "SGD", "learningRate": rate},
            },
        }
    )


def membership(protocol: dict[str, Any]) -> FederatedRun:
    """2 clients, 500 MNIST images, 2 rounds of 20 local epochs."""
    return manifest(
        {
            "protocol": protocol,
            "model": {"kind": "MLP", "hidden": [64]},
            "data": {"source": {"kind": "MNISTSubset"}, "testFraction": 0.9},
            "clients": {"count": 2},
            "rounds": 2,
            "training": {
                "localEpochs": 20,
                "batchSize": 16,
                "optimizer": {"kind": "SGD", "learningRate": 0.1},
            },
        }
    )


def settings(root: Path) -> dict[str, tuple[FederatedRun, list[str]]]:
    """Every setting: its run and the attacks audited on it."""
    inversions = ["dlg", "inverting-gradients", "differencing-inversion", "differencing-subspace"]
    dp = {"clippingNorm": 1.0, "secureNoise": False}
    mi = ["membership-loss", "membership-shadow"]
    return {
        "fedsgd, one digit per client (3 clients)": (
            one_digit(root / "fedsgd", 3, {"name": "fedsgd"}, PLAIN),
            inversions,
        ),
        "perturb, one digit per client (2 clients)": (
            one_digit(root / "perturb", 2, {"name": "perturb"}, LOSSLESS, rate=1.0),
            inversions,
        ),
        "mpdp Faithful, one digit per client (2 clients)": (
            one_digit(
                root / "faithful", 2, {"name": "mpdp", "mpdp": {"mode": "Faithful"}}, LOSSLESS
            ),
            [*inversions, "correction-leak"],
        ),
        "mpdp Hardened, one digit per client (2 clients)": (
            one_digit(
                root / "hardened", 2, {"name": "mpdp", "mpdp": {"mode": "Hardened"}}, LOSSLESS
            ),
            [*inversions, "correction-leak"],
        ),
        "dp-fedavg z=5, one digit per client (2 clients)": (
            one_digit(
                root / "dp5",
                2,
                {"name": "dp-fedavg", "dpFedavg": {**dp, "noiseMultiplier": 5.0}},
                {"kind": "MLP", "hidden": [32]},
                loss="CrossEntropy",
            ),
            inversions,
        ),
        "dp-fedavg z=1e-9, one digit per client (2 clients)": (
            one_digit(
                root / "dp0",
                2,
                {"name": "dp-fedavg", "dpFedavg": {**dp, "noiseMultiplier": 1e-9}},
                {"kind": "MLP", "hidden": [32]},
                loss="CrossEntropy",
            ),
            inversions,
        ),
        "fedavg, MNIST 500 (membership)": (membership({"name": "fedavg"}), mi),
        "dp-fedavg z=3, MNIST 500 (membership)": (
            membership(
                {
                    "name": "dp-fedavg",
                    "dpFedavg": {"clippingNorm": 0.5, "noiseMultiplier": 3.0, "secureNoise": False},
                }
            ),
            mi,
        ),
    }


def ebscfl(mode: str) -> FederatedRun:
    """4 clients on digits, 2 cluster models, MLP 64-4-10, 3 rounds."""
    return manifest(
        {
            "protocol": {
                "name": "ebscfl",
                "ebscfl": {"mode": mode, "clusters": 2, "rootExamples": 40, "rootEpochs": 2},
            },
            "model": {"kind": "MLP", "hidden": [4]},
            "data": {"source": {"kind": "Digits"}},
            "clients": {"count": 4},
            "rounds": 3,
            "training": {"batchSize": 64, "optimizer": {"kind": "SGD", "learningRate": 0.1}},
        }
    )


def lppa(folder: Path, clients: int, options: dict[str, Any]) -> FederatedRun:
    """Clients of one digit each (batch 1, cross-entropy) on an LPPA peer graph."""
    return one_digit(
        folder,
        clients,
        {"name": "lppa", "lppa": {"secureNoise": False, **options}},
        {"kind": "MLP", "hidden": [32], "dtype": "float64"},
        loss="CrossEntropy",
        rate=0.1,
    )


def new_settings(root: Path) -> dict[str, tuple[FederatedRun, list[str]]]:
    """The EBS-CFL and LPPA settings."""
    leaks = ["ebscfl-decode-key", "ebscfl-spectral", "ebscfl-differencing", "ebscfl-segment-solve"]
    ring = {"kind": "Ring", "directed": True}
    return {
        "ebscfl Faithful, 4 clients x 3 rounds": (ebscfl("Faithful"), leaks),
        "ebscfl Repaired, 4 clients x 3 rounds": (ebscfl("Repaired"), leaks),
        "lppa DSGT (no noise), directed ring of 3": (
            lppa(root / "dsgt", 3, {"topology": ring, "variant": "DSGT"}),
            ["lppa-neighbour"],
        ),
        "lppa noise 0.025, directed ring of 3": (
            lppa(root / "ring", 3, {"topology": ring, "noiseScale": 0.025}),
            ["lppa-neighbour"],
        ),
        "lppa noise 0.025, complete graph of 5": (
            lppa(root / "complete", 5, {"topology": {"kind": "Complete"}, "noiseScale": 0.025}),
            ["lppa-neighbour"],
        ),
        "lppa noise 1, directed ring of 3": (
            lppa(root / "loud", 3, {"topology": ring, "noiseScale": 1.0}),
            ["lppa-neighbour"],
        ),
    }


SHOWN = (
    "PSNR (dB)",
    "cosine (absolute)",
    "PSNR gain over the prior (dB), as received",
    "cluster identity",
    "updates recovered (cosine > 0.999)",
    "filtered or not (sign of w_i)",
)
"""The estimates a table shows after the verdict."""


def table(title: str, report: AuditReport) -> str:
    """One setting's results as Markdown."""
    epsilon = "" if report.epsilon is None else f", epsilon {report.epsilon:.3g}"
    lines = [
        f"**{title}** (accuracy {report.accuracy:.3f}{epsilon})",
        "",
        "| attack | measure | value [95% CI] | blind guess | beats blind guessing |",
        "|---|---|---|---|---|",
    ]
    for r in report.results:
        if r.verdict is None:
            lines.append(f"| `{r.attack}` | skipped: {r.skipped} | | | |")
            continue
        shown = [
            r.verdict,
            *(e for e in r.estimates[1:] if e.name in SHOWN),
        ]
        for e in shown:
            chance = "-" if e.chance is None else f"{e.chance:.3g}"
            beats = {True: "**yes**", False: "no", None: ""}[e.beats_chance]
            lines.append(
                f"| `{r.attack}` | {e.name} | {e.value:.3g} [{e.low:.3g}, {e.high:.3g}] | "
                f"{chance} | {beats} |"
            )
    return "\n".join(lines)


def main() -> None:
    """Runs every setting and prints the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Reports go here.")
    parser.add_argument("--figures", type=Path, default=None, help="Copy figures here.")
    parser.add_argument("--only", default="", help="Run the settings whose title has this.")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)
    chosen = {**settings(args.out / "data"), **new_settings(args.out / "data")}
    for index, (title, (run, attacks)) in enumerate(chosen.items()):
        if args.only not in title:
            continue
        out = args.out / f"setting-{index}"
        report = run_audit(run, out, attacks=attacks)
        print(table(title, report), end="\n\n", flush=True)
        if args.figures is not None:
            args.figures.mkdir(parents=True, exist_ok=True)
            for figure in sorted((out / "figures").glob("*.png")):
                shutil.copy(figure, args.figures / f"setting-{index}-{figure.name}")


if __name__ == "__main__":
    main()

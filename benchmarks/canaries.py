"""The canary audit on the shipped examples: the measured ε beside the claimed ε.

Each row is one ``run_canary_audit`` (fedcore/audit/canary) of an example manifest: the
claimed ε (the run's accountant), the one-run lower bound at 95% and its ceiling, the one-shot
estimate with its 95% interval, the verdict and the wall time. One row injects a fault (the
dp-fedavg server's noise replaced by zeros, as tests/unit/test_canary_audit.py does), to show
what a missing noise looks like. The table goes in docs/audit.md ("Canaries"); the runs use
secure noise where the example does, so another invocation draws other numbers.

Run: ``python benchmarks/canaries.py`` (about a minute; prints the table's rows).
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import fedcore.protocols.dp_fedavg as dp_fedavg  # noqa: E402
from fedcore.audit.canary.run import run_canary_audit  # noqa: E402
from fedcore.spec import FederatedRun, load_manifest, parse_manifest  # noqa: E402


def example(name: str) -> Callable[[], FederatedRun]:
    return lambda: load_manifest(ROOT / "examples" / name)


def secagg_with_distributed_dp() -> FederatedRun:
    """digits-secagg with distributed DP (clipping 0.3, noise multiplier 1) for 5 rounds."""
    document = yaml.safe_load((ROOT / "examples" / "digits-secagg.yaml").read_text())
    secagg = document["spec"]["protocol"]["secagg"]
    secagg["distributedDp"] = {"clippingNorm": 0.3, "noiseMultiplier": 1.0}
    document["spec"]["rounds"] = 5
    return parse_manifest(document)


CASES: list[tuple[str, Callable[[], FederatedRun], int, bool]] = [
    ("digits-dpfedavg", example("digits-dpfedavg.yaml"), 1000, False),
    ("digits-dpfedavg, noise switched off (fault)", example("digits-dpfedavg.yaml"), 1000, True),
    ("digits-mpdp (Hardened)", example("digits-mpdp.yaml"), 500, False),
    ("digits-secagg + distributedDp (C 0.3, z 1)", secagg_with_distributed_dp, 100, False),
    ("digits-fedavg (no DP)", example("digits-fedavg.yaml"), 500, False),
]


def _silent(total: dict[str, np.ndarray], std: float, rng: object) -> dict[str, np.ndarray]:
    return {name: np.zeros_like(value) for name, value in total.items()}


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def main() -> None:
    warnings.simplefilter("ignore", UserWarning)
    noise = dp_fedavg.gaussian_noise_like
    for name, make, canaries, fault in CASES:
        dp_fedavg.gaussian_noise_like = _silent if fault else noise  # type: ignore[assignment]
        started = time.monotonic()
        audit = run_canary_audit(make(), canaries=canaries)
        seconds = time.monotonic() - started
        print(json.dumps({"case": name, "seconds": seconds, **audit.as_json()}), file=sys.stderr)
        e, b = audit.estimate, audit.bound
        print(
            f"| {name} | {canaries:,} ({audit.inserted}) | {audit.rounds} "
            f"| {_number(audit.claimed)} | {b.epsilon:.3g} ({audit.ceiling:.3g}) "
            f"| {e.epsilon:.3g} [{e.low:.3g}, {e.high:.3g}] | {audit.verdict} "
            f"| {audit.accuracy:.2f} | {seconds:.1f} |"
        )
    dp_fedavg.gaussian_noise_like = noise


if __name__ == "__main__":
    main()

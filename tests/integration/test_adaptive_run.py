"""adaptive on real processes: the example end to end, and a reproducible Laplace-mechanism run
that equals the one-process simulation bit for bit and reports formal DP with its epsilon."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedcore.simulation import simulate
from fedcore.spec import load_manifest
from tests.integration._runs import fedcore, last_json, write_manifest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:adaptive draws its distortion:UserWarning"),
]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "digits-adaptive.yaml"


def rounds_of(work: Path) -> list[dict[str, Any]]:
    lines = (work / "events.jsonl").read_text(encoding="utf-8").splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "round"]


def test_the_adaptive_example_learns_within_its_distortion_bounds(tmp_path: Path) -> None:
    # Execute
    done = fedcore("run", str(EXAMPLE), "--json", "--workdir", str(tmp_path / "w"), cwd=tmp_path)
    # Assert
    assert done.returncode == 0, done.stderr
    summary = last_json(done.stdout)
    assert summary["phase"] == "Succeeded"
    assert summary["accuracy"] >= 0.85
    rounds = rounds_of(tmp_path / "w")
    assert len(rounds) == 100
    lower = (1.0 - 0.96) / 0.0625  # the example's PL budget
    for entry in rounds:
        metrics = entry["metrics"]
        assert metrics["formal_dp"] == 0.0
        assert metrics["lower"] == pytest.approx(lower)
        assert lower * (1 - 1e-9) <= metrics["distortion_norm"] <= 2 * lower * (1 + 1e-9)
        assert metrics["leakage_max"] <= 0.96 + 1e-12
    assert (tmp_path / "w" / "model.safetensors").exists()


def test_a_reproducible_laplace_run_equals_the_simulation_and_is_formal_dp(
    tmp_path: Path,
) -> None:
    # Prepare
    protocol = {
        "name": "adaptive",
        "adaptive": {
            "measure": "DP",
            "strategy": "Identical",
            "secureNoise": False,
            "dp": {"epsilon": 200.0, "clippingNorm": 1.0},
        },
    }
    manifest = write_manifest(
        tmp_path / "run.yaml",
        protocol=protocol,
        model={"kind": "MLP", "hidden": [16], "dtype": "float64"},
        training={"batchSize": 32, "optimizer": {"kind": "SGD", "learningRate": 0.5}},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        simulated = simulate(load_manifest(manifest))
    # Execute
    done = fedcore("run", str(manifest), "--json", "--workdir", str(tmp_path / "w"), cwd=tmp_path)
    # Assert
    assert done.returncode == 0, done.stderr
    released = load_file(str(tmp_path / "w" / "model.safetensors"))
    for name, value in simulated.weights.items():
        assert np.array_equal(released[name], value), name
    rounds = rounds_of(tmp_path / "w")
    assert all(e["metrics"]["formal_dp"] == 1.0 for e in rounds)
    assert [e["metrics"]["epsilon_composed"] for e in rounds] == [200.0, 400.0, 600.0, 800.0]

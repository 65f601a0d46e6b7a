"""perturb end to end: `fedcore run` over real processes equals simulate() and fedsgd."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedcore.simulation import simulate
from fedcore.spec import load_manifest
from tests.integration._runs import fedcore, last_json, write_manifest

pytestmark = pytest.mark.integration

PERTURB = {
    "protocol": {"name": "perturb", "perturb": {"secureSecrets": False}},
    "model": {"kind": "MLP", "hidden": [32], "bias": False, "dtype": "float64"},
    "training": {"loss": "MSE", "optimizer": {"kind": "SGD", "learningRate": 2.0}},
}
"""Changes to the shared BASE manifest (3 clients, 4 rounds): a perturb run with reproducible
secrets, so that the run over processes can equal simulate() bit for bit."""


def reproducible(manifest: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        run = load_manifest(manifest)
        return run, simulate(run)


@pytest.fixture(scope="module")
def perturb_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One 4-round perturb run of 3 clients through the CLI."""
    folder = tmp_path_factory.mktemp("perturb")
    manifest = write_manifest(folder / "run.yaml", **PERTURB)
    done = fedcore("run", str(manifest), "--json", "--workdir", str(folder / "work"), cwd=folder)
    return {"folder": folder, "manifest": manifest, "process": done}


def test_perturb_run_succeeds_and_reports_a_small_residual_every_round(perturb_run: dict) -> None:
    # Prepare
    done = perturb_run["process"]
    work = perturb_run["folder"] / "work"
    # Execute
    summary = last_json(done.stdout)
    events = [json.loads(line) for line in (work / "events.jsonl").read_text().splitlines()]
    # Assert
    assert done.returncode == 0, done.stderr
    assert summary["phase"] == "Succeeded"
    rounds = [e for e in events if e["event"] == "round"]
    assert [e["round"] for e in rounds] == [1, 2, 3, 4]
    assert all(e["participants"] == 3 for e in rounds)
    assert all(0 <= e["metrics"]["recovery_residual"] < 1e-9 for e in rounds)


def test_perturb_run_final_model_equals_simulation_bit_for_bit(perturb_run: dict) -> None:
    # Prepare
    _, simulated = reproducible(perturb_run["manifest"])
    # Execute
    released = load_file(str(perturb_run["folder"] / "work" / "model.safetensors"))
    # Assert
    assert sorted(released) == sorted(simulated.weights)
    for name, value in simulated.weights.items():
        assert np.array_equal(released[name], value), name


def test_perturb_run_final_model_equals_fedsgd_of_the_same_manifest(perturb_run: dict) -> None:
    # Prepare: the same manifest, only protocol.name changed.
    manifest = perturb_run["folder"] / "fedsgd.yaml"
    write_manifest(manifest, **{**PERTURB, "protocol": {"name": "fedsgd"}})
    # Execute
    fedsgd = simulate(load_manifest(manifest))
    released = load_file(str(perturb_run["folder"] / "work" / "model.safetensors"))
    # Assert
    for name, value in fedsgd.weights.items():
        np.testing.assert_allclose(released[name], value, rtol=0, atol=1e-9)
    assert last_json(perturb_run["process"].stdout)["accuracy"] == fedsgd.accuracy


def test_perturb_run_with_a_residual_over_its_bound_fails_loudly(tmp_path: Path) -> None:
    # Prepare: no float64 recovery is exact to 1e-300, so round 1 must fail the check.
    protocol = {"name": "perturb", "perturb": {"secureSecrets": False, "residualBound": 1e-300}}
    manifest = write_manifest(tmp_path / "run.yaml", **{**PERTURB, "protocol": protocol})
    # Execute
    done = fedcore(
        "run", str(manifest), "--json", "--workdir", str(tmp_path / "work"), cwd=tmp_path
    )
    # Assert
    summary = last_json(done.stdout)
    assert done.returncode == 1
    assert summary["phase"] == "Failed"
    assert summary["reason"] == "RecoveryFailed"
    assert "RecoveryError: Round 1:" in summary["message"]
    assert "over the bound 1.000e-300" in summary["message"]
    assert not (tmp_path / "work" / "model.safetensors").exists()

"""`fedcore run` of dp-fedavg end to end: epsilon per round, the budget's stop, exact replays."""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedcore.privacy import create_accountant
from fedcore.simulation import simulate
from fedcore.spec import load_manifest
from tests.integration._runs import fedcore, last_json, write_manifest

pytestmark = pytest.mark.integration

Z = 1.0
"""The noise multiplier of every run here."""
CLIENTS = {"count": 3, "perRound": 2}
Q = 2 / 3
"""The sampling rate of CLIENTS: 2 of 3 clients per round (public, so no amplification)."""
DELTA = 1e-5
PROTOCOL = {
    "name": "dp-fedavg",
    "dpFedavg": {"clippingNorm": 1.0, "noiseMultiplier": Z, "secureNoise": False},
}


def accountant_epsilon(rounds: int) -> float:
    """The proven bound for a public fixed-size sample: z/2 per round, no sampling (ledger)."""
    accountant = create_accountant("RDP")
    accountant.step(noise_multiplier=Z / 2, sample_rate=1.0, steps=rounds)
    return accountant.get_epsilon(DELTA)


def events_of(work: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (work / "events.jsonl").read_text().splitlines()]


def simulated_weights(manifest: Path, rounds: int | None = None) -> dict[str, np.ndarray]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*for tests only", category=UserWarning)
        return simulate(load_manifest(manifest), rounds=rounds).weights


def models_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def run_cli(folder: Path, manifest: Path, *extra: str) -> dict[str, Any]:
    work = folder / "work"
    done = fedcore(
        "run", str(manifest), "--json", "--quiet", *extra, "--workdir", str(work), cwd=folder
    )
    assert done.returncode == 0, done.stderr
    return {"summary": last_json(done.stdout), "work": work, "manifest": manifest}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One uninterrupted 3-round dp-fedavg run of 3 clients, 2 per round, no budget."""
    folder = tmp_path_factory.mktemp("dp")
    manifest = write_manifest(folder / "run.yaml", protocol=PROTOCOL, clients=CLIENTS, rounds=3)
    return run_cli(folder, manifest)


def test_dp_fedavg_run_reports_the_accountants_epsilon(finished_run: dict[str, Any]) -> None:
    # Prepare
    summary = finished_run["summary"]
    # Execute
    rounds = [e for e in events_of(finished_run["work"]) if e["event"] == "round"]
    # Assert
    assert summary["phase"] == "Succeeded"
    assert summary["rounds_completed"] == 3
    assert summary["epsilon"] == pytest.approx(accountant_epsilon(3), rel=0, abs=1e-9)
    assert summary["epsilon_claim"] == {"adjacency": "ReplaceOne", "amplification": "None"}
    assert [e["round"] for e in rounds] == [1, 2, 3]
    assert all(e["participants"] == 2 for e in rounds)
    spent = [e["epsilon"] for e in rounds]
    assert all(a < b for a, b in itertools.pairwise(spent))
    assert spent[0] == pytest.approx(accountant_epsilon(1), rel=0, abs=1e-9)


def test_dp_fedavg_run_final_model_equals_simulation_bit_for_bit(
    finished_run: dict[str, Any],
) -> None:
    # Execute
    simulated = simulated_weights(finished_run["manifest"])
    released = load_file(str(finished_run["work"] / "model.safetensors"))
    # Assert
    assert models_equal(released, simulated)


def test_dp_fedavg_run_resumed_from_round_2_equals_the_uninterrupted_run(
    finished_run: dict[str, Any], tmp_path: Path
) -> None:
    # Prepare: stopped after round 2 (its checkpoint), then resumed to round 3.
    two = write_manifest(tmp_path / "two.yaml", protocol=PROTOCOL, clients=CLIENTS, rounds=2)
    three = write_manifest(tmp_path / "three.yaml", protocol=PROTOCOL, clients=CLIENTS, rounds=3)
    run_cli(tmp_path, two)
    # Execute
    resumed = run_cli(tmp_path, three, "--resume")
    # Assert
    events = events_of(resumed["work"])
    assert any(e["event"] == "resumed" and e["round"] == 2 for e in events)
    assert resumed["summary"]["epsilon"] == finished_run["summary"]["epsilon"]
    released = load_file(str(resumed["work"] / "model.safetensors"))
    uninterrupted = load_file(str(finished_run["work"] / "model.safetensors"))
    assert models_equal(released, uninterrupted)


def test_dp_fedavg_run_with_a_budget_stops_when_the_next_round_would_pass_it(
    tmp_path: Path,
) -> None:
    # Prepare: a target between the epsilon of k and of k + 1 rounds.
    k = 2
    target = (accountant_epsilon(k) + accountant_epsilon(k + 1)) / 2
    assert accountant_epsilon(k) <= target < accountant_epsilon(k + 1)
    manifest = write_manifest(
        tmp_path / "budget.yaml",
        protocol=PROTOCOL,
        clients=CLIENTS,
        rounds=5,
        privacy={"targetEpsilon": target, "targetDelta": DELTA, "accountant": "RDP"},
    )
    # Execute
    done = run_cli(tmp_path, manifest)
    # Assert
    summary = done["summary"]
    assert summary["phase"] == "Succeeded"
    assert summary["reason"] == "BudgetExhausted"
    assert summary["rounds_completed"] == k
    assert summary["epsilon"] <= target
    assert summary["epsilon"] == pytest.approx(accountant_epsilon(k), rel=0, abs=1e-9)
    budget = [e for e in events_of(done["work"]) if e["event"] == "budget"]
    assert [e["round"] for e in budget] == [k + 1]
    released = load_file(str(done["work"] / "model.safetensors"))
    assert models_equal(released, simulated_weights(manifest, rounds=k))


def test_dp_fedavg_run_with_a_secret_sample_claims_sampling_without_replacement(
    tmp_path: Path,
) -> None:
    # Prepare: 1 of 4 clients a round for 8 rounds, drawn by the server from the OS CSPRNG;
    # the same job with the manifest's seeded sample, simulated, for comparison.
    rounds = 8
    secret = {"count": 4, "perRound": 1, "sampling": "Secret"}
    manifest = write_manifest(
        tmp_path / "secret.yaml", protocol=PROTOCOL, clients=secret, rounds=rounds
    )
    seeded = write_manifest(
        tmp_path / "seeded.yaml",
        protocol=PROTOCOL,
        clients={**secret, "sampling": "Seeded"},
        rounds=rounds,
    )
    accountant = create_accountant("RDP", "without-replacement")
    accountant.step(noise_multiplier=Z / 2, sample_rate=0.25, steps=rounds)
    public = create_accountant("RDP")
    public.step(noise_multiplier=Z / 2, sample_rate=1.0, steps=rounds)
    # Execute
    done = run_cli(tmp_path, manifest)
    # Assert: epsilon is the amplified bound (below the public sample's), every round took
    # one client, and the rounds did not take the seeded sample (the model differs from the
    # seeded job's; equal samples in all 8 rounds have probability 4**-8, about 1.5e-5).
    summary = done["summary"]
    assert summary["phase"] == "Succeeded" and summary["rounds_completed"] == rounds
    assert summary["epsilon"] == pytest.approx(accountant.get_epsilon(DELTA), rel=0, abs=1e-9)
    assert summary["epsilon"] < public.get_epsilon(DELTA)
    assert summary["epsilon_claim"] == {
        "adjacency": "ReplaceOne",
        "amplification": "SamplingWithoutReplacement",
    }
    rounds_run = [e for e in events_of(done["work"]) if e["event"] == "round"]
    assert [e["participants"] for e in rounds_run] == [1] * rounds
    released = load_file(str(done["work"] / "model.safetensors"))
    assert not models_equal(released, simulated_weights(seeded))

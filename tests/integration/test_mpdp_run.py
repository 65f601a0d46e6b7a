"""`fedcore run` of mpdp end to end: a real KDC, server and clients over mutual-TLS gRPC."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedcore.learning.data import client_dataset
from fedcore.learning.models import build_model, get_weights
from fedcore.learning.training import LocalLearner
from fedcore.local.runner import LocalRun
from fedcore.observe.events import read_events
from fedcore.simulation import simulate
from fedcore.spec import FederatedRun, load_manifest
from tests.integration._runs import ServerHold, fedcore, kill_and_wait, last_json, write_manifest
from tests.integration.test_local_run import wait_for_event

pytestmark = pytest.mark.integration

MPDP_SPEC: dict[str, Any] = {
    "model": {"kind": "MLP", "hidden": [16], "bias": False, "dtype": "float64"},
    "clients": {"count": 3},
    "rounds": 3,
    "training": {"loss": "MSE", "optimizer": {"kind": "SGD", "learningRate": 0.5}},
    "checkpoint": {"everyRounds": 0},
}


def mpdp_manifest(path: Path, spec: dict[str, Any] | None = None, **mpdp: Any) -> Path:
    options = {"mode": "Hardened", "graph": "NOut", "graphDegree": 1, **mpdp}
    changes = {**MPDP_SPEC, **(spec or {})}
    return write_manifest(path, protocol={"name": "mpdp", "mpdp": options}, **changes)


def run(folder: Path, manifest: Path) -> tuple[dict[str, Any], Path]:
    work = folder / "work"
    done = fedcore("run", str(manifest), "--json", "--workdir", str(work), cwd=folder)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return last_json(done.stdout), work


def test_run_noise_off_starts_a_kdc_and_equals_simulation_and_fedsgd_uniform(
    tmp_path: Path,
) -> None:
    # Prepare
    manifest = mpdp_manifest(tmp_path / "run.yaml", clientNoiseStd=0)
    fedsgd = write_manifest(
        tmp_path / "fedsgd.yaml",
        protocol={"name": "fedsgd", "fedsgd": {"weighting": "Uniform"}},
        **MPDP_SPEC,
    )
    # Execute
    summary, work = run(tmp_path, manifest)
    released = load_file(str(work / "model.safetensors"))
    simulated = simulate(load_manifest(manifest)).weights
    reference = simulate(load_manifest(fedsgd)).weights
    # Assert
    assert summary["phase"] == "Succeeded" and summary["rounds"] == 3
    assert summary.get("epsilon") is None
    assert (work / "logs" / "kdc.log").exists()
    events = [json.loads(line) for line in (work / "events.jsonl").read_text().splitlines()]
    rounds = [e for e in events if e["event"] == "round"]
    assert [e["participants"] for e in rounds] == [3, 3, 3]
    assert sorted(released) == sorted(reference)
    for name, weights in reference.items():
        np.testing.assert_allclose(released[name], simulated[name], rtol=0, atol=1e-9)
        np.testing.assert_allclose(released[name], weights, rtol=0, atol=1e-9)


def test_run_with_noise_reports_epsilon(tmp_path: Path) -> None:
    # Prepare
    manifest = mpdp_manifest(tmp_path / "run.yaml", clientNoiseStd=2.0, clippingNorm=1.0)
    # Execute
    summary, work = run(tmp_path, manifest)
    # Assert
    assert summary["phase"] == "Succeeded"
    assert summary["epsilon"] is not None and summary["epsilon"] > 0
    assert (work / "logs" / "kdc.log").exists()


def wait_for_round(run: LocalRun, round: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    offset = 0
    while time.monotonic() < deadline:
        events, offset = read_events(run.events_path, offset)
        if any(e["event"] == "round" and e.get("round") == round for e in events):
            return
        time.sleep(0.05)
    raise AssertionError(f"no round {round} event within {timeout} s")


def fedsgd_uniform(run: FederatedRun, members_per_round: list[list[int]]) -> dict[str, np.ndarray]:
    """The model after uniform fedsgd rounds over the given members (a hand-made reference)."""
    spec = run.spec
    learners = {}
    for k in sorted({k for members in members_per_round for k in members}):
        shard = client_dataset(spec, k)
        net = build_model(spec.model, shard.input_shape, shard.num_classes, seed=spec.seed)
        learners[k] = LocalLearner(net, shard, spec.training, seed=spec.seed, client_index=k)
    first = client_dataset(spec, 0)
    weights = get_weights(
        build_model(spec.model, first.input_shape, first.num_classes, seed=spec.seed)
    )
    rate = spec.training.optimizer.learning_rate
    for round_, members in enumerate(members_per_round, start=1):
        grads = [learners[k].gradient(weights, round=round_)[0] for k in members]
        weights = {n: w - rate * sum(g[n] for g in grads) / len(grads) for n, w in weights.items()}
    return weights


def test_run_client_killed_mid_run_redoes_rounds_with_the_survivors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the server holds after round 1 until client 3 is dead
    manifest = mpdp_manifest(
        tmp_path / "run.yaml",
        {"clients": {"count": 4, "quorum": 3}, "rounds": 10},
        clientNoiseStd=0,
    )
    hold = ServerHold(monkeypatch, tmp_path, 1)
    run = LocalRun(load_manifest(manifest), manifest, workdir=tmp_path / "work")
    run.start()
    try:
        wait_for_event(run, "held", round=1)
        # Execute
        kill_and_wait(run.children["client-3"])
        hold.release()
        result = run.wait()
    finally:
        run.stop()
    # Assert
    lines = (tmp_path / "work" / "events.jsonl").read_text().splitlines()
    rounds = [e for e in map(json.loads, lines) if e["event"] == "round"]
    assert result.phase == "Succeeded"
    assert [e["round"] for e in rounds] == list(range(1, 11))
    assert [e["participants"] for e in rounds] == [4] + [3] * 9
    assert rounds[1]["attempts"] == 2  # the first round after the kill is redone
    assert rounds[-1]["participants"] == 3 and rounds[-1]["attempts"] == 2
    # No wrong aggregate: every round's step is the uniform fedsgd step of its participants
    # (all four until client 3 died, the three survivors after), so the released model is.
    assert all(e["participants"] in (3, 4) for e in rounds)
    members = [[0, 1, 2, 3] if e["participants"] == 4 else [0, 1, 2] for e in rounds]
    expected = fedsgd_uniform(load_manifest(manifest), members)
    released = load_file(str(tmp_path / "work" / "model.safetensors"))
    assert sorted(released) == sorted(expected)
    for name, weights in expected.items():
        np.testing.assert_allclose(released[name], weights, rtol=0, atol=1e-9)


def test_example_digits_mpdp_runs_within_its_budget(tmp_path: Path) -> None:
    # Prepare
    example = Path(__file__).resolve().parents[2] / "examples" / "digits-mpdp.yaml"
    # Execute
    summary, work = run(tmp_path, example)
    # Assert: 10 clients, 40 rounds; measured accuracy 0.76 to 0.78 at epsilon 354.9.
    assert summary["phase"] == "Succeeded" and summary["rounds_completed"] == 40
    assert summary["epsilon"] == pytest.approx(354.86, abs=0.1)
    assert summary["accuracy"] > 0.5
    assert (work / "logs" / "kdc.log").exists()

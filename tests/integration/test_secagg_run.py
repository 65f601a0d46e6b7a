"""`fedcore run` of secagg end to end: SecAgg+ over real processes and mutual-TLS gRPC, with a
client lost between two stages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedcore.local.runner import LocalRun
from fedcore.simulation import simulate
from fedcore.spec import load_manifest
from tests.integration._runs import ServerHold, fedcore, kill_and_wait, last_json, write_manifest
from tests.integration.test_local_run import wait_for_event

pytestmark = pytest.mark.integration

SECAGG_SPEC: dict[str, Any] = {
    "protocol": {"name": "secagg", "secagg": {"dropoutRate": 0.2, "corruptRate": 0.2}},
    "clients": {"count": 5, "quorum": "60%"},
    "checkpoint": {"everyRounds": 0},
}


def _events(work: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (work / "events.jsonl").read_text().splitlines()]


DDP = {"clippingNorm": 1.0, "noiseMultiplier": 0.5, "secureNoise": False}


@pytest.mark.parametrize("distributed_dp", [None, DDP], ids=["plain", "distributed-dp"])
def test_a_run_over_processes_equals_its_simulation_bit_for_bit(
    tmp_path: Path, distributed_dp: dict[str, Any] | None
) -> None:
    """With distributed DP the clients' noise is drawn from seeded generators here
    (secureNoise false), so that the run can be compared with its simulation."""
    # Prepare
    spec = json.loads(json.dumps(SECAGG_SPEC))
    if distributed_dp is not None:
        spec["protocol"]["secagg"]["distributedDp"] = distributed_dp
    manifest = write_manifest(tmp_path / "run.yaml", **{**spec, "rounds": 3})
    # Execute
    done = fedcore(
        "run", str(manifest), "--json", "--workdir", str(tmp_path / "work"), cwd=tmp_path
    )
    simulated = simulate(load_manifest(manifest))
    # Assert
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    summary = last_json(done.stdout)
    assert summary["phase"] == "Succeeded" and summary["rounds_completed"] == 3
    released = load_file(str(tmp_path / "work" / "model.safetensors"))
    assert sorted(released) == sorted(simulated.weights)
    for name, value in simulated.weights.items():
        assert np.array_equal(released[name], value), name
    rounds = [e for e in _events(tmp_path / "work") if e["event"] == "round"]
    assert [e["participants"] for e in rounds] == [5, 5, 5]
    assert summary["accuracy"] == pytest.approx(simulated.accuracy, abs=0)
    if distributed_dp is None:
        assert summary.get("epsilon") is None
    else:
        assert summary["epsilon"] == pytest.approx(simulated.epsilon, rel=1e-12)
        assert summary["epsilon"] > 0


def test_a_client_lost_after_sharing_is_unmasked_from_its_neighbours_shares(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Client 3 shares its keys, then dies before its masked input: the survivors reveal its
    mask key's shares, the server removes its pair masks, and the round's model is the mean of
    the other four, exactly as the simulation with the same drop computes it."""
    # Prepare
    manifest = write_manifest(tmp_path / "run.yaml", **{**SECAGG_SPEC, "rounds": 1})
    hold = ServerHold(monkeypatch, tmp_path, "1.2")
    run = LocalRun(load_manifest(manifest), manifest, workdir=tmp_path / "work")
    run.start()
    try:
        wait_for_event(run, "held", round=1, stage=2)
        # Execute
        kill_and_wait(run.children["client-3"])
        hold.release()
        result = run.wait()
    finally:
        run.stop()
    expected = simulate(load_manifest(manifest), drops={(1, 3): {3}})
    # Assert
    assert result.phase == "Succeeded", result
    released = load_file(str(tmp_path / "work" / "model.safetensors"))
    for name, value in expected.weights.items():
        assert np.array_equal(released[name], value), name
    (round_event,) = [e for e in _events(tmp_path / "work") if e["event"] == "round"]
    assert round_event["participants"] == 4
    assert round_event["metrics"]["dropped_after_sharing"] == 1.0
    log = (tmp_path / "work" / "logs" / "server.log").read_text()
    assert "stage 3: clients [3] failed" in log


def test_clients_lost_at_every_stage_are_handled_exactly_as_the_simulation_drops_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run, one client killed in each round at a different stage (real processes, mutual
    TLS): before sharing (after its keys), after sharing (before its masked input), after its
    masked input (before the consistency check) and during unmasking. Those killed before their
    masked input are left out of the sum, the others are in it, and every round's model equals
    the simulation with the same drops bit for bit (the dead stay dead: they fail the first
    stage of every later round)."""
    # Prepare
    spec = {
        **SECAGG_SPEC,
        "protocol": {"name": "secagg", "secagg": {"dropoutRate": 0.4, "corruptRate": 0.05}},
        "clients": {"count": 10, "quorum": "60%"},
        "rounds": 4,
    }
    manifest = write_manifest(tmp_path / "run.yaml", **spec)
    killed = {"1.0": 1, "2.2": 3, "3.3": 5, "4.4": 7}  # held after stage s, killed there
    hold = ServerHold(monkeypatch, tmp_path, *killed)
    run = LocalRun(load_manifest(manifest), manifest, workdir=tmp_path / "work")
    run.start()
    try:
        # Execute
        for point, client in killed.items():
            round_, stage = (int(part) for part in point.split("."))
            wait_for_event(run, "held", round=round_, stage=stage)
            kill_and_wait(run.children[f"client-{client}"])
            hold.release(point)
        result = run.wait()
    finally:
        run.stop()
    drops: dict[tuple[int, int], set[int]] = {}
    dead: set[int] = set()
    for point, client in killed.items():
        round_, stage = (int(part) for part in point.split("."))
        if dead:
            drops[(round_, 0)] = set(dead)
        drops[(round_, stage + 1)] = {client}
        dead.add(client)
    expected = simulate(load_manifest(manifest), drops=drops)
    # Assert
    assert result.phase == "Succeeded", result
    released = load_file(str(tmp_path / "work" / "model.safetensors"))
    for name, value in expected.weights.items():
        assert np.array_equal(released[name], value), name
    rounds = [e for e in _events(tmp_path / "work") if e["event"] == "round"]
    # lost before its masked input: out of the sum; after it: in the sum
    assert [e["participants"] for e in rounds] == [9, 8, 8, 7]
    assert [e["participants"] for e in expected.history] == [9, 8, 8, 7]


def test_thirty_percent_dropping_after_sharing_every_round_equals_its_simulation(
    tmp_path: Path,
) -> None:
    """3 of 10 clients share their keys, then never send their masked input (spec.attack
    DropAfterSharing): every round rebuilds their mask keys from the survivors' shares, and the
    model over processes equals the simulation's, bit for bit."""
    # Prepare
    spec = {
        **SECAGG_SPEC,
        "protocol": {"name": "secagg", "secagg": {"dropoutRate": 0.3, "corruptRate": 0.1}},
        "clients": {"count": 10, "quorum": "60%"},
        "attack": {"kind": "DropAfterSharing", "fraction": 0.3, "seed": 2},
        "rounds": 2,
    }
    manifest = write_manifest(tmp_path / "run.yaml", **spec)
    # Execute
    done = fedcore(
        "run", str(manifest), "--json", "--workdir", str(tmp_path / "work"), cwd=tmp_path
    )
    simulated = simulate(load_manifest(manifest))
    # Assert
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    released = load_file(str(tmp_path / "work" / "model.safetensors"))
    for name, value in simulated.weights.items():
        assert np.array_equal(released[name], value), name
    rounds = [e for e in _events(tmp_path / "work") if e["event"] == "round"]
    assert [e["participants"] for e in rounds] == [7, 7]
    assert [e["metrics"]["dropped_after_sharing"] for e in rounds] == [3.0, 3.0]

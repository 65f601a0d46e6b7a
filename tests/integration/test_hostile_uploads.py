"""Hostile insiders on a live run: a client with a valid certificate sends uploads that are
well-formed and finite, yet would wreck the model (issue 19, item 1).

The attacker is a real client process over real mutual TLS (``spec.attack``: the client
applies the attack to its own upload). The server must refuse each hostile upload, count it
under its sender, log it with the client's name, and finish with the model that the same run
gives in one process, where the same uploads are refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from fedcore.errors import RunAborted
from fedcore.learning.poisoning import attackers
from fedcore.local.runner import LocalRun
from fedcore.simulation import simulate
from fedcore.spec import load_manifest
from tests.integration._runs import BASE, ServerHold, write_manifest
from tests.integration.test_ebscfl_run import events_of
from tests.integration.test_local_run import scrape, wait_for_event

pytestmark = pytest.mark.integration


def refused_from(metrics: str, sender: str, reason: str) -> float | None:
    """The value of the by-sender rejection series of ``sender`` and ``reason``, if any."""
    for line in metrics.splitlines():
        if line.startswith("fedcore_rejected_messages_by_sender_total{") and (
            f'sender="{sender}"' in line and f'reason="{reason}"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return None


@dataclass
class HeldRun:
    """A finished run of one attacker, with the server's metrics read while it was held."""

    bad: int
    result: Any
    metrics: str
    log: str
    rounds: list[dict[str, Any]]


def run_held_after_round_2(
    manifest: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> HeldRun:
    """Runs ``manifest`` (one attacker) with ``LocalRun``, the server held after round 2 so
    that its metrics are read while it is up; the run folder is ``tmp_path/work``."""
    run_spec = load_manifest(manifest)
    (bad,) = attackers(run_spec.spec)
    work = tmp_path / "work"
    hold = ServerHold(monkeypatch, tmp_path, 2)
    run = LocalRun(run_spec, manifest, workdir=work)
    run.start()
    try:
        wait_for_event(run, "held", round=2)
        metrics = scrape(run.metrics_ports["server"])
        hold.release()
        result = run.wait()
    finally:
        run.stop()
    log = (work / "logs" / "server.log").read_text(encoding="utf-8")
    rounds = [e for e in events_of(run.events_path) if e["event"] == "round"]
    return HeldRun(bad, result, metrics, log, rounds)


@pytest.mark.parametrize(
    ("attack", "why"),
    [
        ("Overflow", "moves the model by"),  # finite float32-max values
        ("InflateExamples", "examples; client"),  # claims 1000 x its shard
    ],
)
def test_a_hostile_upload_is_refused_counted_logged_and_the_run_keeps_the_honest_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attack: str, why: str
) -> None:
    # Prepare: one client of four attacks every round (a quorum of three goes on without
    # it); the server holds after round 2 so that its metrics are read while it is up
    manifest = write_manifest(
        tmp_path / "run.yaml",
        clients={"count": 4, "quorum": 3},
        rounds=3,
        checkpoint={"everyRounds": 0},
        attack={"kind": attack, "fraction": 0.25, "scale": 1000},
    )
    # Execute
    held = run_held_after_round_2(manifest, tmp_path, monkeypatch)
    bad, result, metrics, log, rounds = held.bad, held.result, held.metrics, held.log, held.rounds
    work = tmp_path / "work"
    # Assert: refused twice by the hold, under its own name; each round combined the three
    # honest uploads; the released model is the one-process run's, bit for bit
    released = load_file(str(work / "model.safetensors"))
    reference = simulate(load_manifest(manifest)).weights
    assert result.phase == "Succeeded"
    assert refused_from(metrics, f"client-{bad}", "bound") == 2.0
    assert re.search(
        rf"Refused the upload of client {bad} in round 1 \(sender client-{bad}, reason bound\)"
        rf": The upload of client {bad} in round 1 .*{re.escape(why)}",
        log,
    )
    assert [(e["round"], e["participants"], e["failures"]) for e in rounds] == [
        (r, 3, [bad]) for r in (1, 2, 3)
    ]
    assert sorted(released) == sorted(reference)
    for name, weights in reference.items():
        assert np.all(np.isfinite(released[name]))
        np.testing.assert_array_equal(released[name], weights)


ROOT = Path(__file__).resolve().parents[2]


def protocol_manifest(path: Path, protocol: str) -> Path:
    """A small run of ``protocol`` (its example where there is one) whose client 2 of four
    uploads Overflow: every tensor at its type's largest finite value."""
    if protocol == "ebscfl":
        from tests.integration.test_ebscfl_run import EBSCFL_SPEC

        manifest = json.loads(json.dumps(BASE))
        manifest["spec"].update(EBSCFL_SPEC)
    elif protocol == "fedsgd":
        manifest = json.loads(json.dumps(BASE))
        manifest["spec"]["protocol"] = {"name": "fedsgd"}
    else:
        name = protocol.replace("-", "")
        manifest = yaml.safe_load((ROOT / "examples" / f"digits-{name}.yaml").read_text())
    spec = manifest["spec"]
    spec["clients"] = {"count": 4, "quorum": 3}
    spec["rounds"] = 2
    spec["checkpoint"] = {"everyRounds": 0}
    spec["evaluation"] = {"everyRounds": 0}
    spec["attack"] = {"kind": "Overflow", "fraction": 0.25}
    spec.pop("privacy", None)
    options = spec["protocol"].get({"dp-fedavg": "dpFedavg"}.get(protocol, protocol), {})
    for reproducible in ("secureNoise", "secureSecrets"):
        if reproducible in options:
            options[reproducible] = False  # so the one-process run draws the same noise
    manifest["metadata"]["name"] = "e2e"
    path.write_text(yaml.safe_dump(manifest), encoding="utf-8")
    return path


# What each protocol's server can do with an Overflow upload, by what it sees of it.
OVERFLOW_OUTCOMES = {
    "fedsgd": ("Succeeded", "bound"),  # the step at the learning rate is past the bound
    "dp-fedavg": ("Succeeded", "bound"),  # refused before it is clipped
    "adaptive": ("Succeeded", "bound"),
    "ebscfl": ("Succeeded", "encoding"),  # the encoding fails its norm check
    "perturb": ("Succeeded", "upload"),  # its recovered gradient fails the residual check
    "mpdp": ("Failed", "AggregateRefused"),  # masked: the aggregate is refused, not traced
}


@pytest.mark.parametrize("protocol", sorted(OVERFLOW_OUTCOMES))
def test_an_overflowing_upload_is_refused_by_every_protocol_that_can_see_it(
    tmp_path: Path, protocol: str
) -> None:
    # Prepare
    manifest = protocol_manifest(tmp_path / "run.yaml", protocol)
    run_spec = load_manifest(manifest)
    (bad,) = attackers(run_spec.spec)
    work = tmp_path / "work"
    expected_phase, expected = OVERFLOW_OUTCOMES[protocol]
    run = LocalRun(run_spec, manifest, workdir=work)
    run.start()
    try:
        # Execute
        if expected_phase == "Failed":
            with pytest.raises(RunAborted) as failed:
                run.wait()
        else:
            result = run.wait()
    finally:
        run.stop()
    # Assert
    log = (work / "logs" / "server.log").read_text(encoding="utf-8")
    if expected_phase == "Failed":
        assert failed.value.reason == expected and failed.value.round == 1
        assert "the previous model is kept" in str(failed.value)
        return
    assert result.phase == "Succeeded"
    assert f"(sender client-{bad}, reason {expected})" in log
    released = load_file(str(work / "model.safetensors"))
    reference = simulate(load_manifest(manifest)).weights
    assert sorted(released) == sorted(reference)
    for name, weights in reference.items():
        assert np.all(np.isfinite(released[name]))
        np.testing.assert_allclose(released[name], weights, rtol=0, atol=1e-5)


def test_a_misreported_evaluation_is_refused_counted_logged_and_left_out_of_the_sum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client answers the server's evaluation requests with more right than it scored: the
    server refuses each answer under the sender's name and sums the honest clients' counts,
    exactly as the one-process run does."""
    manifest = write_manifest(
        tmp_path / "run.yaml",
        clients={"count": 4, "quorum": 3},
        rounds=3,
        checkpoint={"everyRounds": 0},
        evaluation={"where": "Both", "perClass": True},
        attack={"kind": "MisreportEvaluation", "fraction": 0.25},
    )
    held = run_held_after_round_2(manifest, tmp_path, monkeypatch)
    bad, result, metrics, log, rounds = held.bad, held.result, held.metrics, held.log, held.rounds
    assert result.phase == "Succeeded"
    assert refused_from(metrics, f"client-{bad}", "evaluation") == 2.0  # rounds 1 and 2
    assert re.search(
        rf"Refused the upload of client {bad} in round 1 \(sender client-{bad}, reason "
        rf"evaluation\): An evaluation answer has correct \d+ > total \d+",
        log,
    )
    # Training is untouched (every client uploads); the evaluation is the three honest ones'.
    assert [(e["participants"], e["evaluated_clients"]) for e in rounds] == [(4, 3)] * 3
    simulated = simulate(load_manifest(manifest))
    assert result.accuracy == simulated.accuracy
    # With a shared source, each client scores its block of the server's split (Both).
    assert all(e["server_accuracy"] >= 0 for e in rounds)

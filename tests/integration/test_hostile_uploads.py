"""Hostile insiders on a live run: a client with a valid certificate sends uploads that are
well-formed and finite, yet would wreck the model (issue 19, item 1).

The attacker is a real client process over real mutual TLS (``spec.attack``: the client
applies the attack to its own upload). The server must refuse each hostile upload, count it
under its sender, log it with the client's name, and finish with the model that the same run
gives in one process, where the same uploads are refused.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedcore.learning.poisoning import attackers
from fedcore.local.runner import LocalRun
from fedcore.simulation import simulate
from fedcore.spec import load_manifest
from tests.integration._runs import ServerHold, write_manifest
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
    run_spec = load_manifest(manifest)
    (bad,) = attackers(run_spec.spec)
    work = tmp_path / "work"
    hold = ServerHold(monkeypatch, tmp_path, 2)
    run = LocalRun(run_spec, manifest, workdir=work)
    run.start()
    try:
        wait_for_event(run, "held", round=2)
        # Execute
        metrics = scrape(run.metrics_ports["server"])
        hold.release()
        result = run.wait()
    finally:
        run.stop()
    # Assert: refused twice by the hold, under its own name; each round combined the three
    # honest uploads; the released model is the one-process run's, bit for bit
    log = (work / "logs" / "server.log").read_text(encoding="utf-8")
    rounds = [e for e in events_of(run.events_path) if e["event"] == "round"]
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

"""`fedcore run` of ebscfl end to end: a real KDC, server and clients over mutual-TLS gRPC, the
server fetching its own keys from the KDC; a malformed encoding rejected and counted, and a
KDC killed mid-run that resumes from its own checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedcore.checkpoint import kdc_checkpointer, open_store, read_key
from fedcore.learning.poisoning import attackers
from fedcore.local.runner import LocalRun
from fedcore.protocols.ebscfl.protocol import (
    CLIENT_KEYS,
    OPEN,
    SCORE,
    SCORE_KEYS,
    SERVER_KEYS,
    EbscflKdc,
)
from fedcore.roles._common import RoleConfig, spec_fingerprint
from fedcore.roles.kdc import Kdc
from fedcore.simulation import simulate
from fedcore.spec import load_manifest
from fedcore.transport import Identity, Limits, Payload, RemoteError, RpcClient, issue_run_bundles
from tests.integration._runs import ServerHold, fedcore, kill_and_wait, last_json, write_manifest
from tests.integration.test_local_run import scrape, wait_for_event

pytestmark = pytest.mark.integration

EBSCFL_SPEC: dict[str, Any] = {
    "protocol": {
        "name": "ebscfl",
        "ebscfl": {"mode": "Repaired", "clusters": 2, "rootExamples": 60, "rootEpochs": 3},
    },
    "model": {"kind": "MLP", "hidden": [16]},
    "data": {"source": {"kind": "Digits"}, "clusters": {"count": 2}},
    "clients": {"count": 4, "quorum": "75%"},
    "rounds": 3,
}


def test_the_kdc_role_hands_each_party_only_its_own_keys_over_mutual_tls(tmp_path: Path) -> None:
    # Prepare: the ebscfl KDC role on loopback; every caller is named by its certificate
    manifest = write_manifest(tmp_path / "run.yaml", **EBSCFL_SPEC)
    run = load_manifest(manifest)
    _, bundles = issue_run_bundles(run.metadata.name, num_clients=4)
    bundles["kdc"].write(tmp_path / "pki" / "kdc")
    config = RoleConfig(
        manifest=manifest,
        tls_dir=tmp_path / "pki" / "kdc",
        workdir=tmp_path,
        events=tmp_path / "events.jsonl",
    )
    protocol = EbscflKdc(options=run.spec.protocol.ebscfl, count=4)
    kdc = Kdc(run, config, bundles["kdc"], listen="127.0.0.1:0", protocol=protocol)
    port = kdc.start()

    def call(identity: str, method: str, payload: Payload) -> Payload:
        with RpcClient(
            f"127.0.0.1:{port}",
            bundles[identity],
            service="Kdc",
            limits=Limits(),
        ) as rpc:
            return rpc.call(method, payload, timeout=60.0)

    def refused(identity: str, method: str, payload: Payload) -> str:
        with pytest.raises(RemoteError) as caught:
            call(identity, method, payload)
        return caught.value.code

    g0 = np.random.default_rng(0).standard_normal((2, 30))
    opening = Payload(
        meta={"kind": OPEN, "round": 1, "attempt": 1, "nonce": "n", "roster": [0, 1, 3]},
        tensors={"g0": g0},
    )
    score = Payload(meta={"kind": SCORE, "round": 1, "attempt": 1, "client": 1})
    try:
        # Execute
        server = call("server", "Submit", opening)
        own = call("client-1", "IssueKeys", Payload(meta={"round": 1, "client": 0}))
        other = call("client-0", "IssueKeys", Payload(meta={"round": 1}))
        outsider = call("client-2", "IssueKeys", Payload(meta={"round": 1}))
        scored = call("server", "Submit", score)
        codes = [
            refused("client-0", "Submit", opening),
            refused("client-1", "Submit", score),
            refused("server", "IssueKeys", Payload(meta={"round": 1})),
        ]
    finally:
        kdc.stop()
    # Assert: the server gets its keys and score extractors, never a client's; client-1 gets
    # its own slot though it asked as client 0; a client may not use the server's API
    expected = protocol.issue_keys(1, Identity("client", 1))
    assert sorted(server.tensors) == sorted(SERVER_KEYS)
    assert sorted(scored.tensors) == sorted(SCORE_KEYS)
    assert sorted(own.tensors) == sorted(CLIENT_KEYS) == sorted(other.tensors)
    for name in CLIENT_KEYS:
        np.testing.assert_array_equal(own.tensors[name], expected.tensors[name])
    assert not np.array_equal(own.tensors["slot"], other.tensors["slot"])
    assert outsider.meta["participant"] is False and outsider.tensors == {}
    assert codes == ["PERMISSION_DENIED"] * 3


def events_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_a_malformed_encoding_is_rejected_counted_logged_and_the_rounds_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: one client of four tampers with its encoded upload every round
    manifest = write_manifest(
        tmp_path / "run.yaml",
        **{**EBSCFL_SPEC, "checkpoint": {"everyRounds": 0}},
        attack={"kind": "MalformedEncoding", "fraction": 0.25, "scale": 0.01},
    )
    run_spec = load_manifest(manifest)
    (bad,) = attackers(run_spec.spec)
    hold = ServerHold(monkeypatch, tmp_path, 2)  # the server waits while its metrics are read
    run = LocalRun(run_spec, manifest, workdir=tmp_path / "work")
    run.start()
    try:
        wait_for_event(run, "held", round=2)
        # Execute
        metrics = scrape(run.metrics_ports["server"])
        hold.release()
        result = run.wait()
    finally:
        run.stop()
    # Assert
    counted = re.search(
        r'fedcore_rejected_messages_total\{reason="encoding",role="server",run="e2e"\} (\S+)',
        metrics,
    )
    log = (tmp_path / "work" / "logs" / "server.log").read_text(encoding="utf-8")
    rounds = [e for e in events_of(run.events_path) if e["event"] == "round"]
    assert result.phase == "Succeeded"
    assert counted is not None and float(counted.group(1)) >= 2
    assert f"Refused the upload of client {bad} in round 1" in log and "fails the" in log
    assert [(e["round"], e["participants"], e["attempts"]) for e in rounds] == [
        (r, 3, 2) for r in (1, 2, 3)
    ]
    assert all(e["metrics"]["weight_total"] > 0 for e in rounds)
    assert (tmp_path / "work" / "model-cluster-1.safetensors").exists()


def test_kdc_killed_mid_run_resumes_from_its_checkpoint_and_the_run_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the aggregate does not depend on the keys (exact to float64 rounding), so the
    # run must end with the model of the same run simulated in one process; the server holds
    # after round 1 until the KDC is dead
    total = 4
    manifest = write_manifest(
        tmp_path / "run.yaml",
        **{**EBSCFL_SPEC, "rounds": total, "checkpoint": {"everyRounds": 1}},
    )
    work = tmp_path / "work"
    hold = ServerHold(monkeypatch, tmp_path, 1)
    run = LocalRun(load_manifest(manifest), manifest, workdir=work)
    run.start()
    try:
        wait_for_event(run, "held", round=1)
        saved = [e for e in events_of(run.kdc_events_path) if e["event"] == "checkpoint"]
        # Execute
        kill_and_wait(run.children["kdc"])
        hold.release()
        result = run.wait()
    finally:
        run.stop()
    # Assert
    kdc_events = events_of(run.kdc_events_path)
    resumed = [e for e in kdc_events if e["event"] == "resumed"]
    rounds = [e for e in events_of(run.events_path) if e["event"] == "round"]
    assert result.phase == "Succeeded" and result.restarts == {"kdc": 1}
    assert len(resumed) == 1 and resumed[0]["version"] >= saved[-1]["version"]
    assert "Resumed the KDC state" in (work / "logs" / "kdc.log").read_text()
    assert [(e["round"], e["participants"]) for e in rounds] == [
        (r, 4) for r in range(1, total + 1)
    ]
    ebscfl = load_manifest(manifest)
    state = kdc_checkpointer(
        open_store(ebscfl.spec.checkpoint, name="e2e", workdir=work),
        ebscfl.spec.checkpoint,
        run="e2e",
        fingerprint=spec_fingerprint(ebscfl),
        key=read_key(work / "keys" / "kdc-state.key"),  # the KDC's own, from the run folder
    ).load_latest()
    assert state is not None and state[1]["protocol"]["open"]["round"] == total
    released = load_file(str(work / "model.safetensors"))
    reference = simulate(ebscfl).weights
    for name, weights in reference.items():
        np.testing.assert_allclose(released[name], weights, rtol=0, atol=1e-5)


def test_example_digits_ebscfl_filters_its_attackers(tmp_path: Path) -> None:
    # Prepare
    example = Path(__file__).resolve().parents[2] / "examples" / "digits-ebscfl.yaml"
    # Execute
    done = fedcore("run", str(example), "--json", "--workdir", str(tmp_path / "work"), cwd=tmp_path)
    # Assert: measured in docs/protocols/ebscfl.md
    assert done.returncode == 0, done.stderr[-4000:]
    summary = last_json(done.stdout)
    assert summary["phase"] == "Succeeded"
    assert summary["accuracy"] > 0.5

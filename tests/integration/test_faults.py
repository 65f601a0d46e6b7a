"""Runs that survive their faults, on real processes: a killed server, a client killed
mid-upload, a killed KDC, and the S3 server down mid-run (a real SeaweedFS)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedcore.checkpoint import (
    Checkpointer,
    S3ObjectStore,
    kdc_checkpointer,
    open_store,
    read_key,
)
from fedcore.errors import RoleFailed, RunAborted
from fedcore.learning.data import dataset_info
from fedcore.learning.models import build_model, get_weights
from fedcore.local.runner import Child, LocalRun
from fedcore.observe.events import read_events
from fedcore.roles._common import spec_fingerprint
from fedcore.simulation import simulate
from fedcore.spec import FederatedRun, load_manifest
from tests.integration._proxy import StallingProxy
from tests.integration._runs import ServerHold, fedcore, kill_and_wait, last_json, write_manifest
from tests.integration._s3 import ACCESS_KEY, SECRET_KEY, S3Server, start_s3

pytestmark = pytest.mark.integration

BUCKET = "fedcore-faults"
TIMEOUTS = {"connectTimeoutSeconds": 120, "roundTimeoutSeconds": 120}


# ------------------------------------------------------------------------------- helpers


def events_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def wait_for(
    run: LocalRun, match: Callable[[dict[str, Any]], bool], timeout: float = 300
) -> dict[str, Any]:
    """Waits for the first server event that ``match`` accepts."""
    deadline = time.monotonic() + timeout
    offset = 0
    while time.monotonic() < deadline:
        found, offset = read_events(run.events_path, offset)
        for event in found:
            if match(event):
                return event
        server = run.children["server"]
        if server.process.poll() is not None:
            raise AssertionError(f"the server exited early:\n{server.tail()}")
        time.sleep(0.05)
    raise AssertionError(f"no matching event within {timeout} s")


def held(round_: int) -> Callable[[dict[str, Any]], bool]:
    """The server's ``held`` event after ``round_`` (``ServerHold``)."""
    return lambda e: e["event"] == "held" and e["round"] == round_


def models_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def kill(child: Child) -> None:
    os.killpg(child.process.pid, signal.SIGKILL)


def weights_bytes(run: FederatedRun) -> int:
    """The size of the run's model weights in bytes (a fedavg upload is exactly these)."""
    shape, classes = dataset_info(run.spec)
    model = build_model(run.spec.model, shape, classes, seed=run.spec.seed)
    return sum(w.nbytes for w in get_weights(model).values())


class ProxiedRun(LocalRun):
    """A local run whose client ``index`` reaches the server through ``proxy``."""

    def __init__(self, *args: Any, proxy: StallingProxy, index: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.proxy = proxy
        self.index = index

    def _spawn(self, name: str, args: list[str], port: int) -> Child:
        if name == f"client-{self.index}":
            at = args.index("--server") + 1
            host, server_port = args[at].rsplit(":", 1)
            self.proxy.target = (host, int(server_port))
            args = [*args[:at], self.proxy.address, *args[at + 1 :]]
        return super()._spawn(name, args, port)


def run_with_client_killed_mid_upload(
    tmp_path: Path, manifest: Path, upload_bytes: int, index: int
) -> tuple[Any, list[dict[str, Any]], str]:
    """Runs ``manifest`` with client ``index`` killed halfway through its second upload."""
    proxy = StallingProxy(stall_after=upload_bytes * 3 // 2)
    work = tmp_path / "work"
    run = ProxiedRun(load_manifest(manifest), manifest, workdir=work, proxy=proxy, index=index)
    run.start()
    try:
        assert proxy.stalled.wait(300), "the proxied client never uploaded twice"
        kill(run.children[f"client-{index}"])
        run.children[f"client-{index}"].process.wait(30)
        proxy.cut()  # what the kernel does to a killed process's connections
        result = run.wait()
    finally:
        run.stop()
        proxy.cut()
    rounds = [e for e in events_of(run.events_path) if e["event"] == "round"]
    return result, rounds, (work / "logs" / "server.log").read_text(encoding="utf-8")


# -------------------------------------------------------------------------- the server


def test_server_killed_mid_round_restarts_resumes_and_ends_with_the_uninterrupted_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: roles exec'd as in pods; a checkpoint after every round; rounds of ten local
    # epochs. The server holds after round 2 (checkpointed) and is killed as it is let go: at
    # the start of round 3 at the latest, never after the last round.
    hold = ServerHold(monkeypatch, tmp_path, 2)
    manifest = write_manifest(
        tmp_path / "run.yaml",
        rounds=5,
        training={
            "batchSize": 16,
            "localEpochs": 10,
            "optimizer": {"kind": "SGD", "learningRate": 0.05},
        },
        checkpoint={"everyRounds": 1},
    )
    work = tmp_path / "work"
    run = LocalRun(load_manifest(manifest), manifest, workdir=work, spawn="exec")
    run.start()
    try:
        wait_for(run, held(2))
        # Execute
        hold.release()
        kill(run.children["server"])
        result = run.wait()
    finally:
        run.stop()
    # Assert
    events = events_of(run.events_path)
    at = next(i for i, e in enumerate(events) if e["event"] == "restarted")
    last_good = max(e["round"] for e in events[:at] if e["event"] == "checkpoint")
    resumed = [e["round"] for e in events[at:] if e["event"] == "resumed"]
    redone = [e["round"] for e in events[at:] if e["event"] == "round"]
    assert result.phase == "Succeeded", result
    assert result.restarts == {"server": 1}
    assert events[at]["role"] == "server" and events[at]["exit_code"] == -signal.SIGKILL
    assert last_good == 2
    assert resumed == [last_good]
    assert redone == list(range(last_good + 1, 6))
    assert (work / "logs" / "server.log.1").exists()
    assert "Resumed from the checkpoint" in (work / "logs" / "server.log").read_text()
    # The simulation is the uninterrupted run bit for bit (test_local_run checks that).
    released = load_file(str(work / "model.safetensors"))
    assert models_equal(released, simulate(load_manifest(manifest)).weights)


def test_server_killed_past_its_restart_budget_fails_the_run_naming_the_server(
    tmp_path: Path,
) -> None:
    # Prepare
    manifest = write_manifest(
        tmp_path / "run.yaml",
        rounds=100,
        checkpoint={"everyRounds": 0},
        failurePolicy={**TIMEOUTS, "serverRestarts": 0},
    )
    run = LocalRun(load_manifest(manifest), manifest, workdir=tmp_path / "work")
    run.start()
    try:
        wait_for(run, lambda e: e["event"] == "round")
        # Execute
        kill(run.children["server"])
        with pytest.raises(RoleFailed) as failed:
            run.wait()
    finally:
        run.stop()
    # Assert
    assert failed.value.role == "server"
    assert failed.value.exit_code == -signal.SIGKILL
    assert run.restarts == {}
    assert all(child.process.poll() is not None for child in run.children.values())


# ---------------------------------------------------------------------------- the clients


def test_client_killed_mid_upload_round_completes_with_the_quorum_under_skip(
    tmp_path: Path,
) -> None:
    # Prepare: fedavg (dropout policy Skip), quorum 2 of 3; uploads of ~600 KB in 64 KiB chunks.
    manifest = write_manifest(
        tmp_path / "run.yaml",
        rounds=4,
        model={"kind": "MLP", "hidden": [2048]},
        clients={"count": 3, "quorum": 2},
        transport={"chunkBytes": 65536},
        checkpoint={"everyRounds": 0},
    )
    upload = weights_bytes(load_manifest(manifest))
    # Execute
    result, rounds, log = run_with_client_killed_mid_upload(tmp_path, manifest, upload, index=2)
    # Assert
    assert result.phase == "Succeeded"
    assert [e["round"] for e in rounds] == [1, 2, 3, 4]
    assert rounds[0]["participants"] == 3
    assert rounds[1]["participants"] == 2 and rounds[1]["failures"] == [2]
    assert rounds[1]["attempts"] == 1
    assert all(e["participants"] == 2 and e["failures"] == [2] for e in rounds[2:])
    assert "Round 2 attempt 1: clients [2] failed (disconnected)." in log


def test_client_killed_mid_upload_round_is_redone_without_it_under_redo(tmp_path: Path) -> None:
    # Prepare: mpdp (dropout policy Redo), 4 clients, quorum 3, noise off. An upload is
    # (outputs + 2) gradients in float64 plus a few scalars.
    manifest = write_manifest(
        tmp_path / "run.yaml",
        protocol={"name": "mpdp", "mpdp": {"mode": "Hardened", "clientNoiseStd": 0}},
        model={"kind": "MLP", "hidden": [32], "bias": False, "dtype": "float64"},
        clients={"count": 4, "quorum": 3},
        rounds=4,
        training={"loss": "MSE", "optimizer": {"kind": "SGD", "learningRate": 0.5}},
        transport={"chunkBytes": 65536},
        checkpoint={"everyRounds": 0},
    )
    run = load_manifest(manifest)
    _, classes = dataset_info(run.spec)
    upload = weights_bytes(run) * (classes + 2)
    # Execute
    result, rounds, log = run_with_client_killed_mid_upload(tmp_path, manifest, upload, index=2)
    # Assert
    assert result.phase == "Succeeded"
    assert [e["round"] for e in rounds] == [1, 2, 3, 4]
    assert rounds[0]["participants"] == 4 and rounds[0]["attempts"] == 1
    assert all(e["participants"] == 3 and e["attempts"] == 2 for e in rounds[1:])
    assert "Round 2 attempt 1: clients [2] failed (disconnected)." in log


# -------------------------------------------------------------------------------- the KDC


def test_kdc_killed_mid_run_restarts_from_its_checkpoint_and_the_run_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: mpdp with its noise off equals fedsgd (Uniform) up to float64 rounding; its
    # keys and the server's perturbation come from the OS's CSPRNG, so no two mpdp runs are
    # equal bit for bit, killed or not: the check is the one an uninterrupted run passes.
    spec = {
        "model": {"kind": "MLP", "hidden": [16], "bias": False, "dtype": "float64"},
        "clients": {"count": 3},
        "rounds": 4,
        "training": {"loss": "MSE", "optimizer": {"kind": "SGD", "learningRate": 0.5}},
        "checkpoint": {"everyRounds": 1},
    }
    manifest = write_manifest(
        tmp_path / "run.yaml",
        protocol={"name": "mpdp", "mpdp": {"mode": "Hardened", "clientNoiseStd": 0}},
        **spec,
    )
    fedsgd = write_manifest(
        tmp_path / "fedsgd.yaml",
        protocol={"name": "fedsgd", "fedsgd": {"weighting": "Uniform"}},
        **spec,
    )
    work = tmp_path / "work"
    hold = ServerHold(monkeypatch, tmp_path, 1)  # the KDC dies between rounds 1 and 2
    run = LocalRun(load_manifest(manifest), manifest, workdir=work)
    run.start()
    try:
        wait_for(run, held(1))
        saved = [e for e in events_of(run.kdc_events_path) if e["event"] == "checkpoint"]
        # Execute
        kill_and_wait(run.children["kdc"])
        hold.release()
        result = run.wait()
    finally:
        run.stop()
    # Assert
    events = events_of(run.events_path)
    kdc_events = events_of(run.kdc_events_path)
    rounds = [e for e in events if e["event"] == "round"]
    resumed = [e for e in kdc_events if e["event"] == "resumed"]
    assert result.phase == "Succeeded" and result.restarts == {"kdc": 1}
    assert [e["role"] for e in events if e["event"] == "restarted"] == ["kdc"]
    assert resumed == [{**resumed[0], "role": "kdc", "version": saved[-1]["version"]}]
    assert "Resumed the KDC state" in (work / "logs" / "kdc.log").read_text()
    assert [(e["round"], e["participants"], e["attempts"]) for e in rounds] == [
        (r, 3, 1) for r in (1, 2, 3, 4)
    ]
    mpdp_run = load_manifest(manifest)
    state = kdc_checkpointer(
        open_store(mpdp_run.spec.checkpoint, name="e2e", workdir=work),
        mpdp_run.spec.checkpoint,
        run="e2e",
        fingerprint=spec_fingerprint(mpdp_run),
        key=read_key(work / "keys" / "kdc-state.key"),  # the KDC's own, from the run folder
    ).load_latest()
    assert state is not None and len(state[1]["protocol"]["public_keys"]) == 3
    released = load_file(str(work / "model.safetensors"))
    reference = simulate(load_manifest(fedsgd)).weights
    assert sorted(released) == sorted(reference)
    for name, weights in reference.items():
        np.testing.assert_allclose(released[name], weights, rtol=0, atol=1e-9)


# --------------------------------------------------------------------------------- S3 down


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_s3(tmp_path_factory.mktemp("s3"))
    server.client().create_bucket(Bucket=BUCKET)  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """The S3 server's credentials in the environment; the server is up again afterwards."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    try:
        yield s3
    finally:
        if s3.process.poll() is not None:
            s3.restart()


def s3_checkpoint(s3: S3Server, prefix: str, retry_seconds: float) -> dict[str, Any]:
    return {
        "everyRounds": 1,
        "keepLast": 3,
        "s3": {
            "bucket": BUCKET,
            "endpoint": s3.endpoint,
            "prefix": prefix,
            "retrySeconds": retry_seconds,
        },
    }


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def s3_checkpointer(s3: S3Server, prefix: str, run: FederatedRun, work: Path) -> Checkpointer:
    """The server's checkpoints of the run in ``work`` (signed with its key there)."""
    store = S3ObjectStore(BUCKET, prefix=prefix, endpoint=s3.endpoint, client=s3.client())
    key = read_key(work / "keys" / "checkpoint.key")
    return Checkpointer(store, run="e2e", fingerprint=spec_fingerprint(run), keep_last=3, key=key)


def resume_to(tmp_path: Path, rounds: int, checkpoint: dict[str, Any], work: Path) -> Path:
    """Resumes the run in ``work`` with ``rounds`` rounds; returns its manifest."""
    manifest = write_manifest(
        tmp_path / f"resume-{rounds}.yaml", rounds=rounds, checkpoint=checkpoint
    )
    done = fedcore(
        "run", str(manifest), "--json", "--quiet", "--resume", "--workdir", str(work), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert last_json(done.stdout)["phase"] == "Succeeded"
    return manifest


def test_s3_down_30_seconds_mid_run_is_ridden_out_counted_and_resume_still_works(
    s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the server holds after round 1 (checkpointed) until S3 is down
    s3 = s3_env
    hold = ServerHold(monkeypatch, tmp_path, 1)
    checkpoint = s3_checkpoint(s3, "{name}/outage", retry_seconds=120)
    manifest = write_manifest(tmp_path / "run.yaml", rounds=8, checkpoint=checkpoint)
    work = tmp_path / "work"
    run = LocalRun(load_manifest(manifest), manifest, workdir=work)
    run.start()
    try:
        wait_for(run, held(1))
        # Execute: down for at least 30 s, and until the server has felt it.
        s3.stop()
        hold.release()
        down = time.monotonic()
        failures = 0.0
        while time.monotonic() - down < 30 or failures < 1:
            assert time.monotonic() - down < 240, "no checkpoint failure while S3 was down"
            failures = metric(run.metrics_ports["server"], "fedcore_checkpoint_failures_total")
            time.sleep(0.5)
        s3.restart()
        result = run.wait()
    finally:
        run.stop()
    # Assert
    events = events_of(run.events_path)
    assert result.phase == "Succeeded" and result.restarts == {}
    assert failures >= 1
    assert sorted(e["round"] for e in events if e["event"] == "checkpoint") == list(range(1, 9))
    checkpointer = s3_checkpointer(s3, "e2e/outage", load_manifest(manifest), work)
    assert checkpointer.rounds() == [6, 7, 8]
    for round_ in checkpointer.rounds():
        checkpointer.load(round_)  # every part passes its checksum
    folders = {key.split("/")[0] for key in checkpointer.store.list("")}
    assert folders == {  # no leftovers
        "latest-round.json",
        "round-00000006",
        "round-00000007",
        "round-00000008",
    }
    released = load_file(str(work / "model.safetensors"))
    assert models_equal(released, simulate(load_manifest(manifest)).weights)
    # ...and a resume from the last checkpoint goes on to the same model as a 9-round run.
    longer = resume_to(tmp_path, 9, checkpoint, work)
    assert [e["round"] for e in events_of(work / "events.jsonl") if e["event"] == "resumed"] == [8]
    assert models_equal(
        load_file(str(work / "model.safetensors")), simulate(load_manifest(longer)).weights
    )


def test_s3_down_past_retry_seconds_fails_the_run_clearly_and_resume_continues(
    s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the server holds after round 1 (checkpointed) until S3 is down
    s3 = s3_env
    hold = ServerHold(monkeypatch, tmp_path, 1)
    checkpoint = s3_checkpoint(s3, "{name}/exhausted", retry_seconds=5)
    manifest = write_manifest(tmp_path / "run.yaml", rounds=6, checkpoint=checkpoint)
    work = tmp_path / "work"
    run = LocalRun(load_manifest(manifest), manifest, workdir=work)
    run.start()
    try:
        wait_for(run, held(1))
        s3.stop()
        hold.release()
        # Execute
        with pytest.raises(RunAborted) as aborted:
            run.wait()
    finally:
        run.stop()
        s3.restart()
    # Assert: the run stopped with a clear reason; the checkpoints before the outage are good.
    message = str(aborted.value)
    attempts = re.search(r"\((\d+) attempts", message)
    assert aborted.value.reason == "CheckpointFailed"
    assert "after retrying for 5 s" in message and "retrySeconds" in message
    assert attempts is not None and int(attempts.group(1)) >= 2
    events = events_of(run.events_path)
    saved = [e["round"] for e in events if e["event"] == "checkpoint"]
    assert events[-1]["event"] == "failed" and events[-1]["round"] == saved[-1] + 1
    checkpointer = s3_checkpointer(s3, "e2e/exhausted", load_manifest(manifest), work)
    # The round being written when S3 went down may have landed whole with its answer lost
    # (the server then counts it as failed, and cannot remove it while S3 is down): it is
    # listed only if complete, and every listed round passes its checksums.
    failed = saved[-1] + 1
    listed = checkpointer.rounds()
    assert listed in (saved[-3:], [*saved, failed][-3:])
    for round_ in listed:
        checkpointer.load(round_)
    # ...and resuming once S3 is back starts from the newest whole checkpoint (the failed
    # round's, where it landed) and ends with the uninterrupted model, bit for bit.
    resume_to(tmp_path, 6, checkpoint, work)
    assert [e["round"] for e in events_of(work / "events.jsonl") if e["event"] == "resumed"] == [
        listed[-1]
    ]
    assert models_equal(
        load_file(str(work / "model.safetensors")), simulate(load_manifest(manifest)).weights
    )

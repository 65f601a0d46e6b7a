"""`fedcore run` end to end: real processes, real mutual-TLS gRPC, real checkpoints."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from safetensors.numpy import load_file

from fedcore.checkpoint import Checkpointer, LocalObjectStore, read_key
from fedcore.errors import RoleFailed, RunAborted
from fedcore.local.runner import LocalRun
from fedcore.simulation import simulate
from fedcore.spec import load_manifest
from fedcore.transport import (
    Limits,
    Payload,
    RemoteError,
    RetryPolicy,
    RpcClient,
    TlsBundle,
    encode_chunks,
    issue_run_bundles,
)
from tests.integration._runs import (
    ServerHold,
    attempts,
    fedcore,
    kill_and_wait,
    last_json,
    write_manifest,
)

pytestmark = pytest.mark.integration


def models_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One uninterrupted 4-round run of 3 clients through the CLI."""
    folder = tmp_path_factory.mktemp("full")
    manifest = write_manifest(folder / "run.yaml")
    done = fedcore("run", str(manifest), "--json", "--workdir", str(folder / "work"), cwd=folder)
    return {"folder": folder, "manifest": manifest, "process": done}


def test_run_three_clients_end_to_end_succeeds_with_json_summary(finished_run: dict) -> None:
    # Prepare
    done = finished_run["process"]
    work = finished_run["folder"] / "work"
    # Execute
    summary = last_json(done.stdout)
    # Assert
    assert done.returncode == 0, done.stderr
    assert summary["phase"] == "Succeeded"
    assert summary["rounds"] == 4
    assert 0.5 < summary["accuracy"] <= 1.0
    assert summary["wall_seconds"] > 0
    events = [json.loads(line) for line in (work / "events.jsonl").read_text().splitlines()]
    rounds = [e for e in events if e["event"] == "round"]
    assert [e["round"] for e in rounds] == [1, 2, 3, 4]
    assert all(e["participants"] == 3 and e["failures"] == [] for e in rounds)
    assert not (work / "logs" / "kdc.log").exists()  # fedavg needs no KDC


def test_run_final_model_equals_single_process_simulation_bit_for_bit(finished_run: dict) -> None:
    # Prepare
    run = load_manifest(finished_run["manifest"])
    # Execute
    simulated = simulate(run)
    released = load_file(str(finished_run["folder"] / "work" / "model.safetensors"))
    # Assert
    assert models_equal(released, simulated.weights)


def test_a_run_short_of_memory_keeps_its_uploads_on_disk_and_equals_the_simulation(
    tmp_path: Path,
) -> None:
    # Prepare: spec.uploads.storage Auto (the default) with 300 MiB planned for the run: the
    # server's 300 MiB and 4 models would not fit, so it keeps every upload in a file and adds
    # the files up at combine (and the clients share one process)
    manifest = write_manifest(tmp_path / "run.yaml", rounds=2, checkpoint={"everyRounds": 0})
    work = tmp_path / "work"
    memory = 300 * 2**20
    # Execute
    run = LocalRun(load_manifest(manifest), manifest, workdir=work, memory_bytes=memory)
    result = run.execute()
    # Assert
    assert result.phase == "Succeeded" and result.rounds_completed == 2
    released = load_file(str(work / "model.safetensors"))
    assert models_equal(released, simulate(load_manifest(manifest)).weights)
    server_log = (work / "logs" / "server.log").read_text()
    assert f"Keeping each round's uploads on disk, in {work}" in server_log
    # the MLP 64-32-10 in float32: (64 * 32 + 32 + 32 * 10 + 10) * 4 bytes
    assert (
        f"(spec.uploads.storage Auto; a model of 9,640 bytes, {memory:,} bytes of memory "
        "available)" in server_log
    )
    assert not list(work.glob("fedcore-fold-*")), "the round's files are removed"


def test_a_server_that_cannot_keep_an_upload_on_disk_stops_the_run_naming_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: uploads on disk, and a server whose files may not pass 200 kB (RLIMIT_FSIZE,
    # set by tests/integration/_file_limit/sitecustomize.py in the exec'd server only), so
    # the first upload of the MLP 64-1024-10 (307 kB) cannot be written whole
    limit = Path(__file__).parent / "_file_limit"
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(limit), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.setenv("FEDCORE_TEST_SERVER_FILE_BYTES", "200000")
    manifest = write_manifest(
        tmp_path / "run.yaml",
        model={"kind": "MLP", "hidden": [1024]},
        uploads={"storage": "Disk"},
        checkpoint={"everyRounds": 0},
    )
    work = tmp_path / "work"
    run = LocalRun(load_manifest(manifest), manifest, workdir=work, spawn="exec")
    # Execute
    with pytest.raises(RunAborted) as stopped:
        run.execute()
    # Assert: a named reason, the server's disk named, no partial upload left behind
    assert stopped.value.reason == "UploadsNotStored", str(stopped.value)
    assert "could not keep client" in str(stopped.value) and str(work) in str(stopped.value)
    assert stopped.value.round == 1
    assert "File too large" in (work / "logs" / "server.log").read_text()
    assert not [path for path in work.rglob("client-*.bin")]


def test_run_writes_checkpoints_every_k_rounds(finished_run: dict) -> None:
    # Prepare
    run = load_manifest(finished_run["manifest"])
    store = LocalObjectStore(finished_run["folder"] / "work" / "checkpoints")
    # Execute
    from fedcore.roles._common import spec_fingerprint

    key = read_key(finished_run["folder"] / "work" / "keys" / "checkpoint.key")
    checkpointer = Checkpointer(
        store, run="e2e", fingerprint=spec_fingerprint(run), keep_last=3, key=key
    )
    rounds = checkpointer.rounds()
    _, state = checkpointer.load_latest() or (None, {})
    # Assert
    assert rounds == [2, 4]
    released = load_file(str(finished_run["folder"] / "work" / "model.safetensors"))
    assert models_equal(state["protocol"]["weights"], released)


def _start_up(events: list[dict]) -> list[str]:
    """The events before the first round, as ``starting:<phase>`` or the event's name."""
    first_round = next(i for i, e in enumerate(events) if e["event"] == "round")
    return [
        f"starting:{e['phase']}" if e["event"] == "starting" else e["event"]
        for e in events[:first_round]
    ]


def test_start_up_phases_are_events_in_order_each_handed_to_the_display_once(
    tmp_path: Path,
) -> None:
    # Prepare
    manifest = write_manifest(tmp_path / "run.yaml", rounds=2, checkpoint={"everyRounds": 0})
    run = LocalRun(load_manifest(manifest), manifest, workdir=tmp_path / "work")
    seen: list[dict] = []
    # Execute
    result = run.execute(on_event=seen.append)
    # Assert
    events = [json.loads(line) for line in run.events_path.read_text().splitlines()]
    assert result.phase == "Succeeded"
    assert seen == events  # the phases as they happened, none twice, none left out
    start_up = _start_up(events)
    connected = [e for e in events if e["event"] == "connected"]
    # The runner's phases in order; the clients start beside the server, so the server's own
    # events (ready, then each client connected, then joined) interleave with them after
    # "starting:server", and the server is ready before any client connects.
    runner = [name for name in start_up if name.startswith("starting:") or name == "attempt"]
    server = [name for name in start_up if name not in runner]
    assert runner == ["attempt", "starting:certificates", "starting:server", "starting:clients"]
    assert server == ["ready", *["connected"] * len(connected), "joined"]
    assert start_up.index("ready") > start_up.index("starting:server")
    assert start_up[-1] == "joined"
    clients_phase = next(e for e in events if e.get("phase") == "clients")
    assert clients_phase["clients"] == 3
    assert {e["client"] for e in connected} == {0, 1, 2}
    assert connected[-1]["connected"] == 3 and connected[-1]["clients"] == 3


def test_run_on_a_terminal_draws_each_start_up_phase_on_stderr_only(tmp_path: Path) -> None:
    # Prepare: rich draws live only on a terminal; TTY_COMPATIBLE=1 says stderr is one.
    manifest = write_manifest(tmp_path / "run.yaml", rounds=2, checkpoint={"everyRounds": 0})
    terminal = {"TTY_COMPATIBLE": "1", "TERM": "xterm", "COLUMNS": "250"}
    # Execute
    done = fedcore(
        "run", str(manifest), "--json", "--workdir", str(tmp_path / "w"), cwd=tmp_path, env=terminal
    )
    # Assert
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.strip().splitlines()  # stdout holds the JSON summary and nothing else
    assert json.loads(line)["phase"] == "Succeeded"
    for phase in (
        "issuing the run's CA and a certificate per role",
        "starting the server (model, held-out data)",
        "starting 3 clients (each loads its data): 0/3 connected",
        "clients connected 3/3 (data loaded)",
        "3 clients joined; the rounds begin",
    ):
        assert phase in done.stderr, phase


def test_resume_from_round_2_checkpoint_ends_with_the_uninterrupted_model(
    finished_run: dict, tmp_path: Path
) -> None:
    # Prepare: the same run stopped after round 2 (its checkpoint), then resumed to round 4.
    work = tmp_path / "work"
    first = fedcore(
        "run",
        str(write_manifest(tmp_path / "two.yaml", rounds=2)),
        "--json",
        "--workdir",
        str(work),
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr
    # Execute
    second = fedcore(
        "run",
        str(write_manifest(tmp_path / "four.yaml", rounds=4)),
        "--json",
        "--resume",
        "--workdir",
        str(work),
        cwd=tmp_path,
    )
    # Assert
    assert second.returncode == 0, second.stderr
    earlier, events = attempts(work / "events.jsonl")  # appended, both attempts kept
    assert any(e["event"] == "resumed" and e["round"] == 2 for e in events)
    assert [e["round"] for e in events if e["event"] == "round"] == [3, 4]
    assert [e["round"] for e in earlier if e["event"] == "round"] == [1, 2]
    resumed = load_file(str(work / "model.safetensors"))
    uninterrupted = load_file(str(finished_run["folder"] / "work" / "model.safetensors"))
    assert models_equal(resumed, uninterrupted)


def wait_for_event(run: LocalRun, kind: str, timeout: float = 180, **match: object) -> dict:
    deadline = time.monotonic() + timeout
    offset = 0
    from fedcore.observe.events import read_events

    while time.monotonic() < deadline:
        events, offset = read_events(run.events_path, offset)
        for event in events:
            if event["event"] == kind and all(event.get(k) == v for k, v in match.items()):
                return event
        server = run.children.get("server")
        if server is not None and server.process.poll() is not None:
            raise AssertionError(f"the server exited early:\n{server.tail()}")
        time.sleep(0.05)
    raise AssertionError(f"no {kind} event within {timeout} s")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def raw_session_call(target: str, bundle: TlsBundle, chunks: list[bytes]) -> grpc.StatusCode:
    """Sends raw chunks on the server's Session method; returns the status it ends with."""
    credentials = grpc.ssl_channel_credentials(bundle.ca_pem, bundle.key_pem, bundle.cert_pem)
    with grpc.secure_channel(
        target, credentials, options=[("grpc.ssl_target_name_override", "server.fedcore.invalid")]
    ) as channel:
        call = channel.stream_stream("/fedcore.v1.Server/Session")(iter(chunks), timeout=60)
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_hostile_peers_are_refused_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the server is held after round 1 while the hostile peers call (and its metrics
    # are read), so that nothing races the end of the run
    hold = ServerHold(monkeypatch, tmp_path, 1)
    manifest = write_manifest(
        tmp_path / "run.yaml",
        rounds=3,
        clients={"count": 2},
        transport={"chunkBytes": 65536, "maxMessageBytes": 1048576},
        checkpoint={"everyRounds": 0},
    )
    run = LocalRun(load_manifest(manifest), manifest, workdir=tmp_path / "work")
    run.start()
    try:
        ready = wait_for_event(run, "ready")
        wait_for_event(run, "held", round=1)
        target = f"127.0.0.1:{ready['port']}"
        pki = tmp_path / "work" / "pki"
        client_1 = TlsBundle.load(pki / "client-1")
        _, foreign = issue_run_bundles("e2e", num_clients=2)
        oversized = list(
            encode_chunks(Payload(tensors={"x": np.zeros(300_000, np.float64)}), chunk_bytes=65536)
        )
        valid = list(encode_chunks(Payload(meta={"kind": "hello"}), chunk_bytes=65536))
        # Execute
        with (
            RpcClient(
                target,
                foreign["client-1"],
                service="Server",
                limits=Limits(),
                retry=RetryPolicy(total_seconds=1),
            ) as intruder,
            pytest.raises(RemoteError) as refused,
        ):
            session = intruder.open_session("Session")
            session.receive()
        garbage = raw_session_call(target, client_1, [b"definitely not a fedcore message"])
        truncated = raw_session_call(target, client_1, [valid[0][: len(valid[0]) // 2]])
        too_big = raw_session_call(target, client_1, oversized[:1])
        huge_chunk = raw_session_call(target, client_1, [b"FCM1" + bytes(200_000)])
        runner_identity = raw_session_call(target, TlsBundle.load(pki / "runner"), valid)
        metrics = scrape(run.metrics_ports["server"])
        hold.release()
        result = run.wait()
    finally:
        run.stop()
    # Assert
    assert refused.value.code == "UNAVAILABLE"
    assert garbage == grpc.StatusCode.INVALID_ARGUMENT
    assert truncated == grpc.StatusCode.INVALID_ARGUMENT
    assert too_big == grpc.StatusCode.INVALID_ARGUMENT
    assert huge_chunk == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert runner_identity == grpc.StatusCode.PERMISSION_DENIED
    assert 'fedcore_rejected_messages_total{reason="malformed",role="server",run="e2e"}' in metrics
    assert result.phase == "Succeeded"
    released = load_file(str(tmp_path / "work" / "model.safetensors"))
    assert models_equal(released, simulate(load_manifest(manifest)).weights)


def test_client_killed_mid_run_is_skipped_under_quorum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the server holds after round 1 until client 3 is dead
    manifest = write_manifest(
        tmp_path / "run.yaml",
        rounds=5,
        clients={"count": 4, "quorum": 3},
        checkpoint={"everyRounds": 0},
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
    events = [
        json.loads(line) for line in (tmp_path / "work" / "events.jsonl").read_text().splitlines()
    ]
    rounds = [e for e in events if e["event"] == "round"]
    assert result.phase == "Succeeded"
    assert [e["round"] for e in rounds] == [1, 2, 3, 4, 5]
    assert [e["participants"] for e in rounds] == [4, 3, 3, 3, 3]
    assert [e["failures"] for e in rounds] == [[], [3], [3], [3], [3]]


def test_quorum_lost_fails_the_run_with_reason_and_stops_every_role(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the server holds after round 1 until client 1 is dead (without the hold, the
    # 5 rounds could end before the kill landed: it happened once in a fresh clone)
    manifest = write_manifest(
        tmp_path / "run.yaml",
        rounds=5,
        clients={"count": 2},
        checkpoint={"everyRounds": 0},
        failurePolicy={"roundTimeoutSeconds": 20, "maxRoundRetries": 1},
    )
    hold = ServerHold(monkeypatch, tmp_path, 1)
    run = LocalRun(load_manifest(manifest), manifest, workdir=tmp_path / "work")
    run.start()
    try:
        wait_for_event(run, "held", round=1)
        # Execute
        kill_and_wait(run.children["client-1"])
        hold.release()
        with pytest.raises(RunAborted) as aborted:
            run.wait()
    finally:
        run.stop()
    # Assert
    assert aborted.value.reason == "QuorumLost" and aborted.value.round == 2
    assert "quorum of 2" in str(aborted.value)
    assert all(child.process.poll() is not None for child in run.children.values())


def test_server_failure_stops_the_run_and_shows_the_servers_error(tmp_path: Path) -> None:
    # Prepare
    manifest = write_manifest(
        tmp_path / "run.yaml", data={"source": {"kind": "NpzFolder", "path": "no-such-folder"}}
    )
    # Execute
    done = fedcore("run", str(manifest), "--json", "--workdir", str(tmp_path / "w"), cwd=tmp_path)
    # Assert
    assert done.returncode == 1
    assert "RoleFailed" in done.stderr
    assert "no-such-folder" in done.stderr
    assert last_json(done.stdout)["phase"] == "Failed"


def test_invalid_manifest_is_refused_before_any_process_starts(tmp_path: Path) -> None:
    # Prepare
    manifest = write_manifest(tmp_path / "run.yaml", clients={"count": 3, "perRound": 7})
    # Execute
    done = fedcore("run", str(manifest), "--workdir", str(tmp_path / "w"), cwd=tmp_path)
    # Assert
    assert done.returncode == 1
    assert "SpecError" in done.stderr
    assert "spec.clients.perRound" in done.stderr
    assert not (tmp_path / "w").exists()


def test_role_failure_error_type_names_the_role() -> None:
    # Prepare / Execute
    error = RoleFailed("server", "boom", exit_code=3)
    # Assert
    assert str(error) == "The server failed: boom"
    assert error.exit_code == 3

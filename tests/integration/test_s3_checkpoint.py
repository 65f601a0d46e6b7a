"""Checkpoints in a real S3 server (SeaweedFS): store, resume, faults, credentials."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedcore.checkpoint import Checkpointer, S3ObjectStore
from fedcore.errors import CheckpointError
from tests.integration._runs import fedcore, last_json, write_manifest
from tests.integration._s3 import ACCESS_KEY, SECRET_KEY, S3Server, start_s3

pytestmark = pytest.mark.integration

BUCKET = "fedcore-ckpt"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_s3(tmp_path_factory.mktemp("s3"))
    server.client().create_bucket(Bucket=BUCKET)  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        server.stop()


def store_for(s3: S3Server, prefix: str, **kwargs: object) -> S3ObjectStore:
    return S3ObjectStore(BUCKET, prefix=prefix, endpoint=s3.endpoint, client=s3.client(), **kwargs)  # type: ignore[arg-type]


def test_s3_store_put_get_list_delete_round_trip(s3: S3Server) -> None:
    # Prepare
    store = store_for(s3, "unit/rt")
    # Execute
    store.put("a/one", b"1")
    store.put("a/two", b"22")
    store.put("b/three", b"333")
    listed = store.list("a/")
    got = store.get("a/two")
    store.delete(["a/one", "missing"])
    # Assert
    assert listed == ["a/one", "a/two"]
    assert got == b"22"
    assert store.list("") == ["a/two", "b/three"]
    with pytest.raises(CheckpointError, match="does not exist"):
        store.get("a/one")


def test_s3_checkpointer_skips_a_corrupted_checkpoint_for_the_previous_good_one(
    s3: S3Server,
) -> None:
    # Prepare
    store = store_for(s3, "unit/corrupt")
    checkpointer = Checkpointer(store, run="r", fingerprint="f", keep_last=5)
    checkpointer.save(1, {"w": np.arange(4.0)})
    checkpointer.save(2, {"w": np.arange(4.0) * 2})
    data = bytearray(store.get("round-00000002/tensors.safetensors"))
    data[-1] ^= 0xFF
    store.put("round-00000002/tensors.safetensors", bytes(data))
    # Execute
    round_, state = checkpointer.load_latest() or (None, {})
    # Assert
    assert round_ == 1
    np.testing.assert_array_equal(state["w"], np.arange(4.0))


def test_s3_checkpointer_refuses_a_foreign_checkpoint(s3: S3Server) -> None:
    # Prepare
    store = store_for(s3, "unit/foreign")
    Checkpointer(store, run="other", fingerprint="f", keep_last=3).save(1, {"x": 1})
    ours = Checkpointer(store, run="mine", fingerprint="f", keep_last=3)
    # Execute / Assert
    assert ours.load_latest() is None
    with pytest.raises(CheckpointError, match="belongs to run 'other'"):
        ours.load(1)


def test_s3_wrong_credentials_fail_at_once_with_a_clear_error(s3: S3Server) -> None:
    # Prepare
    store = S3ObjectStore(
        BUCKET,
        prefix="unit/creds",
        endpoint=s3.endpoint,
        client=s3.client(secret_key="wrong-secret"),
        retry_seconds=60,
    )
    started = time.monotonic()
    # Execute
    with pytest.raises(CheckpointError) as failed:
        store.check()
    # Assert
    assert "SignatureDoesNotMatch" in str(failed.value)
    assert "credentials" in str(failed.value)
    assert time.monotonic() - started < 10  # not retried for a minute


def test_s3_store_rides_out_a_server_outage_with_retries(s3: S3Server) -> None:
    # Prepare
    failures: list[float] = []
    store = store_for(
        s3, "unit/outage", retry_seconds=90, on_failure=lambda: failures.append(time.monotonic())
    )
    store.put("before", b"ok")
    s3.stop()
    restarter = threading.Timer(5.0, s3.restart)
    restarter.start()
    # Execute
    try:
        store.put("during", b"written while the server was down")
        got = store.get("during")
    finally:
        restarter.join()
    # Assert
    assert got == b"written while the server was down"
    assert store.get("before") == b"ok"
    assert len(failures) >= 2


def s3_env(s3: S3Server, *, secret: str = SECRET_KEY) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": secret}


def test_run_checkpoints_to_s3_and_resumes_from_it_to_the_same_model(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    for key, value in s3_env(s3).items():
        monkeypatch.setenv(key, value)
    checkpoint = {
        "everyRounds": 1,
        "s3": {"bucket": BUCKET, "endpoint": s3.endpoint, "prefix": "{name}/e2e"},
    }
    full = fedcore(
        "run",
        str(write_manifest(tmp_path / "full.yaml", rounds=3, checkpoint=checkpoint)),
        "--json",
        "--quiet",
        "--workdir",
        str(tmp_path / "full"),
        cwd=tmp_path,
    )
    assert full.returncode == 0, full.stderr
    keys = sorted(
        o["Key"]
        for o in s3.client().list_objects_v2(  # type: ignore[attr-defined]
            Bucket=BUCKET, Prefix="e2e/e2e/"
        )["Contents"]
    )
    # Execute: a second run under another name stops after round 2, then resumes to round 3.
    resumed_checkpoint = {**checkpoint, "s3": {**checkpoint["s3"], "prefix": "{name}/again"}}
    two = write_manifest(tmp_path / "two.yaml", rounds=2, checkpoint=resumed_checkpoint)
    three = write_manifest(tmp_path / "three.yaml", rounds=3, checkpoint=resumed_checkpoint)
    first = fedcore(
        "run", str(two), "--json", "--quiet", "--workdir", str(tmp_path / "b"), cwd=tmp_path
    )
    second = fedcore(
        "run",
        str(three),
        "--json",
        "--quiet",
        "--resume",
        "--workdir",
        str(tmp_path / "b"),
        cwd=tmp_path,
    )
    # Assert
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert "e2e/e2e/round-00000003/MANIFEST.json" in keys
    events = [
        json.loads(line) for line in (tmp_path / "b" / "events.jsonl").read_text().splitlines()
    ]
    assert any(e["event"] == "resumed" and e["round"] == 2 for e in events)
    a = load_file(str(tmp_path / "full" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_run_with_wrong_s3_credentials_does_not_start(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    for key, value in s3_env(s3, secret="not-the-secret").items():
        monkeypatch.setenv(key, value)
    checkpoint = {"everyRounds": 1, "s3": {"bucket": BUCKET, "endpoint": s3.endpoint}}
    manifest = write_manifest(tmp_path / "run.yaml", rounds=2, checkpoint=checkpoint)
    # Execute
    done = fedcore(
        "run", str(manifest), "--json", "--quiet", "--workdir", str(tmp_path / "w"), cwd=tmp_path
    )
    # Assert
    assert done.returncode == 1
    assert "SignatureDoesNotMatch" in done.stderr
    assert "the run does not start" in done.stderr
    assert last_json(done.stdout)["phase"] == "Failed"


# ------------------------------------------------------ large objects, retention, the CLI

MIB = 2**20


def big_state(mib: int, value: float) -> dict[str, object]:
    return {"weights": {f"w{i}": np.full(MIB // 4, value + i, np.float32) for i in range(mib)}}


def test_s3_large_checkpoint_goes_up_in_parts_and_comes_back_by_ranges(s3: S3Server) -> None:
    # Prepare: 5 MiB parts, three at a time; a 42 MiB state is nine parts and nine ranges.
    store = store_for(s3, "unit/multipart", part_bytes=5 * MIB, threads=3)
    checkpointer = Checkpointer(store, run="r", fingerprint="f", keep_last=2)
    state = big_state(42, 1.0)
    # Execute
    info = checkpointer.save(1, state)
    loaded = checkpointer.load(1)
    head = s3.client().head_object(  # type: ignore[attr-defined]
        Bucket=BUCKET, Key="unit/multipart/round-00000001/tensors.safetensors"
    )
    uploads = s3.client().list_multipart_uploads(Bucket=BUCKET, Prefix="unit/multipart/")  # type: ignore[attr-defined]
    # Assert
    assert info.location == f"s3://{BUCKET}/unit/multipart/round-00000001/"
    assert head["ContentLength"] > 42 * MIB
    assert head["ETag"].strip('"').endswith("-9")  # a multipart object of nine parts
    assert not uploads.get("Uploads")
    for name, array in state["weights"].items():  # type: ignore[attr-defined]
        np.testing.assert_array_equal(loaded["weights"][name], array)


@pytest.mark.parametrize("size", [10, 6 * MIB], ids=["one-range", "two-ranges"])
def test_s3_read_exact_refuses_an_object_of_another_size(s3: S3Server, size: int) -> None:
    # Prepare
    store = store_for(s3, "unit/size", part_bytes=5 * MIB)
    store.put("obj", bytes(size))
    # Execute
    exact = store.read_exact("obj", size)
    with pytest.raises(CheckpointError) as longer:
        store.read_exact("obj", size + 1)
    with pytest.raises(CheckpointError) as shorter:
        store.read_exact("obj", size - 1)
    # Assert
    assert len(exact) == size and not any(exact)
    assert f"has {size} bytes where {size + 1} were written" in str(longer.value)
    assert f"has {size} bytes where {size - 1} were written" in str(shorter.value)


def test_s3_upload_cut_by_an_outage_fails_and_keeps_the_previous_object(s3: S3Server) -> None:
    # Prepare
    failures: list[float] = []
    store = store_for(
        s3,
        "unit/cut",
        part_bytes=5 * MIB,
        threads=2,
        retry_seconds=3,
        on_failure=lambda: failures.append(time.monotonic()),
    )
    old = bytes(range(256)) * (11 * MIB // 256)
    store.put_stream("model", [old])

    def new_bytes() -> Iterator[bytes]:
        yield b"\x01" * (6 * MIB)
        s3.stop()  # the server goes away while the upload is under way
        yield b"\x02" * (6 * MIB)

    # Execute
    try:
        with pytest.raises(CheckpointError) as failed:
            store.put_stream("model", new_bytes())
    finally:
        s3.restart()
    # Assert
    assert "after retrying for 3 s" in str(failed.value)
    assert len(failures) >= 2
    assert store.get("model") == old


def test_s3_retention_keeps_the_last_n_every_keep_every_and_the_marked(s3: S3Server) -> None:
    # Prepare
    store = store_for(s3, "unit/retention")
    checkpointer = Checkpointer(store, run="r", fingerprint="f", keep_last=2, keep_every=3)
    # Execute
    checkpointer.save(1, {"w": np.zeros(2)})
    checkpointer.mark(1, "baseline")
    for round_ in range(2, 8):
        checkpointer.save(round_, {"w": np.full(2, float(round_))})
    # Assert
    assert checkpointer.rounds() == [1, 3, 6, 7]
    assert checkpointer.marked() == [1]
    folders = sorted({key.split("/")[0] for key in store.list("")})
    assert folders == ["round-00000001", "round-00000003", "round-00000006", "round-00000007"]
    assert "round-00000001/KEEP" in store.list("round-00000001/")
    np.testing.assert_array_equal(checkpointer.load(3)["w"], np.full(2, 3.0))


def test_cli_checkpoint_list_mark_and_purge_on_s3(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    from click.testing import CliRunner

    from fedcore.checkpoint import open_store, server_checkpointer
    from fedcore.cli import main
    from fedcore.roles._common import spec_fingerprint
    from fedcore.spec import load_manifest

    for key, value in s3_env(s3).items():
        monkeypatch.setenv(key, value)
    checkpoint = {
        "everyRounds": 1,
        "s3": {"bucket": BUCKET, "endpoint": s3.endpoint, "prefix": "{name}/cli"},
    }
    manifest = write_manifest(tmp_path / "run.yaml", checkpoint=checkpoint)
    run = load_manifest(manifest)
    store = open_store(run.spec.checkpoint, name="e2e", workdir=tmp_path)
    checkpointer = server_checkpointer(
        store, run.spec.checkpoint, run="e2e", fingerprint=spec_fingerprint(run)
    )
    for round_ in (1, 2):
        checkpointer.save(round_, {"w": np.full(3, float(round_))})
    cli = CliRunner()
    # Execute
    marked = cli.invoke(main, ["checkpoint", "mark", str(manifest), "1"])
    listed = cli.invoke(main, ["checkpoint", "list", str(manifest), "--verify", "--json"])
    purged = cli.invoke(main, ["checkpoint", "purge", str(manifest), "--yes"])
    # Assert
    assert marked.exit_code == 0, marked.output
    report = json.loads(listed.output)
    assert report["store"].startswith(f"s3://{BUCKET}/e2e/cli/")
    assert [(e["round"], e["marked"], e["verified"]) for e in report["server"]] == [
        (1, True, True),
        (2, False, True),
    ]
    assert "Deleted 7 objects" in purged.output
    assert store.list("") == []

"""Checkpoints in a real S3 server (SeaweedFS): store, resume, faults, credentials."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedcore.checkpoint import Checkpointer, CheckpointRefused, S3ObjectStore
from fedcore.errors import CheckpointError
from tests.integration._runs import attempts, fedcore, last_json, write_manifest
from tests.integration._s3 import ACCESS_KEY, SECRET_KEY, S3Server, start_s3

pytestmark = pytest.mark.integration

BUCKET = "fedcore-ckpt"
KEY = bytes(range(32))
"""The checkpoint key of these tests' checkpointers (never in the store)."""


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


@pytest.mark.parametrize(
    ("part", "what"),
    [
        ("tensors.safetensors", "its part tensors.safetensors fails its checksum"),
        ("MANIFEST.json", "its manifest tag does not verify: the manifest was tampered with"),
    ],
    ids=["object", "manifest"],
)
def test_s3_tampered_newest_checkpoint_is_refused_by_load_and_resume_naming_it(
    s3: S3Server, part: str, what: str
) -> None:
    # Prepare: the store's own credentials in a plain boto3 client, as any writer of it has.
    prefix = f"unit/tampered-{part.split('.')[0].lower()}"
    checkpointer = Checkpointer(
        store_for(s3, prefix), run="r", fingerprint="f", keep_last=5, key=KEY
    )
    checkpointer.save(1, {"w": np.arange(4.0)})
    checkpointer.save(2, {"w": np.arange(4.0) * 2})
    writer = s3.client()
    key = f"{prefix}/round-00000002/{part}"
    body = writer.get_object(Bucket=BUCKET, Key=key)["Body"].read()  # type: ignore[attr-defined]
    if part == "MANIFEST.json":  # a forged manifest: the sums of forged parts, the old tag
        manifest = json.loads(body)
        manifest["parts"]["tensors.safetensors"]["sha256"] = "0" * 64
        forged = json.dumps(manifest, indent=1).encode()
    else:  # same size, one byte changed
        forged = body[:-1] + bytes([body[-1] ^ 0xFF])
    writer.put_object(Bucket=BUCKET, Key=key, Body=forged)  # type: ignore[attr-defined]
    resumer = Checkpointer(store_for(s3, prefix), run="r", fingerprint="f", keep_last=5, key=KEY)
    # Execute
    with pytest.raises(CheckpointRefused) as loaded:
        resumer.load(2)
    with pytest.raises(CheckpointRefused) as resumed:
        resumer.load_latest()
    older = resumer.load(1)
    # Assert
    assert str(loaded.value).startswith(
        f"The checkpoint of round 2 (s3://{BUCKET}/{prefix}/round-00000002/) is refused: {what}"
    )
    assert resumed.value.round == 2 and what in str(resumed.value)
    assert "an older one is not taken in its place silently" in str(resumed.value)
    assert "The newest older checkpoint that verifies is round 1" in str(resumed.value)
    assert "fedcore checkpoint rollback <manifest> 1 --yes" in str(resumed.value)
    np.testing.assert_array_equal(older["w"], np.arange(4.0))


def test_s3_deleting_the_newest_checkpoint_is_refused_not_rolled_back(s3: S3Server) -> None:
    # Prepare
    prefix = "unit/deleted"
    checkpointer = Checkpointer(
        store_for(s3, prefix), run="r", fingerprint="f", keep_last=5, key=KEY
    )
    for round_ in (1, 2, 3):
        checkpointer.save(round_, {"w": np.full(2, float(round_))})
    writer = s3.client()
    for name in ("MANIFEST.json", "state.json", "tensors.safetensors"):
        writer.delete_object(Bucket=BUCKET, Key=f"{prefix}/round-00000003/{name}")  # type: ignore[attr-defined]
    resumer = Checkpointer(store_for(s3, prefix), run="r", fingerprint="f", keep_last=5, key=KEY)
    # Execute
    with pytest.raises(CheckpointRefused) as resumed:
        resumer.load_latest()
    # Assert
    assert resumer.rounds() == [1, 2]
    assert str(resumed.value).startswith(
        f"The latest record names round 3, but that checkpoint is missing from s3://{BUCKET}/"
        f"{prefix}/"
    )
    assert "The newest older checkpoint that verifies is round 2" in str(resumed.value)


def test_s3_sweep_removes_the_parts_of_an_unpublished_round_and_resume_takes_the_last_whole(
    s3: S3Server,
) -> None:
    # Prepare: round 1 whole; round 2's parts uploaded but never published (the writer died
    # before its manifest)
    prefix = "unit/swept"
    checkpointer = Checkpointer(
        store_for(s3, prefix), run="r", fingerprint="f", keep_last=5, key=KEY
    )
    checkpointer.save(1, {"w": np.full(2, 1.0)})
    writer = s3.client()
    for name in ("state.json", "tensors.safetensors"):
        writer.put_object(Bucket=BUCKET, Key=f"{prefix}/round-00000002/{name}", Body=b"partial")  # type: ignore[attr-defined]
    restarted = Checkpointer(store_for(s3, prefix), run="r", fingerprint="f", keep_last=5, key=KEY)

    # Execute: what a restarted server does before resuming
    swept = restarted.sweep()
    found = restarted.load_latest()

    # Assert
    assert swept == ["round-00000002/state.json", "round-00000002/tensors.safetensors"]
    listed = writer.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/round-00000002/")  # type: ignore[attr-defined]
    assert listed.get("KeyCount", 0) == 0
    assert found is not None and found[0] == 1
    assert np.array_equal(found[1]["w"], np.full(2, 1.0))


def test_s3_checkpointer_refuses_a_foreign_checkpoint(s3: S3Server) -> None:
    # Prepare
    store = store_for(s3, "unit/foreign")
    Checkpointer(store, run="other", fingerprint="f", keep_last=3, key=KEY).save(1, {"x": 1})
    ours = Checkpointer(store, run="mine", fingerprint="f", keep_last=3, key=KEY)
    # Execute / Assert
    with pytest.raises(CheckpointRefused, match="belongs to run 'other'"):
        ours.load_latest()
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
    checkpoint: dict[str, Any] = {
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


def test_resume_refuses_a_newest_checkpoint_tampered_in_s3_until_rolled_back_knowingly(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a run of 2 rounds checkpointing each to S3; then whoever holds the store's
    # credentials replaces round 2's tensors with plain boto3 (the key stays in the run folder).
    for key, value in s3_env(s3).items():
        monkeypatch.setenv(key, value)
    checkpoint = {
        "everyRounds": 1,
        "s3": {"bucket": BUCKET, "endpoint": s3.endpoint, "prefix": "{name}/tampered"},
    }
    work = tmp_path / "w"
    two = write_manifest(tmp_path / "two.yaml", rounds=2, checkpoint=checkpoint)
    three = write_manifest(tmp_path / "three.yaml", rounds=3, checkpoint=checkpoint)
    first = fedcore("run", str(two), "--json", "--quiet", "--workdir", str(work), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    writer = s3.client()
    key = "e2e/tampered/round-00000002/tensors.safetensors"
    body = writer.get_object(Bucket=BUCKET, Key=key)["Body"].read()  # type: ignore[attr-defined]
    writer.put_object(Bucket=BUCKET, Key=key, Body=body[:-4] + b"evil")  # type: ignore[attr-defined]
    resume = ("run", str(three), "--json", "--quiet", "--resume", "--workdir", str(work))
    # Execute
    refused = fedcore(*resume, cwd=tmp_path)
    refused_events = json.dumps(attempts(work / "events.jsonl")[-1])
    dry = fedcore("checkpoint", "rollback", str(three), "1", "--workdir", str(work), cwd=tmp_path)
    rolled = fedcore(
        "checkpoint", "rollback", str(three), "1", "--workdir", str(work), "--yes", cwd=tmp_path
    )
    resumed = fedcore(*resume, cwd=tmp_path)
    # Assert
    assert refused.returncode == 1
    failed = last_json(refused.stdout)
    assert failed["phase"] == "Failed" and failed["reason"] == "CheckpointInvalid"
    assert "\nCheckpointInvalid: The server failed: Cannot resume" in "\n" + refused.stderr
    assert failed["message"].startswith(
        f"The server failed: Cannot resume: The checkpoint of round 2 "
        f"(s3://{BUCKET}/e2e/tampered/round-00000002/) is refused: its part "
        f"tensors.safetensors fails its checksum (sha256)"
    )
    assert "The newest older checkpoint that verifies is round 1" in failed["message"]
    assert '"event": "resumed"' not in refused_events and '"event": "round"' not in refused_events
    assert '"event": "attempt"' in refused_events  # the refused attempt's own events
    assert dry.returncode == 0 and "delete rounds [2]" in dry.stdout, dry.stderr
    assert rolled.returncode == 0, rolled.stderr
    assert "round 1 is now the latest; deleted rounds [2]" in rolled.stdout
    assert resumed.returncode == 0, resumed.stderr
    events = attempts(work / "events.jsonl")[-1]  # the successful resume's own events
    assert [e["round"] for e in events if e["event"] == "resumed"] == [1]
    assert [e["round"] for e in events if e["event"] == "round"] == [2, 3]
    assert len(attempts(work / "events.jsonl")) == 3  # the first run, the refused, the resumed
    log = (work / "logs" / "server.log").read_text()
    assert "Taking the checkpoint of round 1" in log and "the latest record names it" in log
    assert (
        body[-4:].hex() not in log
        and (work / "keys" / "checkpoint.key").read_text()[:64] not in log
    )


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
    checkpointer = Checkpointer(store, run="r", fingerprint="f", keep_last=2, key=KEY)
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
    checkpointer = Checkpointer(store, run="r", fingerprint="f", keep_last=2, keep_every=3, key=KEY)
    # Execute
    checkpointer.save(1, {"w": np.zeros(2)})
    checkpointer.mark(1, "baseline")
    for round_ in range(2, 8):
        checkpointer.save(round_, {"w": np.full(2, float(round_))})
    # Assert
    assert checkpointer.rounds() == [1, 3, 6, 7]
    assert checkpointer.marked() == [1]
    folders = sorted({key.split("/")[0] for key in store.list("")})
    assert folders == [
        "latest-round.json",
        "round-00000001",
        "round-00000003",
        "round-00000006",
        "round-00000007",
    ]
    assert "round-00000001/KEEP" in store.list("round-00000001/")
    np.testing.assert_array_equal(checkpointer.load(3)["w"], np.full(2, 3.0))


def test_cli_checkpoint_list_mark_and_purge_on_s3(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    from click.testing import CliRunner

    from fedcore.checkpoint import ensure_key, open_store, server_checkpointer
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
    signing, _ = ensure_key(tmp_path / "keys" / "checkpoint.key")
    checkpointer = server_checkpointer(
        store, run.spec.checkpoint, run="e2e", fingerprint=spec_fingerprint(run), key=signing
    )
    for round_ in (1, 2):
        checkpointer.save(round_, {"w": np.full(3, float(round_))})
    cli = CliRunner()
    # Execute
    marked = cli.invoke(main, ["checkpoint", "mark", str(manifest), "1"])
    listed = cli.invoke(
        main,
        ["checkpoint", "list", str(manifest), "--workdir", str(tmp_path), "--verify", "--json"],
    )
    purged = cli.invoke(main, ["checkpoint", "purge", str(manifest), "--yes"])
    # Assert
    assert marked.exit_code == 0, marked.output
    report = json.loads(listed.output)
    assert report["store"].startswith(f"s3://{BUCKET}/e2e/cli/")
    assert [(e["round"], e["marked"], e["verified"]) for e in report["server"]] == [
        (1, True, True),
        (2, False, True),
    ]
    assert report["latest"] == {"server": 2}
    assert "Deleted 8 objects" in purged.output
    assert store.list("") == []

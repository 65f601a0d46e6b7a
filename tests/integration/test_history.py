"""A run folder keeps its history across starts, and ``--resume`` never starts over silently:
real processes through the ``fedcore`` command."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedcore.errors import RunAborted
from fedcore.local.runner import LocalRun
from fedcore.simulation import simulate
from fedcore.spec import load_manifest
from tests.integration._runs import ServerHold, fedcore, write_manifest
from tests.integration.test_local_run import wait_for_event

pytestmark = pytest.mark.integration


def _run(tmp_path: Path, manifest: Path, work: Path, *flags: str) -> dict[str, Any]:
    done = fedcore(
        "run", str(manifest), "--json", "--quiet", "--workdir", str(work), *flags, cwd=tmp_path
    )
    return {
        "code": done.returncode,
        "summary": json.loads(done.stdout.strip().splitlines()[-1]),
        "stderr": done.stderr,
    }


def _events(work: Path) -> list[dict[str, Any]]:
    lines = (work / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_a_resumed_run_appends_to_its_events_and_keeps_the_first_attempts_logs(
    tmp_path: Path,
) -> None:
    # Prepare: two rounds to the end, then two more with --resume
    work = tmp_path / "work"
    two = write_manifest(tmp_path / "two.yaml", rounds=2, checkpoint={"everyRounds": 1})
    four = write_manifest(tmp_path / "four.yaml", rounds=4, checkpoint={"everyRounds": 1})
    first = _run(tmp_path, two, work)
    first_server_log = (work / "logs" / "server.log").read_text()

    # Execute
    second = _run(tmp_path, four, work, "--resume")

    # Assert: one file, both attempts, each marked, the first one's rounds still there
    assert first["code"] == second["code"] == 0, second["stderr"]
    events = _events(work)
    attempts = [(e["attempt"], e["resume"]) for e in events if e["event"] == "attempt"]
    assert attempts == [(1, False), (2, True)]
    second_start = next(i for i, e in enumerate(events) if e.get("attempt") == 2)
    rounds = [e["round"] for e in events if e["event"] == "round"]
    assert rounds == [1, 2, 3, 4]
    assert [e["round"] for e in events[:second_start] if e["event"] == "round"] == [1, 2]
    assert any(e["event"] == "resumed" and e["round"] == 2 for e in events[second_start:])
    assert sum(e["event"] == "finished" for e in events) == 2
    # the first attempt's logs moved aside, whole; the new ones are the second attempt's
    kept = work / "logs" / "attempt-1"
    assert (kept / "server.log").read_text() == first_server_log
    assert sorted(p.name for p in kept.iterdir()) == sorted(
        ["server.log", "data-prepare.log", "client-0.log", "client-1.log", "client-2.log"]
    )
    assert "Resumed from the checkpoint of round 2" in (work / "logs" / "server.log").read_text()
    assert second["summary"]["attempt"] == 2
    assert second["summary"]["events"] == str(work / "events.jsonl")
    assert second["summary"]["logs"] == str(work / "logs")


def test_resume_with_no_checkpoint_is_refused_with_one_reason_everywhere(tmp_path: Path) -> None:
    # Prepare
    work = tmp_path / "work"
    manifest = write_manifest(tmp_path / "run.yaml", rounds=2, checkpoint={"everyRounds": 1})

    # Execute
    refused = _run(tmp_path, manifest, work, "--resume")

    # Assert: the console, --json and the server's event give the same reason
    assert refused["code"] == 1
    assert refused["summary"]["phase"] == "Failed"
    assert refused["summary"]["reason"] == "NoCheckpoint"
    lines = refused["stderr"].splitlines()
    assert any(line.startswith("NoCheckpoint: The server failed: There is no") for line in lines)
    assert "--resume-if-possible" in refused["stderr"]
    failed = [e for e in _events(work) if e["event"] == "failed"]
    assert [e["reason"] for e in failed] == ["NoCheckpoint"]
    assert not any(e["event"] == "round" for e in _events(work))


def test_resume_if_possible_starts_at_round_one_when_there_is_no_checkpoint(
    tmp_path: Path,
) -> None:
    # Prepare
    work = tmp_path / "work"
    manifest = write_manifest(tmp_path / "run.yaml", rounds=2, checkpoint={"everyRounds": 1})

    # Execute
    done = _run(tmp_path, manifest, work, "--resume-if-possible")

    # Assert
    assert done["code"] == 0, done["stderr"]
    assert done["summary"]["phase"] == "Succeeded"
    assert [e["round"] for e in _events(work) if e["event"] == "round"] == [1, 2]
    assert "No usable checkpoint" in (work / "logs" / "server.log").read_text()


def _small_disk(folder: Path) -> None:
    """Mounts a 4 MiB tmpfs on ``folder`` (removed by the caller's ``_unmount``)."""
    folder.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(
            f"mounting a tmpfs needs root here ({done.stderr.strip()}); "
            "tests/unit/test_checkpoint_faults.py covers a full disk with an ENOSPC store"
        )


def _unmount(folder: Path) -> None:
    subprocess.run(["umount", str(folder)], capture_output=True, check=False)


def _fill(folder: Path, leave: int) -> Path:
    """Writes a file into ``folder`` until its disk has about ``leave`` bytes free."""
    filler = folder / "filler"
    free = shutil.disk_usage(folder).free
    filler.write_bytes(b"\0" * max(0, free - leave))
    return filler


@pytest.mark.parametrize("policy", ["Skip", "Fail"])
def test_a_checkpoint_disk_short_of_space_skips_or_stops_and_resume_continues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    # Prepare: checkpoints on a small real disk; the server holds after round 2 (two
    # checkpoints written) while the test fills the disk
    disk = tmp_path / "disk"
    _small_disk(disk)
    try:
        manifest = write_manifest(
            tmp_path / "run.yaml",
            rounds=4,
            checkpoint={"everyRounds": 1, "whenShortOfSpace": policy, "local": {"path": str(disk)}},
        )
        work = tmp_path / "work"
        hold = ServerHold(monkeypatch, tmp_path, 2)
        run = LocalRun(load_manifest(manifest), manifest, workdir=work)
        run.start()
        stopped: RunAborted | None = None
        try:
            wait_for_event(run, "held", round=2)
            filler = _fill(disk, leave=256 * 1024)

            # Execute
            hold.release()
            try:
                result = run.wait()
            except RunAborted as exc:
                stopped = exc
        finally:
            run.stop()
        monkeypatch.delenv("FEDCORE_TEST_HOLD_AFTER_ROUND")
        events = _events(work)

        # Assert
        if policy == "Skip":
            assert stopped is None and result.phase == "Succeeded"
            skipped = [e for e in events if e["event"] == "checkpoint_skipped"]
            assert [e["round"] for e in skipped] == [3, 4]
            assert all(e["needed"] > e["free"] for e in skipped)
            assert [e["round"] for e in events if e["event"] == "checkpoint"] == [1, 2]
            return
        assert stopped is not None and stopped.reason == "CheckpointFailed"
        assert "needs about" in str(stopped) and "whenShortOfSpace is Fail" in str(stopped)
        assert [e["round"] for e in events if e["event"] == "round"] == [1, 2, 3]
        # space freed: --resume continues from round 2 to the uninterrupted model
        filler.unlink()
        resumed = LocalRun(load_manifest(manifest), manifest, workdir=work, resume=True).execute()
        assert resumed.phase == "Succeeded"
        assert resumed.attempt == 2
        released = load_file(str(work / "model.safetensors"))
        simulated = simulate(load_manifest(manifest)).weights
        assert sorted(released) == sorted(simulated)
        assert all(np.array_equal(released[k], simulated[k]) for k in released)
    finally:
        _unmount(disk)

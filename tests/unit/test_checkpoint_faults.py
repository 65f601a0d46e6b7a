"""Checkpoints under faults: a writer killed at each step, a full disk, too little free space.

The kills are real: a child process writes a checkpoint and ends itself with ``os._exit`` at
the chosen point (no cleanup runs, as with SIGKILL); this process then resumes from what is on
disk. The full disk is a real local store whose next write fails with ENOSPC part way.
"""

from __future__ import annotations

import errno
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

from fedcore.checkpoint import (
    Checkpointer,
    CheckpointShortOfSpace,
    LocalObjectStore,
)
from fedcore.errors import CheckpointError
from tests.unit.test_checkpoint import KEY, _assert_same_tree, _checkpointer, _state

REPO = Path(__file__).resolve().parents[2]

_WRITER = """
import os, sys
from pathlib import Path
from fedcore.checkpoint import LocalObjectStore
from tests.unit.test_checkpoint import _checkpointer, _state

root, kill = Path(sys.argv[1]), sys.argv[2]


class Dying(LocalObjectStore):
    # dies at the chosen step of round 2's checkpoint; round 1's is written whole

    def put(self, key, data):
        second = key.startswith("round-00000002/")
        if second and kill == "before-data" and key.endswith("state.json"):
            os._exit(9)
        if second and kill == "before-manifest" and key.endswith("MANIFEST.json"):
            os._exit(9)
        super().put(key, data)
        if second and kill == "after-manifest" and key.endswith("MANIFEST.json"):
            os._exit(9)

    def put_stream(self, key, chunks):
        def dying():
            for number, chunk in enumerate(chunks):
                if key.startswith("round-00000002/") and kill == "mid-data" and number == 1:
                    os._exit(9)
                yield chunk
        return super().put_stream(key, dying())


checkpointer = _checkpointer(Dying(root))
checkpointer.save(1, _state(1))
checkpointer.save(2, _state(2))
os._exit(0)
"""


def _write_then_die(root: Path, kill: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _WRITER, str(root), kill], cwd=REPO, capture_output=True, timeout=120
    )
    return done.returncode


def _big_state(seed: int) -> dict[str, np.ndarray]:
    """A state whose tensors stream in several chunks (so a kill can land mid-data)."""
    state = _state(seed)
    state["big"] = np.random.default_rng(seed).standard_normal(3_000_000)
    return state


@pytest.mark.parametrize("kill", ["before-data", "mid-data", "before-manifest", "after-manifest"])
def test_a_writer_killed_at_each_step_leaves_the_last_good_checkpoint_to_resume(
    tmp_path: Path, kill: str
) -> None:
    # Prepare: round 1 written whole, then the writer dies inside round 2
    code = _write_then_die(tmp_path, kill)
    assert code == 9
    checkpointer = _checkpointer(LocalObjectStore(tmp_path))

    # Execute: what a restarted server does: sweep, resume, write the next round
    swept = checkpointer.sweep()
    found = checkpointer.load_latest()
    resumed_round = found[0] if found else None
    checkpointer.save(3, _state(3))

    # Assert
    assert found is not None
    expected = 2 if kill == "after-manifest" else 1
    assert resumed_round == expected
    _assert_same_tree(found[1], _state(expected))
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and p.name.startswith(".")]
    assert leftovers == []  # no temporary file survives the sweep
    assert checkpointer.rounds() == ([1, 2, 3] if kill == "after-manifest" else [1, 3])
    if kill in ("before-data", "after-manifest"):
        assert swept == []
    else:
        assert swept  # the half-written round 2 (or its temporary file) was removed
    assert not (tmp_path / "round-00000002").exists() or kill == "after-manifest"


def test_mid_data_kill_leaves_a_temporary_file_that_only_the_sweep_sees(tmp_path: Path) -> None:
    # Prepare
    assert _write_then_die(tmp_path, "mid-data") == 9
    store = LocalObjectStore(tmp_path)

    # Execute
    temporaries = store.temporaries("round-")
    listed = store.list("round-00000002/")

    # Assert: the listing skips it, as before; the sweep finds it
    assert len(temporaries) == 1 and temporaries[0].startswith("round-00000002/.")
    assert listed == ["round-00000002/state.json"]


class FullDisk(LocalObjectStore):
    """A real local store whose disk fills up part way through the next tensors it writes."""

    def __init__(self, root: Path, free: int = 1 << 40) -> None:
        super().__init__(root)
        self.full = False
        self.free = free

    def free_bytes(self) -> int | None:
        return self.free

    def put_stream(self, key: str, chunks: Iterable[bytes | memoryview]) -> int:
        def filling() -> Iterable[bytes | memoryview]:
            for number, chunk in enumerate(chunks):
                if self.full and number == 1:
                    raise OSError(errno.ENOSPC, "No space left on device")
                yield chunk

        return super().put_stream(key, filling())


def test_a_full_disk_fails_the_checkpoint_plainly_and_removes_its_partial_files(
    tmp_path: Path,
) -> None:
    # Prepare
    store = FullDisk(tmp_path)
    checkpointer = _checkpointer(store)
    checkpointer.save(1, _big_state(1))
    store.full = True

    # Execute
    with pytest.raises(CheckpointError) as caught:
        checkpointer.save(2, _big_state(2))

    # Assert: what happened, how much it needs, what to do; nothing of round 2 left
    message = str(caught.value)
    assert "No space left on device" in message
    assert "The disk is full" in message and "needs about" in message
    assert "`fedcore run --resume` continues from round 1" in message
    assert not (tmp_path / "round-00000002").exists()
    assert [p for p in tmp_path.rglob(".*") if p.is_file()] == []
    # after space is freed, the run resumes from round 1 and writes round 2
    store.full = False
    resumed = _checkpointer(LocalObjectStore(tmp_path))
    found = resumed.load_latest()
    assert found is not None and found[0] == 1
    _assert_same_tree(found[1], _big_state(1))
    resumed.save(2, _big_state(2))
    assert resumed.rounds() == [1, 2]


def test_too_little_free_space_writes_nothing_and_says_how_much_is_needed(
    tmp_path: Path,
) -> None:
    # Prepare
    store = FullDisk(tmp_path, free=100_000)
    checkpointer = _checkpointer(store)

    # Execute
    with pytest.raises(CheckpointShortOfSpace) as caught:
        checkpointer.save(1, _big_state(1))

    # Assert
    assert caught.value.free == 100_000
    assert caught.value.needed > 24_000_000  # the tensors alone: 3,000,000 float64
    assert "needs about" in str(caught.value) and "100,000 free" in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_pruning_removes_a_folder_that_holds_only_a_temporary_file(tmp_path: Path) -> None:
    # Prepare: what a writer killed before its first rename leaves (a dot-file, unlisted)
    checkpointer: Checkpointer = _checkpointer(LocalObjectStore(tmp_path), key=KEY)
    checkpointer.save(1, _state(1))
    stale = tmp_path / "round-00000002" / ".state.json.x1y2z3.tmp"
    stale.parent.mkdir()
    stale.write_bytes(b"")

    # Execute
    checkpointer.save(3, _state(3))

    # Assert
    assert not stale.parent.exists()
    assert checkpointer.rounds() == [1, 3]

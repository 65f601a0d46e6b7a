"""Tests for fedcore.checkpoint: the Checkpointer format over a real LocalObjectStore."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedcore.checkpoint import Checkpointer, LocalObjectStore, join_tensors, split_tensors
from fedcore.errors import CheckpointError

RUN = "digits"
FINGERPRINT = "sha256:0123abcd"


def _state(seed: int) -> dict[str, Any]:
    """A nested state tree with every supported kind of value; ``seed`` makes it distinct."""
    rng = np.random.default_rng(seed)
    return {
        "round": seed,
        "protocol": {
            "kind": "fedavg",
            "version": 1,
            "weights": {
                "layer0/w": rng.standard_normal((3, 4)).astype(np.float32),
                "layer0/b": rng.standard_normal(4),
            },
            "history": [1, 2.5, "three", None, True, [np.arange(5, dtype=np.int64)]],
        },
        "accountant": {"history": [[1.1, 0.01, seed]], "mechanism": "rdp"},
        "rng": {"step": np.array(seed, dtype=np.int64), "scale": np.array(0.5)},
        "transposed": np.arange(6, dtype=np.float64).reshape(2, 3).T * seed,
        "nothing": None,
        "empty": {},
        "loss": 0.125 * seed,
    }


def _assert_same_tree(actual: Any, expected: Any, path: str = "") -> None:
    """Asserts two state trees are equal exactly: same types, shapes, dtypes and values."""
    if isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), path
        assert actual.dtype == expected.dtype, path
        assert actual.shape == expected.shape, path
        np.testing.assert_array_equal(actual, expected, err_msg=path)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), path
        assert set(actual) == set(expected), path
        for key, value in expected.items():
            _assert_same_tree(actual[key], value, f"{path}/{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list), path
        assert len(actual) == len(expected), path
        for index, (left, right) in enumerate(zip(actual, expected, strict=True)):
            _assert_same_tree(left, right, f"{path}/{index}")
    else:
        assert type(actual) is type(expected), path
        assert actual == expected, path


def _checkpointer(store: LocalObjectStore, *, keep_last: int = 5, **kwargs: Any) -> Checkpointer:
    options = {"run": RUN, "fingerprint": FINGERPRINT, **kwargs}
    return Checkpointer(store, keep_last=keep_last, **options)


class FailingManifestStore(LocalObjectStore):
    """A real local store whose manifest writes fail on demand; it also records every read."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fail_manifests = False
        self.reads: list[str] = []

    def put(self, key: str, data: bytes) -> None:
        if self.fail_manifests and key.endswith("MANIFEST.json"):
            raise CheckpointError(f"Cannot write {key}: the disk is full.")
        super().put(key, data)

    def get(self, key: str) -> bytes:
        self.reads.append(key)
        return super().get(key)


def test_checkpointer_save_load_round_trips_nested_state_exactly(tmp_path: Path) -> None:
    # Prepare
    checkpointer = _checkpointer(LocalObjectStore(tmp_path))
    state = _state(3)

    # Execute
    info = checkpointer.save(3, state)
    loaded = checkpointer.load(3)

    # Assert
    _assert_same_tree(loaded, state)
    assert loaded["rng"]["step"].shape == ()
    assert info.round == 3
    assert info.bytes > 0
    assert str(tmp_path) in info.location


def test_checkpointer_load_returns_independent_arrays_writable(tmp_path: Path) -> None:
    # Prepare
    checkpointer = _checkpointer(LocalObjectStore(tmp_path))
    checkpointer.save(1, {"w": np.zeros(3, dtype=np.float32)})

    # Execute
    loaded = checkpointer.load(1)
    loaded["w"][0] = 7.0

    # Assert
    np.testing.assert_array_equal(checkpointer.load(1)["w"], np.zeros(3, dtype=np.float32))


def test_checkpointer_rounds_lists_published_rounds_ascending(tmp_path: Path) -> None:
    # Prepare
    checkpointer = _checkpointer(LocalObjectStore(tmp_path))

    # Execute
    for round in (4, 1, 2):
        checkpointer.save(round, _state(round))

    # Assert
    assert checkpointer.rounds() == [1, 2, 4]


def test_checkpointer_load_latest_returns_newest_round(tmp_path: Path) -> None:
    # Prepare
    checkpointer = _checkpointer(LocalObjectStore(tmp_path))
    for round in (1, 2, 3):
        checkpointer.save(round, _state(round))

    # Execute
    latest = checkpointer.load_latest()

    # Assert
    assert latest is not None
    round, state = latest
    assert round == 3
    _assert_same_tree(state, _state(3))


def test_checkpointer_load_latest_returns_none_when_empty(tmp_path: Path) -> None:
    # Prepare
    checkpointer = _checkpointer(LocalObjectStore(tmp_path / "missing"))

    # Execute
    latest = checkpointer.load_latest()

    # Assert
    assert latest is None
    assert checkpointer.rounds() == []


def test_checkpointer_load_latest_ignores_checkpoint_without_manifest(tmp_path: Path) -> None:
    # Prepare
    store = LocalObjectStore(tmp_path)
    checkpointer = _checkpointer(store)
    checkpointer.save(2, _state(2))
    store.put("round-00000003/state.json", json.dumps({"round": 3}).encode("utf-8"))
    store.put("round-00000003/tensors.safetensors", b"half-written")

    # Execute
    rounds = checkpointer.rounds()
    latest = checkpointer.load_latest()

    # Assert
    assert rounds == [2]
    assert latest is not None
    assert latest[0] == 2
    _assert_same_tree(latest[1], _state(2))


def test_checkpointer_load_refuses_corrupted_part_and_latest_falls_back(tmp_path: Path) -> None:
    # Prepare
    checkpointer = _checkpointer(LocalObjectStore(tmp_path))
    checkpointer.save(1, _state(1))
    checkpointer.save(2, _state(2))
    part = tmp_path / "round-00000002" / "tensors.safetensors"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))

    # Execute
    with pytest.raises(CheckpointError) as excinfo:
        checkpointer.load(2)
    latest = checkpointer.load_latest()

    # Assert
    assert "tensors.safetensors" in str(excinfo.value)
    assert "round 2" in str(excinfo.value)
    assert latest is not None
    assert latest[0] == 1
    _assert_same_tree(latest[1], _state(1))


@pytest.mark.parametrize(
    ("run", "fingerprint"),
    [("other-run", FINGERPRINT), (RUN, "sha256:ffff")],
    ids=["other-run", "other-fingerprint"],
)
def test_checkpointer_load_refuses_foreign_manifest_naming_run(
    tmp_path: Path, run: str, fingerprint: str
) -> None:
    # Prepare
    store = LocalObjectStore(tmp_path)
    _checkpointer(store, run=run, fingerprint=fingerprint).save(1, _state(1))
    checkpointer = _checkpointer(store)

    # Execute
    with pytest.raises(CheckpointError) as excinfo:
        checkpointer.load(1)
    latest = checkpointer.load_latest()

    # Assert
    assert repr(run) in str(excinfo.value)
    assert repr(RUN) in str(excinfo.value)
    assert latest is None


def test_checkpointer_save_prunes_beyond_keep_last(tmp_path: Path) -> None:
    # Prepare
    checkpointer = _checkpointer(LocalObjectStore(tmp_path), keep_last=2)

    # Execute
    for round in (1, 2, 3, 4):
        checkpointer.save(round, _state(round))

    # Assert
    assert checkpointer.rounds() == [3, 4]
    assert not (tmp_path / "round-00000001").exists()
    assert not (tmp_path / "round-00000002").exists()
    assert sorted(path.name for path in (tmp_path / "round-00000004").iterdir()) == [
        "MANIFEST.json",
        "state.json",
        "tensors.safetensors",
    ]
    _assert_same_tree(checkpointer.load(3), _state(3))


def test_checkpointer_save_failing_manifest_keeps_previous_checkpoint(tmp_path: Path) -> None:
    # Prepare
    store = FailingManifestStore(tmp_path)
    checkpointer = _checkpointer(store, keep_last=1)
    checkpointer.save(1, _state(1))
    store.fail_manifests = True

    # Execute
    with pytest.raises(CheckpointError):
        checkpointer.save(2, _state(2))
    store.reads.clear()
    latest = checkpointer.load_latest()

    # Assert
    assert (tmp_path / "round-00000002" / "state.json").exists()
    assert checkpointer.rounds() == [1]
    assert latest is not None
    assert latest[0] == 1
    _assert_same_tree(latest[1], _state(1))
    assert store.reads
    assert all(key.startswith("round-00000001/") for key in store.reads)


@pytest.mark.parametrize("key", ["../escape", "round-1/../../escape", "/etc/passwd", "a/../b"])
def test_local_object_store_refuses_key_outside_root(tmp_path: Path, key: str) -> None:
    # Prepare
    store = LocalObjectStore(tmp_path / "store")

    # Execute
    with pytest.raises(CheckpointError) as put_error:
        store.put(key, b"data")
    with pytest.raises(CheckpointError) as get_error:
        store.get(key)

    # Assert
    assert repr(key) in str(put_error.value)
    assert repr(key) in str(get_error.value)
    assert not (tmp_path / "escape").exists()


def test_local_object_store_put_leaves_no_temp_files(tmp_path: Path) -> None:
    # Prepare
    store = LocalObjectStore(tmp_path)

    # Execute
    store.put("round-00000001/state.json", b"first")
    store.put("round-00000001/state.json", b"second")

    # Assert
    files = sorted(path.relative_to(tmp_path).as_posix() for path in tmp_path.rglob("*"))
    assert files == ["round-00000001", "round-00000001/state.json"]
    assert store.get("round-00000001/state.json") == b"second"
    assert store.list("round-") == ["round-00000001/state.json"]


def test_local_object_store_get_missing_key_raises(tmp_path: Path) -> None:
    # Prepare
    store = LocalObjectStore(tmp_path)

    # Execute
    with pytest.raises(CheckpointError) as excinfo:
        store.get("round-00000009/MANIFEST.json")

    # Assert
    assert "round-00000009" in str(excinfo.value)


def test_split_tensors_refuses_non_json_value_naming_path() -> None:
    # Prepare
    state = {"model": {"tags": {"a", "b"}}}

    # Execute
    with pytest.raises(CheckpointError) as excinfo:
        split_tensors(state)

    # Assert
    assert "model/tags" in str(excinfo.value)
    assert "set" in str(excinfo.value)


def test_split_tensors_join_tensors_round_trip_zero_dim_array() -> None:
    # Prepare
    state = {"step": np.array(7, dtype=np.int64), "items": [np.float64(2.5)]}

    # Execute
    tree, tensors = split_tensors(state)
    joined = join_tensors(tree, tensors)

    # Assert
    assert tensors["step"].shape == ()
    _assert_same_tree(joined, {"step": np.array(7, dtype=np.int64), "items": [2.5]})


def test_checkpointer_save_writes_state_json_without_pickle(tmp_path: Path) -> None:
    # Prepare
    checkpointer = _checkpointer(LocalObjectStore(tmp_path))

    # Execute
    checkpointer.save(1, _state(1))
    raw = (tmp_path / "round-00000001" / "state.json").read_bytes()

    # Assert
    tree = json.loads(raw)
    assert tree["protocol"]["kind"] == "fedavg"
    assert tree["protocol"]["weights"]["layer0/w"] == {"__tensor__": "protocol/weights/layer0/w"}
    assert b"numpy" not in raw
    assert not raw.startswith(b"\x80")

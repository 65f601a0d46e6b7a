"""Tests for fedcore.checkpoint: the Checkpointer format over a real LocalObjectStore."""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcore.checkpoint import (
    CHECKPOINT_KEY_ENV,
    KDC_STATE_KEY_ENV,
    Checkpointer,
    CheckpointKeyError,
    CheckpointRefused,
    LocalObjectStore,
    TensorFile,
    client_checkpoint_key,
    ensure_key,
    join_tensors,
    kdc_state_key,
    read_key,
    read_tensors,
    server_checkpoint_key,
    split_tensors,
)
from fedcore.errors import CheckpointError

RUN = "digits"
FINGERPRINT = "sha256:0123abcd"
KEY = bytes(range(32))
"""The run's checkpoint key in these tests (a key file holds it as 64 hex digits)."""
OTHER_KEY = bytes(range(1, 33))


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
    """A signed checkpointer (``key=None``: the unsigned format of version 1)."""
    options = {"run": RUN, "fingerprint": FINGERPRINT, "key": KEY, **kwargs}
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
    for round in (1, 2, 4):
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


def test_checkpointer_unsigned_load_refuses_corrupted_part_and_latest_falls_back(
    tmp_path: Path,
) -> None:
    # Prepare: the unsigned format (decentralized clients' own checkpoints).
    checkpointer = _checkpointer(LocalObjectStore(tmp_path), key=None)
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
    assert json.loads((tmp_path / "round-00000001" / "MANIFEST.json").read_text())["version"] == 1


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
    with pytest.raises(CheckpointRefused) as excinfo:
        checkpointer.load(1)
    with pytest.raises(CheckpointRefused) as resumed:
        checkpointer.load_latest()

    # Assert
    assert repr(run) in str(excinfo.value)
    assert repr(RUN) in str(excinfo.value)
    assert "latest-round record" in str(resumed.value) and repr(run) in str(resumed.value)


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

    # Assert: the unpublished round's parts are removed with it
    assert not (tmp_path / "round-00000002").exists()
    assert checkpointer.rounds() == [1]
    assert latest is not None
    assert latest[0] == 1
    _assert_same_tree(latest[1], _state(1))
    assert store.reads
    assert all(
        key.startswith("round-00000001/") or key == "latest-round.json" for key in store.reads
    )


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


# ------------------------------------------------------------------ the streamed tensor format


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((3, 4)).astype(np.float32),
        "b": rng.standard_normal(4),
        "step": np.array(7, dtype=np.int64),
        "mask": np.array([True, False, True]),
        "empty": np.zeros(0, dtype=np.int16),
        "big_endian": np.arange(5, dtype=">i4"),
        "transposed": np.arange(6, dtype=np.float64).reshape(2, 3).T,
        "bytes": np.arange(3, dtype=np.uint8),
    }


def test_tensor_file_streams_the_same_bytes_as_the_safetensors_library() -> None:
    # Prepare
    from safetensors.numpy import save as library_save

    tensors = _tensors()
    native = {
        name: np.asarray(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"))).reshape(a.shape)
        for name, a in tensors.items()
    }
    # Execute
    layout = TensorFile.of(tensors)
    streamed = b"".join(bytes(chunk) for chunk in layout.chunks(chunk_bytes=7))
    # Assert
    assert streamed == library_save(native)
    assert len(streamed) == layout.size


def test_tensor_file_writes_the_librarys_file_whole_or_not_at_all(tmp_path: Path) -> None:
    # Prepare
    from safetensors.numpy import save_file as library_save_file

    tensors = {k: v for k, v in _tensors().items() if k != "big_endian"}
    contiguous = {k: np.ascontiguousarray(v).reshape(v.shape) for k, v in tensors.items()}
    library_save_file(contiguous, str(tmp_path / "library.safetensors"))
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"the previous model")
    # Execute
    TensorFile.of(tensors).write(path)
    # Assert
    assert path.read_bytes() == (tmp_path / "library.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["library.safetensors", path.name]


def test_read_tensors_reads_library_files_as_writable_views_of_the_buffer() -> None:
    # Prepare
    from safetensors.numpy import save as library_save

    tensors = {k: v for k, v in _tensors().items() if k != "big_endian"}
    buffer = bytearray(library_save(tensors))
    # Execute
    loaded = read_tensors(buffer, what="the file")
    loaded["w"][0, 0] = 42.0
    # Assert
    assert sorted(loaded) == sorted(tensors)
    for name, array in tensors.items():
        assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape, name
    np.testing.assert_array_equal(loaded["b"], tensors["b"])
    assert np.shares_memory(loaded["w"], np.frombuffer(buffer, dtype=np.uint8))


def _file_with_header(header: dict[str, Any], data: bytes) -> bytearray:
    text = json.dumps(header).encode()
    return bytearray(len(text).to_bytes(8, "little") + text + data)


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12), "no tensor"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), "gap"),
        (
            {
                "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
            },
            bytes(6),
            "overlaps",
        ),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), "fit its"),
        ({"a": {"dtype": "O", "shape": [1], "data_offsets": [0, 8]}}, bytes(8), "unknown dtype"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4), "shape"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, bytes(4), "offsets"),
        ({"a": [1, 2]}, bytes(0), "not an object"),
    ],
    ids=["trailing", "gap", "overlap", "size", "dtype", "shape", "offsets", "entry"],
)
def test_read_tensors_refuses_malformed_files_naming_the_problem(
    header: dict[str, Any], data: bytes, message: str
) -> None:
    # Prepare
    buffer = _file_with_header(header, data)
    # Execute
    with pytest.raises(CheckpointError) as refused:
        read_tensors(buffer, what="The file x")
    # Assert
    assert message in str(refused.value)
    assert "The file x" in str(refused.value)


@pytest.mark.parametrize(
    "buffer",
    [
        bytearray(b"\x01\x02"),
        bytearray((100).to_bytes(8, "little") + b"{}"),
        bytearray((2).to_bytes(8, "little") + b"[]"),
    ],
    ids=["short", "header-too-long", "header-not-object"],
)
def test_read_tensors_refuses_truncated_or_odd_headers(buffer: bytearray) -> None:
    # Execute / Assert
    with pytest.raises(CheckpointError):
        read_tensors(buffer, what="f")


def test_tensor_file_refuses_a_dtype_safetensors_cannot_hold_naming_it() -> None:
    # Execute
    with pytest.raises(CheckpointError) as refused:
        TensorFile.of({"z": np.zeros(2, dtype=np.complex128)})
    # Assert
    assert "'z'" in str(refused.value) and "complex128" in str(refused.value)


def test_checkpointer_load_refuses_a_part_of_another_size_and_resume_names_it(
    tmp_path: Path,
) -> None:
    # Prepare
    checkpointer = _checkpointer(LocalObjectStore(tmp_path))
    checkpointer.save(1, _state(1))
    checkpointer.save(2, _state(2))
    part = tmp_path / "round-00000002" / "tensors.safetensors"
    part.write_bytes(part.read_bytes() + b"extra")
    # Execute
    with pytest.raises(CheckpointRefused) as refused:
        checkpointer.load(2)
    with pytest.raises(CheckpointRefused) as resumed:
        checkpointer.load_latest()
    # Assert
    assert "tensors.safetensors" in str(refused.value) and "round 2" in str(refused.value)
    assert resumed.value.round == 2
    assert "newest older checkpoint that verifies is round 1" in str(resumed.value)


def test_checkpointer_load_refuses_a_manifest_moved_to_another_round(tmp_path: Path) -> None:
    # Prepare: round 1's files copied into round 5's folder.
    store = LocalObjectStore(tmp_path)
    checkpointer = _checkpointer(store)
    checkpointer.save(1, _state(1))
    for name in ("state.json", "tensors.safetensors", "MANIFEST.json"):
        store.put(f"round-00000005/{name}", store.get(f"round-00000001/{name}"))
    # Execute
    with pytest.raises(CheckpointError) as refused:
        checkpointer.load(5)
    # Assert
    assert "says round 1" in str(refused.value)


# ------------------------------------------------------------------------------- retention


def test_checkpointer_keeps_the_last_n_and_every_keep_every_multiple(tmp_path: Path) -> None:
    # Prepare
    checkpointer = _checkpointer(LocalObjectStore(tmp_path), keep_last=2, keep_every=3)
    # Execute
    for round in range(1, 8):
        checkpointer.save(round, {"w": np.full(2, float(round))})
    # Assert
    assert checkpointer.rounds() == [3, 6, 7]
    np.testing.assert_array_equal(checkpointer.load(3)["w"], np.full(2, 3.0))


def test_checkpointer_marked_checkpoint_survives_pruning_until_unmarked(tmp_path: Path) -> None:
    # Prepare
    checkpointer = _checkpointer(LocalObjectStore(tmp_path), keep_last=2)
    checkpointer.save(1, {"w": np.zeros(1)})
    checkpointer.save(2, {"w": np.ones(1)})
    # Execute
    checkpointer.mark(1, "the baseline")
    for round in (3, 4):
        checkpointer.save(round, {"w": np.ones(1)})
    kept = checkpointer.rounds()
    marked = checkpointer.marked()
    infos = {info.round: info for info in checkpointer.entries()}
    mark = json.loads((tmp_path / "round-00000001" / "KEEP").read_text())
    was = checkpointer.unmark(1)
    checkpointer.save(5, {"w": np.ones(1)})
    # Assert
    assert kept == [1, 3, 4] and marked == [1]
    assert infos[1].marked and not infos[3].marked and infos[1].bytes > 0
    assert mark["note"] == "the baseline"
    assert was is True
    assert checkpointer.rounds() == [4, 5]
    assert not (tmp_path / "round-00000001").exists()


def test_checkpointer_mark_of_a_missing_round_names_the_rounds_there(tmp_path: Path) -> None:
    # Prepare
    checkpointer = _checkpointer(LocalObjectStore(tmp_path))
    checkpointer.save(2, {"w": np.zeros(1)})
    # Execute
    with pytest.raises(CheckpointError) as refused:
        checkpointer.mark(3)
    # Assert
    assert "round 3" in str(refused.value) and "[2]" in str(refused.value)
    assert checkpointer.marked() == []


def test_checkpointer_failed_write_removes_its_partial_files_at_once(tmp_path: Path) -> None:
    # Prepare: round 2's parts are written, then its manifest fails
    store = FailingManifestStore(tmp_path)
    checkpointer = _checkpointer(store, keep_last=5)
    checkpointer.save(1, _state(1))
    store.fail_manifests = True
    # Execute
    with pytest.raises(CheckpointError):
        checkpointer.save(2, _state(2))
    store.fail_manifests = False
    left = (tmp_path / "round-00000002").exists()
    checkpointer.save(3, _state(3))
    # Assert (a writer killed mid-write leaves files instead: tests/unit/test_checkpoint_faults.py)
    assert not left
    assert checkpointer.rounds() == [1, 3]


def test_checkpointer_series_keep_server_and_kdc_checkpoints_apart(tmp_path: Path) -> None:
    # Prepare
    store = LocalObjectStore(tmp_path)
    server = _checkpointer(store, keep_last=1)
    kdc = _checkpointer(store.child("kdc"), keep_last=1, series="version")
    # Execute
    server.save(1, {"w": np.zeros(1)})
    kdc.save(1, {"keys": {"0": "ab"}})
    kdc.save(2, {"keys": {"0": "cd"}})
    server.save(2, {"w": np.ones(1)})
    # Assert
    assert server.rounds() == [2] and kdc.rounds() == [2]
    assert (tmp_path / "kdc" / "version-00000002" / "MANIFEST.json").exists()
    assert kdc.load(2) == {"keys": {"0": "cd"}}


@pytest.mark.parametrize("kwargs", [{"keep_last": 0}, {"keep_every": -1}, {"series": "Round"}])
def test_checkpointer_refuses_bad_retention_or_series(tmp_path: Path, kwargs: Any) -> None:
    # Execute / Assert
    with pytest.raises(ValueError):
        _checkpointer(LocalObjectStore(tmp_path), **kwargs)


def test_checkpointer_save_refuses_nan_outside_tensors_naming_round(tmp_path: Path) -> None:
    # Prepare
    checkpointer = _checkpointer(LocalObjectStore(tmp_path))
    # Execute
    with pytest.raises(CheckpointError) as refused:
        checkpointer.save(4, {"loss": float("nan")})
    # Assert
    assert "round 4" in str(refused.value)
    assert checkpointer.rounds() == []


def test_local_object_store_read_exact_refuses_another_size(tmp_path: Path) -> None:
    # Prepare
    store = LocalObjectStore(tmp_path)
    store.put("a/b", b"12345")
    # Execute
    got = store.read_exact("a/b", 5)
    with pytest.raises(CheckpointError) as refused:
        store.read_exact("a/b", 6)
    # Assert
    assert bytes(got) == b"12345"
    assert "has 5 bytes where 6 were written" in str(refused.value)


# ---------------------------------------------------------------------------------- memory


def _peak_extra_bytes(action: Any) -> tuple[Any, int]:
    """Runs ``action``; returns its result and the process's peak RSS above its RSS before."""

    def status(field: str) -> int:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise AssertionError(field)

    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")  # resets the peak (VmHWM) to the current RSS
    before = status("VmRSS")
    result = action()
    return result, status("VmHWM") - before


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("encrypt", [False, True], ids=["signed", "encrypted"])
def test_checkpointer_streams_a_large_state_with_bounded_extra_memory(
    tmp_path: Path, encrypt: bool
) -> None:
    # Prepare: 256 MB of tensors. The library path (save: whole file in memory; load: the
    # file, a copy of each tensor, then another copy) peaks at 2-3x that; so did encrypting
    # each part whole (and a part past 2 GiB could not be encrypted at all).
    # One tensor is 192 MB: no path may hold a whole tensor apart.
    size = 256 * 2**20
    state = {"weights": {f"layer{i}": np.full(size // 4 // 32, i, np.float32) for i in range(8)}}
    state["weights"]["big"] = np.full(size // 4 * 3 // 4, 9, np.float32)
    checkpointer = _checkpointer(LocalObjectStore(tmp_path), keep_last=1, encrypt=encrypt)
    # Execute
    _, saving = _peak_extra_bytes(lambda: checkpointer.save(1, state))
    loaded, loading = _peak_extra_bytes(lambda: checkpointer.load(1))
    # Assert
    assert saving < 64 * 2**20, saving
    assert loading < size + 64 * 2**20, loading
    for name, array in state["weights"].items():
        np.testing.assert_array_equal(loaded["weights"][name], array)


# ---------------------------------------------------- the S3 store's part bookkeeping (pure)


class PartRecordingS3:
    """A stand-in for boto3's S3 client holding multipart uploads in memory; parts finish out
    of order (each sleeps by its number), as concurrent uploads do."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.parts: dict[int, bytes] = {}
        self.objects: dict[str, bytes] = {}

    def create_multipart_upload(self, **_: Any) -> dict[str, str]:
        return {"UploadId": "upload-1"}

    def upload_part(self, *, PartNumber: int, Body: bytes, **_: Any) -> dict[str, str]:
        import time

        time.sleep(0.02 * ((PartNumber * 7) % 5))
        with self.lock:
            self.parts[PartNumber] = Body
        return {"ETag": f'"etag-{PartNumber}"'}

    def complete_multipart_upload(self, *, Key: str, MultipartUpload: Any, **_: Any) -> None:
        numbers = [part["PartNumber"] for part in MultipartUpload["Parts"]]
        self.objects[Key] = b"".join(self.parts[n] for n in numbers)

    def head_object(self, *, Key: str, **_: Any) -> dict[str, int]:
        return {"ContentLength": len(self.objects[Key])}

    def put_object(self, *, Key: str, Body: bytes, **_: Any) -> None:
        self.objects[Key] = bytes(Body)

    def abort_multipart_upload(self, **_: Any) -> None:
        pass


def test_s3_store_numbers_parts_in_stream_order_whatever_order_they_finish() -> None:
    # Prepare: 13 parts of 5 MiB (the last shorter), 4 in flight; the stream is slow enough
    # that parts finish while the next one is being cut.
    import time

    from fedcore.checkpoint import S3ObjectStore

    client = PartRecordingS3()
    store = S3ObjectStore("b", prefix="p", client=client, part_bytes=5 * 2**20, threads=4)
    data = np.random.default_rng(0).integers(0, 256, 63 * 2**20 + 12345, dtype=np.uint8)

    def chunks() -> Any:
        for start in range(0, data.size, 2**20):
            time.sleep(0.005)
            yield data[start : start + 2**20].tobytes()

    # Execute
    written = store.put_stream("k", chunks())
    # Assert
    assert written == data.size
    assert sorted(client.parts) == list(range(1, 14))
    assert client.objects["p/k"] == data.tobytes()


# ----------------------------------------------------------- signed checkpoints (issue 19)


def _manifest(root: Path, round: int, series: str = "round") -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads(
        (root / f"{series}-{round:08d}" / "MANIFEST.json").read_text(encoding="utf-8")
    )
    return manifest


def _write_manifest(
    root: Path, round: int, manifest: dict[str, Any], series: str = "round"
) -> None:
    path = root / f"{series}-{round:08d}" / "MANIFEST.json"
    path.write_text(json.dumps(manifest, indent=1), encoding="utf-8")


def test_signed_manifest_carries_run_fingerprint_round_sums_and_a_tag(tmp_path: Path) -> None:
    # Prepare
    checkpointer = _checkpointer(LocalObjectStore(tmp_path))
    # Execute
    checkpointer.save(1, _state(1))
    checkpointer.save(2, _state(2))
    first, second = _manifest(tmp_path, 1), _manifest(tmp_path, 2)
    record = json.loads((tmp_path / "latest-round.json").read_text(encoding="utf-8"))
    # Assert
    assert second["version"] == 2 and second["run"] == RUN and second["round"] == 2
    assert second["fingerprint"] == FINGERPRINT and second["series"] == "round"
    assert set(second["parts"]) == {"state.json", "tensors.safetensors"}
    assert len(second["tag"]) == 64 and second["key_id"] == checkpointer.key_id
    assert second["encryption"] is None
    assert first["previous"] is None
    manifest_sha = hashlib.sha256(
        (tmp_path / "round-00000001" / "MANIFEST.json").read_bytes()
    ).hexdigest()
    assert second["previous"] == {"round": 1, "manifest_sha256": manifest_sha}
    assert record["round"] == 2 and len(record["tag"]) == 64
    assert KEY.hex() not in json.dumps([first, second, record])


def test_signed_checkpoint_with_a_replaced_state_object_of_the_same_size_is_refused(
    tmp_path: Path,
) -> None:
    # Prepare: round 2's state.json replaced by bytes of the same length.
    checkpointer = _checkpointer(LocalObjectStore(tmp_path))
    checkpointer.save(1, _state(1))
    checkpointer.save(2, _state(2))
    part = tmp_path / "round-00000002" / "state.json"
    part.write_bytes(part.read_bytes().replace(b'"fedavg"', b'"evilly"'))
    # Execute
    with pytest.raises(CheckpointRefused) as loaded:
        checkpointer.load(2)
    with pytest.raises(CheckpointRefused) as resumed:
        _checkpointer(LocalObjectStore(tmp_path)).load_latest()
    # Assert
    assert loaded.value.round == 2
    assert str(loaded.value) == (
        f"The checkpoint of round 2 ({tmp_path / 'round-00000002'}) is refused: its part "
        f"state.json fails its checksum (sha256): the object was replaced or damaged."
    )
    assert resumed.value.round == 2
    assert "It is the checkpoint to resume from (the latest record names it)" in str(resumed.value)
    assert "The newest older checkpoint that verifies is round 1" in str(resumed.value)


def test_signed_checkpoint_whose_manifest_was_edited_to_match_replaced_parts_is_refused(
    tmp_path: Path,
) -> None:
    # Prepare: the state replaced and the manifest's sum updated to match it, tag kept.
    checkpointer = _checkpointer(LocalObjectStore(tmp_path))
    checkpointer.save(1, _state(1))
    forged = json.dumps({"round": 1, "protocol": "replaced"}).encode()
    (tmp_path / "round-00000001" / "state.json").write_bytes(forged)
    manifest = _manifest(tmp_path, 1)
    manifest["parts"]["state.json"] = {
        "sha256": hashlib.sha256(forged).hexdigest(),
        "bytes": len(forged),
    }
    _write_manifest(tmp_path, 1, manifest)
    # Execute
    with pytest.raises(CheckpointRefused) as loaded:
        checkpointer.load(1)
    # Assert
    assert loaded.value.round == 1
    assert loaded.value.reason == (
        "its manifest tag does not verify: the manifest was tampered with"
    )


def test_signed_checkpointer_refuses_a_manifest_without_its_tag_as_unsigned(
    tmp_path: Path,
) -> None:
    # Prepare
    checkpointer = _checkpointer(LocalObjectStore(tmp_path))
    checkpointer.save(1, _state(1))
    manifest = _manifest(tmp_path, 1)
    del manifest["tag"]
    _write_manifest(tmp_path, 1, manifest)
    # Execute
    with pytest.raises(CheckpointRefused) as loaded:
        checkpointer.load(1)
    # Assert
    assert loaded.value.reason.startswith("it is unsigned")


def test_signed_checkpoint_read_with_another_key_is_refused_naming_both_key_ids(
    tmp_path: Path,
) -> None:
    # Prepare
    writer = _checkpointer(LocalObjectStore(tmp_path))
    writer.save(1, _state(1))
    reader = _checkpointer(LocalObjectStore(tmp_path), key=OTHER_KEY)
    # Execute
    with pytest.raises(CheckpointRefused) as loaded:
        reader.load(1)
    with pytest.raises(CheckpointRefused) as resumed:
        reader.load_latest()
    # Assert
    assert writer.key_id != reader.key_id
    assert loaded.value.reason == (
        f"its manifest tag does not verify: it was written with another key (key id "
        f"{writer.key_id!r}; this role's key is {reader.key_id}) or tampered with"
    )
    assert resumed.value.round is None
    assert "The latest-round record" in str(resumed.value) and "another key" in str(resumed.value)
    assert "No older checkpoint verifies" in str(resumed.value)


def test_deleting_the_newest_checkpoint_is_refused_not_silently_rolled_back(
    tmp_path: Path,
) -> None:
    # Prepare
    store = LocalObjectStore(tmp_path)
    checkpointer = _checkpointer(store)
    for round in (1, 2, 3):
        checkpointer.save(round, _state(round))
    store.delete([f"round-00000003/{name}" for name in ("MANIFEST.json", "state.json")])
    store.delete(["round-00000003/tensors.safetensors"])
    # Execute
    with pytest.raises(CheckpointRefused) as resumed:
        _checkpointer(store).load_latest()
    # Assert
    assert resumed.value.round == 3
    assert resumed.value.reason == "the checkpoint the latest record names is missing"
    assert "The newest older checkpoint that verifies is round 2" in str(resumed.value)
    assert "`fedcore checkpoint rollback <manifest> 2 --yes`" in str(resumed.value)


def test_deleting_the_newest_checkpoint_and_the_latest_record_is_refused(tmp_path: Path) -> None:
    # Prepare
    store = LocalObjectStore(tmp_path)
    checkpointer = _checkpointer(store)
    for round in (1, 2, 3):
        checkpointer.save(round, _state(round))
    store.delete(["latest-round.json", "round-00000003/MANIFEST.json"])
    # Execute
    with pytest.raises(CheckpointRefused) as resumed:
        _checkpointer(store).load_latest()
    # Assert
    assert resumed.value.reason == "the latest record is missing"
    assert "holds checkpoints of rounds [1, 2] but no latest-round record" in str(resumed.value)


def test_an_older_latest_record_put_back_beside_newer_checkpoints_is_refused(
    tmp_path: Path,
) -> None:
    # Prepare: the record of round 1 copied aside, then put back after rounds 2 and 3.
    store = LocalObjectStore(tmp_path)
    checkpointer = _checkpointer(store)
    checkpointer.save(1, _state(1))
    old_record = store.get("latest-round.json")
    checkpointer.save(2, _state(2))
    checkpointer.save(3, _state(3))
    store.put("latest-round.json", old_record)
    # Execute
    with pytest.raises(CheckpointRefused) as resumed:
        _checkpointer(store).load_latest()
    # Assert
    assert resumed.value.round == 3
    assert "is newer than the latest record (round 1) and does not follow it" in str(resumed.value)


def test_a_checkpoint_replaced_by_a_signed_older_copy_of_the_same_round_is_refused(
    tmp_path: Path,
) -> None:
    # Prepare: a run writes round 2, a fresh start writes round 2 again; the first is put back.
    store = LocalObjectStore(tmp_path)
    _checkpointer(store).save(2, _state(2))
    first = {name: store.get(f"round-00000002/{name}") for name in ("MANIFEST.json", "state.json")}
    first["tensors.safetensors"] = store.get("round-00000002/tensors.safetensors")
    _checkpointer(store).save(2, _state(7))
    for name, data in first.items():
        store.put(f"round-00000002/{name}", data)
    # Execute
    loaded = _checkpointer(store).load(2)
    with pytest.raises(CheckpointRefused) as resumed:
        _checkpointer(store).load_latest()
    # Assert
    assert loaded["round"] == 2
    assert resumed.value.reason == "replaced by another checkpoint of the same round"


def test_resume_takes_a_checkpoint_written_just_before_its_record_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: the writer stopped after round 2's manifest, before its record.
    store = LocalObjectStore(tmp_path)
    checkpointer = _checkpointer(store)
    checkpointer.save(1, _state(1))
    record_of_1 = store.get("latest-round.json")
    checkpointer.save(2, _state(2))
    store.put("latest-round.json", record_of_1)
    caplog.set_level("INFO", logger="fedcore.checkpoint._checkpointer")
    # Execute
    latest = _checkpointer(store).load_latest()
    # Assert
    assert latest is not None and latest[0] == 2
    _assert_same_tree(latest[1], _state(2))
    assert "Taking the checkpoint of round 2" in caplog.text
    assert "written right after round 1, which the latest record names" in caplog.text


def test_resume_logs_which_checkpoint_it_takes_and_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare
    checkpointer = _checkpointer(LocalObjectStore(tmp_path))
    checkpointer.save(1, _state(1))
    checkpointer.save(2, _state(2))
    caplog.set_level("INFO", logger="fedcore.checkpoint._checkpointer")
    # Execute
    latest = _checkpointer(LocalObjectStore(tmp_path)).load_latest()
    # Assert
    assert latest is not None and latest[0] == 2
    assert (
        f"Taking the checkpoint of round 2 from folder {tmp_path}: the latest record names it; "
        f"it verifies (tag and checksums)." in caplog.text
    )


def test_rollback_takes_an_older_checkpoint_knowingly_and_resume_then_starts_there(
    tmp_path: Path,
) -> None:
    # Prepare: round 3 tampered.
    store = LocalObjectStore(tmp_path)
    checkpointer = _checkpointer(store)
    for round in (1, 2, 3):
        checkpointer.save(round, _state(round))
    part = tmp_path / "round-00000003" / "state.json"
    part.write_bytes(part.read_bytes() + b" ")
    # Execute
    deleted = _checkpointer(store).rollback(2)
    latest = _checkpointer(store).load_latest()
    resumed = _checkpointer(store)
    resumed.load_latest()
    resumed.save(3, _state(30))
    # Assert
    assert deleted == [3]
    assert latest is not None and latest[0] == 2
    _assert_same_tree(latest[1], _state(2))
    assert _manifest(tmp_path, 3)["previous"]["round"] == 2
    assert resumed.load_latest() is not None


def test_rollback_refuses_a_checkpoint_that_does_not_verify(tmp_path: Path) -> None:
    # Prepare
    store = LocalObjectStore(tmp_path)
    checkpointer = _checkpointer(store)
    checkpointer.save(1, _state(1))
    checkpointer.save(2, _state(2))
    (tmp_path / "round-00000001" / "state.json").write_bytes(b"{}")
    # Execute
    with pytest.raises(CheckpointRefused) as refused:
        checkpointer.rollback(1)
    # Assert
    assert refused.value.round == 1
    assert checkpointer.rounds() == [1, 2]


def test_old_unsigned_checkpoints_are_refused_saying_how_to_adopt_them(tmp_path: Path) -> None:
    # Prepare: checkpoints of a fedcore before signed manifests.
    store = LocalObjectStore(tmp_path)
    old = _checkpointer(store, key=None)
    old.save(1, _state(1))
    old.save(2, _state(2))
    checkpointer = _checkpointer(store)
    # Execute
    with pytest.raises(CheckpointRefused) as refused:
        checkpointer.load_latest()
    with pytest.raises(CheckpointRefused):
        checkpointer.rollback(2)
    deleted = checkpointer.rollback(2, adopt_unsigned=True)
    latest = _checkpointer(store).load_latest()
    # Assert
    assert "are unsigned" in str(refused.value)
    assert "`fedcore checkpoint rollback <manifest> 2 --yes --adopt-unsigned`" in str(refused.value)
    assert deleted == []
    assert latest is not None and latest[0] == 2
    _assert_same_tree(latest[1], _state(2))
    assert _manifest(tmp_path, 2)["version"] == 2


def test_an_unsigned_checkpointer_refuses_a_signed_checkpoint_saying_it_needs_the_key(
    tmp_path: Path,
) -> None:
    # Prepare
    _checkpointer(LocalObjectStore(tmp_path)).save(1, _state(1))
    # Execute
    with pytest.raises(CheckpointError) as refused:
        _checkpointer(LocalObjectStore(tmp_path), key=None).load(1)
    # Assert
    assert str(refused.value) == "The checkpoint of round 1 is signed; reading it needs its key."


def test_a_fresh_run_deletes_the_unmarked_newer_checkpoints_of_an_earlier_one(
    tmp_path: Path,
) -> None:
    # Prepare: an earlier run wrote rounds 1-4 and marked 3.
    store = LocalObjectStore(tmp_path)
    earlier = _checkpointer(store, keep_last=3)
    for round in (1, 2, 3, 4):
        earlier.save(round, _state(round))
    earlier.mark(3)
    # Execute: a run started afresh (no resume) writes round 1.
    _checkpointer(store, keep_last=3).save(1, _state(10))
    rounds = _checkpointer(store).rounds()
    # Assert
    assert rounds == [1, 3]
    with pytest.raises(CheckpointRefused) as resumed:
        _checkpointer(store).load_latest()
    assert "round 3 is newer than the latest record (round 1)" in str(resumed.value)


# ------------------------------------------------------------------- the KDC's encrypted state


def _kdc(store: LocalObjectStore, key: bytes = KEY) -> Checkpointer:
    return _checkpointer(store.child("kdc"), series="version", key=key, encrypt=True)


def test_kdc_state_round_trips_encrypted_and_no_object_holds_its_secret(tmp_path: Path) -> None:
    # Prepare
    secret = "5ec2e7" * 16
    state = {"protocol": {"master": secret, "round": 3}, "noise": np.arange(4.0)}
    store = LocalObjectStore(tmp_path)
    # Execute
    _kdc(store).save(1, state)
    loaded = _kdc(store).load_latest()
    stored = b"".join(path.read_bytes() for path in tmp_path.rglob("*") if path.is_file())
    # Assert
    assert loaded is not None and loaded[0] == 1
    _assert_same_tree(loaded[1], state)
    assert secret.encode() not in stored and b"master" not in stored
    assert np.arange(4.0).tobytes() not in stored
    assert _manifest(tmp_path / "kdc", 1, "version")["encryption"] == "AES-256-GCM-CHUNKS"


@pytest.mark.parametrize("size", [0, 1, 4 << 20, (4 << 20) + 1, (8 << 20) + 5])
def test_encrypted_tensors_go_in_chunks_that_round_trip_any_size(tmp_path: Path, size: int) -> None:
    # Prepare: tensors of 0 bytes, one, exactly a chunk, a chunk and a byte, two and some.
    rng = np.random.default_rng(size)
    state = {"t": rng.integers(0, 256, size, dtype=np.uint8), "round": 2}
    store = LocalObjectStore(tmp_path)
    # Execute
    _kdc(store).save(1, state)
    loaded = _kdc(store).load(1)
    stored = (tmp_path / "kdc" / "version-00000001" / "tensors.safetensors").read_bytes()
    # Assert: equal, and nothing of the tensor in the clear (a 16-byte window of it).
    _assert_same_tree(loaded, state)
    if size >= 16:
        assert state["t"][size // 2 : size // 2 + 16].tobytes() not in stored


def test_encrypted_tensor_chunks_cut_short_swapped_or_moved_are_refused(tmp_path: Path) -> None:
    # Prepare: tensors of two chunks. (In a checkpoint, the signed manifest's sums refuse such
    # a part first; the chunks' own associated data refuse it without them.)
    from fedcore.checkpoint._checkpointer import CHUNK_BYTES, _open_chunks
    from fedcore.checkpoint._keys import SealKey

    seal = SealKey(KEY, encrypt=True)
    store = LocalObjectStore(tmp_path)
    _kdc(store).save(1, {"t": np.arange(CHUNK_BYTES // 8 + 3, dtype=np.float64)})
    stored = (tmp_path / "kdc" / "version-00000001" / "tensors.safetensors").read_bytes()
    associated = _kdc(store)._associated(1, "tensors.safetensors")
    first = CHUNK_BYTES + 28
    whole = bytes(_open_chunks(seal, bytearray(stored), associated, CHUNK_BYTES))
    # Execute / Assert: the chunks open as they are, and fail cut at a chunk's end, swapped,
    # or under another part's associated data.
    assert len(whole) > CHUNK_BYTES
    for data in {
        "cut": stored[:first],
        "swapped": stored[first:] + stored[:first],
        "flipped": stored[:10] + bytes([stored[10] ^ 1]) + stored[11:],
    }.values():
        with pytest.raises(ValueError):
            _open_chunks(seal, bytearray(data), associated, CHUNK_BYTES)
    with pytest.raises(ValueError):
        _open_chunks(seal, bytearray(stored), associated + b"x", CHUNK_BYTES)


def test_an_encrypted_checkpoint_of_the_earlier_whole_part_format_is_still_read(
    tmp_path: Path,
) -> None:
    # Prepare: a KDC checkpoint as written before 2026-11-27: each part one AES-GCM message.
    from fedcore.checkpoint._checkpointer import MANIFEST_DOMAIN, _canonical
    from fedcore.checkpoint._keys import SealKey

    seal = SealKey(KEY, encrypt=True)
    store = LocalObjectStore(tmp_path)
    state = {"protocol": {"master": "ab" * 32}, "noise": np.arange(5.0)}
    _kdc(store).save(1, state)
    folder = tmp_path / "kdc" / "version-00000001"
    checkpointer = _kdc(store)
    tree, tensors = split_tensors(state)
    parts = {
        "state.json": json.dumps(tree).encode(),
        "tensors.safetensors": b"".join(bytes(c) for c in TensorFile.of(tensors).chunks()),
    }
    manifest = _manifest(tmp_path / "kdc", 1, "version")
    manifest.pop("tag")
    for name, data in parts.items():
        sealed = seal.encrypt(data, checkpointer._associated(1, name))
        (folder / name).write_bytes(sealed)
        manifest["parts"][name] = {
            "sha256": hashlib.sha256(sealed).hexdigest(),
            "bytes": len(sealed),
        }
    manifest["encryption"] = "AES-256-GCM"
    manifest["tag"] = seal.tag(MANIFEST_DOMAIN, _canonical(manifest))
    _write_manifest(tmp_path / "kdc", 1, manifest, "version")
    # Execute
    again = _kdc(store).load(1)
    # Assert
    _assert_same_tree(again, state)


def test_kdc_state_with_tampered_ciphertext_is_refused(tmp_path: Path) -> None:
    # Prepare
    store = LocalObjectStore(tmp_path)
    _kdc(store).save(1, {"protocol": {"master": "ab" * 32}})
    part = tmp_path / "kdc" / "version-00000001" / "state.json"
    data = bytearray(part.read_bytes())
    data[20] ^= 0x01
    part.write_bytes(bytes(data))
    # Execute
    with pytest.raises(CheckpointRefused) as resumed:
        _kdc(store).load_latest()
    # Assert
    assert resumed.value.round == 1
    assert "The checkpoint of version 1" in str(resumed.value)
    assert "its part state.json fails its checksum" in str(resumed.value)
    assert "`fedcore checkpoint rollback" not in str(resumed.value)


def test_kdc_state_is_refused_under_another_key(tmp_path: Path) -> None:
    # Prepare
    store = LocalObjectStore(tmp_path)
    _kdc(store).save(1, {"protocol": {"master": "ab" * 32}})
    # Execute
    with pytest.raises(CheckpointRefused) as loaded:
        _kdc(store, OTHER_KEY).load(1)
    # Assert
    assert "written with another key" in loaded.value.reason


def test_seal_key_aead_binds_its_associated_data_and_refuses_changed_ciphertext() -> None:
    # Prepare
    from fedcore.checkpoint._keys import SealKey

    seal = SealKey(KEY, encrypt=True)
    sealed = seal.encrypt(b"the master secret", b"run r, version 1")
    flipped = sealed[:-1] + bytes([sealed[-1] ^ 1])
    # Execute / Assert
    assert seal.decrypt(sealed, b"run r, version 1") == b"the master secret"
    assert sealed[:12] != seal.encrypt(b"the master secret", b"run r, version 1")[:12]
    for data, associated in ((sealed, b"run r, version 2"), (flipped, b"run r, version 1")):
        with pytest.raises(ValueError, match="AES-GCM tag does not verify"):
            seal.decrypt(data, associated)
    with pytest.raises(ValueError, match="AES-GCM tag does not verify"):
        SealKey(OTHER_KEY, encrypt=True).decrypt(sealed, b"run r, version 1")


# ------------------------------------------------------------------------------- key files


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_ensure_key_creates_a_0600_hex_key_in_a_0700_folder_once(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "run" / "keys" / "checkpoint.key"
    # Execute
    key, created = ensure_key(path)
    again, created_again = ensure_key(path)
    # Assert
    assert created is True and created_again is False
    assert len(key) == 32 and again == key
    assert path.read_text() == key.hex() + "\n"
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.key"]


def test_ensure_key_refuses_a_key_file_others_can_read(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "keys" / "checkpoint.key"
    ensure_key(path)
    path.chmod(0o644)
    # Execute
    with pytest.raises(CheckpointKeyError) as refused:
        ensure_key(path)
    # Assert
    assert f"The checkpoint key file {path} can be read or written by other users (mode 0644)" in (
        str(refused.value)
    )


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "holds 0 hex digits, not 64"),
        (b"ab" * 16 + b"\n", "holds 32 hex digits, not 64"),
        (b"ab" * 33, "holds 66 hex digits, not 64"),
        (b"zz" * 32 + b"\n", "holds characters other than hex digits"),
        (b"ab" * 32 + b"\n\n", "holds characters other than hex digits"),
        (bytes(range(32)) * 2, "holds characters other than hex digits"),
    ],
    ids=["empty", "short", "long", "not-hex", "two-newlines", "raw-bytes"],
)
def test_read_key_refuses_a_malformed_key_file_without_quoting_it(
    tmp_path: Path, content: bytes, why: str
) -> None:
    # Prepare
    path = tmp_path / "checkpoint.key"
    path.write_bytes(content)
    # Execute
    with pytest.raises(CheckpointKeyError) as refused:
        read_key(path)
    # Assert
    assert str(refused.value).startswith(f"The checkpoint key file {path} is malformed: it {why}")
    if content.strip():
        assert content.strip()[:8].decode("latin-1") not in str(refused.value)


@pytest.mark.parametrize("ending", [b"", b"\n", b"\r\n"], ids=["bare", "newline", "crlf"])
def test_read_key_reads_64_hex_digits_with_an_optional_newline(
    tmp_path: Path, ending: bytes
) -> None:
    # Prepare
    path = tmp_path / "k"
    path.write_bytes(KEY.hex().upper().encode() + ending)
    # Execute / Assert
    assert read_key(path) == KEY


def test_role_keys_come_from_their_variables_and_a_named_file_is_never_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    server_file = tmp_path / "secret" / "checkpoint.key"
    server_file.parent.mkdir()
    server_file.write_text(KEY.hex() + "\n")
    monkeypatch.setenv(CHECKPOINT_KEY_ENV, str(server_file))
    monkeypatch.setenv(KDC_STATE_KEY_ENV, str(tmp_path / "secret" / "missing.key"))
    # Execute
    server = server_checkpoint_key(tmp_path / "work")
    with pytest.raises(CheckpointKeyError) as missing:
        kdc_state_key(tmp_path / "work")
    # Assert
    assert server == KEY
    assert str(missing.value).startswith(
        f"The KDC state key ({KDC_STATE_KEY_ENV}) file {tmp_path / 'secret' / 'missing.key'} "
        f"cannot be read: No such file or directory"
    )
    assert not (tmp_path / "work").exists()


def test_role_keys_without_variables_are_distinct_files_made_in_the_workdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    monkeypatch.delenv(CHECKPOINT_KEY_ENV, raising=False)
    monkeypatch.delenv(KDC_STATE_KEY_ENV, raising=False)
    # Execute
    server = server_checkpoint_key(tmp_path)
    kdc = kdc_state_key(tmp_path)
    # Assert
    assert server != kdc
    assert read_key(tmp_path / "keys" / "checkpoint.key") == server
    assert read_key(tmp_path / "keys" / "kdc-state.key") == kdc
    assert server_checkpoint_key(tmp_path) == server


def _local_run(example: str, folder: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A ``LocalRun`` of ``examples/<example>`` in ``folder``, started from a shell that names
    a key file of its own (which no role may be handed)."""
    from fedcore.local.runner import LocalRun
    from fedcore.spec import load_manifest

    manifest = Path(__file__).resolve().parents[2] / "examples" / example
    monkeypatch.setenv(CHECKPOINT_KEY_ENV, "/from/the/shell.key")
    return LocalRun(load_manifest(manifest), manifest, workdir=folder, metrics=False)


def test_local_run_gives_server_and_kdc_their_own_key_file_kept_across_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    run = _local_run("digits-mpdp.yaml", tmp_path / "run", monkeypatch)
    # Execute
    run._prepare()
    first = {name: read_key(tmp_path / "run" / "keys" / name) for name in KEY_NAMES}
    run._prepare()  # a resume: same run folder
    second = {name: read_key(tmp_path / "run" / "keys" / name) for name in KEY_NAMES}
    envs = {role: run.role_env(role) for role in ("server", "kdc", "client-0")}
    # Assert
    assert first == second and first["checkpoint.key"] != first["kdc-state.key"]
    assert _mode(tmp_path / "run" / "keys") == 0o700
    assert all(_mode(tmp_path / "run" / "keys" / name) == 0o600 for name in KEY_NAMES)
    keys = (tmp_path / "run" / "keys").absolute()
    assert envs["server"][CHECKPOINT_KEY_ENV] == str(keys / "checkpoint.key")
    assert envs["kdc"][KDC_STATE_KEY_ENV] == str(keys / "kdc-state.key")
    assert KDC_STATE_KEY_ENV not in envs["server"] and CHECKPOINT_KEY_ENV not in envs["kdc"]
    assert not {CHECKPOINT_KEY_ENV, KDC_STATE_KEY_ENV} & set(envs["client-0"])


def test_local_run_gives_each_decentralized_client_its_own_key_file_and_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: lppa's clients keep their own checkpoints.
    run = _local_run("digits-lppa.yaml", tmp_path / "run", monkeypatch)
    count = run.run.spec.clients.count
    # Execute
    run._prepare()
    keys = (tmp_path / "run" / "keys").absolute()
    files = {i: keys / f"client-{i}-checkpoint.key" for i in range(count)}
    first = {i: read_key(path) for i, path in files.items()}
    run._prepare()  # a resume
    envs = {i: run.role_env(f"client-{i}") for i in range(count)}
    # Assert: one key per client, kept, each handed to its own process alone.
    assert {i: read_key(path) for i, path in files.items()} == first
    assert len(set(first.values()) | {read_key(keys / "checkpoint.key")}) == count + 1
    assert all(_mode(path) == 0o600 for path in files.values())
    for i, env in envs.items():
        assert env[CHECKPOINT_KEY_ENV] == str(files[i])
        assert KDC_STATE_KEY_ENV not in env
    assert run.role_env("server")[CHECKPOINT_KEY_ENV] == str(keys / "checkpoint.key")


def test_client_checkpoint_key_is_the_named_file_else_its_own_in_the_workdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    monkeypatch.delenv(CHECKPOINT_KEY_ENV, raising=False)
    # Execute
    two = client_checkpoint_key(tmp_path, 2)
    five = client_checkpoint_key(tmp_path, 5)
    monkeypatch.setenv(CHECKPOINT_KEY_ENV, str(tmp_path / "keys" / "client-5-checkpoint.key"))
    named = client_checkpoint_key(tmp_path, 2)  # a pod's mounted Secret: that file, whatever
    monkeypatch.setenv(CHECKPOINT_KEY_ENV, str(tmp_path / "missing.key"))
    # Assert
    assert two != five
    assert read_key(tmp_path / "keys" / "client-2-checkpoint.key") == two
    assert named == five
    with pytest.raises(CheckpointKeyError, match="checkpoint key of client 2"):
        client_checkpoint_key(tmp_path, 2)  # a named file is never created


KEY_NAMES = ("checkpoint.key", "kdc-state.key")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=12), st.integers(1, 16))
def test_blocks_cut_any_chunking_into_full_blocks_and_one_last(sizes: list[int], size: int) -> None:
    # Prepare: chunks of the given sizes, of distinct bytes.
    from fedcore.checkpoint._checkpointer import _blocks

    data = bytes(i % 251 for i in range(sum(sizes)))
    chunks, at = [], 0
    for n in sizes:
        chunks.append(memoryview(data[at : at + n]))
        at += n
    # Execute
    blocks = list(_blocks(iter(chunks), size))
    # Assert: in order, whole, every block full but the last, and the last one flagged.
    assert [index for index, _, _ in blocks] == list(range(len(blocks)))
    assert b"".join(block for _, block, _ in blocks) == data
    assert [last for _, _, last in blocks] == [False] * (len(blocks) - 1) + [True]
    assert all(len(block) == size for _, block, _ in blocks[:-1])
    assert 0 < len(blocks[-1][1]) <= size or data == b""

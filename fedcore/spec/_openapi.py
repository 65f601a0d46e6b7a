"""The structural OpenAPI v3 schema of the FederatedRun CRD, generated from the pydantic models.

pydantic's JSON Schema (draft 2020-12) is rewritten into the OpenAPI v3.0 subset that a
Kubernetes 1.20 API server accepts as a *structural* schema: every ``$ref`` inlined, no
``title``/``const``/``$defs``, ``Optional`` as ``nullable``, boolean ``exclusiveMinimum``,
no ``additionalProperties: false`` next to ``properties`` (unknown fields: see below),
int-or-string nodes in the one ``anyOf`` shape the server allows, and every default, including
the ones made by ``default_factory``, rendered as JSON. Nothing is written by hand: a model
change shows up here, and a construct this module cannot express raises instead of emitting
a schema the server would refuse.

Unknown fields: the API server prunes a field its schema does not name before any webhook
sees it, so a typo under ``spec`` would vanish on ``kubectl apply`` while ``fedcore validate``
refuses it. ``openapi_schema`` therefore marks the root and every object node under ``spec``
that has properties with ``x-kubernetes-preserve-unknown-fields: true``: the server still
checks and defaults the declared fields, keeps the rest, and the validating webhook (which
parses with these models, extra fields forbidden) refuses them naming the field. ``status``
keeps pruning: the server writes it. ``model_schema`` (docs, messages) carries no such mark.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from fedcore.spec._run import FederatedRun
from fedcore.spec._status import FederatedRunStatus

_OPENAPI_KEYS = (
    "type",
    "description",
    "nullable",
    "default",
    "enum",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "x-kubernetes-int-or-string",
    "anyOf",
    "x-kubernetes-preserve-unknown-fields",
    "required",
    "items",
    "additionalProperties",
    "properties",
)
"""The keys a generated node may carry, in the order they are written; others are refused."""

_INT_OR_STRING_TYPES = {
    "integer": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "string": frozenset({"pattern", "minLength", "maxLength"}),
}
"""Per branch of an int-or-string union, the validations that only constrain that type."""


def openapi_schema() -> dict[str, Any]:
    """Returns the structural OpenAPI v3 schema of a whole FederatedRun object.

    ``metadata`` is ``{"type": "object"}`` (the API server owns it) and ``status`` is the
    declared ``FederatedRunStatus``: the API server prunes any status field it does not name.
    The root and every object node of ``spec`` keep unknown fields, for the webhook to refuse
    by name as ``fedcore validate`` does (a field misplaced beside ``spec`` as much as a typo
    inside it).

    Returns:
        A fresh dict, ready for ``spec.versions[].schema.openAPIV3Schema`` of the CRD.
    """
    schema = copy.deepcopy(model_schema(FederatedRun))
    schema["properties"]["metadata"] = {"type": "object"}
    schema["properties"]["spec"] = _keeping_unknown_fields(schema["properties"]["spec"])
    schema["properties"]["status"] = _without_defaults(model_schema(FederatedRunStatus))
    schema["x-kubernetes-preserve-unknown-fields"] = True
    return _ordered(schema)


def _keeping_unknown_fields(node: dict[str, Any]) -> dict[str, Any]:
    """A copy of a schema where every node with ``properties`` keeps unknown fields.

    The nodes below (properties, list items, map values) are marked too, so a nested typo such
    as ``spec.training.optimizer.lerningRate`` also reaches the webhook. A map
    (``additionalProperties``) keeps its own shape.
    """
    node = dict(node)
    if "properties" in node:
        node["properties"] = {
            name: _keeping_unknown_fields(child) for name, child in node["properties"].items()
        }
        node["x-kubernetes-preserve-unknown-fields"] = True
    if isinstance(node.get("items"), dict):
        node["items"] = _keeping_unknown_fields(node["items"])
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _keeping_unknown_fields(node["additionalProperties"])
    return _ordered(node)


def _without_defaults(node: Any) -> Any:
    """A copy of a schema with every ``default`` removed (status is written, never defaulted)."""
    if isinstance(node, dict):
        return {key: _without_defaults(value) for key, value in node.items() if key != "default"}
    if isinstance(node, list):
        return [_without_defaults(item) for item in node]
    return node


@functools.cache
def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    """Returns the structural schema of ``model``, every nested model inlined.

    Unlike ``openapi_schema`` it keeps ``metadata`` and ``status`` as the models describe
    them; docs/manifest.md is rendered from it. The result is cached: do not mutate it.

    Raises:
        ValueError: if the models use a construct a structural schema cannot express.
    """
    raw = model.model_json_schema(by_alias=True)
    defs = raw.pop("$defs", {})
    return _convert(raw, defs, model, "<root>")


def schema_at(model: type[BaseModel], path: Sequence[str | int]) -> dict[str, Any] | None:
    """Returns the node of ``model_schema(model)`` at a manifest field path.

    Args:
        model: the root model, e.g. ``FederatedRun``.
        path: the keys from the root, e.g. ``["spec", "model", "hidden", 0]``; a list index
            steps into the list's items. Do not mutate the node returned.

    Returns:
        The schema node, or None if the path leaves the schema.
    """
    node: dict[str, Any] | None = model_schema(model)
    for part in path:
        if node is None:
            return None
        if node.get("type") == "array":
            node = node.get("items")
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            node = node.get("properties", {}).get(str(part))
    return node


def describe_bounds(node: dict[str, Any], *, quote: str = "`") -> str:
    """Says in words which values a schema node allows, e.g. ``1 to 10000``.

    Covers enums, numeric bounds, lengths, patterns and item counts; returns "" when the
    node sets none of them. Shared by docs/manifest.md and validation messages.

    Args:
        node: a node of ``model_schema``.
        quote: what encloses enum values and patterns (Markdown backticks by default).
    """
    parts: list[str] = []
    if "enum" in node:
        values = [f"{quote}{value}{quote}" for value in node["enum"]]
        parts.append(values[0] if len(values) == 1 else "one of " + ", ".join(values))
    numeric = _describe_range(
        node.get("minimum"),
        node.get("exclusiveMinimum", False),
        node.get("maximum"),
        node.get("exclusiveMaximum", False),
    )
    length = _describe_range(node.get("minLength"), False, node.get("maxLength"), False)
    items = _describe_range(node.get("minItems"), False, node.get("maxItems"), False)
    if node.get("x-kubernetes-int-or-string"):
        text = f"a count of {numeric}" if numeric else "a count"
        if "pattern" in node:
            text += f", or a percentage matching {quote}{node['pattern']}{quote}"
        parts.append(text)
    else:
        if numeric:
            parts.append(numeric)
        if length:
            parts.append(f"length {length}")
        if "pattern" in node:
            parts.append(f"matching {quote}{node['pattern']}{quote}")
    if items:
        parts.append(f"{items} items")
    item_node = node.get("items")
    if isinstance(item_node, dict) and item_node.get("type") != "object":
        each = describe_bounds(item_node, quote=quote)
        if each:
            parts.append(f"each item {each}")
    return "; ".join(parts)


def _describe_range(low: Any, low_open: bool, high: Any, high_open: bool) -> str:
    low, high = _plain(low), _plain(high)
    if low is not None and high is not None and not low_open and not high_open:
        return f"{low} to {high}"
    words = []
    if low is not None:
        words.append(f"more than {low}" if low_open else f"at least {low}")
    if high is not None:
        words.append(f"less than {high}" if high_open else f"at most {high}")
    return " and ".join(words)


def _plain(number: Any) -> Any:
    """Writes 1e6 as 1000000 rather than 1000000.0."""
    return int(number) if isinstance(number, float) and number.is_integer() else number


# ------------------------------------------------------------------------------ conversion


def _convert(
    node: dict[str, Any], defs: dict[str, Any], model: type[BaseModel] | None, path: str
) -> dict[str, Any]:
    """Rewrites one pydantic JSON Schema node (and its children) into structural OpenAPI."""
    node = _flatten(node, defs, path)
    node.pop("title", None)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if node.get("x-kubernetes-int-or-string"):
        _hoist_int_or_string(node, path)
    for bound in ("Minimum", "Maximum"):
        exclusive = node.get(f"exclusive{bound}")
        if exclusive is not None and not isinstance(exclusive, bool):
            if bound.lower() in node:
                raise ValueError(f"{path}: both {bound.lower()} and exclusive{bound} are set.")
            node[bound.lower()] = exclusive
            node[f"exclusive{bound}"] = True

    extra = node.pop("additionalProperties", None)
    if extra is True:
        node["x-kubernetes-preserve-unknown-fields"] = True
    elif isinstance(extra, dict):
        node["additionalProperties"] = _convert(extra, defs, None, f"{path}.*")

    if "properties" in node:
        fields = _fields_by_alias(model) if model is not None else {}
        properties = {}
        for name, child in node["properties"].items():
            field = fields.get(name)
            child_model = _model_of(field.annotation) if field is not None else None
            converted = _convert(child, defs, child_model, _join(path, name))
            if field is not None:
                _set_default(converted, field)
            properties[name] = _ordered(converted)
        node["properties"] = properties
    if "items" in node:
        node["items"] = _convert(node["items"], defs, model, f"{path}[]")

    unknown = set(node).difference(_OPENAPI_KEYS)
    if unknown:
        raise ValueError(f"{path}: cannot express {sorted(unknown)} in a structural schema.")
    if "type" not in node and not (
        node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
    ):
        raise ValueError(f"{path}: a structural schema needs a type here.")
    return _ordered(node)


def _flatten(node: dict[str, Any], defs: dict[str, Any], path: str) -> dict[str, Any]:
    """Inlines ``$ref`` and turns ``anyOf: [X, null]`` into X with ``nullable: true``.

    Keys beside a ``$ref`` or an ``anyOf`` (the field's description and default) win over
    the referenced model's own (its class docstring).
    """
    node = dict(node)
    while True:
        if "$ref" in node:
            name = node.pop("$ref").rsplit("/", 1)[-1]
            node = {**copy.deepcopy(defs[name]), **node}
        elif "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
            branches = node.pop("anyOf")
            others = [branch for branch in branches if branch != {"type": "null"}]
            if len(others) != 1:
                raise ValueError(f"{path}: a union of {len(others)} types is not structural.")
            if len(others) < len(branches):
                node["nullable"] = True
            node = {**copy.deepcopy(others[0]), **node}
        else:
            return node


def _hoist_int_or_string(node: dict[str, Any], path: str) -> None:
    """Moves each branch's validations up beside the one ``anyOf`` the API server allows.

    Kubernetes accepts ``anyOf: [{type: integer}, {type: string}]`` and nothing more inside
    it; a numeric bound only constrains numbers and a pattern only strings, so hoisting
    keeps the meaning.
    """
    seen = set()
    for branch in node.pop("anyOf", []):
        branch = dict(branch)
        branch.pop("title", None)
        kind = branch.pop("type", None)
        allowed = _INT_OR_STRING_TYPES.get(kind or "")
        if allowed is None or kind in seen or not set(branch) <= allowed:
            raise ValueError(f"{path}: an int-or-string branch may not be {branch!r}.")
        seen.add(kind)
        node.update(branch)
    if seen != set(_INT_OR_STRING_TYPES):
        raise ValueError(f"{path}: an int-or-string node needs an integer and a string branch.")
    node["anyOf"] = [{"type": "integer"}, {"type": "string"}]


def _set_default(node: dict[str, Any], field: FieldInfo) -> None:
    """Sets the field's default as JSON (nested models in full, unset keys left out)."""
    node.pop("default", None)
    if field.is_required():
        return
    value = field.get_default(call_default_factory=True)
    if value is not None:
        node["default"] = to_jsonable_python(value, by_alias=True, exclude_none=True)


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    return {key: node[key] for key in _OPENAPI_KEYS if key in node}


def _fields_by_alias(model: type[BaseModel]) -> dict[str, FieldInfo]:
    return {(field.alias or name): field for name, field in model.model_fields.items()}


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """Returns the model inside an annotation (``X``, ``X | None``, ``list[X]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _join(path: str, name: str) -> str:
    return name if path == "<root>" else f"{path}.{name}"

"""Tests of fedcore.spec._openapi: the CRD schema is structural and says what the models say."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any

import pytest
import yaml
from pydantic import BaseModel, Field, WithJsonSchema
from pydantic_core import to_jsonable_python

from fedcore.spec import FederatedRun, FederatedRunSpec, openapi_schema
from fedcore.spec._openapi import describe_bounds, model_schema, schema_at

FORBIDDEN_KEYS = {"$ref", "$defs", "definitions", "title", "const", "allOf", "oneOf", "not"}
"""Keys pydantic writes that a Kubernetes 1.20 structural schema must not carry."""

INT_OR_STRING_ANY_OF = [{"type": "integer"}, {"type": "string"}]
"""The only anyOf the API server accepts (on an x-kubernetes-int-or-string node)."""


def _nodes(node: dict[str, Any], path: str = "<root>") -> Iterator[tuple[str, dict[str, Any]]]:
    """Yields every schema node (properties, items, additionalProperties), parents first."""
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _nodes(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}.*")


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _fields(
    model: type[BaseModel], node: dict[str, Any], path: str
) -> Iterator[tuple[str, Any, dict[str, Any], dict[str, Any]]]:
    """Yields (path, FieldInfo, parent node, field node) for every field of ``model``, nested."""
    for name, field in model.model_fields.items():
        alias = field.alias or name
        child = node["properties"].get(alias)
        assert child is not None, f"{path}.{alias} is missing from the schema"
        yield f"{path}.{alias}", field, node, child
        nested = _model_of(field.annotation)
        if nested is not None:
            target = child["items"] if child.get("type") == "array" else child
            yield from _fields(nested, target, f"{path}.{alias}")


def test_openapi_schema_is_structural() -> None:
    # Execute
    schema = openapi_schema()

    # Assert
    assert schema["type"] == "object"
    for path, node in _nodes(schema):
        assert not FORBIDDEN_KEYS & set(node), f"{path} carries {FORBIDDEN_KEYS & set(node)}"
        special = node.get("x-kubernetes-int-or-string") or node.get(
            "x-kubernetes-preserve-unknown-fields"
        )
        assert "type" in node or special, f"{path} has no type"
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, f"{path}: anyOf"
            assert node["anyOf"] == INT_OR_STRING_ANY_OF, f"{path}: anyOf carries more than types"
        for bound in ("Minimum", "Maximum"):
            if f"exclusive{bound}" in node:
                assert node[f"exclusive{bound}"] is True, f"{path}: exclusive{bound} not boolean"
                assert bound.lower() in node, f"{path}: exclusive{bound} without {bound.lower()}"
        if "additionalProperties" in node:
            assert isinstance(node["additionalProperties"], dict), path
            assert "properties" not in node, f"{path}: properties and additionalProperties"
        if "nullable" in node:
            assert node["nullable"] is True, path
        if node.get("type") == "object" and "properties" in node:
            assert set(node.get("required", [])) <= set(node["properties"]), path
        if node.get("type") == "array":
            assert isinstance(node.get("items"), dict), f"{path}: array without items"


def test_openapi_schema_root_metadata_and_status() -> None:
    schema = openapi_schema()

    properties = schema["properties"]
    assert set(properties) == {"apiVersion", "kind", "metadata", "spec", "status"}
    assert properties["metadata"] == {"type": "object"}
    status = properties["status"]
    assert status["type"] == "object"
    assert "x-kubernetes-preserve-unknown-fields" not in status  # declared: the rest is pruned
    assert {"phase", "conditions", "observedGeneration", "privacy"} <= set(status["properties"])
    assert "default" not in json.dumps(status)  # status is written, never defaulted
    assert properties["apiVersion"]["type"] == "string"
    assert properties["kind"]["type"] == "string"
    assert "spec" in schema["required"]


def test_openapi_schema_spec_keeps_unknown_fields_for_the_webhook() -> None:
    """The server would prune an undeclared field before the webhook could refuse it."""
    # Prepare
    schema = openapi_schema()
    spec = schema["properties"]["spec"]

    # Execute
    objects = [(path, node) for path, node in _nodes(spec, "spec") if "properties" in node]
    status_marked = [
        path
        for path, node in _nodes(schema["properties"]["status"], "status")
        if node.get("x-kubernetes-preserve-unknown-fields")
    ]

    # Assert
    assert len(objects) > 20
    for path, node in objects:
        assert node.get("x-kubernetes-preserve-unknown-fields") is True, path
    optimizer = spec["properties"]["training"]["properties"]["optimizer"]
    assert optimizer["x-kubernetes-preserve-unknown-fields"] is True
    assert status_marked == []
    assert schema["x-kubernetes-preserve-unknown-fields"] is True  # e.g. labels beside spec
    assert "x-kubernetes-preserve-unknown-fields" not in model_schema(FederatedRunSpec)


def test_openapi_schema_has_every_model_field_with_default() -> None:
    # Prepare
    spec_node = openapi_schema()["properties"]["spec"]
    seen = 0

    # Execute / Assert
    for path, field, parent, node in _fields(FederatedRunSpec, spec_node, "spec"):
        seen += 1
        alias = path.rsplit(".", 1)[-1]
        assert node.get("description", "").startswith(alias), f"{path}: description"
        if field.is_required():
            assert alias in parent.get("required", []), f"{path} should be required"
            assert "default" not in node, path
            continue
        assert alias not in parent.get("required", []), f"{path} should not be required"
        value = field.get_default(call_default_factory=True)
        if value is None:
            assert "default" not in node, f"{path}: unset fields carry no default"
            assert node.get("nullable") is True, f"{path}: Optional should be nullable"
        else:
            expected = to_jsonable_python(value, by_alias=True, exclude_none=True)
            assert node.get("default") == expected, f"{path}: default"
    assert seen > 50


def test_openapi_schema_defaults_are_pruned_and_in_bounds() -> None:
    """The API server refuses a default with unknown keys or values outside the node."""

    def check(value: Any, node: dict[str, Any], path: str) -> None:
        if "enum" in node:
            assert value in node["enum"], path
        if isinstance(value, dict) and "properties" in node:
            assert set(value) <= set(node["properties"]), f"{path}: default has unknown keys"
            for key, item in value.items():
                check(item, node["properties"][key], f"{path}.{key}")
        if isinstance(value, list):
            for item in value:
                check(item, node["items"], f"{path}[]")
        if isinstance(value, int | float) and not isinstance(value, bool):
            if "minimum" in node:
                assert value >= node["minimum"], path
            if "maximum" in node:
                assert value <= node["maximum"], path

    for path, node in _nodes(openapi_schema()):
        if "default" in node:
            check(node["default"], node, path)


def test_openapi_schema_int_or_string_fields() -> None:
    node = openapi_schema()["properties"]["spec"]["properties"]["clients"]["properties"]["perRound"]

    assert node["x-kubernetes-int-or-string"] is True
    assert node["anyOf"] == INT_OR_STRING_ANY_OF
    assert node["minimum"] == 1
    assert node["pattern"] == r"^(100|[1-9][0-9]?)%$"
    assert node["default"] == "100%"
    assert "type" not in node


def test_openapi_schema_exclusive_bounds_are_boolean() -> None:
    data = openapi_schema()["properties"]["spec"]["properties"]["data"]["properties"]

    node = data["testFraction"]

    assert (node["minimum"], node["exclusiveMinimum"]) == (0, True)
    assert (node["maximum"], node["exclusiveMaximum"]) == (1, True)


def test_openapi_schema_optional_fields_are_nullable() -> None:
    spec = openapi_schema()["properties"]["spec"]["properties"]

    privacy = spec["privacy"]
    import_path = spec["model"]["properties"]["importPath"]

    assert privacy["type"] == "object" and privacy["nullable"] is True
    assert "targetDelta" in privacy["properties"]
    assert import_path["type"] == "string" and import_path["nullable"] is True
    assert import_path["pattern"].startswith("^[A-Za-z_]")


def test_openapi_schema_maps_and_lists() -> None:
    role = openapi_schema()["properties"]["spec"]["properties"]["roles"]["properties"]["server"]

    selector = role["properties"]["nodeSelector"]
    tolerations = role["properties"]["tolerations"]

    assert selector == {
        "type": "object",
        "description": selector["description"],
        "default": {},
        "additionalProperties": {"type": "string"},
    }
    assert tolerations["type"] == "array"
    assert tolerations["items"]["type"] == "object"
    assert set(tolerations["items"]["properties"]) == {"key", "operator", "value", "effect"}


def test_openapi_schema_nested_object_default_is_full_dump() -> None:
    spec = openapi_schema()["properties"]["spec"]["properties"]

    model = spec["model"]

    assert model["default"]["hidden"] == [128]
    assert model["default"]["kind"] == "MLP"
    assert "importPath" not in model["default"], "unset keys stay out of defaults"


def test_openapi_schema_is_plain_json_and_fresh() -> None:
    # Prepare
    first = openapi_schema()

    # Execute
    first["properties"]["spec"]["properties"].clear()
    second = openapi_schema()

    # Assert
    assert second["properties"]["spec"]["properties"]
    assert json.loads(json.dumps(second)) == second
    assert yaml.safe_load(yaml.safe_dump(second)) == second


def test_model_schema_refuses_a_non_structural_union() -> None:
    class Loose(BaseModel):
        value: int | str = Field(0, description="value is anything.")

    with pytest.raises(ValueError, match="union of 2 types"):
        model_schema(Loose)


def test_schema_at_follows_properties_items_and_maps() -> None:
    assert schema_at(FederatedRun, ["spec", "model", "hidden", "0"]) == {
        "type": "integer",
        "minimum": 1,
        "maximum": 1_000_000,
    }
    assert schema_at(FederatedRun, ["spec", "roles", "kdc", "nodeSelector", "zone"]) == {
        "type": "string"
    }
    assert schema_at(FederatedRun, ["spec", "nothing", "here"]) is None


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (["spec", "clients", "count"], "1 to 10000"),
        (["spec", "data", "testFraction"], "more than 0 and less than 1"),
        (["spec", "optimizer"], None),
        (["spec", "training", "optimizer", "momentum"], "at least 0 and less than 1"),
        (
            ["spec", "protocol", "name"],
            "one of `fedavg`, `fedsgd`, `dp-fedavg`, `perturb`, `mpdp`, `lppa`, `adaptive`, "
            "`ebscfl`, `secagg`",
        ),
        (["spec", "model", "channels"], "1 to 8 items; each item 1 to 4096"),
        (["spec", "data", "partition", "alpha"], "more than 0 and at most 1000000"),
        (["apiVersion"], "`fedcore.dev/v1alpha1`"),
    ],
)
def test_describe_bounds(path: list[str], expected: str | None) -> None:
    node = schema_at(FederatedRun, path)

    if expected is None:
        assert node is None
    else:
        assert node is not None
        assert describe_bounds(node) == expected


def test_model_schema_refuses_a_type_specific_check_on_the_wrong_branch() -> None:
    weird = {
        "x-kubernetes-int-or-string": True,
        "anyOf": [{"type": "integer", "pattern": "^1$"}, {"type": "string"}],
    }

    class Odd(BaseModel):
        value: Annotated[int | str, WithJsonSchema(weird)] = Field(1, description="value.")

    with pytest.raises(ValueError, match="int-or-string branch"):
        model_schema(Odd)

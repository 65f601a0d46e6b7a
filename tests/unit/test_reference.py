"""Tests of fedcore.spec._reference: docs/manifest.md is generated and never stale."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedcore.spec import PROTOCOL_FACTS, manifest_reference, openapi_schema
from fedcore.spec._reference import REGENERATE_COMMAND, main

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "manifest.md"


def _leaf_paths(node: dict, path: str = "") -> list[str]:
    paths = []
    for name, child in node.get("properties", {}).items():
        child_path = f"{path}.{name}" if path else name
        paths.append(child_path)
        target = child.get("items", child) if child.get("type") == "array" else child
        suffix = "[]" if child.get("type") == "array" else ""
        paths += _leaf_paths(target, child_path + suffix)
    return paths


def test_docs_manifest_md_is_up_to_date() -> None:
    # Execute
    expected = manifest_reference()
    actual = DOC.read_text(encoding="utf-8") if DOC.exists() else ""

    # Assert
    assert actual == expected, (
        f"docs/manifest.md is stale: regenerate it from the repository root with "
        f"`{REGENERATE_COMMAND}`"
    )


def test_manifest_reference_lists_every_spec_field() -> None:
    # Prepare
    text = manifest_reference()
    spec = openapi_schema()["properties"]["spec"]

    # Execute
    missing = [p for p in _leaf_paths(spec, "spec") if f"| `{p}` |" not in text]

    # Assert
    assert not missing


def test_manifest_reference_rows_have_five_cells() -> None:
    for line in manifest_reference().splitlines():
        if line.startswith("| `spec."):
            cells = re.split(r"(?<!\\)\|", line)[1:-1]
            assert len(cells) == 5, line


def test_manifest_reference_row_content() -> None:
    text = manifest_reference()

    assert "| `spec.training.batchSize` | integer | `32` | 1 to 1000000 | batchSize" in text
    assert "| `spec.clients.count` | integer | required | 1 to 10000 |" in text
    assert "| `spec.clients.perRound` | count or percentage | `100%` |" in text
    assert "| `spec.model.hidden` | list of integer | `[128]` |" in text
    assert "| `spec.roles.kdc.nodeSelector` | map of string | `{}` |" in text
    assert (
        "| `spec.protocol.name` | string | required | one of `fedavg`, `fedsgd`, `dp-fedavg`, "
        "`perturb`, `mpdp`" in text
    )
    assert r"`^(100\|[1-9][0-9]?)%$`" in text, "pipes inside cells are escaped"
    assert "| `spec.roles.kdc.tolerations[].effect` |" in text
    assert "client-&lt;i&gt;.npz" in text, "prose is not read as HTML"


def test_manifest_reference_tables_are_depth_first() -> None:
    headings = [line[4:] for line in manifest_reference().splitlines() if line.startswith("### ")]

    assert headings[:2] == ["FederatedRun", "metadata"]
    assert headings.index("spec") < headings.index("spec.protocol")
    assert headings.index("spec.protocol") < headings.index("spec.protocol.fedavg")
    assert headings.index("spec.protocol.fedsgd") < headings.index("spec.model")
    assert headings.index("spec.data") < headings.index("spec.data.source")
    assert headings.index("spec.data.partition") < headings.index("spec.clients")
    assert headings.index("spec.roles.kdc.tolerations[]") < headings.index("spec.roles.server")


def test_manifest_reference_links_example_and_lists_protocols() -> None:
    text = manifest_reference()

    assert "(../examples/digits-fedavg.yaml)" in text
    assert "```" not in text, "the example is linked, not embedded"
    assert "`kubectl apply" in text and "`fedcore run`" in text
    protocols = text[text.index("## Protocols") :]
    for name, facts in PROTOCOL_FACTS.items():
        flags = [facts.needs_kdc, facts.decentralized, facts.claims_dp]
        cells = [f"`{name}`", *("yes" if f else "no" for f in flags), facts.dropout_policy]
        assert "| " + " | ".join([*cells, facts.summary]) + " |" in protocols


def test_main_prints_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0

    assert capsys.readouterr().out == manifest_reference()


def test_main_write_writes_output(tmp_path: Path) -> None:
    # Prepare
    output = tmp_path / "nested" / "manifest.md"

    # Execute
    status = main(["--write", "--output", str(output)])

    # Assert
    assert status == 0
    assert output.read_text(encoding="utf-8") == manifest_reference()

"""docs/manifest.md, the FederatedRun field reference, rendered from the models and protocol facts.

Run ``python -m fedcore.spec._reference`` to print it and ``--write`` to rewrite the file; a
unit test fails when the committed file differs from what this module renders.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fedcore.spec._facts import PROTOCOL_FACTS
from fedcore.spec._openapi import describe_bounds, model_schema
from fedcore.spec._run import API_VERSION, KIND, FederatedRun

DEFAULT_OUTPUT = Path("docs/manifest.md")
"""Where ``--write`` writes, relative to the working directory (the repository root)."""

REGENERATE_COMMAND = "python -m fedcore.spec._reference --write"
"""The command that rewrites docs/manifest.md."""

EXAMPLE_LINK = "../examples/digits-fedavg.yaml"
"""The quickstart manifest, relative to docs/."""


def manifest_reference() -> str:
    """Returns the Markdown of docs/manifest.md: intro, one table per object, protocols."""
    lines = [
        f"# The {KIND} manifest",
        "",
        f"<!-- Generated from fedcore/spec by `{REGENERATE_COMMAND}`; do not edit. -->",
        "",
        f"A {KIND} (`apiVersion: {API_VERSION}`) describes one federated-learning run. The",
        "same YAML file is taken by `kubectl apply -f` on a cluster with the fedcore operator",
        "and by `fedcore run` on one machine, and both check it with the same validator.",
        "Every problem found is reported at once, each naming the field path in the",
        "manifest's own spelling, e.g. `spec.clients.perRound: '101%' is not allowed: ...`.",
        "",
        f"A complete example is [examples/digits-fedavg.yaml]({EXAMPLE_LINK}).",
        "",
        "Field paths are dotted camelCase keys; `[]` stands for any item of a list. A field",
        "with a default may be left out; `unset` means the field may be left out (or null)",
        "and has no default.",
        "",
        "## Fields",
    ]
    for path, node in _objects(model_schema(FederatedRun), ""):
        lines += ["", f"### {path or KIND}", "", *_table(path, node)]
    lines += ["", "## Protocols", "", *_protocol_table()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the reference, or writes it with ``--write``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m fedcore.spec._reference",
        description="Render docs/manifest.md from the FederatedRun models.",
    )
    parser.add_argument(
        "--write", action="store_true", help="Write the reference to --output instead of printing."
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        help=f"The file --write rewrites, relative to the working directory. "
        f"Default {DEFAULT_OUTPUT}.",
    )
    args = parser.parse_args(argv)
    text = manifest_reference()
    if args.write:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
    else:
        print(text, end="")
    return 0


def _objects(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yields (path, node) for every object with properties, depth first, parents first."""
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        yield from _objects(node["items"], f"{path}[]")
        return
    if not node.get("properties"):
        return
    yield path, node
    for name, child in node["properties"].items():
        yield from _objects(child, f"{path}.{name}" if path else name)


def _table(path: str, node: dict[str, Any]) -> list[str]:
    rows = [
        "| field | type | default | allowed values / bounds | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    required = set(node.get("required", []))
    for name, child in node["properties"].items():
        cells = [
            f"`{path}.{name}`" if path else f"`{name}`",
            _type_of(child),
            "required" if name in required else _default_of(child),
            describe_bounds(child),
            _html_escape(child.get("description", "")),
        ]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return rows


def _type_of(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "count or percentage"
    kind = node.get("type", "object")
    if kind == "array":
        return f"list of {_type_of(node.get('items', {}))}"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map of {_type_of(node['additionalProperties'])}"
    return str(kind)


def _default_of(node: dict[str, Any]) -> str:
    if "default" not in node:
        return "unset"
    value = node["default"]
    if node.get("properties"):
        return "its fields' defaults"
    if isinstance(value, str):
        return f"`{value}`"
    return f"`{json.dumps(value)}`"


def _protocol_table() -> list[str]:
    rows = [
        "| name | needs a KDC | decentralized | claims DP | dropout policy | summary |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for facts in PROTOCOL_FACTS.values():
        cells = [
            f"`{facts.name}`",
            _yes_no(facts.needs_kdc),
            _yes_no(facts.decentralized),
            _yes_no(facts.claims_dp),
            facts.dropout_policy,
            _html_escape(facts.summary),
        ]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return rows


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def _html_escape(text: str) -> str:
    """Keeps prose such as ``client-<i>.npz`` from being read as HTML tags."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


if __name__ == "__main__":
    raise SystemExit(main())

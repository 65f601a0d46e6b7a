"""Loading and validating FederatedRun manifests: one validator for the CLI, runner and operator.

Every problem is collected (not only the first) as a ``SpecIssue`` naming the field path in
the manifest's own camelCase spelling, the bad value, and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from fedcore.errors import SpecError, SpecIssue
from fedcore.spec._facts import protocol_facts
from fedcore.spec._openapi import _model_of, describe_bounds, schema_at
from fedcore.spec._options.adaptive import adaptive_issues
from fedcore.spec._options.ebscfl import ebscfl_issues
from fedcore.spec._options.lppa import lppa_issues
from fedcore.spec._robust import attack_issues
from fedcore.spec._run import FederatedRun, FederatedRunSpec

MAX_MANIFEST_BYTES = 1024 * 1024
"""Manifests larger than this are refused before parsing."""

CHILD_NAME_SUFFIX = "-client-"
"""The longest generated child name is '<name>-client-<index>'; it must fit 63 characters."""


def load_manifest(source: str | Path, *, text: str | None = None) -> FederatedRun:
    """Loads and validates a FederatedRun manifest.

    Args:
        source: the file to read, or a label for ``text`` in error messages.
        text: the manifest's YAML; read from ``source`` when None.

    Returns:
        The validated run.

    Raises:
        SpecError: listing every problem with its field path.
    """
    label = str(source)
    if text is None:
        path = Path(source)
        try:
            if path.stat().st_size > MAX_MANIFEST_BYTES:
                raise SpecError(
                    [SpecIssue("<file>", f"is larger than {MAX_MANIFEST_BYTES} bytes.")],
                    source=label,
                )
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise SpecError([SpecIssue("<file>", f"cannot be read: {exc}.")], source=label) from exc
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError([SpecIssue("<file>", f"is not valid YAML: {exc}")], source=label) from exc
    return parse_manifest(document, source=label)


def parse_manifest(document: Any, *, source: str | None = None) -> FederatedRun:
    """Validates an already-parsed manifest (a dict from YAML or from the API server).

    Raises:
        SpecError: listing every problem with its field path.
    """
    if not isinstance(document, dict):
        kind = type(document).__name__
        raise SpecError(
            [
                SpecIssue(
                    "<root>",
                    f"must be a mapping with apiVersion, kind, metadata and spec, got {kind}.",
                )
            ],
            source=source,
        )
    try:
        run = FederatedRun.model_validate(document)
    except ValidationError as exc:
        raise SpecError(issues_from_pydantic(exc, FederatedRun), source=source) from None
    issues = semantic_issues(run)
    if issues:
        raise SpecError(issues, source=source)
    return run


def issues_from_pydantic(error: ValidationError, model: type[BaseModel]) -> list[SpecIssue]:
    """Turns pydantic's errors into issues with camelCase paths and the allowed values."""
    issues = []
    for item in error.errors(include_url=False):
        loc = [str(part) for part in item["loc"] if not _is_union_tag(part)]
        path = _join_path(loc)
        kind = item["type"]
        value = item.get("input")
        if kind == "extra_forbidden":
            allowed = _allowed_fields(model, loc[:-1])
            message = f"unknown field; allowed fields here: {', '.join(allowed)}."
        elif kind == "missing":
            message = "is required."
        elif kind in _EXPECTED_TYPES:
            message = f"{_short(value)} is {_type_word(value)}; expected {_EXPECTED_TYPES[kind]}."
        elif kind in _BOUND_ERRORS and (bounds := _bounds_at(model, loc)):
            message = f"{_short(value)} is not allowed; allowed: {bounds}."
        else:
            reason = item["msg"].removeprefix("Value error, ")
            message = f"{_short(value)} is not allowed: {reason}."
        issues.append(SpecIssue(path, message))
    return _dedupe(issues)


_EXPECTED_TYPES = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping of fields",
    "model_attributes_type": "a mapping of fields",
}
"""pydantic's type errors, and the type each one expected."""

_BOUND_ERRORS = frozenset(
    {
        "literal_error",
        "enum",
        "greater_than",
        "greater_than_equal",
        "less_than",
        "less_than_equal",
        "string_too_short",
        "string_too_long",
        "string_pattern_mismatch",
        "too_short",
        "too_long",
    }
)
"""pydantic's errors for a value outside what the field allows (answered from the schema)."""


def _bounds_at(model: type[BaseModel], loc: list[str]) -> str:
    """Says what the field at ``loc`` allows, e.g. "1 to 10000"; "" if unknown."""
    node = schema_at(model, loc)
    return describe_bounds(node, quote="'") if node is not None else ""


def _type_word(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number with a fractional part" if not value.is_integer() else "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


def semantic_issues(run: FederatedRun) -> list[SpecIssue]:
    """Cross-field rules that a schema cannot express; returns every issue found."""
    spec = run.spec
    issues: list[SpecIssue] = []
    facts = protocol_facts(spec.protocol.name)
    count = spec.clients.count
    longest_child = f"{run.metadata.name}{CHILD_NAME_SUFFIX}{count - 1}"
    if len(longest_child) > 63:
        issues.append(
            SpecIssue(
                "metadata.name",
                f"{run.metadata.name!r} is too long for {count} clients: the child name "
                f"{longest_child!r} would have {len(longest_child)} characters; at most 63 "
                f"allowed.",
            )
        )
    per_round = spec.clients.per_round
    if isinstance(per_round, int) and per_round > count:
        issues.append(
            SpecIssue(
                "spec.clients.perRound",
                f"{per_round} is more than spec.clients.count ({count}); allowed: 1 to {count} "
                f"or a percentage.",
            )
        )
    sampled = min(spec.clients.sampled_per_round(), count)
    quorum = spec.clients.quorum
    if isinstance(quorum, int) and quorum > sampled:
        issues.append(
            SpecIssue(
                "spec.clients.quorum",
                f"{quorum} is more than the {sampled} clients sampled per round; allowed: 1 to "
                f"{sampled} or a percentage.",
            )
        )
    model = spec.model
    if model.kind == "Import" and model.import_path is None:
        issues.append(SpecIssue("spec.model.importPath", "is required when kind is Import."))
    source = spec.data.source
    if source.kind == "NpzFolder" and source.path is None:
        issues.append(SpecIssue("spec.data.source.path", "is required when kind is NpzFolder."))
    if spec.data.partition.kind == "ByFile" and source.kind != "NpzFolder":
        issues.append(
            SpecIssue(
                "spec.data.partition.kind",
                f"'ByFile' needs spec.data.source.kind NpzFolder, got {source.kind!r}; allowed "
                f"here: 'IID' or 'Dirichlet'.",
            )
        )
    if spec.privacy is not None and spec.privacy.target_epsilon is not None and not facts.claims_dp:
        issues.append(
            SpecIssue(
                "spec.privacy.targetEpsilon",
                f"protocol {facts.name!r} makes no differential-privacy claim, so it cannot keep a "
                f"budget; remove spec.privacy or pick a protocol that claims DP.",
            )
        )
    if (
        spec.clients.sampling == "Secret"
        and sampled < count
        and facts.claims_dp
        and spec.privacy is not None
        and spec.privacy.accountant == "PLD"
    ):
        issues.append(
            SpecIssue(
                "spec.privacy.accountant",
                "'PLD' cannot account a secret sample (spec.clients.sampling Secret with perRound "
                "below 100%): dp-accounting's PLD accountant has no sampling without replacement; "
                "allowed here: 'RDP'.",
            )
        )
    issues.extend(_precondition_issues(run))
    return issues


def _precondition_issues(run: FederatedRun) -> list[SpecIssue]:
    """Each protocol's preconditions, checked before any process or pod starts."""
    spec = run.spec
    issues: list[SpecIssue] = []
    if spec.protocol.name in {"perturb", "mpdp"}:
        issues.extend(_lossless_mlp_issues(spec))
    if spec.protocol.name == "lppa":
        issues.extend(lppa_issues(spec.protocol.lppa, spec.clients, spec.training.optimizer))
    if spec.protocol.name == "adaptive":
        issues.extend(adaptive_issues(spec.protocol.adaptive, spec.training.optimizer))
    if spec.protocol.name == "ebscfl":
        issues.extend(ebscfl_issues(spec.protocol.ebscfl, spec.clients))
    issues.extend(
        attack_issues(spec.attack, spec.protocol.name, spec.protocol.fedavg, spec.clients)
    )
    if spec.protocol.name in {"fedsgd", "perturb", "mpdp"}:
        optimizer = spec.training.optimizer
        if optimizer.kind != "SGD":
            issues.append(
                SpecIssue(
                    "spec.training.optimizer.kind",
                    f"{spec.protocol.name} takes one plain SGD step on the server per round, so "
                    f"{optimizer.kind!r} is not allowed; allowed: 'SGD'.",
                )
            )
        if optimizer.momentum != 0 or optimizer.weight_decay != 0:
            issues.append(
                SpecIssue(
                    "spec.training.optimizer",
                    f"{spec.protocol.name} takes one plain SGD step per round: momentum and "
                    f"weightDecay must be 0.",
                )
            )
    return issues


def _lossless_mlp_issues(spec: FederatedRunSpec) -> list[SpecIssue]:
    """The preconditions of the model-perturbation protocols (digests 000 and 001): their exact
    cancellation holds only for a bias-free ReLU MLP with a linear output, MSE loss, one full
    local gradient per round, in float64."""
    name = spec.protocol.name
    model = spec.model
    issues: list[SpecIssue] = []

    def refuse(path: str, got: object, allowed: str, why: str) -> None:
        issues.append(
            SpecIssue(
                path,
                f"{got!r} is not allowed for protocol {name!r}: {why}; allowed: {allowed}.",
            )
        )

    if model.kind != "MLP":
        refuse(
            "spec.model.kind",
            model.kind,
            "'MLP'",
            "its noise is defined per neuron of fully connected layers only",
        )
    if model.kind == "MLP" and not model.hidden:
        refuse(
            "spec.model.hidden",
            list(model.hidden),
            "at least one hidden layer",
            "the secret scales live on hidden neurons, so a network without one hides nothing",
        )
    if model.activation != "ReLU":
        refuse(
            "spec.model.activation",
            model.activation,
            "'ReLU'",
            "a neuron's secret positive scale passes through its activation only if "
            "act(c*z) = c*act(z) for c > 0, which ReLU satisfies and Tanh and Sigmoid do not",
        )
    if model.bias:
        refuse(
            "spec.model.bias",
            model.bias,
            "false (a bias-free network)",
            "the exact recovery is derived for bias-free layers",
        )
    if model.dtype != "float64":
        refuse(
            "spec.model.dtype",
            model.dtype,
            "'float64'",
            "the recovery cancels noise terms far larger than the gradient, which float32 "
            "rounding cannot do (measured relative errors: 3e-4 and worse)",
        )
    if spec.training.loss != "MSE":
        refuse(
            "spec.training.loss",
            spec.training.loss,
            "'MSE'",
            "the noise cancels exactly only when the loss's gradient is affine in the "
            "outputs, as for MSE and not for CrossEntropy",
        )
    if spec.training.local_epochs != 1:
        refuse(
            "spec.training.localEpochs",
            spec.training.local_epochs,
            "1 (one local step)",
            "a client holds only the perturbed model, so it can take one gradient per round "
            "but cannot step in the true model's coordinates",
        )
    return issues


def _is_union_tag(part: Any) -> bool:
    """pydantic adds the member type's name (e.g. 'int', 'str') to the path of union errors."""
    return isinstance(part, str) and (
        part in {"int", "str", "float"} or part.startswith(("constrained-str", "function-"))
    )


def _join_path(loc: list[str]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if part.isdigit() else (f".{part}" if path else part)
    return path or "<root>"


def _allowed_fields(model: type[BaseModel], loc: list[str]) -> list[str]:
    current: Any = model
    for part in loc:
        if part.isdigit():
            continue
        fields = {(f.alias or n): f for n, f in current.model_fields.items()}
        field = fields.get(part)
        if field is None:
            return []
        current = _model_of(field.annotation)
        if current is None:
            return []
    return sorted(f.alias or n for n, f in current.model_fields.items())


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _dedupe(issues: list[SpecIssue]) -> list[SpecIssue]:
    seen: set[tuple[str, str]] = set()
    result = []
    for issue in issues:
        key = (issue.path, issue.message)
        if key not in seen:
            seen.add(key)
            result.append(issue)
    return result

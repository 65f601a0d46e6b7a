"""Loading and validating FederatedRun manifests: one validator for the CLI, runner and operator.

Every problem is collected (not only the first) as a ``SpecIssue`` naming the field path in
the manifest's own camelCase spelling, the bad value, and what is allowed.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from fedcore.errors import SpecError, SpecIssue
from fedcore.spec._data import FORMAT_INPUTS
from fedcore.spec._datasets import BUILTIN_DATASETS, split_sizes
from fedcore.spec._facts import protocol_facts
from fedcore.spec._loading import (
    MAX_DEPTH,
    MAX_MANIFEST_BYTES,
    MAX_NODES,
    LoadStats,
    load_document,
    read_manifest_bytes,
)
from fedcore.spec._openapi import _model_of, describe_bounds, schema_at
from fedcore.spec._options.adaptive import adaptive_issues
from fedcore.spec._options.ebscfl import ebscfl_issues
from fedcore.spec._options.lppa import lppa_issues
from fedcore.spec._options.secagg import secagg_issues
from fedcore.spec._pod_security import pod_template_issues
from fedcore.spec._robust import attack_issues
from fedcore.spec._run import MAX_OBJECT_NAME, FederatedRun, FederatedRunSpec, longest_object_name

__all__ = [
    "MAX_MANIFEST_BYTES",
    "issues_from_pydantic",
    "load_manifest",
    "parse_manifest",
    "semantic_issues",
]


def load_manifest(
    source: str | Path, *, text: str | bytes | None = None, stats: LoadStats | None = None
) -> FederatedRun:
    """Loads and validates a FederatedRun manifest.

    The YAML is read by ``fedcore.spec._loading.load_document``: at most 1 MiB of UTF-8, one
    document whose top level is a mapping, no duplicate or non-string keys, bounded nesting
    and aliases.

    Args:
        source: the file to read, or a label for ``text`` in error messages.
        text: the manifest's YAML (text, or bytes that must be UTF-8); read from ``source``
            when None.
        stats: filled in with what the YAML loader read, when given.

    Returns:
        The validated run.

    Raises:
        SpecError: listing every problem with its field path; no other exception escapes,
            whatever the input.
    """
    label = str(source)
    data = read_manifest_bytes(Path(source)) if text is None else text
    document = load_document(data, source=label, stats=stats)
    return parse_manifest(document, source=label)


def parse_manifest(document: Any, *, source: str | None = None) -> FederatedRun:
    """Validates an already-parsed manifest (a dict from YAML or from the API server).

    Raises:
        SpecError: listing every problem with its field path; no other exception escapes.
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
    shape = shape_issue(document)
    if shape is not None:
        raise SpecError([shape], source=source)
    try:
        try:
            run = FederatedRun.model_validate(document)
        except ValidationError as exc:
            raise SpecError(issues_from_pydantic(exc, FederatedRun), source=source) from None
        issues = semantic_issues(run)
    except SpecError:
        raise
    except Exception as exc:  # a last resort: one line, never a traceback
        text = " ".join(str(exc).split())[:200]
        raise SpecError(
            [SpecIssue("<root>", f"cannot be validated: {type(exc).__name__}: {text}.")],
            source=source,
        ) from None
    if issues:
        raise SpecError(issues, source=source)
    return run


def shape_issue(document: Any) -> SpecIssue | None:
    """The first place ``document`` nests deeper than ``MAX_DEPTH`` or the node that takes it
    past ``MAX_NODES``; None when it is within both.

    The loader bounds what it reads from YAML; this bounds an already-parsed document the
    same way (the webhook gets its run from the API server as JSON), walking it without
    recursion.
    """
    todo: list[tuple[Any, str, int]] = [(document, "", 1)]
    nodes = 0
    while todo:
        node, path, depth = todo.pop()
        nodes += 1
        if nodes > MAX_NODES:
            return SpecIssue(path or "<root>", f"makes the manifest hold over {MAX_NODES} values.")
        if depth > MAX_DEPTH:  # a value at depth d, scalar or not, as the loader counts it
            return SpecIssue(
                path or "<root>", f"nests deeper than {MAX_DEPTH} levels; allowed: {MAX_DEPTH}."
            )
        if not isinstance(node, dict | list):
            continue
        if isinstance(node, list):
            todo.extend((value, f"{path}[{i}]", depth + 1) for i, value in enumerate(node))
        else:
            todo.extend(
                (value, f"{path}.{key}" if path else str(key), depth + 1)
                for key, value in node.items()
            )
    return None


def issues_from_pydantic(error: ValidationError, model: type[BaseModel]) -> list[SpecIssue]:
    """Turns pydantic's errors into issues with camelCase paths and the allowed values."""
    issues = []
    for item in error.errors(include_url=False):
        loc = [str(part) for part in item["loc"] if not _is_union_tag(part)]
        path = _join_path(loc)
        kind = item["type"]
        value = item.get("input")
        allowed: str | None = None
        if kind == "extra_forbidden":
            allowed = ", ".join(_allowed_fields(model, loc[:-1]))
            message = f"unknown field; allowed fields here: {allowed}."
            value = None  # the field's name is the problem, not its value
        elif kind == "missing":
            message = "is required."
            value = None
        elif kind in _EXPECTED_TYPES:
            expected = _EXPECTED_TYPES[kind]
            allowed = (_bounds_at(model, loc) if kind != "dict_type" else "") or expected
            suffix = f"; allowed: {allowed}" if allowed != expected else ""
            message = f"{_short(value)} is {_type_word(value)}; expected {expected}{suffix}."
        elif kind in _BOUND_ERRORS and (bounds := _bounds_at(model, loc)):
            allowed = bounds
            message = f"{_short(value)} is not allowed; allowed: {bounds}."
        else:
            reason = item["msg"].removeprefix("Value error, ")
            message = f"{_short(value)} is not allowed: {reason}."
        if not _json_scalar(value):
            value = None  # a mapping or list: the message shows it, the data does not repeat it
        issues.append(SpecIssue(path, message, value=value, allowed=allowed))
    return _dedupe(issues)


_EXPECTED_TYPES = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
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


def _json_scalar(value: Any) -> bool:
    """Whether ``value`` is a finite JSON scalar (what ``validate --json`` may echo)."""
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    return value is None or isinstance(value, str | int | bool)


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
        if value != value:
            return "not a number (NaN)"
        if value in (float("inf"), float("-inf")):
            return "an infinity"
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
    name = run.metadata.name
    longest = longest_object_name(name, count)
    if len(longest) > MAX_OBJECT_NAME:
        room = MAX_OBJECT_NAME - (len(longest) - len(name))
        issues.append(
            SpecIssue(
                "metadata.name",
                f"{name!r} is too long for {count} clients: the child name {longest!r} (the "
                f"last client's TLS Secret) would have {len(longest)} characters; at most "
                f"{MAX_OBJECT_NAME} allowed, so at most {max(room, 0)} characters for the name.",
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
    issues.extend(_compression_issues(spec))
    issues.extend(_data_issues(spec))
    issues.extend(_client_data_issues(spec))
    issues.extend(_site_issues(spec))
    issues.extend(_precondition_issues(run))
    issues.extend(
        pod_template_issues(
            {
                role: placement.pod_template
                for role, placement in (
                    ("kdc", spec.roles.kdc),
                    ("server", spec.roles.server),
                    ("clients", spec.roles.clients),
                )
                if placement.pod_template
            }
        )
    )
    return issues


def _compression_issues(spec: FederatedRunSpec) -> list[SpecIssue]:
    """Compression of the messages a protocol needs exact (``ProtocolFacts.compressible``)."""
    facts = protocol_facts(spec.protocol.name)
    compression = spec.transport.compression
    issues = []
    for field, codec in (("uploads", compression.uploads), ("broadcasts", compression.broadcasts)):
        if codec != "None" and field not in facts.compressible:
            issues.append(
                SpecIssue(
                    f"spec.transport.compression.{field}",
                    f"{codec!r} cannot be used with protocol {facts.name!r}: "
                    f"{facts.exact_because}; allowed here: 'None'.",
                )
            )
    return issues


def local_run_issues(run: FederatedRun) -> list[SpecIssue]:
    """What a valid manifest needs that only Kubernetes gives, refused by ``fedcore run``: a
    client whose data is a PersistentVolumeClaim (only the operator mounts one)."""
    own = run.spec.data.client_data
    if own is None or own.bound_by_sites:
        return []
    for index in range(run.spec.clients.count):
        claim = own.source_of(index).volume_claim
        if claim is not None:
            return [
                SpecIssue(
                    "spec.data.clientData",
                    f"client {index}'s source is the PersistentVolumeClaim "
                    f"{claim.claim_name!r}, which only the operator mounts (into that "
                    f"client's pod); fedcore run reads path and s3 sources.",
                )
            ]
    return []


def _client_data_issues(spec: FederatedRunSpec) -> list[SpecIssue]:
    """What clients' own sources (spec.data.clientData), the schema and the evaluation's place
    need from the rest of the manifest."""
    data = spec.data
    own = data.client_data
    schema = data.schema_
    issues: list[SpecIssue] = []
    facts = protocol_facts(spec.protocol.name)
    where = spec.evaluation_where
    if where != "Server" and not facts.clients_hold_model:
        issues.append(
            SpecIssue(
                "spec.evaluation.where",
                f"{where!r}: protocol {facts.name!r}'s clients never hold the true model, so "
                f"they cannot score it; allowed here: 'Server' (with spec.data.source).",
            )
        )
    misreports = spec.attack is not None and spec.attack.kind == "MisreportEvaluation"
    if misreports and (where == "Server" or facts.decentralized):
        issues.append(
            SpecIssue(
                "spec.attack.kind",
                "'MisreportEvaluation' misreports the clients' evaluation, which this run does "
                "not ask for; set spec.evaluation.where to 'Clients' or 'Both' (not for "
                "decentralized protocols, whose clients score their own models).",
            )
        )
    if own is None:
        return issues
    if where != "Clients":
        issues.append(
            SpecIssue(
                "spec.evaluation.where",
                f"{where!r} needs a held-out split on the server, which has no data with "
                f"spec.data.clientData; allowed here: 'Clients'.",
            )
        )
    # Compared with their defaults, not "was it set": the API server writes the CRD's
    # defaults into every stored run.
    defaults = type(data)()
    for field in ("source", "partition"):
        if getattr(data, field) != getattr(defaults, field):
            issues.append(
                SpecIssue(
                    f"spec.data.{field}",
                    "cannot be set with spec.data.clientData: each client reads its own "
                    "source; remove one of the two.",
                )
            )
    if data.clusters.count > 1:
        issues.append(
            SpecIssue(
                "spec.data.clusters.count",
                "must be 1 with spec.data.clientData: the clusters of an experiment are drawn "
                "from a shared source.",
            )
        )
    if own.bound_by_sites and spec.sites is None:
        issues.append(
            SpecIssue(
                "spec.data.clientData",
                "give template or sources: without spec.sites, the manifest names every "
                "client's source.",
            )
        )
    if not own.bound_by_sites and spec.sites is not None:
        issues.append(
            SpecIssue(
                "spec.data.clientData." + ("template" if own.template is not None else "sources"),
                "cannot be set with spec.sites: each site binds its own clients' sources in "
                "its policy, and the hub's manifest names none (docs/sites.md).",
            )
        )
    if own.sources is not None and len(own.sources) != spec.clients.count:
        issues.append(
            SpecIssue(
                "spec.data.clientData.sources",
                f"lists {len(own.sources)} sources for spec.clients.count {spec.clients.count}; "
                f"give one per client.",
            )
        )
    if schema is None:
        issues.append(
            SpecIssue(
                "spec.data.schema",
                "is required with spec.data.clientData: the server builds the model from it, "
                "and each client checks its data against it.",
            )
        )
    else:
        allowed = FORMAT_INPUTS[own.format]
        given = next(name for name in ("features", "image", "shape") if getattr(schema, name))
        if given not in allowed:
            issues.append(
                SpecIssue(
                    f"spec.data.schema.{given}",
                    f"does not describe {own.format} data; allowed for format {own.format}: "
                    + " or ".join(f"spec.data.schema.{name}" for name in allowed)
                    + ".",
                )
            )
    return issues


def _site_issues(spec: FederatedRunSpec) -> list[SpecIssue]:
    """What spec.sites needs: unique names and clients that add up to spec.clients.count."""
    if spec.sites is None:
        return []
    issues: list[SpecIssue] = []
    seen: set[str] = set()
    for position, site in enumerate(spec.sites):
        if site.name in seen:
            issues.append(
                SpecIssue(
                    f"spec.sites[{position}].name",
                    f"{site.name!r} is listed twice; each site appears once, with all its clients.",
                )
            )
        seen.add(site.name)
    total = sum(site.clients for site in spec.sites)
    if total != spec.clients.count:
        issues.append(
            SpecIssue(
                "spec.sites",
                f"the sites run {total} clients but spec.clients.count is "
                f"{spec.clients.count}; the sites' clients must add up to it.",
            )
        )
    return issues


def _data_issues(spec: FederatedRunSpec) -> list[SpecIssue]:
    """What a built-in source's known size and classes rule out before any data is loaded.

    An NpzFolder's contents are known only at run time, where the data loader refuses them.
    """
    data = spec.data
    facts = BUILTIN_DATASETS.get(data.source.kind)
    if facts is None:
        return []
    issues: list[SpecIssue] = []
    train, test = split_sizes(facts.examples, data.test_fraction)
    what = (
        f"{facts.kind} has {facts.examples:,} examples, and spec.data.testFraction "
        f"{data.test_fraction} holds out {test:,} of them, leaving {train:,} for training"
    )
    minimum = data.partition.min_examples
    count = spec.clients.count
    if train < 1:
        issues.append(
            SpecIssue(
                "spec.data.testFraction",
                f"{data.test_fraction} leaves no training examples: {what}; allowed: more "
                f"than 0 and at most {facts.examples - 1}/{facts.examples}.",
            )
        )
    elif minimum > train:
        issues.append(
            SpecIssue(
                "spec.data.partition.minExamples",
                f"{minimum} is more than any client can hold: {what}; allowed: 1 to "
                f"{max(train // count, 1)}.",
            )
        )
    elif count * minimum > train:
        each = "1 training example" if minimum == 1 else f"{minimum} training examples"
        issues.append(
            SpecIssue(
                "spec.clients.count",
                f"{count} clients cannot each hold {each} (spec.data.partition.minExamples "
                f"{minimum}): {what}; allowed: 1 to {train // minimum}.",
            )
        )
    clusters = data.clusters.count
    if clusters > facts.classes:
        issues.append(
            SpecIssue(
                "spec.data.clusters.count",
                f"{clusters} is more than the {facts.classes} classes of {facts.kind}: each "
                f"cluster shifts the labels by its index; allowed: 1 to {facts.classes}.",
            )
        )
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
    if spec.protocol.name == "secagg":
        options = spec.protocol.secagg_options()
        issues.extend(secagg_issues(options, spec.clients))
        if options.distributed_dp is not None:
            issues.extend(_distributed_dp_issues(spec))
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


def _distributed_dp_issues(spec: FederatedRunSpec) -> list[SpecIssue]:
    """secagg's distributed DP is proven as zCDP (fedcore.spec._options.secagg_dp): an RDP
    accountant composes it exactly; PLD and amplification by a secret sample would claim
    what the discrete noise does not prove."""
    issues = []
    if spec.privacy is not None and spec.privacy.accountant == "PLD":
        issues.append(
            SpecIssue(
                "spec.privacy.accountant",
                "'PLD' cannot account secagg's distributed discrete Gaussian (its guarantee is "
                "zCDP, which the PLD of a continuous Gaussian would overstate); allowed: 'RDP'.",
            )
        )
    sampled = min(spec.clients.sampled_per_round(), spec.clients.count)
    if spec.clients.sampling == "Secret" and sampled < spec.clients.count:
        issues.append(
            SpecIssue(
                "spec.clients.sampling",
                "'Secret' sampling's amplification is proven for the Gaussian, not for secagg's "
                "distributed discrete Gaussian; allowed here: 'Seeded' (no amplification is "
                "claimed).",
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


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxstring = _REPR.maxother = 80
"""Shows a nested value without walking it all: a few levels and items of each."""


def _short(value: Any) -> str:
    """The value as a message shows it: its repr, cut to 80 characters, never walking more
    than a few levels and items of a collection (which may be huge or shared)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    try:
        text = _REPR.repr(value) if isinstance(value, list | tuple | dict | set) else repr(value)
    except Exception:  # a repr that fails (too deep, too long): name the type instead
        text = f"<a {type(value).__name__}>"
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

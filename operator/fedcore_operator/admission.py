"""What the validating webhook refuses: everything a 1.20 CRD schema cannot express.

The schema already checks types, enums, bounds and patterns; this adds everything else
``fedcore.spec`` refuses (the same checks ``fedcore validate`` and ``fedcore run`` make, with
the same messages): unknown fields, which the CRD keeps for this purpose, the cross-field rules
and protocol preconditions, and the name rules that come from the objects a run creates
(``metadata.name`` starts with a letter; its longest object name fits 63 characters). Then
the pod-template settings that would weaken pod security, and which spec changes a run
accepts in its current phase. Each problem names the field and says what is allowed. A
Participation (a site's approval) is checked against its model the same way
(``check_participation``). Pure functions: no API calls.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from fedcore.errors import SpecError
from fedcore.sites.participation import Participation
from fedcore.spec import RESUME_INSENSITIVE_FIELDS, parse_manifest
from fedcore.spec._validate import issues_from_pydantic

Object = dict[str, Any]

ALWAYS_MUTABLE = ("suspend", "activeDeadlineSeconds", "backoffLimit")
"""Spec fields any unfinished run may change."""
MUTABLE_WHEN_SUSPENDED = tuple(
    field for field in RESUME_INSENSITIVE_FIELDS if field not in ALWAYS_MUTABLE
)
"""Spec fields a suspended run may change too (they are outside the resume fingerprint)."""


def check(body: Object, old: Object | None, operation: str) -> list[str]:
    """Returns every reason to refuse ``body`` (empty: admit it).

    Args:
        body: the FederatedRun as submitted.
        old: the stored object, for an UPDATE.
        operation: CREATE or UPDATE.
    """
    problems = _spec_problems(body)
    if operation == "UPDATE" and old is not None:
        problems += _change_problems(old, body)
    return problems


def _spec_problems(body: Object) -> list[str]:
    try:
        parse_manifest(as_written(body))
    except SpecError as exc:
        return [f"{issue.path}: {issue.message}" for issue in exc.issues] or [str(exc)]
    return []


def as_written(body: Object) -> Object:
    """The object as ``fedcore validate`` would read it: the fields the API server adds to
    ``metadata`` and the ``status`` it owns left out, every other field kept.

    The CRD keeps unknown fields at the root and under ``spec`` (see
    ``fedcore.spec._openapi``), so a field misplaced beside ``spec`` is refused here by name.
    """
    meta = body.get("metadata") or {}
    document = {key: value for key, value in body.items() if key not in ("metadata", "status")}
    document["metadata"] = {"name": meta.get("name"), "namespace": meta.get("namespace")}
    return document


def _change_problems(old: Object, new: Object) -> list[str]:
    old_spec = old.get("spec") or {}
    new_spec = new.get("spec") or {}
    changed = sorted(
        key
        for key in set(old_spec) | set(new_spec)
        if old_spec.get(key) != new_spec.get(key) and key not in ALWAYS_MUTABLE
    )
    if not changed:
        return []
    phase = (old.get("status") or {}).get("phase")
    if phase in ("Succeeded", "Failed"):
        return [
            f"spec.{key}: the run has {phase.lower()}; its spec can no longer change (create a "
            "new run)."
            for key in changed
        ]
    suspended = bool(old_spec.get("suspend")) and phase == "Suspended"
    allowed = set(MUTABLE_WHEN_SUSPENDED) if suspended else set()
    refused = [key for key in changed if key not in allowed]
    if not refused:
        return []
    if suspended:
        hint = (
            "a suspended run may change only "
            + ", ".join(ALWAYS_MUTABLE + MUTABLE_WHEN_SUSPENDED)
            + " (the rest is part of what its checkpoints resume)"
        )
    else:
        hint = (
            "a run that is not suspended may change only "
            + ", ".join(ALWAYS_MUTABLE)
            + "; suspend it first (spec.suspend: true) to change "
            + ", ".join(MUTABLE_WHEN_SUSPENDED)
        )
    return [
        f"spec.{key}: cannot change while the run is {phase or 'starting'}: {hint}."
        for key in refused
    ]


# ---------------------------------------------------------------------------- participations

PARTICIPATION_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
"""A Participation's name: a DNS label that starts with a letter (it is a label value on
every object it owns, and the prefix of their names)."""


def check_participation(body: Object) -> list[str]:
    """Returns every reason to refuse a Participation (empty: admit it): its name, then what
    the model refuses (unknown fields by name, types, bounds, the digest and image rules).
    Any change is admitted: the operator reviews the run again for each generation."""
    problems = []
    name = str((body.get("metadata") or {}).get("name") or "")
    if not PARTICIPATION_NAME.fullmatch(name):
        problems.append(
            f"metadata.name: {name!r} must be a DNS label that starts with a letter (lowercase "
            "letters, digits and '-', at most 63 characters): it labels the objects it owns"
        )
    document = {key: value for key, value in body.items() if key not in ("metadata", "status")}
    try:
        Participation.model_validate(document)
    except ValidationError as exc:
        problems += [
            f"{issue.path}: {issue.message}" for issue in issues_from_pydantic(exc, Participation)
        ]
    return problems

"""What the validating webhook refuses: everything a 1.20 CRD schema cannot express.

The schema already checks types, enums, bounds and patterns; this adds the cross-field rules
and protocol preconditions of ``fedcore.spec`` (the same checks ``fedcore run`` makes), the
limits that come from Kubernetes names, the pod-template settings that would weaken pod
security, and which spec changes a run accepts in its current phase. Each problem names the
field and says what is allowed. Pure functions: no API calls.
"""

from __future__ import annotations

from typing import Any

from fedcore.errors import SpecError
from fedcore.spec import RESUME_INSENSITIVE_FIELDS
from fedcore_operator import objects
from fedcore_operator.reconcile import manifest_of

Object = dict[str, Any]

ALWAYS_MUTABLE = ("suspend", "activeDeadlineSeconds", "backoffLimit")
"""Spec fields any unfinished run may change."""
MUTABLE_WHEN_SUSPENDED = tuple(
    field for field in RESUME_INSENSITIVE_FIELDS if field not in ALWAYS_MUTABLE
)
"""Spec fields a suspended run may change too (they are outside the resume fingerprint)."""
FORBIDDEN_POD_FIELDS = {
    ("spec", "hostNetwork"): "pods of a run may not use the node's network",
    ("spec", "hostPID"): "pods of a run may not share the node's process namespace",
    ("spec", "hostIPC"): "pods of a run may not share the node's IPC namespace",
    ("spec", "restartPolicy"): "the operator owns restarts (spec.backoffLimit)",
    ("spec", "serviceAccountName"): "the operator gives each role its own ServiceAccount",
}
MAX_NAME = 63


def check(body: Object, old: Object | None, operation: str) -> list[str]:
    """Returns every reason to refuse ``body`` (empty: admit it).

    Args:
        body: the FederatedRun as submitted.
        old: the stored object, for an UPDATE.
        operation: CREATE or UPDATE.
    """
    problems = _spec_problems(body)
    problems += _name_problems(body)
    problems += _template_problems(body)
    if operation == "UPDATE" and old is not None:
        problems += _change_problems(old, body)
    return problems


def _spec_problems(body: Object) -> list[str]:
    try:
        manifest_of(body)
    except SpecError as exc:
        return [f"{issue.path}: {issue.message}" for issue in exc.issues] or [str(exc)]
    return []


def _name_problems(body: Object) -> list[str]:
    name = str(body.get("metadata", {}).get("name") or "")
    count = (body.get("spec") or {}).get("clients", {}).get("count")
    problems = []
    if name and not name[0].isalpha():
        problems.append(
            f"metadata.name: {name!r} must start with a letter: it names the run's Services "
            "(DNS-1035 labels)."
        )
    if name and isinstance(count, int) and count > 0:
        longest = objects.longest_name(name, count)
        if len(longest) > MAX_NAME:
            room = MAX_NAME - (len(longest) - len(name))
            problems.append(
                f"metadata.name: {name!r} is too long for {count} clients: the run's objects "
                f"are named like {longest!r} ({len(longest)} characters, at most {MAX_NAME}); "
                f"use at most {max(room, 0)} characters."
            )
    return problems


def _template_problems(body: Object) -> list[str]:
    problems = []
    roles = (body.get("spec") or {}).get("roles") or {}
    for role, placement in sorted(roles.items()):
        template = (placement or {}).get("podTemplate") or {}
        base = f"spec.roles.{role}.podTemplate"
        for path, why in FORBIDDEN_POD_FIELDS.items():
            node: Any = template
            for part in path:
                node = node.get(part) if isinstance(node, dict) else None
            if node is not None:
                problems.append(f"{base}.{'.'.join(path)}: may not be set: {why}.")
        security = ((template.get("spec") or {}).get("securityContext")) or {}
        if security.get("runAsUser") == 0 or security.get("runAsNonRoot") is False:
            problems.append(
                f"{base}.spec.securityContext: pods of a run run as non-root; runAsUser 0 and "
                "runAsNonRoot false are refused."
            )
        for index, container in enumerate((template.get("spec") or {}).get("containers") or []):
            context = (container or {}).get("securityContext") or {}
            for key, allowed in (
                ("privileged", False),
                ("allowPrivilegeEscalation", False),
                ("readOnlyRootFilesystem", True),
                ("runAsNonRoot", True),
            ):
                if key in context and context[key] != allowed:
                    problems.append(
                        f"{base}.spec.containers[{index}].securityContext.{key}: must be "
                        f"{str(allowed).lower()} (pods of a run are non-root with a read-only "
                        "root filesystem)."
                    )
            if context.get("runAsUser") == 0:
                problems.append(
                    f"{base}.spec.containers[{index}].securityContext.runAsUser: 0 (root) is "
                    "refused."
                )
    return problems


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

"""What a role's podTemplate may not do: weaken its pod's security.

The operator merges ``spec.roles.<role>.podTemplate`` over the pods it builds and re-applies its
locks there; these rules refuse, at validation, every template that would weaken a pod, so that
``fedcore validate`` and the cluster's webhook (which validates with ``fedcore.spec``) give the
same verdict: host namespaces, a node name, privileged or root containers (in ``containers``,
``initContainers`` and ``ephemeralContainers`` alike), added capabilities, privilege escalation,
a writable root filesystem, seccomp or AppArmor unconfined, host paths or Secret, ConfigMap and
projected volumes it does not own, environment read from a Secret or ConfigMap, host ports, and
a service-account token for a role that has none. Each problem names its field.
"""

from __future__ import annotations

from typing import Any

from fedcore.errors import SpecIssue

Object = dict[str, Any]

FORBIDDEN_POD_FIELDS: dict[tuple[str, ...], str] = {
    ("spec", "hostNetwork"): "pods of a run may not use the node's network",
    ("spec", "hostPID"): "pods of a run may not share the node's process namespace",
    ("spec", "hostIPC"): "pods of a run may not share the node's IPC namespace",
    ("spec", "restartPolicy"): "the operator owns restarts (spec.backoffLimit)",
    ("spec", "serviceAccountName"): "the operator gives each role its own ServiceAccount",
    ("spec", "nodeName"): "the scheduler places a run's pods (use nodeSelector or affinity)",
}
"""Pod fields a template may not set at all, and why."""
CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")
"""Every list of containers a pod may hold: each one is held to the same locks."""
CONTAINER_LOCKS = (
    ("privileged", False),
    ("allowPrivilegeEscalation", False),
    ("readOnlyRootFilesystem", True),
    ("runAsNonRoot", True),
)
"""Container securityContext fields a template may only set to the operator's own value."""
FOREIGN_VOLUMES = {
    "hostPath": "pods of a run may not mount the node's file system",
    "secret": "the operator mounts each role's own Secrets; a template may add none",
    "configMap": "the operator mounts the run's own ConfigMap; a template may add none",
    "projected": "projected volumes can carry Secrets, ConfigMaps and tokens; refused",
}
"""Volume kinds a template may not add, and why."""
FOREIGN_ENV = (
    "the operator gives each role its own Secrets and ConfigMap; a template may read no other"
)
APPARMOR_PREFIX = "container.apparmor.security.beta.kubernetes.io/"


def pod_template_issues(templates: dict[str, Object]) -> list[SpecIssue]:
    """Every way the roles' podTemplates (role -> template) would weaken their pods."""
    issues = []
    for role, template in sorted(templates.items()):
        for problem in _pod_problems(role, template):
            path, _, message = problem.partition(": ")
            issues.append(SpecIssue(path, message))
    return issues


def _pod_problems(role: str, template: Object) -> list[str]:
    base = f"spec.roles.{role}.podTemplate"
    problems = []
    for path, why in FORBIDDEN_POD_FIELDS.items():
        node: Any = template
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            problems.append(f"{base}.{'.'.join(path)}: may not be set: {why}.")
    spec = _mapping(template.get("spec"))
    security = _mapping(spec.get("securityContext"))
    if security.get("runAsUser") == 0 or security.get("runAsNonRoot") is False:
        problems.append(
            f"{base}.spec.securityContext: pods of a run run as non-root; runAsUser 0 and "
            "runAsNonRoot false are refused."
        )
    problems += _confinement_problems(f"{base}.spec.securityContext", security)
    if spec.get("automountServiceAccountToken") is True and role != "server":
        problems.append(
            f"{base}.spec.automountServiceAccountToken: may not be true: the {role} role has no "
            "API access (only the server's token may patch its run's status)."
        )
    for index, volume in enumerate(_list(spec.get("volumes"))):
        for kind, why in FOREIGN_VOLUMES.items():
            if kind in _mapping(volume):
                problems.append(f"{base}.spec.volumes[{index}].{kind}: may not be set: {why}.")
    for key, value in sorted(
        _mapping(_mapping(template.get("metadata")).get("annotations")).items()
    ):
        if str(key).startswith(APPARMOR_PREFIX) and value == "unconfined":
            problems.append(
                f"{base}.metadata.annotations.{key}: 'unconfined' is refused (pods of a run keep "
                "the runtime's AppArmor profile)."
            )
    for field in CONTAINER_LISTS:
        for index, container in enumerate(_list(spec.get(field))):
            where = f"{base}.spec.{field}[{index}]"
            problems += _container_problems(
                f"{where}.securityContext",
                _mapping(_mapping(container).get("securityContext")),
            )
            problems += _reference_problems(where, _mapping(container))
    return problems


def _reference_problems(where: str, container: Object) -> list[str]:
    """Environment read from a Secret or ConfigMap, and ports on the node's address."""
    problems = []
    for index, variable in enumerate(_list(container.get("env"))):
        source = _mapping(_mapping(variable).get("valueFrom"))
        for kind in ("secretKeyRef", "configMapKeyRef"):
            if kind in source:
                problems.append(
                    f"{where}.env[{index}].valueFrom.{kind}: may not be set: {FOREIGN_ENV}."
                )
    for index, source in enumerate(_list(container.get("envFrom"))):
        for kind in ("secretRef", "configMapRef"):
            if kind in _mapping(source):
                problems.append(f"{where}.envFrom[{index}].{kind}: may not be set: {FOREIGN_ENV}.")
    for index, port in enumerate(_list(container.get("ports"))):
        for key in ("hostPort", "hostIP"):
            if key in _mapping(port):
                problems.append(
                    f"{where}.ports[{index}].{key}: may not be set: pods of a run do not bind "
                    "the node's address."
                )
    return problems


def _container_problems(where: str, context: Object) -> list[str]:
    problems = []
    for key, allowed in CONTAINER_LOCKS:
        if key in context and context[key] != allowed:
            problems.append(
                f"{where}.{key}: must be {str(allowed).lower()} (pods of a run are non-root "
                "with a read-only root filesystem)."
            )
    if context.get("runAsUser") == 0:
        problems.append(f"{where}.runAsUser: 0 (root) is refused.")
    added = _mapping(context.get("capabilities")).get("add")
    if added:
        problems.append(
            f"{where}.capabilities.add: {added!r} is refused: containers of a run drop every "
            "capability and may add none."
        )
    return problems + _confinement_problems(where, context)


def _confinement_problems(where: str, context: Object) -> list[str]:
    """A seccomp or AppArmor profile of type Unconfined, at pod or container level."""
    return [
        f"{where}.{field}.type: 'Unconfined' is refused (pods of a run keep the runtime's "
        "default profile)."
        for field in ("seccompProfile", "appArmorProfile")
        if _mapping(context.get(field)).get("type") == "Unconfined"
    ]


def _mapping(value: Any) -> Object:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []

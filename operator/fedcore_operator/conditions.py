"""Pure status helpers: pod states, role counts and conditions that keep their transition time.

Nothing here calls the API or, given ``now``, reads the clock; ``plan`` feeds it what a pass
listed, and ``reconcile`` patches the result.
"""

from __future__ import annotations

import datetime
from typing import Any

Object = dict[str, Any]


def now_rfc3339() -> str:
    """The current UTC time as Kubernetes writes it (seconds, ``Z``)."""
    return format_rfc3339(datetime.datetime.now(datetime.UTC))


def format_rfc3339(when: datetime.datetime) -> str:
    """``when`` (UTC) as Kubernetes writes it (whole seconds, ``Z``)."""
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str) -> datetime.datetime:
    """Reads a Kubernetes timestamp back."""
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)


def pod_phase(pod: Object) -> str:
    """The pod's phase (Pending, Running, Succeeded, Failed, Unknown); Pending when unset."""
    return str((pod.get("status") or {}).get("phase") or "Pending")


def pod_ready(pod: Object) -> bool:
    """Whether the pod's Ready condition is True."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def terminating(pod: Object) -> bool:
    """Whether the pod is being deleted."""
    return bool(pod["metadata"].get("deletionTimestamp"))


def pod_exit(pod: Object) -> tuple[int | None, str]:
    """The fedcore container's exit code and a one-line reason, once it terminated."""
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated:
            reason = terminated.get("reason") or ""
            message = (terminated.get("message") or "").strip().splitlines()
            text = f"{reason}: {message[-1]}" if message else reason
            return terminated.get("exitCode"), text
    status = pod.get("status") or {}
    return None, str(status.get("reason") or status.get("message") or "")


def pod_exit_reason(pod: Object) -> str:
    """The one-word reason a pod's fedcore container ended (``OOMKilled``, ``Error``), else
    the pod's own (``Evicted``); "" when none is given."""
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated:
            return str(terminated.get("reason") or "")
    return str((pod.get("status") or {}).get("reason") or "")


def role_counts(pods: list[Object], desired: int, failed: int) -> dict[str, int]:
    """Counts of one role's pods for status.roles."""
    live = [pod for pod in pods if not terminating(pod)]
    return {
        "desired": desired,
        "running": sum(pod_phase(pod) == "Running" for pod in live),
        "ready": sum(pod_ready(pod) for pod in live),
        "succeeded": sum(pod_phase(pod) == "Succeeded" for pod in live),
        "failed": failed,
    }


def set_condition(
    conditions: list[Object],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    generation: int | None,
    now: str | None = None,
) -> list[Object]:
    """Returns ``conditions`` with ``type_`` set; its time changes only when status does.

    ``now`` is the transition time to write (RFC 3339); by default the clock is read.
    """
    text = "True" if status else "False"
    stamp = now or now_rfc3339()
    result = []
    found = False
    for condition in conditions:
        if condition.get("type") != type_:
            result.append(condition)
            continue
        found = True
        changed = condition.get("status") != text
        result.append(
            {
                "type": type_,
                "status": text,
                "reason": reason,
                "message": message,
                "lastTransitionTime": stamp
                if changed
                else condition.get("lastTransitionTime") or stamp,
                "observedGeneration": generation,
            }
        )
    if not found:
        result.append(
            {
                "type": type_,
                "status": text,
                "reason": reason,
                "message": message,
                "lastTransitionTime": stamp,
                "observedGeneration": generation,
            }
        )
    return result


def differs(desired: Any, actual: Any) -> bool:
    """Whether ``actual`` lacks or contradicts anything ``desired`` sets (subset comparison).

    Maps compare key by key (keys the API server added are ignored), lists item by item
    and must have the same length (an empty list matches an absent one: the API server
    omits empty lists, such as a NetworkPolicy's ``ingress: []``), scalars by equality.
    """
    if isinstance(desired, dict):
        if not isinstance(actual, dict):
            return True
        return any(differs(value, actual.get(key)) for key, value in desired.items())
    if isinstance(desired, list):
        if not desired and actual is None:
            return False
        if not isinstance(actual, list) or len(actual) != len(desired):
            return True
        return any(differs(want, have) for want, have in zip(desired, actual, strict=True))
    return bool(desired != actual)

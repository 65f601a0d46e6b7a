"""One level-triggered reconcile of one FederatedRun: observe, compare, act, report.

Each pass reads the run and everything it owns, then does the least that moves the cluster
towards the run's spec: it creates what is missing (Secrets, ConfigMap, ServiceAccounts, RBAC,
Services, NetworkPolicies, then the KDC, server and client pods in that order, each waiting
for the one before to be ready), replaces failed pods within ``backoffLimit``, removes pods of
a suspended or finished run, and patches the operator's part of the status only when it
changed. A pass over a run that needs nothing writes nothing.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fedcore.errors import SpecError
from fedcore.spec import FederatedRun, parse_manifest, resolve_share
from fedcore.transport import RunCa
from fedcore_operator import objects
from fedcore_operator.conditions import (
    differs,
    now_rfc3339,
    parse_rfc3339,
    pod_exit,
    pod_phase,
    pod_ready,
    role_counts,
    set_condition,
    terminating,
)
from fedcore_operator.kube import Kube
from fedcore_operator.settings import OperatorSettings

log = logging.getLogger(__name__)

Object = dict[str, Any]
UPDATABLE = {
    "ConfigMap": ("data",),
    "ServiceAccount": ("automountServiceAccountToken",),
    "Role": ("rules",),
    "RoleBinding": ("subjects",),
    "Service": ("spec",),
    "NetworkPolicy": ("spec",),
}
"""Per owned kind, the top-level fields the operator keeps equal to what it builds."""
TERMINAL = ("Succeeded", "Failed")
CREATE_CONCURRENCY = 8
"""Create requests in flight at once when many objects are missing."""
OPERATOR_FIELDS = (
    "phase",
    "reason",
    "message",
    "observedGeneration",
    "conditions",
    "rounds",
    "progress",
    "roles",
    "restarts",
    "startTime",
    "completionTime",
    "activeSeconds",
    "activeSince",
)
"""The status fields the operator owns; the server patches the others."""


@dataclass
class Outcome:
    """What one reconcile pass did."""

    phase: str | None = None
    writes: int = 0
    actions: list[str] = field(default_factory=list)


def manifest_of(body: Object) -> FederatedRun:
    """Parses a FederatedRun object as the API server returns it into the spec model.

    Raises:
        SpecError: the stored spec is not a valid run (the webhook normally refuses those).
    """
    meta = body["metadata"]
    return parse_manifest(
        {
            "apiVersion": body["apiVersion"],
            "kind": body["kind"],
            "metadata": {"name": meta["name"], "namespace": meta.get("namespace")},
            "spec": body.get("spec") or {},
        }
    )


class Reconciler:
    """Reconciles runs through a ``Kube``; one instance serves every run.

    Args:
        kube: the API access (its write hook counts writes).
        settings: the operator's settings (image, ports).
    """

    def __init__(self, kube: Kube, settings: OperatorSettings) -> None:
        self.kube = kube
        self.settings = settings

    def reconcile(self, namespace: str, name: str) -> Outcome:
        """Runs one pass over the run ``namespace/name``; a vanished run is a no-op."""
        body = self.kube.get("FederatedRun", namespace, name)
        outcome = Outcome()
        if body is None or body["metadata"].get("deletionTimestamp"):
            return outcome
        pass_ = _Pass(self, body, outcome)
        pass_.run()
        return outcome


class _Pass:
    """The state of one reconcile pass over one run."""

    def __init__(self, owner: Reconciler, body: Object, outcome: Outcome) -> None:
        self.kube = owner.kube
        self.settings = owner.settings
        self.body = body
        self.outcome = outcome
        meta = body["metadata"]
        self.name: str = meta["name"]
        self.namespace: str = meta["namespace"]
        self.uid: str = meta["uid"]
        self.generation: int | None = meta.get("generation")
        self.old: Object = dict(body.get("status") or {})
        self.status: Object = {key: self.old[key] for key in OPERATOR_FIELDS if key in self.old}
        self.status.setdefault("conditions", [])
        self.status["observedGeneration"] = self.generation

    # ------------------------------------------------------------------------- driver

    def run(self) -> None:
        try:
            manifest = manifest_of(self.body)
        except SpecError as exc:
            self._finish("Failed", "InvalidSpec", str(exc))
            self._write_status()
            return
        ctx = objects.RunContext(manifest, self.namespace, self.uid, self.settings)
        self.ctx = ctx
        spec = manifest.spec
        self.status["rounds"] = spec.rounds
        self.status["progress"] = f"{self.old.get('round') or 0}/{spec.rounds}"
        self.status.setdefault("restarts", 0)
        self.status.setdefault("startTime", now_rfc3339())
        pods = self.kube.list(
            "Pod", self.namespace, objects.label_selector(objects.selector(self.name))
        )
        self.pods = {pod["metadata"]["name"]: pod for pod in pods}

        if self.old.get("phase") in TERMINAL:
            self._remove_pods(keep_finished=True, spare_running=self._in_finish_grace())
            self._count_roles()
            self._write_status()
            return
        if spec.suspend:
            self._suspend()
            self._write_status()
            return
        if self.old.get("phase") == "Suspended" or not self.status.get("activeSince"):
            self.status["activeSince"] = now_rfc3339()
            self.status.setdefault("activeSeconds", 0.0)
        self._set_condition("Suspended", False, "Running", "The run is not suspended.")

        self._ensure_secrets()
        self._ensure_static()
        if not self._deadline_ok() or not self._replace_failed_pods():
            self._write_status()
            return
        self._start_pods()
        self._count_roles()
        self._write_status()

    # ------------------------------------------------------------------------ objects

    def _create(self, obj: Object) -> None:
        self._create_all([obj])

    def _create_all(self, items: list[Object]) -> None:
        """Creates objects, several requests in flight at once (a 1,000-client run)."""
        if len(items) > 1:
            with ThreadPoolExecutor(CREATE_CONCURRENCY) as pool:
                created = list(pool.map(self.kube.create, items))
        else:
            created = [self.kube.create(item) for item in items]
        for obj, result in zip(items, created, strict=True):
            if result is not None:
                self.outcome.writes += 1
                self.outcome.actions.append(f"created {obj['kind']}/{obj['metadata']['name']}")

    def _ensure_secrets(self) -> None:
        secrets = self.kube.list(
            "Secret", self.namespace, objects.label_selector(objects.selector(self.name))
        )
        existing = {secret["metadata"]["name"]: secret for secret in secrets}
        wanted = [
            (pod, cn, index)
            for pod, cn, index in objects.pod_identities(self.ctx)
            if objects.tls_secret_name(pod) not in existing
        ]
        if not wanted:
            return
        ca_name = objects.ca_secret_name(self.name)
        ca: RunCa
        if ca_name in existing:
            ca = objects.load_ca(existing[ca_name])
        else:
            ca = RunCa.generate(self.name)
            self._create(objects.ca_secret(self.ctx, ca))
        self._create_all(
            [
                objects.pod_tls_secret(self.ctx, ca, pod, common_name, index)
                for pod, common_name, index in wanted
            ]
        )

    def _ensure_static(self) -> None:
        listed: dict[str, dict[str, Object]] = {}
        for desired in objects.static_objects(self.ctx):
            kind = desired["kind"]
            if kind not in listed:
                items = self.kube.list(
                    kind, self.namespace, objects.label_selector(objects.selector(self.name))
                )
                listed[kind] = {item["metadata"]["name"]: item for item in items}
            actual = listed[kind].get(desired["metadata"]["name"])
            if actual is None:
                self._create(desired)
                continue
            patch = {key: desired[key] for key in UPDATABLE[kind] if key in desired}
            if differs(patch, actual):
                self.kube.patch(kind, self.namespace, desired["metadata"]["name"], patch)
                self.outcome.writes += 1
                self.outcome.actions.append(f"updated {kind}/{desired['metadata']['name']}")

    # --------------------------------------------------------------------------- pods

    def _role_pods(self, role: str) -> list[Object]:
        return [
            pod
            for pod in self.pods.values()
            if pod["metadata"].get("labels", {}).get(objects.ROLE_LABEL) == role
        ]

    def _delete_pod(self, pod: Object, grace: int | None = None) -> None:
        if terminating(pod):
            return
        if self.kube.delete("Pod", self.namespace, pod["metadata"]["name"], grace):
            self.outcome.writes += 1
            self.outcome.actions.append(f"deleted Pod/{pod['metadata']['name']}")
        pod["metadata"]["deletionTimestamp"] = now_rfc3339()

    def _remove_pods(self, *, keep_finished: bool, spare_running: bool = False) -> None:
        """Deletes the run's pods: all, or (``keep_finished``) those that have not ended; with
        ``spare_running``, pods that still run are left to end on their own for now."""
        for pod in self.pods.values():
            if keep_finished and pod_phase(pod) in TERMINAL:
                continue
            if spare_running and not terminating(pod):
                continue
            self._delete_pod(pod)

    def _in_finish_grace(self) -> bool:
        """Whether the run succeeded less than ``finish_grace_seconds`` ago: its clients may
        still be writing their final models (lppa's are the run's result) and exit by
        themselves; a later pass (a pod's exit or the resync) deletes whoever outlasts it."""
        if self.status.get("phase", self.old.get("phase")) != "Succeeded":
            return False
        done = self.status.get("completionTime") or self.old.get("completionTime")
        if not done:
            return False
        since = (parse_rfc3339(now_rfc3339()) - parse_rfc3339(done)).total_seconds()
        return since < self.settings.finish_grace_seconds

    def _suspend(self) -> None:
        self._remove_pods(keep_finished=False)
        if self.old.get("phase") != "Suspended":
            since = self.status.get("activeSince")
            if since:
                ran = (parse_rfc3339(now_rfc3339()) - parse_rfc3339(since)).total_seconds()
                self.status["activeSeconds"] = float(self.status.get("activeSeconds") or 0) + ran
            self.status.pop("activeSince", None)
        self._set_phase("Suspended", "Suspended", "spec.suspend is true: the pods are removed.")
        self._set_condition("Suspended", True, "Suspended", "spec.suspend is true.")
        self._count_roles()

    def _deadline_ok(self) -> bool:
        deadline = self.ctx.run.spec.active_deadline_seconds
        since = self.status.get("activeSince")
        if deadline is None or not since:
            return True
        ran = (
            float(self.status.get("activeSeconds") or 0)
            + (parse_rfc3339(now_rfc3339()) - parse_rfc3339(since)).total_seconds()
        )
        if ran <= deadline:
            return True
        self._finish(
            "Failed",
            "DeadlineExceeded",
            f"The run has been active {ran:.0f} s, past spec.activeDeadlineSeconds {deadline}.",
        )
        self._remove_pods(keep_finished=True)
        self._count_roles()
        return False

    def _replace_failed_pods(self) -> bool:
        """Deletes failed pods (recreated below) and ends the run when it cannot go on.

        Returns False when the run reached a terminal phase in this pass.
        """
        limit = self.ctx.run.spec.backoff_limit
        outcome = self.old.get("outcome") or {}
        for pod in list(self.pods.values()):
            phase = pod_phase(pod)
            role = pod["metadata"].get("labels", {}).get(objects.ROLE_LABEL)
            if terminating(pod) or phase not in TERMINAL:
                continue
            if role == "server" and phase == "Succeeded":
                self._finish(
                    "Succeeded",
                    str(outcome.get("reason") or "RoundsCompleted"),
                    "The server finished the run.",
                )
                self._remove_pods(keep_finished=True, spare_running=self._in_finish_grace())
                self._count_roles()
                return False
            if phase != "Failed":
                continue
            code, why = pod_exit(pod)
            if (
                role == "server"
                and outcome.get("phase") == "Failed"
                and not outcome.get("retriable")
            ):
                self._finish(
                    "Failed",
                    str(outcome.get("reason") or "ServerFailed"),
                    str(outcome.get("message") or f"The server failed: {why}"),
                )
                self._remove_pods(keep_finished=True)
                self._count_roles()
                return False
            restarts = int(self.status.get("restarts") or 0) + 1
            self.status["restarts"] = restarts
            failed = self.status.setdefault("failedPods", {})
            failed[role] = failed.get(role, 0) + 1
            if restarts > limit:
                self._finish(
                    "Failed",
                    "BackoffLimitExceeded",
                    f"Pod {pod['metadata']['name']} failed (exit code {code}: {why}) and "
                    f"{restarts - 1} failed pods were already recreated (spec.backoffLimit "
                    f"{limit}).",
                )
                self._remove_pods(keep_finished=True)
                self._count_roles()
                return False
            log.warning(
                "Pod %s failed (exit code %s: %s); recreating it (%d of spec.backoffLimit %d).",
                pod["metadata"]["name"],
                code,
                why,
                restarts,
                limit,
            )
            self._delete_pod(pod, grace=0)
            del self.pods[pod["metadata"]["name"]]
        return True

    def _start_pods(self) -> None:
        """Creates missing pods in order: KDC ready, then server ready, then clients."""
        ctx = self.ctx
        if ctx.needs_kdc:
            kdc = self.pods.get(objects.pod_name(self.name, "kdc"))
            if kdc is None:
                self._create(objects.kdc_pod(ctx, resume=self._resuming()))
            ready = kdc is not None and pod_ready(kdc) and not terminating(kdc)
            self._set_condition(
                "KdcReady",
                ready,
                "PodReady" if ready else "Waiting",
                "The KDC pod is ready." if ready else "Waiting for the KDC pod to be ready.",
            )
            if not ready:
                self._set_phase("Pending", "WaitingForKdc", "Waiting for the KDC pod to be ready.")
                return
        server = self.pods.get(objects.pod_name(self.name, "server"))
        if server is None:
            self._create(objects.server_pod(ctx, resume=self._resuming()))
        ready = server is not None and pod_ready(server) and not terminating(server)
        self._set_condition(
            "ServerReady",
            ready,
            "PodReady" if ready else "Waiting",
            "The server pod is ready." if ready else "Waiting for the server pod to be ready.",
        )
        if not ready:
            self._set_phase(
                "Pending", "WaitingForServer", "Waiting for the server pod to be ready."
            )
            return
        self._create_all(
            [
                objects.client_pod(ctx, index)
                for index in range(ctx.run.spec.clients.count)
                if objects.pod_name(self.name, "client", index) not in self.pods
            ]
        )
        clients = [pod for pod in self._role_pods("client") if not terminating(pod)]
        ready_clients = sum(pod_ready(pod) for pod in clients)
        count = ctx.run.spec.clients.count
        quorum = resolve_share(ctx.run.spec.clients.quorum, count)
        self._set_condition(
            "ClientsReady",
            ready_clients >= quorum,
            "QuorumReady" if ready_clients >= quorum else "Waiting",
            f"{ready_clients} of {count} client pods ready (quorum {quorum}).",
        )
        self._set_phase("Running", "Training", "The server is ready and every client pod exists.")

    def _resuming(self) -> bool:
        """Whether a pod made now continues the run (after a failure, a suspension or a
        checkpoint) rather than starting it: then it loads its latest saved state."""
        return bool(
            self.status.get("restarts")
            or self.old.get("lastCheckpoint")
            or self.old.get("phase") == "Suspended"
        )

    # ------------------------------------------------------------------------- status

    def _count_roles(self) -> None:
        failed = self.status.pop("failedPods", {})
        previous = self.old.get("roles") or {}
        spec = self.ctx.run.spec
        roles = {}
        for role, key, desired in (
            ("kdc", "kdc", 1 if self.ctx.needs_kdc else 0),
            ("server", "server", 1),
            ("client", "clients", spec.clients.count),
        ):
            if spec.suspend:
                desired = 0
            before = int((previous.get(key) or {}).get("failed") or 0)
            roles[key] = role_counts(self._role_pods(role), desired, before + failed.get(role, 0))
        self.status["roles"] = roles

    def _set_condition(self, type_: str, value: bool, reason: str, message: str) -> None:
        self.status["conditions"] = set_condition(
            self.status["conditions"], type_, value, reason, message, self.generation
        )

    def _set_phase(self, phase: str, reason: str, message: str) -> None:
        self.status["phase"] = phase
        self.status["reason"] = reason
        self.status["message"] = message
        self._set_condition("Ready", phase == "Running", reason, message)

    def _finish(self, phase: str, reason: str, message: str) -> None:
        self._set_phase(phase, reason, message)
        self.status["completionTime"] = self.old.get("completionTime") or now_rfc3339()
        self._set_condition("Complete", phase == "Succeeded", reason, message)
        self._set_condition("Failed", phase == "Failed", reason, message)
        self.outcome.actions.append(f"{phase}: {reason}")

    def _write_status(self) -> None:
        self.status.pop("failedPods", None)
        self.outcome.phase = self.status.get("phase")
        current = {key: self.old[key] for key in OPERATOR_FIELDS if key in self.old}
        if not differs(self.status, current) and not differs(current, self.status):
            return
        patch: Object = dict(self.status)
        for key in current:
            if key not in patch:
                patch[key] = None
        self.kube.patch("FederatedRun", self.namespace, self.name, {"status": patch}, sub="status")
        self.outcome.writes += 1

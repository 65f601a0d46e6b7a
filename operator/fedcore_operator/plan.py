"""One reconcile pass decided without the API: what was observed in, what to write out.

``plan`` is a pure function. It takes a FederatedRun as the API server returned it, the
objects it owns (pods, Secrets and the other kinds, as listed), the operator's settings and
the current time, and returns the ordered writes that move the cluster towards the run's spec
and the operator's part of the run's status. It calls no API, reads no clock and draws no
random number, so the same observation always gives the same plan.

The rules it encodes (``fedcore_operator.reconcile`` applies them):

- Missing Secrets (pods' certificates; the server's, KDC's and decentralized clients' keys),
  ConfigMap, ServiceAccounts, RBAC, Services and NetworkPolicies are created and drifted fields
  of the latter (``UPDATABLE``) patched back, then the KDC, server and client pods in that
  order, each waiting for the one before to be ready.
- A failed pod is deleted at once (grace 0) and recreated in the same pass while the run's
  failed pods stay within ``spec.backoffLimit``; past it the run fails
  (``BackoffLimitExceeded``). A failed server whose own report (``status.outcome``) says the
  failure is not retriable ends the run with the server's reason; a succeeded server ends it
  with ``Succeeded``. Which client failures end a run in the server is the protocol's dropout
  policy; the operator only sees what the server reported. A decentralized run's pods are
  never replaced alone: any failed pod restarts them all, once (``_restart_peer_graph``).
- ``spec.suspend`` removes every pod and stops the active clock; ``activeDeadlineSeconds``
  counts active time only and fails the run (``DeadlineExceeded``) past it.
- A finished run is never restarted: its pods that have not ended are deleted, except that
  those of a run that succeeded less than ``finish_grace_seconds`` ago may end on their own.
- The status is patched only when the operator's part of it changed.

Certificates and keys are the random part: the plan only says which pods' certificate Secrets
are missing (``IssueCertificates``); whoever applies it loads the run's CA from its Secret in the
operator's namespace, or mints and creates one, and issues them. Likewise it says which
checkpoint key Secrets are missing, the server's, the KDC's and (decentralized protocols) each
client's (``IssueKeys``, once per run: one that exists is never replaced); the applier draws
the keys. A CA Secret still in the run's
namespace (where operators before issue 19 kept it) is moved there first (``MoveCa``).
The CA Secrets of deleted runs, which no owner reference can remove across namespaces, are
found by ``orphaned_ca_secrets``.
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedcore.errors import CheckpointInvalid, SpecError
from fedcore.spec import FederatedRun, parse_manifest, resolve_share
from fedcore.spec._sites import SiteSpec
from fedcore.spec._status import MAX_FAILURES
from fedcore_operator import objects
from fedcore_operator.conditions import (
    differs,
    format_rfc3339,
    parse_rfc3339,
    pod_exit,
    pod_exit_reason,
    pod_phase,
    pod_ready,
    role_counts,
    set_condition,
    terminating,
)
from fedcore_operator.hub.view import HubView, refusal, site_statuses
from fedcore_operator.settings import OperatorSettings

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
STATIC_KINDS = tuple(UPDATABLE)
"""The owned kinds besides Secrets and pods, in the order ``objects.static_objects`` has them."""
TERMINAL = ("Succeeded", "Failed")
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
    "failures",
    "startTime",
    "completionTime",
    "activeSeconds",
    "activeSince",
    "sites",
)
"""The status fields the operator owns; the server patches the others."""


# ------------------------------------------------------------------------------------ input


@dataclass(frozen=True)
class Observed:
    """Everything one pass knows about one run.

    Attributes:
        body: the FederatedRun as the API server returned it (metadata, spec, status); it is
            not being deleted.
        now: the time of the pass (timezone-aware UTC; whole seconds are used).
        settings: the operator's settings.
        pods: the run's pods as listed (labelled with the run).
        owned: the run's other objects as listed, by kind (``Secret`` and ``STATIC_KINDS``); a
            kind that is absent counts as listed empty. ``kinds_to_observe`` says which kinds
            the plan reads.
        hub: for a run at sites (spec.sites), what the hub's endpoint knows of it; None: this
            operator runs no hub.
    """

    body: Object
    now: datetime.datetime
    settings: OperatorSettings
    pods: Sequence[Object] = ()
    owned: Mapping[str, Sequence[Object]] = field(default_factory=dict)
    hub: HubView | None = None


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


def kinds_to_observe(body: Object) -> tuple[str, ...]:
    """The kinds ``plan`` reads for this run, so a pass lists no more than it needs.

    None for an invalid spec, ``Pod`` and ``Secret`` (a CA Secret left in the run's
    namespace is moved out in every phase) for a finished or suspended run, and for a run
    that goes on ``Pod``, ``Secret`` and then ``STATIC_KINDS``.
    """
    try:
        manifest = manifest_of(body)
    except SpecError:
        return ()
    if (body.get("status") or {}).get("phase") in TERMINAL or manifest.spec.suspend:
        return ("Pod", "Secret")
    return ("Pod", "Secret", *STATIC_KINDS)


# ----------------------------------------------------------------------------------- output


@dataclass(frozen=True)
class CreateObjects:
    """Create these objects; they do not depend on each other (several may be in flight).

    An object whose name already exists is left as it is.
    """

    objects: tuple[Object, ...]


@dataclass(frozen=True)
class PatchObject:
    """Apply ``patch`` (a JSON merge patch) to the owned object ``kind``/``name``."""

    kind: str
    name: str
    patch: Object


@dataclass(frozen=True)
class DeletePod:
    """Delete the pod ``name`` in the background; ``grace`` seconds, None: the pod's own."""

    name: str
    grace: int | None = None


@dataclass(frozen=True)
class IssueCertificates:
    """Create the certificate Secrets of these pods, which are missing.

    Not planned purely because keys are random: the applier reads the run's CA Secret
    ``objects.ca_secret_name`` in ``settings.ca_namespace`` and, when it does not exist or
    belongs to a deleted namesake (``objects.ca_secret_is_for``), mints a CA and creates its
    Secret first (``objects.ca_secret``); then it creates every pod's Secret
    (``objects.pod_tls_secret``).

    Attributes:
        context: the run.
        identities: (pod name, certificate common name, client index) of each missing one.
    """

    context: objects.RunContext
    identities: tuple[tuple[str, str, int | None], ...]


@dataclass(frozen=True)
class IssueKeys:
    """Create the key Secrets (``objects.keys_secret``) of these roles, which are missing.

    Not planned purely because keys are random: the applier draws each key
    (``secrets.token_hex(objects.KEY_BYTES)``) and creates the Secret. A Secret of that name
    that exists after all is left as it is: a run's key is never replaced, since its
    checkpoints are readable only with it.

    Attributes:
        context: the run.
        roles: ``("server", None)``, for protocols with a KDC ``("kdc", None)``, and for
            decentralized ones ``("client", i)`` per client (``objects.key_roles``).
    """

    context: objects.RunContext
    roles: tuple[objects.KeyHolder, ...]


@dataclass(frozen=True)
class MoveCa:
    """Move the run's CA out of its namespace: copy ``legacy`` (``<run>-ca``, as listed there)
    into ``objects.ca_secret`` in the operator's namespace (kept if it already exists), then
    delete ``legacy``. The run keeps its CA, so its pods' certificates stay valid."""

    context: objects.RunContext
    legacy: Object


@dataclass(frozen=True)
class Note:
    """A line for the operator's log: an action of the pass, or (``warning``) a warning."""

    text: str
    warning: bool = False


Step = CreateObjects | PatchObject | DeletePod | IssueCertificates | IssueKeys | MoveCa | Note
"""One thing to do; a plan's steps run in order."""


@dataclass(frozen=True)
class Plan:
    """What one pass does.

    Attributes:
        steps: the writes (and log lines) in the order they must happen: each step may rely on
            the ones before it (the KDC's Secret before its pod, a failed pod's delete before
            its replacement's create).
        status: the operator's part of the run's status after the pass (``OPERATOR_FIELDS``).
        status_patch: the merge patch of the status subresource that writes ``status`` (fields
            the operator no longer sets are nulled), or None when nothing changed.
    """

    steps: tuple[Step, ...]
    status: Object
    status_patch: Object | None

    @property
    def phase(self) -> str | None:
        """The run's phase after the pass."""
        phase = self.status.get("phase")
        return None if phase is None else str(phase)


def plan(observed: Observed) -> Plan:
    """Decides one reconcile pass over ``observed.body`` (see the module docstring)."""
    return _Planner(observed).run()


def orphaned_ca_secrets(
    ca_secrets: Sequence[Object], runs: Mapping[str, Sequence[Object]]
) -> list[str]:
    """The names of the CA Secrets whose run is gone, to delete.

    Args:
        ca_secrets: the CA Secrets in the operator's namespace, as listed by
            ``objects.ca_labels`` (listed before ``runs``, so that a run made in between
            has its CA listed after it, or not at all).
        runs: the FederatedRuns of each namespace the Secrets name, as listed; a namespace
            that could not be listed is absent, and its Secrets are kept (nothing is deleted
            on a guess).

    A Secret is an orphan when its namespace was listed and holds no run of its name and uid
    (a run deleted and made again under the same name is another run).
    """
    orphans = []
    for secret in ca_secrets:
        labels = secret["metadata"].get("labels") or {}
        namespace = str(labels.get(objects.CA_NAMESPACE_LABEL) or "")
        if namespace not in runs:
            continue
        alive = {(run["metadata"]["name"], run["metadata"].get("uid")) for run in runs[namespace]}
        if (labels.get(objects.CA_NAME_LABEL), labels.get(objects.CA_UID_LABEL)) not in alive:
            orphans.append(secret["metadata"]["name"])
    return sorted(orphans)


# ---------------------------------------------------------------------------------- planner


class _Planner:
    """The working state of one ``plan`` call; nothing outside it is changed."""

    def __init__(self, observed: Observed) -> None:
        self.observed = observed
        self.settings = observed.settings
        self.body = observed.body
        self.clock = observed.now.astimezone(datetime.UTC).replace(microsecond=0)
        self.now = format_rfc3339(self.clock)
        self.steps: list[Step] = []
        meta = self.body["metadata"]
        self.name: str = meta["name"]
        self.namespace: str = meta["namespace"]
        self.uid: str = meta["uid"]
        self.generation: int | None = meta.get("generation")
        self.old: Object = dict(self.body.get("status") or {})
        self.status: Object = {
            key: copy.deepcopy(self.old[key]) for key in OPERATOR_FIELDS if key in self.old
        }
        self.status.setdefault("conditions", [])
        self.status["observedGeneration"] = self.generation
        # Copies: a pod deleted in this pass is marked terminating here, not in the input.
        self.pods: dict[str, Object] = {
            pod["metadata"]["name"]: copy.deepcopy(pod) for pod in observed.pods
        }

    # ------------------------------------------------------------------------- driver

    def run(self) -> Plan:
        try:
            manifest = manifest_of(self.body)
        except SpecError as exc:
            self._finish("Failed", "InvalidSpec", str(exc))
            return self._result()
        ctx = objects.RunContext(manifest, self.namespace, self.uid, self.settings)
        self.ctx = ctx
        spec = manifest.spec
        self.status["rounds"] = spec.rounds
        self.status["progress"] = f"{self.old.get('round') or 0}/{spec.rounds}"
        self.status.setdefault("restarts", 0)
        self.status.setdefault("startTime", self.now)
        self._move_legacy_ca()

        if self.old.get("phase") in TERMINAL:
            self._remove_pods(keep_finished=True, spare_running=self._in_finish_grace())
            self._count_roles()
            return self._result()
        if spec.suspend:
            self._suspend()
            return self._result()
        if self.old.get("phase") == "Suspended" or not self.status.get("activeSince"):
            self.status["activeSince"] = self.now
            self.status.setdefault("activeSeconds", 0.0)
        self._set_condition("Suspended", False, "Running", "The run is not suspended.")

        if spec.sites is not None and (
            not self._deadline_ok() or not self._hub_serves(spec.sites)
        ):  # waiting for the hub's endpoint counts against the deadline, as pending pods do
            return self._result()
        self._ensure_secrets()
        self._ensure_static()
        if not self._deadline_ok() or not self._replace_failed_pods():
            return self._result()
        self._start_pods()
        self._count_roles()
        return self._result()

    def _result(self) -> Plan:
        self.status.pop("failedPods", None)
        current = {key: self.old[key] for key in OPERATOR_FIELDS if key in self.old}
        patch: Object | None = None
        if differs(self.status, current) or differs(current, self.status):
            patch = dict(self.status)
            for key in current:
                if key not in patch:
                    patch[key] = None
            patch = {"status": patch}
        return Plan(steps=tuple(self.steps), status=self.status, status_patch=patch)

    # ------------------------------------------------------------------------ objects

    def _listed(self, kind: str) -> dict[str, Object]:
        items = self.observed.owned.get(kind) or ()
        return {item["metadata"]["name"]: item for item in items}

    def _create(self, *items: Object) -> None:
        if items:
            self.steps.append(CreateObjects(tuple(items)))

    def _move_legacy_ca(self) -> None:
        """Moves ``<run>-ca`` out of the run's namespace when it is the run's own CA.

        Only a Secret owned by this run whose certificate is the one every issued pod
        Secret carries is taken: anyone else's Secret of that name is left alone, never
        trusted as the run's CA.
        """
        listed = self._listed("Secret")
        legacy = listed.get(objects.legacy_ca_secret_name(self.name))
        if legacy is None:
            return
        owners = {ref.get("uid") for ref in legacy["metadata"].get("ownerReferences") or []}
        ca_crt = (legacy.get("data") or {}).get("ca.crt")
        issued = [
            listed[name]
            for name in (
                objects.tls_secret_name(pod) for pod, _, _ in objects.pod_identities(self.ctx)
            )
            if name in listed
        ]
        if (
            self.uid in owners
            and ca_crt
            and issued
            and all((secret.get("data") or {}).get("ca.crt") == ca_crt for secret in issued)
        ):
            self.steps.append(MoveCa(self.ctx, legacy))

    def _ensure_secrets(self) -> None:
        existing = self._listed("Secret")
        wanted = tuple(
            (pod, cn, index)
            for pod, cn, index in objects.pod_identities(self.ctx)
            if objects.tls_secret_name(pod) not in existing
        )
        if wanted:
            self.steps.append(IssueCertificates(self.ctx, wanted))
        keys = tuple(
            (role, index)
            for role, index in objects.key_roles(self.ctx)
            if objects.keys_secret_name(self.name, role, index) not in existing
        )
        if keys:
            self.steps.append(IssueKeys(self.ctx, keys))

    def _hub_serves(self, sites: Sequence[SiteSpec]) -> bool:
        """For a run at sites: its ``status.sites``; False (nothing more this pass) while the
        hub's endpoint cannot serve it, and when a site refused it (the run fails)."""
        view = self.observed.hub
        if view is None:
            self._set_phase(
                "Pending",
                "NoHub",
                "The run's clients are at sites, and this operator's hub endpoint is off: "
                "set the chart's hub.enabled (the operator's --hub-listen).",
            )
            return False
        self.status["sites"] = site_statuses(
            sites, view, self.old.get("sites") or [], self.clock, self.generation
        )
        refused = refusal(view)
        if refused is not None:
            site, facts = refused
            self._finish(
                "Failed",
                "SiteRefused",
                f"Site {site} refused the run ({facts.reason}): {facts.message}",
            )
            self._remove_pods(keep_finished=True)
            self._count_roles()
            return False
        if not view.serving:
            self._set_condition(
                "HubEndpoint",
                False,
                "EndpointBusy",
                f"The hub's endpoint serves run {view.holder}; it serves one run at a time.",
            )
            self._set_phase(
                "Pending",
                "EndpointBusy",
                f"Waiting for the hub's endpoint, which serves run {view.holder} now.",
            )
            self._count_roles()
            return False
        self._set_condition(
            "HubEndpoint", True, "Serving", "The hub's endpoint serves this run to its sites."
        )
        return True

    def _ensure_static(self) -> None:
        listed = {kind: self._listed(kind) for kind in STATIC_KINDS}
        wanted = objects.static_objects(self.ctx)
        if self.observed.hub is not None and self.ctx.at_sites:
            revoked = [n for n, state in self.observed.hub.registry.items() if state == "Revoked"]
            wanted.append(objects.revoked_sites_config_map(self.ctx, revoked))
        for desired in wanted:
            kind = desired["kind"]
            name = desired["metadata"]["name"]
            actual = listed[kind].get(name)
            if actual is None:
                self._create(desired)
                continue
            patch = {key: desired[key] for key in UPDATABLE[kind] if key in desired}
            if differs(patch, actual):
                self.steps.append(PatchObject(kind, name, patch))

    # --------------------------------------------------------------------------- pods

    def _role_pods(self, role: str) -> list[Object]:
        return [pod for pod in self.pods.values() if _role(pod) == role]

    def _delete_pod(self, pod: Object, grace: int | None = None) -> None:
        if terminating(pod):
            return
        self.steps.append(DeletePod(pod["metadata"]["name"], grace))
        pod["metadata"]["deletionTimestamp"] = self.now

    def _remove_pods(self, *, keep_finished: bool, spare_running: bool = False) -> None:
        """Deletes the run's pods: all, or (``keep_finished``) those that have not ended; with
        ``spare_running``, pods that still run are left to end on their own for now."""
        for pod in self.pods.values():
            if keep_finished and pod_phase(pod) in TERMINAL:
                continue
            if spare_running and not terminating(pod):
                continue
            self._delete_pod(pod)

    def _seconds_since(self, stamp: str) -> float:
        return (self.clock - parse_rfc3339(stamp)).total_seconds()

    def _in_finish_grace(self) -> bool:
        """Whether the run succeeded less than ``finish_grace_seconds`` ago: its clients may
        still be writing their final models (lppa's are the run's result) and exit by
        themselves; a later pass (a pod's exit or the resync) deletes whoever outlasts it."""
        if self.status.get("phase", self.old.get("phase")) != "Succeeded":
            return False
        done = self.status.get("completionTime") or self.old.get("completionTime")
        if not done:
            return False
        return self._seconds_since(done) < self.settings.finish_grace_seconds

    def _suspend(self) -> None:
        self._remove_pods(keep_finished=False)
        if self.old.get("phase") != "Suspended":
            since = self.status.get("activeSince")
            if since:
                ran = self._seconds_since(since)
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
        ran = float(self.status.get("activeSeconds") or 0) + self._seconds_since(since)
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

    def _record_failure(self, pod: Object, role: str | None, code: int | None, action: str) -> None:
        """Appends a failed pod to status.failures, keeping the latest MAX_FAILURES."""
        entry = {
            "time": self.now,
            "pod": pod["metadata"]["name"],
            "role": role or "",
            "exitCode": code,
            "reason": pod_exit_reason(pod),
            "action": action,
        }
        failures = [*(self.status.get("failures") or []), entry]
        self.status["failures"] = failures[-MAX_FAILURES:]

    def _replace_failed_pods(self) -> bool:
        """Deletes failed pods (recreated below) and ends the run when it cannot go on.

        Returns False when the run reached a terminal phase in this pass.
        """
        limit = self.ctx.run.spec.backoff_limit
        outcome = self.old.get("outcome") or {}
        if self._ended_by_unreadable_checkpoint(outcome):
            return False
        for pod in list(self.pods.values()):
            phase = pod_phase(pod)
            role = _role(pod)
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
                self._record_failure(pod, role, code, "RunFailed")
                self._finish(
                    "Failed",
                    str(outcome.get("reason") or "ServerFailed"),
                    str(outcome.get("message") or f"The server failed: {why}"),
                )
                self._remove_pods(keep_finished=True)
                self._count_roles()
                return False
            if self.ctx.decentralized:
                return self._restart_peer_graph(pod, code, why)
            restarts = self._count_restart([pod])
            if restarts > limit:
                return self._give_up(
                    f"Pod {pod['metadata']['name']} failed (exit code {code}: {why}) and "
                    f"{restarts - 1} failed pods were already recreated (spec.backoffLimit "
                    f"{limit})."
                )
            self.steps.append(
                Note(
                    f"Pod {pod['metadata']['name']} failed (exit code {code}: {why}); "
                    f"recreating it ({restarts} of spec.backoffLimit {limit}).",
                    warning=True,
                )
            )
            self._delete_pod(pod, grace=0)
            del self.pods[pod["metadata"]["name"]]
        return True

    def _ended_by_unreadable_checkpoint(self, outcome: Mapping[str, Any]) -> bool:
        """Ends the run when a pod's role could not restore the checkpoint it must resume from
        (exit code ``CheckpointInvalid.EXIT_CODE``; not once the server succeeded): a new pod
        would read the same checkpoint, so the run fails (reason ``CheckpointInvalid``; the
        server's message when it said more) instead of spending ``spec.backoffLimit``. Looked
        for before any other failed pod: a decentralized run's peers fail with it (their links
        to it end), and a restart for them would be spent in vain.

        Returns whether it ended the run (a terminal phase)."""
        live = [pod for pod in self.pods.values() if not terminating(pod)]
        if any(pod_phase(pod) == "Succeeded" and _role(pod) == "server" for pod in live):
            return False
        failed = [pod for pod in live if pod_phase(pod) == "Failed"]
        unreadable = [pod for pod in failed if pod_exit(pod)[0] == CheckpointInvalid.EXIT_CODE]
        if not unreadable:
            return False
        for pod in failed:
            self._record_failure(pod, _role(pod), pod_exit(pod)[0], "RunFailed")
        name = unreadable[0]["metadata"]["name"]
        why = pod_exit(unreadable[0])[1]
        message = (
            str(outcome["message"])
            if outcome.get("reason") == "CheckpointInvalid" and outcome.get("message")
            else (
                f"Pod {name} cannot restore the checkpoint it must resume from (exit code "
                f"{CheckpointInvalid.EXIT_CODE}: {why}); a new pod would read the same checkpoint, "
                f"so the run stops. Its log says which checkpoint and why (`kubectl logs "
                f"{name}`)."
            )
        )
        self._finish("Failed", "CheckpointInvalid", message)
        self._remove_pods(keep_finished=True)
        self._count_roles()
        return True

    def _restart_peer_graph(self, pod: Object, code: int | None, why: str) -> bool:
        """A pod of a decentralized run failed: every client's state assumes every other
        (noise, mixing weights), so no pod can be replaced alone. Every pod of the run is
        deleted, one restart counted; the server is made again with resume, then the clients,
        each of which restores its own checkpoint of the round the server resumes from (a
        consistent cut: the server checkpoints only once every client did). Other pods that
        failed in the same pass are recorded with it.

        Returns False when the run reached a terminal phase in this pass.
        """
        limit = self.ctx.run.spec.backoff_limit
        restarts = self._count_restart(
            [pod]
            + [
                other
                for other in self.pods.values()
                if other is not pod and pod_phase(other) == "Failed" and not terminating(other)
            ]
        )
        name = pod["metadata"]["name"]
        if restarts > limit:
            return self._give_up(
                f"Pod {name} failed (exit code {code}: {why}) and the run's pods were already "
                f"restarted {restarts - 1} times (spec.backoffLimit {limit})."
            )
        self.steps.append(
            Note(
                f"Pod {name} failed (exit code {code}: {why}); protocol "
                f"{self.ctx.run.spec.protocol.name!r} runs on a fixed peer graph, so every pod "
                f"of the run starts again from its checkpoint ({restarts} of spec.backoffLimit "
                f"{limit}).",
                warning=True,
            )
        )
        for name in sorted(self.pods):
            self._delete_pod(self.pods.pop(name), grace=0)
        return True

    def _count_restart(self, failed: list[Object]) -> int:
        """Counts one restart for these failed pods (``status.restarts``, each in its role's
        failed count and in ``status.failures``); returns the restarts so far."""
        restarts = int(self.status.get("restarts") or 0) + 1
        self.status["restarts"] = restarts
        action = "RunFailed" if restarts > self.ctx.run.spec.backoff_limit else "Recreated"
        counts = self.status.setdefault("failedPods", {})
        for pod in failed:
            role = _role(pod)
            counts[role] = counts.get(role, 0) + 1
            self._record_failure(pod, role, pod_exit(pod)[0], action)
        return restarts

    def _give_up(self, message: str) -> bool:
        """Ends the run past ``spec.backoffLimit``; returns False (a terminal phase)."""
        self._finish("Failed", "BackoffLimitExceeded", message)
        self._remove_pods(keep_finished=True)
        self._count_roles()
        return False

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
        if ctx.at_sites:
            self._set_phase(
                "Running", "Training", "The server is ready; the sites' clients join it."
            )
            return
        self._create(
            *(
                objects.client_pod(ctx, index)
                for index in range(ctx.local_clients)
                if objects.pod_name(self.name, "client", index) not in self.pods
            )
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
            ("client", "clients", self.ctx.local_clients),
        ):
            if spec.suspend:
                desired = 0
            before = int((previous.get(key) or {}).get("failed") or 0)
            roles[key] = role_counts(self._role_pods(role), desired, before + failed.get(role, 0))
        self.status["roles"] = roles

    def _set_condition(self, type_: str, value: bool, reason: str, message: str) -> None:
        self.status["conditions"] = set_condition(
            self.status["conditions"], type_, value, reason, message, self.generation, self.now
        )

    def _set_phase(self, phase: str, reason: str, message: str) -> None:
        self.status["phase"] = phase
        self.status["reason"] = reason
        self.status["message"] = message
        self._set_condition("Ready", phase == "Running", reason, message)

    def _finish(self, phase: str, reason: str, message: str) -> None:
        self._set_phase(phase, reason, message)
        self.status["completionTime"] = self.old.get("completionTime") or self.now
        self._set_condition("Complete", phase == "Succeeded", reason, message)
        self._set_condition("Failed", phase == "Failed", reason, message)
        self.steps.append(Note(f"{phase}: {reason}"))


def _role(pod: Object) -> str | None:
    """The role a pod of a run plays (its ``objects.ROLE_LABEL``), None without the label."""
    role = pod["metadata"].get("labels", {}).get(objects.ROLE_LABEL)
    return None if role is None else str(role)

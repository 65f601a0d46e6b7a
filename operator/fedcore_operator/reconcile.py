"""One level-triggered reconcile of one FederatedRun: observe, plan, apply.

Each pass reads the run and everything it owns (no more kinds than
``plan.kinds_to_observe`` names), hands that to the pure ``plan.plan`` with the current time,
and carries out the plan's steps in order through ``Kube``: creates (several in flight when
many objects are missing, as for a 1,000-client run), patches, pod deletes, and last the
status patch, written only when the operator's part of the status changed. A pass over a run
that needs nothing writes nothing. The rules themselves live in ``fedcore_operator.plan``.

Certificates are minted here, not planned: keys are random, so an ``IssueCertificates`` step
loads the run's CA from its Secret in the operator's namespace (or generates one and creates
its Secret first) and issues the missing pods' certificate Secrets. That Secret has no owner
reference (none can cross namespaces): ``forget`` deletes it when the run is deleted, and
``collect_orphans`` deletes those whose run went while no operator watched. Likewise an
``IssueKeys`` step draws the missing checkpoint keys and creates their Secrets (one that exists
is never replaced).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from secrets import token_hex
from typing import Any

from kubernetes.client.exceptions import ApiException

from fedcore.transport import RunCa
from fedcore_operator import objects
from fedcore_operator.hub.service import HubService
from fedcore_operator.kube import Kube
from fedcore_operator.plan import (
    CreateObjects,
    DeletePod,
    IssueCertificates,
    IssueKeys,
    MoveCa,
    Note,
    Observed,
    PatchObject,
    Step,
    kinds_to_observe,
    manifest_of,
    orphaned_ca_secrets,
    plan,
)
from fedcore_operator.settings import OperatorSettings

__all__ = [
    "CREATE_CONCURRENCY",
    "Outcome",
    "Reconciler",
    "apply_write",
    "create_all",
    "manifest_of",
]

log = logging.getLogger(__name__)

Object = dict[str, Any]
CREATE_CONCURRENCY = 8
"""Create requests in flight at once when many objects are missing."""


@dataclass
class Outcome:
    """What one reconcile pass did."""

    phase: str | None = None
    writes: int = 0
    actions: list[str] = field(default_factory=list)


def create_all(kube: Kube, items: list[Object], outcome: Outcome) -> None:
    """Creates objects, several requests in flight at once (a 1,000-client run); counts each
    one created in ``outcome`` (one that exists already is left as it is)."""
    if len(items) > 1:
        with ThreadPoolExecutor(CREATE_CONCURRENCY) as pool:
            created = list(pool.map(kube.create, items))
    else:
        created = [kube.create(item) for item in items]
    for obj, result in zip(items, created, strict=True):
        if result is not None:
            outcome.writes += 1
            outcome.actions.append(f"created {obj['kind']}/{obj['metadata']['name']}")


def apply_write(kube: Kube, step: object, namespace: str, outcome: Outcome) -> bool:
    """Carries out the steps both reconcilers plan (creates, patches, pod deletes, notes);
    returns False for any other step, which the caller carries out."""
    if isinstance(step, CreateObjects):
        create_all(kube, list(step.objects), outcome)
    elif isinstance(step, PatchObject):
        kube.patch(step.kind, namespace, step.name, step.patch)
        outcome.writes += 1
        outcome.actions.append(f"updated {step.kind}/{step.name}")
    elif isinstance(step, DeletePod):
        if kube.delete("Pod", namespace, step.name, step.grace):
            outcome.writes += 1
            outcome.actions.append(f"deleted Pod/{step.name}")
    elif isinstance(step, Note):
        if step.warning:
            log.warning("%s", step.text)
        else:
            outcome.actions.append(step.text)
    else:
        return False
    return True


class Reconciler:
    """Reconciles runs through a ``Kube``; one instance serves every run.

    Args:
        kube: the API access (its write hook counts writes).
        settings: the operator's settings (image, ports).
    """

    def __init__(
        self, kube: Kube, settings: OperatorSettings, hub: HubService | None = None
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.hub = hub
        """The hub's endpoint (mode hub or both with the chart's hub.enabled), or None."""

    def reconcile(self, namespace: str, name: str) -> Outcome:
        """Runs one pass over the run ``namespace/name``; a vanished run is a no-op."""
        body = self.kube.get("FederatedRun", namespace, name)
        outcome = Outcome()
        if body is None or body["metadata"].get("deletionTimestamp"):
            return outcome
        observed = self.observe(body)
        decided = plan(observed)
        for step in decided.steps:
            self._apply(step, namespace, outcome)
        outcome.phase = decided.phase
        if decided.status_patch is not None:
            self.kube.patch("FederatedRun", namespace, name, decided.status_patch, sub="status")
            outcome.writes += 1
        if observed.hub is not None and observed.hub.serving:
            self._serve_at_hub(body, observed, decided.phase)
        return outcome

    def _serve_at_hub(self, body: Object, observed: Observed, phase: str | None) -> None:
        """Points the hub's endpoint at the run's server and KDC, or frees it once the run
        has ended."""
        assert self.hub is not None
        meta = body["metadata"]
        if phase in ("Succeeded", "Failed"):
            self.hub.release(meta["namespace"], meta["name"])
            return
        secret = self.kube.get(
            "Secret",
            self.settings.ca_namespace,
            objects.ca_secret_name(meta["namespace"], meta["name"]),
        )
        if secret is None or not objects.ca_secret_is_for(secret, meta["uid"]):
            return  # the next pass, once the CA is made
        self.hub.serve(body, manifest_of(body), observed.pods, objects.load_ca(secret))

    def observe(self, body: Object) -> Observed:
        """Lists what the plan for ``body`` reads, and stamps the pass with the current time."""
        meta = body["metadata"]
        labels = objects.label_selector(objects.selector(meta["name"]))
        listed = {
            kind: self.kube.list(kind, meta["namespace"], labels) for kind in kinds_to_observe(body)
        }
        at_sites = (body.get("spec") or {}).get("sites") is not None
        return Observed(
            body=body,
            now=datetime.datetime.now(datetime.UTC),
            settings=self.settings,
            pods=listed.pop("Pod", []),
            owned=listed,
            hub=self.hub.view(body) if at_sites and self.hub is not None else None,
        )

    # -------------------------------------------------------------------------- apply

    def _apply(self, step: Step, namespace: str, outcome: Outcome) -> None:
        if apply_write(self.kube, step, namespace, outcome):
            return
        if isinstance(step, IssueCertificates):
            self._issue_certificates(step, outcome)
        elif isinstance(step, IssueKeys):
            ctx = step.context
            self._create_all(
                [
                    objects.keys_secret(ctx, role, token_hex(objects.KEY_BYTES), index)
                    for role, index in step.roles
                ],
                outcome,
            )
        elif isinstance(step, MoveCa):
            self._move_ca(step, namespace, outcome)

    def _create_all(self, items: list[Object], outcome: Outcome) -> None:
        create_all(self.kube, items, outcome)

    def _issue_certificates(self, step: IssueCertificates, outcome: Outcome) -> None:
        """Loads or mints the run's CA, then creates the missing pods' certificate Secrets."""
        ctx = step.context
        ca = self._run_ca(ctx, outcome)
        self._create_all(
            [
                objects.pod_tls_secret(ctx, ca, pod, common_name, index)
                for pod, common_name, index in step.identities
            ],
            outcome,
        )

    def _run_ca(self, ctx: objects.RunContext, outcome: Outcome) -> RunCa:
        """The run's CA from its Secret in the operator's namespace, made when missing.

        A Secret of that name left by a deleted run of the same name is replaced.
        """
        where = ctx.settings.ca_namespace
        name = objects.ca_secret_name(ctx.namespace, ctx.name)
        for _ in range(3):
            secret = self.kube.get("Secret", where, name)
            if secret is not None and objects.ca_secret_is_for(secret, ctx.uid):
                return objects.load_ca(secret)
            if secret is not None:
                uid = secret["metadata"]["uid"]
                if self.kube.delete("Secret", where, name, uid=uid):
                    outcome.writes += 1
                    outcome.actions.append(f"deleted Secret/{name} of an earlier run")
            ca = RunCa.generate(ctx.name)
            if self.kube.create(objects.ca_secret(ctx, ca)) is not None:
                outcome.writes += 1
                outcome.actions.append(f"created Secret/{name} in {where}")
                return ca
        raise RuntimeError(f"Secret {where}/{name} keeps changing; the next pass retries.")

    def _move_ca(self, step: MoveCa, namespace: str, outcome: Outcome) -> None:
        """Copies a CA Secret left in the run's namespace to the operator's, then deletes it."""
        ctx = step.context
        moved = objects.ca_secret_from(ctx, objects.ca_pem_of(step.legacy))
        where, name = moved["metadata"]["namespace"], moved["metadata"]["name"]
        existing = self.kube.get("Secret", where, name)
        if existing is not None and not objects.ca_secret_is_for(existing, ctx.uid):
            # A deleted namesake's, not yet collected: this run's own CA takes its place.
            self.kube.delete("Secret", where, name, uid=existing["metadata"]["uid"])
            existing = None
        if existing is None and self.kube.create(moved) is None:
            raise RuntimeError(f"Secret {where}/{name} keeps changing; the next pass retries.")
        if existing is None:
            outcome.writes += 1
        legacy = step.legacy["metadata"]
        if self.kube.delete("Secret", namespace, legacy["name"], uid=legacy.get("uid")):
            outcome.writes += 1
            outcome.actions.append(
                f"moved Secret/{legacy['name']} to {ctx.settings.ca_namespace}/"
                f"{moved['metadata']['name']}"
            )

    # ------------------------------------------------------------------ CA custody

    def forget(self, namespace: str, name: str, uid: str | None) -> bool:
        """Deletes the CA Secret of the deleted run ``namespace/name`` (with ``uid``).

        Returns whether it deleted one; a Secret of a newer run of that name is kept.
        """
        if self.hub is not None:
            self.hub.release(namespace, name)
        where = self.settings.ca_namespace
        secret_name = objects.ca_secret_name(namespace, name)
        secret = self.kube.get("Secret", where, secret_name)
        if secret is None or (uid is not None and not objects.ca_secret_is_for(secret, uid)):
            return False
        return self.kube.delete("Secret", where, secret_name, uid=secret["metadata"]["uid"])

    def collect_orphans(self) -> list[str]:
        """Deletes the CA Secrets whose run is gone (``plan.orphaned_ca_secrets``); their names.

        Namespaces whose runs cannot be listed (not watched, forbidden) are skipped.
        """
        where = self.settings.ca_namespace
        selector = objects.label_selector(objects.ca_labels())
        secrets = self.kube.list("Secret", where, selector)
        runs: dict[str, Sequence[Object]] = {}
        for namespace in sorted(
            {
                (secret["metadata"].get("labels") or {}).get(objects.CA_NAMESPACE_LABEL, "")
                for secret in secrets
            }
            - {""}
        ):
            try:
                runs[namespace] = self.kube.list("FederatedRun", namespace, "")
            except ApiException as exc:
                log.warning("Cannot list FederatedRuns in %s (%s); skipped.", namespace, exc.reason)
        by_name: Mapping[str, Object] = {item["metadata"]["name"]: item for item in secrets}
        deleted = []
        for orphan in orphaned_ca_secrets(secrets, runs):
            uid = by_name[orphan]["metadata"].get("uid")
            if self.kube.delete("Secret", where, orphan, uid=uid):
                deleted.append(orphan)
        return deleted

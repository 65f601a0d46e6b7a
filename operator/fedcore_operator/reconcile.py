"""One level-triggered reconcile of one FederatedRun: observe, plan, apply.

Each pass reads the run and everything it owns (no more kinds than
``plan.kinds_to_observe`` names), hands that to the pure ``plan.plan`` with the current time,
and carries out the plan's steps in order through ``Kube``: creates (several in flight when
many objects are missing, as for a 1,000-client run), patches, pod deletes, and last the
status patch, written only when the operator's part of the status changed. A pass over a run
that needs nothing writes nothing. The rules themselves live in ``fedcore_operator.plan``.

Certificates are minted here, not planned: keys are random, so an ``IssueCertificates`` step
loads the run's CA from its Secret (or generates one and creates its Secret first) and issues
the missing pods' certificate Secrets.
"""

from __future__ import annotations

import datetime
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fedcore.transport import RunCa
from fedcore_operator import objects
from fedcore_operator.kube import Kube
from fedcore_operator.plan import (
    CreateObjects,
    DeletePod,
    IssueCertificates,
    Note,
    Observed,
    PatchObject,
    Step,
    kinds_to_observe,
    manifest_of,
    plan,
)
from fedcore_operator.settings import OperatorSettings

__all__ = ["CREATE_CONCURRENCY", "Outcome", "Reconciler", "manifest_of"]

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
        observed = self.observe(body)
        decided = plan(observed)
        for step in decided.steps:
            self._apply(step, namespace, outcome)
        outcome.phase = decided.phase
        if decided.status_patch is not None:
            self.kube.patch("FederatedRun", namespace, name, decided.status_patch, sub="status")
            outcome.writes += 1
        return outcome

    def observe(self, body: Object) -> Observed:
        """Lists what the plan for ``body`` reads, and stamps the pass with the current time."""
        meta = body["metadata"]
        labels = objects.label_selector(objects.selector(meta["name"]))
        listed = {
            kind: self.kube.list(kind, meta["namespace"], labels) for kind in kinds_to_observe(body)
        }
        return Observed(
            body=body,
            now=datetime.datetime.now(datetime.UTC),
            settings=self.settings,
            pods=listed.pop("Pod", []),
            owned=listed,
        )

    # -------------------------------------------------------------------------- apply

    def _apply(self, step: Step, namespace: str, outcome: Outcome) -> None:
        if isinstance(step, CreateObjects):
            self._create_all(list(step.objects), outcome)
        elif isinstance(step, PatchObject):
            self.kube.patch(step.kind, namespace, step.name, step.patch)
            outcome.writes += 1
            outcome.actions.append(f"updated {step.kind}/{step.name}")
        elif isinstance(step, DeletePod):
            if self.kube.delete("Pod", namespace, step.name, step.grace):
                outcome.writes += 1
                outcome.actions.append(f"deleted Pod/{step.name}")
        elif isinstance(step, IssueCertificates):
            self._issue_certificates(step, outcome)
        elif isinstance(step, Note):
            if step.warning:
                log.warning("%s", step.text)
            else:
                outcome.actions.append(step.text)

    def _create_all(self, items: list[Object], outcome: Outcome) -> None:
        """Creates objects, several requests in flight at once (a 1,000-client run)."""
        if len(items) > 1:
            with ThreadPoolExecutor(CREATE_CONCURRENCY) as pool:
                created = list(pool.map(self.kube.create, items))
        else:
            created = [self.kube.create(item) for item in items]
        for obj, result in zip(items, created, strict=True):
            if result is not None:
                outcome.writes += 1
                outcome.actions.append(f"created {obj['kind']}/{obj['metadata']['name']}")

    def _issue_certificates(self, step: IssueCertificates, outcome: Outcome) -> None:
        """Loads or mints the run's CA, then creates the missing pods' certificate Secrets."""
        ctx = step.context
        ca: RunCa
        if step.ca_secret is not None:
            ca = objects.load_ca(step.ca_secret)
        else:
            ca = RunCa.generate(ctx.name)
            self._create_all([objects.ca_secret(ctx, ca)], outcome)
        self._create_all(
            [
                objects.pod_tls_secret(ctx, ca, pod, common_name, index)
                for pod, common_name, index in step.identities
            ],
            outcome,
        )

"""The operator's event loop: kopf watches, a coalescing queue of runs, the webhook.

kopf delivers raw watch events (no handler state is written into the objects): a change to a
FederatedRun, or to a pod it owns, marks that run dirty, and one worker per run reconciles it
(several triggers while a pass runs cause one more pass, not many). Every run is also
reconciled every ``resync_seconds`` (deadlines, missed events). A run's deletion deletes its
CA Secret in the operator's namespace (no owner reference reaches there), and every
``resync_seconds`` the CA Secrets of runs deleted while no operator watched are collected.
Participations (mode site) have a queue of their own, resynced every
``site_resync_seconds``: the hub's run moves on without any event in the site's cluster. The
validating webhook (FederatedRuns, Participations) is served by kopf on the same loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf

from fedcore_operator import admission, objects
from fedcore_operator.crd import GROUP, PLURAL, VERSION
from fedcore_operator.hub.service import HubService
from fedcore_operator.metrics import OperatorMetrics
from fedcore_operator.reconcile import Outcome, Reconciler
from fedcore_operator.site import objects as site_objects
from fedcore_operator.site.reconcile import SiteReconciler

log = logging.getLogger(__name__)

Key = tuple[str, str]
COALESCE_SECONDS = 0.2
"""How long a trigger waits for more before the pass starts (bursts of pod events)."""
SITE_RESYNC_SECONDS = 5.0
"""How often each Participation asks the hub about its run."""
PARTICIPATION_PLURAL = "participations"


@dataclass(frozen=True)
class WebhookConfig:
    """Where the validating webhook listens and how the API server reaches it.

    Attributes:
        port: the HTTPS port.
        address: the bind address.
        host: the name or address the API server calls (kopf-managed configuration).
        certfile, keyfile: the serving certificate and key (PEM files).
        cafile: the CA that signed the certificate (the configuration's caBundle).
        managed: when set, kopf creates the ValidatingWebhookConfiguration of this name;
            when None, it is installed separately (the Helm chart does).
    """

    port: int
    address: str = "0.0.0.0"
    host: str | None = None
    certfile: Path | None = None
    keyfile: Path | None = None
    cafile: Path | None = None
    managed: str | None = None


class RunQueue:
    """Coalesces triggers per object and reconciles each in one worker at a time.

    Args:
        reconcile: one pass over ``(namespace, name)``.
        metrics: the operator's metrics (reconciles, durations).
        observe_phase: records an object's phase (default: the runs' gauge).
    """

    def __init__(
        self,
        reconcile: Callable[[str, str], Outcome],
        metrics: OperatorMetrics,
        observe_phase: Callable[[Key, str | None], None] | None = None,
    ) -> None:
        self._reconcile = reconcile
        self._metrics = metrics
        self._observe_phase = observe_phase or metrics.observe_phase
        self._dirty: dict[Key, asyncio.Event] = {}
        self._workers: dict[Key, asyncio.Task[None]] = {}
        self.known: set[Key] = set()
        self.resyncer: asyncio.Task[None] | None = None
        self.collector: asyncio.Task[None] | None = None
        self.site_syncer: asyncio.Task[None] | None = None

    def trigger(self, key: Key) -> None:
        """Marks ``key`` for a reconcile pass soon."""
        self.known.add(key)
        event = self._dirty.setdefault(key, asyncio.Event())
        event.set()
        worker = self._workers.get(key)
        if worker is None or worker.done():
            self._workers[key] = asyncio.create_task(self._work(key, event))

    def forget(self, key: Key) -> None:
        """Stops tracking a deleted run."""
        self.known.discard(key)
        self._observe_phase(key, None)

    async def resync(self, seconds: float) -> None:
        """Triggers every known run every ``seconds``, forever."""
        while True:
            await asyncio.sleep(seconds)
            for key in list(self.known):
                self.trigger(key)

    async def _work(self, key: Key, event: asyncio.Event) -> None:
        while event.is_set():
            await asyncio.sleep(COALESCE_SECONDS)
            event.clear()
            await asyncio.to_thread(self._one_pass, key)

    def _one_pass(self, key: Key) -> None:
        namespace, name = key
        started = time.perf_counter()
        try:
            outcome = self._reconcile(namespace, name)
        except Exception:
            self._metrics.reconciles.labels("error").inc()
            log.exception("Reconcile of %s/%s failed; it will be retried.", namespace, name)
            return
        finally:
            self._metrics.reconcile_duration.observe(time.perf_counter() - started)
        self._metrics.reconciles.labels("changed" if outcome.writes else "unchanged").inc()
        self._observe_phase(key, outcome.phase)
        for action in outcome.actions:
            log.info("%s/%s: %s", namespace, name, action)


def build_registry(
    reconciler: Reconciler | None,
    metrics: OperatorMetrics,
    *,
    resync_seconds: float,
    webhook: WebhookConfig | None,
    site: SiteReconciler | None = None,
    site_resync_seconds: float = SITE_RESYNC_SECONDS,
    hub: HubService | None = None,
) -> kopf.OperatorRegistry:
    """Registers the operator's kopf handlers in a fresh registry: FederatedRuns' with a
    ``reconciler`` (the hub's part), Participations' with a ``site`` reconciler; with a
    ``hub`` endpoint, its site list is synced every ``resync_seconds`` and a site's word
    about a run triggers that run's pass."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 270
        settings.networking.request_timeout = 60
        if webhook is not None:
            settings.admission.server = kopf.WebhookServer(
                addr=webhook.address,
                port=webhook.port,
                host=webhook.host,
                certfile=webhook.certfile,
                pkeyfile=webhook.keyfile,
                cafile=webhook.cafile,
            )
            settings.admission.managed = webhook.managed

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info()

    if site is not None:
        _register_site(registry, site, metrics, site_resync_seconds, webhook is not None)
    if reconciler is None:
        return registry
    queue = RunQueue(reconciler.reconcile, metrics)

    @kopf.on.startup(registry=registry)
    async def start_resync(**_: Any) -> None:
        queue.resyncer = asyncio.create_task(queue.resync(resync_seconds))
        queue.collector = asyncio.create_task(
            every(
                resync_seconds,
                reconciler.collect_orphans,
                "Deleted the CA Secret of a deleted run: ",
                "Collecting the CA Secrets of deleted runs",
            )
        )
        if hub is not None:
            loop = asyncio.get_running_loop()

            def notify(namespace: str, name: str) -> None:
                loop.call_soon_threadsafe(queue.trigger, (namespace, name))

            hub.notify = notify
            queue.site_syncer = asyncio.create_task(
                every(resync_seconds, hub.sync_sites, "Hub: ", "Syncing the hub's sites")
            )

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def run_changed(**kwargs: Any) -> None:
        key = (kwargs["namespace"], kwargs["name"])
        if kwargs["event"].get("type") == "DELETED":
            queue.forget(key)
            uid = (kwargs.get("body") or {}).get("metadata", {}).get("uid")
            await forget_ca(key, uid)
            return
        queue.trigger(key)

    async def forget_ca(key: Key, uid: str | None) -> None:
        try:
            if await asyncio.to_thread(reconciler.forget, key[0], key[1], uid):
                log.info("%s/%s: deleted its CA Secret (the run was deleted)", *key)
        except Exception:
            log.exception("Deleting the CA Secret of %s/%s failed; collected later.", *key)

    @kopf.on.event(
        "v1", "pods", labels={"app.kubernetes.io/managed-by": objects.MANAGED_BY}, registry=registry
    )
    async def pod_changed(**kwargs: Any) -> None:
        run = kwargs["labels"].get(objects.RUN_LABEL)
        if run:
            queue.trigger((kwargs["namespace"], run))

    if webhook is not None:

        @kopf.on.validate(
            GROUP,
            VERSION,
            PLURAL,
            id="validate-run",
            operations=["CREATE", "UPDATE"],
            registry=registry,
        )
        def validate_run(**kwargs: Any) -> None:
            old = kwargs.get("old")
            problems = admission.check(
                dict(kwargs["body"]),
                dict(old) if old else None,
                kwargs.get("operation") or "CREATE",
            )
            if problems:
                raise kopf.AdmissionError("; ".join(problems), code=422)

    return registry


def _register_site(
    registry: kopf.OperatorRegistry,
    site: SiteReconciler,
    metrics: OperatorMetrics,
    resync_seconds: float,
    validate: bool,
) -> None:
    """Participations: each reconciled on a change to it or to a pod it owns, and every
    ``resync_seconds`` (the hub's run moves on without any event in this cluster); with
    ``validate``, the webhook refuses an invalid one, naming the field."""
    queue = RunQueue(site.reconcile, metrics, metrics.participations.observe)
    if validate:

        @kopf.on.validate(
            GROUP,
            VERSION,
            PARTICIPATION_PLURAL,
            id="validate-participation",
            operations=["CREATE", "UPDATE"],
            registry=registry,
        )
        def validate_participation(**kwargs: Any) -> None:
            problems = admission.check_participation(dict(kwargs["body"]))
            if problems:
                raise kopf.AdmissionError("; ".join(problems), code=422)

    @kopf.on.startup(registry=registry)
    async def start_site_resync(**_: Any) -> None:
        queue.resyncer = asyncio.create_task(queue.resync(resync_seconds))

    @kopf.on.event(GROUP, VERSION, PARTICIPATION_PLURAL, registry=registry)
    async def participation_changed(**kwargs: Any) -> None:
        key = (kwargs["namespace"], kwargs["name"])
        if kwargs["event"].get("type") == "DELETED":
            queue.forget(key)
            return
        queue.trigger(key)

    @kopf.on.event(
        "v1",
        "pods",
        labels={site_objects.PARTICIPATION_LABEL: kopf.PRESENT},
        registry=registry,
    )
    async def site_pod_changed(**kwargs: Any) -> None:
        owner = kwargs["labels"].get(site_objects.PARTICIPATION_LABEL)
        if owner:
            queue.trigger((kwargs["namespace"], owner))


async def every(seconds: float, work: Callable[[], list[str]], done: str, what: str) -> None:
    """Runs ``work`` (in a thread) now and every ``seconds``, forever: each line it returns
    is logged after ``done``; a failure is logged as ``what`` failing, and retried."""
    while True:
        try:
            for line in await asyncio.to_thread(work):
                log.info("%s%s", done, line)
        except Exception:
            log.exception("%s failed; retried later.", what)
        await asyncio.sleep(seconds)


def connection_info() -> kopf.ConnectionInfo:
    """kopf's credentials from the ``kubernetes`` package's loaded configuration.

    One source of truth: ``--kubeconfig`` or the in-cluster ServiceAccount, loaded once by
    ``kubernetes.config``; a rotated in-cluster token is re-read by its refresh hook.
    """
    from kubernetes import client

    configuration = client.Configuration.get_default_copy()
    header = configuration.get_api_key_with_prefix("BearerToken", alias="authorization") or ""
    scheme, _, rest = header.partition(" ")
    token = (rest if scheme.lower() == "bearer" else header).strip() or None
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
        scheme="Bearer" if token else None,
        token=token,
    )

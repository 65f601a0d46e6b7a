"""The hub's endpoint in the operator (mode hub or both): one port for every site.

:class:`HubService` runs ``fedcore.sites.hub.HubEndpoint`` (the same code as ``fedcore hub
serve``) inside the operator, on the registry kept in the Secret ``fedcore-hub``
(:mod:`fedcore_operator.hub.state`). The endpoint splices the sites' clients, TLS untouched,
to the server and KDC pods of the run it serves (at their pod IPs, which each reconcile pass
publishes), signs their certificate requests with that run's CA, and hears each site's
verdict, client counts and calls, which the run's next pass writes into ``status.sites``.

The endpoint tells runs apart by the TLS server name alone (``server.fedcore.invalid``), so it
serves one run at a time: the first run at sites reconciled while the endpoint is free keeps
it until it finishes or is deleted (a run that was served before the operator restarted keeps
its turn); the others wait in phase Pending with reason ``EndpointBusy``. Right after the
operator starts, a run that was not being served waits ``SETTLE_SECONDS``, so that the one
that was gets its pass first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from fedcore.observe.metrics import HubMetrics
from fedcore.sites.hub import HubEndpoint, HubRun
from fedcore.spec import FederatedRun, spec_digest
from fedcore.transport import RunCa
from fedcore_operator import objects
from fedcore_operator.conditions import pod_ready, terminating
from fedcore_operator.hub.state import SecretRegistry, sync_sites
from fedcore_operator.hub.view import HubView, SiteFacts
from fedcore_operator.kube import Kube
from fedcore_operator.settings import OperatorSettings

log = logging.getLogger(__name__)

Object = dict[str, Any]
Key = tuple[str, str, str]
"""A run: (namespace, name, uid)."""
SETTLE_SECONDS = 10.0
TERMINAL = ("Succeeded", "Failed")


class HubService:
    """The hub's endpoint and what it heard, for the operator's reconciler.

    Args:
        kube: the API access.
        settings: the operator's settings (its namespace holds the hub's Secrets).
        listen: the endpoint's ``host:port``.
        metrics_registry: where the endpoint's metrics go (the operator's /metrics).
    """

    def __init__(
        self,
        kube: Kube,
        settings: OperatorSettings,
        listen: str,
        *,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.namespace = settings.ca_namespace
        self.state = SecretRegistry(kube, self.namespace)
        self.registry = self.state.registry
        self.endpoint = HubEndpoint(
            self.registry, listen, metrics=HubMetrics(registry=metrics_registry)
        )
        self.notify: Callable[[str, str], None] | None = None
        """Called with (namespace, name) when a site said something about that run."""
        self._lock = threading.Lock()
        self._holder: Key | None = None
        self._facts: dict[str, dict[str, SiteFacts]] = {}
        self._progress: dict[str, Object] = {}
        self._started = time.monotonic()

    @property
    def port(self) -> int:
        """The endpoint's port."""
        return self.endpoint.port

    def start(self) -> None:
        """Starts the endpoint."""
        self.endpoint.start()
        log.info(
            "The hub's endpoint listens on port %d (hub CA %s).",
            self.endpoint.port,
            self.registry.fingerprint,
        )

    def stop(self) -> None:
        """Stops the endpoint."""
        self.endpoint.stop()

    def sync_sites(self) -> list[str]:
        """Brings the registry to the chart's site list (``state.sync_sites``)."""
        return sync_sites(self.kube, self.registry, self.namespace)

    # ------------------------------------------------------------------ per pass

    def view(self, body: Object, now: float | None = None) -> HubView:
        """What the hub knows of the run ``body`` (a run at sites) for one pass; takes the
        endpoint for it when it is free and the run's turn has come."""
        meta = body["metadata"]
        key: Key = (meta["namespace"], meta["name"], str(meta.get("uid")))
        status = body.get("status") or {}
        clock = time.monotonic() if now is None else now
        with self._lock:
            if status.get("phase") in TERMINAL:
                if self._holder == key:
                    self._release_locked()
            elif self._holder is None and (
                _was_served(status) or clock - self._started >= SETTLE_SECONDS
            ):
                self._holder = key
                log.info("The hub's endpoint serves run %s/%s now.", key[0], key[1])
            serving = self._holder == key
            holder = None if self._holder is None else f"{self._holder[0]}/{self._holder[1]}"
            facts = dict(self._facts.get(key[2], {}))
        return HubView(
            serving=serving,
            holder=None if serving else holder,
            registry={site["name"]: site["state"] for site in self.registry.sites()},
            last_seen=dict(self.endpoint.last_seen),
            facts=facts,
        )

    def serve(self, body: Object, run: FederatedRun, pods: Sequence[Object], ca: RunCa) -> None:
        """Points the endpoint at the run's server and KDC pods as listed (when it serves
        the run), with the run's manifest, CA and progress for the sites."""
        meta = body["metadata"]
        key: Key = (meta["namespace"], meta["name"], str(meta.get("uid")))
        ctx = objects.RunContext(run, key[0], key[2], self.settings)
        status = body.get("status") or {}
        progress = {
            "phase": status.get("phase") or "Pending",
            "round": status.get("round") or 0,
            "rounds": run.spec.rounds,
            **({"reason": status["reason"]} if status.get("phase") == "Failed" else {}),
            **(
                {"epsilon": status["privacy"]["epsilon"]}
                if (status.get("privacy") or {}).get("epsilon") is not None
                else {}
            ),
        }
        backends = {}
        for role, port in (("server", self.settings.server_port), ("kdc", self.settings.kdc_port)):
            address = _pod_address(pods, objects.pod_name(key[1], role), port)
            if address is not None:
                backends[role] = address
        digest = spec_digest(run)
        with self._lock:
            if self._holder != key:
                return
            self._progress[key[2]] = progress
            current = self.endpoint.run
            # A changed spec is a new offer: the sites review its digest again.
            if (
                current is None
                or current.run.metadata.name != key[1]
                or current.ca.cert_pem != ca.cert_pem
                or current.digest != digest
            ):
                hub_run = HubRun(
                    run,
                    objects.manifest_text(ctx),
                    ca,
                    digest,
                    self._events(key),
                    progress=lambda: dict(self._progress.get(key[2], {})),
                )
            else:
                hub_run = current
            self.endpoint.serve(hub_run, backends)

    def release(self, namespace: str, name: str) -> None:
        """Frees the endpoint when it serves the run ``namespace/name`` (deleted, ended)."""
        with self._lock:
            if self._holder is not None and self._holder[:2] == (namespace, name):
                self._release_locked()

    def _release_locked(self) -> None:
        assert self._holder is not None
        log.info("The hub's endpoint no longer serves run %s/%s.", *self._holder[:2])
        self._facts.pop(self._holder[2], None)
        self._progress.pop(self._holder[2], None)
        self._holder = None
        self.endpoint.serve(None, {})

    def _events(self, key: Key) -> Callable[..., None]:
        """What the endpoint calls when a site of the run ``key`` says something."""

        def heard(event: str, **fields: Any) -> None:
            site = str(fields.get("site", ""))
            with self._lock:
                known = self._facts.setdefault(key[2], {})
                facts = known.get(site, SiteFacts())
                if event == "site_approved":
                    facts = SiteFacts("Approved", "", "", facts.clients)
                elif event == "site_refused":
                    facts = SiteFacts(
                        "Refused",
                        str(fields.get("reason", "")),
                        str(fields.get("message", "")),
                        facts.clients,
                    )
                elif event == "site_withdrew":
                    facts = SiteFacts(
                        "Withdrawn", "Withdrawn", str(fields.get("message", "")), facts.clients
                    )
                elif event == "site_clients":
                    counts: dict[str, int] = {
                        k: int(fields[k]) for k in ("total", "ready", "succeeded") if k in fields
                    }
                    facts = SiteFacts(facts.verdict, facts.reason, facts.message, counts)
                else:
                    return
                known[site] = facts
            log.info("Run %s/%s: site %s: %s", key[0], key[1], site, event)
            if self.notify is not None:
                self.notify(key[0], key[1])

        return heard


def _was_served(status: Object) -> bool:
    """Whether the run's status says the endpoint served it (before a restart)."""
    for condition in status.get("conditions") or []:
        if condition.get("type") == "HubEndpoint":
            return condition.get("status") == "True"
    return False


def _pod_address(pods: Sequence[Object], name: str, port: int) -> str | None:
    """``ip:port`` of the named pod when it is ready and not being deleted."""
    for pod in pods:
        if pod["metadata"]["name"] != name or terminating(pod) or not pod_ready(pod):
            continue
        ip = (pod.get("status") or {}).get("podIP")
        if ip:
            return f"[{ip}]:{port}" if ":" in str(ip) else f"{ip}:{port}"
    return None

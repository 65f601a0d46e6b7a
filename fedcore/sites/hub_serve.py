"""Serving one run from a hub: its KDC and server on loopback, the endpoint in front of them.

``fedcore hub serve`` (and the hub part of ``fedcore run`` for a manifest with spec.sites)
does what the local runner does for the run's own roles (certificates, KDC, server, events,
restarts of a dead server on the same port with ``--resume``), starts no client, and opens
the hub's endpoint, through which the sites' clients reach the server and the KDC. Every site
the manifest lists must have been added (``fedcore site add``). A site that refuses the run
when it reviews it stops the run at once with reason ``SiteRefused`` and the site's words.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from fedcore.errors import RunAborted
from fedcore.local.launch import FEDCORE_ROLES, RoleEntry
from fedcore.local.runner import LocalRun, LocalRunResult, ProgressCallback
from fedcore.local.threads import ROLE_THREADS
from fedcore.observe.events import EventLog, read_events
from fedcore.sites._registry import HubRegistry
from fedcore.sites.hub import HubEndpoint, HubRun
from fedcore.spec import FederatedRun, spec_digest
from fedcore.transport import RunCa

log = logging.getLogger(__name__)


class HubServe:
    """One run served from a hub.

    Args:
        run: the validated manifest (with spec.sites).
        manifest: its file (sent to each site as it is).
        registry: the hub's CA and sites.
        listen: the endpoint's ``host:port``.
        workdir: the run's folder at the hub.
        resume: start the server from the latest checkpoint.
        require_checkpoint: with ``resume``, refuse to start (``NoCheckpoint``) without one.
        entry: what the KDC and server processes run.
        spawn: fork the roles from a warm forkserver, or exec each.
        metrics_port: where the endpoint serves its ``/metrics`` (0: nowhere).
    """

    def __init__(
        self,
        run: FederatedRun,
        manifest: Path,
        registry: HubRegistry,
        *,
        listen: str,
        workdir: Path,
        resume: bool = False,
        require_checkpoint: bool = True,
        entry: RoleEntry = FEDCORE_ROLES,
        spawn: Any = "fork",
        threads: int = ROLE_THREADS,
        metrics_port: int = 0,
    ) -> None:
        self.metrics_port = metrics_port
        if run.spec.sites is None:
            raise RunAborted(
                f"Run {run.metadata.name!r} lists no spec.sites; a hub serves runs whose clients "
                "are at sites.",
                reason="InvalidOptions",
            )
        known = {site["name"]: site["state"] for site in registry.sites()}
        for site in run.spec.sites:
            state = known.get(site.name)
            if state is None:
                raise RunAborted(
                    f"spec.sites names site {site.name!r}, which this hub does not know; add "
                    f"it first (fedcore site add {site.name}).",
                    reason="UnknownSite",
                )
            if state == "Revoked":
                raise RunAborted(
                    f"spec.sites names site {site.name!r}, which this hub revoked; a revoked "
                    "site stays revoked: add its replacement under a new name.",
                    reason="UnknownSite",
                )
        self.registry = registry
        self.refusal: dict[str, Any] | None = None
        self.local = LocalRun(
            run,
            manifest,
            workdir=workdir,
            resume=resume,
            require_checkpoint=require_checkpoint,
            entry=entry,
            spawn=spawn,
            threads=threads,
            with_clients=False,
            role_args=("--revoked-sites", str(registry.revoked_path.absolute())),
            check=self._check,
        )
        self._listen = listen
        self._manifest_text = Path(manifest).read_text(encoding="utf-8")
        self.endpoint: HubEndpoint | None = None
        self._progress_lock = threading.Lock()
        self._progress: dict[str, Any] = {"phase": "Running"}
        self._progress_offset = 0

    @property
    def run(self) -> FederatedRun:
        """The run served."""
        return self.local.run

    def _emit(self, event: str, **fields: Any) -> None:
        if event == "site_refused":
            self.refusal = dict(fields)
        EventLog(self.local.events_path).emit(event, **fields)

    def progress(self) -> dict[str, Any]:
        """The run's phase, round, rounds and epsilon, from the server's events so far."""
        with self._progress_lock:
            found, self._progress_offset = read_events(
                self.local.events_path, self._progress_offset
            )
            for event in found:
                kind = event.get("event")
                if kind == "round":
                    self._progress.update(
                        {key: event[key] for key in ("round", "rounds", "epsilon") if key in event}
                    )
                elif kind == "finished":
                    self._progress["phase"] = "Succeeded"
                elif kind == "failed":
                    self._progress.update(phase="Failed", reason=str(event.get("reason", "")))
            return dict(self._progress)

    def _check(self) -> None:
        """Stops the run when a site refused it at its review."""
        refusal = self.refusal
        if refusal is not None:
            with self._progress_lock:
                self._progress.update(phase="Failed", reason="SiteRefused")
            raise RunAborted(
                f"Site {refusal.get('site')} refused run {self.run.metadata.name!r} "
                f"({refusal.get('reason')}): {refusal.get('message')}",
                reason="SiteRefused",
            )

    def start(self, on_event: ProgressCallback | None = None) -> int:
        """Starts the KDC, the server and the endpoint; returns the endpoint's port."""
        self.local.start(on_event)
        ca = RunCa.from_pem(*self._run_ca_pem())
        backends = {"server": f"127.0.0.1:{self.local._ports['server']}"}
        if "kdc" in self.local._ports:
            backends["kdc"] = f"127.0.0.1:{self.local._ports['kdc']}"
        self.endpoint = HubEndpoint(
            self.registry,
            self._listen,
            run=HubRun(
                self.run,
                self._manifest_text,
                ca,
                spec_digest(self.run),
                self._emit,
                progress=self.progress,
            ),
            backends=backends,
        )
        self.endpoint.start()
        self.endpoint.metrics.serve(self.metrics_port)
        log.info("The hub's endpoint listens on port %d.", self.endpoint.port)
        return self.endpoint.port

    def _run_ca_pem(self) -> tuple[bytes, bytes]:
        pki = self.local.workdir / "pki"
        return (pki / "ca" / "ca.crt").read_bytes(), (pki / "ca" / "ca.key").read_bytes()

    def wait(self, on_event: ProgressCallback | None = None) -> LocalRunResult:
        """Follows the run to its end; stops the endpoint and the roles."""
        try:
            return self.local.wait(on_event)
        finally:
            if self.endpoint is not None:
                self.endpoint.stop()

    def stop(self) -> None:
        """Stops the endpoint and the roles."""
        if self.endpoint is not None:
            self.endpoint.stop()
        self.local.stop()

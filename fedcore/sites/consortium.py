"""``fedcore run`` of a manifest with spec.sites: the hub and every site on one machine.

Each party is what it would be on its own machine, only on loopback: the hub (its folder,
CA, KDC, server and endpoint) in this process and its children, and each site as its own
processes (``fedcore site join``, then ``fedcore site serve``) with its own folder, keys and
policy file. The hub adds each site and hands it its token through the environment (never
the command line); the site checks the hub's CA fingerprint, makes its keys, reviews the run
against its policy and starts its clients, which reach the server and the KDC only through the
hub's endpoint. A site's policy is ``--site NAME=POLICY``, else ``<site>/policy.yaml`` beside
the manifest.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fedcore.errors import RoleFailed, SpecError, SpecIssue
from fedcore.local.launch import FEDCORE_ROLES, RoleEntry, dying_with_parent
from fedcore.local.ports import LOOPBACK, free_port
from fedcore.local.runner import STOP_SECONDS, LocalRunResult, ProgressCallback
from fedcore.sites._registry import HubRegistry
from fedcore.sites.hub_serve import HubServe
from fedcore.sites.site import SITE_FILE
from fedcore.spec import FederatedRun

TOKEN_ENV = "FEDCORE_JOIN_TOKEN"
"""Where ``fedcore site join`` reads its token from (the command line would show it to ps)."""


def site_policies(
    run: FederatedRun, manifest: Path, given: Mapping[str, Path] | None = None
) -> dict[str, Path]:
    """Each site's policy file: ``given[name]``, else ``<site>/policy.yaml`` beside the
    manifest.

    Raises:
        SpecError: a site has no policy file, or ``given`` names a site the run does not list.
    """
    sites = [site.name for site in run.spec.sites or []]
    given = dict(given or {})
    issues = [
        SpecIssue("--site", f"{name!r} is not a site of this run (spec.sites: {sites}).")
        for name in sorted(set(given) - set(sites))
    ]
    policies: dict[str, Path] = {}
    for position, name in enumerate(sites):
        path = Path(given.get(name) or Path(manifest).parent / name / "policy.yaml")
        if not path.is_file():
            issues.append(
                SpecIssue(
                    f"spec.sites[{position}]",
                    f"site {name!r} has no policy file at {path}; give one with --site "
                    f"{name}=POLICY.",
                )
            )
        policies[name] = path
    if issues:
        raise SpecError(issues, source=str(manifest))
    return policies


@dataclass
class SiteProcess:
    """One site's ``fedcore site serve`` process."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path


class ConsortiumRun:
    """A run with spec.sites on one machine: the hub, then each site as its own processes.

    Args:
        run: the validated manifest.
        manifest: its file.
        workdir: the run's folder: ``hub/`` (the hub's own folder and the run's), and
            ``sites/<name>/`` (each site's folder: its keys, the run as it received it,
            its clients' logs).
        policies: each site's policy file (``site_policies``).
        resume: resume the server from its latest checkpoint.
        require_checkpoint: with ``resume``, refuse to start without one (``NoCheckpoint``).
        entry: what every role process runs.
        site_env: more environment for the sites' processes (e.g. ``https_proxy``: a site
            behind a proxy).
    """

    def __init__(
        self,
        run: FederatedRun,
        manifest: Path,
        *,
        workdir: Path,
        policies: Mapping[str, Path],
        resume: bool = False,
        require_checkpoint: bool = True,
        entry: RoleEntry = FEDCORE_ROLES,
        site_env: Mapping[str, str] | None = None,
    ) -> None:
        self.site_env = dict(site_env or {})
        self.run = run
        self.workdir = Path(workdir)
        self.policies = dict(policies)
        self.entry = entry
        self.registry = HubRegistry(self.workdir / "hub" / "state")
        self._tokens = {
            site.name: self.registry.add_site(site.name).token
            for site in run.spec.sites or []
            if not self._joined(site.name)
        }
        self.hub = HubServe(
            run,
            manifest,
            self.registry,
            listen=f"{LOOPBACK}:{self._endpoint_port()}",
            workdir=self.workdir / "hub" / "run",
            resume=resume,
            require_checkpoint=require_checkpoint,
            entry=entry,
        )
        self.hub.local.check = self._check
        self.sites: dict[str, SiteProcess] = {}

    def _endpoint_port(self) -> int:
        """The hub endpoint's port: the one an earlier start of this folder used (its sites
        joined that address), else a free one, recorded for a resume."""
        record = self.workdir / "hub" / "endpoint-port"
        if record.is_file():
            return int(record.read_text())
        port = free_port()
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(str(port))
        return port

    def _site_dir(self, name: str) -> Path:
        return self.workdir / "sites" / name

    def _joined(self, name: str) -> bool:
        return (self._site_dir(name) / SITE_FILE).is_file()

    def _command(self, *args: str) -> list[str]:
        return dying_with_parent([sys.executable, "-m", self.entry.module, *args])

    def start(self, on_event: ProgressCallback | None = None) -> None:
        """Starts the hub, then joins every site that has not joined (all at once), then
        starts every site."""
        port = self.hub.start(on_event)
        address = f"{LOOPBACK}:{port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.site_env}
        joining: dict[str, subprocess.Popen[bytes]] = {}
        for name in self.policies:
            folder = self._site_dir(name)
            folder.mkdir(parents=True, exist_ok=True)
            if self._joined(name):
                continue
            join = self._command(
                "site", "join", "--hub", address, "--fingerprint", self.registry.fingerprint,
                "--dir", str(folder),
            )  # fmt: skip
            with (folder / "site.log").open("ab") as out:
                joining[name] = subprocess.Popen(
                    join,
                    env={**env, TOKEN_ENV: self._tokens[name]},
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        for name, process in joining.items():
            if process.wait(timeout=120) != 0:
                log = self._site_dir(name) / "site.log"
                raise RoleFailed(f"site {name}", f"could not join the hub:\n{_tail(log)}")
        for name, policy in self.policies.items():
            folder = self._site_dir(name)
            serve = self._command(
                "site", "serve", "--dir", str(folder), "--policy", str(policy.absolute())
            )
            with (folder / "site.log").open("ab") as out:
                process = subprocess.Popen(
                    serve,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.sites[name] = SiteProcess(name, process, folder / "site.log")

    def _check(self) -> None:
        """Stops the run when a site refused it or its process failed before the run began."""
        self.hub._check()
        for site in self.sites.values():
            code = site.process.poll()
            if code is not None and code != 0:
                raise RoleFailed(
                    f"site {site.name}",
                    f"exited with code {code} before the run's clients joined:\n" + _tail(site.log),
                    exit_code=code,
                )

    def execute(self, on_event: ProgressCallback | None = None) -> LocalRunResult:
        """Runs to the end; stops every process of every party.

        Raises:
            RunAborted: a site refused the run (SiteRefused), or the server stopped it.
            RoleFailed: a role or a site failed.
        """
        try:
            self.start(on_event)
        except BaseException:
            self.stop()
            raise
        try:
            result = self.hub.wait(on_event)
            self._wait_sites()
            return result
        finally:
            self.stop()

    def _wait_sites(self) -> None:
        for site in self.sites.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                site.process.wait(STOP_SECONDS)

    def stop(self) -> None:
        """Stops the hub and every site (SIGTERM, then SIGKILL)."""
        self.hub.stop()
        for site in self.sites.values():
            if site.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(site.process.pid, signal.SIGTERM)
        for site in self.sites.values():
            try:
                site.process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(site.process.pid, signal.SIGKILL)
                site.process.wait()


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


__all__ = ["ConsortiumRun", "site_policies"]

"""A site: joins a hub once, then serves the runs its policy approves with its own clients.

``join`` makes the site's key where it runs, checks the hub's CA against the fingerprint given
out of band with the token, and has the hub sign a certificate request; the key never leaves
the site's folder. ``SiteAgent.serve`` then, for the run the hub serves: reads it, reviews it
against the site's policy (approval bound to the spec's digest, the privacy floor) and reports
a refusal to the hub; makes a key per client and has the hub sign each client's certificate
request; binds its clients' data from its policy (the hub never learns where it is); starts
its clients, which dial the hub's endpoint (and nothing else); renews the site's certificate
and its clients' at half their life; and dials back for the peer links the hub relays to its
clients.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedcore._files import write_atomically
from fedcore.checkpoint import ROLE_KEY_ENVS
from fedcore.errors import FedcoreError, TransportError
from fedcore.local.launch import (
    FEDCORE_ROLES,
    RoleEntry,
    RoleProcess,
    SpawnMode,
    start_role,
    warm_up,
)
from fedcore.local.ports import LOOPBACK, free_port
from fedcore.sites._api import HubApiClient, HubRefused
from fedcore.sites.binding import BINDING_FILE, SiteBinding
from fedcore.sites.policy import SiteRefused, load_policy, review, spec_digest
from fedcore.spec import FederatedRun, parse_manifest, peer_graph, protocol_facts
from fedcore.spec._loading import load_document
from fedcore.transport import (
    Identity,
    TlsBundle,
    certificate_facts,
    dial,
    fingerprint,
    new_key_and_request,
    splice,
)

log = logging.getLogger(__name__)

SITE_FILE = "site.json"
IDENTITY_FOLDER = "identity"
STOP_SECONDS = 10.0
HEARTBEAT_SECONDS = 30.0
"""How often a serving site renews what is due and reports its clients to the hub."""
LOCAL_CONNECT_SECONDS = 5.0
"""How long a relay waits for the client it splices to to listen on its peer port (the hub's
broker waits 15 s for the whole dial-back)."""
_TOKEN_SITE = re.compile(r"([a-z][a-z0-9-]{0,39})\.")


@dataclass(frozen=True)
class SiteConfig:
    """What ``fedcore site join`` leaves in the site's folder (``site.json``)."""

    name: str
    hub: str
    fingerprint: str

    @classmethod
    def load(cls, directory: Path) -> SiteConfig:
        """Reads ``site.json`` from ``directory``.

        Raises:
            FedcoreError: the folder holds no joined site.
        """
        path = Path(directory) / SITE_FILE
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
            return cls(str(document["name"]), str(document["hub"]), str(document["fingerprint"]))
        except (OSError, ValueError, KeyError) as exc:
            raise FedcoreError(
                f"{directory} holds no joined site ({path}: {exc}); run fedcore site join first."
            ) from exc


def answer_relays(
    api: Callable[[], HubApiClient],
    hub: str,
    where: Callable[[int], tuple[str, int] | None],
    stopping: threading.Event,
) -> bool:
    """Answers the hub's relay requests until ``stopping`` is set: polls ``/v1/tunnels`` and,
    for each, dials the hub back and splices the connection to the peer port of the client
    it names (``where``: its host and port; None: not one of this site's). Returns True when
    the hub revoked the site (it stops answering), False when stopped."""
    while not stopping.is_set():
        try:
            answer = api().call("GET", "/v1/tunnels", wait=20.0)
        except HubRefused as exc:
            if exc.reason == "Revoked":
                return True
            stopping.wait(1.0)
            continue
        except (TransportError, OSError, FedcoreError):
            stopping.wait(1.0)
            continue
        for tunnel in answer.get("tunnels", []):
            threading.Thread(
                target=dial_back, args=(hub, tunnel, where), daemon=True, name="dial-back"
            ).start()
    return False


def dial_back(
    hub: str, tunnel: dict[str, Any], where: Callable[[int], tuple[str, int] | None]
) -> None:
    """Dials the hub back for one relay (``FCTUNNEL <token>``) and splices it to the client
    the tunnel names, at ``where(index)``; the two clients' own TLS runs through it."""
    target = str(tunnel.get("target", ""))
    token = str(tunnel.get("token", ""))
    try:
        identity = Identity.parse(target.split(".", 1)[0])
    except TransportError:
        return
    address = where(identity.index) if identity.index is not None else None
    if address is None or not re.fullmatch(r"[0-9a-f]{64}", token):
        log.warning("The hub asked for a relay to %s, which this site does not run.", target)
        return
    try:
        local = _connect(address, LOCAL_CONNECT_SECONDS)  # never proxied
        back = dial(hub)
        back.sendall(b"FCTUNNEL " + token.encode() + b"\n")
    except (TransportError, OSError) as exc:
        log.warning("A dial-back for %s failed: %s", target, exc)
        return
    back.settimeout(None)
    local.settimeout(None)
    splice(back, local)


def _connect(address: tuple[str, int], seconds: float) -> socket.socket:
    """A connection to a client's peer port, retried for ``seconds`` (a client that has just
    started may not listen yet).

    Raises:
        OSError: it still refused, or did not answer, when the time was up.
    """
    deadline = time.monotonic() + seconds
    while True:
        try:
            return socket.create_connection(address, timeout=10.0)
        except ConnectionRefusedError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def enroll(*, hub: str, token: str, expected_fingerprint: str) -> tuple[SiteConfig, TlsBundle]:
    """Enrolls a site at the hub at ``hub``; returns its config and its identity.

    The hub's CA is checked against ``expected_fingerprint`` before anything is sent; the
    site's key is made here and only its certificate request goes to the hub, with the
    one-time token. The caller keeps the identity (a folder, a Secret of the site's cluster).

    Raises:
        FedcoreError: the fingerprint differs (a wrong hub, or a man in the middle), the hub
            refused the token (used, expired, unknown, revoked: the hub's reason), or the hub
            is unreachable.
    """
    match = _TOKEN_SITE.match(token)
    if match is None:
        raise FedcoreError("The join token is malformed; it starts with the site's name.")
    name = match.group(1)
    ca_pem = HubApiClient.fetch_ca(hub)
    found = fingerprint(ca_pem)
    if found != expected_fingerprint.strip().lower():
        raise FedcoreError(
            f"The hub at {hub} presents a CA with fingerprint {found}, not the "
            f"{expected_fingerprint} given with the token: this is not the hub you were invited "
            "to (or someone is in between). Nothing was sent."
        )
    key_pem, request_pem = new_key_and_request(name)
    api = HubApiClient(hub, ca_pem)
    try:
        answer = api.call("POST", "/v1/enroll", {"token": token, "request": request_pem.decode()})
    except HubRefused as exc:
        raise FedcoreError(
            f"The hub refused to enroll site {name!r} ({exc.reason}): {exc}"
        ) from exc
    bundle = TlsBundle(ca_pem=ca_pem, cert_pem=answer["certificate"].encode(), key_pem=key_pem)
    log.info("Site %s joined the hub at %s.", name, hub)
    return SiteConfig(name=name, hub=hub, fingerprint=found), bundle


def join(directory: Path, *, hub: str, token: str, expected_fingerprint: str) -> SiteConfig:
    """Enrolls this machine as a site of the hub at ``hub`` (:func:`enroll`); the key stays in
    ``directory/identity`` (mode 0600), the site's config in ``directory/site.json``.

    Raises:
        FedcoreError: as :func:`enroll`.
    """
    directory = Path(directory)
    config, bundle = enroll(hub=hub, token=token, expected_fingerprint=expected_fingerprint)
    bundle.write(directory / IDENTITY_FOLDER)
    write_atomically(
        directory / SITE_FILE,
        json.dumps(
            {"name": config.name, "hub": config.hub, "fingerprint": config.fingerprint}, indent=1
        ).encode(),
        mode=0o600,
    )
    return config


class SiteAgent:
    """Serves one site: the run the hub serves, as the site's policy allows.

    Args:
        directory: the joined site's folder.
        policy: the site's policy file.
        workdir: where each run's manifest, client keys and logs go (default: the site's
            folder, ``runs/<run>``).
        entry: what a client process runs.
        wait_seconds: how long to wait for the hub to serve a run for this site.
        spawn: fork the clients from a warm forkserver (started while the site reviews the
            run, so that each client does not import torch again) or exec each.
    """

    def __init__(
        self,
        directory: Path,
        policy: Path,
        *,
        workdir: Path | None = None,
        entry: RoleEntry = FEDCORE_ROLES,
        wait_seconds: float = 600.0,
        spawn: SpawnMode = "fork",
    ) -> None:
        self.spawn: SpawnMode = spawn
        self.directory = Path(directory)
        self.config = SiteConfig.load(self.directory)
        self.policy_path = Path(policy)
        self.policy = load_policy(self.policy_path)
        if self.policy.site != self.config.name:
            raise FedcoreError(
                f"The policy {policy} is site {self.policy.site!r}'s, but this folder is site "
                f"{self.config.name!r}'s."
            )
        self.workdir = workdir
        self.entry = entry
        self.wait_seconds = wait_seconds
        self.bundle = TlsBundle.load(self.directory / IDENTITY_FOLDER)
        self.children: dict[int, RoleProcess] = {}
        self._peer_ports: dict[int, int] = {}
        self._stopping = threading.Event()
        self._serving: tuple[str, list[int], bytes, Path] | None = None
        """The run served: its name, this site's clients, the run's CA, the run's folder."""
        self.revoked = False

    @property
    def api(self) -> HubApiClient:
        """A client of the hub API with the site's current certificate."""
        return HubApiClient(self.config.hub, self.bundle.ca_pem, self.bundle)

    # ------------------------------------------------------------------- certificate

    def renew_if_due(self) -> bool:
        """Renews the site's certificate once half its life has passed; returns whether."""
        _, _, start, end = certificate_facts(self.bundle.cert_pem)
        now = datetime.datetime.now(datetime.UTC)
        if now < start + (end - start) / 2:
            return False
        key_pem, request_pem = new_key_and_request(self.config.name)
        answer = self.api.call("POST", "/v1/renew", {"request": request_pem.decode()})
        self.bundle = TlsBundle(self.bundle.ca_pem, answer["certificate"].encode(), key_pem)
        self.bundle.write(self.directory / IDENTITY_FOLDER)
        log.info("Renewed site %s's certificate.", self.config.name)
        return True

    # ----------------------------------------------------------------------- the run

    def fetch_run(self) -> dict[str, Any]:
        """The run the hub serves for this site, waiting up to ``wait_seconds`` for one.

        Raises:
            HubRefused: the hub refused the site (revoked: reason Revoked), or served no run
                in time (NoRun).
        """
        deadline = time.monotonic() + self.wait_seconds
        said = 0.0
        while True:
            try:
                return self.api.call("GET", "/v1/run")
            except HubRefused as exc:
                if exc.reason != "NoRun" or time.monotonic() > deadline:
                    raise
                problem = str(exc)
            except (TransportError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise
                problem = f"the hub at {self.config.hub} is unreachable: {exc}"
            if time.monotonic() - said > 30:
                log.warning("Waiting for a run: %s", problem)
                said = time.monotonic()
            time.sleep(1.0)

    def review(self, offered: dict[str, Any]) -> tuple[FederatedRun, SiteBinding]:
        """Checks the offered run against the policy; reports a refusal to the hub.

        Raises:
            SiteRefused: the policy refuses it (the hub has been told why).
        """
        run = parse_manifest(load_document(str(offered["manifest"]), source="the hub's manifest"))
        try:
            approval = review(self.policy, run)
        except SiteRefused as exc:
            log.error("Site %s refuses run %s: %s", self.config.name, run.metadata.name, exc)
            with contextlib.suppress(HubRefused, TransportError):
                self.api.call(
                    "POST",
                    "/v1/run/refusal",
                    {"run": run.metadata.name, "reason": exc.reason, "message": str(exc)},
                )
            raise
        binding = SiteBinding(site=self.config.name, digest=spec_digest(run), approval=approval)
        return run, binding

    def serve(self) -> dict[str, Any]:
        """Takes part in the hub's run to its end; returns how the site's clients ended.

        Raises:
            SiteRefused: the policy refused the run (the hub was told).
            FedcoreError: the hub refused the site, or a client failed.
        """
        warm_up(self.spawn, self.entry)  # its imports overlap the review
        self.renew_if_due()
        offered = self.fetch_run()
        run, binding = self.review(offered)
        name = run.metadata.name
        workdir = self.workdir or self.directory / "runs" / name
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "manifest.yaml").write_text(str(offered["manifest"]), encoding="utf-8")
        binding.write(workdir / BINDING_FILE)
        clients = list(run.spec.site_clients(self.config.name))
        self._serving = (name, clients, str(offered["runCa"]).encode(), workdir)
        self._issue_client_bundles(name, clients, str(offered["runCa"]).encode(), workdir)
        self.api.call("POST", "/v1/run/approval", {"run": name})
        log.info(
            "Site %s approved run %s (%s); starting clients %s.",
            self.config.name,
            name,
            binding.digest,
            clients,
        )
        threads = [threading.Thread(target=self._keep_certificate, daemon=True)]
        if protocol_facts(run.spec.protocol.name).decentralized:
            threads.append(threading.Thread(target=self._relay, daemon=True))
        self._start_clients(run, clients, workdir)
        for thread in threads:
            thread.start()
        try:
            return self._wait_clients()
        finally:
            self._stopping.set()
            self.stop()

    def _issue_client_bundles(
        self, run: str, clients: list[int], run_ca: bytes, workdir: Path
    ) -> None:
        keys: dict[int, bytes] = {}
        requests: dict[str, str] = {}
        for index in clients:
            keys[index], request = new_key_and_request(f"client-{index}")
            requests[str(index)] = request.decode()
        answer = self.api.call("POST", "/v1/run/certificates", {"run": run, "requests": requests})
        for index in clients:
            cert = answer["certificates"][str(index)].encode()
            TlsBundle(run_ca, cert, keys[index]).write(workdir / "pki" / f"client-{index}")

    def _start_clients(self, run: FederatedRun, clients: list[int], workdir: Path) -> None:
        hub = self.config.hub
        facts = protocol_facts(run.spec.protocol.name)
        graph = peer_graph(run.spec)[0] if facts.decentralized else None
        (workdir / "logs").mkdir(exist_ok=True)
        for index in clients:
            args = [
                "client",
                "--manifest",
                str(workdir / "manifest.yaml"),
                "--tls-dir",
                str(workdir / "pki" / f"client-{index}"),
                "--workdir",
                str(workdir),
                "--index",
                str(index),
                "--server",
                hub,
                "--site-binding",
                str(workdir / BINDING_FILE),
                "--metrics-port",
                "0",
            ]
            if facts.needs_kdc:
                args += ["--kdc", hub]
            if graph is not None:
                port = free_port()
                self._peer_ports[index] = port
                args += ["--peer-listen", f"{LOOPBACK}:{port}"]
                for to in graph.out_neighbours(index):
                    args += ["--peer", f"{to}={hub}"]
            env = dict(os.environ)
            env["PYTHONUNBUFFERED"] = "1"
            # A client's own checkpoint key is its file in the site's run folder
            # (keys/client-<i>-checkpoint.key), never a key file this process was given.
            for variable in ROLE_KEY_ENVS:
                env.pop(variable, None)
            self.children[index] = start_role(
                self.spawn, self.entry, args, workdir / "logs" / f"client-{index}.log", env
            )

    def _wait_clients(self) -> dict[str, Any]:
        codes: dict[int, int] = {}
        while len(codes) < len(self.children):
            for index, child in self.children.items():
                if index not in codes and (code := child.poll()) is not None:
                    codes[index] = code
            time.sleep(0.1)
        failed = {index: code for index, code in codes.items() if code != 0}
        if failed:
            raise FedcoreError(
                f"Site {self.config.name}'s clients {sorted(failed)} exited with errors "
                f"{sorted(set(failed.values()))}"
                + (" (this site was revoked by the hub)" if self.revoked else "")
                + "; see their logs."
            )
        return {"site": self.config.name, "clients": sorted(codes)}

    def renew_clients_if_due(self) -> bool:
        """Gives the run's clients new keys and certificates once half their certificates'
        life has passed (each client takes them up at its next session); returns whether."""
        if self._serving is None:
            return False
        name, clients, run_ca, workdir = self._serving
        due = False
        now = datetime.datetime.now(datetime.UTC)
        for index in clients:
            cert = (workdir / "pki" / f"client-{index}" / "tls.crt").read_bytes()
            _, _, start, end = certificate_facts(cert)
            due = due or now >= start + (end - start) / 2
        if not due:
            return False
        self._issue_client_bundles(name, clients, run_ca, workdir)
        log.info("Renewed the certificates of site %s's clients %s.", self.config.name, clients)
        return True

    def report_clients(self) -> None:
        """Tells the hub how many of the run's clients here run and have finished (it shows
        that, and when the site last called, in its run's status)."""
        if self._serving is None:
            return
        codes = [child.poll() for child in self.children.values()]
        counts = {
            "total": len(self._serving[1]),
            "ready": sum(code is None for code in codes),
            "succeeded": sum(code == 0 for code in codes),
        }
        self.api.call("POST", "/v1/run/clients", {"run": self._serving[0], "clients": counts})

    def _keep_certificate(self) -> None:
        """Every 30 s: renews the site's and its clients' certificates when due, and tells
        the hub how its clients are doing (the site's heartbeat)."""
        while not self._stopping.wait(HEARTBEAT_SECONDS):
            try:
                self.renew_if_due()
                self.renew_clients_if_due()
                self.report_clients()
            except HubRefused as exc:
                if exc.reason == "Revoked":
                    self.revoked = True
                    log.error("The hub revoked site %s: %s", self.config.name, exc)
                    return
                log.warning("Site %s's call to the hub failed: %s", self.config.name, exc)
            except (TransportError, OSError) as exc:
                log.warning("Site %s's call to the hub failed: %s", self.config.name, exc)

    def _relay(self) -> None:
        """Answers the hub's relay requests: dials back and splices to the client's port."""
        self.revoked = answer_relays(
            lambda: self.api,
            self.config.hub,
            lambda index: (
                None if index not in self._peer_ports else (LOOPBACK, self._peer_ports[index])
            ),
            self._stopping,
        )

    def stop(self) -> None:
        """Stops every client still running: SIGTERM, then SIGKILL."""
        for child in self.children.values():
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_SECONDS
        for child in self.children.values():
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()


__all__ = ["SiteAgent", "SiteConfig", "answer_relays", "dial_back", "enroll", "join"]

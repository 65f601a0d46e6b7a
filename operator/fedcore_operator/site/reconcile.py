"""The site's operator: enrolls the site, asks the hub, reviews, and applies the plan.

``SiteIdentity`` keeps the site's key and certificate in one Secret of the operator's own
namespace: on first use it reads the one-time join token from its Secret, checks the hub's
CA against the fingerprint given with it, makes the key here and has the hub sign a
certificate request (:func:`fedcore.sites.site.enroll`); the key never leaves the cluster.
It renews the certificate at half its life.

``SiteReconciler.reconcile`` runs one pass over one Participation: it asks the hub for the
run it serves (``GET /v1/run``, with the site's certificate), reviews it (cached per spec
generation and digest: the review computes the planned epsilon), lists what the
Participation owns, hands all that to the pure ``plan`` and carries out its steps. Client
keys are made here and only their certificate requests go to the hub; so are a decentralized
protocol's clients' checkpoint keys, which never leave the cluster. For a decentralized
protocol, ``SiteRelay`` answers the hub's relays to the site's client pods.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from secrets import token_hex
from typing import Any

from kubernetes.client.exceptions import ApiException

from fedcore.errors import FedcoreError, TransportError
from fedcore.sites._api import HubApiClient, HubRefused
from fedcore.sites.participation import ParticipationSpec
from fedcore.sites.site import SiteConfig, answer_relays, enroll
from fedcore.spec import FederatedRun, protocol_facts
from fedcore.transport import TlsBundle, certificate_facts, new_key_and_request
from fedcore_operator import objects
from fedcore_operator.kube import Kube
from fedcore_operator.reconcile import Outcome, apply_write, create_all
from fedcore_operator.settings import OperatorSettings
from fedcore_operator.site import objects as site_objects
from fedcore_operator.site.plan import (
    KINDS,
    HubProblem,
    IssueClientCertificates,
    IssueClientKeys,
    Offer,
    ReportToHub,
    SiteObserved,
    SiteStep,
    Verdict,
    deletion,
    plan,
    review_offer,
)

log = logging.getLogger(__name__)

Object = dict[str, Any]
HUB_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class SiteSettings:
    """Where the site's hub is and where its identity lives (the chart's ``site`` values).

    Attributes:
        hub: the hub endpoint's ``host:port``.
        fingerprint: the hub CA's fingerprint, given out of band with the join token.
        namespace: the operator's namespace, which holds both Secrets.
        join_secret: the Secret whose key ``token`` is the one-time join token.
        identity_secret: the Secret where the site's key and certificate are kept.
        hub_cidrs: where the client pods may reach the hub (empty: its resolved addresses).
    """

    hub: str
    fingerprint: str
    namespace: str
    join_secret: str = "fedcore-site-join"
    identity_secret: str = "fedcore-site-identity"
    hub_cidrs: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, namespace: str, environ: dict[str, str] | None = None) -> SiteSettings | None:
        """Reads ``FEDCORE_SITE_*``; None when ``FEDCORE_SITE_HUB`` is unset (no site here).

        Raises:
            ValueError: a variable that does not parse, naming it.
        """
        env = dict(os.environ if environ is None else environ)
        hub = env.get("FEDCORE_SITE_HUB", "").strip()
        if not hub:
            return None
        host, sep, port = hub.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"FEDCORE_SITE_HUB: {hub!r} is not host:port")
        fingerprint = env.get("FEDCORE_SITE_FINGERPRINT", "").strip().lower()
        if not fingerprint.startswith("sha256:"):
            raise ValueError("FEDCORE_SITE_FINGERPRINT: give the hub CA's sha256:... fingerprint")
        cidrs = tuple(
            c.strip() for c in env.get("FEDCORE_SITE_HUB_CIDRS", "").split(",") if c.strip()
        )
        for cidr in cidrs:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError as exc:
                raise ValueError(f"FEDCORE_SITE_HUB_CIDRS: {cidr!r} is not a CIDR") from exc
        return cls(
            hub=hub,
            fingerprint=fingerprint,
            namespace=namespace,
            join_secret=env.get("FEDCORE_SITE_JOIN_SECRET", "fedcore-site-join"),
            identity_secret=env.get("FEDCORE_SITE_IDENTITY_SECRET", "fedcore-site-identity"),
            hub_cidrs=cidrs,
        )


class SiteIdentity:
    """The site's key and certificate, kept in a Secret of the operator's namespace."""

    def __init__(self, kube: Kube, settings: SiteSettings) -> None:
        self.kube = kube
        self.settings = settings
        self._lock = threading.Lock()
        self._cached: tuple[SiteConfig, TlsBundle] | None = None

    def current(self) -> tuple[SiteConfig, TlsBundle]:
        """The site's name and bundle: from its Secret, enrolling first when there is none,
        renewing when half its certificate's life has passed.

        Raises:
            FedcoreError: no identity and no usable join token (the reason says which), or
                the hub refused or is unreachable.
        """
        with self._lock:
            if self._cached is None:
                self._cached = self._load() or self._enroll()
            self._cached = self._renew_if_due(*self._cached)
            return self._cached

    def _load(self) -> tuple[SiteConfig, TlsBundle] | None:
        secret = self.kube.get("Secret", self.settings.namespace, self.settings.identity_secret)
        if secret is None:
            return None
        data = {key: base64.b64decode(value) for key, value in (secret.get("data") or {}).items()}
        try:
            config = SiteConfig(
                name=data["site"].decode(),
                hub=self.settings.hub,
                fingerprint=data["fingerprint"].decode(),
            )
            return config, TlsBundle(data["ca.crt"], data["tls.crt"], data["tls.key"])
        except KeyError as exc:
            raise FedcoreError(
                f"Secret {self.settings.namespace}/{self.settings.identity_secret} lacks {exc}; "
                "delete it and give a new join token to enroll again."
            ) from exc

    def _enroll(self) -> tuple[SiteConfig, TlsBundle]:
        where = f"{self.settings.namespace}/{self.settings.join_secret}"
        secret = self.kube.get("Secret", self.settings.namespace, self.settings.join_secret)
        token = (secret or {}).get("data", {}).get("token")
        if not token:
            raise FedcoreError(
                f"The site has not joined its hub yet and Secret {where} holds no 'token': "
                "create it with the join token the hub's admin gave "
                f"(kubectl -n {self.settings.namespace} create secret generic "
                f"{self.settings.join_secret} --from-literal=token=...)."
            )
        config, bundle = enroll(
            hub=self.settings.hub,
            token=base64.b64decode(token).decode().strip(),
            expected_fingerprint=self.settings.fingerprint,
        )
        self._store(config, bundle, create=True)
        log.info(
            "Site %s enrolled at the hub %s; its key stays in %s.",
            config.name,
            self.settings.hub,
            self.settings.identity_secret,
        )
        return config, bundle

    def _store(self, config: SiteConfig, bundle: TlsBundle, *, create: bool) -> None:
        string_data = {
            "site": config.name,
            "fingerprint": config.fingerprint,
            "ca.crt": bundle.ca_pem.decode(),
            "tls.crt": bundle.cert_pem.decode(),
            "tls.key": bundle.key_pem.decode(),
        }
        if create:
            self.kube.create(
                {
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "type": "Opaque",
                    "metadata": {
                        "name": self.settings.identity_secret,
                        "namespace": self.settings.namespace,
                        "labels": {"app.kubernetes.io/managed-by": "fedcore-operator"},
                    },
                    "stringData": string_data,
                }
            )
        else:
            self.kube.patch(
                "Secret",
                self.settings.namespace,
                self.settings.identity_secret,
                {"stringData": string_data},
            )

    def _renew_if_due(self, config: SiteConfig, bundle: TlsBundle) -> tuple[SiteConfig, TlsBundle]:
        _, _, start, end = certificate_facts(bundle.cert_pem)
        if datetime.datetime.now(datetime.UTC) < start + (end - start) / 2:
            return config, bundle
        key_pem, request_pem = new_key_and_request(config.name)
        api = HubApiClient(self.settings.hub, bundle.ca_pem, bundle, timeout=HUB_TIMEOUT_SECONDS)
        answer = api.call("POST", "/v1/renew", {"request": request_pem.decode()})
        renewed = TlsBundle(bundle.ca_pem, str(answer["certificate"]).encode(), key_pem)
        self._store(config, renewed, create=False)
        log.info("Renewed site %s's certificate.", config.name)
        return config, renewed


class SiteRelay:
    """Splices the hub's relays (decentralized protocols) to the site's client pods.

    Once started, a thread polls the hub's ``/v1/tunnels`` with the site's certificate; for
    each relay it dials the hub back and connects to the named client's pod at its IP and
    peer port, which every reconcile pass publishes (:meth:`publish`). The two clients' own
    mutual TLS runs end to end through it; the operator sees only ciphertext.
    """

    def __init__(self, identity: SiteIdentity, hub: str, peer_port: int) -> None:
        self.identity = identity
        self.hub = hub
        self.peer_port = peer_port
        self._addresses: dict[int, str] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def publish(self, pods: Sequence[Object]) -> None:
        """Records the pod IP of each client pod listed (by its client index)."""
        with self._lock:
            for pod in pods:
                index = (pod["metadata"].get("labels") or {}).get(objects.INDEX_LABEL)
                ip = (pod.get("status") or {}).get("podIP")
                if index is not None and index.isdigit() and ip:
                    self._addresses[int(index)] = str(ip)

    def where(self, index: int) -> tuple[str, int] | None:
        """The pod address of client ``index``, if it is one of this site's."""
        with self._lock:
            ip = self._addresses.get(index)
        return None if ip is None else (ip, self.peer_port)

    def start(self) -> None:
        """Starts answering relays (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, daemon=True, name="site-relay")
            self._thread.start()

    def _serve(self) -> None:
        def api() -> HubApiClient:
            _, bundle = self.identity.current()
            return HubApiClient(self.hub, bundle.ca_pem, bundle, timeout=HUB_TIMEOUT_SECONDS)

        if answer_relays(api, self.hub, self.where, self._stopping):
            log.error("The hub revoked this site: it answers no relay any more.")


class SiteReconciler:
    """Reconciles Participations through a ``Kube``; one instance serves them all."""

    def __init__(self, kube: Kube, settings: OperatorSettings, site: SiteSettings) -> None:
        self.kube = kube
        self.settings = settings
        self.site = site
        self.identity = SiteIdentity(kube, site)
        self.relay = SiteRelay(self.identity, site.hub, settings.peer_port)
        self.relay_from = (objects.operator_peer(site.namespace),)
        self._reviews: dict[str, tuple[tuple[int, str], Verdict]] = {}
        """Per Participation (uid), its last review: (generation, digest) and the verdict."""
        self._told: dict[str, dict[str, int]] = {}
        """Per Participation (uid), the client counts the hub was last told."""

    def reconcile(self, namespace: str, name: str) -> Outcome:
        """Runs one pass over the Participation ``namespace/name``; a vanished one is a no-op."""
        body = self.kube.get("Participation", namespace, name)
        outcome = Outcome()
        if body is None:
            return outcome
        if body["metadata"].get("deletionTimestamp"):
            return self.delete(body, namespace, outcome)
        observed = self.observe(body)
        verdict = observed.verdict
        approved = verdict.run if verdict is not None and verdict.approved else None
        if approved is not None and protocol_facts(approved.spec.protocol.name).decentralized:
            self.relay.publish(observed.pods)
            self.relay.start()
        decided = plan(observed)
        patch = decided.status_patch
        for step in decided.steps:
            if not self._apply(step, namespace, outcome) and patch is not None:
                # The hub did not take the report: the status must not say it did.
                previous = (body.get("status") or {}).get("reported")
                patch = {"status": {**patch["status"], "reported": previous}}
        outcome.phase = decided.phase
        if patch is not None:
            self.kube.patch("Participation", namespace, name, patch, sub="status")
            outcome.writes += 1
        if approved is not None and decided.phase == "Running":
            status = (patch or body).get("status") or {}
            self._tell_clients(str(body["metadata"].get("uid")), approved, status.get("clients"))
        return outcome

    def _tell_clients(self, uid: str, run: FederatedRun, clients: Any) -> None:
        """Tells the hub how many of the site's clients are ready and done, when that
        changed (the hub shows it in its run's ``status.sites``)."""
        if not isinstance(clients, dict):
            return
        counts = {key: int(clients.get(key) or 0) for key in ("total", "ready", "succeeded")}
        if self._told.get(uid) == counts:
            return
        try:
            self._api().call(
                "POST", "/v1/run/clients", {"run": run.metadata.name, "clients": counts}
            )
        except (HubRefused, TransportError, OSError, FedcoreError) as exc:
            log.warning("Telling the hub the clients of run %s failed: %s", run.metadata.name, exc)
            return
        self._told[uid] = counts

    def delete(self, body: Object, namespace: str, outcome: Outcome) -> Outcome:
        """A deleted Participation: the hub is told of the withdrawal, then it may go."""
        observed = self.observe(body)
        for step in deletion(body, observed.now, observed.offer, observed.problem):
            if not self._apply(step, namespace, outcome):
                return outcome  # the hub did not take it: the next pass tries again
        return outcome

    # ------------------------------------------------------------------ observe

    def observe(self, body: Object) -> SiteObserved:
        """Enrollment, the hub's offer and its review, the owned objects."""
        meta = body["metadata"]
        labels = site_objects.selector(meta["name"])
        listed = {kind: self.kube.list(kind, meta["namespace"], labels) for kind in KINDS}
        base = SiteObserved(
            body=body,
            now=datetime.datetime.now(datetime.UTC),
            settings=self.settings,
            hub=self.site.hub,
            site=None,
            pods=listed.pop("Pod"),
            owned=listed,
            hub_addresses=self.hub_addresses(),
            relay_from=self.relay_from,
        )
        try:
            config, bundle = self.identity.current()
        except (FedcoreError, HubRefused, TransportError, OSError) as exc:
            return replace(base, enrollment=str(exc))
        enrolled = replace(base, site=config.name)
        api = HubApiClient(self.site.hub, bundle.ca_pem, bundle, timeout=HUB_TIMEOUT_SECONDS)
        try:
            offer = Offer.from_answer(api.call("GET", "/v1/run"))
        except HubRefused as exc:
            return replace(enrolled, problem=HubProblem(exc.reason, str(exc)))
        except (TransportError, OSError, KeyError, ValueError, TypeError) as exc:
            message = f"The hub at {self.site.hub} did not answer: {exc}"
            return replace(enrolled, problem=HubProblem("Unreachable", message))
        return replace(enrolled, offer=offer, verdict=self.review(body, config.name, offer))

    def review(self, body: Object, site: str, offer: Offer) -> Verdict | None:
        """The review of ``offer``, computed once per Participation generation and digest."""
        meta = body["metadata"]
        uid, key = str(meta.get("uid")), (int(meta.get("generation") or 0), offer.digest)
        known = self._reviews.get(uid)
        if known is None or known[0] != key:
            try:
                spec = ParticipationSpec.model_validate(body.get("spec") or {})
            except ValueError:
                return None  # the plan reports the invalid spec
            known = self._reviews[uid] = (key, review_offer(spec, site, offer, self.settings))
        return known[1]

    def hub_addresses(self) -> tuple[str, ...]:
        """The CIDRs the client pods may reach the hub at: the chart's, else the hub's
        addresses as resolved now (a /32 or /128 each)."""
        if self.site.hub_cidrs:
            return self.site.hub_cidrs
        host, _, port = self.site.hub.rpartition(":")
        host = host.strip("[]")
        try:
            infos = socket.getaddrinfo(host, int(port), proto=socket.IPPROTO_TCP)
        except OSError:
            return ("0.0.0.0/0", "::/0")
        found = sorted({str(ipaddress.ip_address(info[4][0])) for info in infos})
        return tuple(f"{a}/{ipaddress.ip_address(a).max_prefixlen}" for a in found)

    # ------------------------------------------------------------------ apply

    def _apply(self, step: SiteStep, namespace: str, outcome: Outcome) -> bool:
        """Carries out one step; returns False only for a report the hub did not take."""
        if isinstance(step, IssueClientCertificates):
            self._issue(step, namespace, outcome)
        elif isinstance(step, IssueClientKeys):
            self._create_all(
                [
                    site_objects.client_keys_secret(
                        step.context, index, token_hex(objects.KEY_BYTES)
                    )
                    for index in step.indices
                ],
                outcome,
            )
        elif isinstance(step, ReportToHub):
            return self._report(step, outcome)
        else:
            apply_write(self.kube, step, namespace, outcome)
        return True

    def _create_all(self, items: list[Object], outcome: Outcome) -> None:
        create_all(self.kube, items, outcome)

    def _api(self) -> HubApiClient:
        _, bundle = self.identity.current()
        return HubApiClient(self.site.hub, bundle.ca_pem, bundle, timeout=HUB_TIMEOUT_SECONDS)

    def _issue(self, step: IssueClientCertificates, namespace: str, outcome: Outcome) -> None:
        """Keys made here; the hub signs their requests; the Secrets hold both."""
        keys: dict[int, bytes] = {}
        requests: dict[str, str] = {}
        for index in step.indices:
            keys[index], request = new_key_and_request(f"client-{index}")
            requests[str(index)] = request.decode()
        answer = self._api().call(
            "POST",
            "/v1/run/certificates",
            {"run": step.context.run.metadata.name, "requests": requests},
        )
        secrets = [
            site_objects.client_tls_secret(
                step.context,
                index,
                key_pem=keys[index],
                cert_pem=str(answer["certificates"][str(index)]).encode(),
                run_ca_pem=step.run_ca.encode(),
            )
            for index in step.indices
        ]
        if not step.renew:
            self._create_all(secrets, outcome)
            return
        for secret in secrets:
            name = secret["metadata"]["name"]
            self.kube.patch("Secret", namespace, name, {"stringData": secret["stringData"]})
            outcome.writes += 1
            outcome.actions.append(f"renewed Secret/{name}")

    def _report(self, step: ReportToHub, outcome: Outcome) -> bool:
        path = {
            "Approved": "/v1/run/approval",
            "Refused": "/v1/run/refusal",
            "Withdrawn": "/v1/run/withdrawal",
        }[step.verdict]
        try:
            self._api().call(
                "POST", path, {"run": step.run, "reason": step.reason, "message": step.message}
            )
        except (HubRefused, TransportError, OSError, FedcoreError, ApiException) as exc:
            log.warning("Telling the hub %s of run %s failed: %s", step.verdict, step.run, exc)
            return False
        outcome.actions.append(f"told the hub: {step.verdict}")
        return True

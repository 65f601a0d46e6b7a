"""The hub's one endpoint: run traffic routed by name, the hub API, relays between clients.

One TCP port (:class:`fedcore.transport.SniRouter`) carries everything a site needs:

- ``server.fedcore.invalid`` and ``kdc.fedcore.invalid``: spliced, TLS untouched, to the
  run's server and KDC, which check the client's certificate themselves (end-to-end mutual
  TLS; the endpoint holds no key of the run);
- ``client-<i>.fedcore.invalid``: a peer link to a client that only dials out, relayed
  through its site's dial-back (:class:`fedcore.transport.TunnelBroker`); the relay carries
  the two clients' own mutual TLS, so it sees only ciphertext;
- ``hub.fedcore.invalid``: the hub API, JSON over HTTPS, terminated here with the endpoint's
  certificate (signed by the hub CA): a site enrolls, renews its certificate, reads the run
  it is part of (with its phase, round and epsilon), has its clients' certificate requests
  signed, reports a refusal or a withdrawal and how many of its clients are ready, and polls
  for relays.

Every refused API call is logged with its sender and counted (``refused``).
"""

from __future__ import annotations

import datetime
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from fedcore.errors import TransportError
from fedcore.observe.metrics import HubMetrics
from fedcore.sites._api import HUB_NAME, MAX_BODY_BYTES, load_identity
from fedcore.sites._registry import EnrollmentRefused, HubRegistry
from fedcore.spec import FederatedRun, protocol_facts
from fedcore.spec._sites import site_ranges
from fedcore.transport import (
    ConnectionHandler,
    Identity,
    RunCa,
    SniRouter,
    TunnelBroker,
    forward_to,
)

log = logging.getLogger(__name__)

CLIENT_CERT_HOURS = 7 * 24
"""How long a site client's certificate for a run lives (a site asks again when it restarts
its clients)."""
POLL_SECONDS = 20.0
"""How long a site's poll for relays waits for one."""
MAX_REFUSAL_CHARS = 1_000


@dataclass
class HubRun:
    """The run a hub serves to its sites.

    Attributes:
        run: the validated manifest (with spec.sites).
        manifest: the manifest's text, sent to each site as it is.
        ca: the run's CA, which signs the sites' clients' certificate requests.
        digest: the spec's digest, for the log (each site computes its own).
        events: reports each site's approval, refusal, withdrawal and certificates (event,
            fields).
        progress: the run's phase, round and epsilon as the hub knows them (what a site shows
            in its Participation's status); None: not reported.
    """

    run: FederatedRun
    manifest: str
    ca: RunCa
    digest: str
    events: Callable[..., None]
    progress: Callable[[], dict[str, Any]] | None = None


class HubEndpoint:
    """The hub's endpoint on one port.

    Args:
        registry: the hub's CA and sites.
        listen: ``host:port`` to listen on.
        run: the run served, None for an endpoint that only enrolls (see :meth:`serve`).
        backends: the address of the run's ``server`` and ``kdc``.
        metrics: the endpoint's metrics (default: its own, labelled with the run's name).
    """

    def __init__(
        self,
        registry: HubRegistry,
        listen: str,
        *,
        run: HubRun | None = None,
        backends: dict[str, str] | None = None,
        metrics: HubMetrics | None = None,
    ) -> None:
        self.registry = registry
        self.run = run
        self.refused: dict[str, int] = {}
        """Refused API calls and connections, by reason (also ``fedcore_hub_refused_total``)."""
        self.last_seen: dict[str, float] = {}
        """When each site last called the API with its certificate (Unix time)."""
        self.metrics = metrics or HubMetrics("" if run is None else run.run.metadata.name)
        self._lock = threading.Lock()
        self._backends: dict[str, tuple[str, ConnectionHandler]] = {}
        self._backend_addresses: dict[str, str] = {}
        self.serve(run, backends or {})
        self.broker = TunnelBroker(self._site_of_target)
        self._context = _server_context(registry)
        self.router = SniRouter(
            listen, self._route, broker=self.broker, on_refused=lambda _, why: self._refuse(why)
        )
        self.port = self.router.port

    def serve(self, run: HubRun | None, backends: dict[str, str]) -> None:
        """Serves ``run`` (None: none) with its ``server`` and ``kdc`` at ``backends`` from
        the next connection on; connections already spliced stay as they are."""
        with self._lock:
            self.run = run
            if backends != self._backend_addresses:
                self._backend_addresses = dict(backends)
                self._backends = {
                    Identity(role).dns_name: (role, forward_to(address))  # type: ignore[arg-type]
                    for role, address in backends.items()
                }

    def start(self) -> None:
        """Starts serving."""
        self.router.start()

    def stop(self) -> None:
        """Stops accepting connections."""
        self.router.stop()

    def _count(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1
        self.metrics.refused(reason)

    def _route(self, name: str) -> ConnectionHandler | None:
        if name == HUB_NAME:
            self.metrics.routed("api")
            return self._serve_api
        backend = self._backends.get(name)
        if backend is not None:
            role, handler = backend
            self.metrics.routed(role)
            return handler
        if (
            self.run is not None
            and protocol_facts(self.run.run.spec.protocol.name).decentralized
            and self._site_of_target(name) is not None
        ):
            self.metrics.routed("relay")
            return lambda connection: self.broker.call(name, connection)
        return None

    def _refuse(self, why: str) -> None:
        """Counts a connection the router refused, under a short reason."""
        if why.startswith("no party"):
            self._count("UnknownName")
        elif why.startswith("its ClientHello"):
            self._count("NoName")
        elif "dial-back" in why or "relays" in why:
            self._count("DialBack")
        elif "limit" in why:
            self._count("TooMany")
        else:
            self._count("NotTls")

    def _site_of_target(self, name: str) -> str | None:
        """The unrevoked site that runs the client named ``name`` (None: no such client)."""
        if self.run is None or not name.endswith(f".{HUB_NAME.split('.', 1)[1]}"):
            return None
        try:
            identity = Identity.parse(name.split(".", 1)[0])
        except TransportError:
            return None
        if identity.role != "client" or identity.index is None:
            return None
        site = self.run.run.spec.site_of(identity.index)
        if site is None or site in self.registry.revoked():
            return None
        return site

    def _serve_api(self, connection: socket.socket) -> None:
        connection.settimeout(30.0)
        try:
            secure = self._context.wrap_socket(connection, server_side=True)
        except (OSError, ssl.SSLError) as exc:
            log.warning("A TLS handshake with the hub API failed: %s", exc)
            self._count("handshake")
            connection.close()
            return
        try:
            _ApiHandler(secure, secure.getpeername(), self)
        except OSError as exc:
            log.warning("A hub API connection broke: %s", exc)
        finally:
            secure.close()

    # ------------------------------------------------------------------ the calls

    def answer(
        self, method: str, path: str, body: dict[str, Any], cert_der: bytes | None
    ) -> tuple[int, dict[str, Any]]:
        """Answers one API call: (HTTP status, JSON answer)."""
        if (method, path) == ("GET", "/v1/ca"):
            return 200, {"ca": self.registry.ca.cert_pem.decode()}
        if (method, path) == ("POST", "/v1/enroll"):
            cert = self.registry.enroll(str(body.get("token", "")), _pem(body, "request"))
            site = self.registry.site_of_certificate(_der(cert))
            log.info("Site %s enrolled.", site)
            if self.run is not None:
                self.run.events("site_enrolled", site=site)
            return 200, {"certificate": cert.decode(), "ca": self.registry.ca.cert_pem.decode()}
        if cert_der is None:
            raise EnrollmentRefused("This call needs the site's certificate.", reason="NotASite")
        site = self.registry.site_of_certificate(cert_der)
        self.metrics.site_seen(site)
        self.last_seen[site] = time.time()
        if (method, path) == ("POST", "/v1/renew"):
            cert = self.registry.renew(site, _pem(body, "request"))
            log.info("Site %s renewed its certificate.", site)
            return 200, {"certificate": cert.decode()}
        if (method, path) == ("GET", "/v1/tunnels"):
            found = self.broker.requests(site, POLL_SECONDS)
            return 200, {"tunnels": [{"token": t, "target": target} for t, target in found]}
        hub_run = self.run
        if hub_run is None or hub_run.run.spec.sites is None:
            return 404, {"reason": "NoRun", "error": "This hub serves no run now."}
        clients = site_ranges(hub_run.run.spec.sites).get(site)
        if clients is None:
            return 404, {
                "reason": "NoRun",
                "error": f"Run {hub_run.run.metadata.name!r} has no clients at site {site!r}.",
            }
        if (method, path) == ("GET", "/v1/run"):
            return 200, {
                "name": hub_run.run.metadata.name,
                "manifest": hub_run.manifest,
                "digest": hub_run.digest,
                "runCa": hub_run.ca.cert_pem.decode(),
                "clients": list(clients),
                "status": {} if hub_run.progress is None else hub_run.progress(),
            }
        if body.get("run") != hub_run.run.metadata.name:
            return 409, {
                "reason": "OtherRun",
                "error": f"This hub serves run {hub_run.run.metadata.name!r}, not "
                f"{body.get('run')!r}.",
            }
        if (method, path) == ("POST", "/v1/run/certificates"):
            return 200, {"certificates": self._client_certificates(site, clients, body)}
        if (method, path) == ("POST", "/v1/run/approval"):
            log.info("Site %s approved run %s.", site, hub_run.run.metadata.name)
            hub_run.events("site_approved", site=site)
            return 200, {}
        if (method, path) == ("POST", "/v1/run/refusal"):
            reason = _printable(str(body.get("reason", "Refused")))[:64]
            message = _printable(str(body.get("message", "")))[:MAX_REFUSAL_CHARS]
            log.warning(
                "Site %s refused run %s (%s): %s", site, hub_run.run.metadata.name, reason, message
            )
            hub_run.events("site_refused", site=site, reason=reason, message=message)
            return 200, {}
        if (method, path) == ("POST", "/v1/run/clients"):
            reported = body.get("clients")
            if not isinstance(reported, dict):
                raise EnrollmentRefused("No client counts were sent.", reason="BadRequest")
            counts = {
                key: int(value)
                for key, value in reported.items()
                if key in ("total", "ready", "succeeded")
                and isinstance(value, int)
                and not isinstance(value, bool)
                and 0 <= value <= len(clients)
            }
            hub_run.events("site_clients", site=site, **counts)
            return 200, {}
        if (method, path) == ("POST", "/v1/run/withdrawal"):
            message = _printable(str(body.get("message", "")))[:MAX_REFUSAL_CHARS]
            log.warning(
                "Site %s withdrew from run %s; its clients stop: %s",
                site,
                hub_run.run.metadata.name,
                message,
            )
            hub_run.events("site_withdrew", site=site, message=message)
            return 200, {}
        return 404, {"reason": "UnknownCall", "error": f"No call {method} {path}."}

    def _client_certificates(
        self, site: str, clients: range, body: dict[str, Any]
    ) -> dict[str, str]:
        assert self.run is not None
        requests = body.get("requests")
        if not isinstance(requests, dict) or not requests:
            raise EnrollmentRefused("No certificate requests were sent.", reason="BadRequest")
        signed: dict[str, str] = {}
        for key, request in requests.items():
            if not (isinstance(key, str) and key.isdigit() and int(key) in clients):
                raise EnrollmentRefused(
                    f"Site {site!r} asked for a certificate of client {key!r}, which it does "
                    f"not run (its clients are {clients.start} to {clients.stop - 1}).",
                    reason="WrongName",
                )
            if not isinstance(request, str):
                raise EnrollmentRefused("A request is not PEM text.", reason="BadRequest")
            try:
                signed[key] = self.run.ca.sign_request(
                    request.encode(),
                    common_name=f"client-{int(key)}",
                    valid_for=datetime.timedelta(hours=CLIENT_CERT_HOURS),
                ).decode()
            except TransportError as exc:
                raise EnrollmentRefused(str(exc), reason="BadRequest") from exc
        log.info("Signed %d client certificates for site %s.", len(signed), site)
        self.run.events("site_certificates", site=site, clients=len(signed))
        return signed


def _printable(text: str) -> str:
    """``text`` with every control character (a newline that would fake a log line) as a
    space: a site's words go into the hub's log and events as one line."""
    return "".join(char if char.isprintable() else " " for char in text)


def _pem(body: dict[str, Any], key: str) -> bytes:
    value = body.get(key)
    if not isinstance(value, str):
        raise EnrollmentRefused(f"The call has no {key!r} text.", reason="BadRequest")
    return value.encode()


def _der(cert_pem: bytes) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert_pem.decode())


def _server_context(registry: HubRegistry) -> ssl.SSLContext:
    """The API's TLS: the endpoint's certificate; a client certificate is asked for (checked
    against the hub CA when given) but not required, since a joining site has none yet."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    load_identity(context, registry.endpoint)
    context.load_verify_locations(cadata=registry.ca.cert_pem.decode())
    context.verify_mode = ssl.CERT_OPTIONAL
    return context


class _ApiHandler(BaseHTTPRequestHandler):
    """One HTTP/1.0 exchange of the hub API on a TLS connection (closed after it)."""

    server_version = "fedcore-hub"
    endpoint: HubEndpoint

    def __init__(self, connection: ssl.SSLSocket, address: Any, endpoint: HubEndpoint) -> None:
        self.endpoint = endpoint
        super().__init__(connection, address, None)  # type: ignore[arg-type]

    def setup(self) -> None:
        self.connection = self.request
        self.rfile = self.connection.makefile("rb")
        self.wfile = self.connection.makefile("wb")

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("hub API %s: " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def _sender(self) -> str:
        der = self.connection.getpeercert(binary_form=True)
        if der is None:
            return f"an unauthenticated caller at {self.client_address[0]}"
        try:
            return f"site {self.endpoint.registry.site_of_certificate(der)}"
        except EnrollmentRefused:
            return f"a caller at {self.client_address[0]}"

    def _handle(self, method: str) -> None:
        length_text = self.headers.get("Content-Length") or "0"
        path = self.path.split("?", 1)[0]
        status: int
        answer: dict[str, Any]
        if not length_text.isdigit() or int(length_text) > MAX_BODY_BYTES:
            status, answer = 413, {"reason": "TooLarge", "error": "The body is too large."}
        else:
            try:
                raw = self.rfile.read(int(length_text)) if int(length_text) else b"{}"
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise ValueError("not an object")
            except ValueError:
                status, answer = 400, {"reason": "BadRequest", "error": "The body is not JSON."}
            else:
                der = self.connection.getpeercert(binary_form=True)
                try:
                    status, answer = self.endpoint.answer(method, path, body, der)
                except EnrollmentRefused as exc:
                    status, answer = 403, {"reason": exc.reason, "error": str(exc)}
        if status != 200:
            self.endpoint._count(str(answer.get("reason")))
            log.warning(
                "Refused %s %s from %s (%s): %s",
                method,
                path,
                self._sender(),
                answer.get("reason"),
                answer.get("error"),
            )
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

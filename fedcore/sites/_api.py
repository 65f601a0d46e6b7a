"""The hub's API as a site calls it: JSON over HTTPS, through the hub's one endpoint.

The site reaches the endpoint's API under the TLS server name ``hub.fedcore.invalid`` and
checks the endpoint's certificate against the hub CA, whose fingerprint it was given out of
band (:meth:`HubApiClient.fetch_ca` is the one call made before that check, and it sends
nothing). Every other call presents the site's own certificate, except ``enroll``, which
carries the one-time token instead.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import tempfile
from pathlib import Path
from typing import Any

from fedcore.errors import FedcoreError
from fedcore.transport import Identity, TlsBundle, dial

HUB_NAME = Identity("hub").dns_name
"""The TLS server name of the hub's API on its endpoint."""
MAX_BODY_BYTES = 4 * 1024 * 1024
"""The largest request or answer body (a site's certificate requests for 1,000 clients fit)."""


def load_identity(context: ssl.SSLContext, bundle: TlsBundle) -> None:
    """Loads ``bundle``'s certificate and key into ``context`` (ssl reads a key only from a
    file: it is written to a private temporary folder, mode 0600, and removed at once)."""
    with tempfile.TemporaryDirectory() as folder:
        cert = Path(folder) / "tls.crt"
        key = Path(folder) / "tls.key"
        cert.write_bytes(bundle.cert_pem)
        key.touch(mode=0o600)
        key.write_bytes(bundle.key_pem)
        context.load_cert_chain(cert, key)


class HubRefused(FedcoreError):
    """The hub answered a site's call with an error; ``reason`` is the hub's (e.g. TokenUsed)."""

    def __init__(self, message: str, *, reason: str, status: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


class _Connection(http.client.HTTPSConnection):
    """An HTTPS connection to the hub's endpoint: dialed through the proxy when one is set,
    with the TLS server name of the hub's API whatever the address."""

    def __init__(self, address: str, context: ssl.SSLContext, timeout: float) -> None:
        host, _, port = address.rpartition(":")
        super().__init__(host.strip("[]"), int(port), context=context, timeout=timeout)
        self._address = address
        self._context = context

    def connect(self) -> None:
        raw: socket.socket = dial(self._address, timeout=self.timeout or 10.0)
        raw.settimeout(self.timeout)
        self.sock = self._context.wrap_socket(raw, server_hostname=HUB_NAME)


class HubApiClient:
    """A site's calls to the hub API.

    Args:
        address: the hub endpoint's ``host:port``.
        ca_pem: the hub CA, to check the endpoint with.
        bundle: the site's own bundle (None while it enrolls).
        timeout: seconds a call may take (a long poll adds its wait).
    """

    def __init__(
        self,
        address: str,
        ca_pem: bytes,
        bundle: TlsBundle | None = None,
        *,
        timeout: float = 30.0,
    ) -> None:
        self.address = address
        self.timeout = timeout
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca_pem.decode())
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if bundle is not None:
            load_identity(context, bundle)
        self._context = context

    @staticmethod
    def fetch_ca(address: str, *, timeout: float = 30.0) -> bytes:
        """The CA certificate the endpoint at ``address`` serves, unchecked: the caller
        compares its fingerprint with the one given out of band before trusting it.

        Raises:
            HubRefused: the endpoint did not answer with a certificate.
            TransportError: the endpoint is unreachable.
        """
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        answer = _exchange(_Connection(address, context, timeout), "GET", "/v1/ca", None)
        ca = answer.get("ca")
        if not isinstance(ca, str):
            raise HubRefused("The hub sent no CA certificate.", reason="BadAnswer", status=200)
        return ca.encode()

    def call(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, wait: float = 0.0
    ) -> dict[str, Any]:
        """One call; returns the JSON answer.

        Raises:
            HubRefused: the hub answered with an error (its reason and message).
            TransportError: the endpoint is unreachable.
            ssl.SSLError: the endpoint's certificate is not the hub's.
        """
        connection = _Connection(self.address, self._context, self.timeout + wait)
        return _exchange(connection, method, path, body)


def _exchange(
    connection: http.client.HTTPSConnection, method: str, path: str, body: dict[str, Any] | None
) -> dict[str, Any]:
    payload = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if payload is not None else {}
    try:
        connection.request(method, path, body=payload, headers=headers)
        response = connection.getresponse()
        data = response.read(MAX_BODY_BYTES + 1)
    finally:
        connection.close()
    if len(data) > MAX_BODY_BYTES:
        raise HubRefused("The hub's answer is too large.", reason="BadAnswer", status=0)
    try:
        answer = json.loads(data or b"{}")
    except ValueError as exc:
        raise HubRefused(
            f"The hub answered {response.status} without JSON.",
            reason="BadAnswer",
            status=response.status,
        ) from exc
    if not isinstance(answer, dict):
        raise HubRefused("The hub's answer is not an object.", reason="BadAnswer", status=0)
    if response.status != 200:
        raise HubRefused(
            str(answer.get("error") or f"HTTP {response.status}"),
            reason=str(answer.get("reason") or "Refused"),
            status=response.status,
        )
    return answer

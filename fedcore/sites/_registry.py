"""A hub's own state: its CA, its endpoint's certificate, and the sites it knows.

The hub's folder (mode 0700) holds:

- ``ca/``: the hub CA (``ca.crt``; ``ca.key``, mode 0600, never leaves the hub), which signs
  the endpoint's certificate and every site's;
- ``endpoint/``: the endpoint's bundle (common name ``hub``, role name ``hub.fedcore.invalid``);
- ``sites.json``: each site, the SHA-256 of its join token (never the token), the token's
  expiry and whether it was used, the serial numbers of the certificates it holds, and when it
  was revoked;
- ``revoked-sites.json``: the revoked sites' names, which the server and the KDC read
  (:class:`fedcore.transport.RevokedSites`).

Every change takes an exclusive lock on ``sites.lock``, so ``fedcore site add`` (a command)
and a serving hub (a process) never lose each other's writes.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedcore._files import write_atomically
from fedcore.errors import FedcoreError, TransportError
from fedcore.spec._sites import SITE_NAME_PATTERN
from fedcore.transport import (
    Identity,
    RevokedSites,
    RunCa,
    TlsBundle,
    certificate_facts,
    fingerprint,
)

HUB_CA_DAYS = 3650
SITE_CERT_HOURS = 7 * 24
"""How long a site's certificate lives; ``fedcore site serve`` renews it at half its life."""
TOKEN_SECONDS = 24 * 3600
SITE_URI_PREFIX = "spiffe://fedcore.invalid/site/"
_TOKEN = re.compile(r"([a-z][a-z0-9-]{0,39})\.([A-Za-z0-9_-]{43})")


class EnrollmentRefused(FedcoreError):
    """The hub refuses a site's enrollment, renewal or request; ``reason`` names why.

    Reasons: ``UnknownToken``, ``TokenUsed``, ``TokenExpired``, ``Revoked``, ``WrongName``,
    ``BadRequest``, ``UnknownSite``, ``NotASite``.
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class JoinToken:
    """What a hub admin hands a site out of band: the token and the hub CA's fingerprint."""

    site: str
    token: str
    fingerprint: str
    expires: float


def _is_party_name(name: str) -> bool:
    """Whether ``name`` is a run party's common name, which no site may take."""
    try:
        Identity.parse(name)
    except TransportError:
        return False
    return True


def _now() -> float:
    return time.time()


def _iso(moment: float | None) -> str | None:
    if moment is None:
        return None
    return datetime.datetime.fromtimestamp(moment, datetime.UTC).isoformat(timespec="seconds")


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class HubRegistry:
    """The hub's CA and its sites, kept in ``directory``.

    Args:
        directory: the hub's folder; created (with a fresh CA) when it holds none.
        on_change: called (with the lock held) after every change of the folder, so that a
            hub that keeps its state elsewhere (the operator: a Secret) saves it before the
            change is answered; an exception from it fails the call that made the change.
    """

    def __init__(self, directory: Path, *, on_change: Callable[[Path], None] | None = None) -> None:
        self.directory = Path(directory)
        self._on_change = on_change
        self._sites_path = self.directory / "sites.json"
        self.revoked_path = self.directory / "revoked-sites.json"
        """The file of revoked sites' names the server and the KDC read."""
        with self._locked():
            if not (self.directory / "ca" / "ca.key").exists():
                self._create()
        cert_pem = (self.directory / "ca" / "ca.crt").read_bytes()
        key_pem = (self.directory / "ca" / "ca.key").read_bytes()
        self.ca = RunCa.from_pem(cert_pem, key_pem)
        self.fingerprint = fingerprint(cert_pem)
        """The hub CA's fingerprint, ``sha256:<hex>``, that a site checks before it enrolls."""
        self.endpoint = TlsBundle.load(self.directory / "endpoint")
        """The endpoint's bundle (``hub.fedcore.invalid``)."""

    def _create(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        ca = RunCa.generate("hub", valid_days=HUB_CA_DAYS, common_name="fedcore hub CA")
        cert_pem, key_pem = ca.to_pem()
        (self.directory / "ca").mkdir(mode=0o700, exist_ok=True)
        write_atomically(self.directory / "ca" / "ca.crt", cert_pem, mode=0o644)
        write_atomically(self.directory / "ca" / "ca.key", key_pem, mode=0o600)
        ca.issue("hub", valid_days=HUB_CA_DAYS).write(self.directory / "endpoint")
        RevokedSites.write(self.revoked_path, set())
        if self._on_change is not None:
            self._on_change(self.directory)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.directory / "sites.lock", "a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            document = json.loads(self._sites_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        return dict(document.get("sites", {}))

    def _write(self, sites: dict[str, dict[str, Any]]) -> None:
        data = json.dumps({"sites": sites}, indent=1, sort_keys=True).encode()
        write_atomically(self._sites_path, data, mode=0o600)
        revoked = {name for name, site in sites.items() if site.get("revoked") is not None}
        RevokedSites.write(self.revoked_path, revoked)
        if self._on_change is not None:
            self._on_change(self.directory)

    # ----------------------------------------------------------------------- the admin's

    def add_site(self, name: str, *, token_seconds: float = TOKEN_SECONDS) -> JoinToken:
        """Registers ``name`` (or re-issues its token while it has not enrolled) and returns
        its one-time join token; only the token's digest is kept.

        Raises:
            EnrollmentRefused: the name is not a site name, or the site is revoked or has
                enrolled already (a revoked name stays revoked: add the site under a new one).
        """
        if re.fullmatch(SITE_NAME_PATTERN, name) is None or _is_party_name(name):
            raise EnrollmentRefused(
                f"{name!r} is not a site name: lowercase letters, digits and '-', starting "
                "with a letter, at most 40 characters, and not a party's name (server, kdc, "
                "runner, hub, client-<index>).",
                reason="WrongName",
            )
        token = f"{name}.{secrets.token_urlsafe(32)}"
        expires = _now() + token_seconds
        with self._locked():
            sites = self._read()
            site = sites.get(name, {})
            if site.get("revoked") is not None:
                raise EnrollmentRefused(
                    f"Site {name!r} was revoked at {_iso(site['revoked'])}; a revoked name stays "
                    "revoked. Add the site under a new name.",
                    reason="Revoked",
                )
            if site.get("serials"):
                raise EnrollmentRefused(
                    f"Site {name!r} has enrolled already; revoke it first to replace it.",
                    reason="TokenUsed",
                )
            sites[name] = {
                "added": _now(),
                "token": _digest(token),
                "expires": expires,
                "used": None,
                "serials": [],
                "revoked": None,
            }
            self._write(sites)
        return JoinToken(site=name, token=token, fingerprint=self.fingerprint, expires=expires)

    def revoke(self, name: str) -> None:
        """Revokes ``name``: its certificates are refused from now on, by the endpoint, the
        server and the KDC alike, and its clients' uploads are never used again.

        Raises:
            EnrollmentRefused: no such site.
        """
        with self._locked():
            sites = self._read()
            if name not in sites:
                raise EnrollmentRefused(f"No site is named {name!r}.", reason="UnknownSite")
            if sites[name].get("revoked") is None:
                sites[name]["revoked"] = _now()
            self._write(sites)

    def sites(self) -> list[dict[str, Any]]:
        """Each site's public facts (never a token digest), sorted by name."""
        now = _now()
        listing = []
        for name, site in sorted(self._read().items()):
            if site.get("revoked") is not None:
                state = "Revoked"
            elif site.get("serials"):
                state = "Enrolled"
            elif site.get("expires", 0) < now:
                state = "TokenExpired"
            else:
                state = "Invited"
            listing.append(
                {
                    "name": name,
                    "state": state,
                    "added": _iso(site.get("added")),
                    "enrolled": _iso(site.get("used")),
                    "revoked": _iso(site.get("revoked")),
                    "certificates": len(site.get("serials", [])),
                }
            )
        return listing

    def revoked(self) -> frozenset[str]:
        """The revoked sites' names."""
        return frozenset(
            name for name, site in self._read().items() if site.get("revoked") is not None
        )

    # ------------------------------------------------------------------------ a site's

    def enroll(self, token: str, request_pem: bytes) -> bytes:
        """Signs a joining site's certificate request with a valid, unused, unexpired token;
        the token is then used up.

        Raises:
            EnrollmentRefused: the token is unknown, used, expired or its site revoked, or the
                request does not name the token's site.
        """
        match = _TOKEN.fullmatch(token) if isinstance(token, str) else None
        if match is None:
            raise EnrollmentRefused("The join token is malformed.", reason="UnknownToken")
        name = match.group(1)
        with self._locked():
            sites = self._read()
            site = sites.get(name)
            if site is None or not hmac.compare_digest(site.get("token", ""), _digest(token)):
                raise EnrollmentRefused(
                    "The join token is not one this hub issued.", reason="UnknownToken"
                )
            if site.get("revoked") is not None:
                raise EnrollmentRefused(f"Site {name!r} is revoked.", reason="Revoked")
            if site.get("used") is not None:
                raise EnrollmentRefused(
                    f"The join token of site {name!r} was used already (at "
                    f"{_iso(site['used'])}); a token enrolls once. Ask the hub admin for a new "
                    "one (fedcore site add after fedcore site revoke).",
                    reason="TokenUsed",
                )
            if site.get("expires", 0) < _now():
                raise EnrollmentRefused(
                    f"The join token of site {name!r} expired at {_iso(site['expires'])}; ask "
                    f"the hub admin for a new one (fedcore site add {name}).",
                    reason="TokenExpired",
                )
            cert_pem = self._sign_site(name, request_pem)
            site["used"] = _now()
            site["serials"] = [*site.get("serials", []), certificate_facts(cert_pem)[1]]
            self._write(sites)
        return cert_pem

    def renew(self, name: str, request_pem: bytes) -> bytes:
        """Signs a new certificate for an enrolled site (its current certificate checked by
        the caller, see :meth:`site_of_certificate`).

        Raises:
            EnrollmentRefused: the site is unknown or revoked, or the request names another.
        """
        with self._locked():
            sites = self._read()
            site = sites.get(name)
            if site is None:
                raise EnrollmentRefused(f"No site is named {name!r}.", reason="UnknownSite")
            if site.get("revoked") is not None:
                raise EnrollmentRefused(f"Site {name!r} is revoked.", reason="Revoked")
            cert_pem = self._sign_site(name, request_pem)
            site["serials"] = [*site.get("serials", [])[-3:], certificate_facts(cert_pem)[1]]
            self._write(sites)
        return cert_pem

    def _sign_site(self, name: str, request_pem: bytes) -> bytes:
        if _is_party_name(name):
            raise EnrollmentRefused(f"{name!r} is a party's name.", reason="WrongName")
        try:
            return self.ca.sign_request(
                request_pem,
                common_name=name,
                uri=f"{SITE_URI_PREFIX}{name}",
                valid_for=datetime.timedelta(hours=SITE_CERT_HOURS),
            )
        except TransportError as exc:
            raise EnrollmentRefused(str(exc), reason="BadRequest") from exc

    def site_of_certificate(self, cert_der: bytes) -> str:
        """The enrolled, unrevoked site a verified client certificate belongs to.

        Raises:
            EnrollmentRefused: it is not a site's certificate (no site URI, or it names a
                party of a run), its serial is not one the hub issued to that site (an older
                one, replaced), or the site is revoked.
        """
        from cryptography import x509

        certificate = x509.load_der_x509_certificate(cert_der)
        try:
            uris = certificate.extensions.get_extension_for_class(
                x509.SubjectAlternativeName
            ).value.get_values_for_type(x509.UniformResourceIdentifier)
        except x509.ExtensionNotFound:
            uris = []
        names = [uri[len(SITE_URI_PREFIX) :] for uri in uris if uri.startswith(SITE_URI_PREFIX)]
        if len(names) != 1 or len(uris) != 1:
            raise EnrollmentRefused("The certificate is not a site's.", reason="NotASite")
        name = names[0]
        if _is_party_name(name):
            raise EnrollmentRefused("The certificate names a party, not a site.", reason="NotASite")
        site = self._read().get(name)
        if site is None:
            raise EnrollmentRefused(f"No site is named {name!r}.", reason="UnknownSite")
        if site.get("revoked") is not None:
            raise EnrollmentRefused(
                f"Site {name!r} was revoked at {_iso(site['revoked'])}.", reason="Revoked"
            )
        if certificate.serial_number not in site.get("serials", []):
            raise EnrollmentRefused(
                f"The certificate of site {name!r} is not one the hub holds for it (replaced "
                "or unknown).",
                reason="NotASite",
            )
        return name

"""The per-run PKI: one CA per run and mutual-TLS material for every role."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast, get_args

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedcore._files import write_atomically
from fedcore.errors import TransportError

__all__ = [
    "ROLE_DOMAIN",
    "Identity",
    "Role",
    "RunCa",
    "TlsBundle",
    "certificate_facts",
    "fingerprint",
    "issue_run_bundles",
    "new_key_and_request",
]

Role = Literal["server", "kdc", "client", "runner", "hub"]
_ROLES: frozenset[str] = frozenset(get_args(Role))
_CLIENT_CN = re.compile(r"client-(0|[1-9][0-9]{0,8})")
_MAX_CN_CHARS = 64
_CLOCK_SKEW = datetime.timedelta(minutes=5)
_CA_FILE = "ca.crt"
_CERT_FILE = "tls.crt"
_KEY_FILE = "tls.key"
ROLE_DOMAIN = "fedcore.invalid"
"""The domain of every party's role name, ``<common name>.fedcore.invalid``.

A name under ``.invalid`` (RFC 6761) never resolves, so it names a party and never a host: a
caller checks the peer's certificate against the role name of the party it means to reach
(``grpc.ssl_target_name_override``), whatever host or address it dials."""
_URI_PREFIX = f"spiffe://{ROLE_DOMAIN}/"


@dataclass(frozen=True)
class TlsBundle:
    """The mutual-TLS material of one identity, all PEM-encoded.

    Attributes:
        ca_pem: the run CA's certificate, to verify peers with.
        cert_pem: this identity's leaf certificate.
        key_pem: this identity's private key (PKCS#8, unencrypted).
    """

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def load(cls, directory: Path) -> TlsBundle:
        """Read a bundle from ``ca.crt``, ``tls.crt`` and ``tls.key`` in ``directory``.

        Args:
            directory: the folder holding the three files (a mounted Secret, for instance).

        Returns:
            The bundle.

        Raises:
            TransportError: a file is missing or unreadable, or does not hold valid PEM.
        """
        directory = Path(directory)
        contents: dict[str, bytes] = {}
        for filename in (_CA_FILE, _CERT_FILE, _KEY_FILE):
            path = directory / filename
            try:
                contents[filename] = path.read_bytes()
            except FileNotFoundError as exc:
                raise TransportError(
                    f"The TLS file {path} is missing; a TLS directory must hold "
                    f"{_CA_FILE}, {_CERT_FILE} and {_KEY_FILE}."
                ) from exc
            except OSError as exc:
                raise TransportError(f"The TLS file {path} could not be read: {exc}.") from exc
        for filename in (_CA_FILE, _CERT_FILE):
            try:
                x509.load_pem_x509_certificate(contents[filename])
            except ValueError as exc:
                raise TransportError(
                    f"The TLS file {directory / filename} does not hold a PEM certificate."
                ) from exc
        try:
            serialization.load_pem_private_key(contents[_KEY_FILE], password=None)
        except (ValueError, TypeError) as exc:
            raise TransportError(
                f"The TLS file {directory / _KEY_FILE} does not hold an unencrypted PEM "
                "private key."
            ) from exc
        return cls(
            ca_pem=contents[_CA_FILE], cert_pem=contents[_CERT_FILE], key_pem=contents[_KEY_FILE]
        )

    @property
    def identity(self) -> Identity:
        """The party this bundle's certificate names (its common name).

        Raises:
            TransportError: the common name is not a fedcore identity.
        """
        return Identity.parse(_named_certificate(self.cert_pem)[1])

    def key_matches(self) -> bool:
        """Whether the private key is the certificate's (a bundle read while another process
        rewrote its files may hold one's new key and the other's old certificate)."""
        try:
            certificate = x509.load_pem_x509_certificate(self.cert_pem)
            key = serialization.load_pem_private_key(self.key_pem, password=None)
        except (ValueError, TypeError):
            return False
        spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        return bool(
            key.public_key().public_bytes(*spki) == certificate.public_key().public_bytes(*spki)
        )

    def renewed(self, directory: Path) -> TlsBundle | None:
        """The bundle now in ``directory`` when it differs from this one and is whole (its
        key matches its certificate, same identity); None otherwise (unchanged, half
        rewritten, unreadable), so the caller keeps this one and asks again later."""
        try:
            fresh = TlsBundle.load(directory)
        except TransportError:
            return None
        if fresh.cert_pem == self.cert_pem or not fresh.key_matches():
            return None
        try:
            same = fresh.identity == self.identity
        except TransportError:
            return None
        return fresh if same else None

    def write(self, directory: Path) -> None:
        """Write the bundle as ``ca.crt``, ``tls.crt`` and ``tls.key`` in ``directory``.

        A missing folder is created with mode 0700. Each file is written to a temporary file
        and moved into place, so a reader never sees half a file; the key gets mode 0600.

        Args:
            directory: the folder to write into.

        Raises:
            TransportError: the folder or a file could not be written.
        """
        directory = Path(directory)
        try:
            if not directory.is_dir():
                directory.mkdir(mode=0o700, parents=True)
                os.chmod(directory, 0o700)
            write_atomically(directory / _CA_FILE, self.ca_pem, mode=0o644)
            write_atomically(directory / _CERT_FILE, self.cert_pem, mode=0o644)
            write_atomically(directory / _KEY_FILE, self.key_pem, mode=0o600)
        except OSError as exc:
            raise TransportError(
                f"The TLS bundle could not be written to {directory}: {exc}."
            ) from exc


@dataclass(frozen=True)
class Identity:
    """Who a peer is, as written in its certificate's common name.

    Attributes:
        role: the peer's role.
        index: the client's index for ``client``; ``None`` for every other role.

    Raises:
        TransportError: the index does not fit the role.
    """

    role: Role
    index: int | None = None

    def __post_init__(self) -> None:
        if self.role not in _ROLES:
            raise TransportError(
                f"The role {self.role!r} is unknown; expected one of {sorted(_ROLES)}."
            )
        if self.role == "client":
            index = self.index
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise TransportError(
                    f"A client identity needs a non-negative integer index, got {index!r}."
                )
        elif self.index is not None:
            raise TransportError(f"The {self.role} identity takes no index, got {self.index!r}.")

    @property
    def common_name(self) -> str:
        """The certificate common name: ``server``, ``kdc``, ``runner`` or ``client-<i>``."""
        return f"client-{self.index}" if self.role == "client" else self.role

    @property
    def dns_name(self) -> str:
        """The party's role name, e.g. ``server.fedcore.invalid``: only its certificate has it.

        Every caller checks the peer's certificate against this name, so no other party's
        certificate (each carries only its own role name) passes as this party's.
        """
        return f"{self.common_name}.{ROLE_DOMAIN}"

    @property
    def uri(self) -> str:
        """The party's URI subject alternative name, ``spiffe://fedcore.invalid/<common name>``.

        A server checks that it names the same party as the certificate's common name.
        """
        return f"{_URI_PREFIX}{self.common_name}"

    @classmethod
    def from_certificate(cls, cert_pem: bytes) -> Identity:
        """Read the party a certificate names, checking its names agree.

        The common name must parse as an identity, and the certificate's URI subject
        alternative names must be exactly that identity's :attr:`uri`.

        Args:
            cert_pem: the PEM-encoded leaf certificate.

        Returns:
            The identity.

        Raises:
            TransportError: the certificate is not PEM, has no single common name, or its
                URI names do not match its common name.
        """
        certificate, common_name = _named_certificate(
            cert_pem, "The peer certificate is not a PEM certificate."
        )
        identity = cls.parse(common_name)
        try:
            sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
            uris = sans.value.get_values_for_type(x509.UniformResourceIdentifier)
        except x509.ExtensionNotFound:
            uris = []
        if uris != [identity.uri]:
            raise TransportError(
                f"The certificate of {identity.common_name!r} carries the URI names {uris}, "
                f"expected exactly [{identity.uri!r}]; its names disagree."
            )
        return identity

    @classmethod
    def parse(cls, common_name: str) -> Identity:
        """Read an identity from a certificate common name, strictly.

        Args:
            common_name: ``server``, ``kdc``, ``runner``, ``hub`` (a hub's endpoint, whose
                certificate only its own CA signs) or ``client-<i>`` where ``<i>`` is a
                decimal index without leading zeros.

        Returns:
            The identity.

        Raises:
            TransportError: the common name is anything else.
        """
        if isinstance(common_name, str):
            if common_name in ("server", "kdc", "runner", "hub"):
                return cls(role=cast(Role, common_name))
            match = _CLIENT_CN.fullmatch(common_name)
            if match is not None:
                return cls(role="client", index=int(match.group(1)))
        raise TransportError(
            f"The certificate common name {common_name!r} is not a fedcore identity; expected "
            "server, kdc, runner, hub or client-<index>."
        )


class RunCa:
    """The certificate authority of one run; it signs the leaf certificate of every role.

    Args:
        certificate: the CA's self-signed certificate.
        private_key: the CA's ECDSA private key.
    """

    def __init__(
        self, certificate: x509.Certificate, private_key: ec.EllipticCurvePrivateKey
    ) -> None:
        self._certificate = certificate
        self._private_key = private_key
        self._cert_pem = certificate.public_bytes(serialization.Encoding.PEM)

    @classmethod
    def generate(
        cls, run_name: str, *, valid_days: int = 365, common_name: str | None = None
    ) -> RunCa:
        """Create a fresh CA for a run.

        Args:
            run_name: the run's name, written into the CA's common name.
            valid_days: how long the CA stays valid, in days from now.
            common_name: the CA's common name (default ``fedcore run <run_name> CA``).

        Returns:
            The new CA (ECDSA P-256, self-signed, path length 0).

        Raises:
            TransportError: ``run_name`` is empty or ``valid_days`` is not positive.
        """
        if not isinstance(run_name, str) or not run_name:
            raise TransportError(f"The run name must be a non-empty string, got {run_name!r}.")
        _check_valid_days(valid_days)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedcore"),
                x509.NameAttribute(NameOID.COMMON_NAME, common_name or _ca_common_name(run_name)),
            ]
        )
        now = datetime.datetime.now(datetime.UTC)
        public_key = key.public_key()
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            .not_valid_after(now + datetime.timedelta(days=valid_days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(certificate, key)

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate, PEM-encoded (the ``ca.crt`` of every bundle)."""
        return self._cert_pem

    @property
    def certificate(self) -> x509.Certificate:
        """The CA certificate."""
        return self._certificate

    def to_pem(self) -> tuple[bytes, bytes]:
        """Serialise the CA to persist it.

        Returns:
            ``(cert_pem, key_pem)``; the key is PKCS#8 and unencrypted, so store it as a secret.
        """
        key_pem = self._private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return self._cert_pem, key_pem

    @classmethod
    def from_pem(cls, cert_pem: bytes, key_pem: bytes) -> RunCa:
        """Load a CA saved with :meth:`to_pem`.

        Args:
            cert_pem: the CA certificate.
            key_pem: the CA's unencrypted private key.

        Returns:
            The CA.

        Raises:
            TransportError: the PEM is invalid, the key is not an EC key, the key does not
                match the certificate, or the certificate is not a CA.
        """
        try:
            certificate = x509.load_pem_x509_certificate(cert_pem)
            key = serialization.load_pem_private_key(key_pem, password=None)
        except (ValueError, TypeError) as exc:
            raise TransportError(f"The run CA's PEM data is invalid: {exc}.") from exc
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise TransportError(
                f"The run CA's private key is a {type(key).__name__}, not an EC key."
            )
        spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        if key.public_key().public_bytes(*spki) != certificate.public_key().public_bytes(*spki):
            raise TransportError("The run CA's private key does not match its certificate.")
        try:
            constraints = certificate.extensions.get_extension_for_class(x509.BasicConstraints)
        except x509.ExtensionNotFound as exc:
            raise TransportError("The run CA's certificate has no BasicConstraints.") from exc
        if not constraints.value.ca:
            raise TransportError("The run CA's certificate is not a CA certificate.")
        return cls(certificate, key)

    def issue(
        self,
        common_name: str,
        *,
        dns_names: Sequence[str] = (),
        ip_addresses: Sequence[str] = (),
        valid_days: int = 365,
    ) -> TlsBundle:
        """Issue a leaf certificate usable both as TLS server and as TLS client.

        A fedcore party (``common_name`` parses as an :class:`Identity`) gets its role name
        (:attr:`Identity.dns_name`) as a DNS name and its :attr:`Identity.uri` as a URI name,
        which no other party's certificate carries; callers check a peer by its role name, and
        servers check that the URI agrees with the common name. No name is added for free (no
        ``localhost``, no ``127.0.0.1``): a name every certificate carried would let any of
        them pass as any party reached under that name.

        Args:
            common_name: the subject's common name, e.g. ``client-7``.
            dns_names: extra DNS names (e.g. Kubernetes Service names).
            ip_addresses: extra IP addresses, v4 or v6, as strings.
            valid_days: how long the certificate stays valid, in days from now.

        Returns:
            The bundle: this CA's certificate, the leaf certificate and its fresh key.

        Raises:
            TransportError: a name, address or validity is invalid.
        """
        if not isinstance(common_name, str) or not 0 < len(common_name) <= _MAX_CN_CHARS:
            raise TransportError(
                f"The common name {common_name!r} must be a string of 1 to {_MAX_CN_CHARS} "
                "characters."
            )
        _check_valid_days(valid_days)
        try:
            party: Identity | None = Identity.parse(common_name)
        except TransportError:
            party = None  # not a party of the run (e.g. a webhook's certificate)
        role_names = [] if party is None else [party.dns_name]
        names: list[x509.GeneralName] = []
        for dns_name in dict.fromkeys([*role_names, *dns_names]):
            if not isinstance(dns_name, str) or not dns_name or not dns_name.isascii():
                raise TransportError(
                    f"The DNS name {dns_name!r} for {common_name!r} must be a non-empty ASCII "
                    "string."
                )
            if _is_role_name(dns_name) and (party is None or dns_name.lower() != role_names[0]):
                raise TransportError(
                    f"The DNS name {dns_name!r} for {common_name!r} is under {ROLE_DOMAIN!r} "
                    "but is not its own role name; a certificate carries only its own party's."
                )
            names.append(x509.DNSName(dns_name))
        addresses: dict[ipaddress.IPv4Address | ipaddress.IPv6Address, None] = {}
        for text in ip_addresses:
            try:
                addresses[ipaddress.ip_address(text)] = None
            except ValueError as exc:
                raise TransportError(
                    f"The IP address {text!r} for {common_name!r} is not a valid address."
                ) from exc
        names.extend(x509.IPAddress(address) for address in addresses)
        if party is not None:
            names.append(x509.UniformResourceIdentifier(party.uri))

        key = ec.generate_private_key(ec.SECP256R1())
        certificate = self._sign(
            common_name, key.public_key(), names, datetime.timedelta(days=valid_days)
        )
        return TlsBundle(
            ca_pem=self._cert_pem,
            cert_pem=certificate.public_bytes(serialization.Encoding.PEM),
            key_pem=key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )

    def sign_request(
        self,
        request_pem: bytes,
        *,
        common_name: str,
        uri: str | None = None,
        dns_names: Sequence[str] = (),
        valid_for: datetime.timedelta,
    ) -> bytes:
        """Sign a certificate request whose key was made elsewhere (and never sent here).

        The request must be a PEM PKCS#10 request with a valid self-signature, for an EC
        P-256 key, naming exactly ``common_name``; the certificate gets the names given here,
        never any the request asks for. A fedcore party's request (``common_name`` parses as an
        :class:`Identity`) gets its role name and URI, as :meth:`issue` gives them.

        Args:
            request_pem: the certificate request.
            common_name: the name the request must carry, and the certificate does.
            uri: a URI name for a certificate that names no party (e.g. a site's).
            dns_names: extra DNS names (never one under the role domain but the party's own).
            valid_for: how long the certificate stays valid (capped at the CA's own end).

        Returns:
            The PEM certificate.

        Raises:
            TransportError: the request is malformed, badly signed, for another name or for
                a key that is not EC P-256.
        """
        try:
            request = x509.load_pem_x509_csr(request_pem)
        except ValueError as exc:
            raise TransportError("The certificate request is not a PEM PKCS#10 request.") from exc
        if not request.is_signature_valid:
            raise TransportError("The certificate request's signature does not verify.")
        public_key = request.public_key()
        if not isinstance(public_key, ec.EllipticCurvePublicKey) or not isinstance(
            public_key.curve, ec.SECP256R1
        ):
            raise TransportError("The certificate request is not for an EC P-256 key.")
        names = request.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        asked = str(names[0].value) if len(names) == 1 else None
        if asked != common_name:
            raise TransportError(f"The certificate request names {asked!r}, not {common_name!r}.")
        try:
            party: Identity | None = Identity.parse(common_name)
        except TransportError:
            party = None
        general: list[x509.GeneralName] = []
        if party is not None:
            general.append(x509.DNSName(party.dns_name))
        for dns_name in dns_names:
            if _is_role_name(dns_name) and (party is None or dns_name.lower() != party.dns_name):
                raise TransportError(
                    f"The DNS name {dns_name!r} is under {ROLE_DOMAIN!r} but is not "
                    f"{common_name!r}'s own role name."
                )
            general.append(x509.DNSName(dns_name))
        if party is not None:
            general.append(x509.UniformResourceIdentifier(party.uri))
        elif uri is not None:
            general.append(x509.UniformResourceIdentifier(uri))
        certificate = self._sign(common_name, public_key, general, valid_for)
        return certificate.public_bytes(serialization.Encoding.PEM)

    def _sign(
        self,
        common_name: str,
        public_key: ec.EllipticCurvePublicKey,
        names: Sequence[x509.GeneralName],
        valid_for: datetime.timedelta,
    ) -> x509.Certificate:
        """A leaf certificate for ``public_key`` (TLS server and client), valid from now (less
        the clock skew) for ``valid_for``, never past this CA's own end."""
        now = datetime.datetime.now(datetime.UTC)
        ca_not_after = self._certificate.not_valid_after_utc
        builder = (
            x509.CertificateBuilder()
            .subject_name(_subject(common_name))
            .issuer_name(self._certificate.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            .not_valid_after(min(now + valid_for, ca_not_after))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._private_key.public_key()),
                critical=False,
            )
        )
        if names:  # an outsider's client-only certificate may carry none
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(self._private_key, hashes.SHA256())


def _named_certificate(
    cert_pem: bytes, not_pem: str = "Not a PEM certificate."
) -> tuple[x509.Certificate, str]:
    """A PEM certificate and its one common name.

    Raises:
        TransportError: ``cert_pem`` is not PEM (``not_pem``), or has no single common name.
    """
    try:
        certificate = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise TransportError(not_pem) from exc
    names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(names) != 1:
        raise TransportError("The certificate has no single common name.")
    return certificate, str(names[0].value)


def _subject(common_name: str) -> x509.Name:
    """A fedcore subject: organization ``fedcore``, the given common name."""
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedcore"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def fingerprint(cert_pem: bytes) -> str:
    """A certificate's fingerprint, ``sha256:<hex>`` of its DER form (what a site checks the
    hub's CA against, given out of band with its join token).

    Raises:
        TransportError: ``cert_pem`` is not a PEM certificate.
    """
    try:
        certificate = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise TransportError("Not a PEM certificate.") from exc
    return "sha256:" + certificate.fingerprint(hashes.SHA256()).hex()


def new_key_and_request(common_name: str) -> tuple[bytes, bytes]:
    """A fresh EC P-256 key and a certificate request for it naming ``common_name``.

    Returns:
        ``(key_pem, request_pem)``: the PKCS#8 key (keep it where it was made) and the request.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(_subject(common_name))
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key_pem, request.public_bytes(serialization.Encoding.PEM)


def certificate_facts(cert_pem: bytes) -> tuple[str, int, datetime.datetime, datetime.datetime]:
    """``(common name, serial, not before, not after)`` of a PEM certificate.

    Raises:
        TransportError: ``cert_pem`` is not a PEM certificate with one common name.
    """
    certificate, common_name = _named_certificate(cert_pem)
    return (
        common_name,
        certificate.serial_number,
        certificate.not_valid_before_utc,
        certificate.not_valid_after_utc,
    )


def _check_valid_days(valid_days: int) -> None:
    if isinstance(valid_days, bool) or not isinstance(valid_days, int) or valid_days < 1:
        raise TransportError(f"valid_days must be a positive integer, got {valid_days!r}.")


def _is_role_name(dns_name: str) -> bool:
    """Whether ``dns_name`` lies under :data:`ROLE_DOMAIN` (case-insensitively, as TLS does)."""
    lowered = dns_name.lower().rstrip(".")
    return lowered == ROLE_DOMAIN or lowered.endswith(f".{ROLE_DOMAIN}")


def _ca_common_name(run_name: str) -> str:
    """``fedcore run <run_name> CA``, shortened with a digest when over 64 characters."""
    common_name = f"fedcore run {run_name} CA"
    if len(common_name) <= _MAX_CN_CHARS:
        return common_name
    digest = hashlib.sha256(run_name.encode("utf-8")).hexdigest()[:8]
    room = _MAX_CN_CHARS - len("fedcore run ") - len(f"~{digest} CA")
    return f"fedcore run {run_name[:room]}~{digest} CA"


def issue_run_bundles(
    run_name: str,
    *,
    num_clients: int,
    hosts: Mapping[str, Sequence[str]] | None = None,
) -> tuple[RunCa, dict[str, TlsBundle]]:
    """Create a run's CA and one bundle per identity.

    Args:
        run_name: the run's name, written into the CA's common name.
        num_clients: how many client identities to issue (``client-0`` onwards).
        hosts: extra DNS names per common name, e.g. ``{"server": ["run-server.ns.svc"]}``;
            every bundle already carries its party's role name (:attr:`Identity.dns_name`).

    Returns:
        The CA and the bundles keyed by common name: ``kdc``, ``server``, ``runner``, then
        ``client-0`` to ``client-<num_clients - 1>``.

    Raises:
        TransportError: ``num_clients`` is negative, or ``hosts`` names an unknown identity.
    """
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 0:
        raise TransportError(f"num_clients must be a non-negative integer, got {num_clients!r}.")
    identities = [Identity("kdc"), Identity("server"), Identity("runner")]
    identities += [Identity("client", index) for index in range(num_clients)]
    common_names = [identity.common_name for identity in identities]
    extra = dict(hosts or {})
    unknown = sorted(set(extra) - set(common_names))
    if unknown:
        raise TransportError(
            f"hosts names {unknown}, which are not identities of this run; expected names "
            f"among kdc, server, runner and client-0 to client-{num_clients - 1}."
        )
    for common_name, dns_names in extra.items():
        if isinstance(dns_names, str):
            raise TransportError(
                f"hosts[{common_name!r}] must be a sequence of DNS names, not the string "
                f"{dns_names!r}."
            )
    ca = RunCa.generate(run_name)
    bundles = {name: ca.issue(name, dns_names=tuple(extra.get(name, ()))) for name in common_names}
    return ca, bundles

"""SecAgg+ key material: per-round X25519 keys, pair seeds, sealed shares, signed round keys.

Each round a client makes two fresh X25519 key pairs (``RoundKeys``): c, to agree with each
neighbour on an AES-256-GCM key that seals the shares it sends through the server
(``share_key``, ``seal_shares``, ``open_shares``), and s, to agree with each neighbour on the
seed of their pair mask (``pair_seed``). The private half of s is what the client
Shamir-shares, so the server can rebuild the pair seeds of a client that drops out (and check
the rebuilt key against the advertised public one, ``private_from_bytes``). Both derivations
are HKDF-SHA256 of the X25519 secret, bound by length-prefixed fields to the label
``fedcore/secagg/v1``, the purpose, the run, the round and the ordered pair. A client signs its
two public keys with the private key of its TLS certificate (``round_key_statement``,
``sign_round_keys``), and every peer checks that signature against the certificate, the run's
CA and the client's index (``verify_round_keys``), so the server cannot substitute keys of its
own for an honest client's.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature, InvalidTag, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedcore.errors import ProtocolError, TransportError
from fedcore.protocols.secagg.maths import PROTOCOL_LABEL, SHARE_BYTES
from fedcore.transport._tls import Identity

KEY_BYTES = 32
"""The size of an X25519 key (public or private), a pair seed and a share key."""

NONCE_BYTES = 12
"""The size of an AES-GCM nonce, prepended to each sealed ciphertext."""

TAG_BYTES = 16
"""The size of an AES-GCM tag."""

_MAX_INDEX = 2**64


def _frame(*parts: bytes | str | int) -> bytes:
    """An unambiguous encoding of ``parts``: each as a 4-byte big-endian length and its bytes
    (a str as UTF-8, an int as 8 bytes big-endian)."""
    out = bytearray()
    for part in parts:
        if isinstance(part, bool):
            raise TypeError("A frame holds no booleans.")
        if isinstance(part, int):
            data = part.to_bytes(8, "big")
        elif isinstance(part, str):
            data = part.encode("utf-8")
        else:
            data = bytes(part)
        out += len(data).to_bytes(4, "big") + data
    return bytes(out)


def _unframe(data: bytes, count: int) -> list[bytes]:
    """The ``count`` parts of a frame, or ProtocolError if ``data`` is not exactly that."""
    parts: list[bytes] = []
    offset = 0
    while offset < len(data) and len(parts) < count:
        if offset + 4 > len(data):
            break
        size = int.from_bytes(data[offset : offset + 4], "big")
        offset += 4
        if offset + size > len(data):
            break
        parts.append(data[offset : offset + size])
        offset += size
    if len(parts) != count or offset != len(data):
        raise ProtocolError(f"A frame of {count} fields is malformed.")
    return parts


def _check_index(value: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_INDEX:
        raise ProtocolError(f"The {what} is a non-negative 64-bit integer, not {value!r}.")


def _check_context(run: str, round: int) -> None:
    if not isinstance(run, str) or not run:
        raise ProtocolError(f"The run is a non-empty string, not {run!r}.")
    _check_index(round, "round")


# ------------------------------------------------------------------------------ round keys


@dataclass(frozen=True)
class RoundKeys:
    """A client's two fresh X25519 key pairs for one round.

    Attributes:
        c_private: agrees the AES-GCM keys that seal the shares the client sends and gets.
        s_private: agrees the pair-mask seeds; its private bytes are Shamir-shared.
    """

    c_private: X25519PrivateKey
    s_private: X25519PrivateKey

    @classmethod
    def new(cls) -> RoundKeys:
        """Two fresh key pairs from the operating system's CSPRNG."""
        return cls(X25519PrivateKey.generate(), X25519PrivateKey.generate())

    def public(self) -> tuple[bytes, bytes]:
        """The raw 32-byte public keys ``(c_public, s_public)``."""
        return (
            self.c_private.public_key().public_bytes_raw(),
            self.s_private.public_key().public_bytes_raw(),
        )

    def mask_private_bytes(self) -> bytes:
        """The raw 32 private bytes of s, the secret the client Shamir-shares."""
        return self.s_private.private_bytes_raw()

    @staticmethod
    def private_from_bytes(
        raw: bytes, expected_public: bytes | None = None, *, client: int | None = None
    ) -> X25519PrivateKey:
        """The module's ``private_from_bytes``: a mask key rebuilt from its shares."""
        return private_from_bytes(raw, expected_public, client=client)


def new_self_seed() -> bytes:
    """A fresh 32-byte self-mask seed b from the operating system's CSPRNG."""
    return os.urandom(KEY_BYTES)


def private_from_bytes(
    raw: bytes, expected_public: bytes | None = None, *, client: int | None = None
) -> X25519PrivateKey:
    """Rebuilds an X25519 private key from reconstructed bytes.

    Args:
        raw: the 32 bytes ``combine_shares`` returned.
        expected_public: the public key the client advertised (and signed); when given, the
            rebuilt key must be its private half, which false shares break.
        client: whose key it is, for the error message.

    Raises:
        ProtocolError: ``raw`` is not 32 bytes, or the key is not ``expected_public``'s.
    """
    who = f"client {client}" if client is not None else "a client"
    if not isinstance(raw, bytes) or len(raw) != KEY_BYTES:
        raise ProtocolError(f"The rebuilt mask key of {who} is not {KEY_BYTES} bytes.")
    key = X25519PrivateKey.from_private_bytes(raw)
    if expected_public is not None and key.public_key().public_bytes_raw() != expected_public:
        raise ProtocolError(
            f"The rebuilt mask key of {who} does not match its advertised public key; some "
            "share of it is false."
        )
    return key


def check_public_key(raw: bytes, *, client: int | None = None) -> None:
    """Checks that ``raw`` is a 32-byte X25519 public key, not all zeros.

    Raises:
        ProtocolError: the key is malformed (naming ``client`` when given).
    """
    who = f"client {client}" if client is not None else "a client"
    if not isinstance(raw, bytes) or len(raw) != KEY_BYTES or not any(raw):
        raise ProtocolError(
            f"A round X25519 public key of {who} is not {KEY_BYTES} bytes, not all zero."
        )


def _agree(
    private: X25519PrivateKey,
    peer_public: bytes,
    *,
    purpose: str,
    run: str,
    round: int,
    pair: tuple[int, int],
) -> bytes:
    """HKDF-SHA256 of the X25519 secret of ``private`` and ``peer_public`` for ``purpose``."""
    _check_context(run, round)
    if not isinstance(pair, tuple) or len(pair) != 2:
        raise ProtocolError(f"A pair is two client indices, not {pair!r}.")
    low, high = sorted(pair)
    _check_index(low, "pair's client")
    _check_index(high, "pair's client")
    if low == high:
        raise ProtocolError(f"A pair is two distinct clients, not {pair!r}.")
    if not isinstance(peer_public, bytes) or len(peer_public) != KEY_BYTES or not any(peer_public):
        raise ProtocolError(
            f"The peer's X25519 public key for pair {low}-{high} is not {KEY_BYTES} bytes, not "
            "all zero."
        )
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as exc:  # an all-zero secret: a low-order point
        raise ProtocolError(f"Key agreement for pair {low}-{high} failed: {exc}") from exc
    if not any(shared):  # pragma: no cover - cryptography already refuses it
        raise ProtocolError(f"Key agreement for pair {low}-{high} gave an all-zero secret.")
    salt = hashlib.sha256(_frame(PROTOCOL_LABEL, "salt", run)).digest()
    info = _frame(PROTOCOL_LABEL, purpose, run, round, low, high)
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt, info=info).derive(shared)


def pair_seed(
    private: X25519PrivateKey, peer_public: bytes, *, run: str, round: int, pair: tuple[int, int]
) -> bytes:
    """The 32-byte pair-mask seed s_uv of a pair for ``round``, from their s keys.

    Both ends get the same seed (the pair is ordered low, high); another pair, round or run
    gets an unrelated one.

    Raises:
        ProtocolError: the peer's key is malformed or of low order, or the pair, run or round
            is invalid.
    """
    return _agree(private, peer_public, purpose="pair-seed", run=run, round=round, pair=pair)


def share_key(
    private: X25519PrivateKey, peer_public: bytes, *, run: str, round: int, pair: tuple[int, int]
) -> bytes:
    """The 32-byte AES-GCM key that seals a pair's shares for ``round``, from their c keys.

    Its HKDF info differs from ``pair_seed``'s, so it never equals a mask seed even for the
    same keys.

    Raises:
        ProtocolError: as ``pair_seed``.
    """
    return _agree(private, peer_public, purpose="share-key", run=run, round=round, pair=pair)


# ------------------------------------------------------------------------------ sealed shares


def _shares_context(run: str, round: int, sender: int, receiver: int) -> bytes:
    _check_context(run, round)
    _check_index(sender, "sender")
    _check_index(receiver, "receiver")
    return _frame(PROTOCOL_LABEL, "shares", run, round, sender, receiver)


def seal_shares(
    key: bytes,
    *,
    run: str,
    round: int,
    sender: int,
    receiver: int,
    self_share: bytes,
    mask_share: bytes,
    self_signature: bytes = b"",
    mask_signature: bytes = b"",
) -> bytes:
    """Encrypts the sender's two shares for the receiver (AES-256-GCM), with the sender's
    signature of each (``share_statement``), so that the receiver can prove what it was dealt.

    The associated data binds the label, run, round, sender and receiver, so the ciphertext
    opens nowhere else. Returns a random 12-byte nonce followed by the ciphertext and tag.

    Raises:
        ProtocolError: the key is not 32 bytes, a share not ``SHARE_BYTES`` bytes, or the
            context is invalid.
    """
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ProtocolError(f"A share key has {KEY_BYTES} bytes.")
    for name, share in (("self", self_share), ("mask", mask_share)):
        if not isinstance(share, bytes) or len(share) != SHARE_BYTES:
            raise ProtocolError(f"Client {sender}'s {name} share is not {SHARE_BYTES} bytes.")
    context = _shares_context(run, round, sender, receiver)
    nonce = os.urandom(NONCE_BYTES)
    plain = _frame(self_share, mask_share, self_signature, mask_signature)
    return nonce + AESGCM(key).encrypt(nonce, plain, context)


def open_shares(
    key: bytes, *, run: str, round: int, sender: int, receiver: int, ciphertext: bytes
) -> tuple[bytes, bytes]:
    """Decrypts the two shares ``seal_shares`` sealed: ``(self_share, mask_share)``.

    Raises:
        ProtocolError: as ``open_signed_shares``.
    """
    opened = open_signed_shares(
        key, run=run, round=round, sender=sender, receiver=receiver, ciphertext=ciphertext
    )
    return opened[0], opened[1]


def open_signed_shares(
    key: bytes, *, run: str, round: int, sender: int, receiver: int, ciphertext: bytes
) -> tuple[bytes, bytes, bytes, bytes]:
    """Decrypts what ``seal_shares`` sealed: ``(self_share, mask_share, self_signature,
    mask_signature)`` (a signature is empty where the sender gave none).

    Raises:
        ProtocolError: the ciphertext is malformed, tampered with or sealed for another run,
            round, sender or receiver (or with another key), or holds shares of the wrong
            width; the message names the sender.
    """
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ProtocolError(f"A share key has {KEY_BYTES} bytes.")
    context = _shares_context(run, round, sender, receiver)
    if not isinstance(ciphertext, bytes) or len(ciphertext) < NONCE_BYTES + TAG_BYTES:
        raise ProtocolError(f"The sealed shares from client {sender} are truncated.")
    nonce, body = ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:]
    try:
        plain = AESGCM(key).decrypt(nonce, body, context)
    except InvalidTag as exc:
        raise ProtocolError(
            f"The sealed shares from client {sender} to client {receiver} do not open: tampered "
            "with, or sealed for another run, round, receiver or key."
        ) from exc
    try:
        self_share, mask_share, self_signature, mask_signature = _unframe(plain, 4)
    except ProtocolError as exc:
        raise ProtocolError(f"The sealed shares from client {sender} are malformed.") from exc
    if len(self_share) != SHARE_BYTES or len(mask_share) != SHARE_BYTES:
        raise ProtocolError(
            f"The sealed shares from client {sender} are not {SHARE_BYTES} bytes each."
        )
    return self_share, mask_share, self_signature, mask_signature


def share_statement(
    run: str, round: int, dealer: int, holder: int, kind: str, share: bytes
) -> bytes:
    """The bytes a dealer signs for one share it deals: the label, ``share``, run, round,
    dealer, holder, the share's kind (``self`` or ``mask``) and the share itself, framed.

    A holder that reveals a share with this signature proves the dealer dealt it; one that
    reveals anything else cannot sign for the dealer, so whoever lies about a share is named.

    Raises:
        ProtocolError: an invalid context, index or kind.
    """
    _check_context(run, round)
    _check_index(dealer, "dealer")
    _check_index(holder, "holder")
    if kind not in ("self", "mask"):
        raise ProtocolError(f"A share's kind is self or mask, not {kind!r}.")
    return _frame(PROTOCOL_LABEL, "share", run, round, dealer, holder, kind, share)


# ------------------------------------------------------------------------------ signatures


def round_key_statement(
    run: str, round: int, client: int, c_public: bytes, s_public: bytes, commitment: bytes = b""
) -> bytes:
    """The bytes a client signs for its round keys: the label, ``round-keys``, run, round,
    client index, both public keys and its commitment to its graph nonce (if any), each
    length-prefixed (4-byte big-endian length; ints as 8 bytes big-endian), so no two
    statements share an encoding.

    Raises:
        ProtocolError: a public key is malformed (naming the client) or the context is invalid.
    """
    _check_context(run, round)
    _check_index(client, "client")
    check_public_key(c_public, client=client)
    check_public_key(s_public, client=client)
    committed = (commitment,) if commitment else ()
    return _frame(PROTOCOL_LABEL, "round-keys", run, round, client, c_public, s_public, *committed)


def _statement_client(statement: bytes) -> int:
    """The client index a round-key statement names, or ProtocolError if it is not one."""
    try:
        label, kind, _run, _round, client = _unframe(statement, 8)[:5]
    except ProtocolError:  # a statement without a commitment
        label, kind, _run, _round, client = _unframe(statement, 7)[:5]
    if label != PROTOCOL_LABEL.encode() or kind != b"round-keys" or len(client) != 8:
        raise ProtocolError("The statement is not a SecAgg+ round-key statement.")
    return int.from_bytes(client, "big")


def sign_round_keys(tls_key_pem: bytes, statement: bytes) -> bytes:
    """Signs a round-key statement with the client's TLS private key.

    ECDSA with SHA-256 for the EC keys fedcore's CA issues (a DER signature); Ed25519 keys
    sign the statement directly.

    Raises:
        ProtocolError: the key is not an unencrypted PEM EC or Ed25519 private key.
    """
    return statement_signer(tls_key_pem)(statement)


def statement_signer(tls_key_pem: bytes) -> Callable[[bytes], bytes]:
    """A function that signs statements as ``sign_round_keys`` does, with the key loaded once
    (a client signs two shares per neighbour in a round).

    Raises:
        ProtocolError: as ``sign_round_keys``.
    """
    try:
        key = serialization.load_pem_private_key(tls_key_pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ProtocolError("The TLS key is not an unencrypted PEM private key.") from exc
    if isinstance(key, ec.EllipticCurvePrivateKey):
        curve_key = key
        return lambda statement: curve_key.sign(statement, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, ed25519.Ed25519PrivateKey):
        edwards_key = key
        return lambda statement: edwards_key.sign(statement)
    raise ProtocolError(f"The TLS key is a {type(key).__name__}, not an EC or Ed25519 key.")


def verify_under_certificate(cert_pem: bytes, who: str, statement: bytes, signature: bytes) -> None:
    """Checks ``signature`` over ``statement`` under the public key of ``cert_pem`` only: for
    the server, whose certificates are the ones every client already checked against the CA
    (``verify_round_keys``) before the stage that brings the signature.

    Raises:
        ProtocolError: the certificate is not PEM, or the signature does not verify.
    """
    _verify_under(_loaded_certificate(cert_pem), who, statement, signature)


@functools.lru_cache(maxsize=4096)
def _loaded_certificate(cert_pem: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(cert_pem)
    except (ValueError, TypeError) as exc:
        raise ProtocolError("A certificate is not a PEM certificate.") from exc


def verify_round_keys(
    cert_pem: bytes,
    ca_pem: bytes,
    client: int,
    statement: bytes,
    signature: bytes,
    *,
    now: datetime.datetime | None = None,
) -> None:
    """Checks that ``client`` signed ``statement`` with the key of a certificate of the run.

    The certificate must be issued directly by the CA (its signature checks under the CA's
    key), be within its validity (and the CA within its own) at ``now`` (default: the
    current time), name exactly ``client-<client>`` (common name and URI, as
    ``Identity.from_certificate`` reads them), allow digital signatures, and its key must
    verify ``signature`` over ``statement``, which must be a round-key statement for
    ``client``.

    Raises:
        ProtocolError: any check fails; the message names the client.
    """
    certificate = _checked_certificate(cert_pem, ca_pem, client, now)
    who = f"client {client}"
    try:
        named = _statement_client(statement)
    except ProtocolError as exc:
        raise ProtocolError(f"The round-key statement of {who} is malformed.") from exc
    if named != client:
        raise ProtocolError(f"The round-key statement checked for {who} names client {named}.")
    _verify_under(certificate, who, statement, signature)


def survivors_statement(run: str, round: int, survivors: Sequence[int], view: bytes = b"") -> bytes:
    """The bytes a client signs in the consistency stage: the label, ``survivors``, run,
    round, the client's ``view`` of the attempt (``view_digest``) and the survivor list,
    framed as ``round_key_statement`` frames its fields. Two clients' signatures agree only
    if the server showed them one attempt."""
    _check_context(run, round)
    for client in survivors:
        _check_index(client, "survivor")
    return _frame(PROTOCOL_LABEL, "survivors", run, round, view, *survivors)


def view_digest(
    adverts: Mapping[int, tuple[bytes, bytes, bytes]],
    members: Sequence[int],
    nonces: Mapping[int, bytes],
    shared: Sequence[int],
) -> bytes:
    """SHA-256 of what the server told one client of everyone in an attempt: each
    advertiser's (c key, s key, commitment), the members and their nonces, and who shared.

    Bell et al.'s malicious-server consistency check signs this with the survivor list: a
    server that shows clients different key lists, members or sharers gets signatures that
    do not verify for one another, and no client reveals shares on fewer than t of them.
    """
    parts: list[bytes | str | int] = ["adverts"]
    for client in sorted(adverts):
        parts += [client, *adverts[client]]
    parts += ["members", *members, *(nonces[client] for client in members), "shared", *shared]
    return hashlib.sha256(_frame(*parts)).digest()


def verify_signed(
    cert_pem: bytes,
    ca_pem: bytes,
    client: int,
    statement: bytes,
    signature: bytes,
    *,
    now: datetime.datetime | None = None,
) -> None:
    """Checks ``client``'s signature over any statement (e.g. ``survivors_statement``): the
    certificate checks of ``verify_round_keys``, without its statement's format.

    Raises:
        ProtocolError: any check fails; the message names the client.
    """
    certificate = _checked_certificate(cert_pem, ca_pem, client, now)
    _verify_under(certificate, f"client {client}", statement, signature)


def _verify_under(
    certificate: x509.Certificate, who: str, statement: bytes, signature: bytes
) -> None:
    """Verifies ``signature`` over ``statement`` under the certificate's public key."""
    if not isinstance(signature, bytes):
        raise ProtocolError(f"The signature of {who} is not bytes.")
    public = certificate.public_key()
    try:
        if isinstance(public, ec.EllipticCurvePublicKey):
            public.verify(signature, statement, ec.ECDSA(hashes.SHA256()))
        elif isinstance(public, ed25519.Ed25519PublicKey):
            public.verify(signature, statement)
        else:
            raise ProtocolError(
                f"The certificate of {who} holds a {type(public).__name__}, not an EC or "
                "Ed25519 key."
            )
    except InvalidSignature as exc:
        raise ProtocolError(
            f"The signature of {who} does not verify under its certificate."
        ) from exc


def _checked_certificate(
    cert_pem: bytes, ca_pem: bytes, client: int, now: datetime.datetime | None
) -> x509.Certificate:
    """The client's certificate, once checked against the CA, its validity, its name and
    its key usage (``verify_round_keys``'s contract). What does not change with time is
    checked once per (certificate, CA, client) and remembered: a round verifies every
    member's certificate, the same ones round after round."""
    certificate, authority = _issued_certificate(cert_pem, ca_pem, client)
    who = f"client {client}"
    moment = now if now is not None else datetime.datetime.now(datetime.UTC)
    for name, cert in (("certificate", certificate), ("CA certificate", authority)):
        if not cert.not_valid_before_utc <= moment <= cert.not_valid_after_utc:
            raise ProtocolError(
                f"The {name} checked for {who} is not valid at {moment.isoformat()} (valid "
                f"{cert.not_valid_before_utc.isoformat()} to "
                f"{cert.not_valid_after_utc.isoformat()})."
            )
    return certificate


@functools.lru_cache(maxsize=4096)
def _issued_certificate(
    cert_pem: bytes, ca_pem: bytes, client: int
) -> tuple[x509.Certificate, x509.Certificate]:
    """(certificate, CA) once the certificate is found issued by the CA to ``client-<client>``
    for signatures; ProtocolError otherwise (failures are not remembered)."""
    _check_index(client, "client")
    who = f"client {client}"
    try:
        certificate = x509.load_pem_x509_certificate(cert_pem)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"The certificate of {who} is not a PEM certificate.") from exc
    try:
        authority = x509.load_pem_x509_certificate(ca_pem)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"The CA to check {who}'s certificate is not PEM.") from exc
    try:
        certificate.verify_directly_issued_by(authority)
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm) as exc:
        raise ProtocolError(f"The certificate of {who} was not issued by the run's CA.") from exc
    try:
        identity = Identity.from_certificate(cert_pem)
    except TransportError as exc:
        raise ProtocolError(f"The certificate checked for {who} is not a party's: {exc}") from exc
    if identity != Identity("client", client):
        raise ProtocolError(
            f"The certificate checked for {who} names {identity.common_name!r}, not "
            f"'client-{client}'."
        )
    try:
        usage = certificate.extensions.get_extension_for_class(x509.KeyUsage).value
        if not usage.digital_signature:
            raise ProtocolError(f"The certificate of {who} does not allow signatures.")
    except x509.ExtensionNotFound:
        pass
    return certificate, authority

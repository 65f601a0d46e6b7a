"""Checkpoint keys: the files that hold them, and what a checkpoint derives from them.

A key file holds 32 random bytes as 64 hex digits (and an optional newline). A role's
checkpoint-authentication key (the server's; a decentralized protocol's client's own) comes
from the file that ``FEDCORE_CHECKPOINT_KEY_FILE`` names, the KDC's state key from
``FEDCORE_KDC_STATE_KEY_FILE`` (on Kubernetes: Secrets mounted into that role's pod alone).
Without the variable, a role uses its file in ``<workdir>/keys/`` (``checkpoint.key``,
``kdc-state.key``, ``client-<i>-checkpoint.key``) and creates it (mode 0600 in a 0700 folder)
when it is not there yet. A key is never logged or put
in a message; what identifies it in messages is its key id, a digest that reveals nothing of it.

From one key a checkpointer derives (HKDF-SHA256) an HMAC-SHA256 key that authenticates its
manifests and its latest-round record and, when it encrypts (the KDC), an AES-256-GCM key for
its parts.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedcore.errors import CheckpointError

log = logging.getLogger(__name__)

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
"""An AES-GCM tag."""
CHECKPOINT_KEY_ENV = "FEDCORE_CHECKPOINT_KEY_FILE"
"""A role's checkpoint-authentication key file: the server's (on Kubernetes: Secret
``<run>-server-keys``) or a decentralized protocol's client's own (``<run>-client-<i>-keys``)."""
KDC_STATE_KEY_ENV = "FEDCORE_KDC_STATE_KEY_FILE"
"""The KDC's state key file (on Kubernetes: Secret ``<run>-kdc-keys``)."""
ROLE_KEY_ENVS = (CHECKPOINT_KEY_ENV, KDC_STATE_KEY_ENV)
"""Every variable that names a role's key file: a process hands each role its own alone."""
KEYS_FOLDER = "keys"
"""The folder under a role's workdir that holds its key when no variable names one."""
CHECKPOINT_KEY_NAME = "checkpoint.key"
CLIENT_CHECKPOINT_KEY_NAME = "client-{index}-checkpoint.key"
"""A decentralized protocol's client's own key file in ``keys/``, ``{index}`` its index."""
KDC_STATE_KEY_NAME = "kdc-state.key"
_HEX = re.compile(r"[0-9a-fA-F]*")


class CheckpointKeyError(CheckpointError):
    """A checkpoint key file is missing, unreadable, malformed or readable by others."""


def read_key(path: Path, *, what: str = "checkpoint key") -> bytes:
    """Returns the 32-byte key a key file holds.

    Raises:
        CheckpointKeyError: the file cannot be read or does not hold exactly 64 hex digits
            (an optional final newline aside); the message never quotes the file's content.
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise CheckpointKeyError(
            f"The {what} file {path} cannot be read: {exc.strerror or exc}."
        ) from exc
    text = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1] if raw.endswith(b"\n") else raw
    try:
        digits = text.decode("ascii")
    except UnicodeDecodeError:
        digits = None
    if digits is None or not _HEX.fullmatch(digits):
        raise CheckpointKeyError(
            f"The {what} file {path} is malformed: it holds characters other than hex digits "
            f"(it must hold {2 * KEY_BYTES} hex digits, {KEY_BYTES} random bytes, and an "
            f"optional newline)."
        )
    if len(digits) != 2 * KEY_BYTES:
        raise CheckpointKeyError(
            f"The {what} file {path} is malformed: it holds {len(digits)} hex digits, not "
            f"{2 * KEY_BYTES} ({KEY_BYTES} random bytes)."
        )
    return bytes.fromhex(digits)


def ensure_key(path: Path, *, what: str = "checkpoint key") -> tuple[bytes, bool]:
    """Returns the key in ``path``, creating it first when it does not exist.

    A new key is 32 bytes from the OS CSPRNG, written as hex with mode 0600 in a folder of mode
    0700 (the folder is narrowed to 0700 when this user owns it). Two processes creating the same
    key at once end up with the same one: the file appears whole, by a hard link, or not at all.

    Returns:
        (the key, whether this call created it).

    Raises:
        CheckpointKeyError: the key cannot be created or read, is malformed, or an existing key
            file can be read or written by other users (group or others in its mode).
    """
    path = Path(path)
    folder = path.parent
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = folder.stat()
        if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077:
            folder.chmod(0o700)
    except OSError as exc:
        raise CheckpointKeyError(
            f"Cannot make the folder {folder} for the {what}: {exc.strerror or exc}."
        ) from exc
    created = False
    if not path.exists():
        temp = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            handle = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(handle, (secrets.token_hex(KEY_BYTES) + "\n").encode("ascii"))
                os.fsync(handle)
            finally:
                os.close(handle)
            try:
                os.link(temp, path)
                created = True
            except FileExistsError:
                pass  # another process made it first: use theirs
        except OSError as exc:
            raise CheckpointKeyError(
                f"Cannot create the {what} file {path}: {exc.strerror or exc}."
            ) from exc
        finally:
            with contextlib.suppress(OSError):
                temp.unlink()
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError as exc:
        raise CheckpointKeyError(
            f"The {what} file {path} cannot be read: {exc.strerror or exc}."
        ) from exc
    if mode & 0o077:
        raise CheckpointKeyError(
            f"The {what} file {path} can be read or written by other users (mode {mode:04o}); "
            f"run `chmod 600 {path}` (and replace the key if others may have read it)."
        )
    if created:
        log.info("Created a new %s in %s.", what, path)
    return read_key(path, what=what), created


def role_key(env: str, workdir: Path, name: str, *, what: str) -> bytes:
    """The key a role uses: the file the variable ``env`` names, else ``<workdir>/keys/<name>``.

    A file named by the variable must exist (a mounted Secret: it is never created); the one in
    the workdir is created when missing (a role started by hand).

    Raises:
        CheckpointKeyError: the key cannot be read or created, or is malformed.
    """
    named = os.environ.get(env)
    if named:
        log.info("Using the %s in %s (%s).", what, named, env)
        return read_key(Path(named), what=f"{what} ({env})")
    path = Path(workdir) / KEYS_FOLDER / name
    key, created = ensure_key(path, what=what)
    if not created:
        log.info("Using the %s in %s.", what, path)
    return key


def server_checkpoint_key(workdir: Path) -> bytes:
    """The server's checkpoint-authentication key (``FEDCORE_CHECKPOINT_KEY_FILE`` or
    ``<workdir>/keys/checkpoint.key``)."""
    return role_key(CHECKPOINT_KEY_ENV, workdir, CHECKPOINT_KEY_NAME, what="checkpoint key")


def kdc_state_key(workdir: Path) -> bytes:
    """The KDC's state key (``FEDCORE_KDC_STATE_KEY_FILE`` or ``<workdir>/keys/kdc-state.key``)."""
    return role_key(KDC_STATE_KEY_ENV, workdir, KDC_STATE_KEY_NAME, what="KDC state key")


def client_checkpoint_key_name(index: int) -> str:
    """``client-<index>-checkpoint.key``: client ``index``'s own key file in ``keys/``."""
    return CLIENT_CHECKPOINT_KEY_NAME.format(index=index)


def client_checkpoint_key(workdir: Path, index: int) -> bytes:
    """Client ``index``'s own checkpoint-authentication key, for a decentralized protocol whose
    clients keep their state (``FEDCORE_CHECKPOINT_KEY_FILE`` or
    ``<workdir>/keys/client-<index>-checkpoint.key``): no other party holds it."""
    return role_key(
        CHECKPOINT_KEY_ENV,
        workdir,
        client_checkpoint_key_name(index),
        what=f"checkpoint key of client {index}",
    )


def key_file_for(env: str, workdir: Path, name: str) -> Path:
    """Where a tool looks for a role's key: the variable's file, else ``<workdir>/keys/<name>``."""
    named = os.environ.get(env)
    return Path(named) if named else Path(workdir) / KEYS_FOLDER / name


class SealKey:
    """What a checkpointer derives from its key: a MAC key and, to encrypt, an AEAD key.

    Args:
        key: the 32-byte key.
        encrypt: also derive the AES-256-GCM key that encrypts the parts.
    """

    def __init__(self, key: bytes, *, encrypt: bool = False) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"A checkpoint key has {KEY_BYTES} bytes, not {len(key)}.")
        self._mac = _derive(key, b"fedcore checkpoint v2: manifest hmac-sha256")
        self._aead = (
            AESGCM(_derive(key, b"fedcore checkpoint v2: part aes-256-gcm")) if encrypt else None
        )
        self.key_id = hmac.new(key, b"fedcore checkpoint v2: key id", hashlib.sha256).hexdigest()[
            :16
        ]
        """Names the key in manifests and messages; reveals nothing of it."""

    @property
    def encrypts(self) -> bool:
        """Whether the parts are encrypted."""
        return self._aead is not None

    def tag(self, domain: bytes, message: bytes) -> str:
        """HMAC-SHA256 of ``domain``, a zero byte and ``message``, as hex."""
        return hmac.new(self._mac, domain + b"\0" + message, hashlib.sha256).hexdigest()

    def verify(self, domain: bytes, message: bytes, tag: object) -> bool:
        """Whether ``tag`` is the tag of ``message`` (in constant time)."""
        return isinstance(tag, str) and hmac.compare_digest(self.tag(domain, message), tag)

    def encrypt(self, data: bytes, associated: bytes) -> bytes:
        """A random 12-byte nonce followed by the AES-256-GCM ciphertext and its tag."""
        assert self._aead is not None
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, data, associated)

    def decrypt(self, data: bytes | bytearray | memoryview, associated: bytes) -> bytes:
        """Inverse of ``encrypt``.

        Raises:
            ValueError: the ciphertext, its nonce or the associated data were changed, or it
                was encrypted under another key.
        """
        assert self._aead is not None
        if len(data) < NONCE_BYTES + TAG_BYTES:
            raise ValueError("too short to be a ciphertext")
        view = memoryview(data)
        try:
            return self._aead.decrypt(
                bytes(view[:NONCE_BYTES]), bytes(view[NONCE_BYTES:]), associated
            )
        except InvalidTag as exc:
            raise ValueError("the AES-GCM tag does not verify") from exc


def _derive(key: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(key)

"""mpdp's key agreement and PRG: X25519 pair seeds, AES-CTR streams, the round's mask graph.

Each client makes an X25519 key pair once and hands only the public key to the KDC, which
relays every client's public key and a session id standing for the run (``run`` below). Two
clients u < v of an attempt derive the same 32-byte pair seed from X25519 and HKDF-SHA256
(salt and info bind the run, the round and the pair); the seed keys AES-256 in counter mode,
whose keystream is the PRG of their masks: u adds the mask, v subtracts it, so the masks
cancel in the sum. Nothing secret ever leaves a client.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedcore.errors import ProtocolError

KEY_BYTES = 32
"""The size of an X25519 public key, a pair seed and a client's noise secret."""

PROTOCOL_LABEL = "fedcore/mpdp/v2"
"""Domain separation of every HKDF and hash in this module. It names the version of the mask
derivation too (v2: the graph drawn from AES-CTR, the noise in blocks of
``_mpdp_maths.NOISE_BLOCK``): clients of another version compute other key fingerprints, so the
server refuses their uploads rather than combine masks that would not cancel."""

STREAM_DELTA = 1
"""The keystream of a pair's noise masks Delta on the gradient (both modes)."""
STREAM_CORRECTIONS = 2
"""The keystream of a pair's fixed-point masks on Psi, Phi and the loss scalars (Hardened)."""
STREAM_ETA = 3
"""The keystream of a client's own DP noise eta (keyed by the client's private secret)."""
STREAM_GRAPH = 4
"""The keystream of the round's mask graph (keyed by a public hash: every client draws it)."""


def new_private_key() -> X25519PrivateKey:
    """Returns a fresh X25519 private key from the operating system's CSPRNG."""
    return X25519PrivateKey.generate()


def public_bytes(key: X25519PrivateKey) -> bytes:
    """Returns the raw 32-byte public key of ``key``."""
    return key.public_key().public_bytes_raw()


def check_public_key(raw: bytes) -> None:
    """Checks that ``raw`` is 32 bytes that X25519 accepts as a public key.

    Raises:
        ProtocolError: the length is wrong or the key is all zeros.
    """
    if len(raw) != KEY_BYTES or not any(raw):
        raise ProtocolError(f"An X25519 public key has {KEY_BYTES} bytes, not all zero.")
    X25519PublicKey.from_public_bytes(raw)


def pair_seed(
    key: X25519PrivateKey, peer_public: bytes, *, run: str, round: int, pair: tuple[int, int]
) -> bytes:
    """Derives the pair's 32-byte seed for ``round``: HKDF-SHA256 of the X25519 secret.

    Both ends get the same seed (the pair is ordered low, high); another pair, round or run
    gets an unrelated one.

    Raises:
        ProtocolError: the peer's key is invalid (e.g. of low order: an all-zero secret).
    """
    shared = shared_secret(key, peer_public, pair=pair)
    return seed_from_shared(shared, run=run, round=round, pair=pair)


def shared_secret(key: X25519PrivateKey, peer_public: bytes, *, pair: tuple[int, int]) -> bytes:
    """The X25519 secret of ``key`` and a peer's public key (the same for every round).

    Raises:
        ProtocolError: the peer's key is invalid (e.g. of low order: an all-zero secret).
    """
    try:
        return key.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as exc:
        raise ProtocolError(f"Key agreement with client {pair} failed: {exc}") from exc


def seed_from_shared(shared: bytes, *, run: str, round: int, pair: tuple[int, int]) -> bytes:
    """The pair's seed for ``round``: HKDF-SHA256 of their X25519 secret (see ``pair_seed``)."""
    low, high = sorted(pair)
    salt = hashlib.sha256(f"{PROTOCOL_LABEL} run={run}".encode()).digest()
    info = f"{PROTOCOL_LABEL} pair-seed run={run} round={round} pair={low}-{high}".encode()
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt, info=info).derive(shared)


def noise_key(secret: bytes, *, run: str, round: int, client: int) -> bytes:
    """Derives a client's per-round key for its own noise from its private secret."""
    info = f"{PROTOCOL_LABEL} own-noise run={run} round={round} client={client}".encode()
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(secret)


def keystream(key: bytes, stream: int, count: int) -> np.ndarray:
    """Returns ``count`` uint64 words of AES-256-CTR keystream (stream id in the nonce).

    Distinct streams of one key never overlap: the 16-byte counter block is the stream id
    (8 bytes) followed by a block counter from 0.
    """
    return keystreams([(key, stream)], count)[0]


def keystreams(sources: Sequence[tuple[bytes, int]], count: int, *, offset: int = 0) -> np.ndarray:
    """Words ``offset`` .. ``offset + count - 1`` of each (key, stream)'s keystream, a row each.

    The words are those ``keystream`` returns at those positions (the counter starts at
    block ``offset / 2``), so a long stream can be taken in slices. ``offset`` must be even
    (an AES block holds two words).

    Raises:
        ValueError: ``offset`` is odd or negative.
    """
    if offset < 0 or offset % 2:
        raise ValueError(f"A keystream slice starts at an even word, not at {offset}.")
    rows = len(sources)
    if count <= 0 or rows == 0:
        return np.zeros((rows, max(count, 0)), dtype=np.uint64)
    size = 8 * count
    # CTR encrypts zeros into the keystream itself, straight into each row of the result.
    out = np.empty(rows * size + _BLOCK_SLACK, dtype=np.uint8)
    zeros = _zeros(size)
    counter = (offset // 2).to_bytes(8, "big")
    for row, (key, stream) in enumerate(sources):
        nonce = stream.to_bytes(8, "big") + counter
        encryptor = Cipher(algorithms.AES(key), modes.CTR(nonce)).encryptor()
        start = row * size
        written = encryptor.update_into(zeros, out.data[start : start + size + _BLOCK_SLACK])
        encryptor.finalize()
        if written != size:  # pragma: no cover - CTR is a stream mode
            raise ProtocolError(f"AES-CTR produced {written} bytes of keystream, not {size}.")
    return out[: rows * size].view("<u8").astype(np.uint64, copy=False).reshape(rows, count)


_BLOCK_SLACK = 15
"""``update_into`` needs room for one AES block less a byte beyond the data."""
_ZEROS = np.zeros(0, dtype=np.uint8)


def _zeros(size: int) -> memoryview:
    """``size`` zero bytes from one shared read-only buffer, grown as needed."""
    global _ZEROS
    if _ZEROS.size < size:
        zeros = np.zeros(max(size, 2 * _ZEROS.size), dtype=np.uint8)
        zeros.flags.writeable = False
        _ZEROS = zeros
    return _ZEROS.data[:size]


def mask_graph(
    participants: Sequence[int], *, kind: str, degree: int, run: str, round: int
) -> dict[int, tuple[int, ...]]:
    """Returns each participant's neighbours in the round's mask graph (symmetric).

    Complete: every pair. NOut: each participant picks ``degree`` others uniformly at random
    and an edge exists if either picked the other (a random n-out graph, the paper's Remark 4);
    the draw is keyed by a hash of (run, round, participant set), so every client computes
    the same graph and a redone attempt with other participants gets a new one.
    """
    members = sorted(participants)
    neighbours: dict[int, set[int]] = {k: set() for k in members}
    if kind == "Complete" or degree >= len(members) - 1:
        for k in members:
            neighbours[k] = {v for v in members if v != k}
    else:
        digest = hashlib.sha256(
            json.dumps([PROTOCOL_LABEL, "graph", run, round, members]).encode()
        ).digest()
        # Each member's picks: the ``degree`` others with the smallest uniform scores, a
        # uniformly random subset of that size, all members' scores from one keystream.
        count = len(members)
        words = count * (count - 1)
        scores = keystream(digest, STREAM_GRAPH, words + words % 2)[:words]
        picks = np.argpartition(scores.reshape(count, count - 1), degree - 1, axis=1)[:, :degree]
        # Row r's scores skip r itself: its column c is member c, or c + 1 from r on.
        chosen = picks + (picks >= np.arange(count)[:, None])
        for row, k in enumerate(members):
            for column in chosen[row].tolist():
                v = members[column]
                neighbours[k].add(v)
                neighbours[v].add(k)
    return {k: tuple(sorted(vs)) for k, vs in neighbours.items()}


def keys_fingerprint(run: str, round: int, public_keys: Mapping[int, bytes]) -> str:
    """A hash of the public keys an upload's masks were derived from (uploads must agree)."""
    h = hashlib.sha256(f"{PROTOCOL_LABEL} keys run={run} round={round}".encode())
    for index in sorted(public_keys):
        h.update(index.to_bytes(8, "big") + public_keys[index])
    return h.hexdigest()

"""secagg: SecAgg+ (Bell et al., CCS 2020) over the server's sessions, in six stages.

Every attempt of a round runs these stages (``ServerProtocol.next_stage``); the server only
relays, and learns the sum of the survivors' encoded updates and who survived:

0. **Advertise.** The server sends the global model and a fresh session id. Each client trains
   and clips its update (trained minus received: per coordinate to [-c, c], or to L2 norm C
   with distributed DP), makes two fresh X25519 key pairs (c: sealing shares, s: pair masks)
   and a fresh 32-byte nonce, and answers the public keys and a commitment to the nonce,
   signed with its TLS key, with its certificate.
1. **Reveal.** The server relays every advert (those that advertised). Each client checks every
   signature against the run's CA, then opens its commitment.
2. **Share keys.** The server relays the nonces (U1: the clients that revealed). Each client
   checks each against its commitment, derives the degree and threshold from |U1| and the spec
   itself (never from the server), draws the sharing graph from a seed that hashes the session
   and every nonce (committed before any was revealed: nobody chooses the graph),
   Shamir-shares a fresh self-mask seed b and its s private key among its neighbours, and
   seals each neighbour's two shares with AES-GCM under a key agreed over c.
3. **Masked input.** The server hands each client the sealed shares addressed to it and the
   clients that shared (U2). Each client encodes its update (levels, or integers plus its
   noise share) and uploads it + PRG(b) + sum over its neighbours in U2 of +-PRG(s_uv) mod
   2^bits.
4. **Consistency.** The server names the clients whose masked input arrived (U3); each client
   signs that list (once per attempt: it never signs two).
5. **Unmask.** The server sends the list with at least t signatures of its members. Each client
   checks them, then reveals, for each neighbour in U3 its self-seed share and for each
   neighbour in U2 but not U3 its key share: never both for one neighbour, and only for the
   list it signed. The server rebuilds each survivor's b and each dropped client's s key
   (checked against its signed public key), removes the masks and decodes the sum.

A round completes exactly while at least t neighbours of every client it must unmask survive
each stage; otherwise ``next_stage`` fails the attempt, nothing of it is revealed, and the round
policy redoes the round (``QuorumLost`` after ``maxRoundRetries``). What the server learns, and
what the analysis assumes, is in docs/protocols/secagg.md.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import secrets
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedcore.errors import ProtocolError
from fedcore.learning.poisoning import attack_of
from fedcore.learning.training import LocalLearner
from fedcore.privacy._noise import noise_generator
from fedcore.protocols._base import (
    ClientProtocol,
    Protocol,
    RoundResult,
    ServerProtocol,
    Weights,
)
from fedcore.protocols._maths import copy_weights, restore_weights
from fedcore.protocols.secagg import keys as sk
from fedcore.protocols.secagg import maths as sm
from fedcore.protocols.secagg import noise
from fedcore.spec import FederatedRunSpec
from fedcore.spec._options.secagg import SecAggOptions
from fedcore.spec._options.secagg_dp import DdpPlan
from fedcore.transport import Payload, TlsBundle

log = logging.getLogger(__name__)

MASKED = "masked"
"""The tensor name of a masked input."""
MASKED_STAGE = 3
"""The stage whose responses are the masked inputs (what the server sees of an update)."""
MAX_CERT_CHARS = 16_384
MAX_SIGNATURE_BYTES = 512
MAX_SEALED_BYTES = 1024
_ROUNDING_TAG = 0x5EC466
"""Separates the stochastic rounding's generator from every other use of the run's seed."""
_NOISE_TAG = 0x5EC000_0000
"""Plus the client index: the stream of a client's reproducible noise (secureNoise false)."""
"""Separates the stochastic rounding's generator from every other use of the run's seed."""


# ------------------------------------------------------------------------------ encodings


def _mask_key(raw: bytes, *, public: bytes, client: int) -> X25519PrivateKey:
    """A rebuilt mask key, checked against the public key its owner advertised."""
    return sk.private_from_bytes(raw, public, client=client)


def _hex(value: bytes) -> str:
    return value.hex()


def _unhex(value: object, *, what: str, size: int | None = None, limit: int = 4096) -> bytes:
    """Bytes from an untrusted hex string (exactly ``size`` bytes, or at most ``limit``)."""
    if not isinstance(value, str) or len(value) > 2 * limit or len(value) % 2:
        raise ProtocolError(f"The {what} is not a hex string of at most {limit} bytes.")
    try:
        raw = bytes.fromhex(value)
    except ValueError as exc:
        raise ProtocolError(f"The {what} is not a hex string.") from exc
    if size is not None and len(raw) != size:
        raise ProtocolError(f"The {what} is {len(raw)} bytes, not {size}.")
    return raw


def _clients(value: object, *, what: str) -> list[int]:
    """A strictly ascending list of client indices from an untrusted message."""
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise ProtocolError(f"The {what} is not a list of client indices.")
    if value != sorted(set(value)):
        raise ProtocolError(f"The {what} is not strictly ascending.")
    return list(value)


def _by_client(value: object, *, what: str) -> dict[int, Any]:
    """A map keyed by client index (JSON keys are strings) from an untrusted message."""
    if not isinstance(value, dict):
        raise ProtocolError(f"The {what} is not a map by client.")
    out: dict[int, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key.isdigit() or len(key) > 9:
            raise ProtocolError(f"The {what} has a key {key!r} that is not a client index.")
        out[int(key)] = item
    return out


def graph_seed(session: str, round: int, nonces: Mapping[int, bytes]) -> bytes:
    """The sharing graph's public seed: SHA-256 of the session, the round and every member's
    revealed nonce. Each nonce was committed to (``commitment``) and signed before any was
    revealed, so neither the server nor a client it controls can choose the graph; a coalition
    can only choose which of its own clients reveal (at most 2^c graphs for c clients)."""
    digest = hashlib.sha256()
    digest.update(f"{sm.PROTOCOL_LABEL}/graph/{session}/{round}".encode())
    for client in sorted(nonces):
        digest.update(client.to_bytes(8, "big") + nonces[client])
    return digest.digest()


def commitment(nonce: bytes) -> bytes:
    """A client's commitment to its graph nonce: SHA-256 of the label and the nonce."""
    return hashlib.sha256(f"{sm.PROTOCOL_LABEL}/nonce/".encode() + nonce).digest()


def float_names(weights: Weights) -> list[str]:
    """The tensors that are summed: the floating-point ones (others keep the global value)."""
    return [name for name, value in weights.items() if np.issubdtype(value.dtype, np.floating)]


@dataclass(frozen=True)
class Encoding:
    """How a round's updates become masked-input words, and the unmasked sum floats again.

    Attributes:
        bits: the masks' modulus is 2^bits.
        quantization: plain SecAgg+: the levels over [-clipRange, clipRange] (else None).
        plan: distributed DP: granularity, noise and modulus (else None).
        fewest: the fewest clients whose sum may be unmasked (clients refuse fewer).
    """

    bits: int
    quantization: sm.Quantization | None
    plan: DdpPlan | None
    fewest: int

    def decode(self, total: np.ndarray, count: int) -> np.ndarray:
        """The float sum of ``count`` inputs from their unmasked sum mod 2^bits."""
        if self.plan is not None:
            return noise.decode_sum(total, self.plan)
        assert self.quantization is not None
        return sm.dequantize_sum(total, count, self.quantization)


def parameters_of(
    options: SecAggOptions, members: int, *, fewest: int, dims: int
) -> tuple[int, int, Encoding]:
    """(degree, threshold, encoding) for ``members`` clients summing ``dims`` coordinates:
    what every party derives from the spec and the member count alone. ``fewest``: the spec's
    least sum (``SecAggOptions.fewest_summed``)."""
    degree, threshold = options.graph_parameters(members)
    least = max(threshold, 2)
    plan = options.dp_plan(fewest=fewest, members=members, dims=dims)
    if plan is not None:
        return degree, threshold, Encoding(plan.bits, None, plan, max(least, fewest))
    levels = 2**options.quantization_bits
    bits = sm.choose_bits(members, levels)
    return (
        degree,
        threshold,
        Encoding(bits, sm.Quantization(options.clip_range, levels, bits), None, least),
    )


# ------------------------------------------------------------------------------ server


@dataclass
class _Advert:
    c_public: bytes
    s_public: bytes
    signature: bytes
    cert: bytes
    commitment: bytes


@dataclass
class _ServerAttempt:
    round: int
    session: str
    stage: int = 0
    adverts: dict[int, _Advert] = field(default_factory=dict)
    nonces: dict[int, bytes] = field(default_factory=dict)
    members: list[int] = field(default_factory=list)  # U1: advertised and revealed
    degree: int = 0
    threshold: int = 0
    encoding: Encoding | None = None
    graph: dict[int, tuple[int, ...]] = field(default_factory=dict)
    sealed: dict[int, dict[int, str]] = field(default_factory=dict)  # sender -> receiver
    shared: list[int] = field(default_factory=list)  # U2
    masked: dict[int, np.ndarray] = field(default_factory=dict)
    survivors: list[int] = field(default_factory=list)  # U3
    signatures: dict[int, str] = field(default_factory=dict)
    total: np.ndarray | None = None  # the dequantized sum of the survivors' updates


class SecAggServer(ServerProtocol):
    """Relays the six stages and applies the mean of the survivors' updates.

    Args:
        initial: the initial global model.
        options: ``spec.protocol.secagg`` (or its defaults).
    """

    kind = "secagg"

    def __init__(self, initial: Weights, options: SecAggOptions, *, fewest: int = 2) -> None:
        self._weights = copy_weights(initial)
        self._options = options
        self._fewest = fewest
        self._names = float_names(initial)
        self._size = sum(int(np.size(initial[name])) for name in self._names)
        self._attempt: _ServerAttempt | None = None
        self._barred: dict[int, str] = {}  # client -> what it was caught doing

    @property
    def barred(self) -> Mapping[int, str]:
        """The clients caught falsifying a share, and how: they sit out every later attempt."""
        return dict(self._barred)

    def _bar(self, client: int, why: str) -> None:
        """Bars ``client`` from the rest of the run (logged with the reason)."""
        if client not in self._barred:
            self._barred[client] = why
            log.warning("secagg: client %d is barred from the run: %s", client, why)

    # ----------------------------------------------------------------- stage 0: plan

    def plan_round(self, round: int, clients: Sequence[int]) -> Mapping[int, Payload]:
        """Opens an attempt for ``clients``, less any barred client (which sits it out)."""
        session = secrets.token_hex(16)
        self._attempt = _ServerAttempt(round, session)
        instruction = Payload(meta={"session": session}, tensors=self._weights)
        return {client: instruction for client in clients if client not in self._barred}

    def _current(self, round: int) -> _ServerAttempt:
        attempt = self._attempt
        if attempt is None or attempt.round != round:
            raise ProtocolError(f"No secagg attempt of round {round} is open.")
        return attempt

    # ---------------------------------------------------------------- check responses

    def check_upload(self, round: int, client: int, upload: Payload) -> None:
        attempt = self._current(round)
        what = f"client {client}'s stage-{attempt.stage} response in round {round}"
        meta = upload.meta
        if "declined" in meta:
            raise ProtocolError(
                f"Client {client} declined stage {attempt.stage}: {str(meta['declined'])[:300]}"
            )
        if attempt.stage != 3 and upload.tensors:
            raise ProtocolError(f"The {what} carries tensors.")
        if attempt.stage == 0:
            attempt.adverts[client] = self._advert(client, meta, what)
        elif attempt.stage == 1:
            nonce = _unhex(meta.get("nonce"), what=f"nonce in {what}", size=sm.SEED_BYTES)
            if commitment(nonce) != attempt.adverts[client].commitment:
                raise ProtocolError(f"The {what}'s nonce does not open its commitment.")
            attempt.nonces[client] = nonce
        elif attempt.stage == 2:
            sealed = _by_client(meta.get("shares"), what=f"shares of {what}")
            if set(sealed) != set(attempt.graph.get(client, ())):
                raise ProtocolError(
                    f"The {what} seals shares for {sorted(sealed)}, not for its "
                    f"neighbours {list(attempt.graph.get(client, ()))}."
                )
            for receiver, text in sealed.items():
                _unhex(text, what=f"sealed shares for {receiver} in {what}", limit=MAX_SEALED_BYTES)
            attempt.sealed[client] = sealed
        elif attempt.stage == 3:
            assert attempt.encoding is not None
            masked = upload.tensors.get(MASKED)
            if set(upload.tensors) != {MASKED} or masked is None:
                raise ProtocolError(f"The {what} must carry exactly the tensor {MASKED!r}.")
            if masked.dtype != np.uint64 or masked.shape != (self._size,):
                raise ProtocolError(f"The {what}'s masked input is not {self._size} uint64 words.")
            if self._size and int(masked.max()) >> attempt.encoding.bits:
                raise ProtocolError(
                    f"The {what}'s masked input has words of 2^{attempt.encoding.bits} or more."
                )
            attempt.masked[client] = masked
        elif attempt.stage == 4:
            _unhex(meta.get("signature"), what=f"signature in {what}", limit=MAX_SIGNATURE_BYTES)
            attempt.signatures[client] = meta["signature"]
        else:
            self._check_reveal(attempt, client, meta, what)

    def _advert(self, client: int, meta: Mapping[str, Any], what: str) -> _Advert:
        c_public = _unhex(meta.get("c"), what=f"c key in {what}", size=sk.KEY_BYTES)
        s_public = _unhex(meta.get("s"), what=f"s key in {what}", size=sk.KEY_BYTES)
        sk.check_public_key(c_public, client=client)
        sk.check_public_key(s_public, client=client)
        signature = _unhex(
            meta.get("signature"), what=f"signature in {what}", limit=MAX_SIGNATURE_BYTES
        )
        cert = meta.get("cert")
        if not isinstance(cert, str) or not 0 < len(cert) <= MAX_CERT_CHARS or not cert.isascii():
            raise ProtocolError(f"The {what} does not carry a PEM certificate.")
        committed = _unhex(meta.get("commitment"), what=f"commitment in {what}", size=32)
        return _Advert(c_public, s_public, signature, cert.encode(), committed)

    def _check_reveal(
        self, attempt: _ServerAttempt, client: int, meta: Mapping[str, Any], what: str
    ) -> None:
        neighbours = set(attempt.graph.get(client, ()))
        survivors, shared = set(attempt.survivors), set(attempt.shared)
        selfs = _by_client(meta.get("self"), what=f"self-seed shares of {what}")
        masks = _by_client(meta.get("mask"), what=f"key shares of {what}")
        if not set(selfs) <= neighbours & survivors or not set(masks) <= neighbours & (
            shared - survivors
        ):
            raise ProtocolError(f"The {what} reveals shares of clients it may not.")
        for owner, text in [*selfs.items(), *masks.items()]:
            _unhex(text, what=f"share of client {owner} in {what}", size=sm.SHARE_BYTES)
        for kind, revealed in (("self", selfs), ("mask", masks)):
            signed = _by_client(meta.get(f"{kind}_signatures"), what=f"{kind} signatures")
            if set(signed) != set(revealed):
                raise ProtocolError(f"The {what} does not sign for exactly its {kind} shares.")
            for owner, text in signed.items():
                _unhex(text, what=f"signature of client {owner}", limit=MAX_SIGNATURE_BYTES)

    # ------------------------------------------------------------------- next stage

    def next_stage(
        self, round: int, stage: int, responses: Mapping[int, Payload], failures: Sequence[int]
    ) -> Mapping[int, Payload] | None:
        attempt = self._current(round)
        if stage != attempt.stage:
            raise ProtocolError(
                f"Stage {stage} settled, but the attempt is in stage {attempt.stage}."
            )
        step = (
            self._to_revealing,
            self._to_sharing,
            self._to_masking,
            self._to_consistency,
            self._to_unmasking,
            self._unmask,
        )[stage]
        following = step(attempt, sorted(responses), responses)
        attempt.stage += 1
        return following

    def _need(self, attempt: _ServerAttempt, count: int, what: str) -> None:
        least = attempt.encoding.fewest if attempt.encoding is not None else 2
        if count < least:
            raise ProtocolError(
                f"Only {count} clients {what}; secagg needs at least {least} (its threshold, "
                "or the quorum its noise is calibrated for), so nothing of this attempt is "
                "revealed."
            )

    def _to_revealing(
        self, attempt: _ServerAttempt, responders: list[int], _: Any
    ) -> Mapping[int, Payload]:
        advertised = [k for k in responders if k in attempt.adverts]
        self._need(attempt, len(advertised), "advertised their keys")
        instruction = Payload(
            meta={
                "session": attempt.session,
                "advertised": advertised,
                "keys": {
                    str(k): {
                        "c": _hex(a.c_public),
                        "s": _hex(a.s_public),
                        "commitment": _hex(a.commitment),
                        "signature": _hex(a.signature),
                        "cert": a.cert.decode(),
                    }
                    for k, a in ((k, attempt.adverts[k]) for k in advertised)
                },
            }
        )
        return {k: instruction for k in advertised}

    def _to_sharing(
        self, attempt: _ServerAttempt, responders: list[int], _: Any
    ) -> Mapping[int, Payload]:
        members = [k for k in responders if k in attempt.nonces]
        self._need(attempt, len(members), "revealed their nonces")
        attempt.members = members
        attempt.degree, attempt.threshold, attempt.encoding = parameters_of(
            self._options, len(members), fewest=self._fewest, dims=self._size
        )
        nonces = {k: attempt.nonces[k] for k in members}
        attempt.graph = sm.sharing_graph(
            members, attempt.degree, graph_seed(attempt.session, attempt.round, nonces)
        )
        instruction = Payload(
            meta={
                "session": attempt.session,
                "members": members,
                "nonces": {str(k): _hex(nonce) for k, nonce in nonces.items()},
            }
        )
        return {k: instruction for k in members}

    def _to_masking(
        self, attempt: _ServerAttempt, responders: list[int], _: Any
    ) -> Mapping[int, Payload]:
        shared = [k for k in responders if k in attempt.sealed]
        self._need(attempt, len(shared), "shared their keys")
        attempt.shared = shared
        plans = {}
        for k in shared:
            incoming = {
                str(v): attempt.sealed[v][k] for v in attempt.graph[k] if v in attempt.sealed
            }
            plans[k] = Payload(
                meta={"session": attempt.session, "shared": shared, "sealed": incoming}
            )
        return plans

    def _to_consistency(
        self, attempt: _ServerAttempt, responders: list[int], _: Any
    ) -> Mapping[int, Payload]:
        survivors = [k for k in responders if k in attempt.masked]
        self._need(attempt, len(survivors), "sent their masked inputs")
        attempt.survivors = survivors
        attempt.masked = {k: attempt.masked[k] for k in survivors}
        instruction = Payload(meta={"session": attempt.session, "survivors": survivors})
        return {k: instruction for k in survivors}

    def _to_unmasking(
        self, attempt: _ServerAttempt, responders: list[int], _: Any
    ) -> Mapping[int, Payload]:
        signed = [k for k in responders if k in attempt.signatures]
        self._need(attempt, len(signed), "signed the survivor list")
        instruction = Payload(
            meta={
                "session": attempt.session,
                "survivors": attempt.survivors,
                "signatures": {str(k): attempt.signatures[k] for k in signed},
            }
        )
        return {k: instruction for k in signed}

    def _unmask(
        self, attempt: _ServerAttempt, responders: list[int], responses: Mapping[int, Payload]
    ) -> None:
        assert attempt.encoding is not None
        survivors, shared = set(attempt.survivors), set(attempt.shared)
        dropped = shared - survivors
        revealed: dict[tuple[str, int], dict[int, tuple[bytes, bytes]]] = {}
        for holder in responders:
            meta = responses[holder].meta
            for kind in ("self", "mask"):
                shares = _by_client(meta.get(kind), what=f"{kind} shares")
                signatures = _by_client(meta.get(f"{kind}_signatures"), what="signatures")
                for owner, text in shares.items():
                    signed = (bytes.fromhex(text), bytes.fromhex(signatures[owner]))
                    revealed.setdefault((kind, owner), {})[holder] = signed
        graph = {u: tuple(v for v in attempt.graph[u] if v in shared) for u in sorted(shared)}
        seeds = {
            u: self._recover(attempt, u, "self", revealed.get(("self", u), {}))
            for u in sorted(survivors)
        }
        pair_seeds = {}
        rebuilt = {}
        for u, d in sorted(sm.needed_edges(graph, survivors, dropped)):
            if d not in rebuilt:
                rebuilt[d] = self._recover(
                    attempt,
                    d,
                    "mask",
                    revealed.get(("mask", d), {}),
                    functools.partial(_mask_key, public=attempt.adverts[d].s_public, client=d),
                )
            pair = (min(u, d), max(u, d))
            pair_seeds[(u, d)] = sk.pair_seed(
                rebuilt[d],
                attempt.adverts[u].s_public,
                run=attempt.session,
                round=attempt.round,
                pair=pair,
            )
        total = sm.unmask_sum(
            attempt.masked,
            graph=graph,
            self_seeds=seeds,
            dropped_pair_seeds=pair_seeds,
            bits=attempt.encoding.bits,
        )
        attempt.total = attempt.encoding.decode(total, len(survivors))
        return None

    def _recover(
        self,
        attempt: _ServerAttempt,
        owner: int,
        kind: str,
        revealed: Mapping[int, tuple[bytes, bytes]],
        commit: Callable[[bytes], Any] | None = None,
    ) -> Any:
        """``owner``'s ``kind`` secret from the revealed (share, dealer's signature) pairs,
        through ``commit`` (a check against a public commitment) where given.

        Shares that do not agree are sorted out by the dealer's signatures: a holder that
        revealed a share ``owner`` did not sign is barred and its share dropped; shares that
        all carry ``owner``'s signature yet do not agree bar ``owner``. With exactly t shares a
        false one would not show, so their signatures are always checked then.

        Raises:
            ProtocolError: fewer than t shares (or fewer than t once the false ones are
                dropped), or a dealer that dealt inconsistent shares: the attempt fails, and
                the barred clients sit out the next one.
        """
        t = attempt.threshold
        what = "self-mask seed" if kind == "self" else "mask key"

        def enough(chosen: Mapping[int, tuple[bytes, bytes]], which: str) -> None:
            if len(chosen) < t:
                raise ProtocolError(
                    f"Only {len(chosen)} {which} shares of client {owner}'s {what} came back "
                    f"(threshold {t}); it cannot be rebuilt, and any client that revealed a "
                    "false one is barred."
                )

        def rebuilt(chosen: Mapping[int, tuple[bytes, bytes]]) -> Any:
            secret = sm.combine_shares({h: share for h, (share, _) in chosen.items()}, t)
            return secret if commit is None else commit(secret)

        shares = dict(revealed)
        checked = len(shares) == t  # a false one among exactly t would not show: check now
        if checked:
            shares = self._signed_by_dealer(attempt, owner, kind, shares)
        enough(shares, "valid")
        try:
            return rebuilt(shares)
        except ProtocolError as exc:
            log.warning("The shares of client %d's %s disagree: %s", owner, what, exc)
        honest = shares if checked else self._signed_by_dealer(attempt, owner, kind, shares)
        enough(honest, "dealt")
        try:
            return rebuilt(honest)
        except ProtocolError:
            self._bar(owner, f"it dealt shares of its {what} that disagree, each signed by it")
            raise ProtocolError(
                f"Client {owner} dealt shares of its {what} that disagree, each signed by it: "
                "it is barred, and the attempt is redone without it."
            ) from None

    def _signed_by_dealer(
        self,
        attempt: _ServerAttempt,
        owner: int,
        kind: str,
        shares: Mapping[int, tuple[bytes, bytes]],
    ) -> dict[int, tuple[bytes, bytes]]:
        """The shares whose signature by ``owner`` verifies; their holders are barred
        otherwise (an honest holder reveals only shares its dealer signed)."""
        cert = attempt.adverts[owner].cert
        kept = {}
        for holder, (share, signature) in shares.items():
            statement = sk.share_statement(
                attempt.session, attempt.round, owner, holder, kind, share
            )
            try:
                sk.verify_under_certificate(cert, f"client {owner}", statement, signature)
            except ProtocolError:
                self._bar(
                    holder,
                    f"it revealed a {kind} share of client {owner} that client {owner} did not "
                    "deal (its signature does not verify)",
                )
                continue
            kept[holder] = (share, signature)
        return kept

    # ---------------------------------------------------------------------- combine

    def combine(
        self, round: int, uploads: Mapping[int, Payload], failures: Sequence[int]
    ) -> RoundResult | None:
        attempt = self._attempt
        if attempt is None or attempt.round != round or attempt.total is None:
            return None
        self._attempt = None
        survivors = attempt.survivors
        mean = attempt.total / len(survivors)
        updated = dict(self._weights)
        at = 0
        for name in self._names:
            value = self._weights[name]
            size = int(np.size(value))
            step = mean[at : at + size].reshape(value.shape)
            updated[name] = (value.astype(np.float64) + step).astype(value.dtype)
            at += size
        if not all(np.all(np.isfinite(updated[name])) for name in self._names):
            raise ProtocolError(f"Round {round}'s aggregate is not finite; the model is kept.")
        self._weights = updated
        return RoundResult(
            participants=len(survivors),
            train_loss=None,  # a client's loss is its own: only the sum is revealed
            metrics={
                "degree": float(attempt.degree),
                "threshold": float(attempt.threshold),
                "dropped_after_sharing": float(len(attempt.shared) - len(survivors)),
                "barred": float(len(self._barred)),
            },
        )

    def global_weights(self) -> Weights:
        return self._weights

    def state_dict(self) -> dict[str, Any]:
        barred = {str(k): why for k, why in self._barred.items()}
        return {
            "kind": self.kind,
            "version": 1,
            "weights": copy_weights(self._weights),
            "barred": barred,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._weights = restore_weights(state, self.kind, self._weights)
        barred = state.get("barred", {})
        if not isinstance(barred, Mapping):
            raise ProtocolError("The checkpoint's barred clients are not a mapping.")
        self._barred = {int(k): str(why) for k, why in barred.items()}


# ------------------------------------------------------------------------------ client


@dataclass
class _ClientAttempt:
    round: int
    session: str
    keys: sk.RoundKeys
    update: np.ndarray  # clipped, in float64; encoded at stage 3
    words: np.ndarray | None = None  # the encoded input, before its masks
    nonce: bytes = b""
    commitments: dict[int, bytes] = field(default_factory=dict)
    members: list[int] = field(default_factory=list)
    publics: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    certs: dict[int, bytes] = field(default_factory=dict)
    neighbours: tuple[int, ...] = ()
    threshold: int = 0
    encoding: Encoding | None = None
    self_seed: bytes = b""
    sealed: dict[int, bytes] = field(default_factory=dict)
    share_keys: dict[int, bytes] = field(default_factory=dict)  # by neighbour, from stage 2
    shared: list[int] = field(default_factory=list)
    nonces: dict[int, bytes] = field(default_factory=dict)  # the members', from stage 2
    committed: list[int] | None = None  # the survivor list this client signed
    revealed: bool = False
    stage: int = 0


class SecAggClient(ClientProtocol):
    """Trains, then answers the six stages; refuses what an honest client must refuse.

    Args:
        index: this client's index.
        options: ``spec.protocol.secagg`` (or its defaults).
        seed: ``spec.seed`` (the stochastic rounding's generator).
        fewest: the spec's least sum (``SecAggOptions.fewest_summed``).
        drops_after_sharing: an experiment's dropout (``spec.attack`` DropAfterSharing): the
            client declines every stage 3 (its masked input).
    """

    def __init__(
        self,
        index: int,
        options: SecAggOptions,
        seed: int,
        *,
        fewest: int = 2,
        drops_after_sharing: bool = False,
    ) -> None:
        self._drops_after_sharing = drops_after_sharing
        self._index = index
        self._options = options
        self._seed = seed
        self._fewest = fewest
        self._tls: TlsBundle | None = None
        self._signer: Callable[[bytes], bytes] | None = None
        self._attempt: _ClientAttempt | None = None

    needs_identity = True

    def set_identity(self, tls: TlsBundle) -> None:
        self._tls = tls
        self._signer = sk.statement_signer(tls.key_pem)

    def compute_upload(
        self, round: int, instruction: Payload, learner: LocalLearner, keys: Payload | None
    ) -> Payload:
        if self._tls is None:
            raise ProtocolError(
                "secagg signs its round keys with the client's TLS key; none is set."
            )
        session = instruction.meta.get("session")
        if not isinstance(session, str) or not 16 <= len(session) <= 128 or not session.isalnum():
            raise ProtocolError("The task carries no valid secagg session id.")
        weights, _ = learner.train(instruction.tensors, round=round)  # its loss stays here
        names = float_names(instruction.tensors)
        update = (
            np.concatenate(
                [
                    (
                        np.asarray(weights[n], dtype=np.float64)
                        - np.asarray(instruction.tensors[n], dtype=np.float64)
                    ).reshape(-1)
                    for n in names
                ]
            )
            if names
            else np.zeros(0)
        )
        dp = self._options.distributed_dp
        if dp is not None:
            update = noise.clip_l2(update, dp.clipping_norm)
        else:
            np.clip(update, -self._options.clip_range, self._options.clip_range, out=update)
        round_keys = sk.RoundKeys.new()
        c_public, s_public = round_keys.public()
        nonce = sk.new_self_seed()  # 32 bytes from the OS CSPRNG
        committed = commitment(nonce)
        statement = sk.round_key_statement(
            session, round, self._index, c_public, s_public, committed
        )
        assert self._signer is not None
        signature = self._signer(statement)
        self._attempt = _ClientAttempt(round, session, round_keys, update, nonce=nonce)
        return Payload(
            meta={
                "c": _hex(c_public),
                "s": _hex(s_public),
                "commitment": _hex(committed),
                "signature": _hex(signature),
                "cert": self._tls.cert_pem.decode(),
            }
        )

    def respond(self, round: int, stage: int, instruction: Payload) -> Payload:
        attempt = self._attempt
        if (
            attempt is None
            or attempt.round != round
            or instruction.meta.get("session") != attempt.session
        ):
            raise ProtocolError(
                f"Stage {stage} of round {round} names no attempt this client is in."
            )
        if stage != attempt.stage + 1:
            raise ProtocolError(f"Asked for stage {stage} after stage {attempt.stage}.")
        if instruction.tensors:
            raise ProtocolError(f"The stage-{stage} request carries tensors.")
        step = {
            1: self._open_nonce,
            2: self._share,
            3: self._mask,
            4: self._sign,
            5: self._reveal,
        }.get(stage)
        if step is None:
            raise ProtocolError(f"secagg has no stage {stage}.")
        response = step(attempt, instruction.meta)
        attempt.stage = stage
        return response

    def _open_nonce(self, attempt: _ClientAttempt, meta: Mapping[str, Any]) -> Payload:
        """Stage 1: checks every advertised key and commitment against its signer's
        certificate, then opens this client's own commitment."""
        assert self._tls is not None
        advertised = _clients(meta.get("advertised"), what="list of clients that advertised")
        if self._index not in advertised:
            raise ProtocolError("The list of clients that advertised leaves this client out.")
        adverts = _by_client(meta.get("keys"), what="advertised keys")
        if set(adverts) != set(advertised):
            raise ProtocolError("The advertised keys are not exactly the advertisers'.")
        for v in advertised:
            advert = adverts[v]
            if not isinstance(advert, dict):
                raise ProtocolError(f"Client {v}'s advertised keys are malformed.")
            c_public = _unhex(advert.get("c"), what=f"c key of client {v}", size=sk.KEY_BYTES)
            s_public = _unhex(advert.get("s"), what=f"s key of client {v}", size=sk.KEY_BYTES)
            committed = _unhex(advert.get("commitment"), what=f"commitment of client {v}", size=32)
            signature = _unhex(
                advert.get("signature"), what=f"signature of client {v}", limit=MAX_SIGNATURE_BYTES
            )
            cert = advert.get("cert")
            if not isinstance(cert, str) or len(cert) > MAX_CERT_CHARS or not cert.isascii():
                raise ProtocolError(f"Client {v}'s certificate is malformed.")
            statement = sk.round_key_statement(
                attempt.session, attempt.round, v, c_public, s_public, committed
            )
            sk.verify_round_keys(cert.encode(), self._tls.ca_pem, v, statement, signature)
            attempt.publics[v] = (c_public, s_public)
            attempt.commitments[v] = committed
            attempt.certs[v] = cert.encode()
        if attempt.publics[self._index] != attempt.keys.public() or attempt.commitments[
            self._index
        ] != commitment(attempt.nonce):
            raise ProtocolError("The advertised keys carry another advert for this client.")
        return Payload(meta={"nonce": _hex(attempt.nonce)})

    def _share(self, attempt: _ClientAttempt, meta: Mapping[str, Any]) -> Payload:
        """Stage 2: checks every revealed nonce against its commitment, draws the graph from
        them and seals its shares for its neighbours."""
        members = _clients(meta.get("members"), what="member list")
        if self._index not in members or not set(members) <= set(attempt.commitments):
            raise ProtocolError("The member list is not a set of advertisers with this client.")
        revealed = _by_client(meta.get("nonces"), what="revealed nonces")
        if set(revealed) != set(members):
            raise ProtocolError("The revealed nonces are not exactly the members'.")
        nonces = {}
        for v in members:
            nonce = _unhex(revealed[v], what=f"nonce of client {v}", size=sm.SEED_BYTES)
            if commitment(nonce) != attempt.commitments[v]:
                raise ProtocolError(f"Client {v}'s nonce does not open its commitment.")
            nonces[v] = nonce
        if nonces[self._index] != attempt.nonce:
            raise ProtocolError("The member list carries another nonce for this client.")
        degree, attempt.threshold, attempt.encoding = parameters_of(
            self._options, len(members), fewest=self._fewest, dims=attempt.update.size
        )
        graph = sm.sharing_graph(
            members, degree, graph_seed(attempt.session, attempt.round, nonces)
        )
        attempt.members = members
        attempt.nonces = nonces
        attempt.neighbours = graph[self._index]
        attempt.self_seed = sk.new_self_seed()
        self_shares = sm.split_secret(attempt.self_seed, attempt.threshold, attempt.neighbours)
        key_shares = sm.split_secret(
            attempt.keys.mask_private_bytes(), attempt.threshold, attempt.neighbours
        )
        assert self._signer is not None
        sealed = {}
        for v in attempt.neighbours:
            attempt.share_keys[v] = sk.share_key(
                attempt.keys.c_private, attempt.publics[v][0], **self._pair(attempt, v)
            )
            signed = {
                kind: self._signer(
                    sk.share_statement(attempt.session, attempt.round, self._index, v, kind, share)
                )
                for kind, share in (("self", self_shares[v]), ("mask", key_shares[v]))
            }
            sealed[str(v)] = _hex(
                sk.seal_shares(
                    attempt.share_keys[v],
                    run=attempt.session,
                    round=attempt.round,
                    sender=self._index,
                    receiver=v,
                    self_share=self_shares[v],
                    mask_share=key_shares[v],
                    self_signature=signed["self"],
                    mask_signature=signed["mask"],
                )
            )
        return Payload(meta={"shares": sealed})

    def _mask(self, attempt: _ClientAttempt, meta: Mapping[str, Any]) -> Payload:
        assert attempt.encoding is not None
        if self._drops_after_sharing:  # an experiment's dropout (spec.attack DropAfterSharing)
            raise ProtocolError("This client drops out after sharing (spec.attack).")
        shared = _clients(meta.get("shared"), what="list of clients that shared")
        if self._index not in shared or not set(shared) <= set(attempt.members):
            raise ProtocolError(
                "The list of clients that shared is not a set of members with this client."
            )
        sealed = _by_client(meta.get("sealed"), what="sealed shares")
        partners = [v for v in attempt.neighbours if v in set(shared)]
        if not set(sealed) <= set(partners):
            raise ProtocolError(
                "Sealed shares came from clients that are not neighbours that shared."
            )
        if len(partners) < attempt.threshold:
            raise ProtocolError(
                f"Only {len(partners)} of this client's neighbours shared (threshold "
                f"{attempt.threshold}): its self-mask seed could not be rebuilt."
            )
        attempt.sealed = {
            v: _unhex(text, what=f"sealed shares of client {v}", limit=MAX_SEALED_BYTES)
            for v, text in sealed.items()
        }
        attempt.shared = shared
        pair_seeds = {
            v: sk.pair_seed(attempt.keys.s_private, attempt.publics[v][1], **self._pair(attempt, v))
            for v in partners
        }
        attempt.words = self._encode(attempt, attempt.encoding)
        masked = sm.mask_input(
            attempt.words,
            client=self._index,
            self_seed=attempt.self_seed,
            pair_seeds=pair_seeds,
            bits=attempt.encoding.bits,
        )
        return Payload(tensors={MASKED: masked})

    def _pair(self, attempt: _ClientAttempt, v: int) -> dict[str, Any]:
        """The context of this client's key agreement with neighbour ``v``."""
        return {
            "run": attempt.session,
            "round": attempt.round,
            "pair": (min(self._index, v), max(self._index, v)),
        }

    def _encode(self, attempt: _ClientAttempt, encoding: Encoding) -> np.ndarray:
        """This client's words: its levels (plain), or its integers plus its noise share."""
        rounding = np.random.default_rng([self._seed, attempt.round, self._index, _ROUNDING_TAG])
        dp = self._options.distributed_dp
        if encoding.plan is not None and dp is not None:
            draws = noise_generator(
                secure=dp.secure_noise,
                seed=self._seed,
                round=attempt.round,
                stream=_NOISE_TAG + self._index,
            )
            return noise.encode(attempt.update, encoding.plan, rounding=rounding, noise=draws)
        assert encoding.quantization is not None
        return sm.quantize(attempt.update, encoding.quantization, stochastic=True, rng=rounding)

    def _sign(self, attempt: _ClientAttempt, meta: Mapping[str, Any]) -> Payload:
        assert self._tls is not None
        survivors = self._survivors(attempt, meta)
        if attempt.committed is not None and attempt.committed != survivors:
            raise ProtocolError("The server asked this client to sign a second survivor list.")
        attempt.committed = survivors
        assert self._signer is not None
        statement = self._survivors_statement(attempt, survivors)
        return Payload(meta={"signature": _hex(self._signer(statement))})

    def _survivors_statement(self, attempt: _ClientAttempt, survivors: list[int]) -> bytes:
        """The survivor list as this client signs and checks it: under its view of the
        attempt (``keys.view_digest``), so signatures of clients shown another attempt fail."""
        adverts = {v: (*attempt.publics[v], attempt.commitments[v]) for v in attempt.publics}
        view = sk.view_digest(adverts, attempt.members, attempt.nonces, attempt.shared)
        return sk.survivors_statement(attempt.session, attempt.round, survivors, view)

    def _survivors(self, attempt: _ClientAttempt, meta: Mapping[str, Any]) -> list[int]:
        survivors = _clients(meta.get("survivors"), what="survivor list")
        if self._index not in survivors or not set(survivors) <= set(attempt.shared):
            raise ProtocolError(
                "The survivor list is not a set of clients that shared, with this client."
            )
        assert attempt.encoding is not None
        if len(survivors) < attempt.encoding.fewest:
            raise ProtocolError(
                f"The survivor list has {len(survivors)} clients, fewer than the "
                f"{attempt.encoding.fewest} this client's input may be summed with (the "
                "threshold, or the quorum its noise share is calibrated for)."
            )
        return survivors

    def _reveal(self, attempt: _ClientAttempt, meta: Mapping[str, Any]) -> Payload:
        assert self._tls is not None
        survivors = self._survivors(attempt, meta)
        if attempt.revealed:
            raise ProtocolError("This client already revealed its shares in this attempt.")
        if survivors != attempt.committed:
            raise ProtocolError(
                "The server asks to unmask another survivor list than the one this client "
                "signed; revealing for it could give away both secrets of a neighbour."
            )
        signatures = _by_client(meta.get("signatures"), what="survivor-list signatures")
        statement = self._survivors_statement(attempt, survivors)
        valid = 0
        for v, text in sorted(signatures.items()):
            if v not in survivors or valid >= attempt.threshold:
                continue  # t valid signatures of members are the check: no need for more
            signature = _unhex(text, what=f"signature of client {v}", limit=MAX_SIGNATURE_BYTES)
            try:
                sk.verify_signed(attempt.certs[v], self._tls.ca_pem, v, statement, signature)
            except ProtocolError as exc:
                log.warning("A survivor-list signature does not verify: %s", exc)
                continue
            valid += 1
        if valid < attempt.threshold:
            raise ProtocolError(
                f"Only {valid} survivors signed this survivor list (threshold "
                f"{attempt.threshold}); the server may be showing clients different lists."
            )
        attempt.revealed = True
        revealed: dict[str, dict[str, str]] = {
            "self": {},
            "mask": {},
            "self_signatures": {},
            "mask_signatures": {},
        }
        survivor_set, shared_set = set(survivors), set(attempt.shared)
        for v in attempt.neighbours:
            if v not in attempt.sealed or v not in shared_set:
                continue
            try:
                self_share, mask_share, self_signed, mask_signed = sk.open_signed_shares(
                    attempt.share_keys[v],
                    run=attempt.session,
                    round=attempt.round,
                    sender=v,
                    receiver=self._index,
                    ciphertext=attempt.sealed[v],
                )
                kind = "self" if v in survivor_set else "mask"
                share, signature = (
                    (self_share, self_signed) if kind == "self" else (mask_share, mask_signed)
                )
                statement = sk.share_statement(
                    attempt.session, attempt.round, v, self._index, kind, share
                )
                sk.verify_signed(attempt.certs[v], self._tls.ca_pem, v, statement, signature)
            except ProtocolError as exc:  # nothing it could prove: it reveals nothing of v
                log.warning("Shares sealed by client %d do not open or verify: %s", v, exc)
                continue
            revealed[kind][str(v)] = _hex(share)
            revealed[f"{kind}_signatures"][str(v)] = _hex(signature)
        return Payload(meta=dict(revealed))


class SecAgg(Protocol):
    """SecAgg+ secure aggregation (see the module docstring)."""

    name = "secagg"

    def create_server(self, spec: FederatedRunSpec, initial: Weights) -> ServerProtocol:
        options = spec.protocol.secagg_options()
        dp = options.distributed_dp
        if dp is not None and not dp.secure_noise:
            warnings.warn(
                "secagg's clients draw their noise from generators seeded by spec.seed "
                "(spec.protocol.secagg.distributedDp.secureNoise is false): anyone who knows "
                "the seed can subtract it, so this run has no differential privacy. Use it for "
                "tests only.",
                UserWarning,
                stacklevel=2,
            )
        return SecAggServer(initial, options, fewest=options.fewest_summed(spec.clients))

    def create_client(self, spec: FederatedRunSpec, index: int) -> ClientProtocol:
        options = spec.protocol.secagg_options()
        return SecAggClient(
            index,
            options,
            spec.seed,
            fewest=options.fewest_summed(spec.clients),
            drops_after_sharing=attack_of(spec, index) == "DropAfterSharing",
        )

    def noise_multiplier(self, spec: FederatedRunSpec) -> float | None:
        """With distributed DP: the Gaussian multiplier whose RDP curve is a round's zCDP
        bound (``fedcore.spec._options.secagg_dp``), for sums of the quorum to the sample;
        None without."""
        options = spec.protocol.secagg_options()
        dp = options.distributed_dp
        if dp is None:
            return None
        from fedcore.learning.data import dataset_info
        from fedcore.learning.models import build_model, get_weights

        shape, classes = dataset_info(spec)
        weights = get_weights(build_model(spec.model, shape, classes, seed=spec.seed))
        dims = sum(int(np.size(weights[name])) for name in float_names(weights))
        sampled = min(spec.clients.sampled_per_round(), spec.clients.count)
        plan = options.dp_plan(
            fewest=options.fewest_summed(spec.clients), members=sampled, dims=dims
        )
        assert plan is not None
        return plan.noise_multiplier

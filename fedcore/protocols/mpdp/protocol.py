"""mpdp: MP_Server model perturbation on the server, DDP_Client noise and pairwise masks on clients.

Xue Yang, Depan Peng, Xiaohu Tang, Yan Feng, Weijun Fang, Jun Shao, "Efficiently Achieving
Secure Model Training and Secure Aggregation to Ensure Bidirectional Privacy-Preservation in
Federated Learning" ("MP-DP"); digest 000 (docs/protocols/mpdp.md says what it protects).

Each round the server expands the bias-free ReLU MLP with identity transitional layers,
multiplies the odd layers by fresh positive noise R, adds an output shift, and sends only that
perturbed model. Each client computes, on its whole shard, the perturbed gradient and the two
correction tensors Psi and Phi (n_L + 2 vector-Jacobian products), scales them so that its
recovered contribution has norm at most B, adds its own noise eta and the pairwise masks Delta
it shares with its neighbours in the round's graph (seeds by X25519 through the KDC's relay of
public keys), and uploads. The server averages the uploads uniformly (the masks cancel),
recovers the true mean gradient plus noise, and takes one SGD step. A round missing an upload
is redone with the survivors (dropout policy Redo), whose masks then pair only among
themselves; an upload of an earlier attempt is refused.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedcore.errors import MessageRejected, NotReady, ProtocolError
from fedcore.learning.canary import CanaryLearner
from fedcore.learning.training import LocalLearner
from fedcore.protocols._base import (
    ClientProtocol,
    KdcProtocol,
    KeyChannel,
    Protocol,
    RoundResult,
    ServerProtocol,
    Weights,
    check_state_kind,
)
from fedcore.protocols._bounds import BoundedServer, UploadBounds, default_update_norm
from fedcore.protocols._maths import copy_weights, restore_weights
from fedcore.protocols.mpdp import keys as keys_
from fedcore.protocols.mpdp import maths
from fedcore.spec import FederatedRunSpec
from fedcore.spec._options import MpdpOptions
from fedcore.transport import Identity, Payload

PUBLIC_KEY_KIND = "x25519-public-key"
"""The ``kind`` of the payload a client submits to the KDC in ``setup``."""


def _layout(widths: Sequence[int], hardened: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """The upload's tensors: name -> (shape, dtype), per odd layer j and the loss scalars.

    The last layer's Psi travels as its row u (``LocalTerms.last_row``), its Phi (always 0) not
    at all: the server rebuilds both.
    """
    masked = "uint64" if hardened else "float64"
    outputs = widths[-1]
    layers = len(widths) - 1
    layout: dict[str, tuple[tuple[int, ...], str]] = {}
    for j in range(layers):
        shape = (widths[j + 1], widths[j])
        layout[f"g.{j}"] = (shape, "float64")
        if j < layers - 1:
            layout[f"psi.{j}"] = ((outputs, *shape), masked)
            layout[f"phi.{j}"] = (shape, masked)
        else:
            layout[f"psi.{j}"] = ((widths[j],), masked)
    layout["terms"] = ((outputs + 2,), masked)
    return layout


@dataclass(frozen=True)
class _MaskContext:
    """What a client's masks for one upload are drawn from."""

    run: str
    round: int
    participants: tuple[int, ...]
    keys: tuple[bytes, ...]
    """The participants' public keys, in the order of ``participants``."""
    size: int
    """Entries of the flat gradient."""
    words: int
    """Fixed-point words of the corrections to mask (0: Faithful mode masks none)."""


@dataclass(frozen=True)
class _Masks:
    """A client's masks for one upload: noise on the gradient, fixed-point masks (or None)."""

    context: _MaskContext
    noise: np.ndarray | None
    words: np.ndarray | None


@dataclass
class _Attempt:
    """The server's record of the attempt in flight (one per plan_round call)."""

    round: int
    number: int
    nonce: str
    participants: tuple[int, ...]
    fingerprint: str | None = None


class MpdpServer(BoundedServer, ServerProtocol):
    """MP_Server and MU_Server: perturbs the model each round, recovers the mean gradient.

    Args:
        initial: the initial global model: the 2-D weights of a bias-free MLP, input first.
        options: ``spec.protocol.mpdp``.
        learning_rate: the server's SGD step size xi.
        rng: the source of the server's secret noise (default: seeded from the OS CSPRNG).
        bounds: the run's upload bounds: mpdp's server sees only the unmasked mean, so it
            checks the claimed example counts and refuses an aggregate past the step bound.

    Raises:
        ProtocolError: the model is not a chain of at least two 2-D weight matrices.
    """

    kind = "mpdp"

    def __init__(
        self,
        initial: Weights,
        *,
        options: MpdpOptions,
        learning_rate: float,
        rng: np.random.Generator | None = None,
        bounds: UploadBounds | None = None,
    ) -> None:
        self._bounds = bounds or UploadBounds(default_update_norm(initial))
        self._names = list(initial)
        self._widths = _widths_of(initial)
        self._weights = {
            name: np.asarray(w, dtype=np.float64).copy() for name, w in initial.items()
        }
        self._options = options
        self._hardened = options.mode == "Hardened"
        self._learning_rate = learning_rate
        self._rng = rng or np.random.default_rng(secrets.randbits(256))
        self._layout = _layout(self._widths, self._hardened)
        self._secrets: maths.Perturbation | None = None
        self._attempt: _Attempt | None = None
        self._lock = threading.Lock()

    def plan_round(self, round: int, clients: Sequence[int]) -> Mapping[int, Payload]:
        """Sends every participant the perturbed model and the attempt's participant set.

        The first attempt of a round draws fresh secrets; a redone attempt of the same round
        (with the survivors) keeps them, so the clients' noise, derived per round, is the same
        too and a redo releases nothing new but the orphaned masks.
        """
        with self._lock:
            previous = self._attempt
            if self._secrets is None or previous is None or previous.round != round:
                self._secrets = maths.draw_perturbation(
                    self._rng,
                    self._widths,
                    hardened=self._hardened,
                    shift_std=self._options.output_noise_std,
                )
                number = 1
            else:
                number = previous.number + 1
            participants = tuple(sorted(int(k) for k in clients))
            attempt = _Attempt(round, number, secrets.token_hex(16), participants)
            self._attempt = attempt
            secret = self._secrets
        layer_bounds, shift_bound = maths.scale_bounds(secret)
        odd = maths.perturb([self._weights[n] for n in self._names], secret)
        tensors = {f"w.{j}": w for j, w in enumerate(odd)}
        tensors.update({f"t.{j}": d for j, d in enumerate(secret.transitional())})
        instruction = Payload(
            meta={
                "round": round,
                "attempt": attempt.number,
                "nonce": attempt.nonce,
                "participants": list(participants),
                "layer_bounds": layer_bounds,
                "shift_bound": shift_bound,
            },
            tensors=tensors,
        )
        return {k: instruction for k in participants}

    def check_upload(self, round: int, client: int, upload: Payload) -> None:
        """Refuses an upload of another attempt, of the wrong shape, or with other keys.

        The first upload of an attempt fixes the fingerprint of the public keys the masks
        were derived from; an upload derived from other keys (a peer re-registered between
        two fetches) is refused, so the attempt is redone rather than combined wrongly.
        """
        what = f"mpdp upload of client {client} in round {round}"
        with self._lock:
            attempt = self._attempt
        if attempt is None or attempt.round != round:
            raise ProtocolError(f"The {what} arrived while no attempt of that round is open.")
        if client not in attempt.participants:
            raise ProtocolError(f"The {what} comes from a client outside the attempt.")
        meta = upload.meta
        if meta.get("nonce") != attempt.nonce or meta.get("attempt") != attempt.number:
            raise ProtocolError(
                f"The {what} belongs to attempt {meta.get('attempt')!r}, not to the open "
                f"attempt {attempt.number} (its masks pair with other participants)."
            )
        self._bounds.check_examples(client, upload, what=what)
        _check_tensors(self._layout, upload, what=what)
        fingerprint = meta.get("keys")
        if not isinstance(fingerprint, str) or len(fingerprint) != 64:
            raise ProtocolError(f"The {what} does not name the public keys it used.")
        with self._lock:
            if attempt.fingerprint is None:
                attempt.fingerprint = fingerprint
            elif attempt.fingerprint != fingerprint:
                raise ProtocolError(
                    f"The {what} was masked with other public keys than the attempt's first "
                    f"upload (a client re-registered); its masks would not cancel."
                )

    def combine(
        self, round: int, uploads: Mapping[int, Payload], failures: Sequence[int]
    ) -> RoundResult | None:
        """Averages, recovers and steps; only with every participant's upload.

        Raises:
            ProtocolError: an upload is missing or of another attempt (the masks would not
                cancel: the aggregate would be wrong).
        """
        if not uploads:
            return None
        with self._lock:
            attempt = self._attempt
            secret = self._secrets
        if attempt is None or secret is None or attempt.round != round:
            raise ProtocolError(f"Round {round} has no open mpdp attempt to combine.")
        if tuple(sorted(uploads)) != attempt.participants or failures:
            missing = sorted(set(attempt.participants) - set(uploads))
            raise ProtocolError(
                f"Round {round} attempt {attempt.number} lacks the uploads of clients "
                f"{missing or sorted(failures)}: their pairwise masks would not cancel. "
                f"Redo the round with the survivors."
            )
        fingerprints = {upload.meta.get("keys") for upload in uploads.values()}
        if attempt.fingerprint is not None:
            fingerprints.add(attempt.fingerprint)
        nonces = {upload.meta.get("nonce") for upload in uploads.values()}
        if nonces != {attempt.nonce} or len(fingerprints) != 1:
            raise ProtocolError(
                f"The uploads of round {round} belong to another attempt or were masked with "
                f"different public keys; their masks would not cancel."
            )
        order = sorted(uploads)
        count = len(order)
        means = {
            name: _mean(name, dtype, [uploads[k] for k in order])
            for name, (_, dtype) in self._layout.items()
        }
        layers = len(self._names)
        last = layers - 1
        gradients = maths.recover(
            [means[f"g.{j}"] for j in range(layers)],
            [
                *(means[f"psi.{j}"] for j in range(last)),
                maths.last_layer_psi(means[f"psi.{last}"], self._widths[-1]),
            ],
            [*(means[f"phi.{j}"] for j in range(last)), np.zeros(means[f"g.{last}"].shape)],
            secret,
        )
        step = self._learning_rate
        updated = {
            name: self._weights[name] - step * gradient
            for name, gradient in zip(self._names, gradients, strict=True)
        }
        # The masks hide who sent what: a bad aggregate can be refused, not traced.
        self._bounds.check_aggregate(round, self._weights, updated)
        self._weights = updated
        loss = maths.recover_loss(means["terms"], secret)
        with self._lock:
            self._secrets = None  # discarded: the next round draws fresh ones
            self._attempt = None
        return RoundResult(participants=count, train_loss=loss)

    def global_weights(self) -> Weights:
        return self._weights

    def state_dict(self) -> dict[str, Any]:
        """The model only: a round's secrets never outlive the round."""
        return {"kind": self.kind, "version": 1, "weights": copy_weights(self._weights)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._weights = restore_weights(state, self.kind, self._weights)
        self._secrets = None
        self._attempt = None


class MpdpClient(ClientProtocol):
    """LMT and DDP_Client: one client's perturbed gradient, corrections, noise and masks.

    Args:
        index: this client's index.
        options: ``spec.protocol.mpdp``.
    """

    def __init__(self, *, index: int, options: MpdpOptions) -> None:
        self._index = index
        self._options = options
        self._hardened = options.mode == "Hardened"
        self._key: X25519PrivateKey | None = None
        self._secret: bytes | None = None
        self._public = b""
        self._checked: set[bytes] = set()
        """Public keys already found valid (checked once, not every round)."""
        self._shared: dict[bytes, bytes] = {}
        """X25519 secrets with the peers' public keys: one exchange per peer key, not per round."""
        self._table: Payload | None = None
        """The KDC's table of public keys as last fetched and checked (reused across rounds)."""
        self._last: _MaskContext | None = None
        """What the last upload's masks were drawn for (the next round's are predicted from it)."""
        self._prepared: _Masks | None = None
        """Masks drawn ahead by ``after_upload``, used only if their context is the one asked."""

    def setup(self, kdc: KeyChannel | None) -> None:
        """Makes this client's X25519 key pair and noise secret; registers the public key.

        Raises:
            ProtocolError: there is no KDC to register with.
        """
        if kdc is None:
            raise ProtocolError("mpdp needs a KDC to relay the clients' public keys.")
        self._key = keys_.new_private_key()
        self._secret = os.urandom(keys_.KEY_BYTES)
        self._public = keys_.public_bytes(self._key)
        self._checked = set()
        self._shared = {}
        self._table = None
        self._last = None
        self._prepared = None
        public = np.frombuffer(keys_.public_bytes(self._key), dtype=np.uint8).copy()
        kdc.submit(Payload(meta={"kind": PUBLIC_KEY_KIND}, tensors={"public_key": public}))

    def reusable_keys(self, round: int, instruction: Payload) -> Payload | None:
        """The table of public keys fetched in an earlier round, for an attempt's first try.

        The table changes only when a client registers a new key (a restarted client). Until
        this client fetches again, its masks with that client use the old key: the uploads'
        key fingerprints then disagree, the server refuses the odd ones out and redoes the
        attempt, and a redone attempt (number 2 on) always fetches afresh. So a stale table
        costs one redo, never a wrong aggregate, and a round costs no KDC call at all.
        """
        return self._table if instruction.meta.get("attempt") == 1 else None

    def compute_upload(
        self, round: int, instruction: Payload, learner: LocalLearner, keys: Payload | None
    ) -> Payload:
        """Runs LMT on the perturbed model, clips, adds eta and the masks; returns the upload.

        Raises:
            ProtocolError: setup was not called, this client is not a participant, or the
                KDC's keys are missing or do not include this client's own public key.
        """
        if self._key is None or self._secret is None:
            raise ProtocolError("The mpdp client was not set up (no key pair).")
        meta = instruction.meta
        participants = [int(k) for k in meta.get("participants", [])]
        if self._index not in participants:
            raise ProtocolError(f"Client {self._index} is not among round {round}'s participants.")
        run, public_keys = self._public_keys(keys, participants)
        self._table = keys
        layers = sum(1 for name in instruction.tensors if name.startswith("w."))
        odd = [np.asarray(instruction.tensors[f"w.{j}"], dtype=np.float64) for j in range(layers)]
        diagonals = [instruction.tensors[f"t.{j}"] for j in range(layers - 1)]
        terms = maths.local_terms(odd, diagonals, learner.features, learner.targets)
        if isinstance(learner, CanaryLearner):  # the canary audit's probe: a fixed gradient
            step = learner.update(-1.0)
            terms = maths.with_gradient(terms, [step[name] for name in learner.direction])
        options = self._options
        if options.client_noise_std > 0:
            bound = maths.norm_bound(
                terms, [float(b) for b in meta["layer_bounds"]], float(meta["shift_bound"])
            )
            if bound > options.clipping_norm:
                terms = terms.scaled(options.clipping_norm / bound)
        hidden = len(terms.gradient) - 1
        gradient = np.concatenate([g.ravel() for g in terms.gradient])
        corrections = np.concatenate(
            [
                *(p.ravel() for p in terms.psi[:hidden]),
                terms.last_row,
                *(f.ravel() for f in terms.phi[:hidden]),
                terms.terms,
            ]
        )
        words = (
            maths.encode_fixed(corrections, parties=len(participants))
            if self._hardened
            else corrections
        )
        context = _MaskContext(
            run,
            round,
            tuple(participants),
            tuple(public_keys[k] for k in participants),
            gradient.size,
            words.size if self._hardened else 0,
        )
        prepared, self._prepared = self._prepared, None
        masks = prepared if prepared is not None and prepared.context == context else None
        if masks is None:
            masks = self._draw_masks(context)
        self._last = context
        if masks.noise is not None:
            gradient += masks.noise
        if masks.words is not None:
            words += masks.words  # wraps mod 2^64, as the server's sum does
        tensors = _unpack(gradient, words, terms)
        return Payload(
            meta={
                "num_examples": learner.num_examples,
                "loss": None,  # only the server can recover the true loss (from "terms")
                "steps": 1,
                "attempt": meta.get("attempt"),
                "nonce": meta.get("nonce"),
                "keys": keys_.keys_fingerprint(
                    run, round, {k: public_keys[k] for k in participants}
                ),
            },
            tensors=tensors,
        )

    def _public_keys(
        self, keys: Payload | None, participants: Sequence[int]
    ) -> tuple[str, dict[int, bytes]]:
        """The run's KDC session id and the participants' public keys, checked against ours."""
        assert self._key is not None
        table = None if keys is None else keys.tensors.get("public_keys")
        if keys is None or table is None or table.ndim != 2 or table.shape[1] != keys_.KEY_BYTES:
            raise ProtocolError("The KDC sent no table of public keys for this round.")
        session = keys.meta.get("session")
        if not isinstance(session, str) or not session:
            raise ProtocolError("The KDC sent no session id with the public keys.")
        found: dict[int, bytes] = {}
        for k in participants:
            if not 0 <= k < table.shape[0]:
                raise ProtocolError(f"The KDC sent no public key for client {k}.")
            found[k] = bytes(table[k].astype(np.uint8))
            if found[k] not in self._checked:
                keys_.check_public_key(found[k])
                self._checked.add(found[k])
        if found[self._index] != self._public:
            raise ProtocolError(
                f"The KDC relays another public key for client {self._index} than its own."
            )
        return session, found

    def _pair_seed(self, peer_public: bytes, *, run: str, round: int, peer: int) -> bytes:
        """The pair seed with ``peer`` for ``round`` (its X25519 secret computed once per key)."""
        assert self._key is not None
        shared = self._shared.get(peer_public)
        if shared is None:
            shared = keys_.shared_secret(self._key, peer_public, pair=(self._index, peer))
            self._shared[peer_public] = shared
        return keys_.seed_from_shared(shared, run=run, round=round, pair=(self._index, peer))

    def after_upload(self, round: int) -> None:
        """Draws the next round's masks ahead, betting on the same participants and keys.

        The masks depend on the round, the participants, their public keys and the sizes,
        never on the model, so the next round's can be drawn while the server combines this
        one's. ``compute_upload`` uses them only if its own context is exactly the predicted
        one (a redo with survivors or a re-registered peer draws afresh).
        """
        last = self._last
        if last is None or last.round != round:
            return
        self._prepared = self._draw_masks(
            _MaskContext(last.run, round + 1, last.participants, last.keys, last.size, last.words)
        )

    def _draw_masks(self, context: _MaskContext) -> _Masks:
        """This client's noise on the gradient (pairwise Delta plus its own eta) and, in
        Hardened mode, its fixed-point masks on the corrections, for ``context``."""
        options = self._options
        public_keys = dict(zip(context.participants, context.keys, strict=True))
        graph = keys_.mask_graph(
            context.participants,
            kind=options.graph,
            degree=options.graph_degree,
            run=context.run,
            round=context.round,
        )
        peers = graph[self._index]
        seeds = [
            self._pair_seed(public_keys[p], run=context.run, round=context.round, peer=p)
            for p in peers
        ]
        adds = [self._index < peer for peer in peers]  # the lower index adds, the higher subtracts
        pairwise = options.pairwise_noise_std
        sources = [
            (seed, keys_.STREAM_DELTA, pairwise if add else -pairwise)
            for seed, add in zip(seeds, adds, strict=True)
        ]
        if options.client_noise_std > 0:
            key = self._noise_key(context.run, context.round)
            sources.append((key, keys_.STREAM_ETA, options.client_noise_std))
        noise = _noise_sum(sources, context.size, gaussian=self._hardened) if sources else None
        words = _mask_sum(seeds, adds, context.words) if context.words and seeds else None
        return _Masks(context, noise, words)

    def _noise_key(self, run: str, round: int) -> bytes:
        """The key of eta, this client's DP noise: the same in every attempt of a round."""
        assert self._secret is not None
        return keys_.noise_key(self._secret, run=run, round=round, client=self._index)


class MpdpKdc(KdcProtocol):
    """Relays the clients' X25519 public keys; it never sees a private key or a seed.

    It also relays a random session id drawn when it starts, which the clients bind into
    every derived key and the mask graph in place of the run's name (a protocol sees only the
    spec, which has no name): two runs never share a pair seed.

    Args:
        num_clients: the run's client count (``spec.clients.count``).
    """

    kind = "mpdp-kdc"

    def __init__(self, num_clients: int) -> None:
        self._count = num_clients
        self._public: dict[int, bytes] = {}
        self._session = secrets.token_hex(16)

    def _client(self, party: Identity, action: str) -> int:
        if party.role != "client" or party.index is None or party.index >= self._count:
            raise PermissionError(f"{party.common_name!r} may not {action}.")
        return party.index

    def accept(self, party: Identity, payload: Payload) -> Payload:
        """Registers (or replaces) a client's public key.

        Raises:
            PermissionError: the party is not a client of this run.
            MessageRejected: the payload is not one valid X25519 public key.
        """
        index = self._client(party, "register an mpdp public key")
        raw = payload.tensors.get("public_key")
        if payload.meta.get("kind") != PUBLIC_KEY_KIND or raw is None or raw.dtype != np.uint8:
            raise MessageRejected(
                f"The mpdp KDC takes one uint8 tensor 'public_key' of kind {PUBLIC_KEY_KIND!r}."
            )
        try:
            keys_.check_public_key(bytes(raw.reshape(-1)))
        except (ProtocolError, ValueError) as exc:
            raise MessageRejected(f"Client {index} sent an invalid public key: {exc}") from exc
        self._public[index] = bytes(raw.reshape(-1))
        return Payload(meta={"registered": index})

    def issue_keys(self, round: int, party: Identity) -> Payload:
        """Returns every client's public key (row i: client i's).

        Raises:
            PermissionError: the party is not a client of this run.
            NotReady: some client has not registered yet (the caller retries).
        """
        self._client(party, f"receive mpdp keys for round {round}")
        missing = [k for k in range(self._count) if k not in self._public]
        if missing:
            raise NotReady(
                f"{len(missing)} of {self._count} clients have not registered their public "
                f"keys yet (first missing: client {missing[0]})."
            )
        table = np.stack(
            [np.frombuffer(self._public[k], dtype=np.uint8) for k in range(self._count)]
        )
        return Payload(
            meta={"round": round, "clients": self._count, "session": self._session},
            tensors={"public_keys": table},
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "version": 1,
            "clients": self._count,
            "session": self._session,
            "public_keys": {str(k): v.hex() for k, v in sorted(self._public.items())},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_kind(state, self.kind, ["clients", "session", "public_keys"])
        self._count = int(state["clients"])
        self._session = str(state["session"])
        self._public = {int(k): bytes.fromhex(v) for k, v in state["public_keys"].items()}


class Mpdp(Protocol):
    """MP-DP (see the module docstring)."""

    name = "mpdp"

    def create_server(self, spec: FederatedRunSpec, initial: Weights) -> ServerProtocol:
        return MpdpServer(
            initial,
            options=spec.protocol.mpdp,
            learning_rate=spec.training.optimizer.learning_rate,
            bounds=UploadBounds.of(spec, initial),
        )

    def create_client(self, spec: FederatedRunSpec, index: int) -> ClientProtocol:
        return MpdpClient(index=index, options=spec.protocol.mpdp)

    def create_kdc(self, spec: FederatedRunSpec) -> KdcProtocol | None:
        return MpdpKdc(spec.clients.count)

    def noise_multiplier(self, spec: FederatedRunSpec) -> float | None:
        """sigma_eta * sqrt(K) / B with K the fewest uploads a round can combine (the quorum).

        The recovered sum of the K clipped contributions has L2 sensitivity B (one client's
        contribution replaced by zero) and carries the K clients' noise, std sigma_eta*sqrt(K)
        per entry; a redo combines at least the quorum. None when clientNoiseStd is 0.
        """
        options = spec.protocol.mpdp
        if options.client_noise_std == 0:
            return None
        sampled = min(spec.clients.sampled_per_round(), spec.clients.count)
        fewest = spec.clients.quorum_of(sampled)
        return options.client_noise_std * math.sqrt(fewest) / options.clipping_norm


NOISE_CHUNK = 1 << 16
"""Keystream words per row a client draws at once (a multiple of ``maths.NOISE_BLOCK``): the
noise and masks of a large model go through in slices, in memory of rows x NOISE_CHUNK words."""


def _noise_sum(
    sources: Sequence[tuple[bytes, int, float]], size: int, *, gaussian: bool
) -> np.ndarray:
    """The sum over ``sources`` (key, stream, coefficient) of coefficient x unit noise.

    Each source's noise is ``maths.unit_noise`` of its keystream, draw i from word i, so the
    two ends of a pair draw the same row whatever else either adds; the first ``size``
    entries are returned.
    """
    streams = [(key, stream) for key, stream, _ in sources]
    coefficients = np.array([coefficient for _, _, coefficient in sources])
    total = np.empty(maths.noise_words(size))
    for start in range(0, total.size, NOISE_CHUNK):
        count = min(NOISE_CHUNK, total.size - start)
        unit = maths.unit_noise(keys_.keystreams(streams, count, offset=start), gaussian=gaussian)
        np.matmul(coefficients, unit, out=total[start : start + count])
    return total[:size]


def _mask_sum(seeds: Sequence[bytes], adds: Sequence[bool], size: int) -> np.ndarray:
    """The pairs' fixed-point masks, added where ``adds`` and subtracted elsewhere, mod 2^64."""
    streams = [(seed, keys_.STREAM_CORRECTIONS) for seed in seeds]
    total = np.empty(size, dtype=np.uint64)
    for start in range(0, size, NOISE_CHUNK):
        count = min(NOISE_CHUNK, size - start)
        words = keys_.keystreams(streams, count + count % 2, offset=start)[:, :count]
        out = total[start : start + count]
        # Integer sums, differences and negations wrap mod 2^64, as the server's sum does;
        # each row goes into the slice in place (no temporaries of the whole batch).
        if adds[0]:
            np.copyto(out, words[0])
        else:
            np.negative(words[0], out=out)
        for row, add in zip(words[1:], adds[1:], strict=True):
            (np.add if add else np.subtract)(out, row, out=out)
    return total


def _widths_of(weights: Weights) -> list[int]:
    """(n_0, ..., n_L) of a chain of 2-D weights; refuses anything else."""
    arrays = list(weights.values())
    if len(arrays) < 2 or any(np.ndim(w) != 2 for w in arrays):
        raise ProtocolError(
            "mpdp needs a bias-free MLP with at least one hidden layer (2-D weights only)."
        )
    widths = [int(arrays[0].shape[1])]
    for w in arrays:
        if w.shape[1] != widths[-1]:
            raise ProtocolError("mpdp needs the model's weights to chain (input first).")
        widths.append(int(w.shape[0]))
    return widths


def _check_tensors(
    layout: Mapping[str, tuple[tuple[int, ...], str]], upload: Payload, *, what: str
) -> None:
    if list(upload.tensors) != list(layout):
        raise ProtocolError(
            f"The {what} has tensors {sorted(upload.tensors)}; expected {sorted(layout)}."
        )
    for name, (shape, dtype) in layout.items():
        got = upload.tensors[name]
        if got.shape != shape or got.dtype != np.dtype(dtype):
            raise ProtocolError(
                f"The {what}'s tensor {name!r} is {got.dtype}{list(got.shape)}; expected "
                f"{dtype}{list(shape)}."
            )
        # A finite sum proves every entry finite; only an overflowing or bad one is scanned.
        if (
            got.dtype.kind == "f"
            and not math.isfinite(float(got.sum()))
            and not np.all(np.isfinite(got))
        ):
            raise ProtocolError(f"The {what}'s tensor {name!r} holds NaN or infinite values.")


def _mean(name: str, dtype: str, uploads: Sequence[Payload]) -> np.ndarray:
    """The uniform mean of one tensor: float64, or the sum mod 2^64 of fixed-point words."""
    if dtype == "uint64":
        total = np.zeros(uploads[0].tensors[name].shape, dtype=np.uint64)
        for upload in uploads:
            total += upload.tensors[name]  # wraps mod 2^64: the masks cancel exactly
        return maths.decode_fixed(total) / len(uploads)
    acc = np.zeros(uploads[0].tensors[name].shape, dtype=np.float64)
    for upload in uploads:
        acc += upload.tensors[name]
    return acc / len(uploads)


def _unpack(
    gradient: np.ndarray, words: np.ndarray, terms: maths.LocalTerms
) -> dict[str, np.ndarray]:
    """Cuts the flat masked vectors back into the upload's named tensors (``_layout``'s order).

    ``words`` holds every hidden layer's Psi, the last layer's row u, every hidden layer's Phi,
    then the loss scalars, as the client packed them.
    """
    hidden = len(terms.gradient) - 1
    offsets = np.cumsum([0, *(g.size for g in terms.gradient)])
    psi_shapes = [*(p.shape for p in terms.psi[:hidden]), terms.last_row.shape]
    psi_at = np.cumsum([0, *(math.prod(shape) for shape in psi_shapes)])
    phi_at = psi_at[-1] + np.cumsum([0, *(f.size for f in terms.phi[:hidden])])
    tensors: dict[str, np.ndarray] = {}
    for j, g in enumerate(terms.gradient):
        tensors[f"g.{j}"] = gradient[offsets[j] : offsets[j + 1]].reshape(g.shape)
        tensors[f"psi.{j}"] = words[psi_at[j] : psi_at[j + 1]].reshape(psi_shapes[j])
        if j < hidden:
            tensors[f"phi.{j}"] = words[phi_at[j] : phi_at[j + 1]].reshape(terms.phi[j].shape)
    tensors["terms"] = words[phi_at[-1] :]
    return tensors

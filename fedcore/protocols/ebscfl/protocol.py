"""ebscfl: EBS-CFL, secure clustered FL with a KDC, Byzantine filtering and verification.

Zhiqiang Li, Haiyong Bao, Menghong Guan, Hao Pan, Cheng Huang, Hong-Ning Dai, "EBS-CFL:
Efficient and Byzantine-robust Secure Clustered Federated Learning"; digest 004
(docs/protocols/ebscfl.md says what it protects and what it does not).

The server keeps m cluster models and, once, the unit update g_0^j of each on its own clean
root data (which also warm-starts model j). Each round it opens an attempt at the KDC (sending
g_0 and the roster) and gets back the SRFC keys, the decode keys and the verification keys of
the attempt; every client fetches its own encode keys, picks the model with the lowest loss on
its shard, trains it, normalises its update and uploads delta_i: the update in its cluster's
block, rotated into its secret slot, plus masks. For each upload the server checks the norm
and the mask component (a malformed upload is rejected: EncodingRejected), fetches that
client's factored score extractor from the KDC and folds its SRFC terms; with every
participant's upload it decodes only the weighted per-cluster sums
sum_{i: c_i = j} ReLU(w_i)/W g_i_hat and moves model j by eta_g(t) ||g_0^j|| times that. A
client with a negative score gets weight zero, and the server learns only W = sum ReLU(w_i).
A round missing an upload (dropped or rejected) is redone with the survivors under fresh keys.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedcore.errors import (
    EncodingRejected,
    FedcoreError,
    MessageRejected,
    NotReady,
    ProtocolError,
)
from fedcore.learning import poisoning
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
from fedcore.protocols._cluster_models import ClusterModels
from fedcore.protocols._maths import cluster_name, flatten, unflatten
from fedcore.protocols.ebscfl import keys as keys_
from fedcore.protocols.ebscfl import maths
from fedcore.spec import FederatedRunSpec
from fedcore.spec._options import EbscflOptions
from fedcore.transport import Identity, Payload

log = logging.getLogger(__name__)

OPEN = "ebscfl/open"
"""The server opens an attempt at the KDC (with g_0 and the roster); the answer is its keys."""
SCORE = "ebscfl/score"
"""The server asks for one client's score extractor and check values."""

SERVER_KEYS = ("embedding", "beta", "tau1", "tau2", "tau3", "decode", "verify")
"""The tensors of the KDC's answer to OPEN: everything the server holds for an attempt."""
SCORE_KEYS = ("a", "b", "p", "q")
"""The tensors of the KDC's answer to SCORE."""
CLIENT_KEYS = ("slot", "embedding", "mask_key")
"""The tensors a client gets from ``issue_keys``: ek^0, A, ek^1."""

WEIGHT_FLOOR = 1e-12
"""W at or below this means every update was filtered: the round keeps the models (G8)."""
AGGREGATE_SLACK = 1e-6
"""A decoded cluster aggregate longer than 1 + this breaks the scheme's invariant (G3)."""


# --------------------------------------------------------------------------- helpers


def learning_rate(options: EbscflOptions, round: int) -> float:
    """eta_g(t) = globalLearningRate * learningRateDecay^(t-1) (G10)."""
    return options.global_learning_rate * options.learning_rate_decay ** (round - 1)


def _geometry(options: EbscflOptions, length: int, clients: int) -> maths.Geometry:
    group = clients if options.layout == "Flat" else min(options.group_size, clients)
    return maths.Geometry(length, options.clusters, options.segment_length, clients, group)


def _tensor(payload: Payload, name: str, shape: tuple[int, ...], what: str) -> np.ndarray:
    """A float64 tensor of ``payload`` with exactly ``shape``, finite.

    Raises:
        ProtocolError: missing, of another dtype or shape, or not finite.
    """
    value = payload.tensors.get(name)
    if value is None or value.dtype != np.float64 or value.shape != shape:
        got = None if value is None else f"{value.dtype}{list(value.shape)}"
        raise ProtocolError(f"The {what} has {name!r} {got}; expected float64{list(shape)}.")
    if not np.all(np.isfinite(value)):
        raise ProtocolError(f"The {what}'s {name!r} holds NaN or infinite values.")
    return value


# ---------------------------------------------------------------------------- server


@dataclass
class _Attempt:
    """The server's record of the attempt in flight."""

    round: int
    number: int
    nonce: str
    roster: tuple[int, ...]
    geometry: maths.Geometry
    keys: dict[str, np.ndarray]
    terms: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def position(self, client: int) -> int:
        return self.roster.index(client)

    def columns(self, group: int) -> slice:
        """The columns of group ``group`` in the concatenated decode and verify keys."""
        width = 3 * self.geometry.width
        start = width * group * self.geometry.group
        return slice(start, start + width * self.geometry.group_size(group))


class EbscflServer(ClusterModels, ServerProtocol):
    """The server: m cluster models, verification, SRFC and the weighted decode.

    Args:
        initial: the initial model (its names, shapes and dtypes).
        options: ``spec.protocol.ebscfl``.
        models: the m warm-started cluster models (flat float64, m x l).
        root_updates: g_0, the server's update of each cluster on its root data (m x l).
    """

    kind = "ebscfl"

    def __init__(
        self,
        initial: Weights,
        *,
        options: EbscflOptions,
        models: np.ndarray,
        root_updates: np.ndarray,
    ) -> None:
        self._like = {name: np.asarray(w) for name, w in initial.items()}
        self._names = list(initial)
        self._options = options
        self._theta = np.array(models, dtype=np.float64)
        self._root = np.array(root_updates, dtype=np.float64)
        self._root_norms = np.linalg.norm(self._root, axis=1)
        if self._theta.shape != self._root.shape or self._theta.shape[0] != options.clusters:
            raise ProtocolError(
                f"ebscfl needs {options.clusters} models and root updates of one length, got "
                f"{self._theta.shape} and {self._root.shape}."
            )
        if not np.all(self._root_norms > 0):
            raise ProtocolError(
                "A cluster's root update g_0 is zero (its root data did not move its model); "
                "raise spec.protocol.ebscfl.rootExamples or rootEpochs."
            )
        self._kdc: KeyChannel | None = None
        self._attempt: _Attempt | None = None
        self._lock = threading.Lock()

    @property
    def length(self) -> int:
        """l, the number of model parameters."""
        return int(self._theta.shape[1])

    # ------------------------------------------------------------------ hooks

    def setup(self, kdc: KeyChannel | None) -> None:
        """Keeps the channel to the KDC (g_0 travels with every attempt it opens).

        Raises:
            ProtocolError: there is no KDC.
        """
        if kdc is None:
            raise ProtocolError("ebscfl's server needs a channel to the KDC.")
        self._kdc = kdc

    def plan_round(self, round: int, clients: Sequence[int]) -> Mapping[int, Payload]:
        """Opens an attempt at the KDC and sends every participant the m cluster models.

        Raises:
            ProtocolError: fewer than 2 participants, no KDC, or the KDC's keys are unusable.
        """
        roster = tuple(sorted(int(k) for k in clients))
        if len(roster) < 2:
            raise ProtocolError(
                f"Round {round} has {len(roster)} participant(s); ebscfl's zero-sum masks need "
                f"at least 2."
            )
        with self._lock:
            previous = self._attempt
        number = previous.number + 1 if previous is not None and previous.round == round else 1
        nonce = secrets.token_hex(16)
        geometry = _geometry(self._options, self.length, len(roster))
        answer = self._call(
            Payload(
                meta={
                    "kind": OPEN,
                    "round": round,
                    "attempt": number,
                    "nonce": nonce,
                    "roster": list(roster),
                },
                tensors={"g0": self._root},
            ),
            f"open round {round} attempt {number}",
        )
        keys = self._check_server_keys(answer, geometry)
        with self._lock:
            self._attempt = _Attempt(round, number, nonce, roster, geometry, keys)
        tensors = {}
        for j in range(self._options.clusters):
            for name, value in unflatten(self._theta[j], self._like).items():
                tensors[cluster_name(j, name)] = value
        instruction = Payload(
            meta={
                "round": round,
                "attempt": number,
                "nonce": nonce,
                "clusters": self._options.clusters,
                "segment": self._options.segment_length,
            },
            tensors=tensors,
        )
        return {k: instruction for k in roster}

    def check_upload(self, round: int, client: int, upload: Payload) -> None:
        """Verifies one encoding (shape, norm, mask component) and folds its SRFC terms.

        Raises:
            ProtocolError: the upload belongs to no open attempt or another one.
            EncodingRejected: the encoding is malformed or fails the norm or mask check.
        """
        what = f"ebscfl upload of client {client} in round {round}"
        with self._lock:
            attempt = self._attempt
        if attempt is None or attempt.round != round or client not in attempt.roster:
            raise ProtocolError(f"The {what} belongs to no open attempt it takes part in.")
        meta = upload.meta
        if meta.get("nonce") != attempt.nonce or meta.get("attempt") != attempt.number:
            raise ProtocolError(
                f"The {what} belongs to attempt {meta.get('attempt')!r}, not to the open "
                f"attempt {attempt.number} (its keys are another attempt's)."
            )
        geometry = attempt.geometry
        position = attempt.position(client)
        group, _ = geometry.place(position)
        shape = (geometry.segments, geometry.upload_width(position))
        if list(upload.tensors) != ["delta"]:
            raise EncodingRejected(
                f"The {what} has tensors {sorted(upload.tensors)}; expected only 'delta'."
            )
        try:
            delta = _tensor(upload, "delta", shape, what)
        except ProtocolError as exc:
            raise EncodingRejected(str(exc)) from exc
        answer = self._call(
            Payload(
                meta={"kind": SCORE, "round": round, "attempt": attempt.number, "client": client}
            ),
            f"fetch client {client}'s score keys",
        )
        side = geometry.srfc_width
        a = _tensor(answer, "a", shape, "KDC's score keys")
        b = _tensor(answer, "b", (shape[1],), "KDC's score keys")
        p = _tensor(answer, "p", (side, side), "KDC's score keys")
        q = _tensor(answer, "q", (side, side), "KDC's score keys")
        norm = float(answer.meta["norm"])
        check = float(answer.meta["check"])
        if not maths.norm_ok(delta, norm):
            raise EncodingRejected(
                f"The {what} fails the norm check: ||delta||^2 = {float(np.vdot(delta, delta)):.9g}"
                f", expected {norm:.9g} (an update not normalised, or masks altered)."
            )
        if not maths.mask_ok(delta, attempt.keys["verify"][attempt.columns(group)], check):
            raise EncodingRejected(
                f"The {what} fails the mask check vk_0 . sum_k delta_k = vk_i (its masks were "
                f"altered)."
            )
        alpha = maths.score_matrix(delta, a, b, p, q)
        k = attempt.keys
        terms = maths.srfc_terms(alpha, k["beta"], k["tau1"], k["tau2"], k["tau3"])
        with self._lock:
            if self._attempt is attempt:
                attempt.terms[client] = terms

    def combine(
        self, round: int, uploads: Mapping[int, Payload], failures: Sequence[int]
    ) -> RoundResult | None:
        """Decodes the weighted per-cluster sums and moves each cluster's model.

        Raises:
            ProtocolError: an upload of the attempt is missing (the masks and SRFC's zero-sum
                terms would not cancel: redo the round with the survivors).
        """
        with self._lock:
            attempt = self._attempt
        if attempt is None or attempt.round != round:
            raise ProtocolError(f"Round {round} has no open ebscfl attempt to combine.")
        if (
            failures
            or tuple(sorted(uploads)) != attempt.roster
            or set(attempt.terms) != set(attempt.roster)
        ):
            missing = sorted(set(attempt.roster) - set(attempt.terms))
            raise ProtocolError(
                f"Round {round} attempt {attempt.number} lacks the checked uploads of clients "
                f"{missing or sorted(failures)}: the zero-sum masks would not cancel. Redo the "
                f"round with the survivors."
            )
        geometry = attempt.geometry
        k = attempt.keys
        s_matrix = 0.5 * sum(linear + rectified for linear, rectified in attempt.terms.values())
        total = maths.weight_total(s_matrix, k["beta"])
        rate = learning_rate(self._options, round)
        metrics: dict[str, float] = {"weight_total": total, "learning_rate": rate}
        with self._lock:
            self._attempt = None
        if not total > WEIGHT_FLOOR:
            log.warning(
                "Round %d: every update was filtered (W = %.3g); models kept.", round, total
            )
            return RoundResult(participants=len(uploads), metrics={**metrics, "updated": 0.0})
        decoded = np.zeros((geometry.segments, geometry.width))
        for group in range(geometry.groups):
            columns = attempt.columns(group)
            key = maths.weighted_decode_key(s_matrix, k["decode"][:, columns], total)
            members = attempt.roster[
                group * geometry.group : group * geometry.group + geometry.group_size(group)
            ]
            summed = sum(uploads[c].tensors["delta"] for c in members)
            decoded += summed @ key.T
        aggregates = maths.cluster_aggregates(decoded, k["embedding"], geometry)
        lengths = np.linalg.norm(aggregates, axis=1)
        if np.any(lengths > 1 + AGGREGATE_SLACK) or total < -WEIGHT_FLOOR:
            log.warning(
                "Round %d: decoded aggregates of lengths %s (at most 1 expected); models kept.",
                round,
                np.round(lengths, 6).tolist(),
            )
            return RoundResult(participants=len(uploads), metrics={**metrics, "updated": 0.0})
        self._theta += rate * self._root_norms[:, None] * aggregates
        return RoundResult(participants=len(uploads), metrics={**metrics, "updated": 1.0})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the cluster models (g_0 is recomputed from the seeded root data)."""
        super().load_state_dict(state)
        self._attempt = None

    # ---------------------------------------------------------------- internals

    def _call(self, payload: Payload, action: str) -> Payload:
        """One call to the KDC; any failure becomes a ProtocolError."""
        if self._kdc is None:
            raise ProtocolError("ebscfl's server was not set up with a KDC channel.")
        try:
            return self._kdc.submit(payload)
        except (FedcoreError, PermissionError) as exc:
            raise ProtocolError(f"The KDC could not {action}: {exc}") from exc

    def _check_server_keys(
        self, answer: Payload, geometry: maths.Geometry
    ) -> dict[str, np.ndarray]:
        d, side = geometry.width, geometry.srfc_width
        columns = 3 * d * geometry.clients
        shapes = {
            "embedding": (d, d),
            "beta": (d, side),
            "tau1": (side, side),
            "tau2": (side, side),
            "tau3": (side, side),
            "decode": (side, columns),
            "verify": (columns,),
        }
        return {
            name: _tensor(answer, name, shape, "KDC's server keys")
            for name, shape in shapes.items()
        }


# ---------------------------------------------------------------------------- client


class EbscflClient(ClientProtocol):
    """A client: picks its cluster, trains, normalises, encodes with its own keys.

    Args:
        index: this client's index.
        attack: this client's attack kind (``spec.attack``; None: honest).
        attack_scale: ``spec.attack.scale``.
        attack_seed: ``spec.attack.seed``.
    """

    def __init__(
        self,
        *,
        index: int,
        attack: str | None = None,
        attack_scale: float = 1.0,
        attack_seed: int = 0,
    ) -> None:
        self._index = index
        self._attack = attack
        self._scale = attack_scale
        self._seed = attack_seed
        self._cache: tuple[int, int, np.ndarray] | None = None

    def compute_upload(
        self, round: int, instruction: Payload, learner: LocalLearner, keys: Payload | None
    ) -> Payload:
        """Returns delta_i; a redone attempt re-encodes the round's update under its new keys.

        When the KDC's keys belong to another attempt than the instruction (the server has
        moved on), the upload is an empty stale one, which the server drops.

        Raises:
            ProtocolError: no keys, or keys or an instruction of the wrong shape.
        """
        meta = instruction.meta
        if keys is None:
            raise ProtocolError("ebscfl's client needs its keys from the KDC.")
        stale = Payload(
            meta={"nonce": meta.get("nonce"), "attempt": meta.get("attempt"), "stale": True}
        )
        if not keys.meta.get("participant") or keys.meta.get("nonce") != meta.get("nonce"):
            return stale
        clusters = int(meta["clusters"])
        segment = int(meta["segment"])
        prefix = cluster_name(0, "")
        names = [n[len(prefix) :] for n in instruction.tensors if n.startswith(prefix)]
        models = [
            {n: instruction.tensors[cluster_name(j, n)] for n in names} for j in range(clusters)
        ]
        cached = self._cache
        if cached is not None and cached[0] == round:
            cluster, unit = cached[1], cached[2]
        else:
            cluster, unit = self._train(round, models, names, learner)
            self._cache = (round, cluster, unit)
        what = f"keys of client {self._index}"
        embedding = keys.tensors.get("embedding")
        slot = keys.tensors.get("slot")
        mask_key = keys.tensors.get("mask_key")
        d = segment * clusters
        if embedding is None or slot is None or mask_key is None or embedding.shape != (d, d):
            raise ProtocolError(f"The KDC's {what} lack ek^0, ek^1 or A of width {d}.")
        geometry = maths.Geometry(unit.size, clusters, segment, 1, 1)
        if slot.shape[0] != d or mask_key.shape != (geometry.segments, slot.shape[1]):
            raise ProtocolError(f"The KDC's {what} do not fit an update of {unit.size} numbers.")
        delta = maths.encode(unit, cluster, geometry, embedding, slot, mask_key)
        if self._attack == "MalformedEncoding":
            delta = poisoning.tamper(delta, self._scale, self._seed, round, self._index)
        return Payload(
            meta={"nonce": meta["nonce"], "attempt": meta["attempt"]},
            tensors={"delta": delta},
        )

    def _train(
        self, round: int, models: list[Weights], names: list[str], learner: LocalLearner
    ) -> tuple[int, np.ndarray]:
        """Algorithm 1: the lowest-loss model on the whole shard, trained; its unit update."""
        losses = [learner.gradient(w, round=round)[1].loss for w in models]
        cluster = int(np.argmin(losses))
        trained, _ = learner.train(models[cluster], round=round)
        update = flatten(trained, names) - flatten(models[cluster], names)
        update = poisoning.poison_update(update, self._attack, self._scale)
        norm = float(np.linalg.norm(update))
        return cluster, update / norm if norm > 0 else update


# ------------------------------------------------------------------------------- KDC


class EbscflKdc(KdcProtocol):
    """Generates and holds every key; hands each party only its own (digest 2.15).

    The server gets, per attempt, A, beta, tau1-3, the decode and verification keys of every
    group, and per client the factored score extractor and its check values; a client gets its
    slot M'_p, A and ek^1. Nobody else gets M, M', R'', mu, R', zeta, R or V. The state (the
    master secret, the unit g_0 and the open attempt) is checkpointed apart by the KDC role.

    Args:
        options: ``spec.protocol.ebscfl``.
        count: ``spec.clients.count``.
    """

    kind = "ebscfl-kdc"

    def __init__(self, *, options: EbscflOptions, count: int) -> None:
        self._options = options
        self._count = count
        self._master = secrets.token_bytes(32)
        self._g0: np.ndarray | None = None
        self._open: keys_.Attempt | None = None
        self._material: keys_.KeyMaterial | None = None

    def accept(self, party: Identity, payload: Payload) -> Payload:
        """The server's calls: OPEN an attempt (with g_0) or fetch one client's SCORE keys.

        Raises:
            PermissionError: the party is not the server.
            MessageRejected: an unknown request or malformed values.
            NotReady: a SCORE for an attempt that is not the open one.
        """
        if party.role != "server":
            raise PermissionError(
                f"{party.common_name!r} may not call the ebscfl KDC's server API."
            )
        kind = payload.meta.get("kind")
        if kind == OPEN:
            return self._open_attempt(payload)
        if kind == SCORE:
            return self._score(payload)
        raise MessageRejected(
            f"The ebscfl KDC takes requests {OPEN!r} and {SCORE!r}, not {kind!r}."
        )

    def issue_keys(self, round: int, party: Identity) -> Payload:
        """A client's ek^0, A and ek^1 for the open attempt of ``round``.

        Raises:
            PermissionError: the party is not a client of this run.
            NotReady: the server has not opened ``round`` yet (the client retries).
        """
        if party.role != "client" or party.index is None or party.index >= self._count:
            raise PermissionError(f"{party.common_name!r} may not receive ebscfl keys.")
        attempt = self._open
        if attempt is None or attempt.round < round:
            raise NotReady(f"The server has not opened round {round} at the KDC yet.")
        meta: dict[str, Any] = {"round": round, "attempt": attempt.attempt, "nonce": attempt.nonce}
        if attempt.round > round or party.index not in attempt.roster:
            return Payload(meta={**meta, "participant": False})
        material = self._keys()
        tensors = material.client_keys(attempt.roster.index(party.index))
        return Payload(meta={**meta, "participant": True}, tensors=tensors)

    def state_dict(self) -> dict[str, Any]:
        """The master secret, the unit g_0 and the open attempt: every key derives from them."""
        return {
            "kind": self.kind,
            "version": 1,
            "clients": self._count,
            "master": self._master.hex(),
            "g0": None if self._g0 is None else self._g0.copy(),
            "open": None if self._open is None else self._open.as_json(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_kind(state, self.kind, ["clients", "master", "g0", "open"])
        self._count = int(state["clients"])
        self._master = bytes.fromhex(str(state["master"]))
        self._g0 = None if state["g0"] is None else np.asarray(state["g0"], dtype=np.float64)
        self._open = None if state["open"] is None else keys_.Attempt.from_json(state["open"])
        self._material = None

    # ---------------------------------------------------------------- internals

    def _open_attempt(self, payload: Payload) -> Payload:
        meta = payload.meta
        try:
            attempt = keys_.Attempt(
                int(meta["round"]), int(meta["attempt"]), str(meta["nonce"]), tuple(meta["roster"])
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise MessageRejected(
                f"An ebscfl OPEN needs round, attempt, nonce and roster: {exc}"
            ) from exc
        roster = attempt.roster
        if (
            len(roster) < 2
            or list(roster) != sorted(set(roster))
            or not all(isinstance(k, int) and 0 <= k < self._count for k in roster)
        ):
            raise MessageRejected(
                f"An ebscfl roster is 2 or more distinct ascending client indices below "
                f"{self._count}, got {list(roster)}."
            )
        g0 = payload.tensors.get("g0")
        m = self._options.clusters
        if g0 is None or g0.dtype != np.float64 or g0.ndim != 2 or g0.shape[0] != m:
            raise MessageRejected(f"An ebscfl OPEN carries g_0 as float64 [{m}, l].")
        norms = np.linalg.norm(g0, axis=1)
        if not np.all(np.isfinite(g0)) or not np.all(norms > 0):
            raise MessageRejected("Every cluster's g_0 must be finite and nonzero.")
        units = g0 / norms[:, None]
        if self._g0 is None or not np.array_equal(self._g0, units):
            self._g0 = units
        self._open = attempt
        self._material = None
        material = self._keys()
        g = material.geometry
        return Payload(
            meta={"round": attempt.round, "attempt": attempt.attempt, "groups": g.groups},
            tensors=material.server_keys(),
        )

    def _score(self, payload: Payload) -> Payload:
        attempt = self._open
        meta = payload.meta
        if attempt is None or (meta.get("round"), meta.get("attempt")) != (
            attempt.round,
            attempt.attempt,
        ):
            raise NotReady(
                f"Round {meta.get('round')} attempt {meta.get('attempt')} is not the open attempt."
            )
        client = meta.get("client")
        if not isinstance(client, int) or client not in attempt.roster:
            raise MessageRejected(f"Client {client!r} is not in the open attempt's roster.")
        keys, norm, check = self._keys().score_keys(attempt.roster.index(client))
        return Payload(meta={"norm": norm, "check": check}, tensors=keys)

    def _keys(self) -> keys_.KeyMaterial:
        if self._material is None:
            attempt, g0 = self._open, self._g0
            if attempt is None or g0 is None:
                raise NotReady("No attempt is open at the KDC.")
            options = self._options
            self._material = keys_.KeyMaterial(
                master=self._master,
                attempt=attempt,
                geometry=_geometry(options, int(g0.shape[1]), len(attempt.roster)),
                g0_units=g0,
                repaired=options.mode == "Repaired",
                zeta_scale=options.zeta_scale,
            )
        return self._material


# --------------------------------------------------------------------------- protocol


class Ebscfl(Protocol):
    """EBS-CFL (see the module docstring)."""

    name = "ebscfl"

    def create_server(self, spec: FederatedRunSpec, initial: Weights) -> ServerProtocol:
        models, root = root_updates(spec, initial)
        return EbscflServer(initial, options=spec.protocol.ebscfl, models=models, root_updates=root)

    def create_client(self, spec: FederatedRunSpec, index: int) -> ClientProtocol:
        attack = spec.attack
        return EbscflClient(
            index=index,
            attack=poisoning.attack_of(spec, index),
            attack_scale=1.0 if attack is None else attack.scale,
            attack_seed=0 if attack is None else attack.seed,
        )

    def create_kdc(self, spec: FederatedRunSpec) -> KdcProtocol | None:
        return EbscflKdc(options=spec.protocol.ebscfl, count=spec.clients.count)


def root_updates(spec: FederatedRunSpec, initial: Weights) -> tuple[np.ndarray, np.ndarray]:
    """The server's initialisation (Alg. 2, as the digest's G12 resolves it).

    The root sample's shards of data cluster q go to model q mod m (the server knows its own
    data's clusters); with fewer data clusters than m, the sample is dealt round-robin to the m
    models instead. Model j is trained from the initial model for rootEpochs on its shards; g_0^j
    is that update, and the trained model is cluster j's starting model (a warm start, so that
    clients of a cluster pick its model from round 1; the paper leaves the models at theta^0).

    Returns:
        (the m starting models, the m updates g_0), flat float64, m x l each.
    """
    from fedcore.learning.data import ArrayDataset, root_shards
    from fedcore.learning.models import build_model

    options = spec.protocol.ebscfl
    m = options.clusters
    shards = root_shards(spec, options.root_examples)
    if len(shards) >= m:
        groups = [[s for q, s in shards if q % m == j] for j in range(m)]
    else:
        x = np.concatenate([s.x for _, s in shards])
        y = np.concatenate([s.y for _, s in shards])
        groups = [[ArrayDataset(x[j::m], y[j::m], shards[0][1].num_classes)] for j in range(m)]
    names = list(initial)
    start = flatten(initial, names)
    models = np.empty((m, start.size))
    updates = np.empty((m, start.size))
    training = spec.training.model_copy(update={"local_epochs": options.root_epochs})
    for j, group in enumerate(groups):
        data = ArrayDataset(
            np.concatenate([s.x for s in group]),
            np.concatenate([s.y for s in group]),
            group[0].num_classes,
        )
        model = build_model(spec.model, data.input_shape, data.num_classes, seed=spec.seed)
        learner = LocalLearner(
            model, data, training, seed=spec.seed, client_index=spec.clients.count + j
        )
        trained, _ = learner.train(initial, round=0)
        models[j] = flatten(trained, names)
        updates[j] = models[j] - start
    return models, updates

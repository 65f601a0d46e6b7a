"""lppa: gradient tracking over a peer graph, trackers masked with zero-sum noise (seed 002).

Miao, Li, Zhang, Zhao and Wu, "Lossless Privacy-Preserving Aggregation for Decentralized
Federated Learning" (the implementer's digest is
``shared/digests/002_LPPA_decentralized_lossless_aggregation.md``, cited by section).

Each client holds a model ``theta_i``, a gradient tracker ``gamma_i`` and its last gradient
``g_i`` as flat vectors. In round 1, before anything else, every client sends each
out-neighbour a fresh Laplace(beta) noise vector and starts its tracker as
``gamma_i^0 = g_i^0 + (noise sent - noise received)`` (Algorithm 1, line 6). Every round it
sends ``(theta_i, gamma_i)`` to its out-neighbours over a direct mutual-TLS link, receives
theirs, and takes one DSGT step (Eqs. 2 and 3, ``_lppa_maths``) with step size
``spec.training.optimizer.learningRate`` and one minibatch gradient of
``spec.training.batchSize`` rows. The noise differences sum to exactly zero (quantised noise),
so the trackers' sum equals the gradients' sum every round and the average model is plain
DSGT's (digest 2.5). Variants: plain DSGT, and the two DP baselines (Laplace noise added by
each client to its own tracker, once or before every transmission; digest gap 8).

The server role is only a coordinator: it sends each client an instruction without tensors
(the round, whether to evaluate, checkpoint or release) and refuses any upload that carries a
tensor or a key outside a short list of scalars. Each client's state (and its checkpoint, its
evaluation, its released model) stays with the client. What this does not protect is listed
in docs/protocols/lppa.md (the digest's leaks 1 to 4).
"""

from __future__ import annotations

import math
import secrets
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedcore.errors import ProtocolError
from fedcore.learning.models import build_model, get_weights
from fedcore.learning.training import LocalLearner
from fedcore.protocols._base import (
    ClientProtocol,
    PeerChannel,
    PeerClientProtocol,
    Protocol,
    RoundResult,
    ServerProtocol,
    Weights,
    check_state_kind,
)
from fedcore.protocols._batches import batch_gradient, batch_rows
from fedcore.protocols.lppa.maths import (
    dsgt_step,
    flatten,
    laplace_noise,
    noise_difference,
    unflatten,
)
from fedcore.spec import FederatedRunSpec, peer_graph
from fedcore.spec.topology import PeerPlan, peer_plans
from fedcore.transport import Payload

LINK_NOISE_STREAM = 0x1A0A
"""Keeps LPPA's link noise apart from other uses of the seed (reproducible mode)."""
DP_NOISE_STREAM = 0x1A0D
"""Keeps the DP baselines' noise apart from other uses of the seed (reproducible mode)."""

UPLOAD_KEYS = frozenset(
    {
        "num_examples",
        "loss",
        "steps",
        "disagreement",
        "eval_accuracy",
        "eval_loss",
        "checkpointed",
        "checkpoint_error",
        "peer_bytes_sent",
        "peer_bytes_received",
    }
)
"""The only things a client may tell the coordinator: scalars about its round, no model data."""

_BUILD_LOCK = threading.Lock()
"""build_model seeds torch's global generator: clients simulated as threads take turns."""


def round_flags(spec: FederatedRunSpec, round: int) -> dict[str, bool]:
    """What the coordinator asks of every client after ``round``: evaluate, checkpoint,
    release (on the server's own schedule for those)."""
    last = round == spec.rounds
    every_eval = spec.evaluation.every_rounds
    every_ckpt = spec.checkpoint.every_rounds
    return {
        "evaluate": last or bool(every_eval and round % every_eval == 0),
        "checkpoint": bool(every_ckpt) and (last or round % every_ckpt == 0),
        "release": last and spec.evaluation.release_final_model,
    }


# ------------------------------------------------------------------------ the coordinator


class LppaCoordinator(ServerProtocol):
    """The server side: paces rounds and gathers scalar metrics; it never holds a model.

    Each start gets a fresh epoch token: the clients tag their peer messages with it, so a
    restarted coordinator's rounds never consume a message of its predecessor's.
    """

    kind = "lppa-coordinator"

    def __init__(self, spec: FederatedRunSpec) -> None:
        self._spec = spec
        self._epoch = secrets.token_hex(8)
        self._round = 0

    def plan_round(self, round: int, clients: Sequence[int]) -> Mapping[int, Payload]:
        meta = {"epoch": self._epoch, "base_round": round - 1, **round_flags(self._spec, round)}
        return {client: Payload(meta=dict(meta)) for client in clients}

    def check_upload(self, round: int, client: int, upload: Payload) -> None:
        """Refuses any tensor and anything but the listed scalars."""
        what = f"The upload of client {client} in round {round}"
        if upload.tensors:
            raise ProtocolError(
                f"{what} carries tensors {sorted(upload.tensors)}; the lppa coordinator accepts "
                f"no tensors (no server sees model data)."
            )
        extra = sorted(set(upload.meta) - UPLOAD_KEYS)
        if extra:
            raise ProtocolError(
                f"{what} carries {extra}; the lppa coordinator accepts only {sorted(UPLOAD_KEYS)}."
            )
        for key, value in upload.meta.items():
            if key == "checkpoint_error":
                if not isinstance(value, str):
                    raise ProtocolError(f"{what} reports a checkpoint_error that is not text.")
            elif (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise ProtocolError(f"{what} reports {key}={value!r}; a finite number is needed.")

    def combine(
        self, round: int, uploads: Mapping[int, Payload], failures: Sequence[int]
    ) -> RoundResult | None:
        if failures:
            raise ProtocolError(
                f"Round {round} lost clients {list(failures)}; lppa cannot go on without them."
            )
        if not uploads:
            return None
        flags = round_flags(self._spec, round)
        if flags["checkpoint"]:
            missing = {
                k: str(u.meta.get("checkpoint_error", "no checkpoint reported"))
                for k, u in uploads.items()
                if u.meta.get("checkpointed") != round
            }
            if missing:
                shown = "; ".join(f"client {k}: {why}" for k, why in sorted(missing.items()))
                raise ProtocolError(
                    f"Round {round}: not every client wrote its checkpoint ({shown}), so no "
                    f"consistent restart point exists."
                )
        order = sorted(uploads)

        def values(key: str) -> list[float]:
            return [float(uploads[k].meta[key]) for k in order if key in uploads[k].meta]

        metrics: dict[str, float] = {}
        accuracy = values("eval_accuracy")
        if accuracy:
            metrics.update(
                accuracy=float(np.mean(accuracy)),
                accuracy_min=float(np.min(accuracy)),
                accuracy_max=float(np.max(accuracy)),
            )
        eval_loss = values("eval_loss")
        if eval_loss:
            metrics["loss"] = float(np.mean(eval_loss))
        disagreement = values("disagreement")
        if disagreement:
            metrics["disagreement"] = float(np.max(disagreement))
        for key in ("peer_bytes_sent", "peer_bytes_received"):
            found = values(key)
            if found:
                metrics[key] = float(np.sum(found))
        losses = values("loss")
        self._round = round
        return RoundResult(
            participants=len(order),
            train_loss=float(np.mean(losses)) if losses else None,
            metrics=metrics,
        )

    def global_weights(self) -> Weights:
        """The coordinator holds no model: always empty."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "version": 1, "round": self._round}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_kind(state, self.kind, ["round"])
        self._round = int(state["round"])


# ---------------------------------------------------------------------------- a client


class LppaClient(PeerClientProtocol):
    """One client: its model, tracker and last gradient, stepped with its neighbours."""

    kind = "lppa-client"

    def __init__(self, spec: FederatedRunSpec, index: int) -> None:
        options = spec.protocol.lppa
        graph, matrix = peer_graph(spec)
        plan: PeerPlan = peer_plans(graph, matrix)[index]
        self._spec = spec
        self._index = index
        self._plan = plan
        self._variant = options.variant
        self._beta = options.noise_scale
        self._every_round = options.injection == "EveryRound"
        self._secure = options.secure_noise
        self._step_size = spec.training.optimizer.learning_rate
        self._peers: PeerChannel | None = None
        self._round = 0
        self._template: Weights | None = None
        self._theta: np.ndarray | None = None
        self._gamma: np.ndarray | None = None
        self._grad: np.ndarray | None = None
        self._bytes_sent = 0
        if not self._secure and self._variant != "DSGT":
            warnings.warn(
                "lppa draws its noise from a generator seeded by spec.seed "
                "(spec.protocol.lppa.secureNoise is false): anyone who knows the seed can "
                "redraw it and remove it. Use it for tests only.",
                UserWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------ the interface

    @property
    def plan(self) -> PeerPlan:
        """This client's links and row of W."""
        return self._plan

    def setup_peers(self, peers: PeerChannel) -> None:
        if peers.index != self._index:
            raise ProtocolError(f"Client {self._index} was given client {peers.index}'s links.")
        self._peers = peers

    def completed_round(self) -> int:
        return self._round

    def local_weights(self) -> Weights:
        if self._theta is None or self._template is None:
            raise ProtocolError(f"Client {self._index} holds no model before its first round.")
        return unflatten(self._theta, self._template)

    def vectors(self) -> dict[str, np.ndarray]:
        """theta, gamma and the cached gradient as flat vectors (for tests and audits)."""
        if self._theta is None or self._gamma is None or self._grad is None:
            return {}
        return {"theta": self._theta, "gamma": self._gamma, "grad": self._grad}

    def state_dict(self) -> dict[str, Any]:
        if self._theta is None or self._gamma is None or self._grad is None:
            return {"kind": self.kind, "version": 1, "index": self._index, "round": 0}
        return {
            "kind": self.kind,
            "version": 1,
            "index": self._index,
            "round": self._round,
            "theta": self.local_weights(),
            "gamma": self._gamma.copy(),
            "grad": self._grad.copy(),
        }

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        if state is None or int(state.get("round", 0)) == 0:
            self._round = 0
            self._theta = self._gamma = self._grad = None
            return
        check_state_kind(state, self.kind, ["index", "round", "theta", "gamma", "grad"])
        if int(state["index"]) != self._index:
            raise ValueError(
                f"The state is client {state['index']}'s; this is client {self._index}."
            )
        template = {name: np.asarray(value) for name, value in dict(state["theta"]).items()}
        theta = flatten(template)
        gamma = np.asarray(state["gamma"])
        grad = np.asarray(state["grad"])
        if gamma.shape != theta.shape or grad.shape != theta.shape:
            raise ValueError("The state's tracker or gradient does not fit its model.")
        self._template = template
        self._theta, self._gamma, self._grad = theta.copy(), gamma.copy(), grad.copy()
        self._round = int(state["round"])

    # ---------------------------------------------------------------------- a round

    def compute_upload(
        self, round: int, instruction: Payload, learner: LocalLearner, keys: Payload | None
    ) -> Payload:
        peers = self._peers
        if peers is None:
            raise ProtocolError(f"Client {self._index} has no peer links (setup_peers).")
        base = int(instruction.meta.get("base_round", round - 1))
        if self._round != base or base != round - 1:
            raise ProtocolError(
                f"Client {self._index} holds round {self._round}, but round {round} starts "
                f"from round {base}; the role must restore its checkpoint first."
            )
        epoch = str(instruction.meta.get("epoch", ""))
        step = round - 1  # the paper's t
        self._bytes_sent = 0
        if self._theta is None:
            self._initialise(epoch, round, learner)
        elif self._variant == "LPPA" and self._every_round:
            self._add(self._exchange_noise(epoch, round))
        if self._variant == "DPEveryRound" and step > 0:
            self._add(self._own_noise(round))
        assert self._theta is not None and self._gamma is not None and self._grad is not None
        state_tag = f"{epoch}/{round}/state"
        for to in self._plan.out_neighbours:
            self._send(to, state_tag, {"theta": self._theta, "gamma": self._gamma})
        thetas: dict[int, np.ndarray] = {}
        gammas: dict[int, np.ndarray] = {}
        for sender in self._plan.in_neighbours:
            message = peers.receive(sender, state_tag)
            thetas[sender] = self._vector(message, "theta", sender)
            gammas[sender] = self._vector(message, "gamma", sender)
        theta_next, gamma_mixed = dsgt_step(
            self._theta,
            self._gamma,
            self._index,
            thetas,
            gammas,
            self._plan.weights,
            self._step_size,
        )
        # |theta_i - sum_j w_ij theta_j|: how far this client is from its neighbourhood.
        mixed = theta_next + self._step_size * self._gamma.astype(np.float64)
        disagreement = float(np.linalg.norm(self._theta.astype(np.float64) - mixed))
        dtype = self._theta.dtype
        theta_next = theta_next.astype(dtype)
        grad_next, loss = self._gradient(theta_next, step + 1, learner)
        gamma_next = (gamma_mixed + grad_next - self._grad).astype(dtype)
        self._theta, self._gamma, self._grad = theta_next, gamma_next, grad_next
        self._round = round
        return Payload(
            meta={
                "num_examples": learner.num_examples,
                "loss": loss,
                "steps": 1,
                "disagreement": disagreement,
            }
        )

    # ------------------------------------------------------------------------ helpers

    def _initialise(self, epoch: str, round: int, learner: LocalLearner) -> None:
        """theta^0 (the run's initial model), g^0, and gamma^0 with the variant's noise."""
        x = learner.features
        with _BUILD_LOCK:
            model = build_model(
                self._spec.model,
                tuple(x.shape[1:]),
                int(learner.targets.shape[1]),
                seed=self._spec.seed,
            )
        initial = get_weights(model)
        for name, value in initial.items():
            if not np.issubdtype(value.dtype, np.floating):
                raise ProtocolError(f"lppa mixes float tensors only; {name!r} is {value.dtype}.")
        self._template = initial
        self._theta = flatten(initial)
        self._grad, _ = self._gradient(self._theta, 0, learner)
        self._gamma = self._grad.copy()
        if self._variant == "LPPA":
            self._add(self._exchange_noise(epoch, round))
        elif self._variant in ("DPInit", "DPEveryRound"):
            self._add(self._own_noise(round))

    def _add(self, noise: np.ndarray) -> None:
        assert self._gamma is not None
        self._gamma = (self._gamma.astype(np.float64) + noise).astype(self._gamma.dtype)

    def _exchange_noise(self, epoch: str, round: int) -> np.ndarray:
        """Sends each out-neighbour fresh noise, takes the in-neighbours'; returns n_i."""
        assert self._peers is not None and self._theta is not None
        tag = f"{epoch}/{round}/noise"
        size = len(self._theta)
        sent = []
        for to in self._plan.out_neighbours:
            if self._secure:
                rng = np.random.Generator(np.random.PCG64(secrets.randbits(128)))
            else:
                rng = np.random.default_rng(
                    [self._spec.seed, round, LINK_NOISE_STREAM, self._index, to]
                )
            noise = laplace_noise(rng, size, self._beta)
            self._send(to, tag, {"noise": noise})
            sent.append(noise)
        received = [
            self._vector(self._peers.receive(sender, tag), "noise", sender, dtype=np.float64)
            for sender in self._plan.in_neighbours
        ]
        return noise_difference(sent, received)

    def _own_noise(self, round: int) -> np.ndarray:
        """A DP baseline's Laplace(beta) noise on this client's own tracker."""
        assert self._theta is not None
        if self._secure:
            rng = np.random.Generator(np.random.PCG64(secrets.randbits(128)))
        else:
            rng = np.random.default_rng([self._spec.seed, round, DP_NOISE_STREAM, self._index])
        return laplace_noise(rng, len(self._theta), self._beta)

    def _gradient(
        self, theta: np.ndarray, step: int, learner: LocalLearner
    ) -> tuple[np.ndarray, float]:
        assert self._template is not None
        rows = batch_rows(
            learner.num_examples,
            self._spec.training.batch_size,
            seed=self._spec.seed,
            step=step,
            client=self._index,
        )
        grads, loss = batch_gradient(
            learner, unflatten(theta, self._template), rows, loss=self._spec.training.loss
        )
        return flatten(grads).astype(theta.dtype), loss

    def _send(self, to: int, tag: str, tensors: dict[str, np.ndarray]) -> None:
        assert self._peers is not None
        self._peers.send(to, tag, Payload(meta={"from": self._index}, tensors=tensors))
        self._bytes_sent += sum(int(v.nbytes) for v in tensors.values())

    def _vector(self, message: Payload, name: str, sender: int, *, dtype: Any = None) -> np.ndarray:
        assert self._theta is not None
        value = message.tensors.get(name)
        expected = self._theta.dtype if dtype is None else np.dtype(dtype)
        if value is None or value.shape != self._theta.shape or value.dtype != expected:
            got = None if value is None else f"{value.dtype}{list(value.shape)}"
            raise ProtocolError(
                f"Client {self._index} got a malformed {name!r} from client {sender}: {got}, "
                f"expected {expected}[{len(self._theta)}]."
            )
        if not np.all(np.isfinite(value)):
            raise ProtocolError(
                f"Client {self._index} got a {name!r} with NaN or infinite values from client "
                f"{sender}."
            )
        return value


class Lppa(Protocol):
    """LPPA over a peer graph (see the module docstring)."""

    name = "lppa"

    def create_server(self, spec: FederatedRunSpec, initial: Weights) -> ServerProtocol:
        return LppaCoordinator(spec)

    def create_client(self, spec: FederatedRunSpec, index: int) -> ClientProtocol:
        return LppaClient(spec, index)

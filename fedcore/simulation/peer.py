"""Decentralized protocols in one process: an in-memory peer network and a simulation.

The same client protocol code that runs in a client process over mutual-TLS peer links runs
here, each client in its own thread (a client blocks on its neighbours' messages, as it does
over the network), behind an in-memory ``PeerChannel``. Every round is played through the
server role's round policy (``fedcore.rounds``), with the coordinator as its server side;
evaluation, checkpoints and releases are the client role's duties and are done here the same
way (checkpoints kept in memory). The result also
records, every round, what only a view of every client can show: the trackers' sum against
the gradients' sum, the average model and the consensus distance. Unit tests, benchmarks and
``fedcore run --simulate`` use it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedcore.errors import PeerLost, ProtocolError
from fedcore.learning.data import client_dataset, test_dataset
from fedcore.learning.models import build_model
from fedcore.learning.training import Evaluator, LocalLearner
from fedcore.privacy import PrivacyLedger
from fedcore.protocols import PeerChannel, PeerClientProtocol, Weights, create_protocol
from fedcore.rounds import AttemptReport, RoundPolicy, play_round
from fedcore.spec import FederatedRun
from fedcore.spec.topology import PeerPlan
from fedcore.transport import Payload

DEFAULT_TIMEOUT = 600.0


class MemoryNetwork:
    """Every client's inbox, keyed by (sender, tag); one lock guards them all, and each inbox
    has its own condition on it, so a message wakes only its receiver.

    Args:
        plans: each client's links (``fedcore.spec.topology.peer_plans``).
        timeout: how long a receive waits before it raises ``PeerLost``.
    """

    def __init__(
        self, plans: Sequence[PeerPlan], timeout: float = DEFAULT_TIMEOUT, *, record: bool = False
    ) -> None:
        self.plans = {plan.index: plan for plan in plans}
        self.timeout = timeout
        self.record = record
        self.messages: list[tuple[int, int, str, Payload]] = []
        """With ``record``: every message sent, as (sender, receiver, tag, a copy)."""
        self._lock = threading.Lock()
        self._arrived = {i: threading.Condition(self._lock) for i in self.plans}
        self._inbox: dict[int, dict[tuple[int, str], Payload]] = {i: {} for i in self.plans}
        self._lost: dict[int, str] = {}
        self.bytes_sent: dict[int, int] = dict.fromkeys(self.plans, 0)
        self.log: list[tuple[int, int, str, dict[str, tuple[int, ...]]]] = []
        """Every message sent: (sender, receiver, tag, {tensor: shape})."""

    def channel(self, index: int) -> MemoryPeers:
        """Client ``index``'s end of the network."""
        return MemoryPeers(self, index)

    def fail(self, index: int, why: str = "stopped") -> None:
        """Marks client ``index`` as gone: its neighbours' receives raise ``PeerLost``."""
        with self._lock:
            self._lost[index] = why
            for arrived in self._arrived.values():
                arrived.notify_all()

    def _deliver(self, sender: int, to: int, tag: str, payload: Payload) -> None:
        plan = self.plans[sender]
        if to not in plan.out_neighbours:
            raise PermissionError(f"Client {sender} has no link to client {to}.")
        copied = Payload(
            meta=dict(payload.meta),
            tensors={name: np.array(value, copy=True) for name, value in payload.tensors.items()},
        )
        with self._lock:
            if sender in self._lost:
                raise PeerLost(f"Client {sender} is stopped.", peer=sender)
            self._inbox[to][(sender, tag)] = copied
            self.bytes_sent[sender] += sum(int(v.nbytes) for v in copied.tensors.values())
            self.log.append(
                (sender, to, tag, {n: tuple(v.shape) for n, v in copied.tensors.items()})
            )
            if self.record:
                self.messages.append((sender, to, tag, copied))
            self._arrived[to].notify_all()

    def _take(self, index: int, sender: int, tag: str) -> Payload:
        plan = self.plans[index]
        if sender not in plan.in_neighbours:
            raise PermissionError(f"Client {sender} is not an in-neighbour of client {index}.")
        neighbours = set(plan.in_neighbours) | set(plan.out_neighbours)
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while True:
                lost = sorted(set(self._lost) & neighbours)
                if lost:
                    raise PeerLost(
                        f"Client {index}'s neighbour client {lost[0]} was lost "
                        f"({self._lost[lost[0]]}).",
                        peer=lost[0],
                    )
                found = self._inbox[index].pop((sender, tag), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerLost(
                        f"Client {index} got nothing from client {sender} for {tag!r} within "
                        f"{self.timeout} s.",
                        peer=sender,
                    )
                self._arrived[index].wait(left)


class MemoryPeers(PeerChannel):
    """One client's links on a ``MemoryNetwork``."""

    def __init__(self, network: MemoryNetwork, index: int) -> None:
        self._network = network
        self._index = index

    @property
    def index(self) -> int:
        return self._index

    def send(self, to: int, tag: str, payload: Payload) -> None:
        self._network._deliver(self._index, to, tag, payload)

    def receive(self, sender: int, tag: str) -> Payload:
        return self._network._take(self._index, sender, tag)


@dataclass
class DecentralizedResult:
    """What a simulated decentralized run ends with.

    Attributes:
        clients: each client's final model.
        mean: the average of the clients' models.
        accuracy: the mean of the clients' held-out accuracies (what the coordinator reports).
        loss: the mean of their held-out losses.
        history: per round: the coordinator's result, the tracker residual
            ``max |sum_i gamma_i - sum_i g_i|`` (protocols that expose trackers), the
            consensus distance ``max_i |theta_i - mean|``, seconds.
        rounds_completed: the rounds run.
        network: the in-memory network (its message log and byte counts).
    """

    clients: dict[int, Weights]
    mean: Weights
    accuracy: float
    loss: float
    history: list[dict[str, Any]] = field(default_factory=list)
    rounds_completed: int = 0
    network: MemoryNetwork | None = None


RoundHook = Callable[[int, dict[int, PeerClientProtocol]], None]
"""Called after each round with the round and every client protocol (for tests)."""


def simulate_decentralized(
    run: FederatedRun,
    *,
    rounds: int | None = None,
    after_round: RoundHook | None = None,
    evaluate: bool = True,
    record: bool = False,
    resume: tuple[int, dict[int, dict[str, Any]]] | None = None,
) -> DecentralizedResult:
    """Runs a decentralized ``run`` (or up to round ``rounds``) in this process.

    Args:
        run: the validated manifest (a protocol whose facts say decentralized).
        rounds: the last round to run (default: the spec's).
        after_round: a hook called after every round.
        evaluate: evaluate where the coordinator asks (False skips it, for speed).
        record: keep a copy of every peer message (``result.network.messages``).
        resume: (round, each client's ``state_dict()`` after it): start from there, as
            client roles do from their checkpoints.

    Raises:
        ProtocolError: the protocol is not decentralized, or a round failed.
    """
    from fedcore.spec import peer_graph

    spec = run.spec
    protocol = create_protocol(spec.protocol.name)
    if not protocol.facts.decentralized:
        raise ProtocolError(f"Protocol {spec.protocol.name!r} is not decentralized.")
    graph, matrix = peer_graph(spec)
    from fedcore.spec.topology import peer_plans

    network = MemoryNetwork(
        peer_plans(graph, matrix), spec.failure_policy.round_timeout_seconds, record=record
    )
    coordinator = protocol.create_server(spec, {})
    count = spec.clients.count
    clients: dict[int, PeerClientProtocol] = {}
    learners: dict[int, LocalLearner] = {}
    for index in range(count):
        client = protocol.create_client(spec, index)
        if not isinstance(client, PeerClientProtocol):
            raise ProtocolError(f"Protocol {spec.protocol.name!r} has no peer client side.")
        client.setup_peers(network.channel(index))
        if resume is not None:
            client.load_state_dict(resume[1][index])
        clients[index] = client
        data = client_dataset(spec, index)
        model = build_model(spec.model, data.input_shape, data.num_classes, seed=spec.seed)
        learners[index] = LocalLearner(
            model, data, spec.training, seed=spec.seed, client_index=index
        )
    test = test_dataset(spec)
    eval_model = build_model(spec.model, test.input_shape, test.num_classes, seed=spec.seed)
    evaluator = Evaluator(eval_model, test, spec.training)
    last = spec.rounds if rounds is None else rounds
    history: list[dict[str, Any]] = []
    saved: dict[int, dict[str, Any]] = {}
    scores: dict[int, tuple[float, float]] = {}
    policy = RoundPolicy(spec, protocol.facts)
    ledger = PrivacyLedger(spec, protocol.noise_multiplier(spec))
    with ThreadPoolExecutor(max_workers=count, thread_name_prefix="peer") as pool:

        def run_attempt(round_: int, number: int, plans: Mapping[int, Payload]) -> AttemptReport:
            # A client that fails raises here, from its thread: the error that names the lost
            # peer, as a client role's log does (the server role reports it as PeerLost).
            futures = {
                index: pool.submit(
                    clients[index].compute_upload, round_, plans[index], learners[index], None
                )
                for index in plans
            }
            uploads = {}
            for index, future in futures.items():
                upload = future.result()
                meta = dict(upload.meta)
                flags = plans[index].meta
                if flags.get("evaluate") and evaluate:
                    result = evaluator.evaluate(clients[index].local_weights())
                    meta.update(eval_accuracy=result.accuracy, eval_loss=result.loss)
                    scores[index] = (result.accuracy, result.loss)
                if flags.get("checkpoint"):
                    saved[index] = clients[index].state_dict()
                    meta["checkpointed"] = round_
                upload = Payload(meta=meta, tensors=upload.tensors)
                coordinator.check_upload(round_, index, upload)
                uploads[index] = upload
            return AttemptReport(uploads, {})

        for round_ in range(1 if resume is None else resume[0] + 1, last + 1):
            started = time.perf_counter()
            outcome = play_round(round_, policy, coordinator, run_attempt, ledger)
            entry: dict[str, Any] = {
                "round": round_,
                "seconds": time.perf_counter() - started,
                "train_loss": None if outcome.result is None else outcome.result.train_loss,
                "metrics": {} if outcome.result is None else dict(outcome.result.metrics),
                **_global_view(clients),
            }
            history.append(entry)
            if after_round is not None:
                after_round(round_, clients)
    finals = {index: client.local_weights() for index, client in clients.items()}
    mean = _mean_weights(list(finals.values()))
    if scores and len(scores) == count:
        accuracy = float(np.mean([a for a, _ in scores.values()]))
        loss = float(np.mean([v for _, v in scores.values()]))
    else:
        results = [evaluator.evaluate(w) for w in finals.values()]
        accuracy = float(np.mean([r.accuracy for r in results]))
        loss = float(np.mean([r.loss for r in results]))
    return DecentralizedResult(
        clients=finals,
        mean=mean,
        accuracy=accuracy,
        loss=loss,
        history=history,
        rounds_completed=last,
        network=network,
    )


def _global_view(clients: dict[int, PeerClientProtocol]) -> dict[str, float]:
    """The tracker residual and consensus distance, from every client's vectors."""
    vectors: list[dict[str, np.ndarray]] = [getattr(c, "vectors", dict)() for c in clients.values()]
    if not vectors or not all(vectors):
        return {}
    theta = np.stack([v["theta"].astype(np.float64) for v in vectors])
    gamma = np.stack([v["gamma"].astype(np.float64) for v in vectors])
    grad = np.stack([v["grad"].astype(np.float64) for v in vectors])
    mean = theta.mean(axis=0)
    return {
        "tracker_residual": float(np.max(np.abs(gamma.sum(axis=0) - grad.sum(axis=0)))),
        "consensus": float(np.max(np.linalg.norm(theta - mean, axis=1))),
    }


def _mean_weights(models: list[Weights]) -> Weights:
    return {
        name: np.mean([m[name].astype(np.float64) for m in models], axis=0).astype(
            models[0][name].dtype
        )
        for name in models[0]
    }

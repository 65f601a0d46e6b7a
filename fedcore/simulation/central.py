"""The simulation mode: a run's protocol maths in one process, no network and no processes.

It plays every round through the same round policy as the server role (``fedcore.rounds``:
sample, plan, attempt, settle, combine, record) and calls the protocol hooks in the same order
as the roles do (plan, compute each upload, check, combine, evaluate), so a run simulated here
ends with bit-identical weights to the same run over processes and mutual TLS whenever the
protocol's randomness is seeded by the spec (fedavg, fedsgd, and the DP protocols with their
secure randomness switched off). A client's upload that the server's check refuses counts as
that client's failure (``rejected``), as in the server role. Unit tests and large client
counts use it.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedcore.errors import MessageRejected, ProtocolError
from fedcore.learning.canary import CanaryClients
from fedcore.learning.data import (
    client_dataset,
    client_test_dataset,
    dataset_info,
    shard_sizes,
    test_dataset,
)
from fedcore.learning.evaluation import answer_meta, checked_answer, score, summed
from fedcore.learning.models import build_model, get_weights
from fedcore.learning.poisoning import attack_of, misreport_evaluation, overflow_upload
from fedcore.learning.training import EvalCounts, Evaluator, LocalLearner
from fedcore.local.threads import ROLE_THREADS, threads_limited
from fedcore.privacy import PrivacyLedger
from fedcore.protocols import (
    ClientProtocol,
    KdcProtocol,
    KeyChannel,
    RoundResult,
    Weights,
    create_protocol,
)
from fedcore.protocols._compressed import round_trip
from fedcore.rounds import AttemptReport, RoundPolicy, play_round, play_stages
from fedcore.spec import FederatedRun, FederatedRunSpec
from fedcore.transport import Identity, Payload, issue_run_bundles


@dataclass
class SimulationResult:
    """What a simulated run ends with.

    Attributes:
        weights: the final global model.
        accuracy: held-out accuracy of the final model.
        loss: held-out loss of the final model.
        history: one entry per round (participants, train_loss, epsilon, seconds).
        epsilon: the privacy spent, for protocols that claim DP (else None).
        epsilon_claim: what epsilon bounds (``PrivacyLedger.claim``; None without DP).
        rounds_completed: the rounds run (fewer than spec.rounds when the budget stopped it).
        reason: RoundsCompleted, or BudgetExhausted.
    """

    weights: Weights
    accuracy: float
    loss: float
    history: list[dict[str, Any]] = field(default_factory=list)
    epsilon: float | None = None
    epsilon_claim: dict[str, str] | None = None
    rounds_completed: int = 0
    reason: str = "RoundsCompleted"


class Observer:
    """Sees what the parties of a simulated run exchange, as they exchange it.

    ``simulate(run, observer=...)`` calls these hooks (all no-ops here) with the very objects
    the protocol hooks produced: an attacker (``fedcore.audit``) subclasses it to see exactly
    what the server, or a client, sees. Only the simulation calls it; the roles never do, so
    it costs the production path nothing. Observers must not mutate what they are given.
    """

    def on_round_start(self, round: int, clients: Sequence[int], weights: Weights) -> None:
        """A round begins: the sampled clients and the server's global model before it."""

    def on_instruction(self, round: int, client: int, instruction: Payload) -> None:
        """The server planned ``instruction`` for ``client`` (what that client receives)."""

    def on_keys(self, round: int, party: Identity, keys: Payload) -> None:
        """The KDC issued ``keys`` to ``party`` for the round."""

    def on_upload(self, round: int, client: int, upload: Payload) -> None:
        """``client`` uploaded ``upload`` (what the server receives)."""

    def on_stage(
        self, round: int, stage: int, client: int, instruction: Payload, response: Payload
    ) -> None:
        """A later stage of a multi-stage protocol: the server sent ``client`` ``instruction``
        and received ``response``."""

    def on_round_end(self, round: int, result: RoundResult | None, weights: Weights) -> None:
        """The server combined the round; ``weights`` is its global model after it."""

    def on_exchange(self, party: Identity, request: Payload, answer: Payload) -> None:
        """``party`` handed the KDC ``request`` through its key channel; ``answer`` came back."""

    def on_peer_message(self, sender: int, receiver: int, tag: str, message: Payload) -> None:
        """Decentralized protocols: ``sender`` sent ``receiver`` ``message`` under ``tag`` (shown
        after the run, in sending order, every message of every round)."""


class LocalKeyChannel(KeyChannel):
    """A party's channel to a KDC side in the same process (shown to ``observer``, if any)."""

    def __init__(self, kdc: KdcProtocol, party: Identity, observer: Observer | None = None) -> None:
        self._kdc = kdc
        self._party = party
        self._observer = observer

    def submit(self, payload: Payload) -> Payload:
        answer = self._kdc.accept(self._party, payload)
        if self._observer is not None:
            self._observer.on_exchange(self._party, payload, answer)
        return answer


def simulate(
    run: FederatedRun,
    *,
    rounds: int | None = None,
    observer: Observer | None = None,
    threads: int = ROLE_THREADS,
    drops: Mapping[tuple[int, int], Collection[int]] | None = None,
    canaries: CanaryClients | None = None,
) -> SimulationResult:
    """Runs ``run`` (or its first ``rounds`` rounds) in this process and returns the result.

    ``observer``, if given, is shown every instruction, key issue and upload as it happens.
    The maths runs at ``threads`` torch and BLAS threads (restored afterwards): at the role
    processes' count, the result equals ``fedcore run``'s bit for bit (``fedcore.local.threads``).
    ``drops`` makes clients drop out: ``{(round, stage): clients}``, each of them fails that
    stage of the round's first attempt (``disconnected``), as a client killed between two
    stages does. ``canaries`` (the canary audit's) are the run's last clients: from
    ``canaries.first`` on, ``spec.clients.count`` counts them, they hold no data and each
    reports its fixed direction (``fedcore.learning.canary``); the data is split among the
    first ``canaries.first`` clients as without them, and only those evaluate.
    """
    with threads_limited(threads):
        return _simulate(
            run, rounds=rounds, observer=observer, drops=drops or {}, canaries=canaries
        )


def without_canaries(spec: FederatedRunSpec, canaries: CanaryClients) -> FederatedRunSpec:
    """``spec`` with only the run's own clients (whose data split the canaries do not change)."""
    own = spec.clients.model_copy(update={"count": canaries.first})
    return spec.model_copy(update={"clients": own})


def federated_evaluation(spec: FederatedRunSpec, models: list[Weights]) -> EvalCounts:
    """The clients' evaluation of ``models`` as the server role sums it: every client scores
    them on its own held-out examples (the model with the lowest loss there, when several),
    and the counts are added."""
    per_class = spec.evaluation.per_class
    answers = []
    for index in range(spec.clients.count):
        test = client_test_dataset(spec, index)
        model = build_model(spec.model, test.input_shape, test.num_classes, seed=spec.seed)
        evaluator = Evaluator(model, test, spec.training, allow_empty=True)
        answer = answer_meta(score(evaluator, models, per_class))
        if attack_of(spec, index) == "MisreportEvaluation":
            answer = misreport_evaluation(answer)
        try:  # as the server role checks each answer, refusing a malformed one
            answers.append(checked_answer(answer, test.num_classes, per_class))
        except MessageRejected:
            continue
    return summed(answers).counts


def _simulate(
    run: FederatedRun,
    *,
    rounds: int | None,
    observer: Observer | None,
    drops: Mapping[tuple[int, int], Collection[int]],
    canaries: CanaryClients | None,
) -> SimulationResult:
    spec = run.spec
    data_spec = spec if canaries is None else without_canaries(spec, canaries)
    protocol = create_protocol(spec.protocol.name)
    if protocol.facts.decentralized:  # no server model: clients step with their peers
        if canaries is not None:
            raise ProtocolError(
                f"Protocol {spec.protocol.name!r} is decentralized: its clients' updates never "
                "reach one model that a canary could move."
            )
        from fedcore.simulation.peer import simulate_decentralized

        peers = simulate_decentralized(run, rounds=rounds, record=observer is not None)
        if observer is not None and peers.network is not None:
            for sender, receiver, tag, message in peers.network.messages:
                observer.on_peer_message(sender, receiver, tag, message)
        return SimulationResult(
            weights=peers.mean,
            accuracy=peers.accuracy,
            loss=peers.loss,
            history=peers.history,
            rounds_completed=peers.rounds_completed,
        )
    input_shape, num_classes = dataset_info(spec)
    model = build_model(spec.model, input_shape, num_classes, seed=spec.seed)
    server = protocol.create_server(spec, get_weights(model))
    sizes = shard_sizes(data_spec)
    if canaries is not None and sizes is not None:
        sizes = (*sizes, *[canaries.examples] * canaries.count)
    server.set_shard_sizes(sizes)
    evaluator = (
        Evaluator(model, test_dataset(spec), spec.training)
        if spec.evaluation_where != "Clients"
        else None
    )
    kdc = protocol.create_kdc(spec)
    server.setup(
        LocalKeyChannel(kdc, Identity("server"), observer)
        if kdc is not None and protocol.facts.server_uses_kdc
        else None
    )
    # Every client is set up before the first round, as every client process is before it
    # takes a task: a KDC may need all of them registered (e.g. public keys) to serve any.
    clients: dict[int, ClientProtocol] = {}
    for index in range(spec.clients.count):
        clients[index] = protocol.create_client(spec, index)
        clients[index].setup(
            None if kdc is None else LocalKeyChannel(kdc, Identity("client", index), observer)
        )
    if any(client.needs_identity for client in clients.values()):
        # Protocols that sign what they send get identities of an in-memory CA, as the roles'.
        _, bundles = issue_run_bundles("simulation", num_clients=spec.clients.count)
        for index, client in clients.items():
            client.set_identity(bundles[Identity("client", index).common_name])
    learners: dict[int, LocalLearner] = {}

    def learner(index: int) -> LocalLearner:
        if index not in learners and canaries is not None and index >= canaries.first:
            canary_model = build_model(spec.model, input_shape, num_classes, seed=spec.seed)
            learners[index] = canaries.learner(
                index, canary_model, spec.training, input_shape, num_classes
            )
        if index not in learners:
            data = client_dataset(data_spec, index)
            client_model = build_model(
                spec.model, data.input_shape, data.num_classes, seed=spec.seed
            )
            learners[index] = LocalLearner(
                client_model, data, spec.training, seed=spec.seed, client_index=index
            )
        return learners[index]

    compression = spec.transport.compression

    def run_stage(
        round_: int, number: int, stage: int, plans: Mapping[int, Payload]
    ) -> AttemptReport:
        dropped = set(drops.get((round_, stage), ())) if number == 1 else set()
        if stage == 0:
            return run_first_stage(round_, number, plans, dropped)
        responses: dict[int, Payload] = {}
        failed: dict[int, str] = {}
        for index, instruction in plans.items():
            if index in dropped:
                failed[index] = "disconnected"
                continue
            try:
                response = clients[index].respond(round_, stage, instruction)
            except ProtocolError as exc:  # as the client role declines
                response = Payload(meta={"declined": str(exc)[:1000]})
            if observer is not None:
                observer.on_stage(round_, stage, index, instruction, response)
            try:
                server.check_upload(round_, index, response)
            except ProtocolError:
                failed[index] = "rejected"
                continue
            responses[index] = response
        return AttemptReport(responses, failed)

    def run_attempt(round_: int, number: int, plans: Mapping[int, Payload]) -> AttemptReport:
        return play_stages(server, round_, number, plans, run_stage)

    def run_first_stage(
        round_: int, number: int, plans: Mapping[int, Payload], dropped: set[int]
    ) -> AttemptReport:
        uploads: dict[int, Payload] = {}
        failed: dict[int, str] = {}
        received: dict[int, Payload] = {}  # each plan as its clients get it, made once
        for index, plan in plans.items():
            if index in dropped:
                failed[index] = "disconnected"
                continue
            instruction = plan
            if compression.broadcasts != "None":
                instruction = received.get(id(plan)) or Payload(
                    meta=plan.meta,
                    tensors=round_trip(
                        spec, "broadcasts", plan.tensors, round=round_, attempt=number
                    ),
                )
                received[id(plan)] = instruction
            if observer is not None:
                observer.on_instruction(round_, index, instruction)
            keys = None
            if kdc is not None:
                keys = clients[index].reusable_keys(round_, instruction) or kdc.issue_keys(
                    round_, Identity("client", index)
                )
            if observer is not None and keys is not None:
                observer.on_keys(round_, Identity("client", index), keys)
            upload = clients[index].compute_upload(round_, instruction, learner(index), keys)
            if attack_of(spec, index) == "Overflow":  # as the client role applies it
                upload = overflow_upload(upload)
            if compression.uploads != "None":  # what the server receives of it
                tensors = round_trip(
                    spec, "uploads", upload.tensors, round=round_, attempt=number, client=index
                )
                upload = Payload(meta=upload.meta, tensors=tensors)
            if observer is not None:
                observer.on_upload(round_, index, upload)
            try:
                server.check_upload(round_, index, upload)
            except ProtocolError:  # refused as the server role refuses it
                failed[index] = "rejected"
                continue
            uploads[index] = upload
        return AttemptReport(uploads, failed)

    def on_sample(round_: int, sampled: list[int]) -> None:
        if observer is not None:
            observer.on_round_start(round_, sampled, server.global_weights())

    policy = RoundPolicy(spec, protocol.facts)
    history: list[dict[str, Any]] = []
    last = spec.rounds if rounds is None else rounds
    ledger = PrivacyLedger(spec, protocol.noise_multiplier(spec))
    reason = "RoundsCompleted"
    completed = 0
    for round_ in range(1, last + 1):
        if policy.budget_stop(round_, ledger) is not None:
            reason = "BudgetExhausted"
            break
        started = time.perf_counter()
        outcome = play_round(round_, policy, server, run_attempt, ledger, on_sample=on_sample)
        result = outcome.result
        if observer is not None:
            observer.on_round_end(round_, result, server.global_weights())
        completed = round_
        entry: dict[str, Any] = {
            "round": round_,
            "seconds": time.perf_counter() - started,
            "participants": outcome.participants,
            "train_loss": None if result is None else result.train_loss,
            "epsilon": outcome.epsilon,
        }
        history.append(entry)
    if spec.evaluation_where == "Server":
        assert evaluator is not None
        final = evaluator.evaluate_models(server.models(), spec.data.clusters.count)
    else:  # each client scores the models on its own held-out examples; counts are summed
        final = federated_evaluation(data_spec, server.models()).result()
    return SimulationResult(
        weights=server.global_weights(),
        accuracy=final.accuracy,
        loss=final.loss,
        history=history,
        epsilon=ledger.epsilon(),
        epsilon_claim=ledger.claim() or None,
        rounds_completed=completed,
        reason=reason,
    )

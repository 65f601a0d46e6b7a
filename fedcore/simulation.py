"""The simulation mode: a run's protocol maths in one process, no network and no processes.

It calls the same protocol hooks in the same order as the roles do (sample, plan, compute each
upload, check, combine, evaluate), so a run simulated here ends with bit-identical weights to
the same run over processes and mutual TLS whenever the protocol's randomness is seeded by the
spec (fedavg, fedsgd, and the DP protocols with their secure randomness switched off). Unit
tests and large client counts use it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fedcore.data import client_dataset, dataset_info, test_dataset
from fedcore.models import build_model, get_weights
from fedcore.privacy import PrivacyLedger
from fedcore.protocols import (
    ClientProtocol,
    KdcProtocol,
    KeyChannel,
    Weights,
    create_protocol,
)
from fedcore.sampling import sample_clients
from fedcore.spec import FederatedRun
from fedcore.training import Evaluator, LocalLearner
from fedcore.transport import Identity, Payload


@dataclass
class SimulationResult:
    """What a simulated run ends with.

    Attributes:
        weights: the final global model.
        accuracy: held-out accuracy of the final model.
        loss: held-out loss of the final model.
        history: one entry per round (participants, train_loss, epsilon, seconds).
        epsilon: the privacy spent, for protocols that claim DP (else None).
        rounds_completed: the rounds run (fewer than spec.rounds when the budget stopped it).
        reason: RoundsCompleted, or BudgetExhausted.
    """

    weights: Weights
    accuracy: float
    loss: float
    history: list[dict[str, Any]] = field(default_factory=list)
    epsilon: float | None = None
    rounds_completed: int = 0
    reason: str = "RoundsCompleted"


class LocalKeyChannel(KeyChannel):
    """A client protocol's channel to a KDC side in the same process."""

    def __init__(self, kdc: KdcProtocol, party: Identity) -> None:
        self._kdc = kdc
        self._party = party

    def submit(self, payload: Payload) -> Payload:
        return self._kdc.accept(self._party, payload)


def simulate(run: FederatedRun, *, rounds: int | None = None) -> SimulationResult:
    """Runs ``run`` (or its first ``rounds`` rounds) in this process and returns the result."""
    spec = run.spec
    protocol = create_protocol(spec.protocol.name)
    input_shape, num_classes = dataset_info(spec)
    model = build_model(spec.model, input_shape, num_classes, seed=spec.seed)
    server = protocol.create_server(spec, get_weights(model))
    evaluator = Evaluator(model, test_dataset(spec), spec.training)
    kdc = protocol.create_kdc(spec)
    # Every client is set up before the first round, as every client process is before it
    # takes a task: a KDC may need all of them registered (e.g. public keys) to serve any.
    clients: dict[int, ClientProtocol] = {}
    for index in range(spec.clients.count):
        clients[index] = protocol.create_client(spec, index)
        clients[index].setup(
            None if kdc is None else LocalKeyChannel(kdc, Identity("client", index))
        )
    learners: dict[int, LocalLearner] = {}
    history: list[dict[str, Any]] = []
    last = spec.rounds if rounds is None else rounds
    ledger = PrivacyLedger(spec, protocol.noise_multiplier(spec))
    reason = "RoundsCompleted"
    completed = 0
    for round_ in range(1, last + 1):
        if ledger.next_round_exceeds() is not None:
            reason = "BudgetExhausted"
            break
        started = time.perf_counter()
        sampled = sample_clients(spec.clients, seed=spec.seed, round=round_)
        uploads = {}
        for index, instruction in server.plan_round(round_, sampled).items():
            if index not in learners:
                data = client_dataset(spec, index)
                client_model = build_model(
                    spec.model, data.input_shape, data.num_classes, seed=spec.seed
                )
                learners[index] = LocalLearner(
                    client_model, data, spec.training, seed=spec.seed, client_index=index
                )
            keys = None if kdc is None else kdc.issue_keys(round_, Identity("client", index))
            upload = clients[index].compute_upload(round_, instruction, learners[index], keys)
            server.check_upload(round_, index, upload)
            uploads[index] = upload
        result = server.combine(round_, uploads, [])
        epsilon = ledger.record_round()
        completed = round_
        entry: dict[str, Any] = {
            "round": round_,
            "seconds": time.perf_counter() - started,
            "participants": len(uploads),
            "train_loss": None if result is None else result.train_loss,
            "epsilon": epsilon,
        }
        history.append(entry)
    final = evaluator.evaluate(server.global_weights())
    return SimulationResult(
        weights=server.global_weights(),
        accuracy=final.accuracy,
        loss=final.loss,
        history=history,
        epsilon=ledger.epsilon(),
        rounds_completed=completed,
        reason=reason,
    )

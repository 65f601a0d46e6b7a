"""The attack interface, what an attack is given (``AuditContext``) and what it returns.

An attack sits in one party's seat (``view``: the server, a client) and sees exactly what that
party sees in the simulated run: the ``Recording`` keeps the instructions, uploads and key
issues of the rounds the audit looks at. To audit a new protocol's known leak (EBS-CFL's
eigenvalue and subspace leaks, LPPA's neighbour attack), subclass ``Attack``, name the
protocols it applies to, and ``register_attack`` it; if the protocol's messages are not the
model's own tensors, register a ``ProtocolView`` for it too (``fedcore.audit._views``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedcore.audit._metrics import Estimate
from fedcore.audit._views import ProtocolView
from fedcore.learning.data import (
    ArrayDataset,
    client_dataset,
    client_test_dataset,
    test_dataset,
)
from fedcore.protocols import RoundResult, Weights
from fedcore.simulation import Observer, SimulationResult
from fedcore.spec import FederatedRun, FederatedRunSpec
from fedcore.transport import Identity, Payload


@dataclass(frozen=True)
class Budget:
    """How hard the attacks try (the defaults run in seconds on a small MLP).

    Attributes:
        dlg_iterations: L-BFGS iterations of DLG.
        ig_iterations: Adam steps of inverting gradients.
        restarts: DLG attempts from fresh dummies on uploads of at most 8 examples (the
            best gradient match is kept).
        victims: uploads attacked per attacked round (server view).
        max_batch: the largest upload (in examples) the inversions attack.
        shadow_models: shadow models of the shadow membership attack.
        mi_samples: members and non-members each scored by membership inference (at most).
    """

    dlg_iterations: int = 60
    ig_iterations: int = 200
    restarts: int = 2
    victims: int = 2
    max_batch: int = 256
    shadow_models: int = 2
    mi_samples: int = 300


class Recording(Observer):
    """What the parties of a simulated run exchanged, for the rounds in ``keep``.

    Attributes:
        participants: the sampled clients of every round.
        instructions: per kept round, what each client received.
        uploads: per kept round, what each client uploaded (a multi-stage protocol: its
            stage-0 answer).
        stages: multi-stage protocols (secagg), per kept round: for each (stage, client) of
            the later stages (1, 2, ...), the (instruction, response) the server sent that
            client and received from it; a round that is redone keeps its last attempt's (a
            client's entries go when it is handed a new attempt's stage-0 instruction).
        keys: per kept round, what the KDC issued to each party.
        exchanges: per round (0: set-up), each (party, request, answer) a party had with the
            KDC through its key channel (e.g. a server that fetches keys per upload).
        peers: decentralized protocols, per kept round: every peer message as (sender,
            receiver, kind, message). ``instructions[t][k]`` then holds what client k received
            in round t and ``uploads[t][k]`` what it sent, each tensor named
            ``<peer>/<kind>/<name>`` (``peer_tensor``).
        before: per kept round, the server's global model before it.
        after: per kept round, the server's global model after it.
    """

    def __init__(self, keep: set[int]) -> None:
        self.keep = keep
        self.participants: dict[int, list[int]] = {}
        self.instructions: dict[int, dict[int, Payload]] = {}
        self.uploads: dict[int, dict[int, Payload]] = {}
        self.stages: dict[int, dict[tuple[int, int], tuple[Payload, Payload]]] = {}
        self.keys: dict[int, dict[str, Payload]] = {}
        self.exchanges: dict[int, list[tuple[str, Payload, Payload]]] = {}
        self.peers: dict[int, list[tuple[int, int, str, Payload]]] = {}
        self._round = 0
        self.before: dict[int, Weights] = {}
        self.after: dict[int, Weights] = {}

    def on_round_start(self, round: int, clients: Sequence[int], weights: Weights) -> None:
        self._round = round
        self.participants[round] = [int(k) for k in clients]
        if round in self.keep:
            self.before[round] = {n: np.array(w, copy=True) for n, w in weights.items()}

    def on_instruction(self, round: int, client: int, instruction: Payload) -> None:
        if round in self.keep:
            self.instructions.setdefault(round, {})[client] = instruction
            stages = self.stages.get(round, {})
            for key in [key for key in stages if key[1] == client]:
                del stages[key]  # an earlier attempt's

    def on_keys(self, round: int, party: Identity, keys: Payload) -> None:
        if round in self.keep:
            self.keys.setdefault(round, {})[party.common_name] = keys

    def on_upload(self, round: int, client: int, upload: Payload) -> None:
        if round in self.keep:
            self.uploads.setdefault(round, {})[client] = upload

    def on_stage(
        self, round: int, stage: int, client: int, instruction: Payload, response: Payload
    ) -> None:
        if round in self.keep:
            self.stages.setdefault(round, {})[(stage, client)] = (instruction, response)

    def on_round_end(self, round: int, result: RoundResult | None, weights: Weights) -> None:
        if round in self.keep:
            self.after[round] = {n: np.array(w, copy=True) for n, w in weights.items()}

    def on_exchange(self, party: Identity, request: Payload, answer: Payload) -> None:
        if self._round == 0 or self._round in self.keep:
            entry = (party.common_name, request, answer)
            self.exchanges.setdefault(self._round, []).append(entry)

    def on_peer_message(self, sender: int, receiver: int, tag: str, message: Payload) -> None:
        round_, kind = peer_round(tag)
        if round_ is None:
            return
        seen = self.participants.setdefault(round_, [])
        self.participants[round_] = sorted({*seen, sender, receiver})
        if round_ not in self.keep:
            return
        self.peers.setdefault(round_, []).append((sender, receiver, kind, message))
        received = self.instructions.setdefault(round_, {}).setdefault(receiver, Payload())
        sent = self.uploads.setdefault(round_, {}).setdefault(sender, Payload())
        for name, value in message.tensors.items():
            received.tensors[peer_tensor(sender, kind, name)] = value
            sent.tensors[peer_tensor(receiver, kind, name)] = value


def peer_round(tag: str) -> tuple[int | None, str]:
    """(round, kind) of a decentralized protocol's peer tag ``<epoch>/<round>/<kind>``; the
    round is None for a tag of another form."""
    parts = tag.split("/")
    if len(parts) < 3 or not parts[-2].isdigit():
        return None, tag
    return int(parts[-2]), parts[-1]


def peer_tensor(peer: int, kind: str, name: str) -> str:
    """The name a peer message's tensor gets in ``Recording.instructions`` (``peer``: the
    sender) or ``Recording.uploads`` (``peer``: the receiver)."""
    return f"{peer}/{kind}/{name}"


@dataclass
class AuditContext:
    """Everything an attack may draw on; each attack uses only its own party's part.

    Attributes:
        run: the audited manifest.
        recording: the messages of the kept rounds.
        view: how the protocol's messages read.
        attacker: the client index that plays the curious client.
        result: the simulated run's result (the server's final model and accuracy).
        seed: the attacker's own randomness.
        budget: how hard the attacks try.
        figures: the folder figures go to.
    """

    run: FederatedRun
    recording: Recording
    view: ProtocolView
    attacker: int
    result: SimulationResult
    seed: int
    budget: Budget
    figures: Path
    _shards: dict[int, ArrayDataset] = field(default_factory=dict, repr=False)

    @property
    def spec(self) -> FederatedRunSpec:
        """The run's spec."""
        return self.run.spec

    def rng(self, tag: int) -> np.random.Generator:
        """A generator for one attack's randomness, from the audit's seed and ``tag``."""
        return np.random.default_rng([self.seed, tag])

    def shard(self, client: int) -> ArrayDataset:
        """A client's training examples (its own data; the ground truth of attacks on it)."""
        if client not in self._shards:
            self._shards[client] = client_dataset(self.spec, client)
        return self._shards[client]

    def test(self) -> ArrayDataset:
        """Held-out examples no client trained on (non-members): the server's split, or with
        clients' own data the union of their held-out rows."""
        if self.spec.data.client_data is None:
            return test_dataset(self.spec)
        parts = [client_test_dataset(self.spec, c) for c in range(self.spec.clients.count)]
        return ArrayDataset(
            np.concatenate([part.x for part in parts]),
            np.concatenate([part.y for part in parts]),
            parts[0].num_classes,
        )

    def kept_rounds(self) -> list[int]:
        """The recorded rounds, ascending."""
        return sorted(self.recording.instructions)


@dataclass
class AttackResult:
    """What one attack measured.

    Attributes:
        attack: the attack's name.
        title: a short human title.
        view: whose seat it attacked from (``server``, ``client``).
        assumes: what the attacker is assumed to know or do.
        verdict: the estimate that decides "beats blind guessing", or None if skipped.
        estimates: every number measured, the verdict first.
        details: further numbers and settings (JSON-able).
        figures: figure files, relative to the report's folder.
        skipped: why it did not run (None if it ran).
    """

    attack: str
    title: str
    view: str
    assumes: str
    verdict: Estimate | None = None
    estimates: list[Estimate] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    figures: list[str] = field(default_factory=list)
    skipped: str | None = None

    def as_json(self) -> dict[str, Any]:
        """The result as a JSON-able dict."""
        return {
            "attack": self.attack,
            "title": self.title,
            "view": self.view,
            "assumes": self.assumes,
            "skipped": self.skipped,
            "beats_chance": None if self.verdict is None else self.verdict.beats_chance,
            "verdict": None if self.verdict is None else self.verdict.as_json(),
            "estimates": [e.as_json() for e in self.estimates],
            "details": self.details,
            "figures": self.figures,
        }


class Attack(ABC):
    """One attack: where it sits, what it assumes, when it applies, and how it runs."""

    name: str
    title: str
    view: str
    assumes: str
    protocols: frozenset[str] | None = None
    """The protocols it applies to (None: any protocol it can read)."""

    def skip_reason(self, ctx: AuditContext) -> str | None:
        """Why it cannot run on this audit's run, or None if it can."""
        if self.protocols is not None and ctx.spec.protocol.name not in self.protocols:
            return f"applies to {', '.join(sorted(self.protocols))} only"
        return ctx.view.skips.get(self.name)

    @abstractmethod
    def run(self, ctx: AuditContext) -> AttackResult:
        """Runs the attack and measures it."""

    def result(self, **kwargs: Any) -> AttackResult:
        """An AttackResult carrying this attack's identity."""
        return AttackResult(
            attack=self.name, title=self.title, view=self.view, assumes=self.assumes, **kwargs
        )


_ATTACKS: dict[str, Attack] = {}


def register_attack(attack: Attack) -> None:
    """Adds an attack (replacing one of the same name)."""
    _ATTACKS[attack.name] = attack


def registered_attacks() -> dict[str, Attack]:
    """The attacks by name, in registration order."""
    return dict(_ATTACKS)

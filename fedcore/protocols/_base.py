"""The protocol interface: one small ABC per side, only declarations with their contracts.

A protocol never sees a clock, socket, thread or process: the roles do all the plumbing
(fan-out, deadlines, dropouts, retries) and call these hooks. The same hooks run in one process
for unit tests and the simulation mode (``fedcore.simulation``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedcore.errors import ProtocolError
from fedcore.spec import FederatedRunSpec, ProtocolFacts
from fedcore.transport import Identity, Payload, TlsBundle

if TYPE_CHECKING:
    from fedcore.learning.training import LocalLearner

Weights = dict[str, np.ndarray]
"""A model's parameters by name, in the model's state_dict order."""


@dataclass(frozen=True)
class RoundResult:
    """What ``ServerProtocol.combine`` reports about a round it applied.

    Attributes:
        participants: how many uploads went into the new state.
        train_loss: the clients' mean local training loss (weighted as the protocol weighs).
        metrics: further protocol-specific numbers (JSON-able), e.g. a recovery residual.
        refused: uploads the protocol could judge only while combining (e.g. perturb's,
            once recovered) and left out of the new state, with the error that refused each,
            by client index; the server role counts and logs them as it does uploads refused
            on arrival.
    """

    participants: int
    train_loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    refused: dict[int, ProtocolError] = field(default_factory=dict)


class ServerProtocol(ABC):
    """The server side: plans each round and combines the uploads into the next state."""

    @abstractmethod
    def plan_round(self, round: int, clients: Sequence[int]) -> Mapping[int, Payload]:
        """Says what each sampled client receives this round.

        Args:
            round: the round number, from 1.
            clients: the indices of the clients sampled for this round, ascending.

        Returns:
            An instruction per client index; a client left out sits the round out.
        """

    @abstractmethod
    def check_upload(self, round: int, client: int, upload: Payload) -> None:
        """Checks one upload as it arrives, before it is accepted for the round.

        The server role calls it from its network threads while the round is open, one call
        at a time (never concurrently with another check), before ``combine``.

        Raises:
            ProtocolError: the upload is malformed (wrong tensors, shapes, counts, values);
                the role refuses it and counts the client as failed for the round.
        """

    def next_stage(
        self, round: int, stage: int, responses: Mapping[int, Payload], failures: Sequence[int]
    ) -> Mapping[int, Payload] | None:
        """After a stage of an attempt settled, says what the next stage asks (multi-stage
        protocols such as secure aggregation); None (the default): the attempt is over.

        Stage 0's instructions come from ``plan_round`` and its responses are the clients'
        uploads; a later stage's responses come from ``ClientProtocol.respond``. Each
        response is checked with ``check_upload`` as it arrives (the protocol knows which
        stage it is in). The attempt's report then holds the last stage's responses as its
        uploads and every stage's failures.

        Args:
            round: the round number, from 1.
            stage: the stage that settled, from 0.
            responses: the accepted responses of that stage, by client index.
            failures: the clients asked in that stage that did not respond.

        Returns:
            An instruction per client index for stage ``stage + 1``, or None.

        Raises:
            ProtocolError: the attempt cannot go on (e.g. fewer survivors than a threshold);
                nothing of it is combined, and the round policy redoes or aborts the round.
        """
        return None

    def take_upload(self, round: int, client: int, upload: Payload) -> Payload | None:
        """Optionally consumes a checked, accepted upload as it arrives (e.g. adds it into a
        running sum, so that its tensors need not be held until the round settles).

        The server role calls it after ``check_upload`` accepted the upload for the current
        attempt of ``plan_round``'s last plan, one call at a time. A taken upload is part of
        the attempt for good: ``combine`` then gets the returned stand-in (its meta) for it.
        The simulation never calls it: ``combine`` must give the same result either way.

        Returns:
            What the runtime keeps in the upload's place, or None (the default): the runtime
            keeps the whole upload for ``combine``.
        """
        return None

    @abstractmethod
    def combine(
        self, round: int, uploads: Mapping[int, Payload], failures: Sequence[int]
    ) -> RoundResult | None:
        """Combines a round's uploads into the next global state.

        Args:
            round: the round number, from 1.
            uploads: each responding client's upload, by client index.
            failures: the planned clients that did not upload (dropped, timed out, rejected).

        Returns:
            The round's result, or None to keep the previous state unchanged.

        Raises:
            ProtocolError: the uploads cannot be combined (e.g. a recovery check failed).
        """

    @abstractmethod
    def global_weights(self) -> Weights:
        """Returns the current global model, for evaluation and release (never mutated)."""

    def models(self) -> list[Weights]:
        """Returns every model the server keeps: one, or one per cluster (clustered protocols).

        The server evaluates each on the data clusters where its loss is lowest and releases
        all of them; the default is ``[global_weights()]``.
        """
        return [self.global_weights()]

    def set_shard_sizes(self, sizes: Sequence[int] | None) -> None:  # noqa: B027 - optional
        """Called by the runtime before the first round with each client's shard size, by
        index, where the server derives the partition from the spec (None where it cannot:
        each client reads its own data). A server that weighs by shard size then weighs by
        these, not by what a client claims; the default ignores them.
        """

    def keep_uploads_on_disk(self, folder: Path) -> None:  # noqa: B027 - optional
        """Called by the runtime before the first round where the run keeps its uploads on
        disk (``spec.uploads.storage``): a server that holds uploads, or their sum, until it
        combines them keeps them in files inside ``folder`` instead, with the same result.
        The default ignores it.
        """

    def setup(self, kdc: KeyChannel | None) -> None:  # noqa: B027 - an optional hook
        """Called once before the first round (again after a restart, after any restore).

        Args:
            kdc: the server's own channel to the KDC for protocols whose facts say
                ``server_uses_kdc``, else None.
        """

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Returns the state an exact resume needs: JSON-able values and numpy arrays only."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores ``state_dict()``'s output.

        Raises:
            ValueError: a key is missing or the ``kind`` tag names another protocol.
        """


class KeyChannel(ABC):
    """What a client's protocol may send to the KDC (key material comes per round as ``keys``)."""

    @abstractmethod
    def submit(self, payload: Payload) -> Payload:
        """Hands the KDC something of this client's (e.g. a public key); returns its answer."""


class ClientProtocol(ABC):
    """The client side: computes an upload from what the server (and KDC) sent."""

    def keep_uploads_on_disk(self, folder: Path) -> None:  # noqa: B027 - optional
        """Called by the runtime before the first round where the run keeps its uploads on
        disk (``spec.uploads.storage``): a server that holds uploads, or their sum, until it
        combines them keeps them in files inside ``folder`` instead, with the same result.
        The default ignores it.
        """

    def setup(self, kdc: KeyChannel | None) -> None:  # noqa: B027 - an optional hook
        """Called once before this client's first task (again after a restart).

        Args:
            kdc: the channel to the KDC, or None for protocols without one.
        """

    needs_identity = False
    """Whether the protocol signs with the client's TLS identity (``set_identity``)."""

    def set_identity(self, tls: TlsBundle) -> None:  # noqa: B027 - an optional hook
        """Called before the first task (and after a certificate renewal) with this client's
        TLS bundle, for protocols that sign what they send (``needs_identity``)."""

    def reusable_keys(self, round: int, instruction: Payload) -> Payload | None:
        """Key material from an earlier round that still serves this one, or None to fetch.

        The runtime asks before each task and calls the KDC only on None (the default: every
        round fetches). A protocol whose keys outlive a round (mpdp's table of public keys)
        returns what it holds, and must return None whenever it could be stale in a way the
        server would not catch.
        """
        return None

    def after_upload(self, round: int) -> None:  # noqa: B027 - an optional hook
        """Called once the upload of ``round`` is on its way, before the next task arrives.

        A protocol can prepare here what its next upload needs that does not depend on the
        next model (mpdp draws the next round's masks), which takes that work off the next
        round's critical path. The default does nothing. Whatever is prepared must equal what
        ``compute_upload`` would compute itself, so a result never depends on this call.
        """

    def respond(self, round: int, stage: int, instruction: Payload) -> Payload:
        """Answers a later stage (``stage`` >= 1) of a multi-stage protocol's attempt.

        Raises:
            ProtocolError: the instruction is malformed, or asks what an honest client must
                refuse (the client then leaves the attempt); the default: this protocol has
                one stage.
        """
        raise ProtocolError(
            f"This protocol has one stage per round; the server asked for stage {stage}."
        )

    @abstractmethod
    def compute_upload(
        self, round: int, instruction: Payload, learner: LocalLearner, keys: Payload | None
    ) -> Payload:
        """Computes this client's upload for a round.

        Args:
            round: the round number, from 1.
            instruction: what the server planned for this client.
            learner: local training on this client's shard.
            keys: this round's key material from the KDC, or None without a KDC.

        Returns:
            The upload; its ``meta`` carries ``num_examples`` and ``loss``.
        """


class PeerChannel(ABC):
    """A client protocol's direct links to its neighbours on the run's peer graph.

    The role (or the simulation) provides it to decentralized protocols only; links are
    mutually authenticated, and a client accepts messages only from its in-neighbours.
    """

    @property
    @abstractmethod
    def index(self) -> int:
        """This client's index."""

    @abstractmethod
    def send(self, to: int, tag: str, payload: Payload) -> None:
        """Queues ``payload`` for out-neighbour ``to`` under ``tag`` (returns at once).

        Raises:
            PeerLost: the link to ``to`` is gone.
        """

    @abstractmethod
    def receive(self, sender: int, tag: str) -> Payload:
        """Blocks for the message in-neighbour ``sender`` sent under ``tag``.

        Raises:
            PeerLost: a neighbour went away, or nothing came within the round's deadline.
        """


class PeerClientProtocol(ClientProtocol):
    """The client side of a decentralized protocol: it holds the model, not the server.

    Its state lives on the client, so the role checkpoints it (each client its own), restores
    it when the coordinator resumes from an earlier round, and evaluates and releases its
    model; the server (a coordinator) never sees a tensor of it.
    """

    @abstractmethod
    def setup_peers(self, peers: PeerChannel) -> None:
        """Called once before the first task, with this client's links."""

    @abstractmethod
    def completed_round(self) -> int:
        """The last round this client's state includes (0: fresh)."""

    @abstractmethod
    def local_weights(self) -> Weights:
        """This client's current model (evaluated and released by the role)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The state an exact resume needs: JSON-able values and numpy arrays only."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restores ``state_dict()``'s output; None starts afresh (round 0).

        Raises:
            ValueError: the state is of another protocol or does not fit the model.
        """


class KdcProtocol(ABC):
    """The KDC side: generates key material and hands each party only its own."""

    @abstractmethod
    def issue_keys(self, round: int, party: Identity) -> Payload:
        """Returns the key material ``party`` may hold for ``round``.

        Raises:
            PermissionError: the party may not receive keys for this round.
        """

    def accept(self, party: Identity, payload: Payload) -> Payload:
        """Takes something a party hands the KDC (e.g. its public key); returns an answer.

        Raises:
            PermissionError: this KDC accepts nothing from ``party`` (the default).
        """
        raise PermissionError(f"This KDC accepts nothing from {party.common_name!r}.")

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Returns the KDC's state (checkpointed apart from the server's)."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores ``state_dict()``'s output."""


class Protocol(ABC):
    """A protocol: its facts and a factory for each side."""

    name: str

    @property
    def facts(self) -> ProtocolFacts:
        """The protocol's facts from the spec's table."""
        from fedcore.spec import protocol_facts

        return protocol_facts(self.name)

    @abstractmethod
    def create_server(self, spec: FederatedRunSpec, initial: Weights) -> ServerProtocol:
        """Returns the server side, starting from the ``initial`` global model."""

    @abstractmethod
    def create_client(self, spec: FederatedRunSpec, index: int) -> ClientProtocol:
        """Returns the client side of client ``index``."""

    def create_kdc(self, spec: FederatedRunSpec) -> KdcProtocol | None:
        """Returns the KDC side, or None for protocols without a KDC."""
        return None

    def noise_multiplier(self, spec: FederatedRunSpec) -> float | None:
        """Returns the Gaussian noise multiplier of one round, or None if the protocol claims
        no DP. The server role feeds it to the accountant once per round (with the client
        sampling rate); protocol code never touches the accountant."""
        return None


def check_state_kind(state: Mapping[str, Any], kind: str, keys: Sequence[str]) -> None:
    """Checks a protocol state's tag and keys.

    Raises:
        ValueError: naming the missing key or the mismatched kind.
    """
    if not state:
        raise ValueError(f"The {kind} state is empty.")
    found = state.get("kind")
    if found != kind:
        raise ValueError(f"The state is of kind {found!r}, not {kind!r}.")
    for key in keys:
        if key not in state:
            raise ValueError(f"The {kind} state has no key {key!r}.")

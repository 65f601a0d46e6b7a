"""One round, written once: the round policy that every runtime drives.

A round samples its clients, then makes attempts until one settles. In each attempt the
protocol plans an instruction per client, the runtime runs the attempt (the server role over
the network, ``fedcore.simulation`` in memory) and reports who uploaded and who failed, and the
policy settles it by the protocol's dropout policy and the run's failure policy:

- a failure under the ``Fail`` dropout policy aborts the run (``ClientLost``, or ``PeerLost``
  for a decentralized protocol);
- a quorum of uploads with no failure, or under ``Skip``, is combined;
- a quorum with failures under ``Redo`` runs the round again without the failed clients;
- fewer uploads than the quorum runs it again with every sampled client;
- an attempt that falls short after ``spec.failurePolicy.maxRoundRetries`` redos aborts the
  run (``QuorumLost``).

The protocol then combines the settled attempt's uploads and the privacy ledger records the
round. Before each round, the policy decides whether it runs at all: one that would take the
privacy spent over ``spec.privacy.targetEpsilon`` stops the run (``BudgetExhausted``).

``RoundPolicy`` decides from the spec and what it is told, nothing else (a ``Secret`` sample
is drawn from the OS CSPRNG, by design). ``play_round`` adds the protocol's and the ledger's
calls and takes the runtime's attempt as a function, so nothing here sees a clock, socket,
thread or process, and every branch is unit-tested without them (tests/unit/test_rounds.py).

Decentralized protocols (lppa) go through the same policy with their coordinator as the server
side: every client is sampled (their spec allows nothing else), their dropout policy is
``Fail``, and the coordinator's combine gathers the clients' scalars. What differs lives in
their runtime's attempt: clients step with their peers, and evaluate and checkpoint themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from fedcore.errors import ProtocolError, RunAborted
from fedcore.privacy import PrivacyLedger
from fedcore.privacy.sampling import sample_clients
from fedcore.protocols import RoundResult, ServerProtocol
from fedcore.spec import FederatedRunSpec, ProtocolFacts
from fedcore.transport import Payload

Action = Literal["combine", "redo", "abort"]


@dataclass(frozen=True)
class AttemptReport:
    """What the runtime reports of one attempt once it settled.

    Attributes:
        uploads: the accepted upload of each client that made one.
        failed: why each other planned client did not (``absent``, ``disconnected``,
            ``timeout``, ``rejected``, ...).
    """

    uploads: Mapping[int, Payload]
    failed: Mapping[int, str]

    @property
    def failures(self) -> list[int]:
        """The failed clients, ascending."""
        return sorted(self.failed)


@dataclass(frozen=True)
class Settlement:
    """The policy's verdict on an attempt.

    Attributes:
        action: ``combine`` its uploads, ``redo`` the round, or ``abort`` the run.
        clients: with ``redo``, whom the next attempt asks.
        reason: with ``abort``, the run's failure reason (``ClientLost``, ``PeerLost``,
            ``CheckpointInvalid`` for a peer that cannot restore its checkpoint, ``QuorumLost``).
        message: with ``abort``, what went wrong and what to do, for the user.
    """

    action: Action
    clients: tuple[int, ...] = ()
    reason: str = ""
    message: str = ""

    def error(self, round_: int) -> RunAborted:
        """The error that ends the run (``abort`` only)."""
        return RunAborted(self.message, reason=self.reason, round=round_)


@dataclass(frozen=True)
class BudgetStop:
    """Why a round does not run: it would spend ``epsilon_next``, over ``target``."""

    round: int
    epsilon_next: float
    target: float | None


@dataclass(frozen=True)
class RoundOutcome:
    """A round that was combined.

    Attributes:
        round: the round.
        sampled: the clients sampled for it.
        attempts: how many attempts it took (1: no redo).
        report: the attempt that was combined.
        result: what the protocol's combine returned.
        epsilon: the privacy spent after it (None for a protocol that claims no DP).
    """

    round: int
    sampled: tuple[int, ...]
    attempts: int
    report: AttemptReport
    result: RoundResult | None
    epsilon: float | None

    @property
    def participants(self) -> int:
        """How many clients' uploads were combined: the protocol's count where it combined
        the round (a multi-stage protocol may sum inputs from clients that missed a later
        stage), else the uploads of the settled attempt."""
        if self.result is not None:
            return self.result.participants
        return len(self.report.uploads)


class RoundPolicy:
    """Decides each round of one run: whom to sample, how to settle an attempt, whether to go on.

    Args:
        spec: the run's validated spec.
        facts: its protocol's facts (the dropout policy, whether it is decentralized).
    """

    def __init__(self, spec: FederatedRunSpec, facts: ProtocolFacts) -> None:
        self.spec = spec
        self.facts = facts

    @property
    def max_attempts(self) -> int:
        """Attempts a round may take: the first and ``spec.failurePolicy.maxRoundRetries``."""
        return self.spec.failure_policy.max_round_retries + 1

    @property
    def stop_on_failure(self) -> bool:
        """Whether an attempt is settled by its first failure (the ``Fail`` dropout policy):
        the runtime need not wait for the other clients."""
        return self.facts.dropout_policy == "Fail"

    def sample(self, round_: int) -> list[int]:
        """The clients of ``round_``, ascending (``fedcore.privacy.sampling``)."""
        return sample_clients(self.spec.clients, seed=self.spec.seed, round=round_)

    def quorum(self, sampled: Sequence[int]) -> int:
        """The uploads a round of ``sampled`` clients needs (``spec.clients.quorum``)."""
        return self.spec.clients.quorum_of(len(sampled))

    def budget_stop(self, round_: int, ledger: PrivacyLedger) -> BudgetStop | None:
        """Whether ``round_`` must not run because the privacy budget would be exceeded."""
        would_reach = ledger.next_round_exceeds()
        if would_reach is None:
            return None
        return BudgetStop(round_, would_reach, ledger.target)

    def settle(
        self, round_: int, attempt: int, sampled: Sequence[int], report: AttemptReport
    ) -> Settlement:
        """Settles attempt number ``attempt`` (from 1) of ``round_``, given its report."""
        failures = report.failures
        policy = self.facts.dropout_policy
        if failures and policy == "Fail":
            return self._lost(round_, report)
        if len(report.uploads) >= self.quorum(sampled):
            if not failures or policy == "Skip":
                return Settlement("combine")
            redo = tuple(sorted(report.uploads))  # Redo: again, without the failed clients
        else:
            redo = tuple(sampled)
        if attempt >= self.max_attempts:
            return Settlement(
                "abort",
                reason="QuorumLost",
                message=(
                    f"Round {round_} got fewer than its quorum of {self.quorum(sampled)} "
                    f"uploads after {self.max_attempts} attempts (spec.clients.quorum, "
                    f"spec.failurePolicy.maxRoundRetries)."
                ),
            )
        return Settlement("redo", clients=redo)

    def _lost(self, round_: int, report: AttemptReport) -> Settlement:
        """The verdict on a failure under the ``Fail`` dropout policy."""
        # A client that said why it failed comes first; then, when it did, only who lost a
        # peer after it (their words repeat its loss); then every other failure.
        order = sorted(report.failed.items(), key=lambda item: (_rank(item[1]), item[0]))
        cause = any(_rank(why) == 0 for _, why in order)
        peers = [k for k, why in order if cause and _rank(why) == 1]
        lost = ", ".join(
            [f"client {k} ({why})" for k, why in order if k not in peers]
            + ([f"{_clients(peers)} (lost a peer link after it)"] if peers else [])
        )
        name = self.spec.protocol.name
        if self.facts.decentralized:
            said = [k for k, why in order if _rank(why) == 0]
            then = (
                f"Once what {_clients(said)} reported is fixed, `fedcore run --resume`"
                if said
                else "`fedcore run --resume`"
            )
            # A client that cannot restore its checkpoint would fail the same way after any
            # restart: the run says so (a reason the operator does not retry).
            unreadable = any(
                report.failed[k].startswith(said_failure("CheckpointInvalid", "")) for k in said
            )
            if unreadable:
                then = (
                    f"Restarting would read the same checkpoint (`fedcore checkpoint list "
                    f"--verify` checks every client's with its own key). {then}"
                )
            return Settlement(
                "abort",
                reason="CheckpointInvalid" if unreadable else "PeerLost",
                message=(
                    f"Round {round_} lost {lost}. Protocol {name!r} runs on a fixed peer graph: "
                    f"every neighbour's state holds noise and mixing weights that assume the "
                    f"lost client, so the run stops (it does not go on without it). {then} "
                    f"restarts every client from its checkpoint of the latest round they all "
                    f"saved."
                ),
            )
        return Settlement(
            "abort",
            reason="ClientLost",
            message=f"Round {round_} lost {lost}; protocol {name!r} cannot go on without a client.",
        )


def _clients(indexes: Sequence[int]) -> str:
    """``client 3`` or ``clients 0, 1, 4``."""
    return f"client{'s' if len(indexes) > 1 else ''} {', '.join(map(str, indexes))}"


SAID_PREFIX = "failed: "
"""Begins the failure of a client that said why it left (``said_failure``)."""


def said_failure(reason: str, text: str) -> str:
    """An attempt's failure for a client that said why it left: ``failed: <reason>: <text>``
    (``reason`` the kind of its error, ``PeerLost`` when it lost a peer)."""
    return f"{SAID_PREFIX}{reason}: {text}"


def _rank(why: str) -> int:
    """How near a failure is to its cause: 0 for a client that reported its own failure
    (``said_failure``), 1 for one that reported losing a peer, 2 for any other."""
    if not why.startswith(SAID_PREFIX):
        return 2
    return 1 if why.startswith(said_failure("PeerLost", "")) else 0


RunStage = Callable[[int, int, int, Mapping[int, Payload]], AttemptReport]
"""The runtime's stage of an attempt: ``(round, attempt, stage from 0, each client's
instruction)`` to the responses that came back and who failed."""


def play_stages(
    server: ServerProtocol,
    round_: int,
    attempt: int,
    plans: Mapping[int, Payload],
    run_stage: RunStage,
) -> AttemptReport:
    """Plays an attempt's stages: stage 0 from ``plans``, then each that the protocol's
    ``next_stage`` asks (one stage for most protocols). Returns the last stage's responses as
    the uploads and every stage's failures; a protocol that cannot go on (``ProtocolError``
    from ``next_stage``) fails the attempt: no uploads, and each client still in it failed
    with the reason, so the policy redoes or aborts the round."""
    failed: dict[int, str] = {}
    stage = 0
    while True:
        report = run_stage(round_, attempt, stage, plans)
        failed.update(report.failed)
        try:
            following = server.next_stage(round_, stage, report.uploads, report.failures)
        except ProtocolError as exc:
            why = f"stage {stage} failed: {exc}"
            failed.update(dict.fromkeys(report.uploads, why))
            return AttemptReport({}, failed)
        if following is None:
            return AttemptReport(report.uploads, failed)
        plans = following
        stage += 1


RunAttempt = Callable[[int, int, Mapping[int, Payload]], AttemptReport]
"""The runtime's attempt: ``(round, attempt number from 1, each client's instruction)`` to
what came back. A redo (attempt > 1) exists to reach the quorum: the server role's waits for
dropped clients to reconnect."""


def play_round(
    round_: int,
    policy: RoundPolicy,
    server: ServerProtocol,
    run_attempt: RunAttempt,
    ledger: PrivacyLedger,
    *,
    on_sample: Callable[[int, list[int]], None] | None = None,
) -> RoundOutcome:
    """Plays ``round_``: sample, then plan and attempt until the policy settles; combine and
    record the round in ``ledger``.

    ``on_sample``, if given, is called with the round and its sampled clients before the first
    plan.

    Raises:
        RunAborted: the policy aborted the run (``ClientLost``, ``PeerLost``, ``QuorumLost``).
        ProtocolError: the protocol's plan or combine failed.
    """
    sampled = policy.sample(round_)
    if on_sample is not None:
        on_sample(round_, sampled)
    clients = sampled
    for attempt in range(1, policy.max_attempts + 1):
        report = run_attempt(round_, attempt, server.plan_round(round_, clients))
        settlement = policy.settle(round_, attempt, sampled, report)
        if settlement.action == "abort":
            raise settlement.error(round_)
        if settlement.action == "combine":
            result = server.combine(round_, report.uploads, report.failures)
            epsilon = ledger.record_round()
            return RoundOutcome(round_, tuple(sampled), attempt, report, result, epsilon)
        clients = list(settlement.clients)
    raise AssertionError("unreachable: the policy aborts a round's last attempt")

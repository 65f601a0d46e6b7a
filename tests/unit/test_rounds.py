"""The round policy alone (fedcore.rounds): every branch, with no process, socket or clock.

The server side is a recording stand-in (pure logic: the policy only calls plan and combine),
the attempts are scripted reports, and the ledger is the real one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from fedcore.errors import RunAborted
from fedcore.privacy import PrivacyLedger
from fedcore.privacy.sampling import sample_clients
from fedcore.protocols import RoundResult, ServerProtocol, Weights
from fedcore.rounds import AttemptReport, RoundPolicy, play_round
from fedcore.spec import DropoutPolicy, FederatedRunSpec, load_manifest, protocol_facts
from fedcore.transport import Payload

MANIFEST = """
apiVersion: fedcore.dev/v1alpha1
kind: FederatedRun
metadata: {name: rounds}
spec:
  protocol: %(protocol)s
  model: {kind: MLP, hidden: [8]}
  data: {source: {kind: Digits}}
  clients: {count: 10, perRound: %(per_round)s, quorum: %(quorum)s}
  rounds: 20
  failurePolicy: {maxRoundRetries: %(retries)d}
  %(privacy)s
"""
FEDAVG = "{name: fedavg}"
DP_FEDAVG = "{name: dp-fedavg, dpFedavg: {clippingNorm: 1.0, noiseMultiplier: 1.1}}"


def spec_of(
    *,
    protocol: str = FEDAVG,
    per_round: str = '"50%"',
    quorum: str = '"60%"',
    retries: int = 2,
    privacy: str = "",
) -> FederatedRunSpec:
    text = MANIFEST % {
        "protocol": protocol,
        "per_round": per_round,
        "quorum": quorum,
        "retries": retries,
        "privacy": privacy,
    }
    return load_manifest("rounds", text=text).spec


def policy_of(
    spec: FederatedRunSpec, dropout: DropoutPolicy = "Skip", *, decentralized: bool = False
) -> RoundPolicy:
    facts = dataclasses.replace(
        protocol_facts(spec.protocol.name), dropout_policy=dropout, decentralized=decentralized
    )
    return RoundPolicy(spec, facts)


class RecordingServer(ServerProtocol):
    """Plans one empty instruction per client and records every plan and combine."""

    def __init__(self) -> None:
        self.plans: list[tuple[int, list[int]]] = []
        self.combined: list[tuple[int, list[int], list[int]]] = []

    def plan_round(self, round: int, clients: Sequence[int]) -> Mapping[int, Payload]:
        self.plans.append((round, list(clients)))
        return {client: Payload(meta={"round": round}) for client in clients}

    def combine(
        self, round: int, uploads: Mapping[int, Payload], failures: Sequence[int]
    ) -> RoundResult | None:
        self.combined.append((round, sorted(uploads), list(failures)))
        return RoundResult(participants=len(uploads), train_loss=float(len(uploads)))

    def check_upload(self, round: int, client: int, upload: Payload) -> None:
        raise AssertionError("the policy never checks an upload: the runtime does")

    def global_weights(self) -> Weights:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


def scripted(*failing: dict[int, str]):  # type: ignore[no-untyped-def]
    """An attempt function whose n-th attempt fails the clients in ``failing[n-1]`` (the last
    entry repeats) and uploads from every other planned client; records (round, number)."""
    calls: list[tuple[int, int]] = []

    def run_attempt(round_: int, number: int, plans: Mapping[int, Payload]) -> AttemptReport:
        calls.append((round_, number))
        failed = {k: v for k, v in failing[min(number, len(failing)) - 1].items() if k in plans}
        uploads = {k: Payload(meta={"from": k}) for k in plans if k not in failed}
        return AttemptReport(uploads, failed)

    run_attempt.calls = calls  # type: ignore[attr-defined]
    return run_attempt


def ledger_of(spec: FederatedRunSpec) -> PrivacyLedger:
    noise = spec.protocol.dp_fedavg.noise_multiplier if spec.protocol.name == "dp-fedavg" else None
    return PrivacyLedger(spec, noise)


def test_the_sample_is_the_seeded_one_and_the_same_on_every_call() -> None:
    # Prepare
    spec = spec_of()
    policy = policy_of(spec)
    # Execute
    samples = [policy.sample(round_) for round_ in (1, 2, 1)]
    # Assert: 5 of 10, from (seed, round), as sample_clients draws them.
    assert samples[0] == samples[2] == sample_clients(spec.clients, seed=spec.seed, round=1)
    assert len(samples[0]) == 5 and samples[0] != samples[1]
    assert policy.quorum(samples[0]) == 3


def test_a_quorum_with_no_failure_is_combined_at_the_first_attempt() -> None:
    # Prepare
    spec = spec_of()
    policy, server, attempt = policy_of(spec, "Redo"), RecordingServer(), scripted({})
    # Execute
    outcome = play_round(4, policy, server, attempt, ledger_of(spec))
    # Assert
    sampled = policy.sample(4)
    assert outcome.attempts == 1 and outcome.participants == 5
    assert outcome.sampled == tuple(sampled) and outcome.report.failures == []
    assert server.plans == [(4, sampled)]
    assert server.combined == [(4, sampled, [])]
    assert outcome.result == RoundResult(participants=5, train_loss=5.0)
    assert attempt.calls == [(4, 1)]
    assert outcome.epsilon is None  # fedavg claims no DP


def test_skip_combines_a_quorum_without_the_failed_clients() -> None:
    # Prepare: 2 of the 5 sampled fail; the quorum is 3.
    spec = spec_of()
    policy, server = policy_of(spec, "Skip"), RecordingServer()
    sampled = policy.sample(1)
    lost = {sampled[0]: "timeout", sampled[3]: "disconnected"}
    # Execute
    outcome = play_round(1, policy, server, scripted(lost), ledger_of(spec))
    # Assert
    kept = [c for c in sampled if c not in lost]
    assert outcome.attempts == 1
    assert server.combined == [(1, kept, sorted(lost))]
    assert outcome.report.failed == lost


def test_redo_runs_the_round_again_without_the_failed_clients() -> None:
    # Prepare: one client fails the first attempt, none the second.
    spec = spec_of()
    policy, server = policy_of(spec, "Redo"), RecordingServer()
    sampled = policy.sample(2)
    attempt = scripted({sampled[1]: "rejected"}, {})
    # Execute
    outcome = play_round(2, policy, server, attempt, ledger_of(spec))
    # Assert
    survivors = [c for c in sampled if c != sampled[1]]
    assert server.plans == [(2, sampled), (2, survivors)]
    assert server.combined == [(2, survivors, [])]
    assert outcome.attempts == 2 and attempt.calls == [(2, 1), (2, 2)]


def test_a_short_attempt_is_run_again_with_every_sampled_client() -> None:
    # Prepare: 3 of 5 fail the first attempt (2 uploads < quorum 3), none the second.
    spec = spec_of()
    policy, server = policy_of(spec, "Skip"), RecordingServer()
    sampled = policy.sample(3)
    attempt = scripted(dict.fromkeys(sampled[:3], "absent"), {})
    # Execute
    outcome = play_round(3, policy, server, attempt, ledger_of(spec))
    # Assert
    assert server.plans == [(3, sampled), (3, sampled)]
    assert server.combined == [(3, sampled, [])]
    assert outcome.attempts == 2


def test_a_quorum_never_reached_aborts_with_quorum_lost_after_every_retry() -> None:
    # Prepare: maxRoundRetries 2, so 3 attempts, each with 4 of 5 failing.
    spec = spec_of(retries=2)
    policy, server = policy_of(spec, "Redo"), RecordingServer()
    sampled = policy.sample(5)
    attempt = scripted(dict.fromkeys(sampled[1:], "timeout"))
    ledger = ledger_of(spec)
    # Execute
    with pytest.raises(RunAborted) as caught:
        play_round(5, policy, server, attempt, ledger)
    # Assert
    assert caught.value.reason == "QuorumLost" and caught.value.round == 5
    assert str(caught.value) == (
        "Round 5 got fewer than its quorum of 3 uploads after 3 attempts (spec.clients.quorum, "
        "spec.failurePolicy.maxRoundRetries)."
    )
    assert attempt.calls == [(5, 1), (5, 2), (5, 3)]
    assert server.combined == []


def test_redo_with_failures_on_its_last_attempt_aborts_with_quorum_lost() -> None:
    # Prepare: no retries allowed; a quorum came but a client failed under Redo.
    spec = spec_of(retries=0)
    policy, server = policy_of(spec, "Redo"), RecordingServer()
    sampled = policy.sample(1)
    # Execute
    with pytest.raises(RunAborted) as caught:
        play_round(1, policy, server, scripted({sampled[0]: "rejected"}), ledger_of(spec))
    # Assert
    assert caught.value.reason == "QuorumLost"
    assert server.combined == []


def test_fail_aborts_at_the_first_failure_naming_every_client_lost() -> None:
    # Prepare
    spec = spec_of()
    policy, server = policy_of(spec, "Fail"), RecordingServer()
    sampled = policy.sample(1)
    lost = {sampled[2]: "disconnected", sampled[0]: "timeout"}
    # Execute
    with pytest.raises(RunAborted) as caught:
        play_round(1, policy, server, scripted(lost), ledger_of(spec))
    # Assert
    assert policy.stop_on_failure
    assert caught.value.reason == "ClientLost"
    first, second = sorted(lost)
    assert str(caught.value) == (
        f"Round 1 lost client {first} ({lost[first]}), client {second} ({lost[second]}); "
        f"protocol 'fedavg' cannot go on without a client."
    )
    assert server.combined == []


def test_fail_in_a_decentralized_protocol_is_peer_lost_with_the_resume_hint() -> None:
    # Prepare
    spec = spec_of(per_round='"100%"')
    policy = policy_of(spec, "Fail", decentralized=True)
    # Execute
    with pytest.raises(RunAborted) as caught:
        play_round(7, policy, RecordingServer(), scripted({3: "disconnected"}), ledger_of(spec))
    # Assert
    assert caught.value.reason == "PeerLost" and caught.value.round == 7
    assert str(caught.value).startswith("Round 7 lost client 3 (disconnected). Protocol 'fedavg'")
    assert "`fedcore run --resume` restarts every client" in str(caught.value)


def test_peer_lost_names_the_client_that_reported_its_own_failure_first() -> None:
    # Prepare: client 5 could not restore its checkpoint; its neighbours 4 and 6 reported
    # losing it, client 0 just went.
    spec = spec_of(per_round='"100%"')
    policy = policy_of(spec, "Fail", decentralized=True)
    failed = {
        0: "disconnected",
        4: "failed: PeerLost: Client 4 lost its neighbour client 5",
        5: "failed: CheckpointError: Client 5 cannot read its checkpoint of round 6",
        6: "failed: PeerLost: Client 6 lost its neighbour client 5",
    }
    # Execute
    with pytest.raises(RunAborted) as caught:
        play_round(7, policy, RecordingServer(), scripted(failed), ledger_of(spec))
    # Assert: the cause, then the rest, then who lost it (once: their words repeat the
    # cause's loss); the hint says to fix the cause.
    text = str(caught.value)
    assert text.startswith(
        f"Round 7 lost client 5 ({failed[5]}), client 0 (disconnected), clients 4, 6 (lost a "
        f"peer link after it). "
    )
    assert "Once what client 5 reported is fixed, `fedcore run --resume` restarts" in text
    assert caught.value.reason == "PeerLost"
    # Without a cause, each loss is said in full.
    alone = {4: failed[4], 6: failed[6]}
    with pytest.raises(RunAborted) as caught:
        play_round(7, policy, RecordingServer(), scripted(alone), ledger_of(spec))
    assert str(caught.value).startswith(f"Round 7 lost client 4 ({failed[4]}), client 6 (")
    assert "`fedcore run --resume` restarts" in str(caught.value)


def test_a_peer_that_cannot_restore_its_checkpoint_stops_the_run_as_checkpoint_invalid() -> None:
    """A restart would read the same checkpoint: the reason is CheckpointInvalid (which the
    operator does not retry), not PeerLost (which it does); the message still names it."""
    # Prepare
    spec = spec_of(per_round='"100%"')
    policy = policy_of(spec, "Fail", decentralized=True)
    failed = {
        2: "failed: CheckpointInvalid: Client 2 must resume from its checkpoint of round 6",
        3: "failed: PeerLost: Client 3 lost its neighbour client 2",
    }
    # Execute
    with pytest.raises(RunAborted) as caught:
        play_round(7, policy, RecordingServer(), scripted(failed), ledger_of(spec))
    # Assert
    text = str(caught.value)
    assert caught.value.reason == "CheckpointInvalid" and caught.value.round == 7
    assert text.startswith(f"Round 7 lost client 2 ({failed[2]}), client 3 (lost a peer link")
    assert "Restarting would read the same checkpoint (`fedcore checkpoint list --verify`" in text
    assert "Once what client 2 reported is fixed, `fedcore run --resume` restarts" in text


def test_only_fail_stops_an_attempt_at_its_first_failure_and_retries_bound_the_attempts() -> None:
    spec = spec_of()
    assert not policy_of(spec, "Skip").stop_on_failure
    assert not policy_of(spec, "Redo").stop_on_failure
    assert policy_of(spec_of(retries=0)).max_attempts == 1
    assert policy_of(spec_of(retries=4)).max_attempts == 5


def test_the_budget_stops_the_run_before_the_round_that_would_exceed_it() -> None:
    # Prepare: every client every round, a budget that a few rounds spend.
    spec = spec_of(
        protocol=DP_FEDAVG,
        per_round='"100%"',
        quorum='"100%"',
        privacy="privacy: {targetEpsilon: 20.0, targetDelta: 1.0e-5, accountant: RDP}",
    )
    policy, server, ledger = policy_of(spec), RecordingServer(), ledger_of(spec)
    # Execute: play rounds until the policy stops the run.
    spent: list[float] = []
    stop = None
    for round_ in range(1, spec.rounds + 1):
        if (stop := policy.budget_stop(round_, ledger)) is not None:
            break
        outcome = play_round(round_, policy, server, scripted({}), ledger)
        assert outcome.epsilon is not None
        spent.append(outcome.epsilon)
    # Assert: every round spent was within the budget, and the next would exceed it.
    assert stop is not None
    assert len(spent) >= 2 and max(spent) <= 20.0
    assert spent == sorted(spent) and len(set(spent)) == len(spent)
    assert stop.round == len(spent) + 1 and stop.target == 20.0
    assert stop.epsilon_next > 20.0
    assert stop.epsilon_next == ledger.next_round_exceeds()
    assert [r for r, *_ in server.combined] == list(range(1, len(spent) + 1))


def test_a_run_resumed_between_rounds_decides_and_spends_as_the_uninterrupted_one() -> None:
    # Prepare: a seeded half sample with DP; an uninterrupted run of 6 rounds.
    spec = spec_of(
        protocol=DP_FEDAVG,
        privacy="privacy: {targetEpsilon: 1000.0, targetDelta: 1.0e-5, accountant: RDP}",
    )
    whole_server, whole_ledger = RecordingServer(), ledger_of(spec)
    whole = [
        play_round(r, policy_of(spec), whole_server, scripted({}), whole_ledger)
        for r in range(1, 7)
    ]
    # Execute: the same run stopped in round 4 (mid-round: nothing of it recorded), restored
    # from the ledger's state after round 3 by a new policy and ledger, and continued.
    first_server, first_ledger = RecordingServer(), ledger_of(spec)
    for r in (1, 2, 3):
        play_round(r, policy_of(spec), first_server, scripted({}), first_ledger)
    state = first_ledger.state_dict()
    resumed_ledger = ledger_of(spec)
    resumed_ledger.load_state_dict(state)
    resumed_server = RecordingServer()
    resumed = [
        play_round(r, policy_of(spec), resumed_server, scripted({}), resumed_ledger)
        for r in (4, 5, 6)
    ]
    # Assert: the same clients and the same epsilon, round for round.
    assert [o.sampled for o in resumed] == [o.sampled for o in whole[3:]]
    assert [o.epsilon for o in resumed] == [o.epsilon for o in whole[3:]]
    assert resumed_server.combined == whole_server.combined[3:]

"""The privacy ledger: what a round is accounted as, the budget's stop, and metrics."""

from __future__ import annotations

import dp_accounting
import pytest

from fedcore.privacy import PrivacyLedger, create_accountant
from fedcore.spec import load_manifest

MANIFEST = """
apiVersion: fedcore.dev/v1alpha1
kind: FederatedRun
metadata: {name: ledger}
spec:
  protocol: {name: dp-fedavg, dpFedavg: {clippingNorm: 1.0, noiseMultiplier: %(z)s}}
  model: {kind: MLP, hidden: [8]}
  data: {source: {kind: Digits}}
  clients: {count: 10, perRound: %(per_round)s, sampling: %(sampling)s}
  rounds: 20
  privacy: {targetEpsilon: %(target)s, targetDelta: 1.0e-5, accountant: RDP}
"""


def ledger_for(
    per_round: str, *, z: float = 1.1, target: float = 1e6, sampling: str = "Seeded"
) -> PrivacyLedger:
    text = MANIFEST % {"z": z, "per_round": per_round, "target": target, "sampling": sampling}
    spec = load_manifest("ledger", text=text).spec
    return PrivacyLedger(spec, z)


def epsilon_of(z: float, q: float, rounds: int) -> float:
    accountant = create_accountant("RDP")
    accountant.step(noise_multiplier=z, sample_rate=q, steps=rounds)
    return accountant.get_epsilon(1e-5)


def run_rounds(ledger: PrivacyLedger, rounds: int) -> list[float]:
    spent = []
    for _ in range(rounds):
        assert ledger.next_round_exceeds() is None
        epsilon = ledger.record_round()
        assert epsilon is not None
        spent.append(epsilon)
    return spent


def test_every_client_every_round_is_one_gaussian_mechanism_per_round_add_remove() -> None:
    # Prepare
    ledger = ledger_for('"100%"')
    # Execute
    spent = run_rounds(ledger, 5)
    # Assert: exact, under add/remove adjacency, the protocol's own multiplier.
    assert ledger.adjacency == "add-remove" and not ledger.sampled
    assert spent == [epsilon_of(1.1, 1.0, t) for t in range(1, 6)]


def test_a_public_sample_claims_no_amplification_replace_one_at_half_the_multiplier() -> None:
    # Prepare: 3 of 10 clients a round, drawn from the manifest's seed (public).
    ledger = ledger_for("3")
    # Execute
    spent = run_rounds(ledger, 5)
    # Assert: z/2 with no sampling (a client replaced moves the clipped sum by twice the
    # bound, in every round in the worst case), far above the Poisson-amplified figure that
    # would hold only for a secret sample.
    assert ledger.adjacency == "replace-one" and ledger.sampled
    assert ledger.round_multiplier == pytest.approx(0.55, rel=0, abs=0)
    assert spent == [epsilon_of(0.55, 1.0, t) for t in range(1, 6)]
    assert spent[-1] > 3 * epsilon_of(1.1, 0.3, 5)


def test_the_budget_stop_fires_on_the_accounted_bound() -> None:
    # Prepare: a target between the bound after 3 and after 4 rounds of the sampled run.
    target = (epsilon_of(0.55, 1.0, 3) + epsilon_of(0.55, 1.0, 4)) / 2
    ledger = ledger_for("3", target=target)
    # Execute
    run_rounds(ledger, 3)
    would_reach = ledger.next_round_exceeds()
    # Assert
    assert would_reach == epsilon_of(0.55, 1.0, 4)
    assert ledger.epsilon() == epsilon_of(0.55, 1.0, 3)


def test_a_protocol_without_dp_is_not_accounted() -> None:
    # Prepare
    spec = load_manifest(
        "ledger", text=MANIFEST % {"z": 1.0, "per_round": 3, "target": 1, "sampling": "Secret"}
    ).spec
    ledger = PrivacyLedger(spec, None)
    # Execute / Assert
    assert not ledger.enabled
    assert ledger.next_round_exceeds() is None
    assert ledger.record_round() is None and ledger.epsilon() is None


def test_a_checkpoint_with_poisson_entries_resumes_as_the_proven_bound() -> None:
    # Prepare: a ledger checkpoint as written before public samples claimed no amplification.
    ledger = ledger_for("3")
    old = {"kind": "accountant", "mechanism": "RDP", "history": [[1.1, 0.3, 4]]}
    # Execute
    ledger.load_state_dict(old)
    epsilon = ledger.record_round()
    # Assert: the four old rounds restated as z/2 without sampling, then the fifth.
    assert ledger.accountant.history == [(0.55, 1.0, 5)]
    assert epsilon == epsilon_of(0.55, 1.0, 5)


def wor_epsilon(z: float, population: int, m: int, rounds: int) -> float:
    """dp-accounting's own RDP composition of a Gaussian on samples without replacement."""
    accountant = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    event = dp_accounting.SampledWithoutReplacementDpEvent(
        population, m, dp_accounting.GaussianDpEvent(z)
    )
    accountant.compose(event, rounds)
    return float(accountant.get_epsilon(1e-5))


def test_a_secret_sample_claims_sampling_without_replacement_at_half_the_multiplier() -> None:
    # Prepare: 3 of 10 clients a round, drawn by the server from the OS CSPRNG.
    ledger = ledger_for("3", sampling="Secret")
    # Execute
    spent = run_rounds(ledger, 5)
    # Assert: dp-accounting's replace-one composition of z/2 on samples of 3 of 10, to the
    # bit; below the public sample's bound for the same rounds.
    assert ledger.secret and ledger.adjacency == "replace-one"
    assert ledger.round_multiplier == 0.55 and ledger.round_rate == 0.3
    assert spent == [wor_epsilon(0.55, 10, 3, t) for t in range(1, 6)]
    assert spent[-1] < epsilon_of(0.55, 1.0, 5)


def test_a_secret_sample_of_every_client_is_no_sample() -> None:
    # Prepare / Execute: Secret changes nothing when every client takes part.
    ledger = ledger_for('"100%"', sampling="Secret")
    spent = run_rounds(ledger, 3)
    # Assert
    assert not ledger.secret and ledger.adjacency == "add-remove"
    assert spent == [epsilon_of(1.1, 1.0, t) for t in range(1, 4)]


def test_a_secret_sample_budget_stops_and_its_checkpoint_resumes_unchanged() -> None:
    # Prepare: a target between the bound after 3 and after 4 secret rounds.
    target = (wor_epsilon(0.55, 10, 3, 3) + wor_epsilon(0.55, 10, 3, 4)) / 2
    ledger = ledger_for("3", target=target, sampling="Secret")
    run_rounds(ledger, 3)
    state = ledger.state_dict()
    # Execute
    resumed = ledger_for("3", target=target, sampling="Secret")
    resumed.load_state_dict(state)
    would_reach = resumed.next_round_exceeds()
    # Assert: the entries are kept (not restated as a public sample's), the stop fires, and
    # a public-sample ledger refuses the checkpoint.
    assert resumed.accountant.history == [(0.55, 0.3, 3)]
    assert would_reach == wor_epsilon(0.55, 10, 3, 4)
    assert resumed.epsilon() == wor_epsilon(0.55, 10, 3, 3)
    with pytest.raises(ValueError, match="sampling 'without-replacement'"):
        ledger_for("3").load_state_dict(state)


@pytest.mark.parametrize(
    ("per_round", "sampling", "z", "claim"),
    [
        ('"100%"', "Secret", 1.1, {"adjacency": "AddRemove", "amplification": "None"}),
        ("3", "Seeded", 1.1, {"adjacency": "ReplaceOne", "amplification": "None"}),
        (
            "3",
            "Secret",
            1.1,
            {"adjacency": "ReplaceOne", "amplification": "SamplingWithoutReplacement"},
        ),
        ("3", "Secret", None, {}),
    ],
)
def test_the_claim_says_what_epsilon_bounds(per_round, sampling, z, claim) -> None:
    # Prepare
    text = MANIFEST % {"z": 1.1, "per_round": per_round, "target": 1e6, "sampling": sampling}
    ledger = PrivacyLedger(load_manifest("ledger", text=text).spec, z)
    # Execute / Assert
    assert ledger.claim() == claim

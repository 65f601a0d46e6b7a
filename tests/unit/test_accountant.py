"""fedcore.privacy accountants: dp-accounting's numbers, merged history, state, refusals."""

from __future__ import annotations

import itertools
import json
import math

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from fedcore.privacy import Accountant, PldAccountant, RdpAccountant, create_accountant
from fedcore.privacy._accountant import _event, gaussian_epsilon

CASES = [
    # (noise_multiplier, sample_rate, steps, delta)
    (1.1, 0.1, 100, 1e-5),
    (0.8, 0.3, 20, 1e-6),
    (2.0, 0.01, 1000, 1e-5),
]


def direct_epsilon(mechanism: str, z: float, q: float, n: int, delta: float) -> float:
    """Epsilon from dp-accounting itself: a Poisson-sampled Gaussian composed n times."""
    accountant = rdp.RdpAccountant() if mechanism == "RDP" else pld.PLDAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    accountant.compose(event, n)
    return float(accountant.get_epsilon(delta))


@pytest.mark.parametrize(("z", "q", "n", "delta"), [*CASES, (1.0, 1.0, 5, 1e-5)])
def test_rdp_accountant_epsilon_equals_dp_accounting_built_directly(z, q, n, delta) -> None:
    # Prepare
    accountant = create_accountant("RDP")
    # Execute
    accountant.step(noise_multiplier=z, sample_rate=q, steps=n)
    # Assert
    assert accountant.get_epsilon(delta) == pytest.approx(
        direct_epsilon("RDP", z, q, n, delta), rel=0, abs=1e-9
    )


@pytest.mark.parametrize(("z", "q", "n", "delta"), [CASES[0], CASES[2]])
def test_pld_accountant_epsilon_equals_dp_accounting_built_directly(z, q, n, delta) -> None:
    # Prepare
    accountant = create_accountant("PLD")
    # Execute
    accountant.step(noise_multiplier=z, sample_rate=q, steps=n)
    # Assert
    assert accountant.get_epsilon(delta) == pytest.approx(
        direct_epsilon("PLD", z, q, n, delta), rel=0, abs=1e-9
    )


@pytest.mark.parametrize(
    "plan",
    [[(1.0, 5)], [(2.0, 30)], [(1.5, 6), (3.0, 10)], [(3.0, 7), (1.0, 3), (2.0, 11)]],
)
def test_pld_accountant_full_participation_is_one_gaussian_with_the_librarys_exact_epsilon(
    plan,
) -> None:
    # Prepare: unsampled Gaussian rounds, some with different noise; dp-accounting's own PLD
    # accountant composes the same events (discretized), and its analytic Gaussian epsilon
    # is asked for the single Gaussian of noise 1 / sqrt(sum(n / z**2)).
    accountant = create_accountant("PLD")
    direct = pld.PLDAccountant()
    for z, n in plan:
        accountant.step(noise_multiplier=z, sample_rate=1.0, steps=n)
        direct.compose(dp_accounting.GaussianDpEvent(z), n)
    sigma = 1 / math.sqrt(math.fsum(n / z**2 for z, n in plan))
    loss = pld.privacy_loss_mechanism.GaussianPrivacyLoss(sigma, pessimistic_estimate=False)
    for delta in (1e-3, 1e-5, 1e-6):
        # Execute
        epsilon = accountant.get_epsilon(delta)
        # Assert: the library's exact number for that Gaussian, the library's composition
        # to 1e-8 relative, and (epsilon, delta) is tight for it (the privacy loss's own
        # hockey-stick divergence at epsilon is delta).
        assert epsilon == dp_accounting.get_epsilon_gaussian(sigma, delta)
        assert epsilon == pytest.approx(float(direct.get_epsilon(delta)), rel=1e-8)
        assert loss.get_delta_for_epsilon(epsilon) == pytest.approx(delta, rel=1e-6)


def test_pld_accountant_full_participation_costs_no_discretized_composition() -> None:
    # Prepare: 1,000 unsampled rounds, whose discretized PLD dp-accounting builds in about
    # half a minute here; the budget check asks for one more round.
    accountant = PldAccountant()
    accountant.step(noise_multiplier=1.1, sample_rate=1.0, steps=1000)
    # Execute
    epsilon = accountant.epsilon_after(1e-5, noise_multiplier=1.1, sample_rate=1.0)
    # Assert: the closed form, with the history itself untouched.
    assert epsilon == dp_accounting.get_epsilon_gaussian(1.1 / math.sqrt(1001), 1e-5)
    assert accountant.history == [(1.1, 1.0, 1000)]


def test_gaussian_epsilon_refuses_a_sampled_round() -> None:
    # Execute / Assert: a Poisson-sampled round is not a Gaussian mechanism.
    with pytest.raises(ValueError, match="Only unsampled"):
        gaussian_epsilon([(1.0, 1.0, 3), (1.0, 0.5, 2)], 1e-5)


def test_rdp_accountant_mixed_history_is_the_librarys_composition_to_the_last_bit() -> None:
    # Prepare: two mechanisms interleaved, so the cached one-round curves are summed with
    # different weights; dp-accounting composes the same events itself.
    accountant = RdpAccountant()
    direct = rdp.RdpAccountant()
    plan = [(1.1, 0.1, 3), (0.7, 1.0, 2), (1.1, 0.1, 4), (2.5, 0.02, 1)]
    # Execute
    for z, q, n in plan:
        for _ in range(n):
            accountant.step(noise_multiplier=z, sample_rate=q)
        one = dp_accounting.GaussianDpEvent(z)
        direct.compose(dp_accounting.PoissonSampledDpEvent(q, one) if q < 1 else one, n)
    # Assert: equal, not approximately equal (RDP composes by exact addition).
    assert len(accountant.history) == 4
    assert accountant.get_epsilon(1e-5) == float(direct.get_epsilon(1e-5))
    assert accountant.epsilon_after(1e-6, noise_multiplier=0.9, sample_rate=0.5, steps=7) == float(
        _composed_with(
            direct, dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(0.9)), 7
        ).get_epsilon(1e-6)
    )


def test_pld_accountant_sampled_history_is_the_librarys_composition_to_the_last_bit() -> None:
    # Prepare: two sampled mechanisms interleaved (the cached one-round PLDs), and the same
    # events composed by dp-accounting's own PLD accountant.
    accountant = PldAccountant()
    direct = pld.PLDAccountant()
    plan = [(1.5, 0.1, 3), (2.0, 0.05, 2), (1.5, 0.1, 2)]
    # Execute
    for z, q, n in plan:
        for _ in range(n):
            accountant.step(noise_multiplier=z, sample_rate=q)
        direct.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), n)
    first = accountant.get_epsilon(1e-5)
    # Assert: equal floats, and asking again (from the cache) changes nothing.
    assert len(accountant.history) == 3
    assert first == float(direct.get_epsilon(1e-5))
    assert accountant.get_epsilon(1e-5) == first


def _composed_with(
    accountant: rdp.RdpAccountant, event: dp_accounting.DpEvent, count: int
) -> rdp.RdpAccountant:
    accountant.compose(event, count)
    return accountant


def test_rdp_accountant_reference_number_is_pinned() -> None:
    # Prepare: computed once with dp-accounting 0.6.0 (z=1.1, q=0.1, 100 rounds, delta=1e-5).
    accountant = RdpAccountant()
    # Execute
    for _ in range(100):
        accountant.step(noise_multiplier=1.1, sample_rate=0.1)
    # Assert
    assert accountant.get_epsilon(1e-5) == pytest.approx(6.62076948219146, rel=0, abs=1e-9)


def test_pld_accountant_reference_number_is_pinned() -> None:
    # Prepare: computed once with dp-accounting 0.6.0 (z=2.0, q=0.01, 1000 rounds, delta=1e-5).
    accountant = PldAccountant()
    # Execute
    accountant.step(noise_multiplier=2.0, sample_rate=0.01, steps=1000)
    # Assert
    assert accountant.get_epsilon(1e-5) == pytest.approx(0.6220485250886894, rel=0, abs=1e-9)


def test_accountant_step_merges_repeats_so_history_stays_small() -> None:
    # Prepare
    accountant = create_accountant("RDP")
    # Execute
    for _ in range(500):
        accountant.step(noise_multiplier=1.0, sample_rate=0.2)
    accountant.step(noise_multiplier=1.5, sample_rate=0.2, steps=3)
    accountant.step(noise_multiplier=1.5, sample_rate=0.2)
    # Assert
    assert accountant.history == [(1.0, 0.2, 500), (1.5, 0.2, 4)]
    assert len(accountant) == 504


def test_accountant_step_one_at_a_time_equals_many_at_once() -> None:
    # Prepare
    one_by_one = create_accountant("RDP")
    at_once = create_accountant("RDP")
    # Execute
    for _ in range(30):
        one_by_one.step(noise_multiplier=1.2, sample_rate=0.05)
    at_once.step(noise_multiplier=1.2, sample_rate=0.05, steps=30)
    # Assert
    assert one_by_one.get_epsilon(1e-5) == at_once.get_epsilon(1e-5)


def test_accountant_epsilon_grows_with_every_round() -> None:
    # Prepare
    accountant = create_accountant("RDP")
    spent = []
    # Execute
    for _ in range(4):
        accountant.step(noise_multiplier=1.0, sample_rate=0.5)
        spent.append(accountant.get_epsilon(1e-5))
    # Assert
    assert all(a < b for a, b in itertools.pairwise(spent))


def test_accountant_before_any_step_has_spent_nothing() -> None:
    # Execute / Assert
    assert create_accountant("PLD").get_epsilon(1e-5) == 0.0
    assert len(create_accountant("RDP")) == 0


def test_accountant_epsilon_after_does_not_change_state() -> None:
    # Prepare
    accountant = create_accountant("RDP")
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, steps=10)
    history = list(accountant.history)
    spent = accountant.get_epsilon(1e-5)
    # Execute
    after = accountant.epsilon_after(1e-5, noise_multiplier=1.0, sample_rate=0.1, steps=5)
    # Assert
    assert accountant.history == history
    assert accountant.get_epsilon(1e-5) == spent
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, steps=5)
    assert accountant.get_epsilon(1e-5) == pytest.approx(after, rel=0, abs=1e-12)
    assert after > spent


@pytest.mark.parametrize("mechanism", ["RDP", "PLD"])
def test_accountant_state_dict_round_trip_keeps_history_and_epsilon(mechanism: str) -> None:
    # Prepare
    first = create_accountant(mechanism)
    first.step(noise_multiplier=2.0, sample_rate=0.01, steps=40)
    first.step(noise_multiplier=3.0, sample_rate=0.01, steps=2)
    second = create_accountant(mechanism)
    # Execute
    state = json.loads(json.dumps(first.state_dict()))
    second.load_state_dict(state)
    # Assert
    assert state["mechanism"] == mechanism and state["kind"] == "accountant"
    assert second.history == first.history
    assert second.get_epsilon(1e-5) == first.get_epsilon(1e-5)


@pytest.mark.parametrize(
    ("state", "fragment"),
    [
        ({}, "state is empty"),
        ({"mechanism": "RDP"}, "does not have the key 'history'"),
        ({"history": []}, "does not have the key 'mechanism'"),
        ({"mechanism": "PLD", "history": []}, "mechanism 'PLD'; this accountant is 'RDP'"),
    ],
)
def test_accountant_load_state_dict_bad_state_is_refused(state: dict, fragment: str) -> None:
    # Prepare
    accountant = create_accountant("RDP")
    # Execute / Assert
    with pytest.raises(ValueError, match=fragment):
        accountant.load_state_dict(state)


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        ({"noise_multiplier": 0.0, "sample_rate": 0.1}, "noise multiplier must be positive"),
        ({"noise_multiplier": -1.0, "sample_rate": 0.1}, "got -1.0"),
        ({"noise_multiplier": 1.0, "sample_rate": 0.0}, r"sampling rate must be in \(0, 1\]"),
        ({"noise_multiplier": 1.0, "sample_rate": 1.5}, "got 1.5"),
        ({"noise_multiplier": 1.0, "sample_rate": 0.1, "steps": 0}, "at least 1, got 0"),
    ],
)
def test_accountant_step_and_epsilon_after_bad_arguments_are_refused(
    arguments: dict, fragment: str
) -> None:
    # Prepare
    accountant = create_accountant("RDP")
    # Execute / Assert
    with pytest.raises(ValueError, match=fragment):
        accountant.step(**arguments)
    with pytest.raises(ValueError, match=fragment):
        accountant.epsilon_after(1e-5, **arguments)
    assert accountant.history == []


def test_create_accountant_unknown_name_is_refused() -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="Unknown accountant 'prv'; known: PLD, RDP"):
        create_accountant("prv")


@pytest.mark.parametrize(("name", "cls"), [("RDP", RdpAccountant), ("PLD", PldAccountant)])
def test_create_accountant_by_name_builds_that_mechanism(name: str, cls: type) -> None:
    # Execute
    accountant = create_accountant(name)
    # Assert
    assert isinstance(accountant, cls) and isinstance(accountant, Accountant)
    assert accountant.mechanism() == name


def test_rdp_accountant_without_replacement_is_the_librarys_replace_one_composition() -> None:
    # Prepare: samples of fixed size m of N (q = m/N, not in lowest terms for 30 of 100) and a
    # full round, composed by dp-accounting's own RDP accountant under replace-one adjacency.
    accountant = create_accountant("RDP", "without-replacement")
    direct = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    plan = [(0.55, 100, 10, 3), (0.55, 10, 3, 2), (1.0, 100, 30, 4), (0.55, 10, 10, 1)]
    # Execute
    for z, population, m, n in plan:
        for _ in range(n):
            accountant.step(noise_multiplier=z, sample_rate=m / population)
        gaussian = dp_accounting.GaussianDpEvent(z)
        direct.compose(
            dp_accounting.SampledWithoutReplacementDpEvent(population, m, gaussian)
            if m < population
            else gaussian,
            n,
        )
    # Assert: the same float, and it is tighter than the same rounds unsampled.
    unsampled = create_accountant("RDP")
    unsampled.step(noise_multiplier=0.55, sample_rate=1.0, steps=5)
    unsampled.step(noise_multiplier=1.0, sample_rate=1.0, steps=4)
    unsampled.step(noise_multiplier=0.55, sample_rate=1.0, steps=1)
    assert accountant.get_epsilon(1e-5) == float(direct.get_epsilon(1e-5))
    assert accountant.get_epsilon(1e-5) < unsampled.get_epsilon(1e-5)


def test_sampling_rate_without_replacement_maps_back_to_the_population_exactly() -> None:
    # Prepare: every m of the largest populations, and m/N pairs with common factors.
    pairs = [(m, 10_000) for m in range(1, 10_000)] + [(m, 9_999) for m in range(1, 9_999)]
    pairs += [(2, 4), (30, 100), (5000, 10_000), (1, 7), (6, 7)]
    # Execute / Assert: the event fedcore builds has the rate m/N bit for bit.
    for m, population in pairs:
        event = _event(1.0, m / population, 1, "without-replacement").event
        assert event.sample_size / event.source_dataset_size == m / population


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: create_accountant("PLD", "without-replacement"), "PLD accountant cannot"),
        (lambda: PldAccountant("without-replacement"), "use the RDP accountant"),
        (lambda: create_accountant("RDP", "shuffled"), "Unknown sampling 'shuffled'"),
    ],
)
def test_accountant_sampling_it_cannot_compose_is_refused(call, fragment: str) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match=fragment):
        call()


def test_accountant_state_keeps_its_sampling_and_refuses_another() -> None:
    # Prepare
    first = create_accountant("RDP", "without-replacement")
    first.step(noise_multiplier=0.55, sample_rate=0.1, steps=7)
    state = json.loads(json.dumps(first.state_dict()))
    # Execute
    second = create_accountant("RDP", "without-replacement")
    second.load_state_dict(state)
    # Assert: restored; a Poisson accountant refuses it; a state from before the key existed
    # is Poisson's.
    assert state["sampling"] == "without-replacement"
    assert second.get_epsilon(1e-5) == first.get_epsilon(1e-5)
    with pytest.raises(ValueError, match="composes sampling 'without-replacement'; this"):
        create_accountant("RDP").load_state_dict(state)
    old = {"kind": "accountant", "mechanism": "RDP", "history": [[1.0, 0.1, 3]]}
    poisson = create_accountant("RDP")
    poisson.load_state_dict(old)
    assert poisson.history == [(1.0, 0.1, 3)]
    with pytest.raises(ValueError, match="composes sampling 'poisson'"):
        create_accountant("RDP", "without-replacement").load_state_dict(old)

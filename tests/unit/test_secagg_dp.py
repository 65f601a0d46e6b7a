"""secagg's distributed DP: the discrete Gaussian, the plan's epsilon against dp-accounting, the
noise in the unmasked sum, and the refusals that keep the claim true."""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import pytest
from scipy import stats

from fedcore.errors import ProtocolError, SpecError
from fedcore.privacy import PrivacyLedger
from fedcore.protocols.secagg import noise
from fedcore.protocols.secagg.protocol import SecAgg, SecAggClient, SecAggServer
from fedcore.simulation import simulate
from fedcore.spec import parse_manifest
from fedcore.spec._options.secagg import DistributedDpOptions, SecAggOptions
from fedcore.spec._options.secagg_dp import ddg_epsilon, ddp_plan
from fedcore.transport import issue_run_bundles
from tests.unit.test_secagg_protocol import FixedLearner

DOCUMENT: dict[str, Any] = {
    "apiVersion": "fedcore.dev/v1alpha1",
    "kind": "FederatedRun",
    "metadata": {"name": "ddp"},
    "spec": {
        "protocol": {
            "name": "secagg",
            "secagg": {
                "dropoutRate": 0.2,
                "corruptRate": 0.2,
                "distributedDp": {"clippingNorm": 1.0, "noiseMultiplier": 1.0},
            },
        },
        "model": {"kind": "MLP", "hidden": [8]},
        "data": {"source": {"kind": "Digits"}},
        "clients": {"count": 5, "quorum": "60%"},
        "rounds": 3,
        "training": {"batchSize": 32, "optimizer": {"kind": "SGD", "learningRate": 0.1}},
        "checkpoint": {"everyRounds": 0},
        "privacy": {"targetDelta": 1e-5},
        "seed": 1,
    },
}


def _document(**changes: Any) -> dict[str, Any]:
    document = copy.deepcopy(DOCUMENT)
    for path, value in changes.items():
        node = document["spec"]
        keys = path.split(".")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return document


# ------------------------------------------------------------------------- the sampler


def test_the_discrete_gaussian_has_its_probabilities() -> None:
    sigma = 2.0
    draws = noise.discrete_gaussian(np.random.default_rng(0), sigma, 200_000)
    support = np.arange(-12, 13)
    weights = np.exp(-(support**2) / (2 * sigma**2))
    expected = weights / weights.sum() * draws.size
    observed = np.array([(draws == y).sum() for y in support])
    assert (np.abs(draws) <= 12).all() or (np.abs(draws) > 12).mean() < 1e-4
    chi2 = ((observed - expected) ** 2 / expected).sum()
    assert chi2 < stats.chi2.ppf(0.999, df=support.size - 1)


def test_a_wide_discrete_gaussian_has_the_variance_of_its_parameter() -> None:
    sigma = 300.0
    draws = noise.discrete_gaussian(np.random.default_rng(1), sigma, 100_000)
    assert draws.dtype == np.int64
    assert abs(draws.mean()) < 4 * sigma / math.sqrt(draws.size)
    assert draws.std() == pytest.approx(sigma, rel=0.01)


# ------------------------------------------------------------------------- accounting


def test_epsilon_is_the_theorem_s_and_the_ledger_composes_it_as_dp_accounting_does() -> None:
    """With a wide noise, tau vanishes and a round's eps is Delta / (sqrt(n) s); the ledger's
    epsilon after R rounds equals dp-accounting's RDP accountant on R Gaussians of multiplier
    1 / eps (the same RDP curve), computed here independently."""
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    run = parse_manifest(_document())
    z_eq = SecAgg().noise_multiplier(run.spec)
    fewest, sampled = 3, 5
    plan = ddp_plan(
        clipping_norm=1.0,
        noise_multiplier=1.0,
        granularity_bits=20,
        fewest=fewest,
        most=sampled,
        dims=1,
    )
    assert plan.sigma == pytest.approx(2**19 / math.sqrt(fewest))
    assert ddg_epsilon(plan.delta2, plan.sigma, fewest, 1) == pytest.approx(
        plan.delta2 / (math.sqrt(fewest) * plan.sigma), rel=1e-12
    )
    assert z_eq is not None and z_eq == pytest.approx(1.0, rel=1e-3)  # z, less rounding
    ledger = PrivacyLedger(run.spec, z_eq)
    for _ in range(7):
        ledger.record_round()
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(z_eq), 7)
    assert ledger.epsilon() == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)


def test_the_bound_grows_when_the_noise_is_narrow() -> None:
    """At s near 1/2, tau is no longer negligible: the bound is above Delta / (sqrt(n) s)."""
    delta2, sigma, n, d = 4.0, 0.6, 20, 100
    assert ddg_epsilon(delta2, sigma, n, d) > delta2 / (math.sqrt(n) * sigma) + 1e-3
    with pytest.raises(ProtocolError, match="below 1/2"):
        ddg_epsilon(delta2, 0.4, n, d)


# -------------------------------------------------------------------- in the protocol


def _round(options: SecAggOptions, dropped_at_2: set[int], clients_count: int = 6):
    bundles = issue_run_bundles("ddp", num_clients=clients_count)[1]
    rng = np.random.default_rng(5)
    initial = {"w": np.zeros((40, 25), dtype=np.float32)}
    fewest = 4
    server = SecAggServer(initial, options, fewest=fewest)
    clients = {}
    learners = {}
    for k in range(clients_count):
        clients[k] = SecAggClient(k, options, seed=3, fewest=fewest)
        clients[k].set_identity(bundles[f"client-{k}"])
        learners[k] = FixedLearner({"w": rng.normal(0, 0.02, (40, 25)).astype(np.float32)})
    plans = server.plan_round(1, list(range(clients_count)))
    for stage in range(6):
        responses = {}
        for k, instruction in plans.items():
            if stage == 3 and k in dropped_at_2:
                continue
            if stage == 0:
                response = clients[k].compute_upload(1, instruction, learners[k], None)
            else:
                response = clients[k].respond(1, stage, instruction)
            server.check_upload(1, k, response)
            responses[k] = response
        plans = server.next_stage(1, stage, responses, [])
    return server, clients, learners


def test_the_unmasked_sum_carries_every_survivor_s_noise_and_nothing_else() -> None:
    dp = DistributedDpOptions(clippingNorm=1.0, noiseMultiplier=2.0, secureNoise=False)
    options = SecAggOptions(dropoutRate=0.2, corruptRate=0.1, distributedDp=dp)
    server, clients, _learners = _round(options, dropped_at_2={5})
    attempt = server._attempt
    plan = attempt.encoding.plan
    survivors = attempt.survivors
    assert survivors == [0, 1, 2, 3, 4]
    words = sum(clients[k]._attempt.words.astype(object) for k in survivors)
    wrapped = np.array([int(w) % 2**plan.bits for w in words], dtype=np.uint64)
    assert np.array_equal(attempt.total, noise.decode_sum(wrapped, plan))
    # The noise: the decoded sum less the clipped updates' sum, in units of gamma, has the
    # standard deviation sqrt(5) s, at least the z C the quorum of 4 is promised.
    clipped = sum(clients[k]._attempt.update for k in survivors)
    residual = (attempt.total - clipped) / plan.gamma
    expected = math.sqrt(len(survivors)) * plan.sigma
    assert residual.std() == pytest.approx(expected, rel=0.08)
    assert expected * plan.gamma >= 2.0 * 1.0  # z C
    for k in survivors:
        assert np.linalg.norm(clients[k]._attempt.update) <= 1.0 + 1e-12


def test_clients_refuse_to_reveal_a_sum_of_fewer_than_the_quorum() -> None:
    """The noise is calibrated for the quorum (4 of 6): a survivor list of 3 is refused by the
    clients themselves, whatever the server says."""
    dp = DistributedDpOptions(clippingNorm=1.0, noiseMultiplier=2.0, secureNoise=False)
    options = SecAggOptions(dropoutRate=0.2, corruptRate=0.1, distributedDp=dp)
    with pytest.raises(ProtocolError, match="secagg needs at least 4"):
        _round(options, dropped_at_2={3, 4, 5})
    _server, clients, _ = _round(options, dropped_at_2=set())
    attempt = clients[0]._attempt
    with pytest.raises(ProtocolError, match="fewer than the 4"):
        clients[0]._survivors(attempt, {"survivors": [0, 1, 2]})


def test_a_run_with_a_budget_stops_before_exceeding_it() -> None:
    run = parse_manifest(_document(**{"privacy.targetEpsilon": 30.0, "rounds": 50}))
    result = simulate(run)
    assert result.reason == "BudgetExhausted"
    assert result.epsilon is not None and result.epsilon <= 30.0
    assert 1 <= result.rounds_completed < 50


@pytest.mark.parametrize(
    ("changes", "path", "words"),
    [
        ({"privacy.accountant": "PLD"}, "spec.privacy.accountant", "zCDP"),
        (
            {"clients.perRound": 4, "clients.sampling": "Secret", "clients.quorum": 3},
            "spec.clients.sampling",
            "amplification",
        ),
        (
            {"protocol.secagg.distributedDp.noiseMultiplier": 1e-7},
            "spec.protocol.secagg.distributedDp",
            "below 1/2",
        ),
        (
            {
                "protocol.secagg.quantizationBits": 40,
                "protocol.secagg.distributedDp.noiseMultiplier": 1e4,
                "clients.count": 1400,
                "clients.quorum": 2,
            },
            "spec.protocol.secagg.distributedDp",
            "modulus",
        ),
    ],
)
def test_what_the_noise_cannot_prove_is_refused(changes, path, words) -> None:
    with pytest.raises(SpecError) as caught:
        parse_manifest(_document(**changes))
    issues = [issue for issue in caught.value.issues if issue.path == path]
    assert issues and words in issues[0].message, caught.value.issues


def test_without_distributed_dp_no_epsilon_is_claimed() -> None:
    document = _document()
    del document["spec"]["protocol"]["secagg"]["distributedDp"]
    del document["spec"]["privacy"]
    assert SecAgg().noise_multiplier(parse_manifest(document).spec) is None

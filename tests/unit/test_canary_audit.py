"""The canary audit (fedcore/audit/canary, fedcore/learning/canary.py): canaries go through each
protocol's own client side, a correct DP run stays under its claim, and a run whose noise is
switched off (a fault injected here, in the test) is caught above it."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import fedcore.protocols.dp_fedavg as dp_fedavg
from fedcore.audit import run_audit
from fedcore.audit._seeded import audited
from fedcore.audit.canary.run import CanaryAudit, check_canaries, run_canary_audit, with_canaries
from fedcore.cli import main
from fedcore.learning.canary import (
    CanaryClients,
    CanaryLearner,
    along,
    random_direction,
    trainable_shapes,
)
from fedcore.learning.models import build_model, get_weights
from fedcore.simulation import simulate
from fedcore.spec import FederatedRun, load_manifest, parse_manifest

EXAMPLES = Path(__file__).parents[2] / "examples"
CORRECT_SEEDS = (0, 1, 2)
"""The seeds of the correct runs checked against their claim (3 s each)."""


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # seeded noise, for tests only
        yield
    torch.set_num_threads(threads)


def digits_run(
    protocol: dict[str, Any], *, clients: int = 5, rounds: int = 2, **spec: Any
) -> FederatedRun:
    """The digits job, small: an MLP of 16 hidden units, float64."""
    document: dict[str, Any] = {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "FederatedRun",
        "metadata": {"name": "canary-test"},
        "spec": {
            "protocol": protocol,
            "model": {"kind": "MLP", "hidden": [16], "dtype": "float64"},
            "data": {"source": {"kind": "Digits"}, "partition": {"kind": "IID"}},
            "clients": {"count": clients},
            "rounds": rounds,
            "training": {
                "localEpochs": 1,
                "batchSize": 32,
                "optimizer": {"kind": "SGD", "learningRate": 0.1},
            },
            "checkpoint": {"everyRounds": 0},
            "seed": 0,
            **spec,
        },
    }
    return parse_manifest(document)


def dp_fedavg_run(noise: float = 6.0) -> FederatedRun:
    """dp-fedavg whose claim (2 rounds at z = 6: about 1.2) is below what 200 canaries can
    show (about 3), so that a missing noise is caught."""
    protocol = {
        "name": "dp-fedavg",
        "dpFedavg": {"clippingNorm": 0.5, "noiseMultiplier": noise, "secureNoise": False},
    }
    return digits_run(protocol, clients=10)


# ------------------------------------------------------------------------------ the canary


def test_a_canary_moves_any_model_by_its_scale_along_its_own_unit_direction() -> None:
    # Prepare
    model = build_model(digits_run({"name": "fedavg"}).spec.model, (64,), 10, seed=0)
    shapes = trainable_shapes(model)
    direction = random_direction(shapes, seed=3, index=7)
    learner = CanaryLearner(
        model,
        digits_run({"name": "fedavg"}).spec.training,
        direction,
        scale=0.25,
        examples=40,
        client_index=12,
        input_shape=(64,),
        num_classes=10,
    )
    start = get_weights(model)
    # Execute
    trained, stats = learner.train(start, round=1)
    gradient, _ = learner.gradient(start, round=2)
    # Assert
    flat = along(direction, direction)
    assert np.linalg.norm(flat) == pytest.approx(1.0, abs=1e-12)
    moved = along(trained, direction) - along(start, direction)
    np.testing.assert_allclose(moved, 0.25 * flat, rtol=0, atol=1e-15)
    np.testing.assert_allclose(along(gradient, direction), -0.25 * flat, rtol=0, atol=0)
    assert stats.num_examples == learner.num_examples == 40
    assert random_direction(shapes, seed=3, index=8).keys() == direction.keys()
    assert not np.array_equal(along(random_direction(shapes, 3, 8), direction), flat)


def test_canaries_join_a_fedavg_round_as_clients_whose_update_is_their_direction() -> None:
    """One round of fedavg with Uniform weighting: the model is the mean of the run's own
    clients' models (their data split as without canaries) and of the canaries' w0 + s·d."""
    # Prepare
    run = digits_run({"name": "fedavg", "fedavg": {"weighting": "Uniform"}}, rounds=1)
    model = build_model(run.spec.model, (64,), 10, seed=0)
    start = get_weights(model)
    directions = tuple(random_direction(trainable_shapes(model), 0, i) for i in range(3))
    probes = CanaryClients(first=5, directions=directions, scale=0.5, examples=100)
    # Execute
    plain = simulate(run)
    probed = simulate(with_canaries(run, 3), canaries=probes)
    # Assert
    d = directions[0]
    expected = (
        5 * along(plain.weights, d) + sum(along(start, d) + 0.5 * along(c, d) for c in directions)
    ) / 8
    np.testing.assert_allclose(along(probed.weights, d), expected, rtol=0, atol=1e-12)


def test_with_canaries_keeps_the_sampling_rate_of_a_per_round_count() -> None:
    base = digits_run({"name": "fedavg"})
    document = base.model_dump(by_alias=True, exclude_none=True)
    document["spec"]["clients"] = {"count": 10, "perRound": 4}
    grown = with_canaries(parse_manifest(document), 15)
    assert grown.spec.clients.count == 25
    assert grown.spec.clients.per_round == 10


# ------------------------------------------------------------------------ DP claims, checked


@pytest.mark.parametrize("seed", CORRECT_SEEDS)
def test_a_correct_dp_fedavg_run_stays_under_its_claim(seed: int) -> None:
    # Execute
    audit = run_canary_audit(dp_fedavg_run(), canaries=200, seed=seed)
    # Assert
    assert audit.claimed is not None and 0.5 < audit.claimed < audit.ceiling
    assert audit.bound.epsilon <= audit.claimed
    assert audit.verdict == "consistent"
    assert audit.estimate.low <= audit.claimed  # the estimate's interval reaches the claim
    assert audit.inserted + len(audit.held_out_scores) == 200


def test_a_run_whose_noise_is_switched_off_is_caught_above_its_claim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fault: dp-fedavg's server adds no noise, while its accountant still claims it."""
    # Prepare
    monkeypatch.setattr(
        dp_fedavg,
        "gaussian_noise_like",
        lambda total, std, rng: {name: np.zeros_like(v) for name, v in total.items()},
    )
    # Execute
    audit = run_canary_audit(dp_fedavg_run(), canaries=200, seed=0)
    # Assert
    assert audit.claimed is not None
    assert audit.bound.epsilon > audit.claimed
    assert audit.verdict == "exceeds claim"
    assert audit.estimate.low > audit.claimed
    assert audit.bound.correct == audit.bound.guesses  # every membership guess right


def test_a_claim_beyond_what_the_canaries_can_bound_is_flagged_by_the_estimate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shipped example claims about 6.7 after 5 rounds: 200 canaries cannot bound that
    much (ceiling about 3), so a missing noise shows as an estimate whose whole interval is
    above the claim."""
    monkeypatch.setattr(
        dp_fedavg,
        "gaussian_noise_like",
        lambda total, std, rng: {name: np.zeros_like(v) for name, v in total.items()},
    )
    run = load_manifest(EXAMPLES / "digits-dpfedavg.yaml")
    audit = run_canary_audit(run, canaries=200, seed=0, rounds=5)
    assert audit.claimed is not None and audit.claimed > audit.ceiling
    assert audit.verdict == "estimate above claim"
    assert audit.estimate.low > audit.claimed


def test_adaptive_formal_dp_is_held_to_its_client_level_claim() -> None:
    """adaptive's DP measure bounds one example of a client's batch: a canary (a whole client)
    is held to B times it per round, over the rounds (pure DP); a learned distortion (no
    formal DP) gets the estimate with no claim."""
    protocol: dict[str, Any] = {
        "name": "adaptive",
        "adaptive": {"measure": "DP", "strategy": "Identical", "dp": {"epsilon": 1.0}},
    }
    run = digits_run(protocol, clients=4, rounds=2)
    audit = run_canary_audit(run, canaries=40, seed=0)
    batch = run.spec.training.batch_size  # the canaries' private rows outnumber it
    assert audit.claimed == 2 * batch * 1.0
    assert audit.claim is not None and audit.claim["batch"] == str(batch)
    assert audit.scale_from == "the protocol's clipping bound"
    assert audit.verdict == "consistent" and audit.bound.epsilon <= audit.claimed
    protocol["adaptive"]["strategy"] = "Learn"
    learned = run_canary_audit(digits_run(protocol, clients=4, rounds=2), canaries=40, seed=0)
    assert learned.claimed is None and learned.verdict == "no DP claim"


@pytest.mark.parametrize(("accountant", "sampling"), [("PLD", "Seeded"), ("RDP", "Secret")])
def test_each_accountant_and_sampling_mode_is_audited_against_its_own_claim(
    accountant: str, sampling: str
) -> None:
    """Half the clients per round: the canaries are sampled at the same rate, and a secret
    sample is audited as the seeded one (no amplification claimed against an observer who
    sees who takes part)."""
    protocol = {
        "name": "dp-fedavg",
        "dpFedavg": {"clippingNorm": 0.5, "noiseMultiplier": 3.0, "secureNoise": False},
    }
    privacy = {"accountant": accountant, "targetDelta": 1e-5}
    document = digits_run(protocol, clients=10, rounds=3, privacy=privacy).model_dump(
        by_alias=True, exclude_none=True
    )
    document["spec"]["clients"] = {"count": 10, "perRound": "50%", "sampling": sampling}
    run = parse_manifest(document)
    audit = run_canary_audit(run, canaries=200, seed=0)
    expected = simulate(with_canaries(audited(run), audit.inserted)).epsilon
    assert audit.claimed == pytest.approx(expected, rel=1e-12)
    assert audit.claim is not None and audit.claim["amplification"] == "None"
    assert audit.per_round == -(-(10 + audit.inserted) // 2)
    assert audit.bound.epsilon <= audit.claimed


def test_more_noise_shows_less_than_less_noise() -> None:
    loud = run_canary_audit(dp_fedavg_run(noise=12.0), canaries=200, seed=0)
    quiet = run_canary_audit(dp_fedavg_run(noise=3.0), canaries=200, seed=0)
    assert loud.claimed is not None and quiet.claimed is not None
    assert loud.claimed < quiet.claimed
    assert loud.estimate.epsilon < quiet.estimate.epsilon


def test_distributed_dp_under_secure_aggregation_is_audited_through_its_clients() -> None:
    """secagg with distributed DP: each canary clips, quantizes, adds its noise share and masks
    its input as an honest client does; the run stays under its claim."""
    protocol = {
        "name": "secagg",
        "secagg": {
            "dropoutRate": 0.1,
            "corruptRate": 0.1,
            "distributedDp": {"clippingNorm": 0.5, "noiseMultiplier": 3.0, "secureNoise": False},
        },
    }
    audited = run_canary_audit(digits_run(protocol, clients=5, rounds=1), canaries=40, seed=0)
    assert audited.claimed is not None and audited.claimed > 0
    assert audited.scale == 0.5 and audited.scale_from == "the protocol's clipping bound"
    assert audited.bound.epsilon <= audited.claimed
    assert np.mean(audited.inserted_scores) > np.mean(audited.held_out_scores)


def test_mpdp_canaries_send_their_gradient_through_the_perturbed_model() -> None:
    """mpdp's clients compute closed-form terms of their data; a canary sends its fixed gradient
    with every correction zero, and the server's recovery moves the model along it."""
    protocol = {"name": "mpdp", "mpdp": {"clippingNorm": 1.0, "clientNoiseStd": 0.001}}
    training = {
        "localEpochs": 1,
        "batchSize": 32,
        "loss": "MSE",
        "optimizer": {"kind": "SGD", "learningRate": 0.1},
    }
    model = {"kind": "MLP", "hidden": [16], "dtype": "float64", "bias": False}
    run = digits_run(protocol, clients=4, rounds=2, model=model, training=training)
    audit = run_canary_audit(run, canaries=40, seed=0)
    assert audit.claimed is not None
    assert min(audit.inserted_scores) > max(audit.held_out_scores)  # nearly no noise: apart


def test_a_protocol_without_a_dp_claim_gets_the_estimate_labelled_as_such() -> None:
    audit = run_canary_audit(digits_run({"name": "fedavg"}), canaries=40, seed=0)
    assert audit.claimed is None and audit.verdict == "no DP claim"
    assert audit.scale_from.startswith("client 0's first update")
    assert min(audit.inserted_scores) > max(audit.held_out_scores)
    assert audit.estimate.epsilon > 5


@pytest.mark.parametrize(
    ("name", "why"),
    [("perturb", "closed-form terms"), ("lppa", "decentralized")],
)
def test_protocols_no_canary_can_probe_are_refused_naming_why(name: str, why: str) -> None:
    run = digits_run({"name": "fedavg"})
    spec = run.spec.model_copy(
        update={"protocol": run.spec.protocol.model_copy(update={"name": name})}
    )
    with pytest.raises(ValueError, match=why):
        check_canaries(spec, 200)
    with pytest.raises(ValueError, match="at least 4"):
        check_canaries(run.spec, 3)


# ----------------------------------------------------------------------------- the report


def test_the_report_puts_the_measured_epsilon_beside_the_claimed_one(tmp_path: Path) -> None:
    # Execute
    report = run_audit(dp_fedavg_run(), tmp_path / "audit", attacks=[], canaries=60)
    # Assert
    assert isinstance(report.canary, CanaryAudit)
    text = (tmp_path / "audit" / "report.md").read_text()
    assert "## Canaries: a measured ε beside the claimed ε" in text
    assert f"| claimed (accountant) | {report.canary.claimed:.3g} |" in text
    assert "How far apart: the claimed ε is" in text
    assert (tmp_path / "audit" / "figures" / "canary-scores.png").stat().st_size > 1000
    assert report.as_json()["canary"]["verdict"] == "consistent"


def test_the_cli_runs_the_canaries_alone_and_refuses_what_it_cannot_probe(tmp_path: Path) -> None:
    # Prepare
    import yaml

    manifest = tmp_path / "run.yaml"
    manifest.write_text(
        yaml.safe_dump(dp_fedavg_run().model_dump(by_alias=True, exclude_none=True))
    )
    perturb = EXAMPLES / "digits-perturb.yaml"
    runner = CliRunner()
    # Execute
    done = runner.invoke(
        main,
        [
            "audit",
            str(manifest),
            "--canaries",
            "40",
            "--attacks",
            "none",
            "--out",
            str(tmp_path / "a"),
        ],
    )
    refused = runner.invoke(main, ["audit", str(perturb), "--canaries", "40", "--attacks", "none"])
    # Assert
    assert done.exit_code == 0, done.output
    assert "canaries: one-run lower bound" in done.output and "consistent" in done.output
    assert refused.exit_code == 2
    assert "--canaries" in refused.output and "closed-form terms" in refused.output

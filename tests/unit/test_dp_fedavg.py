"""dp-fedavg in one process: clipping and noise helpers, the server step, state, the protocol."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest

from fedcore.errors import ProtocolError
from fedcore.privacy import (
    clip_by_global_norm,
    create_accountant,
    gaussian_noise_like,
    global_norm,
    noise_generator,
)
from fedcore.privacy.sampling import sampling_rate
from fedcore.protocols import DpFedAvg, create_protocol, registered_protocols
from fedcore.protocols.dp_fedavg import DpFedAvgServer, expected_clients
from fedcore.protocols.fedavg.protocol import LocalTrainingClient, ModelAveragingServer
from fedcore.spec import load_manifest
from fedcore.transport import Payload

MANIFEST = """
apiVersion: fedcore.dev/v1alpha1
kind: FederatedRun
metadata: {name: unit}
spec:
  protocol:
    name: dp-fedavg
    dpFedavg: {clippingNorm: %(clip)s, noiseMultiplier: %(z)s, secureNoise: %(secure)s}
  model: {kind: MLP, hidden: [16], dtype: float64}
  clients: {count: %(count)s, perRound: "%(per_round)s"}
  rounds: 5
  seed: 11
"""


def spec_for(
    *, clip: float = 1.0, z: float = 1.0, secure: bool = False, count: int = 4, per_round="100%"
):
    text = MANIFEST % {
        "clip": clip,
        "z": z,
        "secure": str(secure).lower(),
        "count": count,
        "per_round": per_round,
    }
    return load_manifest("unit", text=text).spec


def float64_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=(4,))}


def upload_of(weights: dict[str, np.ndarray], examples: int = 10, loss: float = 1.0) -> Payload:
    return Payload(meta={"num_examples": examples, "loss": loss}, tensors=weights)


def insecure_server(initial: dict[str, np.ndarray], **changes) -> DpFedAvgServer:
    arguments = {
        "clipping_norm": 1.0,
        "noise_multiplier": 1.0,
        "expected_clients": 3,
        "secure_noise": False,
        "seed": 7,
        **changes,
    }
    with pytest.warns(UserWarning, match="for tests only"):
        return DpFedAvgServer(initial, **arguments)


def hand_step(
    initial: dict[str, np.ndarray],
    models: dict[int, dict[str, np.ndarray]],
    *,
    clip: float,
    z: float,
    m: int,
    seed: int,
    round: int,
) -> dict[str, np.ndarray]:
    """One DP-FedAvg step written out: clip each update, sum, divide by m, add the noise."""
    total = {name: np.zeros_like(value) for name, value in initial.items()}
    for k in sorted(models):
        update = {name: models[k][name] - initial[name] for name in initial}
        norm = math.sqrt(sum(float(np.sum(u * u)) for u in update.values()))
        scale = clip / norm if norm > clip else 1.0
        total = {name: total[name] + scale * update[name] for name in initial}
    rng = np.random.default_rng([seed, round, 0xD9FA])
    noise = {name: rng.normal(0.0, z * clip / m, size=value.shape) for name, value in total.items()}
    return {name: initial[name] + total[name] / m + noise[name] for name in initial}


# ------------------------------------------------------------------------------- clipping


def test_clip_by_global_norm_above_bound_scales_to_exactly_bound() -> None:
    # Prepare
    tensors = {"a": np.full((2, 3), 2.0), "b": np.array([3.0, -4.0])}
    # Execute
    clipped, norm = clip_by_global_norm(tensors, 1.5)
    # Assert
    assert norm == pytest.approx(math.sqrt(6 * 4 + 9 + 16), rel=1e-15)
    assert global_norm(clipped) == pytest.approx(1.5, rel=1e-12)
    np.testing.assert_allclose(clipped["b"], tensors["b"] * 1.5 / norm, rtol=1e-15)
    assert list(clipped) == ["a", "b"]


def test_clip_by_global_norm_below_bound_returns_unchanged_copies() -> None:
    # Prepare
    tensors = {"a": np.array([[0.3, -0.4]]), "b": np.array([0.0])}
    # Execute
    clipped, norm = clip_by_global_norm(tensors, 1.0)
    # Assert
    assert norm == pytest.approx(0.5)
    np.testing.assert_array_equal(clipped["a"], tensors["a"])
    assert clipped["a"] is not tensors["a"]
    clipped["a"][0, 0] = 9.0
    assert tensors["a"][0, 0] == 0.3


def test_clip_by_global_norm_above_bound_leaves_input_untouched_and_keeps_dtype() -> None:
    # Prepare
    tensors = {"w": np.full((10,), 3.0, dtype=np.float32)}
    before = tensors["w"].copy()
    # Execute
    clipped, _ = clip_by_global_norm(tensors, 1.0)
    # Assert
    assert clipped["w"].dtype == np.float32
    assert float(np.linalg.norm(clipped["w"].astype(np.float64))) == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_array_equal(tensors["w"], before)


def test_clip_by_global_norm_zero_update_is_unchanged() -> None:
    # Execute
    clipped, norm = clip_by_global_norm({"a": np.zeros(3)}, 1.0)
    # Assert
    assert norm == 0.0
    np.testing.assert_array_equal(clipped["a"], np.zeros(3))


@pytest.mark.parametrize("bound", [0.0, -1.0, math.inf, math.nan])
def test_clip_by_global_norm_bad_bound_is_refused(bound: float) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="clipping bound must be positive and finite"):
        clip_by_global_norm({"a": np.ones(2)}, bound)


def test_clip_by_global_norm_non_finite_tensor_is_refused() -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match=r"\['b'\] hold NaN"):
        clip_by_global_norm({"a": np.ones(2), "b": np.array([np.nan])}, 1.0)


# ---------------------------------------------------------------------------------- noise


def test_gaussian_noise_like_large_tensor_has_the_asked_mean_and_std() -> None:
    # Prepare
    shapes = {"a": np.zeros((400, 500), dtype=np.float32), "b": np.zeros(100_000)}
    rng = np.random.default_rng(0)
    # Execute
    noise = gaussian_noise_like(shapes, 0.25, rng)
    # Assert
    assert noise["a"].shape == (400, 500) and noise["a"].dtype == np.float64
    drawn = np.concatenate([noise["a"].ravel(), noise["b"]])
    assert abs(float(drawn.mean())) < 0.25 * 5 / math.sqrt(drawn.size)
    assert float(drawn.std()) == pytest.approx(0.25, rel=0.01)


def test_gaussian_noise_like_zero_std_gives_zeros() -> None:
    # Execute
    noise = gaussian_noise_like({"a": np.ones((2, 2))}, 0.0, np.random.default_rng(1))
    # Assert
    np.testing.assert_array_equal(noise["a"], np.zeros((2, 2)))


@pytest.mark.parametrize("std", [-0.1, math.inf, math.nan])
def test_gaussian_noise_like_bad_std_is_refused(std: float) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="standard deviation must be non-negative"):
        gaussian_noise_like({"a": np.ones(2)}, std, np.random.default_rng(0))


def test_noise_generator_seeded_is_reproducible_per_seed_and_round() -> None:
    # Prepare
    shapes = {"a": np.zeros((5, 5))}
    # Execute
    first = gaussian_noise_like(shapes, 1.0, noise_generator(secure=False, seed=3, round=2))
    again = gaussian_noise_like(shapes, 1.0, noise_generator(secure=False, seed=3, round=2))
    other_round = gaussian_noise_like(shapes, 1.0, noise_generator(secure=False, seed=3, round=3))
    # Assert
    np.testing.assert_array_equal(first["a"], again["a"])
    assert not np.array_equal(first["a"], other_round["a"])


def test_noise_generator_secure_is_not_reproducible() -> None:
    # Prepare
    shapes = {"a": np.zeros((5, 5))}
    # Execute
    first = gaussian_noise_like(shapes, 1.0, noise_generator(secure=True, seed=3, round=2))
    second = gaussian_noise_like(shapes, 1.0, noise_generator(secure=True, seed=3, round=2))
    # Assert
    assert not np.array_equal(first["a"], second["a"])


def test_noise_generator_negative_seed_is_refused() -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="got -1, 2 and"):
        noise_generator(secure=False, seed=-1, round=2)


# ----------------------------------------------------------------------------- the server


def test_dp_fedavg_combine_equals_hand_computation_in_float64() -> None:
    # Prepare: one update far above C, one below, one exactly at the global model.
    rng = np.random.default_rng(1)
    initial = float64_weights(rng)
    models = {
        0: {name: value + 5.0 for name, value in initial.items()},
        2: {name: value + 0.01 * rng.normal(size=value.shape) for name, value in initial.items()},
        5: {name: value.copy() for name, value in initial.items()},
    }
    server = insecure_server(initial, clipping_norm=0.8, noise_multiplier=1.3, expected_clients=4)
    # Execute
    result = server.combine(3, {k: upload_of(v, loss=float(k)) for k, v in models.items()}, [1])
    # Assert
    expected = hand_step(initial, models, clip=0.8, z=1.3, m=4, seed=7, round=3)
    for name in ("a", "b"):
        np.testing.assert_allclose(
            server.global_weights()[name], expected[name], rtol=0, atol=1e-12
        )
    assert result.participants == 3
    assert result.train_loss == pytest.approx((0 + 2 + 5) / 3)
    assert result.metrics == {"clipped_fraction": pytest.approx(1 / 3)}
    assert server.noise_std == pytest.approx(1.3 * 0.8 / 4)


def test_dp_fedavg_combine_tiny_noise_huge_clip_equals_fedavg_uniform() -> None:
    # Prepare: all 4 clients sampled, so the fixed denominator is 4, as fedavg's count.
    spec = spec_for(clip=1e6, z=1e-20, count=4)
    rng = np.random.default_rng(2)
    initial = float64_weights(rng)
    models = {k: float64_weights(rng) for k in range(4)}
    with pytest.warns(UserWarning, match="for tests only"):
        dp = DpFedAvg().create_server(spec, initial)
    plain = ModelAveragingServer(initial, weighting="Uniform")
    # Execute
    dp.combine(1, {k: upload_of(v, examples=1 + 50 * k) for k, v in models.items()}, [])
    plain.combine(1, {k: upload_of(v, examples=1 + 50 * k) for k, v in models.items()}, [])
    # Assert
    for name in ("a", "b"):
        np.testing.assert_allclose(
            dp.global_weights()[name], plain.global_weights()[name], rtol=0, atol=1e-12
        )


def test_dp_fedavg_combine_with_a_dropout_keeps_the_fixed_denominator() -> None:
    # Prepare
    initial = {"w": np.zeros(3)}
    server = insecure_server(initial, clipping_norm=1e6, noise_multiplier=1e-20, expected_clients=2)
    # Execute
    server.combine(1, {0: upload_of({"w": np.array([2.0, 4.0, 6.0])})}, [1])
    # Assert: the one update is divided by m = 2, not by the one upload that came.
    np.testing.assert_allclose(server.global_weights()["w"], [1.0, 2.0, 3.0], atol=1e-12)


def test_dp_fedavg_combine_without_uploads_still_adds_the_noise() -> None:
    # Prepare
    initial = {"w": np.zeros(1000)}
    server = insecure_server(initial, clipping_norm=2.0, noise_multiplier=1.0, expected_clients=4)
    # Execute
    result = server.combine(1, {}, [0, 1, 2, 3])
    # Assert
    assert result.participants == 0 and result.train_loss is None
    assert float(np.std(server.global_weights()["w"])) == pytest.approx(0.5, rel=0.1)


def test_dp_fedavg_combine_more_uploads_than_m_is_refused() -> None:
    # Prepare
    initial = {"w": np.zeros(2)}
    server = insecure_server(initial, expected_clients=1)
    # Execute / Assert
    with pytest.raises(ProtocolError, match="2 uploads, more than the 1 clients"):
        server.combine(1, {0: upload_of({"w": np.ones(2)}), 1: upload_of({"w": np.ones(2)})}, [])


def test_dp_fedavg_combine_float32_model_keeps_dtype_and_never_mutates_inputs() -> None:
    # Prepare
    initial = {"w": np.ones((4, 4), dtype=np.float32), "steps": np.array(3, dtype=np.int64)}
    upload = {"w": np.full((4, 4), 2.0, dtype=np.float32), "steps": np.array(9, dtype=np.int64)}
    server = insecure_server(initial, clipping_norm=0.5, expected_clients=1)
    before = server.global_weights()
    kept = {name: value.copy() for name, value in before.items()}
    # Execute
    server.combine(1, {0: upload_of(upload)}, [])
    # Assert
    after = server.global_weights()
    assert after["w"].dtype == np.float32
    assert after["steps"] == 3, "a non-floating tensor keeps the global model's value"
    np.testing.assert_array_equal(before["w"], kept["w"])
    np.testing.assert_array_equal(upload["w"], np.full((4, 4), 2.0, dtype=np.float32))
    noise = gaussian_noise_like(
        {"w": kept["w"]}, 0.5, noise_generator(secure=False, seed=7, round=1)
    )
    expected = (1.0 + (0.5 / 4.0 + noise["w"])).astype(np.float32)  # update of norm 4 -> 0.5
    np.testing.assert_array_equal(after["w"], expected)


def test_dp_fedavg_secure_noise_differs_between_identical_servers() -> None:
    # Prepare
    initial = {"w": np.zeros(50)}
    first = DpFedAvgServer(
        initial, clipping_norm=1, noise_multiplier=1, expected_clients=1, secure_noise=True, seed=0
    )
    second = DpFedAvgServer(
        initial, clipping_norm=1, noise_multiplier=1, expected_clients=1, secure_noise=True, seed=0
    )
    # Execute
    first.combine(1, {0: upload_of({"w": np.ones(50)})}, [])
    second.combine(1, {0: upload_of({"w": np.ones(50)})}, [])
    # Assert
    assert not np.array_equal(first.global_weights()["w"], second.global_weights()["w"])


def test_dp_fedavg_state_dict_resume_equals_the_uninterrupted_run_bit_for_bit() -> None:
    # Prepare
    rng = np.random.default_rng(9)
    initial = float64_weights(rng)
    rounds = {r: {k: upload_of(float64_weights(rng)) for k in range(3)} for r in (1, 2, 3)}
    uninterrupted = insecure_server(initial)
    stopped = insecure_server(initial)
    for r in (1, 2, 3):
        uninterrupted.combine(r, rounds[r], [])
    stopped.combine(1, rounds[1], [])
    # Execute
    resumed = insecure_server({name: np.zeros_like(v) for name, v in initial.items()})
    resumed.load_state_dict(stopped.state_dict())
    for r in (2, 3):
        resumed.combine(r, rounds[r], [])
    # Assert
    for name in initial:
        np.testing.assert_array_equal(
            resumed.global_weights()[name], uninterrupted.global_weights()[name]
        )
    assert stopped.state_dict()["kind"] == "dp-fedavg"


def test_dp_fedavg_load_state_dict_of_another_protocol_is_refused() -> None:
    # Prepare
    initial = {"w": np.zeros(2)}
    server = insecure_server(initial)
    fedavg_state = ModelAveragingServer(initial, weighting="Uniform").state_dict()
    # Execute / Assert
    with pytest.raises(ValueError, match="kind 'fedavg', not 'dp-fedavg'"):
        server.load_state_dict(fedavg_state)
    with pytest.raises(ValueError, match="no key 'weights'"):
        server.load_state_dict({"kind": "dp-fedavg", "version": 1})


def test_dp_fedavg_check_upload_rejects_a_malformed_model() -> None:
    # Prepare
    server = insecure_server({"w": np.zeros(2)})
    # Execute / Assert
    with pytest.raises(ProtocolError, match="client 4 in round 2"):
        server.check_upload(2, 4, upload_of({"w": np.zeros(3)}))


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"clipping_norm": 0.0}, "clipping norm must be positive and finite, got 0.0"),
        ({"clipping_norm": math.inf}, "clipping norm must be positive and finite, got inf"),
        ({"noise_multiplier": 0.0}, "noise multiplier must be positive and finite, got 0.0"),
        ({"noise_multiplier": -1.0}, "noise multiplier must be positive and finite, got -1.0"),
        ({"expected_clients": 0}, "expected clients per round must be at least 1, got 0"),
        ({"seed": -2}, "seed must be non-negative, got -2"),
    ],
)
def test_dp_fedavg_server_bad_arguments_are_refused(changes: dict, fragment: str) -> None:
    # Prepare
    arguments = {
        "clipping_norm": 1.0,
        "noise_multiplier": 1.0,
        "expected_clients": 3,
        "secure_noise": True,
        "seed": 0,
        **changes,
    }
    # Execute / Assert
    with pytest.raises(ValueError, match=fragment):
        DpFedAvgServer({"w": np.zeros(2)}, **arguments)


# --------------------------------------------------------------------------- the protocol


def test_dp_fedavg_protocol_is_registered_with_its_noise_multiplier_and_client() -> None:
    # Prepare
    spec = spec_for(z=1.7, count=10, per_round="30%")
    # Execute
    protocol = create_protocol("dp-fedavg")
    # Assert
    assert "dp-fedavg" in registered_protocols()
    assert isinstance(protocol, DpFedAvg)
    assert protocol.noise_multiplier(spec) == 1.7
    assert protocol.facts.claims_dp and protocol.facts.dropout_policy == "Skip"
    assert isinstance(protocol.create_client(spec, 0), LocalTrainingClient)
    assert expected_clients(spec) == 3


def test_dp_fedavg_protocol_secure_noise_server_does_not_warn() -> None:
    # Prepare
    spec = spec_for(secure=True)
    # Execute
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        server = DpFedAvg().create_server(spec, {"w": np.zeros(2)})
    # Assert
    assert isinstance(server, DpFedAvgServer)


def test_dp_fedavg_example_manifest_spends_just_under_its_budget() -> None:
    # Prepare
    run = load_manifest(Path(__file__).resolve().parents[2] / "examples" / "digits-dpfedavg.yaml")
    spec = run.spec
    assert spec.privacy is not None and spec.privacy.target_epsilon is not None
    accountant = create_accountant(spec.privacy.accountant)
    z = DpFedAvg().noise_multiplier(spec)
    # Execute
    accountant.step(noise_multiplier=z, sample_rate=sampling_rate(spec.clients), steps=spec.rounds)
    spent = accountant.get_epsilon(spec.privacy.target_delta)
    one_more = accountant.epsilon_after(
        spec.privacy.target_delta, noise_multiplier=z, sample_rate=sampling_rate(spec.clients)
    )
    # Assert: the numbers docs/protocols/dp-fedavg.md reports.
    assert spent == pytest.approx(15.6428, abs=1e-4)
    assert spent <= spec.privacy.target_epsilon < one_more

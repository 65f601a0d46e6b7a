"""Protocol maths in one process: fedavg, fedsgd, the registry, and upload checks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from fedcore.errors import ProtocolError
from fedcore.learning.data import ArrayDataset
from fedcore.learning.models import build_model, get_weights
from fedcore.learning.training import LocalLearner
from fedcore.protocols import (
    FedAvg,
    FedSgd,
    Protocol,
    create_protocol,
    register_protocol,
    registered_protocols,
)
from fedcore.protocols.fedavg.protocol import ModelAveragingServer
from fedcore.spec import load_manifest
from fedcore.transport import Payload

MANIFEST = """
apiVersion: fedcore.dev/v1alpha1
kind: FederatedRun
metadata: {name: unit}
spec:
  protocol: {name: %(protocol)s, %(protocol)s: {weighting: %(weighting)s}}
  model: {kind: MLP, hidden: [16], dtype: float64}
  clients: {count: 4}
  rounds: 5
  training: {batchSize: 32, optimizer: {kind: SGD, learningRate: 0.5}}
"""


def spec_for(protocol: str, weighting: str = "ShardSize"):
    return load_manifest(
        "unit", text=MANIFEST % {"protocol": protocol, "weighting": weighting}
    ).spec


def float64_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=(4,))}


def upload_of(weights: dict[str, np.ndarray], examples: int, loss: float = 1.0) -> Payload:
    return Payload(meta={"num_examples": examples, "loss": loss}, tensors=weights)


def test_fedavg_combine_equals_hand_computed_weighted_mean() -> None:
    # Prepare
    rng = np.random.default_rng(1)
    server = ModelAveragingServer(float64_weights(rng), weighting="ShardSize")
    models = {k: float64_weights(rng) for k in range(3)}
    sizes = {0: 10, 1: 30, 2: 60}
    losses = {0: 1.0, 1: 2.0, 2: 4.0}
    # Execute
    result = server.combine(1, {k: upload_of(models[k], sizes[k], losses[k]) for k in models}, [])
    # Assert
    for name in ("a", "b"):
        expected = (10 * models[0][name] + 30 * models[1][name] + 60 * models[2][name]) / 100
        np.testing.assert_allclose(server.global_weights()[name], expected, rtol=0, atol=1e-12)
    assert result is not None
    assert result.participants == 3
    assert result.train_loss == pytest.approx((10 * 1 + 30 * 2 + 60 * 4) / 100)


def test_fedavg_combine_uniform_weighting_is_plain_mean() -> None:
    # Prepare
    rng = np.random.default_rng(2)
    server = ModelAveragingServer(float64_weights(rng), weighting="Uniform")
    models = [float64_weights(rng) for _ in range(4)]
    # Execute
    server.combine(1, {k: upload_of(m, 5 + 100 * k) for k, m in enumerate(models)}, [3])
    # Assert
    expected = sum(m["a"] for m in models) / 4
    np.testing.assert_allclose(server.global_weights()["a"], expected, rtol=0, atol=1e-12)


def test_fedavg_combine_keeps_dtype_of_float32_model() -> None:
    # Prepare
    weights = {"w": np.ones((2, 2), dtype=np.float32)}
    server = ModelAveragingServer(weights, weighting="ShardSize")
    # Execute
    server.combine(1, {0: upload_of({"w": np.full((2, 2), 3, np.float32)}, 1)}, [])
    # Assert
    assert server.global_weights()["w"].dtype == np.float32
    assert np.all(server.global_weights()["w"] == 3)


def test_fedavg_combine_without_uploads_keeps_state() -> None:
    # Prepare
    rng = np.random.default_rng(3)
    initial = float64_weights(rng)
    server = ModelAveragingServer(initial, weighting="ShardSize")
    # Execute
    result = server.combine(1, {}, [0, 1])
    # Assert
    assert result is None
    np.testing.assert_array_equal(server.global_weights()["a"], initial["a"])


@pytest.mark.parametrize(
    ("tensors", "meta", "fragment"),
    [
        ({"a": np.zeros((3, 4))}, {"num_examples": 1}, "missing ['b']"),
        (
            {"a": np.zeros((3, 4)), "b": np.zeros(4), "c": np.zeros(1)},
            {"num_examples": 1},
            "extra ['c']",
        ),
        ({"a": np.zeros((4, 3)), "b": np.zeros(4)}, {"num_examples": 1}, "expected float64[3, 4]"),
        (
            {"a": np.zeros((3, 4), np.float32), "b": np.zeros(4)},
            {"num_examples": 1},
            "float32[3, 4]",
        ),
        ({"a": np.full((3, 4), np.nan), "b": np.zeros(4)}, {"num_examples": 1}, "NaN"),
        ({"a": np.zeros((3, 4)), "b": np.zeros(4)}, {"num_examples": 0}, "num_examples=0"),
        ({"a": np.zeros((3, 4)), "b": np.zeros(4)}, {"num_examples": True}, "num_examples=True"),
        ({"a": np.zeros((3, 4)), "b": np.zeros(4)}, {}, "num_examples=None"),
    ],
)
def test_model_averaging_check_upload_rejects_malformed_upload(tensors, meta, fragment) -> None:
    # Prepare
    server = ModelAveragingServer(float64_weights(np.random.default_rng(4)), weighting="ShardSize")
    # Execute / Assert
    with pytest.raises(ProtocolError, match=None) as caught:
        server.check_upload(2, 7, Payload(meta=meta, tensors=tensors))
    assert fragment in str(caught.value)
    assert "client 7" in str(caught.value)


def test_fedavg_state_dict_round_trip_and_kind_check() -> None:
    # Prepare
    rng = np.random.default_rng(5)
    first = ModelAveragingServer(float64_weights(rng), weighting="ShardSize")
    second = ModelAveragingServer(float64_weights(rng), weighting="ShardSize")
    # Execute
    second.load_state_dict(first.state_dict())
    # Assert
    np.testing.assert_array_equal(second.global_weights()["b"], first.global_weights()["b"])
    with pytest.raises(ValueError, match="kind 'fedsgd'"):
        second.load_state_dict({**first.state_dict(), "kind": "fedsgd"})
    with pytest.raises(ValueError, match="no key 'weights'"):
        second.load_state_dict({"kind": "fedavg", "version": 1})


def digits_shards(count: int, size: int) -> list[ArrayDataset]:
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).reshape(-1, 1, 8, 8).astype(np.float32)
    return [
        ArrayDataset(
            x=x[k * size : (k + 1) * size],
            y=y[k * size : (k + 1) * size].astype(np.int64),
            num_classes=10,
        )
        for k in range(count)
    ]


def run_protocol(spec, shards: list[ArrayDataset], rounds: int) -> dict[str, np.ndarray]:
    protocol = create_protocol(spec.protocol.name)
    model = build_model(spec.model, (1, 8, 8), 10, seed=spec.seed)
    server = protocol.create_server(spec, get_weights(model))
    learners = [
        LocalLearner(
            build_model(spec.model, (1, 8, 8), 10, seed=spec.seed),
            shard,
            spec.training,
            seed=spec.seed,
            client_index=k,
        )
        for k, shard in enumerate(shards)
    ]
    clients = [protocol.create_client(spec, k) for k in range(len(shards))]
    for round_ in range(1, rounds + 1):
        plans = server.plan_round(round_, list(range(len(shards))))
        uploads = {k: clients[k].compute_upload(round_, plans[k], learners[k], None) for k in plans}
        for k, upload in uploads.items():
            server.check_upload(round_, k, upload)
        server.combine(round_, uploads, [])
    return server.global_weights()


def centralized_gradient_descent(spec, shards: list[ArrayDataset], rounds: int):
    model = build_model(spec.model, (1, 8, 8), 10, seed=spec.seed)
    x = torch.from_numpy(np.concatenate([s.x for s in shards])).double()
    y = torch.from_numpy(np.concatenate([s.y for s in shards]))
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.training.optimizer.learning_rate)
    for _ in range(rounds):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return get_weights(model)


@pytest.mark.parametrize("weighting", ["ShardSize", "Uniform"])
def test_fedsgd_equals_centralized_gradient_descent_on_equal_shards(weighting: str) -> None:
    # Prepare
    spec = spec_for("fedsgd", weighting)
    shards = digits_shards(4, 100)
    # Execute
    federated = run_protocol(spec, shards, rounds=5)
    central = centralized_gradient_descent(spec, shards, rounds=5)
    # Assert
    for name, value in central.items():
        np.testing.assert_allclose(federated[name], value, rtol=0, atol=1e-9)
    initial = get_weights(build_model(spec.model, (1, 8, 8), 10, seed=spec.seed))
    assert not np.allclose(federated["1.weight"], initial["1.weight"])  # it did train


def test_fedsgd_shard_size_weighting_equals_centralized_on_unequal_shards() -> None:
    # Prepare
    spec = spec_for("fedsgd")
    x_shards = digits_shards(1, 400)[0]
    cuts = [0, 50, 150, 400]
    shards = [x_shards.subset(np.arange(a, b)) for a, b in itertools.pairwise(cuts)]
    # Execute
    federated = run_protocol(spec, shards, rounds=3)
    central = centralized_gradient_descent(spec, shards, rounds=3)
    # Assert
    for name, value in central.items():
        np.testing.assert_allclose(federated[name], value, rtol=0, atol=1e-9)


def test_fedavg_one_client_equals_its_local_training() -> None:
    # Prepare
    spec = spec_for("fedavg")
    shard = digits_shards(1, 200)
    learner = LocalLearner(
        build_model(spec.model, (1, 8, 8), 10, seed=spec.seed),
        shard[0],
        spec.training,
        seed=spec.seed,
        client_index=0,
    )
    initial = get_weights(build_model(spec.model, (1, 8, 8), 10, seed=spec.seed))
    # Execute
    federated = run_protocol(spec, shard, rounds=1)
    local, _ = learner.train(initial, round=1)
    # Assert
    for name, value in local.items():
        np.testing.assert_allclose(federated[name], value, rtol=0, atol=1e-12)


def test_registry_knows_baselines_and_refuses_unknown_and_duplicate_names() -> None:
    # Prepare / Execute
    names = registered_protocols()
    # Assert
    assert {"fedavg", "fedsgd"} <= set(names)
    assert isinstance(create_protocol("fedavg"), FedAvg)
    assert isinstance(create_protocol("fedsgd"), FedSgd)
    with pytest.raises(ValueError, match="Unknown protocol 'nope'; registered protocols: "):
        create_protocol("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_protocol("fedavg", FedAvg)


def test_baselines_have_no_kdc() -> None:
    # Prepare
    spec = spec_for("fedavg")
    # Execute
    protocols: list[Protocol] = [FedAvg(), FedSgd()]
    # Assert
    for protocol in protocols:
        assert protocol.create_kdc(spec) is None
        assert protocol.facts.needs_kdc is False

"""The robust aggregation rules against known answers, and fedavg running them (and IFCA)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedcore.errors import ProtocolError
from fedcore.protocols._maths import cluster_name
from fedcore.protocols.fedavg import aggregators
from fedcore.protocols.fedavg.robust import RobustAveragingServer, RobustTrainingClient
from fedcore.spec._options import FedAvgOptions
from fedcore.transport import Payload

UPDATES = [np.array([1.0, 5.0]), np.array([2.0, 3.0]), np.array([10.0, 4.0])]


def test_mean_and_weighted_mean() -> None:
    np.testing.assert_allclose(aggregators.mean(UPDATES), [13 / 3, 4.0])
    np.testing.assert_allclose(aggregators.mean(UPDATES, [1, 1, 2]), [23 / 4, 16 / 4])
    with pytest.raises(ProtocolError):
        aggregators.mean(UPDATES, [0, 0, 0])


def test_median_is_coordinate_wise() -> None:
    np.testing.assert_allclose(aggregators.median(UPDATES), [2.0, 4.0])
    np.testing.assert_allclose(aggregators.median(UPDATES[:2]), [1.5, 4.0])


def test_trimmed_mean_drops_k_of_each_end_per_coordinate() -> None:
    # Prepare: 5 updates, trim 0.2 -> k = 1
    updates = [np.array([v, -v]) for v in (1.0, 2.0, 3.0, 4.0, 100.0)]
    # Execute / Assert
    np.testing.assert_allclose(aggregators.trimmed_mean(updates, 0.2), [3.0, -3.0])
    np.testing.assert_allclose(aggregators.trimmed_mean(updates, 0.0), [22.0, -22.0])
    np.testing.assert_allclose(aggregators.trimmed_mean(updates[:2], 0.49), [1.5, -1.5])  # k = 0
    with pytest.raises(ProtocolError):
        aggregators.trimmed_mean(updates, 0.5)


def test_krum_picks_the_update_closest_to_its_neighbours() -> None:
    # Prepare: three close updates and one outlier; n - f - 2 = 2 neighbours with f = 0
    updates = [
        np.array([0.0, 0.0]),
        np.array([1.0, 0.0]),
        np.array([0.0, 2.0]),
        np.array([9.0, 9.0]),
    ]
    # Execute
    scores = aggregators.krum_scores(updates, 0)
    chosen, update = aggregators.krum(updates, 0)
    # Assert: squared distances: 0 -> {1, 4, 162}: 1 + 4 = 5; 1 -> {1, 5, 145}: 6;
    # 2 -> {4, 5, 130}: 9; 3 -> {162, 145, 130}: 275
    np.testing.assert_allclose(scores, [5.0, 6.0, 9.0, 275.0])
    assert chosen == 0 and np.array_equal(update, [0.0, 0.0])
    with pytest.raises(ProtocolError, match="f \\+ 3"):
        aggregators.krum(updates, 2)


def test_fltrust_weights_by_relu_cosine_and_rescales_to_the_server_norm() -> None:
    # Prepare: g0 = (2, 0); one aligned, one at 60 degrees, one opposed (score 0)
    g0 = np.array([2.0, 0.0])
    updates = [np.array([5.0, 0.0]), np.array([1.0, np.sqrt(3.0)]), np.array([-3.0, 0.0])]
    # Execute
    scores = aggregators.trust_scores(updates, g0)
    found = aggregators.fltrust(updates, g0)
    # Assert: TS = (1, 0.5, 0); rescaled (2, 0) and (1, sqrt 3); weighted mean / 1.5
    np.testing.assert_allclose(scores, [1.0, 0.5, 0.0])
    np.testing.assert_allclose(found, [(2 + 0.5) / 1.5, (0.5 * np.sqrt(3)) / 1.5])
    np.testing.assert_allclose(aggregators.fltrust([-u for u in updates[:2]], g0), [0.0, 0.0])


def test_rfca_is_fltrust_per_cluster_with_one_global_normaliser() -> None:
    # Prepare: two clusters; client 2 opposes its cluster's g0
    g0 = np.array([[1.0, 0.0], [0.0, 1.0]])
    units = [np.array([0.6, 0.8]), np.array([0.0, 1.0]), np.array([-1.0, 0.0])]
    # Execute
    found, scores, total = aggregators.rfca(units, [0, 1, 0], g0)
    # Assert: w = (0.6, 1, -1), W = 1.6
    np.testing.assert_allclose(scores, [0.6, 1.0, -1.0])
    assert total == pytest.approx(1.6)
    np.testing.assert_allclose(found[0], 0.6 / 1.6 * units[0])
    np.testing.assert_allclose(found[1], 1.0 / 1.6 * units[1])


def test_aggregate_dispatches_by_name_and_refuses_unknown_ones() -> None:
    np.testing.assert_allclose(aggregators.aggregate("Median", UPDATES), [2.0, 4.0])
    with pytest.raises(ProtocolError, match="Unknown aggregator"):
        aggregators.aggregate("Bulyan", UPDATES)
    with pytest.raises(ProtocolError, match="server's update"):
        aggregators.aggregate("FLTrust", UPDATES)


# ------------------------------------------------------------------ fedavg with them


def upload(weights: dict[str, np.ndarray], examples: int = 10, **meta: Any) -> Payload:
    return Payload(meta={"num_examples": examples, "loss": 0.5, **meta}, tensors=weights)


def test_fedavg_median_moves_the_model_by_the_median_update() -> None:
    # Prepare
    initial = {"w": np.zeros(2, dtype=np.float64)}
    server = RobustAveragingServer(initial, options=FedAvgOptions(aggregator="Median"))
    uploads = {k: upload({"w": u}) for k, u in enumerate(UPDATES)}
    # Execute
    server.plan_round(1, [0, 1, 2])
    result = server.combine(1, uploads, [])
    # Assert
    np.testing.assert_allclose(server.global_weights()["w"], [2.0, 4.0])
    assert result is not None and result.participants == 3


def test_ifca_aggregates_each_cluster_apart_and_checks_the_named_cluster() -> None:
    # Prepare
    initial = {"w": np.zeros(2, dtype=np.float64)}
    server = RobustAveragingServer(initial, options=FedAvgOptions(clusters=2), seed=1)
    start = [m["w"].copy() for m in server.models()]
    plan = server.plan_round(1, [0, 1, 2])[0]
    uploads = {
        0: upload({"w": start[0] + [1.0, 0.0]}, cluster=0),
        1: upload({"w": start[1] + [0.0, 2.0]}, cluster=1),
        2: upload({"w": start[0] + [3.0, 0.0]}, cluster=0, examples=30),
    }
    # Execute
    for k, u in uploads.items():
        server.check_upload(1, k, u)
    server.combine(1, uploads, [])
    # Assert: cluster 0 takes the shard-weighted mean of its two updates, cluster 1 its own
    assert sorted(plan.tensors) == [cluster_name(0, "w"), cluster_name(1, "w")]
    np.testing.assert_allclose(server.models()[0]["w"], start[0] + [2.5, 0.0])
    np.testing.assert_allclose(server.models()[1]["w"], start[1] + [0.0, 2.0])
    with pytest.raises(ProtocolError, match="names no cluster"):
        server.check_upload(1, 0, upload({"w": start[0]}))
    with pytest.raises(ProtocolError, match="cluster 5"):
        server.check_upload(1, 0, upload({"w": start[0]}, cluster=5))


def test_a_sign_flipping_client_uploads_minus_scale_times_its_update() -> None:
    # Prepare: a learner stub that moves every weight by +1
    class Learner:
        num_examples = 7

        def train(self, weights: dict[str, np.ndarray], *, round: int) -> tuple[Any, Any]:
            from fedcore.learning.training import LocalStats

            return {k: v + 1.0 for k, v in weights.items()}, LocalStats(7, 0.3, 1)

    client = RobustTrainingClient(attack="SignFlip", scale=4.0)
    start = {"w": np.array([1.0, 2.0], dtype=np.float32)}
    # Execute
    found = client.compute_upload(1, Payload(meta={"round": 1}, tensors=start), Learner(), None)  # type: ignore[arg-type]
    # Assert
    np.testing.assert_allclose(found.tensors["w"], [-3.0, -2.0])
    assert found.tensors["w"].dtype == np.float32 and "cluster" not in found.meta


def test_robust_state_round_trips() -> None:
    initial = {"w": np.zeros(3)}
    server = RobustAveragingServer(initial, options=FedAvgOptions(aggregator="Krum", clusters=2))
    other = RobustAveragingServer(
        initial, options=FedAvgOptions(aggregator="Krum", clusters=2), seed=9
    )
    other.load_state_dict(server.state_dict())
    np.testing.assert_array_equal(other.models()[1]["w"], server.models()[1]["w"])
    with pytest.raises(ValueError):
        other.load_state_dict({"kind": "fedavg", "weights": {}})

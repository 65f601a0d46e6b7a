"""Upload bounds (fedcore/protocols/_bounds.py): what one insider's upload may do to the model.

Each case is a finite, well-shaped upload from a client with a valid identity that used to be
accepted: float32-max values, a lie about its example count, a gradient that steps too far.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedcore.errors import AggregateRefused, ProtocolError, UploadRefused
from fedcore.learning.data import client_dataset, shard_sizes
from fedcore.protocols import create_protocol
from fedcore.protocols._bounds import UploadBounds, default_update_norm, step_norm
from fedcore.protocols.fedavg.protocol import ModelAveragingServer
from fedcore.protocols.fedavg.robust import RobustAveragingServer
from fedcore.protocols.fedsgd import GradientStepServer
from fedcore.spec import load_manifest
from fedcore.transport import Payload

MANIFEST = """
apiVersion: fedcore.dev/v1alpha1
kind: FederatedRun
metadata: {name: unit}
spec:
  protocol: {name: fedavg, fedavg: {aggregator: %(aggregator)s}}
  model: {kind: MLP, hidden: [8]}
  clients: {count: 4}
  rounds: 2
%(extra)s
"""


def spec_for(aggregator: str = "Mean", extra: str = ""):
    text = MANIFEST % {"aggregator": aggregator, "extra": f"  {extra}" if extra else ""}
    return load_manifest("unit", text=text).spec


def float32_model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "w": rng.normal(size=(5, 4)).astype(np.float32),
        "b": rng.normal(size=(4,)).astype(np.float32),
    }


def upload(tensors: dict[str, np.ndarray], examples: int, loss: float = 1.0) -> Payload:
    return Payload(meta={"num_examples": examples, "loss": loss}, tensors=tensors)


def near(model: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {n: (v + 0.01 * rng.normal(size=v.shape)).astype(v.dtype) for n, v in model.items()}


def test_default_bound_is_ten_times_the_root_of_the_parameter_count() -> None:
    # Prepare
    model = {"w": np.zeros((5, 4), np.float32), "b": np.zeros(4, np.float32), "n": np.zeros(1, int)}
    # Execute
    bound = default_update_norm(model)
    # Assert: 24 floating-point parameters; the integer buffer does not count
    assert bound == pytest.approx(10 * math.sqrt(24), rel=1e-15)


def test_step_norm_is_the_float64_l2_norm_of_the_change_and_of_a_scaled_gradient() -> None:
    # Prepare
    before = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([0.0], np.float32)}
    after = {"a": np.array([4.0, 6.0], np.float32), "b": np.array([12.0], np.float32)}
    huge = {"a": np.full(2, np.finfo(np.float32).max, np.float32)}
    # Execute
    change = step_norm(after, before)
    scaled = step_norm(after, scale=0.5)
    overflowing = step_norm(huge)
    # Assert: sqrt(9 + 16 + 144) = 13; 0.5 * sqrt(16 + 36 + 144) = 7; float32-max stays finite
    assert change == pytest.approx(13.0, abs=1e-12)
    assert scaled == pytest.approx(7.0, abs=1e-12)
    assert math.isfinite(overflowing) and overflowing > 1e38


def test_a_float32_max_upload_is_refused_and_honest_ones_still_combine() -> None:
    # Prepare: the attack seen on main at edcad46: finite float32-max values passed the
    # finiteness check, and the next round every honest client trained NaN
    rng = np.random.default_rng(3)
    initial = float32_model(rng)
    server = ModelAveragingServer(initial, weighting="Uniform")
    honest = {k: near(initial, rng) for k in (0, 1)}
    hostile = {n: np.full_like(v, np.finfo(np.float32).max) for n, v in initial.items()}
    # Execute
    with pytest.raises(UploadRefused, match=r"client 2 in round 1 moves the model by .* past"):
        server.check_upload(1, 2, upload(hostile, 10))
    for k, model in honest.items():
        server.check_upload(1, k, upload(model, 10))
    server.combine(1, {k: upload(m, 10) for k, m in honest.items()}, failures=[2])
    # Assert: the new model is exactly the honest mean
    for name in initial:
        expected = ((honest[0][name].astype(np.float64) + honest[1][name]) / 2).astype(np.float32)
        np.testing.assert_array_equal(server.global_weights()[name], expected)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_an_upload_with_a_value_that_is_not_finite_is_malformed_naming_its_tensor(
    bad: float,
) -> None:
    # The server finds it through the step norm (finite unless a value is not) and then names
    # the tensor, as the finiteness check before the norm did.
    rng = np.random.default_rng(7)
    initial = float32_model(rng)
    server = ModelAveragingServer(initial, weighting="Uniform", bounds=UploadBounds(1e30))
    tensors = near(initial, rng)
    tensors["b"][2] = bad
    with pytest.raises(ProtocolError, match=r"tensor 'b' holds NaN or infinite values"):
        server.check_upload(1, 0, upload(tensors, 10))
    server.check_upload(1, 1, upload(near(initial, rng), 10))  # an honest one still passes


def test_an_upload_just_past_the_bound_is_refused_and_one_at_it_is_accepted() -> None:
    # Prepare
    initial = {"w": np.zeros(4, np.float64)}
    server = ModelAveragingServer(initial, weighting="Uniform", bounds=UploadBounds(2.0))
    at_bound = {"w": np.array([1.0, 1.0, 1.0, 1.0])}  # norm 2
    past = {"w": np.array([1.0, 1.0, 1.0, 1.0 + 1e-9])}
    # Execute
    server.check_upload(1, 0, upload(at_bound, 5))
    with pytest.raises(UploadRefused, match=r"spec.uploads.maxUpdateNorm"):
        server.check_upload(1, 1, upload(past, 5))


def test_a_gradient_is_bounded_by_the_step_it_takes_at_the_learning_rate() -> None:
    # Prepare: lr 0.5, bound 1: a gradient of norm 2 steps exactly 1, of norm 2.1 steps 1.05
    initial = {"w": np.zeros(2, np.float64)}
    server = GradientStepServer(
        initial, weighting="Uniform", learning_rate=0.5, bounds=UploadBounds(1.0)
    )
    # Execute
    server.check_upload(1, 0, upload({"w": np.array([2.0, 0.0])}, 3))
    with pytest.raises(UploadRefused, match=r"moves the model by 1\.05"):
        server.check_upload(1, 1, upload({"w": np.array([2.1, 0.0])}, 3))


def test_a_claim_past_the_shard_the_server_derives_is_refused() -> None:
    # Prepare: a spec-decided partition: the server knows every shard size
    spec = spec_for()
    sizes = shard_sizes(spec)
    assert sizes is not None and sizes[1] == len(client_dataset(spec, 1))
    initial = float32_model(np.random.default_rng(0))
    server = ModelAveragingServer(initial, weighting="ShardSize")
    server.set_shard_sizes(sizes)
    model = near(initial, np.random.default_rng(1))
    # Execute
    server.check_upload(1, 1, upload(model, sizes[1]))
    server.check_upload(1, 1, upload(model, sizes[1] - 7))  # part of it (adaptive holds out)
    with pytest.raises(UploadRefused, match=rf"claims {sizes[1] + 1} examples; client 1's"):
        server.check_upload(1, 1, upload(model, sizes[1] + 1))


def test_shard_size_weights_are_claims_capped_at_the_shards_the_server_knows() -> None:
    # Prepare: known sizes 10 and 30; client 0 claims more than its shard, client 1 less
    rng = np.random.default_rng(4)
    initial = {"w": rng.normal(size=3)}
    server = ModelAveragingServer(initial, weighting="ShardSize")
    server.set_shard_sizes([10, 30])
    a, b = rng.normal(size=3), rng.normal(size=3)
    # Execute
    server.combine(1, {0: upload({"w": a}, 999), 1: upload({"w": b}, 20)}, failures=[])
    # Assert
    np.testing.assert_allclose(server.global_weights()["w"], (10 * a + 20 * b) / 30, atol=1e-15)


def test_unknown_shards_weigh_at_most_ten_times_the_median_claim() -> None:
    # Prepare: ByFile-like (no known sizes): claims 10, 20, 30 and an inflated 10^9
    rng = np.random.default_rng(5)
    initial = {"w": np.zeros(2)}
    server = ModelAveragingServer(initial, weighting="ShardSize", bounds=UploadBounds(1e6))
    models = {k: rng.normal(size=2) for k in range(4)}
    claims = {0: 10, 1: 20, 2: 30, 3: 10**9}
    # Execute
    server.combine(1, {k: upload({"w": models[k]}, claims[k]) for k in models}, failures=[])
    # Assert: median 25, cap 250
    weights = {0: 10, 1: 20, 2: 30, 3: 250}
    expected = sum(weights[k] * models[k] for k in models) / sum(weights.values())
    np.testing.assert_allclose(server.global_weights()["w"], expected, atol=1e-14)


def test_max_examples_refuses_a_larger_claim_when_the_server_cannot_count() -> None:
    # Prepare
    bounds = UploadBounds(10.0, None, max_examples=500)
    # Execute
    claim = bounds.check_examples(0, upload({}, 500), what="upload of client 0 in round 1")
    with pytest.raises(UploadRefused, match=r"claims 501 examples, more than .*maxExamples 500"):
        bounds.check_examples(0, upload({}, 501), what="upload of client 0 in round 1")
    # Assert
    assert claim == 500


@pytest.mark.parametrize("claim", [0, -3, True, 2.5, "7", None])
def test_a_claim_that_is_not_a_positive_integer_is_malformed(claim: object) -> None:
    # Execute / Assert
    with pytest.raises(ProtocolError, match=r"num_examples=.*positive integer"):
        UploadBounds(1.0).check_examples(0, upload({}, claim), what="upload")  # type: ignore[arg-type]


def test_an_aggregate_that_is_not_finite_or_too_far_is_not_applied() -> None:
    # Prepare
    bounds = UploadBounds(1.0)
    before = {"w": np.zeros(2)}
    # Execute / Assert
    with pytest.raises(AggregateRefused, match=r"Round 4's aggregate holds NaN"):
        bounds.check_aggregate(4, before, {"w": np.array([np.nan, 0.0])})
    with pytest.raises(AggregateRefused, match=r"moves the model by 1\.414"):
        bounds.check_aggregate(4, before, {"w": np.array([1.0, 1.0])})
    with pytest.raises(AggregateRefused, match=r"Round 5's aggregate holds NaN"):
        bounds.check_aggregate_step(5, np.array([np.inf]))
    bounds.check_aggregate(4, before, {"w": np.array([0.6, 0.8])})  # norm 1: at the bound


def test_a_refused_aggregate_keeps_the_previous_model() -> None:
    # Prepare: bounds too wide for the uploads (checked on arrival), too narrow for combine
    initial = {"w": np.zeros(2)}
    server = ModelAveragingServer(initial, weighting="Uniform", bounds=UploadBounds(0.5))
    far = {"w": np.array([3.0, 4.0])}
    # Execute
    with pytest.raises(AggregateRefused):
        server.combine(2, {0: upload(far, 1)}, failures=[])
    # Assert
    np.testing.assert_array_equal(server.global_weights()["w"], np.zeros(2))


def test_robust_fedavg_bounds_the_step_from_the_clients_own_cluster_model() -> None:
    # Prepare
    spec = spec_for("Median", "uploads: {maxUpdateNorm: 1.0}")
    initial = {"w": np.zeros(3)}
    server = create_protocol("fedavg").create_server(spec, initial)
    assert isinstance(server, RobustAveragingServer)
    # Execute
    server.check_upload(1, 0, upload({"w": np.array([0.0, 0.6, 0.8])}, 4))
    with pytest.raises(UploadRefused, match=r"moves the model by 1\.3"):
        server.check_upload(1, 1, upload({"w": np.array([0.0, 0.5, 1.2])}, 4))


def test_the_spec_bound_reaches_every_plaintext_server() -> None:
    # Prepare
    spec = spec_for("Mean", "uploads: {maxUpdateNorm: 0.25, maxExamples: 77}")
    # Execute
    server = create_protocol("fedavg").create_server(spec, {"w": np.zeros(2)})
    # Assert
    assert isinstance(server, ModelAveragingServer)
    assert server._bounds == UploadBounds(0.25, None, 77)


FLOAT32 = hnp.arrays(
    np.float32,
    (3,),
    elements=st.floats(allow_nan=False, allow_infinity=False, width=32),
)


@settings(max_examples=300, deadline=None)
@given(
    uploads=st.lists(
        st.tuples(FLOAT32, st.integers(min_value=-5, max_value=10**12)), min_size=1, max_size=6
    ),
    bound=st.floats(min_value=1e-3, max_value=1e6),
)
def test_whatever_clients_upload_the_accepted_ones_keep_the_model_finite_and_bounded(
    uploads: list[tuple[np.ndarray, int]], bound: float
) -> None:
    # Prepare: any finite float32 values and any claimed counts, from up to six clients
    # whose shards hold 100 examples each
    initial = {"w": np.zeros(3, np.float32)}
    server = ModelAveragingServer(initial, weighting="ShardSize", bounds=UploadBounds(bound))
    server.set_shard_sizes([100] * len(uploads))
    accepted: dict[int, Payload] = {}
    # Execute
    for client, (values, claim) in enumerate(uploads):
        payload = upload({"w": values}, claim)
        try:
            server.check_upload(1, client, payload)
        except ProtocolError:
            continue
        accepted[client] = payload
    if accepted:
        server.combine(1, accepted, failures=[])
    # Assert: every accepted upload was within its bounds, and so is the new model
    model = server.global_weights()["w"]
    for payload in accepted.values():
        assert 1 <= payload.meta["num_examples"] <= 100
        assert step_norm(payload.tensors, initial) <= bound
    assert np.all(np.isfinite(model))
    assert step_norm({"w": model}, initial) <= bound * (1 + 1e-6)

"""adaptive (seed 003): the shell projection, the budgets' inverses, the learner's convergence
where the theory holds, the digest's known answers from the paper's tables, and the
leakage regression that guards the digest's fixes (G1, G2)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from fedcore.errors import SpecError
from fedcore.learning.data import client_dataset
from fedcore.learning.models import build_model, get_weights
from fedcore.learning.training import LocalLearner
from fedcore.protocols import create_protocol
from fedcore.protocols._batches import BATCH_STREAM, batch_rows
from fedcore.protocols.adaptive.maths import (
    cap,
    dp_laplace_scale,
    empirical_leakage,
    learn_distortion,
    pl_leakage,
    pl_lower_bound,
    project_shell,
    random_at_norm,
)
from fedcore.protocols.adaptive.protocol import AdaptiveClient, AdaptiveServer
from fedcore.spec import FederatedRun, parse_manifest
from fedcore.transport import Payload

pytestmark = pytest.mark.filterwarnings("ignore:adaptive draws its distortion:UserWarning")


def adaptive_run(
    *, hidden: list[int] | None = None, batch: int = 16, lr: float = 0.5, **options: Any
) -> FederatedRun:
    document = {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "FederatedRun",
        "metadata": {"name": "adaptive-unit"},
        "spec": {
            "protocol": {"name": "adaptive", "adaptive": {"secureNoise": False, **options}},
            "model": {
                "kind": "MLP",
                "hidden": [8] if hidden is None else hidden,
                "dtype": "float64",
            },
            "clients": {"count": 3},
            "rounds": 3,
            "training": {"batchSize": batch, "optimizer": {"kind": "SGD", "learningRate": lr}},
            "seed": 2,
        },
    }
    return parse_manifest(document)


def client_and_learner(run: FederatedRun, index: int = 0) -> tuple[AdaptiveClient, LocalLearner]:
    spec = run.spec
    data = client_dataset(spec, index)
    model = build_model(spec.model, data.input_shape, data.num_classes, seed=spec.seed)
    client = create_protocol("adaptive").create_client(spec, index)
    assert isinstance(client, AdaptiveClient)
    return client, LocalLearner(model, data, spec.training, seed=spec.seed, client_index=index)


def initial_weights(run: FederatedRun, learner: LocalLearner) -> dict[str, np.ndarray]:
    shape = tuple(learner.features.shape[1:])
    classes = int(learner.targets.shape[1])
    return get_weights(build_model(run.spec.model, shape, classes, seed=run.spec.seed))


# ------------------------------------------------------------------ T1: the projection


def test_projection_lands_in_the_shell_keeps_direction_and_is_idempotent() -> None:
    rng = np.random.default_rng(0)
    lower, upper = 1.5, 3.0
    for _ in range(200):
        y = rng.normal(size=20) * rng.uniform(0.01, 3)
        p = project_shell(y, lower, upper)
        norm = np.linalg.norm(p)
        assert lower - 1e-12 <= norm <= upper + 1e-12
        cosine = float(p @ y) / (norm * np.linalg.norm(y))
        assert cosine == pytest.approx(1.0, abs=1e-12)
        np.testing.assert_allclose(project_shell(p, lower, upper), p, rtol=0, atol=1e-12)
        if lower <= np.linalg.norm(y) <= upper:
            assert np.array_equal(p, y)


def test_projecting_zero_gives_a_seeded_direction_at_the_lower_norm() -> None:
    a = project_shell(np.zeros(10), 2.0, 4.0, np.random.default_rng(5))
    b = project_shell(np.zeros(10), 2.0, 4.0, np.random.default_rng(5))
    assert np.linalg.norm(a) == pytest.approx(2.0)
    assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="random direction"):
        project_shell(np.zeros(3), 1.0, 2.0)
    with pytest.raises(ValueError, match="lower <= upper"):
        project_shell(np.ones(3), 2.0, 1.0)


# ------------------------------------------------------------- T2, T3: the budgets


@pytest.mark.parametrize("budget", [0.5, 0.9, 0.96, 0.99, 0.995])
def test_pl_budget_round_trips_through_its_lower_bound(budget: float) -> None:
    a1, a2 = 1.0, 0.0625
    lower = pl_lower_bound(budget, a1, a2)
    assert pl_leakage(lower, a1, a2) == pytest.approx(budget, abs=1e-12)


def test_pl_lower_bound_falls_with_the_budget_and_clamps_at_zero() -> None:
    bounds = [pl_lower_bound(chi, 1.0, 0.1) for chi in (0.5, 0.8, 0.95, 1.0, 1.5)]
    assert bounds[:4] == sorted(bounds[:4], reverse=True)
    assert bounds[3] == 0.0 and bounds[4] == 0.0


def test_dp_scale_is_the_l1_sensitivity_over_epsilon_and_samples_have_its_std() -> None:
    # Prepare: eta 0.5, C 1, P 100 parameters, batch 10: sensitivity 2 * 0.5 * 1 * 10 / 10 = 1.
    scale = dp_laplace_scale(0.5, 1.0, 100, 10, epsilon=4.0)
    # Execute
    samples = np.random.default_rng(0).laplace(0.0, scale, 100_000)
    # Assert
    assert scale == pytest.approx(0.25)
    assert dp_laplace_scale(0.5, 1.0, 100, 10, epsilon=2.0) > scale
    assert np.std(samples) == pytest.approx(math.sqrt(2) * scale, rel=0.03)


# ------------------------------------------------------------------------- T4: Def E.1


def test_empirical_leakage_of_definition_e1() -> None:
    truth = np.array([0.0, 1.0])
    assert empirical_leakage([truth, truth], truth, diameter=2.0) == 1.0
    assert empirical_leakage([], truth, diameter=2.0) == 0.0
    assert empirical_leakage([truth + np.array([2.0, 0.0])], truth, diameter=2.0) == 0.0
    assert empirical_leakage([truth + np.array([5.0, 0.0])], truth, diameter=2.0) == 0.0  # clipped
    assert empirical_leakage([truth + np.array([1.0, 0.0])], truth, diameter=2.0) == 0.5


# --------------------------------------------------- T5, T6: the paper's own tables

BUDGETS = {"DP": [80, 200, 400, 600, 800], "PL": [0.96, 0.97, 0.98, 0.99, 0.995]}
ACCURACY = {  # Tables 1 (DP) and 5 (PL): Identical, Learn, diff, in percent
    ("DP", "MNIST"): (
        [8.92, 67.98, 83.28, 87.26, 92.04],
        [51.04, 76.46, 86.20, 91.94, 93.40],
        [42.12, 8.48, 2.92, 4.68, 1.36],
    ),
    ("DP", "FMNIST"): (
        [10.68, 52.82, 67.38, 74.04, 76.76],
        [54.48, 59.56, 70.92, 77.52, 78.78],
        [43.80, 6.74, 3.54, 3.48, 2.02],
    ),
    ("PL", "MNIST"): (
        [10.92, 10.38, 64.68, 85.26, 92.00],
        [62.68, 64.72, 73.26, 86.62, 92.94],
        [51.76, 54.34, 8.58, 1.36, 0.94],
    ),
    ("PL", "FMNIST"): (
        [9.64, 35.58, 49.10, 69.74, 78.00],
        [56.94, 57.96, 63.54, 72.94, 79.26],
        [47.30, 22.38, 14.44, 3.20, 1.26],
    ),
}
MSE = {  # Tables 3 (DP) and 4 (PL): Identical, Learn
    ("DP", "MNIST"): ([3.48, 2.61, 2.44, 2.22, 2.23], [3.30, 2.48, 2.43, 2.51, 2.28]),
    ("DP", "FMNIST"): ([2.09, 1.96, 2.01, 1.91, 1.88], [2.05, 1.95, 1.92, 1.86, 1.84]),
    ("PL", "MNIST"): ([3.45, 3.31, 2.84, 2.67, 1.91], [3.37, 3.10, 2.74, 2.24, 2.35]),
    ("PL", "FMNIST"): ([2.10, 2.04, 1.99, 1.89, 1.68], [2.09, 2.07, 1.91, 1.87, 1.84]),
}
CAP_TABLE = {  # Table 2b: Identical, Learn
    ("DP", "MNIST"): (1.62, 2.02),
    ("DP", "FMNIST"): (1.08, 1.31),
    ("PL", "MNIST"): (1.30, 2.09),
    ("PL", "FMNIST"): (0.91, 1.27),
}


@pytest.mark.parametrize("key", list(CAP_TABLE), ids=[f"{m}-{d}" for m, d in CAP_TABLE])
def test_cap_of_the_papers_accuracy_and_mse_reproduces_table_2b(key: tuple[str, str]) -> None:
    # Execute: CAP = mean over budgets of accuracy (a fraction) times the recovery MSE.
    identical = cap([a / 100 for a in ACCURACY[key][0]], MSE[key][0])
    learn = cap([a / 100 for a in ACCURACY[key][1]], MSE[key][1])
    # Assert: to the digest's tolerance (the paper used unrounded cells).
    assert identical == pytest.approx(CAP_TABLE[key][0], abs=0.05)
    assert learn == pytest.approx(CAP_TABLE[key][1], abs=0.05)


@pytest.mark.parametrize("key", list(ACCURACY), ids=[f"{m}-{d}" for m, d in ACCURACY])
def test_the_papers_diff_rows_are_learn_minus_identical(key: tuple[str, str]) -> None:
    identical, learn, diff = ACCURACY[key]
    for a, b, d in zip(identical, learn, diff, strict=True):
        assert b - a == pytest.approx(d, abs=0.01)


# ------------------------------------------------------ T7: the learner where it converges


def test_projected_steps_converge_linearly_to_an_optimum_inside_the_shell() -> None:
    # Prepare: f(d) = 1/2 (d - c)' A (d - c), eigenvalues in [R, L], c inside the shell.
    rng = np.random.default_rng(1)
    basis, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    eigen = np.array([0.5, 0.8, 1.0, 1.5, 1.8, 2.0])
    a = basis @ np.diag(eigen) @ basis.T
    c = random_at_norm(rng, 6, 1.5)
    start = random_at_norm(rng, 6, 1.2)
    r, big_l = eigen.min(), eigen.max()

    def gradient(d: np.ndarray) -> np.ndarray:
        return a @ (d - c)

    # Execute / Assert
    first = float(np.sum((start - c) ** 2))
    for m in range(1, 12):
        d, _ = learn_distortion(start, 1.0, 2.0, gradient, steps=m, step_size=1 / big_l)
        assert float(np.sum((d - c) ** 2)) <= (1 - r / big_l) ** m * first + 1e-15


def test_an_optimum_inside_the_inner_sphere_is_met_on_the_sphere() -> None:
    # Prepare: isotropic A, |c| < l: the constrained optimum is c * l / |c|.
    c = np.array([0.3, -0.4, 0.0])

    def gradient(d: np.ndarray) -> np.ndarray:
        return 2.0 * (d - c)

    # Execute
    d, trace = learn_distortion(
        np.array([0.0, 0.0, 1.0]), 1.0, 2.0, gradient, steps=60, step_size=0.25
    )
    # Assert
    np.testing.assert_allclose(d, c / np.linalg.norm(c), rtol=0, atol=1e-9)
    assert all(1.0 - 1e-12 <= n <= 2.0 + 1e-12 for n in trace.norms)


# --------------------------------------------------------- the client: bounds and flags


@pytest.mark.parametrize(
    ("options", "formal"),
    [
        ({"measure": "PL", "strategy": "Identical"}, False),
        ({"measure": "PL", "strategy": "Learn"}, False),
        ({"measure": "DP", "strategy": "Identical"}, True),
        ({"measure": "DP", "strategy": "Learn"}, False),
    ],
    ids=["pl-identical", "pl-learn", "dp-identical", "dp-learn"],
)
def test_every_upload_keeps_its_distortion_in_the_shell_and_says_if_it_is_formal_dp(
    options: dict[str, Any], formal: bool
) -> None:
    # Prepare
    run = adaptive_run(**options)
    client, learner = client_and_learner(run)
    weights = initial_weights(run, learner)
    # Execute
    upload = client.compute_upload(1, Payload(tensors=weights), learner, None)
    meta = upload.meta
    # Assert
    assert meta["formal_dp"] is formal
    assert meta["lower"] * (1 - 1e-9) <= meta["distortion_norm"] <= meta["upper"] * (1 + 1e-9)
    assert meta["upper"] == pytest.approx(2 * meta["lower"])
    if options["measure"] == "PL":
        assert meta["leakage"] <= 0.98 + 1e-12  # the default budget
        assert meta["lower"] == pytest.approx(pl_lower_bound(0.98, 1.0, 0.0625))
    else:
        assert meta["epsilon"] == 100.0
    if options["strategy"] == "Identical" and options["measure"] == "PL":
        assert meta["distortion_norm"] == pytest.approx(meta["lower"], rel=1e-9)


def test_the_same_seed_gives_the_same_upload_and_a_secure_start_does_not() -> None:
    # Prepare
    run = adaptive_run()
    first, learner = client_and_learner(run)
    second, _ = client_and_learner(run)
    weights = initial_weights(run, learner)
    # Execute
    a = first.compute_upload(2, Payload(tensors=weights), learner, None)
    b = second.compute_upload(2, Payload(tensors=weights), learner, None)
    secure, _ = client_and_learner(adaptive_run(secureNoise=True))
    c = secure.compute_upload(2, Payload(tensors=weights), learner, None)
    # Assert
    assert all(np.array_equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
    assert not all(np.array_equal(a.tensors[n], c.tensors[n]) for n in a.tensors)


def test_private_and_held_out_rows_are_disjoint_and_cover_the_shard() -> None:
    client, learner = client_and_learner(adaptive_run(heldOutFraction=0.25))
    private, held = client.split(learner.num_examples)
    assert not set(private) & set(held)
    assert sorted([*private, *held]) == list(range(learner.num_examples))
    assert len(held) == round(0.25 * learner.num_examples)


def test_the_server_averages_and_composes_epsilon_only_for_formal_uploads() -> None:
    # Prepare
    server = AdaptiveServer({"w": np.zeros(2)}, weighting="ShardSize")

    def upload(value: float, formal: bool) -> Payload:
        meta = {
            "num_examples": 10,
            "loss": 1.0,
            "distortion_norm": 1.0,
            "lower": 1.0,
            "upper": 2.0,
            "formal_dp": formal,
            "epsilon": 50.0,
        }
        return Payload(meta=meta, tensors={"w": np.full(2, value)})

    # Execute
    formal = server.combine(3, {0: upload(1.0, True), 1: upload(3.0, True)}, [])
    learned = server.combine(3, {0: upload(1.0, True), 1: upload(3.0, False)}, [])
    # Assert
    assert formal is not None and learned is not None
    assert formal.metrics["epsilon_composed"] == 150.0 and formal.metrics["formal_dp"] == 1.0
    assert "epsilon_composed" not in learned.metrics and learned.metrics["formal_dp"] == 0.0
    np.testing.assert_allclose(server.global_weights()["w"], [2.0, 2.0])


# ------------------------------------------ T12: the leakage regression of G1 and G2


def median_inversion_error(run: FederatedRun, trials: int = 200) -> float:
    """Median relative error of x_hat = dW[y] / db[y] on single-example uploads."""
    client, learner = client_and_learner(run)
    weights = initial_weights(run, learner)
    private, _ = client.split(learner.num_examples)
    rng = np.random.default_rng(9)
    x_all = learner.features.numpy()
    y_all = learner.labels.numpy()
    errors = []
    for t in range(1, trials + 1):
        start = {n: v + rng.normal(scale=0.05, size=v.shape) for n, v in weights.items()}
        upload = client.compute_upload(t, Payload(tensors=start), learner, None)
        row = private[
            batch_rows(len(private), 1, seed=run.spec.seed, step=t, client=0, stream=BATCH_STREAM)
        ][0]
        x, y = x_all[row].ravel(), y_all[row]
        d_w = upload.tensors["1.weight"] - start["1.weight"]
        d_b = upload.tensors["1.bias"] - start["1.bias"]
        estimate = d_w[y] / d_b[y]
        errors.append(float(np.linalg.norm(estimate - x) / np.linalg.norm(x)))
    return float(np.median(errors))


def test_the_literal_algorithm_leaks_and_the_digests_defaults_hide_as_identical_does() -> None:
    # Prepare: a linear model with a bias (an upload row is a multiple of the input), batch 1,
    # and the same norm bound l = (1 - 0.5) / 0.5 = 1 for every learner.
    common: dict[str, Any] = {
        "hidden": [],
        "batch": 1,
        "lr": 0.1,
        "pl": {"budget": 0.5, "a2": 0.5},
    }
    literal = adaptive_run(init="Zero", gradSource="PrivateBatch", allowUnsafe=True, **common)
    default = adaptive_run(**common)
    identical = adaptive_run(strategy="Identical", **common)
    # Execute
    errors = {
        name: median_inversion_error(run)
        for name, run in (("literal", literal), ("default", default), ("identical", identical))
    }
    # Assert: the paper as printed hands over the input; the defaults hide it like noise.
    assert errors["literal"] < 1e-6, errors
    assert errors["identical"] > 0.5, errors
    assert errors["default"] >= 0.9 * errors["identical"], errors


# ----------------------------------------------------------------------- validation


def test_the_unsafe_settings_and_other_optimizers_are_refused_by_field() -> None:
    with pytest.raises(SpecError) as caught:
        parse_manifest(
            {
                "apiVersion": "fedcore.dev/v1alpha1",
                "kind": "FederatedRun",
                "metadata": {"name": "x"},
                "spec": {
                    "protocol": {
                        "name": "adaptive",
                        "adaptive": {"init": "Zero", "gradSource": "PrivateBatch"},
                    },
                    "clients": {"count": 2},
                    "rounds": 1,
                    "training": {"optimizer": {"kind": "SGD", "momentum": 0.9}},
                },
            }
        )
    issues = [str(issue) for issue in caught.value.issues]
    assert any(i.startswith("spec.protocol.adaptive.init: 'Zero'") for i in issues)
    assert any(i.startswith("spec.protocol.adaptive.gradSource: 'PrivateBatch'") for i in issues)
    assert any(i.startswith("spec.training.optimizer: adaptive takes one") for i in issues)

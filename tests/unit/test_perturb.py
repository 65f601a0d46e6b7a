"""perturb (digest 001) in one process: maths, exact recovery, secrets, checks, preconditions."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from fedcore.errors import ProtocolError, RecoveryError, SpecError
from fedcore.learning.data import ArrayDataset
from fedcore.learning.models import build_model, get_weights
from fedcore.learning.training import LocalLearner
from fedcore.protocols import Perturb, create_protocol
from fedcore.protocols._maths import weighted_mean
from fedcore.protocols.perturb.maths import (
    RoundSecrets,
    balance_residual,
    draw_secrets,
    log_uniform,
    perturb_weights,
    perturbed_terms,
    recover_gradient,
    recover_value,
)
from fedcore.protocols.perturb.protocol import OUTPUT_NOISE, PerturbServer, grad_name
from fedcore.simulation import simulate
from fedcore.spec import load_manifest
from fedcore.transport import Payload, encode_chunks

MANIFEST = """
apiVersion: fedcore.dev/v1alpha1
kind: FederatedRun
metadata: {name: unit}
spec:
  protocol: {name: %(protocol)s, perturb: {secureSecrets: %(secure)s%(extra)s}}
  model: {kind: MLP, hidden: %(hidden)s, bias: false, dtype: float64}
  data: {source: {kind: Digits}, partition: {kind: Dirichlet, alpha: 5}}
  clients: {count: %(clients)d}
  rounds: %(rounds)d
  training: {loss: MSE, optimizer: {kind: SGD, learningRate: 1.0}}
  evaluation: {everyRounds: 0}
  seed: %(seed)d
"""


def spec_for(
    protocol: str = "perturb",
    *,
    hidden: str = "[16]",
    clients: int = 3,
    rounds: int = 3,
    seed: int = 0,
    secure: bool = False,
    extra: str = "",
):
    text = MANIFEST % {
        "protocol": protocol,
        "hidden": hidden,
        "clients": clients,
        "rounds": rounds,
        "seed": seed,
        "secure": str(secure).lower(),
        "extra": extra,
    }
    return load_manifest("unit", text=text)


def digits_shards(sizes: list[int]) -> list[ArrayDataset]:
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).reshape(-1, 1, 8, 8).astype(np.float32)
    starts = np.cumsum([0, *sizes])
    return [
        ArrayDataset(x=x[a:b], y=y[a:b].astype(np.int64), num_classes=10)
        for a, b in itertools.pairwise(starts)
    ]


def learners_for(spec, shards: list[ArrayDataset]) -> list[LocalLearner]:
    return [
        LocalLearner(
            build_model(spec.model, (1, 8, 8), 10, seed=spec.seed),
            shard,
            spec.training,
            seed=spec.seed,
            client_index=k,
        )
        for k, shard in enumerate(shards)
    ]


def quiet_server(spec) -> PerturbServer:
    """The perturb server of ``spec`` (the reproducible-secrets warning silenced)."""
    model = build_model(spec.model, (1, 8, 8), 10, seed=spec.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        server = create_protocol("perturb").create_server(spec, get_weights(model))
    assert isinstance(server, PerturbServer)
    return server


def one_round(spec, sizes: list[int], round_: int = 1):
    """Plans a round, computes and checks every upload; returns server, learners, uploads."""
    server = quiet_server(spec)
    learners = learners_for(spec, digits_shards(sizes))
    clients = [Perturb().create_client(spec, k) for k in range(len(sizes))]
    plans = server.plan_round(round_, list(range(len(sizes))))
    uploads = {k: clients[k].compute_upload(round_, plans[k], learners[k], None) for k in plans}
    for k, upload in uploads.items():
        server.check_upload(round_, k, upload)
    return server, learners, uploads


def random_mlp(rng: np.random.Generator, widths: list[int]) -> list[np.ndarray]:
    return [
        rng.normal(size=(widths[i + 1], widths[i])) / np.sqrt(widths[i])
        for i in range(len(widths) - 1)
    ]


def true_forward(weights: list[np.ndarray], x: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's output of a bias-free ReLU MLP (the last one linear)."""
    outputs = []
    hidden = x
    for layer, weight in enumerate(weights):
        hidden = F.linear(hidden, torch.from_numpy(weight))
        if layer < len(weights) - 1:
            hidden = torch.relu(hidden)
        outputs.append(hidden)
    return outputs


def mse_gradient(weights: list[np.ndarray], x: torch.Tensor, targets: torch.Tensor):
    params = [torch.tensor(w, requires_grad=True) for w in weights]
    hidden = x
    for param in params[:-1]:
        hidden = torch.relu(F.linear(hidden, param))
    loss = F.mse_loss(F.linear(hidden, params[-1]), targets)
    return float(loss.detach()), [g.numpy() for g in torch.autograd.grad(loss, params)]


def relative_error(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    scale = max(float(np.abs(w).max()) for w in want)
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True)) / scale


# ------------------------------------------------------------------------------ the maths


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_draw_secrets_scales_positive_in_range_distinct_and_cells_nonempty(seed: int) -> None:
    # Prepare
    rng = np.random.default_rng(seed)
    widths = [64, 32, 16, 10]
    # Execute
    secrets = draw_secrets(rng, widths, cells=4, hidden_spread=10.0, output_spread=2.0)
    # Assert
    assert [s.shape for s in secrets.hidden_scales] == [(32,), (16,)]
    for scales in secrets.hidden_scales:
        assert np.all(scales > 0)
        assert np.all((scales >= 0.1) & (scales <= 10.0))
    assert np.all(np.abs(secrets.output_noise) >= 0.5) and np.all(np.abs(secrets.output_noise) <= 2)
    assert np.unique(secrets.output_noise).shape == (10,)
    assert np.all(np.abs(secrets.cell_scales) >= 0.5)
    assert sorted(set(secrets.cell_of_output.tolist())) == [0, 1, 2, 3]
    assert secrets.shift_norm_sq() == pytest.approx(float(np.sum(secrets.output_shift() ** 2)))


@pytest.mark.parametrize(
    ("widths", "cells", "fragment"),
    [
        ([64, 10], 1, "at least one hidden layer"),
        ([64, 0, 10], 1, "positive widths"),
        ([64, 8, 10], 11, "from 1 to 10, got 11"),
        ([64, 8, 10], 0, "from 1 to 10, got 0"),
    ],
)
def test_draw_secrets_refuses_bad_shape_or_cells(widths, cells, fragment) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match=fragment):
        draw_secrets(
            np.random.default_rng(0), widths, cells=cells, hidden_spread=2, output_spread=2
        )


@pytest.mark.parametrize("spread", [1.0, 0.5, float("inf")])
def test_log_uniform_refuses_spread_not_above_one(spread: float) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match=f"above 1, got {spread}"):
        log_uniform(np.random.default_rng(0), 3, spread)


@pytest.mark.parametrize("widths", [[12, 9, 4], [12, 9, 7, 5], [12, 9, 7, 6, 1]])
def test_perturb_weights_hides_layers_as_theorem_1_says(widths: list[int]) -> None:
    # Prepare
    rng = np.random.default_rng(7)
    weights = random_mlp(rng, widths)
    secrets = draw_secrets(rng, widths, cells=1, hidden_spread=10, output_spread=2)
    x = torch.from_numpy(rng.normal(size=(20, widths[0])))
    # Execute
    true = true_forward(weights, x)
    hidden = true_forward(perturb_weights(weights, secrets), x)
    # Assert: hidden layers scaled by r^(l); outputs shifted by alpha * r.
    for layer, scales in enumerate(secrets.hidden_scales):
        np.testing.assert_allclose(hidden[layer].numpy(), scales * true[layer].numpy(), atol=1e-12)
    alpha = hidden[-2].sum(dim=1).numpy()
    expected = true[-1].numpy() + alpha[:, None] * secrets.output_shift()
    np.testing.assert_allclose(hidden[-1].numpy(), expected, rtol=1e-12, atol=1e-12)


def test_perturbed_terms_equal_the_papers_per_sample_definitions() -> None:
    # Prepare: the literal sigma_i = alpha dy_i/dW + (y_i - ybar_i) dalpha/dW per sample.
    rng = np.random.default_rng(11)
    widths = [5, 4, 3, 3]
    weights = perturb_weights(
        random_mlp(rng, widths),
        draw_secrets(rng, widths, cells=2, hidden_spread=3, output_spread=2),
    )
    x = torch.from_numpy(rng.normal(size=(6, 5)))
    targets = F.one_hot(torch.tensor([0, 2, 1, 1, 0, 2]), 3).double()
    noise = torch.tensor([0.7, -1.3, 1.9], dtype=torch.float64)
    cell_of_output = torch.tensor([1, 0, 1])
    # Execute
    terms = perturbed_terms(
        [torch.from_numpy(w) for w in weights], x, targets, noise, cell_of_output, 2
    )
    # Assert
    params = [torch.tensor(w, requires_grad=True) for w in weights]
    factor = 2.0 / 3
    literal_cells = [[np.zeros_like(w) for w in weights] for _ in range(2)]
    literal_beta = [np.zeros_like(w) for w in weights]
    for n in range(6):
        hidden = x[n : n + 1]
        for param in params[:-1]:
            hidden = torch.relu(F.linear(hidden, param))
        alpha = hidden.sum()
        output = F.linear(hidden, params[-1])[0]
        d_alpha = torch.autograd.grad(alpha, params, retain_graph=True, allow_unused=True)
        d_alpha_np = [
            np.zeros_like(w) if g is None else g.numpy()
            for g, w in zip(d_alpha, weights, strict=True)
        ]
        for i in range(3):
            d_out = torch.autograd.grad(output[i], params, retain_graph=True)
            residual = float(output[i].detach() - targets[n, i])
            for layer in range(len(weights)):
                sigma = float(alpha.detach()) * d_out[layer].numpy() + residual * d_alpha_np[layer]
                cell = int(cell_of_output[i])
                literal_cells[cell][layer] += factor * float(noise[i]) * sigma / 6
        for layer in range(len(weights)):
            literal_beta[layer] += factor * float(alpha.detach()) * d_alpha_np[layer] / 6
    for cell in range(2):
        assert relative_error(terms.cell_grads[cell], literal_cells[cell]) < 1e-12
    assert relative_error(terms.beta_grads, literal_beta[:-1]) < 1e-12
    assert np.all(literal_beta[-1] == 0), "beta of the last layer is 0 and is not sent"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("widths", [[64, 16, 10], [64, 24, 12, 10], [64, 20, 16, 12, 10]])
@pytest.mark.parametrize("cells", [1, 3, 10])
def test_recover_gradient_and_value_equal_the_true_mse_gradient(seed, widths, cells) -> None:
    # Prepare
    rng = np.random.default_rng(seed)
    weights = random_mlp(rng, widths)
    secrets = draw_secrets(rng, widths, cells=cells, hidden_spread=10, output_spread=2)
    x = torch.from_numpy(rng.uniform(size=(40, widths[0])))
    targets = F.one_hot(torch.from_numpy(rng.integers(0, 10, 40)), 10).double()
    terms = perturbed_terms(
        [torch.from_numpy(w) for w in perturb_weights(weights, secrets)],
        x,
        targets,
        torch.from_numpy(secrets.output_noise),
        torch.from_numpy(secrets.cell_of_output),
        cells,
    )
    # Execute
    gradient = recover_gradient(terms.loss_grad, terms.cell_grads, terms.beta_grads, secrets)
    loss = recover_value(terms.loss, terms.cell_values, terms.beta_value, secrets)
    # Assert
    true_loss, true_gradient = mse_gradient(weights, x, targets)
    assert relative_error(gradient, true_gradient) < 1e-9
    assert loss == pytest.approx(true_loss, rel=1e-9)
    assert balance_residual(weights, gradient) < 1e-9
    assert relative_error(terms.loss_grad, true_gradient) > 1e-3, "G^ alone is not the gradient"


def test_balance_residual_is_zero_for_a_true_gradient_and_large_for_a_wrong_one() -> None:
    # Prepare
    rng = np.random.default_rng(5)
    weights = random_mlp(rng, [10, 8, 6, 4])
    x = torch.from_numpy(rng.normal(size=(30, 10)))
    _, gradient = mse_gradient(weights, x, torch.from_numpy(rng.normal(size=(30, 4))))
    wrong = [gradient[0] * 1.5, gradient[1] / 1.5, gradient[2]]
    # Execute
    right_residual = balance_residual(weights, gradient)
    wrong_residual = balance_residual(weights, wrong)
    garbage_residual = balance_residual(weights, [rng.normal(size=w.shape) for w in weights])
    # Assert
    assert right_residual < 1e-14
    assert wrong_residual > 1e-3
    assert garbage_residual > 1e-3
    assert balance_residual(weights, [np.zeros_like(w) for w in weights]) == 0.0
    assert balance_residual(weights, [np.full_like(w, np.nan) for w in weights]) == np.inf


# ------------------------------------------------------------------ exactness vs fedsgd


@pytest.mark.parametrize(
    ("seed", "hidden", "sizes"),
    [
        (0, "[16]", [40]),
        (1, "[16]", [50, 17, 5]),
        (2, "[24, 12]", [32, 17, 5, 60, 9]),
        (3, "[20, 16, 12]", [70, 33, 12]),
        (4, "[20, 16, 12]", [25, 25]),
    ],
)
def test_perturb_recovered_gradient_equals_fedsgd_shard_weighted_gradient(seed, hidden, sizes):
    # Prepare
    spec = spec_for(hidden=hidden, clients=len(sizes), seed=seed, secure=True).spec
    server, learners, uploads = one_round(spec, sizes)
    true = server.global_weights()
    # Execute
    recovered, residual = server.recover(1, uploads)
    mean = weighted_mean([recovered[k].tensors for k in sorted(recovered)], sizes)
    # Assert
    fedsgd = [learner.gradient(true, round=1) for learner in learners]
    expected = weighted_mean([g for g, _ in fedsgd], sizes)
    names = list(true)
    assert relative_error([mean[n] for n in names], [expected[n] for n in names]) < 1e-9
    for k, (_, stats) in enumerate(fedsgd):
        assert recovered[k].meta["loss"] == pytest.approx(stats.loss, rel=1e-9)
        assert recovered[k].meta["num_examples"] == sizes[k]
    assert residual < 1e-9


def test_perturb_simulate_equals_fedsgd_over_20_rounds() -> None:
    # Prepare: two manifests that differ only in protocol.name.
    perturb = spec_for("perturb", hidden="[16, 12]", clients=4, rounds=20, secure=True)
    fedsgd = spec_for("fedsgd", hidden="[16, 12]", clients=4, rounds=20, secure=True)
    # Execute
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = simulate(perturb)
    want = simulate(fedsgd)
    # Assert
    initial = get_weights(build_model(perturb.spec.model, (1, 8, 8), 10, seed=0))
    for name, value in want.weights.items():
        np.testing.assert_allclose(got.weights[name], value, rtol=0, atol=1e-9)
        assert not np.allclose(value, initial[name]), "the model moved"
    for ours, theirs in zip(got.history, want.history, strict=True):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-9)
    assert got.accuracy == want.accuracy


def test_perturb_combine_takes_fedsgds_step_and_reports_the_residual() -> None:
    # Prepare
    spec = spec_for(clients=3).spec
    sizes = [30, 20, 10]
    server, learners, uploads = one_round(spec, sizes)
    before = server.global_weights()
    fedsgd = [learner.gradient(before, round=1) for learner in learners]
    expected_gradient = weighted_mean([g for g, _ in fedsgd], sizes)
    # Execute
    result = server.combine(1, uploads, [])
    # Assert
    assert result is not None and result.participants == 3
    assert 0 <= result.metrics["recovery_residual"] < 1e-9
    expected_loss = sum(s.loss * n for (_, s), n in zip(fedsgd, sizes, strict=True)) / 60
    assert result.train_loss == pytest.approx(expected_loss, rel=1e-9)
    for name, value in server.global_weights().items():
        np.testing.assert_allclose(
            value, before[name] - 1.0 * expected_gradient[name], rtol=0, atol=1e-12
        )


# ------------------------------------------------------------------------------ secrets


def test_perturb_plan_round_draws_fresh_secrets_every_round_for_the_same_model() -> None:
    # Prepare
    server = quiet_server(spec_for(secure=True).spec)
    true = server.global_weights()
    # Execute: two rounds planned on the same true model (nothing combined in between).
    first = server.plan_round(1, [0])[0]
    first_secrets = server._round.secrets
    first_scales = [np.array(s, copy=True) for s in first_secrets.hidden_scales]
    second = server.plan_round(2, [0])[0]
    second_secrets = server._round.secrets
    # Assert
    for name in true:
        assert not np.allclose(first.tensors[name], second.tensors[name])
    assert not np.allclose(first.tensors[OUTPUT_NOISE], second.tensors[OUTPUT_NOISE])
    assert not np.allclose(first_scales[0], second_secrets.hidden_scales[0])
    assert all(np.all(s == 0) for s in first_secrets.hidden_scales), "the old ones are zeroised"
    assert all(np.all(s > 0) for s in second_secrets.hidden_scales)


@pytest.mark.parametrize("round_", [1, 2, 3, 50])
def test_perturb_hidden_scales_are_positive_and_leak_row_directions_and_signs(round_: int) -> None:
    # Prepare
    server = quiet_server(spec_for(hidden="[16, 12]", secure=False).spec)
    true = server.global_weights()
    names = list(true)
    # Execute
    perturbed = server.plan_round(round_, [0, 1])[0].tensors
    # Assert: each row of W^(1) is scaled by its neuron's r_i > 0 (digest §2.2 S2), which is
    # also the known leak §7b S1: rows keep their directions and hidden layers their signs.
    ratios = perturbed[names[0]] / true[names[0]]
    assert np.allclose(ratios, ratios[:, :1])
    assert np.all(ratios > 0)
    assert np.all(np.sign(perturbed[names[1]]) == np.sign(true[names[1]]))


def test_perturb_secure_secrets_differ_between_servers_of_the_same_spec() -> None:
    # Prepare
    spec = spec_for(secure=True).spec
    # Execute
    first = quiet_server(spec).plan_round(1, [0])[0]
    second = quiet_server(spec).plan_round(1, [0])[0]
    # Assert
    assert not np.array_equal(first.tensors[OUTPUT_NOISE], second.tensors[OUTPUT_NOISE])


def test_perturb_reproducible_secrets_warn() -> None:
    # Prepare
    spec = spec_for(secure=False).spec
    model = build_model(spec.model, (1, 8, 8), 10, seed=0)
    # Execute / Assert
    with pytest.warns(UserWarning, match="secureSecrets is false"):
        Perturb().create_server(spec, get_weights(model))


def secret_arrays(secrets: RoundSecrets, true: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every array a client must not see: the secrets, derived ones, the true weights and rows."""
    found = {f"r{layer + 1}": s for layer, s in enumerate(secrets.hidden_scales)}
    found["gamma"] = secrets.cell_scales
    found["gamma_expanded"] = secrets.cell_scales[secrets.cell_of_output]
    found["r"] = secrets.output_shift()
    found["v"] = np.array([secrets.shift_norm_sq()])
    for layer, factor in enumerate(secrets.scale_factors()):
        found[f"R{layer + 1}"] = factor
    for name, value in true.items():
        found[f"true {name}"] = value
        for row in range(value.shape[0]):
            found[f"true {name} row {row}"] = value[row]
    return found


@pytest.mark.parametrize("extra", ["", ", cells: 1", ", cells: 4"])
def test_perturb_instructions_hold_no_server_secret_bytes(extra: str) -> None:
    # Prepare
    server = quiet_server(spec_for(hidden="[16, 12]", secure=True, extra=extra).spec)
    true = {k: np.array(v, copy=True) for k, v in server.global_weights().items()}
    for round_ in (1, 2, 3):
        # Execute
        plans = server.plan_round(round_, [0, 1, 2])
        secrets = server._round.secrets
        forbidden = secret_arrays(secrets, true)
        # Assert
        for client, plan in plans.items():
            wire = b"".join(encode_chunks(plan, chunk_bytes=1 << 20))
            for what, array in forbidden.items():
                raw = np.ascontiguousarray(array, dtype="<f8").tobytes()
                assert raw not in wire, f"client {client} receives {what} in round {round_}"
            assert set(plan.meta) == {"round", "cells", "cell_of_output"}
            assert list(plan.tensors) == [*true, OUTPUT_NOISE]


def test_perturb_state_dict_holds_only_the_true_model_even_mid_round() -> None:
    # Prepare
    server = quiet_server(spec_for().spec)
    server.plan_round(1, [0])
    # Execute
    state = server.state_dict()
    # Assert
    assert set(state) == {"kind", "version", "weights"}
    assert state["kind"] == "perturb"
    fresh = quiet_server(spec_for().spec)
    fresh.load_state_dict(state)
    for name, value in server.global_weights().items():
        np.testing.assert_array_equal(fresh.global_weights()[name], value)


# ------------------------------------------------------------------------ residual check


def test_perturb_recover_detects_each_live_neurons_tampered_hidden_scale() -> None:
    # Prepare
    spec = spec_for(hidden="[16, 12]").spec
    server, learners, uploads = one_round(spec, [30, 20, 10], round_=4)
    gradients = [learner.gradient(server.global_weights(), round=4)[0] for learner in learners]
    secrets = server._round.secrets
    tried = caught = 0
    for layer, scales in enumerate(secrets.hidden_scales):
        name = list(server.global_weights())[layer]
        for neuron in range(scales.shape[0]):
            live = any(np.any(g[name][neuron] != 0) for g in gradients)
            saved = scales[neuron]
            scales[neuron] = saved * 1.5
            # Execute
            try:
                server.recover(4, uploads)
            except RecoveryError as error:
                caught += 1
                assert live, "a dead neuron's scale does not change the recovered gradient"
                assert error.round == 4 and error.residual > error.bound
            else:
                assert not live, f"the tampered scale of live neuron {neuron} went unnoticed"
            finally:
                scales[neuron] = saved
            tried += live
    # Assert
    assert caught == tried > 10


def test_perturb_combine_with_tampered_hidden_scale_raises_and_keeps_the_model() -> None:
    # Prepare
    server, learners, uploads = one_round(spec_for(hidden="[16, 12]").spec, [30, 20, 10], 4)
    before = {k: np.array(v, copy=True) for k, v in server.global_weights().items()}
    gradient = learners[0].gradient(before, round=4)[0]["1.weight"]
    live = int(np.flatnonzero(np.abs(gradient).sum(axis=1))[0])
    server._round.secrets.hidden_scales[0][live] *= 1.5
    # Execute
    with pytest.raises(RecoveryError) as caught:
        server.combine(4, uploads, [])
    # Assert
    error = caught.value
    assert error.round == 4
    assert error.residual > error.bound == 1e-8
    assert "Round 4" in str(error) and f"{error.residual:.3e}" in str(error)
    for name, value in server.global_weights().items():
        np.testing.assert_array_equal(value, before[name])
    assert server._round is None, "the secrets are discarded"


def test_perturb_combine_with_tampered_cell_scale_raises_recovery_error() -> None:
    # Prepare
    server, _, uploads = one_round(spec_for(extra=", cells: 3").spec, [30, 20], round_=2)
    server._round.secrets.cell_scales[1] *= -1
    # Execute / Assert
    with pytest.raises(RecoveryError, match="Round 2") as caught:
        server.combine(2, uploads, [])
    assert caught.value.round == 2 and caught.value.residual > 1e-3


def test_perturb_combine_leaves_out_a_garbage_upload_of_the_right_shape() -> None:
    # Prepare: client 1's upload is well formed but recovers to no gradient
    server, _, uploads = one_round(spec_for().spec, [30, 20, 10], round_=3)
    honest, _, again = one_round(spec_for().spec, [30, 20, 10], round_=3)
    rng = np.random.default_rng(0)
    garbage = Payload(
        meta=dict(uploads[1].meta),
        tensors={name: rng.normal(size=t.shape) for name, t in uploads[1].tensors.items()},
    )
    server.check_upload(3, 1, garbage)  # well formed: the checks of form accept it
    # Execute
    result = server.combine(3, {**uploads, 1: garbage}, [])
    reference = honest.combine(3, {0: again[0], 2: again[2]}, [1])
    # Assert: refused with the round, client and residual; the round is the other two's
    assert result is not None and reference is not None
    assert result.participants == 2 and sorted(result.refused) == [1]
    refusal = result.refused[1]
    assert isinstance(refusal, RecoveryError)
    assert refusal.round == 3 and "client 1" in str(refusal) and refusal.residual > 1e-3
    for name, value in reference_weights(honest).items():
        np.testing.assert_allclose(server.global_weights()[name], value, rtol=0, atol=1e-12)


def test_perturb_combine_stops_when_no_upload_recovers() -> None:
    # Prepare: every upload is garbage: the server's secrets, not one client, are suspect
    server, _, uploads = one_round(spec_for().spec, [30, 20], round_=2)
    rng = np.random.default_rng(1)
    garbage = {
        k: Payload(
            meta=dict(u.meta),
            tensors={name: rng.normal(size=t.shape) for name, t in u.tensors.items()},
        )
        for k, u in uploads.items()
    }
    before = {k: np.array(v, copy=True) for k, v in server.global_weights().items()}
    # Execute
    with pytest.raises(RecoveryError) as caught:
        server.combine(2, garbage, [])
    # Assert
    assert caught.value.round == 2 and caught.value.residual > 1e-3
    for name, value in server.global_weights().items():
        np.testing.assert_array_equal(value, before[name])


def reference_weights(server: PerturbServer) -> dict[str, np.ndarray]:
    return {k: np.array(v, copy=True) for k, v in server.global_weights().items()}


def test_perturb_combine_without_uploads_keeps_state_and_discards_secrets() -> None:
    # Prepare
    server = quiet_server(spec_for().spec)
    before = {k: np.array(v, copy=True) for k, v in server.global_weights().items()}
    server.plan_round(1, [0, 1])
    # Execute
    result = server.combine(1, {}, [0, 1])
    # Assert
    assert result is None
    assert server._round is None
    for name, value in server.global_weights().items():
        np.testing.assert_array_equal(value, before[name])


def test_perturb_combine_of_an_unplanned_round_raises() -> None:
    # Prepare
    server, _, uploads = one_round(spec_for().spec, [20, 10], round_=1)
    # Execute / Assert
    with pytest.raises(ProtocolError, match="Round 2 was not planned"):
        server.combine(2, uploads, [])


# --------------------------------------------------------------------------- upload form


def malformed(upload: Payload, case: str) -> Payload:
    tensors = dict(upload.tensors)
    meta = dict(upload.meta)
    first = grad_name("1.weight")
    if case == "missing":
        del tensors[first]
    elif case == "extra":
        tensors["beta/3.weight"] = np.zeros((10, 16))
    elif case == "shape":
        tensors[first] = tensors[first][:, :-1]
    elif case == "dtype":
        tensors[first] = tensors[first].astype(np.float32)
    elif case == "nan":
        tensors[first] = np.where(np.eye(*tensors[first].shape) > 0, np.nan, tensors[first])
    elif case == "inf loss":
        meta["loss"] = float("inf")
    elif case == "no beta value":
        del meta["beta_value"]
    elif case == "short cells":
        meta["cell_values"] = meta["cell_values"][:-1]
    elif case == "text cell":
        meta["cell_values"] = ["1.0", *meta["cell_values"][1:]]
    elif case == "zero examples":
        meta["num_examples"] = 0
    return Payload(meta=meta, tensors=tensors)


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("missing", "missing ['grad/1.weight']"),
        ("extra", "extra ['beta/3.weight']"),
        ("shape", "float64[16, 63]"),
        ("dtype", "float32[16, 64]"),
        ("nan", "NaN"),
        ("inf loss", "loss=inf"),
        ("no beta value", "beta_value=None"),
        ("short cells", "a list of 10 numbers"),
        ("text cell", "cell value='1.0'"),
        ("zero examples", "num_examples=0"),
    ],
)
def test_perturb_check_upload_rejects_malformed_upload(case: str, fragment: str) -> None:
    # Prepare
    server, _, uploads = one_round(spec_for().spec, [20, 10], round_=2)
    # Execute / Assert
    with pytest.raises(ProtocolError) as caught:
        server.check_upload(2, 1, malformed(uploads[1], case))
    assert fragment in str(caught.value)
    assert "client 1 in round 2" in str(caught.value)


def test_perturb_check_upload_rejects_unplanned_client_and_closed_round() -> None:
    # Prepare
    server, _, uploads = one_round(spec_for().spec, [20, 10], round_=2)
    # Execute / Assert
    with pytest.raises(ProtocolError, match="not planned"):
        server.check_upload(2, 5, uploads[1])
    with pytest.raises(ProtocolError, match="round that is not open"):
        server.check_upload(3, 1, uploads[1])


# -------------------------------------------------------------------------- preconditions


@pytest.mark.parametrize(
    ("change", "path", "fragment"),
    [
        (
            "model: {kind: MLP, hidden: [16], bias: false, dtype: float32}",
            "spec.model.dtype",
            "float32",
        ),
        (
            "model: {kind: MLP, hidden: [16], bias: true, dtype: float64}",
            "spec.model.bias",
            "bias-free",
        ),
        (
            "model: {kind: MLP, hidden: [16], bias: false, dtype: float64, activation: Tanh}",
            "spec.model.activation",
            "act(c*z) = c*act(z)",
        ),
        ("model: {kind: CNN, bias: false, dtype: float64}", "spec.model.kind", "fully connected"),
        ("training: {loss: CrossEntropy, optimizer: {kind: SGD}}", "spec.training.loss", "affine"),
        (
            "training: {loss: MSE, localEpochs: 2, optimizer: {kind: SGD}}",
            "spec.training.localEpochs",
            "one gradient per round",
        ),
    ],
)
@pytest.mark.parametrize("protocol", ["perturb", "mpdp"])
def test_load_manifest_refuses_lossless_precondition_with_field_path(
    protocol, change, path, fragment
):
    # Prepare
    base = {
        "model": "model: {kind: MLP, hidden: [16], bias: false, dtype: float64}",
        "training": "training: {loss: MSE, optimizer: {kind: SGD}}",
    }
    base[change.split(":")[0]] = change
    text = (
        "apiVersion: fedcore.dev/v1alpha1\nkind: FederatedRun\nmetadata: {name: unit}\nspec:\n"
        f"  protocol: {{name: {protocol}}}\n  clients: {{count: 2}}\n  rounds: 1\n"
        f"  {base['model']}\n  {base['training']}\n"
    )
    # Execute
    with pytest.raises(SpecError) as caught:
        load_manifest("unit", text=text)
    # Assert
    paths = [issue.path for issue in caught.value.issues]
    assert paths == [path]
    assert f"'{protocol}'" in caught.value.issues[0].message
    assert fragment in caught.value.issues[0].message


@pytest.mark.parametrize(
    ("extra", "path"),
    [
        (", hiddenScale: 1", "spec.protocol.perturb.hiddenScale"),
        (", outputScale: 0.5", "spec.protocol.perturb.outputScale"),
        (", cells: 0", "spec.protocol.perturb.cells"),
        (", residualBound: 0", "spec.protocol.perturb.residualBound"),
    ],
)
def test_load_manifest_refuses_out_of_range_perturb_option(extra: str, path: str) -> None:
    # Execute / Assert
    with pytest.raises(SpecError) as caught:
        spec_for(extra=extra)
    assert [issue.path for issue in caught.value.issues] == [path]


def test_perturb_server_refuses_more_cells_than_outputs_and_a_model_without_hidden_layer() -> None:
    # Prepare
    many_cells = spec_for(extra=", cells: 11").spec
    # Execute / Assert
    with pytest.raises(ProtocolError, match="cells is 11, but the model has 10 outputs"):
        quiet_server(many_cells)
    # A network without a hidden layer hides nothing: refused already at validation.
    with pytest.raises(SpecError, match=r"spec\.model\.hidden: \[\] is not allowed"):
        spec_for(hidden="[]")


def test_known_leak_s2_a_client_fits_the_output_noise_with_its_own_labels() -> None:
    # Prepare: a model trained (full-batch MSE gradient descent) to fit digits, perturbed.
    spec = spec_for(hidden="[32]").spec
    x, y = load_digits(return_X_y=True)
    x = torch.from_numpy(x / 16.0)
    targets = F.one_hot(torch.from_numpy(y), 10).double()
    weights = get_weights(build_model(spec.model, (1, 8, 8), 10, seed=0))
    names = list(weights)
    params = [torch.tensor(weights[n], requires_grad=True) for n in names]
    for _ in range(300):
        loss = F.mse_loss(
            F.linear(torch.relu(F.linear(x[:1400], params[0])), params[1]), targets[:1400]
        )
        for param, grad in zip(params, torch.autograd.grad(loss, params), strict=True):
            param.data -= 2.0 * grad
    server = PerturbServer(
        {n: p.detach().numpy() for n, p in zip(names, params, strict=True)},
        learning_rate=1.0,
        residual_bound=1e-8,
        cells=None,
        hidden_scale=10,
        output_scale=2,
        secure_secrets=True,
        seed=0,
    )
    perturbed = server.plan_round(1, [0])[0].tensors
    true = true_forward([server.global_weights()[n] for n in names], x)[-1].numpy()
    hidden, outputs = (t.numpy() for t in true_forward([perturbed[n] for n in names], x))
    alpha = hidden.sum(axis=1)
    own, held_out = slice(0, 150), slice(1400, None)
    # Execute: least squares for r on 150 own labelled examples (digest §7b S2).
    residuals = outputs[own] - targets[own].numpy()
    r_hat = (alpha[own, None] * residuals).sum(axis=0) / (alpha[own] ** 2).sum()
    estimate = outputs[held_out] - alpha[held_out, None] * r_hat
    # Assert: naive reading is near chance, the fitted one near the true model's predictions.
    naive = np.mean(outputs[held_out].argmax(1) == true[held_out].argmax(1))
    fitted = np.mean(estimate.argmax(1) == true[held_out].argmax(1))
    assert np.mean(true[held_out].argmax(1) == y[held_out]) > 0.85, "the model fits"
    assert naive < 0.4
    assert fitted > 0.95

"""Tests of fedcore.learning.training: local training, full-shard gradients and evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedcore.learning import training as training_module
from fedcore.learning.data import ArrayDataset, load_split
from fedcore.learning.models import build_model, get_weights, release_storage, set_weights
from fedcore.learning.training import (
    RESIDENT_BYTES_ENV,
    EvalResult,
    Evaluator,
    LocalLearner,
    LocalStats,
)
from fedcore.spec import DataSpec, ModelSpec, OptimizerSpec, TrainingSpec

SEED = 5
CLIENT = 2


def _shard(n: int = 50) -> ArrayDataset:
    """The first ``n`` digits training examples."""
    train, _ = load_split(DataSpec())
    return train.subset(np.arange(n))


def _model(seed: int = 0, dtype: Literal["float32", "float64"] = "float32") -> nn.Module:
    """A small digits MLP."""
    return build_model(ModelSpec(hidden=[16], dtype=dtype), (1, 8, 8), 10, seed=seed)


def _training(
    *,
    batch_size: int = 16,
    local_epochs: int = 1,
    loss: Literal["CrossEntropy", "MSE"] = "CrossEntropy",
    optimizer: OptimizerSpec | None = None,
) -> TrainingSpec:
    """A TrainingSpec with small batches and, unless given, SGD with momentum."""
    return TrainingSpec(
        batch_size=batch_size,
        local_epochs=local_epochs,
        loss=loss,
        optimizer=optimizer or OptimizerSpec(learning_rate=0.05, momentum=0.9),
    )


def _learner(training: TrainingSpec, data: ArrayDataset | None = None) -> LocalLearner:
    """A LocalLearner for client CLIENT of a run seeded SEED."""
    shard = _shard() if data is None else data
    return LocalLearner(_model(seed=9), shard, training, seed=SEED, client_index=CLIENT)


def _assert_close(a: dict[str, np.ndarray], b: dict[str, np.ndarray], tol: float = 1e-6) -> None:
    """Asserts two weight dicts have the same names and values within ``tol``."""
    assert list(a) == list(b)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=0, atol=tol, err_msg=name)


def _plain_loop(
    weights: dict[str, np.ndarray],
    data: ArrayDataset,
    training: TrainingSpec,
    *,
    round: int,
    epochs: int,
) -> tuple[dict[str, np.ndarray], float]:
    """The reference: a hand-written torch loop with the documented shuffle."""
    model = _model()
    set_weights(model, weights)
    spec = training.optimizer
    optimizer: torch.optim.Optimizer
    if spec.kind == "Adam":
        optimizer = torch.optim.Adam(
            model.parameters(), lr=spec.learning_rate, weight_decay=spec.weight_decay
        )
    else:
        optimizer = torch.optim.SGD(
            model.parameters(),
            lr=spec.learning_rate,
            momentum=spec.momentum,
            weight_decay=spec.weight_decay,
        )
    x = torch.from_numpy(data.x.copy())
    y = torch.from_numpy(data.y.copy())
    rng = np.random.default_rng([SEED, round, CLIENT])
    losses = []
    for _ in range(epochs):
        order = rng.permutation(len(data))
        for start in range(0, len(data), training.batch_size):
            rows = torch.from_numpy(order[start : start + training.batch_size])
            optimizer.zero_grad()
            logits = model(x[rows])
            if training.loss == "MSE":
                loss = F.mse_loss(logits, F.one_hot(y[rows], 10).float())
            else:
                loss = F.cross_entropy(logits, y[rows])
            loss.backward()
            optimizer.step()
            losses.append(loss.item() * len(rows))
    return get_weights(model), sum(losses) / (epochs * len(data))


# ------------------------------------------------------------------------------------ train


@pytest.mark.parametrize(
    "optimizer",
    [
        OptimizerSpec(learning_rate=0.05, momentum=0.9, weight_decay=0.01),
        OptimizerSpec(kind="Adam", learning_rate=0.01, weight_decay=0.001),
    ],
)
def test_local_learner_train_equals_plain_torch_loop(optimizer: OptimizerSpec) -> None:
    # Prepare
    training = _training(optimizer=optimizer)
    learner = _learner(training)
    start = get_weights(_model(seed=1))

    # Execute
    weights, stats = learner.train(start, round=3)

    # Assert
    expected, expected_loss = _plain_loop(start, _shard(), training, round=3, epochs=1)
    _assert_close(weights, expected)
    assert (stats.num_examples, stats.steps) == (50, 4)
    assert stats.loss == pytest.approx(expected_loss, abs=1e-6)


def test_local_learner_train_mse_equals_plain_torch_loop() -> None:
    # Prepare
    training = _training(loss="MSE")
    learner = _learner(training)
    start = get_weights(_model(seed=1))

    # Execute
    weights, stats = learner.train(start, round=0, epochs=2)

    # Assert
    expected, expected_loss = _plain_loop(start, _shard(), training, round=0, epochs=2)
    _assert_close(weights, expected)
    assert stats.loss == pytest.approx(expected_loss, abs=1e-6)
    assert stats.steps == 8


def test_local_learner_train_deterministic_per_round() -> None:
    # Prepare
    training = _training()
    start = get_weights(_model(seed=1))

    # Execute
    first, _ = _learner(training).train(start, round=1)
    again, _ = _learner(training).train(start, round=1)
    other, _ = _learner(training).train(start, round=2)

    # Assert
    _assert_close(first, again, tol=0.0)
    assert not np.array_equal(first["1.weight"], other["1.weight"])


def test_local_learner_train_fresh_optimizer_every_call() -> None:
    # Prepare
    learner = _learner(_training())
    start = get_weights(_model(seed=1))

    # Execute
    first, _ = learner.train(start, round=4)
    learner.train(first, round=5)
    again, _ = learner.train(start, round=4)

    # Assert
    _assert_close(first, again, tol=0.0)


def test_local_learner_train_keeps_callers_weights() -> None:
    # Prepare
    learner = _learner(_training())
    start = get_weights(_model(seed=1))
    kept = {k: v.copy() for k, v in start.items()}

    # Execute
    learner.train(start, round=0)
    learner.gradient(start, round=0)

    # Assert
    _assert_close(start, kept, tol=0.0)


def test_local_learner_train_epochs_override_counts_steps() -> None:
    # Prepare
    learner = _learner(_training(local_epochs=2, batch_size=20))
    start = get_weights(_model(seed=1))

    # Execute
    _, default_stats = learner.train(start, round=0)
    _, override_stats = learner.train(start, round=0, epochs=3)

    # Assert
    assert default_stats.steps == 6
    assert override_stats.steps == 9


def test_local_learner_train_float64_model() -> None:
    # Prepare
    model = _model(seed=1, dtype="float64")
    learner = LocalLearner(model, _shard(), _training(), seed=SEED, client_index=CLIENT)

    # Execute
    weights, stats = learner.train(get_weights(model), round=0)

    # Assert
    assert all(w.dtype == np.float64 for w in weights.values())
    assert np.isfinite(stats.loss)


def test_local_learner_train_dropout_deterministic_and_global_rng_untouched() -> None:
    # Prepare
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Dropout(0.5), nn.Linear(64, 10))

    start = get_weights(make())
    learners = [
        LocalLearner(make(), _shard(), _training(), seed=SEED, client_index=CLIENT)
        for _ in range(2)
    ]
    torch.manual_seed(77)
    expected = torch.rand(3)
    torch.manual_seed(77)

    # Execute
    first, _ = learners[0].train(start, round=0)
    again, _ = learners[1].train(start, round=0)
    drawn = torch.rand(3)

    # Assert
    _assert_close(first, again, tol=0.0)
    assert torch.equal(drawn, expected)


@pytest.mark.parametrize(("round", "epochs"), [(-1, None), (0, 0)])
def test_local_learner_train_refuses_bad_arguments(round: int, epochs: int | None) -> None:
    # Prepare
    learner = _learner(_training())
    start = get_weights(_model())

    # Execute / Assert
    with pytest.raises(ValueError, match="must be"):
        learner.train(start, round=round, epochs=epochs)


def test_local_learner_init_refuses_empty_shard() -> None:
    # Prepare
    empty = _shard().subset(np.array([], dtype=np.int64))

    # Execute / Assert
    with pytest.raises(ValueError, match="Client 2 has no training examples"):
        _learner(_training(), data=empty)


def test_local_learner_train_refuses_mismatched_weights() -> None:
    # Prepare
    learner = _learner(_training())
    wrong = get_weights(build_model(ModelSpec(hidden=[8]), (1, 8, 8), 10, seed=0))

    # Execute / Assert
    with pytest.raises(ValueError, match=r"'1\.weight' has shape"):
        learner.train(wrong, round=0)


# --------------------------------------------------------------------------------- gradient


@pytest.mark.parametrize("loss", ["CrossEntropy", "MSE"])
def test_local_learner_gradient_equals_autograd(loss: Literal["CrossEntropy", "MSE"]) -> None:
    # Prepare
    training = _training(loss=loss)
    learner = _learner(training)
    start = get_weights(_model(seed=1))
    model = _model(seed=1)
    data = _shard()
    logits = model(torch.from_numpy(data.x.copy()))
    labels = torch.from_numpy(data.y.copy())
    if loss == "MSE":
        reference = F.mse_loss(logits, F.one_hot(labels, 10).float())
    else:
        reference = F.cross_entropy(logits, labels)
    reference.backward()
    expected = {}
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None
        expected[name] = parameter.grad.numpy()

    # Execute
    gradient, stats = learner.gradient(start, round=0)

    # Assert
    _assert_close(gradient, expected)
    assert isinstance(stats, LocalStats)
    assert (stats.num_examples, stats.steps) == (50, 1)
    assert stats.loss == pytest.approx(reference.item(), abs=1e-6)


def test_local_learner_gradient_step_equals_full_batch_train() -> None:
    # Prepare
    optimizer = OptimizerSpec(learning_rate=0.3)
    training = _training(batch_size=64, optimizer=optimizer)
    learner = _learner(training)
    start = get_weights(_model(seed=1))

    # Execute
    gradient, _ = learner.gradient(start, round=6)
    trained, stats = learner.train(start, round=6, epochs=1)

    # Assert
    stepped = {name: start[name] - 0.3 * gradient[name] for name in start}
    _assert_close(trained, stepped)
    assert stats.steps == 1


def test_local_learner_gradient_gives_zeros_for_buffers() -> None:
    # Prepare
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.BatchNorm1d(8), nn.Linear(8, 10))

    model = make()
    learner = LocalLearner(model, _shard(), _training(), seed=SEED, client_index=CLIENT)

    # Execute
    gradient, _ = learner.gradient(get_weights(make()), round=0)

    # Assert
    assert list(gradient) == list(get_weights(model))
    assert not gradient["2.running_mean"].any()
    assert gradient["2.num_batches_tracked"].dtype == np.int64
    assert gradient["1.weight"].any()


# -------------------------------------------------------------------------------- evaluator


@pytest.mark.parametrize("loss", ["CrossEntropy", "MSE"])
def test_evaluator_evaluate_equals_manual_computation(
    loss: Literal["CrossEntropy", "MSE"],
) -> None:
    # Prepare
    _, test = load_split(DataSpec())
    weights = get_weights(_model(seed=3))
    reference = _model(seed=3)
    with torch.no_grad():
        logits = reference(torch.from_numpy(test.x.copy()))
    labels = torch.from_numpy(test.y.copy())
    if loss == "MSE":
        expected_loss = F.mse_loss(logits, F.one_hot(labels, 10).float()).item()
    else:
        expected_loss = F.cross_entropy(logits, labels).item()
    expected_accuracy = int((logits.argmax(1) == labels).sum()) / len(test)
    evaluator = Evaluator(_model(), test, _training(loss=loss), batch_size=7)

    # Execute
    result = evaluator.evaluate(weights)

    # Assert
    assert result.num_examples == 360
    assert result.accuracy == expected_accuracy
    assert result.loss == pytest.approx(expected_loss, abs=1e-5)


def test_evaluator_evaluate_improves_after_training() -> None:
    # Prepare
    train, test = load_split(DataSpec())
    start = get_weights(_model(seed=0))
    training = TrainingSpec(batch_size=32, optimizer=OptimizerSpec(learning_rate=0.3))
    learner = LocalLearner(_model(), train, training, seed=0, client_index=0)
    evaluator = Evaluator(_model(), test, TrainingSpec())

    # Execute
    before = evaluator.evaluate(start)
    trained, _ = learner.train(start, round=0, epochs=3)
    after = evaluator.evaluate(trained)

    # Assert
    assert isinstance(after, EvalResult)
    assert after.loss < before.loss
    assert after.accuracy > 0.85


def test_an_evaluator_that_owns_its_model_borrows_the_weights_it_scores() -> None:
    # Prepare: two evaluators of the same data, one copying weights in, one borrowing them
    _, test = load_split(DataSpec())
    training = _training()
    weights = [get_weights(_model(seed=seed)) for seed in (3, 4)]
    copying = Evaluator(_model(), test, training, batch_size=50)
    borrowing = Evaluator(_model(), test, training, batch_size=50, own_model=True)
    model = borrowing._model

    # Execute / Assert: equal counts, the weights untouched, and no storage held between
    assert all(p.device.type == "meta" for p in model.parameters())
    for w in weights:
        before = {name: array.copy() for name, array in w.items()}
        assert borrowing.counts(w, per_class=True) == copying.counts(w, per_class=True)
        assert borrowing.evaluate(w, rows=(10, 70)) == copying.evaluate(w, rows=(10, 70))
        for name, array in w.items():
            np.testing.assert_array_equal(array, before[name])
        assert all(p.device.type == "meta" for p in model.parameters())
        assert all(not p.requires_grad or p.grad is None for p in model.parameters())


def test_set_weights_borrowing_makes_the_module_a_view_of_the_weights() -> None:
    module = _model(seed=1)
    weights = get_weights(_model(seed=2))
    state = set_weights(module, weights, borrow=True)
    for name, array in weights.items():
        assert state[name].data_ptr() == array.ctypes.data  # the very memory, not a copy
    assert all(p.requires_grad for p in module.parameters())  # the module's flags are kept
    with pytest.raises(ValueError, match="shape"):
        set_weights(module, {**weights, "1.weight": np.zeros((2, 2), np.float32)}, borrow=True)


@pytest.fixture
def every_model_large(monkeypatch: pytest.MonkeyPatch) -> None:
    """Treats the small test models as large ones (``LARGE_MODEL_BYTES``): trained in place,
    stepped in the backward pass, their own memory let go."""
    monkeypatch.setattr(training_module, "LARGE_MODEL_BYTES", 1)


def _in_place_learner(training: TrainingSpec) -> LocalLearner:
    """The same learner as ``_learner``, lent the weights its callers consume."""
    return LocalLearner(
        _model(seed=9), _shard(), training, seed=SEED, client_index=CLIENT, in_place=True
    )


@pytest.mark.parametrize(
    "optimizer",
    [
        OptimizerSpec(learning_rate=0.05, momentum=0.9),
        OptimizerSpec(kind="Adam", learning_rate=0.01),
    ],
)
def test_a_consumed_call_trains_in_the_callers_arrays_to_the_very_same_weights(
    optimizer: OptimizerSpec, every_model_large: None
) -> None:
    # Prepare: the same three rounds on a copying learner and on one lent the task's arrays
    training = _training(optimizer=optimizer)
    copying, lent = _learner(training), _in_place_learner(training)
    start = get_weights(_model(seed=1))

    # Execute / Assert
    weights = start
    for round_ in range(3):
        expected, expected_stats = copying.train(weights, round=round_)
        task = {name: array.copy() for name, array in weights.items()}  # the decoded task
        trained, stats = lent.train(task, round=round_, consume=True)
        _assert_close(trained, expected, tol=0.0)  # bit for bit
        assert stats == expected_stats
        for name, array in trained.items():
            assert np.shares_memory(array, task[name])  # trained in the task: no copy
            np.testing.assert_array_equal(task[name], expected[name])
        parameters = dict(lent._model.named_parameters())
        for name, parameter in parameters.items():
            assert parameter.data_ptr() == task[name].ctypes.data  # the model holds no other
        weights = expected


def test_a_lent_learner_copies_unless_the_call_consumes(every_model_large: None) -> None:
    # Prepare
    training = _training()
    lent = _in_place_learner(training)
    start = get_weights(_model(seed=1))
    kept = {k: v.copy() for k, v in start.items()}
    first = {k: v.copy() for k, v in start.items()}

    # Execute: a consumed call, then calls that do not consume (train, gradient)
    trained, _ = lent.train(first, round=0, consume=True)
    uploaded = {k: v.copy() for k, v in trained.items()}
    again, _ = lent.train(start, round=0)
    gradient, _ = lent.gradient(start, round=1)

    # Assert: what did not consume is kept; the first call's arrays (its upload) are not
    # written by the later calls; the numbers are those of a copying learner
    _assert_close(start, kept, tol=0.0)
    _assert_close(first, uploaded, tol=0.0)
    assert all(not np.shares_memory(again[k], start[k]) for k in again)
    _assert_close(again, _learner(training).train(start, round=0)[0], tol=0.0)
    _assert_close(gradient, _learner(training).gradient(start, round=1)[0], tol=0.0)


def test_a_model_shared_by_learners_never_writes_an_upload_it_was_lent(
    every_model_large: None,
) -> None:
    # Prepare: two clients' learners over one model (a client group shares one); the first
    # trains in its task and uploads it, the second copies weights in and trains
    training = _training()
    model = _model(seed=9)
    first = LocalLearner(model, _shard(), training, seed=SEED, client_index=0, in_place=True)
    second = LocalLearner(model, _shard(40), training, seed=SEED, client_index=1)
    task = get_weights(_model(seed=1))
    other = get_weights(_model(seed=2))

    # Execute
    upload, _ = first.train(task, round=0, consume=True)
    sent = {k: v.copy() for k, v in upload.items()}
    trained, _ = second.train(other, round=0)
    set_weights(model, other)  # an evaluation of the same model, copying

    # Assert: the first upload is untouched; the second learner's numbers are its own
    _assert_close(upload, sent, tol=0.0)
    alone = LocalLearner(_model(seed=9), _shard(40), training, seed=SEED, client_index=1)
    _assert_close(trained, alone.train(other, round=0)[0], tol=0.0)


@pytest.mark.parametrize("lent", [False, True])
def test_a_learner_not_lent_its_inputs_never_trains_in_them(lent: bool) -> None:
    # A simulation's clients share the server's arrays: consume alone changes nothing; nor
    # does a lent small model (it copies, which is cheaper for it)
    learner = _in_place_learner(_training()) if lent else _learner(_training())
    start = get_weights(_model(seed=1))
    kept = {k: v.copy() for k, v in start.items()}
    trained, _ = learner.train(start, round=0, consume=True)
    _assert_close(start, kept, tol=0.0)
    assert all(not np.shares_memory(trained[k], start[k]) for k in trained)


class _TinyTransformer(nn.Module):
    """An image read as 8 tokens of 8 pixels through one pre-norm encoder layer (torch's
    multi-head attention, layer norms, dropout): what a large model is built of, small."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(8, 16)
        self.layer = nn.TransformerEncoderLayer(
            16, 2, 32, dropout=0.1, batch_first=True, norm_first=True
        )
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.embed(x.reshape(-1, 8, 8))).mean(dim=1))


def _stepping_learner(
    model: nn.Module, training: TrainingSpec, *, step_in_backward: bool
) -> LocalLearner:
    return LocalLearner(
        model,
        _shard(),
        training,
        seed=SEED,
        client_index=CLIENT,
        step_in_backward=step_in_backward,
    )


@pytest.mark.parametrize(
    "optimizer",
    [
        OptimizerSpec(learning_rate=0.05, momentum=0.9, weight_decay=0.01),
        OptimizerSpec(kind="Adam", learning_rate=0.01, weight_decay=0.01),
    ],
)
@pytest.mark.parametrize("network", ["mlp", "transformer"])
def test_stepping_in_backward_trains_to_the_very_same_weights(
    optimizer: OptimizerSpec, network: str
) -> None:
    # Prepare: two epochs of several batches, from the same start, both ways
    training = _training(optimizer=optimizer, local_epochs=2, batch_size=16)

    def model() -> nn.Module:
        return _model(seed=9) if network == "mlp" else _TinyTransformer(seed=9)

    whole = _stepping_learner(model(), training, step_in_backward=False)
    stepped = _stepping_learner(model(), training, step_in_backward=True)
    start = get_weights(model())

    # Execute / Assert: equal bit for bit, round after round (each call starts afresh)
    weights = start
    for round_ in range(3):
        expected, expected_stats = whole.train(weights, round=round_)
        trained, stats = stepped.train(weights, round=round_)
        _assert_close(trained, expected, tol=0.0)
        assert stats == expected_stats
        weights = expected
    assert all(p.grad is None for p in stepped.model.parameters())
    # Other backward passes on the model are not stepped: the full-shard gradient is exact
    gradient, _ = stepped.gradient(start, round=1)
    _assert_close(gradient, whole.gradient(start, round=1)[0], tol=0.0)


@pytest.mark.parametrize("step_in_backward", [False, True])
def test_stepping_in_backward_holds_one_gradient_at_a_time(step_in_backward: bool) -> None:
    # Prepare: a probe, hooked before the learner's own hooks, counts the parameters that
    # hold a gradient each time one parameter's gradient is complete
    model = _TinyTransformer(seed=3)
    parameters = [p for p in model.parameters() if p.requires_grad]
    held: list[int] = []
    for parameter in parameters:
        parameter.register_post_accumulate_grad_hook(
            lambda _: held.append(sum(p.grad is not None for p in parameters))
        )
    learner = _stepping_learner(model, _training(), step_in_backward=step_in_backward)

    # Execute
    learner.train(get_weights(_TinyTransformer(seed=4)), round=0)

    # Assert: stepped, each gradient is gone before the next is complete; otherwise all
    # of them are held together at the end of each backward pass
    assert held
    assert max(held) == (1 if step_in_backward else len(parameters))


def test_local_learner_train_lets_go_of_gradients_and_optimizer_state() -> None:
    learner = _learner(_training(optimizer=OptimizerSpec(kind="Adam", learning_rate=0.01)))
    trained, _ = learner.train(get_weights(_model(seed=9)), round=0)
    model = learner._model
    assert trained and all(p.grad is None for p in model.parameters())
    optimizer = learner._optimizer
    assert optimizer is not None and not optimizer.state  # Adam's moments: twice the model


def test_evaluator_init_refuses_empty_data() -> None:
    # Prepare
    empty = _shard().subset(np.array([], dtype=np.int64))

    # Execute / Assert
    with pytest.raises(ValueError, match="no examples"):
        Evaluator(_model(), empty, TrainingSpec())


def _mapped(data: ArrayDataset, folder: Path) -> ArrayDataset:
    """The same examples with features in a read-only memory map, as the data cache gives."""
    path = folder / "x.npy"
    np.save(path, data.x)
    return ArrayDataset(np.load(path, mmap_mode="r"), data.y, data.num_classes)


@pytest.mark.parametrize("loss", ["CrossEntropy", "MSE"])
def test_a_streamed_shard_trains_to_the_very_weights_of_a_held_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loss: Literal["CrossEntropy", "MSE"]
) -> None:
    data = _shard(70)
    training = _training(loss=loss, batch_size=16, local_epochs=2)
    held = LocalLearner(_model(dtype="float64"), data, training, seed=4, client_index=1)
    monkeypatch.setenv(RESIDENT_BYTES_ENV, "0")  # anything mapped is streamed
    streamed = LocalLearner(
        _model(dtype="float64"), _mapped(data, tmp_path), training, seed=4, client_index=1
    )
    assert streamed.streamed and not held.streamed
    start = get_weights(_model(seed=9, dtype="float64"))
    trained_held, stats_held = held.train(start, round=3)
    trained_streamed, stats_streamed = streamed.train(start, round=3)
    assert stats_held == stats_streamed
    for name in trained_held:
        assert np.array_equal(trained_held[name], trained_streamed[name]), name
    gradient_held, _ = held.gradient(start, round=3)
    gradient_streamed, g_stats = streamed.gradient(start, round=3)
    for name in gradient_held:
        np.testing.assert_allclose(
            gradient_streamed[name], gradient_held[name], rtol=1e-12, atol=1e-15
        )
    assert g_stats.loss == pytest.approx(held.gradient(start, round=3)[1].loss, rel=1e-12)
    # A protocol that needs the whole matrix gets it (read from the map once).
    assert torch.equal(streamed.features, held.features)
    assert torch.equal(streamed.targets, held.targets)


def test_release_storage_keeps_the_shapes_and_the_next_load_gives_memory_back() -> None:
    # Prepare
    module = _model(seed=1)
    weights = get_weights(_model(seed=2))
    shapes = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    parameters = list(module.parameters())

    # Execute / Assert: one element of memory each, the same shapes and parameter objects
    release_storage(module)
    assert {name: tuple(t.shape) for name, t in module.state_dict().items()} == shapes
    assert all(t.untyped_storage().nbytes() <= 8 for t in module.state_dict().values())
    assert list(module.parameters()) == parameters
    copied = {k: v.copy() for k, v in weights.items()}
    set_weights(module, copied)  # a copying load: fresh storage, the arrays not lent
    for name, tensor in module.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), weights[name])
        assert tensor.untyped_storage().nbytes() == weights[name].nbytes
        assert not np.shares_memory(tensor.numpy(), copied[name])


def test_an_in_place_learner_of_a_large_model_lets_go_of_its_own_memory(
    every_model_large: None,
) -> None:
    # A "large" model here: any (the threshold lowered); its first task brings its memory
    lent = _in_place_learner(_training())
    assert all(p.untyped_storage().nbytes() <= 8 for p in lent.model.parameters())
    task = get_weights(_model(seed=1))
    expected, _ = _learner(_training()).train(task, round=0)
    trained, _ = lent.train({k: v.copy() for k, v in task.items()}, round=0, consume=True)
    _assert_close(trained, expected, tol=0.0)

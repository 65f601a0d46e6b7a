"""The large-model example: examples/big-transformer.yaml and its user model
examples/models/big_transformer.py (benchmarks/bigmodel.py runs it for real)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedcore.learning.data import load_split
from fedcore.learning.models import build_model, get_weights
from fedcore.learning.training import Evaluator, LocalLearner
from fedcore.spec import DataSpec, OptimizerSpec, TrainingSpec, load_manifest

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "examples" / "models"


@pytest.fixture
def big_transformer(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(MODELS))
    import big_transformer

    return big_transformer


def _parameters(factory, input_shape: tuple[int, ...]) -> int:  # type: ignore[no-untyped-def]
    with torch.device("meta"):  # shapes only: no memory for a billion parameters
        model = factory(input_shape, 10)
    return sum(int(t.numel()) for t in model.state_dict().values())


def test_the_example_models_have_the_sizes_they_promise(big_transformer) -> None:  # type: ignore[no-untyped-def]
    assert 100_000_000 <= _parameters(big_transformer.digits_transformer, (1, 8, 8)) < 102_000_000
    assert 1_000_000_000 <= _parameters(big_transformer.transformer_1b, (1, 8, 8)) < 1_020_000_000


def test_the_example_manifest_builds_its_user_model(big_transformer) -> None:  # type: ignore[no-untyped-def]
    run = load_manifest(REPO / "examples" / "big-transformer.yaml")
    assert run.spec.model.kind == "Import"
    assert run.spec.model.import_path == "big_transformer:digits_transformer"
    with torch.device("meta"):
        model = build_model(run.spec.model, (1, 8, 8), 10, seed=run.spec.seed)
    assert sum(p.numel() for p in model.parameters()) >= 100_000_000


@pytest.mark.parametrize("input_shape", [(1, 8, 8), (8, 8), (30,)])
def test_a_small_token_transformer_reads_images_and_vectors(
    big_transformer,
    input_shape: tuple[int, ...],  # type: ignore[no-untyped-def]
) -> None:
    torch.manual_seed(0)
    model = big_transformer.TokenTransformer(input_shape, 3, width=16, layers=2, heads=2)
    x = torch.randn(5, *input_shape)
    out = model(x)
    assert out.shape == (5, 3)
    # Each example is scored on its own (no mixing across the batch).
    torch.testing.assert_close(model(x[2:3]), out[2:3], rtol=1e-5, atol=1e-6)


def test_a_small_token_transformer_learns_digits_through_fedcores_learner(
    big_transformer,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    # The same class as the example, small enough for a unit test: a few local epochs lift
    # held-out accuracy far above chance (0.1; 0.52 when this was written).
    train, test = load_split(DataSpec())

    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return big_transformer.TokenTransformer((1, 8, 8), 10, width=32, layers=2, heads=4)

    training = TrainingSpec(batch_size=32, optimizer=OptimizerSpec(learning_rate=0.05))
    learner = LocalLearner(make(0), train, training, seed=0, client_index=0)
    evaluator = Evaluator(make(1), test, training, own_model=True)
    start = get_weights(make(0))
    trained, stats = learner.train(start, round=0, epochs=3)
    assert stats.num_examples == len(train)
    assert evaluator.evaluate(trained).accuracy > 0.4 > evaluator.evaluate(start).accuracy

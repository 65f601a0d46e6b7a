"""Federated evaluation: the clients' counts add up exactly to the centralized evaluation of the
same model on the union of their held-out examples, and malformed answers are refused."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedcore.errors import MessageRejected
from fedcore.learning.data import (
    ArrayDataset,
    _cache,
    _own,
    client_test_dataset,
    dataset_info,
    test_dataset,
)
from fedcore.learning.evaluation import (
    answer_meta,
    checked_answer,
    evaluation_request,
    is_evaluation,
    requested_models,
    score,
    summed,
)
from fedcore.learning.models import build_model, get_weights
from fedcore.learning.training import EvalCounts, Evaluator
from fedcore.spec import FederatedRunSpec, parse_manifest


def run_spec(data: dict[str, Any], clients: int, **spec: Any) -> FederatedRunSpec:
    return parse_manifest(
        {
            "apiVersion": "fedcore.dev/v1alpha1",
            "kind": "FederatedRun",
            "metadata": {"name": "fed-eval"},
            "spec": {
                "protocol": {"name": "fedavg"},
                "model": {"kind": "MLP", "hidden": [8], "dtype": "float64"},
                "data": data,
                "clients": {"count": clients},
                "rounds": 1,
                **spec,
            },
        }
    ).spec


def trained_weights(spec: FederatedRunSpec, seed: int) -> dict[str, np.ndarray]:
    """A model that is not the initial one (random weights from another seed)."""
    shape, classes = dataset_info(spec)
    return get_weights(build_model(spec.model, shape, classes, seed=seed))


def clients_sum(spec: FederatedRunSpec, weights: dict[str, np.ndarray]) -> EvalCounts:
    answers = []
    for index in range(spec.clients.count):
        test = client_test_dataset(spec, index)
        model = build_model(spec.model, test.input_shape, test.num_classes, seed=spec.seed)
        evaluator = Evaluator(model, test, spec.training, allow_empty=True)
        # Through the wire form and the server's check, as the roles exchange them.
        meta = answer_meta(score(evaluator, [weights], per_class=True))
        answers.append(checked_answer(meta, test.num_classes, per_class=True))
    return summed(answers).counts


def central(spec: FederatedRunSpec, union: ArrayDataset, weights: dict[str, np.ndarray]) -> Any:
    model = build_model(spec.model, union.input_shape, union.num_classes, seed=spec.seed)
    return Evaluator(model, union, spec.training).counts(weights, per_class=True)


def assert_same(fed: EvalCounts, whole: EvalCounts) -> None:
    assert (fed.total, fed.correct) == (whole.total, whole.correct)
    assert fed.class_total == whole.class_total and fed.class_correct == whole.class_correct
    assert math.isclose(fed.loss_sum, whole.loss_sum, rel_tol=1e-9, abs_tol=0)
    assert math.isclose(fed.result().accuracy, whole.result().accuracy, rel_tol=0, abs_tol=1e-15)


def test_clients_blocks_of_a_shared_test_split_add_up_to_the_servers_evaluation() -> None:
    spec = run_spec({"source": {"kind": "Digits"}}, clients=7)
    weights = trained_weights(spec, seed=11)
    assert_same(clients_sum(spec, weights), central(spec, test_dataset(spec), weights))


def test_clients_own_held_out_rows_add_up_to_the_central_evaluation_of_their_union(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_cache.CACHE_ENV, str(tmp_path / "cache"))
    _own._LOADED.clear()
    rng = np.random.default_rng(3)
    for site, rows in enumerate((31, 5, 64)):
        folder = tmp_path / f"site-{site}"
        folder.mkdir()
        frame = pa.table(
            {
                "a": rng.normal(size=rows),
                "b": rng.normal(size=rows),
                "label": rng.choice(["x", "y", "z"], rows).tolist(),
            }
        )
        pq.write_table(frame, folder / "data.parquet")
    data = {
        "clientData": {"format": "Parquet", "template": {"path": str(tmp_path / "site-{index}")}},
        "schema": {"labels": ["x", "y", "z"], "features": [{"name": "a"}, {"name": "b"}]},
        "testFraction": 0.3,
    }
    spec = run_spec(data, clients=3)
    tests = [client_test_dataset(spec, index) for index in range(3)]
    union = ArrayDataset(
        np.concatenate([t.x for t in tests]), np.concatenate([t.y for t in tests]), 3
    )
    weights = trained_weights(spec, seed=5)
    fed = clients_sum(spec, weights)
    assert fed.total == sum(math.ceil(0.3 * rows) for rows in (31, 5, 64))
    assert_same(fed, central(spec, union, weights))
    _own._LOADED.clear()


def test_a_request_carries_every_model_and_the_client_scores_the_best_on_its_data() -> None:
    spec = run_spec({"source": {"kind": "Digits"}}, clients=2)
    models = [trained_weights(spec, seed) for seed in (1, 2, 3)]
    request = evaluation_request(models, per_class=False)
    back = requested_models(request.tensors)
    assert len(back) == 3
    for sent, got in zip(models, back, strict=True):
        assert sent.keys() == got.keys()
        assert all(np.array_equal(sent[name], got[name]) for name in sent)
    test = client_test_dataset(spec, 0)
    model = build_model(spec.model, test.input_shape, test.num_classes, seed=0)
    evaluator = Evaluator(model, test, spec.training)
    losses = [evaluator.counts(weights).loss_sum for weights in models]
    assert score(evaluator, back, per_class=False).loss_sum == min(losses)
    with pytest.raises(MessageRejected):
        requested_models({"weights": np.zeros(2)})


GOOD = {"total": 10, "correct": 7, "lossSum": 3.5, "classTotal": [6, 4], "classCorrect": [5, 2]}


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"total": -1}, "total"),
        ({"correct": 11, "classCorrect": [6, 5]}, "correct 11 > total 10"),
        ({"lossSum": float("nan")}, "lossSum"),
        ({"lossSum": -0.5}, "lossSum"),
        ({"total": True}, "total"),
        ({"correct": 7.0}, "correct"),
        ({"classTotal": [6, 3]}, "do not add up"),
        ({"classTotal": [10]}, "needs 2 counts"),
        ({"classCorrect": [7, 0], "classTotal": [6, 4]}, "more right than scored"),
    ],
)
def test_a_malformed_answer_is_refused_with_what_is_wrong(change: dict[str, Any], why: str) -> None:
    assert checked_answer({"evaluation": GOOD}, 2, per_class=True) == EvalCounts(
        10, 7, 3.5, (6, 4), (5, 2)
    )
    with pytest.raises(MessageRejected, match=why):
        checked_answer({"evaluation": {**GOOD, **change}}, 2, per_class=True)
    with pytest.raises(MessageRejected, match="holds no counts"):
        checked_answer({"upload": GOOD}, 2, per_class=True)


def test_an_evaluation_request_is_not_mistaken_for_a_protocols_own_instruction() -> None:
    request = evaluation_request([{"w": np.zeros(2)}], per_class=False)
    assert is_evaluation(request.meta)
    # lppa tells its peers to evaluate themselves with its own "evaluate" key.
    assert not is_evaluation({"evaluate": True, "round": 3})


def test_misreporting_needs_a_clients_evaluation_and_the_simulation_leaves_it_out() -> None:
    from fedcore.errors import SpecError
    from fedcore.learning.poisoning import attackers
    from fedcore.simulation.central import federated_evaluation

    attack = {"attack": {"kind": "MisreportEvaluation", "fraction": 0.25}}
    with pytest.raises(SpecError, match="'MisreportEvaluation' misreports"):
        run_spec({"source": {"kind": "Digits"}}, clients=4, **attack)
    spec = run_spec(
        {"source": {"kind": "Digits"}}, clients=4, evaluation={"where": "Both"}, **attack
    )
    (bad,) = attackers(spec)
    weights = trained_weights(spec, seed=2)
    honest = [index for index in range(4) if index != bad]
    fed = federated_evaluation(spec, [weights])
    blocks = [client_test_dataset(spec, index) for index in honest]
    union = ArrayDataset(
        np.concatenate([b.x for b in blocks]), np.concatenate([b.y for b in blocks]), 10
    )
    whole = central(spec, union, weights)
    assert (fed.total, fed.correct) == (whole.total, whole.correct)

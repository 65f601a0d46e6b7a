"""Federated evaluation (``spec.evaluation.where`` Clients or Both): the server sends the
models it holds, each client scores them on its own held-out examples and answers with counts,
and the server sums the counts.

A client's answer is counts only (examples scored, those right, the summed loss and, when
asked, the same per class): no example, label or prediction leaves it. The server checks every
answer (whole, non-negative, consistent counts; a finite loss) and refuses a malformed one,
counted and logged with its sender. It cannot check that counts are true: a client that lies
about its own test split moves the reported accuracy, never the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedcore.errors import MessageRejected
from fedcore.learning.training import EvalCounts, Evaluator
from fedcore.transport import Payload

EVALUATION_ATTEMPT = 0
"""The attempt number of an evaluation exchange (a round's training attempts count from 1)."""

_MODEL_SEPARATOR = "/"

REQUEST_KEY = "federatedEvaluation"
"""The instruction key that marks an evaluation request; no protocol's instruction uses it."""


def evaluation_request(models: Sequence[Mapping[str, np.ndarray]], per_class: bool) -> Payload:
    """The instruction that asks a client to score ``models``: their weights as tensors named
    ``<k>/<weight>``."""
    tensors = {
        f"{number}{_MODEL_SEPARATOR}{name}": array
        for number, weights in enumerate(models)
        for name, array in weights.items()
    }
    return Payload(meta={REQUEST_KEY: True, "perClass": per_class}, tensors=tensors)


def is_evaluation(instruction: Mapping[str, Any]) -> bool:
    """Whether a task's instruction asks for an evaluation (not a protocol's own instruction,
    whose keys are the protocol's: lppa's says ``evaluate`` to its peers)."""
    return instruction.get(REQUEST_KEY) is True


def requested_models(tensors: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The models of an evaluation request, in order.

    Raises:
        MessageRejected: a tensor name without a model number.
    """
    models: dict[int, dict[str, np.ndarray]] = {}
    for key, array in tensors.items():
        number, _, name = key.partition(_MODEL_SEPARATOR)
        if not number.isdigit() or not name:
            raise MessageRejected(f"An evaluation request names a tensor {key!r}.")
        models.setdefault(int(number), {})[name] = array
    return [models[number] for number in sorted(models)]


def score(
    evaluator: Evaluator, models: Sequence[dict[str, np.ndarray]], per_class: bool
) -> EvalCounts:
    """Scores the models on the client's held-out examples: one model's counts, or with
    several (a clustered protocol's) the counts of the one with the lowest loss there (IFCA's
    rule, as the server's own evaluation picks per data cluster)."""
    scored = [evaluator.counts(weights, per_class=per_class) for weights in models]
    return min(scored, key=lambda counts: counts.loss_sum)


def answer_meta(counts: EvalCounts) -> dict[str, Any]:
    """A client's answer: its counts, as JSON."""
    meta: dict[str, Any] = {
        "evaluation": {
            "total": counts.total,
            "correct": counts.correct,
            "lossSum": counts.loss_sum,
        }
    }
    if counts.class_total:
        meta["evaluation"]["classTotal"] = list(counts.class_total)
        meta["evaluation"]["classCorrect"] = list(counts.class_correct)
    return meta


def checked_answer(meta: Mapping[str, Any], classes: int, per_class: bool) -> EvalCounts:
    """A client's answer, checked.

    Raises:
        MessageRejected: naming what is wrong (a missing or non-integer count, a count out of
            range, a non-finite or negative loss, per-class counts that do not add up).
    """
    answer = meta.get("evaluation")
    if not isinstance(answer, dict):
        raise MessageRejected("An evaluation answer holds no counts.")
    total = _count(answer, "total")
    correct = _count(answer, "correct")
    if correct > total:
        raise MessageRejected(f"An evaluation answer has correct {correct} > total {total}.")
    loss = answer.get("lossSum")
    if not isinstance(loss, int | float) or isinstance(loss, bool):
        raise MessageRejected("An evaluation answer's lossSum is not a finite, non-negative sum.")
    if not math.isfinite(loss) or loss < 0:
        raise MessageRejected("An evaluation answer's lossSum is not a finite, non-negative sum.")
    class_total: tuple[int, ...] = ()
    class_correct: tuple[int, ...] = ()
    if per_class:
        class_total = _counts(answer, "classTotal", classes)
        class_correct = _counts(answer, "classCorrect", classes)
        if sum(class_total) != total or sum(class_correct) != correct:
            raise MessageRejected("An evaluation answer's per-class counts do not add up.")
        if any(right > seen for right, seen in zip(class_correct, class_total, strict=True)):
            raise MessageRejected("An evaluation answer has more right than scored in a class.")
    return EvalCounts(total, correct, float(loss), class_total, class_correct)


def _count(answer: Mapping[str, Any], key: str) -> int:
    value = answer.get(key)
    if type(value) is not int or value < 0 or value > 2**53:
        raise MessageRejected(f"An evaluation answer's {key} is not a whole, non-negative count.")
    return value


def _counts(answer: Mapping[str, Any], key: str, classes: int) -> tuple[int, ...]:
    values = answer.get(key)
    if not isinstance(values, list) or len(values) != classes:
        raise MessageRejected(f"An evaluation answer's {key} needs {classes} counts.")
    return tuple(_count({key: value}, key) for value in values)


@dataclass(frozen=True)
class FederatedScore:
    """The clients' counts, summed."""

    counts: EvalCounts
    clients: int

    def metrics(self) -> dict[str, Any]:
        """The round's evaluation entries: accuracy and loss over every example scored, how
        many clients and examples, and per class when counted."""
        result = self.counts.result()
        entry: dict[str, Any] = {
            "accuracy": result.accuracy,
            "loss": result.loss,
            "evaluated_clients": self.clients,
            "evaluated_examples": self.counts.total,
        }
        if self.counts.class_total:
            entry["per_class"] = [
                {"total": seen, "correct": right}
                for seen, right in zip(
                    self.counts.class_total, self.counts.class_correct, strict=True
                )
            ]
        return entry


def summed(answers: Sequence[EvalCounts]) -> FederatedScore:
    """The sum of the clients' counts (exact: whole counts, and the losses in float64)."""
    classes = max((len(counts.class_total) for counts in answers), default=0)
    class_total = [0] * classes
    class_correct = [0] * classes
    for counts in answers:
        for position, (seen, right) in enumerate(
            zip(counts.class_total, counts.class_correct, strict=True)
        ):
            class_total[position] += seen
            class_correct[position] += right
    total = EvalCounts(
        total=sum(counts.total for counts in answers),
        correct=sum(counts.correct for counts in answers),
        loss_sum=math.fsum(counts.loss_sum for counts in answers),
        class_total=tuple(class_total),
        class_correct=tuple(class_correct),
    )
    return FederatedScore(total, len(answers))

"""Small numeric helpers shared by the plain protocols."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedcore.errors import ProtocolError
from fedcore.protocols._base import Weights, check_state_kind
from fedcore.transport import Payload


def weighted_mean(tensors: Sequence[Weights], weights: Sequence[float]) -> Weights:
    """Returns sum_k w_k x_k / sum_k w_k per tensor, accumulated in float64.

    Each result keeps the dtype of the first input's tensor of that name.

    Raises:
        ProtocolError: no inputs, or weights that do not sum to a positive number.
    """
    if not tensors:
        raise ProtocolError("There is nothing to average: no uploads were given.")
    total = float(sum(weights))
    if not total > 0:
        raise ProtocolError(f"The averaging weights sum to {total}; a positive sum is needed.")
    result: Weights = {}
    for name, first in tensors[0].items():
        acc = np.zeros(first.shape, dtype=np.float64)
        for values, weight in zip(tensors, weights, strict=True):
            acc += (weight / total) * values[name].astype(np.float64, copy=False)
        result[name] = acc.astype(first.dtype, copy=False)
    return result


def check_like(reference: Weights, upload: Payload, *, what: str) -> None:
    """Checks that an upload's tensors match the reference's names, shapes, dtypes, finiteness.

    Raises:
        ProtocolError: naming the first mismatch.
    """
    names = list(upload.tensors)
    if names != list(reference):
        missing = sorted(set(reference) - set(names))
        extra = sorted(set(names) - set(reference))
        raise ProtocolError(f"The {what} has the wrong tensors: missing {missing}, extra {extra}.")
    for name, ref in reference.items():
        got = upload.tensors[name]
        if got.shape != ref.shape or got.dtype != ref.dtype:
            raise ProtocolError(
                f"The {what}'s tensor {name!r} is {got.dtype}{list(got.shape)}; expected "
                f"{ref.dtype}{list(ref.shape)}."
            )
        if not np.all(np.isfinite(got)):
            raise ProtocolError(f"The {what}'s tensor {name!r} holds NaN or infinite values.")


def example_count(upload: Payload, *, what: str) -> int:
    """Returns an upload's ``num_examples``, checked to be a positive integer.

    Raises:
        ProtocolError: the count is missing, not an integer, or not positive.
    """
    count = upload.meta.get("num_examples")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ProtocolError(
            f"The {what} reports num_examples={count!r}; a positive integer is needed."
        )
    return count


def mean_loss(uploads: Mapping[int, Payload], weights: Mapping[int, float]) -> float | None:
    """Returns the weighted mean of the uploads' reported ``loss``, or None if any lacks one."""
    losses: dict[int, float] = {}
    for client, upload in uploads.items():
        loss = upload.meta.get("loss")
        if isinstance(loss, bool) or not isinstance(loss, int | float):
            return None
        losses[client] = float(loss)
    if not losses:
        return None
    total = sum(weights[k] for k in losses)
    return sum(weights[k] * loss for k, loss in losses.items()) / total


def copy_weights(weights: Weights) -> Weights:
    """Returns a deep copy of a weights dict."""
    return {name: np.array(value, copy=True) for name, value in weights.items()}


def restore_weights(state: Mapping[str, Any], kind: str, reference: Weights) -> Weights:
    """Returns a copy of ``state["weights"]`` in ``reference``'s order, checked against it.

    Raises:
        ValueError: the state's tag is not ``kind``, or its weights differ from the
            reference's names or shapes.
    """
    check_state_kind(state, kind, ["weights"])
    loaded = dict(state["weights"])
    if set(loaded) != set(reference):
        raise ValueError(
            f"The {kind} state's weights are named {sorted(loaded)}; the model's are "
            f"{sorted(reference)}."
        )
    for name, value in reference.items():
        if np.shape(loaded[name]) != value.shape:
            raise ValueError(f"The {kind} state's weight {name!r} has the wrong shape.")
    return {name: np.array(loaded[name], dtype=reference[name].dtype) for name in reference}

"""Small numeric helpers shared by the plain protocols."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedcore.errors import ProtocolError
from fedcore.protocols._base import Weights, check_state_kind
from fedcore.protocols._fold import fold_mean
from fedcore.transport import Payload


def weighted_mean(tensors: Sequence[Weights], weights: Sequence[float]) -> Weights:
    """Returns sum_k w_k x_k / sum_k w_k per tensor, accumulated in float64 in the given order
    (``fedcore.protocols._fold``: the sum a streamed fold of the same uploads equals).

    Each result keeps the dtype of the first input's tensor of that name.

    Raises:
        ProtocolError: no inputs, or weights that do not sum to a positive number.
        ValueError: as many weights as inputs were not given.
    """
    return fold_mean(tensors, weights)


def check_like(reference: Weights, upload: Payload, *, what: str, finite: bool = True) -> None:
    """Checks that an upload's tensors match the reference's names, shapes, dtypes and (with
    ``finite``) finiteness; a caller that computes a norm over every value anyway may leave
    finiteness to ``check_finite``, called when that norm is not finite.

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
    if finite:
        check_finite(upload, what=what)


def check_finite(upload: Payload, *, what: str) -> None:
    """Refuses an upload with a NaN or infinite value, naming the first tensor that has one.

    Raises:
        ProtocolError: naming the tensor.
    """
    for name, got in upload.tensors.items():
        if not np.isfinite(got).all():
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


def flatten(weights: Weights, names: Sequence[str]) -> np.ndarray:
    """The weights as one float64 vector, in ``names`` order."""
    return np.concatenate([np.asarray(weights[n], dtype=np.float64).reshape(-1) for n in names])


def unflatten(vector: np.ndarray, like: Weights) -> Weights:
    """The inverse of ``flatten``, in ``like``'s names, shapes and dtypes."""
    out: Weights = {}
    at = 0
    for name, ref in like.items():
        size = int(np.size(ref))
        out[name] = vector[at : at + size].reshape(np.shape(ref)).astype(ref.dtype)
        at += size
    return out


def cluster_name(cluster: int, name: str) -> str:
    """The instruction tensor of cluster ``cluster``'s weight ``name`` (clustered protocols)."""
    return f"cluster.{cluster}.{name}"

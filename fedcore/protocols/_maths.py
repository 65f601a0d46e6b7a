"""Small numeric helpers shared by the plain protocols."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
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
    scales = [weight / total for weight in weights]
    if len(scales) != len(tensors):
        raise ValueError(f"{len(tensors)} uploads but {len(scales)} weights were given.")
    result: Weights = {}
    block = scratch_elements(tensors[0].values())
    acc = np.empty(block, dtype=np.float64)
    term = np.empty(block, dtype=np.float64)
    for name, first in tensors[0].items():
        flats = [np.ascontiguousarray(values[name]).reshape(-1) for values in tensors]
        out = np.empty(first.size, dtype=first.dtype)
        # Block by block, so that the float64 accumulator and term stay in the CPU cache: the
        # inputs are read once and the result written once (a whole-tensor float64 temporary
        # per upload moved several times the input bytes through memory). Same operations per
        # element, same order, so the result is bit-identical to accumulating whole tensors.
        for start in range(0, first.size, block):
            stop = min(start + block, first.size)
            a, t = acc[: stop - start], term[: stop - start]
            a.fill(0.0)
            for flat, scale in zip(flats, scales, strict=True):
                # Widen, then scale in float64: numpy's multiply with a casting input runs
                # several times slower than this plain cast followed by a float64 multiply.
                np.copyto(t, flat[start:stop], casting="unsafe")
                np.multiply(t, scale, out=t)
                np.add(a, t, out=a)
            out[start:stop] = a
        result[name] = out.reshape(first.shape)
    return result


_BLOCK = 1 << 15
"""Elements per block of weighted_mean: 2 x 256 KiB of float64 scratch, well inside L2."""


def scratch_elements(arrays: Iterable[np.ndarray]) -> int:
    """Elements of blocked float64 scratch for ``arrays``: ``_BLOCK``, or the largest array's
    size if smaller (a small model's scratch then stays off the allocator's mmap path, which
    costs a system call and page faults per call)."""
    return max(1, min(_BLOCK, max((array.size for array in arrays), default=1)))


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

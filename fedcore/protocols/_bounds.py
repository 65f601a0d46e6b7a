"""What one client's upload may do to the model: the bounds a plaintext server checks.

A client with a valid certificate is still an insider the server need not trust. Shape and
finiteness checks (``check_like``) do not stop a finite upload of float32-max values: averaged
in float32 it overflows, and the next round every honest client trains NaN. So a server that
sees individual updates checks three more things (``spec.uploads``):

- **the step**: the L2 norm of the change an upload asks of the model it was sent (for a
  gradient, the step at the run's learning rate) is at most ``max_update_norm``; by default
  ``DEFAULT_UPDATE_RMS * sqrt(parameters)``. A weighted mean with non-negative weights of
  steps within the bound is within it (the triangle inequality), so every aggregate of
  accepted uploads is finite and bounded too;
- **the weight**: under ShardSize weighting, a client's ``num_examples`` may not pass the shard
  size the server derives from the spec (a protocol may train on part of a shard: adaptive
  holds some out); where the server cannot count (ByFile) the claim is capped at
  ``max_examples``, or by default at ``DEFAULT_EXAMPLES_OVER_MEDIAN`` times the round's median
  claim;
- **the aggregate**: as a last guard, ``check_aggregate`` refuses a new model that is not
  finite or moved past the bound (``AggregateRefused``: the previous model is kept). For the
  plaintext servers it cannot fire after the checks above; it is the only check a server
  has when it sees the aggregate alone (mpdp).

Each refused upload raises ``UploadRefused`` from ``check_upload``; the server role counts it
(``fedcore_rejected_messages_total{reason="bound"}``), logs it with the client's name and
settles the round without it (its dropout and failure policy).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedcore.errors import AggregateRefused, ProtocolError, UploadRefused
from fedcore.protocols._base import Weights
from fedcore.protocols._fold import scratch_elements
from fedcore.protocols._kernels import squared_distance
from fedcore.protocols._runs import runs_of, stretches
from fedcore.spec import FederatedRunSpec
from fedcore.spec._uploads import DEFAULT_EXAMPLES_OVER_MEDIAN, DEFAULT_UPDATE_RMS
from fedcore.transport import PackedTensors, Payload


def parameter_count(weights: Weights) -> int:
    """The number of floating-point parameters of a model."""
    return sum(int(np.size(v)) for v in weights.values() if np.issubdtype(v.dtype, np.floating))


def default_update_norm(weights: Weights) -> float:
    """``DEFAULT_UPDATE_RMS * sqrt(parameters)``: a root-mean-square step of 10 per parameter."""
    return DEFAULT_UPDATE_RMS * math.sqrt(max(parameter_count(weights), 1))


def step_norm(tensors: Weights, reference: Weights | None = None, *, scale: float = 1.0) -> float:
    """The L2 norm of ``scale * (tensors - reference)`` (of ``scale * tensors`` without a
    reference) over the floating-point tensors, in float64
    (``fedcore.protocols._kernels.squared_distance``: compiled for large tensors), one call per
    stretch of tensors packed back to back in both (``fedcore.protocols._runs``: a decoded
    upload's and a fold's mean are), else per tensor. The order of the additions then differs
    from a tensor at a time in the last bits: the norm is compared with a bound, never folded
    into a result.

    Raises:
        KeyError: ``reference`` lacks a tensor of ``tensors``.
        ValueError: it has another size for one.
    """
    total = 0.0
    block = scratch_elements(tensors.values())
    scratch = (np.empty(block, dtype=np.float64), np.empty(block, dtype=np.float64))
    runs = tensors.runs() if isinstance(tensors, PackedTensors) else None
    if runs is None or (reference is not None and list(reference) != list(tensors)):
        for name, value in tensors.items():  # a tensor at a time
            if value.dtype.kind != "f":
                continue
            flat = np.ascontiguousarray(value).reshape(-1)
            ref = None if reference is None else np.ascontiguousarray(reference[name]).reshape(-1)
            total += squared_distance(flat, ref, scratch=scratch)
        return abs(scale) * math.sqrt(total)
    sizes = [int(value.size) for value in tensors.values()]
    operands = [runs] if reference is None else [runs, runs_of(reference)]
    for views in stretches(sizes, *operands):
        if views[0].dtype.kind != "f":
            continue
        total += squared_distance(views[0], views[-1] if len(views) > 1 else None, scratch=scratch)
    return abs(scale) * math.sqrt(total)


AGGREGATE_SLACK = 1e-6
"""Relative room for the aggregate over ``max_update_norm``: a mean of steps within the bound,
computed in float64 and stored in float32, may round past it by up to 2^-24 of it."""


@dataclass(frozen=True)
class UploadBounds:
    """The bounds on one client's upload (see the module docstring).

    Attributes:
        max_update_norm: the largest L2 norm of one upload's step.
        shard_sizes: each client's shard size as the server derives it from the spec, by
            index; None when it cannot (ByFile).
        max_examples: the cap on a claimed example count when ``shard_sizes`` is None; None:
            ``DEFAULT_EXAMPLES_OVER_MEDIAN`` times the round's median claim.
    """

    max_update_norm: float
    shard_sizes: tuple[int, ...] | None = None
    max_examples: int | None = None

    @classmethod
    def of(cls, spec: FederatedRunSpec, initial: Weights) -> UploadBounds:
        """The bounds of a run from ``spec.uploads`` and the model's size; the shard sizes
        come later, from the runtime (``BoundedServer.set_shard_sizes``)."""
        uploads = spec.uploads
        norm = uploads.max_update_norm or default_update_norm(initial)
        return cls(norm, None, uploads.max_examples)

    def check_step(self, norm: float, *, what: str) -> None:
        """Refuses a step whose norm is not finite or passes ``max_update_norm``.

        Raises:
            UploadRefused: naming ``what``, the norm and the bound.
        """
        if not norm <= self.max_update_norm:  # also catches NaN
            raise UploadRefused(
                f"The {what} moves the model by {norm:.4g} (L2), past the bound "
                f"{self.max_update_norm:.4g} (spec.uploads.maxUpdateNorm)."
            )

    def check_examples(self, client: int, upload: Payload, *, what: str) -> int:
        """Checks a claimed ``num_examples`` against the shard the server knows of.

        Returns:
            The claim.

        Raises:
            ProtocolError: the claim is not a positive integer.
            UploadRefused: the claim passes the client's shard size where the server knows
                it, or ``max_examples``.
        """
        claim = upload.meta.get("num_examples")
        if isinstance(claim, bool) or not isinstance(claim, int) or claim < 1:
            raise ProtocolError(
                f"The {what} reports num_examples={claim!r}; a positive integer is needed."
            )
        sizes = self.shard_sizes
        if sizes is not None and 0 <= client < len(sizes) and claim > sizes[client]:
            raise UploadRefused(
                f"The {what} claims {claim} examples; client {client}'s shard holds only "
                f"{sizes[client]} (the server derives it from spec.data)."
            )
        if sizes is None and self.max_examples is not None and claim > self.max_examples:
            raise UploadRefused(
                f"The {what} claims {claim} examples, more than spec.uploads.maxExamples "
                f"{self.max_examples}."
            )
        return claim

    def example_weight(self, client: int, upload: Payload) -> float | None:
        """The ShardSize weight of one upload where it alone decides it (the server knows the
        shard sizes, or ``max_examples`` caps the claims), else None: the median cap needs
        the whole round's claims."""
        claim = float(_claim(upload))
        if self.shard_sizes is not None:
            return min(claim, float(self.shard_sizes[client]))
        if self.max_examples is not None:
            return min(claim, float(self.max_examples))
        return None

    def example_weights(self, uploads: Mapping[int, Payload]) -> dict[int, float]:
        """ShardSize weights of a round's uploads: the claims, capped at the server's shard
        sizes where it knows them, else at the median cap (module docstring)."""
        claims = {k: float(_claim(uploads[k])) for k in sorted(uploads)}
        sizes = self.shard_sizes
        if sizes is not None:
            return {k: min(claim, float(sizes[k])) for k, claim in claims.items()}
        cap = (
            float(self.max_examples)
            if self.max_examples is not None
            else DEFAULT_EXAMPLES_OVER_MEDIAN * float(np.median(list(claims.values())))
        )
        return {k: min(claim, cap) for k, claim in claims.items()}

    def check_aggregate(self, round: int, before: Weights, after: Weights) -> None:
        """Refuses a new model that is not finite or moved past ``max_update_norm``.

        Raises:
            AggregateRefused: naming the round and what is wrong; the caller keeps ``before``.
        """
        for name, value in after.items():
            if np.issubdtype(value.dtype, np.floating) and not np.all(np.isfinite(value)):
                raise AggregateRefused(
                    f"Round {round}'s aggregate holds NaN or infinite values in {name!r}; the "
                    f"previous model is kept.",
                    round=round,
                )
        self._check_aggregate_norm(round, step_norm(after, before))

    def check_aggregate_step(self, round: int, step: np.ndarray) -> None:
        """``check_aggregate`` for a flat float step (new model - previous model).

        Raises:
            AggregateRefused: the step is not finite or passes ``max_update_norm``.
        """
        if not np.all(np.isfinite(step)):
            raise AggregateRefused(
                f"Round {round}'s aggregate holds NaN or infinite values; the previous model "
                f"is kept.",
                round=round,
            )
        flat = np.asarray(step, dtype=np.float64).reshape(-1)
        self._check_aggregate_norm(round, math.sqrt(float(np.dot(flat, flat))))

    def _check_aggregate_norm(self, round: int, norm: float) -> None:
        if not norm <= self.max_update_norm * (1 + AGGREGATE_SLACK):
            raise AggregateRefused(
                f"Round {round}'s aggregate moves the model by {norm:.4g} (L2), past the bound "
                f"{self.max_update_norm:.4g} (spec.uploads.maxUpdateNorm); the previous model "
                f"is kept.",
                round=round,
            )


class BoundedServer:
    """Mixin of a server that checks uploads against ``_bounds``."""

    _bounds: UploadBounds

    def set_shard_sizes(self, sizes: Sequence[int] | None) -> None:
        """Takes each client's shard size as the server derives it from the spec (see
        ``ServerProtocol.set_shard_sizes``)."""
        known = None if sizes is None else tuple(int(size) for size in sizes)
        self._bounds = dataclasses.replace(self._bounds, shard_sizes=known)


def _claim(upload: Payload) -> int:
    count = upload.meta.get("num_examples")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ProtocolError(f"An upload reports num_examples={count!r}; expected an integer >= 1.")
    return count

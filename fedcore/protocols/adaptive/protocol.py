"""adaptive: FedSGD where each client uploads its step plus a distortion it learned (seed 003).

Zhang, Li, Chen, Xia and Yang, "Theoretically Principled Federated Learning for Balancing
Privacy and Utility" (the implementer's digest is
``shared/digests/003_principled_privacy_utility_tradeoff.md``, cited by section).

Each round each client takes one SGD step on a minibatch of its private examples
(``W_k = W - eta * g``; per-example clipped gradients under the DP measure), then adds a
distortion ``delta`` whose norm lies in ``[l, upperFactor * l]``:

- PL measure: ``l = (a1 - chi) / a2`` from the leakage budget chi (Eq. 12);
- DP measure: ``l`` is the norm of Laplace noise calibrated to one step's L1 sensitivity and
  epsilon.

Strategy Identical uploads that random start as is (PL: random direction at norm l; DP: the
Laplace mechanism itself, the only output marked ``formal_dp: true``). Strategy Learn moves it
by M projected gradient steps on the client's loss at ``W_k + delta``, with the gradients
taken on a held-out batch of the client's own examples (digest G2) from a random start
(G1); its outputs are marked ``formal_dp: false``: the distortion now depends on data
(G3). The server takes the weighted mean of the uploads (Eq. 1). docs/protocols/adaptive.md
says what this protects and what it does not.
"""

from __future__ import annotations

import math
import secrets
import warnings
from collections.abc import Mapping, Sequence

import numpy as np

from fedcore.errors import ProtocolError
from fedcore.learning.training import LocalLearner
from fedcore.protocols._base import ClientProtocol, Protocol, RoundResult, ServerProtocol, Weights
from fedcore.protocols._batches import BATCH_STREAM, batch_gradient, batch_rows, clipped_gradient
from fedcore.protocols._bounds import UploadBounds
from fedcore.protocols.adaptive.maths import (
    dp_laplace_scale,
    learn_distortion,
    pl_leakage,
    pl_lower_bound,
    random_at_norm,
)
from fedcore.protocols.fedavg.protocol import ModelAveragingServer
from fedcore.protocols.lppa.maths import flatten, unflatten
from fedcore.spec import FederatedRunSpec
from fedcore.transport import Payload

SPLIT_STREAM = 0xAD50
"""Seeds each client's split into private and held-out examples."""
DISTORTION_STREAM = 0xAD51
"""Seeds the distortion's random start (reproducible mode only)."""
HELD_OUT_STREAM = BATCH_STREAM + 1
"""Keeps the held-out batch draws apart from the private ones."""


class AdaptiveServer(ModelAveragingServer):
    """Weighted mean of the distorted uploads (Eq. 1), plus what the clients report."""

    kind = "adaptive"

    def check_upload(self, round: int, client: int, upload: Payload) -> None:
        super().check_upload(round, client, upload)
        what = f"The upload of client {client} in round {round}"
        if not isinstance(upload.meta.get("formal_dp"), bool):
            raise ProtocolError(f"{what} does not say whether it is formally DP (formal_dp).")
        for key in ("distortion_norm", "lower", "upper"):
            value = upload.meta.get(key)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and value >= 0)
            ):
                raise ProtocolError(f"{what} reports {key}={value!r}; a number >= 0 is needed.")

    def combine(
        self, round: int, uploads: Mapping[int, Payload], failures: Sequence[int]
    ) -> RoundResult | None:
        result = super().combine(round, uploads, failures)
        if result is None:
            return None
        metas = [uploads[k].meta for k in sorted(uploads)]
        norms = [float(m["distortion_norm"]) for m in metas]
        metrics = {
            "distortion_norm": float(np.mean(norms)),
            "distortion_norm_max": float(np.max(norms)),
            "lower": float(np.mean([float(m["lower"]) for m in metas])),
            "formal_dp": float(all(m["formal_dp"] for m in metas)),
        }
        leakage = [float(m["leakage"]) for m in metas if "leakage" in m]
        if leakage:
            metrics["leakage_max"] = float(np.max(leakage))
        epsilon = [float(m["epsilon"]) for m in metas if "epsilon" in m]
        if epsilon:
            metrics["epsilon_round"] = float(np.max(epsilon))
            if metrics["formal_dp"]:
                # Basic composition over the rounds so far: an upper bound for any example.
                metrics["epsilon_composed"] = round * metrics["epsilon_round"]
        return RoundResult(result.participants, result.train_loss, metrics)


class AdaptiveClient(ClientProtocol):
    """One SGD step on private rows, then the learned (or Identical) distortion."""

    def __init__(self, spec: FederatedRunSpec, index: int) -> None:
        self._spec = spec
        self._index = index
        self._options = spec.protocol.adaptive
        self._split: tuple[np.ndarray, np.ndarray] | None = None
        if not self._options.secure_noise:
            warnings.warn(
                "adaptive draws its distortion's random start from a generator seeded by "
                "spec.seed (spec.protocol.adaptive.secureNoise is false): anyone who knows the "
                "seed can redraw it. Use it for tests only.",
                UserWarning,
                stacklevel=2,
            )

    def split(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """This client's (private, held-out) rows, fixed for the run.

        Raises:
            ProtocolError: the shard is too small to keep an example on each side.
        """
        if self._split is None:
            rng = np.random.default_rng([self._spec.seed, self._index, SPLIT_STREAM])
            order = rng.permutation(count)
            held = round(self._options.held_out_fraction * count)
            if held < 1 or held >= count:
                raise ProtocolError(
                    f"Client {self._index} holds {count} examples: heldOutFraction "
                    f"{self._options.held_out_fraction} leaves no example on one side."
                )
            self._split = (np.sort(order[held:]), np.sort(order[:held]))
        return self._split

    def compute_upload(
        self, round: int, instruction: Payload, learner: LocalLearner, keys: Payload | None
    ) -> Payload:
        spec, options = self._spec, self._options
        weights = instruction.tensors
        private, held = self.split(learner.num_examples)
        batch = self._rows(private, round, BATCH_STREAM)
        eta = spec.training.optimizer.learning_rate
        if options.measure == "DP":
            grads, loss, _ = clipped_gradient(
                learner,
                weights,
                batch,
                loss=spec.training.loss,
                clipping_norm=options.dp.clipping_norm,
            )
        else:
            grads, loss = batch_gradient(learner, weights, batch, loss=spec.training.loss)
        flat = flatten(weights).astype(np.float64)
        local = flat - eta * flatten(grads).astype(np.float64)
        size = len(local)
        if options.secure_noise:
            rng = np.random.Generator(np.random.PCG64(secrets.randbits(128)))
        else:
            rng = np.random.default_rng([spec.seed, round, DISTORTION_STREAM, self._index])
        meta: dict[str, object] = {}
        if options.measure == "DP":
            scale = dp_laplace_scale(
                eta, options.dp.clipping_norm, size, len(batch), options.dp.epsilon
            )
            start = rng.laplace(0.0, scale, size)
            lower = float(np.linalg.norm(start))
            meta.update(epsilon=options.dp.epsilon, laplace_scale=scale)
        else:
            lower = pl_lower_bound(options.pl.budget, options.pl.a1, options.pl.a2)
            start = random_at_norm(rng, size, lower)
        upper = options.upper_factor * lower
        formal = options.measure == "DP" and options.strategy == "Identical"
        if options.strategy == "Identical":
            delta = start
        else:
            if options.init == "Zero":
                start = np.zeros(size)
            source = held if options.grad_source == "HeldOut" else None
            aux = self._rows(source, round, HELD_OUT_STREAM) if source is not None else batch

            def gradient(distortion: np.ndarray) -> np.ndarray:
                point = unflatten((local + distortion).astype(flat.dtype), weights)
                g, _ = batch_gradient(learner, point, aux, loss=spec.training.loss)
                return flatten(g).astype(np.float64)

            delta, _ = learn_distortion(
                start,
                lower,
                upper,
                gradient,
                steps=options.steps,
                step_size=options.step_size,
                optimizer=options.optimizer,
                regularization=options.regularization,
                rng=rng,
            )
        norm = float(np.linalg.norm(delta))
        if norm < lower * (1 - 1e-9) or norm > upper * (1 + 1e-9):
            raise ProtocolError(
                f"Client {self._index}'s distortion has norm {norm}, outside [{lower}, {upper}]."
            )
        if options.measure == "PL":
            meta["leakage"] = pl_leakage(norm, options.pl.a1, options.pl.a2)
        upload = unflatten(local + delta, weights)
        meta.update(
            num_examples=len(private),
            loss=loss,
            steps=1,
            distortion_norm=norm,
            lower=lower,
            upper=upper,
            formal_dp=formal,
        )
        return Payload(meta=meta, tensors=upload)

    def _rows(self, pool: np.ndarray, round: int, stream: int) -> np.ndarray:
        rows = batch_rows(
            len(pool),
            self._spec.training.batch_size,
            seed=self._spec.seed,
            step=round,
            client=self._index,
            stream=stream,
        )
        return pool if rows is None else pool[rows]


class Adaptive(Protocol):
    """Learned distortion under a privacy budget (see the module docstring)."""

    name = "adaptive"

    def create_server(self, spec: FederatedRunSpec, initial: Weights) -> ServerProtocol:
        return AdaptiveServer(initial, weighting="ShardSize", bounds=UploadBounds.of(spec, initial))

    def create_client(self, spec: FederatedRunSpec, index: int) -> ClientProtocol:
        return AdaptiveClient(spec, index)

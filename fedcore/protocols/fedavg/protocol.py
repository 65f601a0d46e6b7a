"""FedAvg: local epochs on each client, the server takes the weighted mean of the models.

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017, https://arxiv.org/abs/1602.05629. A plain baseline: it protects nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fedcore.learning.training import LocalLearner
from fedcore.protocols._base import (
    ClientProtocol,
    Protocol,
    RoundResult,
    ServerProtocol,
    Weights,
)
from fedcore.protocols._bounds import (
    BoundedServer,
    UploadBounds,
    default_update_norm,
    step_norm,
)
from fedcore.protocols._maths import (
    check_finite,
    check_like,
    copy_weights,
    mean_loss,
    restore_weights,
    weighted_mean,
)
from fedcore.spec import FederatedRunSpec
from fedcore.transport import Payload


class ModelAveragingServer(BoundedServer, ServerProtocol):
    """Sends the global model; replaces it with the weighted mean of what comes back.

    Every upload is checked against the run's bounds (``fedcore.protocols._bounds``) before it
    is accepted, and the new model against them before it is applied.

    Args:
        initial: the initial global model.
        weighting: ``ShardSize`` or ``Uniform``.
        bounds: the run's upload bounds (``UploadBounds.of(spec, initial)``); None: the
            default step bound of the model and capped example claims.
    """

    kind = "fedavg"

    def __init__(
        self, initial: Weights, *, weighting: str, bounds: UploadBounds | None = None
    ) -> None:
        self._weights = copy_weights(initial)
        self._weighting = weighting
        self._bounds = bounds or UploadBounds(default_update_norm(initial))

    def plan_round(self, round: int, clients: Sequence[int]) -> Mapping[int, Payload]:
        instruction = Payload(meta={"round": round}, tensors=self._weights)
        return {client: instruction for client in clients}

    def check_upload(self, round: int, client: int, upload: Payload) -> None:
        """Refuses an upload that does not look like this model (see ``check_like``), claims
        another example count than the client's shard, or steps past the run's bound.

        Raises:
            ProtocolError: the upload is malformed.
            UploadRefused: it passes one of the run's bounds.
        """
        what = f"upload of client {client} in round {round}"
        check_like(self._weights, upload, what=what, finite=False)
        self._bounds.check_examples(client, upload, what=what)
        norm = self._step_norm(upload)
        if not math.isfinite(norm):
            # A norm over every value is finite unless one of them is not (or, in float64,
            # squares past 1e308): name the tensor, as check_like would have.
            check_finite(upload, what=what)
        self._bounds.check_step(norm, what=what)

    def _step_norm(self, upload: Payload) -> float:
        """The norm of the change ``upload`` asks of the model (here: upload - model)."""
        return step_norm(upload.tensors, self._weights)

    def combine(
        self, round: int, uploads: Mapping[int, Payload], failures: Sequence[int]
    ) -> RoundResult | None:
        """Applies the weighted mean of the uploads.

        Raises:
            AggregateRefused: the new model would not be finite or moves past the bound;
                the previous model is kept.
        """
        if not uploads:
            return None
        order = sorted(uploads)
        if self._weighting == "ShardSize":
            weights = self._bounds.example_weights(uploads)
        else:
            weights = dict.fromkeys(order, 1.0)
        updated = self._apply(
            weighted_mean([uploads[k].tensors for k in order], [weights[k] for k in order])
        )
        self._bounds.check_aggregate(round, self._weights, updated)
        self._weights = updated
        return RoundResult(participants=len(order), train_loss=mean_loss(uploads, weights))

    def _apply(self, mean: Weights) -> Weights:
        """Turns the uploads' mean into the next global model (here: the mean itself)."""
        return mean

    def global_weights(self) -> Weights:
        return self._weights

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "version": 1, "weights": copy_weights(self._weights)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._weights = restore_weights(state, self.kind, self._weights)


class LocalTrainingClient(ClientProtocol):
    """Trains the received model for the spec's local epochs and uploads the result."""

    def compute_upload(
        self, round: int, instruction: Payload, learner: LocalLearner, keys: Payload | None
    ) -> Payload:
        weights, stats = learner.train(instruction.tensors, round=round)
        return Payload(
            meta={"num_examples": stats.num_examples, "loss": stats.loss, "steps": stats.steps},
            tensors=weights,
        )


class FedAvg(Protocol):
    """Federated averaging (see the module docstring)."""

    name = "fedavg"

    def create_server(self, spec: FederatedRunSpec, initial: Weights) -> ServerProtocol:
        options = spec.protocol.fedavg
        bounds = UploadBounds.of(spec, initial)
        if options.aggregator == "Mean" and options.clusters == 1:
            return ModelAveragingServer(initial, weighting=options.weighting, bounds=bounds)
        from fedcore.protocols.fedavg.robust import RobustAveragingServer, root_learner

        fltrust = options.aggregator == "FLTrust"
        root = root_learner(spec, options.root_examples) if fltrust else None
        return RobustAveragingServer(
            initial, options=options, root=root, seed=spec.seed, bounds=bounds
        )

    def create_client(self, spec: FederatedRunSpec, index: int) -> ClientProtocol:
        from fedcore.learning.poisoning import attack_of

        attack = attack_of(spec, index)
        poisons = {"SignFlip", "Scale", "InflateExamples"}
        if spec.protocol.fedavg.clusters == 1 and attack not in poisons:
            return LocalTrainingClient()
        from fedcore.protocols.fedavg.robust import RobustTrainingClient

        scale = 1.0 if spec.attack is None else spec.attack.scale
        return RobustTrainingClient(attack=attack, scale=scale)

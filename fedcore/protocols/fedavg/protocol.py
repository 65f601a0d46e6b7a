"""FedAvg: local epochs on each client, the server takes the weighted mean of the models.

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017, https://arxiv.org/abs/1602.05629. A plain baseline: it protects nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
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
from fedcore.protocols._fold import HOLD_BYTES, OrderedFold
from fedcore.protocols._maths import (
    check_finite,
    check_like,
    copy_weights,
    mean_loss,
    restore_weights,
)
from fedcore.protocols._spill import UploadStore
from fedcore.spec import FederatedRunSpec
from fedcore.transport import Payload


class ModelAveragingServer(BoundedServer, ServerProtocol):
    """Sends the global model; replaces it with the weighted mean of what comes back.

    Every upload is checked against the run's bounds (``fedcore.protocols._bounds``) before it
    is accepted, and the new model against them before it is applied.

    Uploads are summed as they arrive (``take_upload``, ``fedcore.protocols._fold``): in client
    order, whatever order they come in, so the server never holds a round's uploads at once
    and the mean is bit-identical to the batch one of the simulation. Where a weight depends
    on the whole round (shard-size weights capped at the round's median claim, when the
    server does not know the shard sizes) each upload is kept in an ``UploadStore`` (in
    memory up to ``hold_bytes``, beyond on disk) and summed at ``combine``, one at a time.

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
        self._fold: OrderedFold | None = None
        self._deferred: UploadStore | None = None
        self.hold_bytes = HOLD_BYTES
        """Bytes of early uploads a fold holds in memory before it writes them to disk."""
        self.spill_dir: str | None = None
        """Where a fold writes early uploads (None: the system's temporary folder)."""
        self.uploads_on_disk = False
        """Whether every upload goes to disk as it arrives (``keep_uploads_on_disk``)."""

    streams_uploads = True
    """Whether ``take_upload`` sums uploads as they arrive (a subclass whose ``combine``
    needs each upload whole says False)."""

    def keep_uploads_on_disk(self, folder: Path) -> None:
        """Every upload goes to a file in ``folder`` as it arrives, and the mean is added up
        from the files a block at a time (``OrderedFold(on_disk=True)``); uploads that wait
        for the round's claims go to disk at once (an ``UploadStore`` without a budget)."""
        self.uploads_on_disk = True
        self.hold_bytes = 0
        self.spill_dir = str(folder)

    def plan_round(self, round: int, clients: Sequence[int]) -> Mapping[int, Payload]:
        instruction = Payload(meta={"round": round}, tensors=self._weights)
        self._open_fold(clients)
        return {client: instruction for client in clients}

    def _open_fold(self, clients: Sequence[int]) -> None:
        """Starts the sum of a new attempt (the previous attempt's, if any, is dropped)."""
        if self._fold is not None:
            self._fold.close()
            self._fold = None
        if self._deferred is not None:
            self._deferred.close()
            self._deferred = None
        if not self.streams_uploads:
            return
        self._fold = self._new_fold(clients, hold_bytes=self.hold_bytes)

    def _new_fold(self, clients: Sequence[int], *, hold_bytes: int) -> OrderedFold:
        return OrderedFold(
            self._weights,
            clients,
            hold_bytes=hold_bytes,
            spill_dir=self.spill_dir,
            on_disk=self.uploads_on_disk,
        )

    def take_upload(self, round: int, client: int, upload: Payload) -> Payload | None:
        """Adds a checked upload into the attempt's sum, or, where its weight waits for the
        round's claims, into the attempt's store; the runtime keeps its meta only. With the
        uploads on disk every upload goes to the fold's files, weighed at ``combine``."""
        if not self.streams_uploads or self._fold is None:
            return None
        weight = self._known_weight(client, upload)
        if self._fold.on_disk:
            self._fold.add(client, upload.tensors, 0.0 if weight is None else weight)
        elif weight is None:  # it waits for the round's claims, in bounded memory
            if self._deferred is None:
                self._deferred = UploadStore(
                    self._weights, budget_bytes=self.hold_bytes, spill_dir=self.spill_dir
                )
            self._deferred.add(client, upload.tensors)
        else:
            self._fold.add(client, upload.tensors, weight)
        return Payload(meta=upload.meta)

    def _known_weight(self, client: int, upload: Payload) -> float | None:
        """The client's averaging weight if its upload alone decides it, else None."""
        if self._weighting != "ShardSize":
            return 1.0
        return self._bounds.example_weight(client, upload)

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
        fold, self._fold = self._fold, None
        deferred, self._deferred = self._deferred, None
        try:
            return self._combine(round, uploads, fold, deferred)
        finally:
            if deferred is not None:
                deferred.close()

    def _combine(
        self,
        round: int,
        uploads: Mapping[int, Payload],
        fold: OrderedFold | None,
        deferred: UploadStore | None,
    ) -> RoundResult | None:
        if not uploads:
            if fold is not None:
                fold.close()
            return None
        order = sorted(uploads)
        if self._weighting == "ShardSize":
            weights = self._bounds.example_weights(uploads)
        else:
            weights = dict.fromkeys(order, 1.0)
        if fold is None or not set(fold.added) <= set(uploads):
            # No plan (a restored server combining directly), or a plan whose taken uploads
            # are not all here: sum these uploads afresh (they must then be whole).
            if fold is not None:
                fold.close()
            fold = self._new_fold(order, hold_bytes=0)
        with fold:
            if fold.on_disk:  # weighed now, with the round's claims (the same known weights)
                for client in fold.added:
                    fold.reweigh(client, weights[client])
            for client in fold.planned:
                if client in uploads and not fold.taken(client):
                    if deferred is not None and client in deferred:
                        fold.add(client, deferred.tensors(client), weights[client])
                        deferred.release(client)  # one kept upload read at a time
                    else:
                        fold.add(client, uploads[client].tensors, weights[client])
                elif client not in uploads:
                    fold.skip(client)
            mean = fold.mean()
        updated = self._apply(mean)
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
        # Nothing reads the task's weights after training: a client role's learner trains in
        # them (consume), and uploads them.
        weights, stats = learner.train(instruction.tensors, round=round, consume=True)
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

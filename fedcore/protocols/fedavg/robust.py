"""fedavg with a robust aggregator (Median, TrimmedMean, Krum, FLTrust) or IFCA's clusters.

``spec.protocol.fedavg.aggregator`` picks the rule of ``aggregators`` that combines the
clients' updates (uploaded model minus the model sent); ``clusters`` > 1 runs IFCA (Ghosh et
al., "An Efficient Framework for Clustered Federated Learning", NeurIPS 2020): the server keeps
that many models, every client trains the one with the lowest loss on its shard and names it,
and each model combines its own clients' updates with the rule. Plain fedavg (Mean, one
cluster) keeps using ``ModelAveragingServer``. These are EBS-CFL's baselines (digest 004): they
protect nothing, and their robustness is measured in benchmarks/ebscfl.py.

A rule needs every upload of the round before it can combine any coordinate, so uploads are not
summed as they arrive, as plain fedavg's are: ``take_upload`` keeps each in the attempt's
``UploadStore`` (``fedcore.protocols._spill``: in memory up to ``hold_bytes``, beyond that on
disk) and the runtime keeps only its meta. ``combine`` runs the rule block by block over the
store (``aggregators.Rows``), whole uploads it is given (the simulation's) read in place, so it
holds K x block values and a few model-sized vectors, not K models, and gives the same result
either way, bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedcore.errors import ProtocolError
from fedcore.learning.training import LocalLearner
from fedcore.protocols._base import (
    ClientProtocol,
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
from fedcore.protocols._cluster_models import ClusterModels
from fedcore.protocols._maths import (
    check_like,
    cluster_name,
    flatten,
    mean_loss,
    unflatten,
)
from fedcore.protocols._spill import HOLD_BYTES, UploadStore
from fedcore.protocols.fedavg import aggregators
from fedcore.spec import FederatedRunSpec
from fedcore.spec._options import FedAvgOptions
from fedcore.transport import Payload

log = logging.getLogger(__name__)


class RobustAveragingServer(ClusterModels, BoundedServer, ServerProtocol):
    """fedavg's server with a robust rule and/or IFCA's cluster models.

    Args:
        initial: the initial global model.
        options: ``spec.protocol.fedavg``.
        root: FLTrust's learner on the server's root data (None for the other rules).
        seed: ``spec.seed`` (IFCA's models start from different seeds' perturbations).
        bounds: the run's upload bounds (``fedcore.protocols._bounds``); None: the model's
            default step bound and capped example claims.
    """

    kind = "fedavg-robust"

    def __init__(
        self,
        initial: Weights,
        *,
        options: FedAvgOptions,
        root: LocalLearner | None = None,
        seed: int = 0,
        bounds: UploadBounds | None = None,
    ) -> None:
        self._like = {n: np.asarray(w) for n, w in initial.items()}
        self._bounds = bounds or UploadBounds(default_update_norm(initial))
        self._names = list(initial)
        self._options = options
        self._root = root
        start = flatten(initial, self._names)
        m = options.clusters
        rng = np.random.default_rng([seed, 0x1FCA])
        scale = float(np.std(start)) if start.size else 0.0
        # IFCA starts its models apart (random initialisations); cluster 0 is the run's model.
        self._theta = np.stack(
            [start] + [start + scale * rng.standard_normal(start.size) for _ in range(m - 1)]
        )
        if options.aggregator == "FLTrust" and (root is None or m != 1):
            raise ProtocolError("FLTrust needs the server's root data and one cluster.")
        self._store: UploadStore | None = None
        self.hold_bytes = HOLD_BYTES
        """Bytes of uploads the attempt's store holds in memory before it writes them to disk."""
        self.spill_dir: str | None = None
        """Where the store writes uploads (None: the system's temporary folder)."""

    def keep_uploads_on_disk(self, folder: Path) -> None:
        """Every upload goes to a file in ``folder`` as it arrives (a store without a budget)."""
        self.hold_bytes = 0
        self.spill_dir = str(folder)

    def plan_round(self, round: int, clients: Sequence[int]) -> Mapping[int, Payload]:
        self._open_store()
        m = self._options.clusters
        if m == 1:
            instruction = Payload(meta={"round": round}, tensors=self.global_weights())
        else:
            tensors = {
                cluster_name(j, n): v
                for j in range(m)
                for n, v in unflatten(self._theta[j], self._like).items()
            }
            instruction = Payload(meta={"round": round, "clusters": m}, tensors=tensors)
        return {client: instruction for client in clients}

    def check_upload(self, round: int, client: int, upload: Payload) -> None:
        """Refuses an upload unlike the model, (IFCA) naming no cluster, claiming another
        example count than the client's shard, or stepping past the run's bound from its
        cluster's model."""
        what = f"upload of client {client} in round {round}"
        check_like(self._like, upload, what=what)
        self._bounds.check_examples(client, upload, what=what)
        cluster: object = 0
        if self._options.clusters > 1:
            cluster = upload.meta.get("cluster")
            if isinstance(cluster, bool) or not isinstance(cluster, int):
                raise ProtocolError(f"The {what} names no cluster (IFCA).")
            if not 0 <= cluster < self._options.clusters:
                raise ProtocolError(f"The {what} names cluster {cluster}, not one of the models.")
        assert isinstance(cluster, int)
        model = unflatten(self._theta[cluster], self._like)
        self._bounds.check_step(step_norm(upload.tensors, model), what=what)

    def _open_store(self) -> UploadStore:
        """Starts the store of a new attempt (the previous attempt's, if any, is dropped)."""
        if self._store is not None:
            self._store.close()
        self._store = UploadStore(
            self._like, budget_bytes=self.hold_bytes, spill_dir=self.spill_dir
        )
        return self._store

    def take_upload(self, round: int, client: int, upload: Payload) -> Payload | None:
        """Keeps a checked upload's tensors in the attempt's store (in memory or on disk); the
        runtime keeps its meta only. Every rule and mode streams so: a rule reads the uploads
        only at ``combine``, where the weights and (IFCA) the clusters come from the metas."""
        if self._store is None:  # no plan (a restored server): the runtime keeps it whole
            return None
        self._store.add(client, upload.tensors)
        return Payload(meta=upload.meta)

    def combine(
        self, round: int, uploads: Mapping[int, Payload], failures: Sequence[int]
    ) -> RoundResult | None:
        """Moves each cluster's model by its rule's aggregate of its clients' updates.

        A taken client's upload is read from the attempt's store; any other must be whole.

        Raises:
            ProtocolError: an upload that was not taken has no tensors (or not the model's).
            AggregateRefused: an aggregate is not finite or moves past the bound; no model moves.
        """
        store, self._store = self._store, None
        if store is None:
            store = UploadStore(self._like, budget_bytes=0, spill_dir=self.spill_dir)
        with store:
            return self._combine(round, uploads, store)

    def _combine(
        self, round: int, uploads: Mapping[int, Payload], store: UploadStore
    ) -> RoundResult | None:
        if not uploads:
            return None
        options = self._options
        order = sorted(uploads)
        for client in order:
            if client not in store:
                store.lend(client, uploads[client].tensors)
        if options.weighting == "ShardSize":
            weights = self._bounds.example_weights(uploads)
        else:
            weights = dict.fromkeys(order, 1.0)
        metrics: dict[str, float] = {}
        steps: dict[int, np.ndarray] = {}
        for j in range(options.clusters):
            members = [k for k in order if int(uploads[k].meta.get("cluster", 0)) == j]
            if not members:
                continue
            # Row i of a block: flatten(upload of members[i])[block] - theta_j[block].
            updates = store.view(members, minus=self._theta[j])
            rule = options.aggregator
            if rule == "FLTrust":
                assert self._root is not None
                trained, _ = self._root.train(unflatten(self._theta[j], self._like), round=round)
                server_update = flatten(trained, self._names) - self._theta[j]
                steps[j], scores = aggregators.fltrust_scored(updates, server_update)
                metrics["trusted"] = float(np.count_nonzero(scores))
                metrics[f"cluster_{j}_clients"] = float(len(members))
                continue
            if rule == "Krum" and updates.count < options.krum_byzantine + 3:
                log.warning(
                    "Round %d cluster %d: %d updates are too few for Krum with f = %d; using "
                    "Median for it.",
                    round,
                    j,
                    updates.count,
                    options.krum_byzantine,
                )
                rule = "Median"
            steps[j] = aggregators.aggregate(
                rule,
                updates,
                weights=[weights[k] for k in members],
                trim=options.trim_fraction,
                byzantine=options.krum_byzantine,
            )
            metrics[f"cluster_{j}_clients"] = float(len(members))
        for step in steps.values():  # all checked before any is applied
            self._bounds.check_aggregate_step(round, step)
        for j, step in steps.items():
            np.add(self._theta[j], step, out=self._theta[j])
        return RoundResult(
            participants=len(order), train_loss=mean_loss(uploads, weights), metrics=metrics
        )


class RobustTrainingClient(ClientProtocol):
    """A fedavg client that (IFCA) picks its model, and (as an attacker) poisons its update.

    Args:
        attack: this client's attack on its upload (SignFlip, Scale, InflateExamples) or
            None (Overflow is applied by the client runtime, to any protocol's upload).
        scale: the attack's scale.
    """

    def __init__(self, *, attack: str | None = None, scale: float = 1.0) -> None:
        self._attack = attack
        self._scale = scale

    def compute_upload(
        self, round: int, instruction: Payload, learner: LocalLearner, keys: Payload | None
    ) -> Payload:
        clusters = int(instruction.meta.get("clusters", 1))
        if clusters == 1:
            models = [dict(instruction.tensors)]
        else:
            prefix = cluster_name(0, "")
            names = [n[len(prefix) :] for n in instruction.tensors if n.startswith(prefix)]
            models = [
                {n: instruction.tensors[cluster_name(j, n)] for n in names} for j in range(clusters)
            ]
        cluster = 0
        if clusters > 1:
            losses = [learner.gradient(w, round=round)[1].loss for w in models]
            cluster = int(np.argmin(losses))
        start = models[cluster]
        trained, stats = learner.train(start, round=round)
        if self._attack in {"SignFlip", "Scale"}:
            from fedcore.learning.poisoning import poison_update

            names = list(start)
            update = poison_update(
                flatten(trained, names) - flatten(start, names), self._attack, self._scale
            )
            trained = unflatten(flatten(start, names) + update, start)
        claimed = stats.num_examples
        if self._attack == "InflateExamples":
            claimed = max(1, int(self._scale * stats.num_examples))
        meta: dict[str, Any] = {
            "num_examples": claimed,
            "loss": stats.loss,
            "steps": stats.steps,
        }
        if clusters > 1:
            meta["cluster"] = cluster
        return Payload(meta=meta, tensors=trained)


def root_learner(spec: FederatedRunSpec, examples: int) -> LocalLearner:
    """FLTrust's learner on the server's root data (every data cluster's shards together)."""
    from fedcore.learning.data import ArrayDataset, root_shards
    from fedcore.learning.models import build_model

    shards = [shard for _, shard in root_shards(spec, examples)]
    data = ArrayDataset(
        np.concatenate([s.x for s in shards]),
        np.concatenate([s.y for s in shards]),
        shards[0].num_classes,
    )
    model = build_model(spec.model, data.input_shape, data.num_classes, seed=spec.seed)
    return LocalLearner(model, data, spec.training, seed=spec.seed, client_index=spec.clients.count)

"""What a client of a decentralized protocol does besides its protocol's maths.

The model lives on the clients, so each client role keeps its peer links (``PeerMesh``),
restores its state when the coordinator's round starts from an earlier round (a resumed or
restarted coordinator), and does, when the coordinator's instruction asks, what the server
role does for a central protocol: evaluate its model on the held-out split, write its own
checkpoint (``clients/client-<i>/`` under the run's checkpoint store, encrypted and signed
with the client's own key) and release its final model (``models/client-<i>.safetensors`` in
its work folder). Only scalars go back to the coordinator.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.numpy import save_file

from fedcore.checkpoint import (
    Checkpointer,
    CheckpointRefused,
    client_checkpoint_key,
    client_checkpointer,
    open_store,
)
from fedcore.errors import CheckpointError, CheckpointInvalid, FedcoreError
from fedcore.learning.data import client_test_dataset, test_dataset
from fedcore.learning.models import build_model
from fedcore.learning.training import Evaluator
from fedcore.observe.metrics import RoleMetrics
from fedcore.protocols import ClientProtocol, PeerClientProtocol
from fedcore.roles._common import RoleConfig, spec_fingerprint
from fedcore.roles._peers import PeerMesh
from fedcore.spec import FederatedRun, peer_graph
from fedcore.spec.topology import peer_plans
from fedcore.transport import Limits, Payload, RetryPolicy, TlsBundle

log = logging.getLogger(__name__)

MODELS_FOLDER = "models"
"""Each client's released model is ``<workdir>/models/client-<i>.safetensors``."""


@dataclass(frozen=True)
class PeerSettings:
    """Where a client serves its peer links and where it finds its out-neighbours.

    Attributes:
        listen: ``host:port`` of this client's peer service.
        addresses: explicit ``host:port`` per client index (the local runner's way).
        template: a ``host:port`` with ``{index}`` for any other client (Kubernetes:
            ``client-{index}.<run>-clients.<ns>.svc:7072``).
    """

    listen: str
    addresses: dict[int, str] = field(default_factory=dict)
    template: str | None = None

    def address_of(self, index: int) -> str:
        """Client ``index``'s peer address.

        Raises:
            FedcoreError: neither an explicit address nor a template names it.
        """
        if index in self.addresses:
            return self.addresses[index]
        if self.template:
            return self.template.replace("{index}", str(index))
        raise FedcoreError(
            f"No peer address for client {index}: pass --peer {index}=HOST:PORT or --peer-template."
        )


def own_checkpointer(run: FederatedRun, workdir: Path, index: int, key: bytes) -> Checkpointer:
    """Client ``index``'s own checkpoints, under ``clients/client-<i>/`` of the run's store,
    encrypted and signed with its own ``key`` (``client_checkpoint_key``)."""
    spec = run.spec.checkpoint
    name = run.metadata.name
    return client_checkpointer(
        open_store(spec, name=name, workdir=workdir),
        spec,
        run=name,
        fingerprint=spec_fingerprint(run),
        index=index,
        key=key,
    )


class PeerDuties:
    """A decentralized client's links, restores, evaluations, checkpoints and releases."""

    def __init__(
        self,
        run: FederatedRun,
        config: RoleConfig,
        tls: TlsBundle,
        *,
        index: int,
        protocol: ClientProtocol,
        settings: PeerSettings | None,
        metrics: RoleMetrics,
        limits: Limits,
        retry: RetryPolicy,
        device: str,
    ) -> None:
        spec = run.spec
        if not isinstance(protocol, PeerClientProtocol):
            raise FedcoreError(f"Protocol {spec.protocol.name!r} has no peer client side.")
        if settings is None:
            raise FedcoreError(
                f"Protocol {spec.protocol.name!r} needs peer links: pass --peer-listen and "
                f"--peer-template (or one --peer INDEX=HOST:PORT per out-neighbour)."
            )
        graph, matrix = peer_graph(spec)
        plan = peer_plans(graph, matrix)[index]
        self.run = run
        self.index = index
        self.workdir = config.workdir
        self.protocol: PeerClientProtocol = protocol
        # Read now, as the server and the KDC read theirs before they serve: a key file that
        # is missing or malformed stops the client at start, naming it, not at its first
        # checkpoint. The store is opened on first use (boto3 costs start-up time).
        self._key = client_checkpoint_key(self.workdir, index)
        self.mesh = PeerMesh(
            plan,
            tls,
            listen=settings.listen,
            addresses={j: settings.address_of(j) for j in plan.out_neighbours},
            limits=limits,
            retry=retry,
            timeout=spec.failure_policy.round_timeout_seconds,
            on_bytes=metrics.count_bytes,
        )
        self._checkpointer: Checkpointer | None = None
        # A peer scores its own model: on its own held-out data, else on the shared test split.
        own = spec.data.client_data is not None
        test = client_test_dataset(spec, index) if own else test_dataset(spec)
        model = build_model(spec.model, test.input_shape, test.num_classes, seed=spec.seed)
        self.evaluator = Evaluator(model.to(device), test, spec.training, device=device)
        self._traffic = (0, 0)

    @property
    def checkpointer(self) -> Checkpointer:
        """This client's checkpointer (opened on first use)."""
        if self._checkpointer is None:
            self._checkpointer = own_checkpointer(self.run, self.workdir, self.index, self._key)
        return self._checkpointer

    def start(self) -> None:
        """Serves and dials the peer links and hands them to the protocol."""
        self.mesh.start()
        self.protocol.setup_peers(self.mesh)
        log.info("Peer service of client %d listens on port %d.", self.index, self.mesh.port)

    def close(self) -> None:
        """Ends the peer links."""
        self.mesh.close()

    def before(self, round: int, instruction: Payload) -> None:
        """Brings the protocol's state to the round the task starts from.

        Raises:
            CheckpointInvalid: this client has no usable checkpoint of that round.
        """
        base = int(instruction.meta.get("base_round", round - 1))
        if self.protocol.completed_round() == base:
            return
        if base == 0:
            log.warning(
                "Round %d starts afresh; dropping the state of round %d.",
                round,
                self.protocol.completed_round(),
            )
            self.protocol.load_state_dict(None)
            return
        try:
            state = self.checkpointer.load(base)
        except CheckpointError as exc:
            adopt = (
                f" To take it knowingly, `{self.checkpointer.rollback_command(base)} "
                f"--adopt-unsigned` checks its sums and signs it with this client's key."
                if isinstance(exc, CheckpointRefused) and "unsigned" in exc.reason
                else ""
            )
            raise CheckpointInvalid(
                f"Client {self.index} must resume from its checkpoint of round {base}, which "
                f"it cannot read: {exc}{adopt}"
            ) from exc
        self.protocol.load_state_dict(state["protocol"])
        log.info("Restored the state of round %d from this client's checkpoint.", base)

    def after(self, round: int, instruction: Payload, upload: Payload) -> Payload:
        """Evaluates, checkpoints and releases as asked; adds the scalars to the upload."""
        meta = dict(upload.meta)
        flags = instruction.meta
        if flags.get("evaluate"):
            result = self.evaluator.evaluate(self.protocol.local_weights())
            meta.update(eval_accuracy=result.accuracy, eval_loss=result.loss)
        if flags.get("checkpoint"):
            try:
                self.checkpointer.save(
                    round, {"round": round, "protocol": self.protocol.state_dict()}
                )
                meta["checkpointed"] = round
            except CheckpointError as exc:
                log.error("The checkpoint of round %d failed: %s", round, exc)
                meta["checkpoint_error"] = str(exc)[:500]
        if flags.get("release"):
            self._release()
        sent, received = self.mesh.bytes_sent, self.mesh.bytes_received
        meta["peer_bytes_sent"] = sent - self._traffic[0]
        meta["peer_bytes_received"] = received - self._traffic[1]
        self._traffic = (sent, received)
        return Payload(meta=meta, tensors=upload.tensors)

    def _release(self) -> None:
        path = self.workdir / MODELS_FOLDER / f"client-{self.index}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(dict(self.protocol.local_weights()), str(tmp))
        tmp.replace(path)

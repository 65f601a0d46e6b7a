"""The server role: plan, fan out, sort, combine, evaluate, checkpoint, report; every round.

The round loop runs in the main thread; each client holds one long-lived two-way session
(gRPC over mutual TLS) whose events meet the loop on a ``RoundBoard``: a task goes out when an
attempt opens, the upload comes back on the same session, and a session that ends marks its
client as dropped at once. The server knows nothing of any
protocol's maths: it calls the protocol's hooks and applies its dropout policy.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedcore.checkpoint import (
    Checkpointer,
    CheckpointShortOfSpace,
    TensorFile,
    server_checkpoint_key,
    server_checkpointer,
)
from fedcore.errors import (
    AggregateRefused,
    CheckpointError,
    EncodingRejected,
    MessageRejected,
    ProtocolError,
    RecoveryError,
    RunAborted,
    UploadRefused,
)
from fedcore.learning._memory import trim
from fedcore.learning.data import dataset_info, shard_sizes, test_dataset
from fedcore.learning.evaluation import (
    EVALUATION_ATTEMPT,
    FederatedScore,
    checked_answer,
    evaluation_request,
    summed,
)
from fedcore.learning.models import build_model, get_weights
from fedcore.learning.training import Evaluator
from fedcore.local.groups import uploads_on_disk
from fedcore.local.probe import available_memory_bytes
from fedcore.observe.events import EventLog
from fedcore.observe.kube_status import status_listeners
from fedcore.observe.metrics import RoleMetrics
from fedcore.privacy import PrivacyLedger
from fedcore.protocols import ServerProtocol, create_protocol
from fedcore.protocols._compressed import META_KEY as COMPRESSION_KEY
from fedcore.protocols._compressed import compress_tensors, decompress_tensors
from fedcore.protocols._spill import remove_spilled
from fedcore.roles._common import (
    KDC_SERVICE,
    SERVER_SERVICE,
    RoleConfig,
    choose_device,
    limits_of,
    parameters_of,
    retry_of,
    role_checkpointer,
    settle_role_process,
    site_gate,
)
from fedcore.roles._history import StoreHistory
from fedcore.roles._hold import HoldPoint
from fedcore.roles.client import RpcKeyChannel
from fedcore.rounds import AttemptReport, RoundPolicy, play_round, play_stages, said_failure
from fedcore.spec import FederatedRun, protocol_facts, spec_digest
from fedcore.transport import (
    Identity,
    Payload,
    RpcClient,
    RpcServer,
    ServerSession,
    SessionHandler,
    TlsBundle,
)

log = logging.getLogger(__name__)

GOODBYE_SECONDS = 10.0
"""How long the server waits at the end for every present client to hear "done"."""
FAILURE_GRACE_SECONDS = 1.0
"""How long a round that stops on a failure waits for the failures that follow it."""


Compressor = Callable[
    [Mapping[str, np.ndarray]], tuple[dict[str, np.ndarray], dict[str, Any] | None]
]
"""Compresses a broadcast's tensors: (what to send, how, or None if sent exact)."""


@dataclass
class Attempt:
    """One try at a round: who was asked, what came back, who failed and why."""

    round: int
    attempt: int
    plans: Mapping[int, Payload]
    stage: int = 0
    """The stage of the attempt (multi-stage protocols; 0 for the others)."""
    uploads: dict[int, Payload] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    delivered: dict[int, ServerSession] = field(default_factory=dict)
    taken: set[int] = field(default_factory=set)
    """Clients whose upload the protocol consumed on arrival (``take_upload``)."""
    spec_digest: str | None = None
    compress: Compressor | None = field(default=None, repr=False)
    _tasks: dict[int, Payload] = field(default_factory=dict, repr=False)

    def deliver(self, client: int, session: ServerSession) -> bool:
        """Sends ``client`` its task on ``session`` unless it already went there."""
        return client in self.deliver_all({client: session})

    def deliver_all(self, sessions: Mapping[int, ServerSession]) -> set[int]:
        """``deliver`` for each client and its session, the tasks queued together
        (``ServerSession.send_all``: their loop woken once); returns the clients whose task
        is on its session now."""
        done = {
            client for client, session in sessions.items() if self.delivered.get(client) is session
        }
        todo = [(client, session) for client, session in sessions.items() if client not in done]
        queued = ServerSession.send_all(
            [(session, self.task_for(client)) for client, session in todo]
        )
        for (client, session), sent in zip(todo, queued, strict=True):
            if sent:
                self.delivered[client] = session
                done.add(client)
        return done

    def release(self) -> None:
        """Lets go of the attempt's tensors once its round is combined (the plans', the tasks'
        and the uploads'; their metas stay): the board keeps the last attempt until the next
        opens, and its model must not outlive the round beside the new one."""
        self.plans = {client: Payload(meta=plan.meta) for client, plan in self.plans.items()}
        self.uploads = {client: Payload(meta=up.meta) for client, up in self.uploads.items()}
        self._tasks.clear()

    def settled(self) -> bool:
        """Whether every planned client has uploaded or failed."""
        return len(self.uploads) + len(self.failed) >= len(self.plans)

    def pending(self, client: int) -> bool:
        """Whether ``client`` was planned and has neither uploaded nor failed."""
        return client in self.plans and client not in self.uploads and client not in self.failed

    def task_for(self, client: int) -> Payload:
        """Returns the message that carries ``client``'s instruction, and the digest of the
        spec the server runs (a site's client checks it against the one it approved).

        Clients with the same plan (one object) get the same message object, which the
        transport then encodes once for all of them."""
        plan = self.plans[client]
        task = self._tasks.get(id(plan))
        if task is None:
            meta = {
                "kind": "task",
                "round": self.round,
                "attempt": self.attempt,
                "instruction": plan.meta,
                "specDigest": self.spec_digest,
            }
            if self.stage:
                meta["stage"] = self.stage
            tensors = plan.tensors
            if self.compress is not None:
                tensors, description = self.compress(plan.tensors)
                if description is not None:
                    meta[COMPRESSION_KEY] = description
            task = Payload(meta=meta, tensors=tensors)
            self._tasks[id(plan)] = task
        return task


class RoundBoard(SessionHandler):
    """Where the round loop meets the client sessions (all state under one condition)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.cond = threading.Condition()
        self.sessions: dict[int, ServerSession] = {}
        self.current: Attempt | None = None
        self.done = False

    # -------------------------------------------------------------- session events

    def opened(self, session: ServerSession) -> None:
        index = self.server.client_index(session.peer)
        with self.cond:
            old = self.sessions.get(index)
            self.sessions[index] = session
            # Under the lock, so that the round loop's "joined" comes after the last of these.
            # A client connects once its constructor has loaded its data and built its model.
            self.server.events.emit(
                "connected",
                client=index,
                connected=len(self.sessions),
                clients=self.server.spec.clients.count,
            )
            self.cond.notify_all()
        if old is not None and old is not session:
            old.close()
        if self.done:
            session.send(Payload(meta={"kind": "done"}))
        log.info("Client %d connected.", index)

    def received(self, session: ServerSession, message: Payload) -> None:
        index = self.server.client_index(session.peer)
        kind = message.meta.get("kind")
        if kind == "hello":
            with self.cond:
                attempt = self.current
                if attempt is not None and attempt.pending(index):
                    attempt.deliver(index, session)
        elif kind == "upload":
            status = self.server.accept_upload(index, message)
            if status != "accepted":
                session.send(Payload(meta={"kind": "ack", "status": status}))
        elif kind == "refused":
            self.server.site_refused(index, message)
            self._left(index, session, "refused")
        elif kind == "failed":
            self._left(index, session, self.server.client_failed(index, message))
        else:
            raise MessageRejected(f"A client sent a message of unknown kind {kind!r}.")

    def _left(self, index: int, session: ServerSession, why: str) -> None:
        """A client said why it leaves: its pending task fails with ``why``, its session ends."""
        with self.cond:
            attempt = self.current
            if attempt is not None and attempt.pending(index):
                attempt.failed[index] = why
            self.cond.notify_all()
        session.close()  # the client leaves: heard

    def closed(self, session: ServerSession) -> None:
        index = self.server.client_index(session.peer)
        with self.cond:
            if self.sessions.get(index) is session:
                del self.sessions[index]
                attempt = self.current
                if not self.done and attempt is not None and attempt.pending(index):
                    attempt.failed[index] = "disconnected"
            self.cond.notify_all()

    # ---------------------------------------------------------------- round loop side

    def release_attempt(self) -> None:
        """``Attempt.release`` of the current attempt, if any (its round is combined)."""
        with self.cond:
            if self.current is not None:
                self.current.release()

    def open_attempt(self, attempt: Attempt, *, wait_for_absent: bool) -> None:
        """Publishes a new attempt and sends each connected planned client its task.

        A planned client that is not connected fails the attempt at once, unless
        ``wait_for_absent``: then its task goes out when it reconnects (until the deadline).
        """
        with self.cond:
            self.current = attempt
            connected = {
                client: self.sessions[client] for client in attempt.plans if client in self.sessions
            }
            delivered = attempt.deliver_all(connected)
            for client in attempt.plans:
                if client not in delivered and not wait_for_absent:
                    attempt.failed[client] = "absent"
            self.cond.notify_all()

    def wait_settled(self, deadline: float, *, stop_on_failure: bool = False) -> Attempt:
        """Blocks until the current attempt is settled or ``deadline`` passes (or, with
        ``stop_on_failure``, until a planned client fails, plus ``FAILURE_GRACE_SECONDS`` for
        the failures it causes: a killed client's neighbours may drop out first, and the
        error should name every client lost, the cause among them)."""
        with self.cond:
            attempt = self.current
            assert attempt is not None
            while not attempt.settled() and not (stop_on_failure and attempt.failed):
                left = deadline - time.monotonic()
                if left <= 0:
                    for client in attempt.plans:
                        if attempt.pending(client):
                            attempt.failed[client] = "timeout"
                    break
                self.cond.wait(left)
            if stop_on_failure and attempt.failed:
                grace = min(deadline, time.monotonic() + FAILURE_GRACE_SECONDS)
                while not attempt.settled() and (left := grace - time.monotonic()) > 0:
                    self.cond.wait(left)
            self.current = None
            return attempt

    def wait_connected(self, count: int, deadline: float) -> int:
        """Blocks until ``count`` clients are connected or ``deadline``; returns how many are."""
        with self.cond:
            while len(self.sessions) < count and time.monotonic() < deadline:
                self.cond.wait(max(0.0, deadline - time.monotonic()))
            return len(self.sessions)

    def finish(self, deadline: float) -> None:
        """Tells every client the run is over and waits (bounded) for them to hang up."""
        with self.cond:
            self.done = True
            for session in self.sessions.values():
                session.send(Payload(meta={"kind": "done"}))
            while self.sessions and time.monotonic() < deadline:
                self.cond.wait(max(0.0, deadline - time.monotonic()))


class Server:
    """The server role of one run.

    Args:
        run: the validated manifest.
        config: how this process was started.
        listen: the ``host:port`` to serve on.
        resume: whether to start from the latest checkpoint.
        kdc: ``host:port`` of the KDC, for protocols whose server calls it.
        require_checkpoint: with ``resume``, refuse to start (reason ``NoCheckpoint``) when
            there is no checkpoint to resume from, instead of starting at round 1 (what a
            restarted server does when it died before its first checkpoint).
    """

    def __init__(
        self,
        run: FederatedRun,
        config: RoleConfig,
        tls: TlsBundle,
        *,
        listen: str,
        resume: bool,
        kdc: str | None = None,
        require_checkpoint: bool = False,
        memory_bytes: int | None = None,
    ) -> None:
        self.run = run
        self.spec = run.spec
        self.config = config
        self.resume = resume
        self.require_checkpoint = require_checkpoint
        self.facts = protocol_facts(self.spec.protocol.name)
        self.spec_digest = spec_digest(run)
        self.round_policy = RoundPolicy(self.spec, self.facts)
        self.events = EventLog(config.events, listeners=status_listeners(run))
        self.hold = HoldPoint(self.events)
        self.metrics = RoleMetrics(run.metadata.name, "server")
        self.metrics.rounds_planned.set(self.spec.rounds)
        device = choose_device(self.spec.roles.server)
        input_shape, num_classes = dataset_info(self.spec)
        model = build_model(self.spec.model, input_shape, num_classes, seed=self.spec.seed)
        scheme = create_protocol(self.spec.protocol.name)
        # Views of the model's tensors: the protocol keeps its own copy, the only one.
        initial = get_weights(model, copy=False)
        self.protocol: ServerProtocol = scheme.create_server(self.spec, initial)
        del initial
        self.protocol.set_shard_sizes(shard_sizes(self.spec))  # weights from what it knows
        self.model_bytes = sum(int(v.nbytes) for v in self.protocol.global_weights().values())
        self.uploads_on_disk = self._place_uploads(memory_bytes)
        self.storage_failure: RunAborted | None = None
        """Set when an upload could not be kept on disk: the attempt then stops the run."""
        self.privacy = PrivacyLedger(self.spec, scheme.noise_multiplier(self.spec), self.metrics)
        if self.privacy.enabled and self.privacy.secret:
            log.info(
                "spec.clients.sampling is Secret: each round's sample is drawn from the OS "
                "CSPRNG, and epsilon claims its amplification (sampling without replacement at "
                "rate %g, noise multiplier %g, replace-one adjacency) against whoever sees the "
                "models but not who took part.",
                self.privacy.round_rate,
                self.privacy.round_multiplier,
            )
        elif self.privacy.enabled and self.privacy.sampled:
            log.warning(
                "spec.clients.perRound is below 100%%: the sample of each round is public "
                "(seeded by the manifest), so no amplification by subsampling is claimed; "
                "epsilon is accounted under replace-one adjacency as if every client took "
                "part in every round (noise multiplier %g per round). spec.clients.sampling: "
                "Secret draws a secret sample, whose amplification is claimed.",
                self.privacy.round_multiplier,
            )
        self.where = self.spec.evaluation_where
        self.num_classes = num_classes
        self.evaluator: Evaluator | None = None
        if self.where != "Clients" and self.spec.data.client_data is None:
            self.evaluator = Evaluator(
                model.to(device),
                test_dataset(self.spec),
                self.spec.training,
                device=device,
                own_model=True,
            )
        self.kdc: RpcClient | None = None
        if self.facts.server_uses_kdc:
            if kdc is None:
                raise RunAborted(
                    f"Protocol {self.spec.protocol.name!r}'s server needs the KDC: pass --kdc.",
                    reason="ProtocolFailed",
                )
            self.kdc = RpcClient(
                kdc,
                tls,
                service=KDC_SERVICE,
                limits=limits_of(self.spec, parameters_of(model)),
                retry=retry_of(self.spec),
                peer=Identity("kdc"),
                on_bytes=self.metrics.count_bytes,
            )
        self.checkpointer = self._checkpointer()
        if config.events is None and self.checkpointer is not None:
            # A pod: no events file outlives it, so its events go beside its checkpoints.
            self.events.add_listener(StoreHistory(self.checkpointer.store))
        self.board = RoundBoard(self)
        self._check_lock = threading.Lock()
        self.history: list[dict[str, Any]] = []
        limits = limits_of(self.spec, parameters_of(model))
        self.gate = site_gate(self.spec, config.revoked_sites)
        self.rpc = RpcServer(
            listen,
            tls,
            {},
            gate=self.gate,
            sessions={"Session": self.board},
            service=SERVER_SERVICE,
            limits=limits,
            max_workers=limits.workers(self.spec.clients.count),
            callers={"Session": ["client"]},
            on_rejected=lambda method, reason, sender: self.metrics.rejected(reason, sender),
            on_bytes=self.metrics.count_bytes,
        )

    def _place_uploads(self, memory_bytes: int | None) -> bool:
        """Keeps the rounds' uploads on disk where ``spec.uploads.storage`` says so (Auto: where
        ``memory_bytes``, else this process's available memory, would not hold them in
        memory); returns whether it does."""
        storage = self.spec.uploads.storage
        model_bytes = self.model_bytes
        memory = None
        if storage == "Auto":
            memory = available_memory_bytes() if memory_bytes is None else memory_bytes
        if not uploads_on_disk(storage, model_bytes, memory):
            return False
        self.config.workdir.mkdir(parents=True, exist_ok=True)
        stale = remove_spilled(self.config.workdir)
        if stale:
            log.info("Removed %d folder(s) of uploads a previous server left unfinished.", stale)
        self.protocol.keep_uploads_on_disk(self.config.workdir)
        log.info(
            "Keeping each round's uploads on disk, in %s (spec.uploads.storage %s; a model "
            "of %s bytes%s).",
            self.config.workdir,
            storage,
            f"{model_bytes:,}",
            "" if memory is None else f", {memory:,} bytes of memory available",
        )
        return True

    # ------------------------------------------------------------------------ clients

    def client_index(self, peer: Identity) -> int:
        """Returns the client index a peer's certificate names.

        Raises:
            PermissionError: the peer is not a client of this run.
        """
        if peer.role != "client" or peer.index is None or peer.index >= self.spec.clients.count:
            raise PermissionError(f"{peer.common_name!r} is not a client of this run.")
        return peer.index

    def accept_upload(self, index: int, message: Payload) -> str:
        """Checks and records one upload (the protocol may sum it at once, ``take_upload``);
        returns accepted, duplicate, stale, rejected, revoked or unstored (the server could
        not keep it: the run stops, ``storage_failure``)."""
        board = self.board
        upload = Payload(meta=dict(message.meta.get("upload") or {}), tensors=message.tensors)
        key = (message.meta.get("round"), message.meta.get("attempt"), message.meta.get("stage", 0))
        with board.cond:
            attempt = board.current
            if attempt is None or (attempt.round, attempt.attempt, attempt.stage) != key:
                self.metrics.rejected("stale", sender=f"client-{index}")
                return "stale"
            if index in attempt.uploads:
                return "duplicate"
            if not attempt.pending(index):
                self.metrics.rejected("stale", sender=f"client-{index}")
                return "stale"
        try:
            if attempt.attempt == EVALUATION_ATTEMPT:
                per_class = self.spec.evaluation.per_class
                checked_answer(upload.meta, self.num_classes, per_class)
                if upload.tensors:
                    raise MessageRejected("An evaluation answer carries tensors.")
            else:
                tensors = decompress_tensors(
                    self.spec,
                    "uploads",
                    message.tensors,
                    message.meta.get(COMPRESSION_KEY),
                    what=f"upload of client {index}",
                )
                upload = Payload(meta=upload.meta, tensors=tensors)
                with self._check_lock:  # protocols need not be thread-safe
                    self.protocol.check_upload(attempt.round, index, upload)
        except (ProtocolError, MessageRejected) as exc:
            self._count_refused(index, attempt.round, exc)
            status = "rejected"
        else:
            status = "accepted"
        with board.cond:
            if board.current is not attempt or not attempt.pending(index):
                return "stale"
            if status == "accepted" and self.gate and self.gate(Identity("client", index)):
                status = "revoked"  # its site was revoked meanwhile: not summed
                attempt.failed[index] = "revoked"
            elif status == "accepted" and attempt.attempt == EVALUATION_ATTEMPT:
                attempt.uploads[index] = upload
            elif status == "accepted":
                # Under the board's lock, so that no later attempt's plan can take it.
                try:
                    with self._check_lock:
                        kept = self.protocol.take_upload(attempt.round, index, upload)
                except ProtocolError as exc:
                    self._count_refused(index, attempt.round, exc)
                    status = "rejected"
                    attempt.failed[index] = "rejected"
                except OSError as exc:  # the server's own disk (spec.uploads.storage)
                    log.error("Could not keep client %d's upload: %s", index, exc)
                    self.storage_failure = self.storage_failure or RunAborted(
                        f"The server could not keep client {index}'s upload of round "
                        f"{attempt.round} on disk in {self.config.workdir} ({exc}); free "
                        "space there, or set spec.uploads.storage: Memory, and resume.",
                        reason="UploadsNotStored",
                        round=attempt.round,
                    )
                    status = "unstored"
                    attempt.failed[index] = "unstored"
                else:
                    if kept is not None:
                        attempt.taken.add(index)
                    attempt.uploads[index] = upload if kept is None else kept
            else:
                attempt.failed[index] = "rejected"
            if status != "accepted" or attempt.settled():
                # The round's thread waits for a settled attempt or a failure: waking it for
                # every upload cost a thread switch per client and round.
                board.cond.notify_all()
        return status

    def site_refused(self, index: int, message: Payload) -> None:
        """Records a site's client refusing a task (its site's policy): event ``site_refused``
        with the site's reason and message (bounded), and the log."""
        reason, text = _client_words(message, default="Refused")
        site = self.spec.site_of(index)
        round_ = _round_of(message)
        log.warning(
            "Client %d (site %s) refused round %s: %s (%s)", index, site, round_, text, reason
        )
        self.events.emit(
            "site_refused",
            site=site,
            client=index,
            round=round_,
            reason=reason,
            message=text,
        )

    def client_failed(self, index: int, message: Payload) -> str:
        """Records a client that cannot answer its task and leaves (a checkpoint it cannot
        restore, a lost peer): event ``client_failed`` and the log, with its reason and message
        (bounded, one line). Returns the attempt's failure for it (``said_failure``)."""
        reason, text = _client_words(message, default="Failed")
        round_ = _round_of(message)
        log.error("Client %d failed round %s and leaves: %s (%s)", index, round_, text, reason)
        self.events.emit("client_failed", client=index, round=round_, reason=reason)
        return said_failure(reason, text)

    def without_revoked(self, attempt: Attempt) -> Attempt:
        """Moves the uploads of clients whose site was revoked meanwhile to ``failed``
        (``revoked``): they are never combined."""
        if self.gate is None:
            return attempt
        for index in list(attempt.uploads):
            if self.gate(Identity("client", index)) is not None:
                if index in attempt.taken:  # summed on arrival, while its site was admitted
                    log.warning(
                        "Client %d's site was revoked after its round %d upload was summed; "
                        "it stays in this round's aggregate.",
                        index,
                        attempt.round,
                    )
                    continue
                del attempt.uploads[index]
                attempt.failed[index] = "revoked"
        return attempt

    def _count_refused(self, index: int, round_: int, exc: ProtocolError | MessageRejected) -> None:
        """Counts and logs one refused upload with its sender (reason encoding, bound,
        evaluation or upload)."""
        if isinstance(exc, MessageRejected):
            reason = "evaluation"
        elif isinstance(exc, EncodingRejected):
            reason = "encoding"
        elif isinstance(exc, UploadRefused):
            reason = "bound"
        else:
            reason = "upload"
        self.metrics.rejected(reason, sender=f"client-{index}")
        log.warning(
            "Refused the upload of client %d in round %d (sender client-%d, reason %s): %s",
            index,
            round_,
            index,
            reason,
            exc,
        )

    # ----------------------------------------------------------------------- round loop

    def serve(self) -> dict[str, Any]:
        """Runs every round and returns the final summary.

        Raises:
            RunAborted: the quorum was lost, a checkpoint failed, or no client came.
        """
        self.metrics.serve(self.config.metrics_port, self.config.metrics_address)
        try:
            self._check_store()
            start_round = self._restore() + 1
            self._setup_protocol()
        except RunAborted as exc:
            # Reported, so that a runner or operator does not restart a server that cannot start.
            self.events.emit("failed", reason=exc.reason, message=str(exc), round=exc.round)
            raise
        self.rpc.start()
        self.events.emit(
            "ready",
            role="server",
            port=self.rpc.port,
            start_round=start_round,
            **self.privacy.claim(),
        )
        try:
            try:
                summary = self._rounds(start_round)
            except ProtocolError as exc:
                # A protocol that cannot go on (e.g. a failed recovery check) stops the run.
                if isinstance(exc, RecoveryError):
                    reason = "RecoveryFailed"
                elif isinstance(exc, AggregateRefused):
                    reason = "AggregateRefused"
                else:
                    reason = "ProtocolFailed"
                raise RunAborted(
                    f"{type(exc).__name__}: {exc}",
                    reason=reason,
                    round=getattr(exc, "round", None),
                ) from exc
        except RunAborted as exc:
            self.events.emit("failed", reason=exc.reason, message=str(exc), round=exc.round)
            self.board.finish(time.monotonic() + GOODBYE_SECONDS)
            raise
        finally:
            self.rpc.stop()
        return summary

    def _rounds(self, start_round: int) -> dict[str, Any]:
        spec = self.spec
        policy = spec.failure_policy
        count = spec.clients.count
        joined = self.board.wait_connected(count, time.monotonic() + policy.connect_timeout_seconds)
        self.events.emit("joined", clients=joined)
        if joined == 0:
            raise RunAborted(
                f"No client connected within {policy.connect_timeout_seconds} s "
                f"(spec.failurePolicy.connectTimeoutSeconds).",
                reason="NoClients",
                round=start_round,
            )
        last_eval: dict[str, Any] = {}
        completed = start_round - 1
        stop_reason: str | None = None
        for round_ in range(start_round, spec.rounds + 1):
            stop = self.round_policy.budget_stop(round_, self.privacy)
            if stop is not None:
                stop_reason = "BudgetExhausted"
                log.warning(
                    "Stopping before round %d: it would spend epsilon %.4f, over the budget of "
                    "%s (spec.privacy.targetEpsilon).",
                    round_,
                    stop.epsilon_next,
                    stop.target,
                )
                self.events.emit(
                    "budget", round=round_, epsilon_next=stop.epsilon_next, target=stop.target
                )
                break
            started = time.monotonic()
            result = self._run_round(round_)
            completed = round_
            evaluation = (
                self._reported_evaluation(result)
                if self.facts.decentralized
                else self._maybe_evaluate(round_)
            )
            if evaluation:
                last_eval = evaluation
            seconds = time.monotonic() - started
            self._record_round(round_, result, evaluation, seconds)
            self._maybe_checkpoint(round_)
            self.hold.after_round(round_)
        if stop_reason is not None and completed >= start_round:
            if not self.facts.decentralized:  # its clients evaluate themselves
                last_eval = self._evaluate(completed)
            self._maybe_checkpoint(completed, force=True)
        if not last_eval and not self.facts.decentralized:
            last_eval = self._evaluate(completed)
        self._release_model()
        summary: dict[str, Any] = {
            "phase": "Succeeded",
            "rounds": spec.rounds,
            "rounds_completed": completed,
            "reason": stop_reason or "RoundsCompleted",
            "accuracy": last_eval.get("accuracy"),
            "loss": last_eval.get("loss"),
            **{
                key: last_eval[key]
                for key in ("server_accuracy", "server_loss", "evaluated_examples", "per_class")
                if key in last_eval
            },
            "epsilon": self.privacy.epsilon(),
            "epsilon_claim": self.privacy.claim() or None,
            "bytes_sent": self.metrics.traffic()[0],
            "bytes_received": self.metrics.traffic()[1],
        }
        self.events.emit("finished", **summary)
        self.board.finish(time.monotonic() + GOODBYE_SECONDS)
        return summary

    def _run_round(self, round_: int) -> dict[str, Any]:
        """Plays one round (``fedcore.rounds``) over the clients' sessions."""
        timeout = self.spec.failure_policy.round_timeout_seconds
        times = {"opened": 0.0, "settled": 0.0}

        def run_stage(
            round_: int, number: int, stage: int, plans: Mapping[int, Payload]
        ) -> AttemptReport:
            if number > 1 and stage == 0:
                self.metrics.redone_rounds.inc()
            # A later stage carries a protocol's own messages: exact, never compressed.
            compress = (
                functools.partial(
                    compress_tensors, self.spec, "broadcasts", round=round_, attempt=number
                )
                if stage == 0
                else None
            )
            # A redo exists to reach the quorum: it waits for dropped clients to reconnect.
            self.board.open_attempt(
                Attempt(
                    round_,
                    number,
                    plans,
                    stage=stage,
                    spec_digest=self.spec_digest,
                    compress=compress,
                ),
                wait_for_absent=number > 1 and stage == 0,
            )
            opened = time.monotonic()
            if stage == 0:
                times["opened"] = opened
            attempt = self.without_revoked(
                self.board.wait_settled(
                    opened + timeout, stop_on_failure=self.round_policy.stop_on_failure
                )
            )
            times["settled"] = time.monotonic()
            if self.storage_failure is not None:
                raise self.storage_failure
            self.rpc.drop_spare()  # the bytes kept for the next upload: not through combine
            report = AttemptReport(dict(attempt.uploads), dict(attempt.failed))
            if report.failed:
                self.metrics.dropouts.inc(len(report.failed))
                log.warning(
                    "Round %d attempt %d%s: clients %s failed (%s).",
                    round_,
                    number,
                    f" stage {stage}" if stage else "",
                    report.failures,
                    ", ".join(sorted(set(report.failed.values()))),
                )
            self.hold.after_stage(round_, stage)
            return report

        def run_attempt(round_: int, number: int, plans: Mapping[int, Payload]) -> AttemptReport:
            return play_stages(self.protocol, round_, number, plans, run_stage)

        outcome = play_round(round_, self.round_policy, self.protocol, run_attempt, self.privacy)
        self.board.release_attempt()
        trim(self.model_bytes)  # the last model's pages, freed on the C heap, back to the system
        result = outcome.result
        refused = {} if result is None else result.refused
        for index, why in sorted(refused.items()):
            self._count_refused(index, round_, why)
        return {
            "participants": outcome.participants - len(refused),
            "failures": sorted({*outcome.report.failures, *refused}),
            "train_loss": None if result is None else result.train_loss,
            "metrics": {} if result is None else result.metrics,
            "attempts": outcome.attempts,
            "wait_seconds": times["settled"] - times["opened"],
            "combine_seconds": time.monotonic() - times["settled"],
            "epsilon": outcome.epsilon,
        }

    def _maybe_evaluate(self, round_: int) -> dict[str, Any]:
        every = self.spec.evaluation.every_rounds
        if round_ == self.spec.rounds or (every and round_ % every == 0):
            return self._evaluate(round_)
        return {}

    def _reported_evaluation(self, result: dict[str, Any]) -> dict[str, float]:
        """A decentralized round's evaluation: the clients' own, reported as scalars."""
        metrics = result.get("metrics") or {}
        found = {k: float(metrics[k]) for k in ("accuracy", "loss") if k in metrics}
        if "accuracy" in found:
            self.metrics.accuracy.set(found["accuracy"])
        if "loss" in found:
            self.metrics.loss.set(found["loss"])
        return found

    def _evaluate(self, round_: int) -> dict[str, Any]:
        """Scores the models where spec.evaluation.where says: on the server's held-out split,
        on the clients' own (their counts summed), or both (the clients' is the run's)."""
        found: dict[str, Any] = {}
        if self.evaluator is not None:
            result = self.evaluator.evaluate_models(
                self.protocol.models(), self.spec.data.clusters.count
            )
            found = {"accuracy": result.accuracy, "loss": result.loss}
        if self.where != "Server":
            if found:
                found = {"server_accuracy": found["accuracy"], "server_loss": found["loss"]}
            score = self._evaluate_on_clients(round_)
            if score is not None:
                found.update(score.metrics())
        if "accuracy" in found:
            self.metrics.accuracy.set(found["accuracy"])
            self.metrics.loss.set(found["loss"])
        return found

    def _evaluate_on_clients(self, round_: int) -> FederatedScore | None:
        """Asks every connected client to score the models on its held-out examples and sums
        the answers that come within spec.failurePolicy.roundTimeoutSeconds (None if none
        does: the round then reports no accuracy)."""
        request = evaluation_request(self.protocol.models(), self.spec.evaluation.per_class)
        plans = dict.fromkeys(range(self.spec.clients.count), request)
        self.board.open_attempt(
            Attempt(round_, EVALUATION_ATTEMPT, plans, spec_digest=self.spec_digest),
            wait_for_absent=False,
        )
        deadline = time.monotonic() + self.spec.failure_policy.round_timeout_seconds
        attempt = self.without_revoked(self.board.wait_settled(deadline))
        per_class = self.spec.evaluation.per_class
        answers = [
            checked_answer(upload.meta, self.num_classes, per_class)
            for _, upload in sorted(attempt.uploads.items())
        ]
        missing = sorted(attempt.failed)
        if missing:
            log.warning(
                "Round %d's evaluation: clients %s did not answer (%s); the result is over the "
                "%d that did.",
                round_,
                missing,
                ", ".join(sorted(set(attempt.failed.values()))),
                len(answers),
            )
        if not answers:
            return None
        return summed(answers)

    def _record_round(
        self, round_: int, result: dict[str, Any], evaluation: dict[str, float], seconds: float
    ) -> None:
        self.metrics.rounds_completed.inc()
        self.metrics.round.set(round_)
        self.metrics.round_duration.observe(seconds)
        self.metrics.participants.set(result["participants"])
        entry = {"round": round_, "seconds": seconds, **result, **evaluation}
        self.history.append(entry)
        self.events.emit("round", rounds=self.spec.rounds, **entry)

    # ------------------------------------------------------------------- checkpoints

    def _checkpointer(self) -> Checkpointer | None:
        return role_checkpointer(
            self.run,
            self.config,
            resume=self.resume,
            on_failure=self.metrics.checkpoint_failures.inc,
            # The key that signs the checkpoints: FEDCORE_CHECKPOINT_KEY_FILE or
            # <workdir>/keys/checkpoint.key, read (or made) only when checkpoints are on.
            factory=lambda store, spec, **ids: server_checkpointer(
                store, spec, key=server_checkpoint_key(self.config.workdir), **ids
            ),
        )

    def _check_store(self) -> None:
        """Fails the run before round 1 when the checkpoint store cannot be used."""
        store = None if self.checkpointer is None else self.checkpointer.store
        if store is not None and self.checkpointer is not None:
            try:
                store.check()
                self.checkpointer.sweep()  # what a killed writer left (this server writes alone)
            except CheckpointError as exc:
                raise RunAborted(
                    f"The checkpoint store cannot be used, so the run does not start: {exc}",
                    reason="CheckpointFailed",
                    round=0,
                ) from exc
        if self.checkpointer is not None and not self.resume:
            try:
                existing = self.checkpointer.rounds()
            except CheckpointError:
                existing = []
            if existing:
                log.warning(
                    "%s already holds checkpoints of rounds %s; this run starts at round 1 and "
                    "writes over them (`fedcore checkpoint purge` clears them; --resume "
                    "continues from them).",
                    self.checkpointer.store.describe(),
                    existing,
                )

    def _maybe_checkpoint(self, round_: int, *, force: bool = False) -> None:
        every = self.spec.checkpoint.every_rounds
        if self.checkpointer is None or not every:
            return
        if round_ % every and round_ != self.spec.rounds and not force:
            return
        state = {
            "round": round_,
            "protocol": self.protocol.state_dict(),
            "privacy": self.privacy.state_dict(),
            "history": self.history,
        }
        started = time.monotonic()
        try:
            info = self.checkpointer.save(round_, state)
        except CheckpointShortOfSpace as exc:
            self.metrics.checkpoint_failures.inc()
            if self.spec.checkpoint.when_short_of_space == "Fail":
                raise RunAborted(
                    f"The checkpoint of round {round_} failed: {exc} "
                    f"(spec.checkpoint.whenShortOfSpace is Fail).",
                    reason="CheckpointFailed",
                    round=round_,
                ) from exc
            log.warning(
                "%s Left out (spec.checkpoint.whenShortOfSpace Skip); the next checkpoint tries "
                "again.",
                exc,
            )
            self.events.emit("checkpoint_skipped", round=round_, needed=exc.needed, free=exc.free)
            return
        except CheckpointError as exc:
            self.metrics.checkpoint_failures.inc()
            raise RunAborted(
                f"The checkpoint of round {round_} failed: {exc}",
                reason="CheckpointFailed",
                round=round_,
            ) from exc
        self.metrics.checkpoint_duration.observe(time.monotonic() - started)
        self.events.emit("checkpoint", round=round_, location=info.location, bytes=info.bytes)

    def _restore(self) -> int:
        """Loads the latest good checkpoint when resuming; returns its round (0: none)."""
        if self.resume and self.checkpointer is None and self.require_checkpoint:
            raise RunAborted(
                "This run keeps no checkpoints (spec.checkpoint.everyRounds is 0), so there is "
                "nothing to resume from. Run without --resume.",
                reason="NoCheckpoint",
                round=0,
            )
        if not self.resume or self.checkpointer is None:
            return 0
        try:
            found = self.checkpointer.load_latest()
        except CheckpointError as exc:  # tampered, unsigned, missing: refused, never skipped
            raise RunAborted(f"Cannot resume: {exc}", reason="CheckpointInvalid", round=0) from exc
        if found is None:
            if self.require_checkpoint:
                raise RunAborted(
                    f"There is no checkpoint to resume from in "
                    f"{self.checkpointer.store.describe()} (no checkpoint folder, no latest "
                    f"record). Run without --resume to start at round 1, or with "
                    f"--resume-if-possible to resume when there is one.",
                    reason="NoCheckpoint",
                    round=0,
                )
            log.warning(
                "No usable checkpoint in %s; starting from round 1.",
                self.checkpointer.store.describe(),
            )
            return 0
        round_, state = found
        try:
            self.protocol.load_state_dict(state["protocol"])
            self.privacy.load_state_dict(state["privacy"])
        except (KeyError, ValueError) as exc:
            raise RunAborted(
                f"The checkpoint of round {round_} cannot be restored: {exc}",
                reason="CheckpointInvalid",
                round=round_,
            ) from exc
        self.history = list(state.get("history", []))
        self.events.emit("resumed", round=round_)
        log.info("Resumed from the checkpoint of round %d.", round_)
        return int(round_)

    def _release_model(self) -> None:
        if not self.spec.evaluation.release_final_model or self.facts.decentralized:
            return  # a decentralized run's clients release their own models
        path = self.config.workdir / "model.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        TensorFile.of(self.protocol.global_weights()).write(path)
        models = self.protocol.models()
        for j, weights in enumerate(models if len(models) > 1 else []):
            TensorFile.of(weights).write(path.with_name(f"model-cluster-{j}.safetensors"))

    def _setup_protocol(self) -> None:
        """Gives the protocol its KDC channel (after any restore).

        Raises:
            RunAborted: the protocol could not set up (e.g. the KDC is unreachable).
        """
        channel = None if self.kdc is None else RpcKeyChannel(self.kdc)
        try:
            self.protocol.setup(channel)
        except ProtocolError as exc:
            raise RunAborted(
                f"The protocol could not set up: {exc}", reason="ProtocolFailed"
            ) from exc


def run_server(
    config: RoleConfig,
    *,
    listen: str,
    resume: bool,
    kdc: str | None = None,
    require_checkpoint: bool = False,
    memory_bytes: int | None = None,
) -> dict[str, Any]:
    """The ``fedcore server`` entry point: serves one run to its end."""
    run, tls = config.load()
    settle_role_process(config.threads)
    server = Server(
        run,
        config,
        tls,
        listen=listen,
        resume=resume,
        kdc=kdc,
        require_checkpoint=require_checkpoint,
        memory_bytes=memory_bytes,
    )
    try:
        return server.serve()
    finally:
        server.events.close()
        if server.kdc is not None:
            server.kdc.close()


def _client_words(message: Payload, *, default: str) -> tuple[str, str]:
    """A client's ``reason`` (64 characters at most, else ``default``) and ``message`` (1000)
    as single printable lines: a client's words go into the log, the events and the run's
    failure."""
    reason, text = (
        "".join(c if c.isprintable() else " " for c in str(message.meta.get(key) or ""))
        for key in ("reason", "message")
    )
    return reason[:64] or default, text[:1000]


def _round_of(message: Payload) -> int | None:
    """The round a client's message names, when it is an integer (None otherwise)."""
    round_ = message.meta.get("round")
    return round_ if isinstance(round_, int) and not isinstance(round_, bool) else None

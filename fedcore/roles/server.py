"""The server role: plan, fan out, sort, combine, evaluate, checkpoint, report; every round.

The round loop runs in the main thread; gRPC handlers (Join, Pull, Push, Presence) run in the
RPC server's threads and meet the loop on a ``RoundBoard``. The server knows nothing of any
protocol's maths: it calls the protocol's hooks and applies its dropout policy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.numpy import save_file

from fedcore.checkpoint import Checkpointer, LocalObjectStore
from fedcore.data import dataset_info, test_dataset
from fedcore.errors import CheckpointError, MessageRejected, ProtocolError, RunAborted
from fedcore.metrics import RoleMetrics
from fedcore.models import build_model, get_weights
from fedcore.protocols import ServerProtocol, create_protocol
from fedcore.roles._common import (
    SERVER_SERVICE,
    RoleConfig,
    choose_device,
    limit_threads,
    limits_of,
    spec_fingerprint,
)
from fedcore.roles._events import EventLog
from fedcore.sampling import sample_clients
from fedcore.spec import FederatedRun, protocol_facts
from fedcore.training import Evaluator
from fedcore.transport import CallContext, Identity, Payload, RpcServer

log = logging.getLogger(__name__)

PULL_WAIT_SECONDS = 20.0
"""The longest a Pull waits for work before answering "wait" (the client then pulls again)."""
GOODBYE_SECONDS = 10.0
"""How long the server waits at the end for every present client to hear "done"."""


@dataclass
class Attempt:
    """One try at a round: who was asked, what came back, who failed and why."""

    round: int
    attempt: int
    plans: Mapping[int, Payload]
    uploads: dict[int, Payload] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)

    def settled(self) -> bool:
        """Whether every planned client has uploaded or failed."""
        return len(self.uploads) + len(self.failed) >= len(self.plans)


class RoundBoard:
    """The hand-off between the round loop and the RPC handlers (all access under one lock)."""

    def __init__(self, client_count: int) -> None:
        self.client_count = client_count
        self.cond = threading.Condition()
        self.joined: set[int] = set()
        self.present: set[int] = set()
        self.said_goodbye: set[int] = set()
        self.current: Attempt | None = None
        self.done = False

    def open_attempt(self, attempt: Attempt) -> None:
        """Publishes a new attempt; clients absent now fail it at once."""
        with self.cond:
            for client in attempt.plans:
                if client not in self.present:
                    attempt.failed[client] = "absent"
            self.current = attempt
            self.cond.notify_all()

    def wait_settled(self, deadline: float) -> Attempt:
        """Blocks until the current attempt is settled or ``deadline`` passes."""
        with self.cond:
            attempt = self.current
            assert attempt is not None
            while not attempt.settled():
                left = deadline - time.monotonic()
                if left <= 0:
                    for client in attempt.plans:
                        if client not in attempt.uploads and client not in attempt.failed:
                            attempt.failed[client] = "timeout"
                    break
                self.cond.wait(left)
            self.current = None
            return attempt

    def wait_joined(self, count: int, deadline: float) -> int:
        """Blocks until ``count`` clients are present or ``deadline``; returns how many are."""
        with self.cond:
            while len(self.present) < count and time.monotonic() < deadline:
                self.cond.wait(max(0.0, deadline - time.monotonic()))
            return len(self.present)

    def finish(self, deadline: float) -> None:
        """Tells every client the run is over and waits (bounded) for them to hear it."""
        with self.cond:
            self.done = True
            self.cond.notify_all()
            while (self.present - self.said_goodbye) and time.monotonic() < deadline:
                self.cond.wait(max(0.0, deadline - time.monotonic()))


class Server:
    """The server role of one run.

    Args:
        run: the validated manifest.
        config: how this process was started.
        listen: the ``host:port`` to serve on.
        resume: whether to start from the latest checkpoint.
    """

    def __init__(self, run: FederatedRun, config: RoleConfig, tls: Any, *, listen: str,
                 resume: bool) -> None:
        self.run = run
        self.spec = run.spec
        self.config = config
        self.resume = resume
        self.facts = protocol_facts(self.spec.protocol.name)
        self.events = EventLog(config.events)
        self.metrics = RoleMetrics(run.metadata.name, "server")
        device = choose_device(self.spec.roles.server)
        input_shape, num_classes = dataset_info(self.spec)
        model = build_model(self.spec.model, input_shape, num_classes, seed=self.spec.seed)
        self.protocol: ServerProtocol = create_protocol(self.spec.protocol.name).create_server(
            self.spec, get_weights(model)
        )
        self.evaluator = Evaluator(model.to(device), test_dataset(self.spec), self.spec.training,
                                   device=device)
        self.checkpointer = self._checkpointer()
        self.board = RoundBoard(self.spec.clients.count)
        self.history: list[dict[str, Any]] = []
        self.rpc = RpcServer(
            listen,
            tls,
            {"Join": self._join, "Pull": self._pull, "Push": self._push,
             "Presence": self._presence},
            service=SERVER_SERVICE,
            limits=limits_of(self.spec),
            max_workers=2 * self.spec.clients.count + 8,
            on_rejected=lambda method, reason: self.metrics.rejected(reason),
            on_bytes=self.metrics.count_bytes,
        )

    # ------------------------------------------------------------------------- handlers

    def _client_index(self, peer: Identity) -> int:
        if peer.role != "client" or peer.index is None or peer.index >= self.spec.clients.count:
            raise PermissionError(f"{peer.common_name!r} is not a client of this run.")
        return peer.index

    def _join(self, peer: Identity, request: Payload, ctx: CallContext) -> Payload:
        index = self._client_index(peer)
        with self.board.cond:
            self.board.joined.add(index)
        log.info("Client %d joined.", index)
        return Payload(meta={"run": self.run.metadata.name, "rounds": self.spec.rounds,
                             "clients": self.spec.clients.count})

    def _presence(self, peer: Identity, request: Payload, ctx: CallContext) -> Payload:
        """Held open by each client for the whole run; its end means the client is gone."""
        index = self._client_index(peer)
        board = self.board
        with board.cond:
            board.present.add(index)
            board.cond.notify_all()
        try:
            with board.cond:
                while not board.done and ctx.is_active():
                    board.cond.wait(1.0)
        finally:
            with board.cond:
                board.present.discard(index)
                attempt = board.current
                if (not board.done and attempt is not None and index in attempt.plans
                        and index not in attempt.uploads):
                    attempt.failed.setdefault(index, "disconnected")
                board.cond.notify_all()
        return Payload(meta={"kind": "done"})

    def _pull(self, peer: Identity, request: Payload, ctx: CallContext) -> Payload:
        """Long-polls for this client's next task after (round, attempt) it last handled."""
        index = self._client_index(peer)
        after = (int(request.meta.get("round", 0)), int(request.meta.get("attempt", 0)))
        remaining = ctx.time_remaining()
        wait = PULL_WAIT_SECONDS if remaining is None else max(0.0, min(PULL_WAIT_SECONDS,
                                                                          remaining - 1.0))
        deadline = time.monotonic() + wait
        board = self.board
        with board.cond:
            while True:
                if board.done:
                    board.said_goodbye.add(index)
                    board.cond.notify_all()
                    return Payload(meta={"kind": "done"})
                attempt = board.current
                if (attempt is not None and index in attempt.plans
                        and (attempt.round, attempt.attempt) > after
                        and index not in attempt.failed and index not in attempt.uploads):
                    plan = attempt.plans[index]
                    return Payload(
                        meta={"kind": "task", "round": attempt.round, "attempt": attempt.attempt,
                              "instruction": plan.meta},
                        tensors=plan.tensors,
                    )
                left = deadline - time.monotonic()
                if left <= 0 or not ctx.is_active():
                    return Payload(meta={"kind": "wait"})
                board.cond.wait(left)

    def _push(self, peer: Identity, request: Payload, ctx: CallContext) -> Payload:
        """Accepts one upload for the current attempt (duplicates are acknowledged, not redone)."""
        index = self._client_index(peer)
        round_, attempt_no = request.meta.get("round"), request.meta.get("attempt")
        upload = Payload(meta=dict(request.meta.get("upload") or {}), tensors=request.tensors)
        board = self.board
        with board.cond:
            attempt = board.current
            if attempt is None or (attempt.round, attempt.attempt) != (round_, attempt_no) \
                    or index not in attempt.plans:
                self.metrics.rejected("stale")
                return Payload(meta={"status": "stale"})
            if index in attempt.uploads:
                return Payload(meta={"status": "duplicate"})
            if index in attempt.failed:
                self.metrics.rejected("stale")
                return Payload(meta={"status": "stale"})
        try:
            self.protocol.check_upload(attempt.round, index, upload)
        except ProtocolError as exc:
            with board.cond:
                if board.current is attempt:
                    attempt.failed[index] = "rejected"
                    board.cond.notify_all()
            self.metrics.rejected("upload")
            log.warning("Refused the upload of client %d in round %d: %s", index, attempt.round,
                        exc)
            raise MessageRejected(str(exc)) from exc
        with board.cond:
            if board.current is attempt and index not in attempt.failed:
                attempt.uploads[index] = upload
                board.cond.notify_all()
                return Payload(meta={"status": "accepted"})
        self.metrics.rejected("stale")
        return Payload(meta={"status": "stale"})

    # ----------------------------------------------------------------------- round loop

    def serve(self) -> dict[str, Any]:
        """Runs every round and returns the final summary.

        Raises:
            RunAborted: the quorum was lost, a checkpoint failed, or no client came.
        """
        self.metrics.serve(self.config.metrics_port, self.config.metrics_address)
        start_round = self._restore() + 1
        self.rpc.start()
        self.events.emit("ready", role="server", port=self.rpc.port, start_round=start_round)
        try:
            summary = self._rounds(start_round)
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
        joined = self.board.wait_joined(count, time.monotonic() + policy.connect_timeout_seconds)
        if joined == 0:
            raise RunAborted(
                f"No client connected within {policy.connect_timeout_seconds} s "
                f"(spec.failurePolicy.connectTimeoutSeconds).",
                reason="NoClients", round=start_round,
            )
        last_eval: dict[str, float] = {}
        for round_ in range(start_round, spec.rounds + 1):
            started = time.monotonic()
            result = self._run_round(round_)
            evaluation = self._maybe_evaluate(round_)
            if evaluation:
                last_eval = evaluation
            seconds = time.monotonic() - started
            self._record_round(round_, result, evaluation, seconds)
            self._maybe_checkpoint(round_)
        if not last_eval:
            last_eval = self._evaluate()
        self._release_model()
        summary = {
            "phase": "Succeeded",
            "rounds": spec.rounds,
            "accuracy": last_eval.get("accuracy"),
            "loss": last_eval.get("loss"),
        }
        self.events.emit("finished", **summary)
        self.board.finish(time.monotonic() + GOODBYE_SECONDS)
        return summary

    def _run_round(self, round_: int) -> dict[str, Any]:
        spec = self.spec
        sampled = sample_clients(spec.clients, seed=spec.seed, round=round_)
        quorum = spec.clients.quorum_of(len(sampled))
        clients = sampled
        for attempt_no in range(spec.failure_policy.max_round_retries + 1):
            if attempt_no:
                self.metrics.redone_rounds.inc()
            plans = self.protocol.plan_round(round_, clients)
            attempt = Attempt(round_, attempt_no + 1, plans)
            self.board.open_attempt(attempt)
            attempt = self.board.wait_settled(
                time.monotonic() + spec.failure_policy.round_timeout_seconds)
            failures = sorted(attempt.failed)
            if failures:
                self.metrics.dropouts.inc(len(failures))
                log.warning("Round %d attempt %d: clients %s failed (%s).", round_, attempt_no + 1,
                            failures, ", ".join(sorted(set(attempt.failed.values()))))
            if len(attempt.uploads) >= quorum:
                if not failures or self.facts.dropout_policy == "Skip":
                    result = self.protocol.combine(round_, attempt.uploads, failures)
                    return {"participants": len(attempt.uploads), "failures": failures,
                            "train_loss": None if result is None else result.train_loss,
                            "metrics": {} if result is None else result.metrics,
                            "attempts": attempt_no + 1}
                if self.facts.dropout_policy == "Fail":
                    break
                clients = sorted(attempt.uploads)  # Redo: again, without the failed clients
            else:
                clients = sampled
        raise RunAborted(
            f"Round {round_} got fewer than its quorum of {quorum} uploads after "
            f"{spec.failure_policy.max_round_retries + 1} attempts (spec.clients.quorum, "
            f"spec.failurePolicy.maxRoundRetries).",
            reason="QuorumLost", round=round_,
        )

    def _maybe_evaluate(self, round_: int) -> dict[str, float]:
        every = self.spec.evaluation.every_rounds
        if round_ == self.spec.rounds or (every and round_ % every == 0):
            return self._evaluate()
        return {}

    def _evaluate(self) -> dict[str, float]:
        result = self.evaluator.evaluate(self.protocol.global_weights())
        self.metrics.accuracy.set(result.accuracy)
        self.metrics.loss.set(result.loss)
        return {"accuracy": result.accuracy, "loss": result.loss}

    def _record_round(self, round_: int, result: dict[str, Any], evaluation: dict[str, float],
                      seconds: float) -> None:
        self.metrics.rounds_completed.inc()
        self.metrics.round.set(round_)
        self.metrics.round_duration.observe(seconds)
        self.metrics.participants.set(result["participants"])
        entry = {"round": round_, "seconds": seconds, **result, **evaluation}
        self.history.append(entry)
        self.events.emit("round", rounds=self.spec.rounds, **entry)

    # ------------------------------------------------------------------- checkpoints

    def _checkpointer(self) -> Checkpointer | None:
        spec = self.spec.checkpoint
        if spec.every_rounds == 0 and not self.resume:
            return None
        path = Path(spec.local.path.replace("{name}", self.run.metadata.name))
        if not path.is_absolute():
            path = self.config.workdir / path if self.config.workdir else path
        return Checkpointer(LocalObjectStore(path), run=self.run.metadata.name,
                            fingerprint=spec_fingerprint(self.run), keep_last=spec.keep_last)

    def _maybe_checkpoint(self, round_: int) -> None:
        every = self.spec.checkpoint.every_rounds
        if self.checkpointer is None or not every:
            return
        if round_ % every and round_ != self.spec.rounds:
            return
        state = {"round": round_, "protocol": self.protocol.state_dict(),
                 "history": self.history}
        started = time.monotonic()
        try:
            info = self.checkpointer.save(round_, state)
        except CheckpointError as exc:
            self.metrics.checkpoint_failures.inc()
            raise RunAborted(f"The checkpoint of round {round_} failed: {exc}",
                             reason="CheckpointFailed", round=round_) from exc
        self.metrics.checkpoint_duration.observe(time.monotonic() - started)
        self.events.emit("checkpoint", round=round_, location=info.location, bytes=info.bytes)

    def _restore(self) -> int:
        """Loads the latest good checkpoint when resuming; returns its round (0: none)."""
        if not self.resume or self.checkpointer is None:
            return 0
        found = self.checkpointer.load_latest()
        if found is None:
            log.warning("No usable checkpoint in %s; starting from round 1.",
                        self.checkpointer.store.describe())
            return 0
        round_, state = found
        try:
            self.protocol.load_state_dict(state["protocol"])
        except (KeyError, ValueError) as exc:
            raise RunAborted(f"The checkpoint of round {round_} cannot be restored: {exc}",
                             reason="CheckpointInvalid", round=round_) from exc
        self.history = list(state.get("history", []))
        self.events.emit("resumed", round=round_)
        log.info("Resumed from the checkpoint of round %d.", round_)
        return int(round_)

    def _release_model(self) -> None:
        if not self.spec.evaluation.release_final_model:
            return
        path = self.config.workdir / "model.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({k: v for k, v in self.protocol.global_weights().items()}, str(tmp))
        tmp.replace(path)


def run_server(config: RoleConfig, *, listen: str, resume: bool) -> dict[str, Any]:
    """The ``fedcore server`` entry point: serves one run to its end."""
    run, tls = config.load()
    limit_threads(config.threads)
    return Server(run, config, tls, listen=listen, resume=resume).serve()

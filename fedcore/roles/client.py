"""The client role: hold one session with the server; compute an upload for each task."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from torch import nn

from fedcore.errors import FedcoreError, MessageRejected, ProtocolError
from fedcore.learning.data import client_dataset, client_test_dataset
from fedcore.learning.evaluation import (
    answer_meta,
    is_evaluation,
    requested_models,
    score,
)
from fedcore.learning.models import build_model
from fedcore.learning.poisoning import attack_of, misreport_evaluation, overflow_upload
from fedcore.learning.training import Evaluator, LocalLearner
from fedcore.observe.metrics import RoleMetrics
from fedcore.protocols import ClientProtocol, KeyChannel, create_protocol
from fedcore.protocols._compressed import META_KEY as COMPRESSION_KEY
from fedcore.protocols._compressed import compress_tensors, decompress_tensors
from fedcore.roles._common import (
    KDC_SERVICE,
    SERVER_SERVICE,
    RoleConfig,
    choose_device,
    limits_of,
    parameters_of,
    retry_of,
    settle_role_process,
)
from fedcore.roles._peer_duties import PeerDuties, PeerSettings
from fedcore.sites.binding import SiteBinding
from fedcore.sites.policy import RoundGuard, SiteRefused
from fedcore.spec import FederatedRun, protocol_facts
from fedcore.transport import (
    AsyncClientSession,
    AsyncRpcClient,
    Identity,
    Payload,
    RemoteError,
    RpcClient,
    TlsBundle,
    Turn,
)

log = logging.getLogger(__name__)

GOODBYE_SECONDS = 10.0
"""How long a client that refuses a task waits for the server to have heard it."""
CALL_SECONDS = 120.0
"""Deadline of one Join or Push attempt (uploads of several GB need minutes)."""
RECONNECT_CODES = frozenset(
    {"UNAVAILABLE", "CANCELLED", "UNKNOWN", "INTERNAL", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}
)
"""Session endings a client reconnects after (with backoff): the server went away, was busy
(RESOURCE_EXHAUSTED: this identity's call slots were still held by a dead session) or ended a
session whose hello it did not get in time."""


class Client:
    """The client role of one run.

    Args:
        run: the validated manifest.
        config: how this process was started.
        tls: this client's bundle.
        index: this client's index (its certificate must say the same).
        server: ``host:port`` of the server.
        kdc: ``host:port`` of the KDC, for protocols that need one.
        peers: where to serve and find peer links (decentralized protocols only).
        compute_lock: held while the model is built and while an upload is computed. Clients
            that share a process (``run_client_group``) share one, so that torch's global
            state (its RNG, forked and reseeded per training call) is never used by two at
            once: each computes exactly what it would in a process of its own.
        guard: a site's check of every task against its approval (a site's client): a task
            it refuses is answered ``refused`` with the reason, and the client stops.
        tls_dir: where ``tls`` was read from, re-read before each new session to the server
            (a site renews its clients' certificates at half their life, while they run);
            None: the bundle given is used to the end.
        model: the network, built from this spec by another client of the same process
            (``run_client_group``), which computes one at a time under the same
            ``compute_lock``: every call loads the weights it is given, so clients can share
            one model's memory. None: built here.
        turn: shared by the clients of a group: one of them at a time reads a large message
            and holds its decoded bytes until it has answered it, and the next large task is
            written into the bytes of the last one trained in (``Turn``). None: one of its own.
    """

    def __init__(
        self,
        run: FederatedRun,
        config: RoleConfig,
        tls: TlsBundle,
        *,
        index: int,
        server: str,
        kdc: str | None = None,
        peers: PeerSettings | None = None,
        compute_lock: AbstractContextManager[Any] | None = None,
        guard: RoundGuard | None = None,
        tls_dir: Path | None = None,
        model: nn.Module | None = None,
        turn: Turn | None = None,
    ) -> None:
        spec = run.spec
        self.turn = turn or Turn()
        self.guard = guard
        self.tls = tls
        self.tls_dir = tls_dir
        if not 0 <= index < spec.clients.count:
            raise FedcoreError(
                f"Client index {index} is outside 0..{spec.clients.count - 1} (spec.clients.count)."
            )
        if tls.identity != Identity("client", index):
            raise FedcoreError(
                f"This client was started as client {index} but its certificate names "
                f"{tls.identity.common_name!r}; the index (--index, FEDCORE_CLIENT_INDEX) and "
                f"the certificate (--tls-dir) must belong together."
            )
        self.run = run
        self.spec = spec
        self.index = index
        self.overflow = attack_of(spec, index) == "Overflow"
        self.config = config
        self.compute_lock = compute_lock or contextlib.nullcontext()
        self.metrics = RoleMetrics(run.metadata.name, "client")
        device = choose_device(spec.roles.clients)
        with self.compute_lock:
            data = client_dataset(spec, index)
            if model is None:
                model = build_model(spec.model, data.input_shape, data.num_classes, seed=spec.seed)
            self.learner = LocalLearner(
                model.to(device),
                data,
                spec.training,
                seed=spec.seed,
                client_index=index,
                device=device,
                in_place=True,  # a task's decoded arrays are this client's own
            )
            # What the server asks it to score (spec.evaluation.where Clients or Both): the
            # models it holds anyway, on its own held-out examples.
            self.evaluator: Evaluator | None = None
            facts = protocol_facts(spec.protocol.name)
            if spec.evaluation_where != "Server" and not facts.decentralized:
                self.evaluator = Evaluator(
                    model,
                    client_test_dataset(spec, index),
                    spec.training,
                    device=device,
                    allow_empty=True,
                )
        self.protocol: ClientProtocol = create_protocol(spec.protocol.name).create_client(
            spec, index
        )
        limits = limits_of(spec, parameters_of(model))
        retry = retry_of(spec)
        self.retry = retry
        self.duties: PeerDuties | None = None
        if protocol_facts(spec.protocol.name).decentralized:
            self.duties = PeerDuties(
                run,
                config,
                tls,
                index=index,
                protocol=self.protocol,
                settings=peers,
                metrics=self.metrics,
                limits=limits,
                retry=retry,
                device=device,
            )
        if protocol_facts(spec.protocol.name).needs_kdc and kdc is None:
            raise FedcoreError(f"Protocol {spec.protocol.name!r} needs a KDC: pass --kdc.")
        self._links = (server, kdc, limits)
        self.kdc = self._connect(tls)

    def _connect(self, tls: TlsBundle) -> RpcClient | None:
        """The channel to the KDC, for protocols that need one, with ``tls``."""
        _, kdc, limits = self._links
        if not (protocol_facts(self.spec.protocol.name).needs_kdc and kdc is not None):
            return None
        return RpcClient(
            kdc,
            tls=tls,
            limits=limits,
            retry=self.retry,
            on_bytes=self.metrics.count_bytes,
            service=KDC_SERVICE,
            peer=Identity("kdc"),
        )

    def _server_link(self) -> AsyncRpcClient:
        """A channel to the server with the current bundle (inside the event loop)."""
        server, _, limits = self._links
        return AsyncRpcClient(
            server,
            self.tls,
            service=SERVER_SERVICE,
            limits=limits,
            peer=Identity("server"),
            on_bytes=self.metrics.count_bytes,
        )

    def _refresh_identity(self) -> bool:
        """Before a new session: takes up a renewed certificate in ``tls_dir`` (a new KDC
        channel; sessions on the old ones have ended). Returns whether it did."""
        if self.tls_dir is None:
            return False
        fresh = self.tls.renewed(self.tls_dir)
        if fresh is None:
            return False
        log.info("Using this client's renewed certificate from now on.")
        if self.kdc is not None:
            self.kdc.close()
        self.tls = fresh
        self.protocol.set_identity(fresh)
        self.kdc = self._connect(fresh)
        return True

    def serve(self) -> dict[str, Any]:
        """Takes part in rounds until the server says the run is over; returns a summary
        (``serve_async`` on an event loop of its own)."""
        return asyncio.run(self.serve_async())

    async def serve_async(self) -> dict[str, Any]:
        """Takes part in rounds until the server says the run is over; returns a summary.

        The session and its messages are served on the running event loop; an upload is
        computed on the loop's thread (clients that share a loop compute one at a time).
        A broken session is reopened with backoff (within spec.failurePolicy's
        connectTimeoutSeconds); the server then resends a task still pending for us.

        Raises:
            RemoteError: the server refused us or stayed unreachable.
        """
        self.metrics.serve(self.config.metrics_port, self.config.metrics_address)
        self.protocol.setup(None if self.kdc is None else RpcKeyChannel(lambda: self.kdc))
        self.protocol.set_identity(self.tls)
        if self.duties is not None:
            self.duties.start()
        jitter = random.Random()  # seeded from the OS once: a seed costs a read of urandom
        delays = self.retry.delays(jitter)
        last = (0, 0)
        rounds = 0
        connected = False
        link = self._server_link()
        try:
            while True:
                if self._refresh_identity():
                    await link.close()
                    link = self._server_link()
                session = link.open_session("Session", turn=self.turn)
                try:
                    await session.send(
                        Payload(meta={"kind": "hello", "round": last[0], "attempt": last[1]})
                    )
                    done_with_bytes = False
                    while True:
                        message = instruction = None  # a large task's bytes go before the next
                        session.answered(done_with_bytes=done_with_bytes)
                        done_with_bytes = False
                        message = await session.receive()
                        if message is None:
                            break
                        delays = self.retry.delays(jitter)  # connected: reset backoff
                        connected = True
                        kind = message.meta.get("kind")
                        if kind == "done":
                            return {"index": self.index, "rounds": rounds}
                        if kind == "ack":
                            log.info(
                                "The server answered %s to an upload.", message.meta.get("status")
                            )
                        elif kind == "task" and (refused := self._refused(message)):
                            await session.send(
                                Payload(
                                    meta={
                                        "kind": "refused",
                                        "round": message.meta.get("round"),
                                        "attempt": message.meta.get("attempt"),
                                        "reason": refused.reason,
                                        "message": str(refused),
                                    }
                                )
                            )
                            await session.finish(GOODBYE_SECONDS)  # the server hears it first
                            raise refused
                        elif kind == "task" and message.meta.get("stage"):
                            last = (int(message.meta["round"]), int(message.meta["attempt"]))
                            await session.send(self._stage_response(last, message))
                        elif kind == "task" and is_evaluation(
                            message.meta.get("instruction") or {}
                        ):
                            last = (int(message.meta["round"]), int(message.meta["attempt"]))
                            await session.send(self._evaluation(last, message))
                        elif kind == "task":
                            last = (int(message.meta["round"]), int(message.meta["attempt"]))
                            instruction = self._instruction(message)  # decompressed once
                            keys = await self._keys(last[0], instruction)
                            try:
                                upload = self._upload(last, instruction, keys)
                            except FedcoreError as exc:
                                await self._say_failed(session, last, exc)
                                raise
                            await session.send(upload)
                            rounds += 1
                            self.protocol.after_upload(last[0])
                            # Trained in the task's bytes and sent them: the next task of the
                            # same layout is written into them, not into new memory.
                            large = session.last_large
                            done_with_bytes = large is not None and self.learner.views(large[1])
                except RemoteError as exc:
                    if exc.code not in RECONNECT_CODES:
                        raise
                    if connected:
                        log.warning("The session ended (%s); reconnecting.", exc.code)
                    else:  # started beside the server, or before it: the usual start
                        log.info("The server is not reachable yet (%s); retrying.", exc.code)
                finally:
                    session.close()
                delay = next(delays, None)
                if delay is None:
                    raise RemoteError(
                        f"The server stayed unreachable for "
                        f"{self.spec.failure_policy.connect_timeout_seconds} s "
                        f"(spec.failurePolicy.connectTimeoutSeconds).",
                        method="Session",
                        code="UNAVAILABLE",
                    )
                await asyncio.sleep(delay)
        finally:
            await link.close()
            if self.kdc is not None:
                self.kdc.close()
            if self.duties is not None:
                self.duties.close()

    async def _say_failed(
        self, session: AsyncClientSession, task_id: tuple[int, int], exc: Exception
    ) -> None:
        """Tells the server why this client cannot answer the task (a checkpoint it cannot
        restore, a lost peer) before it leaves, so the run's failure names the cause rather
        than a disconnection; a server already gone is no reason for another error. A site's
        client sends the error's kind only: its message may name the site's own paths."""
        text = (
            f"see site {self.guard.site}'s log of client {self.index}"
            if self.guard is not None
            else str(exc)[:1000]
        )
        report = Payload(
            meta={
                "kind": "failed",
                "round": task_id[0],
                "attempt": task_id[1],
                "reason": type(exc).__name__,
                "message": text,
            }
        )
        try:
            await session.send(report)
            await session.finish(GOODBYE_SECONDS)  # the server hears it first
        except FedcoreError as lost:
            log.info("Could not tell the server why this client stops: %s", lost)

    def _refused(self, task: Payload) -> SiteRefused | None:
        """The site's refusal of ``task``, None when it has no guard or the guard allows it.
        An evaluation request (attempt 0) is checked for the spec only: it spends nothing."""
        if self.guard is None:
            return None
        round_ = int(task.meta["round"])
        try:
            if is_evaluation(task.meta.get("instruction") or {}):
                self.guard.check(min(round_, self.spec.rounds), task.meta.get("specDigest"))
            else:
                self.guard.check(round_, task.meta.get("specDigest"))
        except SiteRefused as exc:
            log.error("Site %s refuses this task: %s", self.guard.site, exc)
            return exc
        return None

    def _instruction(self, task: Payload) -> Payload:
        """The task's instruction, its tensors decompressed as the task says.

        Raises:
            MessageRejected: the task's compression breaks the spec's (a hostile server).
        """
        tensors = decompress_tensors(
            self.spec, "broadcasts", task.tensors, task.meta.get(COMPRESSION_KEY), what="task"
        )
        return Payload(meta=dict(task.meta.get("instruction") or {}), tensors=tensors)

    async def _keys(self, round_: int, instruction: Payload) -> Payload | None:
        """This round's keys from the KDC (protocols that need one; a thread waits for the
        call, so other sessions on the loop go on), or None."""
        kdc = self.kdc
        if kdc is None:
            return None
        reusable = self.protocol.reusable_keys(round_, instruction)
        if reusable is not None:
            return reusable
        return await asyncio.to_thread(
            kdc.call, "IssueKeys", Payload(meta={"round": round_}), timeout=CALL_SECONDS
        )

    def _upload(
        self, task_id: tuple[int, int], instruction: Payload, keys: Payload | None
    ) -> Payload:
        round_, attempt = task_id
        if self.duties is not None:
            self.duties.before(round_, instruction)
        with self.compute_lock, self.metrics.round_duration.time():
            upload = self.protocol.compute_upload(round_, instruction, self.learner, keys)
        if self.overflow:  # an experiment's attacker (spec.attack Overflow)
            upload = overflow_upload(upload)
        if self.duties is not None:
            upload = self.duties.after(round_, instruction, upload)
        self.metrics.rounds_completed.inc()
        self.metrics.round.set(round_)
        tensors, description = compress_tensors(
            self.spec, "uploads", upload.tensors, round=round_, attempt=attempt, client=self.index
        )
        meta = {"kind": "upload", "round": round_, "attempt": attempt, "upload": upload.meta}
        if description is not None:
            meta[COMPRESSION_KEY] = description
        return Payload(meta=meta, tensors=tensors)

    def _stage_response(self, task_id: tuple[int, int], task: Payload) -> Payload:
        """Answers a later stage of a multi-stage protocol's attempt. What the protocol
        refuses to answer (a hostile or broken server's request) is declined, with the
        reason, and logged; the client stays in the run."""
        round_, attempt = task_id
        stage = task.meta.get("stage")
        if isinstance(stage, bool) or not isinstance(stage, int) or stage < 1:
            raise MessageRejected(f"A task names stage {stage!r}; a stage is an integer >= 1.")
        try:
            with self.compute_lock:
                response = self.protocol.respond(round_, stage, self._instruction(task))
        except ProtocolError as exc:
            log.error("Declined stage %d of round %d: %s", stage, round_, exc)
            response = Payload(meta={"declined": str(exc)[:1000]})
        meta = {
            "kind": "upload",
            "round": round_,
            "attempt": attempt,
            "stage": stage,
            "upload": response.meta,
        }
        return Payload(meta=meta, tensors=response.tensors)

    def _evaluation(self, task_id: tuple[int, int], task: Payload) -> Payload:
        """Scores the models the server sent on this client's held-out examples; answers
        with counts only."""
        round_, attempt = task_id
        if self.evaluator is None:
            raise FedcoreError(
                "The server asked for an evaluation, which this run's spec.evaluation.where "
                "does not give the clients."
            )
        instruction = task.meta.get("instruction") or {}
        with self.compute_lock:
            counts = score(
                self.evaluator,
                requested_models(task.tensors),
                bool(instruction.get("perClass")),
            )
        answer = answer_meta(counts)
        if attack_of(self.spec, self.index) == "MisreportEvaluation":  # an experiment's attacker
            answer = misreport_evaluation(answer)
        return Payload(
            meta={"kind": "upload", "round": round_, "attempt": attempt, "upload": answer}
        )


class RpcKeyChannel(KeyChannel):
    """A client protocol's channel to the KDC over mutual-TLS gRPC.

    Args:
        kdc: the KDC's channel, or a function that returns the current one (a client whose
            certificate is renewed gets new channels).
    """

    def __init__(self, kdc: RpcClient | Callable[[], RpcClient | None]) -> None:
        self._kdc = kdc

    def submit(self, payload: Payload) -> Payload:
        kdc = self._kdc if isinstance(self._kdc, RpcClient) else self._kdc()
        if kdc is None:
            raise FedcoreError("This party has no channel to the KDC.")
        return kdc.call("Submit", payload, timeout=CALL_SECONDS)


def run_client(
    config: RoleConfig,
    *,
    index: int,
    server: str,
    kdc: str | None,
    peers: PeerSettings | None = None,
    site_binding: Path | None = None,
) -> dict[str, Any]:
    """The ``fedcore client`` entry point: takes part in one run to its end.

    With ``site_binding`` (a site's client), the client reads its data source from the
    site's binding and checks every task against the site's approval before it computes."""
    run, tls = config.load()
    settle_role_process(config.threads)
    guard = None
    if site_binding is not None:
        binding = SiteBinding.load(site_binding)
        guard = binding.guard(run)
        run = binding.bind(run)
    return Client(
        run,
        config,
        tls,
        index=index,
        server=server,
        kdc=kdc,
        peers=peers,
        guard=guard,
        tls_dir=None if site_binding is None else config.tls_dir,
    ).serve()

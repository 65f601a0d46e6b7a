"""The client role: join, hold a presence call, then pull a task, compute, push, until done."""

from __future__ import annotations

import logging
import threading
from typing import Any

from fedcore.data import client_dataset
from fedcore.errors import FedcoreError, TransportError
from fedcore.metrics import RoleMetrics
from fedcore.models import build_model
from fedcore.protocols import ClientProtocol, create_protocol
from fedcore.roles._common import (
    KDC_SERVICE,
    SERVER_SERVICE,
    RoleConfig,
    choose_device,
    limit_threads,
    limits_of,
    retry_of,
)
from fedcore.roles.server import PULL_WAIT_SECONDS
from fedcore.spec import FederatedRun, protocol_facts
from fedcore.training import LocalLearner
from fedcore.transport import Payload, RemoteError, RpcClient, TlsBundle

log = logging.getLogger(__name__)

CALL_SECONDS = 120.0
"""Deadline of one Join or Push attempt (uploads of several GB need minutes)."""


class Client:
    """The client role of one run.

    Args:
        run: the validated manifest.
        config: how this process was started.
        tls: this client's bundle.
        index: this client's index (its certificate must say the same).
        server: ``host:port`` of the server.
        kdc: ``host:port`` of the KDC, for protocols that need one.
        server_name: the name on the server's (and KDC's) certificate, if not the host.
    """

    def __init__(self, run: FederatedRun, config: RoleConfig, tls: TlsBundle, *, index: int,
                 server: str, kdc: str | None = None, server_name: str | None = None) -> None:
        spec = run.spec
        if not 0 <= index < spec.clients.count:
            raise FedcoreError(
                f"Client index {index} is outside 0..{spec.clients.count - 1} (spec.clients.count)."
            )
        self.run = run
        self.spec = spec
        self.index = index
        self.config = config
        self.metrics = RoleMetrics(run.metadata.name, "client")
        data = client_dataset(spec, index)
        device = choose_device(spec.roles.clients)
        model = build_model(spec.model, data.input_shape, data.num_classes, seed=spec.seed)
        self.learner = LocalLearner(model.to(device), data, spec.training, seed=spec.seed,
                                    client_index=index, device=device)
        self.protocol: ClientProtocol = create_protocol(spec.protocol.name).create_client(
            spec, index)
        limits = limits_of(spec)
        retry = retry_of(spec)
        self.server = RpcClient(server, tls, service=SERVER_SERVICE, limits=limits, retry=retry,
                                server_name=server_name, on_bytes=self.metrics.count_bytes)
        self.kdc: RpcClient | None = None
        if protocol_facts(spec.protocol.name).needs_kdc:
            if kdc is None:
                raise FedcoreError(f"Protocol {spec.protocol.name!r} needs a KDC: pass --kdc.")
            self.kdc = RpcClient(kdc, tls, service=KDC_SERVICE, limits=limits, retry=retry,
                                 server_name=server_name, on_bytes=self.metrics.count_bytes)
        self._done = threading.Event()

    def serve(self) -> dict[str, Any]:
        """Takes part in rounds until the server says the run is over; returns a summary."""
        self.metrics.serve(self.config.metrics_port, self.config.metrics_address)
        self.server.call("Join", Payload(meta={"index": self.index}), timeout=CALL_SECONDS)
        presence = threading.Thread(target=self._hold_presence, name="presence", daemon=True)
        presence.start()
        rounds = 0
        last = (0, 0)
        try:
            while True:
                task = self.server.call("Pull", Payload(meta={"round": last[0],
                                                              "attempt": last[1]}),
                                        timeout=PULL_WAIT_SECONDS + 10)
                kind = task.meta.get("kind")
                if kind == "done":
                    break
                if kind != "task":
                    continue
                round_, attempt = int(task.meta["round"]), int(task.meta["attempt"])
                upload = self._compute(round_, task)
                reply = self.server.call(
                    "Push",
                    Payload(meta={"round": round_, "attempt": attempt, "upload": upload.meta},
                            tensors=upload.tensors),
                    timeout=CALL_SECONDS,
                )
                status = reply.meta.get("status")
                if status != "accepted":
                    log.info("The server answered %s to the upload of round %d.", status, round_)
                self.metrics.rounds_completed.inc()
                self.metrics.round.set(round_)
                rounds += 1
                last = (round_, attempt)
        finally:
            self._done.set()
            self.server.close()
            if self.kdc is not None:
                self.kdc.close()
        return {"index": self.index, "rounds": rounds}

    def _compute(self, round_: int, task: Payload) -> Payload:
        instruction = Payload(meta=dict(task.meta.get("instruction") or {}), tensors=task.tensors)
        keys = None
        if self.kdc is not None:
            keys = self.kdc.call("IssueKeys", Payload(meta={"round": round_}),
                                 timeout=CALL_SECONDS)
        with self.metrics.round_duration.time():
            return self.protocol.compute_upload(round_, instruction, self.learner, keys)

    def _hold_presence(self) -> None:
        """Keeps one Presence call open; reopens it if it breaks before the run ends."""
        while not self._done.is_set():
            try:
                reply = self.server.call("Presence", Payload(), timeout=7 * 24 * 3600)
                if reply.meta.get("kind") == "done":
                    return
            except (RemoteError, TransportError) as exc:
                if self._done.is_set():
                    return
                log.warning("Presence call ended (%s); reopening.", exc)
                self._done.wait(0.5)


def run_client(config: RoleConfig, *, index: int, server: str, kdc: str | None,
               server_name: str | None) -> dict[str, Any]:
    """The ``fedcore client`` entry point: takes part in one run to its end."""
    run, tls = config.load()
    limit_threads(config.threads)
    return Client(run, config, tls, index=index, server=server, kdc=kdc,
                  server_name=server_name).serve()

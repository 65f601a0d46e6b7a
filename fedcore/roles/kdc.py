"""The KDC role: serves each party the key material its protocol's KDC side issues to it."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from fedcore.errors import FedcoreError, MessageRejected
from fedcore.events import EventLog
from fedcore.metrics import RoleMetrics
from fedcore.protocols import KdcProtocol, create_protocol
from fedcore.roles._common import KDC_SERVICE, RoleConfig, limits_of
from fedcore.spec import FederatedRun
from fedcore.transport import CallContext, Identity, Payload, RpcServer, TlsBundle

log = logging.getLogger(__name__)


class Kdc:
    """The KDC role of one run: ``IssueKeys`` and ``Submit``, answered by the protocol's KDC side.

    Raises:
        FedcoreError: the run's protocol has no KDC side.
    """

    def __init__(
        self,
        run: FederatedRun,
        config: RoleConfig,
        tls: TlsBundle,
        *,
        listen: str,
        protocol: KdcProtocol | None = None,
    ) -> None:
        self.run = run
        self.config = config
        kdc = protocol or create_protocol(run.spec.protocol.name).create_kdc(run.spec)
        if kdc is None:
            raise FedcoreError(
                f"Protocol {run.spec.protocol.name!r} has no KDC; `fedcore kdc` is only started "
                f"for protocols that need one."
            )
        self.protocol = kdc
        self.metrics = RoleMetrics(run.metadata.name, "kdc")
        self.events = EventLog(config.events)
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.rpc = RpcServer(
            listen,
            tls,
            {"IssueKeys": self._issue_keys, "Submit": self._submit},
            service=KDC_SERVICE,
            limits=limits_of(run.spec),
            max_workers=2 * run.spec.clients.count + 8,
            on_rejected=lambda method, reason: self.metrics.rejected(reason),
            on_bytes=self.metrics.count_bytes,
        )

    def _issue_keys(self, peer: Identity, request: Payload, ctx: CallContext) -> Payload:
        round_ = request.meta.get("round")
        if isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0:
            raise MessageRejected(f"IssueKeys needs a round number >= 0, got {round_!r}.")
        with self.lock:
            return self.protocol.issue_keys(round_, peer)

    def _submit(self, peer: Identity, request: Payload, ctx: CallContext) -> Payload:
        with self.lock:
            return self.protocol.accept(peer, request)

    def start(self) -> int:
        """Starts serving; returns the bound port."""
        self.metrics.serve(self.config.metrics_port, self.config.metrics_address)
        self.rpc.start()
        self.events.emit("ready", role="kdc", port=self.rpc.port)
        return self.rpc.port

    def stop(self) -> None:
        """Stops serving."""
        self.rpc.stop()
        self.stopped.set()


def run_kdc(config: RoleConfig, *, listen: str) -> dict[str, Any]:
    """The ``fedcore kdc`` entry point: serves keys until SIGTERM or SIGINT."""
    run, tls = config.load()
    kdc = Kdc(run, config, tls, listen=listen)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: kdc.stopped.set())
    kdc.start()
    kdc.stopped.wait()
    kdc.rpc.stop()
    return {"role": "kdc"}

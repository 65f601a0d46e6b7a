"""The KDC role: serves each party the key material its protocol's KDC side issues to it.

The KDC checkpoints its protocol state apart from the server, under ``<prefix>/kdc/`` of the
run's checkpoint store (same format: parts first, a signed manifest with checksums last). Its
parts are encrypted with AES-256-GCM and its manifests signed, under keys derived from the
KDC's state key, which only the KDC holds (``FEDCORE_KDC_STATE_KEY_FILE``, else
``<workdir>/keys/kdc-state.key``): whoever can read or write the store, the server included,
can neither read the KDC's secrets nor replace its state unnoticed. It saves the initial state
before it serves, and every changed state before it answers the call that changed it, so a
party whose call succeeded is never forgotten. Started with ``--resume`` (a restarted KDC), it
loads the checkpoint its signed latest record names before it serves, and refuses to start
when that checkpoint fails verification or is missing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import signal
import threading
from collections.abc import Callable, Mapping
from typing import Any

from fedcore.checkpoint import (
    Checkpointer,
    CheckpointRefused,
    kdc_checkpointer,
    kdc_state_key,
    split_tensors,
)
from fedcore.errors import CheckpointError, FedcoreError, MessageRejected, NotReady, RunAborted
from fedcore.observe.events import EventLog
from fedcore.observe.metrics import RoleMetrics
from fedcore.protocols import KdcProtocol, create_protocol
from fedcore.roles._common import (
    KDC_SERVICE,
    RoleConfig,
    limits_of,
    model_parameters,
    role_checkpointer,
    site_gate,
)
from fedcore.spec import FederatedRun
from fedcore.transport import CallContext, Identity, Payload, RpcServer, TlsBundle

log = logging.getLogger(__name__)


class Kdc:
    """The KDC role of one run: ``IssueKeys`` and ``Submit``, answered by the protocol's KDC side.

    Args:
        run: the validated manifest.
        config: how this process was started.
        tls: the KDC's bundle.
        listen: the ``host:port`` to serve on.
        protocol: the KDC side to serve (default: the run's protocol's).
        resume: load the latest good KDC checkpoint before serving.

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
        resume: bool = False,
    ) -> None:
        self.run = run
        self.config = config
        self.resume = resume
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
        self.failure: RunAborted | None = None
        self.checkpointer = self._checkpointer()
        self.version = 0
        self._saved: str | None = None
        limits = limits_of(run.spec, model_parameters(run.spec))
        self.rpc = RpcServer(
            listen,
            tls,
            {"IssueKeys": self._issue_keys, "Submit": self._submit},
            service=KDC_SERVICE,
            limits=limits,
            max_workers=limits.workers(run.spec.clients.count + 1),  # the clients, the server
            callers={"IssueKeys": ["client"], "Submit": ["client", "server"]},
            on_rejected=lambda method, reason, sender: self.metrics.rejected(reason, sender),
            on_bytes=self.metrics.count_bytes,
            gate=site_gate(run.spec, config.revoked_sites),
        )

    # -------------------------------------------------------------------------- calls

    def _issue_keys(self, peer: Identity, request: Payload, ctx: CallContext) -> Payload:
        round_ = request.meta.get("round")
        if isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0:
            raise MessageRejected(f"IssueKeys needs a round number >= 0, got {round_!r}.")
        return self._answer(lambda: self.protocol.issue_keys(round_, peer))

    def _submit(self, peer: Identity, request: Payload, ctx: CallContext) -> Payload:
        return self._answer(lambda: self.protocol.accept(peer, request))

    def _answer(self, call: Callable[[], Payload]) -> Payload:
        """Runs one protocol call and saves the state it changed before answering.

        Raises:
            NotReady: the KDC is stopping because its state could not be saved.
        """
        with self.lock:
            if self.failure is not None:
                raise NotReady(f"The KDC is stopping: {self.failure}")
            answer = call()
            try:
                self._persist()
            except RunAborted as exc:
                raise NotReady(f"The KDC is stopping: {exc}") from exc
            return answer

    # -------------------------------------------------------------------- checkpoints

    def _checkpointer(self) -> Checkpointer | None:
        return role_checkpointer(
            self.run,
            self.config,
            resume=self.resume,
            on_failure=self.metrics.checkpoint_failures.inc,
            factory=lambda store, spec, **ids: kdc_checkpointer(
                store, spec, key=kdc_state_key(self.config.workdir), **ids
            ),
        )

    def _prepare_state(self) -> None:
        """Checks the store, then resumes the latest good state or saves the initial one.

        Raises:
            RunAborted: the store cannot be used or the checkpoint cannot be restored.
        """
        checkpointer = self.checkpointer
        if checkpointer is None:
            return
        try:
            checkpointer.store.check()
            checkpointer.sweep()  # what a killed writer left (this KDC writes its series alone)
            found = checkpointer.load_latest() if self.resume else None
            existing = checkpointer.rounds()
        except CheckpointRefused as exc:
            raise RunAborted(
                f"The KDC does not start: its state cannot be resumed: {exc}",
                reason="CheckpointInvalid",
            ) from exc
        except CheckpointError as exc:
            raise RunAborted(
                f"The KDC's checkpoint store cannot be used, so the KDC does not start: {exc}",
                reason="CheckpointFailed",
            ) from exc
        if found is not None:
            version, state = found
            try:
                self.protocol.load_state_dict(state["protocol"])
            except (KeyError, ValueError, TypeError) as exc:
                raise RunAborted(
                    f"The KDC checkpoint version {version} cannot be restored: {exc}",
                    reason="CheckpointInvalid",
                ) from exc
            self.version = version
            self._saved = _digest(self.protocol.state_dict())
            self.events.emit("resumed", role="kdc", version=version)
            log.info("Resumed the KDC state from its checkpoint version %d.", version)
            return
        if self.resume:
            log.warning(
                "No usable KDC checkpoint in %s; starting with a fresh state.",
                checkpointer.store.describe(),
            )
        # A fresh state is numbered after any older one, so it is the one a resume finds.
        self.version = max(existing, default=0)
        self._persist()

    def _persist(self) -> None:
        """Saves the protocol's state if it changed since the last save (call under the lock).

        Raises:
            RunAborted: the save failed; the KDC stops (reason CheckpointFailed).
        """
        if self.checkpointer is None:
            return
        state = self.protocol.state_dict()
        digest = _digest(state)
        if digest == self._saved:
            return
        version = self.version + 1
        try:
            info = self.checkpointer.save(version, {"version": version, "protocol": state})
        except CheckpointError as exc:
            self.metrics.checkpoint_failures.inc()
            failure = RunAborted(
                f"The KDC could not save its state (version {version}): {exc}",
                reason="CheckpointFailed",
            )
            self._fail(failure)
            raise failure from exc
        self.version = version
        self._saved = digest
        self.events.emit("checkpoint", role="kdc", version=version, location=info.location)

    def _fail(self, failure: RunAborted) -> None:
        """Reports ``failure`` and makes the role stop."""
        if self.failure is None:
            self.failure = failure
            log.error("%s", failure)
            self.events.emit("failed", role="kdc", reason=failure.reason, message=str(failure))
        self.stopped.set()

    # ------------------------------------------------------------------------ serving

    def start(self) -> int:
        """Prepares (or resumes) the state, then starts serving; returns the bound port.

        Raises:
            RunAborted: the checkpoint store cannot be used or the state cannot be restored.
        """
        self.metrics.serve(self.config.metrics_port, self.config.metrics_address)
        try:
            with self.lock:
                self._prepare_state()
        except RunAborted as exc:
            self._fail(exc)
            raise
        self.rpc.start()
        self.events.emit("ready", role="kdc", port=self.rpc.port)
        return self.rpc.port

    def stop(self) -> None:
        """Stops serving."""
        self.rpc.stop()
        self.stopped.set()


def _digest(state: Mapping[str, Any]) -> str:
    """A digest of a state tree (JSON values and arrays), to tell whether it changed."""
    tree, tensors = split_tensors(state)
    digest = hashlib.sha256(json.dumps(tree, sort_keys=True).encode("utf-8"))
    for name in sorted(tensors):
        array = tensors[name]
        digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def run_kdc(config: RoleConfig, *, listen: str, resume: bool = False) -> dict[str, Any]:
    """The ``fedcore kdc`` entry point: serves keys until SIGTERM or SIGINT.

    Raises:
        RunAborted: the KDC's state could not be saved or restored.
    """
    run, tls = config.load()
    kdc = Kdc(run, config, tls, listen=listen, resume=resume)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: kdc.stopped.set())
    kdc.start()
    kdc.stopped.wait()
    kdc.rpc.stop()
    if kdc.failure is not None:
        raise kdc.failure
    return {"role": "kdc"}

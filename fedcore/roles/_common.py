"""What every role process shares: its configuration and the spec-derived settings."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedcore.checkpoint import Checkpointer, open_store
from fedcore.local.allocator import tune_allocator
from fedcore.local.threads import limit_threads
from fedcore.spec import (
    RESUME_INSENSITIVE_FIELDS,
    FederatedRun,
    FederatedRunSpec,
    RoleSpec,
    load_manifest,
)
from fedcore.spec._runtime import message_limit
from fedcore.transport import Identity, Limits, RetryPolicy, RevokedSites, TlsBundle


def settle_role_process(threads: int) -> None:
    """What a role process sets before it works: its maths' thread count (``limit_threads``)
    and the C allocator's thresholds (``tune_allocator``: message-sized buffers reused)."""
    limit_threads(threads)
    tune_allocator()


SERVER_SERVICE = "Server"
KDC_SERVICE = "Kdc"


@dataclass(frozen=True)
class RoleConfig:
    """How one role process was started.

    Attributes:
        manifest: the FederatedRun manifest file.
        tls_dir: the folder with this role's ca.crt, tls.crt and tls.key.
        workdir: the run's folder (checkpoints, final model).
        metrics_port: where /metrics is served (0: not served).
        metrics_address: the address /metrics binds to.
        events: the JSON-lines progress file (None: no events).
        threads: torch's intra-op threads in this process.
        revoked_sites: the hub's file of revoked sites (a hub's server and KDC), or None.
    """

    manifest: Path
    tls_dir: Path
    workdir: Path
    metrics_port: int = 0
    metrics_address: str = "127.0.0.1"
    events: Path | None = None
    threads: int = 1
    revoked_sites: Path | None = None

    def load(self) -> tuple[FederatedRun, TlsBundle]:
        """Loads the manifest and this role's TLS bundle."""
        return load_manifest(self.manifest), TlsBundle.load(self.tls_dir)


def site_gate(
    spec: FederatedRunSpec, revoked_sites: Path | None
) -> Callable[[Identity], str | None] | None:
    """What bars a client of a revoked site (``RpcServer``'s gate), None without sites."""
    if spec.sites is None or revoked_sites is None:
        return None
    revoked = RevokedSites(revoked_sites)

    def gate(peer: Identity) -> str | None:
        if peer.role != "client" or peer.index is None:
            return None
        site = spec.site_of(peer.index)
        if site is not None and site in revoked.names():
            return (
                f"{peer.common_name} belongs to site {site!r}, which the hub revoked; its "
                "calls and uploads are refused."
            )
        return None

    return gate


def limits_of(spec: FederatedRunSpec, parameters: int) -> Limits:
    """Returns the transport limits a spec sets for a model of ``parameters`` scalars.

    The message limit is ``spec.transport.maxMessageBytes``, or derived from the model's size
    when unset (``fedcore.spec._runtime.message_limit``).
    """
    return Limits(
        chunk_bytes=spec.transport.chunk_bytes,
        max_message_bytes=message_limit(spec, parameters),
    )


def parameters_of(module: Any) -> int:
    """Returns how many scalars a torch module's state holds (weights and buffers)."""
    return sum(int(tensor.numel()) for tensor in module.state_dict().values())


def model_parameters(spec: FederatedRunSpec) -> int:
    """Returns the run model's scalars, for a role that does not build the model (the KDC).

    Builds the model once (loading the data's shape); skipped (0) when the spec sets
    ``maxMessageBytes``, which then needs no model.
    """
    if spec.transport.max_message_bytes is not None:
        return 0
    from fedcore.learning.data import dataset_info
    from fedcore.learning.models import build_model

    input_shape, num_classes = dataset_info(spec)
    return parameters_of(build_model(spec.model, input_shape, num_classes, seed=spec.seed))


def retry_of(spec: FederatedRunSpec) -> RetryPolicy:
    """Returns the retry policy a spec sets."""
    return RetryPolicy(total_seconds=spec.failure_policy.connect_timeout_seconds)


def choose_device(role: RoleSpec) -> str:
    """Returns "cuda" when the role asks for GPUs and torch sees one, else "cpu"; logs which
    (a pod's start-up log says what it trains on)."""
    log = logging.getLogger(__name__)
    if role.gpus > 0:
        import torch

        if torch.cuda.is_available():
            log.info("Training on cuda: %s.", torch.cuda.get_device_name(0))
            return "cuda"
        log.warning("The role asks for GPUs but none is visible; using the CPU.")
    log.info("Training on the CPU.")
    return "cpu"


def spec_fingerprint(run: FederatedRun) -> str:
    """Returns a digest of the run's name and the spec fields a resume must not change."""
    spec = run.spec.model_dump(by_alias=True, mode="json")
    for field in RESUME_INSENSITIVE_FIELDS:
        spec.pop(field, None)
    text = json.dumps({"name": run.metadata.name, "spec": spec}, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def configure_logging(role: str, level: str = "INFO") -> None:
    """Logs to stderr as '<time> <role> <level> <message>'."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def role_checkpointer(
    run: FederatedRun,
    config: RoleConfig,
    *,
    resume: bool,
    on_failure: Callable[[], None],
    factory: Callable[..., Checkpointer],
) -> Checkpointer | None:
    """Opens a role's checkpoints in the run's store (None: checkpoints off and no resume).

    Args:
        factory: builds the role's Checkpointer from the store, e.g. ``server_checkpointer``.
        on_failure: counts each failed store request (the checkpoint-failure metric).
    """
    spec = run.spec.checkpoint
    if spec.every_rounds == 0 and not resume:
        return None
    name = run.metadata.name
    store = open_store(spec, name=name, workdir=config.workdir, on_failure=on_failure)
    return factory(store, spec, run=name, fingerprint=spec_fingerprint(run))

"""The checkpoint store a run's spec names, and the checkpointers of its server, its KDC and
(decentralized protocols) each client."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fedcore.checkpoint._checkpointer import Checkpointer
from fedcore.checkpoint._objects import LocalObjectStore, ObjectStore
from fedcore.spec import CheckpointSpec

KDC_FOLDER = "kdc"
"""The KDC's checkpoints live under ``<prefix>/kdc/``, apart from the server's."""
CLIENTS_FOLDER = "clients"
"""A decentralized protocol's client ``i`` keeps its own checkpoints under
``<prefix>/clients/client-<i>/``."""


def open_store(
    spec: CheckpointSpec,
    *,
    name: str,
    workdir: Path,
    on_failure: Callable[[], None] | None = None,
) -> ObjectStore:
    """Returns the run's checkpoint store: ``spec.s3`` when set, else the local folder.

    Args:
        spec: ``spec.checkpoint``.
        name: the run's name (``{name}`` in a path or prefix).
        workdir: the run's folder, which a relative local path starts from.
        on_failure: called once per failed S3 attempt (the checkpoint-failure metric).
    """
    if spec.s3 is not None:
        s3 = spec.s3
        from fedcore.checkpoint._s3 import S3ObjectStore  # boto3: only runs that use S3

        return S3ObjectStore(
            s3.bucket,
            prefix=s3.prefix.replace("{name}", name),
            endpoint=s3.endpoint,
            region=s3.region,
            server_side_encryption=s3.server_side_encryption,
            kms_key_id=s3.kms_key_id,
            retry_seconds=s3.retry_seconds,
            on_failure=on_failure,
        )
    path = Path(spec.local.path.replace("{name}", name))
    if not path.is_absolute():
        path = workdir / path
    return LocalObjectStore(path)


def server_checkpointer(
    store: ObjectStore, spec: CheckpointSpec, *, run: str, fingerprint: str, key: bytes | None
) -> Checkpointer:
    """The server's checkpoints: ``round-NNNNNNNN/`` at the top of the run's store, signed
    with ``key`` (``server_checkpoint_key``; None only to list or mark them)."""
    return Checkpointer(
        store,
        run=run,
        fingerprint=fingerprint,
        keep_last=spec.keep_last,
        keep_every=spec.keep_every,
        key=key,
    )


def kdc_checkpointer(
    store: ObjectStore, spec: CheckpointSpec, *, run: str, fingerprint: str, key: bytes | None
) -> Checkpointer:
    """The KDC's checkpoints: ``kdc/version-NNNNNNNN/``, one per change of its state, encrypted
    (AES-256-GCM) and signed under keys derived from ``key`` (``kdc_state_key``; None only to
    list or mark them)."""
    return Checkpointer(
        store.child(KDC_FOLDER),
        run=run,
        fingerprint=fingerprint,
        keep_last=spec.keep_last,
        series="version",
        key=key,
        encrypt=key is not None,
    )


def client_checkpointer(
    store: ObjectStore,
    spec: CheckpointSpec,
    *,
    run: str,
    fingerprint: str,
    index: int,
    key: bytes | None,
) -> Checkpointer:
    """Client ``index``'s own checkpoints (decentralized protocols, whose model lives on the
    clients): ``clients/client-<index>/round-NNNNNNNN/``, encrypted (AES-256-GCM) and signed
    under keys derived from ``key`` (``client_checkpoint_key``, the client's own; None only to
    list them): whoever else reads the store (the coordinator, another client, with the same
    S3 credentials) learns nothing of the client's model."""
    return Checkpointer(
        store.child(f"{CLIENTS_FOLDER}/client-{index}"),
        run=run,
        fingerprint=fingerprint,
        keep_last=spec.keep_last,
        keep_every=spec.keep_every,
        key=key,
        encrypt=key is not None,
        selector=f"--client {index}",
    )

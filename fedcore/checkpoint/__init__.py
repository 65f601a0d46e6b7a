"""Checkpoints: one format over pluggable object stores (a local folder, S3)."""

from typing import TYPE_CHECKING, Any

from fedcore.checkpoint._checkpointer import (
    Checkpointer,
    CheckpointInfo,
    CheckpointRefused,
    CheckpointShortOfSpace,
    LatestRecord,
    join_tensors,
    split_tensors,
)
from fedcore.checkpoint._keys import (
    CHECKPOINT_KEY_ENV,
    CHECKPOINT_KEY_NAME,
    KDC_STATE_KEY_ENV,
    KDC_STATE_KEY_NAME,
    KEYS_FOLDER,
    ROLE_KEY_ENVS,
    CheckpointKeyError,
    client_checkpoint_key,
    client_checkpoint_key_name,
    ensure_key,
    kdc_state_key,
    key_file_for,
    read_key,
    server_checkpoint_key,
)
from fedcore.checkpoint._objects import LocalObjectStore, ObjectStore
from fedcore.checkpoint._open import (
    CLIENTS_FOLDER,
    KDC_FOLDER,
    client_checkpointer,
    kdc_checkpointer,
    open_store,
    server_checkpointer,
)
from fedcore.checkpoint._tensors import TensorFile, read_tensors

if TYPE_CHECKING:
    from fedcore.checkpoint._s3 import S3ObjectStore


def __getattr__(name: str) -> Any:
    """``S3ObjectStore`` is imported on first use: boto3 costs a role's start-up a quarter of a
    second, and only runs that keep checkpoints in S3 need it."""
    if name == "S3ObjectStore":
        from fedcore.checkpoint._s3 import S3ObjectStore

        return S3ObjectStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CHECKPOINT_KEY_ENV",
    "CHECKPOINT_KEY_NAME",
    "CLIENTS_FOLDER",
    "KDC_FOLDER",
    "KDC_STATE_KEY_ENV",
    "KDC_STATE_KEY_NAME",
    "KEYS_FOLDER",
    "ROLE_KEY_ENVS",
    "CheckpointInfo",
    "CheckpointKeyError",
    "CheckpointRefused",
    "CheckpointShortOfSpace",
    "Checkpointer",
    "LatestRecord",
    "LocalObjectStore",
    "ObjectStore",
    "S3ObjectStore",
    "TensorFile",
    "client_checkpoint_key",
    "client_checkpoint_key_name",
    "client_checkpointer",
    "ensure_key",
    "join_tensors",
    "kdc_checkpointer",
    "kdc_state_key",
    "key_file_for",
    "open_store",
    "read_key",
    "read_tensors",
    "server_checkpoint_key",
    "server_checkpointer",
    "split_tensors",
]

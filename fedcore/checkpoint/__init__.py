"""Checkpoints: one format over pluggable object stores (a local folder, S3)."""

from fedcore.checkpoint._checkpointer import (
    Checkpointer,
    CheckpointInfo,
    join_tensors,
    split_tensors,
)
from fedcore.checkpoint._objects import LocalObjectStore, ObjectStore
from fedcore.checkpoint._open import KDC_FOLDER, kdc_checkpointer, open_store, server_checkpointer
from fedcore.checkpoint._s3 import S3ObjectStore
from fedcore.checkpoint._tensors import TensorFile, read_tensors

__all__ = [
    "KDC_FOLDER",
    "CheckpointInfo",
    "Checkpointer",
    "LocalObjectStore",
    "ObjectStore",
    "S3ObjectStore",
    "TensorFile",
    "join_tensors",
    "kdc_checkpointer",
    "open_store",
    "read_tensors",
    "server_checkpointer",
    "split_tensors",
]

"""Checkpoints: one format over pluggable object stores (a local folder, S3)."""

from fedcore.checkpoint._checkpointer import (
    Checkpointer,
    CheckpointInfo,
    join_tensors,
    split_tensors,
)
from fedcore.checkpoint._objects import LocalObjectStore, ObjectStore
from fedcore.checkpoint._s3 import S3ObjectStore

__all__ = [
    "CheckpointInfo",
    "Checkpointer",
    "LocalObjectStore",
    "ObjectStore",
    "S3ObjectStore",
    "join_tensors",
    "split_tensors",
]

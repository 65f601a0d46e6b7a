"""Checkpoints: one format over pluggable object stores (a local folder; S3 to come)."""

from fedcore.checkpoint._checkpointer import (
    Checkpointer,
    CheckpointInfo,
    join_tensors,
    split_tensors,
)
from fedcore.checkpoint._objects import LocalObjectStore, ObjectStore

__all__ = [
    "CheckpointInfo",
    "Checkpointer",
    "LocalObjectStore",
    "ObjectStore",
    "join_tensors",
    "split_tensors",
]

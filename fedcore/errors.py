"""The fedcore exception tree.

::

    FedcoreError                 root of everything fedcore raises on purpose
    ├── SpecError                a manifest is invalid (carries every issue found)
    ├── DataError                the run's data cannot serve the manifest (also a ValueError)
    ├── ProtocolError            a protocol's maths or preconditions failed
    │   ├── RecoveryError        a lossless protocol's recovery residual passed its bound
    │   ├── EncodingRejected     an upload's encoding failed the protocol's verification
    │   ├── UploadRefused        an upload passed the run's bounds (spec.uploads)
    │   └── AggregateRefused     a round's aggregate would wreck the model; it is not applied
    ├── TransportError           a message could not be sent, received or decoded
    │   ├── MessageRejected      a peer sent a malformed, truncated or oversized message
    │   ├── NotReady             the peer cannot answer yet (e.g. keys not all registered)
    │   └── PeerLost             a decentralized protocol's neighbour went away mid-run
    ├── CheckpointError          a checkpoint could not be written or read
    │   └── CheckpointInvalid    a role cannot restore the checkpoint it must resume from
    ├── RoleFailed               a role process (kdc, server, client) exited with an error
    └── RunAborted               a run stopped before its last round (quorum lost, budget, ...)

Foreign errors (grpc, boto3, OS) are translated at the boundary with ``raise ... from exc``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class FedcoreError(Exception):
    """Root of every error fedcore raises on purpose."""


@dataclass(frozen=True)
class SpecIssue:
    """One problem found in a manifest.

    Attributes:
        path: the dotted field path, e.g. ``spec.clients.count``.
        message: a sentence saying what is wrong and what is allowed.
        value: the offending value, when the validator recorded it (keyword-only; None when
            not recorded or when the field is missing). Not part of equality.
        allowed: what the field allows, e.g. ``"1 to 10000"``, when the validator recorded it
            (keyword-only). Not part of equality.
    """

    path: str
    message: str
    value: Any = field(default=None, kw_only=True, compare=False)
    allowed: str | None = field(default=None, kw_only=True, compare=False)

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecError(FedcoreError):
    """A manifest is invalid; ``issues`` lists every problem with its field path."""

    def __init__(self, issues: list[SpecIssue], *, source: str | None = None) -> None:
        self.issues = list(issues)
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {issue}" for issue in self.issues)
        super().__init__(f"The FederatedRun manifest{where} is invalid:\n{lines}")


class DataError(FedcoreError, ValueError):
    """The run's data cannot serve the manifest: unreadable or malformed files, or too few
    examples for the clients (known only when an NpzFolder is read). Also a ValueError, which
    the data loaders raised before it existed."""


class ProtocolError(FedcoreError):
    """A protocol's maths or preconditions failed."""


class RecoveryError(ProtocolError):
    """A lossless protocol's recovery residual passed its bound."""

    def __init__(self, message: str, *, round: int, residual: float, bound: float) -> None:
        self.round = round
        self.residual = residual
        self.bound = bound
        super().__init__(message)


class EncodingRejected(ProtocolError):
    """An upload's encoding failed the protocol's verification (e.g. ebscfl's norm or mask
    check); the server refuses it, counts it under reason ``encoding`` and goes on."""


class UploadRefused(ProtocolError):
    """An upload passed one of the run's bounds (spec.uploads): it steps too far or claims
    another example count than its shard; the server refuses it, counts it under reason
    ``bound`` with its sender, and settles the round without it."""


class AggregateRefused(ProtocolError):
    """A round's aggregate would make the model non-finite or move it past
    ``spec.uploads.maxUpdateNorm``; the server keeps the previous model and the run stops
    (reason ``AggregateRefused``). Plaintext servers refuse the offending uploads before this
    can happen; it guards the protocols whose server sees only the aggregate."""

    def __init__(self, message: str, *, round: int) -> None:
        self.round = round
        super().__init__(message)


class TransportError(FedcoreError):
    """A message could not be sent, received or decoded."""


class MessageRejected(TransportError):
    """A peer sent a malformed, truncated or oversized message."""


class NotReady(TransportError):
    """The peer cannot answer yet; the caller retries with backoff (e.g. keys still missing)."""


class PeerLost(TransportError):
    """A client's neighbour on the peer graph went away (or went silent) mid-run."""

    def __init__(self, message: str, *, peer: int | None = None) -> None:
        self.peer = peer
        super().__init__(message)


class CheckpointError(FedcoreError):
    """A checkpoint could not be written or read."""


class CheckpointInvalid(CheckpointError):
    """A role cannot restore the checkpoint it must resume from (changed, unsigned, written
    with another key, missing or unreadable): starting the role again reads the same
    checkpoint, so the run stops (reason ``CheckpointInvalid``) rather than retries."""

    EXIT_CODE = 65
    """A role process's exit code for it (``EX_DATAERR``): the operator ends the run instead
    of recreating the pod (``fedcore.cli.crash.EXIT_CHECKPOINT_INVALID``)."""


class RoleFailed(FedcoreError):
    """A role process exited with an error."""

    def __init__(self, role: str, message: str, *, exit_code: int | None = None) -> None:
        self.role = role
        self.exit_code = exit_code
        super().__init__(f"The {role} failed: {message}")


class RunAborted(FedcoreError):
    """A run stopped before its last round; ``reason`` is a PascalCase word."""

    def __init__(self, message: str, *, reason: str, round: int | None = None) -> None:
        self.reason = reason
        self.round = round
        super().__init__(message)

"""How the roles behave while running: deadlines and retries, and message size limits."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fedcore.spec._base import SpecModel

if TYPE_CHECKING:
    from fedcore.spec._run import FederatedRunSpec

MESSAGE_FLOOR_BYTES = 64 * 1024**2
"""What the derived message limit allows on top of the model: headers, keys, small models."""
MODEL_COPIES = 32
"""How many float64 copies of the model one message may carry under the derived limit
(ebscfl's task carries up to 16 float64 cluster models)."""
MESSAGE_CEILING_BYTES = 8 * 1024**3
"""The derived message limit never exceeds this (the former fixed default)."""


class FailurePolicySpec(SpecModel):
    """Deadlines and retries of the roles."""

    round_timeout_seconds: float = Field(
        600,
        gt=0,
        le=7 * 24 * 3600,
        description="roundTimeoutSeconds is how long the server waits for a round's uploads "
        "before treating the missing clients as dropped. Default 600.",
    )
    connect_timeout_seconds: float = Field(
        300,
        gt=0,
        le=24 * 3600,
        description="connectTimeoutSeconds is how long a role keeps retrying (with backoff) to "
        "reach its peers, and how long the server waits for the first quorum. Default 300.",
    )
    max_round_retries: int = Field(
        2,
        ge=0,
        le=100,
        description="maxRoundRetries is how often a round missing its quorum is redone before "
        "the run fails with reason QuorumLost. Default 2.",
    )
    server_restarts: int = Field(
        3,
        ge=0,
        le=100,
        description="serverRestarts is how often `fedcore run` restarts a server that died "
        "without reporting a failure (killed, crashed), on the same port and with --resume, "
        "so it continues from its latest checkpoint while the clients reconnect. On "
        "Kubernetes the operator recreates the pod instead. Default 3.",
    )
    kdc_restarts: int = Field(
        3,
        ge=0,
        le=100,
        description="kdcRestarts is the same for the KDC: it resumes its key material from "
        "its own checkpoint. Default 3.",
    )


CompressionCodec = Literal["None", "Float16", "BFloat16", "Int8"]


class CompressionSpec(SpecModel):
    """Lossy compression of the float tensors in messages (fedcore/transport/_compression.py)."""

    uploads: CompressionCodec = Field(
        "None",
        description="uploads compresses every client's upload: Float16 or BFloat16 (half the "
        "bytes; relative error at most 2^-11 or 2^-8 per value with Nearest rounding) or Int8 "
        "(a quarter, plus one scale per tensor; error at most the tensor's largest magnitude "
        "/ 254). None (default): exact. Refused for protocols whose maths needs exact values.",
    )
    broadcasts: CompressionCodec = Field(
        "None",
        description="broadcasts compresses the model (or instruction) the server sends each "
        "round, with the same codecs. None (default): exact.",
    )
    rounding: Literal["Nearest", "Stochastic"] = Field(
        "Nearest",
        description="rounding is Nearest (deterministic, the smallest error) or Stochastic "
        "(unbiased: a value's expected round trip is the value itself, at up to twice the "
        "error), drawn from generators seeded by spec.seed, the round and the client.",
    )


class TransportSpec(SpecModel):
    """Limits of the messages between roles, and their compression."""

    chunk_bytes: int = Field(
        4 * 1024 * 1024,
        ge=64 * 1024,
        le=64 * 1024 * 1024,
        description="chunkBytes is the size of one gRPC message; tensors travel in chunks of "
        "this size. Default 4 MiB (4194304).",
    )
    max_message_bytes: int | None = Field(
        None,
        ge=1024 * 1024,
        le=1024**4,
        description="maxMessageBytes is the largest logical message (a whole model or upload) "
        "a role accepts; larger ones are rejected, and one party may have a role hold at most "
        "this many bytes of unfinished messages. Unset (default): derived from the model, "
        "32 float64 copies of its parameters plus 64 MiB (plus ebscfl's SRFC key matrices), "
        "at most 8 GiB.",
    )
    compression: CompressionSpec = Field(
        default_factory=CompressionSpec,
        description="compression of uploads and broadcasts (off by default).",
    )


def message_limit(spec: FederatedRunSpec, parameters: int) -> int:
    """The largest logical message the roles of a run accept.

    Args:
        spec: the run's spec; an explicit ``spec.transport.maxMessageBytes`` wins.
        parameters: how many scalars the run's model has (weights and buffers).

    Returns:
        ``maxMessageBytes`` when set; otherwise ``MODEL_COPIES`` float64 copies of the model
        plus ``MESSAGE_FLOOR_BYTES`` (plus, for ebscfl, room for its four widest SRFC key
        matrices, which the KDC sends the server), at most ``MESSAGE_CEILING_BYTES``.

    Raises:
        ValueError: ``parameters`` is negative.
    """
    explicit = spec.transport.max_message_bytes
    if explicit is not None:
        return explicit
    if parameters < 0:
        raise ValueError(f"A model has a non-negative number of parameters, got {parameters}.")
    extra = 0
    if spec.protocol.name == "ebscfl":
        options = spec.protocol.ebscfl
        sampled = min(spec.clients.sampled_per_round(), spec.clients.count)
        side = 2 * options.segment_length * options.clusters * sampled
        extra = 4 * side * side * 8
    derived = MESSAGE_FLOOR_BYTES + MODEL_COPIES * 8 * parameters + extra
    return min(derived, MESSAGE_CEILING_BYTES)

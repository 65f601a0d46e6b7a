"""How the roles behave while running: deadlines and retries, and message size limits."""

from __future__ import annotations

from pydantic import Field

from fedcore.spec._base import SpecModel


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


class TransportSpec(SpecModel):
    """Limits of the messages between roles."""

    chunk_bytes: int = Field(
        4 * 1024 * 1024,
        ge=64 * 1024,
        le=64 * 1024 * 1024,
        description="chunkBytes is the size of one gRPC message; tensors travel in chunks of "
        "this size. Default 4 MiB (4194304).",
    )
    max_message_bytes: int = Field(
        8 * 1024**3,
        ge=1024 * 1024,
        le=1024**4,
        description="maxMessageBytes is the largest logical message (a whole model or upload) "
        "a role accepts; larger ones are rejected. Default 8 GiB.",
    )

"""When and where the server saves exact-resume checkpoints: a local folder or S3."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedcore.spec._base import SpecModel


class LocalStoreSpec(SpecModel):
    """A checkpoint folder on a local or mounted file system."""

    path: str = Field(
        "checkpoints",
        min_length=1,
        description="path of the folder; '{name}' becomes the run's name. A relative path is "
        "taken from the run's folder (fedcore run: runs/<name>; a pod: its work volume). "
        "Default 'checkpoints'.",
    )


class S3StoreSpec(SpecModel):
    """A checkpoint prefix in S3 or any S3-compatible object store."""

    bucket: str = Field(
        min_length=3,
        max_length=63,
        pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$",
        description="bucket that holds the checkpoints; it must exist. Required.",
    )
    prefix: str = Field(
        "{name}/checkpoints",
        max_length=512,
        description="prefix of the run's keys; '{name}' becomes the run's name. Default "
        "'{name}/checkpoints'.",
    )
    endpoint: str | None = Field(
        None,
        pattern=r"^https?://[^\s/]+(/.*)?$",
        description="endpoint URL of an S3-compatible server (e.g. http://minio:9000); unset "
        "uses AWS.",
    )
    region: str = Field("us-east-1", min_length=1, description="region. Default us-east-1.")
    credentials_secret: str | None = Field(
        None,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="credentialsSecret names a Kubernetes Secret with AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY that the operator passes to the server, the KDC and a "
        "decentralized protocol's clients (each encrypts its own checkpoints with its own "
        "key; a site's clients never get it). Locally (and when unset) credentials come from "
        "the environment or an AWS profile.",
    )
    server_side_encryption: Literal["AES256", "aws:kms"] | None = Field(
        None,
        description="serverSideEncryption asks the server to encrypt every object: AES256 or "
        "aws:kms. Unset: the bucket's default.",
    )
    kms_key_id: str | None = Field(
        None, description="kmsKeyId is the KMS key for serverSideEncryption aws:kms."
    )
    retry_seconds: float = Field(
        120,
        gt=0,
        le=3600,
        description="retrySeconds is how long an unreachable or throttling store is retried "
        "(with backoff) before the checkpoint fails. Default 120.",
    )


class CheckpointSpec(SpecModel):
    """When and where the server saves an exact-resume checkpoint."""

    every_rounds: int = Field(
        5,
        ge=0,
        description="everyRounds saves after every k-th round and after the last. Default 5; "
        "0 turns checkpoints off.",
    )
    keep_last: int = Field(
        3, ge=1, le=1000, description="keepLast is how many recent checkpoints stay. Default 3."
    )
    keep_every: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="keepEvery also keeps, for good, every checkpoint whose round is a multiple "
        "of it (e.g. 50: rounds 50, 100, ...), besides the keepLast newest and any marked with "
        "`fedcore checkpoint mark`. Default 0: none.",
    )
    when_short_of_space: Literal["Skip", "Fail"] = Field(
        "Skip",
        description="whenShortOfSpace is what the server does when the checkpoint folder's "
        "disk has less free space than the checkpoint needs (known before writing; not for "
        "S3): Skip (default) leaves that checkpoint out, with a warning, an event and the "
        "failure metric, and tries again at the next one; Fail stops the run with reason "
        "CheckpointFailed. A write that fails anyway stops the run either way, its partial "
        "files removed.",
    )
    local: LocalStoreSpec = Field(
        default_factory=LocalStoreSpec,
        description="local is the checkpoint folder, used when s3 is unset.",
    )
    s3: S3StoreSpec | None = Field(
        None, description="s3 puts the checkpoints in S3 instead of the local folder."
    )

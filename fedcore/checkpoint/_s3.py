"""Checkpoint objects in S3 (or any S3-compatible server) through boto3."""

from __future__ import annotations

import builtins
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError

from fedcore.checkpoint._objects import ObjectStore
from fedcore.errors import CheckpointError

log = logging.getLogger(__name__)

AUTH_ERRORS = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "AuthorizationHeaderMalformed",
        "NoSuchBucket",
        "InvalidBucketName",
    }
)
"""Errors that no retry can fix: reported at once, never retried."""


class S3ObjectStore(ObjectStore):
    """Objects under ``prefix`` in ``bucket``.

    Transient failures (the endpoint unreachable, throttling, 5xx) are retried with exponential
    backoff and jitter for up to ``retry_seconds``; each failed attempt calls ``on_failure``
    (the checkpoint-failure metric). Wrong credentials or a missing bucket fail at once.

    Args:
        bucket: the bucket name.
        prefix: the key prefix of this run's objects (``/`` is added if missing).
        endpoint: the endpoint URL for S3-compatible servers; None for AWS.
        region: the region.
        server_side_encryption: ``AES256`` or ``aws:kms`` to ask the server to encrypt, or None.
        kms_key_id: the KMS key for ``aws:kms``.
        retry_seconds: how long transient failures are retried.
        client: a boto3 S3 client to use instead of building one (credentials come from the
            environment: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or a profile).
    """

    def __init__(
        self,
        bucket: str,
        *,
        prefix: str = "",
        endpoint: str | None = None,
        region: str = "us-east-1",
        server_side_encryption: str | None = None,
        kms_key_id: str | None = None,
        retry_seconds: float = 120.0,
        on_failure: Callable[[], None] | None = None,
        client: Any = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        self.endpoint = endpoint
        self.retry_seconds = retry_seconds
        self.on_failure = on_failure
        self._extra: dict[str, str] = {}
        if server_side_encryption:
            self._extra["ServerSideEncryption"] = server_side_encryption
            if kms_key_id:
                self._extra["SSEKMSKeyId"] = kms_key_id
        self.client = client or boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=region,
            config=Config(retries={"max_attempts": 1}, connect_timeout=5, read_timeout=60),
        )

    def describe(self) -> str:
        where = f" at {self.endpoint}" if self.endpoint else ""
        return f"s3://{self.bucket}/{self.prefix}{where}"

    def check(self) -> None:
        """Checks that the bucket is reachable with these credentials.

        Raises:
            CheckpointError: naming the bucket and the server's reason.
        """
        self._retry(
            "check access to",
            "",
            lambda: self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1),
        )

    def put(self, key: str, data: bytes) -> None:
        self._retry(
            "write",
            key,
            lambda: self.client.put_object(
                Bucket=self.bucket, Key=self.prefix + key, Body=data, **self._extra
            ),
        )

    def get(self, key: str) -> bytes:
        def read() -> bytes:
            response = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)
            return bytes(response["Body"].read())

        result: bytes = self._retry("read", key, read)
        return result

    def list(self, prefix: str) -> builtins.list[str]:
        def listing() -> builtins.list[str]:
            keys: builtins.list[str] = []
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                keys.extend(item["Key"][len(self.prefix) :] for item in page.get("Contents", []))
            return sorted(keys)

        result: builtins.list[str] = self._retry("list", prefix, listing)
        return result

    def delete(self, keys: builtins.list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self.prefix + key} for key in keys[start : start + 1000]]
            self._delete_batch(batch)

    def _delete_batch(self, batch: builtins.list[dict[str, str]]) -> None:
        if batch:
            self._retry(
                "delete",
                batch[0]["Key"],
                lambda: self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                ),
            )

    def _retry(self, action: str, key: str, call: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + self.retry_seconds
        bound = 0.2
        while True:
            try:
                return call()
            except ClientError as exc:
                error = exc.response.get("Error", {})
                code = str(error.get("Code", "Unknown"))
                if code == "NoSuchKey" or code == "404":
                    raise CheckpointError(
                        f"Cannot {action} {self.describe()}{key}: the object does not exist."
                    ) from exc
                if code in AUTH_ERRORS:
                    raise CheckpointError(
                        f"Cannot {action} {self.describe()}{key}: the server answered {code} "
                        f"({error.get('Message', '')}); check the bucket and the credentials "
                        f"(spec.checkpoint.s3)."
                    ) from exc
                failure: Exception = exc
            except (EndpointConnectionError, BotoCoreError, OSError) as exc:
                failure = exc
            if self.on_failure is not None:
                self.on_failure()
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckpointError(
                    f"Cannot {action} {self.describe()}{key} after retrying for "
                    f"{self.retry_seconds:.0f} s: {failure}"
                ) from failure
            delay = min(random.uniform(0, bound), left)
            log.warning("S3 %s of %s failed (%s); retrying in %.2f s.", action, key, failure, delay)
            time.sleep(delay)
            bound = min(bound * 2, 5.0)

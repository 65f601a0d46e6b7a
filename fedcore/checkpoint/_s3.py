"""Checkpoint objects in S3 (or any S3-compatible server) through boto3.

Large objects travel in parts: a write is a multipart upload whose parts are cut from the
stream as it comes (at most ``threads`` parts in memory, each retried on its own), and a read
fills one preallocated buffer with ranged GETs in parallel. A 1 GB checkpoint therefore needs
about ``threads x part_bytes`` of memory beyond the model itself, not several copies of it.
"""

from __future__ import annotations

import builtins
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError

from fedcore.checkpoint._objects import ObjectStore, _size_message
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

PERMANENT_ERRORS = frozenset(
    {
        "InvalidRange",
        "InvalidArgument",
        "InvalidRequest",
        "InvalidPart",
        "InvalidPartOrder",
        "EntityTooSmall",
        "EntityTooLarge",
        "MalformedXML",
        "MethodNotAllowed",
        "NoSuchUpload",
        "KMS.NotFoundException",
    }
)
"""Answers about the request itself: retrying the same request cannot help."""

MISSING = frozenset({"NoSuchKey", "404", "NotFound"})

PART_BYTES = 16 * 1024 * 1024
"""The size of one part of a multipart upload and of one ranged GET (S3's minimum is 5 MiB)."""
THREADS = 4
"""Parts uploaded or downloaded at once."""
READ_CHUNK = 1024 * 1024


class S3Refused(CheckpointError):
    """The server refused a request in a way no retry can fix; ``code`` is its error code."""

    def __init__(self, message: str, *, code: str) -> None:
        self.code = code
        super().__init__(message)


class S3ObjectStore(ObjectStore):
    """Objects under ``prefix`` in ``bucket``.

    Transient failures (the endpoint unreachable, throttling, 5xx) are retried with exponential
    backoff and jitter for up to ``retry_seconds`` per request; each failed attempt calls
    ``on_failure`` (the checkpoint-failure metric). Wrong credentials, a missing bucket or a
    malformed request fail at once.

    Args:
        bucket: the bucket name.
        prefix: the key prefix of this run's objects (``/`` is added if missing).
        endpoint: the endpoint URL for S3-compatible servers; None for AWS.
        region: the region.
        server_side_encryption: ``AES256`` or ``aws:kms`` to ask the server to encrypt, or None.
        kms_key_id: the KMS key for ``aws:kms``.
        retry_seconds: how long transient failures of one request are retried.
        on_failure: called once per failed attempt.
        client: a boto3 S3 client to use instead of building one (credentials come from the
            environment: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or a profile).
        part_bytes: the part size of multipart uploads and ranged reads.
        threads: how many parts travel at once.
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
        part_bytes: int = PART_BYTES,
        threads: int = THREADS,
    ) -> None:
        if part_bytes < 5 * 1024 * 1024:
            raise ValueError(f"part_bytes must be at least 5 MiB (S3's minimum), not {part_bytes}.")
        self.bucket = bucket
        self.prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        self.endpoint = endpoint
        self.region = region
        self.retry_seconds = retry_seconds
        self.on_failure = on_failure
        self.part_bytes = part_bytes
        self.threads = max(1, threads)
        self.server_side_encryption = server_side_encryption
        self.kms_key_id = kms_key_id
        self._extra: dict[str, str] = {}
        if server_side_encryption:
            self._extra["ServerSideEncryption"] = server_side_encryption
            if kms_key_id:
                self._extra["SSEKMSKeyId"] = kms_key_id
        # A session of its own: boto3's default session caches the first credentials it
        # resolves for the life of the process (a later change of the environment is ignored).
        self.client = client or boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint,
            region_name=region,
            config=Config(
                retries={"max_attempts": 1},
                connect_timeout=5,
                read_timeout=60,
                max_pool_connections=max(10, 2 * self.threads),
            ),
        )

    def describe(self) -> str:
        where = f" at {self.endpoint}" if self.endpoint else ""
        return f"s3://{self.bucket}/{self.prefix}{where}"

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"

    def child(self, name: str) -> S3ObjectStore:
        """Returns the store of the sub-prefix ``name/`` (same bucket, client and settings)."""
        return S3ObjectStore(
            self.bucket,
            prefix=f"{self.prefix}{name.strip('/')}/",
            endpoint=self.endpoint,
            region=self.region,
            server_side_encryption=self.server_side_encryption,
            kms_key_id=self.kms_key_id,
            retry_seconds=self.retry_seconds,
            on_failure=self.on_failure,
            client=self.client,
            part_bytes=self.part_bytes,
            threads=self.threads,
        )

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

    # ------------------------------------------------------------------------ writes

    def put(self, key: str, data: bytes) -> None:
        self._retry(
            "write",
            key,
            lambda: self.client.put_object(
                Bucket=self.bucket, Key=self.prefix + key, Body=data, **self._extra
            ),
        )

    def put_stream(self, key: str, chunks: Iterable[bytes | memoryview]) -> int:
        """Writes the chunks as one object: a single PUT when small, else a multipart upload.

        Raises:
            CheckpointError: a part failed after its retries; the upload is aborted and any
                previous object under ``key`` is intact.
        """
        upload = _MultipartUpload(self, key)
        pending: list[memoryview] = []
        filled = 0
        total = 0
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                total += len(view)
                while len(view):
                    take = min(len(view), self.part_bytes - filled)
                    pending.append(view[:take])
                    filled += take
                    view = view[take:]
                    if filled == self.part_bytes:
                        upload.add(b"".join(pending))
                        pending, filled = [], 0
            if not upload.started:
                self.put(key, b"".join(pending))
                return total
            if filled:
                upload.add(b"".join(pending))
            upload.complete(total)
        except BaseException:
            upload.abort()
            raise
        return total

    # ------------------------------------------------------------------------- reads

    def get(self, key: str) -> bytes:
        def read() -> bytes:
            response = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)
            return bytes(response["Body"].read())

        result: bytes = self._retry("read", key, read)
        return result

    def read_exact(self, key: str, size: int) -> bytearray:
        """Reads the object into a new buffer with ranged GETs in parallel.

        Raises:
            CheckpointError: the object is missing, unreadable or not ``size`` bytes long.
        """
        if size == 0:
            data = self.get(key)
            if data:
                raise CheckpointError(_size_message(key, len(data), 0))
            return bytearray()
        buffer = bytearray(size)
        view = memoryview(buffer)
        cancel = threading.Event()

        def fetch(begin: int, end: int) -> None:
            def once() -> None:
                response = self.client.get_object(
                    Bucket=self.bucket, Key=self.prefix + key, Range=f"bytes={begin}-{end - 1}"
                )
                body = response["Body"]
                try:
                    found = _object_size(response, requested=end - begin)
                    if found != size:
                        raise CheckpointError(_size_message(key, found, size))
                    position = begin
                    for chunk in body.iter_chunks(READ_CHUNK):
                        if position + len(chunk) > end:
                            raise CheckpointError(_size_message(key, position + len(chunk), size))
                        view[position : position + len(chunk)] = chunk
                        position += len(chunk)
                    if position != end:
                        raise OSError(f"the body ended after {position - begin} bytes")
                finally:
                    body.close()

            self._retry("read", key, once, cancel=cancel)

        ranges = [
            (start, min(start + self.part_bytes, size)) for start in range(0, size, self.part_bytes)
        ]
        if len(ranges) == 1:
            fetch(*ranges[0])
            return buffer
        with futures.ThreadPoolExecutor(self.threads, thread_name_prefix="s3-read") as pool:
            running = [pool.submit(fetch, begin, end) for begin, end in ranges]
            try:
                for future in futures.as_completed(running):
                    future.result()
            except BaseException:
                cancel.set()
                for future in running:
                    future.cancel()
                raise
        return buffer

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

    # ------------------------------------------------------------------------ retries

    def _retry(
        self,
        action: str,
        key: str,
        call: Callable[[], Any],
        *,
        cancel: threading.Event | None = None,
    ) -> Any:
        """Runs ``call``, retrying transient failures with backoff for ``retry_seconds``.

        Raises:
            CheckpointError: a permanent failure (at once) or a transient one that outlasted
                the retries (naming how long and how many attempts).
        """
        deadline = time.monotonic() + self.retry_seconds
        bound = 0.2
        attempts = 0
        while True:
            attempts += 1
            try:
                return call()
            except ClientError as exc:
                error = exc.response.get("Error", {})
                code = str(error.get("Code", "Unknown"))
                where = f"{self.describe()}{key}"
                if code in MISSING:
                    raise S3Refused(
                        f"Cannot {action} {where}: the object does not exist.", code=code
                    ) from exc
                if code in AUTH_ERRORS:
                    raise S3Refused(
                        f"Cannot {action} {where}: the server answered {code} "
                        f"({error.get('Message', '')}); check the bucket and the credentials "
                        f"(spec.checkpoint.s3).",
                        code=code,
                    ) from exc
                if code in PERMANENT_ERRORS:
                    raise S3Refused(
                        f"Cannot {action} {where}: the server answered {code} "
                        f"({error.get('Message', '')}).",
                        code=code,
                    ) from exc
                failure: Exception = exc
            except (EndpointConnectionError, BotoCoreError, OSError) as exc:
                failure = exc
            if self.on_failure is not None:
                self.on_failure()
            left = deadline - time.monotonic()
            if left <= 0 or (cancel is not None and cancel.is_set()):
                raise CheckpointError(
                    f"Cannot {action} {self.describe()}{key} after retrying for "
                    f"{self.retry_seconds:g} s ({attempts} attempts; "
                    f"spec.checkpoint.s3.retrySeconds): {failure}"
                ) from failure
            delay = min(random.uniform(0, bound), left)
            log.warning("S3 %s of %s failed (%s); retrying in %.2f s.", action, key, failure, delay)
            if cancel is not None:
                cancel.wait(delay)
            else:
                time.sleep(delay)
            bound = min(bound * 2, 5.0)


class _MultipartUpload:
    """One multipart upload, started on its first part; parts go up ``threads`` at a time."""

    def __init__(self, store: S3ObjectStore, key: str) -> None:
        self.store = store
        self.key = key
        self.upload_id: str | None = None
        self.parts: dict[int, str] = {}
        self.count = 0
        self.running: set[futures.Future[None]] = set()
        self.cancel = threading.Event()
        self.pool: futures.ThreadPoolExecutor | None = None

    @property
    def started(self) -> bool:
        return self.upload_id is not None

    def add(self, data: bytes) -> None:
        """Queues one part, waiting while ``threads`` parts are already in flight."""
        store = self.store
        if self.upload_id is None:
            answer = store._retry(
                "start the upload of",
                self.key,
                lambda: store.client.create_multipart_upload(
                    Bucket=store.bucket, Key=store.prefix + self.key, **store._extra
                ),
            )
            self.upload_id = str(answer["UploadId"])
            self.pool = futures.ThreadPoolExecutor(store.threads, thread_name_prefix="s3-part")
        while len(self.running) >= store.threads:
            done, _ = futures.wait(self.running, return_when=futures.FIRST_COMPLETED)
            self._collect(done)
        self.count += 1
        assert self.pool is not None
        self.running.add(self.pool.submit(self._upload_part, self.count, data))

    def _upload_part(self, number: int, data: bytes) -> None:
        store = self.store
        answer = store._retry(
            f"write part {number} of",
            self.key,
            lambda: store.client.upload_part(
                Bucket=store.bucket,
                Key=store.prefix + self.key,
                UploadId=self.upload_id,
                PartNumber=number,
                Body=data,
            ),
            cancel=self.cancel,
        )
        self.parts[number] = str(answer["ETag"])

    def _collect(self, done: set[futures.Future[None]]) -> None:
        for future in done:
            self.running.discard(future)
            future.result()  # raises the part's CheckpointError

    def complete(self, total: int) -> None:
        """Waits for every part, publishes the object, then checks its size.

        Raises:
            CheckpointError: the completion failed, or the store assembled another size.
        """
        store = self.store
        self._collect(set(futures.wait(self.running).done))
        if sorted(self.parts) != list(range(1, self.count + 1)):
            raise CheckpointError(f"The upload of {self.key} lost track of its parts.")
        parts = [{"ETag": tag, "PartNumber": n} for n, tag in sorted(self.parts.items())]
        try:
            store._retry(
                "complete the upload of",
                self.key,
                lambda: store.client.complete_multipart_upload(
                    Bucket=store.bucket,
                    Key=store.prefix + self.key,
                    UploadId=self.upload_id,
                    MultipartUpload={"Parts": parts},
                ),
            )
        except S3Refused as exc:
            # A retried completion whose first try did succeed answers NoSuchUpload.
            if exc.code != "NoSuchUpload" or self._size() != total:
                raise
        self.upload_id = None  # published: nothing to abort any more
        self._close()
        size = store._retry("check", self.key, self._head_size)
        if size != total:
            raise CheckpointError(
                f"The store assembled {store.describe()}{self.key} as {size} bytes, not {total}."
            )

    def _head_size(self) -> int:
        store = self.store
        head = store.client.head_object(Bucket=store.bucket, Key=store.prefix + self.key)
        return int(head["ContentLength"])

    def _size(self) -> int | None:
        try:
            return self._head_size()
        except (ClientError, BotoCoreError, OSError):
            return None

    def abort(self) -> None:
        """Stops the parts in flight and aborts the upload (best effort: one try)."""
        self.cancel.set()
        for future in self.running:
            future.cancel()
        self._close()
        if self.upload_id is None:
            return
        store = self.store
        try:
            store.client.abort_multipart_upload(
                Bucket=store.bucket, Key=store.prefix + self.key, UploadId=self.upload_id
            )
        except (ClientError, BotoCoreError, OSError) as exc:
            log.warning(
                "Could not abort the multipart upload of %s (%s); a bucket lifecycle rule "
                "(AbortIncompleteMultipartUpload) removes its parts.",
                self.key,
                exc,
            )
        self.upload_id = None

    def _close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


def _object_size(response: dict[str, Any], *, requested: int) -> int:
    """The whole object's size from a ranged GET's answer.

    Raises:
        CheckpointError: the server ignored the range on an object of another size.
    """
    content_range = response.get("ContentRange")
    if content_range:
        return int(str(content_range).rsplit("/", 1)[1])
    length = int(response.get("ContentLength", -1))
    if length != requested:
        raise CheckpointError("The S3 server ignored a ranged read (no Content-Range).")
    return length

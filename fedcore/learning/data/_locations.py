"""Where one client's own files are: a folder on its machine (or a mounted claim), or an S3
prefix read with the client's own credentials.

A location lists its files (name, size and version: what keys the data cache) and hands each
one to a reader as a local path: a folder's file as it is, an S3 object downloaded into a
temporary file next to the cache and deleted once read, so that a client never holds more than
one object of its source on disk outside the cache, and never in memory.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fedcore.errors import DataError
from fedcore.spec._data import ClientSourceSpec, S3SourceSpec

DATA_DIR_ENV = "FEDCORE_DATA_DIR"
"""Where a client's pod has its PersistentVolumeClaim mounted (set by the operator)."""

DATA_CREDENTIALS_ENV = "FEDCORE_DATA_CREDENTIALS_DIR"
"""Where a client's pod has its S3 credentials Secret mounted (set by the operator)."""

ACCESS_KEY_FILE = "AWS_ACCESS_KEY_ID"
SECRET_KEY_FILE = "AWS_SECRET_ACCESS_KEY"
SESSION_TOKEN_FILE = "AWS_SESSION_TOKEN"


@dataclass(frozen=True)
class SourceFile:
    """One file of a location.

    Attributes:
        name: its path relative to the location, with '/' separators.
        size: its size in bytes.
        version: what changes when its content does (a modification time, an ETag).
        address: where the location fetches it from (an S3 object's key); empty for a folder.
    """

    name: str
    size: int
    version: str
    address: str = ""


class Location(Protocol):
    """The files of one client's source."""

    where: str
    """The location as messages name it (a path, ``s3://bucket/prefix``); never a secret."""

    def key(self) -> dict[str, Any]:
        """What identifies the location in the data cache's key."""
        ...

    def files(self) -> list[SourceFile]:
        """Every file, sorted by name.

        Raises:
            DataError: the location cannot be listed.
        """
        ...

    def local(self, file: SourceFile) -> contextlib.AbstractContextManager[Path]:
        """A local path holding ``file``'s bytes, valid inside the context.

        Raises:
            DataError: the file cannot be fetched.
        """
        ...


class FolderLocation:
    """A folder (or one file) on this machine; hidden files and folders are skipped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = str(path)

    def key(self) -> dict[str, Any]:
        return {"path": str(self.path.resolve())}

    def files(self) -> list[SourceFile]:
        path = self.path
        try:
            if path.is_file():
                stat = path.stat()
                return [SourceFile(path.name, stat.st_size, str(stat.st_mtime_ns))]
            if not path.is_dir():
                raise DataError(f"{path} is neither a folder nor a file.")
            found = []
            for folder, names, files in os.walk(path):
                names[:] = sorted(name for name in names if not name.startswith("."))
                for name in files:
                    if name.startswith("."):
                        continue
                    full = Path(folder) / name
                    stat = full.stat()
                    relative = full.relative_to(path).as_posix()
                    found.append(SourceFile(relative, stat.st_size, str(stat.st_mtime_ns)))
        except OSError as exc:
            raise DataError(f"{path} cannot be listed: {exc.strerror or exc}.") from exc
        return sorted(found, key=lambda file: file.name)

    @contextlib.contextmanager
    def local(self, file: SourceFile) -> Iterator[Path]:
        yield self.path if self.path.is_file() else self.path / file.name


class S3Location:
    """An S3 prefix, read with credentials that belong to this client alone.

    The credentials come from files named like the variables (``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, optionally ``AWS_SESSION_TOKEN``): in a pod, the Secret the
    operator mounted into this client's pod (``$FEDCORE_DATA_CREDENTIALS_DIR``); in a local run,
    ``credentialsPath``. Without either, boto3's default chain (the environment, a profile, a
    workload identity). They are never logged.
    """

    def __init__(self, spec: S3SourceSpec, scratch: Path | None) -> None:
        self.spec = spec
        self.prefix = spec.prefix or ""
        self.where = f"s3://{spec.bucket}/{self.prefix}"
        self.scratch = scratch
        self._client: Any = None

    def key(self) -> dict[str, Any]:
        return {
            "endpoint": self.spec.endpoint,
            "bucket": self.spec.bucket,
            "prefix": self.prefix,
        }

    def client(self) -> Any:
        """The boto3 client, made on first use."""
        if self._client is None:
            import boto3
            from botocore.config import Config

            # A session of its own: boto3's default session caches the credentials it first
            # resolves, which would then be shared by every client of this process.
            self._client = boto3.session.Session().client(
                "s3",
                endpoint_url=self.spec.endpoint,
                region_name=self.spec.region,
                config=Config(retries={"max_attempts": 5, "mode": "standard"}),
                **_credentials(self.spec),
            )
        return self._client

    def files(self) -> list[SourceFile]:
        found = []
        try:
            pages = self.client().get_paginator("list_objects_v2")
            for page in pages.paginate(Bucket=self.spec.bucket, Prefix=self.prefix):
                for item in page.get("Contents", []):
                    key = str(item["Key"])
                    name = key[len(self.prefix) :].lstrip("/")
                    if not name or key.endswith("/") or _hidden(name):
                        continue
                    etag = str(item.get("ETag", ""))
                    found.append(SourceFile(name, int(item["Size"]), etag, key))
        except Exception as exc:  # botocore's errors, a refused connection, bad credentials
            raise DataError(f"{self.where} cannot be listed: {_s3_problem(exc)}") from exc
        return sorted(found, key=lambda file: file.name)

    @contextlib.contextmanager
    def local(self, file: SourceFile) -> Iterator[Path]:
        key = file.address
        suffix = "".join(Path(file.name).suffixes[-2:])
        handle, name = tempfile.mkstemp(prefix=".s3-", suffix=suffix, dir=self.scratch)
        os.close(handle)
        path = Path(name)
        try:
            try:
                self.client().download_file(self.spec.bucket, key, str(path))
            except Exception as exc:
                raise DataError(
                    f"s3://{self.spec.bucket}/{key} cannot be read: {_s3_problem(exc)}"
                ) from exc
            yield path
        finally:
            path.unlink(missing_ok=True)


def _hidden(name: str) -> bool:
    return any(part.startswith(".") for part in name.split("/"))


def _credentials(spec: S3SourceSpec) -> dict[str, str]:
    """The client's own keys, read from its credentials folder (none: boto3's chain)."""
    mounted = os.environ.get(DATA_CREDENTIALS_ENV)
    folder = Path(mounted) if mounted else None
    if folder is None and spec.credentials_path is not None:
        folder = Path(spec.credentials_path)
    if folder is None:
        return {}
    keys: dict[str, str] = {}
    for file, argument in (
        (ACCESS_KEY_FILE, "aws_access_key_id"),
        (SECRET_KEY_FILE, "aws_secret_access_key"),
        (SESSION_TOKEN_FILE, "aws_session_token"),
    ):
        try:
            keys[argument] = (folder / file).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            if file != SESSION_TOKEN_FILE:
                raise DataError(
                    f"The S3 credentials folder {folder} has no file {file} (it needs "
                    f"{ACCESS_KEY_FILE} and {SECRET_KEY_FILE})."
                ) from None
        except OSError as exc:
            raise DataError(
                f"The S3 credentials file {folder / file} cannot be read: {exc.strerror}."
            ) from exc
    return keys


def _s3_problem(exc: Exception) -> str:
    """What went wrong with an S3 call, in words that hold no secret."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error") or {}
        code = error.get("Code", "")
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
            return f"access denied ({code}): these credentials may not read it"
        if code in ("NoSuchBucket", "NoSuchKey", "404"):
            return f"it does not exist ({code})"
        return f"{code or type(exc).__name__}: {error.get('Message', '')}".strip()
    return f"{type(exc).__name__}: {exc}"


def open_location(source: ClientSourceSpec, index: int, scratch: Path | None) -> Location:
    """The location of client ``index``'s source (its '{index}' already replaced).

    Raises:
        DataError: a PersistentVolumeClaim outside a pod that mounts it.
    """
    if source.s3 is not None:
        return S3Location(source.s3, scratch)
    if source.volume_claim is not None:
        mounted = os.environ.get(DATA_DIR_ENV)
        if not mounted:
            raise DataError(
                f"Client {index}'s data is the PersistentVolumeClaim "
                f"{source.volume_claim.claim_name!r}, which only the operator mounts (into "
                f"this client's pod); fedcore run reads spec.data.clientData path sources."
            )
        return FolderLocation(Path(mounted))
    assert source.path is not None
    return FolderLocation(Path(source.path))

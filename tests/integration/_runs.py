"""Helpers for the end-to-end tests: small manifests and a way to run them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

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


def last_json(stdout: str) -> dict[str, Any]:
    """Returns the JSON object on stdout's last line."""
    return json.loads(stdout.strip().splitlines()[-1])

"""A real Prometheus for the integration tests: the binaries, a scraping server, its HTTP API."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedcore.local.ports import free_port

MISSING = (
    "The {name} binary is missing: run `bash hack/testenv.sh` (it installs Debian's prometheus "
    "package, which holds prometheus and promtool), or use `bash hack/test.sh`, which does."
)


def prometheus_binary() -> str:
    """Returns the path of ``prometheus``, or fails with how to install it."""
    found = shutil.which("prometheus")
    if found is None:
        raise AssertionError(MISSING.format(name="prometheus"))
    return found


def promtool_binary() -> str:
    """Returns the path of ``promtool``, or fails with how to install it."""
    found = shutil.which("promtool")
    if found is None:
        raise AssertionError(MISSING.format(name="promtool"))
    return found


def get_json(url: str) -> dict[str, Any]:
    """GETs a URL and decodes its JSON body."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def api(port: int, path: str, **params: str | Sequence[str]) -> dict[str, Any]:
    """Calls ``/api/v1/<path>`` of the Prometheus on ``port``; returns the whole JSON answer.

    A PromQL error comes back as HTTP 400 with a JSON body, which is returned, not raised.
    """
    url = f"http://127.0.0.1:{port}/api/v1/{path}?" + urllib.parse.urlencode(params, doseq=True)
    try:
        return get_json(url)
    except urllib.error.HTTPError as exc:
        if exc.code in (400, 422):
            return json.loads(exc.read())
        raise


def query(port: int, promql: str) -> list[dict[str, Any]]:
    """Returns the instant result of a PromQL query (raises KeyError when it fails)."""
    return api(port, "query", query=promql)["data"]["result"]


@contextmanager
def running_prometheus(
    folder: Path, targets: Sequence[str] | Mapping[str, Mapping[str, str]]
) -> Iterator[int]:
    """Runs Prometheus scraping ``targets`` every second; yields its port, then stops it.

    Args:
        folder: where its config, TSDB and log go (``prometheus.log``).
        targets: ``host:port`` of every ``/metrics`` endpoint (job ``fedcore``), or a mapping
            from each to the target labels Prometheus adds to its series, as Kubernetes service
            discovery would (e.g. ``namespace`` and ``pod``).
    """
    binary = prometheus_binary()
    port = free_port()
    config = folder / "prom.yml"
    if isinstance(targets, Mapping):
        static = [{"targets": [t], "labels": dict(labels)} for t, labels in targets.items()]
    else:
        static = [{"targets": list(targets)}]
    config.write_text(
        json.dumps(
            {
                "global": {"scrape_interval": "1s", "scrape_timeout": "900ms"},
                "scrape_configs": [{"job_name": "fedcore", "static_configs": static}],
            }
        )
    )
    with (folder / "prometheus.log").open("wb") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={folder / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:
        yield port
    finally:
        process.terminate()
        process.wait(30)


def log_tail(folder: Path, chars: int = 2000) -> str:
    """The end of the log of the Prometheus that ran in ``folder``."""
    path = folder / "prometheus.log"
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def poll(check: Callable[[], bool], timeout: float, interval: float = 0.5) -> bool:
    """Calls ``check`` until it returns True (True) or ``timeout`` seconds pass (False).

    An OSError (Prometheus not listening yet) counts as not yet.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return True
        except OSError:
            pass
        time.sleep(interval)
    return False

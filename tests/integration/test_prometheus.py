"""A real Prometheus scrapes every role of a running `fedcore run`."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from fedcore.runner import LocalRun, free_port
from fedcore.spec import load_manifest
from tests.integration._runs import write_manifest
from tests.integration.test_local_run import wait_for_event

pytestmark = pytest.mark.integration


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        raise AssertionError(
            "The prometheus binary is missing: run `bash hack/testenv.sh` (it installs Debian's "
            "prometheus package), or use `bash hack/test.sh`, which does."
        )
    return found


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    return get_json(url)["data"]["result"]


def test_prometheus_scrapes_server_and_clients_of_a_local_run(tmp_path: Path) -> None:
    # Prepare
    binary = prometheus_binary()
    manifest = write_manifest(
        tmp_path / "run.yaml", rounds=100_000, clients={"count": 2}, checkpoint={"everyRounds": 0}
    )
    run = LocalRun(load_manifest(manifest), manifest, workdir=tmp_path / "work")
    prom_port = free_port()
    prometheus = None
    try:
        run.start()
        wait_for_event(run, "round", round=1)
        targets = [f"127.0.0.1:{port}" for port in run.metrics_ports.values()]
        config = tmp_path / "prom.yml"
        config.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": "1s", "scrape_timeout": "900ms"},
                    "scrape_configs": [
                        {"job_name": "fedcore", "static_configs": [{"targets": targets}]}
                    ],
                }
            )
        )
        prometheus = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "prometheus.log").open("wb"),
        )
        # Execute: poll until every target is up and the counters have been scraped.
        deadline = time.monotonic() + 90
        up: list[dict] = []
        rounds: list[dict] = []
        while time.monotonic() < deadline:
            try:
                up = query(prom_port, 'up{job="fedcore"} == 1')
                rounds = query(prom_port, 'fedcore_rounds_completed_total{role="server"} > 0')
            except OSError:
                pass
            if len(up) == 3 and rounds:
                break
            time.sleep(0.5)
        clients = query(prom_port, 'fedcore_round{role="client"}')
        builds = query(prom_port, "fedcore_build_info")
        received = query(prom_port, 'fedcore_bytes_received_total{role="server"} > 0')
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(30)
        run.stop()
    # Assert
    assert len(up) == 3, (tmp_path / "prometheus.log").read_text()[-2000:]
    assert rounds and rounds[0]["metric"]["run"] == "e2e"
    assert sorted(r["metric"]["role"] for r in builds) == ["client", "client", "server"]
    assert len(clients) == 2 and all(float(r["value"][1]) >= 1 for r in clients)
    assert received

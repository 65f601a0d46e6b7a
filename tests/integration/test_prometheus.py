"""A real Prometheus scrapes every role of a running `fedcore run`."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedcore.local.runner import LocalRun
from fedcore.spec import load_manifest
from tests.integration._prometheus import log_tail, poll, query, running_prometheus
from tests.integration._runs import write_manifest
from tests.integration.test_local_run import wait_for_event

pytestmark = pytest.mark.integration


def test_prometheus_scrapes_server_and_clients_of_a_local_run(tmp_path: Path) -> None:
    # Prepare
    manifest = write_manifest(
        tmp_path / "run.yaml", rounds=100_000, clients={"count": 2}, checkpoint={"everyRounds": 0}
    )
    run = LocalRun(load_manifest(manifest), manifest, workdir=tmp_path / "work")
    found: dict[str, list[dict]] = {}
    try:
        run.start()
        wait_for_event(run, "round", round=1)
        targets = [f"127.0.0.1:{port}" for port in run.metrics_ports.values()]
        with running_prometheus(tmp_path, targets) as prom_port:

            def scraped() -> bool:
                found["up"] = query(prom_port, 'up{job="fedcore"} == 1')
                found["rounds"] = query(
                    prom_port, 'fedcore_rounds_completed_total{role="server"} > 0'
                )
                return len(found["up"]) == 3 and bool(found["rounds"])

            # Execute: poll until every target is up and the counters have been scraped.
            poll(scraped, timeout=90)
            clients = query(prom_port, 'fedcore_round{role="client"}')
            builds = query(prom_port, "fedcore_build_info")
            received = query(prom_port, 'fedcore_bytes_received_total{role="server"} > 0')
    finally:
        run.stop()
    # Assert
    assert len(found.get("up", [])) == 3, log_tail(tmp_path)
    assert found["rounds"] and found["rounds"][0]["metric"]["run"] == "e2e"
    assert sorted(r["metric"]["role"] for r in builds) == ["client", "client", "server"]
    assert len(clients) == 2 and all(float(r["value"][1]) >= 1 for r in clients)
    assert received

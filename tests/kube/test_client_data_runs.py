"""Clients' own data on Kubernetes: each hospital's PersistentVolumeClaim is mounted into its own
client pod only, the server holds no data, and the run's result equals the same run on one
machine."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedcore.simulation import simulate
from fedcore.spec import parse_manifest
from tests.kube._operator import OperatorProcess, install_crd, running_operator, wait_for_run
from tests.kube.cluster import ControlPlane
from tests.kube.kubelet import FakeKubelet
from tests.kube.test_operator_runs import debug, listed, phase_is

ROOT = Path(__file__).resolve().parents[2]
SITES = 3


@pytest.fixture
def operator(
    control_plane: ControlPlane, kubelet: FakeKubelet, tmp_path: Path
) -> Iterator[OperatorProcess]:
    install_crd(control_plane)
    with running_operator(control_plane, tmp_path / "operator", webhook=False) as op:
        yield op


def hospitals_run(name: str, data: dict[str, Any]) -> dict[str, Any]:
    """The hospitals example with plain FedAvg (deterministic) over three sites."""
    manifest = yaml.safe_load((ROOT / "examples" / "hospitals-tabular.yaml").read_text())
    manifest["metadata"]["name"] = name
    spec = manifest["spec"]
    spec["protocol"] = {"name": "fedavg"}
    spec.pop("privacy")
    spec["rounds"] = 3
    spec["clients"] = {"count": SITES}
    spec["data"]["clientData"] = data
    spec["checkpoint"] = {"everyRounds": 0}
    spec["failurePolicy"] = {"connectTimeoutSeconds": 120}
    return manifest


def bound_claim(plane: ControlPlane, namespace: str, claim: str) -> None:
    """A PersistentVolumeClaim bound to a volume made for it (the fake kubelet gives a claim a
    folder of its own: workdir/pvc/<namespace>/<claim>)."""
    volume = f"{namespace}-{claim}"
    objects = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "hostPath": {"path": f"/srv/{volume}"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]
    for item in objects:
        plane.kubectl("apply", "-f", "-", input=json.dumps(item))


def test_each_client_reads_its_own_claim_and_the_run_equals_one_machines(
    control_plane: ControlPlane,
    kubelet: FakeKubelet,
    operator: OperatorProcess,
    namespace: str,
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_data.py"), "--out", str(data)],
        check=True,
        capture_output=True,
    )
    for site in range(SITES):
        claim = f"hospital-{site}"
        bound_claim(control_plane, namespace, claim)
        folder = kubelet.workdir / "pvc" / namespace / claim / "records"
        shutil.copytree(data / "hospitals" / f"hospital-{site}", folder)
    run = hospitals_run(
        "hospitals",
        {
            "format": "Parquet",
            "template": {"volumeClaim": {"claimName": "hospital-{index}", "subPath": "records"}},
        },
    )
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(run))
    finished = wait_for_run(
        control_plane,
        namespace,
        "hospitals",
        phase_is("Succeeded", "Failed"),
        timeout=240,
        what="end",
        debug=debug(control_plane, kubelet, operator, namespace, "hospitals"),
    )
    status = finished["status"]
    assert status["phase"] == "Succeeded", status
    local = hospitals_run(
        "hospitals",
        {
            "format": "Parquet",
            "template": {"path": str(data / "hospitals" / "hospital-{index}")},
        },
    )
    expected = simulate(parse_manifest(local))
    final = status["finalMetrics"]
    assert final["accuracy"] == expected.accuracy
    assert sum(entry["total"] for entry in final["perClass"]) == final["evaluatedExamples"]
    pods = {pod["metadata"]["name"]: pod for pod in listed(control_plane, namespace, "pods")}
    for site in range(SITES):
        pod = pods.get(f"hospitals-client-{site}")
        if pod is None:  # finished clients may be gone; the server pod stays
            continue
        claims = [
            volume["persistentVolumeClaim"]
            for volume in pod["spec"]["volumes"]
            if "persistentVolumeClaim" in volume
        ]
        assert claims == [{"claimName": f"hospital-{site}", "readOnly": True}]
    server = pods["hospitals-server"]
    assert not any("persistentVolumeClaim" in volume for volume in server["spec"]["volumes"])
    assert "Parsed the data source" not in kubelet.log_of(namespace, "hospitals-server")

"""A user's first steps on a real node: `helm install` the chart, `kubectl apply` the quickstart.

The operator runs from its built image, reconciles the FederatedRun into KDC, server and client
pods that run the built runtime image in real containers, and the run must end as
`fedcore run` ends the same manifest on this machine: Succeeded, with the same accuracy.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from fedcore.local.ports import free_ports
from fedcore_operator.settings import OperatorSettings
from tests.integration._prometheus import log_tail, poll, query, running_prometheus
from tests.integration._s3 import start_s3
from tests.kube._operator import wait_for_run
from tests.kube.cluster import read_json
from tests.kube.test_chart import CHART, helm
from tests.kube.test_operator_runs import create_credentials, s3_run
from tests.node.node import RealNode

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples/digits-fedavg.yaml"
LPPA = ROOT / "examples/digits-lppa.yaml"


def _phase_is(*phases: str) -> Callable[[dict[str, object]], bool]:
    return lambda run: (run.get("status") or {}).get("phase") in phases  # type: ignore[union-attr]


def _local_accuracy(workdir: Path) -> float:
    """The final accuracy `fedcore run` reaches on this machine for the quickstart."""
    result = subprocess.run(
        [sys.executable, "-m", "fedcore", "run", str(QUICKSTART), "--workdir", str(workdir),
         "--json", "--quiet", "--no-metrics"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    return float(summary["accuracy"])


@dataclass
class Release:
    """The chart installed on the real node, watching one namespace for runs."""

    system: str
    runs: str
    debug: Callable[[], str]


@pytest.fixture(scope="module")
def release(node: RealNode) -> Iterator[Release]:
    """`helm install` of charts/fedcore with the built operator image, watching ``runs``."""
    plane = node.control_plane
    name = f"fc{uuid.uuid4().hex[:6]}"
    system = plane.create_namespace(f"{name}-system")
    runs = plane.create_namespace(f"{name}-runs")
    kubeconfig = f"--kubeconfig={plane.kubeconfig}"

    def debug() -> str:
        core = plane.core()
        parts = []
        for namespace in (system, runs):
            for pod in core.list_namespaced_pod(namespace).items:
                try:
                    log = node.logs(namespace, pod.metadata.name)[-2500:]
                except Exception as exc:  # a pod that never started has no log
                    log = f"(no log: {exc})"
                parts.append(f"--- {pod.metadata.name} {pod.status.phase}\n{log}")
        return "\n".join(parts)

    helm(
        "install", name, str(CHART), kubeconfig, "--namespace", system,
        "--set", f"operator.watchNamespaces={{{runs}}}",
        "--set", "operator.resyncSeconds=3",
        "--set", "dashboard.enabled=false",
        "--wait", "--timeout", "180s",
    )  # fmt: skip
    # Ready is not reachable yet: kube-proxy installs the webhook Service's rules a moment
    # after the pod is Ready, and until then the API server's call is refused ("connection
    # refused"). Wait for the webhook to answer a server-side dry run, as a user would retry.
    deadline = time.monotonic() + 90
    while True:
        answer = plane.kubectl(
            "apply", "--dry-run=server", "-n", runs, "-f", str(QUICKSTART), check=False
        )
        if answer.returncode == 0 or "failed calling webhook" not in answer.stderr:
            break
        assert time.monotonic() < deadline, f"the webhook never answered:\n{answer.stderr}"
        time.sleep(1)
    try:
        yield Release(system, runs, debug)
    finally:
        helm("uninstall", name, kubeconfig, "--namespace", system, check=False)
        for namespace in (runs, system):
            plane.delete_namespace(namespace, wait=60)


def _apply_and_wait(node: RealNode, release: Release, manifest: Path, name: str) -> dict[str, Any]:
    """`kubectl apply -f manifest` in the release's run namespace; the run ``name``'s status
    once it has ended (Succeeded or Failed)."""
    plane = node.control_plane
    plane.kubectl("apply", "-n", release.runs, "-f", str(manifest))
    run = wait_for_run(
        plane, release.runs, name, _phase_is("Succeeded", "Failed"),
        timeout=420, what="the end", debug=release.debug,
    )  # fmt: skip
    return dict(run["status"])


def test_helm_install_and_kubectl_apply_train_the_quickstart_in_real_containers(
    node: RealNode, release: Release, tmp_path: Path
) -> None:
    plane = node.control_plane
    status = _apply_and_wait(node, release, QUICKSTART, "digits-fedavg")
    assert status["phase"] == "Succeeded", f"{status}\n{release.debug()}"
    assert status["finalMetrics"]["roundsCompleted"] == 20
    assert status["restarts"] == 0
    # The same manifest, the same maths: `fedcore run` here reaches the same accuracy.
    assert status["finalMetrics"]["accuracy"] == _local_accuracy(tmp_path / "local")
    # The operator itself runs from the built image, in a container of the node.
    (operator,) = plane.core().list_namespaced_pod(release.system).items
    (container,) = operator.status.container_statuses
    assert container.image.endswith("fedcore-operator:" + __import__("fedcore").__version__)
    assert container.ready and container.container_id.startswith("containerd://")


def test_the_lppa_example_trains_over_peer_links_between_pods_in_real_containers(
    node: RealNode, release: Release
) -> None:
    """The decentralized example on the real node: each client pod serves its peer service on
    its pod IP and dials each out-neighbour by the headless Service's stable name, over mutual
    TLS; the run ends as the local example does, and its end logs no warning."""
    manifest = yaml.safe_load(LPPA.read_text(encoding="utf-8"))
    count = manifest["spec"]["clients"]["count"]
    degree = manifest["spec"]["protocol"]["lppa"]["topology"]["degree"]
    status = _apply_and_wait(node, release, LPPA, "digits-lppa")
    assert status["phase"] == "Succeeded", f"{status}\n{release.debug()}"
    assert status["finalMetrics"]["roundsCompleted"] == manifest["spec"]["rounds"]
    assert status["restarts"] == 0
    # The noise is secret (secureNoise), so not the local run's bits: its accuracy bar
    # (tests/integration/test_lppa_run.py).
    assert status["finalMetrics"]["accuracy"] >= 0.75
    for index in range(count):
        log = node.logs(release.runs, f"digits-lppa-client-{index}")
        assert log.count("Peer link to client") == degree, log[-3000:]
        assert log.count("Peer link from client") == degree, log[-3000:]
        noisy = [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line]
        assert noisy == [] and "Traceback" not in log, log[-3000:]


def test_a_client_over_its_memory_limit_is_oom_killed_and_status_says_so(
    node: RealNode, release: Release
) -> None:
    plane = node.control_plane
    body = yaml.safe_load(QUICKSTART.read_text())
    body["metadata"]["name"] = "too-small"
    body["spec"]["clients"]["count"] = 2
    body["spec"]["roles"] = {"clients": {"resources": {"limits": {"memory": "40Mi"}}}}
    plane.kubectl("apply", "-n", release.runs, "-f", "-", input=yaml.safe_dump(body))

    def oom_killed(run: dict[str, object]) -> bool:
        failures = (run.get("status") or {}).get("failures") or []  # type: ignore[union-attr]
        return any(f.get("reason") == "OOMKilled" for f in failures)

    run = wait_for_run(
        plane, release.runs, "too-small", oom_killed, timeout=240,
        what="an OOMKilled failure", debug=release.debug,
    )  # fmt: skip
    failure = next(f for f in run["status"]["failures"] if f["reason"] == "OOMKilled")
    assert failure["role"] == "client"
    assert failure["exitCode"] == 137  # SIGKILL from the kernel's OOM killer
    assert failure["action"] in ("Recreated", "RunFailed")
    plane.kubectl("delete", "-n", release.runs, "federatedrun", "too-small", "--wait=false")


def test_a_server_that_cannot_use_its_store_says_why_in_its_pods_termination_message(
    node: RealNode, release: Release
) -> None:
    """A failed role writes its one-line error to /dev/termination-log, which a real kubelet
    mounts into the read-only, non-root container and copies into the pod's status: the
    failed server pod, and the run's message, name the cause, not only ``Error``."""
    plane = node.control_plane
    create_credentials(plane, release.runs)
    (port,) = free_ports(1)  # nothing listens there: the store is unreachable
    body = yaml.safe_load(QUICKSTART.read_text())
    body["metadata"]["name"] = "no-store"
    body["spec"]["checkpoint"] = {
        "everyRounds": 1,
        "s3": {
            "bucket": "runs",
            "endpoint": f"http://{node.network.gateway}:{port}",
            "credentialsSecret": "s3-credentials",
            "retrySeconds": 1,
        },
    }
    body["spec"]["backoffLimit"] = 0
    plane.kubectl("apply", "-n", release.runs, "-f", "-", input=yaml.safe_dump(body))
    try:
        run = wait_for_run(
            plane, release.runs, "no-store", _phase_is("Succeeded", "Failed"),
            timeout=300, what="the end", debug=release.debug,
        )  # fmt: skip
        status = run["status"]
        assert status["phase"] == "Failed", f"{status}\n{release.debug()}"
        assert "checkpoint store cannot be used" in status["message"], status
        server = read_json(plane.core().read_namespaced_pod, "no-store-server", release.runs)
        (state,) = [c["state"]["terminated"] for c in server["status"]["containerStatuses"]]
        assert state["exitCode"] == 1, state
        assert state["message"].startswith("CheckpointFailed: The checkpoint store cannot"), state
        assert "\n" not in state["message"].strip() and len(state["message"]) <= 2048, state
    finally:
        plane.kubectl("delete", "-n", release.runs, "federatedrun", "no-store", "--wait=false",
                      check=False)  # fmt: skip


HOLD_FILE = "/hold/until-deleted"


def _held_after_round(round_: int) -> dict[str, Any]:
    """A server podTemplate that holds the server after ``round_`` (``fedcore/roles/_hold.py``).

    An init container (the runtime image, like any other container of the pod) creates the
    hold file in an emptyDir before the server starts; the server then waits after that round,
    once it is checkpointed, while the file exists. A test acts there without racing the run;
    a recreated server, resumed past that round, never holds.
    """
    mount = [{"name": "hold", "mountPath": "/hold"}]
    return {
        "spec": {
            "volumes": [{"name": "hold", "emptyDir": {}}],
            "initContainers": [
                {
                    "name": "hold",
                    "image": OperatorSettings().image,
                    "command": ["python", "-c", f"open({HOLD_FILE!r}, 'w').close()"],
                    "volumeMounts": mount,
                }
            ],
            "containers": [
                {
                    "name": "fedcore",
                    "env": [
                        {"name": "FEDCORE_TEST_HOLD_AFTER_ROUND", "value": str(round_)},
                        {"name": "FEDCORE_TEST_HOLD_FILE", "value": HOLD_FILE},
                    ],
                    "volumeMounts": mount,
                }
            ],
        }
    }


def test_checkpoints_in_s3_survive_a_deleted_server_pod_and_prometheus_scrapes_it(
    node: RealNode, release: Release, tmp_path: Path
) -> None:
    plane = node.control_plane
    s3 = start_s3(tmp_path / "s3", host=node.network.gateway)  # where pods can reach it
    try:
        s3.client().create_bucket(Bucket="runs")  # type: ignore[attr-defined]
        create_credentials(plane, release.runs)
        body = s3_run("phoenix", s3, "runs", rounds=12)
        body["spec"]["roles"] = {"server": {"podTemplate": _held_after_round(3)}}
        plane.kubectl("apply", "-n", release.runs, "-f", "-", input=yaml.safe_dump(body))
        # The server holds after round 3's checkpoint until its pod goes.
        run = wait_for_run(
            plane, release.runs, "phoenix",
            lambda r: ((r.get("status") or {}).get("lastCheckpoint") or {}).get("round", 0) >= 3,
            timeout=300, what="a checkpoint of round 3", debug=release.debug,
        )  # fmt: skip
        assert run["status"]["lastCheckpoint"]["round"] == 3
        server = read_json(plane.core().read_namespaced_pod, "phoenix-server", release.runs)
        address = f"{server['status']['podIP']}:{OperatorSettings().metrics_port}"

        # Prometheus on the host scrapes the held server through its pod IP.
        (tmp_path / "prom").mkdir()
        with running_prometheus(tmp_path / "prom", [address]) as port:
            scraped = poll(
                lambda: bool(query(port, 'fedcore_round{role="server"} == 3')), timeout=60
            )
            assert scraped, log_tail(tmp_path / "prom")

        plane.kubectl("delete", "pod", "-n", release.runs, "phoenix-server", "--wait=false")
        run = wait_for_run(
            plane, release.runs, "phoenix", _phase_is("Succeeded", "Failed"),
            timeout=420, what="the end", debug=release.debug,
        )  # fmt: skip
        status = run["status"]
        # A string, not a tuple: pytest shortens a tuple's repr and hides the pods' logs.
        assert status["phase"] == "Succeeded", f"{status}\n{release.debug()}"
        assert status["round"] == 12
        # A deleted pod is not a failed one: the operator made a new server pod (no restart
        # counted against backoffLimit), and it resumed from what the old one wrote to S3.
        assert not status.get("failures") and status["restarts"] == 0
        again = read_json(plane.core().read_namespaced_pod, "phoenix-server", release.runs)
        assert again["metadata"]["uid"] != server["metadata"]["uid"]
        log = node.logs(release.runs, "phoenix-server")
        assert "Resumed from the checkpoint of round 3" in log, log[-2000:]
    finally:
        plane.kubectl("delete", "-n", release.runs, "federatedrun", "phoenix", "--wait=false",
                      check=False)  # fmt: skip
        s3.stop()


def test_the_hospitals_example_reads_each_hospitals_claim_in_real_containers(
    node: RealNode, release: Release, tmp_path: Path
) -> None:
    """examples/kubernetes: four hostPath volumes and claims, one per hospital, and the
    dp-fedavg run over them. Each hospital holds a different number of patients, so the
    held-out examples the clients report add up to the expected total only if each client
    read its own claim."""
    plane = node.control_plane
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_data.py"), "--out", str(data)],
        check=True, capture_output=True,
    )  # fmt: skip
    claims = []
    example_claims = (ROOT / "examples/kubernetes/hospitals-claims.yaml").read_text()
    for item in yaml.safe_load_all(example_claims):
        if item["kind"] == "PersistentVolume":
            site = item["metadata"]["name"].rsplit("-", 1)[1]
            item["metadata"]["name"] = f"{release.runs}-hospital-{site}"
            item["spec"]["hostPath"]["path"] = str(data / "hospitals" / f"hospital-{site}")
            item["spec"]["claimRef"]["namespace"] = release.runs
        else:
            item["metadata"]["namespace"] = release.runs
            site = item["metadata"]["name"].rsplit("-", 1)[1]
            item["spec"]["volumeName"] = f"{release.runs}-hospital-{site}"
        claims.append(item)
    plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(claims))
    manifest = ROOT / "examples/kubernetes/hospitals-tabular.yaml"
    plane.kubectl("apply", "-n", release.runs, "-f", str(manifest))
    run = wait_for_run(
        plane, release.runs, "hospitals-tabular", _phase_is("Succeeded", "Failed"),
        timeout=420, what="the end", debug=release.debug,
    )  # fmt: skip
    status = run["status"]
    assert status["phase"] == "Succeeded", f"{status}\n{release.debug()}"
    body = yaml.safe_load(manifest.read_text())
    assert status["privacy"]["epsilon"] <= body["spec"]["privacy"]["targetEpsilon"]
    final = status["finalMetrics"]
    sizes = [
        pq.read_metadata(data / "hospitals" / f"hospital-{site}" / "records.parquet").num_rows
        for site in range(4)
    ]
    assert len(set(sizes)) == 4
    assert final["evaluatedExamples"] == sum(math.ceil(0.2 * size) for size in sizes)
    assert sum(entry["total"] for entry in final["perClass"]) == final["evaluatedExamples"]
    pods = {pod.metadata.name: pod for pod in plane.core().list_namespaced_pod(release.runs).items}
    for name, pod in pods.items():  # the finished clients' pods that are still there
        mounted = [v.persistent_volume_claim for v in pod.spec.volumes if v.persistent_volume_claim]
        if name.startswith("hospitals-tabular-client-"):
            site = name.rsplit("-", 1)[1]
            assert [(c.claim_name, c.read_only) for c in mounted] == [(f"hospital-{site}", True)]
        elif name.startswith("hospitals-tabular-"):
            assert mounted == [], name
    plane.kubectl("delete", "-n", release.runs, "federatedrun", "hospitals-tabular", "--wait=false")

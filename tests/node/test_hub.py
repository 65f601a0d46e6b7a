"""A hub's cluster on a real node: `helm install` with the hub's endpoint on, a site on a machine.

The operator image serves the hub's endpoint in a container of the node (its registry kept in
a Secret, the join token written from the chart's site list), behind the chart's NodePort
Service. A FederatedRun with spec.sites runs its server in a container; the site, on this
machine (`fedcore site join` with the token, then `fedcore site serve`), dials the endpoint
through the Service and its clients train through it. The run ends as one machine ends it.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

import fedcore
from fedcore.simulation import simulate
from fedcore.spec import parse_manifest, spec_digest
from tests.kube.test_chart import CHART, helm
from tests.node.node import RealNode

ROOT = Path(__file__).resolve().parents[2]
SITE = "machine-site"


def _run_document() -> dict[str, Any]:
    """The quickstart, smaller: three clients, all at the machine site, four rounds."""
    document = yaml.safe_load((ROOT / "examples" / "digits-fedavg.yaml").read_text())
    document["metadata"]["name"] = "digits-from-a-hub"
    spec = document["spec"]
    spec["clients"] = {"count": 3, "perRound": "100%", "quorum": "100%"}
    spec["rounds"] = 4
    spec["checkpoint"] = {"everyRounds": 0}
    spec["failurePolicy"] = {"connectTimeoutSeconds": 180}
    spec["sites"] = [{"name": SITE, "clients": 3}]
    return document


def _join_secret(node: RealNode, namespace: str, timeout: float) -> dict[str, str]:
    """The site's join Secret, decoded, once the hub's operator wrote it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = node.control_plane.kubectl(
            "-n", namespace, "get", "secret", f"fedcore-hub-join-{SITE}", "-o", "json",
            check=False,
        )  # fmt: skip
        if found.returncode == 0:
            data = json.loads(found.stdout)["data"]
            return {key: base64.b64decode(value).decode() for key, value in data.items()}
        time.sleep(1)
    raise AssertionError(f"no join Secret for {SITE} after {timeout:.0f} s")


def test_a_hub_installed_with_the_chart_serves_a_run_to_a_machine_site_in_real_containers(
    node: RealNode, tmp_path: Path
) -> None:
    plane = node.control_plane
    name = f"fh{uuid.uuid4().hex[:6]}"
    system = plane.create_namespace(f"{name}-system")
    runs = plane.create_namespace(f"{name}-runs")
    kubeconfig = f"--kubeconfig={plane.kubeconfig}"
    document = _run_document()
    run = parse_manifest(json.loads(json.dumps(document)))
    site_folder = tmp_path / "site"
    site_folder.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    serving: subprocess.Popen[bytes] | None = None

    def debug() -> str:
        parts = []
        for namespace in (system, runs):
            for pod in plane.core().list_namespaced_pod(namespace).items:
                try:
                    log = node.logs(namespace, pod.metadata.name)[-2500:]
                except Exception as exc:  # a pod that never started has no log
                    log = f"(no log: {exc})"
                parts.append(f"--- {pod.metadata.name} {pod.status.phase}\n{log}")
        site_log = site_folder / "site.log"
        if site_log.exists():
            parts.append(f"--- the site\n{site_log.read_text(errors='replace')[-2500:]}")
        return "\n".join(parts)

    helm(
        "install", name, str(CHART), kubeconfig, "--namespace", system,
        "--set", "mode=hub",
        "--set", "hub.enabled=true",
        "--set", f"hub.sites={{{SITE}}}",
        "--set", "hub.service.type=NodePort",
        "--set", f"operator.watchNamespaces={{{runs}}}",
        "--set", "dashboard.enabled=false",
        "--wait", "--timeout", "180s",
    )  # fmt: skip
    try:
        # Prepare: the token and fingerprint the hub's admin hands the site, and the endpoint
        # the Service publishes on the node.
        joining = _join_secret(node, system, 60)
        service = json.loads(
            plane.kubectl(
                "-n", system, "get", "service", f"{name}-fedcore-hub", "-o", "json"
            ).stdout
        )
        (port,) = service["spec"]["ports"]
        hub = f"{node.network.gateway}:{port['nodePort']}"
        joined = subprocess.run(
            [sys.executable, "-m", "fedcore", "site", "join", "--hub", hub,
             "--fingerprint", joining["fingerprint"], "--dir", str(site_folder)],
            env={**env, "FEDCORE_JOIN_TOKEN": joining["token"]},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert joined.returncode == 0, f"{joined.stderr[-2000:]}\n{debug()}"
        policy = site_folder / "policy.yaml"
        policy.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "fedcore.dev/v1alpha1",
                    "kind": "SitePolicy",
                    "site": SITE,
                    "approvals": [
                        {
                            "run": run.metadata.name,
                            "specDigest": spec_digest(run),
                            "clients": 3,
                            "floor": {"protocols": ["fedavg"]},
                        }
                    ],
                }
            ),
            encoding="utf-8",
        )

        # Execute: the run in the hub's cluster, the site serving its clients.
        plane.kubectl("apply", "-n", runs, "-f", "-", input=json.dumps(document))
        with (site_folder / "site.log").open("ab") as out:
            serving = subprocess.Popen(
                [sys.executable, "-m", "fedcore", "site", "serve", "--dir", str(site_folder),
                 "--policy", str(policy)],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 420
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            body = json.loads(
                plane.kubectl("-n", runs, "get", "fedrun", run.metadata.name, "-o", "json").stdout
            )
            status = body.get("status") or {}
            if status.get("phase") in ("Succeeded", "Failed"):
                break
            time.sleep(2)

        # Assert: the run trained the one machine's model...
        assert status.get("phase") == "Succeeded", f"{status}\n{debug()}"
        alone = json.loads(json.dumps(document))
        del alone["spec"]["sites"]
        assert status["finalMetrics"]["accuracy"] == simulate(parse_manifest(alone)).accuracy
        # ...and the hub's status said who took part.
        (entry,) = status["sites"]
        assert (entry["name"], entry["state"], entry["approval"]) == (SITE, "Enrolled", "Approved")
        # The operator (the endpoint) and the server ran the built images in the node's
        # containers; the hub's cluster made no client pod.
        server = f"{run.metadata.name}-server"
        in_runs = plane.core().list_namespaced_pod(runs).items
        assert [pod.metadata.name for pod in in_runs] == [server]
        operators = plane.core().list_namespaced_pod(system).items
        assert len(operators) == 1
        for pod, image in (
            (in_runs[0], f"ghcr.io/fedcore/fedcore:{fedcore.__version__}"),
            (operators[0], f"ghcr.io/fedcore/fedcore-operator:{fedcore.__version__}"),
        ):
            (container,) = pod.status.container_statuses
            assert container.image.endswith(image), container.image
            assert str(container.container_id).startswith("containerd://")
    finally:
        if serving is not None and serving.poll() is None:
            os.killpg(serving.pid, signal.SIGTERM)
            try:
                serving.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(serving.pid, signal.SIGKILL)
                serving.wait()
        helm("uninstall", name, kubeconfig, "--namespace", system, check=False)
        for namespace in (runs, system):
            plane.delete_namespace(namespace, wait=60)

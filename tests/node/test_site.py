"""A site's cluster on a real node: `helm install` in mode site, a join token, a Participation.

The site's operator runs the built runtime image in a container of the node (its review
computes the planned epsilon with torch and dp-accounting), validates Participations in its
webhook, enrolls with the token (its key is made in the cluster), and reconciles the
Participation into client pods in real containers, which reach the hub (`fedcore hub serve`'s
code, on the host, at the pod network's gateway). The run ends as one machine ends it.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

import fedcore
from fedcore.local.ports import free_port
from fedcore.local.runner import LocalRunResult
from fedcore.simulation import simulate
from fedcore.sites._registry import HubRegistry
from fedcore.sites.hub_serve import HubServe
from fedcore.spec import load_manifest, parse_manifest, spec_digest
from fedcore_operator.crd import GROUP, VERSION
from tests.kube.test_chart import CHART, helm
from tests.node.node import RealNode

ROOT = Path(__file__).resolve().parents[2]
SITE = "node-site"


def _run_document() -> dict[str, Any]:
    """The quickstart, smaller: three clients, all at the site, four rounds."""
    document = yaml.safe_load((ROOT / "examples" / "digits-fedavg.yaml").read_text())
    document["metadata"]["name"] = "digits-at-a-site"
    spec = document["spec"]
    spec["clients"] = {"count": 3, "perRound": "100%", "quorum": "100%"}
    spec["rounds"] = 4
    spec["checkpoint"] = {"everyRounds": 0}
    spec["sites"] = [{"name": SITE, "clients": 3}]
    return document


def test_a_site_installed_with_the_chart_runs_its_clients_for_a_hub_in_real_containers(
    node: RealNode, tmp_path: Path
) -> None:
    plane = node.control_plane
    registry = HubRegistry(tmp_path / "hub-state")
    token = registry.add_site(SITE).token
    hub_address = f"{node.network.gateway}:{free_port()}"
    name = f"fs{uuid.uuid4().hex[:6]}"
    system = plane.create_namespace(f"{name}-system")
    data = plane.create_namespace(f"{name}-data")
    kubeconfig = f"--kubeconfig={plane.kubeconfig}"
    plane.kubectl(
        "-n", system, "create", "secret", "generic", "fedcore-site-join",
        f"--from-literal=token={token}",
    )  # fmt: skip
    document = _run_document()
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    run = load_manifest(path)
    hub = HubServe(run, path, registry, listen=hub_address, workdir=tmp_path / "hub")
    outcome: dict[str, Any] = {}

    def follow() -> None:
        try:
            outcome["result"] = hub.wait()
        except BaseException as exc:
            outcome["error"] = exc

    def debug() -> str:
        parts = []
        for namespace in (system, data):
            for pod in plane.core().list_namespaced_pod(namespace).items:
                try:
                    log = node.logs(namespace, pod.metadata.name)[-2500:]
                except Exception as exc:  # a pod that never started has no log
                    log = f"(no log: {exc})"
                parts.append(f"--- {pod.metadata.name} {pod.status.phase}\n{log}")
        return "\n".join(parts)

    helm(
        "install", name, str(CHART), kubeconfig, "--namespace", system,
        "--set", "mode=site",
        "--set", f"site.hub={hub_address}",
        "--set", f"site.fingerprint={registry.fingerprint}",
        "--set", f"operator.watchNamespaces={{{data}}}",
        "--set", "dashboard.enabled=false",
        "--wait", "--timeout", "180s",
    )  # fmt: skip
    try:
        follower = threading.Thread(target=follow, daemon=True)
        try:
            hub.start()
            follower.start()
            participation = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "Participation",
                "metadata": {"name": "digits"},
                "spec": {
                    "run": run.metadata.name,
                    "specDigest": spec_digest(run),
                    "clients": 3,
                    "floor": {"protocols": ["fedavg"]},
                    "pods": {"resources": {"limits": {"memory": "1Gi"}}},
                },
            }
            # The webhook's Service answers a moment after the pod is Ready (kube-proxy's
            # rules): retry the apply while the API server cannot call it, as a user would.
            deadline = time.monotonic() + 90
            while True:
                applied = plane.kubectl(
                    "apply", "-n", data, "-f", "-", input=json.dumps(participation), check=False
                )
                if applied.returncode == 0:
                    break
                assert "failed calling webhook" in applied.stderr, applied.stderr
                assert time.monotonic() < deadline, f"the webhook never answered:\n{applied}"
                time.sleep(1)
            follower.join(420)
            assert not follower.is_alive(), f"the hub's run did not end:\n{debug()}"
            deadline = time.monotonic() + 60
            status: dict[str, Any] = {}
            while time.monotonic() < deadline:
                body = json.loads(
                    plane.kubectl("-n", data, "get", "participation", "digits", "-o", "json").stdout
                )
                status = body.get("status") or {}
                if status.get("phase") in ("Succeeded", "Failed"):
                    break
                time.sleep(1)
        finally:
            hub.stop()
            follower.join(30)
        assert "error" not in outcome, f"{outcome.get('error')}\n{debug()}"
        result: LocalRunResult = outcome["result"]
        assert result.phase == "Succeeded" and result.rounds_completed == 4
        assert status.get("phase") == "Succeeded", f"{status}\n{debug()}"
        assert status["clients"] == {"total": 3, "ready": 0, "succeeded": 3, "restarts": 0}
        # The same run on one machine, all clients beside the server, trains the same model.
        alone = json.loads(json.dumps(document))
        del alone["spec"]["sites"]
        assert result.accuracy == simulate(parse_manifest(alone)).accuracy
        # The site's operator and clients ran the built runtime image in the node's containers.
        image = f"ghcr.io/fedcore/fedcore:{fedcore.__version__}"
        pods = (
            plane.core().list_namespaced_pod(system).items
            + plane.core().list_namespaced_pod(data).items
        )
        assert len(pods) == 4, [pod.metadata.name for pod in pods]
        for pod in pods:
            (container,) = pod.status.container_statuses
            assert container.image.endswith(image), container.image
            assert str(container.container_id).startswith("containerd://")

    finally:
        helm("uninstall", name, kubeconfig, "--namespace", system, check=False)
        for namespace in (data, system):
            plane.delete_namespace(namespace, wait=60)

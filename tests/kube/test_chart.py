"""The Helm chart: lint, templates over several value sets, schema refusals, and a real install.

The install goes into the real test API server; the fake kubelet then runs the operator's own
pod (its command, its ServiceAccount token, the chart's least-privilege RBAC), and a
FederatedRun applied through it trains to the end.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

import fedcore
from tests.kube._operator import install_crd, wait_for_run
from tests.kube.cluster import DEFAULT_BIN, ControlPlane
from tests.kube.kubelet import FakeKubelet

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/fedcore"


def helm_binary() -> str:
    folder = Path(os.environ.get("FEDCORE_K8S_BIN") or DEFAULT_BIN).expanduser()
    helm = folder / "helm"
    if not helm.exists():
        raise AssertionError(f"{helm} is missing: run `bash hack/control-plane.sh`.")
    return str(helm)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [helm_binary(), *args], capture_output=True, text=True, timeout=120, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stderr}")
    return result


def render(*sets: str) -> list[dict[str, Any]]:
    args = ["template", "demo", str(CHART), "--namespace", "fedcore-system"]
    for item in sets:
        args += ["--set", item]
    return [doc for doc in yaml.safe_load_all(helm(*args).stdout) if doc]


def by_kind(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    result: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        result.setdefault(doc["kind"], []).append(doc)
    return result


def test_chart_lints() -> None:
    result = helm("lint", str(CHART), "--strict")
    assert "0 chart(s) failed" in result.stdout


def test_default_values_render_operator_rbac_webhook_and_dashboard() -> None:
    kinds = by_kind(render())
    assert set(kinds) == {
        "ServiceAccount",
        "Secret",
        "ConfigMap",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Service",
        "Deployment",
        "ValidatingWebhookConfiguration",
    }
    deployment = kinds["Deployment"][0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"ghcr.io/fedcore/fedcore-operator:{fedcore.__version__}"
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["FEDCORE_OPERATOR_IMAGE"] == f"ghcr.io/fedcore/fedcore:{fedcore.__version__}"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert "--leader-election" in container["args"]
    webhook = kinds["ValidatingWebhookConfiguration"][0]["webhooks"][0]
    assert webhook["clientConfig"]["service"]["path"] == "/validate-run"
    assert webhook["rules"][0]["resources"] == ["federatedruns"]
    dashboard = kinds["ConfigMap"][0]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["fedcore-runs.json"].lstrip().startswith("{")
    # The runs ClusterRole never grants secrets beyond get/list/create, nor any wildcard.
    for role in kinds["ClusterRole"]:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"]
            if "secrets" in rule["resources"]:
                assert set(rule["verbs"]) == {"get", "list", "create"}


def test_monitoring_values_add_service_monitor_pod_monitor_and_rules() -> None:
    kinds = by_kind(
        render("metrics.serviceMonitor.enabled=true", "metrics.prometheusRule.enabled=true")
    )
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule"} <= set(kinds)
    rules = kinds["PrometheusRule"][0]["spec"]["groups"]
    alerts = {rule["alert"] for group in rules for rule in group["rules"] if "alert" in rule}
    assert alerts, "the PrometheusRule carries no alert"


def test_watch_namespaces_bind_the_runs_role_only_there() -> None:
    kinds = by_kind(render("operator.watchNamespaces={team-a,team-b}", "webhook.enabled=false"))
    bindings = [b for b in kinds["RoleBinding"] if b["roleRef"]["kind"] == "ClusterRole"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    cluster_bindings = [b["metadata"]["name"] for b in kinds["ClusterRoleBinding"]]
    assert cluster_bindings == ["demo-fedcore-discovery"]
    container = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    assert "--namespace=team-a" in container["args"]
    assert "ValidatingWebhookConfiguration" not in kinds
    assert not any(arg.startswith("--webhook") for arg in container["args"])


BAD_VALUES = [
    (["operator.logFormat=xml"], "operator.logFormat"),
    (["operator.replicas=0"], "operator.replicas"),
    (["operator.replicass=2"], "replicass"),
    (["operator.replicas=3", "operator.leaderElection=false"], "needs operator.leaderElection"),
    (["webhook.existingSecret=mine"], "webhook.caBundle is required"),
    (["metrics.serviceMonitor.interval=often"], "metrics.serviceMonitor.interval"),
    (["webhook.failurePolicy=Maybe"], "webhook.failurePolicy"),
]


@pytest.mark.parametrize(("sets", "message"), BAD_VALUES, ids=[b[1] for b in BAD_VALUES])
def test_bad_values_are_refused_with_a_clear_message(sets: list[str], message: str) -> None:
    args = ["template", "demo", str(CHART)]
    for item in sets:
        args += ["--set", item]
    result = helm(*args, check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_helm_install_runs_the_operator_with_the_charts_rbac_and_a_run_succeeds(
    control_plane: ControlPlane, kubelet: FakeKubelet, namespace: str
) -> None:
    install_crd(control_plane)  # helm keeps an existing CRD as it is
    release = f"fc{uuid.uuid4().hex[:6]}"
    system = control_plane.create_namespace(f"{release}-system")
    kubeconfig = f"--kubeconfig={control_plane.kubeconfig}"
    helm(
        "install", release, str(CHART), kubeconfig, "--namespace", system,
        "--set", "webhook.enabled=false",  # the API server cannot call loopback Services
        "--set", "operator.resyncSeconds=3",
        "--set", "dashboard.enabled=false",
    )  # fmt: skip
    try:
        pods = control_plane.core().list_namespaced_pod(
            system, label_selector="app.kubernetes.io/component=operator"
        )
        assert len(pods.items) <= 1
        body = yaml.safe_load((ROOT / "examples/digits-fedavg.yaml").read_text())
        body["metadata"]["name"] = "via-helm"
        body["spec"]["clients"]["count"] = 3
        body["spec"]["rounds"] = 3
        control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))

        def operator_log() -> str:
            found = control_plane.core().list_namespaced_pod(system).items
            return "\n".join(kubelet.log_of(system, pod.metadata.name)[-3000:] for pod in found)

        wait_for_run(
            control_plane,
            namespace,
            "via-helm",
            lambda r: (r.get("status") or {}).get("phase") in ("Running", "Succeeded"),
            timeout=120,
            what="phase Running",
            debug=operator_log,
        )
        run = wait_for_run(
            control_plane,
            namespace,
            "via-helm",
            lambda r: (r.get("status") or {}).get("phase") in ("Succeeded", "Failed"),
            timeout=180,
            what="the end",
            debug=operator_log,
        )
        assert run["status"]["phase"] == "Succeeded", (run["status"], operator_log())
        assert "Forbidden" not in operator_log()
    finally:
        helm("uninstall", release, kubeconfig, "--namespace", system, check=False)
        control_plane.kubectl("delete", "clusterrolebinding", "-l",
                              f"app.kubernetes.io/instance={release}", check=False)  # fmt: skip

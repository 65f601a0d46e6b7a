"""The Helm chart: lint, templates over several value sets, schema refusals, and a real install.

The install goes into the real test API server; the fake kubelet then runs the operator's own
pod (its command, its ServiceAccount token, the chart's least-privilege RBAC), and a
FederatedRun applied through it trains to the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

import fedcore
from fedcore_operator import objects
from fedcore_operator.kube import request
from fedcore_operator.settings import CLUSTER_DNS, OperatorSettings
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


def render_sets(release: str, namespace: str, *sets: str) -> list[dict[str, Any]]:
    args = ["template", release, str(CHART), "--namespace", namespace]
    for item in sets:
        args += ["--set", item]
    return [doc for doc in yaml.safe_load_all(helm(*args).stdout) if doc]


def render_values(
    values: dict[str, Any], release: str = "demo", namespace: str = "fedcore-system"
) -> list[dict[str, Any]]:
    """``helm template`` with a values file (for values ``--set`` cannot spell)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:
        yaml.safe_dump(values, file)
        file.flush()
        args = ["template", release, str(CHART), "--namespace", namespace, "-f", file.name]
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
        "NetworkPolicy",
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
    # No role grants secrets beyond get/list/create/delete (delete: moving a CA out of a
    # run's namespace), nor any wildcard; and by default nothing is bound cluster-wide but
    # the discovery reads: the runs role only in the release namespace.
    for role in kinds["ClusterRole"] + kinds["Role"]:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"]
            if "secrets" in rule["resources"]:
                assert set(rule["verbs"]) == {"get", "list", "create", "delete"}
    assert [b["roleRef"]["name"] for b in kinds["ClusterRoleBinding"]] == ["demo-fedcore-discovery"]
    runs_bindings = [b for b in kinds["RoleBinding"] if b["roleRef"]["kind"] == "ClusterRole"]
    assert [b["metadata"]["namespace"] for b in runs_bindings] == ["fedcore-system"]
    assert "--namespace=fedcore-system" in container["args"]
    assert "--ca-namespace=$(POD_NAMESPACE)" in container["args"]


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
    assert sorted(b["metadata"]["namespace"] for b in bindings) == [
        "fedcore-system",
        "team-a",
        "team-b",
    ]
    cluster_bindings = [b["metadata"]["name"] for b in kinds["ClusterRoleBinding"]]
    assert cluster_bindings == ["demo-fedcore-discovery"]
    container = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    namespaces = [arg for arg in container["args"] if arg.startswith("--namespace=")]
    assert namespaces == [
        "--namespace=fedcore-system",
        "--namespace=team-a",
        "--namespace=team-b",
    ]
    assert "ValidatingWebhookConfiguration" not in kinds
    assert not any(arg.startswith("--webhook") for arg in container["args"])
    assert [p["metadata"]["name"] for p in kinds["NetworkPolicy"]] == ["demo-fedcore-operator"]


def test_cluster_wide_is_asked_for_explicitly() -> None:
    # Execute
    kinds = by_kind(render("operator.clusterWide=true", "operator.watchNamespaces={team-a}"))

    # Assert: one ClusterRoleBinding for the runs role, no per-namespace binding or flag.
    cluster_bindings = sorted(b["roleRef"]["name"] for b in kinds["ClusterRoleBinding"])
    assert cluster_bindings == ["demo-fedcore-discovery", "demo-fedcore-runs"]
    assert not [b for b in kinds["RoleBinding"] if b["roleRef"]["kind"] == "ClusterRole"]
    container = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    assert not [arg for arg in container["args"] if arg.startswith("--namespace=")]


def operator_env(kinds: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    container = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    return {item["name"]: item.get("value") for item in container["env"]}


def test_network_policy_values_reach_the_operator_and_its_own_policies() -> None:
    # Prepare
    values = {
        "networkPolicy": {
            "metricsFrom": [{"podSelector": {"matchLabels": {"app": "vm-agent"}}}],
            "dnsTo": [{"podSelector": {"matchLabels": {"k8s-app": "node-local-dns"}}}],
            "apiServer": {"ports": [6443], "cidrs": ["10.0.0.1/32"]},
            "s3To": [{"ipBlock": {"cidr": "52.216.0.0/15"}}],
            "webhookFrom": [{"ipBlock": {"cidr": "10.0.0.0/24"}}],
        }
    }

    # Execute
    kinds = by_kind(render_values(values))
    defaults = by_kind(render())

    # Assert: the operator builds every run's policies from these (its settings)...
    env = operator_env(kinds)
    assert (
        json.loads(env["FEDCORE_OPERATOR_METRICS_FROM"]) == values["networkPolicy"]["metricsFrom"]
    )
    assert json.loads(env["FEDCORE_OPERATOR_DNS_TO"]) == values["networkPolicy"]["dnsTo"]
    assert json.loads(env["FEDCORE_OPERATOR_S3_TO"]) == values["networkPolicy"]["s3To"]
    assert (env["FEDCORE_OPERATOR_API_PORTS"], env["FEDCORE_OPERATOR_API_CIDRS"]) == (
        "6443",
        "10.0.0.1/32",
    )
    settings = OperatorSettings.from_env({k: v for k, v in env.items() if v is not None})
    assert settings.metrics_from == ({"podSelector": {"matchLabels": {"app": "vm-agent"}}},)
    # ... and the chart's own policies for the operator's pod use them too.
    policies = {p["metadata"]["name"]: p["spec"] for p in kinds["NetworkPolicy"]}
    operator = policies["demo-fedcore-operator"]
    assert operator["ingress"] == [
        {
            "from": values["networkPolicy"]["metricsFrom"],
            "ports": [{"protocol": "TCP", "port": 8080}],
        }
    ]
    assert operator["egress"] == [
        {
            "to": values["networkPolicy"]["dnsTo"],
            "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
        },
        {
            "ports": [{"protocol": "TCP", "port": 6443}],
            "to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}],
        },
    ]
    assert policies["demo-fedcore-webhook"]["ingress"] == [
        {
            "ports": [{"protocol": "TCP", "port": 9443}],
            "from": values["networkPolicy"]["webhookFrom"],
        }
    ]
    # By default the scraper is Prometheus in "monitoring" and DNS kube-dns in kube-system.
    default_env = operator_env(defaults)
    assert json.loads(default_env["FEDCORE_OPERATOR_METRICS_FROM"]) == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]
    assert tuple(json.loads(default_env["FEDCORE_OPERATOR_DNS_TO"])) == CLUSTER_DNS


def test_no_scraper_named_closes_metrics() -> None:
    kinds = by_kind(render_values({"networkPolicy": {"metricsFrom": []}}))
    assert json.loads(operator_env(kinds)["FEDCORE_OPERATOR_METRICS_FROM"]) == []
    operator = next(
        p for p in kinds["NetworkPolicy"] if p["metadata"]["name"].endswith("-operator")
    )
    assert operator["spec"]["ingress"] == []


def test_pod_security_labels_only_the_run_namespaces_and_only_when_asked() -> None:
    # Execute
    labelled = by_kind(
        render(
            "operator.watchNamespaces={team-a,fedcore-system}",
            "podSecurity.labelNamespaces=true",
        )
    )
    unlabelled = by_kind(render("operator.watchNamespaces={team-a}"))

    # Assert: the release namespace (made by --create-namespace, not the chart) is not one.
    (namespace,) = labelled["Namespace"]
    assert namespace["metadata"]["name"] == "team-a"
    labels = namespace["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"
        assert labels[f"pod-security.kubernetes.io/{mode}-version"] == "latest"
    assert namespace["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert "Namespace" not in unlabelled


FINGERPRINT = "sha256:" + "ab" * 32
SITE = ["site.hub=hub.example.org:7443", f"site.fingerprint={FINGERPRINT}"]
BAD_VALUES = [
    (["operator.logFormat=xml"], "operator.logFormat"),
    (["operator.replicas=0"], "operator.replicas"),
    (["operator.replicass=2"], "replicass"),
    (["operator.replicas=3", "operator.leaderElection=false"], "needs operator.leaderElection"),
    (["webhook.existingSecret=mine"], "webhook.caBundle is required"),
    (["metrics.serviceMonitor.interval=often"], "metrics.serviceMonitor.interval"),
    (["webhook.failurePolicy=Maybe"], "webhook.failurePolicy"),
    (["operator.clusterWide=yes"], "operator.clusterWide"),
    (["podSecurity.level=strict"], "podSecurity.level"),
    (["networkPolicy.apiServer.cidrs={everywhere}"], "networkPolicy.apiServer.cidrs"),
    (["networkPolicy.dnsTo=null"], "dnsTo is required"),
    (["networkPolicy.metricsFrom[0].hostNetwork=true"], "hostNetwork"),
    (["mode=spoke"], "mode must be one of"),
    (["mode=site"], "mode: site needs site.hub"),
    (["site.hub=hub.example.org"], "site.hub: Does not match pattern"),
    (["site.fingerprint=sha256:XYZ"], "site.fingerprint: Does not match pattern"),
    (["site.hub=hub.example.org:7443"], "site.fingerprint is required"),
    (["site.hubCidrs={anywhere}"], "site.hubCidrs"),
    (["site.joinTokenSecret=Not_A_Name"], "site.joinTokenSecret"),
    (["mode=site", *SITE, "hub.enabled=true"], "hub.enabled is true in mode: site"),
    (["hub.enabled=true", "operator.replicas=2"], "hub.enabled needs operator.replicas: 1"),
    (["hub.sites={hospital-a,Bad_Site}"], "hub.sites.1: Does not match pattern"),
    (["hub.revokedSites={" + "a" * 41 + "}"], "hub.revokedSites.0"),
    (["hub.service.type=Internal"], "hub.service.type must be one of"),
    (["hub.from[0].hostNetwork=true"], "hostNetwork"),
    (["hub.enabled=true", "hub.service.nodePort=30443"], "hub.service.nodePort and"),
    (["hub.enabled=true", "hub.service.loadBalancerIP=192.0.2.1"], "hub.service.loadBalancerIP"),
    (
        ["hub.enabled=true", "hub.ingress.enabled=true"],
        "hub.ingress.enabled needs hub.ingress.host",
    ),
    (["hub.enabled=true", "hub.port=8080"], "hub.port 8080 is taken"),
]


@pytest.mark.parametrize(("sets", "message"), BAD_VALUES, ids=[b[1] for b in BAD_VALUES])
def test_bad_values_are_refused_with_a_clear_message(sets: list[str], message: str) -> None:
    args = ["template", "demo", str(CHART)]
    for item in sets:
        args += ["--set", item]
    result = helm(*args, check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


RUNTIME_IMAGE = f"ghcr.io/fedcore/fedcore:{fedcore.__version__}"
OPERATOR_IMAGE = f"ghcr.io/fedcore/fedcore-operator:{fedcore.__version__}"
SITE_KINDS = ("pods", "secrets", "configmaps", "serviceaccounts", "networkpolicies")


def without_generated_certs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rendered objects less what ``genCA`` makes anew on each render."""
    kept = []
    for doc in docs:
        doc = json.loads(json.dumps(doc))
        if doc["kind"] == "Secret":
            doc.pop("data", None)
        for webhook in doc.get("webhooks", []):
            webhook["clientConfig"].pop("caBundle", None)
        kept.append(doc)
    return kept


def operator_container(kinds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    container: dict[str, Any] = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    return container


def runs_rules(kinds: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    (role,) = [r for r in kinds["ClusterRole"] if r["metadata"]["name"] == "demo-fedcore-runs"]
    rules: list[dict[str, Any]] = role["rules"]
    return rules


def verbs_on(rules: list[dict[str, Any]], resource: str) -> set[str]:
    return {verb for rule in rules if resource in rule["resources"] for verb in rule["verbs"]}


def test_mode_both_without_a_hub_is_the_single_cluster_install() -> None:
    # Execute
    default = by_kind(render())
    both = render("mode=both", "site.joinTokenSecret=other", "site.hubCidrs={10.0.0.0/8}")

    # Assert: the same objects (the site values do nothing without site.hub), and none of the
    # site's: no --mode flag (both is the operator's default), no site env, the operator image.
    assert without_generated_certs(both) == without_generated_certs(render())
    container = operator_container(default)
    assert container["image"] == OPERATOR_IMAGE
    assert container["command"] == ["python", "-m", "fedcore_operator", "run"]
    assert not [arg for arg in container["args"] if arg.startswith("--mode")]
    assert not [name for name in operator_env(default) if name.startswith("FEDCORE_SITE_")]
    assert "participations" not in json.dumps(default["ClusterRole"])
    assert verbs_on(runs_rules(default), "federatedruns") == {"get", "list", "watch"}
    assert "demo-fedcore-ca-keys" in [r["metadata"]["name"] for r in default["Role"]]


def test_site_mode_runs_the_runtime_image_with_the_site_env_and_participation_rbac() -> None:
    # Execute
    kinds = by_kind(
        render(
            "mode=site",
            *SITE,
            "site.hubCidrs={203.0.113.0/24}",
            "operator.watchNamespaces={team-a}",
        )
    )

    # Assert: the operator runs the runtime image (torch, dp-accounting) with its own command.
    container = operator_container(kinds)
    assert container["image"] == RUNTIME_IMAGE
    assert container["command"] == ["python", "-m", "fedcore_operator", "run"]
    assert "--mode=site" in container["args"]
    assert not [arg for arg in container["args"] if arg.startswith("--ca-")]
    assert "--webhook-port=9443" in container["args"]
    assert container["readinessProbe"]["tcpSocket"]["port"] == "webhook"
    env = operator_env(kinds)
    assert {name: value for name, value in env.items() if name.startswith("FEDCORE_SITE_")} == {
        "FEDCORE_SITE_HUB": "hub.example.org:7443",
        "FEDCORE_SITE_FINGERPRINT": FINGERPRINT,
        "FEDCORE_SITE_JOIN_SECRET": "fedcore-site-join",
        "FEDCORE_SITE_IDENTITY_SECRET": "fedcore-site-identity",
        "FEDCORE_SITE_HUB_CIDRS": "203.0.113.0/24",
    }
    assert env["FEDCORE_OPERATOR_IMAGE"] == RUNTIME_IMAGE
    # ... the webhook validates Participations only; no FederatedRun rules or CA custody ...
    (config,) = kinds["ValidatingWebhookConfiguration"]
    assert [(w["clientConfig"]["service"]["path"], w["rules"][0]["resources"]) for w in
            config["webhooks"]] == [("/validate-participation", ["participations"])]  # fmt: skip
    assert [p["name"] for p in kinds["Service"][0]["spec"]["ports"]] == ["metrics", "webhook"]
    assert "federatedruns" not in json.dumps(kinds["ClusterRole"] + kinds["Role"])
    assert "demo-fedcore-ca-keys" not in [r["metadata"]["name"] for r in kinds["Role"]]
    # ... the Participation rules, bound where it reconciles, and what they own.
    rules = runs_rules(kinds)
    assert verbs_on(rules, "participations") == {"get", "list", "watch", "patch"}
    assert verbs_on(rules, "participations/status") == {"get", "patch"}
    for resource in SITE_KINDS:
        assert verbs_on(rules, resource) >= {"get", "list", "watch", "create", "patch", "delete"}
    bindings = [b for b in kinds["RoleBinding"] if b["roleRef"]["name"] == "demo-fedcore-runs"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["fedcore-system", "team-a"]
    # The operator's own policy adds the hub's port, at site.hubCidrs.
    policies = {p["metadata"]["name"]: p["spec"] for p in kinds["NetworkPolicy"]}
    assert sorted(policies) == ["demo-fedcore-operator", "demo-fedcore-webhook"]
    assert policies["demo-fedcore-operator"]["egress"][-1] == {
        "ports": [{"protocol": "TCP", "port": 7443}],
        "to": [{"ipBlock": {"cidr": "203.0.113.0/24"}}],
    }
    # ... and the site's client pods' peer port, for the relays it splices to them.
    assert policies["demo-fedcore-operator"]["egress"][-2] == {
        "ports": [{"protocol": "TCP", "port": OperatorSettings().peer_port}],
        "to": [
            {
                "namespaceSelector": {},
                "podSelector": {
                    "matchExpressions": [{"key": "fedcore.dev/participation", "operator": "Exists"}]
                },
            }
        ],
    }


def test_site_mode_without_hub_cidrs_opens_the_hubs_port_only() -> None:
    kinds = by_kind(
        render("mode=site", "site.hub=[2001:db8::1]:443", f"site.fingerprint={FINGERPRINT}")
    )
    operator = next(
        p for p in kinds["NetworkPolicy"] if p["metadata"]["name"].endswith("-operator")
    )
    assert operator["spec"]["egress"][-1] == {"ports": [{"protocol": "TCP", "port": 443}]}
    assert operator_env(kinds)["FEDCORE_SITE_HUB_CIDRS"] == ""


def test_site_env_is_what_the_site_operator_reads() -> None:
    from fedcore_operator.site.reconcile import SiteSettings

    env = operator_env(by_kind(render("mode=site", *SITE, "site.hubCidrs={203.0.113.0/24}")))
    settings = SiteSettings.from_env("fedcore-system", env)
    assert settings is not None
    assert (settings.hub, settings.fingerprint, settings.hub_cidrs) == (
        "hub.example.org:7443",
        FINGERPRINT,
        ("203.0.113.0/24",),
    )
    assert (settings.join_secret, settings.identity_secret) == (
        "fedcore-site-join",
        "fedcore-site-identity",
    )


def test_mode_both_with_a_hub_reconciles_runs_and_participations() -> None:
    kinds = by_kind(render(*SITE))
    container = operator_container(kinds)
    assert container["image"] == RUNTIME_IMAGE
    assert not [arg for arg in container["args"] if arg.startswith("--mode")]
    assert "--webhook-port=9443" in container["args"]
    (config,) = kinds["ValidatingWebhookConfiguration"]
    assert [w["name"] for w in config["webhooks"]] == [
        "validate-run.fedcore.dev",
        "validate-participation.fedcore.dev",
    ]
    assert operator_env(kinds)["FEDCORE_SITE_HUB"] == "hub.example.org:7443"
    rules = runs_rules(kinds)
    assert verbs_on(rules, "federatedruns") == {"get", "list", "watch"}
    assert verbs_on(rules, "participations") == {"get", "list", "watch", "patch"}


def test_hub_mode_renders_no_participation_rules_nor_site_env() -> None:
    # Execute: site values are ignored in mode hub.
    kinds = by_kind(render("mode=hub", *SITE))

    # Assert
    container = operator_container(kinds)
    assert container["image"] == OPERATOR_IMAGE
    assert "--mode=hub" in container["args"]
    assert not [name for name in operator_env(kinds) if name.startswith("FEDCORE_SITE_")]
    rbac = json.dumps(kinds["ClusterRole"] + kinds["Role"])
    assert "participations" not in rbac and "federatedruns" in rbac
    assert "ValidatingWebhookConfiguration" in kinds
    for policy in kinds["NetworkPolicy"]:
        assert 7443 not in [
            p.get("port") for r in policy["spec"].get("egress", []) for p in r["ports"]
        ]
    defaults = without_generated_certs(render())
    hub = without_generated_certs([doc for kind in kinds.values() for doc in kind])
    assert sorted(
        json.dumps(d, sort_keys=True) for d in hub if d["kind"] != "Deployment"
    ) == sorted(json.dumps(d, sort_keys=True) for d in defaults if d["kind"] != "Deployment")


def test_site_mode_needs_the_hub_and_names_it() -> None:
    result = helm("template", "demo", str(CHART), "--set", "mode=site", check=False)
    assert result.returncode != 0
    assert "site.hub" in result.stderr and "site.fingerprint" in result.stderr, result.stderr


HUB_NAMES = ("hub.fedcore.invalid", "server.fedcore.invalid", "kdc.fedcore.invalid")
HUB_PEERS = [{"ipBlock": {"cidr": "203.0.113.0/24"}}]


def named(kinds: dict[str, list[dict[str, Any]]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [doc for doc in kinds.get(kind, []) if doc["metadata"]["name"] == name]
    return found


def hub_objects(kinds: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str]]:
    """The hub endpoint's objects rendered: (kind, name)."""
    names = {"demo-fedcore-hub", "fedcore-hub-sites"}
    return sorted(
        (doc["kind"], doc["metadata"]["name"])
        for docs in kinds.values()
        for doc in docs
        if doc["metadata"]["name"] in names
    )


def test_the_hub_endpoint_is_off_by_default() -> None:
    # Execute: hub values do nothing while hub.enabled is false.
    default = by_kind(render())
    idle = render("hub.sites={hospital-a}", "hub.service.type=LoadBalancer", "hub.port=8443")

    # Assert
    assert hub_objects(default) == []
    container = operator_container(default)
    assert "hub" not in [port["name"] for port in container["ports"]]
    assert "FEDCORE_HUB_LISTEN" not in operator_env(default)
    assert without_generated_certs(idle) == without_generated_certs(render())


def test_the_hub_endpoint_renders_its_port_service_sites_rbac_and_policy() -> None:
    # Execute
    values = {
        "hub": {
            "enabled": True,
            "sites": ["hospital-a", "lab-b2"],
            "revokedSites": ["old-site"],
            "from": HUB_PEERS,
        }
    }
    kinds = by_kind(render_values(values))
    bare = by_kind(render("mode=hub", "hub.enabled=true", "hub.port=8443"))

    # Assert: the operator serves it on its port "hub"...
    container = operator_container(kinds)
    assert {"name": "hub", "containerPort": 7443} in container["ports"]
    assert operator_env(kinds)["FEDCORE_HUB_LISTEN"] == "0.0.0.0:7443"
    assert operator_env(bare)["FEDCORE_HUB_LISTEN"] == "0.0.0.0:8443"
    # ... behind a ClusterIP Service by default, selecting the operator's pod ...
    service = named(kinds, "Service", "demo-fedcore-hub")
    pod_labels = kinds["Deployment"][0]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "hub", "protocol": "TCP", "port": 7443, "targetPort": "hub"}
    ]
    assert "Ingress" not in kinds
    # ... with the sites in the ConfigMap the operator reads, by its fixed name ...
    sites = named(kinds, "ConfigMap", "fedcore-hub-sites")
    assert sites["metadata"]["namespace"] == "fedcore-system"
    assert sites["data"] == {"sites": "hospital-a lab-b2", "revoked": "old-site"}
    assert named(bare, "ConfigMap", "fedcore-hub-sites")["data"] == {"sites": "", "revoked": ""}
    # ... RBAC on exactly its Secrets and ConfigMap, in the release namespace only ...
    role = named(kinds, "Role", "demo-fedcore-hub")
    assert role["metadata"]["namespace"] == "fedcore-system"
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": [
                "fedcore-hub",
                "fedcore-hub-join-hospital-a",
                "fedcore-hub-join-lab-b2",
            ],
            "verbs": ["get", "patch"],
        },
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["fedcore-hub-sites"],
            "verbs": ["get"],
        },
    ]
    binding = named(kinds, "RoleBinding", "demo-fedcore-hub")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "demo-fedcore-hub",
    }
    assert [b["roleRef"]["name"] for b in kinds["ClusterRoleBinding"]] == ["demo-fedcore-discovery"]
    # ... and a NetworkPolicy: in on the hub's port from hub.from, out to the runs' server and
    # KDC pods (as the operator labels them) on their ports.
    policy = named(kinds, "NetworkPolicy", "demo-fedcore-hub")["spec"]
    assert policy["podSelector"]["matchLabels"] == service["spec"]["selector"]
    assert policy["ingress"] == [{"ports": [{"protocol": "TCP", "port": 7443}], "from": HUB_PEERS}]
    settings = OperatorSettings()
    ports = {"server": settings.server_port, "kdc": settings.kdc_port}
    assert [rule["ports"] for rule in policy["egress"]] == [
        [{"protocol": "TCP", "port": 7070}],
        [{"protocol": "TCP", "port": 7071}],
    ]
    for rule, role_name in zip(policy["egress"], ("server", "kdc"), strict=True):
        (peer,) = rule["to"]
        assert peer["namespaceSelector"] == {}
        labels = peer["podSelector"]["matchLabels"]
        assert labels.items() <= objects.role_labels("some-run", role_name).items()
        assert not labels.items() <= objects.role_labels("some-run", "client", 0).items()
        assert rule["ports"][0]["port"] == ports[role_name]
    open_policy = named(bare, "NetworkPolicy", "demo-fedcore-hub")["spec"]
    assert open_policy["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8443}]}]


def test_the_hub_sites_and_names_are_what_the_operator_reads() -> None:
    from fedcore_operator.hub import state

    kinds = by_kind(
        render("hub.enabled=true", "hub.sites={hospital-a,lab-b}", "hub.revokedSites={old}")
    )
    config_map = named(kinds, "ConfigMap", state.SITES_CONFIG_MAP)
    assert state.SiteList.from_config_map(config_map) == state.SiteList(
        sites=("hospital-a", "lab-b"), revoked=("old",)
    )
    (secrets, *_) = named(kinds, "Role", "demo-fedcore-hub")["rules"]
    assert secrets["resourceNames"] == [
        state.HUB_SECRET,
        state.join_secret_name("hospital-a"),
        state.join_secret_name("lab-b"),
    ]


HUB_SERVICES = [
    ("ClusterIP", [], {"type": "ClusterIP"}, {}),
    (
        "NodePort",
        ["hub.service.type=NodePort", "hub.service.nodePort=30443"],
        {"type": "NodePort"},
        {"nodePort": 30443},
    ),
    (
        "LoadBalancer",
        [
            "hub.service.type=LoadBalancer",
            "hub.service.loadBalancerSourceRanges={198.51.100.0/24,203.0.113.0/24}",
            "hub.service.loadBalancerIP=192.0.2.10",
            "hub.service.externalTrafficPolicy=Local",
            "hub.service.annotations.example\\.com/lb=internal",
            "hub.service.port=443",
        ],
        {
            "type": "LoadBalancer",
            "loadBalancerSourceRanges": ["198.51.100.0/24", "203.0.113.0/24"],
            "loadBalancerIP": "192.0.2.10",
            "externalTrafficPolicy": "Local",
        },
        {"port": 443},
    ),
]


@pytest.mark.parametrize(
    ("case", "sets", "spec", "port"), HUB_SERVICES, ids=[c[0] for c in HUB_SERVICES]
)
def test_the_hub_service_takes_each_type(
    case: str, sets: list[str], spec: dict[str, Any], port: dict[str, Any]
) -> None:
    kinds = by_kind(render("hub.enabled=true", *sets))
    service = named(kinds, "Service", "demo-fedcore-hub")
    rest = {k: v for k, v in service["spec"].items() if k not in ("selector", "ports")}
    assert rest == spec, case
    assert service["spec"]["ports"] == [
        {"name": "hub", "protocol": "TCP", "port": 7443, "targetPort": "hub", **port}
    ]
    annotations = service["metadata"].get("annotations")
    assert annotations == ({"example.com/lb": "internal"} if case == "LoadBalancer" else None)


def test_the_hub_ingress_passes_tls_through_for_the_host_and_each_role_name() -> None:
    # Execute
    kinds = by_kind(
        render(
            "hub.enabled=true",
            "hub.ingress.enabled=true",
            "hub.ingress.host=hub.example.org",
            "hub.ingress.className=nginx",
        )
    )

    # Assert: a rule per server name, all to the hub Service's port; no TLS section.
    ingress = named(kinds, "Ingress", "demo-fedcore-hub")
    assert ingress["apiVersion"] == "networking.k8s.io/v1"
    assert ingress["metadata"]["annotations"] == {
        "nginx.ingress.kubernetes.io/ssl-passthrough": "true",
        "nginx.ingress.kubernetes.io/backend-protocol": "HTTPS",
    }
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert "tls" not in ingress["spec"]
    rules = ingress["spec"]["rules"]
    assert [rule["host"] for rule in rules] == ["hub.example.org", *HUB_NAMES]
    backend = {"service": {"name": "demo-fedcore-hub", "port": {"name": "hub"}}}
    for rule in rules:
        assert rule["http"]["paths"] == [{"path": "/", "pathType": "Prefix", "backend": backend}]
    assert named(kinds, "Service", "demo-fedcore-hub")["spec"]["ports"][0]["name"] == "hub"


RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


def allowed(
    plane: ControlPlane, account: tuple[str, str], verb: str, resource: str, namespace: str
) -> bool:
    """The API server's SubjectAccessReview of ``account`` (namespace, name); "" namespace:
    across all namespaces."""
    namespace_of, name = account
    attributes = {"verb": verb, "resource": resource}
    if namespace:
        attributes["namespace"] = namespace
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": f"system:serviceaccount:{namespace_of}:{name}",
            "groups": [
                "system:serviceaccounts",
                f"system:serviceaccounts:{namespace_of}",
                "system:authenticated",
            ],
            "resourceAttributes": attributes,
        },
    }
    answer = request(
        plane.api_client(),
        "POST",
        "/apis/authorization.k8s.io/v1/subjectaccessreviews",
        body=review,
    )
    return bool(answer["status"].get("allowed"))


RBAC_CASES = [
    ("default", [], {"system"}),
    ("watchNamespaces", ["operator.watchNamespaces={%(team)s}"], {"system", "team"}),
    ("clusterWide", ["operator.clusterWide=true"], {"system", "team", "other", ""}),
]


@pytest.mark.parametrize(("case", "sets", "readable"), RBAC_CASES, ids=[c[0] for c in RBAC_CASES])
def test_the_operator_reads_secrets_only_in_its_namespaces(
    control_plane: ControlPlane, case: str, sets: list[str], readable: set[str]
) -> None:
    # Prepare: the chart's RBAC as `helm template` renders it, applied to the real API server
    # (which authorizes with RBAC), for a release in "system", runs in "team", and "other".
    release = f"rb{uuid.uuid4().hex[:6]}"
    names = {key: f"{release}-{key}" for key in ("system", "team", "other")}
    for namespace in names.values():
        control_plane.create_namespace(namespace)
    docs = render_sets(release, names["system"], *(item % names for item in sets))
    rbac = [doc for doc in docs if doc["kind"] in RBAC_KINDS]
    account = (names["system"], f"{release}-fedcore")
    try:
        control_plane.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": rbac}),
        )

        # Execute: ask the API server what the operator's ServiceAccount may do where.
        where = {"": "", **names}
        verdicts = {
            (verb, key): allowed(control_plane, account, verb, "secrets", where[key])
            for verb in ("get", "list", "create")
            for key in where
        }
        deletes = {
            key: allowed(control_plane, account, "delete", "secrets", where[key]) for key in where
        }
        pods = {key: allowed(control_plane, account, "create", "pods", where[key]) for key in where}

        # Assert
        for (verb, key), verdict in verdicts.items():
            assert verdict == (key in readable), (case, verb, key or "all namespaces")
        assert deletes == {key: key in readable for key in where}, case
        assert pods == {key: key in readable for key in where}, case
        # Every case may keep CA keys in its own namespace (the ca-keys Role).
        assert deletes["system"]
    finally:
        control_plane.kubectl(
            "delete", "clusterrole,clusterrolebinding", "-l",
            f"app.kubernetes.io/instance={release}", check=False,
        )  # fmt: skip
        for namespace in names.values():
            control_plane.delete_namespace(namespace)


def test_notes_warn_when_the_operator_may_read_every_secret(control_plane: ControlPlane) -> None:
    # Execute
    def notes(*sets: str) -> str:
        args = ["install", "notes", str(CHART), f"--kubeconfig={control_plane.kubeconfig}"]
        args += ["--namespace", "fedcore-notes", "--dry-run"]
        for item in sets:
            args += ["--set", item]
        return helm(*args).stdout.split("NOTES:", 1)[1]

    wide = notes("operator.clusterWide=true")
    scoped = notes("operator.watchNamespaces={team-a}")

    # Assert
    assert "WARNING: operator.clusterWide is true" in wide
    assert "Secrets in EVERY namespace" in wide
    assert "WARNING" not in scoped
    assert "watches FederatedRuns in fedcore-notes, team-a." in scoped
    assert "kubectl apply -n team-a -f examples/digits-fedavg.yaml" in scoped


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
        "--set", f"operator.watchNamespaces={{{namespace}}}",
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
        # The run's CA key is in the release namespace, not the run's.
        core = control_plane.core()
        in_run = [s.metadata.name for s in core.list_namespaced_secret(namespace).items]
        assert "via-helm-ca" not in in_run
        kept = core.read_namespaced_secret(f"fedcore-ca.{namespace}.via-helm", system)
        assert set(kept.data) == {"ca.crt", "ca.key"}
    finally:
        helm("uninstall", release, kubeconfig, "--namespace", system, check=False)
        control_plane.kubectl("delete", "clusterrolebinding", "-l",
                              f"app.kubernetes.io/instance={release}", check=False)  # fmt: skip

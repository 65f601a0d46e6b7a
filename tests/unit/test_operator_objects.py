"""The operator's pure builders: the CRD file, owned objects, pod security and placement."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest
import yaml
from cryptography import x509

from fedcore.spec import load_manifest, openapi_schema, parse_manifest
from fedcore_operator import objects
from fedcore_operator.crd import (
    CHART_CRD_PATH,
    FEDERATED_RUN,
    PARTICIPATION,
    PARTICIPATION_CRD_NAME,
    PARTICIPATION_CRD_PATH,
    PRINTER_COLUMNS,
    crd_manifest,
    crd_yaml,
    crds_yaml,
)
from fedcore_operator.settings import OperatorSettings


def manifest(protocol: str = "fedavg", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "FederatedRun",
        "metadata": {"name": "demo"},
        "spec": {"protocol": {"name": protocol}, "clients": {"count": 3}, "rounds": 2},
    }
    if protocol in ("perturb", "mpdp"):
        body["spec"].update(
            {
                "model": {"kind": "MLP", "hidden": [16], "bias": False, "dtype": "float64"},
                "training": {"loss": "MSE", "localEpochs": 1, "batchSize": 100000},
            }
        )
    body["spec"].update(spec)
    return body


def context(body: dict[str, Any]) -> objects.RunContext:
    return objects.RunContext(parse_manifest(body), "team-a", "uid-1", OperatorSettings())


def test_chart_crd_is_the_generated_one() -> None:
    assert CHART_CRD_PATH.read_text(encoding="utf-8") == crd_yaml(), (
        "charts/fedcore/crds/federatedruns.yaml is stale: run "
        "`python -m fedcore_operator crd --write`"
    )


def test_crd_declares_status_subresource_printer_columns_and_status_schema() -> None:
    crd = crd_manifest()
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [column["name"] for column in version["additionalPrinterColumns"]] == [
        column["name"] for column in PRINTER_COLUMNS
    ]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert "x-kubernetes-preserve-unknown-fields" not in status
    assert {"phase", "conditions", "observedGeneration", "round", "privacy"} <= set(
        status["properties"]
    )
    assert status["properties"]["phase"]["enum"] == [
        "Pending",
        "Running",
        "Succeeded",
        "Failed",
        "Suspended",
    ]
    assert crd["spec"]["names"]["shortNames"]


def test_chart_participation_crd_is_the_generated_one() -> None:
    assert PARTICIPATION_CRD_PATH.read_text(encoding="utf-8") == crd_yaml(PARTICIPATION), (
        "charts/fedcore/crds/participations.yaml is stale: run "
        "`python -m fedcore_operator crd --write`"
    )
    assert PARTICIPATION_CRD_PATH.parent == CHART_CRD_PATH.parent
    assert [doc["metadata"]["name"] for doc in yaml.safe_load_all(crds_yaml())] == [
        "federatedruns.fedcore.dev",
        PARTICIPATION_CRD_NAME,
    ]


def test_both_crds_come_from_one_builder_and_the_run_schema_is_openapi_schema() -> None:
    run_schema = crd_manifest(FEDERATED_RUN)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert run_schema == openapi_schema()
    assert crd_manifest() == crd_manifest(FEDERATED_RUN)


def _schema_nodes(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    found = [(path, node)]
    for name, child in node.get("properties", {}).items():
        found += _schema_nodes(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            found += _schema_nodes(node[key], f"{path}[]")
    return found


def test_participation_crd_names_columns_status_and_unknown_fields() -> None:
    # Execute
    crd = crd_manifest(PARTICIPATION)

    # Assert: names, the status subresource and the printer columns.
    assert crd["metadata"]["name"] == "participations.fedcore.dev" == PARTICIPATION_CRD_NAME
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["singular"]) == (
        "Participation",
        "participations",
        "participation",
    )
    assert names["shortNames"] == ["fedpart"] and names["categories"] == ["fedcore"]
    assert crd["spec"]["scope"] == "Namespaced"
    (version,) = crd["spec"]["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Run", "Phase", "Ready", "Round", "Epsilon", "Reason", "Age"]
    assert columns["Run"]["jsonPath"] == ".spec.run"
    assert (columns["Ready"]["jsonPath"], columns["Ready"]["type"]) == (
        ".status.clients.ready",
        "integer",
    )
    assert (columns["Round"]["jsonPath"], columns["Round"]["type"]) == (
        ".status.run.round",
        "integer",
    )
    assert (columns["Epsilon"]["jsonPath"], columns["Epsilon"]["type"]) == (
        ".status.run.epsilon",
        "number",
    )
    assert columns["Reason"]["priority"] == 1 and columns["Age"]["type"] == "date"
    # The schema: metadata the server's; every spec object keeps unknown fields (for the site
    # operator to refuse by name); status declared, pruned and never defaulted.
    schema = version["schema"]["openAPIV3Schema"]
    assert schema["properties"]["metadata"] == {"type": "object"}
    spec = schema["properties"]["spec"]
    assert {"run", "specDigest", "clients", "floor"} <= set(spec["required"])
    spec_objects = [(p, node) for p, node in _schema_nodes(spec, "spec") if "properties" in node]
    assert len(spec_objects) > 5
    for path, node in spec_objects:
        assert node.get("x-kubernetes-preserve-unknown-fields") is True, path
    status = schema["properties"]["status"]
    for path, node in _schema_nodes(status, "status"):
        assert "x-kubernetes-preserve-unknown-fields" not in node, path
        assert "default" not in node, path
    assert {"phase", "reason", "clients", "run", "conditions"} <= set(status["properties"])
    assert "Refused" in status["properties"]["phase"]["enum"]
    assert "epsilon" in status["properties"]["run"]["properties"]


def kinds(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(item["kind"], item["metadata"]["name"]) for item in items]


def test_fedavg_run_has_no_kdc_and_every_object_is_owned_and_labelled() -> None:
    ctx = context(manifest())
    built = objects.static_objects(ctx)
    assert ("Service", "demo-kdc") not in kinds(built)
    assert ("Service", "demo-server") in kinds(built)
    assert ("Service", "demo-clients") in kinds(built)
    assert [name for name, _, _ in objects.pod_identities(ctx)] == [
        "demo-server",
        "demo-client-0",
        "demo-client-1",
        "demo-client-2",
    ]
    for item in built:
        assert item["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert item["metadata"]["labels"][objects.RUN_LABEL] == "demo"
        assert item["metadata"]["namespace"] == "team-a"


def test_mpdp_run_gets_a_kdc_that_only_clients_reach() -> None:
    ctx = context(manifest("mpdp"))
    assert ctx.needs_kdc
    policies = {item["metadata"]["name"]: item for item in objects.network_policies(ctx)}
    kdc = policies["demo-kdc"]["spec"]
    assert kdc["policyTypes"] == ["Ingress", "Egress"]
    grpc_in = [rule for rule in kdc["ingress"] if "from" in rule]
    assert len(grpc_in) == 1
    assert grpc_in[0]["from"] == [
        {"podSelector": {"matchLabels": {objects.RUN_LABEL: "demo", objects.ROLE_LABEL: "client"}}}
    ]
    client_egress = policies["demo-client"]["spec"]["egress"]

    def to_role(role: str, port: int) -> dict[str, Any]:
        labels = {objects.RUN_LABEL: "demo", objects.ROLE_LABEL: role}
        return {
            "to": [{"podSelector": {"matchLabels": labels}}],
            "ports": [{"protocol": "TCP", "port": port}],
        }

    assert client_egress == [CLUSTER_DNS_RULE, to_role("server", 7070), to_role("kdc", 7071)]
    # Not decentralized: no client-to-client rule either way, and no scraper named: no ingress.
    assert policies["demo-client"]["spec"]["ingress"] == []


CLUSTER_DNS_RULE = {
    "to": [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
        }
    ],
    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
}
API_RULE = {
    "to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}],
    "ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}],
}
STORE = {"ipBlock": {"cidr": "192.0.2.0/24"}}
ANY_ADDRESS = [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}]
S3_CASES = [
    ("no S3", None, (), []),
    ("IPv4 endpoint", "http://10.1.2.3:9000", (STORE,), [{"ipBlock": {"cidr": "10.1.2.3/32"}}]),
    ("IPv6 endpoint", "https://[2001:db8::5]", (), [{"ipBlock": {"cidr": "2001:db8::5/128"}}]),
    ("host name, peers named", "http://minio.store:9000", (STORE,), [STORE]),
    ("host name, none named", "http://minio.store:9000", (), ANY_ADDRESS),
    ("AWS default, peers named", "", (STORE,), [STORE]),
]


@pytest.mark.parametrize(
    ("case", "endpoint", "s3_to", "to"), S3_CASES, ids=[case[0] for case in S3_CASES]
)
def test_server_reaches_dns_the_api_server_and_the_s3_endpoint_only(
    case: str, endpoint: str | None, s3_to: tuple[dict[str, Any], ...], to: list[Any]
) -> None:
    # Prepare
    spec: dict[str, Any] = {}
    if endpoint is not None:
        s3: dict[str, Any] = {"bucket": "runs"}
        if endpoint:
            s3["endpoint"] = endpoint
        spec["checkpoint"] = {"s3": s3}
    settings = OperatorSettings(s3_to=s3_to)
    ctx = objects.RunContext(parse_manifest(manifest(**spec)), "team-a", "uid-1", settings)
    port = 9000 if endpoint and ":9000" in endpoint else 443

    # Execute
    policies = {item["metadata"]["name"]: item["spec"] for item in objects.network_policies(ctx)}

    # Assert
    store = [{"to": to, "ports": [{"protocol": "TCP", "port": port}]}] if to else []
    assert policies["demo-server"]["egress"] == [CLUSTER_DNS_RULE, API_RULE, *store]


def test_metrics_are_open_to_the_named_scraper_only() -> None:
    # Prepare
    scraper = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    body = parse_manifest(manifest("mpdp"))
    named = objects.RunContext(body, "team-a", "uid-1", OperatorSettings(metrics_from=(scraper,)))
    unnamed = objects.RunContext(body, "team-a", "uid-1", OperatorSettings())

    # Execute
    with_scraper = objects.network_policies(named)
    without = objects.network_policies(unnamed)

    # Assert: one rule per role lets the scraper, and nothing else, reach port 9090.
    for policy in with_scraper:
        rules = [rule for rule in policy["spec"]["ingress"] if rule["ports"][0]["port"] == 9090]
        assert rules == [{"from": [scraper], "ports": [{"protocol": "TCP", "port": 9090}]}]
    for policy in without:
        assert all(rule["ports"][0]["port"] != 9090 for rule in policy["spec"]["ingress"])
        assert all("from" in rule for rule in policy["spec"]["ingress"])
    for policy in [*with_scraper, *without]:
        assert policy["spec"]["egress"][0] == CLUSTER_DNS_RULE


def test_pods_are_non_root_read_only_and_carry_placement() -> None:
    body = manifest(
        roles={
            "clients": {
                "gpus": 2,
                "nodeSelector": {"pool": "gpu"},
                "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {"key": "zone", "operator": "In", "values": ["a"]}
                                    ]
                                }
                            ]
                        }
                    }
                },
                "resources": {"requests": {"cpu": "1"}},
            }
        }
    )
    ctx = context(body)
    pod = objects.client_pod(ctx, 1)
    spec = pod["spec"]
    container = spec["containers"][0]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"] == {
        "requests": {"cpu": "1"},
        "limits": {"nvidia.com/gpu": "2"},
    }
    assert spec["nodeSelector"] == {"pool": "gpu"}
    assert spec["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "nodeAffinity" in spec["affinity"]
    assert spec["hostname"] == "client-1" and spec["subdomain"] == "demo-clients"
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["FEDCORE_CLIENT_INDEX"] == "1"
    assert env["FEDCORE_SERVER"] == "demo-server.team-a.svc:7070"
    assert "FEDCORE_KDC" not in env
    assert spec["automountServiceAccountToken"] is False
    assert spec["restartPolicy"] == "Never"
    server = objects.server_pod(ctx, resume=True)
    server_env = {
        item["name"]: item.get("value") for item in server["spec"]["containers"][0]["env"]
    }
    assert server_env["FEDCORE_RESUME"] == "1"
    assert server_env["FEDCORE_STATUS_RUN"] == "demo"
    assert server["spec"]["automountServiceAccountToken"] is True
    assert server["spec"]["containers"][0]["resources"] == {}


def test_pod_template_merges_but_cannot_weaken_security() -> None:
    template = {
        "metadata": {"labels": {"team": "x", objects.RUN_LABEL: "evil"}, "annotations": {"a": "b"}},
        "spec": {
            "priorityClassName": "high",
            "securityContext": {"runAsNonRoot": False},
            "restartPolicy": "Always",
            "containers": [
                {
                    "name": "fedcore",
                    "securityContext": {"readOnlyRootFilesystem": False, "privileged": True},
                    "env": [{"name": "X", "value": "1"}],
                },
                {"name": "sidecar", "image": "busybox"},
            ],
        },
    }
    # Validation refuses such a template (fedcore/spec/_pod_security.py); the merge must hold
    # its locks on its own too (defence in depth), so the template is applied directly.
    ctx = context(manifest())
    pod = objects.apply_pod_template(objects.server_pod(ctx, resume=False), template)
    assert pod["metadata"]["labels"]["team"] == "x"
    assert pod["metadata"]["labels"][objects.RUN_LABEL] == "demo"
    assert pod["metadata"]["annotations"]["a"] == "b"
    assert pod["spec"]["priorityClassName"] == "high"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["restartPolicy"] == "Never"
    names = [container["name"] for container in pod["spec"]["containers"]]
    assert names == ["fedcore", "sidecar"]
    for container in pod["spec"]["containers"]:
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["privileged"] is False
    # The template's env merges by name (as kubectl's strategic merge): the operator's stay.
    built = objects.server_pod(ctx, resume=False)["spec"]["containers"][0]["env"]
    assert pod["spec"]["containers"][0]["env"] == [*built, {"name": "X", "value": "1"}]


def test_pod_template_env_mounts_and_ports_merge_by_key() -> None:
    ctx = context(manifest())
    built = objects.server_pod(ctx, resume=False)
    container = built["spec"]["containers"][0]
    template = {
        "spec": {
            "volumes": [{"name": "extra", "emptyDir": {}}],
            "containers": [
                {
                    "name": "fedcore",
                    "env": [
                        {"name": "FEDCORE_WORKDIR", "value": "/elsewhere"},
                        {"name": "NEW", "value": "1"},
                    ],
                    "volumeMounts": [{"name": "extra", "mountPath": "/extra"}],
                    "ports": [{"name": "debug", "containerPort": 5678}],
                }
            ],
        }
    }
    merged = objects.apply_pod_template(built, template)["spec"]["containers"][0]
    env = {item["name"]: item.get("value") for item in merged["env"]}
    assert env["FEDCORE_WORKDIR"] == "/elsewhere"  # replaced by name
    assert env["NEW"] == "1"  # added
    assert env["FEDCORE_MANIFEST"] == "/etc/fedcore/run/run.yaml"  # the operator's, kept
    assert len(merged["env"]) == len(container["env"]) + 1
    assert merged["volumeMounts"] == [
        *container["volumeMounts"],
        {"name": "extra", "mountPath": "/extra"},
    ]
    assert [port["containerPort"] for port in merged["ports"]] == [
        *(port["containerPort"] for port in container["ports"]),
        5678,
    ]


def test_template_leaves_the_built_pod_alone() -> None:
    ctx = context(manifest())
    pod = objects.server_pod(ctx, resume=False)
    before = copy.deepcopy(pod)
    objects.apply_pod_template(pod, {"spec": {"priorityClassName": "x"}})
    assert pod == before


def test_pod_certificates_name_their_services_and_chain_to_the_run_ca() -> None:
    from fedcore.transport import RunCa

    ctx = context(manifest("mpdp"))
    ca = RunCa.generate("demo")
    secret = objects.pod_tls_secret(ctx, ca, "demo-server", "server", None)
    certificate = x509.load_pem_x509_certificate(secret["stringData"]["tls.crt"].encode())
    names = certificate.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.DNSName)
    assert "demo-server.team-a.svc" in names
    assert certificate.issuer == ca.certificate.subject
    client = objects.pod_tls_secret(ctx, ca, "demo-client-2", "client-2", 2)
    cert = x509.load_pem_x509_certificate(client["stringData"]["tls.crt"].encode())
    assert "client-2.demo-clients.team-a.svc" in cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.DNSName)
    stored = objects.ca_secret(ctx, ca)
    as_read = {
        "data": {
            key: base64.b64encode(value.encode()).decode()
            for key, value in stored["stringData"].items()
        }
    }
    assert objects.load_ca(as_read).cert_pem == ca.cert_pem


def test_server_role_allows_only_its_own_status() -> None:
    ctx = context(manifest())
    role = objects.server_status_role(ctx)
    assert role["rules"] == [
        {
            "apiGroups": ["fedcore.dev"],
            "resources": ["federatedruns/status"],
            "resourceNames": ["demo"],
            "verbs": ["get", "patch"],
        }
    ]


@pytest.mark.parametrize("protocol", ["fedavg", "fedsgd", "dp-fedavg", "perturb", "mpdp"])
def test_manifest_config_map_round_trips_to_the_same_spec(protocol: str) -> None:
    ctx = context(manifest(protocol))
    text = objects.manifest_config_map(ctx)["data"][objects.MANIFEST_FILE]
    again = load_manifest(objects.MANIFEST_FILE, text=text)  # as a role reads it
    assert again.spec == ctx.run.spec
    assert again.metadata.namespace == "team-a"


def test_the_manifest_a_role_loads_keeps_number_like_strings_as_strings() -> None:
    # Prepare: quantities that a YAML dumper leaves unquoted and a YAML reader takes as numbers
    limits = {"memory": "1e3", "cpu": "2e0"}
    ctx = context(manifest("fedavg", roles={"clients": {"resources": {"limits": limits}}}))
    # Execute: read as a role reads it
    text = objects.manifest_config_map(ctx)["data"][objects.MANIFEST_FILE]
    again = load_manifest(objects.MANIFEST_FILE, text=text)
    # Assert
    assert again.spec == ctx.run.spec
    assert again.spec.roles.clients.resources.limits == limits


def test_ebscfl_server_gets_the_kdc_address_and_may_reach_it() -> None:
    # Prepare: ebscfl's server fetches its own keys from the KDC (server_uses_kdc)
    ctx = context(manifest("ebscfl"))
    mpdp = context(manifest("mpdp"))
    # Execute
    container = objects.server_pod(ctx, resume=False)["spec"]["containers"][0]
    env = {item["name"]: item.get("value") for item in container["env"]}
    mpdp_container = objects.server_pod(mpdp, resume=False)["spec"]["containers"][0]
    mpdp_env = {item["name"] for item in mpdp_container["env"]}
    policies = {item["metadata"]["name"]: item["spec"] for item in objects.network_policies(ctx)}
    # Assert
    assert env["FEDCORE_KDC"] == "demo-kdc.team-a.svc:7071"
    assert "FEDCORE_KDC" not in mpdp_env
    callers = [rule["from"] for rule in policies["demo-kdc"]["ingress"] if "from" in rule]
    roles = sorted(p["podSelector"]["matchLabels"][objects.ROLE_LABEL] for p in callers[0])
    assert roles == ["client", "server"]
    server_targets = [
        rule["to"][0]["podSelector"]["matchLabels"][objects.ROLE_LABEL]
        for rule in policies["demo-server"]["egress"]
        if objects.ROLE_LABEL in rule["to"][0].get("podSelector", {}).get("matchLabels", {})
    ]
    assert server_targets == ["kdc"]


# ----------------------------------------------------------------- locks (issue 19, item 4)

HOSTILE_TEMPLATE: dict[str, Any] = {
    "metadata": {
        "annotations": {
            "container.apparmor.security.beta.kubernetes.io/fedcore": "unconfined",
            "seccomp.security.alpha.kubernetes.io/pod": "unconfined",
            "team": "x",
        }
    },
    "spec": {
        "hostPID": True,
        "hostNetwork": True,
        "hostIPC": True,
        "nodeName": "node-7",
        "serviceAccountName": "admin",
        "serviceAccount": "admin",
        "automountServiceAccountToken": True,
        "restartPolicy": "Always",
        "priorityClassName": "high",
        "securityContext": {
            "runAsUser": 0,
            "runAsNonRoot": False,
            "seccompProfile": {"type": "Unconfined"},
            "sysctls": [{"name": "kernel.shm_rmid_forced", "value": "0"}],
            "seLinuxOptions": {"type": "spc_t"},
            "supplementalGroups": [0],
        },
        "initContainers": [
            {
                "name": "setup",
                "image": "busybox",
                "securityContext": {
                    "privileged": True,
                    "runAsUser": 0,
                    "capabilities": {"add": ["SYS_ADMIN"]},
                },
                "volumeMounts": [{"name": "host", "mountPath": "/host"}],
                "env": [
                    {
                        "name": "STOLEN",
                        "valueFrom": {"secretKeyRef": {"name": "demo-ca", "key": "ca.key"}},
                    }
                ],
            }
        ],
        "ephemeralContainers": [
            {"name": "debug", "image": "busybox", "securityContext": {"privileged": True}}
        ],
        "containers": [
            {
                "name": "fedcore",
                "securityContext": {
                    "capabilities": {"add": ["SYS_ADMIN", "NET_ADMIN"]},
                    "seccompProfile": {"type": "Unconfined"},
                    "procMount": "Unmasked",
                    "allowPrivilegeEscalation": True,
                },
                "ports": [{"name": "grpc", "containerPort": 7070, "hostPort": 7070}],
                "volumeMounts": [{"name": "ca", "mountPath": "/etc/fedcore/tls"}],
                "envFrom": [{"secretRef": {"name": "demo-client-0-tls"}}],
            },
            {
                "name": "sidecar",
                "image": "busybox",
                "securityContext": {"runAsUser": 0, "readOnlyRootFilesystem": False},
                "volumeMounts": [
                    {"name": "host", "mountPath": "/host"},
                    {"name": "scratch", "mountPath": "/scratch"},
                    {"name": "tls", "mountPath": "/tls"},
                ],
            },
        ],
        "volumes": [
            {"name": "host", "hostPath": {"path": "/"}},
            {"name": "ca", "secret": {"secretName": "demo-ca"}},
            {"name": "tls", "secret": {"secretName": "demo-ca"}},
            {"name": "conf", "configMap": {"name": "other"}},
            {"name": "token", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}},
            {"name": "nfs", "nfs": {"server": "10.0.0.1", "path": "/"}},
            {"name": "scratch", "emptyDir": {"medium": "Memory"}},
        ],
    },
}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What Pod Security Admission's ``restricted`` level (v1.25+) would refuse in ``pod``."""
    spec = pod["spec"]
    problems = [key for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]
    allowed = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral"}
    allowed |= {"persistentVolumeClaim", "projected", "secret"}
    for volume in spec.get("volumes") or []:
        problems += [f"volume {key}" for key in set(volume) - {"name"} - allowed]
    pod_security = spec.get("securityContext") or {}
    if pod_security.get("sysctls"):
        problems.append("sysctls")
    for container in [*spec["containers"], *spec.get("initContainers", [])]:
        security = container.get("securityContext") or {}
        name = container["name"]
        if security.get("privileged"):
            problems.append(f"{name} privileged")
        if security.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name} allowPrivilegeEscalation")
        if not (security.get("runAsNonRoot") or pod_security.get("runAsNonRoot")):
            problems.append(f"{name} runAsNonRoot")
        if security.get("runAsUser", pod_security.get("runAsUser")) == 0:
            problems.append(f"{name} runAsUser 0")
        capabilities = security.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            problems.append(f"{name} drop ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name} capabilities.add")
        seccomp = security.get("seccompProfile") or pod_security.get("seccompProfile") or {}
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name} seccomp")
        if any(port.get("hostPort") for port in container.get("ports") or []):
            problems.append(f"{name} hostPort")
        if security.get("procMount") not in (None, "Default"):
            problems.append(f"{name} procMount")
        if security.get("seLinuxOptions") or pod_security.get("seLinuxOptions"):
            problems.append(f"{name} seLinuxOptions")
    for key, value in (pod["metadata"].get("annotations") or {}).items():
        if "apparmor" in key or "seccomp" in key:
            problems.append(f"annotation {key}={value}")
    return problems


def test_hostile_template_gets_none_of_what_it_asks_for() -> None:
    # Prepare: a template that asks for everything validation refuses, applied directly (as if
    # it had got past admission): the operator's merge must hold on its own.
    ctx = context(manifest())
    built = objects.server_pod(ctx, resume=False)

    # Execute
    pod = objects.apply_pod_template(built, copy.deepcopy(HOSTILE_TEMPLATE))

    # Assert: pod level
    spec = pod["spec"]
    for key in ("hostPID", "hostNetwork", "hostIPC", "nodeName", "ephemeralContainers"):
        assert key not in spec, key
    assert spec["serviceAccountName"] == "demo-server" and "serviceAccount" not in spec
    assert spec["restartPolicy"] == "Never"
    assert spec["priorityClassName"] == "high"  # harmless choices are kept
    assert spec["securityContext"] == built["spec"]["securityContext"]
    # Volumes: the operator's own (its "tls" is the pod's Secret, not the CA's), plus the
    # template's emptyDir; no host path, Secret, ConfigMap, projected token or NFS.
    assert spec["volumes"] == [
        *built["spec"]["volumes"],
        {"name": "scratch", "emptyDir": {"medium": "Memory"}},
    ]
    assert {"name": "tls", "secret": {"secretName": "demo-server-tls", "defaultMode": 0o440}} in (
        spec["volumes"]
    )
    # Containers, init containers and sidecars alike
    main, sidecar = spec["containers"]
    (init,) = spec["initContainers"]
    locked = {**objects.LOCKED_CONTAINER_SECURITY, "capabilities": {"drop": ["ALL"]}}
    for container in (main, sidecar, init):
        assert container["securityContext"] == locked, container["name"]
    assert main["ports"][0] == {"name": "grpc", "containerPort": 7070}
    assert main["volumeMounts"] == built["spec"]["containers"][0]["volumeMounts"]
    assert "envFrom" in main and main["envFrom"] == []  # another pod's Secret: dropped
    assert init["volumeMounts"] == [] and init["env"] == []
    assert sidecar["volumeMounts"] == [
        {"name": "scratch", "mountPath": "/scratch"},
        {"name": "tls", "mountPath": "/tls"},
    ]
    assert pod["metadata"]["annotations"]["team"] == "x"
    assert restricted_violations(pod) == []


def test_a_template_may_choose_harmless_security_settings() -> None:
    # Prepare
    template = {
        "spec": {
            "securityContext": {
                "runAsUser": 2000,
                "fsGroup": 3000,
                "supplementalGroups": [4000],
                "seccompProfile": {"type": "Localhost", "localhostProfile": "fedcore.json"},
            },
            "containers": [
                {"name": "fedcore", "securityContext": {"runAsUser": 2001}},
                {
                    "name": "sidecar",
                    "image": "busybox",
                    "env": [
                        {
                            "name": "S3_KEY",
                            "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": "k"}},
                        }
                    ],
                },
            ],
        }
    }
    ctx = context(manifest(checkpoint={"s3": {"bucket": "runs", "credentialsSecret": "s3-creds"}}))

    # Execute
    pod = objects.apply_pod_template(objects.server_pod(ctx, resume=False), template)

    # Assert
    security = pod["spec"]["securityContext"]
    assert security["runAsUser"] == 2000 and security["fsGroup"] == 3000
    assert security["supplementalGroups"] == [4000] and security["runAsNonRoot"] is True
    assert security["seccompProfile"]["type"] == "Localhost"
    main, sidecar = pod["spec"]["containers"]
    assert main["securityContext"]["runAsUser"] == 2001
    assert main["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    # The run's own S3 Secret is one the server pod already has: a sidecar may read it.
    assert sidecar["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "s3-creds"
    assert restricted_violations(pod) == []


@pytest.mark.parametrize("protocol", ["fedavg", "mpdp", "lppa"])
def test_locks_leave_every_built_pod_as_it_is_and_it_meets_restricted(protocol: str) -> None:
    # Prepare
    s3 = {"s3": {"bucket": "runs", "endpoint": "http://10.0.0.9:9000", "credentialsSecret": "c"}}
    ctx = context(manifest(protocol, checkpoint=s3))
    pods = [objects.server_pod(ctx, resume=True), objects.client_pod(ctx, 0)]
    if ctx.needs_kdc:
        pods.append(objects.kdc_pod(ctx, resume=False))

    # Execute
    locked = [objects.lock_pod(pod, pod) for pod in pods]

    # Assert
    assert locked == pods
    for pod in pods:
        assert restricted_violations(pod) == [], pod["metadata"]["name"]


def test_the_run_ca_is_kept_in_the_operators_namespace_without_owner() -> None:
    # Prepare
    from fedcore.transport import RunCa

    settings = OperatorSettings(ca_namespace="fedcore-system")
    ctx = objects.RunContext(parse_manifest(manifest()), "team-a", "uid-1", settings)
    ca = RunCa.generate("demo")

    # Execute
    secret = objects.ca_secret(ctx, ca)

    # Assert
    meta = secret["metadata"]
    assert (meta["namespace"], meta["name"]) == ("fedcore-system", "fedcore-ca.team-a.demo")
    assert "ownerReferences" not in meta
    assert objects.RUN_LABEL not in meta["labels"]  # not listed among the run's own objects
    assert meta["labels"][objects.CA_UID_LABEL] == "uid-1"
    assert objects.ca_secret_is_for(secret, "uid-1")
    assert not objects.ca_secret_is_for(secret, "uid-2")
    assert objects.legacy_ca_secret_name("demo") == "demo-ca"
    # No pod of the run refers to it.
    for pod in (objects.server_pod(ctx, resume=False), objects.client_pod(ctx, 0)):
        assert "fedcore-ca" not in json.dumps(pod)


# ---------------------------------------------------------------------------- checkpoint keys

KEY_ENVS = {"FEDCORE_CHECKPOINT_KEY_FILE", "FEDCORE_KDC_STATE_KEY_FILE"}


def key_wiring(pod: dict[str, Any]) -> dict[str, Any]:
    """What a pod gets of the run's keys: the key Secrets its volumes name (with their mode),
    the mounts of those volumes in each container, and the key file variables set."""
    volumes = {
        volume["name"]: volume["secret"]
        for volume in pod["spec"]["volumes"]
        if "secret" in volume and volume["secret"]["secretName"].endswith("-keys")
    }
    containers = [*pod["spec"]["containers"], *pod["spec"].get("initContainers", [])]
    return {
        "secrets": {source["secretName"]: source.get("defaultMode") for source in volumes.values()},
        "mounts": [
            (container["name"], mount["mountPath"], mount.get("readOnly"))
            for container in containers
            for mount in container.get("volumeMounts") or []
            if mount["name"] in volumes
        ],
        "env": {
            item["name"]: item.get("value")
            for container in containers
            for item in container.get("env") or []
            if item["name"] in KEY_ENVS or "-keys" in json.dumps(item)
        },
    }


def test_server_and_kdc_pods_mount_only_their_own_key_and_clients_none() -> None:
    # Prepare: a protocol with a KDC, and an S3 Secret every checkpointing pod is given.
    s3 = {"s3": {"bucket": "runs", "credentialsSecret": "c"}}
    ctx = context(manifest("mpdp", checkpoint=s3))

    # Execute
    server = key_wiring(objects.server_pod(ctx, resume=True))
    kdc = key_wiring(objects.kdc_pod(ctx, resume=False))
    clients = [key_wiring(objects.client_pod(ctx, index)) for index in range(3)]

    # Assert
    assert server == {
        "secrets": {"demo-server-keys": 0o440},
        "mounts": [("fedcore", "/etc/fedcore/keys", True)],
        "env": {"FEDCORE_CHECKPOINT_KEY_FILE": "/etc/fedcore/keys/checkpoint.key"},
    }
    assert kdc == {
        "secrets": {"demo-kdc-keys": 0o440},
        "mounts": [("fedcore", "/etc/fedcore/keys", True)],
        "env": {"FEDCORE_KDC_STATE_KEY_FILE": "/etc/fedcore/keys/state.key"},
    }
    assert clients == [{"secrets": {}, "mounts": [], "env": {}}] * 3


def test_a_run_without_a_kdc_has_a_server_key_only() -> None:
    ctx = context(manifest("fedavg"))
    assert objects.key_roles(ctx) == [("server", None)]
    assert objects.key_roles(context(manifest("mpdp"))) == [("kdc", None), ("server", None)]
    assert key_wiring(objects.server_pod(ctx, resume=False))["secrets"] == {
        "demo-server-keys": 0o440
    }


def test_each_client_of_a_decentralized_protocol_mounts_its_own_key_and_no_other() -> None:
    # Prepare: lppa's clients keep their own checkpoints (in S3, to be resumable).
    s3 = {"s3": {"bucket": "runs", "credentialsSecret": "c"}}
    ctx = context(manifest("lppa", checkpoint=s3))

    # Execute
    holders = objects.key_roles(ctx)
    clients = [key_wiring(objects.client_pod(ctx, index)) for index in range(3)]
    server = key_wiring(objects.server_pod(ctx, resume=False))

    # Assert: a Secret per client, each mounted read-only into its own pod alone, and named
    # by the same variable the server's pod uses for its own key.
    assert holders == [("server", None), ("client", 0), ("client", 1), ("client", 2)]
    for index, wiring in enumerate(clients):
        assert wiring == {
            "secrets": {f"demo-client-{index}-keys": 0o440},
            "mounts": [("fedcore", "/etc/fedcore/keys", True)],
            "env": {"FEDCORE_CHECKPOINT_KEY_FILE": "/etc/fedcore/keys/checkpoint.key"},
        }
    assert server["secrets"] == {"demo-server-keys": 0o440}


def test_key_secret_holds_the_key_as_hex_and_is_owned_by_the_run() -> None:
    # Prepare
    ctx = context(manifest("mpdp"))
    key = "0123456789abcdef" * 4

    # Execute
    server = objects.keys_secret(ctx, "server", key)
    kdc = objects.keys_secret(ctx, "kdc", key)

    # Assert
    assert server["metadata"]["name"] == "demo-server-keys"
    assert server["stringData"] == {"checkpoint.key": key}
    assert kdc["metadata"]["name"] == "demo-kdc-keys"
    assert kdc["stringData"] == {"state.key": key}
    for secret in (server, kdc):
        assert secret["kind"] == "Secret" and secret["type"] == "Opaque"
        assert secret["metadata"]["namespace"] == "team-a"
        assert secret["metadata"]["ownerReferences"] == [objects.owner_reference(ctx)]
        assert secret["metadata"]["labels"][objects.RUN_LABEL] == "demo"
    for bad_role, bad_key in (("client", key), ("server", key.upper()), ("server", key[:-2])):
        with pytest.raises(ValueError):
            objects.keys_secret(ctx, bad_role, bad_key)
    # A decentralized protocol's client has one, named after its pod, and needs its index.
    lppa = context(manifest("lppa"))
    client = objects.keys_secret(lppa, "client", key, 2)
    assert client["metadata"]["name"] == "demo-client-2-keys"
    assert client["stringData"] == {"checkpoint.key": key}
    assert client["metadata"]["labels"][objects.INDEX_LABEL] == "2"
    assert client["metadata"]["ownerReferences"] == [objects.owner_reference(lppa)]
    with pytest.raises(ValueError):
        objects.keys_secret(lppa, "client", key)


def test_key_secret_names_are_never_the_runs_longest() -> None:
    longest = objects.longest_name("r" * 40, 1)
    for role in ("server", "kdc"):
        assert len(objects.keys_secret_name("r" * 40, role)) < len(longest)
    # A client's key Secret is one character longer than its TLS Secret: still far within a
    # Secret name's 253 (a DNS subdomain); the 63 of a DNS label bind Services and pods.
    assert len(objects.keys_secret_name("r" * 40, "client", 0)) == len(longest) + 1 <= 253


KEY_THIEF_TEMPLATE: dict[str, Any] = {
    "spec": {
        "initContainers": [
            {
                "name": "copy",
                "image": "busybox",
                "volumeMounts": [{"name": "keys", "mountPath": "/stolen"}],
                "env": [
                    {
                        "name": "K",
                        "valueFrom": {
                            "secretKeyRef": {"name": "demo-server-keys", "key": "checkpoint.key"}
                        },
                    }
                ],
            }
        ],
        "containers": [
            {
                "name": "fedcore",
                "env": [
                    {"name": "FEDCORE_CHECKPOINT_KEY_FILE", "value": "/var/lib/fedcore/k"},
                    {"name": "FEDCORE_KDC_STATE_KEY_FILE", "value": "/var/lib/fedcore/s"},
                ],
                "envFrom": [{"secretRef": {"name": "demo-kdc-keys"}}],
                "volumeMounts": [{"name": "keys", "mountPath": "/etc/fedcore/keys"}],
            }
        ],
        "volumes": [
            {"name": "keys", "secret": {"secretName": "demo-server-keys"}},
            {"name": "kdc", "secret": {"secretName": "demo-kdc-keys"}},
            {"name": "both", "projected": {"sources": [{"secret": {"name": "demo-kdc-keys"}}]}},
        ],
    }
}


def test_a_template_gives_no_decentralized_client_another_clients_key() -> None:
    # Prepare: client 0's template asks for client 1's key Secret and the server's.
    ctx = context(manifest("lppa"))
    built = objects.client_pod(ctx, 0)
    template = copy.deepcopy(KEY_THIEF_TEMPLATE)
    template["spec"]["volumes"].append(
        {"name": "peer", "secret": {"secretName": "demo-client-1-keys"}}
    )
    template["spec"]["containers"][0]["envFrom"] = [{"secretRef": {"name": "demo-client-1-keys"}}]

    # Execute
    pod = objects.apply_pod_template(built, template)

    # Assert: its own key, as built, and nothing of another's.
    wiring = key_wiring(pod)
    assert wiring["secrets"] == {"demo-client-0-keys": 0o440}
    assert "demo-client-1-keys" not in json.dumps(pod)
    assert "demo-server-keys" not in json.dumps(pod)
    fedcore = pod["spec"]["containers"][0]
    assert {item["name"]: item.get("value") for item in fedcore["env"]}[
        "FEDCORE_CHECKPOINT_KEY_FILE"
    ] == "/etc/fedcore/keys/checkpoint.key"
    assert restricted_violations(pod) == []


def test_a_template_cannot_move_where_a_role_writes_its_termination_message() -> None:
    # Prepare: a template that points the message at the work volume (a checkpoint there)
    ctx = context(manifest("lppa"))
    built = objects.client_pod(ctx, 0)
    template = {
        "spec": {
            "containers": [
                {
                    "name": "fedcore",
                    "terminationMessagePath": "/var/lib/fedcore/checkpoints/latest",
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                    "env": [{"name": "FEDCORE_TERMINATION_LOG", "value": "/var/lib/fedcore/x"}],
                }
            ]
        }
    }
    # Execute
    pod = objects.apply_pod_template(built, template)
    # Assert
    fedcore = pod["spec"]["containers"][0]
    assert fedcore["terminationMessagePath"] == "/dev/termination-log"
    assert fedcore["terminationMessagePolicy"] == "File"
    written = [item for item in fedcore["env"] if item["name"] == "FEDCORE_TERMINATION_LOG"]
    assert written == [{"name": "FEDCORE_TERMINATION_LOG", "value": "/dev/termination-log"}]


@pytest.mark.parametrize("role", ["client", "kdc", "server"])
def test_a_template_gives_no_pod_another_roles_key(role: str) -> None:
    # Prepare: a template (past validation) that asks for both keys and redirects the key
    # variables into the work emptyDir.
    ctx = context(manifest("mpdp"))
    built = {
        "client": objects.client_pod(ctx, 0),
        "kdc": objects.kdc_pod(ctx, resume=False),
        "server": objects.server_pod(ctx, resume=False),
    }[role]

    # Execute
    pod = objects.apply_pod_template(built, copy.deepcopy(KEY_THIEF_TEMPLATE))

    # Assert: exactly the key wiring the operator built, nothing from the template, except
    # what refers to the pod's own key Secret (as a sidecar may read any Secret its pod was
    # given): the server's init container keeps the variable drawn from demo-server-keys and
    # mounts its "keys" volume, the KDC's fedcore container keeps envFrom demo-kdc-keys.
    wiring = key_wiring(pod)
    own = key_wiring(built)
    assert wiring["secrets"] == own["secrets"]
    assert [volume["name"] for volume in pod["spec"]["volumes"]] == [
        volume["name"] for volume in built["spec"]["volumes"]
    ]
    fedcore_mounts = [mount for mount in wiring["mounts"] if mount[0] == "fedcore"]
    assert fedcore_mounts == own["mounts"]
    init_env = pod["spec"]["initContainers"][0]["env"]
    main_env = {
        item["name"]: item.get("value")
        for item in pod["spec"]["containers"][0]["env"]
        if item["name"].endswith("_KEY_FILE")
    }
    env_from = pod["spec"]["containers"][0]["envFrom"]
    assert env_from == ([{"secretRef": {"name": "demo-kdc-keys"}}] if role == "kdc" else [])
    if role == "server":
        assert [item["name"] for item in init_env] == ["K"]
        assert ("copy", "/stolen", None) in wiring["mounts"]
        assert main_env == {
            "FEDCORE_CHECKPOINT_KEY_FILE": "/etc/fedcore/keys/checkpoint.key",
            "FEDCORE_KDC_STATE_KEY_FILE": "/var/lib/fedcore/s",
        }
    elif role == "kdc":
        assert init_env == []
        assert ("copy", "/stolen", None) in wiring["mounts"]
        assert main_env == {
            "FEDCORE_CHECKPOINT_KEY_FILE": "/var/lib/fedcore/k",
            "FEDCORE_KDC_STATE_KEY_FILE": "/etc/fedcore/keys/state.key",
        }
    else:
        assert init_env == [] and wiring["mounts"] == []
        assert wiring["secrets"] == {}
    assert restricted_violations(pod) == []


OWN_SCHEMA = {"labels": ["a", "b"], "features": [{"name": "x"}]}


def own_data_manifest(template: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return manifest(
        data={
            "clientData": {"format": "Parquet", "template": template},
            "schema": OWN_SCHEMA,
        },
        **spec,
    )


def test_each_client_pod_mounts_its_own_claim_read_only_and_no_other_pod_does() -> None:
    ctx = context(
        own_data_manifest(
            {"volumeClaim": {"claimName": "site-{index}", "subPath": "study-{index}/v2"}},
            roles={
                "clients": {
                    "podTemplate": {
                        "spec": {
                            # A template cannot swap the operator's data volume for another.
                            "volumes": [
                                {"name": "data", "persistentVolumeClaim": {"claimName": "site-0"}}
                            ]
                        }
                    }
                }
            },
        )
    )
    for index in range(3):
        pod = objects.client_pod(ctx, index)
        claims = [
            volume["persistentVolumeClaim"]
            for volume in pod["spec"]["volumes"]
            if "persistentVolumeClaim" in volume
        ]
        assert claims == [{"claimName": f"site-{index}", "readOnly": True}]
        container = pod["spec"]["containers"][0]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "data")
        assert mount == {
            "name": "data",
            "mountPath": objects.DATA_DIR,
            "readOnly": True,
            "subPath": f"study-{index}/v2",
        }
        assert {"name": "FEDCORE_DATA_DIR", "value": objects.DATA_DIR} in container["env"]
    server = objects.server_pod(ctx, resume=False)
    assert not any("persistentVolumeClaim" in v for v in server["spec"]["volumes"])
    assert "FEDCORE_DATA_DIR" not in {e["name"] for e in server["spec"]["containers"][0]["env"]}


def test_each_client_pod_gets_its_own_s3_credentials_as_files_and_egress_to_the_store() -> None:
    ctx = context(
        own_data_manifest(
            {
                "s3": {
                    "endpoint": "http://10.1.2.3:8333",
                    "bucket": "hospital-{index}",
                    "prefix": "records/",
                    "credentialsSecret": "hospital-{index}-s3",
                }
            }
        )
    )
    for index in range(3):
        pod = objects.client_pod(ctx, index)
        secrets = {
            volume["secret"]["secretName"]: volume["secret"]["defaultMode"]
            for volume in pod["spec"]["volumes"]
            if "secret" in volume
        }
        assert secrets[f"hospital-{index}-s3"] == 0o440
        assert not {f"hospital-{other}-s3" for other in range(3) if other != index} & set(secrets)
        container = pod["spec"]["containers"][0]
        assert {
            "name": "data-credentials",
            "mountPath": objects.DATA_CREDENTIALS_DIR,
            "readOnly": True,
        } in container["volumeMounts"]
        assert "envFrom" not in container  # files, not variables
    server = objects.server_pod(ctx, resume=False)
    assert not any(
        "hospital" in volume.get("secret", {}).get("secretName", "")
        for volume in server["spec"]["volumes"]
    )
    policies = {p["metadata"]["name"]: p for p in objects.network_policies(ctx)}
    egress = policies["demo-client"]["spec"]["egress"]
    assert {
        "to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}],
        "ports": [{"protocol": "TCP", "port": 8333}],
    } in egress
    server_egress = policies["demo-server"]["spec"]["egress"]
    assert not any("10.1.2.3/32" in json.dumps(rule) for rule in server_egress)

"""The operator's pure builders: the CRD file, owned objects, pod security and placement."""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest
from cryptography import x509

from fedcore.spec import load_manifest, parse_manifest
from fedcore_operator import objects
from fedcore_operator.crd import CHART_CRD_PATH, PRINTER_COLUMNS, crd_manifest, crd_yaml
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
    targets = [
        rule["to"][0]["podSelector"]["matchLabels"][objects.ROLE_LABEL]
        for rule in client_egress
        if "to" in rule
    ]
    assert sorted(targets) == ["kdc", "server"]
    # Not decentralized: no client-to-client rule either way.
    assert all("from" not in rule for rule in policies["demo-client"]["spec"]["ingress"])


def test_server_egress_opens_the_s3_endpoint_port_only_with_s3_checkpoints() -> None:
    local = context(manifest())
    s3 = context(manifest(checkpoint={"s3": {"bucket": "runs", "endpoint": "http://minio:9000"}}))

    def ports(ctx: objects.RunContext) -> set[int]:
        server = [
            p for p in objects.network_policies(ctx) if p["metadata"]["name"] == "demo-server"
        ]
        return {
            port["port"]
            for rule in server[0]["spec"]["egress"]
            if "to" in rule
            for port in rule["ports"]
        }

    assert ports(local) == {443, 6443}
    assert ports(s3) == {443, 6443, 9000}


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
    assert pod["spec"]["containers"][0]["env"] == [{"name": "X", "value": "1"}]


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
        if "to" in rule and "podSelector" in rule["to"][0]
    ]
    assert server_targets == ["kdc"]

"""What a decentralized (lppa) run becomes on Kubernetes: peer env, names and policies."""

from __future__ import annotations

from typing import Any

from cryptography import x509

from fedcore.spec import parse_manifest
from fedcore_operator import objects
from fedcore_operator.settings import OperatorSettings


def context(protocol: str = "lppa", **spec: Any) -> objects.RunContext:
    body: dict[str, Any] = {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "FederatedRun",
        "metadata": {"name": "demo"},
        "spec": {"protocol": {"name": protocol}, "clients": {"count": 4}, "rounds": 2, **spec},
    }
    return objects.RunContext(parse_manifest(body), "team-a", "uid-1", OperatorSettings())


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    container = pod["spec"]["containers"][0]
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


def test_a_lppa_client_pod_gets_its_peer_listen_address_and_the_peer_template() -> None:
    # Prepare
    ctx = context()
    # Execute
    pod = objects.client_pod(ctx, 2)
    env = env_of(pod)
    names = [item["name"] for item in pod["spec"]["containers"][0]["env"]]
    # Assert
    assert ctx.decentralized
    assert env["FEDCORE_PEER_LISTEN"] == "$(POD_IP):7072"
    assert env["FEDCORE_PEER_TEMPLATE"] == "client-{index}.demo-clients.team-a.svc:7072"
    assert names.index("POD_IP") < names.index("FEDCORE_PEER_LISTEN")  # $(POD_IP) resolves
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert ports["peer"] == 7072
    assert pod["spec"]["hostname"] == "client-2"
    assert pod["spec"]["subdomain"] == "demo-clients"
    # The template, filled in, is the stable DNS name the headless Service gives client 3.
    assert env["FEDCORE_PEER_TEMPLATE"].replace("{index}", "3").split(":")[0] == (
        f"client-3.{objects.service_host(ctx, objects.peers_service_name('demo'))}"
    )


def test_a_central_protocols_client_pod_has_no_peer_settings() -> None:
    env = env_of(objects.client_pod(context("fedavg"), 0))
    assert "FEDCORE_PEER_LISTEN" not in env and "FEDCORE_PEER_TEMPLATE" not in env


def dns_names(secret: dict[str, Any]) -> list[str]:
    cert = x509.load_pem_x509_certificate(secret["stringData"]["tls.crt"].encode())
    return cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.DNSName)


def test_a_lppa_client_certificate_names_the_bare_client_its_peers_dial() -> None:
    # Prepare
    ca = objects.RunCa.generate("demo")
    # Execute
    lppa = objects.pod_tls_secret(context(), ca, "demo-client-1", "client-1", 1)
    fedavg = objects.pod_tls_secret(context("fedavg"), ca, "demo-client-1", "client-1", 1)
    # Assert
    assert "client-1" in dns_names(lppa)
    assert "client-1.demo-clients.team-a.svc" in dns_names(lppa)
    assert "client-1" not in dns_names(fedavg)


def test_lppa_clients_reach_each_other_on_the_peer_port_and_their_checkpoint_store() -> None:
    # Prepare
    s3 = {"s3": {"bucket": "runs", "endpoint": "http://minio:9000", "credentialsSecret": "s3"}}
    ctx = context(checkpoint=s3)
    # Execute
    policies = {p["metadata"]["name"]: p["spec"] for p in objects.network_policies(ctx)}
    client = policies["demo-client"]
    pod = objects.client_pod(ctx, 0)
    # Assert
    peer_in = [rule for rule in client["ingress"] if "from" in rule]
    assert peer_in[0]["ports"] == [{"protocol": "TCP", "port": 7072}]
    egress_ports = {port["port"] for rule in client["egress"] for port in rule.get("ports", [])}
    assert {7072, 9000} <= egress_ports
    assert pod["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "s3"}}]


def test_a_central_protocols_clients_get_no_store_access() -> None:
    s3 = {"s3": {"bucket": "runs", "endpoint": "http://minio:9000", "credentialsSecret": "s3"}}
    ctx = context("fedavg", checkpoint=s3)
    policies = {p["metadata"]["name"]: p["spec"] for p in objects.network_policies(ctx)}
    egress_ports = {
        port["port"] for rule in policies["demo-client"]["egress"] for port in rule.get("ports", [])
    }
    assert 9000 not in egress_ports and 7072 not in egress_ports
    assert "envFrom" not in objects.client_pod(ctx, 0)["spec"]["containers"][0]


def client_rules(policy: dict[str, Any], direction: str) -> list[dict[str, Any]]:
    """The rules of ``direction`` whose peers select this run's client pods."""
    key = "from" if direction == "ingress" else "to"
    wanted = objects.selector("demo", "client")
    return [
        rule
        for rule in policy[direction]
        if any(
            (peer.get("podSelector") or {}).get("matchLabels") == wanted
            for peer in rule.get(key, [])
        )
    ]


def test_clients_reach_each_other_only_on_the_peer_port_and_only_when_decentralized() -> None:
    # Prepare
    lppa = {p["metadata"]["name"]: p["spec"] for p in objects.network_policies(context())}
    fedavg = {p["metadata"]["name"]: p["spec"] for p in objects.network_policies(context("fedavg"))}
    # Execute
    lppa_in = client_rules(lppa["demo-client"], "ingress")
    lppa_out = client_rules(lppa["demo-client"], "egress")
    # Assert: one rule each way between clients, on the peer port alone, and the pods serve it.
    assert [rule["ports"] for rule in lppa_in] == [[{"protocol": "TCP", "port": 7072}]]
    assert [rule["ports"] for rule in lppa_out] == [[{"protocol": "TCP", "port": 7072}]]
    assert set(lppa["demo-client"]["policyTypes"]) == {"Ingress", "Egress"}
    ports = objects.client_pod(context(), 2)["spec"]["containers"][0]["ports"]
    assert {"name": "peer", "containerPort": 7072, "protocol": "TCP"} in ports
    assert client_rules(fedavg["demo-client"], "ingress") == []
    assert client_rules(fedavg["demo-client"], "egress") == []

"""The operator on the real control plane: objects, idempotence, admission, RBAC, deletion.

Runs here that need not train use a nodeSelector no node matches, so their pods stay Pending
and the cluster state is stable; tests/kube/test_operator_runs.py trains for real.
"""

from __future__ import annotations

import base64
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from kubernetes.client import ApiClient, Configuration
from kubernetes.client.exceptions import ApiException

from fedcore.observe.kube_status import status_patch
from fedcore.spec import parse_manifest
from fedcore_operator import objects
from fedcore_operator.crd import GROUP, PLURAL, VERSION
from fedcore_operator.kube import request
from tests.kube._operator import (
    WEBHOOK_NAME,
    OperatorProcess,
    get_run,
    install_crd,
    running_operator,
    start_operator,
    wait_for_run,
)
from tests.kube.cluster import SA_TOKEN_TYPE as SA_TOKEN
from tests.kube.cluster import ControlPlane

ROOT = Path(__file__).resolve().parents[2]
CA_NAMESPACE = "default"
"""Where the test operator keeps the runs' CA Secrets (its lease namespace)."""
OWNED_KINDS = (
    ("v1", "secrets"),
    ("v1", "configmaps"),
    ("v1", "serviceaccounts"),
    ("v1", "services"),
    ("v1", "pods"),
    ("rbac.authorization.k8s.io/v1", "roles"),
    ("rbac.authorization.k8s.io/v1", "rolebindings"),
    ("networking.k8s.io/v1", "networkpolicies"),
)


@pytest.fixture(scope="module")
def operator(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The CRD installed and one operator (webhook on) for this module."""
    install_crd(control_plane)
    try:
        with running_operator(control_plane, tmp_path_factory.mktemp("operator")) as op:
            yield op
    finally:
        # kopf registered the webhook; without its server every later apply would fail.
        control_plane.kubectl(
            "delete", "validatingwebhookconfiguration", WEBHOOK_NAME, "--ignore-not-found"
        )


def run_manifest(name: str, protocol: str = "fedavg", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "FederatedRun",
        "metadata": {"name": name},
        "spec": {
            "protocol": {"name": protocol},
            "clients": {"count": 3},
            "rounds": 2,
            "roles": {
                role: {"nodeSelector": {"fedcore.dev/no-such-node": "true"}}
                for role in ("kdc", "server", "clients")
            },
        },
    }
    if protocol in ("perturb", "mpdp"):
        body["spec"]["model"] = {"kind": "MLP", "hidden": [8], "bias": False, "dtype": "float64"}
        body["spec"]["training"] = {"loss": "MSE", "batchSize": 100000}
    body["spec"].update(spec)
    return body


def apply(plane: ControlPlane, namespace: str, body: dict[str, Any], check: bool = True) -> Any:
    return plane.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body), check=check)


def owned(plane: ControlPlane, namespace: str, run: str) -> set[tuple[str, str]]:
    """(resource, name) of everything in the namespace labelled with the run."""
    api = plane.api_client()
    found = set()
    for group_version, resource in OWNED_KINDS:
        prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        items = request(
            api,
            "GET",
            f"{prefix}/namespaces/{namespace}/{resource}",
            query=[("labelSelector", f"{objects.RUN_LABEL}={run}")],
        )["items"]
        found |= {(resource, item["metadata"]["name"]) for item in items}
    return found


def expected_objects(run: str, clients: int, kdc: bool) -> set[tuple[str, str]]:
    pods = ([f"{run}-kdc"] if kdc else []) + [f"{run}-server"]
    pods += [f"{run}-client-{index}" for index in range(clients)]
    roles = (["kdc"] if kdc else []) + ["server", "client"]
    return (
        {("secrets", f"{pod}-tls") for pod in pods}
        | {("secrets", f"{run}-{role}-keys") for role in (["kdc"] if kdc else []) + ["server"]}
        | {("pods", pod) for pod in pods}
        | {("configmaps", f"{run}-manifest")}
        | {("serviceaccounts", f"{run}-{role}") for role in roles}
        | {("services", f"{run}-server"), ("services", f"{run}-clients")}
        | ({("services", f"{run}-kdc")} if kdc else set())
        | {("networkpolicies", f"{run}-{role}") for role in roles}
        | {("roles", f"{run}-server-status"), ("rolebindings", f"{run}-server-status")}
    )


def secret(plane: ControlPlane, namespace: str, name: str) -> dict[str, Any] | None:
    """The Secret as JSON, or None."""
    try:
        result: dict[str, Any] = request(
            plane.api_client(), "GET", f"/api/v1/namespaces/{namespace}/secrets/{name}"
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return result


def run_ca(plane: ControlPlane, namespace: str, run: str) -> dict[str, Any] | None:
    """The run's CA Secret where the operator keeps it."""
    return secret(plane, CA_NAMESPACE, objects.ca_secret_name(namespace, run))


def wait_until(check: Any, what: str, timeout: float = 30, debug: Any = lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout:.0f} s\n{debug()}")
        time.sleep(0.3)


def test_reconcile_creates_exactly_the_expected_objects_then_writes_nothing(
    control_plane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    apply(control_plane, namespace, run_manifest("alpha", "mpdp"))
    # The KDC comes first and never gets ready (no node matches): the server waits for it.
    kdc_only = expected_objects("alpha", 3, kdc=True) - {
        ("pods", f"alpha-{name}") for name in ("server", "client-0", "client-1", "client-2")
    }
    deadline = time.monotonic() + 30
    while owned(control_plane, namespace, "alpha") != kdc_only and time.monotonic() < deadline:
        time.sleep(0.3)
    assert owned(control_plane, namespace, "alpha") == kdc_only
    run = wait_for_run(
        control_plane,
        namespace,
        "alpha",
        lambda r: (r.get("status") or {}).get("reason") == "WaitingForKdc",
        timeout=30,
        what="phase Pending waiting for the KDC",
    )
    assert run["status"]["phase"] == "Pending"
    assert run["status"]["observedGeneration"] == run["metadata"]["generation"]
    conditions = {c["type"]: c for c in run["status"]["conditions"]}
    assert conditions["KdcReady"]["status"] == "False"
    # Several resyncs (every 3 s) and a metadata change later, nothing was written.
    time.sleep(1.5)
    writes = operator.metric("fedcore_operator_api_writes_total")
    passes = operator.metric("fedcore_operator_reconciles_total")
    control_plane.kubectl("annotate", "-n", namespace, "federatedrun/alpha", "touched=yes")
    time.sleep(8)
    assert operator.metric("fedcore_operator_reconciles_total") >= passes + 2
    assert operator.metric("fedcore_operator_api_writes_total") == writes
    assert owned(control_plane, namespace, "alpha") == kdc_only


def test_pods_are_locked_down_and_ordered(
    control_plane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    apply(control_plane, namespace, run_manifest("beta"))
    pod = control_plane.wait_for_pod(
        namespace, "beta-server", lambda p: p is not None, timeout=30, what="creation"
    )
    assert pod is not None
    container = pod["spec"]["containers"][0]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "FederatedRun"
    # The server is never ready here, so no client pod may exist.
    time.sleep(4)
    assert control_plane.pod(namespace, "beta-client-0") is None


def test_deleting_a_run_removes_everything_it_owned(
    control_plane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    apply(control_plane, namespace, run_manifest("gamma"))
    want = expected_objects("gamma", 3, kdc=False) - {
        ("pods", f"gamma-client-{index}") for index in range(3)
    }
    deadline = time.monotonic() + 30
    while owned(control_plane, namespace, "gamma") != want and time.monotonic() < deadline:
        time.sleep(0.3)
    assert owned(control_plane, namespace, "gamma") == want
    control_plane.kubectl("delete", "-n", namespace, "federatedrun/gamma", "--wait=true")
    deadline = time.monotonic() + 60
    while owned(control_plane, namespace, "gamma") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert owned(control_plane, namespace, "gamma") == set()
    assert get_run(control_plane, namespace, "gamma") is None
    # The CA Secret, out of reach of owner references in the operator's namespace, goes too.
    wait_until(
        lambda: run_ca(control_plane, namespace, "gamma") is None,
        "deletion of the run's CA Secret",
        debug=operator.tail,
    )


def test_the_run_ca_is_kept_out_of_the_runs_namespace_and_pods_get_their_tls(
    control_plane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    # Prepare / Execute
    apply(control_plane, namespace, run_manifest("keys"))
    control_plane.wait_for_pod(
        namespace, "keys-server", lambda p: p is not None, timeout=30, what="creation"
    )

    # Assert: only the pods' own Secrets and the server's key are in the run's namespace, none
    # with a CA key.
    listed = request(control_plane.api_client(), "GET", f"/api/v1/namespaces/{namespace}/secrets")[
        "items"
    ]
    mine = {item["metadata"]["name"]: item for item in listed if item["type"] != SA_TOKEN}
    key = base64.b64decode(mine.pop("keys-server-keys")["data"]["checkpoint.key"]).decode()
    assert len(key) == 64 and bytes.fromhex(key).hex() == key  # 32 bytes as lowercase hex
    pods = ["keys-server", *(f"keys-client-{index}" for index in range(3))]
    assert set(mine) == {f"{pod}-tls" for pod in pods}
    assert all("ca.key" not in item["data"] for item in mine.values())
    # The CA is in the operator's namespace, labelled with its run, and signed every pod's.
    run = get_run(control_plane, namespace, "keys")
    ca = run_ca(control_plane, namespace, "keys")
    assert run is not None and ca is not None
    assert objects.ca_secret_is_for(ca, run["metadata"]["uid"])
    assert "ownerReferences" not in ca["metadata"]
    authority = x509.load_pem_x509_certificate(base64.b64decode(ca["data"]["ca.crt"]))
    for item in mine.values():
        assert item["data"]["ca.crt"] == ca["data"]["ca.crt"]
        issued = x509.load_pem_x509_certificate(base64.b64decode(item["data"]["tls.crt"]))
        issued.verify_directly_issued_by(authority)
    server = control_plane.pod(namespace, "keys-server")
    assert server is not None
    assert [v["secret"]["secretName"] for v in server["spec"]["volumes"] if "secret" in v] == [
        "keys-server-tls",
        "keys-server-keys",
    ]


def test_a_ca_left_in_the_runs_namespace_is_moved_to_the_operators(
    control_plane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    # Prepare: a run whose CA an operator before issue 19 kept as <run>-ca in its namespace.
    apply(control_plane, namespace, run_manifest("old"))
    wait_until(lambda: run_ca(control_plane, namespace, "old") is not None, "a CA Secret")
    wait_until(
        lambda: secret(control_plane, namespace, "old-client-2-tls") is not None,
        "the pods' Secrets",
    )
    original = run_ca(control_plane, namespace, "old")
    run = get_run(control_plane, namespace, "old")
    assert original is not None and run is not None
    api = control_plane.api_client()
    request(
        api, "DELETE", f"/api/v1/namespaces/{CA_NAMESPACE}/secrets/{original['metadata']['name']}"
    )
    legacy = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": "old-ca",
            "labels": objects.run_labels("old"),
            "ownerReferences": [
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": "FederatedRun",
                    "name": "old",
                    "uid": run["metadata"]["uid"],
                }
            ],
        },
        "data": original["data"],
    }

    # Execute: the next resync finds it.
    request(api, "POST", f"/api/v1/namespaces/{namespace}/secrets", body=legacy)
    wait_until(
        lambda: secret(control_plane, namespace, "old-ca") is None,
        "move of old-ca",
        debug=operator.tail,
    )

    # Assert: the same CA, now in the operator's namespace; the pods' Secrets still chain to it.
    moved = run_ca(control_plane, namespace, "old")
    assert moved is not None
    assert moved["data"] == original["data"]
    assert objects.ca_secret_is_for(moved, run["metadata"]["uid"])
    client = secret(control_plane, namespace, "old-client-2-tls")
    assert client is not None and client["data"]["ca.crt"] == moved["data"]["ca.crt"]


def test_ca_secrets_of_runs_that_are_gone_are_collected(
    control_plane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    # Prepare: a CA Secret whose run was deleted while no operator watched, beside a live one.
    apply(control_plane, namespace, run_manifest("live"))
    wait_until(lambda: run_ca(control_plane, namespace, "live") is not None, "a CA Secret")
    orphan = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": objects.ca_secret_name(namespace, "ghost"),
            "labels": {
                **objects.ca_labels(),
                objects.CA_NAMESPACE_LABEL: namespace,
                objects.CA_NAME_LABEL: "ghost",
                objects.CA_UID_LABEL: "00000000-0000-0000-0000-000000000000",
            },
        },
        "stringData": {"ca.crt": "x", "ca.key": "y"},
    }

    # Execute
    request(
        control_plane.api_client(),
        "POST",
        f"/api/v1/namespaces/{CA_NAMESPACE}/secrets",
        body=orphan,
    )

    # Assert: collected within a few resyncs (3 s); the live run's is kept.
    wait_until(
        lambda: run_ca(control_plane, namespace, "ghost") is None,
        "collection of the orphaned CA Secret",
        debug=operator.tail,
    )
    assert run_ca(control_plane, namespace, "live") is not None


INVALID = [
    ("rounds zero", {"rounds": 0}, "spec.rounds"),
    ("unknown protocol", {"protocol": {"name": "magic"}}, "spec.protocol.name"),
    ("quorum over count", {"clients": {"count": 3, "quorum": 5}}, "spec.clients.quorum"),
    ("perturb with biases", {"protocol": {"name": "perturb"}}, "spec.model"),
    ("sampling misspelt", {"clients": {"count": 3, "sampling": "secret"}}, "spec.clients.sampling"),
    (
        "secret sample with PLD",
        {
            "protocol": {"name": "dp-fedavg"},
            "clients": {"count": 3, "perRound": 2, "sampling": "Secret"},
            "privacy": {"accountant": "PLD"},
        },
        "'PLD' cannot account a secret sample",
    ),
    (
        "privileged template",
        {
            "roles": {
                "server": {
                    "podTemplate": {
                        "spec": {
                            "containers": [
                                {"name": "fedcore", "securityContext": {"privileged": True}}
                            ]
                        }
                    }
                }
            }
        },
        "securityContext.privileged: must be false",
    ),
]


@pytest.mark.parametrize(("case", "change", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_manifests_are_refused_at_kubectl_apply(
    control_plane: ControlPlane,
    operator: OperatorProcess,
    namespace: str,
    case: str,
    change: dict[str, Any],
    message: str,
) -> None:
    body = run_manifest("bad")
    body["spec"].update(change)
    result = apply(control_plane, namespace, body, check=False)
    assert result.returncode != 0, f"{case} was admitted"
    assert message in result.stderr, result.stderr
    assert get_run(control_plane, namespace, "bad") is None


def test_name_that_cannot_name_services_is_refused(
    control_plane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    result = apply(control_plane, namespace, run_manifest("9lives"), check=False)
    assert result.returncode != 0
    assert "must start with a lowercase letter" in result.stderr


def test_running_run_refuses_a_spec_change_it_cannot_apply(
    control_plane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    apply(control_plane, namespace, run_manifest("delta"))
    wait_for_run(
        control_plane,
        namespace,
        "delta",
        lambda r: (r.get("status") or {}).get("phase") == "Pending",
        timeout=30,
        what="phase Pending",
    )
    result = apply(control_plane, namespace, run_manifest("delta", rounds=7), check=False)
    assert result.returncode != 0
    assert "spec.rounds: cannot change while the run is Pending" in result.stderr
    # Suspending is always allowed, and removes the pods.
    apply(control_plane, namespace, run_manifest("delta", suspend=True))
    run = wait_for_run(
        control_plane,
        namespace,
        "delta",
        lambda r: (r.get("status") or {}).get("phase") == "Suspended",
        timeout=30,
        what="phase Suspended",
    )
    assert run["status"]["conditions"]
    deadline = time.monotonic() + 20
    while control_plane.pod(namespace, "delta-server") is not None and time.monotonic() < deadline:
        time.sleep(0.3)
    assert control_plane.pod(namespace, "delta-server") is None
    # While suspended, rounds may change.
    apply(control_plane, namespace, run_manifest("delta", suspend=True, rounds=7))
    stored = get_run(control_plane, namespace, "delta")
    assert stored is not None and stored["spec"]["rounds"] == 7


def test_server_token_can_patch_its_own_status_and_nothing_else(
    control_plane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    apply(control_plane, namespace, run_manifest("own"))
    apply(control_plane, namespace, run_manifest("other"))
    for name in ("own", "other"):
        wait_for_run(
            control_plane,
            namespace,
            name,
            lambda r: (r.get("status") or {}).get("phase") == "Pending",
            timeout=30,
            what="phase Pending",
        )
    token = control_plane.token_for(namespace, "own-server")
    configuration = Configuration()
    configuration.host = control_plane.server
    configuration.ssl_ca_cert = str(control_plane.ca_path)
    configuration.api_key = {"authorization": f"Bearer {token}"}
    api = ApiClient(configuration)
    runs = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    merge = "application/merge-patch+json"
    patched = request(
        api,
        "PATCH",
        f"{runs}/own/status",
        body={"status": {"round": 1}},
        content_type=merge,
    )
    assert patched["status"]["round"] == 1
    forbidden = [
        ("PATCH", f"{runs}/other/status", {"status": {"round": 1}}),
        ("PATCH", f"{runs}/own", {"spec": {"rounds": 9}}),
        ("GET", f"/api/v1/namespaces/{namespace}/secrets", None),
        ("GET", f"/api/v1/namespaces/{namespace}/pods", None),
        ("DELETE", f"{runs}/own", None),
    ]
    for method, path, body in forbidden:
        with pytest.raises(ApiException) as caught:
            request(api, method, path, body=body, content_type=merge)
        assert caught.value.status == 403, (method, path)


def test_generated_crd_prunes_undeclared_status_fields(
    control_plane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    apply(control_plane, namespace, run_manifest("prune"))
    api = control_plane.api_client()
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/prune/status"
    result = request(
        api,
        "PATCH",
        path,
        body={"status": {"round": 2, "madeUp": "x"}},
        content_type="application/merge-patch+json",
    )
    assert result["status"]["round"] == 2
    assert "madeUp" not in result["status"]
    printed = control_plane.kubectl("get", "-n", namespace, "frun", "prune").stdout
    header = printed.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "ROUND", "EPSILON", "AGE"]
    schema = yaml.safe_load(
        control_plane.kubectl("get", "crd", f"{PLURAL}.{GROUP}", "-o", "yaml").stdout
    )
    assert schema["spec"]["versions"][0]["subresources"] == {"status": {}}


def test_status_keeps_what_epsilon_bounds_and_refuses_other_values(
    control_plane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    # Prepare: a dp-fedavg run with a secret sample, and the status patch its server's ready
    # event makes (the server's own mapping, as its StatusReporter sends it).
    body = run_manifest(
        "claim", "dp-fedavg", clients={"count": 3, "perRound": 2, "sampling": "Secret"}
    )
    apply(control_plane, namespace, body)
    claim = {"adjacency": "ReplaceOne", "amplification": "SamplingWithoutReplacement"}
    ready = status_patch(
        parse_manifest(body), {"event": "ready", "start_round": 1, "time": 0, **claim}
    )
    api = control_plane.api_client()
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/claim/status"
    # Execute
    result = request(
        api, "PATCH", path, body={"status": ready}, content_type="application/merge-patch+json"
    )
    # Assert: kept by the CRD's schema, and a value outside its enum refused.
    assert {k: result["status"]["privacy"][k] for k in claim} == claim
    with pytest.raises(ApiException) as refused:
        request(
            api,
            "PATCH",
            path,
            body={"status": {"privacy": {"adjacency": "Maybe"}}},
            content_type="application/merge-patch+json",
        )
    assert refused.value.status == 422


def test_only_the_lease_holder_reconciles_and_a_follower_takes_over(
    control_plane: ControlPlane, operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    apply(control_plane, namespace, run_manifest("lease"))
    first = start_operator(control_plane, tmp_path / "a", webhook=False, lease="le-test")
    second = start_operator(
        control_plane, tmp_path / "b", webhook=False, lease="le-test", wait_leading=False
    )
    try:
        time.sleep(8)  # more than two resyncs of the leader
        assert first.metric("fedcore_operator_reconciles_total") > 0
        assert second.metric("fedcore_operator_leader") == 0
        assert second.metric("fedcore_operator_reconciles_total") == 0
        assert first.stop(signal.SIGKILL) != 0
        deadline = time.monotonic() + 60
        while second.metric("fedcore_operator_leader") != 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert second.metric("fedcore_operator_leader") == 1, second.tail()
        deadline = time.monotonic() + 30
        while (
            second.metric("fedcore_operator_reconciles_total") == 0 and time.monotonic() < deadline
        ):
            time.sleep(0.5)
        assert second.metric("fedcore_operator_reconciles_total") > 0
        # SIGTERM is a graceful stop: exit code 0.
        assert second.stop(signal.SIGTERM) == 0, second.tail()
    finally:
        first.stop(signal.SIGKILL)
        second.stop(signal.SIGKILL)


def test_active_deadline_fails_the_run_and_removes_its_pods(
    control_plane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    apply(control_plane, namespace, run_manifest("late", activeDeadlineSeconds=2))
    run = wait_for_run(
        control_plane,
        namespace,
        "late",
        lambda r: (r.get("status") or {}).get("phase") == "Failed",
        timeout=40,
        what="phase Failed",
        debug=operator.tail,
    )
    assert run["status"]["reason"] == "DeadlineExceeded"
    assert "spec.activeDeadlineSeconds 2" in run["status"]["message"]
    assert {c["type"]: c["status"] for c in run["status"]["conditions"]}["Failed"] == "True"
    deadline = time.monotonic() + 20
    while control_plane.pod(namespace, "late-server") is not None and time.monotonic() < deadline:
        time.sleep(0.3)
    assert control_plane.pod(namespace, "late-server") is None

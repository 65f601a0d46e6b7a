"""A hub on Kubernetes and a site on Kubernetes: two control planes, each with its own etcd,
kube-apiserver and fake kubelet, and nothing shared but the hub's one endpoint.

The hub's cluster runs the operator in mode hub with its endpoint on (the chart's
``hub.enabled``): its FederatedRun has clients at two sites, ``hub-own`` (the hub
organization's own clients, reconciled by a site operator in the same cluster) and
``hospital-k8s`` (a site operator in the second cluster). Both enroll with the join tokens the
hub's operator wrote into Secrets from its site list. Cases: the run trains the one machine's
model, the hub's ``status.sites`` shows both sites enrolled, approved, their clients and when
they were last seen, and nothing of the second site's data source is in any object of the
hub's cluster; a site that refuses the run (its floor, its image allow-list, a spec changed
since it approved) fails it with the site's reason and words on both sides.
"""

from __future__ import annotations

import base64
import json
import random
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fedcore.local.ports import free_port
from fedcore.simulation import simulate
from fedcore.spec import parse_manifest, spec_digest
from tests.kube._operator import OperatorProcess, install_crd, start_operator, wait_for_run
from tests.kube.cluster import ControlPlane
from tests.kube.kubelet import FakeKubelet
from tests.kube.test_client_data_runs import bound_claim
from tests.kube.test_site_cluster import (
    PARTICIPATION_CRD,
    PARTICIPATION_CRD_NAME,
    get_participation,
    phase,
    wait_participation,
)
from tests.kube.test_site_cluster import (
    run_document as site_run_document,
)

OWN = "hub-own"
SITE = "hospital-k8s"
SENTINEL = "z8k2w"
"""In every name of the second site's data (claims): none may be in the hub's cluster."""
OPERATOR_NAMESPACE = "default"
KINDS = (
    "pods,services,configmaps,secrets,serviceaccounts,roles,rolebindings,networkpolicies,"
    "events,persistentvolumeclaims,leases,federatedruns,participations"
)


# ------------------------------------------------------------------------- the clusters


@dataclass
class HubSide:
    """The hub's cluster, its operator, its endpoint's port and the sites' join tokens."""

    plane: ControlPlane
    operator: OperatorProcess
    port: int
    tokens: dict[str, str]
    fingerprint: str


@pytest.fixture(scope="module")
def hub_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane(workdir=tmp_path_factory.mktemp("hub-plane"))
    plane.start()
    try:
        plane.register_nodes(1)
        install_crd(plane)
        install_participations(plane)
        yield plane
    finally:
        plane.stop()


def install_participations(plane: ControlPlane) -> None:
    install_crd(plane, PARTICIPATION_CRD, PARTICIPATION_CRD_NAME)


@pytest.fixture(scope="module")
def hub_kubelet(
    hub_plane: ControlPlane, kubelet: FakeKubelet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FakeKubelet]:
    """The hub cluster's kubelet; its pods' loopback addresses differ from the site's."""
    with FakeKubelet(
        hub_plane, hub_plane.nodes, workdir=tmp_path_factory.mktemp("hub-kubelet")
    ) as fake:
        while fake._ip_prefix == kubelet._ip_prefix:
            fake._ip_prefix = f"127.{random.randrange(1, 255)}"
        yield fake


@pytest.fixture(scope="module")
def hub(
    hub_plane: ControlPlane, hub_kubelet: FakeKubelet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[HubSide]:
    """The hub's operator (mode hub, endpoint on), with both sites on its list: it writes
    each one's join token into a Secret of its namespace."""
    hub_plane.kubectl(
        "-n", OPERATOR_NAMESPACE, "create", "configmap", "fedcore-hub-sites",
        f"--from-literal=sites={OWN} {SITE}", "--from-literal=revoked=",
    )  # fmt: skip
    port = free_port()
    operator = start_operator(
        hub_plane,
        tmp_path_factory.mktemp("hub-operator"),
        webhook=False,
        lease="fedcore-hub-operator",
        extra_env={"FEDCORE_OPERATOR_MODE": "hub", "FEDCORE_HUB_LISTEN": f"127.0.0.1:{port}"},
    )
    try:
        tokens: dict[str, str] = {}
        fingerprint = ""
        deadline = time.monotonic() + 60
        while len(tokens) < 2:
            assert time.monotonic() < deadline, f"no join tokens:\n{operator.tail()}"
            for site in (OWN, SITE):
                data = secret_data(hub_plane, OPERATOR_NAMESPACE, f"fedcore-hub-join-{site}")
                if data:
                    tokens[site], fingerprint = data["token"], data["fingerprint"]
            time.sleep(0.5)
        yield HubSide(hub_plane, operator, port, tokens, fingerprint)
    finally:
        operator.stop()


def secret_data(plane: ControlPlane, namespace: str, name: str) -> dict[str, str]:
    """The Secret's data, decoded; empty when there is no such Secret."""
    found = plane.kubectl("-n", namespace, "get", "secret", name, "-o", "json", check=False)
    if found.returncode != 0:
        return {}
    data = json.loads(found.stdout).get("data") or {}
    return {key: base64.b64decode(value).decode() for key, value in data.items()}


def start_site(
    plane: ControlPlane, hub: HubSide, site: str, folder: Path
) -> Iterator[OperatorProcess]:
    """A site's operator (mode site) in ``plane``, enrolling with ``site``'s join token."""
    plane.kubectl(
        "-n", OPERATOR_NAMESPACE, "create", "secret", "generic", "fedcore-site-join",
        f"--from-literal=token={hub.tokens[site]}",
    )  # fmt: skip
    operator = start_operator(
        plane,
        folder,
        webhook=False,
        lease="fedcore-site-operator",
        extra_env={
            "FEDCORE_OPERATOR_MODE": "site",
            "FEDCORE_SITE_HUB": f"127.0.0.1:{hub.port}",
            "FEDCORE_SITE_FINGERPRINT": hub.fingerprint,
            "FEDCORE_SITE_RESYNC_SECONDS": "1",
        },
    )
    try:
        yield operator
    finally:
        operator.stop()
        for secret in ("fedcore-site-join", "fedcore-site-identity"):
            plane.kubectl(
                "-n", OPERATOR_NAMESPACE, "delete", "secret", secret, "--ignore-not-found"
            )


@pytest.fixture(scope="module")
def own_site(hub: HubSide, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    """The hub organization's own site operator, in the hub's cluster."""
    yield from start_site(hub.plane, hub, OWN, tmp_path_factory.mktemp("own-site"))


@pytest.fixture(scope="module")
def cluster_site(
    control_plane: ControlPlane,
    kubelet: FakeKubelet,
    hub: HubSide,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[OperatorProcess]:
    """The second site's operator, in the suite's (the site's) cluster."""
    install_participations(control_plane)
    yield from start_site(control_plane, hub, SITE, tmp_path_factory.mktemp("cluster-site"))


@pytest.fixture
def hub_namespace(hub: HubSide) -> Iterator[str]:
    name = hub.plane.create_namespace(f"h-{uuid.uuid4().hex[:10]}")
    yield name
    hub.plane.delete_namespace(name)


# ------------------------------------------------------------------------------ the run


def run_document(name: str) -> dict[str, Any]:
    """The hospitals example as FedAvg: client 0 at the hub's own site, 1 and 2 at the other."""
    return site_run_document(
        name, sites=[{"name": OWN, "clients": 1}, {"name": SITE, "clients": 2}]
    )


def participation(document: dict[str, Any], clients: int, claims: str, **spec: Any) -> str:
    """A Participation approving the run, its clients reading the claims ``<claims>-<i>``."""
    run = parse_manifest(json.loads(json.dumps(document)))
    body: dict[str, Any] = {
        "run": run.metadata.name,
        "specDigest": spec_digest(run),
        "clients": clients,
        "floor": {"protocols": [run.spec.protocol.name]},
        "data": {
            "template": {"volumeClaim": {"claimName": f"{claims}-{{index}}", "subPath": "records"}}
        },
    }
    body.update(spec)
    return json.dumps(
        {
            "apiVersion": "fedcore.dev/v1alpha1",
            "kind": "Participation",
            "metadata": {"name": "study"},
            "spec": body,
        }
    )


def claims(
    plane: ControlPlane, kubelet: FakeKubelet, namespace: str, prefix: str, data: dict[int, Path]
) -> None:
    """A bound claim ``<prefix>-<index>`` per client of the site (its index there), holding
    that hospital's tables."""
    for index, folder in data.items():
        claim = f"{prefix}-{index}"
        bound_claim(plane, namespace, claim)
        shutil.copytree(folder, kubelet.workdir / "pvc" / namespace / claim / "records")


def sites_of(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {entry["name"]: entry for entry in (run.get("status") or {}).get("sites") or []}


def approved_and_ready(entry: dict[str, Any]) -> bool:
    """Whether the site approved the run and reports every one of its clients ready."""
    ready = (entry.get("reported") or {}).get("ready")
    return bool(entry.get("approval") == "Approved" and ready == entry["clients"])


def test_a_run_with_clients_in_the_hubs_cluster_and_a_sites_cluster_trains_the_one_machine_model(
    hub: HubSide,
    own_site: OperatorProcess,
    cluster_site: OperatorProcess,
    hub_kubelet: FakeKubelet,
    control_plane: ControlPlane,
    kubelet: FakeKubelet,
    namespace: str,
    hub_namespace: str,
    hospitals: Path,
) -> None:
    # Prepare: each site binds its own data; the hub's cluster holds the run.
    document = run_document("joint")
    own = hub.plane.create_namespace(f"own-{uuid.uuid4().hex[:8]}")
    claims(hub.plane, hub_kubelet, own, "own", {0: hospitals / "hospital-0"})
    claims(  # '{index}' in a Participation is the client's index at the site
        control_plane, kubelet, namespace, SENTINEL,
        {0: hospitals / "hospital-1", 1: hospitals / "hospital-2"},
    )  # fmt: skip
    hub.plane.kubectl("apply", "-n", own, "-f", "-", input=participation(document, 1, "own"))
    control_plane.kubectl(
        "apply", "-n", namespace, "-f", "-", input=participation(document, 2, SENTINEL)
    )

    # Execute
    hub.plane.kubectl("apply", "-n", hub_namespace, "-f", "-", input=json.dumps(document))

    def debug() -> str:
        return (
            f"--- hub operator\n{hub.operator.tail(40)}\n--- own site\n{own_site.tail(30)}"
            f"\n--- cluster site\n{cluster_site.tail(30)}"
        )

    running = wait_for_run(
        hub.plane, hub_namespace, "joint",
        lambda r: len(sites_of(r)) == 2 and all(map(approved_and_ready, sites_of(r).values())),
        timeout=240, what="both sites approved with every client ready", debug=debug,
    )  # fmt: skip
    done = wait_for_run(
        hub.plane, hub_namespace, "joint",
        lambda r: (r.get("status") or {}).get("phase") in ("Succeeded", "Failed"),
        timeout=300, what="its end", debug=debug,
    )  # fmt: skip

    # Assert: the run trained the model one machine trains with the same data and seed.
    status = done["status"]
    assert status["phase"] == "Succeeded", (status, debug())
    local = run_document("joint")
    del local["spec"]["sites"]
    local["spec"]["data"]["clientData"] = {
        "format": "Parquet",
        "template": {"path": str(hospitals / "hospital-{index}")},
    }
    assert status["finalMetrics"]["accuracy"] == simulate(parse_manifest(local)).accuracy
    # The hub's cluster ran the server only; the clients ran in the sites' clusters.
    hub_pods = hub.plane.kubectl("-n", hub_namespace, "get", "pods", "-o", "json").stdout
    roles = {p["metadata"]["labels"].get("fedcore.dev/role") for p in json.loads(hub_pods)["items"]}
    assert roles <= {"server"}, roles
    assert status["roles"]["clients"]["desired"] == 0
    # status.sites: both enrolled, approved, every client ready, seen during the run.
    mid = sites_of(running)
    for name, clients in ((OWN, 1), (SITE, 2)):
        entry = mid[name]
        assert entry["clients"] == clients and entry["state"] == "Enrolled", entry
        assert entry["reported"]["total"] == clients, entry
        conditions = {c["type"]: (c["status"], c["reason"]) for c in entry["conditions"]}
        assert conditions == {
            "Enrolled": ("True", "Enrolled"),
            "Approved": ("True", "Approved"),
            "Reachable": ("True", "Calling"),
        }, entry
        assert entry["lastSeen"] >= done["metadata"]["creationTimestamp"], entry
    # Each site's Participation ended with the run, its clients done.
    for plane, where, op in ((hub.plane, own, own_site), (control_plane, namespace, cluster_site)):
        ended = wait_participation(
            plane, where, "study", phase("Succeeded", "Failed"),
            timeout=60, what="its end", op=op,
        )  # fmt: skip
        assert ended["status"]["phase"] == "Succeeded", ended["status"]
        assert ended["status"]["reason"] in ("RunSucceeded", "ClientsFinished"), ended["status"]
    # Nothing of the second site's data source is in any object of the hub's cluster...
    everything = hub.plane.kubectl("get", KINDS, "-A", "-o", "json").stdout
    assert len(json.loads(everything)["items"]) > 20
    assert SENTINEL not in everything
    # ...while the site's own binding, in its own cluster, names its claims.
    binding = secret_data(control_plane, namespace, "study-site-binding")
    assert SENTINEL in binding["site-binding.json"]
    hub.plane.delete_namespace(own)


def evil_image(document: dict[str, Any]) -> None:
    document["spec"]["roles"] = {"clients": {"image": "evil.example/fedcore:latest"}}


def more_rounds(document: dict[str, Any]) -> None:
    document["spec"]["rounds"] = 4


@pytest.mark.parametrize(
    ("case", "reason", "words"),
    [
        ("floor", "Protocol", "dp-fedavg"),
        ("image", "ImageNotAllowed", "evil.example/fedcore:latest"),
        ("spec", "SpecChanged", "sha256:"),
    ],
)
def test_a_site_that_refuses_the_run_fails_it_with_its_reason_on_both_clusters(
    hub: HubSide,
    cluster_site: OperatorProcess,
    control_plane: ControlPlane,
    namespace: str,
    hub_namespace: str,
    case: str,
    reason: str,
    words: str,
) -> None:
    # Prepare: the second site's Participation takes only dp-fedavg runs (floor), allows no
    # image but the operator's own (image), or approved the run before it changed (spec).
    document = run_document(f"refused-{case}")
    approved = json.loads(json.dumps(document))
    spec: dict[str, Any] = {}
    if case == "floor":
        spec["floor"] = {"protocols": ["dp-fedavg"]}
    elif case == "image":
        evil_image(document)
        approved = json.loads(json.dumps(document))
    else:
        more_rounds(document)
    control_plane.kubectl(
        "apply", "-n", namespace, "-f", "-",
        input=participation(approved, 2, SENTINEL, **spec),
    )  # fmt: skip
    # Execute
    hub.plane.kubectl("apply", "-n", hub_namespace, "-f", "-", input=json.dumps(document))
    done = wait_for_run(
        hub.plane, hub_namespace, f"refused-{case}",
        lambda r: (r.get("status") or {}).get("phase") in ("Succeeded", "Failed"),
        timeout=120, what="its end", debug=lambda: hub.operator.tail(40),
    )  # fmt: skip
    # Assert: the hub's run failed with the site's reason and words...
    status = done["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "SiteRefused"), status
    assert f"Site {SITE} refused the run ({reason})" in status["message"], status
    assert words in status["message"], status
    entry = sites_of(done)[SITE]
    assert entry["approval"] == "Refused" and entry["reason"] == reason, entry
    conditions = {c["type"]: (c["status"], c["reason"]) for c in entry["conditions"]}
    assert conditions["Approved"] == ("False", reason), entry
    # ...and the site's Participation says the same, with no client pod made.
    found = get_participation(control_plane, namespace, "study")
    assert (found["status"]["phase"], found["status"]["reason"]) == ("Refused", reason)
    assert found["status"]["reported"]["verdict"] == "Refused"
    pods = control_plane.kubectl("-n", namespace, "get", "pods", "-o", "name").stdout
    assert pods.strip() == "", pods

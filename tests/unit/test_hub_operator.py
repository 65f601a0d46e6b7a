"""The operator as a hub: the plan of a run at sites, its ``status.sites``, the hub's state in
Secrets, and the endpoint's claim, one run at a time.

The plan and ``site_statuses`` are pure and get hand-made observations (the run ``team-a/demo``
of ``test_operator_plan`` with its three clients at two sites). ``sync_sites``,
``SecretRegistry`` and ``HubService`` talk to the API through ``Kube``, which a small in-memory
fake stands for here (objects in a dict, merge patches, ``stringData`` folded into ``data`` as
the API server does); the registry, its certificates and the endpoint are the real ones.
"""

from __future__ import annotations

import base64
import copy
import datetime
import json
import logging
import ssl
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from fedcore.sites._registry import EnrollmentRefused, HubRegistry
from fedcore.transport import RunCa, new_key_and_request
from fedcore_operator import objects
from fedcore_operator.hub.service import SETTLE_SECONDS, HubService
from fedcore_operator.hub.state import (
    HUB_SECRET,
    SITES_CONFIG_MAP,
    SecretRegistry,
    SiteList,
    join_secret_name,
    sync_sites,
)
from fedcore_operator.hub.view import LINK_SECONDS, HubView, SiteFacts, refusal, site_statuses
from fedcore_operator.kube import Kube
from fedcore_operator.plan import (
    CreateObjects,
    IssueCertificates,
    IssueKeys,
    Observed,
    PatchObject,
    Plan,
    manifest_of,
    plan,
)
from fedcore_operator.settings import OperatorSettings
from tests.unit.test_operator_plan import (
    NOW,
    SETTINGS,
    conditions_of,
    context,
    observe,
    owned,
    pod,
    run_body,
    stamp,
    summary,
)

Object = dict[str, Any]
SITES = [{"name": "hospital-a", "clients": 2}, {"name": "hospital-b", "clients": 1}]
"""The run's three clients: 0 and 1 at hospital-a, 2 at hospital-b."""
HUB_NAMESPACE = "fedcore"
REGISTRY = {"hospital-a": "Enrolled", "gone": "Revoked", "old": "Revoked", "new": "Invited"}
"""The hub's registry: hospital-a enrolled, hospital-b unknown, two other sites revoked."""
SERVING = HubView(serving=True, registry=REGISTRY)
PROTOCOLS = ["fedavg", "mpdp", "ebscfl", "lppa"]
"""With and without a KDC, with a server that calls its KDC, and decentralized."""


# ---------------------------------------------------------------------------- observations


def sites_body(protocol: str = "fedavg", status: Object | None = None) -> Object:
    """The stored run ``team-a/demo`` whose clients are at hospital-a and hospital-b."""
    return run_body(protocol, status, sites=copy.deepcopy(SITES))


def at_hub(
    body: Object,
    hub: HubView | None,
    pods: list[Object] | None = None,
    *,
    fresh: bool = False,
    at: float = 0,
) -> Observed:
    """What a pass of an operator with (or without, None) a hub sees; unless ``fresh``, every
    object of the run exists, the revoked-sites ConfigMap as ``hub`` would make it."""
    observed = replace(observe(body, pods, fresh=fresh, at=at), hub=hub)
    if fresh or hub is None:
        return observed
    listed = {kind: list(items) for kind, items in owned(body).items()}
    revoked = [name for name, state in hub.registry.items() if state == "Revoked"]
    listed["ConfigMap"].append(objects.revoked_sites_config_map(context(body), revoked))
    return replace(observed, owned=listed)


def created(result: Plan) -> list[Object]:
    """Every object the plan creates, in order."""
    return [obj for step in result.steps if isinstance(step, CreateObjects) for obj in step.objects]


def created_named(result: Plan, kind: str) -> dict[str, Object]:
    return {obj["metadata"]["name"]: obj for obj in created(result) if obj["kind"] == kind}


def container(pod_object: Object) -> Object:
    (only,) = pod_object["spec"]["containers"]
    return dict(only)


def needs_kdc(protocol: str) -> bool:
    return context(sites_body(protocol)).needs_kdc


def ready_pods(protocol: str, *roles: str) -> list[Object]:
    """Ready pods of the given roles, the KDC's first when the protocol has one."""
    names = [role for role in ("kdc", "server") if role in roles]
    if not needs_kdc(protocol):
        names = [name for name in names if name != "kdc"]
    return [pod(name) for name in names]


def revoked_in(config_map: Object) -> list[str]:
    names: list[str] = json.loads(config_map["data"][objects.REVOKED_FILE])["revoked"]
    return names


# ----------------------------------------------------------------------------- plan: gates


@pytest.mark.parametrize("protocol", ["fedavg", "mpdp"])
def test_a_run_at_sites_waits_with_no_hub_and_makes_nothing(protocol: str) -> None:
    # Prepare
    observed = at_hub(sites_body(protocol), None, fresh=True)

    # Execute
    result = plan(observed)

    # Assert
    assert (result.phase, result.status["reason"]) == ("Pending", "NoHub")
    assert "hub.enabled" in result.status["message"]
    assert result.steps == ()
    assert conditions_of(result.status)["Ready"] == ("False", "NoHub")
    assert "sites" not in result.status
    assert result.status_patch is not None


def test_a_run_at_sites_waits_while_the_endpoint_serves_another_run() -> None:
    # Prepare
    view = HubView(serving=False, holder="team-b/other", registry=REGISTRY)
    observed = at_hub(sites_body("mpdp"), view, fresh=True)

    # Execute
    result = plan(observed)

    # Assert
    assert (result.phase, result.status["reason"]) == ("Pending", "EndpointBusy")
    assert "team-b/other" in result.status["message"]
    assert result.steps == (), "no Secret, object or pod before the endpoint serves the run"
    conditions = conditions_of(result.status)
    assert conditions["HubEndpoint"] == ("False", "EndpointBusy")
    assert conditions["Ready"] == ("False", "EndpointBusy")
    (hub_endpoint,) = [c for c in result.status["conditions"] if c["type"] == "HubEndpoint"]
    assert "team-b/other" in hub_endpoint["message"]
    assert [entry["name"] for entry in result.status["sites"]] == ["hospital-a", "hospital-b"]
    assert result.status["roles"]["clients"]["desired"] == 0


# ---------------------------------------------------------------------------- plan: serving


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_served_run_at_sites_gets_server_and_kdc_secrets_and_no_clients(protocol: str) -> None:
    # Prepare
    observed = at_hub(sites_body(protocol), SERVING, fresh=True)
    roles = ["kdc", "server"] if needs_kdc(protocol) else ["server"]

    # Execute
    result = plan(observed)

    # Assert
    issue = next(step for step in result.steps if isinstance(step, IssueCertificates))
    assert issue.identities == tuple((f"demo-{role}", role, None) for role in roles)
    keys = next(step for step in result.steps if isinstance(step, IssueKeys))
    assert "client" not in keys.roles
    pods = created_named(result, "Pod")
    assert list(pods) == [f"demo-{roles[0]}"], "the first role's pod and no client's"
    assert created_named(result, "ConfigMap").keys() == {"demo-manifest", "demo-revoked-sites"}
    assert conditions_of(result.status)["HubEndpoint"] == ("True", "Serving")
    assert result.status["roles"]["clients"]["desired"] == 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_served_run_at_sites_reads_the_hubs_revoked_sites(protocol: str) -> None:
    # Prepare: past the KDC (when there is one), so the pass makes the server's pod
    body = sites_body(protocol)
    observed = at_hub(body, SERVING, ready_pods(protocol, "kdc"), fresh=True)
    roles = ["kdc", "server"] if needs_kdc(protocol) else ["server"]
    kdc_pass = plan(at_hub(body, SERVING, fresh=True))

    # Execute
    result = plan(observed)

    # Assert
    config_map = created_named(result, "ConfigMap")["demo-revoked-sites"]
    assert revoked_in(config_map) == ["gone", "old"]
    assert config_map["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    pods = {**created_named(kdc_pass, "Pod"), **created_named(result, "Pod")}
    assert sorted(pods) == sorted(f"demo-{role}" for role in roles)
    for made in pods.values():
        volumes = {v["name"]: v for v in made["spec"]["volumes"]}
        assert volumes["revoked-sites"] == {
            "name": "revoked-sites",
            "configMap": {"name": "demo-revoked-sites"},
        }
        mounts = {m["name"]: m for m in container(made)["volumeMounts"]}
        assert mounts["revoked-sites"]["mountPath"] == objects.REVOKED_DIR
        assert mounts["revoked-sites"]["readOnly"] is True
        env = {e["name"]: e.get("value") for e in container(made)["env"]}
        assert env["FEDCORE_REVOKED_SITES"] == f"{objects.REVOKED_DIR}/{objects.REVOKED_FILE}"


def test_a_site_revoked_since_the_last_pass_is_patched_into_the_runs_list() -> None:
    # Prepare: every object exists as the registry was; then the hub revokes hospital-a
    body = sites_body()
    before = at_hub(body, SERVING, ready_pods("fedavg", "server"))
    now_revoked = HubView(serving=True, registry={**REGISTRY, "hospital-a": "Revoked"})
    observed = replace(before, hub=now_revoked)

    # Execute
    result = plan(observed)

    # Assert
    (patch,) = [step for step in result.steps if isinstance(step, PatchObject)]
    assert (patch.kind, patch.name) == ("ConfigMap", "demo-revoked-sites")
    assert revoked_in(patch.patch) == ["gone", "hospital-a", "old"]
    assert result.status["sites"][0]["state"] == "Revoked"
    assert conditions_of(result.status["sites"][0])["Enrolled"] == ("False", "Revoked")


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    "settings",
    [
        replace(SETTINGS, ca_namespace=HUB_NAMESPACE),
        replace(
            SETTINGS,
            ca_namespace=HUB_NAMESPACE,
            hub_from=({"ipBlock": {"cidr": "10.9.0.0/16"}},),
        ),
    ],
    ids=["operator pods", "hub_from"],
)
def test_only_the_hub_reaches_the_server_and_kdc_of_a_run_at_sites(
    protocol: str, settings: OperatorSettings
) -> None:
    # Prepare
    observed = replace(at_hub(sites_body(protocol), SERVING, fresh=True), settings=settings)
    expected_peers = (
        [{"ipBlock": {"cidr": "10.9.0.0/16"}}]
        if settings.hub_from
        else [
            {
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": HUB_NAMESPACE}
                },
                "podSelector": {"matchLabels": objects.OPERATOR_POD_LABELS},
            }
        ]
    )

    # Execute
    result = plan(observed)

    # Assert
    assert objects.hub_peers(settings) == expected_peers
    policies = created_named(result, "NetworkPolicy")
    roles = ["demo-server", "demo-kdc"] if needs_kdc(protocol) else ["demo-server"]
    assert sorted(policies) == sorted(roles), "no client policy"
    server_in = policies["demo-server"]["spec"]["ingress"][0]
    assert server_in["from"] == expected_peers
    assert server_in["ports"] == [{"protocol": "TCP", "port": settings.server_port}]
    if needs_kdc(protocol):
        kdc_in = policies["demo-kdc"]["spec"]["ingress"][0]
        server_too = (
            [{"podSelector": {"matchLabels": objects.selector("demo", "server")}}]
            if protocol == "ebscfl"
            else []
        )
        assert kdc_in["from"] == [*expected_peers, *server_too]
    services = created_named(result, "Service")
    assert sorted(services) == sorted(roles), "no peers headless Service"
    assert objects.peers_service_name("demo") not in services


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_run_at_sites_whose_server_is_ready_trains_with_no_client_pod(protocol: str) -> None:
    # Prepare
    observed = at_hub(sites_body(protocol), SERVING, ready_pods(protocol, "kdc", "server"))

    # Execute
    result = plan(observed)

    # Assert
    assert (result.phase, result.status["reason"]) == ("Running", "Training")
    assert result.steps == ()
    conditions = conditions_of(result.status)
    assert conditions["ServerReady"] == ("True", "PodReady")
    assert conditions["Ready"] == ("True", "Training")
    assert "ClientsReady" not in conditions
    clients = result.status["roles"]["clients"]
    assert (clients["desired"], clients["running"]) == (0, 0)


# ----------------------------------------------------------------------- plan: a refusal


def test_a_site_refusal_fails_the_run_naming_the_site_reason_and_message() -> None:
    # Prepare: the run trains; hospital-b's review then refuses it
    view = HubView(
        serving=True,
        registry=REGISTRY,
        facts={
            "hospital-a": SiteFacts("Approved"),
            "hospital-b": SiteFacts("Refused", "EpsilonTooHigh", "epsilon 7.9 exceeds 5"),
        },
    )
    observed = at_hub(sites_body(), view, ready_pods("fedavg", "server"))

    # Execute
    result = plan(observed)

    # Assert
    assert (result.phase, result.status["reason"]) == ("Failed", "SiteRefused")
    assert result.status["message"] == (
        "Site hospital-b refused the run (EpsilonTooHigh): epsilon 7.9 exceeds 5"
    )
    conditions = conditions_of(result.status)
    assert conditions["Failed"] == ("True", "SiteRefused")
    assert conditions["Complete"] == ("False", "SiteRefused")
    assert result.status["completionTime"] == stamp()
    assert [s for s in summary(result.steps) if s[0] == "delete"] == [
        ("delete", "Pod/demo-server", None)
    ]
    assert not created(result)
    approvals = {entry["name"]: entry["approval"] for entry in result.status["sites"]}
    assert approvals == {"hospital-a": "Approved", "hospital-b": "Refused"}


def test_a_refusal_fails_the_run_even_while_another_run_holds_the_endpoint() -> None:
    # Prepare
    view = HubView(
        serving=False,
        holder="team-b/other",
        facts={"hospital-a": SiteFacts("Refused", "NotApproved", "unknown spec digest")},
    )

    # Execute
    result = plan(at_hub(sites_body(), view, fresh=True))

    # Assert
    assert (result.phase, result.status["reason"]) == ("Failed", "SiteRefused")
    assert "hospital-a" in result.status["message"]


def test_refusal_names_the_first_refusing_site_by_name() -> None:
    # Prepare
    view = HubView(
        serving=True,
        facts={
            "west": SiteFacts("Refused", "B", "b"),
            "east": SiteFacts("Refused", "A", "a"),
            "alpha": SiteFacts("Withdrawn", "Withdrawn", "stopped"),
            "beta": SiteFacts(None, clients={"ready": 1}),
        },
    )

    # Execute
    found = refusal(view)
    none = refusal(HubView(serving=True, facts={"alpha": SiteFacts("Approved")}))

    # Assert
    assert found == ("east", SiteFacts("Refused", "A", "a"))
    assert none is None


# ---------------------------------------------------------------------------- status.sites


def spec_sites() -> Any:
    spec_sites = manifest_of(sites_body()).spec.sites
    assert spec_sites is not None
    return spec_sites


def unix(seconds_ago: float) -> float:
    return (NOW - datetime.timedelta(seconds=seconds_ago)).timestamp()


def test_site_statuses_give_each_site_its_state_approval_counts_and_reachability() -> None:
    # Prepare
    view = HubView(
        serving=True,
        registry={"hospital-a": "Enrolled"},
        last_seen={"hospital-a": unix(5.7)},
        facts={"hospital-a": SiteFacts("Approved", clients={"total": 2, "ready": 1})},
    )

    # Execute
    entries = site_statuses(spec_sites(), view, [], NOW, 3)

    # Assert
    a, b = entries
    assert (a["name"], a["clients"], a["state"], a["approval"]) == (
        "hospital-a",
        2,
        "Enrolled",
        "Approved",
    )
    assert a["reported"] == {"total": 2, "ready": 1}
    assert a["lastSeen"] == stamp(6), "whole seconds, RFC 3339"
    assert conditions_of(a) == {
        "Enrolled": ("True", "Enrolled"),
        "Approved": ("True", "Approved"),
        "Reachable": ("True", "Calling"),
    }
    assert all(c["observedGeneration"] == 3 for c in a["conditions"])
    assert all(c["lastTransitionTime"] == stamp() for c in a["conditions"])
    assert (b["name"], b["clients"], b["state"], b["approval"]) == (
        "hospital-b",
        1,
        "Unknown",
        "Pending",
    )
    assert "reported" not in b and "lastSeen" not in b
    assert conditions_of(b) == {
        "Enrolled": ("False", "Unknown"),
        "Approved": ("False", "Pending"),
        "Reachable": ("False", "NeverSeen"),
    }


@pytest.mark.parametrize(
    ("facts", "approval", "condition", "message"),
    [
        (None, "Pending", ("False", "Pending"), "The site has not reviewed the run yet."),
        (SiteFacts("Approved"), "Approved", ("True", "Approved"), None),
        (
            SiteFacts("Refused", "EpsilonTooHigh", "epsilon 7.9 exceeds 5"),
            "Refused",
            ("False", "EpsilonTooHigh"),
            "epsilon 7.9 exceeds 5",
        ),
        (
            SiteFacts("Withdrawn", "Withdrawn", "the site's admin stopped it"),
            "Withdrawn",
            ("False", "Withdrawn"),
            "the site's admin stopped it",
        ),
    ],
    ids=["pending", "approved", "refused", "withdrawn"],
)
def test_site_statuses_report_each_verdict(
    facts: SiteFacts | None, approval: str, condition: tuple[str, str], message: str | None
) -> None:
    # Prepare
    view = HubView(serving=True, facts={} if facts is None else {"hospital-b": facts})

    # Execute
    _, b = site_statuses(spec_sites(), view, [], NOW, 1)

    # Assert
    assert b["approval"] == approval
    assert conditions_of(b)["Approved"] == condition
    if message is not None:
        (approved,) = [c for c in b["conditions"] if c["type"] == "Approved"]
        assert approved["message"] == message


@pytest.mark.parametrize(
    ("seconds_ago", "reachable"),
    [
        (0, ("True", "Calling")),
        (LINK_SECONDS, ("True", "Calling")),
        (LINK_SECONDS + 1, ("False", "LinkLost")),
        (3600, ("False", "LinkLost")),
    ],
)
def test_a_site_that_stopped_calling_has_lost_its_link(
    seconds_ago: float, reachable: tuple[str, str]
) -> None:
    # Prepare
    view = HubView(serving=True, last_seen={"hospital-a": unix(seconds_ago)})

    # Execute
    a, _ = site_statuses(spec_sites(), view, [], NOW, 1)

    # Assert
    assert a["lastSeen"] == stamp(seconds_ago)
    assert conditions_of(a)["Reachable"] == reachable
    if reachable[1] == "LinkLost":
        (condition,) = [c for c in a["conditions"] if c["type"] == "Reachable"]
        assert f"for {int(seconds_ago)} s" in condition["message"]


def test_site_statuses_keep_what_an_earlier_pass_wrote_when_the_hub_heard_nothing() -> None:
    # Prepare: the status a pass wrote an hour ago; the operator restarted since
    earlier = NOW - datetime.timedelta(hours=1)
    heard = HubView(
        serving=True,
        registry={"hospital-a": "Enrolled", "hospital-b": "Enrolled"},
        last_seen={"hospital-a": earlier.timestamp() - 10},
        facts={
            "hospital-a": SiteFacts("Approved", clients={"total": 2, "ready": 2}),
            "hospital-b": SiteFacts("Withdrawn", "Withdrawn", "maintenance"),
        },
    )
    old = site_statuses(spec_sites(), heard, [], earlier, 1)
    restarted = HubView(serving=True, registry={"hospital-a": "Enrolled"})

    # Execute
    entries = site_statuses(spec_sites(), restarted, copy.deepcopy(old), NOW, 2)

    # Assert
    a, b = entries
    assert a["approval"] == "Approved"
    assert a["reported"] == {"total": 2, "ready": 2}
    assert a["lastSeen"] == old[0]["lastSeen"]
    assert conditions_of(a)["Reachable"] == ("False", "LinkLost"), "an hour without a call"
    times = {c["type"]: c["lastTransitionTime"] for c in a["conditions"]}
    assert times["Approved"] == times["Enrolled"] == old[0]["conditions"][0]["lastTransitionTime"]
    assert times["Reachable"] == stamp()
    assert (b["approval"], b["reason"], b["message"]) == ("Withdrawn", "Withdrawn", "maintenance")
    assert (b["state"], conditions_of(b)["Enrolled"]) == ("Unknown", ("False", "Unknown"))


def test_site_counts_merge_with_what_was_reported_before() -> None:
    # Prepare
    old = [{"name": "hospital-a", "approval": "Approved", "reported": {"total": 2, "ready": 2}}]
    view = HubView(serving=True, facts={"hospital-a": SiteFacts(None, clients={"succeeded": 1})})

    # Execute
    a, _ = site_statuses(spec_sites(), view, old, NOW, 1)

    # Assert
    assert a["reported"] == {"total": 2, "ready": 2, "succeeded": 1}
    assert a["approval"] == "Approved"


def test_the_plan_writes_status_sites_and_keeps_them_over_a_restart() -> None:
    # Prepare: a pass that heard hospital-a, then one of a restarted operator (nothing heard)
    body = sites_body()
    view = HubView(
        serving=True,
        registry=REGISTRY,
        last_seen={"hospital-a": unix(3)},
        facts={"hospital-a": SiteFacts("Approved", clients={"total": 2, "ready": 2})},
    )
    first = plan(at_hub(body, view, ready_pods("fedavg", "server")))
    body = {**body, "status": first.status}
    restarted = HubView(serving=True, registry=REGISTRY)

    # Execute
    second = plan(at_hub(body, restarted, ready_pods("fedavg", "server"), at=5))

    # Assert
    assert first.status["sites"][0]["lastSeen"] == stamp(3)
    assert second.status["sites"] == first.status["sites"]
    assert second.status_patch is None, "nothing changed"


# -------------------------------------------------------------------- the API, in memory


class FakeKube(Kube):
    """``Kube`` over a dict: create refuses a name taken, patch merges (``stringData`` into
    base64 ``data``, as the API server stores a Secret), and every write is recorded."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], Object] = {}
        self.writes: list[tuple[str, str, str]] = []

    @staticmethod
    def _stored(obj: Object) -> Object:
        obj = copy.deepcopy(obj)
        if obj.get("kind") == "Secret" and "stringData" in obj:
            data = obj.setdefault("data", {})
            for key, value in obj.pop("stringData").items():
                data[key] = base64.b64encode(value.encode()).decode()
        return obj

    def get(self, kind: str, namespace: str, name: str) -> Object | None:
        found = self.objects.get((kind, namespace, name))
        return copy.deepcopy(found)

    def list(self, kind: str, namespace: str, labels: str) -> list[Object]:
        wanted = dict(pair.split("=", 1) for pair in labels.split(",") if pair)
        return [
            copy.deepcopy(obj)
            for (k, ns, _), obj in sorted(self.objects.items())
            if (k, ns) == (kind, namespace)
            and all((obj["metadata"].get("labels") or {}).get(a) == b for a, b in wanted.items())
        ]

    def create(self, obj: Object) -> Object | None:
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key in self.objects:
            return None
        self.objects[key] = self._stored({**obj, "kind": key[0]})
        self.writes.append(("create", key[0], key[2]))
        return copy.deepcopy(self.objects[key])

    def patch(self, kind: str, namespace: str, name: str, patch: Object, sub: str = "") -> Object:
        key = (kind, namespace, name)
        if key not in self.objects:
            raise ApiException(status=404, reason="Not Found")
        self.objects[key] = self._stored(_merge(self.objects[key], patch))
        self.writes.append(("patch", kind, name))
        return copy.deepcopy(self.objects[key])

    def delete(
        self,
        kind: str,
        namespace: str,
        name: str,
        grace_seconds: int | None = None,
        *,
        uid: str | None = None,
    ) -> bool:
        self.writes.append(("delete", kind, name))
        return self.objects.pop((kind, namespace, name), None) is not None


def _merge(target: Any, patch: Any) -> Any:
    """A JSON merge patch (RFC 7386)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge(result.get(key), value)
    return result


def sites_config_map(sites: str, revoked: str = "") -> Object:
    """The chart's ConfigMap of the hub's sites."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": SITES_CONFIG_MAP, "namespace": HUB_NAMESPACE},
        "data": {"sites": sites, "revoked": revoked},
    }


def join_secret(kube: FakeKube, site: str) -> dict[str, str] | None:
    """A site's join Secret's keys, decoded (None: no such Secret)."""
    secret = kube.get("Secret", HUB_NAMESPACE, join_secret_name(site))
    if secret is None:
        return None
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def states(registry: HubRegistry) -> dict[str, str]:
    return {site["name"]: site["state"] for site in registry.sites()}


def enroll(registry: HubRegistry, token: str, site: str) -> bytes:
    return registry.enroll(token, new_key_and_request(site)[1])


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube()


@pytest.fixture
def registry(tmp_path: Path) -> HubRegistry:
    return HubRegistry(tmp_path / "hub")


# ------------------------------------------------------------------------------ sync_sites


def test_site_list_reads_names_separated_by_blanks_or_commas() -> None:
    # Execute
    listed = SiteList.from_config_map(sites_config_map(" a, b  c,,a ", "d"))
    empty = SiteList.from_config_map(None)

    # Assert
    assert listed == SiteList(sites=("a", "b", "c"), revoked=("d",))
    assert empty == SiteList()


def test_sync_invites_each_listed_site_with_a_join_secret(
    kube: FakeKube, registry: HubRegistry
) -> None:
    # Prepare
    kube.create(sites_config_map("a b", "c"))
    before = time.time()

    # Execute
    done = sync_sites(kube, registry, HUB_NAMESPACE)

    # Assert
    assert done == [
        f"invited site a (join token in Secret {HUB_NAMESPACE}/fedcore-hub-join-a)",
        f"invited site b (join token in Secret {HUB_NAMESPACE}/fedcore-hub-join-b)",
    ]
    assert states(registry) == {"a": "Invited", "b": "Invited"}, "c unknown: nothing to revoke"
    for site in ("a", "b"):
        given = join_secret(kube, site)
        assert given is not None
        assert given.keys() == {"token", "fingerprint", "expires"}
        assert given["token"].startswith(f"{site}.")
        assert given["fingerprint"] == registry.fingerprint
        assert int(given["expires"]) >= int(before)
        stored = kube.objects[("Secret", HUB_NAMESPACE, join_secret_name(site))]
        assert stored["metadata"]["labels"]["fedcore.dev/site"] == site
    assert join_secret(kube, "c") is None
    token = join_secret(kube, "a")
    assert token is not None
    assert enroll(registry, token["token"], "a"), "the Secret's token enrolls site a"


def test_sync_revokes_a_known_site_listed_as_revoked(kube: FakeKube, registry: HubRegistry) -> None:
    # Prepare
    kube.create(sites_config_map("a b c", "c"))
    registry.add_site("c")

    # Execute
    done = sync_sites(kube, registry, HUB_NAMESPACE)

    # Assert
    assert "revoked site c" in done
    assert states(registry) == {"a": "Invited", "b": "Invited", "c": "Revoked"}
    assert registry.revoked() == {"c"}
    assert join_secret(kube, "c") is None, "a revoked site is never invited"


def test_a_second_sync_does_nothing(kube: FakeKube, registry: HubRegistry) -> None:
    # Prepare
    kube.create(sites_config_map("a b", "c"))
    registry.add_site("c")
    sync_sites(kube, registry, HUB_NAMESPACE)
    kube.writes.clear()
    secrets = copy.deepcopy(kube.objects)

    # Execute
    done = sync_sites(kube, registry, HUB_NAMESPACE)

    # Assert
    assert done == []
    assert kube.writes == []
    assert kube.objects == secrets


def test_deleting_a_join_secret_gives_the_site_a_new_token(
    kube: FakeKube, registry: HubRegistry
) -> None:
    # Prepare
    kube.create(sites_config_map("a b"))
    sync_sites(kube, registry, HUB_NAMESPACE)
    old = join_secret(kube, "a")
    assert old is not None
    kube.delete("Secret", HUB_NAMESPACE, join_secret_name("a"))

    # Execute
    done = sync_sites(kube, registry, HUB_NAMESPACE)

    # Assert
    assert done == [f"invited site a (join token in Secret {HUB_NAMESPACE}/fedcore-hub-join-a)"]
    new = join_secret(kube, "a")
    assert new is not None
    assert new["token"] != old["token"] and new["token"].startswith("a.")
    assert states(registry)["a"] == "Invited", "not enrolled"
    with pytest.raises(EnrollmentRefused) as refused:
        enroll(registry, old["token"], "a")
    assert refused.value.reason == "UnknownToken"
    assert enroll(registry, new["token"], "a")


def test_an_enrolled_site_gets_no_new_token(kube: FakeKube, registry: HubRegistry) -> None:
    # Prepare
    kube.create(sites_config_map("a"))
    sync_sites(kube, registry, HUB_NAMESPACE)
    given = join_secret(kube, "a")
    assert given is not None
    enroll(registry, given["token"], "a")
    kube.delete("Secret", HUB_NAMESPACE, join_secret_name("a"))

    # Execute
    done = sync_sites(kube, registry, HUB_NAMESPACE)

    # Assert
    assert done == []
    assert join_secret(kube, "a") is None
    assert states(registry) == {"a": "Enrolled"}


def test_sync_overwrites_a_join_secret_left_by_an_earlier_hub(
    kube: FakeKube, registry: HubRegistry
) -> None:
    # Prepare: the Secret of a hub whose registry is gone (its token names no site here)
    kube.create(sites_config_map("a"))
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": join_secret_name("a"), "namespace": HUB_NAMESPACE},
            "stringData": {"token": "a.stale", "fingerprint": "sha256:00", "expires": "1"},
        }
    )

    # Execute
    done = sync_sites(kube, registry, HUB_NAMESPACE)

    # Assert
    assert done == [f"invited site a (join token in Secret {HUB_NAMESPACE}/fedcore-hub-join-a)"]
    given = join_secret(kube, "a")
    assert given is not None
    assert given["token"] != "a.stale" and given["fingerprint"] == registry.fingerprint
    assert enroll(registry, given["token"], "a")


def test_sync_skips_a_name_that_is_no_site_name(
    kube: FakeKube, registry: HubRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare
    kube.create(sites_config_map("a Bad_Name server b"))

    # Execute
    with caplog.at_level(logging.WARNING, logger="fedcore_operator.hub.state"):
        done = sync_sites(kube, registry, HUB_NAMESPACE)

    # Assert
    assert [line.split(" (")[0] for line in done] == ["invited site a", "invited site b"]
    assert states(registry) == {"a": "Invited", "b": "Invited"}
    assert join_secret(kube, "Bad_Name") is None and join_secret(kube, "server") is None
    warned = " ".join(record.getMessage() for record in caplog.records)
    assert "'Bad_Name'" in warned and "'server'" in warned


def test_sync_with_no_site_list_does_nothing(kube: FakeKube, registry: HubRegistry) -> None:
    # Execute
    done = sync_sites(kube, registry, HUB_NAMESPACE)

    # Assert
    assert done == []
    assert kube.writes == []
    assert registry.sites() == []


# -------------------------------------------------------------------------- SecretRegistry


def test_a_fresh_hub_saves_its_registry_into_its_secret(kube: FakeKube, tmp_path: Path) -> None:
    # Execute
    state = SecretRegistry(kube, HUB_NAMESPACE, tmp_path / "one")
    made = kube.get("Secret", HUB_NAMESPACE, HUB_SECRET)
    state.registry.add_site("north")
    saved = kube.get("Secret", HUB_NAMESPACE, HUB_SECRET)

    # Assert
    assert made is not None and saved is not None
    assert made["type"] == "Opaque"
    assert made["metadata"]["labels"]["app.kubernetes.io/component"] == "hub"
    assert set(made["data"]) == {
        "ca--ca.crt",
        "ca--ca.key",
        "endpoint--ca.crt",
        "endpoint--tls.crt",
        "endpoint--tls.key",
        "revoked-sites.json",
    }
    assert set(saved["data"]) == {*made["data"], "sites.json"}, "no sites.lock"
    assert kube.writes == [("create", "Secret", HUB_SECRET), ("patch", "Secret", HUB_SECRET)]
    key = (tmp_path / "one" / "ca" / "ca.key").read_bytes()
    assert base64.b64decode(saved["data"]["ca--ca.key"]) == key
    sites = json.loads(base64.b64decode(saved["data"]["sites.json"]))
    assert list(sites["sites"]) == ["north"]


def test_a_restarted_hub_restores_its_ca_and_sites_from_the_secret(
    kube: FakeKube, tmp_path: Path
) -> None:
    # Prepare
    first = SecretRegistry(kube, HUB_NAMESPACE, tmp_path / "one")
    token = first.registry.add_site("north")
    first.registry.add_site("south")
    first.registry.revoke("south")
    kube.writes.clear()

    # Execute
    again = SecretRegistry(kube, HUB_NAMESPACE, tmp_path / "two")

    # Assert
    assert again.registry.fingerprint == first.registry.fingerprint
    assert again.registry.sites() == first.registry.sites()
    assert again.registry.revoked() == {"south"}
    assert kube.writes == [], "restoring writes nothing"
    assert (tmp_path / "two" / "ca" / "ca.key").stat().st_mode & 0o077 == 0
    assert enroll(again.registry, token.token, "north"), "the first hub's token still enrolls"
    assert kube.writes == [("patch", "Secret", HUB_SECRET)], "the enrollment is saved"


def test_a_registry_made_beside_another_operators_refuses_to_lose_its_state(
    tmp_path: Path,
) -> None:
    # Prepare: another operator makes the Secret between this one's read and its create
    class Racing(FakeKube):
        def create(self, obj: Object) -> Object | None:
            if obj["metadata"]["name"] == HUB_SECRET:
                super().create({**obj, "data": {}})
            return super().create(obj)

    # Execute / Assert
    with pytest.raises(RuntimeError, match="appeared while this operator made"):
        SecretRegistry(Racing(), HUB_NAMESPACE, tmp_path / "one")


# ------------------------------------------------------------------------------ HubService


@pytest.fixture
def service(
    kube: FakeKube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[HubService]:
    """A started hub service on a free port; its registry's folder under ``tmp_path``."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    hub = HubService(kube, replace(SETTINGS, ca_namespace=HUB_NAMESPACE), "127.0.0.1:0")
    hub.start()
    yield hub
    hub.stop()


def listed_run(
    name: str, uid: str, *, phase: str | None = None, served: bool | None = None
) -> Object:
    """A run at sites ``team-a/<name>`` as a pass reads it."""
    body = sites_body()
    body["metadata"].update({"name": name, "uid": uid})
    status: Object = {}
    if phase is not None:
        status["phase"] = phase
    if served is not None:
        status["conditions"] = [{"type": "HubEndpoint", "status": str(served), "reason": "Serving"}]
    if status:
        body["status"] = status
    return body


def test_the_service_keeps_its_registry_in_the_hub_secret(
    service: HubService, kube: FakeKube
) -> None:
    # Execute
    saved = kube.get("Secret", HUB_NAMESPACE, HUB_SECRET)

    # Assert
    assert saved is not None
    assert service.registry is service.state.registry
    assert service.port > 0


def test_no_run_claims_the_endpoint_while_the_operator_settles(service: HubService) -> None:
    # Prepare
    early = service._started + SETTLE_SECONDS / 2

    # Execute
    view = service.view(listed_run("one", "uid-one", phase="Pending"), now=early)

    # Assert
    assert view == HubView(serving=False, holder=None)


def test_a_run_served_before_a_restart_claims_the_endpoint_at_once(service: HubService) -> None:
    # Prepare
    early = service._started + 1
    served = listed_run("one", "uid-one", phase="Running", served=True)
    waiting = listed_run("two", "uid-two", phase="Pending", served=False)

    # Execute
    first = service.view(waiting, now=early)
    second = service.view(served, now=early)
    third = service.view(waiting, now=service._started + SETTLE_SECONDS)

    # Assert
    assert (first.serving, first.holder) == (False, None)
    assert (second.serving, second.holder) == (True, None)
    assert (third.serving, third.holder) == (False, "team-a/one")


def test_after_settling_the_first_run_claims_and_the_next_waits(service: HubService) -> None:
    # Prepare
    later = service._started + SETTLE_SECONDS
    one = listed_run("one", "uid-one")
    two = listed_run("two", "uid-two", phase="Pending")

    # Execute
    first = service.view(one, now=later)
    second = service.view(two, now=later)
    again = service.view(one, now=later + 60)

    # Assert
    assert (first.serving, first.holder) == (True, None)
    assert (second.serving, second.holder) == (False, "team-a/one")
    assert (again.serving, again.holder) == (True, None)


def test_a_finished_run_frees_the_endpoint_and_never_claims_it(service: HubService) -> None:
    # Prepare
    later = service._started + SETTLE_SECONDS
    one = listed_run("one", "uid-one", phase="Running")
    two = listed_run("two", "uid-two", phase="Pending")
    service.view(one, now=later)

    # Execute
    ended = service.view(listed_run("one", "uid-one", phase="Succeeded"), now=later)
    failed_again = service.view(listed_run("three", "uid-3", phase="Failed"), now=later)
    next_one = service.view(two, now=later)

    # Assert
    assert (ended.serving, ended.holder) == (False, None)
    assert (failed_again.serving, failed_again.holder) == (False, None)
    assert (next_one.serving, next_one.holder) == (True, None)


def test_a_run_made_again_under_the_same_name_waits_for_the_old_ones_release(
    service: HubService,
) -> None:
    # Prepare
    later = service._started + SETTLE_SECONDS
    service.view(listed_run("one", "uid-old"), now=later)

    # Execute
    waiting = service.view(listed_run("one", "uid-new"), now=later)
    service.release("team-a", "one")
    claimed = service.view(listed_run("one", "uid-new"), now=later)

    # Assert
    assert (waiting.serving, waiting.holder) == (False, "team-a/one")
    assert claimed.serving


def test_release_frees_the_endpoint_for_the_next_run(service: HubService) -> None:
    # Prepare
    later = service._started + SETTLE_SECONDS
    service.view(listed_run("one", "uid-one"), now=later)

    # Execute
    service.release("team-a", "other")  # not the holder: nothing happens
    still = service.view(listed_run("two", "uid-two"), now=later)
    service.release("team-a", "one")
    freed = service.view(listed_run("two", "uid-two"), now=later)

    # Assert
    assert (still.serving, still.holder) == (False, "team-a/one")
    assert (freed.serving, freed.holder) == (True, None)
    assert service.endpoint.run is None


def test_the_views_registry_and_last_seen_are_the_hubs(service: HubService) -> None:
    # Prepare
    service.registry.add_site("hospital-a")
    service.registry.add_site("gone")
    service.registry.revoke("gone")
    service.endpoint.last_seen["hospital-a"] = 1_700_000_000.0

    # Execute
    view = service.view(listed_run("one", "uid-one"), now=service._started + SETTLE_SECONDS)

    # Assert
    assert view.registry == {"hospital-a": "Invited", "gone": "Revoked"}
    assert view.last_seen == {"hospital-a": 1_700_000_000.0}


def test_site_events_become_facts_and_notify_the_run(service: HubService) -> None:
    # Prepare
    later = service._started + SETTLE_SECONDS
    body = listed_run("one", "uid-one")
    service.view(body, now=later)
    notified: list[tuple[str, str]] = []
    service.notify = lambda namespace, name: notified.append((namespace, name))
    heard = service._events(("team-a", "one", "uid-one"))

    # Execute
    heard("site_clients", site="hospital-a", total=2, ready=1)
    heard("site_approved", site="hospital-a")
    heard("site_refused", site="hospital-b", reason="EpsilonTooHigh", message="too much")
    heard("site_clients", site="hospital-b", total=1, ready=0, succeeded=0)
    heard("site_certificates", site="hospital-a", clients=2)  # not a fact
    view = service.view(body, now=later)

    # Assert
    assert view.facts == {
        "hospital-a": SiteFacts("Approved", "", "", {"total": 2, "ready": 1}),
        "hospital-b": SiteFacts(
            "Refused", "EpsilonTooHigh", "too much", {"total": 1, "ready": 0, "succeeded": 0}
        ),
    }
    assert notified == [("team-a", "one")] * 4


def test_a_withdrawal_is_a_fact_and_a_release_forgets_the_runs_facts(
    service: HubService,
) -> None:
    # Prepare
    later = service._started + SETTLE_SECONDS
    body = listed_run("one", "uid-one")
    service.view(body, now=later)
    service._events(("team-a", "one", "uid-one"))("site_withdrew", site="hospital-b", message="m")
    withdrawn = service.view(body, now=later).facts

    # Execute
    service.release("team-a", "one")
    after = service.view(body, now=later)

    # Assert
    assert withdrawn == {"hospital-b": SiteFacts("Withdrawn", "Withdrawn", "m")}
    assert after.serving and after.facts == {}


def ready_with_ip(name: str, ip: str) -> Object:
    listed = pod(name)
    listed["status"]["podIP"] = ip
    return listed


def test_serve_points_the_endpoint_at_the_ready_server_and_kdc(service: HubService) -> None:
    # Prepare
    body = listed_run("one", "uid-one")
    body["spec"]["protocol"] = {"name": "mpdp"}
    body["spec"].update(run_body("mpdp")["spec"])
    body["spec"]["sites"] = copy.deepcopy(SITES)
    service.view(body, now=service._started + SETTLE_SECONDS)
    ca = RunCa.generate("one")
    pods = [ready_with_ip("kdc", "fd00::7"), ready_with_ip("server", "10.1.2.3")]
    for listed in pods:
        listed["metadata"]["name"] = listed["metadata"]["name"].replace("demo", "one")

    # Execute
    service.serve(body, manifest_of(body), pods, ca)

    # Assert
    served = service.endpoint.run
    assert served is not None
    assert served.run.metadata.name == "one"
    assert served.ca.cert_pem == ca.cert_pem
    assert service.endpoint._backend_addresses == {
        "server": f"10.1.2.3:{SETTINGS.server_port}",
        "kdc": f"[fd00::7]:{SETTINGS.kdc_port}",
    }
    assert served.progress is not None
    assert served.progress() == {"phase": "Pending", "round": 0, "rounds": 2}


def test_serve_leaves_a_pod_that_is_not_ready_out_and_ignores_a_waiting_run(
    service: HubService,
) -> None:
    # Prepare
    later = service._started + SETTLE_SECONDS
    one, two = listed_run("one", "uid-one"), listed_run("two", "uid-two")
    service.view(one, now=later)
    service.view(two, now=later)
    starting = ready_with_ip("server", "10.1.2.3")
    starting["metadata"]["name"] = "one-server"
    starting["status"]["conditions"][0]["status"] = "False"

    # Execute
    service.serve(one, manifest_of(one), [starting], RunCa.generate("one"))
    served = service.endpoint.run
    service.serve(two, manifest_of(two), [], RunCa.generate("two"))

    # Assert
    assert served is not None and service.endpoint.run is served, "two waits: not served"
    assert service.endpoint._backend_addresses == {}


def test_a_sites_refusal_through_the_endpoint_fails_its_run(service: HubService) -> None:
    # Prepare: hospital-a enrolls; the endpoint serves run one
    later = service._started + SETTLE_SECONDS
    token = service.registry.add_site("hospital-a")
    cert = enroll(service.registry, token.token, "hospital-a")
    der = ssl.PEM_cert_to_DER_cert(cert.decode())
    body = listed_run("one", "uid-one", phase="Running", served=True)
    service.view(body, now=later)
    service.serve(body, manifest_of(body), [], RunCa.generate("one"))
    notified: list[tuple[str, str]] = []
    service.notify = lambda namespace, name: notified.append((namespace, name))

    # Execute
    answer = service.endpoint.answer(
        "POST",
        "/v1/run/refusal",
        {"run": "one", "reason": "EpsilonTooHigh", "message": "epsilon 7.9 exceeds 5"},
        der,
    )
    view = service.view(body, now=later)
    result = plan(replace(observe(body, fresh=True), hub=view))

    # Assert
    assert answer == (200, {})
    assert notified == [("team-a", "one")]
    assert view.facts["hospital-a"] == SiteFacts(
        "Refused", "EpsilonTooHigh", "epsilon 7.9 exceeds 5"
    )
    assert "hospital-a" in view.last_seen
    assert view.registry == {"hospital-a": "Enrolled"}
    assert (result.phase, result.status["reason"]) == ("Failed", "SiteRefused")
    assert result.status["message"] == (
        "Site hospital-a refused the run (EpsilonTooHigh): epsilon 7.9 exceeds 5"
    )
    (entry, _) = result.status["sites"]
    assert (entry["state"], entry["approval"], entry["reason"]) == (
        "Enrolled",
        "Refused",
        "EpsilonTooHigh",
    )


def test_client_counts_through_the_endpoint_reach_the_runs_status(service: HubService) -> None:
    # Prepare
    later = service._started + SETTLE_SECONDS
    token = service.registry.add_site("hospital-b")
    der = ssl.PEM_cert_to_DER_cert(enroll(service.registry, token.token, "hospital-b").decode())
    body = listed_run("one", "uid-one")
    service.view(body, now=later)
    service.serve(body, manifest_of(body), [], RunCa.generate("one"))

    # Execute
    approved = service.endpoint.answer("POST", "/v1/run/approval", {"run": "one"}, der)
    counted = service.endpoint.answer(
        "POST", "/v1/run/clients", {"run": "one", "clients": {"total": 1, "ready": 1}}, der
    )
    view = service.view(body, now=later)
    entries = site_statuses(spec_sites(), view, [], datetime.datetime.now(datetime.UTC), 1)

    # Assert
    assert (approved, counted) == ((200, {}), (200, {}))
    assert view.facts == {"hospital-b": SiteFacts("Approved", "", "", {"total": 1, "ready": 1})}
    b = entries[1]
    assert (b["state"], b["approval"], b["reported"]) == (
        "Enrolled",
        "Approved",
        {"total": 1, "ready": 1},
    )
    assert conditions_of(b)["Reachable"] == ("True", "Calling")


def test_a_run_waiting_for_the_endpoint_fails_past_its_active_deadline() -> None:
    # Prepare: a run at sites has waited 100 s for the endpoint, with a 60 s deadline.
    body = sites_body(status={"phase": "Pending", "activeSince": stamp(100), "activeSeconds": 0})
    body["spec"]["activeDeadlineSeconds"] = 60
    view = HubView(serving=False, holder="team-b/other", registry=REGISTRY)

    # Execute
    result = plan(at_hub(body, view, fresh=True))

    # Assert: it fails as a run whose pods wait would, and makes nothing.
    assert (result.phase, result.status["reason"]) == ("Failed", "DeadlineExceeded")
    assert "active 100 s, past spec.activeDeadlineSeconds 60" in result.status["message"]
    assert created(result) == []

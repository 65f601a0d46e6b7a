"""A site's operator without an API server or a hub: the Participation, the review of the
hub's run against it, the pure plan of one pass, and the objects it makes.

Every observation is built by hand: a Participation of site hospital-a (the run's clients 0
and 1 in examples/sites/consortium.yaml) or hospital-b (client 2), the hub's offer of the
consortium's manifest as text, the pods and other objects a pass lists, and the time.
"""

from __future__ import annotations

import base64
import copy
import datetime
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from fedcore.sites.participation import ParticipationSpec, ParticipationStatus, image_allowed
from fedcore.sites.policy import Approval, SitePolicy, review
from fedcore.spec import parse_manifest, protocol_facts, spec_digest
from fedcore.transport import RunCa, certificate_facts, new_key_and_request
from fedcore_operator.plan import CreateObjects, DeletePod, Note, PatchObject
from fedcore_operator.settings import OperatorSettings
from fedcore_operator.site import objects as site_objects
from fedcore_operator.site.objects import SiteContext
from fedcore_operator.site.plan import (
    DELETION_GIVE_UP_SECONDS,
    FINALIZER,
    MAX_CLIENT_RESTARTS,
    HubProblem,
    IssueClientCertificates,
    IssueClientKeys,
    Offer,
    ReportToHub,
    SiteObserved,
    SitePlan,
    SiteStep,
    Verdict,
    deletion,
    plan,
    review_offer,
)

Object = dict[str, Any]
REPO = Path(__file__).resolve().parents[2]
CONSORTIUM = REPO / "examples" / "sites" / "consortium.yaml"
"""dp-fedavg over 4 clients (epsilon 7.88 at 1e-5, target 8): hospital-a runs clients 0 and 1,
hospital-b client 2, hospital-c client 3."""

NOW = datetime.datetime(2025, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
NOW_TEXT = "2025-01-01T12:00:00Z"
SETTINGS = OperatorSettings()
HUB = "hub.example.org:7443"
HUB_CIDRS = ("203.0.113.10/32",)
RUN_CA = "-----BEGIN CERTIFICATE-----\nrun-ca\n-----END CERTIFICATE-----\n"
NAMESPACE = "hospital"
UID = "uid-participation"
RUN = "consortium"
NAME = "consortium-a"
"""The Participation of hospital-a (its pods are consortium-a-client-0 and -1)."""
SITE = "hospital-a"
FLOOR = {"protocols": ["dp-fedavg"], "maxEpsilon": 8}
"""A floor the consortium's run (planned epsilon 7.88 at delta 1e-5) meets."""
CLAIM_TEMPLATE = {"template": {"volumeClaim": {"claimName": "campus-{index}"}}}
OTHER_DIGEST = "sha256:" + "0" * 64
IMAGE_DIGEST = "registry.example/team/fedcore@sha256:" + "a" * 64
DELETE = object()

STATIC = (
    "ServiceAccount/consortium-a-client",
    "ConfigMap/consortium-a-manifest",
    "Secret/consortium-a-site-binding",
    "NetworkPolicy/consortium-a-clients",
)
"""What an approved Participation makes before any client: in this order, one step."""
PODS_A = ("Pod/consortium-a-client-0", "Pod/consortium-a-client-1")


# ------------------------------------------------------------------------------- manifests


def document(changes: dict[tuple[str, ...], Any] | None = None) -> Object:
    """The consortium's manifest as a mapping, with ``changes`` (a path: a value, or DELETE)."""
    found = yaml.safe_load(CONSORTIUM.read_text())
    for keys, value in (changes or {}).items():
        parent = found
        for key in keys[:-1]:
            parent = parent.setdefault(key, {})
        if value is DELETE:
            del parent[keys[-1]]
        else:
            parent[keys[-1]] = value
    return found


def text_of(found: Object) -> str:
    """A manifest as the hub sends it: YAML text."""
    return yaml.safe_dump(found, sort_keys=False)


def digest_of(text: str) -> str:
    return spec_digest(parse_manifest(yaml.safe_load(text)))


MANIFEST = text_of(document())
DIGEST = digest_of(MANIFEST)
LPPA_MANIFEST = text_of(
    document(
        {
            ("spec", "protocol"): {"name": "lppa", "lppa": {"topology": {"kind": "Ring"}}},
            ("spec", "privacy"): DELETE,
        }
    )
)
"""The consortium on lppa (decentralized): it claims no DP, so it keeps no budget."""
MPDP_MANIFEST = text_of(
    document(
        {
            ("spec", "protocol"): {"name": "mpdp"},
            ("spec", "model"): {"kind": "MLP", "hidden": [16], "bias": False, "dtype": "float64"},
            ("spec", "training"): {"loss": "MSE", "localEpochs": 1, "batchSize": 100000},
            ("spec", "data"): {"source": {"kind": "Digits"}, "partition": {"kind": "IID"}},
            ("spec", "evaluation"): {"where": "Server"},
        }
    )
)
"""The consortium on mpdp (a KDC) over a shared source: no site binds data."""


# ---------------------------------------------------------------------------- participations


def approval(digest: str = DIGEST, **changes: Any) -> Object:
    """hospital-a's Participation spec, as kubectl stores it (camelCase)."""
    spec: Object = {
        "run": RUN,
        "specDigest": digest,
        "clients": 2,
        "data": copy.deepcopy(CLAIM_TEMPLATE),
        "floor": dict(FLOOR),
    }
    spec.update(changes)
    return spec


def participation(spec: Object, status: Object | None = None, name: str = NAME) -> Object:
    body: Object = {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "Participation",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "uid": UID,
            "generation": 1,
            "finalizers": [FINALIZER],  # what the first pass adds
        },
        "spec": spec,
    }
    if status is not None:
        body["status"] = status
    return body


def offer(
    text: str = MANIFEST,
    *,
    name: str = RUN,
    clients: tuple[int, ...] = (0, 1),
    status: Object | None = None,
) -> Offer:
    """The hub's answer: the run it serves, running unless ``status`` says otherwise."""
    return Offer(
        name=name,
        manifest=text,
        digest=digest_of(text),
        run_ca=RUN_CA,
        clients=clients,
        status={"phase": "Running"} if status is None else status,
    )


def verdict_of(spec: Object, hub: Offer, site: str = SITE) -> Verdict:
    return review_offer(ParticipationSpec.model_validate(spec), site, hub, SETTINGS)


def context(
    spec: Object,
    text: str = MANIFEST,
    *,
    site: str = SITE,
    name: str = NAME,
    settings: OperatorSettings = SETTINGS,
) -> SiteContext:
    return SiteContext(
        name=name,
        namespace=NAMESPACE,
        uid=UID,
        spec=ParticipationSpec.model_validate(spec),
        site=site,
        hub=HUB,
        run=parse_manifest(yaml.safe_load(text)),
        manifest=text,
        settings=settings,
    )


# ------------------------------------------------------------------------------ observations


def listed_pod(
    index: int, phase: str = "Running", *, ready: bool | None = None, name: str = NAME
) -> Object:
    """Client ``index``'s pod as a pass lists it (Ready while Running unless ``ready``)."""
    ready = phase == "Running" if ready is None else ready
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": site_objects.client_pod_name(name, index),
            "namespace": NAMESPACE,
            "labels": site_objects.labels(name, index),
        },
        "status": {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def as_listed(obj: Object) -> Object:
    """``obj`` as the API server lists it: a Secret's stringData becomes base64 data."""
    listed = copy.deepcopy(obj)
    text = listed.pop("stringData", None)
    if text is not None:
        listed["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in text.items()}
    return listed


def owned(ctx: SiteContext, digest: str = DIGEST) -> dict[str, list[Object]]:
    """Every object an earlier pass made for ``ctx``: the static ones as built, and each
    client's TLS Secret (no certificate listed: none is due for renewal)."""
    listed: dict[str, list[Object]] = {}
    for obj in (
        site_objects.service_account(ctx),
        site_objects.manifest_config_map(ctx),
        site_objects.binding_secret(ctx, digest),
        site_objects.network_policy(ctx, list(HUB_CIDRS), digest),
    ):
        listed.setdefault(obj["kind"], []).append(as_listed(obj))
    listed["Secret"] += [
        {"kind": "Secret", "metadata": {"name": site_objects.client_tls_name(ctx.name, index)}}
        for index in ctx.clients
    ]
    return listed


def observe(
    spec: Object,
    *,
    hub: Offer | None = None,
    problem: HubProblem | None = None,
    site: str | None = SITE,
    name: str = NAME,
    status: Object | None = None,
    pods: tuple[Object, ...] = (),
    settled: bool = False,
    enrollment: str = "",
) -> SiteObserved:
    """One pass over the Participation ``name`` (hospital-a's unless told); ``settled``: the
    objects an earlier pass made exist already."""
    verdict = None
    if hub is not None and site is not None:
        try:
            verdict = verdict_of(spec, hub, site)
        except ValidationError:
            verdict = None  # as the reconciler: the plan reports the invalid spec
    return SiteObserved(
        body=participation(spec, status, name),
        now=NOW,
        settings=SETTINGS,
        hub=HUB,
        site=site,
        enrollment=enrollment,
        offer=hub,
        problem=problem,
        verdict=verdict,
        hub_addresses=HUB_CIDRS,
        pods=pods,
        owned=owned(context(spec, hub.manifest if hub else MANIFEST, site=site or SITE, name=name))
        if settled
        else {},
    )


def reported(observed: SiteObserved, status: Object | None = None) -> SiteObserved:
    """``observed`` whose Participation already says the hub was told of the approval."""
    found = {"reported": {"verdict": "Approved", "digest": DIGEST}, **(status or {})}
    return replace(observed, body=participation(observed.body["spec"], found))


def settled_running() -> SiteObserved:
    """hospital-a's approved Participation, told to the hub, its objects made, pods ready."""
    return reported(
        observe(approval(), hub=offer(), settled=True, pods=(listed_pod(0), listed_pod(1)))
    )


def with_certificates(observed: SiteObserved, certificates: dict[int, bytes]) -> SiteObserved:
    """``observed`` whose clients' TLS Secrets list these certificates (base64, as listed)."""
    by_name = {site_objects.client_tls_name(NAME, i): pem for i, pem in certificates.items()}
    listed = {kind: list(items) for kind, items in observed.owned.items()}
    listed["Secret"] = [
        {**secret, "data": {"tls.crt": base64.b64encode(by_name[name]).decode()}}
        if (name := secret["metadata"]["name"]) in by_name
        else secret
        for secret in listed["Secret"]
    ]
    return replace(observed, owned=listed)


def summary(steps: tuple[SiteStep, ...]) -> list[tuple[Any, ...]]:
    """Each step as a short tuple: what it touches, by kind/name or index."""
    found: list[tuple[Any, ...]] = []
    for step in steps:
        if isinstance(step, CreateObjects):
            names = tuple(f"{obj['kind']}/{obj['metadata']['name']}" for obj in step.objects)
            found.append(("create", names))
        elif isinstance(step, IssueClientCertificates):
            found.append(("certificates", step.indices, step.renew))
        elif isinstance(step, IssueClientKeys):
            found.append(("keys", step.indices))
        elif isinstance(step, ReportToHub):
            found.append(("report", step.verdict, step.reason))
        elif isinstance(step, DeletePod):
            found.append(("delete", step.name, step.grace))
        elif isinstance(step, PatchObject):
            found.append(("patch", step.kind, step.name))
        elif isinstance(step, Note):
            found.append(("note", step.warning))
        else:  # pragma: no cover - a new step kind must be summarized here
            raise AssertionError(f"unknown step {step!r}")
    return found


def status_of(decided: SitePlan) -> Object:
    assert decided.status_patch is not None
    return decided.status_patch["status"]


def conditions(decided: SitePlan) -> dict[str, tuple[str, str]]:
    """Each condition's status and reason."""
    return {c["type"]: (c["status"], c["reason"]) for c in status_of(decided)["conditions"]}


def env(pod: Object) -> dict[str, Any]:
    return {
        item["name"]: item.get("value", item.get("valueFrom"))
        for item in pod["spec"]["containers"][0]["env"]
    }


# ------------------------------------------------------------------------ ParticipationSpec


def test_participation_spec_reads_its_camel_case_fields() -> None:
    # Prepare
    stored = approval(
        images=[IMAGE_DIGEST, "registry.example/team/"],
        withdrawn=True,
        pods={
            "gpus": 1,
            "nodeSelector": {"pool": "fl"},
            "resources": {"limits": {"memory": "4Gi"}},
            "tolerations": [{"key": "fl", "operator": "Exists"}],
        },
    )
    # Execute
    spec = ParticipationSpec.model_validate(stored)
    # Assert
    assert spec.run == RUN
    assert spec.spec_digest == DIGEST
    assert spec.clients == 2
    assert spec.images == [IMAGE_DIGEST, "registry.example/team/"]
    assert spec.withdrawn is True
    assert spec.pods.gpus == 1
    assert spec.pods.node_selector == {"pool": "fl"}
    assert spec.pods.resources.limits == {"memory": "4Gi"}
    assert [t.key for t in spec.pods.tolerations] == ["fl"]
    assert spec.floor.max_epsilon == 8


def test_participation_spec_defaults_to_no_images_no_placement_not_withdrawn() -> None:
    spec = ParticipationSpec.model_validate(approval())
    assert spec.images == []
    assert spec.withdrawn is False
    assert spec.pods.gpus == 0
    assert spec.pods.node_selector == {}
    assert spec.pods.resources.requests == {} and spec.pods.resources.limits == {}


@pytest.mark.parametrize(
    "digest",
    ["sha256:abc", "sha256:" + "A" * 64, "md5:" + "0" * 64, "0" * 64, "sha256:" + "0" * 65],
)
def test_participation_spec_refuses_a_bad_digest_naming_spec_digest(digest: str) -> None:
    with pytest.raises(ValidationError) as caught:
        ParticipationSpec.model_validate(approval(digest))
    assert [error["loc"] for error in caught.value.errors()] == [("specDigest",)]


@pytest.mark.parametrize(
    "image",
    [
        "registry.example/team/fedcore:1.0",  # a tag: mutable
        "registry.example/team",  # a prefix must end in '/'
        "registry.example/team/fedcore@sha256:abc",  # a short digest
        "registry.example/team/fedcore@sha256:" + "A" * 64,  # upper-case hex
        "registry.example/@team/",  # a prefix holds no '@'
        "",
    ],
)
def test_participation_spec_refuses_an_image_neither_by_digest_nor_a_prefix(image: str) -> None:
    with pytest.raises(ValidationError) as caught:
        ParticipationSpec.model_validate(approval(images=[IMAGE_DIGEST, image]))
    errors = caught.value.errors()
    assert [error["loc"] for error in errors] == [("images",)]
    assert f"{image!r} is neither an image by digest" in errors[0]["msg"]


def test_approval_and_policy_are_what_the_policy_review_takes() -> None:
    # Prepare
    spec = ParticipationSpec.model_validate(approval(images=["registry.example/"]))
    run = parse_manifest(yaml.safe_load(MANIFEST))
    # Execute
    approved = spec.approval()
    policy = spec.policy(SITE)
    # Assert
    assert approved == Approval.model_validate(
        {
            "run": RUN,
            "specDigest": DIGEST,
            "clients": 2,
            "data": CLAIM_TEMPLATE,
            "floor": FLOOR,
        }
    )
    assert isinstance(policy, SitePolicy)
    assert policy.site == SITE
    assert policy.approvals == [approved]
    assert review(policy, run) == approved


# ----------------------------------------------------------------------------- image_allowed


OWN = SETTINGS.image


def test_image_allowed_takes_the_operators_own_image_even_with_an_empty_list() -> None:
    assert image_allowed(OWN, [], OWN) is True
    assert image_allowed(OWN, ["registry.example/"], OWN) is True


def test_image_allowed_takes_a_digest_entry_exactly() -> None:
    other = "registry.example/team/fedcore@sha256:" + "b" * 64
    assert image_allowed(IMAGE_DIGEST, [IMAGE_DIGEST], OWN) is True
    assert image_allowed(other, [IMAGE_DIGEST], OWN) is False
    assert image_allowed("registry.example/team/fedcore:1.0", [IMAGE_DIGEST], OWN) is False


def test_image_allowed_takes_a_prefix_by_prefix() -> None:
    allowed = ["registry.example/team/"]
    assert image_allowed("registry.example/team/fedcore:1.0", allowed, OWN) is True
    assert image_allowed(IMAGE_DIGEST, allowed, OWN) is True
    assert image_allowed("registry.example/team-b/fedcore:1.0", allowed, OWN) is False
    assert image_allowed("registry.example/fedcore:1.0", allowed, OWN) is False
    assert image_allowed("mirror.example/registry.example/team/x:1", allowed, OWN) is False


def test_image_allowed_refuses_a_tag_only_image_not_listed() -> None:
    assert image_allowed("ghcr.io/fedcore/fedcore:latest", [IMAGE_DIGEST], OWN) is False
    assert image_allowed("ghcr.io/fedcore/fedcore:latest", [], OWN) is False


# ------------------------------------------------------------------------------ review_offer


def test_review_approves_the_approved_run_with_its_digest() -> None:
    verdict = verdict_of(approval(), offer())
    assert (verdict.approved, verdict.reason) == (True, "Approved")
    assert verdict.digest == DIGEST
    assert verdict.run is not None and verdict.run.metadata.name == RUN
    assert verdict.message == f"Run 'consortium' ({DIGEST}) is approved."


def test_review_refuses_another_spec_digest_as_spec_changed() -> None:
    verdict = verdict_of(approval(OTHER_DIGEST), offer())
    assert (verdict.approved, verdict.reason) == (False, "SpecChanged")
    assert verdict.digest == DIGEST  # the digest of what the hub serves, not the approved one
    assert OTHER_DIGEST in verdict.message and f"now {DIGEST}" in verdict.message


def test_review_refuses_another_client_count() -> None:
    verdict = verdict_of(approval(clients=3), offer())
    assert (verdict.approved, verdict.reason) == (False, "ClientCount")
    assert "gives site 'hospital-a' 2 client(s)" in verdict.message


def test_review_refuses_a_site_the_run_does_not_list() -> None:
    verdict = verdict_of(approval(clients=1), offer(), site="hospital-z")
    assert (verdict.approved, verdict.reason) == (False, "ClientCount")
    assert "does not list site 'hospital-z'" in verdict.message


def test_review_refuses_a_run_whose_data_the_participation_does_not_bind() -> None:
    verdict = verdict_of(approval(data=None), offer())
    assert (verdict.approved, verdict.reason) == (False, "NoDataBinding")


@pytest.mark.parametrize(
    ("floor", "reason", "words"),
    [
        ({"protocols": ["dp-fedavg"], "maxEpsilon": 7}, "Epsilon", "plans epsilon 7.884"),
        ({"protocols": ["fedavg"]}, "Protocol", "accepts only fedavg"),
        ({"protocols": ["dp-fedavg"], "maxEpsilon": 8, "delta": 1e-6}, "Delta", "delta 1e-05"),
        ({"protocols": ["dp-fedavg"], "minNoiseMultiplier": 3}, "NoiseMultiplier", "2.5"),
    ],
)
def test_review_refuses_a_run_below_the_privacy_floor(
    floor: Object, reason: str, words: str
) -> None:
    verdict = verdict_of(approval(floor=floor), offer())
    assert (verdict.approved, verdict.reason) == (False, reason)
    assert words in verdict.message
    assert verdict.digest == DIGEST


def test_review_refuses_a_client_image_that_spec_images_does_not_allow() -> None:
    # Prepare: the hub names its own client image, by tag
    text = text_of(document({("spec", "roles"): {"clients": {"image": "evil.example/x:1"}}}))
    # Execute
    verdict = verdict_of(approval(digest_of(text), images=[IMAGE_DIGEST]), offer(text))
    # Assert
    assert (verdict.approved, verdict.reason) == (False, "ImageNotAllowed")
    assert "'evil.example/x:1'" in verdict.message and IMAGE_DIGEST in verdict.message
    assert verdict.digest == digest_of(text) != DIGEST


def test_review_approves_a_client_image_under_an_allowed_prefix() -> None:
    text = text_of(document({("spec", "roles"): {"clients": {"image": "registry.example/t/x:1"}}}))
    verdict = verdict_of(approval(digest_of(text), images=["registry.example/t/"]), offer(text))
    assert (verdict.approved, verdict.reason) == (True, "Approved")


def test_review_approves_the_operators_own_image_with_no_images_listed() -> None:
    text = text_of(document({("spec", "roles"): {"clients": {"image": SETTINGS.image}}}))
    verdict = verdict_of(approval(digest_of(text)), offer(text))
    assert (verdict.approved, verdict.reason) == (True, "Approved")


def test_review_refuses_another_run_by_name() -> None:
    verdict = verdict_of(approval(run="other-run"), offer())
    assert (verdict.approved, verdict.reason) == (False, "OtherRun")
    assert verdict.message == "The hub serves run 'consortium', not 'other-run'."
    assert verdict.digest == DIGEST


def test_review_approves_a_decentralized_protocol() -> None:
    # Its peer links go through the hub's relays, which the site's operator answers.
    assert protocol_facts("lppa").decentralized
    spec = approval(digest_of(LPPA_MANIFEST), floor={"protocols": ["lppa"]})
    verdict = verdict_of(spec, offer(LPPA_MANIFEST))
    assert (verdict.approved, verdict.reason) == (True, "Approved")


RELAY_FROM = (
    {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "fedcore-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}},
    },
)


def test_a_decentralized_client_pod_dials_every_peer_at_the_hub() -> None:
    spec = approval(digest_of(LPPA_MANIFEST), floor={"protocols": ["lppa"]})
    ctx = replace(context(spec, LPPA_MANIFEST), relay_from=RELAY_FROM)
    pod = site_objects.client_pod(ctx, 1, digest_of(LPPA_MANIFEST))
    env = {item["name"]: item.get("value") for item in pod["spec"]["containers"][0]["env"]}
    assert env["FEDCORE_PEER_TEMPLATE"] == HUB  # the hub relays by the peer's name
    assert env["FEDCORE_PEER_LISTEN"] == f"$(POD_IP):{SETTINGS.peer_port}"
    policy = site_objects.network_policy(ctx, ["192.0.2.7/32"], digest_of(LPPA_MANIFEST))
    assert policy["spec"]["ingress"] == [
        {"from": list(RELAY_FROM), "ports": [{"protocol": "TCP", "port": SETTINGS.peer_port}]}
    ]


def test_a_decentralized_sites_clients_get_their_own_checkpoint_keys_drawn_once() -> None:
    # Prepare: hospital-a approves the consortium on lppa, whose clients keep their own
    # checkpoints; a later pass lists what the first made, the key Secrets among them.
    spec = approval(digest_of(LPPA_MANIFEST), floor={"protocols": ["lppa"]})
    hub = offer(LPPA_MANIFEST)
    first = observe(spec, hub=hub)
    ctx = context(spec, LPPA_MANIFEST)
    keys = [site_objects.client_keys_secret(ctx, index, "ab" * 32) for index in (0, 1)]
    made = owned(ctx, digest_of(LPPA_MANIFEST))
    settled = replace(
        observe(spec, hub=hub, pods=(listed_pod(0), listed_pod(1))),
        body=participation(
            spec, {"reported": {"verdict": "Approved", "digest": digest_of(LPPA_MANIFEST)}}
        ),
        owned=made,
    )
    with_keys = replace(settled, owned={**made, "Secret": [*made["Secret"], *map(as_listed, keys)]})
    # Execute
    decided = plan(first)
    lost = plan(settled)  # the key Secrets went (deleted by hand): drawn again
    later = plan(with_keys)
    pod = site_objects.client_pod(ctx, 1, digest_of(LPPA_MANIFEST))
    # Assert: the keys are drawn here (the hub never sees them) before the pods, once; each
    # pod mounts its own, named after the Participation, owned by it.
    steps = summary(decided.steps)
    assert steps.index(("keys", (0, 1))) < steps.index(("create", PODS_A))
    assert summary(lost.steps) == [("keys", (0, 1))]
    assert summary(later.steps) == [] and later.phase == "Running"
    assert [secret["metadata"]["name"] for secret in keys] == [
        "consortium-a-client-0-keys",
        "consortium-a-client-1-keys",
    ]
    assert keys[0]["stringData"] == {"checkpoint.key": "ab" * 32}
    assert keys[0]["metadata"]["ownerReferences"] == [site_objects.owner_reference(ctx)]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["keys"]["secret"]["secretName"] == "consortium-a-client-1-keys"
    assert env(pod)["FEDCORE_CHECKPOINT_KEY_FILE"] == "/etc/fedcore/keys/checkpoint.key"
    # A centralized protocol's site clients keep no checkpoints, and get no key.
    central = plan(observe(approval(), hub=offer()))
    assert not [step for step in central.steps if isinstance(step, IssueClientKeys)]


def test_a_sites_decentralized_client_pod_names_none_of_the_hubs_store_credentials() -> None:
    # Prepare: the hub keeps its checkpoints in its bucket, with a Secret of its cluster.
    text = text_of(
        document(
            {
                ("spec", "protocol"): {"name": "lppa", "lppa": {"topology": {"kind": "Ring"}}},
                ("spec", "privacy"): DELETE,
                ("spec", "checkpoint"): {"s3": {"bucket": "hub", "credentialsSecret": "hub-s3"}},
            }
        )
    )
    spec = approval(digest_of(text), floor={"protocols": ["lppa"]})
    # Execute
    pod = site_objects.client_pod(context(spec, text), 0, digest_of(text))
    # Assert: the pod would not start without that Secret here, and the site's clients keep
    # their own checkpoints in the site's volume, never in another organization's bucket.
    assert "hub-s3" not in json.dumps(pod)
    assert "envFrom" not in pod["spec"]["containers"][0]


def test_a_centralized_client_pod_takes_no_relay() -> None:
    ctx = replace(context(approval()), relay_from=RELAY_FROM)
    policy = site_objects.network_policy(ctx, ["192.0.2.7/32"], DIGEST)
    assert policy["spec"]["ingress"] == []


def test_review_refuses_a_manifest_that_does_not_parse_as_invalid_run() -> None:
    hub = replace(offer(), manifest="apiVersion: fedcore.dev/v1alpha1\nkind: Nothing\n")
    verdict = verdict_of(approval(), hub)
    assert (verdict.approved, verdict.reason, verdict.digest) == (False, "InvalidRun", "")
    assert verdict.run is None


# ------------------------------------------------------------------------------------ plan


def test_plan_makes_nothing_before_the_site_is_enrolled() -> None:
    # Execute
    decided = plan(observe(approval(), site=None, enrollment="no join token"))
    # Assert
    assert decided.steps == ()
    assert decided.phase == "Pending"
    status = status_of(decided)
    assert (status["reason"], status["message"]) == ("NotEnrolled", "no join token")
    assert "site" not in status
    assert conditions(decided) == {"Enrolled": ("False", "NotEnrolled")}


@pytest.mark.parametrize(
    ("changes", "where"),
    [
        ({"specDigest": "sha256:abc"}, "spec.specDigest: "),
        ({"images": ["registry.example/x:1"]}, "spec.images: "),
        ({"clients": 0}, "spec.clients: "),
    ],
)
def test_plan_fails_an_invalid_spec_naming_the_field(changes: Object, where: str) -> None:
    decided = plan(observe({**approval(), **changes}, hub=offer()))
    assert decided.steps == ()
    assert decided.phase == "Failed"
    status = status_of(decided)
    assert status["reason"] == "InvalidSpec"
    assert status["message"].startswith(where)


def test_plan_reports_then_makes_an_approved_runs_objects_certificates_and_pods() -> None:
    # Execute
    decided = plan(observe(approval(), hub=offer()))
    # Assert: the hub is told first; then the static objects, certificates, pods in order
    assert summary(decided.steps) == [
        ("report", "Approved", ""),
        ("create", STATIC),
        ("certificates", (0, 1), False),
        ("create", PODS_A),
    ]
    issue = decided.steps[2]
    assert isinstance(issue, IssueClientCertificates)
    assert (issue.context.name, issue.context.site, issue.run_ca) == (NAME, SITE, RUN_CA)
    assert decided.phase == "Running"
    status = status_of(decided)
    assert (status["reason"], status["site"], status["digest"]) == ("Approved", SITE, DIGEST)
    assert status["clients"] == {"total": 2, "ready": 0, "succeeded": 0, "restarts": 0}
    assert status["reported"] == {"verdict": "Approved", "digest": DIGEST}
    assert status["run"] == {"phase": "Running"}
    assert status["lastSeen"] == NOW_TEXT
    assert status["observedGeneration"] == 1
    assert conditions(decided) == {
        "Enrolled": ("True", "Enrolled"),
        "HubReachable": ("True", "Answered"),
        "Approved": ("True", "Approved"),
        "ClientsReady": ("False", "NotAllReady"),
    }


def test_plan_asks_certificates_and_pods_for_the_sites_global_client_indices_only() -> None:
    # Prepare: hospital-b runs the run's client 2 (its own client 0)
    spec = approval(clients=1, data={"template": {"volumeClaim": {"claimName": "records"}}})
    observed = observe(spec, hub=offer(clients=(2,)), site="hospital-b", name="consortium-b")
    # Execute
    decided = plan(observed)
    # Assert
    assert summary(decided.steps) == [
        ("report", "Approved", ""),
        ("create", tuple(name.replace("consortium-a", "consortium-b") for name in STATIC)),
        ("certificates", (2,), False),
        ("create", ("Pod/consortium-b-client-2",)),
    ]
    status = status_of(decided)
    assert (status["site"], status["clients"]["total"]) == ("hospital-b", 1)


def test_plan_does_not_report_an_approval_the_hub_was_told_of() -> None:
    # Prepare
    first = observe(approval(), hub=offer())
    second = replace(first, body=participation(approval(), status_of(plan(first))))
    # Execute
    decided = plan(second)
    # Assert
    assert summary(decided.steps) == [
        ("create", STATIC),
        ("certificates", (0, 1), False),
        ("create", PODS_A),
    ]
    assert decided.status_patch is None


def test_plan_reports_again_for_a_new_digest() -> None:
    told = {"reported": {"verdict": "Approved", "digest": OTHER_DIGEST}}
    decided = plan(observe(approval(), hub=offer(), settled=True, status=told))
    assert summary(decided.steps) == [
        ("report", "Approved", ""),
        ("create", PODS_A),
    ]
    assert status_of(decided)["reported"] == {"verdict": "Approved", "digest": DIGEST}


def test_plan_makes_nothing_when_every_client_pod_is_ready() -> None:
    # Execute
    decided = plan(settled_running())
    # Assert
    assert decided.steps == ()
    assert decided.phase == "Running"
    assert status_of(decided)["clients"] == {"total": 2, "ready": 2, "succeeded": 0, "restarts": 0}
    assert conditions(decided)["ClientsReady"] == ("True", "AllReady")
    assert status_of(decided)["message"] == "2 of 2 client pods are ready."


def test_plan_makes_only_the_missing_client_pod() -> None:
    decided = plan(reported(observe(approval(), hub=offer(), settled=True, pods=(listed_pod(1),))))
    assert summary(decided.steps) == [("create", ("Pod/consortium-a-client-0",))]


def test_plan_neither_makes_again_nor_counts_a_terminating_pod() -> None:
    # Prepare
    leaving = listed_pod(0)
    leaving["metadata"]["deletionTimestamp"] = NOW_TEXT
    # Execute
    decided = plan(
        reported(observe(approval(), hub=offer(), settled=True, pods=(leaving, listed_pod(1))))
    )
    # Assert
    assert decided.steps == ()
    assert status_of(decided)["clients"]["ready"] == 1


def test_plan_patches_a_network_policy_that_drifted() -> None:
    # Prepare: the hub's addresses changed since the policy was made
    moved = ["198.51.100.7/32"]
    observed = replace(settled_running(), hub_addresses=tuple(moved))
    # Execute
    decided = plan(observed)
    # Assert
    assert summary(decided.steps) == [("patch", "NetworkPolicy", "consortium-a-clients")]
    patch = decided.steps[0]
    assert isinstance(patch, PatchObject)
    wanted = site_objects.network_policy(context(approval()), moved, DIGEST)
    assert patch.patch == {"spec": wanted["spec"]}
    assert patch.patch["spec"]["egress"][1]["to"] == [{"ipBlock": {"cidr": "198.51.100.7/32"}}]


def test_plan_makes_a_failed_client_pod_again_and_counts_the_restart() -> None:
    # Prepare
    pods = (listed_pod(0, "Failed"), listed_pod(1))
    observed = reported(
        observe(approval(), hub=offer(), settled=True, pods=pods),
        {"clients": {"total": 2, "ready": 1, "succeeded": 0, "restarts": 1}},
    )
    # Execute
    decided = plan(observed)
    # Assert
    assert summary(decided.steps) == [("delete", "consortium-a-client-0", 0), ("note", True)]
    note = decided.steps[1]
    assert isinstance(note, Note)
    assert (
        note.text
        == f"Client pod consortium-a-client-0 failed; made again (2 of {MAX_CLIENT_RESTARTS})."
    )
    assert decided.phase == "Running"
    assert status_of(decided)["clients"] == {"total": 2, "ready": 1, "succeeded": 0, "restarts": 2}


def test_plan_fails_after_the_last_restart_and_stops_the_other_pods() -> None:
    # Prepare
    pods = (listed_pod(0, "Failed"), listed_pod(1))
    observed = reported(
        observe(approval(), hub=offer(), settled=True, pods=pods),
        {"clients": {"restarts": MAX_CLIENT_RESTARTS}},
    )
    # Execute
    decided = plan(observed)
    # Assert
    assert summary(decided.steps) == [("delete", "consortium-a-client-1", 30)]
    assert decided.phase == "Failed"
    status = status_of(decided)
    assert status["reason"] == "BackoffLimitExceeded"
    assert status["message"] == "Client pods consortium-a-client-0 failed, with 3 restarts spent."
    assert status["clients"]["restarts"] == MAX_CLIENT_RESTARTS


def test_plan_keeps_a_participation_that_gave_up_failed_and_makes_no_pod_again() -> None:
    # Prepare: the pass after the one that gave up; the other pod is gone
    observed = reported(
        observe(approval(), hub=offer(), settled=True, pods=(listed_pod(0, "Failed"),)),
        {
            "phase": "Failed",
            "reason": "BackoffLimitExceeded",
            "message": "given up",
            "digest": DIGEST,
            "clients": {"restarts": MAX_CLIENT_RESTARTS},
        },
    )
    # Execute
    decided = plan(observed)
    # Assert
    assert summary(decided.steps) == []
    assert decided.phase == "Failed"
    status = status_of(decided) if decided.status_patch else observed.body["status"]
    assert (status["reason"], status["message"]) == ("BackoffLimitExceeded", "given up")


def test_plan_rewrites_the_binding_when_the_approval_changes() -> None:
    # Prepare: objects made for the approved spec; the site now accepts another floor
    observed = reported(observe(approval(), hub=offer(), settled=True))
    listed = {kind: list(items) for kind, items in observed.owned.items()}
    floor = {"protocols": ["dp-fedavg", "fedavg"]}
    changed = replace(
        observed,
        body=participation(
            approval(floor=floor), {"reported": {"verdict": "Approved", "digest": DIGEST}}
        ),
        owned=listed,
    )
    # Execute
    decided = plan(changed)
    # Assert
    patches = [step for step in decided.steps if isinstance(step, PatchObject)]
    assert [(p.kind, p.name) for p in patches] == [("Secret", "consortium-a-site-binding")]
    document = json.loads(patches[0].patch["stringData"]["site-binding.json"])
    assert document["approval"]["floor"]["protocols"] == ["dp-fedavg", "fedavg"]


def test_plan_makes_again_a_certificate_of_another_runs_ca() -> None:
    # Prepare: client 1's Secret holds another CA (an earlier run of the same name)
    observed = settled_running()
    listed = {kind: list(items) for kind, items in observed.owned.items()}
    other = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nother\n").decode()
    listed["Secret"] = [
        {**secret, "data": {"ca.crt": other}}
        if secret["metadata"]["name"] == "consortium-a-client-1-tls"
        else secret
        for secret in listed["Secret"]
    ]
    # Execute
    decided = plan(replace(observed, owned=listed))
    # Assert
    assert summary(decided.steps) == [("certificates", (1,), True)]


def test_plan_stops_the_pods_and_tells_the_hub_of_a_refusal() -> None:
    # Prepare: the hub's spec changed since hospital-a approved it
    pods = (listed_pod(0), listed_pod(1, "Succeeded", ready=False))
    observed = observe(approval(OTHER_DIGEST), hub=offer(), settled=True, pods=pods)
    # Execute
    decided = plan(observed)
    # Assert
    assert summary(decided.steps) == [
        ("delete", "consortium-a-client-0", 30),
        ("report", "Refused", "SpecChanged"),
    ]
    assert decided.phase == "Refused"
    status = status_of(decided)
    assert status["reason"] == "SpecChanged"
    assert status["reported"] == {"verdict": "Refused", "digest": DIGEST, "reason": "SpecChanged"}
    assert status["clients"] == {"total": 2, "ready": 1, "succeeded": 1, "restarts": 0}
    assert conditions(decided)["Approved"] == ("False", "SpecChanged")


def test_plan_tells_the_hub_of_a_refusal_once() -> None:
    told = {"reported": {"verdict": "Refused", "digest": DIGEST, "reason": "SpecChanged"}}
    observed = observe(approval(OTHER_DIGEST), hub=offer(), status=told)
    decided = plan(observed)
    assert decided.steps == ()
    assert decided.phase == "Refused"


def test_plan_withdraws_stopping_the_pods_and_telling_the_hub() -> None:
    # Prepare
    pods = (listed_pod(0), listed_pod(1))
    observed = reported(observe(approval(withdrawn=True), hub=offer(), settled=True, pods=pods))
    # Execute
    decided = plan(observed)
    # Assert
    assert summary(decided.steps) == [
        ("delete", "consortium-a-client-0", 30),
        ("delete", "consortium-a-client-1", 30),
        ("report", "Withdrawn", ""),
    ]
    assert decided.phase == "Withdrawn"
    status = status_of(decided)
    assert status["reason"] == "Withdrawn"
    assert status["reported"] == {"verdict": "Withdrawn", "digest": DIGEST}
    assert conditions(decided)["Approved"] == ("False", "Withdrawn")


def test_plan_keeps_the_pods_running_while_the_hub_is_unreachable() -> None:
    # Prepare
    problem = HubProblem("Unreachable", "The hub did not answer: timed out")
    observed = reported(
        observe(approval(), problem=problem, settled=True, pods=(listed_pod(0), listed_pod(1))),
        {"phase": "Running", "lastSeen": "2025-01-01T11:00:00Z"},
    )
    # Execute
    decided = plan(observed)
    # Assert
    assert decided.steps == ()
    assert decided.phase == "Unreachable"
    status = status_of(decided)
    assert (status["reason"], status["message"]) == ("Unreachable", problem.message)
    assert status["lastSeen"] == "2025-01-01T11:00:00Z"
    assert conditions(decided)["HubReachable"] == ("False", "Unreachable")


def test_plan_waits_pending_when_the_hub_is_unreachable_and_no_pod_runs() -> None:
    decided = plan(observe(approval(), problem=HubProblem("Unreachable", "no answer")))
    assert decided.steps == ()
    assert decided.phase == "Pending"
    assert status_of(decided)["reason"] == "Unreachable"


def test_plan_stops_the_pods_of_a_revoked_site() -> None:
    observed = observe(approval(), problem=HubProblem("Revoked", "revoked"), pods=(listed_pod(0),))
    decided = plan(observed)
    assert summary(decided.steps) == [("delete", "consortium-a-client-0", 30)]
    assert (decided.phase, status_of(decided)["reason"]) == ("Failed", "Revoked")


def test_plan_waits_pending_while_the_hub_serves_another_run() -> None:
    other = offer(text_of(document({("metadata", "name"): "another"})), name="another")
    decided = plan(observe(approval(), hub=other))
    assert decided.steps == ()
    assert decided.phase == "Pending"
    status = status_of(decided)
    assert status["reason"] == "RunNotServed"
    assert status["message"] == ("The hub serves run 'another', not 'consortium'; waiting for it.")


def test_plan_follows_the_hubs_succeeded_run_and_makes_no_pod() -> None:
    # Execute
    decided = plan(observe(approval(), hub=offer(status={"phase": "Succeeded", "round": 15})))
    # Assert
    assert summary(decided.steps) == [("report", "Approved", "")]  # nothing made for a run done
    assert decided.phase == "Succeeded"
    status = status_of(decided)
    assert status["reason"] == "RunSucceeded"
    assert status["run"] == {"phase": "Succeeded", "round": 15}


def test_plan_follows_the_hubs_failed_run_with_its_reason() -> None:
    hub = offer(status={"phase": "Failed", "reason": "QuorumLost"})
    decided = plan(
        reported(observe(approval(), hub=hub, settled=True, pods=(listed_pod(0, "Failed"),)))
    )
    assert decided.steps == ()
    assert decided.phase == "Failed"
    assert status_of(decided)["reason"] == "QuorumLost"


def test_plan_patches_no_status_when_nothing_changed() -> None:
    # Prepare
    first = observe(approval(), hub=offer(), settled=True, pods=(listed_pod(0), listed_pod(1)))
    written = status_of(plan(first))
    # Execute
    again = plan(replace(first, body=participation(approval(), written)))
    # Assert
    assert again.steps == ()
    assert again.status_patch is None
    assert again.phase == "Running"


def test_plan_renews_only_the_client_certificates_past_half_their_life() -> None:
    # Prepare: client 0's certificate lives two hours, client 1's one; 40 minutes have passed
    ca = RunCa.generate(RUN)
    certificates = {}
    for index, hours in ((0, 2), (1, 1)):
        _, request = new_key_and_request(f"client-{index}")
        certificates[index] = ca.sign_request(
            request, common_name=f"client-{index}", valid_for=datetime.timedelta(hours=hours)
        )
    start = certificate_facts(certificates[1])[2]
    observed = with_certificates(settled_running(), certificates)
    # Execute
    decided = plan(replace(observed, now=start + datetime.timedelta(minutes=40)))
    # Assert
    assert summary(decided.steps) == [("certificates", (1,), True)]


def test_plan_renews_a_client_certificate_that_does_not_parse() -> None:
    observed = with_certificates(settled_running(), {0: b"not a certificate"})
    decided = plan(observed)
    assert summary(decided.steps) == [("certificates", (0,), True)]


@pytest.mark.parametrize(
    "situation",
    ["approved", "not-enrolled", "refused", "unreachable", "invalid", "withdrawn", "other-run"],
)
def test_plan_writes_a_status_the_participation_schema_takes(situation: str) -> None:
    # Prepare
    observed = {
        "approved": lambda: observe(
            approval(), hub=offer(status={"phase": "Running", "round": 3, "epsilon": 2})
        ),
        "not-enrolled": lambda: observe(approval(), site=None, enrollment="no token"),
        "refused": lambda: observe(approval(OTHER_DIGEST), hub=offer()),
        "unreachable": lambda: observe(approval(), problem=HubProblem("Unreachable", "no answer")),
        "invalid": lambda: observe({**approval(), "clients": 0}, hub=offer()),
        "withdrawn": lambda: observe(approval(withdrawn=True), hub=offer()),
        "other-run": lambda: observe(approval(run="other-run"), hub=offer()),
    }[situation]()
    # Execute
    decided = plan(observed)
    # Assert
    status = ParticipationStatus.model_validate(status_of(decided))
    assert status.phase == decided.phase
    assert status.observed_generation == 1


# ---------------------------------------------------------------------------------- objects


HUB_PLACEMENT = {
    "image": SETTINGS.image,
    "nodeSelector": {"hub-pool": "gpu"},
    "gpus": 8,
    "resources": {"requests": {"cpu": "64"}},
    "podTemplate": {
        "metadata": {"labels": {"hub-label": "yes"}},
        "spec": {"priorityClassName": "hub-high"},
    },
}
"""What the hub's manifest says of the clients' pods: the site ignores all but the image."""
SITE_PODS = {
    "resources": {"requests": {"cpu": "2"}, "limits": {"memory": "4Gi"}},
    "gpus": 1,
    "nodeSelector": {"site-pool": "fl"},
    "tolerations": [{"key": "fl", "operator": "Exists", "effect": "NoSchedule"}],
}


def test_client_pod_is_labelled_and_owned_by_the_participation_not_a_run() -> None:
    pod = site_objects.client_pod(context(approval()), 1, DIGEST)
    meta = pod["metadata"]
    assert (meta["name"], meta["namespace"]) == ("consortium-a-client-1", NAMESPACE)
    assert meta["labels"] == {
        "app.kubernetes.io/managed-by": "fedcore-operator",
        "fedcore.dev/participation": NAME,
        "fedcore.dev/role": "client",
        "fedcore.dev/client-index": "1",
    }
    assert "fedcore.dev/run" not in meta["labels"]
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "fedcore.dev/v1alpha1",
            "kind": "Participation",
            "name": NAME,
            "uid": UID,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def test_client_pod_dials_the_hub_and_reads_the_mounted_binding() -> None:
    # Execute
    pod = site_objects.client_pod(context(approval()), 1, DIGEST)
    # Assert
    found = env(pod)
    assert found["FEDCORE_SERVER"] == HUB
    assert "FEDCORE_KDC" not in found  # dp-fedavg needs no KDC
    assert found["FEDCORE_CLIENT_INDEX"] == "1"
    assert found["FEDCORE_SITE_BINDING"] == "/etc/fedcore/site/site-binding.json"
    spec = pod["spec"]
    container = spec["containers"][0]
    assert {"name": "site", "mountPath": "/etc/fedcore/site", "readOnly": True} in container[
        "volumeMounts"
    ]
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    assert volumes["site"] == {
        "name": "site",
        "secret": {"secretName": "consortium-a-site-binding", "defaultMode": 0o440},
    }
    assert volumes["tls"]["secret"]["secretName"] == "consortium-a-client-1-tls"
    assert volumes["manifest"]["configMap"]["name"] == "consortium-a-manifest"
    assert spec["serviceAccountName"] == "consortium-a-client"
    assert spec["automountServiceAccountToken"] is False
    assert "subdomain" not in spec


def test_client_pod_dials_the_hub_for_the_kdc_too() -> None:
    # Prepare
    assert protocol_facts("mpdp").needs_kdc
    ctx = context(approval(digest_of(MPDP_MANIFEST), data=None), MPDP_MANIFEST)
    # Execute
    found = env(site_objects.client_pod(ctx, 0, digest_of(MPDP_MANIFEST)))
    # Assert
    assert (found["FEDCORE_SERVER"], found["FEDCORE_KDC"]) == (HUB, HUB)


def test_client_pod_container_is_locked() -> None:
    pod = site_objects.client_pod(context(approval()), 0, DIGEST)
    security = pod["spec"]["containers"][0]["securityContext"]
    assert security == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["restartPolicy"] == "Never"


def test_client_pod_takes_the_sites_placement_and_ignores_the_hubs() -> None:
    # Prepare
    text = text_of(document({("spec", "roles"): {"clients": HUB_PLACEMENT}}))
    ctx = context(approval(digest_of(text), pods=SITE_PODS), text)
    # Execute
    pod = site_objects.client_pod(ctx, 0, digest_of(text))
    # Assert
    spec = pod["spec"]
    container = spec["containers"][0]
    assert container["resources"] == {
        "requests": {"cpu": "2"},
        "limits": {"memory": "4Gi", "nvidia.com/gpu": "1"},
    }
    assert spec["nodeSelector"] == {"site-pool": "fl"}
    assert spec["tolerations"] == [{"key": "fl", "operator": "Exists", "effect": "NoSchedule"}]
    assert "priorityClassName" not in spec
    assert "hub-label" not in pod["metadata"]["labels"]
    assert container["image"] == SETTINGS.image


def test_client_pod_runs_the_hubs_image_or_else_the_operators() -> None:
    text = text_of(document({("spec", "roles"): {"clients": {"image": "registry.example/t/x:1"}}}))
    named = site_objects.client_pod(context(approval(digest_of(text)), text), 0, digest_of(text))
    unnamed = site_objects.client_pod(context(approval()), 0, DIGEST)
    assert named["spec"]["containers"][0]["image"] == "registry.example/t/x:1"
    assert unnamed["spec"]["containers"][0]["image"] == SETTINGS.image


def test_client_pod_mounts_only_its_own_claim_read_only() -> None:
    # Execute
    pods = [site_objects.client_pod(context(approval()), index, DIGEST) for index in (0, 1)]
    # Assert
    for index, pod in enumerate(pods):
        claims = [v for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v]
        assert claims == [
            {
                "name": "data",
                "persistentVolumeClaim": {"claimName": f"campus-{index}", "readOnly": True},
            }
        ]
        mounts = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "data"]
        assert mounts == [{"name": "data", "mountPath": "/var/lib/fedcore-data", "readOnly": True}]
        assert env(pod)["FEDCORE_DATA_DIR"] == "/var/lib/fedcore-data"


def test_client_pod_takes_its_claim_by_its_index_at_the_site() -> None:
    # Prepare: hospital-b's one client is the run's client 2, the site's client 0
    spec = approval(clients=1, data={"template": {"volumeClaim": {"claimName": "b-{index}"}}})
    ctx = context(spec, site="hospital-b", name="consortium-b")
    # Execute
    pod = site_objects.client_pod(ctx, 2, DIGEST)
    # Assert
    assert pod["metadata"]["name"] == "consortium-b-client-2"
    assert env(pod)["FEDCORE_CLIENT_INDEX"] == "2"
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims == ["b-0"]


def test_binding_secret_holds_the_sites_data_and_the_digest() -> None:
    # Execute
    secret = site_objects.binding_secret(context(approval()), DIGEST)
    # Assert
    assert secret["metadata"]["name"] == "consortium-a-site-binding"
    assert secret["type"] == "Opaque"
    assert secret["metadata"]["labels"]["fedcore.dev/participation"] == NAME
    assert list(secret["stringData"]) == ["site-binding.json"]
    assert json.loads(secret["stringData"]["site-binding.json"]) == {
        "site": SITE,
        "digest": DIGEST,
        "approval": {
            "run": RUN,
            "specDigest": DIGEST,
            "clients": 2,
            "data": {"template": {"volumeClaim": {"claimName": "campus-{index}"}}},
            "floor": {
                "protocols": ["dp-fedavg"],
                "maxEpsilon": 8.0,
                "delta": 1e-05,
                "secureAggregation": False,
            },
        },
    }


def test_manifest_config_map_holds_the_hubs_text_unchanged() -> None:
    config_map = site_objects.manifest_config_map(context(approval()))
    assert config_map["metadata"]["name"] == "consortium-a-manifest"
    assert config_map["data"] == {"run.yaml": MANIFEST}


def test_service_account_mounts_no_token() -> None:
    account = site_objects.service_account(context(approval()))
    assert account["metadata"]["name"] == "consortium-a-client"
    assert account["automountServiceAccountToken"] is False


def test_client_tls_secret_holds_the_key_made_here_and_the_hubs_certificate() -> None:
    secret = site_objects.client_tls_secret(
        context(approval()), 1, key_pem=b"KEY", cert_pem=b"CERT", run_ca_pem=RUN_CA.encode()
    )
    assert secret["metadata"]["name"] == "consortium-a-client-1-tls"
    assert secret["type"] == "kubernetes.io/tls"
    assert secret["metadata"]["labels"]["fedcore.dev/client-index"] == "1"
    assert secret["stringData"] == {"ca.crt": RUN_CA, "tls.crt": "CERT", "tls.key": "KEY"}


DNS_RULE = {
    "to": [copy.deepcopy(peer) for peer in SETTINGS.dns_to],
    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
}
HUB_RULE = {
    "to": [{"ipBlock": {"cidr": "203.0.113.10/32"}}],
    "ports": [{"protocol": "TCP", "port": 7443}],
}


def test_network_policy_lets_the_clients_reach_only_dns_and_the_hub() -> None:
    # Execute
    policy = site_objects.network_policy(context(approval()), list(HUB_CIDRS), DIGEST)
    # Assert
    assert policy["metadata"]["name"] == "consortium-a-clients"
    assert policy["spec"] == {
        "podSelector": {"matchLabels": {"fedcore.dev/participation": NAME}},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [],
        "egress": [DNS_RULE, HUB_RULE],
    }


def test_network_policy_adds_the_s3_endpoint_of_the_sites_data() -> None:
    # Prepare
    data = {
        "template": {
            "s3": {
                "bucket": "campus-{index}",
                "endpoint": "http://10.1.2.3:9000",
                "credentialsSecret": "s3-{index}",
            }
        }
    }
    # Execute
    policy = site_objects.network_policy(context(approval(data=data)), list(HUB_CIDRS), DIGEST)
    # Assert
    assert policy["spec"]["egress"] == [
        DNS_RULE,
        HUB_RULE,
        {
            "to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}],
            "ports": [{"protocol": "TCP", "port": 9000}],
        },
    ]


def test_network_policy_lets_only_the_chart_scraper_in() -> None:
    # Prepare
    scraper = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    settings = OperatorSettings(metrics_from=(scraper,))
    # Execute
    policy = site_objects.network_policy(
        context(approval(), settings=settings), list(HUB_CIDRS), DIGEST
    )
    # Assert
    assert policy["spec"]["ingress"] == [
        {"from": [scraper], "ports": [{"protocol": "TCP", "port": 9090}]}
    ]


# ------------------------------------------------------------------------------ deletion


def test_the_first_pass_holds_the_participation_with_the_finalizer_first() -> None:
    observed = observe(approval(), site=None)
    body = copy.deepcopy(observed.body)
    body["metadata"]["finalizers"] = ["other.example/keep"]
    decided = plan(replace(observed, body=body))
    assert summary(decided.steps) == [("patch", "Participation", NAME)]
    step = decided.steps[0]
    assert isinstance(step, PatchObject)
    assert step.patch == {"metadata": {"finalizers": ["other.example/keep", FINALIZER]}}


def deleted(status: Object | None, seconds_ago: float = 5) -> Object:
    body = participation(approval(), status)
    when = NOW - datetime.timedelta(seconds=seconds_ago)
    body["metadata"]["deletionTimestamp"] = when.strftime("%Y-%m-%dT%H:%M:%SZ")
    body["metadata"]["finalizers"] = [FINALIZER, "other.example/keep"]
    return body


RELEASE = ("patch", "Participation", NAME)
APPROVED = {"reported": {"verdict": "Approved", "digest": DIGEST}}


def test_a_deleted_approved_participation_tells_the_hub_then_lets_go() -> None:
    steps = deletion(deleted(APPROVED), NOW, offer(), None)
    assert summary(steps) == [("report", "Withdrawn", ""), RELEASE]
    release = steps[1]
    assert isinstance(release, PatchObject)
    assert release.patch == {"metadata": {"finalizers": ["other.example/keep"]}}


def test_a_deleted_participation_never_approved_lets_go_at_once() -> None:
    assert summary(deletion(deleted(None), NOW, offer(), None)) == [RELEASE]


def test_a_deleted_participation_lets_go_when_the_hub_no_longer_serves_the_run() -> None:
    assert summary(deletion(deleted(APPROVED), NOW, offer(name="other"), None)) == [RELEASE]
    gone = HubProblem("NoRun", "This hub serves no run now.")
    assert summary(deletion(deleted(APPROVED), NOW, None, gone)) == [RELEASE]


def test_a_deleted_participation_waits_for_an_unreachable_hub_then_goes_untold() -> None:
    down = HubProblem("Unreachable", "refused")
    assert deletion(deleted(APPROVED, seconds_ago=5), NOW, None, down) == ()
    late = deletion(deleted(APPROVED, seconds_ago=DELETION_GIVE_UP_SECONDS), NOW, None, down)
    assert summary(late) == [("note", True), RELEASE]


def test_a_participation_without_the_finalizer_needs_no_deletion_step() -> None:
    body = deleted(APPROVED)
    body["metadata"]["finalizers"] = ["other.example/keep"]
    assert deletion(body, NOW, offer(), None) == ()

"""A site's policy: loading, the spec digest, review, the privacy floor and the round guard.

Epsilon is the real ledger's; the expected values are computed here with dp-accounting
directly (RDP, one Gaussian mechanism of multiplier z per round, every client every round).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import dp_accounting
import pytest
import yaml
from dp_accounting import rdp

from fedcore.errors import FedcoreError, SpecError
from fedcore.sites.policy import (
    Approval,
    PolicyError,
    PrivacyFloor,
    RoundGuard,
    SiteData,
    SitePolicy,
    SiteRefused,
    floor_check,
    load_policy,
    planned_epsilon,
    review,
    spec_digest,
)
from fedcore.spec import PROTOCOL_FACTS, FederatedRun, load_manifest, parse_manifest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "hospitals-tabular.yaml"
"""dp-fedavg, noise multiplier 2.5, 15 rounds, 4 clients: epsilon 7.88 at 1e-5, target 8."""

SECRET_PATH = "/secret/hospital-records/{index}"
"""The site's data path: no refusal may show it (the hub reads refusals)."""

DELETE = object()


def _document(changes: dict[tuple[str, ...], Any] | None = None) -> dict[str, Any]:
    """The example, spread over sites north (3 clients) and south (1), data left to them."""
    document = yaml.safe_load(EXAMPLE.read_text())
    document["spec"]["sites"] = [{"name": "north", "clients": 3}, {"name": "south", "clients": 1}]
    del document["spec"]["data"]["clientData"]["template"]
    for keys, value in (changes or {}).items():
        parent = document
        for key in keys[:-1]:
            parent = parent.setdefault(key, {})
        if value is DELETE:
            del parent[keys[-1]]
        else:
            parent[keys[-1]] = value
    return document


def _run(changes: dict[tuple[str, ...], Any] | None = None) -> FederatedRun:
    return parse_manifest(_document(changes))


def _approval(approved: FederatedRun, /, **changes: Any) -> dict[str, Any]:
    approval: dict[str, Any] = {
        "run": approved.metadata.name,
        "specDigest": spec_digest(approved),
        "clients": 3,
        "data": {"template": {"path": SECRET_PATH}},
        "floor": {"protocols": ["dp-fedavg"], "maxEpsilon": 8},
    }
    approval.update(changes)
    return approval


def _policy(*approvals: dict[str, Any], site: str = "north") -> SitePolicy:
    return SitePolicy.model_validate(
        {
            "apiVersion": "fedcore.dev/v1alpha1",
            "kind": "SitePolicy",
            "site": site,
            "approvals": list(approvals),
        }
    )


def _floor(**fields: Any) -> PrivacyFloor:
    return PrivacyFloor.model_validate({"protocols": ["dp-fedavg"], **fields})


def _rdp_epsilon(z: float, rounds: int, delta: float = 1e-5) -> float:
    """Epsilon of ``rounds`` Gaussian mechanisms of multiplier ``z``, by dp-accounting."""
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), rounds))
    return float(accountant.get_epsilon(delta))


def _refusal(call: Any, *args: Any, **kwargs: Any) -> SiteRefused:
    with pytest.raises(SiteRefused) as caught:
        call(*args, **kwargs)
    refused = caught.value
    assert "/secret/" not in str(refused)
    return refused


# ------------------------------------------------------------------------------ spec digest


def test_the_digest_is_sha256_of_the_canonical_spec() -> None:
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", spec_digest(_run()))


def test_the_digest_ignores_key_order_formatting_spelled_out_defaults_and_metadata() -> None:
    plain = spec_digest(_run())
    document = _document()
    reordered = {key: document[key] for key in reversed(document)}
    reordered["spec"] = {key: document["spec"][key] for key in sorted(document["spec"])}
    reordered["spec"]["privacy"]["targetEpsilon"] = 8.0  # was 8
    reordered["spec"]["clients"]["sampling"] = "Seeded"  # the default, spelled out
    reordered["spec"]["clients"]["quorum"] = "100%"  # the default, spelled out
    reordered["metadata"].update(namespace="hospitals", labels={"team": "oncology"})
    reordered["status"] = {"phase": "Running"}
    text = yaml.safe_dump(reordered, sort_keys=False, default_flow_style=True, width=60)
    assert text != yaml.safe_dump(document)
    assert spec_digest(load_manifest("reordered.yaml", text=text)) == plain
    assert spec_digest(load_manifest(EXAMPLE.name, text=yaml.safe_dump(document))) == plain


@pytest.mark.parametrize(
    "changes",
    [
        {("spec", "rounds"): 16},
        {("spec", "protocol", "dpFedavg", "noiseMultiplier"): 2.6},
        {("spec", "privacy", "targetEpsilon"): 7.5},
        {("spec", "clients", "sampling"): "Secret"},
        {("spec", "training", "optimizer", "learningRate"): 0.25},
        {("spec", "seed"): 1},
        {("spec", "sites"): [{"name": "north", "clients": 2}, {"name": "south", "clients": 2}]},
        {("metadata", "name"): "hospitals-tabular-2"},
    ],
    ids=lambda changes: ".".join(next(iter(changes))),
)
def test_any_change_of_a_value_changes_the_digest(changes: dict[tuple[str, ...], Any]) -> None:
    assert spec_digest(_run(changes)) != spec_digest(_run())


# ----------------------------------------------------------------------------------- review


def test_review_returns_the_approval_of_a_run_within_its_floor() -> None:
    run = _run()
    policy = _policy(_approval(run, run="another-run"), _approval(run))
    approval = review(policy, run)
    assert approval is policy.approvals[1]
    assert approval.data is not None
    assert approval.data.source_of(2).path == "/secret/hospital-records/2"


@pytest.mark.parametrize(
    ("approval", "changes", "reason", "words"),
    [
        pytest.param(
            {"run": "another-run"},
            {},
            "NotApproved",
            ["'north'", "has not approved", "'hospitals-tabular'"],
            id="no-approval",
        ),
        pytest.param(
            {},
            {("spec", "rounds"): 14},
            "SpecChanged",
            ["spec changed after site 'north' approved it", "approved sha256:", "now sha256:"],
            id="spec-changed",
        ),
        pytest.param(
            {"clients": 2},
            {},
            "ClientCount",
            ["gives site 'north' 3 client(s)", "approved 2"],
            id="client-count",
        ),
        pytest.param(
            {},
            {("spec", "sites"): [{"name": "east", "clients": 3}, {"name": "south", "clients": 1}]},
            "ClientCount",
            ["does not list site 'north'", "spec.sites", "3 client(s)"],
            id="site-not-listed",
        ),
        pytest.param(
            {"data": None},
            {},
            "NoDataBinding",
            ["leaves each client's data to its site", "site 'north'", "binds no data"],
            id="no-data-binding",
        ),
        pytest.param(
            {"floor": {"protocols": ["dp-fedavg"], "maxEpsilon": 5}},
            {},
            "Epsilon",
            ["plans epsilon 7.884", "at most epsilon 5", "site 'north'"],
            id="floor",
        ),
    ],
)
def test_review_refuses(
    approval: dict[str, Any],
    changes: dict[tuple[str, ...], Any],
    reason: str,
    words: list[str],
) -> None:
    reviewed = _run(changes)
    # The site approved the run it reviews, but for SpecChanged: that one it approved unchanged.
    approved = _run() if reason == "SpecChanged" else reviewed
    refused = _refusal(review, _policy(_approval(approved, **approval)), reviewed)
    assert refused.reason == reason
    assert refused.site == "north"
    assert refused.run == "hospitals-tabular"
    assert isinstance(refused, FedcoreError)
    for word in words:
        assert word in str(refused)


def test_review_needs_no_data_binding_for_a_run_without_clients_own_data() -> None:
    document = _document({("spec", "protocol", "dpFedavg", "secureNoise"): False})
    del document["spec"]["data"]
    document["spec"]["data"] = {"source": {"kind": "Digits"}}
    del document["spec"]["evaluation"]["where"]
    run = parse_manifest(document)
    assert run.spec.data.client_data is None
    assert review(_policy(_approval(run, data=None)), run).data is None


# ------------------------------------------------------------------------------------ floor


@pytest.mark.parametrize(
    ("floor", "changes", "reason", "words"),
    [
        pytest.param(
            {"protocols": ["fedavg", "mpdp"]},
            {},
            "Protocol",
            ["protocol 'dp-fedavg'", "accepts only fedavg, mpdp"],
            id="protocol",
        ),
        pytest.param(
            {"protocols": ["fedavg"], "maxEpsilon": 8},
            {("spec", "protocol"): {"name": "fedavg"}, ("spec", "privacy"): DELETE},
            "Epsilon",
            ["protocol 'fedavg'", "claims no differential privacy", "at most epsilon 8"],
            id="no-dp",
        ),
        pytest.param(
            {"maxEpsilon": 8},
            {("spec", "privacy", "targetDelta"): 1e-4},
            "Delta",
            ["delta 0.0001", "spec.privacy.targetDelta", "delta 1e-05", "epsilon 8"],
            id="delta",
        ),
        pytest.param(
            {"maxEpsilon": 5},
            {},
            "Epsilon",
            ["plans epsilon 7.884 at delta 1e-05", "15 rounds", "at most epsilon 5"],
            id="epsilon",
        ),
        pytest.param(
            {"maxEpsilon": 8},
            {("spec", "privacy", "targetEpsilon"): DELETE, ("spec", "rounds"): 20},
            "Epsilon",
            ["plans epsilon 9.", "20 rounds, no targetEpsilon", "at most epsilon 8"],
            id="epsilon-of-rounds",
        ),
        pytest.param(
            {"minNoiseMultiplier": 3},
            {},
            "NoiseMultiplier",
            ["multiplier 2.5", "at least 3", "site 'north'"],
            id="noise",
        ),
        pytest.param(
            {"protocols": ["fedavg"], "minNoiseMultiplier": 0.5},
            {("spec", "protocol"): {"name": "fedavg"}, ("spec", "privacy"): DELETE},
            "NoiseMultiplier",
            ["protocol 'fedavg'", "adds no calibrated noise", "at least 0.5"],
            id="no-noise",
        ),
        pytest.param(
            {"secureAggregation": True},
            {},
            "SecureAggregation",
            ["protocol 'dp-fedavg'", "sees each client's update", "requires secure aggregation"],
            id="secure-aggregation",
        ),
    ],
)
def test_the_floor_refuses(
    floor: dict[str, Any],
    changes: dict[tuple[str, ...], Any],
    reason: str,
    words: list[str],
) -> None:
    refused = _refusal(floor_check, _floor(**floor), _run(changes), site="north")
    assert refused.reason == reason
    for word in words:
        assert word in str(refused)
    assert "'hospitals-tabular'" in str(refused)


@pytest.mark.parametrize(
    "floor",
    [
        {"maxEpsilon": 8},
        {"maxEpsilon": 7.9, "minNoiseMultiplier": 2.5},
        {"maxEpsilon": 8, "delta": 1e-4},
        {"protocols": ["fedavg", "dp-fedavg"]},
    ],
)
def test_the_floor_allows(floor: dict[str, Any]) -> None:
    floor_check(_floor(**floor), _run(), site="north")


def test_secagg_is_the_protocol_that_provides_secure_aggregation() -> None:
    assert [f.name for f in PROTOCOL_FACTS.values() if f.secure_aggregation] == ["secagg"]


def test_a_floor_that_requires_secure_aggregation_admits_secagg() -> None:
    floor_check(
        _floor(secureAggregation=True, protocols=["secagg"]),
        _run({("spec", "protocol"): {"name": "secagg"}, ("spec", "privacy"): DELETE}),
        site="north",
    )


def test_the_planned_epsilon_is_the_ledger_s() -> None:
    computed = _rdp_epsilon(2.5, 15)
    assert computed == pytest.approx(7.88, abs=0.01)
    assert planned_epsilon(_run()) == pytest.approx(computed, rel=1e-9)  # target 8 is above
    without = _run({("spec", "privacy", "targetEpsilon"): DELETE})
    assert planned_epsilon(without) == pytest.approx(computed, rel=1e-9)
    longer = _run({("spec", "privacy", "targetEpsilon"): DELETE, ("spec", "rounds"): 40})
    assert planned_epsilon(longer) == pytest.approx(_rdp_epsilon(2.5, 40), rel=1e-9)
    assert planned_epsilon(_run({("spec", "rounds"): 40})) == 8  # the run stops at its target
    fedavg = _run({("spec", "protocol"): {"name": "fedavg"}, ("spec", "privacy"): DELETE})
    assert planned_epsilon(fedavg) is None


# ------------------------------------------------------------------------------ round guard


def _guard(
    max_epsilon: float | None, changes: dict[tuple[str, ...], Any] | None = None
) -> tuple[RoundGuard, str]:
    run = _run(changes)
    floor = {"protocols": ["dp-fedavg"], "maxEpsilon": max_epsilon}
    approval = Approval.model_validate(_approval(run, floor=floor))
    return RoundGuard(run, approval, "north"), spec_digest(run)


def test_the_guard_lets_every_round_within_the_floor_through() -> None:
    guard, digest = _guard(8)
    for round_ in range(1, 16):
        guard.check(round_, digest)
    assert guard.last_round == 15


def test_the_guard_stops_at_the_last_round_within_max_epsilon() -> None:
    guard, digest = _guard(5, {("spec", "privacy", "targetEpsilon"): DELETE})
    expected = max(r for r in range(16) if r == 0 or _rdp_epsilon(2.5, r) <= 5)
    assert 1 < expected < 15
    for round_ in range(1, expected + 1):
        guard.check(round_, digest)
    assert "last_round" in vars(guard)  # computed once, on the first check
    assert guard.last_round == expected
    refused = _refusal(guard.check, expected + 1, digest)
    assert refused.reason == "Epsilon"
    reached = f"{_rdp_epsilon(2.5, expected + 1):.4g}"
    for word in [f"round {expected + 1}", f"epsilon to {reached}", "at most epsilon 5"]:
        assert word in str(refused)
    assert f"up to round {expected} only" in str(refused)


def test_the_guard_refuses_another_spec_and_rounds_past_the_last() -> None:
    guard, digest = _guard(None)
    for wrong in (None, "sha256:" + "0" * 64):
        refused = _refusal(guard.check, 1, wrong)
        assert refused.reason == "SpecChanged"
        assert "site 'north' approved it" in str(refused)
        assert digest in str(refused)
    refused = _refusal(guard.check, 16, digest)
    assert refused.reason == "RoundLimit"
    for word in ["round 16", "'hospitals-tabular'", "15 rounds", "site 'north'"]:
        assert word in str(refused)
    guard.check(15, digest)


# ---------------------------------------------------------------------------------- loading

POLICY = """\
apiVersion: fedcore.dev/v1alpha1
kind: SitePolicy
site: north
approvals:
  - run: hospitals-tabular
    specDigest: "%(digest)s"
    clients: 3
    data:
      sources:
        - path: data/hospital-0
        - path: /mnt/hospital-1
        - s3: {bucket: north-data, prefix: h2/, credentialsPath: keys/h2}
    floor:
      protocols: [dp-fedavg]
      maxEpsilon: 8
      minNoiseMultiplier: 2
"""


def test_load_policy_takes_relative_paths_from_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _run()
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "policy.yaml").write_text(POLICY % {"digest": spec_digest(run)})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    policy = load_policy(Path("../site/policy.yaml"))
    approval = review(policy, run)
    assert approval.data is not None
    first, second, third = (approval.data.source_of(i) for i in range(3))
    assert first.path == str(folder.resolve() / "data" / "hospital-0")
    assert second.path == "/mnt/hospital-1"
    assert third.s3 is not None
    assert third.s3.credentials_path == str(folder.resolve() / "keys" / "h2")
    with pytest.raises(IndexError):
        approval.data.source_of(3)


def test_a_template_takes_the_site_s_own_index() -> None:
    data = SiteData.model_validate({"template": {"volumeClaim": {"claimName": "north-{index}"}}})
    source = data.source_of(1)
    assert source.volume_claim is not None
    assert source.volume_claim.claim_name == "north-1"


def _policy_text(digest: str, **replacements: str) -> str:
    text = POLICY % {"digest": digest}
    for old, new in replacements.items():
        assert old in text
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize(
    ("replacement", "path", "words"),
    [
        (("maxEpsilon: 8", "maxEpsilon: -1"), "approvals[0].floor.maxEpsilon", ["-1"]),
        (("maxEpsilon: 8", "maxEpsilon: many"), "approvals[0].floor.maxEpsilon", ["number"]),
        (("[dp-fedavg]", "[dp-fedsum]"), "approvals[0].floor.protocols", ["dp-fedsum"]),
        (("maxEpsilon: 8", "maxEpsilon: 8\n      delta: 1"), "approvals[0].floor.delta", []),
        (("maxEpsilon: 8", "maxEps: 8"), "approvals[0].floor.maxEps", ["maxEpsilon"]),
        (("clients: 3", "clients: 2"), "approvals[0]", ["3 sources", "clients is 2"]),
        (("specDigest: ", "specDigest: sha1"), "approvals[0].specDigest", []),
        (("site: north", "site: North_Site"), "site", []),
        (("kind: SitePolicy", "kind: FederatedRun"), "kind", ["SitePolicy"]),
        (
            ("    data:\n", "    data:\n      template: {path: 'x/{index}'}\n"),
            "approvals[0].data",
            ["exactly one of template and sources"],
        ),
        (
            (
                "approvals:\n",
                "approvals:\n  - {run: hospitals-tabular, specDigest: "
                '"sha256:' + "0" * 64 + '", clients: 1, floor: {protocols: [fedavg]}}\n',
            ),
            "approvals",
            ["approved twice", "approvals[0]", "approvals[1]"],
        ),
    ],
)
def test_load_policy_names_the_field(
    tmp_path: Path, replacement: tuple[str, str], path: str, words: list[str]
) -> None:
    file = tmp_path / "policy.yaml"
    file.write_text(_policy_text("sha256:" + "a" * 64, **{replacement[0]: replacement[1]}))
    with pytest.raises(PolicyError) as caught:
        load_policy(file)
    issue = next(issue for issue in caught.value.issues if issue.path == path)
    for word in words:
        assert word in issue.message
    assert isinstance(caught.value, SpecError)
    assert str(caught.value).startswith(f"The SitePolicy in {file} is invalid")


def test_load_policy_refuses_unsafe_yaml_and_a_missing_file(tmp_path: Path) -> None:
    file = tmp_path / "policy.yaml"
    file.write_text("site: north\nsite: south\n")
    with pytest.raises(PolicyError) as caught:
        load_policy(file)
    assert caught.value.issues[0].path == "site"
    assert "given twice" in caught.value.issues[0].message
    with pytest.raises(PolicyError) as caught:
        load_policy(tmp_path / "absent.yaml")
    assert caught.value.issues[0].path == "<file>"


def test_an_empty_policy_approves_nothing() -> None:
    refused = _refusal(review, _policy(), _run())
    assert refused.reason == "NotApproved"

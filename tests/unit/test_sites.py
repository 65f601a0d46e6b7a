"""Sites without a network: the revoked-sites file, a site's data binding, the hub's registry
(join tokens, enrollment, renewal, revocation), the operator's refusal of spec.sites and the
``fedcore site`` / ``fedcore hub`` commands' checks."""

from __future__ import annotations

import copy
import datetime
import json
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fedcore.cli import main
from fedcore.errors import FedcoreError
from fedcore.sites._registry import SITE_URI_PREFIX, EnrollmentRefused, HubRegistry, JoinToken
from fedcore.sites.binding import SiteBinding
from fedcore.sites.policy import Approval, spec_digest
from fedcore.spec import FederatedRun, load_manifest
from fedcore.transport import (
    Identity,
    RevokedSites,
    TlsBundle,
    certificate_facts,
    fingerprint,
    new_key_and_request,
)
from fedcore_operator import admission
from fedcore_operator.plan import manifest_of

REPO = Path(__file__).resolve().parents[2]
CONSORTIUM = REPO / "examples" / "sites" / "consortium.yaml"
"""dp-fedavg over 4 clients: hospital-a runs clients 0 and 1, hospital-b 2, hospital-c 3."""
DIGITS = REPO / "examples" / "digits-fedavg.yaml"
"""A run without spec.sites."""

FLOOR = {"protocols": ["dp-fedavg"], "maxEpsilon": 8}
"""A floor the consortium's run (epsilon 7.88) meets."""


def _der(cert_pem: bytes) -> bytes:
    return x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)


def _refused(reason: str, call: Any, *args: Any, **kwargs: Any) -> str:
    """Calls ``call``, expects EnrollmentRefused for ``reason`` and returns its message."""
    with pytest.raises(EnrollmentRefused) as caught:
        call(*args, **kwargs)
    assert caught.value.reason == reason, str(caught.value)
    return str(caught.value)


# --------------------------------------------------------------------------- RevokedSites


def _write_revoked(path: Path, text: str, stamp: int) -> None:
    """Writes ``text`` and gives the file the modification time ``stamp`` (seconds), so that
    every write is a change whatever the file system's clock resolution."""
    path.write_text(text, encoding="utf-8")
    os.utime(path, ns=(stamp * 10**9, stamp * 10**9))


def test_no_revoked_sites_file_means_no_site_is_revoked(tmp_path: Path) -> None:
    assert RevokedSites(tmp_path / "revoked-sites.json").names() == frozenset()


def test_a_written_name_is_revoked(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "revoked-sites.json"
    revoked = RevokedSites(path)
    assert revoked.names() == frozenset()
    # Execute
    RevokedSites.write(path, {"north", "east"})
    # Assert
    assert revoked.names() == {"north", "east"}
    assert json.loads(path.read_text()) == {"revoked": ["east", "north"]}
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_broken_revoked_sites_file_keeps_the_names_last_read(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "revoked-sites.json"
    revoked = RevokedSites(path)
    _write_revoked(path, json.dumps({"revoked": ["north"]}), 1_000)
    assert revoked.names() == {"north"}
    # Execute / Assert: half a file, another document, a wrong type: still north
    for stamp, text in enumerate(['{"revoked": ["nor', '{"sites": []}', '{"revoked": 3}'], 1_001):
        _write_revoked(path, text, stamp)
        assert revoked.names() == {"north"}, text
    path.unlink()
    assert revoked.names() == {"north"}


def test_revoked_names_never_shrink_when_the_file_is_rewritten_smaller(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "revoked-sites.json"
    revoked = RevokedSites(path)
    _write_revoked(path, json.dumps({"revoked": ["north", "south"]}), 1_000)
    assert revoked.names() == {"north", "south"}
    # Execute
    _write_revoked(path, json.dumps({"revoked": ["east"]}), 1_001)
    grown = revoked.names()
    _write_revoked(path, json.dumps({"revoked": []}), 1_002)
    # Assert
    assert grown == {"north", "south", "east"}
    assert revoked.names() == {"north", "south", "east"}


# ---------------------------------------------------------------------------- SiteBinding


@pytest.fixture(scope="module")
def consortium() -> FederatedRun:
    return load_manifest(CONSORTIUM)


def _approval(run: FederatedRun, clients: int, data: dict[str, Any] | None) -> Approval:
    document: dict[str, Any] = {
        "run": run.metadata.name,
        "specDigest": spec_digest(run),
        "clients": clients,
        "floor": FLOOR,
    }
    if data is not None:
        document["data"] = data
    return Approval.model_validate(document)


def test_bind_gives_each_of_the_sites_clients_its_own_source_by_its_index_at_the_site(
    consortium: FederatedRun,
) -> None:
    # Prepare: hospital-a runs the run's clients 0 and 1, hospital-b client 2
    a = SiteBinding(
        "hospital-a",
        spec_digest(consortium),
        _approval(consortium, 2, {"template": {"path": "/a/campus-{index}"}}),
    )
    b = SiteBinding(
        "hospital-b",
        spec_digest(consortium),
        _approval(consortium, 1, {"sources": [{"path": "/b/records"}]}),
    )
    # Execute
    at_a = a.bind(consortium).spec.data.client_data
    at_b = b.bind(consortium).spec.data.client_data
    # Assert
    assert at_a is not None and at_b is not None
    assert not at_a.bound_by_sites and not at_b.bound_by_sites
    assert at_a.format == "Parquet"
    assert [at_a.source_of(index).path for index in (0, 1)] == ["/a/campus-0", "/a/campus-1"]
    assert at_b.source_of(2).path == "/b/records"
    assert consortium.spec.data.client_data is not None
    assert consortium.spec.data.client_data.bound_by_sites  # the hub's run is left unchanged


def test_bind_leaves_the_rest_of_the_run_unchanged(consortium: FederatedRun) -> None:
    # Prepare
    binding = SiteBinding(
        "hospital-c",
        spec_digest(consortium),
        _approval(consortium, 1, {"template": {"path": "/c/{index}"}}),
    )
    # Execute
    bound = binding.bind(consortium)
    # Assert
    assert bound.metadata == consortium.metadata
    assert bound.spec.model_dump(exclude={"data"}) == consortium.spec.model_dump(exclude={"data"})
    assert bound.spec.data.schema_ == consortium.spec.data.schema_
    assert bound.spec.data.client_data is not None
    assert bound.spec.data.client_data.source_of(3).path == "/c/0"


def test_bind_without_data_in_the_approval_leaves_the_run_as_it_is(
    consortium: FederatedRun,
) -> None:
    binding = SiteBinding("hospital-c", spec_digest(consortium), _approval(consortium, 1, None))
    assert binding.bind(consortium) is consortium


def test_bind_keeps_the_sites_clients_out_of_the_hubs_checkpoint_store(
    consortium: FederatedRun,
) -> None:
    # Prepare: the hub keeps its checkpoints in its own bucket, with its own credentials.
    s3 = {"bucket": "hub-runs", "credentialsSecret": "hub-s3"}
    checkpoint = consortium.spec.checkpoint.model_copy(
        update={"s3": type(consortium.spec.checkpoint).model_validate({"s3": s3}).s3}
    )
    run = consortium.model_copy(
        update={"spec": consortium.spec.model_copy(update={"checkpoint": checkpoint})}
    )
    binding = SiteBinding("hospital-c", spec_digest(run), _approval(run, 1, None))
    # Execute
    bound = binding.bind(run)
    # Assert: the site's clients keep theirs in the site's folder; the rest as approved.
    assert run.spec.checkpoint.s3 is not None and bound.spec.checkpoint.s3 is None
    assert bound.spec.checkpoint.local == run.spec.checkpoint.local
    assert bound.spec.model_dump(exclude={"checkpoint"}) == run.spec.model_dump(
        exclude={"checkpoint"}
    )


def test_bind_refuses_a_run_without_clients_at_the_site(consortium: FederatedRun) -> None:
    # Prepare
    binding = SiteBinding(
        "hospital-z",
        spec_digest(consortium),
        _approval(consortium, 1, {"template": {"path": "/z/{index}"}}),
    )
    # Execute / Assert
    with pytest.raises(FedcoreError, match="has no clients at site 'hospital-z'"):
        binding.bind(consortium)


def test_a_binding_written_is_read_back_the_same_and_only_its_owner_reads_it(
    consortium: FederatedRun, tmp_path: Path
) -> None:
    # Prepare
    binding = SiteBinding(
        "hospital-a",
        spec_digest(consortium),
        _approval(consortium, 2, {"sources": [{"path": "/a/0"}, {"path": "/a/1"}]}),
    )
    path = tmp_path / "site-binding.json"
    # Execute
    binding.write(path)
    loaded = SiteBinding.load(path)
    # Assert
    assert loaded == binding
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text())["approval"]["specDigest"] == spec_digest(consortium)


@pytest.mark.parametrize("text", [None, "{", '{"site": "a"}', '{"site": "a", "digest": "x"}'])
def test_a_missing_or_malformed_binding_is_refused(tmp_path: Path, text: str | None) -> None:
    # Prepare
    path = tmp_path / "site-binding.json"
    if text is not None:
        path.write_text(text)
    # Execute / Assert
    with pytest.raises(FedcoreError, match=r"site-binding\.json is unreadable"):
        SiteBinding.load(path)


# ---------------------------------------------------------------------------- HubRegistry


@pytest.fixture
def registry(tmp_path: Path) -> HubRegistry:
    return HubRegistry(tmp_path / "hub")


def _states(registry: HubRegistry) -> dict[str, str]:
    return {site["name"]: site["state"] for site in registry.sites()}


def _enrolled(registry: HubRegistry, name: str = "north") -> bytes:
    """Adds and enrolls site ``name``; returns its certificate."""
    token = registry.add_site(name)
    return registry.enroll(token.token, new_key_and_request(name)[1])


def test_a_new_hub_makes_its_ca_and_endpoint_once(tmp_path: Path) -> None:
    # Execute
    first = HubRegistry(tmp_path / "hub")
    again = HubRegistry(tmp_path / "hub")
    # Assert
    folder = tmp_path / "hub"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / "ca" / "ca.key").stat().st_mode) == 0o600
    assert (
        first.fingerprint
        == again.fingerprint
        == fingerprint((folder / "ca" / "ca.crt").read_bytes())
    )
    endpoint = TlsBundle.load(folder / "endpoint")
    assert endpoint.identity == Identity("hub")
    assert endpoint.ca_pem == first.ca.cert_pem
    assert RevokedSites(first.revoked_path).names() == frozenset()
    assert first.sites() == []


def test_an_added_site_is_invited_and_the_hub_keeps_only_its_tokens_digest(
    registry: HubRegistry,
) -> None:
    # Execute
    before = time.time()
    token = registry.add_site("north", token_seconds=3600)
    # Assert
    assert isinstance(token, JoinToken)
    assert token.site == "north"
    assert token.token.startswith("north.")
    assert token.fingerprint == registry.fingerprint
    assert before + 3600 <= token.expires <= time.time() + 3600
    (listed,) = registry.sites()
    assert listed["name"] == "north"
    assert (listed["state"], listed["enrolled"], listed["revoked"], listed["certificates"]) == (
        "Invited",
        None,
        None,
        0,
    )
    stored = (registry.directory / "sites.json").read_text()
    secret = token.token.split(".", 1)[1]
    assert token.token not in stored and secret not in stored
    assert stat.S_IMODE((registry.directory / "sites.json").stat().st_mode) == 0o600
    assert "token" not in json.dumps(registry.sites())


@pytest.mark.parametrize(
    "name", ["North", "1north", "north_1", "north-", "a" * 41, "server", "kdc", "hub", "client-3"]
)
def test_add_site_refuses_a_name_that_is_no_site_name(registry: HubRegistry, name: str) -> None:
    message = _refused("WrongName", registry.add_site, name)
    assert "is not a site name" in message
    assert registry.sites() == []


def test_an_expired_token_is_listed_and_refused(registry: HubRegistry) -> None:
    # Prepare
    token = registry.add_site("north", token_seconds=-1)
    # Execute
    message = _refused(
        "TokenExpired", registry.enroll, token.token, new_key_and_request("north")[1]
    )
    # Assert
    assert "expired at" in message and "fedcore site add north" in message
    assert _states(registry) == {"north": "TokenExpired"}


def test_enroll_signs_the_sites_request_once(registry: HubRegistry) -> None:
    # Prepare
    token = registry.add_site("north")
    key_pem, request_pem = new_key_and_request("north")
    # Execute
    cert_pem = registry.enroll(token.token, request_pem)
    again = _refused("TokenUsed", registry.enroll, token.token, new_key_and_request("north")[1])
    # Assert
    certificate = x509.load_pem_x509_certificate(cert_pem)
    certificate.verify_directly_issued_by(registry.ca.certificate)
    assert certificate_facts(cert_pem)[0] == "north"
    key = serialization.load_pem_private_key(key_pem, password=None)
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    assert certificate.public_key().public_bytes(*spki) == key.public_key().public_bytes(*spki)
    sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [f"{SITE_URI_PREFIX}north"]
    assert sans.get_values_for_type(x509.DNSName) == []
    assert "was used already" in again
    (listed,) = registry.sites()
    assert (listed["state"], listed["certificates"]) == ("Enrolled", 1)
    assert listed["enrolled"] is not None
    assert registry.site_of_certificate(_der(cert_pem)) == "north"
    assert "enrolled already" in _refused("TokenUsed", registry.add_site, "north")


def test_enroll_refuses_a_request_for_another_name_and_keeps_the_token(
    registry: HubRegistry,
) -> None:
    # Prepare
    token = registry.add_site("north")
    # Execute
    message = _refused("BadRequest", registry.enroll, token.token, new_key_and_request("south")[1])
    garbage = _refused("BadRequest", registry.enroll, token.token, b"not a request")
    # Assert
    assert "names 'south', not 'north'" in message
    assert "not a PEM PKCS#10 request" in garbage
    assert _states(registry) == {"north": "Invited"}
    registry.enroll(token.token, new_key_and_request("north")[1])  # the token still works
    assert _states(registry) == {"north": "Enrolled"}


@pytest.mark.parametrize(
    "token",
    ["", "north", "north.short", "North." + "a" * 43, "north." + "a" * 43, "south." + "a" * 43],
)
def test_enroll_refuses_a_token_the_hub_did_not_issue(registry: HubRegistry, token: str) -> None:
    # Prepare
    registry.add_site("north")
    # Execute
    message = _refused("UnknownToken", registry.enroll, token, new_key_and_request("north")[1])
    # Assert
    assert "join token" in message
    assert _states(registry) == {"north": "Invited"}


def test_adding_an_invited_site_again_replaces_its_token(registry: HubRegistry) -> None:
    # Prepare
    old = registry.add_site("north")
    new = registry.add_site("north")
    # Execute
    _refused("UnknownToken", registry.enroll, old.token, new_key_and_request("north")[1])
    registry.enroll(new.token, new_key_and_request("north")[1])
    # Assert
    assert old.token != new.token
    assert _states(registry) == {"north": "Enrolled"}


def test_renew_keeps_at_most_the_last_four_certificates(registry: HubRegistry) -> None:
    # Prepare
    certificates = [_enrolled(registry)]
    # Execute
    for _ in range(4):
        certificates.append(registry.renew("north", new_key_and_request("north")[1]))
    # Assert
    stored = json.loads((registry.directory / "sites.json").read_text())["sites"]["north"]
    assert stored["serials"] == [certificate_facts(pem)[1] for pem in certificates[1:]]
    assert registry.sites()[0]["certificates"] == 4
    message = _refused("NotASite", registry.site_of_certificate, _der(certificates[0]))
    assert "replaced or unknown" in message
    for pem in certificates[1:]:
        assert registry.site_of_certificate(_der(pem)) == "north"


def test_renew_refuses_an_unknown_site_and_another_name(registry: HubRegistry) -> None:
    # Prepare
    _enrolled(registry)
    # Execute / Assert
    assert "No site is named 'south'" in _refused(
        "UnknownSite", registry.renew, "south", new_key_and_request("south")[1]
    )
    _refused("BadRequest", registry.renew, "north", new_key_and_request("south")[1])
    assert registry.sites()[0]["certificates"] == 1


def test_a_revoked_site_is_refused_everywhere_and_its_name_stays_revoked(
    registry: HubRegistry,
) -> None:
    # Prepare
    cert_pem = _enrolled(registry)
    invited = registry.add_site("south")
    watched = RevokedSites(registry.revoked_path)
    # Execute
    registry.revoke("north")
    registry.revoke("south")
    first = registry.sites()[0]["revoked"]
    registry.revoke("north")  # again: nothing changes
    # Assert
    assert _states(registry) == {"north": "Revoked", "south": "Revoked"}
    assert registry.sites()[0]["revoked"] == first
    assert registry.revoked() == {"north", "south"}
    assert watched.names() == {"north", "south"}
    assert "was revoked at" in _refused("Revoked", registry.site_of_certificate, _der(cert_pem))
    _refused("Revoked", registry.renew, "north", new_key_and_request("north")[1])
    _refused("Revoked", registry.enroll, invited.token, new_key_and_request("south")[1])
    assert "stays revoked" in _refused("Revoked", registry.add_site, "north")
    assert "No site is named 'east'" in _refused("UnknownSite", registry.revoke, "east")


def test_site_of_certificate_refuses_what_is_not_an_enrolled_sites(registry: HubRegistry) -> None:
    # Prepare
    registry.add_site("north")
    week = datetime.timedelta(days=7)

    def signed(common_name: str, uri: str | None) -> bytes:
        request = new_key_and_request(common_name)[1]
        return _der(
            registry.ca.sign_request(request, common_name=common_name, uri=uri, valid_for=week)
        )

    # Execute / Assert
    _refused("NotASite", registry.site_of_certificate, _der(registry.endpoint.cert_pem))
    _refused("NotASite", registry.site_of_certificate, _der(registry.ca.issue("client-3").cert_pem))
    _refused("NotASite", registry.site_of_certificate, signed("north", None))
    assert "names a party" in _refused(
        "NotASite", registry.site_of_certificate, signed("x", f"{SITE_URI_PREFIX}server")
    )
    _refused("UnknownSite", registry.site_of_certificate, signed("east", f"{SITE_URI_PREFIX}east"))
    assert "replaced or unknown" in _refused(
        "NotASite", registry.site_of_certificate, signed("north", f"{SITE_URI_PREFIX}north")
    )


# ------------------------------------------------------------------------------- operator


def _body(document: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(document)
    body["metadata"] = {**body["metadata"], "namespace": "ns", "uid": "u-1", "generation": 1}
    return body


def test_the_operator_takes_a_run_with_sites_which_its_hub_serves() -> None:
    document = yaml.safe_load(CONSORTIUM.read_text())
    assert manifest_of(_body(document)).spec.sites is not None
    assert admission.check(_body(document), None, "CREATE") == []


def test_the_operator_takes_a_run_without_sites() -> None:
    document = yaml.safe_load(DIGITS.read_text())
    assert manifest_of(_body(document)).spec.sites is None
    assert admission.check(_body(document), None, "CREATE") == []


# ------------------------------------------------------------------------------------ CLI


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[CliRunner]:
    """A runner; the root logger (which ``hub serve`` configures) is restored after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield CliRunner()
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)


def test_site_add_prints_the_token_fingerprint_and_expiry_as_json(
    cli: CliRunner, tmp_path: Path
) -> None:
    # Prepare
    hub = tmp_path / "hub"
    # Execute
    result = cli.invoke(
        main, ["site", "add", "north", "--hub-dir", str(hub), "--json", "--expires", "2h"]
    )
    # Assert
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert set(printed) == {"site", "token", "fingerprint", "expires"}
    assert printed["site"] == "north" and printed["token"].startswith("north.")
    assert printed["fingerprint"] == HubRegistry(hub).fingerprint
    expires = datetime.datetime.strptime(printed["expires"], "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.UTC
    )
    left = expires - datetime.datetime.now(datetime.UTC)
    assert datetime.timedelta(hours=1, minutes=58) < left <= datetime.timedelta(hours=2)
    # and the token enrolls the site
    HubRegistry(hub).enroll(printed["token"], new_key_and_request("north")[1])


def test_site_add_list_and_revoke(cli: CliRunner, tmp_path: Path) -> None:
    # Prepare
    hub = str(tmp_path / "hub")
    # Execute
    added = cli.invoke(main, ["site", "add", "north", "--hub-dir", hub])
    listed = cli.invoke(main, ["site", "list", "--hub-dir", hub, "--json"])
    revoked = cli.invoke(main, ["site", "revoke", "north", "--hub-dir", hub])
    relisted = cli.invoke(main, ["site", "list", "--hub-dir", hub])
    readded = cli.invoke(main, ["site", "add", "north", "--hub-dir", hub])
    # Assert
    assert added.exit_code == 0, added.output
    assert "token:       north." in added.stdout and "fingerprint: sha256:" in added.stdout
    assert listed.exit_code == 0, listed.output
    (entry,) = json.loads(listed.stdout)
    assert (entry["name"], entry["state"]) == ("north", "Invited")
    assert revoked.exit_code == 0, revoked.output
    assert "Site north is revoked." in revoked.stdout
    assert relisted.stdout.split()[:2] == ["north", "Revoked"]
    assert readded.exit_code == 1
    assert "stays revoked" in readded.stderr
    assert json.loads((tmp_path / "hub" / "revoked-sites.json").read_text()) == {
        "revoked": ["north"]
    }


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["site", "add", "Bad_Name"], 1, "is not a site name"),
        (["site", "revoke", "east"], 1, "No site is named 'east'"),
        (["site", "add", "north", "--expires", "soon"], 2, "is not a duration"),
        (["site", "add", "north", "--expires", "0h"], 2, "is not a positive duration"),
    ],
    ids=["bad-name", "revoke-unknown", "bad-duration", "zero-duration"],
)
def test_site_commands_refuse_with_a_reason(
    cli: CliRunner, tmp_path: Path, args: list[str], code: int, words: str
) -> None:
    result = cli.invoke(main, [*args, "--hub-dir", str(tmp_path / "hub")])
    assert result.exit_code == code, result.output
    assert words in result.stderr


def _policy_file(tmp_path: Path, run: FederatedRun, digest: str) -> Path:
    path = tmp_path / "policy.yaml"
    policy = {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "SitePolicy",
        "site": "hospital-b",
        "approvals": [
            {
                "run": run.metadata.name,
                "specDigest": digest,
                "clients": 1,
                "data": {"template": {"path": "records-{index}"}},
                "floor": FLOOR,
            }
        ],
    }
    path.write_text(yaml.safe_dump(policy))
    return path


def test_site_review_prints_the_spec_digest(cli: CliRunner, consortium: FederatedRun) -> None:
    # Execute
    result = cli.invoke(main, ["site", "review", str(CONSORTIUM)])
    # Assert
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert f"specDigest:  {spec_digest(consortium)}" in lines
    assert "run:         consortium" in lines
    assert "site:        hospital-a (2 clients)" in lines
    assert "approves" not in result.stdout


def test_site_review_with_an_approving_policy(
    cli: CliRunner, tmp_path: Path, consortium: FederatedRun
) -> None:
    # Prepare
    policy = _policy_file(tmp_path, consortium, spec_digest(consortium))
    # Execute
    result = cli.invoke(main, ["site", "review", str(CONSORTIUM), "--policy", str(policy)])
    # Assert
    assert result.exit_code == 0, result.output
    assert "The policy approves this run." in result.stdout


def test_site_review_with_a_refusing_policy_exits_1_naming_why(
    cli: CliRunner, tmp_path: Path, consortium: FederatedRun
) -> None:
    # Prepare: the policy approved another spec
    policy = _policy_file(tmp_path, consortium, "sha256:" + "0" * 64)
    # Execute
    result = cli.invoke(main, ["site", "review", str(CONSORTIUM), "--policy", str(policy)])
    # Assert
    assert result.exit_code == 1
    assert f"specDigest:  {spec_digest(consortium)}" in result.stdout
    assert "The policy refuses this run (SpecChanged)" in result.stderr
    assert "approves" not in result.stdout


def test_run_refuses_site_policies_for_a_run_without_sites(cli: CliRunner, tmp_path: Path) -> None:
    # Execute
    work = tmp_path / "work"
    result = cli.invoke(
        main,
        ["run", str(DIGITS), "--quiet", "--spawn", "exec", "--workdir", str(work), "--site", "x=y"],
    )
    # Assert
    assert result.exit_code == 2, result.output
    assert "--site is for a manifest with spec.sites" in result.stderr
    assert not work.exists()


def test_run_refuses_to_simulate_a_run_whose_sites_bind_the_data(
    cli: CliRunner, tmp_path: Path
) -> None:
    result = cli.invoke(main, ["run", str(CONSORTIUM), "--simulate", "--quiet"])
    assert result.exit_code == 2, result.output
    assert "--simulate needs every client's data in one process" in result.stderr


def test_hub_serve_refuses_a_site_the_hub_does_not_know(cli: CliRunner, tmp_path: Path) -> None:
    # Prepare: the hub knows hospital-a and hospital-b, not hospital-c
    hub = tmp_path / "hub"
    registry = HubRegistry(hub)
    registry.add_site("hospital-a")
    registry.add_site("hospital-b")
    # Execute
    result = cli.invoke(main, ["hub", "serve", str(CONSORTIUM), "--dir", str(hub)])
    # Assert
    assert result.exit_code == 1, result.output
    assert "UnknownSite" in result.stderr
    assert "'hospital-c', which this hub does not know" in result.stderr
    assert "fedcore site add hospital-c" in result.stderr
    assert not (hub / "runs").exists()


def test_hub_serve_refuses_a_revoked_site(cli: CliRunner, tmp_path: Path) -> None:
    # Prepare
    hub = tmp_path / "hub"
    registry = HubRegistry(hub)
    for name in ("hospital-a", "hospital-b", "hospital-c"):
        registry.add_site(name)
    registry.revoke("hospital-b")
    # Execute
    result = cli.invoke(main, ["hub", "serve", str(CONSORTIUM), "--dir", str(hub)])
    # Assert
    assert result.exit_code == 1, result.output
    assert "'hospital-b', which this hub revoked" in result.stderr
    assert not (hub / "runs").exists()


def test_hub_serve_refuses_a_run_without_sites(cli: CliRunner, tmp_path: Path) -> None:
    # Execute
    hub = tmp_path / "hub"
    result = cli.invoke(main, ["hub", "serve", str(DIGITS), "--dir", str(hub)])
    # Assert
    assert result.exit_code == 1, result.output
    assert "InvalidOptions" in result.stderr
    assert "lists no spec.sites" in result.stderr
    assert not (hub / "runs").exists()


class _Heard:
    """Stands in for a client's session to the server: keeps what the client says."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def send(self, message: Any) -> None:
        self.sent.append(message)

    async def finish(self, seconds: float) -> None:
        pass


@pytest.mark.parametrize("site", [None, "hospital-b"])
def test_a_client_that_fails_a_task_tells_the_server_why_but_a_sites_keeps_its_paths(
    site: str | None,
) -> None:
    # Prepare: a failure whose message names a path of the client's machine.
    import asyncio
    from types import SimpleNamespace

    from fedcore.errors import CheckpointError
    from fedcore.roles.client import Client

    guard = None if site is None else SimpleNamespace(site=site)
    client = SimpleNamespace(guard=guard, index=4)
    session = _Heard()
    error = CheckpointError("Cannot read /data/ward-7/checkpoints/round-3/state.json.")
    # Execute
    asyncio.run(Client._say_failed(client, session, (3, 1), error))  # type: ignore[arg-type]
    # Assert: the kind always; the message only where no site keeps its own machine's paths.
    (said,) = session.sent
    assert said.meta["kind"] == "failed" and said.meta["reason"] == "CheckpointError"
    assert (said.meta["round"], said.meta["attempt"]) == (3, 1)
    if site is None:
        assert said.meta["message"] == str(error)
    else:
        assert "/data" not in json.dumps(said.meta)
        assert said.meta["message"] == "see site hospital-b's log of client 4"

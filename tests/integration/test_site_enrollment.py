"""A hub's endpoint and a site, in one process over real TLS on loopback: enrollment by
one-time token and certificate request, the CA fingerprint, revocation, renewal, the
review of a run against a site's policy (each refusal seen on both sides), the routing by
TLS server name and a relay that carries only ciphertext."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedcore.errors import FedcoreError
from fedcore.sites._api import HubApiClient, HubRefused
from fedcore.sites._registry import EnrollmentRefused, HubRegistry
from fedcore.sites.hub import HubEndpoint, HubRun
from fedcore.sites.policy import SiteRefused, spec_digest
from fedcore.sites.site import SiteAgent, join
from fedcore.spec import FederatedRun, parse_manifest
from fedcore.transport import (
    Identity,
    RunCa,
    SniRouter,
    TlsBundle,
    TunnelBroker,
    certificate_facts,
    dial,
    new_key_and_request,
    splice,
)
from fedcore.transport._router import read_server_name

pytestmark = pytest.mark.integration

RUN: dict[str, Any] = {
    "apiVersion": "fedcore.dev/v1alpha1",
    "kind": "FederatedRun",
    "metadata": {"name": "consortium"},
    "spec": {
        "protocol": {
            "name": "dp-fedavg",
            "dpFedavg": {"clippingNorm": 1.0, "noiseMultiplier": 2.5},
        },
        "model": {"kind": "MLP", "hidden": [8]},
        "data": {"source": {"kind": "Digits"}},
        "clients": {"count": 3},
        "sites": [{"name": "hospital-a", "clients": 2}, {"name": "hospital-b", "clients": 1}],
        "rounds": 15,
        "privacy": {"targetDelta": 1.0e-5},
    },
}


def policy_file(folder: Path, run: FederatedRun, *, site: str = "hospital-a", **floor: Any) -> Path:
    """A policy approving ``run`` for ``site`` (its clients in the run), with ``floor``."""
    clients = len(run.spec.site_clients(site))
    document = {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "SitePolicy",
        "site": site,
        "approvals": [
            {
                "run": run.metadata.name,
                "specDigest": spec_digest(run),
                "clients": clients,
                "floor": {"protocols": ["dp-fedavg"], **floor},
            }
        ],
    }
    path = folder / f"{site}-policy.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


@dataclass
class Hub:
    """A hub's registry and endpoint serving one run; ``events`` records what it reports."""

    registry: HubRegistry
    endpoint: HubEndpoint
    address: str
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[Hub]:
    registry = HubRegistry(tmp_path / "hub")
    run = parse_manifest(RUN)
    events: list[tuple[str, dict[str, Any]]] = []
    hub_run = HubRun(
        run,
        yaml.safe_dump(RUN),
        RunCa.generate("consortium"),
        spec_digest(run),
        lambda event, **fields: events.append((event, fields)),
    )
    endpoint = HubEndpoint(registry, "127.0.0.1:0", run=hub_run)
    endpoint.start()
    yield Hub(registry, endpoint, f"127.0.0.1:{endpoint.port}", events)
    endpoint.stop()


def test_a_site_enrolls_with_its_own_key_and_the_token_works_once(
    hub: Hub, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = hub.registry.add_site("hospital-a")
    config = join(
        tmp_path / "a", hub=hub.address, token=token.token, expected_fingerprint=token.fingerprint
    )
    assert config.name == "hospital-a"
    bundle = TlsBundle.load(tmp_path / "a" / "identity")
    assert (tmp_path / "a" / "identity" / "tls.key").stat().st_mode & 0o777 == 0o600
    assert bundle.ca_pem == hub.registry.ca.cert_pem
    # The certificate names the site and holds the key made at the site: the hub has no copy.
    name, _serial, start, end = certificate_facts(bundle.cert_pem)
    assert name == "hospital-a"
    assert bundle.key_pem not in b"".join(
        p.read_bytes() for p in hub.registry.directory.rglob("*") if p.is_file()
    )
    assert hub.registry.sites()[0]["state"] == "Enrolled"
    assert 0 < (end - start).total_seconds() <= 7 * 24 * 3600 + 600
    # The token is never stored: only its digest.
    assert token.token not in (hub.registry.directory / "sites.json").read_text()
    # Twice: refused on both sides, with the same words.
    with (
        caplog.at_level(logging.WARNING, logger="fedcore.sites.hub"),
        pytest.raises(FedcoreError, match="was used already") as refused,
    ):
        join(
            tmp_path / "again",
            hub=hub.address,
            token=token.token,
            expected_fingerprint=token.fingerprint,
        )
    assert "TokenUsed" in str(refused.value)
    assert "Refused POST /v1/enroll" in caplog.text and "was used already" in caplog.text
    assert hub.endpoint.refused.get("TokenUsed") == 1
    sample = hub.endpoint.metrics.registry.get_sample_value
    assert sample("fedcore_hub_refused_total", {"run": "consortium", "reason": "TokenUsed"}) == 1
    # fetch_ca and enroll of each join: four API connections, nothing else routed.
    assert sample("fedcore_hub_connections_total", {"run": "consortium", "route": "api"}) == 4
    assert sample("fedcore_hub_connections_total", {"run": "consortium", "route": "server"}) == 0
    assert not (tmp_path / "again" / "identity").exists()


def test_an_expired_token_is_refused_on_both_sides(
    hub: Hub, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = hub.registry.add_site("hospital-b", token_seconds=0.2)
    time.sleep(0.3)
    with (
        caplog.at_level(logging.WARNING, logger="fedcore.sites.hub"),
        pytest.raises(FedcoreError, match="expired at") as refused,
    ):
        join(
            tmp_path / "b",
            hub=hub.address,
            token=token.token,
            expected_fingerprint=token.fingerprint,
        )
    assert "TokenExpired" in str(refused.value)
    assert "(TokenExpired)" in caplog.text
    assert hub.registry.sites()[0]["state"] == "TokenExpired"


def test_a_wrong_fingerprint_stops_the_join_before_anything_is_sent(
    hub: Hub, tmp_path: Path
) -> None:
    token = hub.registry.add_site("hospital-a")
    other = HubRegistry(tmp_path / "other-hub")  # a hub the site was not invited to
    with pytest.raises(FedcoreError, match="not the hub you were invited to") as refused:
        join(
            tmp_path / "a",
            hub=hub.address,
            token=token.token,
            expected_fingerprint=other.fingerprint,
        )
    assert hub.registry.fingerprint in str(refused.value)
    # The hub saw no enrollment: the token is unused and still works.
    assert hub.registry.sites()[0]["state"] == "Invited"
    assert not any(event == "site_enrolled" for event, _ in hub.events)
    join(tmp_path / "a", hub=hub.address, token=token.token, expected_fingerprint=token.fingerprint)


def test_a_forged_or_foreign_request_is_refused(hub: Hub, tmp_path: Path) -> None:
    token = hub.registry.add_site("hospital-a")
    _, request = new_key_and_request("hospital-b")  # asks for another site's name
    with pytest.raises(EnrollmentRefused, match="names 'hospital-b', not 'hospital-a'"):
        hub.registry.enroll(token.token, request)
    _, request = new_key_and_request("server")  # a party's name: never a site's
    with pytest.raises(EnrollmentRefused, match="not a site name"):
        hub.registry.add_site("server")
    with pytest.raises(EnrollmentRefused, match="not one this hub issued"):
        hub.registry.enroll("hospital-a." + "A" * 43, request)
    with pytest.raises(EnrollmentRefused, match="malformed"):
        hub.registry.enroll("no token at all", request)


def joined_site(hub: Hub, folder: Path, name: str = "hospital-a") -> TlsBundle:
    token = hub.registry.add_site(name)
    join(folder, hub=hub.address, token=token.token, expected_fingerprint=token.fingerprint)
    return TlsBundle.load(folder / "identity")


def test_clients_certificates_are_signed_only_for_the_sites_own_clients(
    hub: Hub, tmp_path: Path
) -> None:
    bundle = joined_site(hub, tmp_path / "a")
    api = HubApiClient(hub.address, bundle.ca_pem, bundle)
    offered = api.call("GET", "/v1/run")
    assert offered["clients"] == [0, 1]
    keys, requests = {}, {}
    for index in (0, 1):
        keys[index], request = new_key_and_request(f"client-{index}")
        requests[str(index)] = request.decode()
    answer = api.call("POST", "/v1/run/certificates", {"run": "consortium", "requests": requests})
    for index in (0, 1):
        cert = answer["certificates"][str(index)].encode()
        assert Identity.from_certificate(cert) == Identity("client", index)
    _, request = new_key_and_request("client-2")  # hospital-b's client
    with pytest.raises(HubRefused, match="client '2', which it does not run") as refused:
        api.call(
            "POST",
            "/v1/run/certificates",
            {"run": "consortium", "requests": {"2": request.decode()}},
        )
    assert refused.value.reason == "WrongName"


def test_a_revoked_site_is_refused_at_its_next_call(hub: Hub, tmp_path: Path) -> None:
    bundle = joined_site(hub, tmp_path / "a")
    api = HubApiClient(hub.address, bundle.ca_pem, bundle)
    assert api.call("GET", "/v1/run")["name"] == "consortium"
    hub.registry.revoke("hospital-a")
    with pytest.raises(HubRefused, match="was revoked at") as refused:
        api.call("GET", "/v1/run")
    assert refused.value.reason == "Revoked"
    assert json.loads(hub.registry.revoked_path.read_text()) == {"revoked": ["hospital-a"]}
    with pytest.raises(EnrollmentRefused, match="stays revoked"):
        hub.registry.add_site("hospital-a")


def test_a_renewed_certificate_replaces_the_old_one(hub: Hub, tmp_path: Path) -> None:
    bundle = joined_site(hub, tmp_path / "a")
    api = HubApiClient(hub.address, bundle.ca_pem, bundle)
    key, request = new_key_and_request("hospital-a")
    renewed = api.call("POST", "/v1/renew", {"request": request.decode()})["certificate"]
    fresh = TlsBundle(bundle.ca_pem, renewed.encode(), key)
    assert HubApiClient(hub.address, bundle.ca_pem, fresh).call("GET", "/v1/run")["clients"]
    # Renewing again keeps only the latest few serials; the first one still works until then.
    assert api.call("GET", "/v1/run")["clients"] == [0, 1]


def test_an_agent_renews_its_certificate_at_half_its_life(
    hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    joined_site(hub, tmp_path / "a")
    policy = policy_file(tmp_path, parse_manifest(RUN))
    agent = SiteAgent(tmp_path / "a", policy)
    assert agent.renew_if_due() is False  # fresh
    before = certificate_facts(agent.bundle.cert_pem)[1]
    import fedcore.sites.site as site_module

    real = site_module.certificate_facts

    def aged(cert_pem: bytes) -> Any:
        name, serial, start, end = real(cert_pem)
        return name, serial, start - (end - start), end - (end - start) / 2 - (end - start)

    monkeypatch.setattr(site_module, "certificate_facts", aged)
    assert agent.renew_if_due() is True
    assert certificate_facts(agent.bundle.cert_pem)[1] != before
    assert TlsBundle.load(tmp_path / "a" / "identity").cert_pem == agent.bundle.cert_pem


@pytest.mark.parametrize(
    ("floor", "reason", "words"),
    [
        ({"maxEpsilon": 5.0}, "Epsilon", "epsilon"),
        ({"minNoiseMultiplier": 3.0}, "NoiseMultiplier", "3"),
        ({"protocols": ["fedavg"]}, "Protocol", "dp-fedavg"),
        ({"secureAggregation": True}, "SecureAggregation", "secure aggregation"),
    ],
)
def test_a_floor_that_refuses_the_run_is_heard_on_both_sides(
    hub: Hub, tmp_path: Path, floor: dict[str, Any], reason: str, words: str
) -> None:
    joined_site(hub, tmp_path / "a")
    run = parse_manifest(RUN)
    agent = SiteAgent(tmp_path / "a", policy_file(tmp_path, run, **floor))
    with pytest.raises(SiteRefused) as refused:
        agent.review(agent.fetch_run())
    assert refused.value.reason == reason
    assert words in str(refused.value)
    refusals = [fields for event, fields in hub.events if event == "site_refused"]
    assert refusals == [{"site": "hospital-a", "reason": reason, "message": str(refused.value)}]


def test_a_spec_changed_after_approval_is_refused_on_both_sides(hub: Hub, tmp_path: Path) -> None:
    joined_site(hub, tmp_path / "a")
    approved = json.loads(json.dumps(RUN))
    approved["spec"]["rounds"] = 10  # what the site reviewed; the hub now serves 15
    agent = SiteAgent(tmp_path / "a", policy_file(tmp_path, parse_manifest(approved)))
    with pytest.raises(SiteRefused, match="changed after") as refused:
        agent.review(agent.fetch_run())
    assert refused.value.reason == "SpecChanged"
    assert spec_digest(parse_manifest(RUN)) in str(refused.value)
    assert [f["reason"] for e, f in hub.events if e == "site_refused"] == ["SpecChanged"]
    # The same spec written differently (a default spelled out, keys reordered) is the same.
    same = json.loads(json.dumps(RUN))
    same["spec"]["seed"] = 0
    same["spec"] = dict(reversed(list(same["spec"].items())))
    assert spec_digest(parse_manifest(same)) == spec_digest(parse_manifest(RUN))
    agent = SiteAgent(tmp_path / "a", policy_file(tmp_path, parse_manifest(same)))
    run, binding = agent.review(agent.fetch_run())
    assert binding.digest == spec_digest(run)


# --------------------------------------------------------------------------- the router


def tls_pair(folder: Path) -> tuple[TlsBundle, TlsBundle]:
    ca = RunCa.generate("relay")
    return ca.issue("client-1"), ca.issue("client-2")


def test_the_router_reads_the_name_a_caller_asks_for_and_refuses_others(tmp_path: Path) -> None:
    asked: list[str] = []
    refused: list[tuple[str, str]] = []

    def route(name: str) -> Any:
        asked.append(name)
        return None if name != "server.fedcore.invalid" else (lambda c: c.close())

    router = SniRouter("127.0.0.1:0", route, on_refused=lambda a, w: refused.append((a, w)))
    router.start()
    try:
        for name in ("server.fedcore.invalid", "kdc.fedcore.invalid"):
            context = ssl.create_default_context()
            with (
                socket.create_connection(("127.0.0.1", router.port)) as raw,
                pytest.raises((ssl.SSLError, OSError)),
            ):
                context.wrap_socket(raw, server_hostname=name)
        with socket.create_connection(("127.0.0.1", router.port)) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\n\r\n")  # not TLS: closed unread (reset)
            with contextlib.suppress(ConnectionResetError):
                assert raw.recv(10) == b""
        deadline = time.monotonic() + 5
        while len(refused) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        router.stop()
    assert asked == ["server.fedcore.invalid", "kdc.fedcore.invalid"]
    assert [a for a, _ in refused] == ["kdc.fedcore.invalid", "nothing readable"]


def tls_records(stream: bytes) -> list[int]:
    """The content types of a byte stream that must be TLS records end to end."""
    kinds = []
    at = 0
    while at < len(stream):
        header = stream[at : at + 5]
        assert len(header) == 5, "a truncated record header"
        kind, version, length = header[0], header[1:3], int.from_bytes(header[3:5], "big")
        assert kind in (20, 21, 22, 23), f"byte {at} starts no TLS record"
        assert version in (b"\x03\x01", b"\x03\x03") and length <= 2**14 + 256
        kinds.append(kind)
        at += 5 + length
    return kinds


def test_a_relay_carries_only_the_two_parties_ciphertext(tmp_path: Path) -> None:
    """client-1 reaches client-2, which only dials out, through a router and its dial-back;
    every byte the relay carries is a TLS record of their own end-to-end session."""
    one, two = tls_pair(tmp_path)
    secret = b"the plaintext of a peer message " * 64
    broker = TunnelBroker(lambda target: "site-b" if target.startswith("client-2.") else None)
    seen: list[bytes] = []

    def recording_route(name: str) -> Any:
        if not name.startswith("client-2."):
            return None
        return lambda connection: broker.call(name, connection)

    router = SniRouter("127.0.0.1:0", recording_route, broker=broker)
    router.start()
    # client-2 serves TLS on a local port it never exposes; its site dials back for it.
    listener = socket.create_server(("127.0.0.1", 0))
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for name, data in (("tls.crt", two.cert_pem), ("tls.key", two.key_pem)):
        (tmp_path / name).write_bytes(data)
    server_context.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    server_context.load_verify_locations(cadata=two.ca_pem.decode())
    server_context.verify_mode = ssl.CERT_REQUIRED
    got: list[bytes] = []

    def serve_two() -> None:
        connection, _ = listener.accept()
        with server_context.wrap_socket(connection, server_side=True) as secure:
            data = b""
            while len(data) < len(secret):
                data += secure.recv(65536)
            got.append(data)
            secure.sendall(b"welcome")

    def site_of_two() -> None:
        ((token, _target),) = broker.requests("site-b", timeout=10)
        back = dial(f"127.0.0.1:{router.port}")
        back.sendall(b"FCTUNNEL " + token.encode() + b"\n")
        local = dial(f"127.0.0.1:{listener.getsockname()[1]}")
        back.settimeout(None)
        local.settimeout(None)
        tap = _Tap(local)
        splice(back, tap.outer)
        seen.append(tap.upstream())

    threads = [threading.Thread(target=serve_two), threading.Thread(target=site_of_two)]
    for thread in threads:
        thread.start()
    for name, data in (("c1.crt", one.cert_pem), ("c1.key", one.key_pem)):
        (tmp_path / name).write_bytes(data)
    context = ssl.create_default_context(cadata=one.ca_pem.decode())
    context.load_cert_chain(tmp_path / "c1.crt", tmp_path / "c1.key")
    with (
        socket.create_connection(("127.0.0.1", router.port)) as raw,
        context.wrap_socket(raw, server_hostname="client-2.fedcore.invalid") as secure,
    ):
        secure.sendall(secret)
        assert secure.recv(7) == b"welcome"
    for thread in threads:
        thread.join(10)
    router.stop()
    assert got == [secret]
    assert broker.relayed == 1
    (upstream,) = seen
    kinds = tls_records(upstream)
    assert kinds[0] == 22 and 23 in kinds  # a handshake, then application data
    assert b"plaintext of a peer message" not in upstream


class _Tap:
    """A socket pair in front of ``inner`` that records what passes toward it."""

    def __init__(self, inner: socket.socket) -> None:
        self.outer, mine = socket.socketpair()
        self._recorded = bytearray()
        self._done = threading.Event()

        def forward() -> None:
            try:
                while chunk := mine.recv(65536):
                    self._recorded += chunk
                    inner.sendall(chunk)
            except OSError:
                pass
            self._done.set()

        def backward() -> None:
            try:
                while chunk := inner.recv(65536):
                    mine.sendall(chunk)
            except OSError:
                pass
            with contextlib.suppress(OSError):
                mine.shutdown(socket.SHUT_WR)

        threading.Thread(target=forward, daemon=True).start()
        threading.Thread(target=backward, daemon=True).start()

    def upstream(self) -> bytes:
        self._done.wait(10)
        return bytes(self._recorded)


def test_read_server_name_handles_a_dial_back_line() -> None:
    left, right = socket.socketpair()
    left.sendall(b"FCTUNNEL " + b"ab" * 32 + b"\nrest")
    assert read_server_name(right, 2) == b"ab" * 32
    assert right.recv(4) == b"rest"  # only the line was consumed
    left.sendall(b"\x00\x01 junk")
    with pytest.raises(ValueError, match=r"not TLS|neither"):
        read_server_name(right, 2)


def test_the_router_holds_at_most_its_connection_limit() -> None:
    refused: list[str] = []
    router = SniRouter(
        "127.0.0.1:0",
        lambda name: None,
        hello_seconds=5,
        max_connections=1,
        on_refused=lambda asked, why: refused.append(why),
    )
    router.start()
    try:
        held = socket.create_connection(("127.0.0.1", router.port))  # says nothing yet
        time.sleep(0.2)
        with (
            socket.create_connection(("127.0.0.1", router.port)) as extra,
            contextlib.suppress(ConnectionResetError),
        ):
            assert extra.recv(1) == b""  # closed at once
        held.close()
        deadline = time.monotonic() + 10
        while len(refused) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        router.stop()
    assert refused[0] == "over its connection limit"
    assert "closed before its ClientHello" in refused[1]  # the held one, once it hung up


def test_a_sites_refusal_is_one_line_in_the_hubs_log(hub: Hub, tmp_path: Path) -> None:
    bundle = joined_site(hub, tmp_path / "a")
    api = HubApiClient(hub.address, bundle.ca_pem, bundle)
    forged = "no\n2026-11-26 hub INFO fedcore.sites.hub: Site hospital-b approved run consortium."
    api.call(
        "POST",
        "/v1/run/refusal",
        {"run": "consortium", "reason": "Epsilon\r\n", "message": forged},
    )
    (event,) = [fields for name, fields in hub.events if name == "site_refused"]
    assert "\n" not in event["message"] and "\r" not in event["reason"]
    assert event["message"].startswith("no 2026-11-26 hub INFO")


def test_an_agent_renews_its_clients_certificates_at_half_their_life(
    hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    joined_site(hub, tmp_path / "a")
    agent = SiteAgent(tmp_path / "a", policy_file(tmp_path, parse_manifest(RUN)))
    assert agent.renew_clients_if_due() is False  # serving nothing yet
    assert hub.endpoint.run is not None
    run_ca = hub.endpoint.run.ca.cert_pem
    work = tmp_path / "work"
    agent._issue_client_bundles("consortium", [0, 1], run_ca, work)
    agent._serving = ("consortium", [0, 1], run_ca, work)
    before = {i: TlsBundle.load(work / "pki" / f"client-{i}") for i in (0, 1)}
    assert agent.renew_clients_if_due() is False  # fresh
    import fedcore.sites.site as site_module

    real = site_module.certificate_facts

    def aged(cert_pem: bytes) -> Any:
        name, serial, start, end = real(cert_pem)
        return name, serial, start - (end - start), end - (end - start)

    monkeypatch.setattr(site_module, "certificate_facts", aged)
    assert agent.renew_clients_if_due() is True
    for index in (0, 1):
        renewed = before[index].renewed(work / "pki" / f"client-{index}")
        assert renewed is not None and renewed.key_pem != before[index].key_pem
        assert Identity.from_certificate(renewed.cert_pem) == Identity("client", index)
        assert renewed.ca_pem == run_ca
    assert [f["clients"] for e, f in hub.events if e == "site_certificates"] == [2, 2]


def test_a_serving_agent_reports_its_clients_to_the_hub_and_bad_counts_are_refused(
    hub: Hub, tmp_path: Path
) -> None:
    # Prepare: hospital-a serves the run's clients 0 and 1: one still runs, one ended well.
    import subprocess
    import sys

    bundle = joined_site(hub, tmp_path / "a")
    agent = SiteAgent(tmp_path / "a", policy_file(tmp_path, parse_manifest(RUN)))
    agent._serving = (RUN["metadata"]["name"], [0, 1], b"", tmp_path / "work")
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(30)
    agent.children = {0: running, 1: done}
    try:
        # Execute
        agent.report_clients()
    finally:
        running.kill()
        running.wait(10)
    # Assert: the hub heard the site's counts, and when it last called.
    reports = [fields for event, fields in hub.events if event == "site_clients"]
    assert reports == [{"site": "hospital-a", "total": 2, "ready": 1, "succeeded": 1}]
    assert time.time() - hub.endpoint.last_seen["hospital-a"] < 30
    # Counts that are not whole numbers within the site's clients are dropped; no counts at
    # all are refused with a reason.
    api = HubApiClient(hub.address, bundle.ca_pem, bundle)
    body = {"run": RUN["metadata"]["name"], "clients": {"total": 9, "ready": True, "x": 1}}
    api.call("POST", "/v1/run/clients", body)
    assert [f for e, f in hub.events if e == "site_clients"][-1] == {"site": "hospital-a"}
    with pytest.raises(HubRefused) as refused:
        api.call("POST", "/v1/run/clients", {"run": RUN["metadata"]["name"], "clients": [1]})
    assert refused.value.reason == "BadRequest" and refused.value.status == 403

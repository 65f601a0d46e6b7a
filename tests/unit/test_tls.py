"""Tests for fedcore.transport._tls: the per-run CA, leaf bundles, identities and real mTLS."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import DNSName, PolicyBuilder, Store

from fedcore.errors import TransportError
from fedcore.transport import (
    CallContext,
    Identity,
    Limits,
    Payload,
    RemoteError,
    RpcClient,
    RpcServer,
    RunCa,
    TlsBundle,
    certificate_facts,
    fingerprint,
    issue_run_bundles,
    new_key_and_request,
)

SERVICE = "fedcore.test.Echo"
METHOD = f"/{SERVICE}/WhoAmI"


@pytest.fixture(scope="module")
def run_ca() -> RunCa:
    return RunCa.generate("test-run")


@pytest.fixture(scope="module")
def other_ca() -> RunCa:
    return RunCa.generate("test-run")


def _cert(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def _common_name(certificate: x509.Certificate) -> str:
    return str(certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


def test_run_ca_leaf_verifies_against_its_ca(run_ca: RunCa) -> None:
    # Prepare
    bundle = run_ca.issue("client-3")
    leaf = _cert(bundle.cert_pem)

    # Execute
    leaf.verify_directly_issued_by(_cert(run_ca.cert_pem))

    # Assert
    assert bundle.ca_pem == run_ca.cert_pem


def test_run_ca_leaf_passes_webpki_server_and_client_policies(run_ca: RunCa) -> None:
    # Prepare
    bundle = run_ca.issue("server", dns_names=["server.ns.svc"])
    leaf = _cert(bundle.cert_pem)
    builder = PolicyBuilder().store(Store([_cert(run_ca.cert_pem)]))

    # Execute
    server_chain = builder.build_server_verifier(DNSName("server.ns.svc")).verify(leaf, [])
    client = builder.build_client_verifier().verify(leaf, [])

    # Assert
    assert server_chain[-1] == _cert(run_ca.cert_pem)
    assert client.chain[0] == leaf


def test_run_ca_leaf_rejected_by_another_run_ca(run_ca: RunCa, other_ca: RunCa) -> None:
    # Prepare
    leaf = _cert(run_ca.issue("client-0").cert_pem)

    # Execute / Assert
    with pytest.raises(InvalidSignature):
        leaf.verify_directly_issued_by(_cert(other_ca.cert_pem))


def test_run_ca_leaf_rejected_by_differently_named_ca(run_ca: RunCa) -> None:
    # Prepare
    leaf = _cert(run_ca.issue("client-0").cert_pem)
    stranger = RunCa.generate("another-run")

    # Execute / Assert
    with pytest.raises(ValueError, match="Issuer"):
        leaf.verify_directly_issued_by(_cert(stranger.cert_pem))


def test_run_ca_generate_ca_extensions(run_ca: RunCa) -> None:
    # Prepare
    certificate = _cert(run_ca.cert_pem)

    # Execute
    constraints = certificate.extensions.get_extension_for_class(x509.BasicConstraints)
    usage = certificate.extensions.get_extension_for_class(x509.KeyUsage)

    # Assert
    assert constraints.critical
    assert constraints.value.ca
    assert constraints.value.path_length == 0
    assert usage.value.key_cert_sign
    assert usage.value.crl_sign
    assert not usage.value.digital_signature
    assert _common_name(certificate) == "fedcore run test-run CA"
    assert certificate.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == (
        "fedcore"
    )
    assert certificate.issuer == certificate.subject
    assert isinstance(certificate.public_key(), ec.EllipticCurvePublicKey)
    certificate.verify_directly_issued_by(certificate)


def test_run_ca_issue_leaf_extensions(run_ca: RunCa) -> None:
    # Prepare
    bundle = run_ca.issue(
        "server", dns_names=["run-server.ns.svc", "localhost"], ip_addresses=["10.0.0.5", "::1"]
    )
    certificate = _cert(bundle.cert_pem)

    # Execute
    san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    eku = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    constraints = certificate.extensions.get_extension_for_class(x509.BasicConstraints)

    # Assert
    assert _common_name(certificate) == "server"
    assert san.get_values_for_type(x509.DNSName) == [
        "server.fedcore.invalid",
        "run-server.ns.svc",
        "localhost",
    ]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.0.0.5"),
        ipaddress.ip_address("::1"),
    ]
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://fedcore.invalid/server"
    ]
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert constraints.critical
    assert not constraints.value.ca
    assert isinstance(certificate.signature_hash_algorithm, hashes.SHA256)
    public_key = certificate.public_key()
    assert isinstance(public_key, ec.EllipticCurvePublicKey)
    assert isinstance(public_key.curve, ec.SECP256R1)
    key = serialization.load_pem_private_key(bundle.key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.public_key().public_numbers() == public_key.public_numbers()


def test_run_ca_issue_default_sans_name_only_the_party(run_ca: RunCa) -> None:
    # Prepare
    certificate = _cert(run_ca.issue("kdc").cert_pem)

    # Execute
    san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value

    # Assert: no localhost, no 127.0.0.1: nothing any other certificate also carries
    assert san.get_values_for_type(x509.DNSName) == ["kdc.fedcore.invalid"]
    assert san.get_values_for_type(x509.IPAddress) == []
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://fedcore.invalid/kdc"
    ]


def test_run_ca_issue_outsider_gets_no_party_names(run_ca: RunCa) -> None:
    # Prepare / Execute
    plain = _cert(run_ca.issue("admin").cert_pem)
    webhook = _cert(run_ca.issue("fedcore-operator", ip_addresses=["127.0.0.1"]).cert_pem)

    # Assert
    with pytest.raises(x509.ExtensionNotFound):
        plain.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    san = webhook.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == []
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == []
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]


@pytest.mark.parametrize(
    ("common_name", "dns_name"),
    [
        ("client-3", "server.fedcore.invalid"),
        ("client-3", "Server.Fedcore.Invalid"),
        ("client-3", "fedcore.invalid"),
        ("admin", "kdc.fedcore.invalid"),
    ],
)
def test_run_ca_issue_refuses_another_partys_role_name(
    run_ca: RunCa, common_name: str, dns_name: str
) -> None:
    # Execute / Assert
    with pytest.raises(TransportError, match="not its own role name"):
        run_ca.issue(common_name, dns_names=[dns_name])


def test_identity_names(run_ca: RunCa) -> None:
    # Prepare
    identity = Identity("client", 12)

    # Execute
    read = Identity.from_certificate(run_ca.issue("client-12").cert_pem)

    # Assert
    assert identity.dns_name == "client-12.fedcore.invalid"
    assert identity.uri == "spiffe://fedcore.invalid/client-12"
    assert read == identity


def test_identity_from_certificate_refuses_names_that_disagree(run_ca: RunCa) -> None:
    # Prepare: a certificate without URI names (as issued before role names) and one built
    # by hand whose URI names another party than its common name
    plain = run_ca.issue("admin").cert_pem
    key = ec.generate_private_key(ec.SECP256R1())
    mismatched = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "client-1")]))
        .issuer_name(_cert(run_ca.cert_pem).subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_cert(run_ca.cert_pem).not_valid_before_utc)
        .not_valid_after(_cert(run_ca.cert_pem).not_valid_after_utc)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier("spiffe://fedcore.invalid/server")]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
    )

    # Execute / Assert
    with pytest.raises(TransportError, match="not a fedcore identity"):
        Identity.from_certificate(plain)
    with pytest.raises(TransportError, match=r"spiffe://fedcore\.invalid/server.*disagree"):
        Identity.from_certificate(mismatched)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"common_name": ""},
        {"common_name": "c" * 65},
        {"common_name": "server", "ip_addresses": ["not-an-ip"]},
        {"common_name": "server", "dns_names": ["bücher.example"]},
        {"common_name": "server", "dns_names": [""]},
        {"common_name": "server", "valid_days": 0},
    ],
)
def test_run_ca_issue_rejects_bad_arguments(run_ca: RunCa, kwargs: dict[str, Any]) -> None:
    # Prepare
    common_name = kwargs.pop("common_name")

    # Execute / Assert
    with pytest.raises(TransportError):
        run_ca.issue(common_name, **kwargs)


def test_run_ca_generate_long_run_name_fits_common_name() -> None:
    # Prepare
    run_name = "r" * 63

    # Execute
    ca = RunCa.generate(run_name)

    # Assert
    common_name = _common_name(_cert(ca.cert_pem))
    assert len(common_name) <= 64
    assert common_name.startswith("fedcore run rrr")
    assert common_name.endswith(" CA")


def test_run_ca_generate_rejects_empty_run_name() -> None:
    # Execute / Assert
    with pytest.raises(TransportError, match="run name"):
        RunCa.generate("")


def test_run_ca_pem_round_trip(run_ca: RunCa) -> None:
    # Prepare
    cert_pem, key_pem = run_ca.to_pem()

    # Execute
    restored = RunCa.from_pem(cert_pem, key_pem)
    leaf = _cert(restored.issue("client-1").cert_pem)

    # Assert
    assert restored.cert_pem == run_ca.cert_pem
    leaf.verify_directly_issued_by(_cert(run_ca.cert_pem))


def test_run_ca_from_pem_rejects_mismatched_key(run_ca: RunCa, other_ca: RunCa) -> None:
    # Prepare
    cert_pem, _ = run_ca.to_pem()
    _, other_key_pem = other_ca.to_pem()

    # Execute / Assert
    with pytest.raises(TransportError, match="does not match"):
        RunCa.from_pem(cert_pem, other_key_pem)


def test_run_ca_from_pem_rejects_leaf_certificate(run_ca: RunCa) -> None:
    # Prepare
    bundle = run_ca.issue("server")

    # Execute / Assert
    with pytest.raises(TransportError, match="not a CA"):
        RunCa.from_pem(bundle.cert_pem, bundle.key_pem)


def test_run_ca_from_pem_rejects_garbage() -> None:
    # Execute / Assert
    with pytest.raises(TransportError, match="PEM"):
        RunCa.from_pem(b"not pem", b"not pem")


@pytest.mark.parametrize(
    ("common_name", "identity"),
    [
        ("server", Identity("server", None)),
        ("kdc", Identity("kdc", None)),
        ("runner", Identity("runner", None)),
        ("client-0", Identity("client", 0)),
        ("client-7", Identity("client", 7)),
        ("client-999", Identity("client", 999)),
    ],
)
def test_identity_parse_round_trip(common_name: str, identity: Identity) -> None:
    # Execute
    parsed = Identity.parse(common_name)

    # Assert
    assert parsed == identity
    assert parsed.common_name == common_name


@pytest.mark.parametrize(
    "common_name",
    [
        "client-",
        "client-x",
        "client-01",
        "client--1",
        "client-1 ",
        " server",
        "client-1\n",
        "client-\u0663",
        "client-1234567890",
        "client",
        "Server",
        "admin",
        "",
    ],
)
def test_identity_parse_rejects_unknown(common_name: str) -> None:
    # Execute / Assert
    with pytest.raises(TransportError, match="not a fedcore identity"):
        Identity.parse(common_name)


@pytest.mark.parametrize(
    ("role", "index"),
    [("client", None), ("client", -1), ("client", True), ("server", 0), ("admin", None)],
)
def test_identity_init_rejects_bad_index(role: Any, index: Any) -> None:
    # Execute / Assert
    with pytest.raises(TransportError):
        Identity(role, index)


def test_issue_run_bundles_identities_and_hosts() -> None:
    # Prepare
    hosts = {"server": ["run-server.ns.svc"], "client-1": ["run-client-1.ns.svc"]}

    # Execute
    ca, bundles = issue_run_bundles("demo", num_clients=3, hosts=hosts)

    # Assert
    assert list(bundles) == ["kdc", "server", "runner", "client-0", "client-1", "client-2"]
    for common_name, bundle in bundles.items():
        certificate = _cert(bundle.cert_pem)
        certificate.verify_directly_issued_by(_cert(ca.cert_pem))
        assert _common_name(certificate) == common_name
        assert Identity.parse(common_name).common_name == common_name
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == [
            f"{common_name}.fedcore.invalid",
            *hosts.get(common_name, []),
        ]
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
            f"spiffe://fedcore.invalid/{common_name}"
        ]
    assert len({bundle.key_pem for bundle in bundles.values()}) == 6


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"num_clients": -1}, "num_clients"),
        ({"num_clients": 2, "hosts": {"client-2": ["x"]}}, "client-2"),
        ({"num_clients": 2, "hosts": {"server": "server.ns.svc"}}, "sequence"),
    ],
)
def test_issue_run_bundles_rejects_bad_arguments(kwargs: dict[str, Any], fragment: str) -> None:
    # Execute / Assert
    with pytest.raises(TransportError, match=fragment):
        issue_run_bundles("demo", **kwargs)


def test_tls_bundle_write_load_round_trip(run_ca: RunCa, tmp_path: Path) -> None:
    # Prepare
    bundle = run_ca.issue("client-2")
    directory = tmp_path / "nested" / "tls"

    # Execute
    bundle.write(directory)
    loaded = TlsBundle.load(directory)

    # Assert
    assert loaded == bundle
    assert stat.S_IMODE((directory / "tls.key").stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert sorted(path.name for path in directory.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]


def test_tls_bundle_write_replaces_existing(run_ca: RunCa, tmp_path: Path) -> None:
    # Prepare
    run_ca.issue("client-0").write(tmp_path)
    replacement = run_ca.issue("client-1")

    # Execute
    replacement.write(tmp_path)

    # Assert
    assert TlsBundle.load(tmp_path) == replacement
    assert stat.S_IMODE((tmp_path / "tls.key").stat().st_mode) == 0o600


def test_tls_bundle_load_missing_file(run_ca: RunCa, tmp_path: Path) -> None:
    # Prepare
    run_ca.issue("server").write(tmp_path)
    (tmp_path / "tls.key").unlink()

    # Execute / Assert
    with pytest.raises(TransportError, match=r"tls\.key is missing"):
        TlsBundle.load(tmp_path)


def test_tls_bundle_load_invalid_pem(run_ca: RunCa, tmp_path: Path) -> None:
    # Prepare
    run_ca.issue("server").write(tmp_path)
    (tmp_path / "tls.crt").write_bytes(b"garbage")

    # Execute / Assert
    with pytest.raises(TransportError, match=r"tls\.crt does not hold a PEM certificate"):
        TlsBundle.load(tmp_path)


def _who_am_i(request: bytes, context: grpc.ServicerContext) -> bytes:
    names = context.auth_context().get("x509_common_name", [])
    return names[0] if names else b""


@pytest.fixture(scope="module")
def mtls_port(run_ca: RunCa) -> Iterator[int]:
    bundle = run_ca.issue("server")
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"WhoAmI": grpc.unary_unary_rpc_method_handler(_who_am_i)}
    )
    server.add_generic_rpc_handlers((handler,))
    credentials = grpc.ssl_server_credentials(
        [(bundle.key_pem, bundle.cert_pem)],
        root_certificates=bundle.ca_pem,
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield port
    finally:
        server.stop(None).wait()


def _call(
    port: int, credentials: grpc.ChannelCredentials, name: str = "server.fedcore.invalid"
) -> bytes:
    options = [("grpc.ssl_target_name_override", name)]
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as channel:
        response: bytes = channel.unary_unary(METHOD)(b"", timeout=10)
        return response


def test_mtls_grpc_client_of_same_ca_gets_its_common_name(run_ca: RunCa, mtls_port: int) -> None:
    # Prepare
    bundle = run_ca.issue("client-7")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=bundle.ca_pem,
        private_key=bundle.key_pem,
        certificate_chain=bundle.cert_pem,
    )

    # Execute
    response = _call(mtls_port, credentials)

    # Assert
    assert response == b"client-7"
    assert Identity.parse(response.decode()) == Identity("client", 7)


def test_mtls_grpc_client_of_another_ca_refused(other_ca: RunCa, mtls_port: int) -> None:
    # Prepare
    bundle = other_ca.issue("client-7")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=bundle.ca_pem,
        private_key=bundle.key_pem,
        certificate_chain=bundle.cert_pem,
    )

    # Execute / Assert
    with pytest.raises(grpc.RpcError) as caught:
        _call(mtls_port, credentials)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_grpc_foreign_client_cert_refused_by_server(
    run_ca: RunCa, other_ca: RunCa, mtls_port: int
) -> None:
    # Prepare
    foreign = other_ca.issue("client-7")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=run_ca.cert_pem,
        private_key=foreign.key_pem,
        certificate_chain=foreign.cert_pem,
    )

    # Execute / Assert
    with pytest.raises(grpc.RpcError) as caught:
        _call(mtls_port, credentials)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_grpc_client_without_certificate_refused(run_ca: RunCa, mtls_port: int) -> None:
    # Prepare
    credentials = grpc.ssl_channel_credentials(root_certificates=run_ca.cert_pem)

    # Execute / Assert
    with pytest.raises(grpc.RpcError) as caught:
        _call(mtls_port, credentials)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_bundle_identity_reads_the_certificates_common_name() -> None:
    # Prepare
    _, bundles = issue_run_bundles("ident", num_clients=2)
    # Execute
    identities = {name: bundle.identity for name, bundle in bundles.items()}
    # Assert
    assert identities["client-1"] == Identity("client", 1)
    assert identities["server"] == Identity("server")
    assert identities["runner"].role == "runner"


# ------------------------------------------------------- identity on every link (RpcServer)

LIMITS = Limits(chunk_bytes=64 * 1024, max_message_bytes=1 << 20)


def _whoami(peer: Identity, request: Payload, ctx: CallContext) -> Payload:
    return Payload(meta={"caller": peer.common_name})


@pytest.fixture(scope="module")
def run_pki() -> tuple[RunCa, dict[str, TlsBundle]]:
    return issue_run_bundles("links", num_clients=2)


@contextmanager
def _serving(bundle: TlsBundle, **kwargs: Any) -> Iterator[RpcServer]:
    rejected: list[tuple[str, str, str | None]] = []
    server = RpcServer(
        "127.0.0.1:0",
        bundle,
        {"WhoAmI": _whoami, "Admin": _whoami},
        service="Server",
        limits=LIMITS,
        max_workers=4,
        on_rejected=lambda method, reason, sender: rejected.append((method, reason, sender)),
        **kwargs,
    )
    server.rejected = rejected  # type: ignore[attr-defined]
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=0)


def _ask(port: int, bundle: TlsBundle, *, peer: Identity | None = None) -> Payload:
    with RpcClient(
        f"127.0.0.1:{port}", bundle, service="Server", limits=LIMITS, peer=peer
    ) as client:
        return client.call("WhoAmI", Payload(), timeout=10, retry=False)


@pytest.mark.parametrize("impostor", ["client-1", "kdc", "runner"])
def test_rpc_client_refuses_another_partys_certificate_as_the_server(
    run_pki: tuple[RunCa, dict[str, TlsBundle]], impostor: str
) -> None:
    # Prepare: another party of the same run serves on loopback, posing as the server
    _, bundles = run_pki
    # Execute / Assert
    with _serving(bundles[impostor]) as fake, pytest.raises(RemoteError) as caught:
        _ask(fake.port, bundles["client-0"])
    assert caught.value.code == "UNAVAILABLE"
    assert "Hostname Verification Check failed" in str(caught.value)


def test_rpc_client_refuses_a_localhost_certificate_as_the_server(
    run_pki: tuple[RunCa, dict[str, TlsBundle]],
) -> None:
    # Prepare: the observed attack: a run certificate naming localhost and 127.0.0.1 (as every
    # certificate did), served at 127.0.0.1, used to pass as the server or the KDC
    ca, bundles = run_pki
    posing = ca.issue("client-1", dns_names=["localhost"], ip_addresses=["127.0.0.1"])
    with _serving(posing) as fake:
        # Execute / Assert
        for expected in (Identity("server"), Identity("kdc")):
            with pytest.raises(RemoteError) as caught:
                _ask(fake.port, bundles["client-0"], peer=expected)
            assert caught.value.code == "UNAVAILABLE"


def test_rpc_client_reaches_the_real_server_by_its_role_name(
    run_pki: tuple[RunCa, dict[str, TlsBundle]],
) -> None:
    # Prepare
    _, bundles = run_pki
    with _serving(bundles["server"]) as real:
        # Execute
        answer = _ask(real.port, bundles["client-1"])
    # Assert
    assert answer.meta == {"caller": "client-1"}


def test_rpc_client_without_peer_needs_a_service_named_after_a_role(
    run_pki: tuple[RunCa, dict[str, TlsBundle]],
) -> None:
    # Prepare
    _, bundles = run_pki
    # Execute / Assert
    with pytest.raises(TransportError, match="'Echo' is not named after a role"):
        RpcClient("127.0.0.1:1", bundles["client-0"], service="Echo", limits=LIMITS)


def test_rpc_server_refuses_a_certificate_whose_uri_disagrees(
    run_pki: tuple[RunCa, dict[str, TlsBundle]],
) -> None:
    # Prepare: signed by the run's CA, common name client-0, URI naming the server
    ca, bundles = run_pki
    ca_cert, ca_key_pem = ca.to_pem()
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    forged = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "client-0")]))
        .issuer_name(_cert(ca_cert).subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_cert(ca_cert).not_valid_before_utc)
        .not_valid_after(_cert(ca_cert).not_valid_after_utc)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier("spiffe://fedcore.invalid/server")]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    bundle = TlsBundle(
        ca_pem=ca_cert,
        cert_pem=forged.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    with _serving(bundles["server"]) as real:
        # Execute
        with pytest.raises(RemoteError) as caught:
            _ask(real.port, bundle)
        # Assert
        assert caught.value.code == "PERMISSION_DENIED"
        assert "spiffe://fedcore.invalid/server" in str(caught.value)
        assert real.rejected == [("WhoAmI", "identity", None)]  # type: ignore[attr-defined]


def test_rpc_server_refuses_a_role_a_method_does_not_take(
    run_pki: tuple[RunCa, dict[str, TlsBundle]],
) -> None:
    # Prepare: Admin takes calls from the runner only
    _, bundles = run_pki
    with _serving(bundles["server"], callers={"Admin": ["runner"]}) as real:
        with RpcClient(
            f"127.0.0.1:{real.port}", bundles["client-0"], service="Server", limits=LIMITS
        ) as client:
            # Execute
            with pytest.raises(RemoteError) as caught:
                client.call("Admin", Payload(), timeout=10, retry=False)
            allowed = client.call("WhoAmI", Payload(), timeout=10, retry=False)
        # Assert
        assert caught.value.code == "PERMISSION_DENIED"
        assert "takes calls from ['runner'] only, not from 'client-0'" in str(caught.value)
        assert allowed.meta == {"caller": "client-0"}
        assert real.rejected == [("Admin", "identity", "client-0")]  # type: ignore[attr-defined]


def test_rpc_server_refuses_callers_for_a_method_it_does_not_serve(
    run_pki: tuple[RunCa, dict[str, TlsBundle]],
) -> None:
    # Prepare
    _, bundles = run_pki
    # Execute / Assert
    with pytest.raises(TransportError, match=r"callers names \['Nope'\]"):
        RpcServer(
            "127.0.0.1:0",
            bundles["server"],
            {"WhoAmI": _whoami},
            service="Server",
            limits=LIMITS,
            callers={"Nope": ["client"]},
        )


# ------------------------------------------------------------------ requests signed by the CA


def _request(
    common_name: str,
    *,
    curve: ec.EllipticCurve | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> bytes:
    """A PEM certificate request for a fresh key on ``curve`` (P-256 unless given)."""
    key = ec.generate_private_key(curve or ec.SECP256R1())
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def _names(certificate: x509.Certificate) -> tuple[list[str], list[str]]:
    """The certificate's DNS and URI subject alternative names."""
    try:
        sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [], []
    return (
        sans.get_values_for_type(x509.DNSName),
        sans.get_values_for_type(x509.UniformResourceIdentifier),
    )


WEEK = datetime.timedelta(days=7)


def test_sign_request_gives_a_party_its_role_name_and_uri_from_the_ca(run_ca: RunCa) -> None:
    # Prepare: a request for client-3's key that asks for the server's names too
    key_pem, request_pem = new_key_and_request("client-3")
    # Execute
    cert_pem = run_ca.sign_request(request_pem, common_name="client-3", valid_for=WEEK)
    # Assert
    certificate = _cert(cert_pem)
    assert _common_name(certificate) == "client-3"
    assert _names(certificate) == (
        ["client-3.fedcore.invalid"],
        ["spiffe://fedcore.invalid/client-3"],
    )
    assert Identity.from_certificate(cert_pem) == Identity("client", 3)
    certificate.verify_directly_issued_by(run_ca.certificate)
    key = serialization.load_pem_private_key(key_pem, password=None)
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    assert certificate.public_key().public_bytes(*spki) == key.public_key().public_bytes(*spki)


def test_sign_request_never_gives_the_names_a_request_asks_for(run_ca: RunCa) -> None:
    # Prepare
    request_pem = _request(
        "client-3",
        sans=[
            x509.DNSName("server.fedcore.invalid"),
            x509.DNSName("evil.example"),
            x509.UniformResourceIdentifier("spiffe://fedcore.invalid/server"),
        ],
    )
    # Execute
    certificate = _cert(run_ca.sign_request(request_pem, common_name="client-3", valid_for=WEEK))
    # Assert
    assert _names(certificate) == (
        ["client-3.fedcore.invalid"],
        ["spiffe://fedcore.invalid/client-3"],
    )


def test_sign_request_gives_a_site_only_the_uri_given(run_ca: RunCa) -> None:
    # Prepare
    _, request_pem = new_key_and_request("north")
    # Execute
    cert_pem = run_ca.sign_request(
        request_pem,
        common_name="north",
        uri="spiffe://fedcore.invalid/site/north",
        valid_for=datetime.timedelta(hours=1),
    )
    # Assert
    certificate = _cert(cert_pem)
    assert _common_name(certificate) == "north"
    assert _names(certificate) == ([], ["spiffe://fedcore.invalid/site/north"])
    name, serial, not_before, not_after = certificate_facts(cert_pem)
    assert (name, serial) == ("north", certificate.serial_number)
    assert not_after - not_before == datetime.timedelta(hours=1, minutes=5)  # the clock skew


def test_sign_request_never_outlives_the_ca(run_ca: RunCa) -> None:
    # Prepare
    _, request_pem = new_key_and_request("north")
    # Execute
    cert_pem = run_ca.sign_request(
        request_pem, common_name="north", valid_for=datetime.timedelta(days=10_000)
    )
    # Assert
    assert certificate_facts(cert_pem)[3] == run_ca.certificate.not_valid_after_utc


def test_sign_request_refuses_a_role_name_for_a_site(run_ca: RunCa) -> None:
    # Prepare
    _, request_pem = new_key_and_request("north")
    # Execute / Assert
    with pytest.raises(TransportError, match=r"is under 'fedcore\.invalid' but is not 'north'"):
        run_ca.sign_request(
            request_pem,
            common_name="north",
            dns_names=["server.fedcore.invalid"],
            valid_for=WEEK,
        )


def test_sign_request_refuses_a_request_for_another_name(run_ca: RunCa) -> None:
    # Prepare
    _, request_pem = new_key_and_request("client-4")
    # Execute / Assert
    with pytest.raises(TransportError, match="names 'client-4', not 'client-3'"):
        run_ca.sign_request(request_pem, common_name="client-3", valid_for=WEEK)


def test_sign_request_refuses_a_request_with_no_common_name(run_ca: RunCa) -> None:
    # Prepare
    key = ec.generate_private_key(ec.SECP256R1())
    request_pem = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedcore")]))
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
    )
    # Execute / Assert
    with pytest.raises(TransportError, match="names None, not 'north'"):
        run_ca.sign_request(request_pem, common_name="north", valid_for=WEEK)


def test_sign_request_refuses_a_request_whose_signature_does_not_verify(run_ca: RunCa) -> None:
    # Prepare: the last byte of the DER is the signature's; change it
    request = x509.load_pem_x509_csr(new_key_and_request("client-3")[1])
    der = bytearray(request.public_bytes(serialization.Encoding.DER))
    der[-1] ^= 0x01
    tampered = x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM)
    # Execute / Assert
    with pytest.raises(TransportError, match="signature does not verify"):
        run_ca.sign_request(tampered, common_name="client-3", valid_for=WEEK)


@pytest.mark.parametrize(
    "request_pem",
    [
        b"not a request",
        b"-----BEGIN CERTIFICATE REQUEST-----\nZ2FyYmFnZQ==\n-----END CERTIFICATE REQUEST-----\n",
        b"",
    ],
    ids=["text", "garbage-pem", "empty"],
)
def test_sign_request_refuses_what_is_not_a_pem_request(run_ca: RunCa, request_pem: bytes) -> None:
    with pytest.raises(TransportError, match="not a PEM PKCS#10 request"):
        run_ca.sign_request(request_pem, common_name="client-3", valid_for=WEEK)


def test_sign_request_refuses_a_certificate_in_place_of_a_request(run_ca: RunCa) -> None:
    with pytest.raises(TransportError, match="not a PEM PKCS#10 request"):
        run_ca.sign_request(run_ca.cert_pem, common_name="client-3", valid_for=WEEK)


def test_sign_request_refuses_a_key_that_is_not_p256(run_ca: RunCa) -> None:
    # Prepare
    request_pem = _request("client-3", curve=ec.SECP384R1())
    # Execute / Assert
    with pytest.raises(TransportError, match="not for an EC P-256 key"):
        run_ca.sign_request(request_pem, common_name="client-3", valid_for=WEEK)


def test_new_key_and_request_makes_a_p256_key_and_a_signed_request() -> None:
    # Execute
    key_pem, request_pem = new_key_and_request("north")
    # Assert
    key = serialization.load_pem_private_key(key_pem, password=None)
    request = x509.load_pem_x509_csr(request_pem)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert isinstance(key.curve, ec.SECP256R1)
    assert request.is_signature_valid
    assert _common_name(request) == "north"  # type: ignore[arg-type]


def test_fingerprint_is_the_sha256_of_the_der(run_ca: RunCa) -> None:
    # Prepare
    der = run_ca.certificate.public_bytes(serialization.Encoding.DER)
    # Execute
    printed = fingerprint(run_ca.cert_pem)
    # Assert
    assert printed == "sha256:" + hashlib.sha256(der).hexdigest()
    assert printed != fingerprint(RunCa.generate("another").cert_pem)


@pytest.mark.parametrize("call", [fingerprint, certificate_facts])
def test_fingerprint_and_facts_refuse_what_is_not_a_certificate(call: Any) -> None:
    with pytest.raises(TransportError, match="Not a PEM certificate"):
        call(b"-----BEGIN CERTIFICATE-----\nZ2FyYmFnZQ==\n-----END CERTIFICATE-----\n")


def test_the_hub_is_a_party_with_its_own_role_name(run_ca: RunCa) -> None:
    # Execute
    hub = Identity.parse("hub")
    bundle = run_ca.issue("hub")
    # Assert
    assert hub == Identity("hub")
    assert (hub.common_name, hub.dns_name, hub.uri) == (
        "hub",
        "hub.fedcore.invalid",
        "spiffe://fedcore.invalid/hub",
    )
    assert bundle.identity == hub
    assert _names(_cert(bundle.cert_pem)) == (["hub.fedcore.invalid"], [hub.uri])
    with pytest.raises(TransportError, match="The hub identity takes no index"):
        Identity("hub", 0)


def test_a_renewed_bundle_is_taken_up_only_when_whole(tmp_path: Path) -> None:
    from fedcore.transport import RunCa, TlsBundle

    ca = RunCa.generate("renewal")
    first, second = ca.issue("client-4"), ca.issue("client-4")
    folder = tmp_path / "client-4"
    first.write(folder)
    current = TlsBundle.load(folder)
    assert current.key_matches() and current.renewed(folder) is None  # unchanged
    second.write(folder)
    assert current.renewed(folder) == second
    # Half rewritten (a new key beside the old certificate): not taken up yet.
    TlsBundle(second.ca_pem, first.cert_pem, second.key_pem).write(folder)
    assert not TlsBundle.load(folder).key_matches()
    assert current.renewed(folder) is None
    # Another party's certificate: never taken up.
    ca.issue("client-5").write(folder)
    assert current.renewed(folder) is None

"""Tests for fedcore.transport._tls: the per-run CA, leaf bundles, identities and real mTLS."""

from __future__ import annotations

import ipaddress
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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
from fedcore.transport import Identity, RunCa, TlsBundle, issue_run_bundles

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
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "run-server.ns.svc"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("10.0.0.5"),
        ipaddress.ip_address("::1"),
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


def test_run_ca_issue_default_sans(run_ca: RunCa) -> None:
    # Prepare
    certificate = _cert(run_ca.issue("kdc").cert_pem)

    # Execute
    san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value

    # Assert
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]


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
        assert san.get_values_for_type(x509.DNSName) == ["localhost", *hosts.get(common_name, [])]
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


def _call(port: int, credentials: grpc.ChannelCredentials) -> bytes:
    with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
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

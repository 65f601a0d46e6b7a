"""SecAgg+ keys: round keys, pair seeds, sealed shares, signed round keys, a whole round."""

from __future__ import annotations

import datetime
import os
import re

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.x509.oid import NameOID

from fedcore.errors import ProtocolError
from fedcore.protocols.secagg import keys
from fedcore.protocols.secagg.keys import (
    RoundKeys,
    new_self_seed,
    open_shares,
    pair_seed,
    private_from_bytes,
    round_key_statement,
    seal_shares,
    share_key,
    sign_round_keys,
    verify_round_keys,
)
from fedcore.protocols.secagg.maths import (
    SHARE_BYTES,
    combine_shares,
    mask_input,
    needed_edges,
    sharing_graph,
    split_secret,
    unmask_sum,
)
from fedcore.transport import RunCa, TlsBundle

RUN = "secagg-unit"
LOW_ORDER = b"\x01" + bytes(31)  # u = 1: a point of small order, its X25519 secret is zero


@pytest.fixture(scope="module")
def ca() -> RunCa:
    return RunCa.generate(RUN)


@pytest.fixture(scope="module")
def other_ca() -> RunCa:
    return RunCa.generate(RUN)


@pytest.fixture(scope="module")
def bundles(ca: RunCa) -> dict[int, TlsBundle]:
    return {index: ca.issue(f"client-{index}") for index in (3, 4)}


# ------------------------------------------------------------------------------ round keys


def test_round_keys_are_fresh_and_rebuildable() -> None:
    one, two = RoundKeys.new(), RoundKeys.new()
    c_public, s_public = one.public()
    assert len(c_public) == len(s_public) == 32 and c_public != s_public
    assert one.public() != two.public()
    raw = one.mask_private_bytes()
    assert len(raw) == 32
    rebuilt = private_from_bytes(raw, s_public, client=7)
    assert RoundKeys.private_from_bytes(raw).private_bytes_raw() == raw
    assert rebuilt.public_key().public_bytes_raw() == s_public
    with pytest.raises(ProtocolError, match="client 7 does not match"):
        private_from_bytes(two.mask_private_bytes(), s_public, client=7)
    with pytest.raises(ProtocolError, match="client 7 is not 32 bytes"):
        private_from_bytes(raw[:31], client=7)
    assert len(new_self_seed()) == 32 and new_self_seed() != new_self_seed()


def test_pair_seeds_agree_and_are_bound_to_their_context() -> None:
    u, v = RoundKeys.new(), RoundKeys.new()
    seed = pair_seed(u.s_private, v.public()[1], run=RUN, round=2, pair=(1, 5))
    assert len(seed) == 32
    assert pair_seed(v.s_private, u.public()[1], run=RUN, round=2, pair=(5, 1)) == seed
    others = {
        pair_seed(u.s_private, v.public()[1], run=RUN, round=3, pair=(1, 5)),
        pair_seed(u.s_private, v.public()[1], run="other", round=2, pair=(1, 5)),
        pair_seed(u.s_private, v.public()[1], run=RUN, round=2, pair=(1, 6)),
        share_key(u.s_private, v.public()[1], run=RUN, round=2, pair=(1, 5)),
    }
    assert seed not in others and len(others) == 4
    assert share_key(u.c_private, v.public()[0], run=RUN, round=2, pair=(1, 5)) == share_key(
        v.c_private, u.public()[0], run=RUN, round=2, pair=(5, 1)
    )


@pytest.mark.parametrize(
    ("peer", "message"),
    [
        (bytes(32), "pair 1-5 is not 32 bytes"),
        (b"\x09" * 31, "pair 1-5 is not 32 bytes"),
        (LOW_ORDER, "Key agreement for pair 1-5 failed"),
    ],
)
def test_key_agreement_refuses_bad_peer_keys(peer: bytes, message: str) -> None:
    for derive in (pair_seed, share_key):
        with pytest.raises(ProtocolError, match=message):
            derive(RoundKeys.new().s_private, peer, run=RUN, round=0, pair=(1, 5))


def test_key_agreement_refuses_bad_context() -> None:
    key, peer = RoundKeys.new().s_private, RoundKeys.new().public()[1]
    with pytest.raises(ProtocolError, match="distinct"):
        pair_seed(key, peer, run=RUN, round=0, pair=(2, 2))
    with pytest.raises(ProtocolError, match="round"):
        pair_seed(key, peer, run=RUN, round=-1, pair=(1, 2))
    with pytest.raises(ProtocolError, match="run"):
        pair_seed(key, peer, run="", round=0, pair=(1, 2))


# ------------------------------------------------------------------------------ sealed shares


def _sealed(key: bytes, **context: object) -> tuple[bytes, bytes, bytes]:
    first, second = os.urandom(SHARE_BYTES), os.urandom(SHARE_BYTES)
    arguments: dict[str, object] = {"run": RUN, "round": 4, "sender": 2, "receiver": 9}
    arguments |= context
    sealed = seal_shares(key, self_share=first, mask_share=second, **arguments)  # type: ignore[arg-type]
    return sealed, first, second


def test_sealed_shares_open_only_where_they_were_sealed_for() -> None:
    key = os.urandom(32)
    sealed, first, second = _sealed(key)
    context: dict[str, object] = {"run": RUN, "round": 4, "sender": 2, "receiver": 9}
    assert open_shares(key, ciphertext=sealed, **context) == (first, second)  # type: ignore[arg-type]
    assert _sealed(key)[0][:12] != sealed[:12]  # a fresh nonce each time
    flipped = bytearray(sealed)
    flipped[20] ^= 1
    wrong: list[tuple[bytes, bytes, dict[str, object]]] = [
        (key, sealed, {"receiver": 8}),
        (key, sealed, {"round": 5}),
        (key, sealed, {"run": "other"}),
        (key, sealed, {"sender": 3}),
        (os.urandom(32), sealed, {}),
        (key, bytes(flipped), {}),
    ]
    for k, ciphertext, change in wrong:
        arguments = context | change
        sender = arguments["sender"]
        with pytest.raises(ProtocolError, match=f"from client {sender} to client"):
            open_shares(k, ciphertext=ciphertext, **arguments)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="from client 2 are truncated"):
        open_shares(key, ciphertext=sealed[:27], **context)  # type: ignore[arg-type]


def test_well_sealed_but_malformed_shares_are_refused() -> None:
    key = os.urandom(32)
    context = keys._shares_context(RUN, 4, 2, 9)
    for plain in (b"junk", keys._frame(b"a" * 66, b"b" * 65), keys._frame(b"a" * 66)):
        nonce = os.urandom(12)
        sealed = nonce + AESGCM(key).encrypt(nonce, plain, context)
        with pytest.raises(ProtocolError, match="from client 2"):
            open_shares(key, run=RUN, round=4, sender=2, receiver=9, ciphertext=sealed)
    with pytest.raises(ProtocolError, match="share is not 66 bytes"):
        seal_shares(
            key, run=RUN, round=4, sender=2, receiver=9, self_share=b"x", mask_share=b"y" * 66
        )


# ------------------------------------------------------------------------------ signatures


def _statement(client: int = 3, round: int = 6) -> bytes:
    c_public, s_public = RoundKeys.new().public()
    return round_key_statement(RUN, round, client, c_public, s_public)


def test_statements_are_unambiguous() -> None:
    c_public, s_public = RoundKeys.new().public()
    one = round_key_statement(RUN, 1, 2, c_public, s_public)
    assert one == round_key_statement(RUN, 1, 2, c_public, s_public)
    variants = {
        round_key_statement(RUN + "x", 1, 2, c_public, s_public),
        round_key_statement(RUN, 2, 2, c_public, s_public),
        round_key_statement(RUN, 1, 3, c_public, s_public),
        round_key_statement(RUN, 1, 2, s_public, c_public),
    }
    assert one not in variants and len(variants) == 4
    assert keys._statement_client(one) == 2
    with pytest.raises(ProtocolError, match="client 2"):
        round_key_statement(RUN, 1, 2, bytes(32), s_public)
    with pytest.raises(ProtocolError, match="client 2"):
        round_key_statement(RUN, 1, 2, c_public, s_public[:5])


def test_a_good_signature_verifies(bundles: dict[int, TlsBundle], ca: RunCa) -> None:
    statement = _statement(3)
    signature = sign_round_keys(bundles[3].key_pem, statement)
    verify_round_keys(bundles[3].cert_pem, ca.cert_pem, 3, statement, signature)


def test_bad_signatures_fail(bundles: dict[int, TlsBundle], ca: RunCa, other_ca: RunCa) -> None:
    statement = _statement(3)
    signature = sign_round_keys(bundles[3].key_pem, statement)
    cert = bundles[3].cert_pem

    def fails(message: str, *args: object, **kwargs: object) -> None:
        with pytest.raises(ProtocolError, match=message):
            verify_round_keys(*args, **kwargs)  # type: ignore[arg-type]

    # Another client's certificate, for the same claimed client or its own.
    fails(
        "names 'client-4', not 'client-3'",
        bundles[4].cert_pem,
        ca.cert_pem,
        3,
        statement,
        signature,
    )
    fails(
        "statement checked for client 4 names client 3",
        bundles[4].cert_pem,
        ca.cert_pem,
        4,
        statement,
        signature,
    )
    statement_4 = _statement(4)
    fails(
        "signature of client 4 does not verify",
        bundles[4].cert_pem,
        ca.cert_pem,
        4,
        statement_4,
        sign_round_keys(bundles[3].key_pem, statement_4),
    )
    # A certificate of another CA, even for the right name; the right one against another CA.
    foreign = other_ca.issue("client-3")
    fails(
        "client 3 was not issued by the run's CA",
        foreign.cert_pem,
        ca.cert_pem,
        3,
        statement,
        sign_round_keys(foreign.key_pem, statement),
    )
    fails("client 3 was not issued", cert, other_ca.cert_pem, 3, statement, signature)
    # A statement for another round, a flipped bit in the statement or the signature.
    fails("client 3 does not verify", cert, ca.cert_pem, 3, _statement(3, round=7), signature)
    flipped = bytearray(statement)
    flipped[-1] ^= 1
    fails("client 3 does not verify", cert, ca.cert_pem, 3, bytes(flipped), signature)
    bad = bytearray(signature)
    bad[len(bad) // 2] ^= 0x10
    fails("client 3 does not verify", cert, ca.cert_pem, 3, statement, bytes(bad))
    # Outside the certificate's validity; malformed inputs.
    late = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=400)
    fails("not valid at", cert, ca.cert_pem, 3, statement, signature, now=late)
    fails("client 3 is not a PEM certificate", b"junk", ca.cert_pem, 3, statement, signature)
    fails("statement of client 3 is malformed", cert, ca.cert_pem, 3, b"x" + statement, signature)
    fails("client 3 does not verify", cert, ca.cert_pem, 3, statement, b"")


def test_a_certificate_without_the_party_uri_fails(ca: RunCa) -> None:
    """A certificate of the CA named client-3 but without its URI name is not a party's."""
    cert_pem, ca_key_pem = ca.to_pem()
    key = ec.generate_private_key(ec.SECP256R1())
    certificate = _leaf(ca, ca_key_pem, key.public_key(), uri=False)
    statement = _statement(3)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with pytest.raises(ProtocolError, match=re.escape("checked for client 3 is not a party's")):
        verify_round_keys(certificate, cert_pem, 3, statement, sign_round_keys(key_pem, statement))


def test_an_ed25519_identity_signs_too(ca: RunCa) -> None:
    cert_pem, ca_key_pem = ca.to_pem()
    key = ed25519.Ed25519PrivateKey.generate()
    certificate = _leaf(ca, ca_key_pem, key.public_key(), uri=True)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    statement = _statement(3)
    signature = sign_round_keys(key_pem, statement)
    assert len(signature) == 64
    verify_round_keys(certificate, cert_pem, 3, statement, signature)
    with pytest.raises(ProtocolError, match="client 3 does not verify"):
        verify_round_keys(certificate, cert_pem, 3, _statement(3, round=1), signature)
    with pytest.raises(ProtocolError, match="not an unencrypted PEM"):
        sign_round_keys(b"junk", statement)


def _leaf(
    ca: RunCa,
    ca_key_pem: bytes,
    public: ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey,
    *,
    uri: bool,
) -> bytes:
    """A client-3 leaf the CA signs by hand (an EC key without its URI, or an Ed25519 key)."""
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    now = datetime.datetime.now(datetime.UTC)
    names: list[x509.GeneralName] = [x509.DNSName("client-3.fedcore.invalid")]
    if uri:
        names.append(x509.UniformResourceIdentifier("spiffe://fedcore.invalid/client-3"))
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "client-3")]))
        .issuer_name(ca.certificate.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return certificate.public_bytes(serialization.Encoding.PEM)


# ------------------------------------------------------------------------------ a whole round


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_round_with_dropouts_at_every_stage_sums_exactly(seed: int) -> None:
    """Real keys end to end: clients advertise signed keys, seal their shares of b and of the
    s key to their neighbours, mask; some drop before uploading (the server rebuilds their s
    key, checks it against its public key, and derives the pair seeds it needs), some after
    uploading (their self seed b is rebuilt); the server gets the survivors' exact sum."""
    rng = np.random.default_rng(seed)
    ca = RunCa.generate(RUN)
    n, degree, threshold, bits, size, round_ = 9, 6, 3, 20, 33, 2
    clients = list(range(n))
    bundles = {u: ca.issue(f"client-{u}") for u in clients[:3]}  # a few signers suffice
    graph = sharing_graph(clients, degree, rng.bytes(32))
    round_keys = {u: RoundKeys.new() for u in clients}
    public = {u: round_keys[u].public() for u in clients}
    for u, bundle in bundles.items():  # signed advertisements, checked by every peer
        statement = round_key_statement(RUN, round_, u, *public[u])
        signature = sign_round_keys(bundle.key_pem, statement)
        verify_round_keys(bundle.cert_pem, ca.cert_pem, u, statement, signature)

    # Sharing: u seals (share of b_u, share of s_u) for each neighbour v under their c key.
    self_seeds = {u: new_self_seed() for u in clients}
    inbox: dict[int, dict[int, bytes]] = {v: {} for v in clients}
    for u in clients:
        b_shares = split_secret(self_seeds[u], threshold, graph[u])
        s_shares = split_secret(round_keys[u].mask_private_bytes(), threshold, graph[u])
        for v in graph[u]:
            key = share_key(
                round_keys[u].c_private, public[v][0], run=RUN, round=round_, pair=(u, v)
            )
            inbox[v][u] = seal_shares(
                key,
                run=RUN,
                round=round_,
                sender=u,
                receiver=v,
                self_share=b_shares[v],
                mask_share=s_shares[v],
            )

    # Masking with the pair seeds from the s keys.
    inputs = {u: rng.integers(0, 2**bits, size=size, dtype=np.uint64) for u in clients}
    uploads = {}
    for u in clients:
        pairs = {
            v: pair_seed(round_keys[u].s_private, public[v][1], run=RUN, round=round_, pair=(u, v))
            for v in graph[u]
        }
        uploads[u] = mask_input(
            inputs[u], client=u, self_seed=self_seeds[u], pair_seeds=pairs, bits=bits
        )
    before = set(rng.choice(clients, size=2, replace=False).tolist())
    after = set(rng.choice([u for u in clients if u not in before], size=1).tolist())
    survivors = [u for u in clients if u not in before]
    responders = [u for u in clients if u not in before | after]

    # Unmasking: each responder opens its inbox and reveals b-shares of survivors and
    # s-shares of clients that dropped before uploading (never both for one client).
    b_revealed: dict[int, dict[int, bytes]] = {u: {} for u in survivors}
    s_revealed: dict[int, dict[int, bytes]] = {d: {} for d in before}
    for v in responders:
        for u, sealed in inbox[v].items():
            key = share_key(
                round_keys[v].c_private, public[u][0], run=RUN, round=round_, pair=(u, v)
            )
            b_share, s_share = open_shares(
                key, run=RUN, round=round_, sender=u, receiver=v, ciphertext=sealed
            )
            if u in before:
                s_revealed[u][v] = s_share
            else:
                b_revealed[u][v] = b_share
    rebuilt_b = {u: combine_shares(b_revealed[u], threshold) for u in survivors}
    assert rebuilt_b == {u: self_seeds[u] for u in survivors}
    dropped_keys = {
        d: private_from_bytes(combine_shares(s_revealed[d], threshold), public[d][1], client=d)
        for d in before
    }
    edges = needed_edges(graph, survivors, before)
    seeds = {
        (u, d): pair_seed(dropped_keys[d], public[u][1], run=RUN, round=round_, pair=(u, d))
        for u, d in edges
    }
    total = unmask_sum(
        {u: uploads[u] for u in survivors},
        graph=graph,
        self_seeds=rebuilt_b,
        dropped_pair_seeds=seeds,
        bits=bits,
    )
    expected = np.zeros(size, dtype=np.uint64)
    for u in survivors:
        expected = expected + inputs[u]
    assert np.array_equal(total, expected & np.uint64(2**bits - 1))


def test_a_dealt_share_is_proved_by_its_dealers_signature_and_nothing_else(bundles) -> None:
    # Prepare
    from fedcore.protocols.secagg.keys import (
        open_signed_shares,
        share_statement,
        statement_signer,
        verify_under_certificate,
    )

    sign = statement_signer(bundles[3].key_pem)
    share = bytes(range(66))
    statement = share_statement(RUN, 4, 3, 7, "self", share)
    signature = sign(statement)
    key = bytes(32)
    sealed = seal_shares(
        key,
        run=RUN,
        round=4,
        sender=3,
        receiver=7,
        self_share=share,
        mask_share=share[::-1],
        self_signature=signature,
        mask_signature=b"",
    )
    # Execute
    opened = open_signed_shares(key, run=RUN, round=4, sender=3, receiver=7, ciphertext=sealed)
    # Assert
    assert opened == (share, share[::-1], signature, b"")
    verify_under_certificate(bundles[3].cert_pem, "client 3", statement, signature)
    other = bytes([1]) + share[1:]
    for lie in (
        share_statement(RUN, 4, 3, 7, "self", other),  # another share
        share_statement(RUN, 4, 3, 8, "self", share),  # another holder
        share_statement(RUN, 4, 3, 7, "mask", share),  # another kind
        share_statement(RUN, 5, 3, 7, "self", share),  # another round
    ):
        with pytest.raises(ProtocolError, match="does not verify"):
            verify_under_certificate(bundles[3].cert_pem, "client 3", lie, signature)
    with pytest.raises(ProtocolError, match="does not verify"):
        verify_under_certificate(bundles[4].cert_pem, "client 4", statement, signature)
    with pytest.raises(ProtocolError, match="kind is self or mask"):
        share_statement(RUN, 4, 3, 7, "both", share)

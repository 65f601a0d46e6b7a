"""The KDC role over real mutual-TLS gRPC, in process, with a small test KDC protocol."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from fedcore.checkpoint import KDC_STATE_KEY_ENV, CheckpointKeyError
from fedcore.errors import FedcoreError, RunAborted
from fedcore.protocols import KdcProtocol
from fedcore.protocols._base import check_state_kind
from fedcore.roles._common import RoleConfig
from fedcore.roles.kdc import Kdc
from fedcore.spec import FederatedRun, load_manifest
from fedcore.transport import (
    Identity,
    Limits,
    Payload,
    RemoteError,
    RetryPolicy,
    RpcClient,
    RunCa,
    TlsBundle,
    issue_run_bundles,
)
from tests.integration._runs import write_manifest

pytestmark = pytest.mark.integration

CALL_SECONDS = 60.0
"""One call's deadline: generous, the machine is shared."""


class PairwiseSeeds(KdcProtocol):
    """A test KDC side: per-round, per-client seeds derived from a secret only the KDC holds.

    Args:
        num_clients: the run's client count; other indices are refused.
        secret: the KDC's secret key.
    """

    kind = "pairwise-seeds"

    def __init__(self, num_clients: int, secret: bytes) -> None:
        self.num_clients = num_clients
        self.secret = secret

    def seed(self, round: int, client: int) -> np.ndarray:
        """Returns client ``client``'s seed for ``round``: HMAC-SHA256 as 4 uint64 words."""
        digest = hmac.new(self.secret, f"{round}:{client}".encode(), hashlib.sha256).digest()
        return np.frombuffer(digest, dtype="<u8").copy()

    def issue_keys(self, round: int, party: Identity) -> Payload:
        if party.role != "client" or party.index is None or party.index >= self.num_clients:
            raise PermissionError(
                f"The identity {party.common_name!r} may not receive keys for round {round}."
            )
        return Payload(
            meta={"round": round, "client": party.index},
            tensors={"seed": self.seed(round, party.index)},
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "version": 1,
            "secret": self.secret.hex(),
            "clients": self.num_clients,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_kind(state, self.kind, ["secret", "clients"])
        self.secret = bytes.fromhex(state["secret"])
        self.num_clients = int(state["clients"])


@dataclass
class KdcUnderTest:
    """A started KDC and everything a test needs to call it."""

    port: int
    protocol: PairwiseSeeds
    ca: RunCa
    bundles: dict[str, TlsBundle]
    events: Path
    run: FederatedRun
    config: RoleConfig

    def client(self, identity: str, **kwargs: Any) -> RpcClient:
        bundle = self.bundles[identity] if identity in self.bundles else self.ca.issue(identity)
        return RpcClient(
            f"127.0.0.1:{self.port}",
            bundle,
            service="Kdc",
            limits=Limits(),
            **kwargs,
        )

    def issue(self, identity: str, meta: dict[str, Any]) -> Payload:
        with self.client(identity) as rpc:
            return rpc.call("IssueKeys", Payload(meta=meta), timeout=CALL_SECONDS)


@pytest.fixture(scope="module")
def kdc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KdcUnderTest]:
    """A KDC for a 2-client fedavg run, serving PairwiseSeeds on a free loopback port."""
    folder = tmp_path_factory.mktemp("kdc")
    manifest = write_manifest(folder / "run.yaml", clients={"count": 2})
    run = load_manifest(manifest)
    ca, bundles = issue_run_bundles(run.metadata.name, num_clients=2)
    bundles["kdc"].write(folder / "pki" / "kdc")
    events = folder / "events.jsonl"
    config = RoleConfig(
        manifest=manifest, tls_dir=folder / "pki" / "kdc", workdir=folder, events=events
    )
    protocol = PairwiseSeeds(num_clients=2, secret=b"known only to the KDC")
    server = Kdc(run, config, bundles["kdc"], listen="127.0.0.1:0", protocol=protocol)
    try:
        port = server.start()
        yield KdcUnderTest(port, protocol, ca, bundles, events, run, config)
    finally:
        server.stop()


def test_issue_keys_each_client_gets_only_its_own_seed(kdc: KdcUnderTest) -> None:
    # Prepare
    round_ = 3
    # Execute
    first = kdc.issue("client-0", {"round": round_})
    second = kdc.issue("client-1", {"round": round_})
    # Assert
    assert first.meta == {"round": round_, "client": 0}
    assert second.meta == {"round": round_, "client": 1}
    assert list(first.tensors) == ["seed"] and list(second.tensors) == ["seed"]
    np.testing.assert_array_equal(first.tensors["seed"], kdc.protocol.seed(round_, 0))
    np.testing.assert_array_equal(second.tensors["seed"], kdc.protocol.seed(round_, 1))
    assert not np.array_equal(first.tensors["seed"], second.tensors["seed"])


def test_issue_keys_repeated_round_same_seed_new_round_new_seed(kdc: KdcUnderTest) -> None:
    # Prepare
    identity = "client-1"
    # Execute
    again_a = kdc.issue(identity, {"round": 5})
    again_b = kdc.issue(identity, {"round": 5})
    other_round = kdc.issue(identity, {"round": 6})
    # Assert
    np.testing.assert_array_equal(again_a.tensors["seed"], again_b.tensors["seed"])
    assert not np.array_equal(again_a.tensors["seed"], other_round.tensors["seed"])


def test_issue_keys_identity_comes_from_certificate_not_request(kdc: KdcUnderTest) -> None:
    # Prepare: client-0 claims to be client 1 in the request.
    meta = {"round": 1, "client": 1, "party": "client-1", "index": 1}
    # Execute
    issued = kdc.issue("client-0", meta)
    # Assert
    assert issued.meta == {"round": 1, "client": 0}
    np.testing.assert_array_equal(issued.tensors["seed"], kdc.protocol.seed(1, 0))
    assert not np.array_equal(issued.tensors["seed"], kdc.protocol.seed(1, 1))


@pytest.mark.parametrize("identity", ["server", "runner", "kdc", "client-7"])
def test_issue_keys_non_client_or_unknown_client_is_permission_denied(
    kdc: KdcUnderTest, identity: str
) -> None:
    # Prepare: client-7 has a valid certificate of this run's CA but the run has 2 clients.
    meta = {"round": 1}
    # Execute
    with pytest.raises(RemoteError) as refused:
        kdc.issue(identity, meta)
    # Assert
    assert refused.value.code == "PERMISSION_DENIED"
    assert refused.value.method == "IssueKeys"
    assert identity in str(refused.value)


@pytest.mark.parametrize(
    "meta",
    [{}, {"round": -1}, {"round": "x"}, {"round": None}, {"round": True}, {"round": 1.5}],
    ids=["missing", "negative", "string", "null", "bool", "float"],
)
def test_issue_keys_malformed_round_is_invalid_argument_and_kdc_keeps_serving(
    kdc: KdcUnderTest, meta: dict[str, Any]
) -> None:
    # Prepare
    valid = {"round": 2}
    # Execute
    with pytest.raises(RemoteError) as refused:
        kdc.issue("client-0", meta)
    after = kdc.issue("client-0", valid)
    # Assert
    assert refused.value.code == "INVALID_ARGUMENT"
    assert "round" in str(refused.value)
    np.testing.assert_array_equal(after.tensors["seed"], kdc.protocol.seed(2, 0))


def test_issue_keys_garbage_bytes_are_invalid_argument_and_kdc_keeps_serving(
    kdc: KdcUnderTest,
) -> None:
    # Prepare
    bundle = kdc.bundles["client-1"]
    credentials = grpc.ssl_channel_credentials(bundle.ca_pem, bundle.key_pem, bundle.cert_pem)
    options = [("grpc.ssl_target_name_override", "kdc.fedcore.invalid")]
    # Execute
    with grpc.secure_channel(f"127.0.0.1:{kdc.port}", credentials, options=options) as channel:
        call = channel.stream_stream("/fedcore.v1.Kdc/IssueKeys")(
            iter([b"definitely not a fedcore message"]), timeout=CALL_SECONDS
        )
        with pytest.raises(grpc.RpcError) as refused:
            list(call)
    after = kdc.issue("client-1", {"round": 4})
    # Assert
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert after.meta == {"round": 4, "client": 1}


def test_issue_keys_certificate_of_another_ca_is_unavailable(kdc: KdcUnderTest) -> None:
    # Prepare: a certificate with the right name, signed by another run's CA.
    _, foreign = issue_run_bundles(kdc.run.metadata.name, num_clients=2)
    intruder = RpcClient(
        f"127.0.0.1:{kdc.port}",
        foreign["client-0"],
        service="Kdc",
        limits=Limits(),
        retry=RetryPolicy(total_seconds=1),
    )
    # Execute
    with intruder, pytest.raises(RemoteError) as refused:
        intruder.call("IssueKeys", Payload(meta={"round": 1}), timeout=CALL_SECONDS)
    after = kdc.issue("client-0", {"round": 1})
    # Assert
    assert refused.value.code == "UNAVAILABLE"
    assert after.meta == {"round": 1, "client": 0}


def test_kdc_start_writes_ready_event_with_its_port(kdc: KdcUnderTest) -> None:
    # Prepare
    deadline = time.monotonic() + 60
    ready: list[dict[str, Any]] = []
    # Execute
    while not ready and time.monotonic() < deadline:
        lines = kdc.events.read_text(encoding="utf-8").splitlines() if kdc.events.exists() else []
        ready = [event for event in map(json.loads, lines) if event["event"] == "ready"]
        if not ready:
            time.sleep(0.05)
    # Assert
    assert len(ready) == 1
    assert ready[0]["role"] == "kdc"
    assert ready[0]["port"] == kdc.port


def test_kdc_for_protocol_without_kdc_side_raises(kdc: KdcUnderTest) -> None:
    # Prepare: the run is fedavg, whose protocol creates no KDC side.
    bundle = kdc.bundles["kdc"]
    # Execute
    with pytest.raises(FedcoreError) as refused:
        Kdc(kdc.run, kdc.config, bundle, listen="127.0.0.1:0")
    # Assert
    assert "Protocol 'fedavg' has no KDC" in str(refused.value)


def test_pairwise_seeds_state_dict_round_trip_issues_the_same_seeds() -> None:
    # Prepare
    original = PairwiseSeeds(num_clients=2, secret=b"first secret")
    restored = PairwiseSeeds(num_clients=1, secret=b"another secret")
    party = Identity("client", 1)
    # Execute
    restored.load_state_dict(original.state_dict())
    # Assert
    np.testing.assert_array_equal(
        restored.issue_keys(3, party).tensors["seed"], original.issue_keys(3, party).tensors["seed"]
    )
    with pytest.raises(ValueError, match="kind"):
        restored.load_state_dict({"kind": "fedavg", "secret": "00", "clients": 1})


def start_kdc(folder: Path, protocol: KdcProtocol, *, resume: bool) -> tuple[Kdc, KdcUnderTest]:
    """A KDC of a checkpointed 2-client run in ``folder`` (its manifest and PKI made once)."""
    manifest = folder / "run.yaml"
    if not manifest.exists():
        write_manifest(manifest, clients={"count": 2}, checkpoint={"everyRounds": 1})
        ca, bundles = issue_run_bundles("e2e", num_clients=2)
        _PKI[str(folder)] = (ca, bundles)
        bundles["kdc"].write(folder / "pki" / "kdc")
    ca, bundles = _PKI[str(folder)]
    run = load_manifest(manifest)
    events = folder / "events.jsonl"
    config = RoleConfig(
        manifest=manifest, tls_dir=folder / "pki" / "kdc", workdir=folder, events=events
    )
    kdc = Kdc(run, config, bundles["kdc"], listen="127.0.0.1:0", protocol=protocol, resume=resume)
    port = kdc.start()
    return kdc, KdcUnderTest(port, protocol, ca, bundles, events, run, config)  # type: ignore[arg-type]


_PKI: dict[str, tuple[RunCa, dict[str, TlsBundle]]] = {}
"""The CA and bundles of each test folder's run (a restarted KDC keeps its certificate)."""


def test_kdc_restarted_with_resume_serves_its_checkpointed_state_and_without_forgets(
    tmp_path: Path,
) -> None:
    # Prepare: a KDC with secret A saves its state before it serves.
    first, first_kdc = start_kdc(tmp_path, PairwiseSeeds(2, b"secret A"), resume=False)
    try:
        before = first_kdc.issue("client-1", {"round": 3}).tensors["seed"]
    finally:
        first.stop()
    # Execute: restarted with --resume (and another secret it must not use), then without.
    resumed, resumed_kdc = start_kdc(tmp_path, PairwiseSeeds(2, b"secret B"), resume=True)
    try:
        after = resumed_kdc.issue("client-1", {"round": 3}).tensors["seed"]
    finally:
        resumed.stop()
    fresh, fresh_kdc = start_kdc(tmp_path, PairwiseSeeds(2, b"secret C"), resume=False)
    try:
        forgotten = fresh_kdc.issue("client-1", {"round": 3}).tensors["seed"]
    finally:
        fresh.stop()
    # Assert
    np.testing.assert_array_equal(after, before)
    assert not np.array_equal(forgotten, before)
    np.testing.assert_array_equal(forgotten, PairwiseSeeds(2, b"secret C").seed(3, 1))
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["version"] for e in events if e["event"] == "resumed"] == [1]
    # The fresh KDC's state is numbered after the old one, so a later resume finds it.
    assert [e["version"] for e in events if e["event"] == "checkpoint"] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "kdc").iterdir()) == [
        "latest-version.json",
        "version-00000001",
        "version-00000002",
    ]


def test_mpdp_kdc_saves_a_registration_before_answering_it(tmp_path: Path) -> None:
    # Prepare
    from fedcore.protocols.mpdp.protocol import PUBLIC_KEY_KIND, MpdpKdc

    kdc, under_test = start_kdc(tmp_path, MpdpKdc(2), resume=False)
    key = np.frombuffer(bytes(range(1, 33)), dtype=np.uint8).copy()
    try:
        # Execute
        with under_test.client("client-0") as rpc:
            rpc.call(
                "Submit",
                Payload(meta={"kind": PUBLIC_KEY_KIND}, tensors={"public_key": key}),
                timeout=CALL_SECONDS,
            )
        saved = kdc.checkpointer.load_latest() if kdc.checkpointer is not None else None
        session = kdc.protocol.state_dict()["session"]
    finally:
        kdc.stop()
    restarted, _ = start_kdc(tmp_path, MpdpKdc(2), resume=True)
    restarted.stop()
    # Assert
    assert saved is not None and saved[0] == 2
    assert saved[1]["protocol"]["public_keys"] == {"0": key.tobytes().hex()}
    assert restarted.protocol.state_dict()["session"] == session
    assert restarted.protocol.state_dict()["public_keys"] == {"0": key.tobytes().hex()}


def test_kdc_state_in_the_store_is_encrypted_under_a_key_only_the_kdc_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    monkeypatch.delenv(KDC_STATE_KEY_ENV, raising=False)
    secret = b"the KDC master secret"
    # Execute
    kdc, _ = start_kdc(tmp_path, PairwiseSeeds(2, secret), resume=False)
    kdc.stop()
    stored = b"".join(p.read_bytes() for p in (tmp_path / "checkpoints").rglob("*") if p.is_file())
    key_file = tmp_path / "keys" / "kdc-state.key"
    manifest = json.loads(
        (tmp_path / "checkpoints" / "kdc" / "version-00000001" / "MANIFEST.json").read_text()
    )
    # Assert
    assert secret not in stored and secret.hex().encode() not in stored
    assert b"pairwise-seeds" not in stored  # the state's JSON is ciphertext too
    assert manifest["encryption"] == "AES-256-GCM-CHUNKS" and manifest["version"] == 2
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    assert key_file.read_text().strip() not in stored.decode("latin-1")


def test_kdc_resume_refuses_a_tampered_state_and_does_not_start(tmp_path: Path) -> None:
    # Prepare: version 1 saved, then its encrypted state replaced by other bytes.
    first, _ = start_kdc(tmp_path, PairwiseSeeds(2, b"secret A"), resume=False)
    first.stop()
    part = tmp_path / "checkpoints" / "kdc" / "version-00000001" / "state.json"
    part.write_bytes(bytes(len(part.read_bytes())))
    # Execute
    with pytest.raises(RunAborted) as refused:
        start_kdc(tmp_path, PairwiseSeeds(2, b"secret B"), resume=True)
    # Assert
    assert refused.value.reason == "CheckpointInvalid"
    assert str(refused.value).startswith(
        "The KDC does not start: its state cannot be resumed: The checkpoint of version 1"
    )
    assert "its part state.json fails its checksum (sha256)" in str(refused.value)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["reason"] for e in events if e["event"] == "failed"] == ["CheckpointInvalid"]


def test_kdc_with_a_malformed_state_key_fails_at_start_up_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    key_file = tmp_path / "state.key"
    key_file.write_text("not a key\n")
    monkeypatch.setenv(KDC_STATE_KEY_ENV, str(key_file))
    # Execute
    with pytest.raises(CheckpointKeyError) as refused:
        start_kdc(tmp_path, PairwiseSeeds(2, b"secret A"), resume=False)
    # Assert
    assert str(refused.value).startswith(
        f"The KDC state key ({KDC_STATE_KEY_ENV}) file {key_file} is malformed"
    )
    assert not (tmp_path / "checkpoints").exists()

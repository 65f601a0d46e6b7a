"""Runs whose clients are at sites, end to end: the hub (KDC, server, endpoint) and each site as
its own processes with its own folder, keys and policy, over real mutual TLS on loopback.

Each case runs once: three sites train the same model as one site (one site reading its data
from a real S3 server with its own credentials, none of which reaches the hub); a site revoked
mid-run is cut off while the run goes on; the hub's server killed mid-run is restarted and the
sites reconnect; lppa's peer links go through the hub's relay, the sites behind an HTTPS proxy
that sees only TLS; a site whose floor refuses the run stops it, with its reason on both sides.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from fedcore.checkpoint import read_key
from fedcore.checkpoint._keys import SealKey
from fedcore.sites.consortium import ConsortiumRun, site_policies
from fedcore.sites.hub import HubEndpoint
from fedcore.sites.policy import spec_digest
from fedcore.sites.site import SiteAgent
from fedcore.spec import FederatedRun, load_manifest
from tests.integration._connect_proxy import ConnectProxy
from tests.integration._runs import ServerHold, fedcore, last_json
from tests.integration._s3 import S3Server, start_s3

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SENTINEL = "SENTINEL-7f3a"
"""In every name of the sites' data (folders, bucket, keys): none may reach the hub."""
BUCKET = f"records-{SENTINEL.lower()}"
ACCESS = f"{SENTINEL}-access"
SECRET = f"{SENTINEL}-secret-0123456789"


@pytest.fixture(scope="module")
def hospitals(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's hospital tables (examples/make_data.py), in folders named with SENTINEL."""
    out = tmp_path_factory.mktemp("data")
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_data.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    marked = out / SENTINEL
    shutil.move(out / "hospitals", marked)
    return marked


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory, hospitals: Path) -> Iterator[S3Server]:
    """SeaweedFS with hospital-c's identity, which may read only its own prefix."""
    identities = (
        {
            "name": "hospital-c",
            "credentials": [{"accessKey": ACCESS, "secretKey": SECRET}],
            "actions": [f"Read:{BUCKET}/hospital-c/*", f"List:{BUCKET}/hospital-c/*"],
        },
    )
    server = start_s3(tmp_path_factory.mktemp("s3"), identities=identities)
    admin: Any = server.client()
    admin.create_bucket(Bucket=BUCKET)
    admin.upload_file(
        str(hospitals / "hospital-3" / "records.parquet"), BUCKET, "hospital-c/records.parquet"
    )
    yield server
    server.stop()


def manifest(folder: Path, name: str, **changes: Any) -> dict[str, Any]:
    """examples/hospitals-tabular.yaml as FedAvg (deterministic), 4 rounds, with ``changes``."""
    document = yaml.safe_load((ROOT / "examples" / "hospitals-tabular.yaml").read_text())
    document["metadata"]["name"] = name
    spec = document["spec"]
    spec["protocol"] = {"name": "fedavg"}
    spec.pop("privacy")
    spec["rounds"] = 4
    spec["checkpoint"] = {"everyRounds": 1}
    spec["failurePolicy"] = {"connectTimeoutSeconds": 120, "roundTimeoutSeconds": 60}
    spec["data"]["clientData"] = {"format": "Parquet"}
    spec["sites"] = [
        {"name": "hospital-a", "clients": 2},
        {"name": "hospital-b", "clients": 1},
        {"name": "hospital-c", "clients": 1},
    ]
    spec.update(changes)
    return document


def write(path: Path, document: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    return path


def policies(
    folder: Path,
    run: FederatedRun,
    data: dict[str, Any] | None,
    floors: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Path]:
    """One policy file per site in ``folder/<site>/policy.yaml``, approving ``run``."""
    found = {}
    for site in run.spec.sites or []:
        approval: dict[str, Any] = {
            "run": run.metadata.name,
            "specDigest": spec_digest(run),
            "clients": site.clients,
            "floor": {"protocols": [run.spec.protocol.name], **(floors or {}).get(site.name, {})},
        }
        if data is not None:
            approval["data"] = data[site.name]
        document = {
            "apiVersion": "fedcore.dev/v1alpha1",
            "kind": "SitePolicy",
            "site": site.name,
            "approvals": [approval],
        }
        found[site.name] = write(folder / site.name / "policy.yaml", document)
    return found


def folder_data(hospitals: Path) -> dict[str, Any]:
    """Each site's binding of its clients to the hospitals' folders (hospital-a: 0 and 1)."""
    return {
        "hospital-a": {"template": {"path": str(hospitals / "hospital-{index}")}},
        "hospital-b": {"sources": [{"path": str(hospitals / "hospital-2")}]},
        "hospital-c": {"sources": [{"path": str(hospitals / "hospital-3")}]},
    }


def hospital_data(hospitals: Path, s3: S3Server, credentials: Path) -> dict[str, Any]:
    """hospital-a's two campuses and hospital-b from folders, hospital-c from S3."""
    credentials.mkdir(parents=True, exist_ok=True)
    (credentials / "AWS_ACCESS_KEY_ID").write_text(ACCESS)
    (credentials / "AWS_SECRET_ACCESS_KEY").write_text(SECRET)
    return {
        **folder_data(hospitals),
        "hospital-c": {
            "sources": [
                {
                    "s3": {
                        "bucket": BUCKET,
                        "prefix": "hospital-c/",
                        "endpoint": s3.endpoint,
                        "region": "us-east-1",
                        "credentialsPath": str(credentials),
                    }
                }
            ]
        },
    }


def consortium(
    folder: Path, document: dict[str, Any], data: dict[str, Any] | None, **kwargs: Any
) -> ConsortiumRun:
    path = write(folder / "run.yaml", document)
    run = load_manifest(path)
    given = policies(folder / "policies", run, data, kwargs.pop("floors", None))
    return ConsortiumRun(
        run,
        path,
        workdir=folder / "work",
        policies=site_policies(run, path, given),
        **kwargs,
    )


def test_three_sites_train_the_model_one_site_trains_and_the_hub_learns_no_data_location(
    tmp_path: Path, hospitals: Path, s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    received: list[str] = []
    answer = HubEndpoint.answer

    def recording(self: HubEndpoint, method: str, path: str, body: Any, der: Any) -> Any:
        received.append(json.dumps(body))  # every message a site sends the hub's API
        return answer(self, method, path, body, der)

    monkeypatch.setattr(HubEndpoint, "answer", recording)
    document = manifest(tmp_path, "three-sites")
    data = hospital_data(hospitals, s3, tmp_path / "hospital-c-only" / "credentials")
    result = consortium(tmp_path / "sites", document, data).execute()
    assert result.phase == "Succeeded" and result.rounds_completed == 4
    # One site: the same clients reading the same tables, every client where the server is.
    single = json.loads(json.dumps(document))
    single["metadata"]["name"] = "one-site"
    del single["spec"]["sites"]
    single["spec"]["data"]["clientData"] = {
        "format": "Parquet",
        "sources": [
            {"path": str(hospitals / "hospital-0")},
            {"path": str(hospitals / "hospital-1")},
            {"path": str(hospitals / "hospital-2")},
            {"s3": data["hospital-c"]["sources"][0]["s3"]},
        ],
    }
    path = write(tmp_path / "single" / "run.yaml", single)
    done = fedcore(
        "run",
        str(path),
        "--workdir",
        str(tmp_path / "single" / "work"),
        "--json",
        "--quiet",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    alone = last_json(done.stdout)
    assert alone["accuracy"] == result.accuracy
    ours = load_file(str(tmp_path / "sites" / "work" / "hub" / "run" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "single" / "work" / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name])
    # Nothing of any site's data source reached the hub: not in a message its API received,
    # not in a file it wrote (state, PKI, events, logs, checkpoints, the model).
    assert received and all(SENTINEL not in text and ACCESS not in text for text in received)
    hub = tmp_path / "sites" / "work" / "hub"
    files = [path for path in hub.rglob("*") if path.is_file()]
    assert len(files) > 20
    for path in files:
        content = path.read_bytes()
        for secret in (SENTINEL, SENTINEL.lower(), ACCESS, SECRET, str(hospitals)):
            assert secret.encode() not in content, f"{secret} in {path}"
    # ...while each site's own folder does hold its binding (mode 0600).
    binding = tmp_path / "sites" / "work" / "sites" / "hospital-c" / "runs" / "three-sites"
    assert BUCKET in (binding / "site-binding.json").read_text()
    assert (binding / "site-binding.json").stat().st_mode & 0o777 == 0o600


def round_events(run: ConsortiumRun) -> list[dict[str, Any]]:
    lines = run.hub.local.events_path.read_text().splitlines()
    return [event for event in map(json.loads, lines) if event.get("event") == "round"]


def test_a_site_revoked_mid_run_is_cut_off_and_the_run_goes_on(
    tmp_path: Path, hospitals: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = folder_data(hospitals)
    document = manifest(tmp_path, "revoked", rounds=8, clients={"count": 4, "quorum": "75%"})
    # The hub's server waits after round 2 until the revocation is written (its rounds take
    # milliseconds, and events reach the callback by polling: never "after round 2" otherwise).
    hold = ServerHold(monkeypatch, tmp_path, 2)
    run = consortium(tmp_path, document, data)
    revoked: list[int] = []

    def on_event(event: dict[str, Any]) -> None:
        if event.get("event") == "held" and not revoked:
            run.registry.revoke("hospital-c")
            revoked.append(event["round"])
            hold.release()

    result = run.execute(on_event)
    assert revoked == [2]
    assert result.phase == "Succeeded" and result.rounds_completed == 8
    rounds = round_events(run)
    assert [r["participants"] for r in rounds[:2]] == [4, 4]
    # From round 3 on, client 3 (hospital-c's) never counts again.
    for event in rounds[2:]:
        assert event["participants"] == 3, event
        assert 3 in event["failures"], event
    site = run.sites["hospital-c"]
    assert site.process.returncode not in (0, None)
    client_log = (
        tmp_path / "work" / "sites" / "hospital-c" / "runs" / "revoked" / "logs" / "client-3.log"
    )
    assert "which the hub revoked" in client_log.read_text()
    server_log = (run.hub.local.workdir / "logs" / "server.log").read_text()
    assert "which the hub revoked" in server_log and "client-3" in server_log
    assert all(run.sites[name].process.returncode == 0 for name in ("hospital-a", "hospital-b"))


def test_the_hubs_server_killed_mid_run_is_restarted_and_the_sites_reconnect(
    tmp_path: Path, hospitals: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = folder_data(hospitals)
    # The hub's server waits after round 2 (checkpointed) until it is killed there.
    hold = ServerHold(monkeypatch, tmp_path, 2)
    run = consortium(tmp_path, manifest(tmp_path, "restarted", rounds=6), data)
    killed: list[int] = []
    site_c = tmp_path / "work" / "sites" / "hospital-c"
    work_c = site_c / "runs" / "restarted"

    def on_event(event: dict[str, Any]) -> None:
        if event.get("event") == "held" and not killed:
            # hospital-c renews its client's certificate (as its agent does at half its life):
            # the client takes it up when it reconnects to the restarted server.
            agent = SiteAgent(site_c, run.policies["hospital-c"])
            run_ca = (work_c / "pki" / "client-3" / "ca.crt").read_bytes()
            agent._issue_client_bundles("restarted", [3], run_ca, work_c)
            server = run.hub.local.children["server"].process
            killed.append(server.pid)
            os.kill(server.pid, signal.SIGKILL)
            hold.release()  # the restarted server resumes at round 3: no hold there

    result = run.execute(on_event)
    assert killed
    assert result.phase == "Succeeded" and result.rounds_completed == 6
    assert result.restarts == {"server": 1}
    rounds = [event["round"] for event in round_events(run)]
    assert rounds[-1] == 6 and set(rounds) == set(range(1, 7))
    assert all(site.process.returncode == 0 for site in run.sites.values())
    assert "renewed certificate" in (work_c / "logs" / "client-3.log").read_text()
    assert (
        "renewed certificate"
        not in (
            tmp_path
            / "work"
            / "sites"
            / "hospital-b"
            / "runs"
            / "restarted"
            / "logs"
            / "client-2.log"
        ).read_text()
    )


def test_lppa_links_between_sites_go_through_the_hubs_relay_as_ciphertext(
    tmp_path: Path,
) -> None:
    document = yaml.safe_load((ROOT / "examples" / "digits-lppa.yaml").read_text())
    document["metadata"]["name"] = "lppa-sites"
    spec = document["spec"]
    spec["clients"] = {"count": 6}
    spec["protocol"]["lppa"]["topology"]["degree"] = 2
    spec["protocol"]["lppa"]["secureNoise"] = False
    spec["rounds"] = 6
    spec["evaluation"] = {"everyRounds": 3}
    spec["checkpoint"] = {"everyRounds": 3}
    spec["sites"] = [{"name": "north", "clients": 3}, {"name": "south", "clients": 3}]
    proxy = ConnectProxy()
    try:
        run = consortium(
            tmp_path, document, None, site_env={"https_proxy": proxy.url, "no_proxy": ""}
        )
        result = run.execute()
    finally:
        proxy.stop()
    assert result.phase == "Succeeded" and result.rounds_completed == 6
    tunnels = proxy.snapshot()
    hub = f"127.0.0.1:{run.hub.endpoint.port}" if run.hub.endpoint else ""
    # Every connection of every site and client went out through the proxy, to the hub only.
    assert tunnels and {tunnel.target for tunnel in tunnels} == {hub}
    dial_backs = [t for t in tunnels if bytes(t.up).startswith(b"FCTUNNEL ")]
    # Each client dials its 2 out-neighbours through the hub; each link is one dial-back.
    assert len(dial_backs) >= 6 * 2
    carried = 0
    for tunnel in dial_backs:
        down = bytes(tunnel.down)  # what the relay carried from the dialing client
        up = bytes(tunnel.up).split(b"\n", 1)[1]  # what the dialed client answered
        for stream in (down, up):
            if not stream:
                continue  # a dial-back whose caller had given up: it carried nothing
            kinds = _tls_records(stream)  # nothing but TLS records, from the first byte
            assert kinds[0] == 22  # each begins with its own handshake (end-to-end TLS)
            carried += sum(kind == 23 for kind in kinds)
            assert b"Link" not in stream and b"round" not in stream
    assert carried > 6 * 2 * 6  # encrypted records: every link carried messages every round
    # Each client's checkpoints are its site's, encrypted with a key that exists only there.
    work = tmp_path / "work"
    for site, clients in (("north", range(3)), ("south", range(3, 6))):
        for index in clients:
            key = next((work / "sites" / site).rglob(f"client-{index}-checkpoint.key"))
            manifests = list((work / "sites" / site).rglob(f"client-{index}/round-*/MANIFEST.json"))
            assert len(manifests) == 2 and key.stat().st_mode & 0o077 == 0
            for manifest in map(json.loads, (m.read_text() for m in manifests)):
                assert manifest["encryption"] == "AES-256-GCM-CHUNKS"
                assert manifest["key_id"] == SealKey(read_key(key)).key_id
    assert not list((work / "hub").rglob("client-*-checkpoint.key"))


def _tls_records(stream: bytes) -> list[int]:
    kinds = []
    at = 0
    while at + 5 <= len(stream):
        kind, length = stream[at], int.from_bytes(stream[at + 3 : at + 5], "big")
        assert kind in (20, 21, 22, 23) and stream[at + 1] == 3, f"no TLS record at byte {at}"
        kinds.append(kind)
        at += 5 + length
    assert at == len(stream), "the stream ends inside a record"
    return kinds


def test_a_site_whose_floor_refuses_the_run_stops_it_with_its_reason(
    tmp_path: Path, hospitals: Path
) -> None:
    document = yaml.safe_load((ROOT / "examples" / "sites" / "consortium.yaml").read_text())
    path = write(tmp_path / "run.yaml", document)
    run = load_manifest(path)
    data = folder_data(hospitals)
    floors = {"hospital-b": {"maxEpsilon": 5.0, "delta": 1.0e-5}}
    given = policies(tmp_path / "policies", run, data, floors)
    args = [f"--site={name}={policy}" for name, policy in given.items()]
    done = fedcore(
        "run",
        str(path),
        "--workdir",
        str(tmp_path / "work"),
        "--json",
        "--quiet",
        *args,
        cwd=tmp_path,
    )
    assert done.returncode != 0
    failed = last_json(done.stdout)
    assert failed["phase"] == "Failed" and failed["reason"] == "SiteRefused"
    assert "Site hospital-b refused run 'consortium' (Epsilon)" in failed["message"]
    assert "allows at most epsilon 5" in failed["message"]
    site_log = (tmp_path / "work" / "sites" / "hospital-b" / "site.log").read_text()
    assert "allows at most epsilon 5" in site_log and "refuses run consortium" in site_log
    # It refused before any client of any site started training.
    events = (tmp_path / "work" / "hub" / "run" / "events.jsonl").read_text()
    assert '"event": "round"' not in events


def test_clients_refuse_a_server_that_runs_another_spec_than_the_one_approved(
    tmp_path: Path, hospitals: Path
) -> None:
    """A hub that shows the sites one spec (which they approve) and runs another: each
    client checks the digest the server's tasks carry, refuses before it trains, and the
    server records each site's reason."""
    data = folder_data(hospitals)
    shown = manifest(tmp_path, "two-faced", rounds=4)
    runs = manifest(tmp_path, "two-faced", rounds=40)  # what the server really runs
    runs["spec"]["failurePolicy"]["maxRoundRetries"] = 0
    path = write(tmp_path / "run.yaml", runs)
    approved = load_manifest(write(tmp_path / "shown.yaml", shown))
    given = policies(tmp_path / "policies", approved, data)
    run = ConsortiumRun(load_manifest(path), path, workdir=tmp_path / "work", policies=given)
    run.hub._manifest_text = (tmp_path / "shown.yaml").read_text()  # the lie
    with pytest.raises(Exception) as stopped:
        run.execute()
    assert getattr(stopped.value, "reason", None) == "QuorumLost", stopped.value
    lines = run.hub.local.events_path.read_text().splitlines()
    refusals = [e for e in map(json.loads, lines) if e.get("event") == "site_refused"]
    assert {e["client"] for e in refusals} == {0, 1, 2, 3}
    assert {e["reason"] for e in refusals} == {"SpecChanged"}
    assert all(spec_digest(approved) in e["message"] for e in refusals)
    assert '"event": "round"' not in "\n".join(lines)  # no round was ever combined
    log = tmp_path / "work" / "sites" / "hospital-b" / "runs" / "two-faced" / "logs"
    assert "changed after" in (log / "client-2.log").read_text()


def test_a_protocol_with_a_kdc_runs_with_its_clients_at_sites(tmp_path: Path) -> None:
    """mpdp: each site's clients reach the KDC, like the server, only through the hub's
    endpoint (the only address they are given)."""
    document = yaml.safe_load((ROOT / "examples" / "digits-mpdp.yaml").read_text())
    document["metadata"]["name"] = "mpdp-sites"
    spec = document["spec"]
    spec["clients"] = {"count": 4, "quorum": "100%"}
    spec["rounds"] = 2
    spec["sites"] = [{"name": "east", "clients": 2}, {"name": "west", "clients": 2}]
    run = consortium(tmp_path, document, None)
    result = run.execute()
    assert result.phase == "Succeeded" and result.rounds_completed == 2
    assert [event["participants"] for event in round_events(run)] == [4, 4]
    kdc_log = (run.hub.local.workdir / "logs" / "kdc.log").read_text()
    assert "Refused" not in kdc_log


def test_the_consortium_example_runs_as_docs_sites_md_says(tmp_path: Path) -> None:
    """`fedcore run examples/sites/consortium.yaml`, with the examples' data beside it: each
    policy file approves the example's current digest (a changed example must be approved
    again), and the run keeps its budget."""
    shutil.copytree(ROOT / "examples" / "sites", tmp_path / "sites")
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_data.py"), "--out", str(tmp_path / "data")],
        check=True,
        capture_output=True,
    )
    done = fedcore(
        "run",
        "sites/consortium.yaml",
        "--workdir",
        str(tmp_path / "work"),
        "--json",
        "--quiet",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = last_json(done.stdout)
    assert summary["phase"] == "Succeeded" and summary["rounds_completed"] == 15
    assert summary["epsilon"] <= 8 and summary["evaluated_examples"] > 0
    assert sorted(p.name for p in (tmp_path / "work" / "sites").iterdir()) == [
        "hospital-a",
        "hospital-b",
        "hospital-c",
    ]


def test_a_consortium_stopped_mid_run_resumes_with_the_sites_it_has(
    tmp_path: Path, hospitals: Path
) -> None:
    """`fedcore run --resume` of a folder whose sites joined: the hub comes back on the address
    they joined, they are not asked to join again, get new client certificates from the new
    run CA and go on from the last checkpoint."""
    data = folder_data(hospitals)
    document = manifest(tmp_path, "resumed", rounds=5)
    first = consortium(tmp_path, document, data)

    def stop(event: dict[str, Any]) -> None:
        if event.get("event") == "round" and event["round"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(Exception, match="interrupted"):
        first.execute(stop)
    identity = (tmp_path / "work" / "sites" / "hospital-a" / "identity" / "tls.crt").read_bytes()
    second = consortium(tmp_path, document, data, resume=True)
    result = second.execute()
    assert result.phase == "Succeeded" and result.rounds_completed == 5 and result.attempt == 2
    assert second.hub.endpoint is not None and first.hub.endpoint is not None
    assert second.hub.endpoint.port == first.hub.endpoint.port
    assert (tmp_path / "work" / "sites" / "hospital-a" / "identity" / "tls.crt").read_bytes() == (
        identity
    )  # the same enrollment
    lines = second.hub.local.events_path.read_text().splitlines()
    resumed = [json.loads(line) for line in lines if '"event": "resumed"' in line]
    # Stopped at round 2's event, which comes before that round's checkpoint is written.
    assert resumed and resumed[0]["round"] in (1, 2)


@pytest.mark.parametrize("protocol", ["perturb", "ebscfl", "adaptive"])
def test_the_other_protocols_run_with_their_clients_at_sites(protocol: str, tmp_path: Path) -> None:
    """Every protocol runs across sites (fedavg, dp-fedavg, lppa and mpdp above): each
    example's clients split over two sites, three rounds."""
    document = yaml.safe_load((ROOT / "examples" / f"digits-{protocol}.yaml").read_text())
    document["metadata"]["name"] = f"{protocol}-sites"
    spec = document["spec"]
    count = spec["clients"]["count"]
    spec["rounds"] = 3
    spec["sites"] = [
        {"name": "east", "clients": count // 2},
        {"name": "west", "clients": count - count // 2},
    ]
    result = consortium(tmp_path, document, None).execute()
    assert result.phase == "Succeeded" and result.rounds_completed == 3
    assert result.accuracy is not None and result.accuracy > 0.1  # 10 classes: above chance

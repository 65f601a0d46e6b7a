"""lppa on real processes: the example end to end, equality with the one-process simulation,
a coordinator that never receives a model tensor (its every message inspected), mutual-TLS
peer links that only graph neighbours may open, and a lost peer that fails the run, which
then resumes from every client's own checkpoint."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from fedcore.checkpoint import read_key
from fedcore.checkpoint._keys import SealKey
from fedcore.errors import PeerLost, RoleFailed, RunAborted
from fedcore.local.runner import LocalRun, peer_arguments
from fedcore.observe.events import read_events
from fedcore.protocols.lppa.protocol import UPLOAD_KEYS
from fedcore.roles import RoleConfig, Server
from fedcore.roles._peers import PeerMesh
from fedcore.simulation.peer import simulate_decentralized
from fedcore.spec import FederatedRun, load_manifest, peer_graph
from fedcore.spec.topology import PeerPlan, build_graph, mixing_matrix, peer_plans
from fedcore.transport import Limits, Payload, RetryPolicy, issue_run_bundles
from tests.integration._runs import fedcore, last_json

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:lppa draws its noise:UserWarning"),
]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "digits-lppa.yaml"


def small_manifest(path: Path, **changes: Any) -> Path:
    """A 4-client ring, reproducible noise, float64: comparable with the simulation."""
    spec: dict[str, Any] = {
        "protocol": {"name": "lppa", "lppa": {"secureNoise": False, "topology": {"kind": "Ring"}}},
        "model": {"kind": "MLP", "hidden": [16], "dtype": "float64"},
        "clients": {"count": 4},
        "rounds": 6,
        "training": {"batchSize": 32, "optimizer": {"kind": "SGD", "learningRate": 0.1}},
        "evaluation": {"everyRounds": 3},
        "checkpoint": {"everyRounds": 3},
        "failurePolicy": {"connectTimeoutSeconds": 120, "roundTimeoutSeconds": 120},
        "seed": 5,
    }
    spec.update(changes)
    manifest = {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "FederatedRun",
        "metadata": {"name": "lppa-e2e"},
        "spec": spec,
    }
    path.write_text(yaml.safe_dump(manifest), encoding="utf-8")
    return path


def events_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def quietly_load(path: Path) -> FederatedRun:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return load_manifest(path)


# ------------------------------------------------------------------------- the example


@pytest.fixture(scope="module")
def example_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("lppa-example")
    done = fedcore("run", str(EXAMPLE), "--json", "--workdir", str(folder / "work"), cwd=folder)
    return {"work": folder / "work", "process": done}


def test_the_lppa_example_trains_over_peer_links_and_each_client_keeps_its_model(
    example_run: dict[str, Any],
) -> None:
    # Prepare
    done, work = example_run["process"], example_run["work"]
    run = load_manifest(EXAMPLE)
    count = run.spec.clients.count
    # Execute
    summary = last_json(done.stdout)
    events = events_of(work / "events.jsonl")
    rounds = [e for e in events if e["event"] == "round"]
    models = [load_file(str(work / "models" / f"client-{i}.safetensors")) for i in range(count)]
    # Assert
    assert done.returncode == 0, done.stderr
    assert summary["phase"] == "Succeeded" and summary["model"] == str(work / "models")
    assert summary["accuracy"] >= 0.75
    assert len(rounds) == run.spec.rounds
    assert all(e["participants"] == count and e["metrics"]["peer_bytes_sent"] > 0 for e in rounds)
    evaluated = [e for e in rounds if "accuracy" in e]
    assert [e["round"] for e in evaluated] == [25, 50, 75, 100, 125, 150]
    assert evaluated[-1]["metrics"]["accuracy_min"] >= 0.7
    # The clients agree (consensus), and nobody else holds a model.
    spread = max(float(np.max(np.abs(m[n] - models[0][n]))) for m in models for n in m)
    assert spread < 0.1
    assert not (work / "model.safetensors").exists()
    for i in range(count):
        folder = work / "checkpoints" / "clients" / f"client-{i}"
        assert sorted(p.name for p in folder.iterdir()) == [
            "latest-round.json",
            "round-00000050",
            "round-00000100",
            "round-00000150",
        ]


def test_the_coordinator_of_the_example_received_only_scalars(
    example_run: dict[str, Any],
) -> None:
    # Prepare: one model is 4810 float32 weights (19 KB).
    done = example_run["process"]
    summary = last_json(done.stdout)
    run = load_manifest(EXAMPLE)
    uploads = run.spec.rounds * run.spec.clients.count
    # Assert: what reached the server, all rounds together, is far less than one model per
    # upload (hello messages and uploads of a few scalars each).
    assert summary["server_bytes_received"] / uploads < 19_240 / 20


def test_the_example_ends_its_peer_links_without_a_warning_or_an_error(
    example_run: dict[str, Any],
) -> None:
    """At the end of a run every client closes its links a few milliseconds apart. That used
    to log, in most runs: a WARNING per link a neighbour closed first, an ERROR "handler failed"
    (gRPC's "Server already stopped" read by a session under its server's stop) and an
    asyncio ERROR "Event loop is closed" (gRPC's poller handing a stopped server's last
    completions to its closed loop)."""
    # Prepare
    done, work = example_run["process"], example_run["work"]
    # Execute
    noisy = [
        line
        for log in sorted((work / "logs").glob("*.log"))
        for line in log.read_text(encoding="utf-8").splitlines()
        if " WARNING " in line or " ERROR " in line or "Traceback" in line
    ]
    # Assert
    assert done.returncode == 0, done.stderr
    assert noisy == []
    assert "Traceback" not in done.stderr and "leaked" not in done.stderr


# ----------------------------------------------------------- equality with the simulation


def test_a_reproducible_run_equals_the_simulation_bit_for_bit(tmp_path: Path) -> None:
    # Prepare
    manifest = small_manifest(tmp_path / "run.yaml")
    simulated = simulate_decentralized(quietly_load(manifest))
    # Execute
    done = fedcore("run", str(manifest), "--json", "--workdir", str(tmp_path / "w"), cwd=tmp_path)
    # Assert
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout)["accuracy"] == pytest.approx(simulated.accuracy, abs=1e-12)
    for index, weights in simulated.clients.items():
        released = load_file(str(tmp_path / "w" / "models" / f"client-{index}.safetensors"))
        for name, value in weights.items():
            assert np.array_equal(released[name], value), (index, name)


# ------------------------------------------------- the coordinator's messages, inspected


def test_the_coordinator_never_receives_a_model_tensor(tmp_path: Path) -> None:
    """The server role runs here, in this process, with a spy on every message it receives
    and every task it sends; the clients are `fedcore client` processes."""
    # Prepare
    manifest = small_manifest(tmp_path / "run.yaml", rounds=4)
    run = quietly_load(manifest)
    count = run.spec.clients.count
    _, bundles = issue_run_bundles(
        run.metadata.name,
        num_clients=count,
        hosts={f"client-{i}": [f"client-{i}"] for i in range(count)},
    )
    for name, bundle in bundles.items():
        bundle.write(tmp_path / "pki" / name)
    config = RoleConfig(
        manifest, tmp_path / "pki" / "server", tmp_path / "w", events=tmp_path / "events.jsonl"
    )
    server = Server(run, config, bundles["server"], listen="127.0.0.1:0", resume=False)
    received: list[Payload] = []
    sent: list[Payload] = []
    board_received = server.board.received

    def spy(session: Any, message: Payload) -> None:
        received.append(message)
        board_received(session, message)

    server.board.received = spy  # type: ignore[method-assign]
    plan_round = server.protocol.plan_round

    def planned(round_: int, clients: Any) -> Any:
        plans = plan_round(round_, clients)
        sent.extend(plans.values())
        return plans

    server.protocol.plan_round = planned  # type: ignore[method-assign]
    outcome: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: outcome.update(server.serve()), daemon=True)
    thread.start()
    peers = peer_arguments(run.spec)
    processes = []
    for i in range(count):
        log = (tmp_path / f"client-{i}.log").open("wb")
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "fedcore",
                    "client",
                    "--manifest",
                    str(manifest),
                    "--tls-dir",
                    str(tmp_path / "pki" / f"client-{i}"),
                    "--workdir",
                    str(tmp_path / "w"),
                    "--index",
                    str(i),
                    "--server",
                    f"127.0.0.1:{server.rpc.port}",
                    *peers[i],
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        )
    # Execute
    try:
        thread.join(400)
        codes = [p.wait(60) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
        server.events.close()
    # Assert
    logs = "\n".join((tmp_path / f"client-{i}.log").read_text() for i in range(count))
    assert outcome.get("phase") == "Succeeded", logs
    assert codes == [0] * count, logs
    uploads = [m for m in received if m.meta.get("kind") == "upload"]
    assert len(uploads) == count * 4
    assert all(not m.tensors for m in received), "a message to the coordinator had a tensor"
    assert all(set(m.meta["upload"]) <= UPLOAD_KEYS for m in uploads)
    assert all(
        isinstance(v, int | float | bool | str) for m in uploads for v in m.meta["upload"].values()
    )
    assert sent and all(not plan.tensors for plan in sent)
    assert server.protocol.global_weights() == {}


# --------------------------------------------------------------------- the peer links


def bundles_for(count: int) -> dict[str, Any]:
    _, bundles = issue_run_bundles(
        "mesh", num_clients=count, hosts={f"client-{i}": [f"client-{i}"] for i in range(count)}
    )
    return bundles


def mesh_of(plan: PeerPlan, bundles: dict[str, Any], retry: float = 30.0) -> PeerMesh:
    """A client's mesh, listening; its out-neighbours' addresses are filled in later."""
    return PeerMesh(
        plan,
        bundles[f"client-{plan.index}"],
        listen="127.0.0.1:0",
        addresses=dict.fromkeys(plan.out_neighbours, "unset"),
        limits=Limits(),
        retry=RetryPolicy(total_seconds=retry),
        timeout=5.0,
    )


def meshes(plans: list[PeerPlan]) -> list[PeerMesh]:
    """Every client's mesh, each dialing its out-neighbours' real ports."""
    bundles = bundles_for(len(plans))
    result = [mesh_of(plan, bundles) for plan in plans]
    for mesh, plan in zip(result, plans, strict=True):
        mesh._addresses = {j: f"127.0.0.1:{result[j].port}" for j in plan.out_neighbours}
        mesh.start()
    return result


def test_peer_links_carry_tagged_messages_between_neighbours(tmp_path: Path) -> None:
    # Prepare
    graph = build_graph("Ring", 3, directed=True)
    plans = peer_plans(graph, mixing_matrix(graph))
    links = meshes(plans)
    try:
        # Execute
        for mesh in links:
            mesh.send(
                (mesh.index + 1) % 3,
                "e/1/state",
                Payload(
                    meta={"from": mesh.index}, tensors={"theta": np.full(4, float(mesh.index))}
                ),
            )
        got = [links[i].receive((i - 1) % 3, "e/1/state") for i in range(3)]
        # Assert
        assert [int(m.tensors["theta"][0]) for m in got] == [2, 0, 1]
        assert [m.meta["from"] for m in got] == [2, 0, 1]
        with pytest.raises(PeerLost, match="got nothing from its in-neighbour client 2"):
            links[0].receive(2, "e/2/state")
    finally:
        for mesh in links:
            mesh.close()


def test_a_client_refuses_a_peer_link_from_a_client_that_is_not_its_in_neighbour(
    tmp_path: Path,
) -> None:
    # Prepare: client 1 believes it sends to client 0; client 0 takes links from client 2 only.
    plans = [
        PeerPlan(0, in_neighbours=(2,), out_neighbours=(1,)),
        PeerPlan(1, in_neighbours=(0,), out_neighbours=(0,)),
        PeerPlan(2, in_neighbours=(), out_neighbours=(0,)),
    ]
    links = meshes(plans)
    try:
        # Execute / Assert
        with pytest.raises(PeerLost, match=r"refused our link.*not an in-neighbour of client-0"):
            links[1].send(0, "e/1/state", Payload(tensors={"theta": np.zeros(2)}))
    finally:
        for mesh in links:
            mesh.close()


def test_a_peer_link_reaches_only_the_client_the_graph_names(tmp_path: Path) -> None:
    # Prepare: client 2 would accept client 1, but client 1 dials it believing it is client 0.
    bundles = bundles_for(3)
    target = mesh_of(PeerPlan(2, in_neighbours=(1,), out_neighbours=()), bundles)
    target.start()
    caller = mesh_of(PeerPlan(1, in_neighbours=(), out_neighbours=(0,)), bundles, retry=3.0)
    caller._addresses = {0: f"127.0.0.1:{target.port}"}
    caller.start()
    try:
        # Execute / Assert: TLS refuses client 2's certificate for the name client-0.
        with pytest.raises(PeerLost, match=r"stayed unreachable|could not reach"):
            caller.send(0, "e/1/state", Payload(tensors={"theta": np.zeros(2)}))
    finally:
        caller.close()
        target.close()


# -------------------------------------------------------- a lost peer, then the resume


def wait_for_round(run: LocalRun, round_: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    offset = 0
    while time.monotonic() < deadline:
        found, offset = read_events(run.events_path, offset)
        if any(e.get("event") == "round" and e["round"] >= round_ for e in found):
            return
        if run.children["server"].process.poll() is not None:
            raise AssertionError(f"the server exited early:\n{run.children['server'].tail()}")
        time.sleep(0.02)
    raise AssertionError(f"round {round_} did not come within {timeout} s")


@pytest.mark.timeout(900)
def test_a_lost_peer_fails_the_run_clearly_and_resume_ends_as_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    # Prepare: enough rounds that the kill lands mid-run; a checkpoint every 5 rounds.
    manifest = small_manifest(
        tmp_path / "run.yaml",
        rounds=400,
        checkpoint={"everyRounds": 5},
        evaluation={"everyRounds": 100},
    )
    run = quietly_load(manifest)
    work = tmp_path / "work"
    first = LocalRun(run, manifest, workdir=work)
    first.start()
    # Execute: kill client 1 once round 12 is done.
    try:
        wait_for_round(first, 12)
        os.killpg(first.children["client-1"].process.pid, signal.SIGKILL)
        with pytest.raises(RunAborted) as caught:
            first.wait()
    finally:
        first.stop()
    failed = caught.value
    # Assert: a clear reason, naming the lost client.
    assert failed.reason == "PeerLost", str(failed)
    assert "client 1" in str(failed) and "fixed peer graph" in str(failed)
    logs = (work / "logs" / "client-0.log").read_text() + (
        work / "logs" / "client-2.log"
    ).read_text()
    assert "PeerLost" in logs or "The peer link with client 1 ended" in logs
    # Execute: every client resumes from its own checkpoint of the last round all saved.
    resumed = LocalRun(run, manifest, workdir=work, resume=True).execute()
    # Assert
    assert resumed.phase == "Succeeded"
    whole = simulate_decentralized(run, evaluate=False)
    for index, weights in whole.clients.items():
        released = load_file(str(work / "models" / f"client-{index}.safetensors"))
        for name, value in weights.items():
            assert np.array_equal(released[name], value), (index, name)
    restored = [
        line
        for i in range(4)
        for line in (work / "logs" / f"client-{i}.log").read_text().splitlines()
        if "Restored the state of round" in line
    ]
    assert len(restored) == 4
    graph, _ = peer_graph(run.spec)
    assert graph.neighbours(1) == (0, 2)


def test_each_client_signs_its_own_checkpoints_and_a_changed_one_stops_the_resume_naming_it(
    tmp_path: Path,
) -> None:
    # Prepare: a finished run (checkpoints of rounds 3 and 6), taken back to round 3.
    manifest = small_manifest(tmp_path / "run.yaml")
    run = quietly_load(manifest)
    work = tmp_path / "work"
    assert LocalRun(run, manifest, workdir=work).execute().phase == "Succeeded"
    back = fedcore(
        "checkpoint", "rollback", str(manifest), "3", "--workdir", str(work), "--yes", cwd=tmp_path
    )
    assert back.returncode == 0, back.stderr
    clients = work / "checkpoints" / "clients"
    key_ids = {
        index: json.loads(
            (clients / f"client-{index}" / "round-00000003" / "MANIFEST.json").read_text()
        )["key_id"]
        for index in range(4)
    }
    own_ids = {
        index: SealKey(read_key(work / "keys" / f"client-{index}-checkpoint.key")).key_id
        for index in range(4)
    }
    # What a reader of the store (the coordinator, another client) finds: ciphertext only.
    stored = b"".join(p.read_bytes() for p in clients.rglob("*") if p.is_file())
    released = load_file(str(work / "models" / "client-0.safetensors"))
    window = next(iter(released.values())).tobytes()[:32]
    state = clients / "client-2" / "round-00000003" / "state.json"
    original = state.read_bytes()
    state.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    # Execute: resume with client 2's checkpoint changed, then with it put back.
    with pytest.raises(RunAborted) as caught:
        LocalRun(run, manifest, workdir=work, resume=True).execute()
    state.write_bytes(original)
    resumed = LocalRun(run, manifest, workdir=work, resume=True).execute()
    # Assert: each client signed with its own key (no two alike, none the server's); the
    # changed checkpoint stopped the resume naming client 2, the round and why; put back,
    # the resume ends as the uninterrupted run.
    assert key_ids == own_ids and len(set(key_ids.values())) == 4
    assert window not in stored and b"theta" not in stored
    assert SealKey(read_key(work / "keys" / "checkpoint.key")).key_id not in key_ids.values()
    message = str(caught.value)
    assert caught.value.reason == "CheckpointInvalid"  # no restart would get past it
    assert message.startswith("Round 4 lost client 2 (failed: CheckpointInvalid: Client 2 must ")
    assert "resume from its checkpoint of round 3" in message and "fails its checksum" in message
    assert "Restarting would read the same checkpoint" in message
    assert "Once what client 2 reported is fixed, `fedcore run --resume`" in message
    assert resumed.phase == "Succeeded"
    whole = simulate_decentralized(run, evaluate=False)
    for index, weights in whole.clients.items():
        released = load_file(str(work / "models" / f"client-{index}.safetensors"))
        assert all(np.array_equal(released[n], v) for n, v in weights.items()), index


def test_a_client_that_cannot_start_fails_the_run_at_once_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: client 1's peer port is taken (as when another process grabbed it between the
    # runner picking it and the client binding it). Before, the server waited its
    # connectTimeoutSeconds (120 s here) for a client that had already died.
    manifest = small_manifest(tmp_path / "run.yaml")
    run = quietly_load(manifest)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    real = peer_arguments

    def with_port_taken(spec: Any) -> dict[int, list[str]]:
        found = real(spec)
        found[1][found[1].index("--peer-listen") + 1] = f"127.0.0.1:{port}"
        for index, args in found.items():
            found[index] = [f"1=127.0.0.1:{port}" if arg.startswith("1=") else arg for arg in args]
        return found

    monkeypatch.setattr("fedcore.local.runner.peer_arguments", with_port_taken)
    started = time.monotonic()
    # Execute
    try:
        with pytest.raises(RoleFailed) as failure:
            LocalRun(run, manifest, workdir=tmp_path / "work").execute()
    finally:
        taken.close()
    # Assert: the client is named with its own error, long before the connect timeout.
    assert failure.value.role == "client-1"
    assert "Address already in use" in str(failure.value)
    assert time.monotonic() - started < 60

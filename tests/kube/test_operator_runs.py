"""FederatedRuns that train for real: ``kubectl apply`` -> operator -> pods run by the fake kubelet.

The fake kubelet runs each pod's command as a local process (its own 127.x address, its
Secrets and ConfigMap written to files), so these runs go through the same code as on a
cluster: the operator's objects, the roles' mutual TLS, the server's status reports.
"""

from __future__ import annotations

import base64
import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedcore_operator.kube import request
from tests.integration._s3 import ACCESS_KEY, SECRET_KEY, S3Server, start_s3
from tests.kube._operator import (
    OperatorProcess,
    install_crd,
    running_operator,
    start_operator,
    wait_for_run,
)
from tests.kube.cluster import ControlPlane
from tests.kube.kubelet import FakeKubelet

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def operator(
    control_plane: ControlPlane, kubelet: FakeKubelet, tmp_path: Path
) -> Iterator[OperatorProcess]:
    """A fresh operator per test (no webhook: test_operator.py covers it)."""
    install_crd(control_plane)
    with running_operator(control_plane, tmp_path / "operator", webhook=False) as op:
        yield op


def phase_is(*phases: str) -> Any:
    return lambda run: (run.get("status") or {}).get("phase") in phases


def debug(plane: ControlPlane, kubelet: FakeKubelet, op: OperatorProcess, ns: str, run: str) -> Any:
    def text() -> str:
        parts = [f"--- operator\n{op.tail(40)}"]
        failed = [
            pod["metadata"]["name"]
            for pod in listed(plane, ns, "pods")
            if (pod.get("status") or {}).get("phase") == "Failed"
        ]
        for pod in dict.fromkeys([f"{run}-server", f"{run}-client-0", *failed]):
            try:
                parts.append(f"--- {pod}\n{kubelet.log_of(ns, pod)[-3000:]}")
            except Exception as exc:
                parts.append(f"--- {pod}: no log ({exc})")
        return "\n".join(parts)

    return text


def test_quickstart_manifest_trains_to_completion_through_kubectl_apply(
    control_plane: ControlPlane, kubelet: FakeKubelet, operator: OperatorProcess, namespace: str
) -> None:
    control_plane.kubectl("apply", "-n", namespace, "-f", str(ROOT / "examples/digits-fedavg.yaml"))
    run = wait_for_run(
        control_plane,
        namespace,
        "digits-fedavg",
        phase_is("Succeeded", "Failed"),
        timeout=240,
        what="end",
        debug=debug(control_plane, kubelet, operator, namespace, "digits-fedavg"),
    )
    status = run["status"]
    assert status["phase"] == "Succeeded", status
    assert status["round"] == 20 and status["progress"] == "20/20"
    assert status["finalMetrics"]["accuracy"] > 0.8
    assert status["finalMetrics"]["roundsCompleted"] == 20
    assert status["lastCheckpoint"]["round"] == 20
    assert status["roles"]["clients"]["desired"] == 10
    assert status["restarts"] == 0
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Complete"] == "True" and conditions["Failed"] == "False"
    # Finished runs keep the server pod (its log) and remove what still ran.
    assert control_plane.pod(namespace, "digits-fedavg-server") is not None


def s3_run(name: str, s3: S3Server, bucket: str, rounds: int) -> dict[str, Any]:
    return {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "FederatedRun",
        "metadata": {"name": name},
        "spec": {
            "protocol": {"name": "fedavg"},
            "clients": {"count": 3},
            "rounds": rounds,
            # Slow enough rounds that a test acts while the run is still going.
            "training": {"batchSize": 16, "localEpochs": 4},
            "checkpoint": {
                "everyRounds": 1,
                "s3": {
                    "bucket": bucket,
                    "endpoint": s3.endpoint,
                    "credentialsSecret": "s3-credentials",
                    "retrySeconds": 30,
                },
            },
            "failurePolicy": {"connectTimeoutSeconds": 120},
            "backoffLimit": 2,
        },
    }


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[S3Server]:
    server = start_s3(tmp_path / "s3")
    try:
        yield server
    finally:
        server.stop()


def apply_until_checkpoint(
    plane: ControlPlane,
    kubelet: FakeKubelet,
    operator: OperatorProcess,
    namespace: str,
    s3: S3Server,
    body: dict[str, Any],
    round_: int,
) -> Any:
    """Makes the bucket ``runs`` and the credentials Secret, applies the run ``body``, and
    waits for its checkpoint of ``round_``; returns its debug printer."""
    s3.client().create_bucket(Bucket="runs")  # type: ignore[attr-defined]
    create_credentials(plane, namespace)
    name = body["metadata"]["name"]
    plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))
    show = debug(plane, kubelet, operator, namespace, name)
    wait_for_run(
        plane, namespace, name,
        lambda r: ((r.get("status") or {}).get("lastCheckpoint") or {}).get("round", 0) >= round_,
        timeout=180, what=f"a checkpoint of round {round_}", debug=show,
    )  # fmt: skip
    return show


def create_credentials(plane: ControlPlane, namespace: str) -> None:
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "s3-credentials"},
        "stringData": {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY},
    }
    plane.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(secret))


def listed(plane: ControlPlane, namespace: str, resource: str) -> list[dict[str, Any]]:
    """The namespace's ``pods`` or ``secrets`` as JSON."""
    path = f"/api/v1/namespaces/{namespace}/{resource}"
    items: list[dict[str, Any]] = request(plane.api_client(), "GET", path)["items"]
    return items


def run_keys(plane: ControlPlane, namespace: str, run: str) -> dict[str, tuple[str, bytes]]:
    """The run's key Secrets in its namespace: name -> (uid, the key file's content)."""
    found = {}
    for secret in listed(plane, namespace, "secrets"):
        meta = secret["metadata"]
        if meta["name"] in (f"{run}-server-keys", f"{run}-kdc-keys"):
            owners = [ref["name"] for ref in meta.get("ownerReferences") or []]
            assert owners == [run], (meta["name"], owners)
            (content,) = (secret.get("data") or {}).values()
            found[meta["name"]] = (meta["uid"], base64.b64decode(content))
    return found


def key_mounts(plane: ControlPlane, namespace: str) -> dict[str, list[str]]:
    """Per pod of the namespace, the key Secrets (``-keys``) its volumes name."""
    return {
        pod["metadata"]["name"]: [
            volume["secret"]["secretName"]
            for volume in pod["spec"].get("volumes") or []
            if volume.get("secret", {}).get("secretName", "").endswith("-keys")
        ]
        for pod in listed(plane, namespace, "pods")
    }


def test_killed_server_pod_is_recreated_and_resumes_from_its_checkpoint(
    control_plane: ControlPlane,
    kubelet: FakeKubelet,
    operator: OperatorProcess,
    namespace: str,
    s3: S3Server,
) -> None:
    body = s3_run("phoenix", s3, "runs", rounds=30)
    show = apply_until_checkpoint(control_plane, kubelet, operator, namespace, s3, body, 3)
    keys = run_keys(control_plane, namespace, "phoenix")
    assert list(keys) == ["phoenix-server-keys"]
    kubelet.kill(namespace, "phoenix-server", signal.SIGKILL)
    run = wait_for_run(
        control_plane,
        namespace,
        "phoenix",
        phase_is("Succeeded", "Failed"),
        timeout=240,
        what="end",
        debug=show,
    )
    status = run["status"]
    assert status["phase"] == "Succeeded", (status, show())
    assert status["restarts"] == 1, status
    assert status["roles"]["server"]["failed"] == 1
    (failure,) = status["failures"]  # the attempt's history outlives the pod
    assert (failure["pod"], failure["role"], failure["action"]) == (
        "phoenix-server",
        "server",
        "Recreated",
    )
    assert failure["exitCode"] != 0 and failure["time"]
    assert status["round"] == 30
    log = kubelet.log_of(namespace, "phoenix-server")
    assert "Resumed from the checkpoint of round" in log, log[-2000:]
    # The recreated server read its checkpoints with the run's key: the same Secret, unchanged.
    assert run_keys(control_plane, namespace, "phoenix") == keys
    # Each server pod kept its events beside the checkpoints: the killed one's up to its last
    # checkpoint, the new one's from its resume to the end.
    client: Any = s3.client()
    listed_keys = client.list_objects_v2(Bucket="runs", Prefix="phoenix/checkpoints/history/")
    names = sorted(item["Key"] for item in listed_keys.get("Contents", []))
    assert len(names) == 2, names
    first, second = (
        [
            json.loads(line)
            for line in client.get_object(Bucket="runs", Key=name)["Body"].read().splitlines()
        ]
        for name in names
    )
    assert first[0]["event"] == "ready" and first[0]["start_round"] == 1
    # (the kill may land between a checkpoint's status report and its history write)
    assert first[-1]["event"] == "checkpoint" and first[-1]["round"] >= 2
    assert not any(event["event"] == "finished" for event in first)
    resumed = next(event for event in second if event["event"] == "ready")
    assert second[0]["event"] == "resumed" and resumed["start_round"] > first[-1]["round"]
    assert second[-1]["event"] == "finished" and second[-1]["rounds_completed"] == 30


def test_operator_killed_mid_run_comes_back_without_duplicates_or_lost_status(
    control_plane: ControlPlane, kubelet: FakeKubelet, namespace: str, tmp_path: Path
) -> None:
    install_crd(control_plane)
    first = start_operator(control_plane, tmp_path / "op", webhook=False)
    body = yaml.safe_load((ROOT / "examples/digits-fedavg.yaml").read_text())
    body["metadata"]["name"] = "sturdy"
    body["spec"]["clients"]["count"] = 4
    body["spec"]["rounds"] = 15
    try:
        control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))
        wait_for_run(
            control_plane,
            namespace,
            "sturdy",
            lambda r: ((r.get("status") or {}).get("round") or 0) >= 2,
            timeout=180,
            what="round 2",
            debug=lambda: first.tail(),
        )
    finally:
        first.stop(signal.SIGKILL)
    time.sleep(2)
    with running_operator(control_plane, tmp_path / "op2", webhook=False) as second:
        run = wait_for_run(
            control_plane,
            namespace,
            "sturdy",
            phase_is("Succeeded", "Failed"),
            timeout=240,
            what="end",
            debug=debug(control_plane, kubelet, second, namespace, "sturdy"),
        )
        status = run["status"]
        assert status["phase"] == "Succeeded", status
        show = debug(control_plane, kubelet, second, namespace, "sturdy")
        # A string, not a tuple: pytest shortens a tuple's repr and hides the pods' logs.
        assert status["restarts"] == 0, (
            f"{status['roles']}\n{show()}\n--- first operator\n{first.tail()}\n"
            f"--- kubelet's view\n{kubelet.describe(namespace)}"
        )
    assert status["round"] == 15
    names = sorted(pod["metadata"]["name"] for pod in listed(control_plane, namespace, "pods"))
    assert len(names) == len(set(names))
    assert all(name.startswith("sturdy-") for name in names)


def test_failed_client_pod_is_recreated_and_a_suspended_run_resumes(
    control_plane: ControlPlane,
    kubelet: FakeKubelet,
    operator: OperatorProcess,
    namespace: str,
    s3: S3Server,
) -> None:
    s3.client().create_bucket(Bucket="runs")  # type: ignore[attr-defined]
    create_credentials(control_plane, namespace)
    body = s3_run("pause", s3, "runs", rounds=40)
    body["spec"]["clients"]["quorum"] = 2
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))
    show = debug(control_plane, kubelet, operator, namespace, "pause")

    def checkpoint_at_least(round_: int) -> Any:
        return lambda r: (
            ((r.get("status") or {}).get("lastCheckpoint") or {}).get("round", 0) >= round_
        )

    wait_for_run(control_plane, namespace, "pause", checkpoint_at_least(2), timeout=180,
                 what="a checkpoint of round 2", debug=show)  # fmt: skip
    kubelet.kill(namespace, "pause-client-1", signal.SIGKILL)
    run = wait_for_run(
        control_plane,
        namespace,
        "pause",
        lambda r: (
            ((r.get("status") or {}).get("roles") or {}).get("clients", {}).get("failed") == 1
        ),
        timeout=60,
        what="the failed client counted",
        debug=show,
    )
    assert run["status"]["restarts"] == 1
    # The server's key is a Secret of the run's namespace that only the server pod mounts.
    keys = run_keys(control_plane, namespace, "pause")
    assert list(keys) == ["pause-server-keys"]
    (key,) = (content for _, content in keys.values())
    assert len(key) == 64 and bytes.fromhex(key.decode()).hex().encode() == key  # lowercase hex
    mounts = key_mounts(control_plane, namespace)
    assert mounts.pop("pause-server") == ["pause-server-keys"], mounts
    assert mounts and all(name.startswith("pause-client-") for name in mounts), mounts
    assert all(found == [] for found in mounts.values()), mounts
    wait_for_run(control_plane, namespace, "pause", checkpoint_at_least(5), timeout=180,
                 what="a checkpoint of round 5", debug=show)  # fmt: skip
    patch = '{"spec": {"suspend": true}}'
    control_plane.kubectl("patch", "-n", namespace, "frun", "pause", "--type=merge", "-p", patch)
    run = wait_for_run(control_plane, namespace, "pause", phase_is("Suspended"), timeout=60,
                       what="phase Suspended", debug=show)  # fmt: skip
    deadline = time.monotonic() + 30
    while control_plane.core().list_namespaced_pod(namespace).items:
        assert time.monotonic() < deadline, "the suspended run's pods were not removed"
        time.sleep(0.5)
    suspended_round = run["status"]["lastCheckpoint"]["round"]
    assert suspended_round < 40
    patch = '{"spec": {"suspend": false}}'
    control_plane.kubectl("patch", "-n", namespace, "frun", "pause", "--type=merge", "-p", patch)
    run = wait_for_run(control_plane, namespace, "pause", phase_is("Succeeded", "Failed"),
                       timeout=240, what="end", debug=show)  # fmt: skip
    status = run["status"]
    assert status["phase"] == "Succeeded", (status, show())
    assert status["round"] == 40
    assert status["restarts"] == 1, status
    assert status["activeSeconds"] > 0
    log = kubelet.log_of(namespace, "pause-server")
    assert "Resumed from the checkpoint of round" in log, log[-2000:]
    # Kept across the suspension: the same Secret (uid) and key.
    assert run_keys(control_plane, namespace, "pause") == keys


def test_lppa_clients_train_over_their_peer_links_through_the_headless_service_names(
    control_plane: ControlPlane, kubelet: FakeKubelet, operator: OperatorProcess, namespace: str
) -> None:
    """Each client dials each neighbour at client-<j>.<run>-clients.<ns>.svc, as on a cluster.

    The fake kubelet hands the clients' peer-address template to its cluster DNS, which gives
    a per-pod name an address only as real DNS would (a headless Service selecting a pod with
    that hostname and subdomain), so the run ends only if the operator's objects give every
    client such a name and the clients retry until their peers listen.
    """
    body = yaml.safe_load((ROOT / "examples/digits-lppa.yaml").read_text())
    body["metadata"]["name"] = "mesh"
    body["spec"]["protocol"]["lppa"]["topology"] = {"kind": "Complete"}
    body["spec"]["clients"]["count"] = 4
    body["spec"]["rounds"] = 10
    body["spec"]["evaluation"]["everyRounds"] = 5
    body["spec"]["checkpoint"]["everyRounds"] = 5
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))
    show = debug(control_plane, kubelet, operator, namespace, "mesh")
    run = wait_for_run(
        control_plane, namespace, "mesh", phase_is("Succeeded", "Failed"), timeout=240,
        what="end", debug=show,
    )  # fmt: skip
    assert run["status"]["phase"] == "Succeeded", (run["status"], show())
    # The run succeeds when its coordinator does; each client pod ends a moment later, after it
    # has written its own model, and the status counts it then.
    run = wait_for_run(
        control_plane, namespace, "mesh",
        lambda r: ((r.get("status") or {}).get("roles") or {}).get("clients", {}).get(
            "succeeded") == 4,
        timeout=60, what="every client pod to end", debug=show,
    )  # fmt: skip
    status = run["status"]
    assert status["round"] == 10 and status["restarts"] == 0
    assert status["roles"]["clients"]["succeeded"] == 4
    assert status["finalMetrics"]["roundsCompleted"] == 10
    assert status["finalMetrics"]["accuracy"] > 0.1  # better than chance on 10 classes
    clients = range(4)
    # Each client signed its own checkpoints with its own key Secret, which no other pod has.
    mounts = key_mounts(control_plane, namespace)
    for i in clients:
        assert mounts[f"mesh-client-{i}"] == [f"mesh-client-{i}-keys"], mounts
        log = kubelet.log_of(namespace, f"mesh-client-{i}")
        # (the fake kubelet maps /etc/fedcore/keys to a folder of its own)
        used = (
            rf"Using the checkpoint key of client {i} in \S+/checkpoint\.key "
            r"\(FEDCORE_CHECKPOINT_KEY_FILE\)"
        )
        assert re.search(used, log), log[-3000:]
    assert mounts["mesh-server"] == ["mesh-server-keys"], mounts
    client_keys = [
        secret
        for secret in listed(control_plane, namespace, "secrets")
        if secret["metadata"]["name"].startswith("mesh-client-")
        and secret["metadata"]["name"].endswith("-keys")
    ]
    assert len({base64.b64decode(s["data"]["checkpoint.key"]) for s in client_keys}) == 4
    for i in clients:
        name = f"client-{i}.mesh-clients.{namespace}.svc.cluster.local"
        assert kubelet.dns.answered.get(name) == kubelet.pod_ip(namespace, f"mesh-client-{i}")
        log = kubelet.log_of(namespace, f"mesh-client-{i}")
        for j in clients:
            if j != i:
                assert f"Peer link to client {j} is up." in log, log[-3000:]
                assert f"Peer link from client {j} is up." in log, log[-3000:]


def peer_ring(s3: S3Server, *, backoff_limit: int) -> dict[str, Any]:
    """The lppa example as run ``ring``: 3 clients on the complete graph, 300 rounds, a
    checkpoint every 10 in the bucket ``runs`` of ``s3``."""
    body = yaml.safe_load((ROOT / "examples/digits-lppa.yaml").read_text())
    body["metadata"]["name"] = "ring"
    spec = body["spec"]
    spec["protocol"]["lppa"]["topology"] = {"kind": "Complete"}
    spec["clients"]["count"] = 3
    spec["rounds"] = 300
    spec["evaluation"]["everyRounds"] = 100
    spec["checkpoint"] = {
        "everyRounds": 10,
        "s3": {
            "bucket": "runs",
            "endpoint": s3.endpoint,
            "credentialsSecret": "s3-credentials",
            "retrySeconds": 30,
        },
    }
    spec["backoffLimit"] = backoff_limit
    return body


def test_a_killed_lppa_client_restarts_every_pod_which_resume_from_their_own_checkpoints(
    control_plane: ControlPlane,
    kubelet: FakeKubelet,
    operator: OperatorProcess,
    namespace: str,
    s3: S3Server,
) -> None:
    """A decentralized run cannot replace one client alone (its neighbours' states assume it):
    the operator restarts every pod, once; each client restores its own checkpoint (in S3,
    encrypted with its own key Secret) of the round the coordinator resumes from."""
    body = peer_ring(s3, backoff_limit=2)
    show = apply_until_checkpoint(control_plane, kubelet, operator, namespace, s3, body, 20)
    kubelet.kill(namespace, "ring-client-1", signal.SIGKILL)
    run = wait_for_run(
        control_plane, namespace, "ring", phase_is("Succeeded", "Failed"), timeout=300,
        what="end", debug=show,
    )  # fmt: skip
    status = run["status"]
    assert status["phase"] == "Succeeded", (status, show())
    assert status["restarts"] == 1 and status["round"] == 300
    killed = [f for f in status["failures"] if f["pod"] == "ring-client-1"]
    assert [(f["role"], f["action"]) for f in killed] == [("client", "Recreated")]
    assert "Resumed from the checkpoint of round" in kubelet.log_of(namespace, "ring-server")
    for index in range(3):
        log = kubelet.log_of(namespace, f"ring-client-{index}")
        assert "Restored the state of round" in log, log[-3000:]
    # What a reader of the bucket finds of a client: ciphertext under that client's own key.
    objects = s3.client().list_objects_v2(Bucket="runs", Prefix="ring/checkpoints/clients/")  # type: ignore[attr-defined]
    manifests = [o["Key"] for o in objects["Contents"] if o["Key"].endswith("MANIFEST.json")]
    assert manifests
    for key in manifests:
        manifest = json.loads(s3.client().get_object(Bucket="runs", Key=key)["Body"].read())  # type: ignore[attr-defined]
        assert manifest["encryption"] == "AES-256-GCM-CHUNKS", key


def test_an_lppa_client_whose_key_secret_was_lost_ends_the_run_at_once_checkpoint_invalid(
    control_plane: ControlPlane,
    kubelet: FakeKubelet,
    operator: OperatorProcess,
    namespace: str,
    s3: S3Server,
) -> None:
    """A client that cannot restore its checkpoint (here its key Secret was deleted, so the
    operator drew a new key, which cannot open the old checkpoints) would fail the same way in
    every new pod: the run ends Failed with reason CheckpointInvalid after the one restart
    that found it, instead of restarting until spec.backoffLimit."""
    body = peer_ring(s3, backoff_limit=4)
    show = apply_until_checkpoint(control_plane, kubelet, operator, namespace, s3, body, 20)
    control_plane.kubectl("delete", "secret", "-n", namespace, "ring-client-1-keys")
    kubelet.kill(namespace, "ring-client-1", signal.SIGKILL)
    run = wait_for_run(
        control_plane, namespace, "ring", phase_is("Succeeded", "Failed"), timeout=300,
        what="end", debug=show,
    )  # fmt: skip
    status = run["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "CheckpointInvalid"), (status, show())
    assert status["restarts"] == 1, status
    assert "client 1" in status["message"] and "another key" in status["message"], status
    log = kubelet.log_of(namespace, "ring-client-1")
    assert "CheckpointInvalid: Client 1 must resume from its checkpoint" in log, log[-3000:]
    # The failed pod (kept) says why in its status: the role's termination message.
    (failed,) = [
        p
        for p in listed(control_plane, namespace, "pods")
        if p["metadata"]["name"] == "ring-client-1"
    ]
    (state,) = [c["state"]["terminated"] for c in failed["status"]["containerStatuses"]]
    assert state["exitCode"] == 65, state
    assert state["message"].startswith("CheckpointInvalid: Client 1 must resume"), state


def test_secagg_with_distributed_dp_runs_from_the_pods_own_tls_identities(
    control_plane: ControlPlane, kubelet: FakeKubelet, operator: OperatorProcess, namespace: str
) -> None:
    """Each client pod signs its round keys with the key of its own TLS Secret and checks the
    others' against the run's CA, as mounted: the run ends only if every identity is the
    client's own, and its epsilon is the one its ledger computes."""
    body = yaml.safe_load((ROOT / "examples/digits-secagg.yaml").read_text())
    body["metadata"]["name"] = "masked"
    body["spec"]["clients"]["count"] = 4
    body["spec"]["clients"]["quorum"] = 3
    body["spec"]["rounds"] = 3
    body["spec"]["protocol"]["secagg"]["distributedDp"] = {"noiseMultiplier": 1.0}
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))
    show = debug(control_plane, kubelet, operator, namespace, "masked")
    run = wait_for_run(
        control_plane, namespace, "masked", phase_is("Succeeded", "Failed"), timeout=240,
        what="end", debug=show,
    )  # fmt: skip
    status = run["status"]
    assert status["phase"] == "Succeeded", (status, show())
    assert status["finalMetrics"]["roundsCompleted"] == 3
    assert status["privacy"]["epsilon"] > 0
    log = kubelet.log_of(namespace, "masked-server")
    assert "refused" not in log.lower() and "declined" not in log.lower(), log[-3000:]

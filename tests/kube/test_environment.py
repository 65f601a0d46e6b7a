"""The test environment itself: a real control plane, and pods run by the fake kubelet."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import textwrap
import time
from typing import Any

import pytest

from tests.kube.cluster import ControlPlane, pod_ready, read_json
from tests.kube.dns import DnsServer, NoSuchName
from tests.kube.kubelet import DNS_RE, TEMPLATE_RE, FakeKubelet, expand

PYTHON_IMAGE = "python:3.11-slim"


def make_pod(name: str, script: str, *args: str, **spec: Any) -> dict[str, Any]:
    """A pod running ``python -c script args...`` with restartPolicy Never."""
    container = {
        "name": "main",
        "image": PYTHON_IMAGE,
        "command": ["python", "-c", textwrap.dedent(script)],
        "args": list(args),
    }
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": spec.pop("labels", {"test": name})},
        "spec": {"restartPolicy": "Never", "containers": [container], **spec},
    }


def create(plane: ControlPlane, namespace: str, pod: dict[str, Any]) -> str:
    plane.core().create_namespaced_pod(namespace, pod, _preload_content=False)
    return str(pod["metadata"]["name"])


def terminated(pod: dict[str, Any]) -> dict[str, Any]:
    return dict(pod["status"]["containerStatuses"][0]["state"]["terminated"])


def last_json(text: str) -> Any:
    lines = [line for line in text.splitlines() if line.startswith("{")]
    assert lines, f"no JSON line in the pod's output:\n{text}"
    return json.loads(lines[-1])


# -- pure helpers ------------------------------------------------------------------------------


def test_expand_follows_kubernetes_rules() -> None:
    values = {"A": "x", "B": "y"}.get
    assert expand("$(A)-$(B)", values) == "x-y"
    assert expand("$$(A) $(C) $(A", values) == "$(A) $(C) $(A"
    assert expand("cost: $5 $", values) == "cost: $5 $"


def test_dns_pattern_finds_cluster_names_only() -> None:
    found = [m.group(0) for m in DNS_RE.finditer("a.ns.svc:80 x.y.ns.svc.cluster.local b.ns.svcx")]
    assert found == ["a.ns.svc:80", "x.y.ns.svc.cluster.local"]
    assert not DNS_RE.search("a.ns.svc.example.com") and not DNS_RE.search("w.a.b.ns.svc")


def test_template_pattern_takes_whole_per_pod_templates_only() -> None:
    match = TEMPLATE_RE.fullmatch("client-{index}.run-clients.ns.svc:7072")
    assert match is not None and match.groups() == ("client-{index}", "run-clients.ns", "7072")
    assert TEMPLATE_RE.fullmatch("client-{index}.run-clients.ns.svc.cluster.local:7072")
    assert not TEMPLATE_RE.fullmatch("client-{index}.run-clients.ns.svc")  # no port
    assert not TEMPLATE_RE.fullmatch("client-1.run-clients.ns.svc:7072")  # no template


def dns_query(server: str, name: str, qtype: int) -> tuple[int, list[bytes]]:
    """(rcode, A addresses) of one UDP query to ``server``."""
    host, port = server.rsplit(":", 1)
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    query = struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + question
    query += struct.pack("!HH", qtype, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(5)
        sock.sendto(query, (host, int(port)))
        reply = sock.recv(4096)
    ident, flags, _, count = struct.unpack_from("!HHHH", reply)
    assert ident == 0x1234 and flags & 0x8000
    offset, addresses = len(query), []
    for _ in range(count):
        rtype, _, _, size = struct.unpack_from("!HHIH", reply, offset + 2)
        assert rtype == 1 and size == 4
        addresses.append(reply[offset + 12 : offset + 16])
        offset += 16
    return flags & 0xF, addresses


def test_cluster_dns_answers_a_nodata_nxdomain_and_servfail() -> None:
    def lookup(name: str) -> str:
        if name == "p0.peers.ns.svc.cluster.local":
            return "127.5.6.7"
        if name == "broken.ns.svc.cluster.local":
            raise RuntimeError("cannot tell")
        raise NoSuchName(name)

    server = DnsServer(lookup).start()
    try:
        assert dns_query(server.address, "P0.peers.ns.svc.cluster.local", 1) == (
            0, [socket.inet_aton("127.5.6.7")],
        )  # fmt: skip
        assert dns_query(server.address, "p0.peers.ns.svc.cluster.local", 28) == (0, [])
        assert dns_query(server.address, "p1.peers.ns.svc.cluster.local", 1) == (3, [])
        assert dns_query(server.address, "broken.ns.svc.cluster.local", 1) == (2, [])
        assert server.answered == {"p0.peers.ns.svc.cluster.local": "127.5.6.7"}
    finally:
        server.stop()


# -- the control plane and the fake kubelet ------------------------------------------------------


def test_pod_gets_env_secret_and_succeeds(
    control_plane: ControlPlane, kubelet: FakeKubelet, namespace: str
) -> None:
    core = control_plane.core()
    core.create_namespaced_secret(
        namespace,
        {"metadata": {"name": "creds"}, "stringData": {"password": "s3cret", "user": "ada"}},
        _preload_content=False,
    )
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "settings"}, "data": {"MODE": "fast"}},
        _preload_content=False,
    )  # fmt: skip
    script = """
        import json, os, sys
        keys = ("GREETING", "POD_IP", "POD_NAME", "PASSWORD", "MODE", "KUBERNETES_SERVICE_PORT")
        env = {key: os.environ.get(key) for key in keys}
        print(json.dumps({"env": env, "file": open(sys.argv[1]).read(), "argv": sys.argv[1:],
                          "user": open("/etc/creds/user").read() if os.path.exists(
                              "/etc/creds/user") else None}))
    """
    pod = make_pod(
        "env",
        script,
        "/etc/creds/password",
        "$(POD_NAME)",
        "$$(POD_NAME)",
        container={
            "env": [
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "GREETING", "value": "hello $(POD_NAME) at $(POD_IP)"},
                {
                    "name": "PASSWORD",
                    "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}},
                },
            ],
            "envFrom": [{"configMapRef": {"name": "settings"}}],
            "volumeMounts": [{"name": "creds", "mountPath": "/etc/creds", "readOnly": True}],
        },
        volumes=[{"name": "creds", "secret": {"secretName": "creds"}}],
    )
    create(control_plane, namespace, pod)
    done = control_plane.wait_for_phase(namespace, "env", "Succeeded", "Failed")
    output = kubelet.log_of(namespace, "env")
    assert done["status"]["phase"] == "Succeeded", output
    assert terminated(done)["exitCode"] == 0 and terminated(done)["reason"] == "Completed"
    ip = done["status"]["podIP"]
    assert ip.startswith("127.") and ip == kubelet.pod_ip(namespace, "env")
    assert done["spec"]["nodeName"] in control_plane.nodes
    report = last_json(output)
    assert report["env"] == {
        "GREETING": f"hello env at {ip}",
        "POD_IP": ip,
        "POD_NAME": "env",
        "PASSWORD": "s3cret",
        "MODE": "fast",
        "KUBERNETES_SERVICE_PORT": str(control_plane.api_port),
    }
    assert report["file"] == "s3cret"
    assert report["argv"][1:] == ["env", "$(POD_NAME)"]
    assert report["argv"][0].startswith(str(kubelet.folder_of(namespace, "env")))
    assert report["user"] == "ada"  # a mount path inside the -c script is rewritten too


def test_failing_and_crashing_pods_report_failed(
    control_plane: ControlPlane, kubelet: FakeKubelet, namespace: str
) -> None:
    create(control_plane, namespace, make_pod("fails", "import sys; sys.exit(3)"))
    create(control_plane, namespace, make_pod("sleeps", "import time; time.sleep(600)"))
    control_plane.wait_for_phase(namespace, "sleeps", "Running")
    kubelet.kill(namespace, "sleeps", signal.SIGKILL)
    failed = control_plane.wait_for_phase(namespace, "fails", "Succeeded", "Failed")
    assert failed["status"]["phase"] == "Failed"
    assert terminated(failed)["exitCode"] == 3 and terminated(failed)["reason"] == "Error"
    crashed = control_plane.wait_for_phase(namespace, "sleeps", "Succeeded", "Failed")
    assert crashed["status"]["phase"] == "Failed"
    assert terminated(crashed)["exitCode"] == 128 + signal.SIGKILL
    assert not pod_ready(crashed)


def test_gpu_request_is_scheduled_on_the_gpu_node(
    control_plane: ControlPlane, kubelet: FakeKubelet, namespace: str
) -> None:
    pod = make_pod("gpu", "pass", container={"resources": {"limits": {"nvidia.com/gpu": "2"}}})
    create(control_plane, namespace, pod)
    done = control_plane.wait_for_phase(namespace, "gpu", "Succeeded", "Failed")
    assert done["status"]["phase"] == "Succeeded", kubelet.log_of(namespace, "gpu")
    assert done["spec"]["nodeName"].startswith("fake-gpu-node")


SERVER = """
    import socket, sys
    server = socket.create_server((sys.argv[1], 8123))
    print("listening on", server.getsockname(), flush=True)
    while True:
        connection, _ = server.accept()
        with connection:
            if connection.recv(4) == b"ping":
                connection.sendall(b"pong")
"""

CLIENT = """
    import json, os, socket, sys
    answers = []
    for address in sys.argv[1:]:
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as connection:
            connection.sendall(b"ping")
            answers.append(connection.recv(4).decode())
    print(json.dumps({"argv": sys.argv[1:], "answers": answers}))
"""


def test_service_dns_names_reach_the_ready_pod(
    control_plane: ControlPlane, kubelet: FakeKubelet, namespace: str
) -> None:
    core = control_plane.core()
    for service in (
        {
            "metadata": {"name": "a-svc"},
            "spec": {"selector": {"app": "a"}, "ports": [{"port": 80, "targetPort": "serve"}]},
        },
        {
            "metadata": {"name": "a-headless"},
            "spec": {"clusterIP": "None", "selector": {"app": "a"}, "ports": [{"port": 8123}]},
        },
    ):
        core.create_namespaced_service(namespace, service, _preload_content=False)
    # B first: the kubelet holds it back until a Ready pod serves the names it uses.
    client = make_pod(
        "b",
        CLIENT,
        f"a-svc.{namespace}.svc:80",
        f"a0.a-headless.{namespace}.svc.cluster.local:8123",
    )
    create(control_plane, namespace, client)
    server = make_pod(
        "a",
        SERVER,
        "0.0.0.0",
        labels={"app": "a"},
        hostname="a0",
        subdomain="a-headless",
        container={
            "ports": [{"name": "serve", "containerPort": 8123}],
            "readinessProbe": {"tcpSocket": {"port": "serve"}, "periodSeconds": 1},
        },
    )
    create(control_plane, namespace, server)
    done = control_plane.wait_for_phase(namespace, "b", "Succeeded", "Failed")
    assert done["status"]["phase"] == "Succeeded", kubelet.log_of(namespace, "b")
    served = control_plane.pod(namespace, "a")
    assert served is not None and pod_ready(served), kubelet.log_of(namespace, "a")
    ip = served["status"]["podIP"]
    assert kubelet.argv_of(namespace, "a")[-1] == ip  # 0.0.0.0 is the pod's own address
    report = last_json(kubelet.log_of(namespace, "b"))
    assert report["argv"] == [f"{ip}:8123", f"{ip}:8123"]
    assert report["answers"] == ["pong", "pong"]
    # No Endpoints check: 1.20 rejects loopback addresses in Endpoints (the controller fails).


API_CALL = """
    import os, ssl, sys, urllib.error, urllib.request
    folder = os.environ["FEDCORE_SERVICEACCOUNT_DIR"]
    token = open(os.path.join(folder, "token")).read()
    namespace = open(os.path.join(folder, "namespace")).read()
    context = ssl.create_default_context(cafile=os.path.join(folder, "ca.crt"))
    request = urllib.request.Request(
        f"{sys.argv[1]}/api/v1/namespaces/{namespace}/secrets",
        headers={"Authorization": f"Bearer {token}"},
    )
    try:
        code = urllib.request.urlopen(request, context=context, timeout=10).status
    except urllib.error.HTTPError as error:
        code = error.code
    print("status", code)
    sys.exit(0 if code == int(sys.argv[2]) else 1)
"""


def test_service_account_token_calls_the_api_under_rbac(
    control_plane: ControlPlane, kubelet: FakeKubelet, namespace: str
) -> None:
    core = control_plane.core()
    core.create_namespaced_service_account(
        namespace, {"metadata": {"name": "reader"}}, _preload_content=False
    )
    api = "https://kubernetes.default.svc:443"
    create(
        control_plane,
        namespace,
        make_pod("denied", API_CALL, api, "403", serviceAccountName="reader"),
    )
    denied = control_plane.wait_for_phase(namespace, "denied", "Succeeded", "Failed")
    assert denied["status"]["phase"] == "Succeeded", kubelet.log_of(namespace, "denied")
    control_plane.kubectl(
        "-n", namespace, "create", "role", "secret-reader", "--verb=list", "--resource=secrets"
    )
    control_plane.kubectl(
        "-n", namespace, "create", "rolebinding", "reader", "--role=secret-reader",
        f"--serviceaccount={namespace}:reader",
    )  # fmt: skip
    create(
        control_plane,
        namespace,
        make_pod("allowed", API_CALL, api, "200", serviceAccountName="reader"),
    )
    allowed = control_plane.wait_for_phase(namespace, "allowed", "Succeeded", "Failed")
    assert allowed["status"]["phase"] == "Succeeded", kubelet.log_of(namespace, "allowed")
    assert kubelet.argv_of(namespace, "allowed")[-2].startswith("https://127.0.0.1:")


def test_deleting_a_running_pod_kills_its_process(
    control_plane: ControlPlane, kubelet: FakeKubelet, namespace: str
) -> None:
    script = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so only SIGKILL ends it
        print("started", flush=True)
        time.sleep(600)
    """
    create(control_plane, namespace, make_pod("stubborn", script, terminationGracePeriodSeconds=1))
    running = control_plane.wait_for_pod(namespace, "stubborn", pod_ready, what="Ready", timeout=30)
    assert running is not None
    pid = int(running["status"]["containerStatuses"][0]["containerID"].removeprefix("fake://"))
    os.kill(pid, 0)  # alive
    began = time.monotonic()
    control_plane.core().delete_namespaced_pod("stubborn", namespace, _preload_content=False)
    control_plane.wait_for_pod(namespace, "stubborn", lambda p: p is None, what="deletion")
    assert time.monotonic() - began < 8
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_garbage_collector_deletes_owned_objects(
    control_plane: ControlPlane, namespace: str
) -> None:
    core = control_plane.core()
    owner = read_json(core.create_namespaced_config_map, namespace, {"metadata": {"name": "owner"}})
    reference = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
    }
    core.create_namespaced_config_map(
        namespace,
        {"metadata": {"name": "owned", "ownerReferences": [reference]}},
        _preload_content=False,
    )
    core.delete_namespaced_config_map("owner", namespace, _preload_content=False)
    deadline = time.monotonic() + 30
    while True:
        names = [
            item["metadata"]["name"]
            for item in read_json(core.list_namespaced_config_map, namespace)["items"]
        ]
        if "owned" not in names:
            break
        assert time.monotonic() < deadline, f"the owned ConfigMap is still there: {names}"
        time.sleep(0.2)


PEER = """
    import json, socket, sys, threading, time
    pinged = threading.Event()
    server = socket.create_server((sys.argv[1], 8123))

    def serve():
        while True:
            connection, _ = server.accept()
            with connection:
                if connection.recv(4) == b"ping":
                    connection.sendall(b"pong")
                    pinged.set()

    threading.Thread(target=serve, daemon=True).start()
    host, port = sys.argv[2].rsplit(":", 1)
    deadline = time.monotonic() + 60
    while True:  # as a client on a cluster must: retry until the peer listens
        try:
            with socket.create_connection((host, int(port)), timeout=2) as connection:
                connection.sendall(b"ping")
                answer = connection.recv(4).decode()
            break
        except OSError:
            assert time.monotonic() < deadline, "the peer never listened"
            time.sleep(0.2)
    assert pinged.wait(60), "the peer never called"
    print(json.dumps({"peer": sys.argv[2], "answer": answer}))
"""


def test_pods_that_name_each_other_through_a_headless_service_both_start(
    control_plane: ControlPlane, kubelet: FakeKubelet, namespace: str
) -> None:
    # As on a cluster, a per-pod name exists once the pod has an address, before it is Ready
    # (publishNotReadyAddresses): two pods each waiting for the other to be Running would
    # never start.
    service = {
        "metadata": {"name": "peers"},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"app": "peer"},
            "ports": [{"port": 8123}],
        },
    }
    control_plane.core().create_namespaced_service(namespace, service, _preload_content=False)
    for me, other in (("p0", "p1"), ("p1", "p0")):
        pod = make_pod(
            me, PEER, "0.0.0.0", f"{other}.peers.{namespace}.svc:8123",
            labels={"app": "peer"}, hostname=me, subdomain="peers",
        )  # fmt: skip
        create(control_plane, namespace, pod)
    for me, other in (("p0", "p1"), ("p1", "p0")):
        done = control_plane.wait_for_phase(namespace, me, "Succeeded", "Failed")
        assert done["status"]["phase"] == "Succeeded", kubelet.log_of(namespace, me)
        report = last_json(kubelet.log_of(namespace, me))
        assert report == {"peer": f"{kubelet.pod_ip(namespace, other)}:8123", "answer": "pong"}

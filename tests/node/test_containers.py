"""What a real container runtime gives the operator's pods, read from inside the container.

The pod is the operator's own client pod (`fedcore_operator.objects.client_pod`) for the
quickstart's run, with its command replaced by a probe that reports what the process actually
got: its ids, capabilities, no-new-privileges and seccomp state, whether the root filesystem
is writable, its Secret files' modes and owners, and whether its scratch volumes are writable.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import yaml

from fedcore.spec import load_manifest
from fedcore_operator import objects
from fedcore_operator.settings import OperatorSettings
from tests.kube.cluster import read_json
from tests.node.node import RealNode, wait_for_pod_phase

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, os, stat
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
keys = ("CapEff", "CapPrm", "CapBnd", "NoNewPrivs", "Seccomp")
report = {key: status[key].strip() for key in keys}
report.update(uid=os.getuid(), gid=os.getgid(), groups=sorted(os.getgroups()))
def writable(folder):
    try:
        with open(os.path.join(folder, "probe"), "w") as handle:
            handle.write("x")
        return True
    except OSError as exc:
        return exc.errno
report["writable"] = {folder: writable(folder) for folder in ("/", "/opt/venv", "/tmp", WORK)}
report["secrets"] = {}
for name in sorted(os.listdir(TLS)):
    if name.startswith(".."):
        continue
    info = os.stat(os.path.join(TLS, name))
    report["secrets"][name] = [stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid]
import fedcore
report["fedcore"] = fedcore.__version__
print("PROBE " + json.dumps(report), flush=True)
"""


def _probe_pod(namespace: str) -> dict[str, Any]:
    """The operator's client-0 pod of the quickstart run, running the probe instead."""
    run = load_manifest(ROOT / "examples/digits-fedavg.yaml")
    ctx = objects.RunContext(run, namespace, "uid-probe", OperatorSettings())
    pod = objects.client_pod(ctx, 0)
    container = pod["spec"]["containers"][0]
    script = f"TLS = {objects.TLS_DIR!r}\nWORK = {objects.WORK_DIR!r}\n{PROBE}"
    container["command"] = [container["command"][0], "-c", script]
    container.pop("readinessProbe", None)
    pod["metadata"].pop("ownerReferences", None)
    return pod


def test_the_operators_pod_gets_non_root_read_only_no_capabilities_and_private_secrets(
    node: RealNode, node_namespace: str
) -> None:
    plane = node.control_plane
    pod = _probe_pod(node_namespace)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    tls_secret = volumes["tls"]["secret"]["secretName"]
    manifest = volumes["manifest"]["configMap"]["name"]
    plane.kubectl("create", "secret", "generic", tls_secret, "-n", node_namespace,
                  "--from-literal=tls.key=k", "--from-literal=tls.crt=c")  # fmt: skip
    plane.kubectl("create", "configmap", manifest, "-n", node_namespace,
                  "--from-literal=run.yaml=kind: FederatedRun")  # fmt: skip
    plane.kubectl("create", "serviceaccount", pod["spec"]["serviceAccountName"],
                  "-n", node_namespace)  # fmt: skip
    plane.kubectl("apply", "-n", node_namespace, "-f", "-", input=yaml.safe_dump(pod))
    name = pod["metadata"]["name"]

    done = wait_for_pod_phase(plane.core(), node_namespace, name, timeout=180)

    log = node.logs(node_namespace, name)
    assert done["status"]["phase"] == "Succeeded", (done["status"], log)
    report = json.loads(log.split("PROBE ", 1)[1])
    # uid and gid 10001 (the pod's runAsUser/runAsGroup), with the fsGroup as a group.
    assert (report["uid"], report["gid"]) == (10001, 10001)
    assert 10001 in report["groups"] and 0 not in report["groups"]
    # No capability at all, no privilege escalation, seccomp filtering (RuntimeDefault).
    assert report["CapEff"] == report["CapPrm"] == report["CapBnd"] == "0000000000000000"
    assert report["NoNewPrivs"] == "1"
    assert report["Seccomp"] == "2"
    # The image and the root filesystem are read-only; the pod's emptyDirs are not.
    assert report["writable"]["/"] == errno.EROFS
    assert report["writable"]["/opt/venv"] == errno.EROFS
    assert report["writable"]["/tmp"] is True
    assert report["writable"][objects.WORK_DIR] is True
    # Secret files: 0440, root-owned, group the fsGroup: readable by the pod's user only.
    assert report["secrets"] == {
        "tls.crt": [0o440, 0, 10001],
        "tls.key": [0o440, 0, 10001],
    }
    assert report["fedcore"] == __import__("fedcore").__version__
    # The pod got an address on the node's pod network.
    status = read_json(plane.core().read_namespaced_pod, name, node_namespace)["status"]
    assert status["podIP"].rsplit(".", 1)[0] == node.network.gateway.rsplit(".", 1)[0]

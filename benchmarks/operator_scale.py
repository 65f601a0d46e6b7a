"""The operator at scale: one 1,000-client FederatedRun against the real 1.20 test control plane.

Measures, in one invocation and for several repetitions (a fresh namespace each):
seconds from ``kubectl apply`` to every pod created (the server pod is marked Ready by this
script, standing in for a kubelet, so that the clients are created), seconds to every owned
object, API writes per reconcile pass once nothing changes (target: zero), reconcile pass
duration at rest, and the operator's resident memory (current and peak).

Run: ``python -m benchmarks.operator_scale [--clients 1000] [--repeats 3] [--write]``
(needs the control-plane binaries: ``bash hack/control-plane.sh``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.spine import write_section
from fedcore import __version__
from fedcore_operator import objects
from fedcore_operator.kube import request
from tests.kube._operator import OperatorProcess, install_crd, start_operator
from tests.kube.cluster import ControlPlane

BEGIN = "<!-- operator:begin -->"
END = "<!-- operator:end -->"
REST_SECONDS = 15.0
"""How long the run is watched at rest (five resyncs of 3 s) for writes per reconcile."""


def manifest(name: str, clients: int) -> dict[str, Any]:
    """A fedavg run with ``clients`` clients."""
    return {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "FederatedRun",
        "metadata": {"name": name},
        "spec": {"protocol": {"name": "fedavg"}, "clients": {"count": clients}, "rounds": 10},
    }


def count(plane: ControlPlane, namespace: str, resource: str, run: str) -> int:
    """How many objects of ``resource`` (core v1) carry the run's label."""
    items = request(
        plane.api_client(),
        "GET",
        f"/api/v1/namespaces/{namespace}/{resource}",
        query=[
            ("labelSelector", f"{objects.RUN_LABEL}={run}"),
            ("limit", "5000"),
        ],
    )["items"]
    return len(items)


def mark_ready(plane: ControlPlane, namespace: str, pod: str) -> None:
    """Plays the kubelet for one pod: Running and Ready."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    status = {
        "phase": "Running",
        "podIP": "127.0.0.2",
        "startTime": now,
        "conditions": [
            {"type": kind, "status": "True", "lastTransitionTime": now}
            for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
        ],
    }
    request(
        plane.api_client(),
        "PATCH",
        f"/api/v1/namespaces/{namespace}/pods/{pod}/status",
        body={"status": status},
        content_type="application/merge-patch+json",
    )


def memory_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


def measure(plane: ControlPlane, op: OperatorProcess, clients: int, repeat: int) -> dict[str, Any]:
    """One apply of a ``clients``-client run, measured to rest."""
    namespace = plane.create_namespace(f"scale-{repeat}-{int(time.time())}")
    name = "scale"
    started = time.monotonic()
    plane.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest(name, clients)))
    server = objects.pod_name(name, "server")
    while plane.pod(namespace, server) is None:
        time.sleep(0.05)
    mark_ready(plane, namespace, server)
    want_pods = clients + 1
    while count(plane, namespace, "pods", name) < want_pods:
        time.sleep(0.2)
    pods_seconds = time.monotonic() - started
    want_secrets = clients + 1  # each pod's; the run's CA is in the operator's namespace
    while count(plane, namespace, "secrets", name) < want_secrets:
        time.sleep(0.2)
    objects_seconds = time.monotonic() - started
    time.sleep(4)  # let the last passes (status) land
    writes = op.metric("fedcore_operator_api_writes_total")
    passes = op.metric("fedcore_operator_reconciles_total")
    duration_sum = op.metric("fedcore_operator_reconcile_duration_seconds_sum")
    time.sleep(REST_SECONDS)
    rest_passes = op.metric("fedcore_operator_reconciles_total") - passes
    rest_writes = op.metric("fedcore_operator_api_writes_total") - writes
    rest_duration = op.metric("fedcore_operator_reconcile_duration_seconds_sum") - duration_sum
    rss, peak = memory_kib(op.process.pid)
    # No kubelet runs these pods: remove them at once so the next repetition starts clean.
    plane.kubectl("delete", "-n", namespace, "frun", name, "--wait=false")
    plane.kubectl(
        "delete",
        "-n",
        namespace,
        "pods",
        "--all",
        "--grace-period=0",
        "--force",
        "--wait=true",
        timeout=300,
    )
    plane.delete_namespace(namespace)
    return {
        "pods_seconds": pods_seconds,
        "objects_seconds": objects_seconds,
        "rest_passes": rest_passes,
        "writes_per_pass": rest_writes / rest_passes if rest_passes else float("nan"),
        "pass_seconds": rest_duration / rest_passes if rest_passes else float("nan"),
        "rss_mib": rss / 1024,
        "peak_mib": peak / 1024,
    }


def render(clients: int, results: list[dict[str, Any]]) -> str:
    """The docs/benchmarks.md section."""

    def med(key: str) -> float:
        return statistics.median(result[key] for result in results)

    rows = [
        ("apply to every pod created", f"{med('pods_seconds'):.1f} s"),
        ("apply to every owned object created", f"{med('objects_seconds'):.1f} s"),
        ("API writes per reconcile at rest", f"{med('writes_per_pass'):.2f}"),
        ("reconcile pass at rest", f"{med('pass_seconds') * 1000:.0f} ms"),
        ("operator memory after (RSS)", f"{med('rss_mib'):.0f} MiB"),
        ("operator memory peak", f"{med('peak_mib'):.0f} MiB"),
    ]
    lines = [
        BEGIN,
        f"## Operator at scale: one {clients:,}-client run",
        "",
        f"`python -m benchmarks.operator_scale --clients {clients} --write`, "
        f"{datetime.date.today().isoformat()}, fedcore {__version__}, Python "
        f"{platform.python_version()}, {platform.machine()}; the real kube-apiserver 1.20.2 "
        "with etcd, controller-manager and scheduler on this machine; medians of "
        f"{len(results)} applies, each into a fresh namespace. The script marks the server pod "
        "Ready (no kubelet runs the pods), so the operator creates the clients.",
        "",
        "| measure | value |",
        "|---|---|",
        *[f"| {what} | {value} |" for what, value in rows],
        "",
        "Per repetition: "
        + "; ".join(
            f"{r['pods_seconds']:.1f} s to pods, {r['writes_per_pass']:.2f} writes/pass over "
            f"{r['rest_passes']:.0f} passes"
            for r in results
        )
        + ".",
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    """Runs the benchmark and prints (or writes) its section."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp, ControlPlane(workdir=Path(tmp) / "plane") as plane:
        plane.register_nodes(3)
        install_crd(plane)
        op = start_operator(plane, Path(tmp) / "operator", webhook=False)
        try:
            for repeat in range(args.repeats):
                results.append(measure(plane, op, args.clients, repeat))
                print(f"repeat {repeat + 1}: {results[-1]}", file=sys.stderr)
        finally:
            op.stop()
    section = render(args.clients, results)
    print(section)
    if args.write:
        write_section(section, begin=BEGIN, end=END)


if __name__ == "__main__":
    main()

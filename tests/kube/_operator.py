"""The operator as a real process against the test control plane, with its webhook and CRD."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from fedcore.local.ports import free_ports
from fedcore.transport import RunCa
from fedcore_operator.crd import CHART_CRD_PATH, CRD_NAME, GROUP, PLURAL, VERSION
from tests.kube.cluster import ControlPlane

WEBHOOK_NAME = "fedcore-test.fedcore.dev"


@dataclass
class OperatorProcess:
    """One running operator and where to look at it."""

    process: subprocess.Popen[bytes]
    log: Path
    metrics_port: int
    args: list[str]
    env: dict[str, str]

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples called ``name`` on /metrics whose labels match ``labels``."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
            and all(sample.labels.get(key) == value for key, value in labels.items())
        )

    def tail(self, lines: int = 60) -> str:
        """The last lines of the operator's log."""
        text = self.log.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        """Stops the process; returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return int(self.process.returncode)


def install_crd(plane: ControlPlane, path: Path = CHART_CRD_PATH, name: str = CRD_NAME) -> None:
    """Applies one of the chart's CRDs (the FederatedRun's by default) and waits until it is
    Established.

    Polled rather than ``kubectl wait``: a kubectl newer than the API server fails at once
    ("conditions accessor error") while a CRD just made has no conditions yet.
    """
    plane.kubectl("apply", "-f", str(path))
    deadline = time.monotonic() + 60
    while True:
        found = plane.kubectl("get", f"crd/{name}", "-o", "json", check=False)
        if found.returncode == 0:
            conditions = (json.loads(found.stdout).get("status") or {}).get("conditions") or []
            if any(
                c.get("type") == "Established" and c.get("status") == "True" for c in conditions
            ):
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"CRD {name} is not Established after 60 s: {found.stdout}")
        time.sleep(0.3)


def webhook_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a serving certificate for 127.0.0.1, as PEM files (cert, key, ca)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca = RunCa.generate("webhook")
    bundle = ca.issue("fedcore-operator", ip_addresses=["127.0.0.1"])
    cert, key, ca_file = folder / "tls.crt", folder / "tls.key", folder / "ca.crt"
    cert.write_bytes(bundle.cert_pem)
    key.write_bytes(bundle.key_pem)
    ca_file.write_bytes(bundle.ca_pem)
    return cert, key, ca_file


@contextmanager
def running_operator(
    plane: ControlPlane,
    folder: Path,
    *,
    webhook: bool = True,
    extra_env: dict[str, str] | None = None,
    namespaces: Sequence[str] = (),
) -> Iterator[OperatorProcess]:
    """Starts ``python -m fedcore_operator run`` and waits for it to lead and serve.

    ``namespaces`` limits what it reconciles (all by default); its webhook sees every run.
    """
    op = start_operator(plane, folder, webhook=webhook, extra_env=extra_env, namespaces=namespaces)
    try:
        yield op
    finally:
        op.stop()


def start_operator(
    plane: ControlPlane,
    folder: Path,
    *,
    webhook: bool = True,
    extra_env: dict[str, str] | None = None,
    lease: str = "fedcore-operator",
    wait_leading: bool = True,
    namespaces: Sequence[str] = (),
) -> OperatorProcess:
    """Starts one operator process (leader election on); waits until it leads (or serves)."""
    folder.mkdir(parents=True, exist_ok=True)
    metrics_port, webhook_port = free_ports(2)
    args = [
        sys.executable,
        "-m",
        "fedcore_operator",
        "run",
        f"--kubeconfig={plane.kubeconfig}",
        f"--metrics-port={metrics_port}",
        "--metrics-address=127.0.0.1",
        "--health-port=0",
        "--lease-namespace=default",
        f"--lease-name={lease}",
        "--log-format=plain",
        *(f"--namespace={namespace}" for namespace in namespaces),
    ]
    if webhook:
        cert, key, ca = webhook_certificates(folder / "webhook")
        args += [
            f"--webhook-port={webhook_port}",
            "--webhook-address=127.0.0.1",
            "--webhook-host=127.0.0.1",
            f"--webhook-cert={cert}",
            f"--webhook-key={key}",
            f"--webhook-ca={ca}",
            f"--manage-webhook={WEBHOOK_NAME}",
        ]
    env = {
        **os.environ,
        "FEDCORE_OPERATOR_RESYNC_SECONDS": "3",
        "PYTHONUNBUFFERED": "1",
        **(extra_env or {}),
    }
    log = folder / f"operator-{len(list(folder.glob('operator-*.log')))}.log"
    handle = log.open("wb")
    process = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, env=env)
    handle.close()
    op = OperatorProcess(process, log, metrics_port, args, env)
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise AssertionError(f"the operator exited with {process.returncode}:\n{op.tail()}")
        try:
            if op.metric("fedcore_operator_leader") == 1.0 or not wait_leading:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"the operator did not start leading:\n{op.tail()}")
        time.sleep(0.3)
    return op


def get_run(plane: ControlPlane, namespace: str, name: str) -> dict[str, Any] | None:
    """The FederatedRun as JSON, or None."""
    from kubernetes.client import CustomObjectsApi

    try:
        result: Any = CustomObjectsApi(plane.api_client()).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return dict(result)


def wait_for_run(
    plane: ControlPlane,
    namespace: str,
    name: str,
    predicate: Callable[[dict[str, Any]], bool],
    *,
    timeout: float,
    what: str,
    debug: Callable[[], str] = lambda: "",
) -> dict[str, Any]:
    """Polls the run until ``predicate`` holds on it; fails with its status otherwise."""
    deadline = time.monotonic() + timeout
    run: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        run = get_run(plane, namespace, name)
        if run is not None and predicate(run):
            return run
        time.sleep(0.5)
    raise AssertionError(
        f"run {namespace}/{name}: no {what} after {timeout:.0f} s; status: "
        f"{(run or {}).get('status')}\n{debug()}"
    )

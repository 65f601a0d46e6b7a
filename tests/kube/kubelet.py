"""A fake kubelet: runs the pods bound to the fake nodes as local processes, reports real status.

The strong form of the loop TESTENV.md describes. For each pod bound to one of its nodes it

- gives the pod its own loopback address (127.B.X.Y: all of 127.0.0.0/8 is loopback on Linux)
  and a folder, writes its volumes there (secret, configMap, emptyDir, downwardAPI, projected;
  hostPath is the host's path; a persistentVolumeClaim is a folder per claim that outlives the
  pod) and, with a service account, the SA's token and the cluster CA (``serviceaccount/``,
  also set as ``FEDCORE_SERVICEACCOUNT_DIR``);
- builds each container's environment and command line as Kubernetes does (envFrom, env with
  ``valueFrom``, ``$(VAR)`` expansion, command + args; ``python``/``python3`` is this venv's
  interpreter), then rewrites it for the host: mount paths become the pod's folders,
  ``0.0.0.0`` becomes the pod's IP (a pod's "all interfaces" is its own), and cluster DNS
  names (``svc.ns.svc[.cluster.local]``, ``host.subdomain.ns.svc...``) become the IP of a
  Ready pod behind them (waiting for one), with a Service's port mapped to its targetPort (TLS
  still verifies: every fedcore client checks its peer by role name, not by host);
- serves cluster DNS (`tests.kube.dns`) for names a process can only resolve later: a value
  that is a whole ``host-{index}.subdomain.ns.svc[.cluster.local]:port`` template (one address
  per pod, filled in by the process) becomes the gRPC target
  ``dns://<this DNS>/host-{index}.subdomain.ns.svc.cluster.local:port``, resolved at each dial;
- starts the process (its own process group; output to ``<folder>/<container>.log``), polls
  readiness probes (tcpSocket, httpGet, exec) against the pod's IP, and patches pods/status
  (Running, Ready, podIP; then Succeeded/Failed with the exit code); restarts containers for
  restartPolicy Always/OnFailure;
- on a deletionTimestamp: SIGTERM to the group, SIGKILL after min(grace, 10) s, then deletes
  the pod with grace 0.

Per-pod names (``host.subdomain.ns.svc``) follow real DNS: they exist once a headless Service
named ``subdomain`` selects a pod with that hostname and subdomain that has an IP, i.e. is bound
to a node (the kubelet gives a pod its IP the first time its name is needed and keeps it when
the pod starts), and, unless the Service publishes not-ready addresses, is Ready.

Not emulated: image entrypoints (a container needs a ``command``, unless `entrypoints` maps its
image), liveness probes, resource limits, readiness gates, separate network namespaces (two pods
that bind the same port on 127.0.0.1 collide; bind to the pod IP or 0.0.0.0).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import itertools
import json
import logging
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import kubernetes
from kubernetes.client.rest import ApiException

from tests.kube.cluster import ControlPlane, dying_with_parent, now_rfc3339, read_json
from tests.kube.dns import DnsServer, NoSuchName

LOG = logging.getLogger("fedcore.tests.kubelet")
REPO = Path(__file__).resolve().parents[2]
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
TERMINAL = ("Succeeded", "Failed")
T = TypeVar("T")

_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
DNS_RE = re.compile(
    rf"(?<![\w.-])({_LABEL}(?:\.{_LABEL}){{1,2}})\.svc(?:\.cluster\.local)?\.?"
    r"(?![\w-]|\.[\w-])(?::(\d+)(?!\d))?"
)
TEMPLATE_RE = re.compile(
    rf"([-a-z0-9]*\{{index\}}[-a-z0-9]*)\.({_LABEL}\.{_LABEL})\.svc(?:\.cluster\.local)?\.?:(\d+)"
)
ANY_ADDRESS_RE = re.compile(r"(?<![\w.])0\.0\.0\.0(?![\w./])")
PYTHON_RE = re.compile(r"python(?:3(?:\.\d+)?)?")
QUANTITY_RE = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
SUFFIXES = {
    "": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
}  # fmt: skip


class _Stop(Exception):
    """The pod is being deleted, or the kubelet stops: give up what was under way."""


class NotYet(Exception):
    """Something the pod needs (a Secret, a DNS target...) is not there yet: retry."""


def expand(text: str, lookup: Callable[[str], str | None]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: ``$$`` escapes, an unknown ``$(VAR)`` stays as is."""
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    while cursor < len(text):
        if text[cursor] == "$" and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            following = text[cursor + 1]
            advance = 1
            if following == "$":
                out.append("$")
            elif following == "(":
                close = text.find(")", cursor + 2)
                if close < 0:
                    out.append("$(")
                else:
                    name = text[cursor + 2 : close]
                    value = lookup(name)
                    out.append(f"$({name})" if value is None else value)
                    advance = close - cursor
            else:
                out.append("$" + following)
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    out.append(text[checkpoint:])
    return "".join(out)


def parse_quantity(text: str) -> float:
    """A Kubernetes quantity ("500m", "64Gi", "2") as a number."""
    match = QUANTITY_RE.match(str(text).strip())
    if not match or match.group(2) not in SUFFIXES:
        raise ValueError(f"unsupported quantity {text!r}")
    return float(match.group(1)) * SUFFIXES[match.group(2)]


def _decode(data: Mapping[str, str] | None) -> dict[str, bytes]:
    return {key: base64.b64decode(value) for key, value in (data or {}).items()}


def _exit_code(returncode: int) -> tuple[int, int | None]:
    """(exitCode as a container runtime reports it, signal or None)."""
    if returncode < 0:
        return 128 - returncode, -returncode
    return returncode, None


@dataclass
class _Container:
    """One container of a pod and the process that plays it."""

    spec: dict[str, Any]
    init: bool
    log: Path
    process: subprocess.Popen[bytes] | None = None
    restart_count: int = 0
    state: dict[str, Any] = field(
        default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}}
    )
    last_state: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    started: bool = False
    started_at: str = ""
    next_probe: float = 0.0
    probe_failures: int = 0
    restart_at: float | None = None
    exit_code: int | None = None
    argv: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def status(self) -> dict[str, Any]:
        """This container's entry of containerStatuses."""
        status: dict[str, Any] = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": f"fake://{self.spec.get('image', '')}",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
        }
        if self.process is not None:
            status["containerID"] = f"fake://{self.process.pid}"
        if self.last_state:
            status["lastState"] = self.last_state
        return status


class _PodWorker(threading.Thread):
    """Plays one pod from its first sight to its end (or deletion)."""

    def __init__(self, kubelet: FakeKubelet, pod: dict[str, Any], ip: str) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.kubelet = kubelet
        self.pod = pod
        self.namespace: str = meta["namespace"]
        self.pod_name: str = meta["name"]
        self.uid: str = meta["uid"]
        self.ip = ip
        self.folder = kubelet.workdir / f"{self.namespace}_{self.pod_name}_{self.uid[:8]}"
        self.deleting = threading.Event()
        self.gone = threading.Event()
        self.finished = threading.Event()
        spec = pod["spec"]
        self.restart_policy: str = spec.get("restartPolicy") or "Always"
        self.init_containers = [
            _Container(c, True, self.folder / f"{c['name']}.log")
            for c in spec.get("initContainers") or []
        ]
        self.containers = [
            _Container(c, False, self.folder / f"{c['name']}.log") for c in spec["containers"]
        ]
        self.phase = "Pending"
        self.reason: str | None = None
        self.message: str | None = None
        self.start_time = now_rfc3339()
        self.volumes: dict[str, Path] = {}
        self.sa_dir: Path | None = None
        self._transitions: dict[str, tuple[str, str]] = {}
        self._published = ""
        self._lock = threading.Lock()
        self._waiting_for = ""
        self.core: kubernetes.client.CoreV1Api | None = None

    # -- plumbing --------------------------------------------------------------------------

    def update(self, pod: dict[str, Any]) -> None:
        """A newer version of the pod from the watch."""
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self.deleting.set()

    def _api(self) -> kubernetes.client.CoreV1Api:
        assert self.core is not None
        return self.core

    def _check(self) -> None:
        if self.deleting.is_set() or self.kubelet.stopping.is_set():
            raise _Stop

    def _wait_for(self, what: str, attempt: Callable[[], T], timeout: float | None = None) -> T:
        """Retries ``attempt`` while it raises `NotYet`; raises after ``timeout`` seconds."""
        deadline = time.monotonic() + (timeout or self.kubelet.wait_timeout)
        logged = False
        while True:
            self._check()
            try:
                return attempt()
            except NotYet as exc:
                detail = str(exc)
            if not logged:
                LOG.info("%s/%s waits for %s: %s", self.namespace, self.pod_name, what, detail)
                logged = True
                self._waiting_for = f"waiting for {what}: {detail}"
                self.publish()
            if time.monotonic() > deadline:
                raise RuntimeError(f"gave up waiting for {what}: {detail}")
            self.deleting.wait(0.2)

    # -- the pod's life --------------------------------------------------------------------

    def run(self) -> None:
        self.core = self.kubelet.control_plane.core()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / "home").mkdir(exist_ok=True)
            self.publish()
            self._prepare_volumes()
            if self._run_init_containers():
                self._run_containers()
        except _Stop:
            pass
        except Exception as exc:
            LOG.exception("pod %s/%s failed in the fake kubelet", self.namespace, self.pod_name)
            if not self.deleting.is_set() and not self.kubelet.stopping.is_set():
                self._kill_all(grace=2)
                self.phase = "Failed"
                self.reason = "FakeKubeletError"
                self.message = f"{type(exc).__name__}: {exc}"[:2000]
                for container in self.containers:
                    if "terminated" not in container.state:
                        container.state = {
                            "terminated": {
                                "exitCode": 128,
                                "reason": "StartError",
                                "message": self.message,
                                "startedAt": container.started_at or None,
                                "finishedAt": now_rfc3339(),
                            }
                        }
                with contextlib.suppress(Exception):
                    self.publish()
        finally:
            try:
                if self.kubelet.stopping.is_set():
                    self._kill_all(grace=self.kubelet.stop_grace)
                elif self.deleting.is_set():
                    self._kill_all(grace=self._grace())
            finally:
                self.finished.set()
            # `finished` first: a deletion the watch notices from now on deletes the pod itself.
            if self.deleting.is_set() and not self.gone.is_set():
                self.delete()

    def delete(self) -> None:
        """Deletes the pod (grace 0) unless the kubelet stops; errors are logged."""
        if self.kubelet.stopping.is_set():
            return
        try:
            self.kubelet.delete_pod(self._api(), self.namespace, self.pod_name, self.uid)
        except Exception:
            LOG.exception("deleting pod %s/%s", self.namespace, self.pod_name)

    def _grace(self) -> float:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = spec.get("terminationGracePeriodSeconds", 30)
        return float(min(grace, 10))

    def _run_init_containers(self) -> bool:
        for container in self.init_containers:
            while True:
                self._start(container)
                while container.process is not None and container.process.poll() is None:
                    self._check()
                    self.deleting.wait(0.1)
                self._reap(container)
                if container.exit_code == 0:
                    self.publish()
                    break
                if self.restart_policy == "Never":
                    self.phase = "Failed"
                    self.publish()
                    return False
                self.publish()
                self._sleep_backoff(container)
                container.last_state = container.state
                container.restart_count += 1
        return True

    def _run_containers(self) -> None:
        for container in self.containers:
            self._start(container)
        while True:
            self._check()
            changed = False
            for container in self.containers:
                changed |= self._tick(container)
            if changed:
                self.publish()
            if self.phase in TERMINAL:
                return
            self.deleting.wait(0.1)

    def _sleep_backoff(self, container: _Container) -> None:
        deadline = time.monotonic() + min(10.0, 0.5 * 2**container.restart_count)
        while time.monotonic() < deadline:
            self._check()
            self.deleting.wait(0.1)

    def _tick(self, container: _Container) -> bool:
        """Notices an exit, runs probes, restarts; whether the status changed."""
        now = time.monotonic()
        if container.process is not None:
            if container.process.poll() is None:
                return self._probe(container)
            self._reap(container)
            if self.restart_policy == "Always" or (
                self.restart_policy == "OnFailure" and container.exit_code != 0
            ):
                container.restart_at = now + min(10.0, 0.5 * 2**container.restart_count)
            return True
        if container.restart_at is not None and now >= container.restart_at:
            container.restart_at = None
            container.last_state = container.state
            container.restart_count += 1
            self._start(container)
            return True
        return False

    def _reap(self, container: _Container) -> None:
        assert container.process is not None
        code, sig = _exit_code(container.process.wait())
        with self._lock:
            container.process = None
        container.exit_code = code
        container.ready = False
        container.started = False
        terminated: dict[str, Any] = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": container.started_at,
            "finishedAt": now_rfc3339(),
            "containerID": container.state.get("running", {}).get("containerID"),
        }
        terminated = {k: v for k, v in terminated.items() if v is not None}
        if sig is not None:
            terminated["signal"] = sig
        # What the container wrote to its termination message path (the kubelet's 4096 bytes).
        written = self._termination_log(container).read_bytes()[:4096].decode(errors="replace")
        if written.strip():
            terminated["message"] = written
        container.state = {"terminated": terminated}
        LOG.info(
            "%s/%s container %s exited with %s",
            self.namespace, self.pod_name, container.name, code,
        )  # fmt: skip

    # -- status ----------------------------------------------------------------------------

    def _compute_phase(self) -> str:
        if self.phase in TERMINAL:
            return self.phase
        if any(c.exit_code != 0 for c in self.init_containers):
            return "Pending"
        main = self.containers
        if any(c.process is not None or c.restart_at is not None for c in main):
            return "Running"
        if any("terminated" not in c.state for c in main):
            return "Pending"
        return "Succeeded" if all(c.exit_code == 0 for c in main) else "Failed"

    def _condition(self, kind: str, ok: bool, reason: str | None = None) -> dict[str, Any]:
        status = "True" if ok else "False"
        previous = self._transitions.get(kind)
        if previous is None or previous[0] != status:
            self._transitions[kind] = (status, now_rfc3339())
        condition: dict[str, Any] = {
            "type": kind,
            "status": status,
            "lastProbeTime": None,
            "lastTransitionTime": self._transitions[kind][1],
        }
        condition["reason"] = reason if not ok and reason else None  # None: drop the old one
        return condition

    def publish(self) -> None:
        """Patches pods/status when it changed since the last patch."""
        self.phase = self._compute_phase()
        initialized = all(c.exit_code == 0 for c in self.init_containers)
        ready = self.phase == "Running" and all(c.ready for c in self.containers)
        not_ready = "PodCompleted" if self.phase in TERMINAL else "ContainersNotReady"
        for container in (*self.init_containers, *self.containers):
            waiting = container.state.get("waiting")
            if waiting is not None and self._waiting_for:
                waiting["message"] = self._waiting_for
        status: dict[str, Any] = {
            "phase": self.phase,
            "conditions": [
                self._condition("Initialized", initialized, "ContainersNotInitialized"),
                self._condition("Ready", ready, not_ready),
                self._condition("ContainersReady", ready, not_ready),
                self._condition("PodScheduled", True),
            ],
            "hostIP": "127.0.0.1",
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self.start_time,
            "containerStatuses": [c.status() for c in self.containers],
        }
        if self.init_containers:
            status["initContainerStatuses"] = [c.status() for c in self.init_containers]
        if self.reason:
            status["reason"] = self.reason
        if self.message:
            status["message"] = self.message
        encoded = json.dumps(
            {k: v for k, v in status.items() if k != "conditions"}, sort_keys=True
        ) + json.dumps([(c["type"], c["status"]) for c in status["conditions"]])
        if encoded == self._published:
            return
        try:
            self._api().patch_namespaced_pod_status(
                self.pod_name, self.namespace, {"status": status}, _preload_content=False
            )
            self._published = encoded
        except ApiException as exc:
            if exc.status == 404:
                self.gone.set()
                self.deleting.set()
                return
            raise

    # -- volumes ---------------------------------------------------------------------------

    def _read(self, kind: str, name: str, optional: bool) -> dict[str, bytes] | None:
        """A Secret's or ConfigMap's data (None when optional and absent); `NotYet` if absent."""
        api = self._api()
        try:
            if kind == "Secret":
                obj = read_json(api.read_namespaced_secret, name, self.namespace)
                return _decode(obj.get("data"))
            obj = read_json(api.read_namespaced_config_map, name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            if optional:
                return None
            raise NotYet(f"{kind} {self.namespace}/{name} does not exist") from None
        data = {key: value.encode() for key, value in (obj.get("data") or {}).items()}
        data.update(_decode(obj.get("binaryData")))
        return data

    def _object_data(self, kind: str, name: str, optional: bool) -> dict[str, bytes] | None:
        return self._wait_for(f"{kind} {name}", lambda: self._read(kind, name, optional))

    @staticmethod
    def _write_files(
        folder: Path,
        data: Mapping[str, bytes],
        items: Iterable[Mapping[str, Any]] | None,
        mode: int | None,
        optional: bool,
    ) -> None:
        wanted = (
            [(item["key"], item["path"], item.get("mode")) for item in items]
            if items
            else [(key, key, None) for key in data]
        )
        for key, relative, item_mode in wanted:
            if key not in data:
                if optional:
                    continue
                raise RuntimeError(f"key {key!r} is missing (keys: {sorted(data)})")
            target = folder / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data[key])
            target.chmod(item_mode if item_mode is not None else (mode or 0o644))

    def _prepare_volumes(self) -> None:
        spec = self.pod["spec"]
        for volume in spec.get("volumes") or []:
            self.volumes[volume["name"]] = self._volume(volume)
        account = spec.get("serviceAccountName") or spec.get("serviceAccount")
        automount = spec.get("automountServiceAccountToken")
        if account and automount is None:
            sa = self._wait_for(f"ServiceAccount {account}", lambda: self._service_account(account))
            automount = sa.get("automountServiceAccountToken")
        if account and automount is not False:
            token = self._wait_for(
                f"a token for ServiceAccount {account}", lambda: self._token(account)
            )
            self.sa_dir = self.folder / "serviceaccount"
            self.sa_dir.mkdir(exist_ok=True)
            (self.sa_dir / "token").write_text(token)
            (self.sa_dir / "namespace").write_text(self.namespace)
            ca = self.kubelet.control_plane.ca_path
            (self.sa_dir / "ca.crt").write_bytes(ca.read_bytes() if ca else b"")

    def _service_account(self, name: str) -> dict[str, Any]:
        try:
            return read_json(self._api().read_namespaced_service_account, name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                raise NotYet(f"ServiceAccount {self.namespace}/{name} does not exist") from None
            raise

    def _token(self, account: str) -> str:
        token = self.kubelet.control_plane.find_token(self.namespace, account)
        if token is None:
            raise NotYet("the token controller has not created its Secret yet")
        return token

    def _volume(self, volume: dict[str, Any]) -> Path:
        name = volume["name"]
        folder = self.folder / "volumes" / name
        if "hostPath" in volume:
            path = Path(volume["hostPath"]["path"])
            if volume["hostPath"].get("type") == "DirectoryOrCreate":
                path.mkdir(parents=True, exist_ok=True)
            return path
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            path = self.kubelet.workdir / "pvc" / self.namespace / claim
            path.mkdir(parents=True, exist_ok=True)
            return path
        folder.mkdir(parents=True, exist_ok=True)
        if "secret" in volume or "configMap" in volume:
            kind = "Secret" if "secret" in volume else "ConfigMap"
            source = volume["secret"] if kind == "Secret" else volume["configMap"]
            optional = bool(source.get("optional"))
            data = self._object_data(kind, source.get("secretName") or source["name"], optional)
            self._write_files(
                folder, data or {}, source.get("items"), source.get("defaultMode"), optional
            )
        elif "downwardAPI" in volume:
            self._downward_files(folder, volume["downwardAPI"])
        elif "projected" in volume:
            projected = volume["projected"]
            for source in projected.get("sources") or []:
                self._projected(folder, source, projected.get("defaultMode"))
        elif "emptyDir" not in volume:
            LOG.warning("volume %s of %s/%s: type not emulated, empty folder",
                        name, self.namespace, self.pod_name)  # fmt: skip
        return folder

    def _projected(self, folder: Path, source: dict[str, Any], mode: int | None) -> None:
        if "secret" in source or "configMap" in source:
            kind = "Secret" if "secret" in source else "ConfigMap"
            ref = source["secret"] if kind == "Secret" else source["configMap"]
            optional = bool(ref.get("optional"))
            data = self._object_data(kind, ref["name"], optional)
            self._write_files(folder, data or {}, ref.get("items"), mode, optional)
        elif "downwardAPI" in source:
            self._downward_files(folder, source["downwardAPI"])
        elif "serviceAccountToken" in source:
            account = self.pod["spec"].get("serviceAccountName") or "default"
            token = self._wait_for(
                f"a token for ServiceAccount {account}", lambda: self._token(account)
            )
            target = folder / source["serviceAccountToken"]["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(token)

    def _downward_files(self, folder: Path, source: dict[str, Any]) -> None:
        for item in source.get("items") or []:
            if "fieldRef" in item:
                value = self._field(item["fieldRef"]["fieldPath"])
            else:
                value = self._resource(item["resourceFieldRef"], None)
            target = folder / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(value)

    # -- environment and command line ------------------------------------------------------

    def _field(self, path: str) -> str:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if match:
            return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
        if path in ("metadata.labels", "metadata.annotations"):
            values = meta.get(path.split(".")[1]) or {}
            return "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
        values = {
            "metadata.name": meta["name"],
            "metadata.namespace": meta["namespace"],
            "metadata.uid": meta["uid"],
            "spec.nodeName": spec.get("nodeName", ""),
            "spec.serviceAccountName": spec.get("serviceAccountName", ""),
            "status.hostIP": "127.0.0.1",
            "status.podIP": self.ip,
            "status.podIPs": self.ip,
        }
        if path not in values:
            raise RuntimeError(f"fieldRef {path!r} is not emulated")
        return str(values[path])

    def _resource(self, ref: dict[str, Any], container: _Container | None) -> str:
        spec = container.spec if container else None
        if ref.get("containerName"):
            spec = next(
                c for c in self.pod["spec"]["containers"] if c["name"] == ref["containerName"]
            )
        kind, _, resource = ref["resource"].partition(".")
        resources = (spec or {}).get("resources") or {}
        raw = (resources.get(kind) or {}).get(resource)
        if raw is None and kind == "requests":
            raw = (resources.get("limits") or {}).get(resource)
        if raw is None:
            raw = {"cpu": "16", "memory": "64Gi", "ephemeral-storage": "100Gi"}.get(resource, "0")
        divisor = parse_quantity(ref.get("divisor") or "1")
        return str(math.ceil(parse_quantity(raw) / divisor))

    def _env_value(self, source: dict[str, Any], container: _Container) -> str | None:
        if "fieldRef" in source:
            return self._field(source["fieldRef"]["fieldPath"])
        if "resourceFieldRef" in source:
            return self._resource(source["resourceFieldRef"], container)
        kind = "Secret" if "secretKeyRef" in source else "ConfigMap"
        ref = source["secretKeyRef"] if kind == "Secret" else source["configMapKeyRef"]
        optional = bool(ref.get("optional"))

        def attempt() -> str | None:
            data = self._read(kind, ref["name"], optional)
            if data is None:
                return None
            if ref["key"] not in data:
                if optional:
                    return None
                raise NotYet(f"{kind} {ref['name']} has no key {ref['key']!r}")
            return data[ref["key"]].decode()

        return self._wait_for(f"{kind} {ref['name']}", attempt)

    def _pod_env(self, container: _Container, service_env: Mapping[str, str]) -> dict[str, str]:
        """The container's own variables, as the kubelet computes them (before rewriting)."""
        env: dict[str, str] = {}
        for source in container.spec.get("envFrom") or []:
            prefix = source.get("prefix", "")
            kind = "Secret" if "secretRef" in source else "ConfigMap"
            ref = source["secretRef"] if kind == "Secret" else source["configMapRef"]
            data = self._object_data(kind, ref["name"], bool(ref.get("optional"))) or {}
            for key, raw in data.items():
                env[prefix + key] = raw.decode()
        for item in container.spec.get("env") or []:
            value: str | None
            if "valueFrom" in item:
                value = self._env_value(item["valueFrom"], container)
                if value is None:
                    continue
            else:
                value = expand(
                    item.get("value") or "", lambda name: env.get(name, service_env.get(name))
                )
            env[item["name"]] = value
        return env

    def _mounts(self, container: _Container) -> dict[str, Path]:
        mounts: dict[str, Path] = {}
        for mount in container.spec.get("volumeMounts") or []:
            path = self.volumes.get(mount["name"])
            if path is None:
                raise RuntimeError(f"volumeMount {mount['name']!r} names no volume of the pod")
            if mount.get("subPath"):
                path = path / mount["subPath"]
                if not path.exists():
                    path.mkdir(parents=True)
            mounts[mount["mountPath"].rstrip("/") or "/"] = path
        if self.sa_dir is not None:
            mounts.setdefault(SA_MOUNT, self.sa_dir)
        mounts[self._termination_path(container)] = self._termination_log(container)
        return mounts

    @staticmethod
    def _termination_path(container: _Container) -> str:
        """Where the container may write its termination message (Kubernetes' default)."""
        return str(container.spec.get("terminationMessagePath") or "/dev/termination-log")

    def _termination_log(self, container: _Container) -> Path:
        """The host file behind the container's termination message path (made empty)."""
        path = self.folder / f"{container.spec['name']}.termination-log"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        return path

    def _rewriter(self, mounts: Mapping[str, Path]) -> Callable[[str], tuple[str, bool]]:
        """A function that rewrites one string for the host; also says if DNS was rewritten."""
        ordered = sorted((m for m in mounts if m != "/"), key=len, reverse=True)
        mount_re = (
            re.compile(
                r"(?<![\w.-])(" + "|".join(re.escape(m) for m in ordered) + r")(?=/|$|[^\w.-])"
            )
            if ordered
            else None
        )

        def rewrite(text: str) -> tuple[str, bool]:
            if mount_re is not None:
                text = mount_re.sub(lambda m: str(mounts[m.group(1)]), text)
            text = ANY_ADDRESS_RE.sub(self.ip, text)
            template = TEMPLATE_RE.fullmatch(text)
            if template is not None:
                host, rest, port = template.groups()
                dns = self.kubelet.dns.address
                return f"dns://{dns}/{host}.{rest}.svc.cluster.local:{port}", False
            rewritten = False

            def resolve(match: re.Match[str]) -> str:
                nonlocal rewritten
                port = int(match.group(2)) if match.group(2) else None
                ip, new_port = self.kubelet.resolve(match.group(1).split("."), port)
                rewritten = True
                return ip if port is None else f"{ip}:{new_port}"

            return DNS_RE.sub(resolve, text), rewritten

        return rewrite

    def _configure(self, container: _Container) -> tuple[list[str], dict[str, str], Path]:
        """argv, environment and working folder of the container's next process."""
        kubelet = self.kubelet
        service_env = {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(kubelet.control_plane.api_port),
        }
        own = self._pod_env(container, service_env)
        lookup = {**service_env, **own}
        spec = container.spec
        command = [expand(part, lookup.get) for part in spec.get("command") or []]
        args = [expand(part, lookup.get) for part in spec.get("args") or []]
        if not command:
            entrypoint = kubelet.entrypoints.get(spec.get("image", ""))
            if entrypoint is None:
                raise RuntimeError(
                    f"container {container.name} has no command: image entrypoints are not "
                    "emulated (give it a command, or FakeKubelet(entrypoints={image: argv}))"
                )
            command = list(entrypoint)
        rewrite = self._rewriter(self._mounts(container))

        def rewrite_all() -> tuple[list[str], dict[str, str]]:
            argv = [rewrite(part)[0] for part in [*command, *args]]
            env = {key: rewrite(value)[0] for key, value in own.items()}
            return argv, env

        argv, env_rewritten = self._wait_for("cluster DNS names", rewrite_all)
        if PYTHON_RE.fullmatch(Path(argv[0]).name):
            argv[0] = sys.executable
        hostname = self.pod["spec"].get("hostname") or self.pod_name
        env = {
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
            "HOME": str(self.folder / "home"),
            "HOSTNAME": hostname,
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "operator")]),
            **service_env,
        }
        if self.sa_dir is not None:
            env["FEDCORE_SERVICEACCOUNT_DIR"] = str(self.sa_dir)
        env.update(kubelet.extra_env)
        env.update(env_rewritten)
        cwd = self.folder
        if spec.get("workingDir"):
            cwd = Path(rewrite(spec["workingDir"])[0])
            cwd.mkdir(parents=True, exist_ok=True)
        return argv, env, cwd

    def _start(self, container: _Container) -> None:
        self._waiting_for = ""
        argv, env, cwd = self._configure(container)
        self._check()
        container.argv = argv
        container.exit_code = None
        self._termination_log(container).write_bytes(b"")  # each start's own message
        container.started_at = now_rfc3339()
        with container.log.open("ab") as log:
            log.write(f"--- fake kubelet: {shlex.join(argv)}\n".encode())
            log.flush()
            try:
                process = subprocess.Popen(
                    # This worker thread outlives its processes; should pytest itself be
                    # killed, they go with it instead of lingering on a shared machine.
                    dying_with_parent(argv),
                    env=env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                container.exit_code = 128
                container.state = {
                    "terminated": {
                        "exitCode": 128,
                        "reason": "StartError",
                        "message": str(exc),
                        "startedAt": container.started_at,
                        "finishedAt": now_rfc3339(),
                    }
                }
                log.write(f"--- fake kubelet: cannot start: {exc}\n".encode())
                raise RuntimeError(
                    f"container {container.name}: cannot start {argv[0]}: {exc}"
                ) from exc
        with self._lock:
            container.process = process
        self._check()  # deleted or stopped meanwhile: the finally of run() ends the process
        container.state = {
            "running": {"startedAt": container.started_at, "containerID": f"fake://{process.pid}"}
        }
        container.probe_failures = 0
        startup = container.spec.get("startupProbe")
        container.started = startup is None
        readiness = container.spec.get("readinessProbe")
        container.ready = not container.init and readiness is None and startup is None
        first = startup or readiness
        delay = (first or {}).get("initialDelaySeconds", 0)
        container.next_probe = time.monotonic() + delay
        LOG.info("%s/%s container %s started (pid %s, ip %s): %s",
                 self.namespace, self.pod_name, container.name, process.pid, self.ip,
                 shlex.join(argv))  # fmt: skip
        self.publish()

    # -- probes ----------------------------------------------------------------------------

    def _probe(self, container: _Container) -> bool:
        """Runs the startup or readiness probe when due; whether readiness changed."""
        now = time.monotonic()
        probe = (
            container.spec.get("startupProbe")
            if not container.started
            else container.spec.get("readinessProbe")
        )
        if probe is None or now < container.next_probe:
            return False
        ok = self._run_probe(probe, container)
        period = float(probe.get("periodSeconds", 10))
        waiting = not container.started or not container.ready
        container.next_probe = now + (min(period, 0.2) if waiting else min(period, 2.0))
        if not container.started:
            if ok:
                container.started = True
                has_readiness = container.spec.get("readinessProbe") is not None
                container.ready = not has_readiness
                return True
            return False
        if ok:
            container.probe_failures = 0
            if not container.ready:
                container.ready = True
                return True
            return False
        container.probe_failures += 1
        if container.ready and container.probe_failures >= probe.get("failureThreshold", 3):
            container.ready = False
            return True
        return False

    def _port(self, port: int | str, container: _Container) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for candidate in container.spec.get("ports") or []:
            if candidate.get("name") == port:
                return int(candidate["containerPort"])
        raise RuntimeError(f"probe port {port!r} names no containerPort")

    def _run_probe(self, probe: dict[str, Any], container: _Container) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        try:
            if "tcpSocket" in probe:
                tcp = probe["tcpSocket"]
                address = (tcp.get("host") or self.ip, self._port(tcp["port"], container))
                with socket.create_connection(address, timeout=timeout):
                    return True
            if "httpGet" in probe:
                get = probe["httpGet"]
                host = get.get("host") or self.ip
                port = self._port(get["port"], container)
                connection: http.client.HTTPConnection
                if get.get("scheme", "HTTP").upper() == "HTTPS":
                    context = ssl._create_unverified_context()
                    connection = http.client.HTTPSConnection(
                        host, port, timeout=timeout, context=context
                    )
                else:
                    connection = http.client.HTTPConnection(host, port, timeout=timeout)
                try:
                    headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
                    connection.request("GET", get.get("path", "/"), headers=headers)
                    return 200 <= connection.getresponse().status < 400
                finally:
                    connection.close()
            if "exec" in probe:
                rewrite = self._rewriter(self._mounts(container))
                argv = [rewrite(part)[0] for part in probe["exec"]["command"]]
                if PYTHON_RE.fullmatch(Path(argv[0]).name):
                    argv[0] = sys.executable
                result = subprocess.run(
                    argv, capture_output=True, timeout=max(timeout, 5), cwd=self.folder,
                    check=False,
                )  # fmt: skip
                return result.returncode == 0
        except (OSError, subprocess.TimeoutExpired, http.client.HTTPException):
            return False
        return True

    # -- signals ---------------------------------------------------------------------------

    def signal(self, sig: int) -> int:
        """Sends ``sig`` to every running container's process group; how many got it."""
        sent = 0
        with self._lock:
            for container in (*self.init_containers, *self.containers):
                if container.process is not None and container.process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(container.process.pid, sig)
                        sent += 1
        return sent

    def _kill_all(self, grace: float) -> None:
        """SIGTERM to every process group, SIGKILL after ``grace`` seconds."""
        if self.signal(signal.SIGTERM) == 0:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if all(
                c.process is None or c.process.poll() is not None
                for c in (*self.init_containers, *self.containers)
            ):
                return
            time.sleep(0.05)
        self.signal(signal.SIGKILL)
        for container in (*self.init_containers, *self.containers):
            process = container.process
            if process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(5)


class FakeKubelet:
    """Plays the kubelet for every pod bound to ``nodes`` (see the module docstring).

    Use as a context manager, or call `start` and `stop`.
    """

    def __init__(
        self,
        control_plane: ControlPlane,
        nodes: Iterable[str] | None = None,
        *,
        workdir: Path | None = None,
        wait_timeout: float = 120.0,
        extra_env: Mapping[str, str] | None = None,
        entrypoints: Mapping[str, list[str]] | None = None,
        stop_grace: float = 2.0,
    ) -> None:
        self.control_plane = control_plane
        self._nodes = set(nodes) if nodes is not None else None
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="fedcore-kubelet-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.wait_timeout = wait_timeout
        self.extra_env = dict(extra_env or {})
        self.entrypoints = dict(entrypoints or {})
        self.stop_grace = stop_grace
        self.stopping = threading.Event()
        self._synced = threading.Event()
        self._lock = threading.Lock()
        self._workers: dict[str, _PodWorker] = {}
        self._by_name: dict[tuple[str, str], _PodWorker] = {}
        self._ips = itertools.product(range(1, 255), range(1, 255))
        self._ip_prefix = f"127.{random.randrange(1, 255)}"
        self._ip_of_name: dict[tuple[str, str], str] = {}
        self._ip_lock = threading.Lock()
        self.dns = DnsServer(self._dns_lookup)
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    @property
    def nodes(self) -> set[str]:
        """The node names whose pods this kubelet runs."""
        return self._nodes if self._nodes is not None else set(self.control_plane.nodes)

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> FakeKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> FakeKubelet:
        """Starts the cluster DNS and the watch thread; waits for the first list of pods."""
        self.dns.start()
        self._thread = threading.Thread(target=self._watch_loop, name="fake-kubelet", daemon=True)
        self._thread.start()
        if not self._synced.wait(timeout):
            raise RuntimeError(f"the fake kubelet could not list pods: {self.errors[-1:]}")
        return self

    def stop(self) -> None:
        """Ends every process (SIGTERM, SIGKILL after ``stop_grace`` s); pods stay as they are.

        A workdir this object made itself is deleted; a given one is kept (logs, volumes).
        """
        self.stopping.set()
        with self._lock:
            workers = list(self._by_name.values())
        for worker in workers:
            worker.deleting.set()  # wakes it up; with `stopping` set it does not delete the pod
        for worker in workers:
            worker.join(self.stop_grace + 6)
            worker.signal(signal.SIGKILL)
        if self._thread is not None:
            self._thread.join(1)
        self.dns.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- queries for tests -----------------------------------------------------------------

    def _worker(self, namespace: str, pod: str) -> _PodWorker:
        with self._lock:
            worker = self._by_name.get((namespace, pod))
        if worker is None:
            raise KeyError(f"the fake kubelet has not run pod {namespace}/{pod}")
        return worker

    def log_of(self, namespace: str, pod: str, container: str | None = None) -> str:
        """The output of a pod's container (the first container by default)."""
        worker = self._worker(namespace, pod)
        name = container or worker.containers[0].name
        path = worker.folder / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def describe(self, namespace: str, tail: int = 1500) -> str:
        """The end of every container log of every pod incarnation the kubelet ran in
        ``namespace``, earlier incarnations of recreated pods included (for failure messages)."""
        parts = []
        for folder in sorted(self.workdir.glob(f"{namespace}_*"), key=lambda f: f.stat().st_mtime):
            for log in sorted(folder.glob("*.log")):
                text = log.read_text(errors="replace")[-tail:]
                parts.append(f"--- {folder.name}/{log.name}\n{text}")
        return "\n".join(parts)

    def kill(self, namespace: str, pod: str, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` to the pod's processes, as a crash would (the exit code is reported)."""
        if self._worker(namespace, pod).signal(sig) == 0:
            raise RuntimeError(f"pod {namespace}/{pod} has no running process")

    def pod_ip(self, namespace: str, pod: str) -> str:
        """The loopback IP given to the pod."""
        return self._worker(namespace, pod).ip

    def folder_of(self, namespace: str, pod: str) -> Path:
        """The pod's folder (volumes/, serviceaccount/, home/, <container>.log)."""
        return self._worker(namespace, pod).folder

    def argv_of(self, namespace: str, pod: str, container: str | None = None) -> list[str]:
        """The command line the container was last started with (after rewriting)."""
        worker = self._worker(namespace, pod)
        for candidate in (*worker.init_containers, *worker.containers):
            if container in (None, candidate.name):
                return list(candidate.argv)
        raise KeyError(container)

    # -- DNS -------------------------------------------------------------------------------

    def resolve(self, labels: list[str], port: int | None) -> tuple[str, int | None]:
        """The (IP, port) a cluster DNS name + port reaches; `NotYet` while nothing serves it.

        ``[svc, ns]``: a Ready pod selected by the Service (Running suffices with
        publishNotReadyAddresses), the port mapped to its targetPort unless headless;
        ``[host, subdomain, ns]``: the pod with that hostname and subdomain (`_pod_address`).
        """
        core = self.control_plane.core()
        if len(labels) == 2:
            name, namespace = labels
            if (name, namespace) == ("kubernetes", "default"):
                api_port = self.control_plane.api_port
                return "127.0.0.1", api_port if port in (None, 443) else port
            return self._service_target(core, self._service(core, name, namespace), port)
        return self._pod_address(core, *labels), port

    @staticmethod
    def _service(core: kubernetes.client.CoreV1Api, name: str, namespace: str) -> dict[str, Any]:
        """The Service; `NotYet` while it does not exist."""
        try:
            return read_json(core.read_namespaced_service, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                raise NotYet(f"Service {namespace}/{name} does not exist") from None
            raise

    @staticmethod
    def _selected_pods(
        core: kubernetes.client.CoreV1Api, namespace: str, selector: Mapping[str, str]
    ) -> list[dict[str, Any]]:
        """The pods of ``namespace`` whose labels match ``selector``."""
        labels = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        return list(read_json(core.list_namespaced_pod, namespace, label_selector=labels)["items"])

    def _pod_address(
        self, core: kubernetes.client.CoreV1Api, host: str, subdomain: str, namespace: str
    ) -> str:
        """The A record of ``host.subdomain.namespace.svc``, as a cluster's DNS would give it.

        It exists once the headless Service ``subdomain`` selects a pod with that hostname and
        subdomain that has an address: with publishNotReadyAddresses, any live pod bound to
        this kubelet's nodes (its address is given now, and kept for when it starts);
        otherwise a Ready one. `NotYet` before.
        """
        where = f"{host}.{subdomain}.{namespace}.svc"
        spec = self._service(core, subdomain, namespace)["spec"]
        selector = spec.get("selector") or {}
        if spec.get("clusterIP") != "None" or not selector:
            raise NotYet(f"{where}: Service {subdomain} is not headless with a selector")
        pods = self._selected_pods(core, namespace, selector)
        matching = [
            pod
            for pod in pods
            if pod["spec"].get("subdomain") == subdomain
            and (pod["spec"].get("hostname") or pod["metadata"]["name"]) == host
        ]
        if spec.get("publishNotReadyAddresses"):
            for pod in sorted(matching, key=lambda pod: pod["metadata"]["name"]):
                if (
                    pod["spec"].get("nodeName") in self.nodes
                    and not pod["metadata"].get("deletionTimestamp")
                    and (pod.get("status") or {}).get("phase") not in TERMINAL
                ):
                    return self._allocate_ip(namespace, pod["metadata"]["name"])
            raise NotYet(f"{where}: no live pod bound to a node behind Service {subdomain}")
        chosen = self._pick(matching, False)
        if chosen is None:
            raise NotYet(f"{where}: no Ready pod behind Service {subdomain}")
        return str(chosen["status"]["podIP"])

    def _dns_lookup(self, name: str) -> str:
        """The cluster DNS's answer for ``name`` (see `tests.kube.dns.answer`).

        Per-pod names and headless Services; a ClusterIP Service has no emulated address.
        """
        labels = name.removesuffix(".cluster.local").split(".")
        if labels[-1:] != ["svc"] or len(labels) not in (3, 4):
            raise NoSuchName(name)
        core = self.control_plane.core()
        try:
            if len(labels) == 4:
                return self._pod_address(core, *labels[:3])
            service = self._service(core, labels[0], labels[1])
            if service["spec"].get("clusterIP") != "None":
                raise RuntimeError(f"{name}: ClusterIP Services are not emulated by the DNS")
            return self.resolve(labels[:2], None)[0]
        except NotYet as exc:
            raise NoSuchName(str(exc)) from None

    @staticmethod
    def _pick(pods: list[dict[str, Any]], not_ready: bool) -> dict[str, Any] | None:
        def ready(pod: dict[str, Any]) -> bool:
            return any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in pod["status"].get("conditions") or []
            )

        candidates = sorted(
            (
                pod
                for pod in pods
                if pod["status"].get("phase") == "Running"
                and pod["status"].get("podIP")
                and not pod["metadata"].get("deletionTimestamp")
                and (not_ready or ready(pod))
            ),
            key=lambda pod: (not ready(pod), pod["metadata"]["name"]),
        )
        return candidates[0] if candidates else None

    def _service_target(
        self, core: kubernetes.client.CoreV1Api, service: dict[str, Any], port: int | None
    ) -> tuple[str, int | None]:
        meta, spec = service["metadata"], service["spec"]
        selector = spec.get("selector") or {}
        where = f"Service {meta['namespace']}/{meta['name']}"
        if not selector:
            return self._endpoints_target(core, service, port)
        pods = self._selected_pods(core, meta["namespace"], selector)
        chosen = self._pick(pods, bool(spec.get("publishNotReadyAddresses")))
        if chosen is None:
            raise NotYet(f"no Ready pod behind {where}")
        target = port
        if port is not None and spec.get("clusterIP") != "None":
            for entry in spec.get("ports") or []:
                if entry["port"] != port:
                    continue
                wanted = entry.get("targetPort", port)
                if isinstance(wanted, int) or str(wanted).isdigit():
                    target = int(wanted)
                else:
                    target = next(
                        (
                            int(p["containerPort"])
                            for c in chosen["spec"]["containers"]
                            for p in c.get("ports") or []
                            if p.get("name") == wanted
                        ),
                        port,
                    )
        return chosen["status"]["podIP"], target

    @staticmethod
    def _endpoints_target(
        core: kubernetes.client.CoreV1Api, service: dict[str, Any], port: int | None
    ) -> tuple[str, int | None]:
        meta = service["metadata"]
        try:
            endpoints = read_json(core.read_namespaced_endpoints, meta["name"], meta["namespace"])
        except ApiException as exc:
            if exc.status == 404:
                raise NotYet(f"no Endpoints for Service {meta['name']}") from None
            raise
        for subset in endpoints.get("subsets") or []:
            for address in subset.get("addresses") or []:
                target = port
                names = {e["port"]: e.get("name") for e in service["spec"].get("ports") or []}
                for entry in subset.get("ports") or []:
                    if port is not None and entry.get("name") == names.get(port):
                        target = int(entry["port"])
                return address["ip"], target
        raise NotYet(f"Endpoints of Service {meta['name']} has no address")

    # -- the watch -------------------------------------------------------------------------

    def delete_pod(
        self, core: kubernetes.client.CoreV1Api, namespace: str, name: str, uid: str
    ) -> None:
        """Deletes the pod now (grace 0), only if it is still the one with ``uid``."""
        body: Any = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
        try:
            core.delete_namespaced_pod(
                name, namespace, grace_period_seconds=0, body=body, _preload_content=False
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def _allocate_ip(self, namespace: str, name: str) -> str:
        """One address per pod name: a recreated pod gets its predecessor's address.

        DNS is mostly emulated by rewriting names once, when a process starts; keeping the
        address of a name stands in for the stable ClusterIP a real Service gives its clients.
        Called first by a DNS answer for a pod not started yet, it gives that pod its address
        ahead (the worker that starts the pod gets the same one).
        """
        key = (namespace, name)
        with self._ip_lock:
            if key not in self._ip_of_name:
                third, fourth = next(self._ips)
                self._ip_of_name[key] = f"{self._ip_prefix}.{third}.{fourth}"
            return self._ip_of_name[key]

    def _watch_loop(self) -> None:
        core = self.control_plane.core()
        version: str | None = None
        while not self.stopping.is_set():
            try:
                if version is None:
                    listing = read_json(core.list_pod_for_all_namespaces)
                    version = listing["metadata"]["resourceVersion"]
                    self._relist(core, listing["items"])
                    self._synced.set()
                version = self._watch(core, version)
            except Exception as exc:
                if self.stopping.is_set():
                    break
                self.errors.append(repr(exc))
                LOG.warning("pod watch failed (%r); listing again", exc)
                version = None
                self.stopping.wait(0.5)

    def _watch(self, core: kubernetes.client.CoreV1Api, version: str) -> str | None:
        """Follows the pod watch from ``version``; the last version, or None to list again."""
        response: Any = core.list_pod_for_all_namespaces(
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=5,
            _preload_content=False,
            _request_timeout=(5, 30),
        )
        try:
            buffer = b""
            for chunk in response.stream(65536):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    kind, obj = event["type"], event["object"]
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            return None
                        raise RuntimeError(f"watch error: {obj.get('message')}")
                    version = obj["metadata"]["resourceVersion"]
                    if kind != "BOOKMARK":
                        self._dispatch(core, kind, obj)
                if self.stopping.is_set():
                    break
        finally:
            response.release_conn()
        return version

    def _relist(self, core: kubernetes.client.CoreV1Api, pods: list[dict[str, Any]]) -> None:
        seen = set()
        for pod in pods:
            seen.add(pod["metadata"]["uid"])
            self._dispatch(core, "ADDED", pod)
        with self._lock:
            lost = [w for uid, w in self._workers.items() if uid not in seen]
            for worker in lost:
                del self._workers[worker.uid]
        for worker in lost:
            worker.gone.set()
            worker.deleting.set()

    def _dispatch(self, core: kubernetes.client.CoreV1Api, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        if pod["spec"].get("nodeName") not in self.nodes:
            return
        try:
            self._handle(core, kind, pod)
        except Exception as exc:
            LOG.exception("fake kubelet: pod %s/%s", meta["namespace"], meta["name"])
            self.errors.append(f"{meta['namespace']}/{meta['name']}: {exc!r}")
            with contextlib.suppress(Exception):
                core.patch_namespaced_pod_status(
                    meta["name"],
                    meta["namespace"],
                    {"status": {"phase": "Failed", "reason": "FakeKubeletError",
                                "message": repr(exc)[:2000]}},
                    _preload_content=False,
                )  # fmt: skip

    def _handle(self, core: kubernetes.client.CoreV1Api, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        with self._lock:
            worker = self._workers.get(uid)
        if kind == "DELETED":
            if worker is not None:
                worker.gone.set()
                worker.deleting.set()
                with self._lock:
                    self._workers.pop(uid, None)
            return
        if worker is not None:
            worker.update(pod)
            if worker.finished.is_set() and meta.get("deletionTimestamp"):
                worker.delete()
            return
        if self.stopping.is_set():
            return
        status = pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            self.delete_pod(core, meta["namespace"], meta["name"], uid)
            return
        if status.get("phase") in TERMINAL:
            return
        if status.get("phase") == "Running" or status.get("containerStatuses"):
            core.patch_namespaced_pod_status(
                meta["name"],
                meta["namespace"],
                {"status": {"phase": "Failed", "reason": "NodeLost",
                            "message": "the fake kubelet that ran this pod is gone"}},
                _preload_content=False,
            )  # fmt: skip
            return
        worker = _PodWorker(self, pod, self._allocate_ip(meta["namespace"], meta["name"]))
        with self._lock:
            self._workers[uid] = worker
            self._by_name[(meta["namespace"], meta["name"])] = worker
        worker.start()

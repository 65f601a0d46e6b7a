"""A real Kubernetes 1.20 control plane on loopback: etcd, apiserver, controller-manager, scheduler.

envtest-style: every port is picked free at start-up, the PKI is generated into a temporary
folder, and each component is stopped by its PID. No kubelet runs: register Node objects with
`ControlPlane.register_nodes` and let `tests.kube.kubelet.FakeKubelet` play the kubelet.

Binaries come from ``$FEDCORE_K8S_BIN`` (default ``~/.cache/k8s-1.20.2``, built by
``bash hack/control-plane.sh``); etcd is Debian's ``etcd-server``. With
``$FEDCORE_TEST_KUBECONFIG`` set, nothing is started and that cluster is used instead.

``python -m tests.kube.cluster`` starts one and keeps it up until Ctrl-C (for poking at it).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import http.client
import ipaddress
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from kubernetes.client.rest import ApiException

from fedcore.local.ports import free_ports

BIN_ENV = "FEDCORE_K8S_BIN"
KUBECONFIG_ENV = "FEDCORE_TEST_KUBECONFIG"
DEFAULT_BIN = Path.home() / ".cache" / "k8s-1.20.2"
COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
SA_TOKEN_TYPE = "kubernetes.io/service-account-token"
NODE_LABEL = "fedcore.dev/fake-node"


class ControlPlaneError(RuntimeError):
    """The control plane could not be started or used."""


def now_rfc3339() -> str:
    """The current UTC time as Kubernetes writes it (second precision, ``Z``)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def read_json(call: Any, *args: Any, **kwargs: Any) -> Any:
    """Calls a `kubernetes` client method and returns the raw JSON body (dicts, camelCase keys).

    Skips the client's model classes: the dicts carry exactly the API's field names.
    """
    response = call(*args, _preload_content=False, **kwargs)
    return json.loads(response.data)


# ---------------------------------------------------------------------------- PKI


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _pem_key(key: Any) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _issue(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    *,
    issuer: x509.Certificate | None = None,
    issuer_key: ec.EllipticCurvePrivateKey | None = None,
    server_names: Sequence[str] = (),
    client: bool = False,
) -> x509.Certificate:
    """A certificate for ``key``: self-signed CA when ``issuer`` is None."""
    start = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=30))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if issuer is None:
        builder = builder.add_extension(
            x509.BasicConstraints(ca=True, path_length=None), critical=True
        ).add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    else:
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
        if server_names:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
            sans: list[x509.GeneralName] = []
            for entry in server_names:
                try:
                    sans.append(x509.IPAddress(ipaddress.ip_address(entry)))
                except ValueError:
                    sans.append(x509.DNSName(entry))
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        builder = builder.add_extension(
            x509.BasicConstraints(ca=False, path_length=None), critical=True
        ).add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


@dataclass
class Pki:
    """Paths of the generated PKI files."""

    folder: Path
    ca_crt: Path = field(init=False)
    ca_key: Path = field(init=False)
    apiserver_crt: Path = field(init=False)
    apiserver_key: Path = field(init=False)
    admin_crt: Path = field(init=False)
    admin_key: Path = field(init=False)
    sa_key: Path = field(init=False)
    sa_pub: Path = field(init=False)

    def __post_init__(self) -> None:
        for name in ("ca", "apiserver", "admin"):
            setattr(self, f"{name}_crt", self.folder / f"{name}.crt")
            setattr(self, f"{name}_key", self.folder / f"{name}.key")
        self.sa_key = self.folder / "sa.key"
        self.sa_pub = self.folder / "sa.pub"

    def generate(self, addresses: Sequence[str] = ()) -> Pki:
        """Writes a CA, the apiserver's serving cert, an admin client cert, an SA key pair.

        The serving certificate names loopback, the in-cluster names, and ``addresses``.
        """
        self.folder.mkdir(parents=True, exist_ok=True)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _issue(_name("fedcore-test-ca"), ca_key)
        serving_key = ec.generate_private_key(ec.SECP256R1())
        serving = _issue(
            _name("kube-apiserver"),
            serving_key,
            issuer=ca,
            issuer_key=ca_key,
            server_names=(
                "127.0.0.1",
                "localhost",
                "kubernetes",
                "kubernetes.default.svc",
                *addresses,
            ),
        )
        admin_key = ec.generate_private_key(ec.SECP256R1())
        admin = _issue(
            _name("fedcore-admin", "system:masters"),
            admin_key,
            issuer=ca,
            issuer_key=ca_key,
            client=True,
        )
        sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pem = serialization.Encoding.PEM
        self.ca_crt.write_bytes(ca.public_bytes(pem))
        self.ca_key.write_bytes(_pem_key(ca_key))
        self.apiserver_crt.write_bytes(serving.public_bytes(pem))
        self.apiserver_key.write_bytes(_pem_key(serving_key))
        self.admin_crt.write_bytes(admin.public_bytes(pem))
        self.admin_key.write_bytes(_pem_key(admin_key))
        self.sa_key.write_bytes(_pem_key(sa_key))
        self.sa_pub.write_bytes(
            sa_key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        for key in (self.ca_key, self.apiserver_key, self.admin_key, self.sa_key):
            key.chmod(0o600)
        return self


def write_kubeconfig(path: Path, server: str, pki: Pki) -> None:
    """An admin kubeconfig with the certificates inline (self-contained)."""

    def b64(file: Path) -> str:
        return base64.b64encode(file.read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "fedcore-test",
                "cluster": {"server": server, "certificate-authority-data": b64(pki.ca_crt)},
            }
        ],
        "users": [
            {
                "name": "fedcore-admin",
                "user": {
                    "client-certificate-data": b64(pki.admin_crt),
                    "client-key-data": b64(pki.admin_key),
                },
            }
        ],
        "contexts": [
            {
                "name": "fedcore-test",
                "context": {"cluster": "fedcore-test", "user": "fedcore-admin"},
            }
        ],
        "current-context": "fedcore-test",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)


# ---------------------------------------------------------------------------- processes


_DEATH_SHIM = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL); "  # PR_SET_PDEATHSIG
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


def dying_with_parent(args: Sequence[str]) -> list[str]:
    """``args`` behind a shim that asks for SIGKILL when the thread that started it dies, then
    execs them (same PID).

    A shim, not ``preexec_fn``: Popen runs a ``preexec_fn`` between fork and exec, and in a
    test process where gRPC's poller threads run, gRPC's fork handlers can abort that child
    (a control-plane component died so, with SIGABRT, in a full run). Without ``preexec_fn``
    Popen starts the child with vfork, which runs no fork handlers.
    """
    return [sys.executable, "-I", "-S", "-c", _DEATH_SHIM, *args]


@dataclass
class Component:
    """One started process of the control plane."""

    name: str
    args: list[str]
    log: Path
    process: subprocess.Popen[bytes]

    def tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of this component's log."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds."""
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            self.process.wait(5)


def spawn_component(workdir: Path, name: str, args: list[str]) -> Component:
    """Starts ``args`` in ``workdir``, dying with this process, logging to logs/<name>.log."""
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            dying_with_parent(args),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=workdir,
        )
    return Component(name, args, log, process)


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on 127.0.0.1.

    Use as a context manager, or call `start` and `stop`. With ``$FEDCORE_TEST_KUBECONFIG``
    set (or ``kubeconfig=`` given), nothing is started and that cluster is used.
    """

    def __init__(
        self,
        *,
        bin_dir: Path | None = None,
        workdir: Path | None = None,
        kubeconfig: Path | None = None,
        start_timeout: float = 60.0,
        advertise_address: str = "127.0.0.1",
    ) -> None:
        """``advertise_address``: where the API server listens and what the ``kubernetes``
        Service points at; a real node's pods need an address they can route to (its pod
        network's gateway), and then the ServiceAccount admission plugin mounts their tokens.
        """
        env_kubeconfig = os.environ.get(KUBECONFIG_ENV)
        self.external = kubeconfig is not None or bool(env_kubeconfig)
        self.bin_dir = Path(bin_dir or os.environ.get(BIN_ENV) or DEFAULT_BIN).expanduser()
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="fedcore-k8s-"))
        self.start_timeout = start_timeout
        self.advertise_address = advertise_address
        self.kubeconfig: Path = (
            Path(kubeconfig or env_kubeconfig or "").expanduser()
            if self.external
            else self.workdir / "admin.kubeconfig"
        )
        self.server = ""
        self.ca_path: Path | None = None
        self.api_port = 0
        self.components: list[Component] = []
        self.nodes: list[str] = []
        self._created_nodes: list[str] = []
        self._keep_files = False
        self.startup_seconds = 0.0
        self._configuration: kubernetes.client.Configuration | None = None
        self._lock = threading.Lock()
        self._node_counters: dict[str, int] = {}

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ControlPlane:
        """Starts every component (or connects to the external cluster) and waits for /readyz."""
        began = time.monotonic()
        if self.external:
            self._connect_external()
        else:
            self._start_local()
        self.startup_seconds = time.monotonic() - began
        return self

    def stop(self) -> None:
        """Stops every component by PID (scheduler first, etcd last); deletes etcd's data.

        A workdir this object made itself goes entirely; a given one keeps logs/ and pki/.
        On an external cluster, deletes the Node objects `register_nodes` created.
        """
        if self.external and self._created_nodes:
            core = self.core()
            for node in self._created_nodes:
                with contextlib.suppress(Exception):
                    core.delete_node(node)
            self._created_nodes = []
        for component in reversed(self.components):
            component.stop()
        self.components = []
        if not self.external:
            everything = self._own_workdir and not self._keep_files
            shutil.rmtree(self.workdir / ("" if everything else "etcd"), ignore_errors=True)

    def _binary(self, name: str) -> str:
        if name == "etcd":
            found = shutil.which("etcd") or "/usr/bin/etcd"
            if not Path(found).exists():
                raise ControlPlaneError(
                    "etcd is missing: run `bash hack/control-plane.sh` (it installs "
                    "Debian's etcd-server), or set FEDCORE_TEST_KUBECONFIG to use a cluster."
                )
            return found
        path = self.bin_dir / name
        if not os.access(path, os.X_OK):
            raise ControlPlaneError(
                f"{path} is missing: run `bash hack/control-plane.sh` to build the Kubernetes "
                f"1.20.2 control plane into {self.bin_dir} (~10 min cold), point {BIN_ENV} at a "
                f"folder with {', '.join(COMPONENTS)}, or set {KUBECONFIG_ENV} to use an "
                "existing cluster."
            )
        return str(path)

    def _spawn(self, name: str, args: list[str]) -> Component:
        component = spawn_component(self.workdir, name, args)
        self.components.append(component)
        return component

    def _start_local(self) -> None:
        binaries = {name: self._binary(name) for name in ("etcd", *COMPONENTS)}
        address = self.advertise_address
        loopback = ipaddress.ip_address(address).is_loopback
        # 10.0.0.1: the `kubernetes` Service's ClusterIP, which real pods dial.
        pki = Pki(self.workdir / "pki").generate(() if loopback else (address, "10.0.0.1"))
        self.ca_path = pki.ca_crt
        etcd_port, peer_port, self.api_port = free_ports(3)
        self.server = f"https://{address}:{self.api_port}"
        write_kubeconfig(self.kubeconfig, self.server, pki)
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        try:
            self._spawn(
                "etcd",
                [
                    binaries["etcd"],
                    f"--data-dir={self.workdir / 'etcd'}",
                    f"--listen-client-urls={etcd_url}",
                    f"--advertise-client-urls={etcd_url}",
                    f"--listen-peer-urls={peer_url}",
                    f"--initial-advertise-peer-urls={peer_url}",
                    f"--initial-cluster=default={peer_url}",
                    "--unsafe-no-fsync",
                    "--log-level=warn",
                ],
            )
            apiserver = self._spawn(
                "kube-apiserver",
                [
                    binaries["kube-apiserver"],
                    f"--etcd-servers={etcd_url}",
                    f"--bind-address={address}",
                    f"--advertise-address={address}",
                    f"--secure-port={self.api_port}",
                    "--insecure-port=0",
                    f"--cert-dir={self.workdir / 'apiserver-certs'}",
                    f"--tls-cert-file={pki.apiserver_crt}",
                    f"--tls-private-key-file={pki.apiserver_key}",
                    f"--client-ca-file={pki.ca_crt}",
                    f"--service-account-key-file={pki.sa_pub}",
                    f"--service-account-signing-key-file={pki.sa_key}",
                    "--service-account-issuer=https://kubernetes.default.svc",
                    "--service-cluster-ip-range=10.0.0.0/24",
                    "--allow-privileged=true",
                    "--authorization-mode=RBAC",
                    # The fake kubelet mounts no tokens; a real one needs the plugin's.
                    f"--{'disable' if loopback else 'enable'}-admission-plugins=ServiceAccount",
                    # Logs and exec through a real kubelet, which checks client certificates.
                    f"--kubelet-client-certificate={pki.admin_crt}",
                    f"--kubelet-client-key={pki.admin_key}",
                    "--kubelet-preferred-address-types=InternalIP,Hostname",
                    "--profiling=false",
                    "--v=1",
                ],
            )
            kubernetes.client.CoreV1Api(self.api_client())  # ~1 s of imports, while it boots
            self._wait_ready(apiserver, pki)
            kubeconfig = f"--kubeconfig={self.kubeconfig}"
            self._spawn(
                "kube-controller-manager",
                [
                    binaries["kube-controller-manager"],
                    kubeconfig,
                    "--leader-elect=false",
                    "--bind-address=127.0.0.1",
                    "--port=0",
                    "--secure-port=0",
                    f"--service-account-private-key-file={pki.sa_key}",
                    f"--root-ca-file={pki.ca_crt}",
                    # Fake nodes send no heartbeats; a real kubelet's not-ready taint is lifted
                    # by the node lifecycle controller.
                    "--controllers=*" if not loopback else "--controllers=*,-nodelifecycle",
                    "--concurrent-gc-syncs=5",
                    "--v=1",
                ],
            )
            self._spawn(
                "kube-scheduler",
                [
                    binaries["kube-scheduler"],
                    kubeconfig,
                    "--leader-elect=false",
                    "--bind-address=127.0.0.1",
                    "--port=0",
                    "--secure-port=0",
                    "--v=1",
                ],
            )
            time.sleep(0.2)
            self.check_alive()
        except BaseException:
            self._keep_files = True  # the logs the error message names
            self.stop()
            raise

    def _wait_ready(self, apiserver: Component, pki: Pki) -> None:
        context = ssl.create_default_context(cafile=str(pki.ca_crt))
        context.load_cert_chain(str(pki.admin_crt), str(pki.admin_key))
        deadline = time.monotonic() + self.start_timeout
        last = ""
        while time.monotonic() < deadline:
            for component in self.components:
                if component.process.poll() is not None:
                    raise ControlPlaneError(
                        f"{component.name} exited with {component.process.returncode} during "
                        f"start-up; last lines of {component.log}:\n{component.tail()}"
                    )
            connection = http.client.HTTPSConnection(
                self.advertise_address, self.api_port, context=context, timeout=2
            )
            try:
                connection.request("GET", "/readyz")
                response = connection.getresponse()
                last = f"{response.status} {response.read()[-300:].decode(errors='replace')}"
                if response.status == 200:
                    return
            except OSError as exc:
                last = repr(exc)
            finally:
                connection.close()
            time.sleep(0.1)
        raise ControlPlaneError(
            f"kube-apiserver not ready after {self.start_timeout:.0f} s ({last}); last lines of "
            f"{apiserver.log}:\n{apiserver.tail()}"
        )

    def _connect_external(self) -> None:
        if not self.kubeconfig.exists():
            raise ControlPlaneError(f"{KUBECONFIG_ENV}={self.kubeconfig} does not exist")
        configuration = self._load_configuration()
        self.server = configuration.host
        self.api_port = int(self.server.rsplit(":", 1)[1]) if self.server.count(":") > 1 else 443
        if configuration.ssl_ca_cert:
            self.ca_path = Path(configuration.ssl_ca_cert)
        kubernetes.client.VersionApi(self.api_client()).get_code()

    def check_alive(self) -> None:
        """Raises `ControlPlaneError` with the log tail of any component that has exited."""
        for component in self.components:
            if component.process.poll() is not None:
                raise ControlPlaneError(
                    f"{component.name} exited with {component.process.returncode}; last lines "
                    f"of {component.log}:\n{component.tail()}"
                )

    def log_tail(self, component: str, lines: int = 40) -> str:
        """The last lines of one component's log ("etcd", "kube-apiserver", ...)."""
        for started in self.components:
            if started.name == component:
                return started.tail(lines)
        return ""

    # -- clients ---------------------------------------------------------------------------

    def _load_configuration(self) -> kubernetes.client.Configuration:
        with self._lock:
            if self._configuration is None:
                configuration = kubernetes.client.Configuration()
                kubernetes.config.load_kube_config(
                    config_file=str(self.kubeconfig), client_configuration=configuration
                )
                self._configuration = configuration
            return self._configuration

    def api_client(self) -> kubernetes.client.ApiClient:
        """A new admin `ApiClient` (not thread-safe to share: make one per thread)."""
        return kubernetes.client.ApiClient(self._load_configuration())

    def core(self) -> kubernetes.client.CoreV1Api:
        """A `CoreV1Api` on a new admin client."""
        return kubernetes.client.CoreV1Api(self.api_client())

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Runs kubectl against this cluster (text mode; 1.32 warns about skew: harmless)."""
        kubectl = shutil.which("kubectl") or "/usr/bin/kubectl"
        result = subprocess.run(
            [kubectl, f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(
                result.returncode, result.args, result.stdout, result.stderr
            ) from ControlPlaneError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result

    # -- objects ---------------------------------------------------------------------------

    def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> str:
        """Creates namespace ``name`` (fine if it exists) and returns its name."""
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
        if labels:
            body["metadata"]["labels"] = labels  # type: ignore[index]
        try:
            self.core().create_namespace(body)  # type: ignore[arg-type]
        except ApiException as exc:
            if exc.status != 409:
                raise
        return name

    def delete_namespace(self, name: str, *, wait: float = 0.0) -> None:
        """Deletes a namespace (its pods get graceful deletion); waits up to ``wait`` s."""
        core = self.core()
        try:
            core.delete_namespace(name, propagation_policy="Background")
        except ApiException as exc:
            if exc.status != 404:
                raise
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                core.read_namespace(name, _preload_content=False)
            except ApiException as exc:
                if exc.status == 404:
                    return
                raise
            time.sleep(0.2)

    def register_nodes(self, count: int, gpus: int = 0, *, prefix: str | None = None) -> list[str]:
        """Creates ``count`` Ready Node objects the scheduler will bind pods to; their names.

        Each has 16 cpu, 64Gi memory, 500 pods (and ``gpus`` nvidia.com/gpu); the
        node.kubernetes.io/not-ready taint the admission plugin adds is removed.
        """
        prefix = prefix or ("fake-gpu-node" if gpus else "fake-node")
        core = self.core()
        capacity = {"cpu": "16", "memory": "64Gi", "pods": "500", "ephemeral-storage": "100Gi"}
        if gpus:
            capacity["nvidia.com/gpu"] = str(gpus)
        names = []
        for _ in range(count):
            with self._lock:
                index = self._node_counters.get(prefix, 0)
                self._node_counters[prefix] = index + 1
            name = f"{prefix}-{index}"
            labels = {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                NODE_LABEL: "true",
            }
            if gpus:
                labels["nvidia.com/gpu.present"] = "true"
            body = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": labels},
                "spec": {},
            }
            try:
                core.create_node(body)  # type: ignore[arg-type]
                self._created_nodes.append(name)
            except ApiException as exc:
                if exc.status != 409:
                    raise
            core.patch_node_status(name, {"status": self._node_status(name, capacity)})
            core.patch_node(
                name,
                {"spec": {"taints": None}},
                _content_type="application/merge-patch+json",
            )
            names.append(name)
        self.nodes.extend(names)
        return names

    @staticmethod
    def _node_status(name: str, capacity: dict[str, str]) -> dict[str, Any]:
        now = now_rfc3339()

        def condition(kind: str, status: str, reason: str) -> dict[str, str]:
            return {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": "fedcore fake kubelet",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }

        return {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [
                condition("Ready", "True", "KubeletReady"),
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID"),
                condition("NetworkUnavailable", "False", "RouteCreated"),
            ],
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": name,
                "systemUUID": name,
                "bootID": name,
                "kernelVersion": os.uname().release,
                "osImage": "fedcore fake kubelet",
                "containerRuntimeVersion": "fake://1.0",
                "kubeletVersion": "v1.20.2",
                "kubeProxyVersion": "v1.20.2",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }

    def find_token(self, namespace: str, service_account: str) -> str | None:
        """The token of ``service_account``'s token Secret, or None while there is none."""
        core = self.core()
        try:
            account = read_json(core.read_namespaced_service_account, service_account, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        secrets = read_json(
            core.list_namespaced_secret, namespace, field_selector=f"type={SA_TOKEN_TYPE}"
        )["items"]
        for secret in secrets:
            annotations = secret["metadata"].get("annotations") or {}
            if (
                annotations.get("kubernetes.io/service-account.name") == service_account
                and annotations.get("kubernetes.io/service-account.uid")
                == account["metadata"]["uid"]
                and (secret.get("data") or {}).get("token")
            ):
                return base64.b64decode(secret["data"]["token"]).decode()
        return None

    def token_for(self, namespace: str, service_account: str, timeout: float = 30.0) -> str:
        """The SA's token, read from the Secret the token controller creates (waits for it).

        On an external cluster of Kubernetes >= 1.24 (no such Secrets), falls back to a
        TokenRequest after a few seconds.
        """
        deadline = time.monotonic() + timeout
        began = time.monotonic()
        while True:
            token = self.find_token(namespace, service_account)
            if token:
                return token
            if self.external and time.monotonic() - began > 5:
                request = {
                    "apiVersion": "authentication.k8s.io/v1",
                    "kind": "TokenRequest",
                    "spec": {"expirationSeconds": 3600},
                }
                answer = read_json(
                    self.core().create_namespaced_service_account_token,
                    service_account,
                    namespace,
                    request,
                )
                return str(answer["status"]["token"])
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"no token Secret for ServiceAccount {namespace}/{service_account} after "
                    f"{timeout:.0f} s (is kube-controller-manager running?)\n"
                    f"{self.log_tail('kube-controller-manager', 20)}"
                )
            time.sleep(0.1)

    # -- waiting ---------------------------------------------------------------------------

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod as JSON, or None when it does not exist."""
        try:
            return read_json(self.core().read_namespaced_pod, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def wait_for_pod(
        self,
        namespace: str,
        name: str,
        predicate: Callable[[dict[str, Any] | None], bool],
        *,
        timeout: float = 30.0,
        what: str = "the condition",
    ) -> dict[str, Any] | None:
        """Polls the pod (None once gone) until ``predicate`` holds; returns that version."""
        deadline = time.monotonic() + timeout
        while True:
            pod = self.pod(namespace, name)
            if predicate(pod):
                return pod
            if time.monotonic() > deadline:
                status = json.dumps((pod or {}).get("status"), indent=1)[:3000]
                raise AssertionError(
                    f"pod {namespace}/{name}: no {what} after {timeout:.0f} s; status: {status}"
                )
            time.sleep(0.1)

    def wait_for_phase(
        self, namespace: str, name: str, *phases: str, timeout: float = 30.0
    ) -> dict[str, Any]:
        """Waits for the pod to reach one of ``phases`` and returns it."""
        pod = self.wait_for_pod(
            namespace,
            name,
            lambda p: p is not None and p.get("status", {}).get("phase") in phases,
            timeout=timeout,
            what=f"phase {'/'.join(phases)}",
        )
        assert pod is not None
        return pod


def pod_ready(pod: dict[str, Any] | None) -> bool:
    """Whether the pod's Ready condition is True."""
    conditions = ((pod or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


@contextlib.contextmanager
def running_control_plane(**kwargs: Any) -> Iterator[ControlPlane]:
    """`ControlPlane` as a context manager function."""
    plane = ControlPlane(**kwargs)
    with plane:
        yield plane


def main() -> None:
    """Starts a control plane with two fake nodes and waits for Ctrl-C."""
    with running_control_plane() as plane:
        plane.register_nodes(1)
        plane.register_nodes(1, gpus=4)
        print(f"up in {plane.startup_seconds:.1f} s; export KUBECONFIG={plane.kubeconfig}")
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


if __name__ == "__main__":
    main()

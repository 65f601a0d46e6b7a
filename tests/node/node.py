"""A real Kubernetes node on this machine: containerd + runc, a CNI bridge, kubelet, kube-proxy.

What tests/kube's fake kubelet cannot check (a container's user, read-only root, capabilities,
Secret file modes, memory limits, probes, pod IPs and Services) needs pods in real containers.
`PodNetwork` makes a Linux bridge with a /24 of its own; the API server listens on its gateway
address (`tests.kube.cluster.ControlPlane(advertise_address=...)`) so pods reach it through the
``kubernetes`` Service. `RealNode` then starts, each with its files under one work folder:

- containerd 1.6 (Debian's) with the CRI plugin, runc and overlayfs, the CNI bridge plugin
  from containernetworking-plugins, and the locally built pause image as the sandbox;
- the images `hack/images.sh --save` wrote, imported with ``ctr``;
- kubelet 1.20.2 (built by hack/control-plane.sh), which registers the Node itself;
- kube-proxy 1.20.2 in iptables mode (Services' ClusterIPs);
- the cluster DNS (`tests.kube.dns`) on the gateway's port 53, answering from the Services and
  Endpoints the real controllers keep.

Everything is stopped by PID and every mount under the work folder is undone. Needs root,
iptables and the binaries above; `hack/test.sh` provides them. ``python -m tests.node.node``
starts one and keeps it up until Ctrl-C (hack/cluster.sh does that for people).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from kubernetes.client.rest import ApiException

from fedcore.local.ports import free_ports
from tests.kube.cluster import DEFAULT_BIN, Component, ControlPlane, read_json, spawn_component
from tests.kube.dns import DnsServer, NoSuchName

IMAGES_ENV = "FEDCORE_IMAGE_ARCHIVES"
DEFAULT_IMAGES = Path.home() / ".cache" / "fedcore-images" / "archives"
PAUSE_IMAGE = "localhost/fedcore-pause:3.4.1"
CNI_BIN = Path("/usr/lib/cni")
CLUSTER_DOMAIN = "cluster.local"


class NodeError(RuntimeError):
    """The node could not be set up or used."""


def _run(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=timeout)


def missing_requirements() -> list[str]:
    """What this machine lacks for a real node (empty when it can run one)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root")
    for tool in ("containerd", "ctr", "runc", "iptables", "ip"):
        if not shutil.which(tool):
            missing.append(tool)
    if not (CNI_BIN / "bridge").exists():
        missing.append("containernetworking-plugins")
    bin_dir = Path(os.environ.get("FEDCORE_K8S_BIN") or DEFAULT_BIN).expanduser()
    missing += [str(bin_dir / b) for b in ("kubelet", "kube-proxy") if not (bin_dir / b).exists()]
    return missing


STATE_FILE = "node.json"
"""In a node's work folder: its bridge and subnet, for cleaning up after a killed test run."""


def _mount_points() -> list[str]:
    return [
        line.split()[1].replace("\\040", " ")
        for line in Path("/proc/self/mounts").read_text().splitlines()
    ]


def unmount_under(folder: Path) -> None:
    """Every mount under ``folder``, deepest first (Secrets, containers' root filesystems)."""
    mounts = [mount for mount in _mount_points() if mount.startswith(str(folder))]
    for mount in sorted(mounts, key=len, reverse=True):
        _run("umount", "-l", mount, check=False)


def discard_storage(workdir: Path) -> None:
    """Removes a node's containerd images and snapshots (several GB); its logs stay.

    Only once nothing is mounted under ``workdir``: a removal must never follow a mount (a
    Secret's, a container's root filesystem) out of it.
    """
    if not any(mount.startswith(str(workdir)) for mount in _mount_points()):
        shutil.rmtree(workdir / "containerd", ignore_errors=True)


def remove_pod_nat_rules(subnet: ipaddress.IPv4Network) -> None:
    """The NAT rules the CNI bridge plugin added for the pods of ``subnet``, and their chains.

    The plugin removes them when a pod's sandbox is torn down through the CRI; containers
    killed at the end of a session are not, so they are removed here.
    """
    prefix = str(subnet.network_address).rsplit(".", 1)[0] + "."
    rules = _run("iptables", "-t", "nat", "-S", check=False).stdout.splitlines()
    chains = set()
    for rule in rules:
        words = shlex.split(rule)
        if words[:2] != ["-A", "POSTROUTING"] or "-s" not in words or "-j" not in words:
            continue
        source, target = words[words.index("-s") + 1], words[words.index("-j") + 1]
        if source.startswith(prefix) and target.startswith("CNI-"):
            _run("iptables", "-t", "nat", "-D", *words[1:], check=False)
            chains.add(target)
    for chain in chains:
        _run("iptables", "-t", "nat", "-F", chain, check=False)
        _run("iptables", "-t", "nat", "-X", chain, check=False)


def remove_pod_netns(subnet: ipaddress.IPv4Network) -> None:
    """The network namespaces the CRI made for pod sandboxes with an address in ``subnet``."""
    prefix = str(subnet.network_address).rsplit(".", 1)[0] + "."
    for netns in Path("/var/run/netns").glob("cni-*"):
        if f"inet {prefix}" in _run("ip", "-n", netns.name, "-4", "addr", check=False).stdout:
            _run("ip", "netns", "del", netns.name, check=False)


def clean_stale_nodes() -> None:
    """What a killed test session left: the shims, mounts, network namespaces, bridge and NAT
    rules of every node whose containerd no longer runs."""
    shims = _run("pgrep", "-a", "-f", "containerd-shim-runc-v2", check=False).stdout
    stale: dict[Path, list[int]] = {}
    for line in shims.splitlines():
        pid, *argv = line.split()
        if "-address" in argv:
            socket_path = Path(argv[argv.index("-address") + 1])
            stale.setdefault(socket_path.parent.parent, []).append(int(pid))
    for workdir, pids in stale.items():
        config = workdir / "containerd" / "config.toml"
        if _run("pgrep", "-f", f"containerd --config {config}", check=False).stdout.strip():
            continue  # a live node
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        unmount_under(workdir)
        discard_storage(workdir)
        with contextlib.suppress(OSError, ValueError, KeyError):
            state = json.loads((workdir / STATE_FILE).read_text())
            subnet = ipaddress.ip_network(state["subnet"])
            assert isinstance(subnet, ipaddress.IPv4Network)
            remove_pod_nat_rules(subnet)
            remove_pod_netns(subnet)
            _run("ip", "link", "del", state["bridge"], check=False)


class PodNetwork:
    """A bridge with a free 10.217.N.0/24; its .1 is the node's (and the API server's) address."""

    def __init__(self) -> None:
        used = _run("ip", "-4", "route", "show").stdout
        for third in random.sample(range(1, 255), 254):
            subnet = ipaddress.ip_network(f"10.217.{third}.0/24")
            if str(subnet) not in used:
                break
        else:
            raise NodeError("no free 10.217.N.0/24 for the pod network")
        self.subnet = subnet
        self.gateway = str(subnet.network_address + 1)
        self.bridge = f"fcbr{third}"

    def create(self) -> PodNetwork:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
        return self

    def remove(self) -> None:
        _run("ip", "link", "del", self.bridge, check=False)


def _containerd_config(work: Path, cni_conf: Path) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""\
version = 2
root = "{work}/root"
state = "{work}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{work}/containerd.sock"
[ttrpc]
  address = "{work}/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{work}/opt"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  # Without it runc fails with "can't get final child's PID from pipe" in a sandbox that
  # cannot lower oom_score_adj.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{cni_conf}"
"""


class RealNode:
    """One registered, Ready node whose pods run in containerd; see the module docstring."""

    def __init__(
        self,
        control_plane: ControlPlane,
        network: PodNetwork,
        *,
        images: Path | None = None,
        workdir: Path | None = None,
        name: str = "node-0",
        start_timeout: float = 120.0,
    ) -> None:
        self.control_plane = control_plane
        self.network = network
        self.images = Path(images or os.environ.get(IMAGES_ENV) or DEFAULT_IMAGES).expanduser()
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="fedcore-node-"))
        self.name = name
        self.start_timeout = start_timeout
        self.bin_dir = control_plane.bin_dir
        self.components: list[Component] = []
        self.dns: DnsServer | None = None
        self.socket = self.workdir / "containerd" / "containerd.sock"

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> RealNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> RealNode:
        clean_stale_nodes()
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / STATE_FILE).write_text(
            json.dumps({"bridge": self.network.bridge, "subnet": str(self.network.subnet)})
        )
        try:
            self._start_containerd()
            self._import_images()
            self.dns = DnsServer(self._lookup, host=self.network.gateway, port=53).start()
            self._start_kube_proxy()
            self._start_kubelet()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stops the kubelet, every container, containerd and kube-proxy; undoes mounts."""
        for component in reversed(self.components):
            if component.name in ("kubelet", "kube-proxy"):
                component.stop()
        if self.socket.exists():
            self._remove_containers()
        for component in reversed(self.components):
            component.stop()
        self.components = []
        if self.dns is not None:
            self.dns.stop()
            self.dns = None
        proxy = self.bin_dir / "kube-proxy"
        if proxy.exists():
            _run(str(proxy), "--cleanup", check=False)
        remove_pod_nat_rules(self.network.subnet)
        unmount_under(self.workdir)
        discard_storage(self.workdir)

    # -- components ------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str]) -> Component:
        component = spawn_component(self.workdir, name, args)
        self.components.append(component)
        return component

    def _check_alive(self) -> None:
        for component in self.components:
            if component.process.poll() is not None:
                raise NodeError(
                    f"{component.name} exited with {component.process.returncode}; last lines "
                    f"of {component.log}:\n{component.tail()}"
                )

    def ctr(self, *args: str, timeout: float = 300) -> str:
        """``ctr`` against this node's containerd, in the CRI's namespace."""
        result = _run(
            "ctr",
            "--address",
            str(self.socket),
            "-n",
            "k8s.io",
            *args,
            check=False,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise NodeError(f"ctr {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def _start_containerd(self) -> None:
        work = self.workdir / "containerd"
        cni_conf = self.workdir / "cni"
        work.mkdir(parents=True)
        cni_conf.mkdir()
        (cni_conf / "10-fedcore.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "0.4.0",
                    "name": "fedcore",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": self.network.bridge,
                            "isGateway": True,
                            "ipMasq": True,
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": str(self.network.subnet)}]],
                                "routes": [{"dst": "0.0.0.0/0"}],
                                "dataDir": str(self.workdir / "ipam"),
                            },
                        },
                        {"type": "portmap", "capabilities": {"portMappings": True}},
                    ],
                }
            )
        )
        config = work / "config.toml"
        config.write_text(_containerd_config(work, cni_conf))
        self._spawn("containerd", ["containerd", "--config", str(config)])
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise NodeError("containerd did not open its socket in 30 s")
            time.sleep(0.1)

    def _import_images(self) -> None:
        archives = sorted(self.images.glob("*.tar"))
        if not any(a.name == "fedcore-pause.tar" for a in archives):
            raise NodeError(
                f"no images in {self.images}: run `bash hack/images.sh --save {self.images} "
                "pause operator runtime` (or point FEDCORE_IMAGE_ARCHIVES at such a folder)"
            )
        for archive in archives:
            self.ctr("images", "import", str(archive))

    def _start_kube_proxy(self) -> None:
        healthz, metrics = free_ports(2)
        self._spawn(
            "kube-proxy",
            [
                str(self.bin_dir / "kube-proxy"),
                f"--kubeconfig={self.control_plane.kubeconfig}",
                f"--hostname-override={self.name}",
                "--proxy-mode=iptables",
                # Replies from a pod on the same bridge come back through the host.
                "--masquerade-all",
                f"--cluster-cidr={self.network.subnet}",
                f"--bind-address={self.network.gateway}",
                f"--healthz-bind-address=127.0.0.1:{healthz}",
                f"--metrics-bind-address=127.0.0.1:{metrics}",
                # A sandbox cannot raise conntrack limits nor lower its own OOM score.
                "--conntrack-max-per-core=0",
                "--conntrack-tcp-timeout-established=0",
                "--conntrack-tcp-timeout-close-wait=0",
                "--oom-score-adj=0",
                "--v=1",
            ],
        )

    def _start_kubelet(self) -> None:
        work = self.workdir / "kubelet"
        work.mkdir()
        (port,) = free_ports(1)
        resolv = self.workdir / "resolv.conf"
        resolv.write_text(f"nameserver {self.network.gateway}\n")
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": self.network.gateway,
            "port": port,
            "readOnlyPort": 0,
            "healthzPort": 0,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(self.control_plane.ca_path)},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            "failSwapOn": False,
            "enforceNodeAllocatable": [],
            "clusterDNS": [self.network.gateway],
            "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": str(resolv),
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "maxPods": 30,
        }
        (work / "config.yaml").write_text(yaml.safe_dump(config))
        self._spawn(
            "kubelet",
            [
                str(self.bin_dir / "kubelet"),
                f"--config={work / 'config.yaml'}",
                f"--kubeconfig={self.control_plane.kubeconfig}",
                "--container-runtime=remote",
                f"--container-runtime-endpoint=unix://{self.socket}",
                f"--root-dir={work}",
                f"--cert-dir={work / 'pki'}",
                f"--hostname-override={self.name}",
                f"--node-ip={self.network.gateway}",
                f"--pod-infra-container-image={PAUSE_IMAGE}",
                "--oom-score-adj=0",
                "--v=1",
            ],
        )

    def _wait_ready(self) -> None:
        core = self.control_plane.core()
        deadline = time.monotonic() + self.start_timeout
        last = "not registered"
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                node = read_json(core.read_node, self.name)
                ready = [c for c in node["status"].get("conditions", []) if c["type"] == "Ready"]
                if ready and ready[0]["status"] == "True" and self._service_routes():
                    return
                last = ready[0]["message"] if ready else "no Ready condition"
            except ApiException as exc:
                if exc.status != 404:
                    raise
            time.sleep(0.5)
        raise NodeError(f"node {self.name} not Ready in {self.start_timeout} s: {last}")

    def _service_routes(self) -> bool:
        """kube-proxy has written the `kubernetes` Service's rules (pods can reach the API)."""
        rules = _run("iptables", "-t", "nat", "-S", "KUBE-SERVICES", check=False).stdout
        return "default/kubernetes" in rules

    # -- cluster DNS -------------------------------------------------------------------------

    def _lookup(self, name: str) -> str:
        """A cluster DNS's A record for ``name``: a Service's ClusterIP, or for a headless one
        (and ``host.subdomain.ns.svc``) the address of an endpoint, from the real Endpoints."""
        labels = name.lower().removesuffix("." + CLUSTER_DOMAIN).split(".")
        if labels[-1:] != ["svc"] or len(labels) not in (3, 4):
            raise NoSuchName(name)
        core = self.control_plane.core()
        service_name, namespace = labels[-3], labels[-2]

        def read(call: Any) -> dict[str, Any]:
            try:
                return dict(read_json(call, service_name, namespace))
            except ApiException as exc:
                if exc.status == 404:
                    raise NoSuchName(name) from None
                raise

        service = read(core.read_namespaced_service)
        if len(labels) == 3 and service["spec"].get("clusterIP") not in (None, "None"):
            return str(service["spec"]["clusterIP"])
        endpoints = read(core.read_namespaced_endpoints)
        for subset in endpoints.get("subsets") or []:
            for address in [*subset.get("addresses", []), *subset.get("notReadyAddresses", [])]:
                if len(labels) == 3 or address.get("hostname") == labels[0]:
                    return str(address["ip"])
        raise NoSuchName(name)

    # -- teardown ----------------------------------------------------------------------------

    def _remove_containers(self) -> None:
        """Kills every container's task, then deletes the tasks and the containers."""
        steps = [
            ("tasks", ("kill", "-s", "SIGKILL")),
            ("tasks", ("delete", "-f")),
            ("containers", ("delete",)),
        ]
        with contextlib.suppress(NodeError, subprocess.TimeoutExpired):
            for kind, action in steps:
                for name in self.ctr(kind, "ls", "-q", timeout=30).split():
                    with contextlib.suppress(NodeError):
                        self.ctr(kind, *action, name, timeout=30)
                if action[0] == "kill":
                    time.sleep(0.5)  # the kills land before the deletes
        remove_pod_netns(self.network.subnet)

    # -- helpers for tests -----------------------------------------------------------------

    def logs(self, namespace: str, pod: str, container: str | None = None) -> str:
        """A container's log through the API server (the real kubelet serves it)."""
        core = self.control_plane.core()
        kwargs: dict[str, Any] = {"container": container} if container else {}
        return str(core.read_namespaced_pod_log(pod, namespace, **kwargs))


def wait_for_pod_phase(
    core: kubernetes.client.CoreV1Api,
    namespace: str,
    name: str,
    phases: tuple[str, ...] = ("Succeeded", "Failed"),
    timeout: float = 120.0,
) -> dict[str, Any]:
    """The pod once its phase is one of ``phases``; NodeError with its status otherwise."""
    deadline = time.monotonic() + timeout
    pod: dict[str, Any] = {}
    while time.monotonic() < deadline:
        pod = read_json(core.read_namespaced_pod, name, namespace)
        if pod.get("status", {}).get("phase") in phases:
            return pod
        time.sleep(0.5)
    raise NodeError(f"pod {namespace}/{name} not in {phases} in {timeout} s: {pod.get('status')}")


def write_scrape_targets(core: kubernetes.client.CoreV1Api, path: Path) -> None:
    """Every running pod's container port named ``metrics``, as a Prometheus file_sd file."""
    targets = [
        {
            "targets": [f"{pod.status.pod_ip}:{port.container_port}"],
            "labels": {"namespace": pod.metadata.namespace, "pod": pod.metadata.name},
        }
        for pod in core.list_pod_for_all_namespaces().items
        if pod.status.pod_ip and pod.status.phase == "Running"
        for container in pod.spec.containers
        for port in container.ports or []
        if port.name == "metrics"
    ]
    part = path.with_suffix(".part")
    part.write_text(json.dumps(targets))
    part.replace(path)


def main() -> None:
    """Starts a control plane and a real node, writes the kubeconfig, runs until SIGTERM/Ctrl-C.

    ``python -m tests.node.node [KUBECONFIG]``: the kubeconfig is copied to KUBECONFIG (default
    ~/.cache/fedcore-cluster/kubeconfig); hack/cluster.sh up/down start and stop this. Every 5 s
    it writes ``scrape-targets.json`` beside it: the pods' metrics ports, for a Prometheus's
    ``file_sd_configs`` (Debian's Prometheus has no Kubernetes service discovery).
    """
    target = Path(
        sys.argv[1] if len(sys.argv) > 1 else Path.home() / ".cache/fedcore-cluster/kubeconfig"
    )
    scrape = target.parent / "scrape-targets.json"
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    network = PodNetwork().create()
    try:
        with ControlPlane(advertise_address=network.gateway) as plane, RealNode(plane, network):
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(plane.kubeconfig, target)
            target.chmod(0o600)
            print(f"cluster up: export KUBECONFIG={target}", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    with contextlib.suppress(Exception):
                        write_scrape_targets(plane.core(), scrape)
                    time.sleep(5)
    finally:
        network.remove()
        target.unlink(missing_ok=True)
        scrape.unlink(missing_ok=True)


if __name__ == "__main__":
    main()

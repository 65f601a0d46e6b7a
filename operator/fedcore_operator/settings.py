"""The operator's own settings, read once from its environment (the chart sets them)."""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass, field
from typing import Any

from fedcore import __version__

DEFAULT_IMAGE = f"ghcr.io/fedcore/fedcore:{__version__}"
CLUSTER_DNS: tuple[dict[str, Any], ...] = (
    {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
    },
)
"""The cluster DNS as a NetworkPolicy peer: kube-dns (or CoreDNS, which keeps the label) in
kube-system. ``kubernetes.io/metadata.name`` is set on every namespace from Kubernetes 1.21."""
ANYWHERE = ("0.0.0.0/0", "::/0")


@dataclass(frozen=True)
class OperatorSettings:
    """How the operator builds pods and where it listens.

    Attributes:
        image: the runtime image of every role's pod unless the run names its own.
        image_pull_policy: the pods' imagePullPolicy.
        python: the interpreter command in the runtime image.
        server_port, kdc_port, peer_port, metrics_port: the roles' container ports.
        api_ports: TCP ports the server's egress NetworkPolicy opens towards the API server.
        api_cidrs: the addresses those ports are open to (default: any).
        ca_namespace: where the runs' CA Secrets are kept: the operator's own namespace, never
            a run's (``objects.ca_secret``).
        metrics_from: NetworkPolicy peers that may scrape the role pods' metrics port (the
            chart's scraper); empty: no one.
        dns_to: NetworkPolicy peers the pods may send DNS queries to (the cluster DNS).
        s3_to: NetworkPolicy peers for an S3 endpoint given by host name (an IP endpoint gets
            its own /32 or /128); empty: any address on the endpoint's port.
        run_as_user: the non-root uid (and gid) every pod runs as.
        resync_seconds: how often every run is reconciled even when nothing changed.
        finish_grace_seconds: how long the pods still running when a run succeeds may take to
            end on their own (clients writing their final models) before they are deleted.
        extra_env: environment added to every role's container (e.g. a proxy setting).
        hub_from: NetworkPolicy peers of the hub's endpoint, the only callers of the server
            and KDC of a run at sites (empty: the operator's pods in ``ca_namespace``).
    """

    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    python: str = "python"
    server_port: int = 7070
    kdc_port: int = 7071
    peer_port: int = 7072
    metrics_port: int = 9090
    api_ports: tuple[int, ...] = (443, 6443)
    api_cidrs: tuple[str, ...] = ANYWHERE
    ca_namespace: str = "default"
    metrics_from: tuple[dict[str, Any], ...] = ()
    dns_to: tuple[dict[str, Any], ...] = CLUSTER_DNS
    s3_to: tuple[dict[str, Any], ...] = ()
    run_as_user: int = 10001
    resync_seconds: float = 30.0
    finish_grace_seconds: float = 30.0
    extra_env: dict[str, str] = field(default_factory=dict)
    hub_from: tuple[dict[str, Any], ...] = ()

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> OperatorSettings:
        """Reads ``FEDCORE_OPERATOR_*`` variables; unset ones keep their defaults.

        ``CA_NAMESPACE`` (else ``NAMESPACE``, the operator's own, which the chart sets),
        ``API_CIDRS`` (comma-separated), and ``METRICS_FROM``, ``DNS_TO``, ``S3_TO`` and
        ``HUB_FROM`` as JSON lists of NetworkPolicy peers.

        Raises:
            ValueError: a variable that does not parse, naming it.
        """
        env = dict(os.environ if environ is None else environ)
        prefix = "FEDCORE_OPERATOR_"
        extra = {
            key[len(prefix + "POD_ENV_") :]: value
            for key, value in env.items()
            if key.startswith(prefix + "POD_ENV_")
        }
        api_ports = env.get(prefix + "API_PORTS")
        return cls(
            image=env.get(prefix + "IMAGE", DEFAULT_IMAGE),
            image_pull_policy=env.get(prefix + "IMAGE_PULL_POLICY", "IfNotPresent"),
            python=env.get(prefix + "PYTHON", "python"),
            api_ports=tuple(int(port) for port in api_ports.split(","))
            if api_ports
            else (443, 6443),
            api_cidrs=_cidrs(prefix + "API_CIDRS", env.get(prefix + "API_CIDRS")) or ANYWHERE,
            ca_namespace=env.get(prefix + "CA_NAMESPACE")
            or env.get(prefix + "NAMESPACE")
            or "default",
            metrics_from=_peers(prefix + "METRICS_FROM", env.get(prefix + "METRICS_FROM"), ()),
            dns_to=_peers(prefix + "DNS_TO", env.get(prefix + "DNS_TO"), CLUSTER_DNS) or _no_dns(),
            s3_to=_peers(prefix + "S3_TO", env.get(prefix + "S3_TO"), ()),
            resync_seconds=float(env.get(prefix + "RESYNC_SECONDS", "30")),
            finish_grace_seconds=float(env.get(prefix + "FINISH_GRACE_SECONDS", "30")),
            extra_env=extra,
            hub_from=_peers(prefix + "HUB_FROM", env.get(prefix + "HUB_FROM"), ()),
        )


PEER_KEYS = frozenset({"namespaceSelector", "podSelector", "ipBlock"})


def _peers(
    name: str, text: str | None, default: tuple[dict[str, Any], ...]
) -> tuple[dict[str, Any], ...]:
    """A JSON list of NetworkPolicy peers (``namespaceSelector``/``podSelector``/``ipBlock``)."""
    if text is None or not text.strip():
        return default
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: not JSON ({exc})") from exc
    if not isinstance(value, list):
        raise ValueError(f"{name}: must be a JSON list of NetworkPolicy peers")
    for index, peer in enumerate(value):
        if not isinstance(peer, dict) or not peer or not set(peer) <= PEER_KEYS:
            raise ValueError(
                f"{name}[{index}]: a NetworkPolicy peer has only {', '.join(sorted(PEER_KEYS))}"
            )
        if "ipBlock" in peer:
            _cidrs(f"{name}[{index}].ipBlock.cidr", str(peer["ipBlock"].get("cidr", "")))
    return tuple(value)


def _no_dns() -> tuple[dict[str, Any], ...]:
    raise ValueError(
        "FEDCORE_OPERATOR_DNS_TO: an empty list would open DNS to every address; name the "
        "cluster DNS"
    )


def _cidrs(name: str, text: str | None) -> tuple[str, ...]:
    """Comma-separated CIDRs, each checked."""
    cidrs = tuple(part.strip() for part in (text or "").split(",") if part.strip())
    for cidr in cidrs:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError as exc:
            raise ValueError(f"{name}: {cidr!r} is not a CIDR") from exc
    return cidrs

"""What a FederatedRun becomes on Kubernetes: pure builders of every object the operator owns.

Nothing here talks to the API server. Each builder takes a ``RunContext`` and returns the
object as a plain dict, labelled with the run and owned by it (garbage collection removes
them all with the run). Certificates and keys are the random part: the run's CA is made once
and kept in a Secret in the operator's own namespace (never the run's; see ``ca_secret``); a
pod's certificate Secret is issued only when it is missing; the checkpoint keys of the server,
the KDC and a decentralized protocol's clients (``keys_secret``) are drawn once per run and
never replaced.
"""

from __future__ import annotations

import base64
import copy
import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from fedcore.spec import FederatedRun, RoleSpec, protocol_facts
from fedcore.transport import RunCa
from fedcore_operator.crd import GROUP, PLURAL, VERSION
from fedcore_operator.settings import OperatorSettings

MANAGED_BY = "fedcore-operator"
RUN_LABEL = "fedcore.dev/run"
ROLE_LABEL = "fedcore.dev/role"
INDEX_LABEL = "fedcore.dev/client-index"
RESUME_ANNOTATION = "fedcore.dev/resume"
CA_COMPONENT = "run-ca"
CA_NAMESPACE_LABEL = "fedcore.dev/run-namespace"
CA_NAME_LABEL = "fedcore.dev/run-name"
CA_UID_LABEL = "fedcore.dev/run-uid"

TLS_DIR = "/etc/fedcore/tls"
KEYS_DIR = "/etc/fedcore/keys"
TERMINATION_LOG = "/dev/termination-log"
"""The container's termination message path (Kubernetes' default, set explicitly): a failed
role writes its one-line error there, which the pod's status then shows
(``terminated.message``) and the operator quotes."""
TERMINATION_LOG_ENV = "FEDCORE_TERMINATION_LOG"
"""Names ``TERMINATION_LOG`` to the role (``fedcore.cli.crash.TERMINATION_LOG_ENV``)."""
TERMINATION_FIELDS = ("terminationMessagePath", "terminationMessagePolicy")
"""The fedcore container's fields a pod template cannot change (``_lock_container``)."""
KEY_BYTES = 32
"""A checkpoint key is 32 random bytes, kept as 64 lowercase hex digits (fedcore.checkpoint)."""
ROLE_KEYS = {
    "server": ("checkpoint.key", "FEDCORE_CHECKPOINT_KEY_FILE"),
    "kdc": ("state.key", "FEDCORE_KDC_STATE_KEY_FILE"),
    "client": ("checkpoint.key", "FEDCORE_CHECKPOINT_KEY_FILE"),
}
"""Per role that has one, its key's file name in its pod's key Secret and the variable that
names it in that pod alone (fedcore/checkpoint/_keys.py; docs/operations.md, "On Kubernetes
(the operator's contract)"). A client has one only in a decentralized protocol, whose clients
keep their own checkpoints (``role_has_key``): each its own Secret ``<run>-client-<i>-keys``."""
KEY_FILE_ENVS = frozenset(env for _, env in ROLE_KEYS.values())
OWNED_ENVS = KEY_FILE_ENVS | {TERMINATION_LOG_ENV}
"""The fedcore container's variables a pod template cannot change (``_lock_container``)."""
MANIFEST_DIR = "/etc/fedcore/run"
MANIFEST_FILE = "run.yaml"
WORK_DIR = "/var/lib/fedcore"
DATA_DIR = "/var/lib/fedcore-data"
"""Where a client's PersistentVolumeClaim (spec.data.clientData volumeClaim) is mounted."""
DATA_CREDENTIALS_DIR = "/etc/fedcore/data-credentials"
"""Where a client's S3 credentials Secret (spec.data.clientData s3.credentialsSecret) is
mounted, as files."""
CONTAINER = "fedcore"

Object = dict[str, Any]


@dataclass(frozen=True)
class RunContext:
    """One run as the operator sees it: its parsed manifest and its identity on the cluster."""

    run: FederatedRun
    namespace: str
    uid: str
    settings: OperatorSettings

    @property
    def name(self) -> str:
        """The run's name."""
        return self.run.metadata.name

    @property
    def needs_kdc(self) -> bool:
        """Whether the protocol needs a KDC."""
        return protocol_facts(self.run.spec.protocol.name).needs_kdc

    @property
    def server_uses_kdc(self) -> bool:
        """Whether the protocol's server calls the KDC too (ebscfl)."""
        return protocol_facts(self.run.spec.protocol.name).server_uses_kdc

    @property
    def decentralized(self) -> bool:
        """Whether clients talk to each other over peer links."""
        return protocol_facts(self.run.spec.protocol.name).decentralized

    @property
    def at_sites(self) -> bool:
        """Whether the run's clients are at sites (spec.sites): this cluster runs only its
        KDC and server, which the hub's endpoint puts the sites' clients through to."""
        return self.run.spec.sites is not None

    @property
    def local_clients(self) -> int:
        """How many client pods this cluster runs for the run (none for a run at sites)."""
        return 0 if self.at_sites else self.run.spec.clients.count


# ------------------------------------------------------------------------------------ names


def pod_name(run: str, role: str, index: int | None = None) -> str:
    """``<run>-server``, ``<run>-kdc`` or ``<run>-client-<index>``."""
    return f"{run}-{role}" if index is None else f"{run}-{role}-{index}"


def tls_secret_name(pod: str) -> str:
    """The Secret with one pod's certificate, key and the run's CA certificate."""
    return f"{pod}-tls"


def keys_secret_name(run: str, role: str, index: int | None = None) -> str:
    """``<run>-server-keys``, ``<run>-kdc-keys`` or ``<run>-client-<i>-keys``: the role's
    checkpoint key, its pod's alone."""
    return f"{pod_name(run, role, index)}-keys"


def ca_secret_name(namespace: str, run: str) -> str:
    """The Secret with the run's CA key, in the operator's namespace (read by it only).

    Neither a namespace nor a run name holds a dot, so the name is unambiguous.
    """
    return f"fedcore-ca.{namespace}.{run}"


def legacy_ca_secret_name(run: str) -> str:
    """Where operators before issue 19 kept the CA: ``<run>-ca`` in the run's own namespace.

    A run that still has one gets it moved to ``ca_secret_name`` (``plan.MoveCa``).
    """
    return f"{run}-ca"


def ca_labels() -> dict[str, str]:
    """The labels every run CA Secret carries, as a selector (``Reconciler.collect_orphans``)."""
    return {
        "app.kubernetes.io/name": "fedcore",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/component": CA_COMPONENT,
    }


def manifest_name(run: str) -> str:
    """The ConfigMap with the run's manifest."""
    return f"{run}-manifest"


def service_account_name(run: str, role: str) -> str:
    """The ServiceAccount of a role's pods."""
    return f"{run}-{role}"


def server_role_name(run: str) -> str:
    """The Role (and RoleBinding) that lets the server patch its run's status."""
    return f"{run}-server-status"


def peers_service_name(run: str) -> str:
    """The headless Service that gives each client pod a stable DNS name."""
    return f"{run}-clients"


def service_host(ctx: RunContext, service: str) -> str:
    """The cluster DNS name of one of the run's Services."""
    return f"{service}.{ctx.namespace}.svc"


def longest_name(run: str, clients: int) -> str:
    """The longest object name the run will have (a client's TLS Secret)."""
    return tls_secret_name(pod_name(run, "client", max(clients - 1, 0)))


# ----------------------------------------------------------------------------------- labels


def run_labels(run: str) -> dict[str, str]:
    """Labels on every object the operator makes for a run."""
    return {
        "app.kubernetes.io/name": "fedcore",
        "app.kubernetes.io/instance": run,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        RUN_LABEL: run,
    }


def role_labels(run: str, role: str, index: int | None = None) -> dict[str, str]:
    """Labels of one role's objects; client pods also carry their index."""
    labels = {**run_labels(run), ROLE_LABEL: role, "app.kubernetes.io/component": role}
    if index is not None:
        labels[INDEX_LABEL] = str(index)
    return labels


def selector(run: str, role: str | None = None) -> dict[str, str]:
    """The smallest label set that selects a run's pods (of one role)."""
    return {RUN_LABEL: run} if role is None else {RUN_LABEL: run, ROLE_LABEL: role}


def label_selector(labels: dict[str, str]) -> str:
    """``a=b,c=d`` for a list call."""
    return ",".join(f"{key}={value}" for key, value in labels.items())


def owner_reference(ctx: RunContext) -> dict[str, Any]:
    """The owner reference that hands an object to the run's garbage collection."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "FederatedRun",
        "name": ctx.name,
        "uid": ctx.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(ctx: RunContext, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ctx.namespace,
        "labels": dict(labels),
        "ownerReferences": [owner_reference(ctx)],
    }


# ---------------------------------------------------------------------- config and secrets


def manifest_text(ctx: RunContext) -> str:
    """The manifest every role loads: the run as applied, defaults filled in, no status.

    Written as JSON (a subset of YAML): every string stays quoted, so a value such as the
    quantity ``"1e3"``, which a YAML dumper leaves plain, never reads back as a number.
    """
    manifest = {
        "apiVersion": ctx.run.api_version,
        "kind": ctx.run.kind,
        "metadata": {"name": ctx.name, "namespace": ctx.namespace},
        "spec": ctx.run.spec.model_dump(by_alias=True, mode="json", exclude_none=True),
    }
    return json.dumps(manifest, indent=2) + "\n"


def manifest_config_map(ctx: RunContext) -> Object:
    """The ConfigMap mounted into every role at ``MANIFEST_DIR``."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(ctx, manifest_name(ctx.name), run_labels(ctx.name)),
        "data": {MANIFEST_FILE: manifest_text(ctx)},
    }


def pod_identities(ctx: RunContext) -> list[tuple[str, str, int | None]]:
    """(pod name, certificate common name, client index) of every pod of the run."""
    identities: list[tuple[str, str, int | None]] = []
    if ctx.needs_kdc:
        identities.append((pod_name(ctx.name, "kdc"), "kdc", None))
    identities.append((pod_name(ctx.name, "server"), "server", None))
    identities += [
        (pod_name(ctx.name, "client", index), f"client-{index}", index)
        for index in range(ctx.local_clients)
    ]
    return identities


KeyHolder = tuple[str, int | None]
"""A pod that holds a key: its role and, for a client, its index."""


def role_has_key(ctx: RunContext, role: str) -> bool:
    """Whether the role's pods hold a key: the server and the KDC always, a client only in a
    decentralized protocol (its own checkpoints)."""
    return role in ROLE_KEYS and (role != "client" or ctx.decentralized)


def key_roles(ctx: RunContext) -> list[KeyHolder]:
    """The pods that get a key Secret: the KDC (when the protocol has one), the server and,
    in a decentralized protocol, every client this cluster runs."""
    holders: list[KeyHolder] = [("kdc", None)] if ctx.needs_kdc else []
    holders.append(("server", None))
    if role_has_key(ctx, "client"):
        holders += [("client", index) for index in range(ctx.local_clients)]
    return holders


def keys_secret(ctx: RunContext, role: str, key_hex: str, index: int | None = None) -> Object:
    """The Secret ``keys_secret_name`` holding the key ``key_hex`` of the role's pod (client
    ``index``'s) (64 lowercase hex digits, drawn by the caller: ``secrets.token_hex(KEY_BYTES)``).

    Owned by the run like the pods' certificate Secrets, so it lives exactly as long as the
    run, across recreated pods and suspensions: a new key would make the run's own
    checkpoints unreadable. Only that pod mounts it (``_pod``).

    Raises:
        ValueError: the role has no key here, or ``key_hex`` is not 64 lowercase hex digits.
    """
    if not role_has_key(ctx, role) or (role == "client") != (index is not None):
        raise ValueError(f"Role {role!r} has no key Secret in run {ctx.name!r}.")
    return key_secret_object(
        _metadata(ctx, keys_secret_name(ctx.name, role, index), role_labels(ctx.name, role, index)),
        ROLE_KEYS[role][0],
        key_hex,
    )


def key_secret_object(metadata: dict[str, Any], file_name: str, key_hex: str) -> Object:
    """A key Secret: ``file_name`` holding ``key_hex`` (64 lowercase hex digits).

    Raises:
        ValueError: ``key_hex`` is not 64 lowercase hex digits.
    """
    if len(key_hex) != 2 * KEY_BYTES or set(key_hex) - set("0123456789abcdef"):
        raise ValueError(f"A key is {2 * KEY_BYTES} lowercase hex digits.")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata,
        "stringData": {file_name: key_hex},
    }


def ca_secret(ctx: RunContext, ca: RunCa) -> Object:
    """The Secret with the run's CA certificate and key, in the operator's namespace.

    Not in the run's namespace: no run pod, run author or ServiceAccount there can read it
    (the operator's namespace is one only the operator reads). Owner references cannot cross
    namespaces, so it has none: the operator deletes it when the run is deleted, and its
    labels (the run's namespace, name and uid) let it find those whose run is gone.
    """
    ca_cert, ca_key = ca.to_pem()
    return ca_secret_from(ctx, {"ca.crt": ca_cert.decode(), "ca.key": ca_key.decode()})


def ca_secret_from(ctx: RunContext, string_data: dict[str, str]) -> Object:
    """``ca_secret`` with the given ``ca.crt`` and ``ca.key`` (a legacy Secret's, moved)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": ca_secret_name(ctx.namespace, ctx.name),
            "namespace": ctx.settings.ca_namespace,
            "labels": {
                **ca_labels(),
                CA_NAMESPACE_LABEL: ctx.namespace,
                CA_NAME_LABEL: ctx.name,
                CA_UID_LABEL: ctx.uid,
            },
        },
        "stringData": dict(string_data),
    }


def ca_secret_is_for(secret: Object, uid: str) -> bool:
    """Whether a CA Secret belongs to the run with ``uid`` (not to a deleted namesake)."""
    labels = (secret.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(CA_UID_LABEL) == uid)


def ca_pem_of(secret: Object) -> dict[str, str]:
    """``ca.crt`` and ``ca.key`` of a CA Secret as the API server returns it (base64 data)."""
    data = secret.get("data") or {}
    return {key: base64.b64decode(data[key]).decode() for key in ("ca.crt", "ca.key")}


def load_ca(secret: Object) -> RunCa:
    """Reads the run's CA back from its Secret (as the API server returns it: base64 data)."""
    pem = ca_pem_of(secret)
    return RunCa.from_pem(pem["ca.crt"].encode(), pem["ca.key"].encode())


def pod_tls_secret(
    ctx: RunContext, ca: RunCa, pod: str, common_name: str, index: int | None
) -> Object:
    """One pod's Secret: the run's CA certificate, the pod's certificate and key.

    The server's and KDC's certificates name their Services; a client's names its stable
    DNS name under the headless Service and, for decentralized protocols, its bare common
    name, which its peers check when they dial it (fedcore.roles._peers).
    """
    role = common_name.split("-")[0]
    if index is None:
        dns_names = _dns_names(ctx, pod)
    else:
        dns_names = [f"{common_name}.{service_host(ctx, peers_service_name(ctx.name))}"]
        if ctx.decentralized:
            dns_names.append(common_name)
    bundle = ca.issue(common_name, dns_names=dns_names)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": _metadata(ctx, tls_secret_name(pod), role_labels(ctx.name, role, index)),
        "stringData": {
            "ca.crt": bundle.ca_pem.decode(),
            "tls.crt": bundle.cert_pem.decode(),
            "tls.key": bundle.key_pem.decode(),
        },
    }


def _dns_names(ctx: RunContext, service: str) -> list[str]:
    return [
        service,
        f"{service}.{ctx.namespace}",
        service_host(ctx, service),
        f"{service_host(ctx, service)}.cluster.local",
    ]


# ------------------------------------------------------------------------------------- RBAC


def service_accounts(ctx: RunContext) -> list[Object]:
    """One ServiceAccount per role; only the server's token is mounted (to patch status)."""
    roles = (["kdc"] if ctx.needs_kdc else []) + ["server"] + ([] if ctx.at_sites else ["client"])
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": _metadata(
                ctx, service_account_name(ctx.name, role), role_labels(ctx.name, role)
            ),
            "automountServiceAccountToken": role == "server",
        }
        for role in roles
    ]


def server_status_role(ctx: RunContext) -> Object:
    """A Role that allows reading and patching this run's status and nothing else."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(ctx, server_role_name(ctx.name), role_labels(ctx.name, "server")),
        "rules": [
            {
                "apiGroups": [GROUP],
                "resources": [f"{PLURAL}/status"],
                "resourceNames": [ctx.name],
                "verbs": ["get", "patch"],
            }
        ],
    }


def server_status_role_binding(ctx: RunContext) -> Object:
    """Binds ``server_status_role`` to the server's ServiceAccount."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(ctx, server_role_name(ctx.name), role_labels(ctx.name, "server")),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": server_role_name(ctx.name),
        },
        "subjects": [
            {
                "kind": "ServiceAccount",
                "name": service_account_name(ctx.name, "server"),
                "namespace": ctx.namespace,
            }
        ],
    }


# --------------------------------------------------------------------------------- Services


def services(ctx: RunContext) -> list[Object]:
    """The server's and KDC's Services, and the clients' headless Service for peer links."""
    settings = ctx.settings
    result = [
        _service(
            ctx, "server", [("grpc", settings.server_port), ("metrics", settings.metrics_port)]
        )
    ]
    if ctx.needs_kdc:
        result.append(
            _service(ctx, "kdc", [("grpc", settings.kdc_port), ("metrics", settings.metrics_port)])
        )
    if ctx.at_sites:
        return result
    peers = _service(
        ctx, "client", [("peer", settings.peer_port), ("metrics", settings.metrics_port)]
    )
    peers["metadata"]["name"] = peers_service_name(ctx.name)
    peers["spec"]["clusterIP"] = "None"
    peers["spec"]["publishNotReadyAddresses"] = True
    result.append(peers)
    return result


def _service(ctx: RunContext, role: str, ports: list[tuple[str, int]]) -> Object:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(ctx, pod_name(ctx.name, role), role_labels(ctx.name, role)),
        "spec": {
            "selector": selector(ctx.name, role),
            "ports": [
                {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
                for name, port in ports
            ],
        },
    }


# -------------------------------------------------------------------------- NetworkPolicies


def network_policies(ctx: RunContext) -> list[Object]:
    """One policy per role: each pod may reach only what its role needs.

    Every policy names both directions, so anything not listed is denied: clients reach the
    server and (when there is one) the KDC, and each other only when the protocol is
    decentralized; only the run's clients (and, for ebscfl, its server) reach the KDC; the
    server reaches the API server (its status, ``settings.api_cidrs``) and the checkpoint
    store (``_store_egress``); every pod resolves names at the cluster DNS only
    (``settings.dns_to``) and serves /metrics to the named scraper only
    (``settings.metrics_from``; none named: to no one).
    """
    settings = ctx.settings
    dns: dict[str, Any] = {
        "to": [copy.deepcopy(peer) for peer in settings.dns_to],
        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
    }
    scrapes: list[dict[str, Any]] = (
        [
            {
                "from": [copy.deepcopy(peer) for peer in settings.metrics_from],
                "ports": [{"protocol": "TCP", "port": settings.metrics_port}],
            }
        ]
        if settings.metrics_from
        else []
    )
    clients: dict[str, Any] = {"podSelector": {"matchLabels": selector(ctx.name, "client")}}
    # A run at sites has no client pods: its clients come through the hub's endpoint.
    callers = hub_peers(settings) if ctx.at_sites else [clients]

    def to_role(role: str, port: int) -> dict[str, Any]:
        return {
            "to": [{"podSelector": {"matchLabels": selector(ctx.name, role)}}],
            "ports": [{"protocol": "TCP", "port": port}],
        }

    store = _store_egress(ctx)
    server_egress = [dns, _to_cidrs(settings.api_cidrs, settings.api_ports), *store]
    if ctx.needs_kdc and ctx.server_uses_kdc:  # the server fetches its own keys (ebscfl)
        server_egress.append(to_role("kdc", settings.kdc_port))
    client_egress = (
        []
        if ctx.at_sites  # no client pods here; the sites bind their clients' data
        else [dns, to_role("server", settings.server_port), *_client_data_egress(ctx)]
    )
    client_ingress = [*scrapes]
    policies = [
        _policy(
            ctx,
            "server",
            ingress=[
                {"from": callers, "ports": [{"protocol": "TCP", "port": settings.server_port}]},
                *scrapes,
            ],
            egress=server_egress,
        )
    ]
    if ctx.needs_kdc:
        client_egress.append(to_role("kdc", settings.kdc_port))
        kdc_callers = copy.deepcopy(callers)
        if ctx.server_uses_kdc:
            kdc_callers.append({"podSelector": {"matchLabels": selector(ctx.name, "server")}})
        policies.append(
            _policy(
                ctx,
                "kdc",
                ingress=[
                    {
                        "from": kdc_callers,
                        "ports": [{"protocol": "TCP", "port": settings.kdc_port}],
                    },
                    *scrapes,
                ],
                egress=[dns, *store],
            )
        )
    if ctx.decentralized:
        client_egress.extend(store)  # each client writes its own checkpoints
        client_egress.append(to_role("client", settings.peer_port))
        client_ingress.append(
            {"from": [clients], "ports": [{"protocol": "TCP", "port": settings.peer_port}]}
        )
    if not ctx.at_sites:
        policies.append(_policy(ctx, "client", ingress=client_ingress, egress=client_egress))
    return policies


OPERATOR_POD_LABELS = {
    "app.kubernetes.io/name": "fedcore",
    "app.kubernetes.io/component": "operator",
}
"""The labels the chart gives the operator's pod."""


def hub_peers(settings: OperatorSettings) -> list[dict[str, Any]]:
    """NetworkPolicy peers of the hub's endpoint (the operator's pods, in its namespace):
    the only callers of a run-at-sites' server and KDC."""
    if settings.hub_from:
        return [copy.deepcopy(peer) for peer in settings.hub_from]
    return [operator_peer(settings.ca_namespace)]


def operator_peer(namespace: str) -> dict[str, Any]:
    """The NetworkPolicy peer of the operator's pods in ``namespace``."""
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)},
    }


def revoked_sites_name(run: str) -> str:
    """``<run>-revoked-sites``: the hub's revoked sites, as a run-at-sites' server reads them."""
    return f"{run}-revoked-sites"


REVOKED_DIR = "/etc/fedcore/revoked"
REVOKED_FILE = "revoked-sites.json"


def revoked_sites_config_map(ctx: RunContext, revoked: Sequence[str]) -> Object:
    """The ConfigMap the server and KDC of a run at sites read the revoked sites from
    (``fedcore.transport.RevokedSites``); the operator keeps it equal to the hub's list."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(ctx, revoked_sites_name(ctx.name), run_labels(ctx.name)),
        "data": {REVOKED_FILE: json.dumps({"revoked": sorted(revoked)}, indent=1)},
    }


def _to_cidrs(cidrs: tuple[str, ...], ports: tuple[int, ...]) -> dict[str, Any]:
    return {
        "to": [{"ipBlock": {"cidr": cidr}} for cidr in cidrs],
        "ports": [{"protocol": "TCP", "port": port} for port in ports],
    }


def _store_egress(ctx: RunContext) -> list[dict[str, Any]]:
    """Egress to the S3 endpoint, when checkpoints go to S3 (``_s3_egress``)."""
    s3 = ctx.run.spec.checkpoint.s3
    return [] if s3 is None else _s3_egress(ctx, s3.endpoint)


def _client_data_egress(ctx: RunContext) -> list[dict[str, Any]]:
    """Egress to the S3 endpoints the clients read their own data from (``_s3_egress``)."""
    own = ctx.run.spec.data.client_data
    if own is None:
        return []
    endpoints = []
    for index in range(ctx.run.spec.clients.count):
        s3 = own.source_of(index).s3
        if s3 is not None and s3.endpoint not in endpoints:
            endpoints.append(s3.endpoint)
    return [rule for endpoint in endpoints for rule in _s3_egress(ctx, endpoint)]


def _s3_egress(ctx: RunContext, endpoint: str | None) -> list[dict[str, Any]]:
    """Egress to an S3 endpoint.

    To the endpoint's own address when it is an IP (a /32 or /128); for a host name (or
    AWS's default endpoint) to ``settings.s3_to`` when the chart names it (CIDRs, or the
    selectors of an in-cluster store), else to any address, on the endpoint's port only.
    """
    host: str | None = None
    port = 443
    if endpoint is not None:
        url = urlparse(endpoint)
        host = url.hostname
        port = url.port or (443 if url.scheme == "https" else 80)
    ports = [{"protocol": "TCP", "port": port}]
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        address = None
    if address is not None:
        cidr = f"{address}/{address.max_prefixlen}"
        return [{"to": [{"ipBlock": {"cidr": cidr}}], "ports": ports}]
    if ctx.settings.s3_to:
        return [{"to": [copy.deepcopy(peer) for peer in ctx.settings.s3_to], "ports": ports}]
    return [_to_cidrs(("0.0.0.0/0", "::/0"), (port,))]


def _policy(
    ctx: RunContext, role: str, *, ingress: list[dict[str, Any]], egress: list[dict[str, Any]]
) -> Object:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(ctx, pod_name(ctx.name, role), role_labels(ctx.name, role)),
        "spec": {
            "podSelector": {"matchLabels": selector(ctx.name, role)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": egress,
        },
    }


# ------------------------------------------------------------------------------------- pods


def kdc_pod(ctx: RunContext, *, resume: bool) -> Object:
    """The KDC's pod (only for protocols that need one); ``resume`` reloads its saved keys."""
    settings = ctx.settings
    env = _listen_env(settings.kdc_port)
    if resume:
        env.append({"name": "FEDCORE_RESUME", "value": "1"})
    pod = _pod(
        ctx,
        "kdc",
        None,
        ctx.run.spec.roles.kdc,
        env=env,
        ports=[("grpc", settings.kdc_port)],
        ready_port="grpc",
    )
    pod["metadata"].setdefault("annotations", {})[RESUME_ANNOTATION] = str(resume).lower()
    return pod


def server_pod(ctx: RunContext, *, resume: bool) -> Object:
    """The server's pod; ``resume`` starts it from the latest checkpoint (a recreated pod)."""
    settings = ctx.settings
    env = _listen_env(settings.server_port)
    env += [
        {"name": "FEDCORE_STATUS_RUN", "value": ctx.name},
        {
            "name": "FEDCORE_STATUS_NAMESPACE",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        },
    ]
    if resume:
        env.append({"name": "FEDCORE_RESUME", "value": "1"})
    if ctx.needs_kdc and ctx.server_uses_kdc:
        env.append(
            {
                "name": "FEDCORE_KDC",
                "value": f"{service_host(ctx, pod_name(ctx.name, 'kdc'))}:{settings.kdc_port}",
            }
        )
    pod = _pod(
        ctx,
        "server",
        None,
        ctx.run.spec.roles.server,
        env=env,
        ports=[("grpc", settings.server_port)],
        ready_port="grpc",
    )
    pod["metadata"].setdefault("annotations", {})[RESUME_ANNOTATION] = str(resume).lower()
    return pod


def client_pod(ctx: RunContext, index: int) -> Object:
    """Client ``index``'s pod, with a stable DNS name under the headless Service."""
    settings = ctx.settings
    env: list[dict[str, Any]] = [
        {"name": "FEDCORE_CLIENT_INDEX", "value": str(index)},
        {
            "name": "FEDCORE_SERVER",
            "value": f"{service_host(ctx, pod_name(ctx.name, 'server'))}:{settings.server_port}",
        },
    ]
    if ctx.needs_kdc:
        env.append(
            {
                "name": "FEDCORE_KDC",
                "value": f"{service_host(ctx, pod_name(ctx.name, 'kdc'))}:{settings.kdc_port}",
            }
        )
    env += _metrics_env()
    if ctx.decentralized:
        peers = service_host(ctx, peers_service_name(ctx.name))
        env += [
            {"name": "FEDCORE_PEER_LISTEN", "value": f"$(POD_IP):{settings.peer_port}"},
            {
                "name": "FEDCORE_PEER_TEMPLATE",
                "value": f"client-{{index}}.{peers}:{settings.peer_port}",
            },
        ]
    ports = [("peer", settings.peer_port)] if ctx.decentralized else []
    pod = _pod(ctx, "client", index, ctx.run.spec.roles.clients, env=env, ports=ports)
    pod["spec"]["hostname"] = f"client-{index}"
    pod["spec"]["subdomain"] = peers_service_name(ctx.name)
    return pod


def _mount_client_data(ctx: RunContext, pod: Object, index: int) -> None:
    """Mounts client ``index``'s own data source into its pod, and into no other: its
    PersistentVolumeClaim read-only at ``DATA_DIR`` (its subPath only), or the Secret with its
    S3 credentials, as 0440 files at ``DATA_CREDENTIALS_DIR``. Added before the pod template,
    so that ``lock_pod`` keeps them as the operator's own volumes."""
    own = ctx.run.spec.data.client_data
    if own is None:
        return
    source = own.source_of(index)
    container = pod["spec"]["containers"][0]
    volumes = pod["spec"]["volumes"]
    if source.volume_claim is not None:
        claim = source.volume_claim
        volumes.append(
            {
                "name": "data",
                "persistentVolumeClaim": {"claimName": claim.claim_name, "readOnly": True},
            }
        )
        mount: dict[str, Any] = {"name": "data", "mountPath": DATA_DIR, "readOnly": True}
        if claim.sub_path:
            mount["subPath"] = claim.sub_path
        container["volumeMounts"].append(mount)
        container["env"].append({"name": "FEDCORE_DATA_DIR", "value": DATA_DIR})
    if source.s3 is not None and source.s3.credentials_secret:
        volumes.append(
            {
                "name": "data-credentials",
                "secret": {"secretName": source.s3.credentials_secret, "defaultMode": 0o440},
            }
        )
        container["volumeMounts"].append(
            {"name": "data-credentials", "mountPath": DATA_CREDENTIALS_DIR, "readOnly": True}
        )
        container["env"].append(
            {"name": "FEDCORE_DATA_CREDENTIALS_DIR", "value": DATA_CREDENTIALS_DIR}
        )


def _listen_env(port: int) -> list[dict[str, Any]]:
    return [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "FEDCORE_LISTEN", "value": f"$(POD_IP):{port}"},
        *_metrics_env(include_pod_ip=False),
    ]


def _metrics_env(include_pod_ip: bool = True) -> list[dict[str, Any]]:
    env = []
    if include_pod_ip:
        env.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    env.append({"name": "FEDCORE_METRICS_ADDRESS", "value": "$(POD_IP)"})
    return env


def _pod(
    ctx: RunContext,
    role: str,
    index: int | None,
    placement: RoleSpec,
    *,
    env: list[dict[str, Any]],
    ports: list[tuple[str, int]],
    ready_port: str | None = None,
) -> Object:
    settings = ctx.settings
    name = pod_name(ctx.name, role, index)
    s3 = ctx.run.spec.checkpoint.s3
    common_env: list[dict[str, Any]] = [
        {"name": "FEDCORE_MANIFEST", "value": f"{MANIFEST_DIR}/{MANIFEST_FILE}"},
        {"name": "FEDCORE_TLS_DIR", "value": TLS_DIR},
        {"name": "FEDCORE_WORKDIR", "value": WORK_DIR},
        {"name": "FEDCORE_METRICS_PORT", "value": str(settings.metrics_port)},
        {"name": "HOME", "value": "/tmp"},
        {"name": "TMPDIR", "value": "/tmp"},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
        {"name": TERMINATION_LOG_ENV, "value": TERMINATION_LOG},
        *({"name": key, "value": value} for key, value in sorted(settings.extra_env.items())),
    ]
    keys = ROLE_KEYS[role] if role_has_key(ctx, role) else None
    if keys is not None:
        common_env.append({"name": keys[1], "value": f"{KEYS_DIR}/{keys[0]}"})
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": placement.image or settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": [settings.python, "-m", "fedcore", role],
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "File",
        "env": common_env + env,
        "ports": [
            {"name": port_name, "containerPort": port, "protocol": "TCP"}
            for port_name, port in [*ports, ("metrics", settings.metrics_port)]
        ],
        "resources": _resources(placement),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "tls", "mountPath": TLS_DIR, "readOnly": True},
            {"name": "manifest", "mountPath": MANIFEST_DIR, "readOnly": True},
            {"name": "work", "mountPath": WORK_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    if keys is not None:
        container["volumeMounts"].append({"name": "keys", "mountPath": KEYS_DIR, "readOnly": True})
    if ctx.at_sites and role in ("server", "kdc"):
        container["volumeMounts"].append(
            {"name": "revoked-sites", "mountPath": REVOKED_DIR, "readOnly": True}
        )
        container["env"].append(
            {"name": "FEDCORE_REVOKED_SITES", "value": f"{REVOKED_DIR}/{REVOKED_FILE}"}
        )
    # Clients of a decentralized protocol write their own checkpoints.
    writes_checkpoints = role in ("server", "kdc") or (role == "client" and ctx.decentralized)
    if s3 is not None and s3.credentials_secret and writes_checkpoints:
        container["envFrom"] = [{"secretRef": {"name": s3.credentials_secret}}]
    if ready_port is not None:
        container["readinessProbe"] = {
            "tcpSocket": {"port": ready_port},
            "periodSeconds": 2,
            "failureThreshold": 3,
        }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "serviceAccountName": service_account_name(ctx.name, role),
        "automountServiceAccountToken": role == "server",
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_user,
            "fsGroup": settings.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "tls", "secret": {"secretName": tls_secret_name(name), "defaultMode": 0o440}},
            {"name": "manifest", "configMap": {"name": manifest_name(ctx.name)}},
            {"name": "work", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {}},
        ],
    }
    if keys is not None:
        # 0440 like the TLS Secret: the kubelet makes the files root-owned with the pod's
        # fsGroup as group (a 0400 mode gets the group bits added anyway), so uid 10001 reads
        # them through its fsGroup; no other user of the node can.
        spec["volumes"].append(
            {
                "name": "keys",
                "secret": {
                    "secretName": keys_secret_name(ctx.name, role, index),
                    "defaultMode": 0o440,
                },
            }
        )
    if ctx.at_sites and role in ("server", "kdc"):
        spec["volumes"].append(
            {"name": "revoked-sites", "configMap": {"name": revoked_sites_name(ctx.name)}}
        )
    if placement.node_selector:
        spec["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        spec["tolerations"] = [
            toleration.model_dump(by_alias=True, exclude_none=True)
            for toleration in placement.tolerations
        ]
    if placement.affinity:
        spec["affinity"] = copy.deepcopy(placement.affinity)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _metadata(ctx, name, role_labels(ctx.name, role, index)),
        "spec": spec,
    }
    if role == "client" and index is not None:
        _mount_client_data(ctx, pod, index)
    return apply_pod_template(pod, placement.pod_template)


def _resources(placement: RoleSpec) -> dict[str, dict[str, str]]:
    resources: dict[str, dict[str, str]] = {}
    if placement.resources.requests:
        resources["requests"] = dict(placement.resources.requests)
    if placement.resources.limits:
        resources["limits"] = dict(placement.resources.limits)
    if placement.gpus:
        resources.setdefault("limits", {})["nvidia.com/gpu"] = str(placement.gpus)
    return resources


LOCKED_CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "privileged": False,
}
"""Container security settings a podTemplate cannot change."""
OWNED_POD_FIELDS = ("restartPolicy", "serviceAccountName", "automountServiceAccountToken")
"""Pod fields the operator sets and a podTemplate cannot change: put back from the built pod."""
DROPPED_POD_FIELDS = (
    "hostNetwork",
    "hostPID",
    "hostIPC",
    "nodeName",
    "serviceAccount",
    "ephemeralContainers",
)
"""Pod fields a podTemplate may not set: dropped (host namespaces, a node that bypasses the
scheduler, the deprecated ServiceAccount alias, ephemeral containers)."""
TEMPLATE_VOLUME_KINDS = frozenset(
    {"emptyDir", "ephemeral", "persistentVolumeClaim", "downwardAPI", "csi"}
)
"""Volume kinds a podTemplate may add: those Pod Security ``restricted`` allows, less the
Secret, ConfigMap and projected volumes the operator alone mounts (each role's own)."""
CONFINED_PROFILES = ("RuntimeDefault", "Localhost")
"""seccomp and AppArmor profile types a template may choose (never ``Unconfined``)."""
PROFILE_ANNOTATIONS = (
    "container.apparmor.security.beta.kubernetes.io/",
    "seccomp.security.alpha.kubernetes.io/pod",
    "container.seccomp.security.alpha.kubernetes.io/",
)
"""Annotations that still set AppArmor and seccomp profiles on older clusters."""


def apply_pod_template(pod: Object, template: dict[str, Any]) -> Object:
    """Merges a role's ``podTemplate`` over a built pod, then re-applies its locks.

    Labels and annotations are added (the operator's own labels win), spec fields are set
    (maps merged, lists replaced but for `MERGE_KEYS`' env, volumeMounts and ports, merged by
    key), containers merge by name (unknown names are added as sidecars), volumes are added
    beside the operator's (which keep their names), and then
    ``lock_pod`` takes back whatever would weaken the pod. Validation refuses such templates
    already (``fedcore/spec/_pod_security.py``); this is the second line, for whatever gets
    past it.
    """
    if not template:
        return pod
    merged = copy.deepcopy(pod)
    meta = template.get("metadata") or {}
    for key in ("labels", "annotations"):
        extra = meta.get(key) or {}
        merged["metadata"][key] = {**extra, **merged["metadata"].get(key, {})}
    spec_template = copy.deepcopy(template.get("spec") or {})
    containers = spec_template.pop("containers", None)
    volumes = spec_template.pop("volumes", None)
    merged["spec"] = _merge_maps(merged["spec"], spec_template)
    if containers:
        by_name = {container["name"]: container for container in merged["spec"]["containers"]}
        for override in containers:
            if not isinstance(override, dict):
                continue
            name = override.get("name", CONTAINER)
            if name in by_name:
                by_name[name].update(_merge_maps(by_name[name], override))
            else:
                merged["spec"]["containers"].append(override)
    if isinstance(volumes, list):
        merged["spec"]["volumes"] = [*merged["spec"].get("volumes", []), *volumes]
    return lock_pod(merged, pod)


def lock_pod(pod: Object, built: Object) -> Object:
    """``pod`` (``built`` with a template merged over it) with every lock of ``built`` back.

    Host namespaces, ``nodeName``, the deprecated ``serviceAccount`` and ephemeral containers
    are dropped; the restart policy, ServiceAccount and token mount are the built pod's; the
    pod's securityContext keeps only non-root ids, group settings and confined profiles over
    the built one (no sysctls, SELinux or Windows options); the operator's volumes are its own
    (the ``keys`` of the server, the KDC and a decentralized protocol's client, each its own;
    a template's ``secret`` volume never stays, so no template gives a pod another's key), and
    of the template's only kinds in ``TEMPLATE_VOLUME_KINDS`` under new names stay; every
    container, init container and sidecar alike gets ``_lock_container``; AppArmor and seccomp
    annotations that say ``unconfined`` are dropped. Returns a new object.
    """
    locked = copy.deepcopy(pod)
    spec = locked["spec"]
    base = built["spec"]
    for key in DROPPED_POD_FIELDS:
        spec.pop(key, None)
    for key in OWNED_POD_FIELDS:
        spec[key] = copy.deepcopy(base[key])
    spec["securityContext"] = _pod_security(
        spec.get("securityContext"), base.get("securityContext") or {}
    )
    own_volumes = [copy.deepcopy(volume) for volume in base.get("volumes") or []]
    own_names = {volume["name"] for volume in own_volumes}
    spec["volumes"] = own_volumes + [
        volume
        for volume in spec.get("volumes") or []
        if isinstance(volume, dict)
        and volume.get("name") not in own_names
        and set(volume) - {"name"}
        and set(volume) - {"name"} <= TEMPLATE_VOLUME_KINDS
    ]
    volume_names = {volume["name"] for volume in spec["volumes"]}
    secrets = _secret_names(built)
    built_containers = {container["name"]: container for container in base["containers"]}
    spec["containers"] = [
        _lock_container(
            container, volume_names, secrets, built_containers.get(container.get("name"))
        )
        for container in spec["containers"]
        if isinstance(container, dict)
    ]
    if "initContainers" in spec:
        spec["initContainers"] = [
            _lock_container(container, volume_names, secrets, None)
            for container in spec["initContainers"] or []
            if isinstance(container, dict)
        ]
        if not spec["initContainers"]:
            del spec["initContainers"]
    annotations = locked["metadata"].get("annotations")
    if annotations:
        locked["metadata"]["annotations"] = {
            key: value
            for key, value in annotations.items()
            if not (str(key).startswith(PROFILE_ANNOTATIONS) and value == "unconfined")
        }
    return locked


def _positive_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _confined(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") in CONFINED_PROFILES


def _pod_security(given: Any, built: Object) -> Object:
    """The pod's securityContext: the built one, with only harmless template choices kept."""
    result = copy.deepcopy(built)
    given = given if isinstance(given, dict) else {}
    for key in ("runAsUser", "runAsGroup", "fsGroup"):
        if _positive_id(given.get(key)):
            result[key] = given[key]
    for key in ("seccompProfile", "appArmorProfile"):
        if _confined(given.get(key)):
            result[key] = copy.deepcopy(given[key])
    groups = given.get("supplementalGroups")
    if isinstance(groups, list) and all(_positive_id(group) for group in groups) and groups:
        result["supplementalGroups"] = list(groups)
    if given.get("fsGroupChangePolicy") in ("Always", "OnRootMismatch"):
        result["fsGroupChangePolicy"] = given["fsGroupChangePolicy"]
    result["runAsNonRoot"] = True
    return result


def _container_security(given: Any) -> Object:
    """A container's securityContext: the locks, plus a non-root id or confined profile."""
    given = given if isinstance(given, dict) else {}
    result: Object = {}
    for key in ("runAsUser", "runAsGroup"):
        if _positive_id(given.get(key)):
            result[key] = given[key]
    for key in ("seccompProfile", "appArmorProfile"):
        if _confined(given.get(key)):
            result[key] = copy.deepcopy(given[key])
    result.update(LOCKED_CONTAINER_SECURITY)
    result["capabilities"] = {"drop": ["ALL"]}
    return result


def _secret_names(pod: Object) -> set[str]:
    """Every Secret the (built) pod refers to: its own volumes and environment."""
    spec = pod["spec"]
    names = {
        volume["secret"]["secretName"] for volume in spec.get("volumes") or [] if "secret" in volume
    }
    for container in spec["containers"]:
        for item in container.get("envFrom") or []:
            if "secretRef" in item:
                names.add(item["secretRef"]["name"])
        for item in container.get("env") or []:
            ref = (item.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                names.add(ref["name"])
    return names


def _lock_container(
    container: Object, volumes: set[str], secrets: set[str], built: Object | None
) -> Object:
    """One container with the locks back.

    Its securityContext is ``_container_security``'s; host ports go; environment from a
    Secret the pod does not own goes (the operator hands each pod its own Secrets only: a
    client never gets ``<run>-server-keys``); mounts of volumes the pod does not have go; the
    operator's own container (``built``) keeps its mounts, its key file and termination
    message variables (``OWNED_ENVS``) and its termination message fields, and the template's
    extra mounts may not take their paths.
    """
    locked = dict(container)
    locked["securityContext"] = _container_security(container.get("securityContext"))
    if "ports" in locked:
        locked["ports"] = [
            {key: value for key, value in port.items() if key not in ("hostPort", "hostIP")}
            for port in locked["ports"] or []
            if isinstance(port, dict)
        ]
    if "env" in locked:
        locked["env"] = [
            item
            for item in locked["env"] or []
            if isinstance(item, dict)
            and _ref_name(_mapping(item.get("valueFrom")).get("secretKeyRef"), secrets)
        ]
    if "envFrom" in locked:
        locked["envFrom"] = [
            item
            for item in locked["envFrom"] or []
            if isinstance(item, dict) and _ref_name(item.get("secretRef"), secrets)
        ]
    if built is not None:
        _keep_owned_env(locked, built)
        for key in TERMINATION_FIELDS:
            locked[key] = built[key]
    mounts = [
        mount
        for mount in locked.get("volumeMounts") or []
        if isinstance(mount, dict) and mount.get("name") in volumes
    ]
    if built is not None:
        own = [copy.deepcopy(mount) for mount in built.get("volumeMounts") or []]
        paths = {mount["mountPath"] for mount in own}
        mounts = own + [mount for mount in mounts if mount.get("mountPath") not in paths]
    if mounts or "volumeMounts" in locked:
        locked["volumeMounts"] = mounts
    if "volumeDevices" in locked:
        locked["volumeDevices"] = [
            device
            for device in locked["volumeDevices"] or []
            if isinstance(device, dict) and device.get("name") in volumes
        ]
    return locked


def _keep_owned_env(container: Object, built: Object) -> None:
    """Puts the built container's ``OWNED_ENVS`` back (in place, or appended), so that a
    template's ``env`` cannot point the role at a key in its work ``emptyDir`` instead (a new
    key per pod, which would leave a recreated pod unable to read the run's checkpoints), nor
    have it write its termination message over one of its files."""
    own = {item["name"]: item for item in built.get("env") or [] if item.get("name") in OWNED_ENVS}
    if not own:
        return
    env = [
        copy.deepcopy(own[item["name"]]) if item.get("name") in own else item
        for item in container.get("env") or []
    ]
    present = {item.get("name") for item in env}
    env += [copy.deepcopy(item) for name, item in own.items() if name not in present]
    container["env"] = env


def _ref_name(ref: Any, allowed: set[str]) -> bool:
    """True when ``ref`` is absent or names a Secret in ``allowed``."""
    return ref is None or (isinstance(ref, dict) and ref.get("name") in allowed)


def _mapping(value: Any) -> Object:
    return value if isinstance(value, dict) else {}


MERGE_KEYS = {"env": "name", "volumeMounts": "mountPath", "ports": "containerPort"}
"""Lists a template merges into by an entry's key, as kubectl's strategic merge does: an entry
with a key the built list has replaces that entry, others are added."""


def _merge_maps(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    result = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = _merge_maps(result[key], value)
        elif key in MERGE_KEYS and isinstance(value, list) and isinstance(result.get(key), list):
            result[key] = _merge_by_key(result[key], value, MERGE_KEYS[key])
        else:
            result[key] = copy.deepcopy(value)
    return result


def _merge_by_key(base: list[Any], override: list[Any], key: str) -> list[Any]:
    """``base`` with each entry of ``override`` replacing the one with its ``key``, or added."""
    merged = [copy.deepcopy(entry) for entry in base]
    index = {entry.get(key): i for i, entry in enumerate(merged) if isinstance(entry, dict)}
    for entry in override:
        if isinstance(entry, dict) and entry.get(key) in index:
            merged[index[entry[key]]] = copy.deepcopy(entry)
        else:
            merged.append(copy.deepcopy(entry))
    return merged


def static_objects(ctx: RunContext) -> list[Object]:
    """Every owned object but the Secrets and the pods, in the order they are created."""
    return [
        manifest_config_map(ctx),
        *service_accounts(ctx),
        server_status_role(ctx),
        server_status_role_binding(ctx),
        *services(ctx),
        *network_policies(ctx),
    ]


def run_resource_path(namespace: str, name: str) -> str:
    """The API path of a FederatedRun."""
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"

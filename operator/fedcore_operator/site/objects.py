"""The objects a site's operator makes in the site's cluster for one Participation.

Every object is named after the Participation (``<participation>-client-<i>`` and so on),
owned by it (deleted with it), and labelled with ``fedcore.dev/participation``, never with
the run label: a FederatedRun's operator in the same cluster never takes a site's pods for
its own. The client pods are built by the run operator's own ``objects.client_pod`` (the same
locked pod security, data mounts and podTemplate rules) from the hub's run bound to the
site's data, then re-pointed: at the hub's endpoint for the server and KDC, at the site's
binding (approval, data, floor), and at the certificate the hub signed for the key made here.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from fedcore.sites.binding import BINDING_FILE, SiteBinding
from fedcore.sites.participation import ParticipationSpec
from fedcore.spec import FederatedRun
from fedcore.spec._roles import RoleSpec
from fedcore_operator import objects
from fedcore_operator.crd import GROUP, VERSION
from fedcore_operator.settings import ANYWHERE, OperatorSettings

Object = dict[str, Any]
PARTICIPATION_LABEL = "fedcore.dev/participation"
SITE_DIR = "/etc/fedcore/site"
CLIENT_ROLE = "client"


@dataclass(frozen=True)
class SiteContext:
    """One Participation as the site's operator sees it, with the hub's run it approves.

    Attributes:
        name, namespace, uid: the Participation's.
        spec: its validated spec.
        site: the site's name at the hub.
        hub: the hub endpoint's ``host:port``, which the client pods dial.
        run: the hub's run, as the hub's manifest says.
        manifest: the hub's manifest text, unchanged (its digest is what was approved).
        settings: the operator's settings (default image, ports, DNS and scraper peers).
        relay_from: NetworkPolicy peers of the site's operator, which splices the hub's
            relays to the client pods' peer port (decentralized protocols).
    """

    name: str
    namespace: str
    uid: str
    spec: ParticipationSpec
    site: str
    hub: str
    run: FederatedRun
    manifest: str
    settings: OperatorSettings
    relay_from: tuple[Object, ...] = ()

    @property
    def clients(self) -> range:
        """The run's client indices at this site."""
        return self.run.spec.site_clients(self.site)

    @property
    def image(self) -> str:
        """The image the client pods run: the hub's choice, else the operator's own."""
        return self.run.spec.roles.clients.image or self.settings.image

    def binding(self, digest: str) -> SiteBinding:
        """The site's binding of the run its clients read (``--site-binding``)."""
        return SiteBinding(site=self.site, digest=digest, approval=self.spec.approval())

    def run_context(self, digest: str) -> objects.RunContext:
        """The run as the site's pods see it: bound to the site's data, named after the
        Participation, its client placement the site's own."""
        run = self.binding(digest).bind(self.run)
        pods = self.spec.pods
        placement = RoleSpec(
            resources=pods.resources,
            gpus=pods.gpus,
            node_selector=pods.node_selector,
            tolerations=pods.tolerations,
            image=self.image,
        )
        roles = run.spec.roles.model_copy(update={"clients": placement})
        spec = run.spec.model_copy(update={"roles": roles})
        metadata = run.metadata.model_copy(update={"name": self.name})
        run = run.model_copy(update={"spec": spec, "metadata": metadata})
        return objects.RunContext(
            run=run, namespace=self.namespace, uid=self.uid, settings=self.settings
        )


# ------------------------------------------------------------------------------------ names


def client_pod_name(participation: str, index: int) -> str:
    """``<participation>-client-<index>`` (the run's global client index)."""
    return objects.pod_name(participation, CLIENT_ROLE, index)


def client_tls_name(participation: str, index: int) -> str:
    """The Secret with client ``index``'s key (made here), certificate and the run's CA."""
    return objects.tls_secret_name(client_pod_name(participation, index))


def binding_name(participation: str) -> str:
    """The Secret with the site's binding (it names the site's data locations)."""
    return f"{participation}-site-binding"


def labels(participation: str, index: int | None = None) -> dict[str, str]:
    """The labels of a Participation's objects (``index``: a client's)."""
    found = {
        "app.kubernetes.io/managed-by": objects.MANAGED_BY,
        PARTICIPATION_LABEL: participation,
        objects.ROLE_LABEL: CLIENT_ROLE,
    }
    if index is not None:
        found[objects.INDEX_LABEL] = str(index)
    return found


def selector(participation: str) -> str:
    """The label selector of every object of a Participation."""
    return f"{PARTICIPATION_LABEL}={participation}"


def owner_reference(ctx: SiteContext) -> Object:
    """The owner reference that hands an object to the Participation's garbage collection."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Participation",
        "name": ctx.name,
        "uid": ctx.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(ctx: SiteContext, name: str, index: int | None = None) -> Object:
    return {
        "name": name,
        "namespace": ctx.namespace,
        "labels": labels(ctx.name, index),
        "ownerReferences": [owner_reference(ctx)],
    }


# ---------------------------------------------------------------------------------- objects


def manifest_config_map(ctx: SiteContext) -> Object:
    """The hub's manifest, as the hub sent it (every client checks its digest)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(ctx, objects.manifest_name(ctx.name)),
        "data": {objects.MANIFEST_FILE: ctx.manifest},
    }


def binding_secret(ctx: SiteContext, digest: str) -> Object:
    """The site's binding: the approval, the spec digest, the site's data locations."""
    binding = ctx.binding(digest)
    document = {
        "site": binding.site,
        "digest": binding.digest,
        "approval": binding.approval.model_dump(mode="json", by_alias=True, exclude_none=True),
    }
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(ctx, binding_name(ctx.name)),
        "stringData": {BINDING_FILE: json.dumps(document, indent=1)},
    }


def service_account(ctx: SiteContext) -> Object:
    """The client pods' ServiceAccount, its token never mounted."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(ctx, objects.service_account_name(ctx.name, CLIENT_ROLE)),
        "automountServiceAccountToken": False,
    }


def client_tls_secret(
    ctx: SiteContext, index: int, *, key_pem: bytes, cert_pem: bytes, run_ca_pem: bytes
) -> Object:
    """Client ``index``'s key (made by this operator), its certificate signed by the hub,
    and the run's CA certificate."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": _metadata(ctx, client_tls_name(ctx.name, index), index),
        "stringData": {
            "ca.crt": run_ca_pem.decode(),
            "tls.crt": cert_pem.decode(),
            "tls.key": key_pem.decode(),
        },
    }


def client_keys_name(participation: str, index: int) -> str:
    """The Secret with client ``index``'s own checkpoint key (a decentralized protocol's),
    drawn here: the hub never sees it."""
    return objects.keys_secret_name(participation, CLIENT_ROLE, index)


def client_keys_secret(ctx: SiteContext, index: int, key_hex: str) -> Object:
    """Client ``index``'s checkpoint key Secret (``key_hex``: 64 lowercase hex digits drawn by
    the caller), mounted into that client's pod alone (``objects.client_pod``).

    Raises:
        ValueError: ``key_hex`` is not 64 lowercase hex digits.
    """
    file_name, _ = objects.ROLE_KEYS[CLIENT_ROLE]
    return objects.key_secret_object(
        _metadata(ctx, client_keys_name(ctx.name, index), index), file_name, key_hex
    )


def client_pod(ctx: SiteContext, index: int, digest: str) -> Object:
    """Client ``index``'s pod: the run operator's client pod, pointed at the hub."""
    pod = objects.client_pod(ctx.run_context(digest), index)
    pod["metadata"]["labels"] = labels(ctx.name, index)
    pod["metadata"]["ownerReferences"] = [owner_reference(ctx)]
    spec = pod["spec"]
    spec.pop("subdomain", None)  # no headless Service: peers are not reached in the cluster
    container = spec["containers"][0]
    run_ctx = ctx.run_context(digest)
    hub_links = {"FEDCORE_SERVER": ctx.hub}
    if run_ctx.needs_kdc:
        hub_links["FEDCORE_KDC"] = ctx.hub
    if run_ctx.decentralized:
        # Every peer is dialled at the hub, which relays by the peer's name (its TLS server
        # name) to the peer's site: through this site's operator when the peer is here.
        hub_links["FEDCORE_PEER_TEMPLATE"] = ctx.hub
    container["env"] = [
        {"name": item["name"], "value": hub_links[item["name"]]}
        if item["name"] in hub_links
        else item
        for item in container["env"]
    ]
    container["env"].append({"name": "FEDCORE_SITE_BINDING", "value": f"{SITE_DIR}/{BINDING_FILE}"})
    container["volumeMounts"].append({"name": "site", "mountPath": SITE_DIR, "readOnly": True})
    spec["volumes"].append(
        {"name": "site", "secret": {"secretName": binding_name(ctx.name), "defaultMode": 0o440}}
    )
    return pod


def network_policy(ctx: SiteContext, hub_addresses: list[str], digest: str) -> Object:
    """The client pods may reach only the hub's endpoint (its addresses as resolved, or the
    chart's ``hubCidrs``), the cluster DNS and the S3 endpoints of the site's data; they
    serve /metrics to the chart's scraper only, and their peer port (decentralized
    protocols) to the site's operator only. No ingress from anywhere else."""
    settings = ctx.settings
    port = int(ctx.hub.rsplit(":", 1)[1])
    run_ctx = ctx.run_context(digest)
    egress: list[Object] = [
        {
            "to": [copy.deepcopy(peer) for peer in settings.dns_to],
            "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
        },
        {
            # No address known is any address (on the hub's port only), never "no rule".
            "to": [{"ipBlock": {"cidr": cidr}} for cidr in hub_addresses or ANYWHERE],
            "ports": [{"protocol": "TCP", "port": port}],
        },
        *objects._client_data_egress(run_ctx),
    ]
    ingress: list[Object] = (
        [
            {
                "from": [copy.deepcopy(peer) for peer in settings.metrics_from],
                "ports": [{"protocol": "TCP", "port": settings.metrics_port}],
            }
        ]
        if settings.metrics_from
        else []
    )
    if run_ctx.decentralized and ctx.relay_from:
        ingress.append(
            {
                "from": [copy.deepcopy(peer) for peer in ctx.relay_from],
                "ports": [{"protocol": "TCP", "port": settings.peer_port}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(ctx, f"{ctx.name}-clients"),
        "spec": {
            "podSelector": {"matchLabels": {PARTICIPATION_LABEL: ctx.name}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": egress,
        },
    }

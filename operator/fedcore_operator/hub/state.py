"""The hub's own state on Kubernetes: its registry kept in a Secret, its sites from the chart.

A hub outside Kubernetes keeps its CA and sites in a folder (``fedcore.sites._registry``).
The operator in mode hub keeps the same folder in a private temporary directory and mirrors
it into the Secret ``fedcore-hub`` of its own namespace: loaded from there at start, saved
there after every change (an enrollment, a renewal, a revocation) before the change is
answered, so a restarted operator knows every site and certificate it knew. Nothing of it is
ever logged.

The sites themselves are the hub admin's, declared in the chart's values (``hub.sites``,
``hub.revokedSites``), which the chart writes into the ConfigMap ``fedcore-hub-sites``. Each
pass of :func:`sync_sites` adds a listed site that the registry does not know, with its
one-time join token in the Secret ``fedcore-hub-join-<site>`` (keys ``token``,
``fingerprint``, ``expires``: what the site's admin needs, handed over out of band), gives a
new token to a site whose token expired unused once its admin deletes that Secret, and
revokes every site listed as revoked (for good: a revoked name stays revoked).
"""

from __future__ import annotations

import base64
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedcore.sites._registry import EnrollmentRefused, HubRegistry
from fedcore_operator.kube import Kube

log = logging.getLogger(__name__)

Object = dict[str, Any]
HUB_SECRET = "fedcore-hub"
"""The Secret (operator's namespace) that holds the hub's registry: its CA key among it."""
SITES_CONFIG_MAP = "fedcore-hub-sites"
"""The ConfigMap (operator's namespace, written by the chart) that lists the hub's sites."""
JOIN_SECRET_PREFIX = "fedcore-hub-join-"
"""``<prefix><site>``: a site's one-time join token, for the hub admin to hand over."""
_SEPARATOR = "--"
"""Stands for '/' in a Secret key (``ca--ca.key`` is ``ca/ca.key``)."""
_SKIPPED = frozenset({"sites.lock"})


def join_secret_name(site: str) -> str:
    """The Secret that holds ``site``'s join token."""
    return f"{JOIN_SECRET_PREFIX}{site}"


def _labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": "fedcore", "app.kubernetes.io/component": "hub"}


class SecretRegistry:
    """The hub's registry in a private folder, mirrored into the Secret ``fedcore-hub``.

    Args:
        kube: the API access.
        namespace: the operator's namespace.
        folder: where the folder lives while the operator runs (default: a new private
            temporary directory).

    Raises:
        RuntimeError: the Secret cannot be read or written.
    """

    def __init__(self, kube: Kube, namespace: str, folder: Path | None = None) -> None:
        self.kube = kube
        self.namespace = namespace
        self.folder = Path(folder or tempfile.mkdtemp(prefix="fedcore-hub-"))
        secret = kube.get("Secret", namespace, HUB_SECRET)
        self._exists = secret is not None
        if secret is not None:
            self._restore(secret)
        self.registry = HubRegistry(self.folder, on_change=self._save)

    def _restore(self, secret: Object) -> None:
        for key, value in (secret.get("data") or {}).items():
            parts = key.split(_SEPARATOR)
            if any(part in ("", ".", "..") for part in parts):
                raise RuntimeError(f"Secret {self.namespace}/{HUB_SECRET} has a bad key {key!r}.")
            path = self.folder.joinpath(*parts)
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.touch(mode=0o600)
            path.write_bytes(base64.b64decode(value))

    def _save(self, folder: Path) -> None:
        data = {
            _SEPARATOR.join(path.relative_to(folder).parts): base64.b64encode(
                path.read_bytes()
            ).decode()
            for path in sorted(folder.rglob("*"))
            if path.is_file() and path.name not in _SKIPPED
        }
        if self._exists:
            self.kube.patch("Secret", self.namespace, HUB_SECRET, {"data": data})
            return
        created = self.kube.create(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "Opaque",
                "metadata": {"name": HUB_SECRET, "namespace": self.namespace, "labels": _labels()},
                "data": data,
            }
        )
        if created is None:  # made by another operator since: its state would be lost
            raise RuntimeError(
                f"Secret {self.namespace}/{HUB_SECRET} appeared while this operator made the "
                "hub's registry; restart the operator to load it."
            )
        self._exists = True


@dataclass(frozen=True)
class SiteList:
    """The hub admin's sites, as the chart's ConfigMap lists them."""

    sites: tuple[str, ...] = ()
    revoked: tuple[str, ...] = ()

    @classmethod
    def from_config_map(cls, config_map: Object | None) -> SiteList:
        """Reads the keys ``sites`` and ``revoked`` (names separated by blanks or commas)."""
        data = (config_map or {}).get("data") or {}

        def names(key: str) -> tuple[str, ...]:
            text = str(data.get(key) or "").replace(",", " ")
            return tuple(dict.fromkeys(name for name in text.split() if name))

        return cls(sites=names("sites"), revoked=names("revoked"))


def sync_sites(kube: Kube, registry: HubRegistry, namespace: str) -> list[str]:
    """Brings the registry to the sites the chart lists; returns what it did, for the log.

    A listed site the registry does not know is added, and one whose token expired unused
    gets a new one once its join Secret is gone; each new token goes into the site's join
    Secret. A site listed as revoked is revoked. A site that is no longer listed is left as
    it is (list it under ``revoked`` to shut it out). A name that is not a site name is
    skipped with a warning.
    """
    wanted = SiteList.from_config_map(kube.get("ConfigMap", namespace, SITES_CONFIG_MAP))
    known = {site["name"]: site["state"] for site in registry.sites()}
    done: list[str] = []
    for name in wanted.sites:
        if name in wanted.revoked or known.get(name) in ("Enrolled", "Revoked"):
            continue
        secret = join_secret_name(name)
        if name in known and kube.get("Secret", namespace, secret) is not None:
            continue  # invited; once its token expired, deleting the Secret gives a new one
        try:
            token = registry.add_site(name)
        except EnrollmentRefused as exc:
            log.warning("The hub's site list names %r, which cannot be added: %s", name, exc)
            continue
        string_data = {
            "token": token.token,
            "fingerprint": token.fingerprint,
            "expires": str(int(token.expires)),
        }
        if kube.create(_join_secret(namespace, name, string_data)) is None:
            kube.patch("Secret", namespace, secret, {"stringData": string_data})
        done.append(f"invited site {name} (join token in Secret {namespace}/{secret})")
    for name in wanted.revoked:
        if known.get(name) not in (None, "Revoked"):
            registry.revoke(name)
            done.append(f"revoked site {name}")
    return done


def _join_secret(namespace: str, site: str, string_data: dict[str, str]) -> Object:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": join_secret_name(site),
            "namespace": namespace,
            "labels": {**_labels(), "fedcore.dev/site": site},
        },
        "stringData": string_data,
    }

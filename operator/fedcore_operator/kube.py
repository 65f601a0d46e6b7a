"""A thin, dict-in dict-out layer over the Kubernetes API for the kinds the operator owns.

The typed clients of the ``kubernetes`` package turn every object into a model class; the
operator builds and compares plain dicts, so it calls the REST paths directly through the
package's ``ApiClient`` (authentication, TLS and retries stay the package's). Every write
goes through here, so the counter of writes per reconcile is exact.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from fedcore_operator.crd import GROUP, PLURAL, VERSION

KIND_PATHS: dict[str, tuple[str, str]] = {
    "Pod": ("/api/v1", "pods"),
    "Secret": ("/api/v1", "secrets"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Service": ("/api/v1", "services"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "FederatedRun": (f"/apis/{GROUP}/{VERSION}", PLURAL),
    "Participation": (f"/apis/{GROUP}/{VERSION}", "participations"),
}
"""API prefix and resource of each kind the operator reads or writes (all namespaced)."""

Object = dict[str, Any]


class Kube:
    """Namespaced get, list, create, patch and delete of plain-dict objects.

    Args:
        api: an authenticated ``kubernetes.client.ApiClient``.
        on_write: called with the verb after every successful write (for metrics).
    """

    def __init__(self, api: ApiClient, on_write: Callable[[str], None] | None = None) -> None:
        self.api = api
        self._on_write = on_write or (lambda verb: None)

    def _path(self, kind: str, namespace: str, name: str | None = None, sub: str = "") -> str:
        prefix, resource = KIND_PATHS[kind]
        path = f"{prefix}/namespaces/{namespace}/{resource}"
        if name is not None:
            path += f"/{name}"
        if sub:
            path += f"/{sub}"
        return path

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        return request(self.api, method, path, body=body, query=query, content_type=content_type)

    def get(self, kind: str, namespace: str, name: str) -> Object | None:
        """Returns the object, or None when it does not exist."""
        try:
            result: Object = self._call("GET", self._path(kind, namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return result

    def list(self, kind: str, namespace: str, labels: str) -> list[Object]:
        """Returns every object of ``kind`` in ``namespace`` matching the label selector
        (empty: all)."""
        result = self._call("GET", self._path(kind, namespace), query=[("labelSelector", labels)])
        return list(result.get("items") or [])

    def create(self, obj: Object) -> Object | None:
        """Creates ``obj``; returns None when an object of that name already exists."""
        namespace = obj["metadata"]["namespace"]
        try:
            result: Object = self._call("POST", self._path(obj["kind"], namespace), body=obj)
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise
        self._on_write("create")
        return result

    def patch(self, kind: str, namespace: str, name: str, patch: Object, sub: str = "") -> Object:
        """Applies a JSON merge patch (to a subresource such as ``status`` when given)."""
        result: Object = self._call(
            "PATCH",
            self._path(kind, namespace, name, sub),
            body=patch,
            content_type="application/merge-patch+json",
        )
        self._on_write("patch")
        return result

    def delete(
        self,
        kind: str,
        namespace: str,
        name: str,
        grace_seconds: int | None = None,
        *,
        uid: str | None = None,
    ) -> bool:
        """Deletes the object in the background; returns False when it was already gone.

        With ``uid``, only that very object: one made again under the same name is kept
        (returns False).
        """
        body: Object = {"propagationPolicy": "Background"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            self._call("DELETE", self._path(kind, namespace, name), body=body)
        except ApiException as exc:
            if exc.status == 404 or (exc.status == 409 and uid is not None):
                return False
            raise
        self._on_write("delete")
        return True


def request(
    api: ApiClient,
    method: str,
    path: str,
    *,
    body: Any = None,
    query: list[tuple[str, str]] | None = None,
    content_type: str = "application/json",
) -> Any:
    """One authenticated REST call; returns the decoded JSON body (None when empty).

    Raises:
        ApiException: the API server answered with a status outside 2xx.
    """
    method, url, headers, payload, _ = api.param_serialize(
        method=method,
        resource_path=path,
        query_params=query or [],
        header_params={"Accept": "application/json", "Content-Type": content_type},
        body=body,
        auth_settings=["BearerToken"],
    )
    response = api.call_api(method, url, header_params=headers, body=payload)
    response.read()
    if not 200 <= response.status < 300:
        raise ApiException(http_resp=response)
    raw = response.data
    return json.loads(raw) if raw else None

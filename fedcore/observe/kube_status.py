"""The server's progress, written into its FederatedRun's status on Kubernetes.

When the operator starts a server pod it sets ``FEDCORE_STATUS_RUN`` and
``FEDCORE_STATUS_NAMESPACE``; the server then patches ``status.round``, ``progress``,
``privacy``, ``lastCheckpoint``, ``finalMetrics`` and ``outcome`` of that one run with the pod's
ServiceAccount token (its Role allows nothing else). Patches go out from a background thread,
coalesced, so a slow API server never slows a round; the last one is flushed before the
process exits. Locally (no such variables) nothing is reported.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from pathlib import Path
from typing import Any

from fedcore.spec import API_VERSION, FederatedRun

log = logging.getLogger(__name__)

SERVICEACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
RETRIABLE_REASONS = frozenset({"Interrupted", "QuorumLost", "CheckpointFailed", "PeerLost"})
"""Failures a recreated server pod may get past; any other failure ends the run. PeerLost (a
decentralized run lost a client): the operator restarts every pod of the run, each from its own
checkpoint; not where the clients are at sites, whose pods it cannot restart."""
FLUSH_SECONDS = 10.0


def status_listeners(run: FederatedRun) -> list[StatusReporter]:
    """A reporter for the run when the operator asked for one (``FEDCORE_STATUS_RUN``)."""
    name = os.environ.get("FEDCORE_STATUS_RUN")
    if not name:
        return []
    namespace = os.environ.get("FEDCORE_STATUS_NAMESPACE") or run.metadata.namespace or "default"
    return [StatusReporter(run, namespace, name)]


def status_patch(run: FederatedRun, event: dict[str, Any]) -> dict[str, Any]:
    """The status fields one server event sets ({} for events that set none)."""
    kind = event.get("event")
    rounds = run.spec.rounds
    privacy = run.spec.privacy
    when = datetime.datetime.fromtimestamp(event.get("time", 0.0), datetime.UTC)
    stamp = when.strftime("%Y-%m-%dT%H:%M:%SZ")
    patch: dict[str, Any] = {}
    if kind in ("ready", "resumed"):
        done = int(event.get("start_round", 1)) - 1 if kind == "ready" else int(event["round"])
        patch = {"round": done, "rounds": rounds, "progress": f"{done}/{rounds}"}
        if privacy is not None:
            patch["privacy"] = {
                "delta": privacy.target_delta,
                "targetEpsilon": privacy.target_epsilon,
            }
        if event.get("adjacency") is not None:
            patch.setdefault("privacy", {}).update(
                {"adjacency": event["adjacency"], "amplification": event.get("amplification")}
            )
    elif kind == "round":
        done = int(event["round"])
        patch = {"round": done, "rounds": rounds, "progress": f"{done}/{rounds}"}
        if event.get("epsilon") is not None:
            patch["privacy"] = {"epsilon": float(event["epsilon"])}
    elif kind == "checkpoint":
        patch = {
            "lastCheckpoint": {
                "round": int(event["round"]),
                "location": str(event["location"]),
                "time": stamp,
            }
        }
    elif kind == "finished":
        patch = {
            "finalMetrics": {
                "accuracy": event.get("accuracy"),
                "loss": event.get("loss"),
                "roundsCompleted": event.get("rounds_completed"),
                **{
                    name: event[key]
                    for key, name in (
                        ("evaluated_examples", "evaluatedExamples"),
                        ("per_class", "perClass"),
                        ("server_accuracy", "serverAccuracy"),
                    )
                    if key in event
                },
            },
            "outcome": {"phase": "Succeeded", "reason": event.get("reason", "RoundsCompleted")},
        }
        if event.get("epsilon") is not None:
            patch["privacy"] = {"epsilon": float(event["epsilon"])}
    elif kind == "failed":
        reason = str(event.get("reason") or "Failed")
        patch = {
            "outcome": {
                "phase": "Failed",
                "reason": reason,
                "message": str(event.get("message") or "")[:1024],
                "retriable": reason in RETRIABLE_REASONS
                and not (reason == "PeerLost" and run.spec.sites is not None),
            }
        }
    return patch


def merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
    """Merges ``patch`` into ``into`` in place, the way a JSON merge patch would."""
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value


class StatusReporter:
    """Patches one run's status from the server's events, from a background thread.

    Args:
        run: the run's manifest (rounds and privacy come from it).
        namespace: the run's namespace.
        name: the run's name.
        api: a ``kubernetes.client.ApiClient``; by default one is built from the pod's
            ServiceAccount (``FEDCORE_SERVICEACCOUNT_DIR``, default the standard mount).
    """

    def __init__(self, run: FederatedRun, namespace: str, name: str, api: Any = None) -> None:
        self.run = run
        self.path = f"/apis/{API_VERSION}/namespaces/{namespace}/federatedruns/{name}/status"
        self._api = api
        self._pending: dict[str, Any] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="status-reporter", daemon=True)
        self._thread.start()

    def __call__(self, event: dict[str, Any]) -> None:
        patch = status_patch(self.run, event)
        if not patch:
            return
        with self._cond:
            merge(self._pending, patch)
            self._cond.notify()

    def close(self) -> None:
        """Sends what is pending (waiting up to ``FLUSH_SECONDS``) and stops the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(FLUSH_SECONDS)
        if self._thread.is_alive():
            log.warning("The final status could not be written within %s s.", FLUSH_SECONDS)

    def _loop(self) -> None:
        failures = 0
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                patch, self._pending = self._pending, {}
                closing = self._closed
            try:
                self._send(patch)
                failures = 0
            except Exception as exc:
                failures += 1
                log.warning("Could not patch the run's status (%s); will retry.", exc)
                with self._cond:
                    merge(patch, self._pending)
                    self._pending = patch
                    self._cond.wait(min(5.0, 0.5 * 2**failures))
                if closing and failures >= 3:
                    return

    def _send(self, patch: dict[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        api = self._client()
        method, url, headers, payload, _ = api.param_serialize(
            method="PATCH",
            resource_path=self.path,
            header_params={
                "Content-Type": "application/merge-patch+json",
                "Accept": "application/json",
            },
            body={"status": patch},
            auth_settings=["BearerToken"],
        )
        response = api.call_api(method, url, header_params=headers, body=payload)
        response.read()
        if not 200 <= response.status < 300:
            raise ApiException(http_resp=response)

    def _client(self) -> Any:
        if self._api is None:
            from kubernetes import client

            configuration = client.Configuration()
            load_in_cluster(configuration)
            self._api = client.ApiClient(configuration)
        return self._api


def load_in_cluster(configuration: Any = None) -> None:
    """Loads the pod's ServiceAccount credentials into ``configuration`` (None: the default).

    The folder is ``FEDCORE_SERVICEACCOUNT_DIR`` when set (the test kubelet's stand-in for the
    mount), else the standard ``/var/run/secrets/kubernetes.io/serviceaccount``.
    """
    from kubernetes import config

    folder = Path(os.environ.get("FEDCORE_SERVICEACCOUNT_DIR", SERVICEACCOUNT_DIR))
    loader = config.incluster_config.InClusterConfigLoader(
        token_filename=str(folder / "token"), cert_filename=str(folder / "ca.crt")
    )
    if configuration is None:
        loader.load_and_set()
    else:
        loader.load_and_set(configuration)

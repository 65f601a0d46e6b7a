"""Leader election through a coordination.k8s.io Lease, so two replicas never reconcile at once.

It uses the ``kubernetes`` package's LeaderElection and LeaseLock in a daemon thread: the
replica that holds the Lease runs the operator; when renewing fails it stops the operator
(the process exits and its Deployment starts it again as a follower). A graceful stop
releases the Lease, so a follower takes over at its next try instead of after the Lease
expires.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

log = logging.getLogger(__name__)


class _ReleasableLeaseLock(LeaseLock):
    """A LeaseLock that stops writing once released, so renewals cannot recreate it."""

    released = False

    def create(self, name: str, namespace: str, election_record: Any) -> bool:
        if self.released:
            return False
        return bool(super().create(name, namespace, election_record))

    def update(self, name: str, namespace: str, updated_record: Any) -> bool:
        if self.released:
            return False
        return bool(super().update(name, namespace, updated_record))


class LeaseElector:
    """Campaigns for the Lease ``namespace/name`` as ``identity``.

    Args:
        on_lost: called once when this replica stops being the leader.
        lease_seconds, renew_seconds, retry_seconds: the Lease timings (as in client-go).
    """

    def __init__(
        self,
        name: str,
        namespace: str,
        identity: str,
        *,
        on_lost: Callable[[], None],
        lease_seconds: int = 15,
        renew_seconds: int = 10,
        retry_seconds: int = 2,
    ) -> None:
        self.identity = identity
        self.leading = threading.Event()
        self._on_lost = on_lost
        self._lock = _ReleasableLeaseLock(name, namespace, identity)
        config = electionconfig.Config(
            self._lock,
            lease_duration=lease_seconds,
            renew_deadline=renew_seconds,
            retry_period=retry_seconds,
            onstarted_leading=self._started,
            onstopped_leading=self._stopped,
        )
        self._election = leaderelection.LeaderElection(config)
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)

    def start(self) -> None:
        """Starts campaigning in the background."""
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until this replica leads (True) or ``timeout`` passes (False)."""
        return self.leading.wait(timeout)

    def release(self) -> None:
        """Stops renewing and deletes the Lease if this replica still holds it."""
        lock = self._lock
        lock.released = True
        self.leading.clear()
        try:
            lease = lock.api_instance.read_namespaced_lease(lock.name, lock.namespace)
            meta = lease.metadata
            if lease.spec is None or meta is None or lease.spec.holder_identity != self.identity:
                return
            lock.api_instance.delete_namespaced_lease(
                lock.name,
                lock.namespace,
                body=client.V1DeleteOptions(
                    preconditions=client.V1Preconditions(
                        uid=meta.uid, resource_version=meta.resource_version
                    )
                ),
            )
            log.info("%s released the leader Lease.", self.identity)
        except ApiException as exc:
            log.warning("Could not release the leader Lease: %s", exc.reason)

    def _run(self) -> None:
        try:
            self._election.run()
        except Exception:
            log.exception("Leader election failed.")
            self._stopped()

    def _started(self) -> None:
        log.info("%s holds the leader Lease; reconciling.", self.identity)
        self.leading.set()

    def _stopped(self) -> None:
        if self._lock.released:
            return
        if self.leading.is_set():
            log.warning("%s lost the leader Lease; stopping.", self.identity)
        self.leading.clear()
        self._on_lost()

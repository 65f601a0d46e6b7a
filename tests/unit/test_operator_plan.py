"""The operator's pure plan: one table of situations, each with exactly what a pass does.

No API server: each situation is an observation (the run, its pods and other objects, the
time) and the exact steps, phase, reason and conditions ``plan`` must give for it.
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from fedcore.errors import CheckpointInvalid
from fedcore.spec import parse_manifest
from fedcore_operator import objects
from fedcore_operator.plan import (
    STATIC_KINDS,
    CreateObjects,
    DeletePod,
    IssueCertificates,
    IssueKeys,
    MoveCa,
    Note,
    Observed,
    PatchObject,
    Plan,
    Step,
    kinds_to_observe,
    orphaned_ca_secrets,
    plan,
)
from fedcore_operator.settings import OperatorSettings

Object = dict[str, Any]
NOW = datetime.datetime(2025, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
SETTINGS = OperatorSettings()  # finish_grace_seconds 30


def stamp(seconds_ago: float = 0) -> str:
    """``NOW`` minus ``seconds_ago`` as Kubernetes writes it."""
    return (NOW - datetime.timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------- observations


def run_body(protocol: str = "fedavg", status: Object | None = None, **spec: Any) -> Object:
    """A stored FederatedRun ``team-a/demo`` with three clients."""
    body: Object = {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "FederatedRun",
        "metadata": {"name": "demo", "namespace": "team-a", "uid": "uid-1", "generation": 1},
        "spec": {"protocol": {"name": protocol}, "clients": {"count": 3}, "rounds": 2},
    }
    if protocol == "mpdp":
        body["spec"].update(
            {
                "model": {"kind": "MLP", "hidden": [16], "bias": False, "dtype": "float64"},
                "training": {"loss": "MSE", "localEpochs": 1, "batchSize": 100000},
            }
        )
    body["spec"].update(spec)
    if status is not None:
        body["status"] = status
    return body


def context(body: Object) -> objects.RunContext:
    meta = body["metadata"]
    manifest = parse_manifest(
        {**body, "metadata": {"name": meta["name"], "namespace": meta["namespace"]}}
    )
    return objects.RunContext(manifest, meta["namespace"], meta["uid"], SETTINGS)


def owned(body: Object) -> dict[str, list[Object]]:
    """Every Secret and static object of the run, as a pass after the first lists them (the
    run's CA is not among them: it lives in the operator's namespace)."""
    ctx = context(body)
    secrets: list[Object] = [
        {"kind": "Secret", "metadata": {"name": objects.tls_secret_name(pod)}, "data": CA_DATA}
        for pod, _, _ in objects.pod_identities(ctx)
    ]
    secrets += [keys_listed(ctx, holder) for holder in objects.key_roles(ctx)]
    listed: dict[str, list[Object]] = {"Secret": secrets}
    for obj in objects.static_objects(ctx):
        listed.setdefault(obj["kind"], []).append(copy.deepcopy(obj))
    return listed


def keys_listed(ctx: objects.RunContext, holder: objects.KeyHolder) -> Object:
    """A pod's key Secret as the API server lists it (base64 data, no stringData)."""
    role, index = holder
    secret = objects.keys_secret(ctx, role, "ab" * 32, index)
    data = {name: "YWJhYg==" for name in secret.pop("stringData")}
    return {**secret, "data": data}


def without_secret(observed: Observed, name: str) -> Observed:
    """``observed`` with the Secret ``name`` no longer listed."""
    listed = {kind: list(items) for kind, items in observed.owned.items()}
    listed["Secret"] = [item for item in listed["Secret"] if item["metadata"]["name"] != name]
    return replace(observed, owned=listed)


CA_DATA = {"ca.crt": "Q0EgY2VydA=="}
"""The ``ca.crt`` every issued pod Secret of run ``demo`` carries (base64, as listed)."""


def legacy_ca(*, owner: str = "uid-1", ca_crt: str = "Q0EgY2VydA==") -> Object:
    """``demo-ca`` in the run's namespace, as an operator before issue 19 left it."""
    return {
        "kind": "Secret",
        "metadata": {
            "name": "demo-ca",
            "uid": "secret-uid",
            "labels": objects.run_labels("demo"),
            "ownerReferences": [{"kind": "FederatedRun", "name": "demo", "uid": owner}],
        },
        "data": {"ca.crt": ca_crt, "ca.key": "a2V5"},
    }


def with_secret(observed: Observed, secret: Object) -> Observed:
    """``observed`` with one more Secret listed in the run's namespace."""
    listed = {kind: list(items) for kind, items in observed.owned.items()}
    listed.setdefault("Secret", []).append(secret)
    return replace(observed, owned=listed)


def pod(
    name: str,
    phase: str = "Running",
    *,
    ready: bool | None = None,
    exit_code: int | None = None,
) -> Object:
    """A listed pod of run ``demo``: ``name`` is ``server``, ``kdc`` or ``client-<i>``."""
    role = name.split("-")[0]
    index = int(name.split("-")[1]) if role == "client" else None
    ready = phase == "Running" if ready is None else ready
    status: Object = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if exit_code is not None:
        status["containerStatuses"] = [
            {"state": {"terminated": {"exitCode": exit_code, "reason": "Error"}}}
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"demo-{name}",
            "namespace": "team-a",
            "labels": objects.role_labels("demo", role, index),
        },
        "status": status,
    }


def observe(
    body: Object,
    pods: list[Object] | None = None,
    *,
    fresh: bool = False,
    at: float = 0,
) -> Observed:
    """What a pass sees ``at`` seconds after ``NOW``; ``fresh``: nothing owned exists yet."""
    return Observed(
        body=body,
        now=NOW + datetime.timedelta(seconds=at),
        settings=SETTINGS,
        pods=pods or [],
        owned={} if fresh else owned(body),
    )


def settled(observed: Observed) -> Observed:
    """``observed`` whose run already carries the status a pass over it writes."""
    body = copy.deepcopy(observed.body)
    body["status"] = {**body.get("status", {}), **plan(observed).status}
    return replace(observed, body=body)


ALL_CLIENTS = ["client-0", "client-1", "client-2"]


def running(*names: str) -> list[Object]:
    return [pod(name) for name in names]


# ------------------------------------------------------------------------------- summaries


def summary(steps: tuple[Step, ...]) -> list[tuple[Any, ...]]:
    """Each step as a short tuple: what it touches by kind/name, with pods' resume flag."""

    def named(obj: Object) -> str:
        text = f"{obj['kind']}/{obj['metadata']['name']}"
        annotations = obj["metadata"].get("annotations") or {}
        if annotations.get(objects.RESUME_ANNOTATION) == "true":
            text += " (resume)"
        return text

    result: list[tuple[Any, ...]] = []
    for step in steps:
        if isinstance(step, CreateObjects):
            result.append(("create", *map(named, step.objects)))
        elif isinstance(step, PatchObject):
            result.append(("patch", f"{step.kind}/{step.name}", step.patch))
        elif isinstance(step, DeletePod):
            result.append(("delete", f"Pod/{step.name}", step.grace))
        elif isinstance(step, IssueCertificates):
            result.append(("issue", *(pod for pod, _, _ in step.identities)))
        elif isinstance(step, IssueKeys):
            result.append(("keys", *(objects.keys_secret_name("demo", *h) for h in step.roles)))
        elif isinstance(step, MoveCa):
            result.append(("move CA", f"Secret/{step.legacy['metadata']['name']}"))
        elif isinstance(step, Note):
            result.append(("warn" if step.warning else "note", step.text))
    return result


def conditions_of(status: Object) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status.get("conditions") or []}


def one_by_one(*names: str) -> list[tuple[Any, ...]]:
    return [("create", name) for name in names]


STATIC_FEDAVG = one_by_one(
    "ConfigMap/demo-manifest",
    "ServiceAccount/demo-server",
    "ServiceAccount/demo-client",
    "Role/demo-server-status",
    "RoleBinding/demo-server-status",
    "Service/demo-server",
    "Service/demo-clients",
    "NetworkPolicy/demo-server",
    "NetworkPolicy/demo-client",
)
STATIC_MPDP = one_by_one(
    "ConfigMap/demo-manifest",
    "ServiceAccount/demo-kdc",
    "ServiceAccount/demo-server",
    "ServiceAccount/demo-client",
    "Role/demo-server-status",
    "RoleBinding/demo-server-status",
    "Service/demo-server",
    "Service/demo-kdc",
    "Service/demo-clients",
    "NetworkPolicy/demo-server",
    "NetworkPolicy/demo-kdc",
    "NetworkPolicy/demo-client",
)
CLIENT_PODS = ("Pod/demo-client-0", "Pod/demo-client-1", "Pod/demo-client-2")
WAITING_FOR_SERVER = {
    "Suspended": ("False", "Running"),
    "ServerReady": ("False", "Waiting"),
    "Ready": ("False", "WaitingForServer"),
}
TRAINING = {
    "Suspended": ("False", "Running"),
    "ServerReady": ("True", "PodReady"),
    "ClientsReady": ("True", "QuorumReady"),
    "Ready": ("True", "Training"),
}


def finished(reason: str, *, succeeded: bool) -> dict[str, tuple[str, str]]:
    """The conditions of a run that ended, running until then, with ``reason``."""
    return {
        "Suspended": ("False", "Running"),
        "Ready": ("False", reason),
        "Complete": (str(succeeded), reason),
        "Failed": (str(not succeeded), reason),
    }


def roles(
    kdc: Object | None = None, server: Object | None = None, clients: Object | None = None
) -> Object:
    """status.roles: every count 0 unless given."""

    def counts(desired: int, given: Object | None) -> Object:
        zero = {"desired": desired, "running": 0, "ready": 0, "succeeded": 0, "failed": 0}
        return {**zero, **(given or {})}

    return {
        "kdc": counts(0, kdc),
        "server": counts(1, server),
        "clients": counts(3, clients),
    }


# ------------------------------------------------------------------------------ situations


@dataclass(frozen=True)
class Situation:
    """One observation and exactly what the plan for it must be.

    Attributes:
        observed: the pass's input.
        steps: ``summary`` of the plan's steps.
        phase, reason: the run's phase and reason after the pass.
        conditions: every condition as type -> (status, reason).
        status: further status fields and their exact values (None: the field is unset).
        written: whether the status is patched.
    """

    observed: Observed
    steps: list[tuple[Any, ...]]
    phase: str
    reason: str
    conditions: dict[str, tuple[str, str]]
    status: Object = field(default_factory=dict)
    written: bool = True


def fresh_run() -> Situation:
    return Situation(
        observe(run_body(), fresh=True),
        steps=[
            ("issue", "demo-server", "demo-client-0", "demo-client-1", "demo-client-2"),
            ("keys", "demo-server-keys"),
            *STATIC_FEDAVG,
            ("create", "Pod/demo-server"),
        ],
        phase="Pending",
        reason="WaitingForServer",
        conditions=WAITING_FOR_SERVER,
        status={
            "message": "Waiting for the server pod to be ready.",
            "observedGeneration": 1,
            "rounds": 2,
            "progress": "0/2",
            "restarts": 0,
            "startTime": stamp(),
            "activeSince": stamp(),
            "activeSeconds": 0.0,
            "completionTime": None,
            "roles": roles(),
        },
    )


def fresh_run_with_a_kdc() -> Situation:
    return Situation(
        observe(run_body("mpdp"), fresh=True),
        steps=[
            (
                "issue",
                "demo-kdc",
                "demo-server",
                "demo-client-0",
                "demo-client-1",
                "demo-client-2",
            ),
            ("keys", "demo-kdc-keys", "demo-server-keys"),
            *STATIC_MPDP,
            ("create", "Pod/demo-kdc"),
        ],
        phase="Pending",
        reason="WaitingForKdc",
        conditions={
            "Suspended": ("False", "Running"),
            "KdcReady": ("False", "Waiting"),
            "Ready": ("False", "WaitingForKdc"),
        },
        status={"roles": roles(kdc={"desired": 1})},
    )


def kdc_not_ready() -> Situation:
    before = settled(observe(run_body("mpdp"), fresh=True))
    return Situation(
        observe(before.body, [pod("kdc", "Pending")], at=5),
        steps=[],
        phase="Pending",
        reason="WaitingForKdc",
        conditions={
            "Suspended": ("False", "Running"),
            "KdcReady": ("False", "Waiting"),
            "Ready": ("False", "WaitingForKdc"),
        },
        written=False,
    )


def kdc_ready() -> Situation:
    before = settled(observe(run_body("mpdp"), [pod("kdc", "Pending")]))
    return Situation(
        observe(before.body, running("kdc"), at=5),
        steps=[("create", "Pod/demo-server")],
        phase="Pending",
        reason="WaitingForServer",
        conditions={
            "Suspended": ("False", "Running"),
            "KdcReady": ("True", "PodReady"),
            "ServerReady": ("False", "Waiting"),
            "Ready": ("False", "WaitingForServer"),
        },
        status={"roles": roles(kdc={"desired": 1, "running": 1, "ready": 1})},
    )


def server_ready() -> Situation:
    return Situation(
        observe(run_body(), running("server")),
        steps=[("create", *CLIENT_PODS)],
        phase="Running",
        reason="Training",
        conditions={**TRAINING, "ClientsReady": ("False", "Waiting")},
        status={
            "message": "The server is ready and every client pod exists.",
            "roles": roles(server={"running": 1, "ready": 1}),
        },
    )


def failure(pod_name: str, role: str, code: int, action: str) -> Object:
    """One entry of status.failures, seen now."""
    return {
        "time": stamp(),
        "pod": pod_name,
        "role": role,
        "exitCode": code,
        "reason": "Error",
        "action": action,
    }


def failed_client(protocol: str) -> Callable[[], Situation]:
    """A client pod failed; the protocol's dropout policy (fedavg Skip, mpdp Redo, lppa Fail)
    is the server's business, and the operator recreates the pod within backoffLimit."""

    def situation() -> Situation:
        kdc = ["kdc"] if protocol == "mpdp" else []
        pods = [*running(*kdc, "server", "client-0", "client-2")]
        pods.append(pod("client-1", "Failed", exit_code=137))
        return Situation(
            observe(run_body(protocol, status={"phase": "Running", "restarts": 0}), pods),
            steps=[
                (
                    "warn",
                    "Pod demo-client-1 failed (exit code 137: Error); recreating it "
                    "(1 of spec.backoffLimit 6).",
                ),
                ("delete", "Pod/demo-client-1", 0),
                ("create", "Pod/demo-client-1"),
            ],
            phase="Running",
            reason="Training",
            conditions={
                **({"KdcReady": ("True", "PodReady")} if kdc else {}),
                **TRAINING,
                "ClientsReady": ("False", "Waiting"),
            },
            status={
                "restarts": 1,
                "failures": [failure("demo-client-1", "client", 137, "Recreated")],
                "roles": roles(
                    kdc={"desired": 1, "running": 1, "ready": 1} if kdc else None,
                    server={"running": 1, "ready": 1},
                    clients={"running": 2, "ready": 2, "failed": 1},
                ),
            },
        )

    return situation


def server_restarting(
    observed: Observed, warning: str, deleted: list[str], status: Object
) -> Situation:
    """A pass that warns, deletes these pods (grace 0) and makes the server again with resume,
    then waits for it; one restart counted, ``status`` the rest of the status."""
    return Situation(
        observed,
        steps=[
            ("warn", warning),
            *(("delete", f"Pod/demo-{name}", 0) for name in deleted),
            ("create", "Pod/demo-server (resume)"),
        ],
        phase="Pending",
        reason="WaitingForServer",
        conditions=WAITING_FOR_SERVER,
        status={"restarts": 1, **status},
    )


def failed_peer(*, server_too: bool) -> Callable[[], Situation]:
    """A client pod of a decentralized run (lppa) failed, and with it (``server_too``) the
    server, which said PeerLost, retriable: no pod is replaced alone; every pod of the run is
    deleted, one restart counted, and the server made again with resume (the clients follow
    once it is ready, each restoring its own checkpoint)."""

    def situation() -> Situation:
        status: Object = {"phase": "Running", "restarts": 0}
        pods = [*running("client-0", "client-2"), pod("client-1", "Failed", exit_code=137)]
        if server_too:
            status["outcome"] = {
                "phase": "Failed",
                "reason": "PeerLost",
                "message": "Round 2 lost client 1.",
                "retriable": True,
            }
            pods.insert(0, pod("server", "Failed", exit_code=1))
        else:
            pods.insert(0, pod("server"))
        failures = [failure("demo-client-1", "client", 137, "Recreated")]
        if server_too:
            failures.insert(0, failure("demo-server", "server", 1, "Recreated"))
        first = "server" if server_too else "client-1"
        code = 1 if server_too else 137
        return server_restarting(
            observe(run_body("lppa", status=status), pods),
            (
                f"Pod demo-{first} failed (exit code {code}: Error); protocol 'lppa' runs on a "
                "fixed peer graph, so every pod of the run starts again from its checkpoint "
                "(1 of spec.backoffLimit 6)."
            ),
            [*ALL_CLIENTS, "server"],
            {
                "failures": failures,
                "roles": roles(  # every pod is going: none runs
                    server={"failed": 1} if server_too else None, clients={"failed": 1}
                ),
            },
        )

    return situation


def failed_server(outcome: Object | None) -> Callable[[], Situation]:
    """The server pod failed and said the failure is retriable, or said nothing (killed)."""

    def situation() -> Situation:
        status: Object = {"phase": "Running", "restarts": 0}
        if outcome is not None:
            status["outcome"] = outcome
        pods = [pod("server", "Failed", exit_code=1), *running(*ALL_CLIENTS)]
        return server_restarting(
            observe(run_body(status=status), pods),
            "Pod demo-server failed (exit code 1: Error); recreating it "
            "(1 of spec.backoffLimit 6).",
            ["server"],
            {"roles": roles(server={"failed": 1}, clients={"running": 3, "ready": 3})},
        )

    return situation


def server_failed_for_good() -> Situation:
    """The server stopped the run for good (not retriable: its checkpoint was refused), which
    a decentralized run's pods do not get past by restarting either."""
    outcome = {
        "phase": "Failed",
        "reason": "CheckpointInvalid",
        "message": "The checkpoint of round 2 is refused.",
        "retriable": False,
    }
    pods = [pod("server", "Failed", exit_code=1), pod("client-0", "Succeeded")]
    pods += running("client-1", "client-2")
    return Situation(
        observe(run_body("lppa", status={"phase": "Running", "outcome": outcome}), pods),
        steps=[
            ("note", "Failed: CheckpointInvalid"),
            ("delete", "Pod/demo-client-1", None),
            ("delete", "Pod/demo-client-2", None),
        ],
        phase="Failed",
        reason="CheckpointInvalid",
        conditions=finished("CheckpointInvalid", succeeded=False),
        status={
            "message": "The checkpoint of round 2 is refused.",
            "completionTime": stamp(),
            "restarts": 0,
            "failures": [failure("demo-server", "server", 1, "RunFailed")],
            "roles": roles(clients={"succeeded": 1}),
        },
    )


def peer_cannot_restore(*, server_said: bool) -> Callable[[], Situation]:
    """A client pod of a decentralized run exited with ``CheckpointInvalid.EXIT_CODE``: it
    cannot restore its checkpoint, and a restart would read the same one, so the run ends at
    once (no restart counted), with the server's words when it already said them. A peer
    that failed with it (its link ended), listed first, restarts nothing either."""

    def situation() -> Situation:
        status: Object = {"phase": "Running", "restarts": 0}
        server_words = "Round 21 lost client 1 (failed: CheckpointInvalid: ...)."
        if server_said:
            status["outcome"] = {
                "phase": "Failed",
                "reason": "CheckpointInvalid",
                "message": server_words,
                "retriable": False,
            }
        code = CheckpointInvalid.EXIT_CODE
        pods = [
            pod("client-0", "Failed", exit_code=1),
            *running("server", "client-2"),
            pod("client-1", "Failed", exit_code=code),
        ]
        message = (
            server_words
            if server_said
            else (
                f"Pod demo-client-1 cannot restore the checkpoint it must resume from (exit code "
                f"{code}: Error); a new pod would read the same checkpoint, so the run stops. Its "
                f"log says which checkpoint and why (`kubectl logs demo-client-1`)."
            )
        )
        return Situation(
            observe(run_body("lppa", status=status), pods),
            steps=[
                ("note", "Failed: CheckpointInvalid"),
                ("delete", "Pod/demo-server", None),
                ("delete", "Pod/demo-client-2", None),
            ],
            phase="Failed",
            reason="CheckpointInvalid",
            conditions=finished("CheckpointInvalid", succeeded=False),
            status={
                "message": message,
                "completionTime": stamp(),
                "restarts": 0,
                "failures": [
                    failure("demo-client-0", "client", 1, "RunFailed"),
                    failure("demo-client-1", "client", code, "RunFailed"),
                ],
                "roles": roles(),
            },
        )

    return situation


def backoff_limit_exhausted() -> Situation:
    pods = [*running("server", "client-1"), pod("client-0", "Failed", exit_code=2)]
    pods.append(pod("client-2", "Pending"))
    body = run_body(backoffLimit=1, status={"phase": "Running", "restarts": 1})
    message = (
        "Pod demo-client-0 failed (exit code 2: Error) and 1 failed pods were already "
        "recreated (spec.backoffLimit 1)."
    )
    return Situation(
        observe(body, pods),
        steps=[
            ("note", "Failed: BackoffLimitExceeded"),
            ("delete", "Pod/demo-server", None),
            ("delete", "Pod/demo-client-1", None),
            ("delete", "Pod/demo-client-2", None),
        ],
        phase="Failed",
        reason="BackoffLimitExceeded",
        conditions=finished("BackoffLimitExceeded", succeeded=False),
        status={
            "message": message,
            "restarts": 2,
            "completionTime": stamp(),
            "roles": roles(clients={"failed": 1}),
        },
    )


def suspend() -> Situation:
    status = {"phase": "Running", "activeSince": stamp(100), "activeSeconds": 20.0}
    pods = [*running("server", "client-0", "client-1"), pod("client-2", "Succeeded")]
    return Situation(
        observe(run_body(suspend=True, status=status), pods),
        steps=[
            ("delete", "Pod/demo-server", None),
            ("delete", "Pod/demo-client-0", None),
            ("delete", "Pod/demo-client-1", None),
            ("delete", "Pod/demo-client-2", None),
        ],
        phase="Suspended",
        reason="Suspended",
        conditions={"Ready": ("False", "Suspended"), "Suspended": ("True", "Suspended")},
        status={
            "activeSeconds": 120.0,
            "activeSince": None,
            "roles": {
                "kdc": roles()["kdc"],
                "server": {**roles()["server"], "desired": 0},
                "clients": {**roles()["clients"], "desired": 0},
            },
        },
    )


def unsuspend() -> Situation:
    status = {"phase": "Suspended", "activeSeconds": 120.0, "restarts": 0}
    return Situation(
        observe(run_body(status=status)),
        steps=[("create", "Pod/demo-server (resume)")],
        phase="Pending",
        reason="WaitingForServer",
        conditions=WAITING_FOR_SERVER,
        status={"activeSince": stamp(), "activeSeconds": 120.0},
    )


def deadline_passed() -> Situation:
    status = {"phase": "Running", "activeSince": stamp(100), "activeSeconds": 0.0}
    pods = running("server", *ALL_CLIENTS)
    return Situation(
        observe(run_body(activeDeadlineSeconds=60, status=status), pods),
        steps=[
            ("note", "Failed: DeadlineExceeded"),
            ("delete", "Pod/demo-server", None),
            ("delete", "Pod/demo-client-0", None),
            ("delete", "Pod/demo-client-1", None),
            ("delete", "Pod/demo-client-2", None),
        ],
        phase="Failed",
        reason="DeadlineExceeded",
        conditions=finished("DeadlineExceeded", succeeded=False),
        status={
            "message": "The run has been active 100 s, past spec.activeDeadlineSeconds 60.",
            "completionTime": stamp(),
            "roles": roles(),
        },
    )


def deadline_not_reached() -> Situation:
    """55 s active of 60: 20 s before a suspension, 35 s since."""
    status = {"phase": "Running", "activeSince": stamp(30), "activeSeconds": 20.0}
    pods = running("server", *ALL_CLIENTS)
    before = settled(observe(run_body(activeDeadlineSeconds=60, status=status), pods))
    return Situation(
        observe(before.body, pods, at=5),
        steps=[],
        phase="Running",
        reason="Training",
        conditions=TRAINING,
        status={"activeSince": stamp(30), "activeSeconds": 20.0, "completionTime": None},
        written=False,
    )


def server_succeeded_pods() -> list[Object]:
    return [pod("server", "Succeeded"), pod("client-0", "Succeeded"), *running("client-1")]


def server_succeeded() -> Situation:
    """The server ended the run; clients still writing their models may end on their own."""
    status = {"phase": "Running", "outcome": {"phase": "Succeeded", "reason": "BudgetExhausted"}}
    return Situation(
        observe(run_body(status=status), server_succeeded_pods()),
        steps=[("note", "Succeeded: BudgetExhausted")],
        phase="Succeeded",
        reason="BudgetExhausted",
        conditions=finished("BudgetExhausted", succeeded=True),
        status={
            "message": "The server finished the run.",
            "completionTime": stamp(),
            "roles": roles(
                server={"succeeded": 1}, clients={"succeeded": 1, "running": 1, "ready": 1}
            ),
        },
    )


def succeeded_run(at: float) -> Observed:
    """A pass ``at`` seconds after ``server_succeeded`` wrote its status."""
    before = settled(server_succeeded().observed)
    return observe(before.body, server_succeeded_pods(), at=at)


FINISHED = {
    "Suspended": ("False", "Running"),
    "Ready": ("False", "BudgetExhausted"),
    "Complete": ("True", "BudgetExhausted"),
    "Failed": ("False", "BudgetExhausted"),
}


def succeeded_within_grace() -> Situation:
    return Situation(
        succeeded_run(at=10),
        steps=[],
        phase="Succeeded",
        reason="BudgetExhausted",
        conditions=FINISHED,
        status={"completionTime": stamp()},
        written=False,
    )


def succeeded_after_grace() -> Situation:
    return Situation(
        succeeded_run(at=60),
        steps=[("delete", "Pod/demo-client-1", None)],
        phase="Succeeded",
        reason="BudgetExhausted",
        conditions=FINISHED,
        status={
            "completionTime": stamp(),
            "roles": roles(server={"succeeded": 1}, clients={"succeeded": 1}),
        },
    )


def failed_run() -> Situation:
    status = {
        "phase": "Failed",
        "reason": "QuorumLost",
        "completionTime": stamp(5),
        "restarts": 6,
    }
    pods = [pod("server", "Failed", exit_code=1), *running("client-0", "client-1")]
    return Situation(
        observe(run_body(status=status), pods),
        steps=[("delete", "Pod/demo-client-0", None), ("delete", "Pod/demo-client-1", None)],
        phase="Failed",
        reason="QuorumLost",
        conditions={},
        status={"completionTime": stamp(5), "restarts": 6, "roles": roles()},
    )


def invalid_spec() -> Situation:
    return Situation(
        observe(run_body(rounds=0), fresh=True),
        steps=[("note", "Failed: InvalidSpec")],
        phase="Failed",
        reason="InvalidSpec",
        conditions={
            "Ready": ("False", "InvalidSpec"),
            "Complete": ("False", "InvalidSpec"),
            "Failed": ("True", "InvalidSpec"),
        },
        status={"completionTime": stamp(), "roles": None},
    )


def drifted_config_map() -> Situation:
    before = settled(observe(run_body(), running("server", *ALL_CLIENTS)))
    observed = observe(before.body, running("server", *ALL_CLIENTS), at=5)
    observed.owned["ConfigMap"][0]["data"] = {"run.yaml": "edited by hand"}
    data = objects.manifest_config_map(context(before.body))["data"]
    return Situation(
        observed,
        steps=[("patch", "ConfigMap/demo-manifest", {"data": data})],
        phase="Running",
        reason="Training",
        conditions=TRAINING,
        written=False,
    )


def nothing_to_do() -> Situation:
    before = settled(observe(run_body(), running("server", *ALL_CLIENTS)))
    return Situation(
        observe(before.body, running("server", *ALL_CLIENTS), at=5),
        steps=[],
        phase="Running",
        reason="Training",
        conditions=TRAINING,
        status={
            "roles": roles(server={"running": 1, "ready": 1}, clients={"running": 3, "ready": 3})
        },
        written=False,
    )


def failed_server_whose_keys_are_missing() -> Situation:
    """A run made by an operator before the key Secrets: the server's is made before the
    recreated server pod that mounts it (in that pass's order)."""
    situation = failed_server(None)()
    observed = without_secret(situation.observed, "demo-server-keys")
    return replace(
        situation, observed=observed, steps=[("keys", "demo-server-keys"), *situation.steps]
    )


def legacy_ca_of_a_running_run(secret: Object, moved: bool) -> Callable[[], Situation]:
    """A running run (nothing else to do) that lists ``demo-ca`` in its own namespace."""

    def make() -> Situation:
        situation = nothing_to_do()
        return replace(
            situation,
            observed=with_secret(situation.observed, secret),
            steps=[("move CA", "Secret/demo-ca")] if moved else [],
        )

    return make


def legacy_ca_of_a_finished_run() -> Situation:
    situation = succeeded_within_grace()
    return replace(
        situation,
        observed=with_secret(situation.observed, legacy_ca()),
        steps=[("move CA", "Secret/demo-ca")],
    )


def legacy_ca_of_a_new_run() -> Situation:
    """Nothing is issued yet, so no ``demo-ca`` can be this run's CA: a new one is made."""
    situation = fresh_run()
    return replace(situation, observed=with_secret(situation.observed, legacy_ca()))


SITUATIONS: dict[str, Callable[[], Situation]] = {
    "legacy CA Secret in the run's namespace is moved": legacy_ca_of_a_running_run(
        legacy_ca(), moved=True
    ),
    "legacy CA Secret of a finished run is moved": legacy_ca_of_a_finished_run,
    "demo-ca owned by another run is not taken": legacy_ca_of_a_running_run(
        legacy_ca(owner="uid-2"), moved=False
    ),
    "demo-ca that did not sign the pods' certificates is not taken": legacy_ca_of_a_running_run(
        legacy_ca(ca_crt="T1RIRVI="), moved=False
    ),
    "demo-ca beside a run with no certificates is not taken": legacy_ca_of_a_new_run,
    "fresh run": fresh_run,
    "fresh run with a KDC": fresh_run_with_a_kdc,
    "KDC not ready: no server yet": kdc_not_ready,
    "KDC ready: server created": kdc_ready,
    "server ready: clients created together": server_ready,
    "failed client, dropout policy Skip (fedavg)": failed_client("fedavg"),
    "failed client, dropout policy Redo (mpdp)": failed_client("mpdp"),
    "failed client, dropout policy Fail (lppa): every pod restarts": failed_peer(server_too=False),
    "failed client and server (PeerLost, retriable): every pod restarts once": failed_peer(
        server_too=True
    ),
    "failed server, retriable report (QuorumLost)": failed_server(
        {"phase": "Failed", "reason": "QuorumLost", "retriable": True}
    ),
    "failed server, no report (killed)": failed_server(None),
    "failed server whose key Secret is missing": failed_server_whose_keys_are_missing,
    "failed server, not retriable (CheckpointInvalid)": server_failed_for_good,
    "lppa client cannot restore its checkpoint: the run ends": peer_cannot_restore(
        server_said=False
    ),
    "lppa client cannot restore its checkpoint, the server said why": peer_cannot_restore(
        server_said=True
    ),
    "backoffLimit exhausted": backoff_limit_exhausted,
    "suspend": suspend,
    "unsuspend resumes": unsuspend,
    "activeDeadlineSeconds not reached": deadline_not_reached,
    "activeDeadlineSeconds passed": deadline_passed,
    "server succeeded": server_succeeded,
    "succeeded run within the finish grace": succeeded_within_grace,
    "succeeded run after the finish grace": succeeded_after_grace,
    "failed run": failed_run,
    "invalid spec": invalid_spec,
    "drifted ConfigMap patched back": drifted_config_map,
    "nothing to do writes nothing": nothing_to_do,
}


@pytest.mark.parametrize("make", list(SITUATIONS.values()), ids=list(SITUATIONS))
def test_plan_situation_gives_exactly_its_steps_and_status(make: Callable[[], Situation]) -> None:
    # Prepare
    situation = make()
    before = copy.deepcopy(situation.observed)

    # Execute
    result = plan(situation.observed)

    # Assert
    assert summary(result.steps) == situation.steps
    assert (result.phase, result.status.get("reason")) == (situation.phase, situation.reason)
    assert conditions_of(result.status) == situation.conditions
    for key, value in situation.status.items():
        assert result.status.get(key) == value, key
    assert (result.status_patch is not None) == situation.written
    if result.status_patch is not None:
        written = {k: v for k, v in result.status_patch["status"].items() if v is not None}
        assert written == result.status
    assert situation.observed == before, "plan changed its input"
    assert plan(situation.observed) == result, "plan is not deterministic"


def test_plan_condition_times_come_from_the_observation_only() -> None:
    # Prepare
    observed = observe(run_body(), fresh=True, at=42)

    # Execute
    result = plan(observed)

    # Assert
    times = {c["lastTransitionTime"] for c in result.status["conditions"]}
    assert times == {stamp(-42)}


def test_plan_builds_the_pods_and_certificates_it_names() -> None:
    # Prepare
    body = run_body()
    ctx = context(body)
    observed = replace(observe(body, running("server")), owned={"Secret": []})

    # Execute
    result: Plan = plan(observed)

    # Assert
    issue = next(step for step in result.steps if isinstance(step, IssueCertificates))
    assert issue.context == ctx
    assert issue.identities == tuple(objects.pod_identities(ctx))
    clients = result.steps[-1]
    assert isinstance(clients, CreateObjects)
    assert list(clients.objects) == [objects.client_pod(ctx, index) for index in range(3)]


@pytest.mark.parametrize("protocol", ["fedavg", "mpdp", "lppa"])
def test_key_secrets_are_planned_before_the_first_pod_and_never_again(protocol: str) -> None:
    # Prepare: the first pass of a run, then passes over its life once its Secrets are listed:
    # pods failed and recreated, suspended, resumed, finished.
    body = run_body(protocol)
    ctx = context(body)
    kdc = ["kdc"] if protocol == "mpdp" else []
    # A decentralized protocol's clients keep their own checkpoints, each with its own key.
    clients = [("client", index) for index in range(3)] if protocol == "lppa" else []
    later = {
        "running": observe(body, running(*kdc, "server", *ALL_CLIENTS)),
        "server failed": observe(
            run_body(protocol, status={"phase": "Running", "restarts": 0}),
            [*running(*kdc), pod("server", "Failed", exit_code=137), *running(*ALL_CLIENTS)],
        ),
        "all pods gone": observe(run_body(protocol, status={"phase": "Running", "restarts": 1})),
        "suspended": observe(run_body(protocol, suspend=True, status={"phase": "Running"})),
        "resumed": observe(run_body(protocol, status={"phase": "Suspended", "restarts": 0})),
        "succeeded": observe(run_body(protocol, status={"phase": "Succeeded"})),
    }

    # Execute
    first = plan(observe(body, fresh=True))
    afterwards = {name: plan(observed) for name, observed in later.items()}

    # Assert: one IssueKeys, for the KDC (when there is one), the server and (lppa) each
    # client, before any pod.
    issued = [step for step in first.steps if isinstance(step, IssueKeys)]
    assert issued == [IssueKeys(ctx, (*((r, None) for r in kdc), ("server", None), *clients))]
    first_pod = next(
        index
        for index, step in enumerate(first.steps)
        if isinstance(step, CreateObjects) and step.objects[0]["kind"] == "Pod"
    )
    assert first.steps.index(issued[0]) < first_pod
    for name, result in afterwards.items():
        assert not [step for step in result.steps if isinstance(step, IssueKeys)], name
    recreated = [
        obj["metadata"]["name"]
        for step in afterwards["all pods gone"].steps
        if isinstance(step, CreateObjects)
        for obj in step.objects
        if obj["kind"] == "Pod"
    ]
    assert recreated == [f"demo-{kdc[0] if kdc else 'server'}"]


@pytest.mark.parametrize(
    ("body", "kinds"),
    [
        (run_body(), ("Pod", "Secret", *STATIC_KINDS)),
        (run_body(status={"phase": "Suspended"}), ("Pod", "Secret", *STATIC_KINDS)),
        (run_body(suspend=True), ("Pod", "Secret")),
        (run_body(status={"phase": "Succeeded"}), ("Pod", "Secret")),
        (run_body(status={"phase": "Failed"}), ("Pod", "Secret")),
        (run_body(rounds=0), ()),
    ],
    ids=["going on", "unsuspended", "suspended", "succeeded", "failed", "invalid"],
)
def test_kinds_to_observe_lists_only_what_the_plan_reads(
    body: Object, kinds: tuple[str, ...]
) -> None:
    assert kinds_to_observe(body) == kinds


def test_plan_moves_the_legacy_ca_before_issuing_with_it() -> None:
    # Prepare: the run's CA is still in its namespace, and one client's Secret is missing.
    observed = settled(observe(run_body(), running("server", *ALL_CLIENTS)))
    listed = {kind: list(items) for kind, items in observed.owned.items()}
    listed["Secret"] = [
        secret for secret in listed["Secret"] if secret["metadata"]["name"] != "demo-client-2-tls"
    ]
    observed = with_secret(replace(observed, owned=listed), legacy_ca())

    # Execute
    result = plan(observed)

    # Assert: moved first, so the applier finds the CA in the operator's namespace.
    assert summary(result.steps)[:2] == [
        ("move CA", "Secret/demo-ca"),
        ("issue", "demo-client-2"),
    ]
    move = result.steps[0]
    assert isinstance(move, MoveCa)
    assert move.legacy["data"]["ca.key"] == "a2V5"


def ca_secret_listed(namespace: str, name: str, uid: str) -> Object:
    ctx = objects.RunContext(
        parse_manifest(
            {
                "apiVersion": "fedcore.dev/v1alpha1",
                "kind": "FederatedRun",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"protocol": {"name": "fedavg"}, "clients": {"count": 3}, "rounds": 2},
            }
        ),
        namespace,
        uid,
        replace(SETTINGS, ca_namespace="fedcore-system"),
    )
    secret = objects.ca_secret_from(ctx, {"ca.crt": "c", "ca.key": "k"})
    assert secret["metadata"]["namespace"] == "fedcore-system"
    return secret


def run_listed(name: str, uid: str) -> Object:
    return {"metadata": {"name": name, "uid": uid}}


def test_orphaned_ca_secrets_are_those_whose_run_is_gone_or_was_made_again() -> None:
    # Prepare
    secrets = [
        ca_secret_listed("team-a", "alive", "u1"),
        ca_secret_listed("team-a", "deleted", "u2"),
        ca_secret_listed("team-a", "made-again", "u3"),
        ca_secret_listed("team-b", "b-run", "u4"),
        ca_secret_listed("unlisted", "x", "u5"),
    ]
    runs = {
        "team-a": [run_listed("alive", "u1"), run_listed("made-again", "u9")],
        "team-b": [],
    }

    # Execute
    orphans = orphaned_ca_secrets(secrets, runs)

    # Assert: a namespace whose runs could not be listed keeps its Secrets.
    assert orphans == [
        "fedcore-ca.team-a.deleted",
        "fedcore-ca.team-a.made-again",
        "fedcore-ca.team-b.b-run",
    ]


def test_a_policy_with_no_ingress_is_not_drift_once_the_api_server_omits_the_empty_list() -> None:
    # Prepare: a client policy with no ingress rule (no scraper named, not decentralized), as
    # the API server returns it (empty lists omitted), and one with the old open metrics rule.
    body = run_body()
    settled_run = settled(observe(body, running("server", *ALL_CLIENTS)))
    stored = observe(settled_run.body, running("server", *ALL_CLIENTS), at=5)
    old = observe(settled_run.body, running("server", *ALL_CLIENTS), at=5)
    for observed in (stored, old):
        client = next(
            item
            for item in observed.owned["NetworkPolicy"]
            if item["metadata"]["name"] == "demo-client"
        )
        assert client["spec"]["ingress"] == []
        del client["spec"]["ingress"]
    old_client = next(
        item for item in old.owned["NetworkPolicy"] if item["metadata"]["name"] == "demo-client"
    )
    old_client["spec"]["ingress"] = [{"ports": [{"protocol": "TCP", "port": 9090}]}]

    # Execute
    quiet = plan(stored)
    upgraded = plan(old)

    # Assert: nothing to write; the old rule is replaced by the empty list (merge patch).
    assert summary(quiet.steps) == []
    patches = [step for step in upgraded.steps if isinstance(step, PatchObject)]
    assert [(step.name, step.patch["spec"]["ingress"]) for step in patches] == [("demo-client", [])]


def test_plan_keeps_the_latest_ten_failed_pods_in_status_the_newest_last() -> None:
    # Prepare: ten failures already recorded, then client 1 fails again
    earlier = [failure(f"demo-client-{n}", "client", 1, "Recreated") for n in range(10)]
    pods = [*running("server", "client-0", "client-2"), pod("client-1", "Failed", exit_code=137)]
    observed = observe(
        run_body(status={"phase": "Running", "restarts": 3, "failures": earlier}), pods
    )

    # Execute
    result = plan(observed)

    # Assert
    kept = result.status["failures"]
    assert len(kept) == 10
    assert kept[:-1] == earlier[1:]
    assert kept[-1] == failure("demo-client-1", "client", 137, "Recreated")


def test_plan_records_the_kubelets_reason_for_a_failed_pod() -> None:
    # Prepare: client 1 killed for memory (the kubelet says OOMKilled)
    killed = pod("client-1", "Failed", exit_code=137)
    killed["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] = "OOMKilled"
    observed = observe(
        run_body(status={"phase": "Running", "restarts": 0}),
        [*running("server", "client-0", "client-2"), killed],
    )

    # Execute
    result = plan(observed)

    # Assert
    (entry,) = result.status["failures"]
    assert (entry["pod"], entry["exitCode"], entry["reason"], entry["action"]) == (
        "demo-client-1",
        137,
        "OOMKilled",
        "Recreated",
    )


def test_a_decentralized_run_past_its_backoff_limit_fails_naming_the_pod() -> None:
    # Prepare: lppa's pods were restarted backoffLimit (6) times; client 2 fails again.
    body = run_body("lppa", status={"phase": "Running", "restarts": 6})
    pods = [*running("server", "client-0", "client-1"), pod("client-2", "Failed", exit_code=1)]
    # Execute
    result = plan(observe(body, pods))
    # Assert: the run ends, the still running pods go, the failure is recorded as RunFailed.
    assert result.phase == "Failed" and result.status["reason"] == "BackoffLimitExceeded"
    assert result.status["message"] == (
        "Pod demo-client-2 failed (exit code 1: Error) and the run's pods were already "
        "restarted 6 times (spec.backoffLimit 6)."
    )
    assert result.status["failures"][-1] == failure("demo-client-2", "client", 1, "RunFailed")
    deleted = sorted(step.name for step in result.steps if isinstance(step, DeletePod))
    assert deleted == ["demo-client-0", "demo-client-1", "demo-server"]

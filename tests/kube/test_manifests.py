"""The same verdict on the cluster: a table of manifests, each judged locally and by the cluster.

Each case is one manifest, judged three ways: ``fedcore.spec.load_manifest`` on its YAML text
(what ``fedcore validate`` does), a create of it through the API (as JSON) and ``kubectl apply``
of the same text. The cluster is the real 1.20 API server with the generated CRD and the
operator's validating webhook registered. The verdicts must agree, and every field path the
local error names must be named by the cluster's refusal too. Where the CRD schema refuses, the
text is the API server's; where it cannot, the webhook's, which is the local text itself.

The operator serving the webhook reconciles only a namespace of its own, so the admitted runs
here never get pods.

What kubectl does before the cluster sees anything decides two cases. It drops an explicit
null from the run it creates (and a null in its patch deletes the field), so ``backoffLimit:
null`` always gets the default there: the table expects it admitted. And it keeps the last of
two equal keys in one YAML mapping, which ``fedcore validate`` refuses and no rule on the
cluster can see, so that case is not in the table.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from fedcore.errors import SpecError, SpecIssue
from fedcore.spec import load_manifest
from fedcore_operator.crd import GROUP, PLURAL, VERSION
from fedcore_operator.kube import request
from tests.kube._operator import WEBHOOK_NAME, install_crd, start_operator
from tests.kube.cluster import ControlPlane

SERVICE_LONG_NAME = "too-long-for-the-clients-service-" + "x" * 23
"""56 characters: its Service ``<name>-clients`` would have 64 (a DNS-1035 label: 63 at most)."""
SECRET_LONG_NAME = "too-long-for-a-client-tls-secret-" + "x" * 18
"""51 characters, 3 clients: ``<name>-client-2`` has 61, its TLS Secret ``<name>-client-2-tls``
65: the Services fit, the names the operator derives from a client do not."""


def base_manifest() -> dict[str, Any]:
    """A valid, small run (fedavg, 3 clients on the digits data, 2 rounds)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "FederatedRun",
        "metadata": {"name": "table"},
        "spec": {
            "protocol": {"name": "fedavg"},
            "clients": {"count": 3},
            "rounds": 2,
        },
    }


@dataclass(frozen=True)
class Case:
    """One manifest of the table and the verdict every judge must give it.

    Attributes:
        id: the pytest id.
        changes: dotted paths (from the manifest's root) set on `base_manifest`; a list
            index is a number (``spec.roles.server.tolerations.0.keyy``).
        admitted: whether the manifest is valid.
        path: a field path the refusal must name (besides every path the local error names).
        text: a YAML text to use instead of the changed base manifest (for what only YAML
            can carry, such as ``.inf``); the API then gets it as application/yaml.
        needs: which part of the work the case waits for, when it does (for the report).
    """

    id: str
    changes: dict[str, Any] = field(default_factory=dict)
    admitted: bool = False
    path: str | None = None
    text: str | None = None
    needs: str = ""

    def manifest(self) -> dict[str, Any]:
        """The base manifest with this case's changes."""
        body = base_manifest()
        for dotted, value in self.changes.items():
            *parents, last = dotted.split(".")
            node: Any = body
            for part, after in zip(parents, [*parents, last][1:], strict=True):
                key: Any = int(part) if part.isdigit() else part
                if isinstance(node, dict) and key not in node:
                    node[key] = [] if after.isdigit() else {}
                elif isinstance(node, list) and key == len(node):
                    node.append([] if after.isdigit() else {})
                node = node[key]
            if isinstance(node, list):
                node.append(value)
            else:
                node[last] = value
        return body

    def yaml_text(self) -> str:
        """The YAML text every judge reads."""
        return self.text if self.text is not None else yaml.safe_dump(self.manifest())


STRICT = "strict types in fedcore/spec (no bool or string coerced into a number)"
NAME = "the metadata.name rule in fedcore/spec made the cluster's"
FEASIBLE = "the feasibility checks in fedcore/spec (clients vs the dataset's size)"
NULL = (
    "null read as unset in fedcore/spec: kubectl apply drops a null before it sends the run "
    "(and a patch's null deletes the field), the API server defaults it"
)

INFINITE_EPSILON = """\
apiVersion: fedcore.dev/v1alpha1
kind: FederatedRun
metadata:
  name: table
spec:
  protocol:
    name: dp-fedavg
  clients:
    count: 3
  rounds: 2
  privacy:
    targetEpsilon: .inf
"""
"""Valid with a finite epsilon. JSON has no infinity: kubectl and the API server's YAML reader
refuse it before the schema (their message cannot name the field)."""

ALIAS_BOMB = """\
apiVersion: fedcore.dev/v1alpha1
kind: FederatedRun
metadata:
  name: table
spec:
  protocol: {name: fedavg}
  clients: {count: 3}
  rounds: 2
  roles:
    server:
      podTemplate:
        metadata:
          a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
          b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
          c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
          d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
          e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
          f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
          g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
          h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
          i: [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""
"""Billion laughs: 387 million strings once expanded. The loader refuses it without expanding;
the API server's and kubectl's YAML readers refuse its excessive aliasing."""


def nested(levels: int) -> Any:
    """``levels`` lists, one inside the other, around one string."""
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


CASES = [
    Case("valid", admitted=True),
    Case(
        "valid with lists, maps and a null",
        {
            "spec.clients": {"count": 4, "perRound": 3, "quorum": "50%"},
            "spec.training.optimizer.learningRate": 0.05,
            "spec.roles.server.tolerations.0": {"key": "gpu", "operator": "Exists"},
            "spec.privacy": None,
            "metadata.labels": {"team": "a"},
        },
        admitted=True,
    ),
    Case("unknown field under spec", {"spec.roundz": 3}, path="spec.roundz"),
    Case(
        "unknown field nested",
        {"spec.training.optimizer.lerningRate": 0.1},
        path="spec.training.optimizer.lerningRate",
    ),
    Case(
        "unknown field in a list item",
        {"spec.roles.server.tolerations.0": {"key": "gpu", "operatr": "Exists"}},
        path="spec.roles.server.tolerations[0].operatr",
    ),
    Case("unknown field beside spec", {"labels": {"team": "a"}}, path="labels"),
    Case("rounds a string", {"spec.rounds": "20"}, path="spec.rounds", needs=STRICT),
    Case("rounds a boolean", {"spec.rounds": True}, path="spec.rounds", needs=STRICT),
    Case("rounds a fraction", {"spec.rounds": 2.5}, path="spec.rounds"),
    Case("rounds a whole float", {"spec.rounds": 20.0}, admitted=True, needs=STRICT),
    Case("backoffLimit null", {"spec.backoffLimit": None}, admitted=True, needs=NULL),
    Case("rounds null", {"spec.rounds": None}, path="spec.rounds"),
    Case("suspend a string", {"spec.suspend": "true"}, path="spec.suspend", needs=STRICT),
    Case("negative count", {"spec.clients.count": -3}, path="spec.clients.count"),
    Case(
        "perRound above count",
        {"spec.clients": {"count": 3, "perRound": 5}},
        path="spec.clients.perRound",
    ),
    Case(
        "quorum above perRound",
        {"spec.clients": {"count": 10, "perRound": 3, "quorum": 5}},
        path="spec.clients.quorum",
    ),
    Case(
        "perRound bad percentage", {"spec.clients.perRound": "150%"}, path="spec.clients.perRound"
    ),
    Case("bad protocol name", {"spec.protocol.name": "fedavgg"}, path="spec.protocol.name"),
    Case("protocol not a mapping", {"spec.protocol": "fedavg"}, path="spec.protocol"),
    Case("name starts with a digit", {"metadata.name": "9lives"}, path="metadata.name", needs=NAME),
    Case("name with capitals", {"metadata.name": "Table"}, path="metadata.name"),
    Case(
        "name too long for its Services", {"metadata.name": SERVICE_LONG_NAME}, path="metadata.name"
    ),
    Case(
        "name too long for its TLS Secrets",
        {"metadata.name": SECRET_LONG_NAME},
        path="metadata.name",
        needs=NAME,
    ),
    Case(
        "5000 clients on the digits data",
        {"spec.clients.count": 5000},
        path="spec.clients.count",
        needs=FEASIBLE,
    ),
    Case("targetEpsilon infinite", text=INFINITE_EPSILON, needs=STRICT),
    Case("alias bomb", text=ALIAS_BOMB),
    Case("empty document", text="# nothing but a comment\n"),
    Case(
        "privileged root init container",
        {
            "spec.roles.server.podTemplate.spec.initContainers": [
                {
                    "name": "x",
                    "image": "busybox",
                    "securityContext": {"privileged": True, "runAsUser": 0},
                }
            ]
        },
        path="spec.roles.server.podTemplate.spec.initContainers[0].securityContext.privileged",
    ),
    Case(
        "added capability, seccomp unconfined",
        {
            "spec.roles.clients.podTemplate.spec.containers": [
                {
                    "name": "fedcore",
                    "securityContext": {
                        "capabilities": {"add": ["SYS_ADMIN"]},
                        "seccompProfile": {"type": "Unconfined"},
                    },
                }
            ]
        },
        path="spec.roles.clients.podTemplate.spec.containers[0].securityContext.capabilities.add",
    ),
    Case(
        "host path and the run CA as volumes",
        {
            "spec.roles.kdc.podTemplate.spec.volumes": [
                {"name": "root", "hostPath": {"path": "/"}},
                {"name": "ca", "secret": {"secretName": "table-ca"}},
            ]
        },
        path="spec.roles.kdc.podTemplate.spec.volumes[0].hostPath",
    ),
    Case(
        "a safe podTemplate",
        {
            "spec.roles.clients.podTemplate": {
                "metadata": {"labels": {"team": "a"}},
                "spec": {
                    "priorityClassName": "high",
                    "volumes": [{"name": "scratch", "emptyDir": {}}],
                },
            }
        },
        admitted=True,
    ),
    Case(
        "nested 57 deep in a podTemplate",
        {"spec.roles.server.podTemplate.spec.x": nested(57)},
        admitted=True,
    ),
    Case(
        "nested 58 deep in a podTemplate",
        {"spec.roles.server.podTemplate.spec.x": nested(58)},
        path="spec.roles.server.podTemplate.spec.x",
    ),
]


@dataclass(frozen=True)
class Verdict:
    """What one judge said: admitted or not, and its message."""

    admitted: bool
    message: str = ""
    issues: tuple[SpecIssue, ...] = ()
    stored: dict[str, Any] | None = None


def local_verdict(case: Case) -> Verdict:
    """``fedcore.spec.load_manifest`` on the case's text (what ``fedcore validate`` runs)."""
    try:
        load_manifest(f"<{case.id}>", text=case.yaml_text())
    except SpecError as exc:
        return Verdict(False, str(exc), tuple(exc.issues))
    return Verdict(True)


def api_verdict(plane: ControlPlane, namespace: str, case: Case) -> Verdict:
    """A create through the API: the case's manifest as JSON, or its text as YAML."""
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    if case.text is None:
        body: Any = case.manifest()
        content_type = "application/json"
    else:
        body, content_type = case.text, "application/yaml"
    try:
        stored = request(plane.api_client(), "POST", path, body=body, content_type=content_type)
    except ApiException as exc:
        if exc.status not in (400, 422):
            raise
        try:
            message = str(json.loads(exc.body or "{}").get("message", exc.body))
        except json.JSONDecodeError:
            message = str(exc.body)
        return Verdict(False, message)
    return Verdict(True, stored=stored)


def kubectl_verdict(plane: ControlPlane, namespace: str, case: Case) -> Verdict:
    """``kubectl apply -f -`` of the case's text."""
    result = plane.kubectl("apply", "-n", namespace, "-f", "-", input=case.yaml_text(), check=False)
    return Verdict(result.returncode == 0, (result.stderr or result.stdout).strip())


@dataclass(frozen=True)
class Table:
    """Where the table's runs go: one namespace for API creates, one for kubectl."""

    api: str
    kubectl: str


@pytest.fixture(scope="module")
def table(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Table]:
    """The CRD installed, the operator's webhook answering, and two empty namespaces."""
    if shutil.which("kubectl") is None and not Path("/usr/bin/kubectl").exists():
        pytest.fail("kubectl is missing: the table applies every case with it.")
    install_crd(control_plane)
    suffix = uuid.uuid4().hex[:8]
    idle = control_plane.create_namespace(f"t-idle-{suffix}")
    names = Table(
        control_plane.create_namespace(f"t-api-{suffix}"),
        control_plane.create_namespace(f"t-kubectl-{suffix}"),
    )
    op = start_operator(
        control_plane,
        tmp_path_factory.mktemp("operator"),
        lease=f"fedcore-manifests-{suffix}",
        namespaces=[idle],
    )
    try:
        _wait_for_webhook(control_plane, names.api, op.tail)
        yield names
    finally:
        op.stop()
        # kopf registered the webhook; without its server every later apply would fail.
        control_plane.kubectl(
            "delete", "validatingwebhookconfiguration", WEBHOOK_NAME, "--ignore-not-found"
        )
        for namespace in (idle, names.api, names.kubectl):
            control_plane.delete_namespace(namespace)


def _wait_for_webhook(plane: ControlPlane, namespace: str, log: Any, timeout: float = 60) -> None:
    """Waits until a run only the webhook refuses is refused (a dry run: nothing is stored)."""
    body = Case("probe", {"spec.clients": {"count": 3, "perRound": 5}}).manifest()
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            request(plane.api_client(), "POST", path, body=body, query=[("dryRun", "All")])
        except ApiException as exc:
            if exc.status == 422 and "spec.clients.perRound" in str(exc.body):
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"the webhook did not answer in {timeout:.0f} s:\n{log()}")
        time.sleep(0.3)


def _delete_run(plane: ControlPlane, namespace: str, name: str) -> None:
    """Deletes the run if it exists (no finalizers: it is gone at once)."""
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
    try:
        request(plane.api_client(), "DELETE", path)
    except ApiException as exc:
        if exc.status != 404:
            raise


def _kept(sent: Any, stored: Any, path: str) -> list[str]:
    """The paths of what was sent and is not in the stored object as sent (pruned, changed).

    A null sent is "unset": the server may default it or keep it.
    """
    if isinstance(sent, dict):
        if not isinstance(stored, dict):
            return [path]
        return [
            lost
            for key, value in sent.items()
            if value is not None
            for lost in (
                _kept(value, stored[key], f"{path}.{key}") if key in stored else [f"{path}.{key}"]
            )
        ]
    return [] if sent == stored else [path]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_the_cluster_gives_the_local_verdict(
    control_plane: ControlPlane, table: Table, case: Case
) -> None:
    # Execute: each judge sees a create (an admitted run is deleted again, so that the next
    # case with its name is not an update).
    local = local_verdict(case)
    name = str((yaml.safe_load(case.yaml_text()) or {}).get("metadata", {}).get("name"))
    try:
        api = api_verdict(control_plane, table.api, case)
        kubectl = kubectl_verdict(control_plane, table.kubectl, case)
    finally:
        for namespace in (table.api, table.kubectl):
            _delete_run(control_plane, namespace, name)

    # Assert: one verdict, the intended one.
    verdicts = {"fedcore.spec": local, "API": api, "kubectl apply": kubectl}
    said = "\n".join(
        f"  {judge}: {'admitted' if v.admitted else 'refused'} {v.message}"
        for judge, v in verdicts.items()
    )
    assert {v.admitted for v in verdicts.values()} == {case.admitted}, (
        f"{case.id}: expected {'admitted' if case.admitted else 'refused'}"
        + (f" (needs {case.needs})" if case.needs else "")
        + f":\n{said}"
    )
    if case.admitted:
        # Nothing sent was pruned or changed on the way in.
        assert api.stored is not None
        assert _kept(case.manifest()["spec"], api.stored["spec"], "spec") == []
        return
    # Assert: the cluster names the field the local error names.
    # A YAML-level refusal (case.text) comes from kubectl's or the API's YAML reader: it names
    # the key, not the path.
    paths = {issue.path for issue in local.issues} - {"<file>", "<root>"}
    names = set() if case.text is not None else set(paths)
    if case.path is not None:
        names.add(case.path)
        assert any(case.path in path for path in (*paths, local.message)), said
    for name in sorted(names):
        assert name in api.message, f"{case.id}: the API does not name {name}:\n{said}"
        assert name in kubectl.message, f"{case.id}: kubectl does not name {name}:\n{said}"
    # Assert: where the webhook refused, it said what fedcore validate says, word for word
    # (but for what the YAML loader found in the text, which the webhook never sees: it names
    # the same field in its own words).
    for cluster in (api, kubectl):
        if "admission webhook" in cluster.message:
            for issue in local.issues:
                if issue.path not in ("<file>", "<root>"):
                    assert str(issue) in cluster.message, f"{case.id}: not {issue}:\n{said}"

"""A site in its own Kubernetes cluster: its say is a Participation there, reconciled by the
site's operator (mode site), which dials out to the hub and nowhere else.

The hub is `fedcore hub serve`'s code (KDC, server and endpoint as processes on loopback);
the site's cluster is the suite's control plane with its fake kubelet, and the site's
operator is a real process in mode site. A second site runs on a bare machine
(`fedcore site serve`), so one run has clients in a cluster and on a machine. Cases: the run
trains the model one machine trains, and no name of the site's data reaches the hub; a
Participation whose floor refuses the run, one whose allow-list refuses the run's image, one
approved for another spec: each refused with its reason on both sides; the site's operator
killed mid-run: a new one picks up without a second pod; the approval withdrawn mid-run: the
site's clients stop and the hub hears it.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import CustomObjectsApi
from kubernetes.client.exceptions import ApiException

from fedcore.errors import FedcoreError
from fedcore.local.ports import free_port
from fedcore.local.runner import LocalRunResult
from fedcore.roles._hold import FILE_VARIABLE, ROUND_VARIABLE
from fedcore.simulation import simulate
from fedcore.sites._registry import HubRegistry
from fedcore.sites.hub import HubEndpoint
from fedcore.sites.hub_serve import HubServe
from fedcore.spec import FederatedRun, load_manifest, parse_manifest, spec_digest
from fedcore_operator.crd import GROUP, VERSION
from tests.kube._operator import WEBHOOK_NAME, OperatorProcess, install_crd, start_operator
from tests.kube.cluster import ControlPlane
from tests.kube.kubelet import FakeKubelet
from tests.kube.test_client_data_runs import bound_claim
from tests.kube.test_operator_runs import listed

ROOT = Path(__file__).resolve().parents[2]
PARTICIPATION_CRD = ROOT / "charts" / "fedcore" / "crds" / "participations.yaml"
PARTICIPATION_CRD_NAME = "participations.fedcore.dev"
SENTINEL = "q7f3a"
"""In every name of the cluster site's data (claims, sub-paths): none may reach the hub."""
SITE = "hospital-k8s"
BARE = "hospital-bare"
OPERATOR_NAMESPACE = "default"


# -------------------------------------------------------------------------------- the hub


class Hub:
    """One run served from a hub on a fixed loopback port, followed in a thread."""

    def __init__(self, state: HubState, run_file: Path, workdir: Path) -> None:
        self.serve = HubServe(
            load_manifest(run_file),
            run_file,
            state.registry,
            listen=f"127.0.0.1:{state.port}",
            workdir=workdir,
        )
        self.result: LocalRunResult | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def _follow(self) -> None:
        try:
            self.result = self.serve.wait()
        except BaseException as exc:
            self.error = exc

    def __enter__(self) -> Hub:
        self.serve.start()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.serve.stop()
        self._thread.join(30)

    def events(self, kind: str) -> list[dict[str, Any]]:
        lines = self.serve.local.events_path.read_text().splitlines()
        return [event for event in map(json.loads, lines) if event.get("event") == kind]

    def ended(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the hub's run did not end in time"


@dataclass(frozen=True)
class HubState:
    """The hub's registry (both sites added), its endpoint's port, the bare site's token."""

    registry: HubRegistry
    port: int
    bare_token: str
    bare_folder: Path


@pytest.fixture(scope="module")
def hub_state(tmp_path_factory: pytest.TempPathFactory) -> HubState:
    registry = HubRegistry(tmp_path_factory.mktemp("hub-state"))
    token = registry.add_site(BARE).token
    return HubState(registry, free_port(), token, tmp_path_factory.mktemp("bare-site"))


@pytest.fixture(scope="module")
def site_operator(
    control_plane: ControlPlane,
    kubelet: FakeKubelet,
    hub_state: HubState,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[], OperatorProcess]]:
    """Starts the site's operator (mode site, its webhook validating Participations) on
    demand; the first start enrolls the site with a join token in a Secret; every operator is
    stopped at the end."""
    registry, port = hub_state.registry, hub_state.port
    install_crd(control_plane, PARTICIPATION_CRD, PARTICIPATION_CRD_NAME)
    token = registry.add_site(SITE).token
    control_plane.kubectl(
        "-n", OPERATOR_NAMESPACE, "create", "secret", "generic", "fedcore-site-join",
        f"--from-literal=token={token}",
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("site-operator")
    started: list[OperatorProcess] = []
    env = {
        "FEDCORE_OPERATOR_MODE": "site",
        "FEDCORE_SITE_HUB": f"127.0.0.1:{port}",
        "FEDCORE_SITE_FINGERPRINT": registry.fingerprint,
        "FEDCORE_SITE_RESYNC_SECONDS": "1",
    }

    def start() -> OperatorProcess:
        op = start_operator(
            control_plane, folder, webhook=True, extra_env=env, lease="fedcore-site-operator"
        )
        started.append(op)
        return op

    yield start
    for op in started:
        op.stop()
    control_plane.kubectl(
        "delete", "validatingwebhookconfiguration", WEBHOOK_NAME, "--ignore-not-found"
    )
    for secret in ("fedcore-site-join", "fedcore-site-identity"):
        control_plane.kubectl(
            "-n", OPERATOR_NAMESPACE, "delete", "secret", secret, "--ignore-not-found"
        )


@pytest.fixture
def operator(site_operator: Callable[[], OperatorProcess]) -> Iterator[OperatorProcess]:
    op = site_operator()
    yield op
    op.stop()


# ------------------------------------------------------------------------------ the run


def run_document(name: str, *, dp: bool = False, **changes: Any) -> dict[str, Any]:
    """The hospitals example as FedAvg (deterministic; ``dp``: its DP-FedAvg): two clients at
    the cluster site, one at the bare site."""
    document = yaml.safe_load((ROOT / "examples" / "hospitals-tabular.yaml").read_text())
    document["metadata"]["name"] = name
    spec = document["spec"]
    if not dp:
        spec["protocol"] = {"name": "fedavg"}
        spec.pop("privacy")
    spec["rounds"] = 3
    spec["clients"] = {"count": 3}
    spec["checkpoint"] = {"everyRounds": 0}
    spec["failurePolicy"] = {"connectTimeoutSeconds": 120, "roundTimeoutSeconds": 60}
    spec["data"]["clientData"] = {"format": "Parquet"}
    spec["sites"] = [{"name": SITE, "clients": 2}, {"name": BARE, "clients": 1}]
    spec.update(changes)
    return document


def write_run(folder: Path, document: dict[str, Any]) -> tuple[Path, FederatedRun]:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    return path, load_manifest(path)


def participation(run: FederatedRun, name: str = "study", **spec: Any) -> dict[str, Any]:
    """A Participation approving ``run`` for the cluster site: its two clients read claims
    named with SENTINEL."""
    body: dict[str, Any] = {
        "run": run.metadata.name,
        "specDigest": spec_digest(run),
        "clients": 2,
        "floor": {"protocols": [run.spec.protocol.name]},
        "data": {
            "template": {
                "volumeClaim": {"claimName": f"{SENTINEL}-{{index}}", "subPath": "records"}
            }
        },
        "pods": {"resources": {"requests": {"cpu": "100m"}}},
    }
    body.update(spec)
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Participation",
        "metadata": {"name": name},
        "spec": body,
    }


def site_claims(plane: ControlPlane, kubelet: FakeKubelet, namespace: str, hospitals: Path) -> None:
    """The cluster site's two claims, holding hospital-0's and hospital-1's tables."""
    for index in range(2):
        claim = f"{SENTINEL}-{index}"
        bound_claim(plane, namespace, claim)
        folder = kubelet.workdir / "pvc" / namespace / claim / "records"
        shutil.copytree(hospitals / f"hospital-{index}", folder)


def get_participation(plane: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    found: Any = CustomObjectsApi(plane.api_client()).get_namespaced_custom_object(
        GROUP, VERSION, namespace, "participations", name
    )
    return dict(found)


def wait_participation(
    plane: ControlPlane,
    namespace: str,
    name: str,
    predicate: Callable[[dict[str, Any]], bool],
    *,
    timeout: float,
    what: str,
    op: OperatorProcess,
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            body = get_participation(plane, namespace, name)
        except ApiException:
            body = {}
        if body and predicate(body):
            return body
        time.sleep(0.5)
    raise AssertionError(
        f"Participation {name} did not reach {what}: {json.dumps(body.get('status'), indent=1)}"
        f"\n--- operator\n{op.tail(60)}"
    )


def phase(*phases: str) -> Callable[[dict[str, Any]], bool]:
    return lambda body: (body.get("status") or {}).get("phase") in phases


def client_pods(plane: ControlPlane, namespace: str) -> list[dict[str, Any]]:
    return [
        pod
        for pod in listed(plane, namespace, "pods")
        if "fedcore.dev/participation" in (pod["metadata"].get("labels") or {})
    ]


def held_after_round_one(monkeypatch: pytest.MonkeyPatch, folder: Path) -> Path:
    """Makes the hub's server hold after round 1 while the returned file exists."""
    hold = folder / "hold"
    hold.touch()
    monkeypatch.setenv(ROUND_VARIABLE, "1")
    monkeypatch.setenv(FILE_VARIABLE, str(hold))
    return hold


def wait_held(hub: Hub, operator: OperatorProcess, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not hub.events("held"):
        assert hub.error is None, hub.error
        assert time.monotonic() < deadline, f"the run never held:\n{operator.tail(40)}"
        time.sleep(0.3)


def run_round(body: dict[str, Any]) -> int | None:
    return ((body.get("status") or {}).get("run") or {}).get("round")


class BareSite:
    """The second site: `fedcore site join` (once, when the hub first listens), then
    `fedcore site serve` with its policy for ``run``."""

    def __init__(self, hub: HubState, run: FederatedRun, data: Path | None) -> None:
        self.hub = hub
        folder = self.folder = hub.bare_folder
        folder.mkdir(parents=True, exist_ok=True)
        self.log = folder / "site.log"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        policy = {
            "apiVersion": "fedcore.dev/v1alpha1",
            "kind": "SitePolicy",
            "site": BARE,
            "approvals": [
                {
                    "run": run.metadata.name,
                    "specDigest": spec_digest(run),
                    "clients": 1,
                    "floor": {"protocols": [run.spec.protocol.name]},
                    **({} if data is None else {"data": {"sources": [{"path": str(data)}]}}),
                }
            ],
        }
        self.policy = folder / f"policy-{run.metadata.name}.yaml"
        self.policy.write_text(yaml.safe_dump(policy), encoding="utf-8")
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> BareSite:
        hub = f"127.0.0.1:{self.hub.port}"
        if not (self.folder / "site.json").exists():
            self._join(hub)
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "fedcore", "site", "serve", "--dir", str(self.folder),
                 "--policy", str(self.policy)],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        return self

    def _join(self, hub: str) -> None:
        joined = subprocess.run(
            [sys.executable, "-m", "fedcore", "site", "join", "--hub", hub,
             "--fingerprint", self.hub.registry.fingerprint, "--dir", str(self.folder)],
            env={**self.env, "FEDCORE_JOIN_TOKEN": self.hub.bare_token},
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
        assert joined.returncode == 0, joined.stderr[-2000:]

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


# ------------------------------------------------------------------------------ the cases


def test_a_run_with_clients_in_a_cluster_and_on_a_machine_trains_the_one_machine_model(
    control_plane: ControlPlane,
    kubelet: FakeKubelet,
    operator: OperatorProcess,
    namespace: str,
    hub_state: HubState,
    hospitals: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    received: list[str] = []
    answer = HubEndpoint.answer

    def recording(self: HubEndpoint, method: str, path: str, body: Any, der: Any) -> Any:
        received.append(json.dumps(body))  # every message a site sends the hub's API
        return answer(self, method, path, body, der)

    monkeypatch.setattr(HubEndpoint, "answer", recording)
    site_claims(control_plane, kubelet, namespace, hospitals)
    started = time.time()
    path, run = write_run(tmp_path / "hub", run_document("mixed"))
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(participation(run)))
    bare = BareSite(hub_state, run, hospitals / "hospital-2")
    hold = held_after_round_one(monkeypatch, tmp_path)
    with Hub(hub_state, path, tmp_path / "hub" / "work") as hub, bare:
        wait_held(hub, operator)
        mid = wait_participation(
            control_plane, namespace, "study", lambda b: run_round(b) == 1,
            timeout=60, what="round 1 reported", op=operator,
        )  # fmt: skip
        hold.unlink()
        hub.ended(240)
        done = wait_participation(
            control_plane, namespace, "study", lambda b: phase("Failed")(b) or (
                phase("Succeeded")(b) and b["status"]["clients"]["succeeded"] == 2
            ),
            timeout=60, what="its end, with both client pods done", op=operator,
        )  # fmt: skip
    assert hub.error is None and hub.result is not None, (hub.error, operator.tail())
    assert hub.result.phase == "Succeeded" and hub.result.rounds_completed == 3
    # The hub saw both sites call in during the run (a site whose link is lost stops this).
    assert hub.serve.endpoint is not None
    sample = hub.serve.endpoint.metrics.registry.get_sample_value
    for name in (SITE, BARE):
        seen = sample(
            "fedcore_hub_site_last_seen_timestamp_seconds", {"run": "mixed", "site": name}
        )
        assert seen is not None and started < seen <= time.time(), (name, seen)
    # Mid-run, the Participation showed the hub's run: its phase, round and rounds.
    assert mid["status"]["phase"] == "Running", mid["status"]
    assert mid["status"]["run"] == {"phase": "Running", "round": 1, "rounds": 3}
    assert mid["status"]["clients"] == {"total": 2, "ready": 2, "succeeded": 0, "restarts": 0}
    status = done["status"]
    assert status["phase"] == "Succeeded", status
    assert status["site"] == SITE and status["digest"] == spec_digest(run)
    assert status["clients"]["succeeded"] == 2 and status["reported"]["verdict"] == "Approved"
    # From the hub's last answer (RunSucceeded), or from the pods once it stopped answering.
    assert status["reason"] in ("RunSucceeded", "ClientsFinished"), status
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Enrolled"] == "True" and conditions["Approved"] == "True"
    during = {c["type"]: c["status"] for c in mid["status"]["conditions"]}
    assert during == {
        "Enrolled": "True",
        "HubReachable": "True",
        "Approved": "True",
        "ClientsReady": "True",
    }
    # The model the three clients trained is the one machine's with the same data and seed.
    local = run_document("mixed")
    del local["spec"]["sites"]
    local["spec"]["data"]["clientData"] = {
        "format": "Parquet",
        "template": {"path": str(hospitals / "hospital-{index}")},
    }
    assert hub.result.accuracy == simulate(parse_manifest(local)).accuracy
    # The site's key stayed in its cluster: the hub saw only requests and certificates.
    identity = control_plane.kubectl(
        "-n", OPERATOR_NAMESPACE, "get", "secret", "fedcore-site-identity", "-o", "json"
    )
    key = base64.b64decode(json.loads(identity.stdout)["data"]["tls.key"]).decode()
    chunk = key.splitlines()[1]  # 64 characters of the key's body, as any PEM copy has them
    assert "PRIVATE KEY" in key and len(chunk) == 64
    assert all(chunk not in text for text in received)
    # Nothing of the site's data source reached the hub: no message, no file it wrote.
    assert received and all(SENTINEL not in text for text in received)
    files = [p for p in (tmp_path / "hub" / "work").rglob("*") if p.is_file()]
    assert len(files) > 5
    for file in files:
        assert SENTINEL.encode() not in file.read_bytes(), file
    # ...while the site's own binding, in its own namespace, names its claims.
    binding = json.loads(
        control_plane.kubectl(
            "-n", namespace, "get", "secret", "study-site-binding", "-o", "json"
        ).stdout
    )
    assert SENTINEL in base64.b64decode(binding["data"]["site-binding.json"]).decode()


def refused(
    plane: ControlPlane,
    namespace: str,
    operator: OperatorProcess,
    hub_state: HubState,
    folder: Path,
    document: dict[str, Any],
    body: dict[str, Any],
) -> tuple[dict[str, Any], Hub]:
    """Serves ``document`` from the hub with ``body`` applied at the site; returns the
    Participation once Refused, and the hub once its run ended."""
    path, _ = write_run(folder, document)
    plane.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
    with Hub(hub_state, path, folder / "work") as hub:
        found = wait_participation(
            plane, namespace, body["metadata"]["name"], phase("Refused"),
            timeout=90, what="Refused", op=operator,
        )  # fmt: skip
        hub.ended(60)
    assert client_pods(plane, namespace) == []
    return found, hub


def assert_hub_failed(hub: Hub, reason: str, words: str) -> None:
    error = hub.error
    assert isinstance(error, FedcoreError), error
    assert getattr(error, "reason", None) == "SiteRefused", error
    assert f"Site {SITE} refused run" in str(error) and f"({reason})" in str(error), error
    assert words in str(error), error
    assert hub.events("round") == []


def test_a_floor_that_refuses_the_run_refuses_it_on_both_sides(
    control_plane: ControlPlane,
    operator: OperatorProcess,
    namespace: str,
    hub_state: HubState,
    tmp_path: Path,
) -> None:
    document = run_document("floor", dp=True)
    _, run = write_run(tmp_path / "plan", document)
    body = participation(run, floor={"protocols": ["dp-fedavg"], "maxEpsilon": 0.5})
    found, hub = refused(control_plane, namespace, operator, hub_state, tmp_path, document, body)
    status = found["status"]
    assert status["reason"] == "Epsilon", status
    assert "plans epsilon" in status["message"] and "at most epsilon 0.5" in status["message"]
    assert status["reported"] == {
        "verdict": "Refused",
        "digest": spec_digest(run),
        "reason": "Epsilon",
    }
    conditions = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert conditions["Approved"] == ("False", "Epsilon")
    assert_hub_failed(hub, "Epsilon", "at most epsilon 0.5")


def test_an_image_off_the_allow_list_is_refused_on_both_sides(
    control_plane: ControlPlane,
    operator: OperatorProcess,
    namespace: str,
    hub_state: HubState,
    tmp_path: Path,
) -> None:
    document = run_document("image", roles={"clients": {"image": "evil.example/fedcore:latest"}})
    _, run = write_run(tmp_path / "plan", document)
    body = participation(run, images=["registry.example.org/fedcore/"])
    found, hub = refused(control_plane, namespace, operator, hub_state, tmp_path, document, body)
    status = found["status"]
    assert status["reason"] == "ImageNotAllowed", status
    assert "evil.example/fedcore:latest" in status["message"]
    assert_hub_failed(hub, "ImageNotAllowed", "evil.example/fedcore:latest")


def test_a_spec_changed_after_approval_is_refused_on_both_sides(
    control_plane: ControlPlane,
    operator: OperatorProcess,
    namespace: str,
    hub_state: HubState,
    tmp_path: Path,
) -> None:
    _, approved = write_run(tmp_path / "approved", run_document("changed", rounds=3))
    served = run_document("changed", rounds=30)
    body = participation(approved)
    found, hub = refused(control_plane, namespace, operator, hub_state, tmp_path, served, body)
    status = found["status"]
    assert status["reason"] == "SpecChanged", status
    assert spec_digest(approved) in status["message"]
    assert status["digest"] != spec_digest(approved)
    assert_hub_failed(hub, "SpecChanged", spec_digest(approved))


def test_the_site_operator_killed_mid_run_is_replaced_without_a_second_pod(
    control_plane: ControlPlane,
    kubelet: FakeKubelet,
    site_operator: Callable[[], OperatorProcess],
    namespace: str,
    hub_state: HubState,
    hospitals: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = site_operator()
    site_claims(control_plane, kubelet, namespace, hospitals)
    path, run = write_run(tmp_path / "hub", run_document("restart"))
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(participation(run)))
    bare = BareSite(hub_state, run, hospitals / "hospital-2")
    hold = held_after_round_one(monkeypatch, tmp_path)
    with Hub(hub_state, path, tmp_path / "hub" / "work") as hub, bare:
        wait_held(hub, first)
        wait_participation(
            control_plane, namespace, "study", lambda b: run_round(b) == 1,
            timeout=60, what="round 1 reported", op=first,
        )  # fmt: skip
        before = {
            p["metadata"]["name"]: p["metadata"]["uid"]
            for p in client_pods(control_plane, namespace)
        }
        assert sorted(before) == ["study-client-0", "study-client-1"]
        first.stop(signal.SIGKILL)
        second = site_operator()  # waits for the dead one's Lease to lapse, then leads
        seen = get_participation(control_plane, namespace, "study")["status"]["lastSeen"]
        wait_participation(
            control_plane, namespace, "study",
            lambda b: (b.get("status") or {}).get("lastSeen", "") > seen,
            timeout=60, what="a pass of the new operator", op=second,
        )  # fmt: skip
        after = {
            p["metadata"]["name"]: p["metadata"]["uid"]
            for p in client_pods(control_plane, namespace)
        }
        assert after == before  # the same two pods: none made again, none added
        hold.unlink()
        hub.ended(240)
        done = wait_participation(
            control_plane, namespace, "study", phase("Succeeded", "Failed"),
            timeout=60, what="its end", op=second,
        )  # fmt: skip
    second.stop()  # releases the Lease for the next test's operator
    assert hub.error is None and hub.result is not None and hub.result.rounds_completed == 3
    assert done["status"]["phase"] == "Succeeded" and done["status"]["clients"]["restarts"] == 0
    assert "created Pod" not in second.log.read_text()


def test_an_approval_withdrawn_mid_run_stops_the_sites_clients_and_the_run_goes_on(
    control_plane: ControlPlane,
    kubelet: FakeKubelet,
    operator: OperatorProcess,
    namespace: str,
    hub_state: HubState,
    hospitals: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    site_claims(control_plane, kubelet, namespace, hospitals)
    document = run_document("withdrawn", clients={"count": 3, "quorum": 1})
    document["spec"]["failurePolicy"]["roundTimeoutSeconds"] = 10
    path, run = write_run(tmp_path / "hub", document)
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(participation(run)))
    bare = BareSite(hub_state, run, hospitals / "hospital-2")
    hold = held_after_round_one(monkeypatch, tmp_path)
    with Hub(hub_state, path, tmp_path / "hub" / "work") as hub, bare:
        wait_held(hub, operator)
        control_plane.kubectl(
            "-n", namespace, "patch", "participation", "study", "--type=merge",
            "-p", json.dumps({"spec": {"withdrawn": True}}),
        )  # fmt: skip
        withdrawn = wait_participation(
            control_plane, namespace, "study",
            lambda b: phase("Withdrawn")(b) and not client_pods(control_plane, namespace),
            timeout=90, what="Withdrawn with no pod left", op=operator,
        )  # fmt: skip
        assert [e["site"] for e in hub.events("site_withdrew")] == [SITE]
        hold.unlink()
        hub.ended(240)
    status = withdrawn["status"]
    assert status["reason"] == "Withdrawn" and status["reported"]["verdict"] == "Withdrawn"
    # The run applied its dropout policy (quorum 1): it went on with the bare site's client.
    assert hub.error is None and hub.result is not None, hub.error
    assert hub.result.phase == "Succeeded" and hub.result.rounds_completed == 3
    rounds = hub.events("round")
    assert [r["participants"] for r in rounds] == [3, 1, 1]


def test_an_invalid_participation_is_refused_at_apply_naming_each_field(
    control_plane: ControlPlane, operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    _, run = write_run(tmp_path, run_document("invalid"))
    # What the CRD's schema cannot refuse: the API server takes the name and keeps the fields.
    body = participation(run, name="bad.name", withdrawm=True, images=["evil:latest"])
    answer = control_plane.kubectl(
        "apply", "-n", namespace, "-f", "-", input=json.dumps(body), check=False
    )
    assert answer.returncode != 0
    for words in (
        "metadata.name: 'bad.name' must be a DNS label",
        "spec.withdrawm: unknown field",
        "spec.images: ['evil:latest'] is not allowed",
    ):
        assert words in answer.stderr, answer.stderr
    assert client_pods(control_plane, namespace) == []


def test_a_participation_deleted_mid_run_tells_the_hub_before_it_goes(
    control_plane: ControlPlane,
    kubelet: FakeKubelet,
    operator: OperatorProcess,
    namespace: str,
    hub_state: HubState,
    hospitals: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    site_claims(control_plane, kubelet, namespace, hospitals)
    document = run_document("deleted", clients={"count": 3, "quorum": 1})
    document["spec"]["failurePolicy"]["roundTimeoutSeconds"] = 10
    path, run = write_run(tmp_path / "hub", document)
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(participation(run)))
    bare = BareSite(hub_state, run, hospitals / "hospital-2")
    hold = held_after_round_one(monkeypatch, tmp_path)
    with Hub(hub_state, path, tmp_path / "hub" / "work") as hub, bare:
        wait_held(hub, operator)
        held = get_participation(control_plane, namespace, "study")
        assert held["metadata"]["finalizers"] == ["fedcore.dev/tell-the-hub"]
        control_plane.kubectl("-n", namespace, "delete", "participation", "study", "--wait=false")
        deadline = time.monotonic() + 60
        while True:
            try:
                get_participation(control_plane, namespace, "study")
            except ApiException as exc:
                assert exc.status == 404
                break
            assert time.monotonic() < deadline, operator.tail()
            time.sleep(0.5)
        assert [e["site"] for e in hub.events("site_withdrew")] == [SITE]
        deadline = time.monotonic() + 60
        while client_pods(control_plane, namespace):  # collected with their owner
            assert time.monotonic() < deadline, client_pods(control_plane, namespace)
            time.sleep(0.5)
        hold.unlink()
        hub.ended(240)
    assert hub.error is None and hub.result is not None and hub.result.phase == "Succeeded"
    assert [r["participants"] for r in hub.events("round")] == [3, 1, 1]


def test_lppa_peer_links_reach_the_clusters_pods_through_the_hubs_relay_and_the_operator(
    control_plane: ControlPlane,
    operator: OperatorProcess,
    namespace: str,
    hub_state: HubState,
    tmp_path: Path,
) -> None:
    """lppa over a complete graph of three clients, two in the cluster: every link to a
    cluster client is relayed by the hub to the site's operator, which splices it to the
    client pod's peer port; the other site's client answers its own."""
    document = yaml.safe_load((ROOT / "examples" / "digits-lppa.yaml").read_text())
    document["metadata"]["name"] = "lppa-cluster"
    spec = document["spec"]
    spec["clients"] = {"count": 3}
    spec["protocol"]["lppa"]["topology"] = {"kind": "KRegular", "degree": 2}
    spec["protocol"]["lppa"]["secureNoise"] = False
    spec["rounds"] = 3
    spec["evaluation"] = {"everyRounds": 3}
    spec["checkpoint"] = {"everyRounds": 0}
    spec["sites"] = [{"name": SITE, "clients": 2}, {"name": BARE, "clients": 1}]
    path, run = write_run(tmp_path / "hub", document)
    body = participation(run, floor={"protocols": ["lppa"]})
    del body["spec"]["data"]  # the run's data is the Digits set, split by client index
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
    with Hub(hub_state, path, tmp_path / "hub" / "work") as hub, BareSite(hub_state, run, None):
        hub.ended(240)
    assert hub.error is None and hub.result is not None, (hub.error, operator.tail())
    assert hub.result.phase == "Succeeded" and hub.result.rounds_completed == 3
    assert hub.serve.endpoint is not None
    relayed = hub.serve.endpoint.metrics.registry.get_sample_value(
        "fedcore_hub_connections_total", {"run": "lppa-cluster", "route": "relay"}
    )
    assert relayed is not None and relayed >= 3 * 2  # each client's two out-links at least
    assert "A dial-back for" not in operator.log.read_text()  # none failed at the operator
    pods = {p["metadata"]["name"]: p for p in client_pods(control_plane, namespace)}
    assert sorted(pods) == ["study-client-0", "study-client-1"]

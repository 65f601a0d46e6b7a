"""One reconcile pass over one Participation, decided without the API or the hub.

``plan`` is a pure function, as the run operator's is: it takes the Participation as the API
server returned it, what the hub last answered about the run (or why it did not), the
verdict of the site's review of that run, the objects the Participation owns and the time,
and returns the ordered steps and the status patch. The rules:

- Not enrolled at the hub: nothing is made (phase Pending, reason NotEnrolled).
- Withdrawn (``spec.withdrawn``): the client pods are deleted and the hub is told once
  (phase Withdrawn).
- The hub unreachable: whatever runs keeps running (the clients retry on their own); phase
  Unreachable while client pods are still running, with condition HubReachable False. The
  hub serving no run, or another one: phase Pending (reason RunNotServed).
- A refused review (a digest other than the approved one, the privacy floor, an image not on
  the allow-list, a protocol a Kubernetes site cannot run yet): the client pods are deleted
  and the hub is told once per digest and reason (phase Refused).
- An approved run: the client pods' ServiceAccount, the hub's manifest, the site's binding
  and the NetworkPolicy are made (drifted fields patched back), then each client's
  certificate is asked for (a key made here, its request signed by the hub: a step the
  applier carries out) and its pod made; the hub is told of the approval once per digest.
  A failed client pod is made again while the hub's run goes on, at most
  ``MAX_CLIENT_RESTARTS`` times in all (then phase Failed, BackoffLimitExceeded). Once the
  hub reports its run ended, no pod is made and the phase follows the hub's.

Pods are found by name and label, so an operator restarted mid-run makes no duplicate.
Every Participation carries the finalizer ``FINALIZER`` (added at its first pass): deleting
one tells the hub of the withdrawal before it goes (``deletion``), as ``withdrawn`` does.
"""

from __future__ import annotations

import base64
import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from fedcore.errors import FedcoreError, SpecError
from fedcore.sites.participation import ParticipationSpec, image_allowed
from fedcore.sites.policy import SiteRefused, review
from fedcore.spec import FederatedRun, parse_manifest, spec_digest
from fedcore.spec._loading import load_document
from fedcore.transport import certificate_facts
from fedcore_operator.conditions import (
    differs,
    format_rfc3339,
    parse_rfc3339,
    pod_phase,
    pod_ready,
    set_condition,
    terminating,
)
from fedcore_operator.plan import CreateObjects, DeletePod, Note, PatchObject
from fedcore_operator.settings import OperatorSettings
from fedcore_operator.site import objects as site_objects
from fedcore_operator.site.objects import SiteContext

Object = dict[str, Any]
FINALIZER = "fedcore.dev/tell-the-hub"
"""Kept on a Participation until the hub has been told that a deleted approval is withdrawn."""
DELETION_GIVE_UP_SECONDS = 120
"""How long a deleted Participation waits for an unreachable hub before it goes untold."""
MAX_CLIENT_RESTARTS = 3
"""Failed client pods made again per Participation before it fails."""
STOP_GRACE_SECONDS = 30
UPDATABLE = {"ConfigMap": ("data",), "NetworkPolicy": ("spec",)}


# ------------------------------------------------------------------------------------ input


@dataclass(frozen=True)
class Offer:
    """The hub's answer about the run it serves (``GET /v1/run``)."""

    name: str
    manifest: str
    digest: str
    run_ca: str
    clients: tuple[int, ...]
    status: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_answer(cls, answer: Mapping[str, Any]) -> Offer:
        """Reads the hub's JSON answer (its fields checked for type)."""
        status = answer.get("status")
        return cls(
            name=str(answer["name"]),
            manifest=str(answer["manifest"]),
            digest=str(answer["digest"]),
            run_ca=str(answer["runCa"]),
            clients=tuple(int(index) for index in answer.get("clients", [])),
            status=dict(status) if isinstance(status, dict) else {},
        )


@dataclass(frozen=True)
class Verdict:
    """The site's review of an offered run against one Participation.

    Attributes:
        approved: whether the site's clients may run it.
        reason: why not (one CamelCase word), when refused.
        message: the review's words.
        digest: the digest of the offered run's spec, as the site computed it.
        run: the offered run, parsed (None when its manifest did not parse).
    """

    approved: bool
    reason: str
    message: str
    digest: str
    run: FederatedRun | None = None


@dataclass(frozen=True)
class HubProblem:
    """Why the hub gave no offer: ``Unreachable``, ``NoRun``, ``Revoked`` or its reason."""

    reason: str
    message: str


@dataclass(frozen=True)
class SiteObserved:
    """Everything one pass knows about one Participation.

    Attributes:
        body: the Participation as the API server returned it (not being deleted).
        now: the time of the pass (timezone-aware UTC).
        settings: the operator's settings.
        hub: the hub endpoint's ``host:port``.
        site: the site's name once enrolled; None before.
        enrollment: why the site is not enrolled (when ``site`` is None).
        offer: the hub's run, when the hub answered with one.
        problem: why there is no offer (None when there is one).
        verdict: the review of ``offer`` against this Participation (None without offer).
        hub_addresses: the CIDRs the client pods may reach the hub at.
        relay_from: NetworkPolicy peers of the site's operator (relays to the client pods).
        pods: the Participation's pods as listed.
        owned: its other objects as listed, by kind (Secret, ConfigMap, ServiceAccount,
            NetworkPolicy).
    """

    body: Object
    now: datetime.datetime
    settings: OperatorSettings
    hub: str
    site: str | None
    enrollment: str = ""
    offer: Offer | None = None
    problem: HubProblem | None = None
    verdict: Verdict | None = None
    hub_addresses: tuple[str, ...] = ()
    relay_from: tuple[Object, ...] = ()
    pods: Sequence[Object] = ()
    owned: Mapping[str, Sequence[Object]] = field(default_factory=dict)


# ------------------------------------------------------------------------------------ steps


@dataclass(frozen=True)
class IssueClientCertificates:
    """Make a key for each of these clients, have the hub sign its request, and create (or,
    for ``renew``, replace the data of) its TLS Secret."""

    context: SiteContext
    indices: tuple[int, ...]
    run_ca: str
    renew: bool = False


@dataclass(frozen=True)
class IssueClientKeys:
    """Draw a checkpoint key for each of these clients (a decentralized protocol's, which keep
    their own checkpoints) and create its Secret; one that exists is never replaced."""

    context: SiteContext
    indices: tuple[int, ...]


@dataclass(frozen=True)
class ReportToHub:
    """Tell the hub the site's verdict on the run (``/v1/run/approval``, ``refusal`` or
    ``withdrawal``); the status patch records it only once the hub took it."""

    run: str
    verdict: Literal["Approved", "Refused", "Withdrawn"]
    reason: str = ""
    message: str = ""


SiteStep = (
    CreateObjects
    | PatchObject
    | DeletePod
    | IssueClientCertificates
    | IssueClientKeys
    | ReportToHub
    | Note
)


@dataclass(frozen=True)
class SitePlan:
    """What one pass decided: steps in order, then the status patch (None: unchanged)."""

    steps: tuple[SiteStep, ...]
    phase: str
    status_patch: Object | None


# ----------------------------------------------------------------------------------- review


def review_offer(
    spec: ParticipationSpec, site: str, offer: Offer, settings: OperatorSettings
) -> Verdict:
    """Reviews the hub's run against a Participation, as a site's policy file is reviewed
    (:func:`fedcore.sites.policy.review`: the approved digest, the client count, the privacy
    floor), plus what a Kubernetes site adds: the image allow-list."""
    try:
        run = parse_manifest(load_document(offer.manifest, source="the hub's manifest"))
    except (SpecError, FedcoreError, ValueError) as exc:
        return Verdict(False, "InvalidRun", f"The hub's manifest does not parse: {exc}", "")
    digest = spec_digest(run)
    name = run.metadata.name
    if name != spec.run:
        return Verdict(
            False, "OtherRun", f"The hub serves run {name!r}, not {spec.run!r}.", digest, run
        )
    try:
        review(spec.policy(site), run)
    except SiteRefused as exc:
        return Verdict(False, exc.reason, str(exc), digest, run)
    image = run.spec.roles.clients.image or settings.image
    if not image_allowed(image, spec.images, settings.image):
        return Verdict(
            False,
            "ImageNotAllowed",
            f"Run {name!r} runs its clients in image {image!r}, which spec.images does not "
            f"allow (allowed: the operator's own image {settings.image!r}"
            + (f" and {', '.join(spec.images)}" if spec.images else "")
            + ").",
            digest,
            run,
        )
    return Verdict(True, "Approved", f"Run {name!r} ({digest}) is approved.", digest, run)


# ------------------------------------------------------------------------------------- plan


def plan(observed: SiteObserved) -> SitePlan:
    """Decides one pass over one Participation (see the module's rules)."""
    return _SitePlanner(observed).decide()


class _SitePlanner:
    def __init__(self, observed: SiteObserved) -> None:
        self.o = observed
        meta = observed.body["metadata"]
        self.name: str = meta["name"]
        self.namespace: str = meta["namespace"]
        self.generation: int | None = meta.get("generation")
        self.status: Object = dict(observed.body.get("status") or {})
        self.now = format_rfc3339(observed.now)
        self.steps: list[SiteStep] = []
        self.conditions: list[Object] = list(self.status.get("conditions") or [])
        self.new: Object = {}

    # ------------------------------------------------------------------ helpers

    def condition(self, type_: str, status: bool, reason: str, message: str) -> None:
        self.conditions = set_condition(
            self.conditions, type_, status, reason, message, self.generation, self.now
        )

    def live_pods(self) -> list[Object]:
        return [pod for pod in self.o.pods if not terminating(pod)]

    def stop_pods(self, grace: int = STOP_GRACE_SECONDS) -> None:
        for pod in self.live_pods():
            if pod_phase(pod) not in ("Succeeded", "Failed"):
                self.steps.append(DeletePod(pod["metadata"]["name"], grace))

    def report(
        self,
        verdict: Literal["Approved", "Refused", "Withdrawn"],
        reason: str = "",
        message: str = "",
        digest: str = "",
    ) -> None:
        done = self.status.get("reported") or {}
        wanted = {"verdict": verdict, "digest": digest}
        if reason and verdict == "Refused":
            wanted["reason"] = reason
        if all(done.get(key) == value for key, value in wanted.items()):
            self.new["reported"] = done
            return
        self.steps.append(ReportToHub(self.spec_run, verdict, reason, message))
        self.new["reported"] = wanted

    @property
    def spec_run(self) -> str:
        return str((self.o.body.get("spec") or {}).get("run", ""))

    def finish(self, phase: str, reason: str, message: str) -> SitePlan:
        status: Object = {
            "phase": phase,
            "reason": reason,
            "message": message,
            "observedGeneration": self.generation,
            "conditions": self.conditions,
            **self.new,
        }
        if self.o.site is not None:
            status["site"] = self.o.site
        for key in ("run", "lastSeen", "reported", "digest", "clients"):
            if key not in status and key in self.status:
                status[key] = self.status[key]
        patch = None if not differs(status, self.status) else {"status": status}
        return SitePlan(tuple(self.steps), phase, patch)

    # ------------------------------------------------------------------ decide

    def decide(self) -> SitePlan:
        finalizers = list(self.o.body["metadata"].get("finalizers") or [])
        if FINALIZER not in finalizers:
            self.steps.append(
                PatchObject(
                    "Participation",
                    self.name,
                    {"metadata": {"finalizers": [*finalizers, FINALIZER]}},
                )
            )
        try:
            spec = ParticipationSpec.model_validate(self.o.body.get("spec") or {})
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            self.stop_pods()  # an approval that no longer reads is no approval
            return self.finish("Failed", "InvalidSpec", f"spec.{where}: {first['msg']}")
        if self.o.site is None:
            self.condition("Enrolled", False, "NotEnrolled", self.o.enrollment)
            return self.finish("Pending", "NotEnrolled", self.o.enrollment)
        self.condition("Enrolled", True, "Enrolled", f"Site {self.o.site} joined the hub.")
        if self.o.offer is not None:
            self.condition("HubReachable", True, "Answered", f"The hub at {self.o.hub} answered.")
            self.new["lastSeen"] = self.now
            if self.o.offer.name == spec.run:
                self.new["run"] = _hub_run_status(self.o.offer.status)
        elif self.o.problem is not None:
            self.condition("HubReachable", False, self.o.problem.reason, self.o.problem.message)
        if spec.withdrawn:
            self.stop_pods()
            if self.o.offer is not None and self.o.offer.name == spec.run:
                self.report(
                    "Withdrawn",
                    message="The site withdrew its approval.",
                    digest=self.o.verdict.digest if self.o.verdict else self.o.offer.digest,
                )
            self.condition("Approved", False, "Withdrawn", "spec.withdrawn is true.")
            self.count_clients(self.o.offer)
            return self.finish("Withdrawn", "Withdrawn", "The site withdrew its approval.")
        if self.o.offer is None:
            problem = self.o.problem or HubProblem("Unreachable", "The hub did not answer.")
            self.count_clients(None)
            previous = str(self.status.get("phase") or "Pending")
            if previous in ("Succeeded", "Failed", "Refused", "Withdrawn"):
                return self.finish(
                    previous,
                    str(self.status.get("reason") or ""),
                    str(self.status.get("message") or ""),
                )
            if problem.reason == "Revoked":
                self.stop_pods()
                return self.finish("Failed", "Revoked", problem.message)
            total = int((self.status.get("clients") or {}).get("total", 0))
            done = [p for p in self.live_pods() if pod_phase(p) == "Succeeded"]
            if total and len(done) == total:
                # The hub stops answering once its run ends; the clients ended it with it.
                return self.finish(
                    "Succeeded",
                    "ClientsFinished",
                    f"All {total} client pods finished the run; the hub no longer serves it.",
                )
            running = [p for p in self.live_pods() if pod_phase(p) not in ("Succeeded", "Failed")]
            if problem.reason == "Unreachable" and running:
                return self.finish("Unreachable", problem.reason, problem.message)
            return self.finish("Pending", problem.reason, problem.message)
        offer = self.o.offer
        if offer.name != spec.run:
            return self.finish(
                "Pending",
                "RunNotServed",
                f"The hub serves run {offer.name!r}, not {spec.run!r}; waiting for it.",
            )
        verdict = self.o.verdict
        assert verdict is not None, "an offer comes with its review"
        self.new["digest"] = verdict.digest
        if not verdict.approved or verdict.run is None:
            self.stop_pods()
            self.condition("Approved", False, verdict.reason, verdict.message)
            self.report("Refused", verdict.reason, verdict.message, verdict.digest)
            self.count_clients(offer)
            return self.finish("Refused", verdict.reason, verdict.message)
        self.condition("Approved", True, "Approved", verdict.message)
        self.report("Approved", digest=verdict.digest)
        ctx = SiteContext(
            name=self.name,
            namespace=self.namespace,
            uid=self.o.body["metadata"]["uid"],
            spec=spec,
            site=self.o.site,
            hub=self.o.hub,
            run=verdict.run,
            manifest=offer.manifest,
            settings=self.o.settings,
            relay_from=self.o.relay_from,
        )
        return self.run_clients(ctx, offer, verdict.digest)

    def count_clients(self, offer: Offer | None) -> None:
        pods = self.live_pods()
        known = int((self.status.get("clients") or {}).get("total", len(pods)))
        self.new["clients"] = {
            "total": len(offer.clients) if offer is not None else known,
            "ready": sum(1 for pod in pods if pod_ready(pod)),
            "succeeded": sum(1 for pod in pods if pod_phase(pod) == "Succeeded"),
            "restarts": int((self.status.get("clients") or {}).get("restarts", 0)),
        }

    # ------------------------------------------------------------------ approved

    def run_clients(self, ctx: SiteContext, offer: Offer, digest: str) -> SitePlan:
        hub_phase = str(offer.status.get("phase") or "Running")
        ended = hub_phase in ("Succeeded", "Failed")
        names = {site_objects.client_pod_name(self.name, index): index for index in ctx.clients}
        live = [pod for pod in self.live_pods() if pod["metadata"]["name"] in names]
        restarts = int((self.status.get("clients") or {}).get("restarts", 0))
        self.new["clients"] = {
            "total": len(names),
            "ready": sum(1 for pod in live if pod_ready(pod)),
            "succeeded": sum(1 for pod in live if pod_phase(pod) == "Succeeded"),
            "restarts": restarts,
        }
        gave_up = (
            self.status.get("reason") == "BackoffLimitExceeded"
            and self.status.get("digest") == digest
        )
        failed = [pod["metadata"]["name"] for pod in live if pod_phase(pod) == "Failed"]
        if gave_up or (failed and not ended and restarts + len(failed) > MAX_CLIENT_RESTARTS):
            # Terminal for this digest: a new approval (another digest) starts afresh.
            self.stop_pods()
            return self.finish(
                "Failed",
                "BackoffLimitExceeded",
                str(self.status.get("message") or "")
                if gave_up
                else f"Client pods {', '.join(sorted(failed))} failed, with "
                f"{MAX_CLIENT_RESTARTS} restarts spent.",
            )
        if not ended:
            self.ensure_static(ctx, digest)
            self.ensure_certificates(ctx, offer)
            self.ensure_keys(ctx, digest)
            create: list[Object] = []
            pods = {pod["metadata"]["name"]: pod for pod in self.o.pods}
            for name, index in names.items():
                pod = pods.get(name)
                if pod is None:
                    create.append(site_objects.client_pod(ctx, index, digest))
                elif pod_phase(pod) == "Failed" and not terminating(pod):
                    restarts += 1
                    self.steps.append(DeletePod(name, 0))
                    self.steps.append(
                        Note(
                            f"Client pod {name} failed; made again ({restarts} of "
                            f"{MAX_CLIENT_RESTARTS}).",
                            warning=True,
                        )
                    )
            if create:
                self.steps.append(CreateObjects(tuple(create)))
            self.new["clients"]["restarts"] = restarts
        ready, total = self.new["clients"]["ready"], len(names)
        self.condition(
            "ClientsReady",
            ready == total,
            "AllReady" if ready == total else "NotAllReady",
            f"{ready} of {total} client pods are ready.",
        )
        if hub_phase == "Succeeded":
            return self.finish("Succeeded", "RunSucceeded", "The hub's run succeeded.")
        if hub_phase == "Failed":
            reason = str(offer.status.get("reason") or "RunFailed")
            return self.finish("Failed", reason, f"The hub's run failed ({reason}).")
        return self.finish("Running", "Approved", f"{ready} of {total} client pods are ready.")

    def ensure_certificates(self, ctx: SiteContext, offer: Offer) -> None:
        """A certificate for each client that has none; a new one for each whose certificate
        is another run's or past half its life."""
        secrets = {s["metadata"]["name"]: s for s in self.o.owned.get("Secret", [])}
        missing, stale = [], []
        for index in ctx.clients:
            secret = secrets.get(site_objects.client_tls_name(self.name, index))
            if secret is None:
                missing.append(index)
            elif _stale(secret, offer.run_ca, self.o.now):
                stale.append(index)
        if missing:
            self.steps.append(IssueClientCertificates(ctx, tuple(missing), offer.run_ca))
        if stale:
            self.steps.append(IssueClientCertificates(ctx, tuple(stale), offer.run_ca, renew=True))

    def ensure_keys(self, ctx: SiteContext, digest: str) -> None:
        """A checkpoint key for each client that has none, for a decentralized protocol."""
        if not ctx.run_context(digest).decentralized:
            return
        secrets = {s["metadata"]["name"] for s in self.o.owned.get("Secret", [])}
        missing = tuple(
            index
            for index in ctx.clients
            if site_objects.client_keys_name(self.name, index) not in secrets
        )
        if missing:
            self.steps.append(IssueClientKeys(ctx, missing))

    def ensure_static(self, ctx: SiteContext, digest: str) -> None:
        built = [
            site_objects.service_account(ctx),
            site_objects.manifest_config_map(ctx),
            site_objects.binding_secret(ctx, digest),
            site_objects.network_policy(ctx, list(self.o.hub_addresses), digest),
        ]
        create = []
        for obj in built:
            kind, name = obj["kind"], obj["metadata"]["name"]
            found = next(
                (o for o in self.o.owned.get(kind, []) if o["metadata"]["name"] == name), None
            )
            if found is None:
                create.append(obj)
                continue
            for key in UPDATABLE.get(kind, ()):
                if differs(obj[key], found.get(key)):
                    self.steps.append(PatchObject(kind, name, {key: obj[key]}))
            if kind == "Secret" and _decoded(found) != obj["stringData"]:
                # The binding follows the approval: a new digest, data or floor.
                self.steps.append(PatchObject(kind, name, {"stringData": obj["stringData"]}))
        if create:
            self.steps.append(CreateObjects(tuple(create)))


def _decoded(secret: Object) -> dict[str, str]:
    """A listed Secret's data as text."""
    return {
        key: base64.b64decode(value).decode(errors="replace")
        for key, value in (secret.get("data") or {}).items()
    }


def _hub_run_status(status: Mapping[str, Any]) -> Object:
    """The hub's words on its run, only the fields the status schema has, typed."""
    found: Object = {}
    for key, kind in (("phase", str), ("reason", str), ("round", int), ("rounds", int)):
        value = status.get(key)
        if isinstance(value, kind) and not isinstance(value, bool):
            found[key] = value
    epsilon = status.get("epsilon")
    if isinstance(epsilon, int | float) and not isinstance(epsilon, bool):
        found["epsilon"] = float(epsilon)
    return found


def _stale(secret: Object, run_ca: str, now: datetime.datetime) -> bool:
    """Whether a client's certificate must be made again: another run's (another CA), or
    past half its life."""
    ca = _decoded(secret).get("ca.crt")
    if ca is not None and ca.strip() != run_ca.strip():
        return True
    return _past_half_life(secret, now)


def _past_half_life(secret: Object, now: datetime.datetime) -> bool:
    """Whether the client certificate in ``secret`` has passed half its life."""
    encoded = (secret.get("data") or {}).get("tls.crt")
    if not encoded:
        return False
    try:
        _, _, start, end = certificate_facts(base64.b64decode(encoded))
    except (ValueError, FedcoreError):
        return True
    return now >= start + (end - start) / 2


KINDS = ("Pod", "Secret", "ConfigMap", "ServiceAccount", "NetworkPolicy")
"""The kinds a pass lists, by the Participation's label."""


def deletion(
    body: Object, now: datetime.datetime, offer: Offer | None, problem: HubProblem | None
) -> tuple[SiteStep, ...]:
    """The steps for a Participation being deleted: tell the hub it is withdrawn (when the
    hub was told it approved, and still serves that run), then drop ``FINALIZER``; the pods
    go with the Participation (owner references). An unreachable hub is given
    ``DELETION_GIVE_UP_SECONDS`` before the Participation goes untold."""
    meta = body["metadata"]
    finalizers = list(meta.get("finalizers") or [])
    if FINALIZER not in finalizers:
        return ()
    remaining = [name for name in finalizers if name != FINALIZER]
    release = PatchObject("Participation", meta["name"], {"metadata": {"finalizers": remaining}})
    reported = (body.get("status") or {}).get("reported") or {}
    run = str((body.get("spec") or {}).get("run", ""))
    served = offer is not None and offer.name == run
    unreachable = offer is None and (problem is None or problem.reason == "Unreachable")
    if reported.get("verdict") != "Approved" or not (served or unreachable):
        return (release,)  # nothing to withdraw, or the hub no longer serves the run
    if served:
        tell = ReportToHub(run, "Withdrawn", message="The site deleted its Participation.")
        return (tell, release)
    since = parse_rfc3339(str(meta.get("deletionTimestamp")))
    if (now - since).total_seconds() >= DELETION_GIVE_UP_SECONDS:
        note = Note(
            f"Participation {meta['name']} is deleted; the hub did not answer for "
            f"{DELETION_GIVE_UP_SECONDS} s, so it was not told of the withdrawal.",
            warning=True,
        )
        return (note, release)
    return ()

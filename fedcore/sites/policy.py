"""A site's policy: the runs it approved, each with its clients, data and privacy floor.

A site (``spec.sites``) runs some of a run's clients on its own machine. Before they train, it
reviews the run the hub sends against its own policy file (``load_policy``, ``review``): the
run must be one it approved, by name and by the digest of its spec (``spec_digest``), give the
site the clients it approved, find each client's data in the site's own binding when the
manifest leaves data to the sites, and keep within the approval's privacy floor
(``floor_check``). While the run goes on, a ``RoundGuard`` checks every task the server sends:
the spec it says it runs, the round, and the epsilon that round would bring.

Every refusal is a ``SiteRefused`` with a short machine reason and a message for both the
site's and the hub's people, naming the site, the run, the value asked and the site's limit,
and never a data path (the hub sees it).

Epsilon is the run's own privacy ledger's (``fedcore.privacy.PrivacyLedger``): the same
accountant, adjacency and sampling, at the run's delta.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from fedcore.errors import FedcoreError, SpecError, SpecIssue
from fedcore.privacy import PrivacyLedger
from fedcore.spec import (
    PROTOCOL_FACTS,
    FederatedRun,
    FederatedRunSpec,
    PrivacySpec,
    protocol_facts,
    spec_digest,
)
from fedcore.spec._base import SpecModel
from fedcore.spec._data import ClientSourceSpec
from fedcore.spec._loading import load_document, read_manifest_bytes
from fedcore.spec._sites import SITE_NAME_PATTERN
from fedcore.spec._validate import issues_from_pydantic

__all__ = [
    "Approval",
    "PolicyError",
    "PrivacyFloor",
    "RefusalReason",
    "RoundGuard",
    "SiteData",
    "SitePolicy",
    "SiteRefused",
    "floor_check",
    "load_policy",
    "planned_epsilon",
    "review",
    "spec_digest",
]

RefusalReason = Literal[
    "NotApproved",
    "SpecChanged",
    "ClientCount",
    "Protocol",
    "Epsilon",
    "Delta",
    "NoiseMultiplier",
    "SecureAggregation",
    "NoDataBinding",
    "RoundLimit",
]
"""Why a site refuses a run or a round (``SiteRefused.reason``)."""

_DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
_RUN_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


# ----------------------------------------------------------------------------------- models


class PrivacyFloor(SpecModel):
    """The least privacy a site accepts for a run it approved."""

    protocols: list[str] = Field(
        min_length=1,
        description="protocols lists the protocols the site accepts (spec.protocol.name), "
        "e.g. [dp-fedavg]. Required; at least one.",
    )
    max_epsilon: float | None = Field(
        None,
        gt=0,
        description="maxEpsilon is the most epsilon the site accepts at delta: the run's "
        "planned epsilon (its targetEpsilon, or the epsilon its rounds spend if that is less) "
        "must not pass it, and the site's clients stop taking part in a round that would. A "
        "protocol that claims no differential privacy is refused. Unset: no epsilon limit.",
    )
    delta: float = Field(
        1e-5,
        gt=0,
        lt=1,
        description="delta at which maxEpsilon is meant: the run's spec.privacy.targetDelta "
        "must not be larger. Default 1e-5.",
    )
    min_noise_multiplier: float | None = Field(
        None,
        ge=0,
        description="minNoiseMultiplier is the least Gaussian noise multiplier per round "
        "the site accepts (the protocol's, relative to one client's contribution bound); a "
        "protocol that adds none is refused. Unset: no limit.",
    )
    secure_aggregation: bool = Field(
        False,
        description="secureAggregation, when true, requires a protocol whose server learns "
        "only the sum of the clients' updates (secagg); a run of any other protocol is "
        "refused. Default false.",
    )

    @field_validator("protocols")
    @classmethod
    def _known_protocols(cls, protocols: list[str]) -> list[str]:
        unknown = [name for name in protocols if name not in PROTOCOL_FACTS]
        if unknown:
            known = ", ".join(sorted(PROTOCOL_FACTS))
            raise ValueError(f"unknown protocol {unknown[0]!r}; known protocols: {known}")
        return protocols


class SiteData(SpecModel):
    """Where the site's own clients' data is: exactly one of template and sources.

    Client indices here are the site's own, 0 to clients - 1, whatever global indices the
    run gives them.
    """

    template: ClientSourceSpec | None = Field(
        None,
        description="template is one source for every client of the site, in which '{index}' "
        "becomes the client's index at the site (0 to clients - 1). A relative path is taken "
        "from the policy file's folder.",
    )
    sources: list[ClientSourceSpec] | None = Field(
        None,
        min_length=1,
        max_length=10_000,
        description="sources lists each of the site's clients' sources, by its index at the "
        "site (as many as the approval's clients). A relative path is taken from the policy "
        "file's folder.",
    )

    @model_validator(mode="after")
    def _template_or_list(self) -> SiteData:
        if (self.template is None) == (self.sources is None):
            raise ValueError("give exactly one of template and sources")
        return self

    def source_of(self, local_index: int) -> ClientSourceSpec:
        """The source of the site's client ``local_index`` (0 to clients - 1), its '{index}'
        replaced by ``local_index``.

        Raises:
            IndexError: ``local_index`` is negative, or ``sources`` has no entry for it.
        """
        if local_index < 0:
            raise IndexError(f"a site's client index is 0 or more, got {local_index}")
        if self.template is not None:
            return self.template.for_client(local_index)
        assert self.sources is not None
        if local_index >= len(self.sources):
            raise IndexError(
                f"the site binds {len(self.sources)} sources, none for its client {local_index}"
            )
        return self.sources[local_index].for_client(local_index)


class Approval(SpecModel):
    """One run the site approved: its spec, its clients at the site, their data, its floor."""

    run: str = Field(
        min_length=1,
        max_length=63,
        pattern=_RUN_NAME_PATTERN,
        description="run is the approved run's metadata.name. Required.",
    )
    spec_digest: str = Field(
        pattern=_DIGEST_PATTERN,
        description="specDigest is the digest of the approved run's spec, 'sha256:' and 64 "
        "hexadecimal digits (fedcore.sites.policy.spec_digest); any change to the spec "
        "needs a new approval. Required.",
    )
    clients: int = Field(
        ge=1,
        le=10_000,
        description="clients is how many of the run's clients the site runs (its entry in "
        "spec.sites). Required; at least 1.",
    )
    data: SiteData | None = Field(
        None,
        description="data binds the site's clients' own data; needed when the run's "
        "spec.data.clientData leaves each client's source to its site. Unset: no binding.",
    )
    floor: PrivacyFloor = Field(
        description="floor is the least privacy the site accepts for this run. Required."
    )

    @model_validator(mode="after")
    def _one_source_per_client(self) -> Approval:
        data = self.data
        if data is None:
            return self
        if data.sources is not None and len(data.sources) != self.clients:
            raise ValueError(
                f"data.sources lists {len(data.sources)} sources but clients is "
                f"{self.clients}: give one per client of the site"
            )
        if data.template is not None and self.clients > 1 and not data.template.mentions_index():
            raise ValueError(
                "data.template never mentions '{index}', so every client of the site would "
                "read the same data"
            )
        return self


class SitePolicy(SpecModel):
    """A site's policy file: the site's name and the runs it approved."""

    api_version: Literal["fedcore.dev/v1alpha1"] = Field(
        description="apiVersion must be fedcore.dev/v1alpha1."
    )
    kind: Literal["SitePolicy"] = Field(description="kind must be SitePolicy.")
    site: str = Field(
        pattern=SITE_NAME_PATTERN,
        description="site is the site's name, as in the runs' spec.sites: lowercase letters, "
        "digits and '-', starting with a letter, at most 40 characters. Required.",
    )
    approvals: list[Approval] = Field(
        description="approvals lists the runs the site approved, each run name at most once. "
        "Required; may be empty (the site approves nothing).",
    )

    @field_validator("approvals")
    @classmethod
    def _each_run_once(cls, approvals: list[Approval]) -> list[Approval]:
        first: dict[str, int] = {}
        for position, approval in enumerate(approvals):
            if approval.run in first:
                raise ValueError(
                    f"run {approval.run!r} is approved twice (approvals[{first[approval.run]}] "
                    f"and approvals[{position}]); a run name may appear once"
                )
            first[approval.run] = position
        return approvals

    def approval_of(self, run: str) -> Approval | None:
        """The approval of the run named ``run``, if any."""
        return next((approval for approval in self.approvals if approval.run == run), None)


# ---------------------------------------------------------------------------------- loading


class PolicyError(SpecError):
    """A site policy file is invalid; ``issues`` lists every problem with its field path."""

    def __init__(self, issues: list[SpecIssue], *, source: str | None = None) -> None:
        super().__init__(issues, source=source)
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {issue}" for issue in self.issues)
        self.args = (f"The SitePolicy{where} is invalid:\n{lines}",)


def load_policy(path: Path) -> SitePolicy:
    """Loads and validates a site's policy file.

    The YAML is read as a manifest is (``fedcore.spec._loading``: at most 1 MiB of UTF-8, one
    mapping, no duplicate keys, bounded nesting and aliases). Relative ``path`` and
    ``s3.credentialsPath`` of the data sources are made absolute from the file's folder, so
    the policy means the same from any working directory.

    Raises:
        PolicyError: (a ``SpecError``) listing every problem with its field path, e.g.
            ``approvals[0].floor.maxEpsilon``.
    """
    path = Path(path)
    label = str(path)
    try:
        document = load_document(read_manifest_bytes(path), source=label)
    except SpecError as exc:
        raise PolicyError(exc.issues, source=label) from None
    try:
        policy = SitePolicy.model_validate(document)
    except ValidationError as exc:
        raise PolicyError(issues_from_pydantic(exc, SitePolicy), source=label) from None
    return _paths_from(policy, path.resolve().parent)


def _paths_from(policy: SitePolicy, folder: Path) -> SitePolicy:
    """``policy`` with every relative local path of its data sources taken from ``folder``."""
    approvals = []
    for approval in policy.approvals:
        data = approval.data
        if data is not None:
            data = data.model_copy(
                update={
                    "template": None
                    if data.template is None
                    else _source_from(data.template, folder),
                    "sources": None
                    if data.sources is None
                    else [_source_from(source, folder) for source in data.sources],
                }
            )
        approvals.append(approval.model_copy(update={"data": data}))
    return policy.model_copy(update={"approvals": approvals})


def _source_from(source: ClientSourceSpec, folder: Path) -> ClientSourceSpec:
    if source.path is not None and not Path(source.path).is_absolute():
        return source.model_copy(update={"path": str(folder / source.path)})
    s3 = source.s3
    if s3 is None or s3.credentials_path is None or Path(s3.credentials_path).is_absolute():
        return source
    s3 = s3.model_copy(update={"credentials_path": str(folder / s3.credentials_path)})
    return source.model_copy(update={"s3": s3})


# ----------------------------------------------------------------------------------- digest


# ---------------------------------------------------------------------------------- refusal


class SiteRefused(FedcoreError):
    """A site refuses a run, or one round of it.

    Attributes:
        reason: the short machine reason (``RefusalReason``).
        site: the refusing site's name.
        run: the run's name.
    """

    def __init__(self, reason: RefusalReason, message: str, *, site: str, run: str) -> None:
        self.reason: RefusalReason = reason
        self.site = site
        self.run = run
        super().__init__(message)


def review(policy: SitePolicy, run: FederatedRun) -> Approval:
    """The site's approval of ``run``, if the run is what the site approved.

    Raises:
        SiteRefused: the first rule ``run`` breaks: no approval of its name (NotApproved),
            another spec digest (SpecChanged), spec.sites without this site or with another
            client count (ClientCount), data left to the sites but not bound by this one
            (NoDataBinding), then ``floor_check``'s rules.
    """
    site, name = policy.site, run.metadata.name
    approval = policy.approval_of(name)
    if approval is None:
        raise SiteRefused(
            "NotApproved",
            f"site {site!r} has not approved run {name!r}: its policy holds no approval of a "
            f"run of that name.",
            site=site,
            run=name,
        )
    digest = spec_digest(run)
    if digest != approval.spec_digest:
        raise _spec_changed(site, name, approval.spec_digest, digest)
    listed = {entry.name: entry.clients for entry in run.spec.sites or []}
    if site not in listed:
        raise SiteRefused(
            "ClientCount",
            f"run {name!r} does not list site {site!r} in spec.sites, so none of its clients "
            f"are the site's; site {site!r} approved it for {approval.clients} client(s).",
            site=site,
            run=name,
        )
    if listed[site] != approval.clients:
        raise SiteRefused(
            "ClientCount",
            f"run {name!r} gives site {site!r} {listed[site]} client(s) in spec.sites; site "
            f"{site!r} approved {approval.clients}.",
            site=site,
            run=name,
        )
    client_data = run.spec.data.client_data
    if client_data is not None and client_data.bound_by_sites and approval.data is None:
        raise SiteRefused(
            "NoDataBinding",
            f"run {name!r} leaves each client's data to its site (spec.data.clientData names "
            f"no source), but site {site!r}'s approval binds no data for its clients.",
            site=site,
            run=name,
        )
    floor_check(approval.floor, run, site=site)
    return approval


def _spec_changed(site: str, run: str, approved: str, now: str | None) -> SiteRefused:
    asked = "and the server names no spec digest" if now is None else f"now {now}"
    return SiteRefused(
        "SpecChanged",
        f"the run's spec changed after site {site!r} approved it (approved {approved}, "
        f"{asked}); a new approval is needed (run {run!r}).",
        site=site,
        run=run,
    )


def floor_check(floor: PrivacyFloor, run: FederatedRun, *, site: str) -> None:
    """Checks ``run`` against a site's privacy floor.

    Raises:
        SiteRefused: the first rule broken, in this order: a protocol the floor does not list
            (Protocol); with maxEpsilon, a protocol that claims no DP or adds no noise
            (Epsilon), a delta above the floor's (Delta), a planned epsilon above maxEpsilon
            (Epsilon); a noise multiplier below minNoiseMultiplier or none (NoiseMultiplier);
            secure aggregation required and not provided (SecureAggregation).
    """
    name, protocol = run.metadata.name, run.spec.protocol.name
    facts = protocol_facts(protocol)

    def refuse(reason: RefusalReason, message: str) -> SiteRefused:
        return SiteRefused(reason, message, site=site, run=name)

    if protocol not in floor.protocols:
        raise refuse(
            "Protocol",
            f"run {name!r} uses protocol {protocol!r}; site {site!r} accepts only "
            f"{', '.join(floor.protocols)}.",
        )
    if floor.max_epsilon is not None:
        limit = (
            f"site {site!r} allows at most epsilon {floor.max_epsilon:g} at delta {floor.delta:g}"
        )
        if not facts.claims_dp:
            raise refuse(
                "Epsilon",
                f"run {name!r} uses protocol {protocol!r}, which claims no differential "
                f"privacy; {limit}.",
            )
        delta = (run.spec.privacy or PrivacySpec()).target_delta
        if delta > floor.delta:
            raise refuse(
                "Delta",
                f"run {name!r} accounts its epsilon at delta {delta:g} (spec.privacy."
                f"targetDelta), above the delta {floor.delta:g} at which site {site!r} means "
                f"its limit of epsilon {floor.max_epsilon:g}.",
            )
        planned = planned_epsilon(run)
        if planned is None:
            raise refuse(
                "Epsilon",
                f"run {name!r} uses protocol {protocol!r} without noise, so it claims no "
                f"differential privacy; {limit}.",
            )
        if planned > floor.max_epsilon:
            target = (run.spec.privacy or PrivacySpec()).target_epsilon
            budget = "no targetEpsilon" if target is None else f"targetEpsilon {target:g}"
            raise refuse(
                "Epsilon",
                f"run {name!r} plans epsilon {planned:.4g} at delta {delta:g} ({run.spec.rounds} "
                f"rounds, {budget}); {limit}.",
            )
    if floor.min_noise_multiplier is not None:
        multiplier = _noise_multiplier(run)
        if multiplier is None:
            raise refuse(
                "NoiseMultiplier",
                f"run {name!r} uses protocol {protocol!r}, which adds no calibrated noise; "
                f"site {site!r} requires a noise multiplier of at least "
                f"{floor.min_noise_multiplier:g}.",
            )
        if multiplier < floor.min_noise_multiplier:
            raise refuse(
                "NoiseMultiplier",
                f"run {name!r} adds noise of multiplier {multiplier:.4g} per round; site "
                f"{site!r} requires at least {floor.min_noise_multiplier:g}.",
            )
    if floor.secure_aggregation and not facts.secure_aggregation:
        raise refuse(
            "SecureAggregation",
            f"run {name!r} uses protocol {protocol!r}, whose server sees each client's update "
            f"(or its encoding), not only their sum; site {site!r} requires secure "
            f"aggregation.",
        )


def planned_epsilon(run: FederatedRun) -> float | None:
    """The most epsilon ``run`` can spend, at its delta: the least of its targetEpsilon (the
    run stops before a round would pass it) and the epsilon its ``spec.rounds`` rounds spend
    by its privacy ledger. None when the protocol claims no DP or adds no noise."""
    multiplier = _noise_multiplier(run)
    if multiplier is None:
        return None
    spent = _epsilon_after(run.spec, multiplier, run.spec.rounds)
    assert spent is not None
    target = run.spec.privacy.target_epsilon if run.spec.privacy is not None else None
    return spent if target is None else min(target, spent)


def _noise_multiplier(run: FederatedRun) -> float | None:
    """The protocol's noise multiplier per round; None when it claims no DP."""
    if not protocol_facts(run.spec.protocol.name).claims_dp:
        return None
    # The protocols (and torch) are imported only for a protocol that claims DP.
    from fedcore.protocols import create_protocol

    return create_protocol(run.spec.protocol.name).noise_multiplier(run.spec)


def _epsilon_after(spec: FederatedRunSpec, noise_multiplier: float, rounds: int) -> float | None:
    """The epsilon the run's ledger reports after ``rounds`` rounds (0 for none).

    One step of ``rounds`` rounds is what ``rounds`` calls of ``record_round`` account (the
    accountant merges repeats), without an epsilon computed for each."""
    ledger = PrivacyLedger(spec, noise_multiplier)
    if not ledger.enabled or ledger.round_multiplier is None:
        return None
    if rounds > 0:
        ledger.accountant.step(
            noise_multiplier=ledger.round_multiplier,
            sample_rate=ledger.round_rate,
            steps=rounds,
        )
    return ledger.epsilon()


# ------------------------------------------------------------------------------- the rounds


class RoundGuard:
    """What a site's client checks before each task of an approved run.

    Args:
        run: the run as reviewed (``review``).
        approval: the site's approval of it.
        site: the site's name.
    """

    def __init__(self, run: FederatedRun, approval: Approval, site: str) -> None:
        self.run = run
        self.approval = approval
        self.site = site

    def check(self, round: int, spec_digest: str | None) -> None:
        """Checks one task: ``round`` (from 1) of the run the server says has ``spec_digest``.

        Raises:
            SiteRefused: the digest is not the approved one (SpecChanged), the round is past
                spec.rounds (RoundLimit), or the epsilon after it would pass the floor's
                maxEpsilon (Epsilon).
        """
        name = self.run.metadata.name
        if spec_digest != self.approval.spec_digest:
            raise _spec_changed(self.site, name, self.approval.spec_digest, spec_digest)
        if round > self.run.spec.rounds:
            raise SiteRefused(
                "RoundLimit",
                f"the server asks site {self.site!r} for round {round} of run {name!r}, which "
                f"has {self.run.spec.rounds} rounds (spec.rounds).",
                site=self.site,
                run=name,
            )
        if round > self.last_round:
            floor = self.approval.floor
            reached = self._epsilon(round)
            delta = (self.run.spec.privacy or PrivacySpec()).target_delta
            spends = (
                "claims no differential privacy"
                if reached is None
                else f"would bring epsilon to {reached:.4g} at delta {delta:g}"
            )
            raise SiteRefused(
                "Epsilon",
                f"round {round} of run {name!r} {spends}; site {self.site!r} allows at most "
                f"epsilon {floor.max_epsilon:g} at delta {floor.delta:g}, so its clients take "
                f"part up to round {self.last_round} only.",
                site=self.site,
                run=name,
            )

    @functools.cached_property
    def last_round(self) -> int:
        """The last round the site's clients take part in under maxEpsilon (spec.rounds
        without one); computed once, by bisection (epsilon grows with the rounds)."""
        rounds = self.run.spec.rounds
        if self.approval.floor.max_epsilon is None:
            return rounds
        low, high = 0, rounds  # epsilon after `low` rounds is within the limit
        if self._within(high):
            return high
        while high - low > 1:
            middle = (low + high) // 2
            if self._within(middle):
                low = middle
            else:
                high = middle
        return low

    @functools.cached_property
    def _multiplier(self) -> float | None:
        return _noise_multiplier(self.run)

    def _epsilon(self, rounds: int) -> float | None:
        if self._multiplier is None:
            return None
        return _epsilon_after(self.run.spec, self._multiplier, rounds)

    def _within(self, rounds: int) -> bool:
        limit = self.approval.floor.max_epsilon
        assert limit is not None
        spent = self._epsilon(rounds)
        return spent is not None and math.isfinite(spent) and spent <= limit

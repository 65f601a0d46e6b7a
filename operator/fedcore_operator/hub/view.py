"""What the hub knows of a run's sites, and the run's ``status.sites`` made from it (pure).

The hub's endpoint hears each site's calls: its enrollment, its verdict on the run (approved,
refused with a reason, withdrawn), how many of its clients are ready and done, and when it
last called. :class:`HubView` is that knowledge for one reconcile pass of one run;
:func:`site_statuses` turns it into the run's ``status.sites``, one entry per site of
``spec.sites``, keeping what an earlier pass wrote for whatever the hub has not heard since
(an operator restarted mid-run forgets nothing the status already says).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedcore.spec._sites import SiteSpec
from fedcore_operator.conditions import format_rfc3339, parse_rfc3339, set_condition

Object = dict[str, Any]
LINK_SECONDS = 60.0
"""A site that has not called the hub for this long has lost its link (sites call every few
seconds while they take part in a run)."""


@dataclass(frozen=True)
class SiteFacts:
    """What the hub heard from one site about one run (None: nothing yet)."""

    verdict: str | None = None
    """``Approved``, ``Refused`` or ``Withdrawn``."""
    reason: str = ""
    message: str = ""
    clients: Mapping[str, int] = field(default_factory=dict)
    """``total``, ``ready`` and ``succeeded``, as the site reported them."""


@dataclass(frozen=True)
class HubView:
    """The hub's side of one run, for one reconcile pass.

    Attributes:
        serving: whether the hub's endpoint serves this run (it serves one run at a time).
        holder: the run the endpoint serves (``namespace/name``) when it is another one.
        registry: each known site's registry state (``Invited``, ``Enrolled``,
            ``TokenExpired``, ``Revoked``).
        last_seen: when each site last called the hub (Unix time).
        facts: what each site said about this run.
    """

    serving: bool
    holder: str | None = None
    registry: Mapping[str, str] = field(default_factory=dict)
    last_seen: Mapping[str, float] = field(default_factory=dict)
    facts: Mapping[str, SiteFacts] = field(default_factory=dict)


def refusal(view: HubView) -> tuple[str, SiteFacts] | None:
    """The first site that refused the run at its review, with what it said."""
    for name, facts in sorted(view.facts.items()):
        if facts.verdict == "Refused":
            return name, facts
    return None


def site_statuses(
    sites: Sequence[SiteSpec],
    view: HubView,
    old: Sequence[Object],
    now: datetime.datetime,
    generation: int | None,
) -> list[Object]:
    """The run's ``status.sites``: per site, its registry state, its verdict, its clients
    (as it reports them), when it was last seen, and the conditions ``Enrolled``,
    ``Approved`` and ``Reachable`` with reasons."""
    before = {str(entry.get("name")): entry for entry in old if isinstance(entry, dict)}
    result = []
    for site in sites:
        previous = before.get(site.name) or {}
        entry: Object = {
            "name": site.name,
            "clients": site.clients,
            "state": view.registry.get(site.name, "Unknown"),
            "conditions": [dict(c) for c in previous.get("conditions") or []],
        }
        facts = view.facts.get(site.name)
        verdict = facts.verdict if facts is not None and facts.verdict else previous.get("approval")
        entry["approval"] = verdict or "Pending"
        if facts is not None and facts.verdict:
            entry["reason"], entry["message"] = facts.reason, facts.message
        elif previous.get("reason") is not None:
            entry["reason"], entry["message"] = previous.get("reason"), previous.get("message")
        counts = dict(previous.get("reported") or {})
        if facts is not None:
            counts.update(facts.clients)
        if counts:
            entry["reported"] = counts
        seen = view.last_seen.get(site.name)
        if seen is not None:
            entry["lastSeen"] = format_rfc3339(
                datetime.datetime.fromtimestamp(int(seen), datetime.UTC)
            )
        elif previous.get("lastSeen"):
            entry["lastSeen"] = previous["lastSeen"]
        _conditions(entry, now, generation)
        result.append(entry)
    return result


def _conditions(entry: Object, now: datetime.datetime, generation: int | None) -> None:
    stamp = format_rfc3339(now)

    def condition(type_: str, status: bool, reason: str, message: str) -> None:
        entry["conditions"] = set_condition(
            entry["conditions"], type_, status, reason, message, generation, stamp
        )

    state = entry["state"]
    condition(
        "Enrolled",
        state == "Enrolled",
        state,
        {
            "Enrolled": "The site holds a certificate of the hub.",
            "Invited": "The site was given a join token and has not used it yet.",
            "TokenExpired": "The site's join token expired unused; delete its join Secret "
            "for a new one.",
            "Revoked": "The hub revoked the site: its clients are refused.",
        }.get(state, "The hub's site list (hub.sites) does not name this site."),
    )
    approval = entry["approval"]
    if approval == "Approved":
        condition("Approved", True, "Approved", "The site's Participation approved this run.")
    else:
        condition(
            "Approved",
            False,
            str(entry.get("reason") or approval),
            str(
                entry.get("message")
                or {"Pending": "The site has not reviewed the run yet."}.get(approval, approval)
            ),
        )
    seen = entry.get("lastSeen")
    if seen is None:
        condition("Reachable", False, "NeverSeen", "The site has not called the hub.")
        return
    quiet = (now - parse_rfc3339(seen)).total_seconds()
    if quiet > LINK_SECONDS:
        condition(
            "Reachable", False, "LinkLost", f"The site has not called the hub for {int(quiet)} s."
        )
    else:
        condition("Reachable", True, "Calling", "The site calls the hub.")

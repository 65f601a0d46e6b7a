"""The sites a run's clients are spread over (spec.sites): who runs which clients."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from fedcore.spec._base import SpecModel

SITE_NAME_PATTERN = r"^[a-z]([a-z0-9-]{0,38}[a-z0-9])?$"
"""A site's name: a DNS label of at most 40 characters (it goes into certificate names)."""


class SiteSpec(SpecModel):
    """One site: an organization that runs some of the run's clients on its own machines."""

    name: str = Field(
        description="name of the site, as the hub admin registered it (fedcore site add): "
        "lowercase letters, digits and '-', at most 40 characters. Required.",
    )
    clients: int = Field(
        description="clients is how many of the run's clients this site runs. The sites "
        "take the client indices in the order listed: the first site's are 0 to clients - 1. "
        "Required; at least 1.",
        ge=1,
        le=10_000,
    )

    @field_validator("name")
    @classmethod
    def _dns_label(cls, name: str) -> str:
        if re.fullmatch(SITE_NAME_PATTERN, name) is None:
            raise ValueError(
                f"{name!r} is not a site name: lowercase letters, digits and '-', starting "
                "with a letter, at most 40 characters"
            )
        return name


def site_ranges(sites: list[SiteSpec]) -> dict[str, range]:
    """Each site's client indices, in the order the sites are listed."""
    ranges: dict[str, range] = {}
    start = 0
    for site in sites:
        ranges[site.name] = range(start, start + site.clients)
        start += site.clients
    return ranges

"""A site's say on Kubernetes: the Participation resource, in the site's own cluster.

A Participation approves one run of the hub the site joined and binds it to the site's things:
how many clients, their pods' resources and placement, their data (a PersistentVolumeClaim
or an S3 prefix whose credentials Secret stays in the site's namespace), the privacy floor,
and which images may run. The approval is bound to the run's spec digest, as a policy file's
is (:mod:`fedcore.sites.policy`); the site's operator reviews the hub's run against it with
the same code, and reconciles an approved Participation into the site's client pods.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from fedcore.sites.policy import (
    _DIGEST_PATTERN,
    _RUN_NAME_PATTERN,
    Approval,
    PrivacyFloor,
    SiteData,
    SitePolicy,
)
from fedcore.spec._base import SpecModel
from fedcore.spec._roles import ResourcesSpec, TolerationSpec
from fedcore.spec._status import Condition

KIND = "Participation"
PLURAL = "participations"
IMAGE_DIGEST = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")
"""An image named by its digest: ``registry/repository@sha256:<64 hex>``."""


class ClientPodsSpec(SpecModel):
    """The site's own placement and resources for its client pods (the hub's are ignored)."""

    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="resources of each client pod."
    )
    gpus: int = Field(
        0, ge=0, le=16, description="gpus is the number of nvidia.com/gpu per client pod."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="nodeSelector of the client pods. Default none."
    )
    tolerations: list[TolerationSpec] = Field(
        default_factory=list, description="tolerations of the client pods. Default none."
    )


class ParticipationSpec(SpecModel):
    """One run of the hub that the site approves, and the site's things it may use."""

    run: str = Field(
        min_length=1,
        max_length=63,
        pattern=_RUN_NAME_PATTERN,
        description="run is the name of the hub's run (its metadata.name). Required.",
    )
    spec_digest: str = Field(
        pattern=_DIGEST_PATTERN,
        description="specDigest is the digest of the approved run's spec ('sha256:' and 64 "
        "hexadecimal digits; `fedcore site review` prints it). The site's clients run only "
        "while the hub's run has this digest: any change to its spec needs a new approval. "
        "Required.",
    )
    clients: int = Field(
        ge=1,
        le=10_000,
        description="clients is how many of the run's clients the site runs; it must equal "
        "the site's entry in the run's spec.sites. Required.",
    )
    data: SiteData | None = Field(
        None,
        description="data binds each client to the site's own data: a template with "
        "'{index}' (the client's index at the site) or one source per client, each a "
        "volumeClaim (a PersistentVolumeClaim in this namespace, mounted read-only into that "
        "client's pod only) or an s3 prefix (its credentialsSecret a Secret in this "
        "namespace). Needed when the run leaves each client's source to its site.",
    )
    floor: PrivacyFloor = Field(
        description="floor is the least privacy the site accepts for this run (as in a "
        "policy file). Required."
    )
    pods: ClientPodsSpec = Field(
        default_factory=ClientPodsSpec,
        description="pods sets the client pods' resources, GPUs, nodeSelector and "
        "tolerations; what the hub's manifest says of them is ignored.",
    )
    images: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="images lists the images the site lets its clients run: an image by "
        "digest (registry/repository@sha256:...), or a prefix ending in '/' (a registry or "
        "a repository folder). The image the hub's run names for its clients must match "
        "one; empty (default): only the site operator's own runtime image.",
    )
    withdrawn: bool = Field(
        False,
        description="withdrawn, when true, withdraws the approval: the site's clients are "
        "stopped and the hub is told; the run goes on without them if its dropout policy "
        "allows. Default false.",
    )

    @field_validator("images")
    @classmethod
    def _digest_or_prefix(cls, images: list[str]) -> list[str]:
        for image in images:
            if not (IMAGE_DIGEST.fullmatch(image) or (image.endswith("/") and "@" not in image)):
                raise ValueError(
                    f"{image!r} is neither an image by digest (registry/repository@sha256:<64 "
                    "hex digits>) nor a prefix ending in '/'"
                )
        return images

    def approval(self) -> Approval:
        """The approval a policy file would say for this run."""
        return Approval(
            run=self.run,
            spec_digest=self.spec_digest,
            clients=self.clients,
            data=self.data,
            floor=self.floor,
        )

    def policy(self, site: str) -> SitePolicy:
        """A policy of site ``site`` that approves this run only."""
        return SitePolicy(
            api_version="fedcore.dev/v1alpha1",
            kind="SitePolicy",
            site=site,
            approvals=[self.approval()],
        )


ParticipationPhase = Literal[
    "Pending", "Refused", "Running", "Succeeded", "Failed", "Withdrawn", "Unreachable"
]
"""Pending: not yet reviewed (the hub is not serving the run, the site is not enrolled).
Refused: the review refused the run (reason). Running: approved, client pods made.
Succeeded, Failed: the hub's run ended so (the site's clients with it). Withdrawn: the site
withdrew its approval. Unreachable: the hub has not answered for a while (pods are kept)."""


class ClientsStatus(SpecModel):
    """The site's client pods."""

    total: int = Field(0, description="total: the client pods the site runs for the run.")
    ready: int = Field(0, description="ready: those running and ready.")
    succeeded: int = Field(0, description="succeeded: those that exited 0.")
    restarts: int = Field(0, description="restarts: failed client pods made again.")


class HubRunStatus(SpecModel):
    """The hub's run, as the hub last reported it."""

    phase: str | None = Field(None, description="phase of the run at the hub.")
    reason: str | None = Field(None, description="reason the run ended, when it failed.")
    round: int | None = Field(None, description="round: rounds completed.")
    rounds: int | None = Field(None, description="rounds the run will do.")
    epsilon: float | None = Field(None, description="epsilon spent so far.")


class HubReport(SpecModel):
    """What the site last told the hub about the run."""

    verdict: Literal["Approved", "Refused", "Withdrawn"] = Field(description="verdict told.")
    digest: str = Field(description="digest of the spec it was about.")
    reason: str | None = Field(None, description="reason of a refusal.")


class ParticipationStatus(SpecModel):
    """What the site's operator observed of a Participation."""

    phase: ParticipationPhase | None = Field(None, description="phase of the participation.")
    reason: str | None = Field(None, description="reason for the phase, one CamelCase word.")
    message: str | None = Field(None, description="message for humans about the phase.")
    observed_generation: int | None = Field(
        None, description="observedGeneration: the spec generation this status is about."
    )
    site: str | None = Field(None, description="site: this cluster's site name at the hub.")
    digest: str | None = Field(None, description="digest of the hub's run spec last seen.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="conditions: Enrolled, HubReachable, Approved, ClientsReady.",
    )
    clients: ClientsStatus | None = Field(None, description="clients: the site's client pods.")
    run: HubRunStatus | None = Field(None, description="run: the hub's run as it reported it.")
    last_seen: str | None = Field(
        None, description="lastSeen: when the hub last answered (RFC 3339)."
    )
    reported: HubReport | None = Field(None, description="reported: what the hub was told.")


class Participation(SpecModel):
    """A whole Participation object, as the API server stores it."""

    api_version: Literal["fedcore.dev/v1alpha1"] = Field(
        description="apiVersion must be fedcore.dev/v1alpha1."
    )
    kind: Literal["Participation"] = Field(description="kind must be Participation.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="standard metadata.")
    spec: ParticipationSpec = Field(description="spec: the approval and what it binds.")
    status: ParticipationStatus | None = Field(None, description="status, set by the operator.")


def image_allowed(image: str, allowed: list[str], own_image: str) -> bool:
    """Whether a client pod may run ``image``: the site operator's own image always, else an
    entry of ``allowed`` that names it by digest or is a prefix of it."""
    if image == own_image:
        return True
    for entry in allowed:
        if entry.endswith("/"):
            if image.startswith(entry):
                return True
        elif image == entry:
            return True
    return False


__all__ = [
    "KIND",
    "PLURAL",
    "ClientPodsSpec",
    "ClientsStatus",
    "HubReport",
    "HubRunStatus",
    "Participation",
    "ParticipationPhase",
    "ParticipationSpec",
    "ParticipationStatus",
    "image_allowed",
]

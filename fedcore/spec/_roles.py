"""Per-role Kubernetes placement and resources of the kdc, server and client pods (spec.roles)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from fedcore.spec._base import SpecModel


class ResourcesSpec(SpecModel):
    """Kubernetes resource requests and limits of one role's pods."""

    requests: dict[str, str] = Field(
        default_factory=dict,
        description="requests maps a resource name (cpu, memory) to a quantity. Default none.",
    )
    limits: dict[str, str] = Field(
        default_factory=dict,
        description="limits maps a resource name (cpu, memory) to a quantity. Default none.",
    )


class TolerationSpec(SpecModel):
    """A Kubernetes toleration."""

    key: str | None = Field(None, description="key of the taint to tolerate.")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="operator of the match.")
    value: str | None = Field(None, description="value of the taint for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="effect to tolerate; unset tolerates every effect."
    )


class RoleSpec(SpecModel):
    """Placement and resources of one role's pods (Kubernetes only; ignored locally)."""

    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="resources of each pod of the role."
    )
    gpus: int = Field(
        0,
        ge=0,
        le=16,
        description="gpus is the number of nvidia.com/gpu per pod. Default 0. Locally, a role "
        "with gpus uses CUDA when torch sees it and the CPU otherwise.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="nodeSelector of the role's pods. Default none."
    )
    tolerations: list[TolerationSpec] = Field(
        default_factory=list, description="tolerations of the role's pods. Default none."
    )
    affinity: dict[str, Any] = Field(
        default_factory=dict,
        description="affinity of the role's pods, as in a Pod's spec.affinity. Default none.",
    )
    image: str | None = Field(
        None,
        min_length=1,
        max_length=512,
        description="image of the role's pods. Default: the operator's runtime image.",
    )
    pod_template: dict[str, Any] = Field(
        default_factory=dict,
        description="podTemplate is a partial Pod merged over what the operator builds for the "
        "role: metadata.labels and annotations are added, spec fields set, and containers (by "
        "name; the operator's is `fedcore`) merged field by field, their env, volumeMounts and "
        "ports by name, mountPath and containerPort. The security settings "
        "(non-root, read-only root filesystem, no privilege escalation) cannot be weakened. "
        "Default none.",
    )


class RolesSpec(SpecModel):
    """Per-role placement and resources."""

    kdc: RoleSpec = Field(default_factory=RoleSpec, description="kdc: the key server's pod.")
    server: RoleSpec = Field(default_factory=RoleSpec, description="server: the server's pod.")
    clients: RoleSpec = Field(default_factory=RoleSpec, description="clients: every client's pod.")

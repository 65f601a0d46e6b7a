"""The status of a FederatedRun: what the operator and the server report on Kubernetes.

The operator owns ``phase``, ``reason``, ``message``, ``conditions``, ``observedGeneration``,
``roles`` and the times; the server patches ``round``, ``privacy``, ``lastCheckpoint`` and
``finalMetrics`` as the run goes. The CRD declares this schema, so the API server prunes
any other status field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedcore.spec._base import SpecModel

Phase = Literal["Pending", "Running", "Succeeded", "Failed", "Suspended"]
PHASES: tuple[Phase, ...] = ("Pending", "Running", "Succeeded", "Failed", "Suspended")


class Condition(SpecModel):
    """One condition, as the Kubernetes API conventions define them."""

    type: str = Field(description="type of the condition, e.g. ServerReady or Complete.")
    status: Literal["True", "False", "Unknown"] = Field(description="status of the condition.")
    reason: str = Field("", description="reason: one CamelCase word for machines.")
    message: str = Field("", description="message for humans.")
    last_transition_time: str | None = Field(
        None, description="lastTransitionTime: when status last changed (RFC 3339)."
    )
    observed_generation: int | None = Field(
        None, description="observedGeneration the condition was computed from."
    )


class RoleCounts(SpecModel):
    """How many pods of one role exist and in which state."""

    desired: int = Field(0, description="desired number of pods.")
    running: int = Field(0, description="running pods.")
    ready: int = Field(0, description="ready pods.")
    succeeded: int = Field(0, description="pods that exited 0.")
    failed: int = Field(0, description="pods that failed (each recreated one counts once).")


class RolesStatus(SpecModel):
    """Pod counts per role."""

    kdc: RoleCounts = Field(default_factory=RoleCounts, description="the KDC's pod.")
    server: RoleCounts = Field(default_factory=RoleCounts, description="the server's pod.")
    clients: RoleCounts = Field(default_factory=RoleCounts, description="the client pods.")


class PrivacyStatus(SpecModel):
    """Privacy spent so far, for protocols that claim differential privacy."""

    epsilon: float | None = Field(None, description="epsilon spent so far.")
    delta: float | None = Field(None, description="delta of the accounting.")
    target_epsilon: float | None = Field(None, description="targetEpsilon: the budget, if any.")
    adjacency: Literal["AddRemove", "ReplaceOne"] | None = Field(
        None,
        description="adjacency epsilon holds under: AddRemove (one client's data added or "
        "removed: every client takes part every round) or ReplaceOne (replaced: a sample of "
        "the clients each round).",
    )
    amplification: Literal["None", "SamplingWithoutReplacement"] | None = Field(
        None,
        description="amplification epsilon claims from the client sample: None (every client, "
        "or a public seeded sample) or SamplingWithoutReplacement (a secret sample, "
        "spec.clients.sampling Secret).",
    )


class CheckpointStatus(SpecModel):
    """The latest complete checkpoint."""

    round: int = Field(description="round the checkpoint was taken after.")
    location: str = Field(description="location: the checkpoint's folder or S3 URL.")
    time: str | None = Field(None, description="time it was written (RFC 3339).")


class ClassCount(SpecModel):
    """The examples of one label the clients scored, and those right."""

    total: int = Field(description="total examples of the label scored.")
    correct: int = Field(description="correct: those the model got right.")


class FinalMetrics(SpecModel):
    """What the finished run reports."""

    accuracy: float | None = Field(
        None,
        description="accuracy on the held-out examples (spec.evaluation.where: the server's "
        "split, or the clients' own, their counts summed).",
    )
    loss: float | None = Field(None, description="loss on the held-out examples.")
    evaluated_examples: int | None = Field(
        None, description="evaluatedExamples the clients scored (clients' evaluation only)."
    )
    per_class: list[ClassCount] | None = Field(
        None,
        description="perClass: per label, in spec.data.schema.labels order, the examples the "
        "clients scored and those right (spec.evaluation.perClass).",
    )
    server_accuracy: float | None = Field(
        None, description="serverAccuracy on the server's split (spec.evaluation.where Both)."
    )
    rounds_completed: int | None = Field(None, description="roundsCompleted by the run.")
    wall_seconds: float | None = Field(None, description="wallSeconds the server ran.")


class ServerOutcome(SpecModel):
    """How the server process ended, as it reported itself."""

    phase: Literal["Succeeded", "Failed"] = Field(description="phase the server ended in.")
    reason: str = Field(description="reason, e.g. RoundsCompleted, BudgetExhausted, QuorumLost.")
    message: str | None = Field(None, description="message of a failure.")
    retriable: bool | None = Field(
        None, description="retriable: whether a recreated server pod may get past the failure."
    )


class PodFailure(SpecModel):
    """One failed pod the operator saw (status.failures keeps the latest 10)."""

    time: str = Field(description="time the operator saw it failed (RFC 3339).")
    pod: str = Field(description="pod: its name.")
    role: str = Field(description="role: kdc, server or client.")
    exit_code: int | None = Field(None, description="exitCode of its fedcore container.")
    reason: str = Field("", description="reason the kubelet gave (e.g. OOMKilled, Error).")
    action: Literal["Recreated", "RunFailed"] = Field(
        description="action: Recreated (within backoffLimit) or RunFailed (the run ended)."
    )


MAX_FAILURES = 10
"""How many failed pods status.failures keeps, the newest last."""


class SiteClientCounts(SpecModel):
    """A site's clients of the run, as the site reports them (the hub cannot check them)."""

    total: int | None = Field(None, description="total: the site's clients of the run.")
    ready: int | None = Field(None, description="ready: its client pods that are ready.")
    succeeded: int | None = Field(None, description="succeeded: its client pods that are done.")


class SiteRunStatus(SpecModel):
    """One site of a run at sites (spec.sites), as the hub's endpoint knows it."""

    name: str = Field(description="name of the site.")
    clients: int = Field(description="clients the run has at the site.")
    state: str = Field(
        description="state of the site in the hub's registry: Invited, Enrolled, "
        "TokenExpired, Revoked, or Unknown (not on the hub's site list)."
    )
    approval: Literal["Pending", "Approved", "Refused", "Withdrawn"] = Field(
        description="approval: the site's last word on this run."
    )
    reason: str | None = Field(None, description="reason the site gave for a refusal.")
    message: str | None = Field(None, description="message the site gave.")
    reported: SiteClientCounts | None = Field(
        None, description="reported: the site's clients, as the site reports them."
    )
    last_seen: str | None = Field(
        None, description="lastSeen: when the site last called the hub (RFC 3339)."
    )
    conditions: list[Condition] = Field(
        default_factory=list, description="conditions: Enrolled, Approved and Reachable."
    )


class FederatedRunStatus(SpecModel):
    """status of a FederatedRun, written by fedcore on Kubernetes."""

    phase: Phase | None = Field(None, description="phase of the run.")
    reason: str | None = Field(None, description="reason for the phase, one CamelCase word.")
    message: str | None = Field(None, description="message for humans about the phase.")
    observed_generation: int | None = Field(
        None, description="observedGeneration: the spec generation the operator last acted on."
    )
    conditions: list[Condition] = Field(default_factory=list, description="conditions of the run.")
    round: int | None = Field(None, description="round: rounds completed so far.")
    rounds: int | None = Field(None, description="rounds the run will do.")
    progress: str | None = Field(None, description='progress as "round/rounds".')
    privacy: PrivacyStatus | None = Field(None, description="privacy spent.")
    last_checkpoint: CheckpointStatus | None = Field(
        None, description="lastCheckpoint: the latest complete checkpoint."
    )
    roles: RolesStatus | None = Field(None, description="roles: pod counts per role.")
    restarts: int | None = Field(
        None, description="restarts: failed pods recreated so far (bounded by backoffLimit)."
    )
    failures: list[PodFailure] = Field(
        default_factory=list,
        description="failures: the latest failed pods (at most 10, the newest last), each with "
        "its exit code, the kubelet's reason and what the operator did.",
    )
    final_metrics: FinalMetrics | None = Field(
        None, description="finalMetrics of the finished run."
    )
    outcome: ServerOutcome | None = Field(
        None, description="outcome the server reported when it stopped."
    )
    start_time: str | None = Field(None, description="startTime of the run (RFC 3339).")
    completion_time: str | None = Field(None, description="completionTime of the run (RFC 3339).")
    active_seconds: float | None = Field(
        None,
        description="activeSeconds the run ran before its current stretch (suspended time "
        "excluded); the deadline counts this plus the time since activeSince.",
    )
    active_since: str | None = Field(
        None, description="activeSince: when the current unsuspended stretch began (RFC 3339)."
    )
    sites: list[SiteRunStatus] = Field(
        default_factory=list,
        description="sites of a run at sites (spec.sites): each one's enrollment, approval, "
        "clients and link, as the hub's endpoint knows them.",
    )

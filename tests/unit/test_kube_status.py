"""What the server writes into its run's status, event by event (pure mapping)."""

from __future__ import annotations

from fedcore.observe.kube_status import merge, status_patch
from fedcore.spec import parse_manifest

RUN = parse_manifest(
    {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "FederatedRun",
        "metadata": {"name": "demo"},
        "spec": {
            "protocol": {"name": "dp-fedavg"},
            "clients": {"count": 4},
            "rounds": 10,
            "privacy": {"targetEpsilon": 8.0, "targetDelta": 1e-5},
        },
    }
)


def test_round_events_set_progress_and_epsilon() -> None:
    patch = status_patch(RUN, {"event": "round", "round": 3, "epsilon": 1.25, "time": 0})
    assert patch == {"round": 3, "rounds": 10, "progress": "3/10", "privacy": {"epsilon": 1.25}}


def test_ready_after_resume_reports_the_restored_round_and_budget() -> None:
    patch = status_patch(RUN, {"event": "ready", "start_round": 6, "time": 0})
    assert patch["round"] == 5 and patch["progress"] == "5/10"
    assert patch["privacy"] == {"delta": 1e-5, "targetEpsilon": 8.0}


def test_checkpoint_finished_and_failed_events() -> None:
    checkpoint = status_patch(
        RUN, {"event": "checkpoint", "round": 4, "location": "s3://b/p/round-4", "time": 0}
    )
    assert checkpoint == {
        "lastCheckpoint": {
            "round": 4,
            "location": "s3://b/p/round-4",
            "time": "1970-01-01T00:00:00Z",
        }
    }
    finished = status_patch(
        RUN,
        {
            "event": "finished",
            "accuracy": 0.9,
            "loss": 0.3,
            "rounds_completed": 10,
            "reason": "RoundsCompleted",
            "epsilon": 2.0,
            "time": 0,
        },
    )
    assert finished["finalMetrics"] == {"accuracy": 0.9, "loss": 0.3, "roundsCompleted": 10}
    assert finished["outcome"] == {"phase": "Succeeded", "reason": "RoundsCompleted"}
    fatal = status_patch(RUN, {"event": "failed", "reason": "RecoveryFailed", "message": "m"})
    assert fatal["outcome"]["retriable"] is False
    transient = status_patch(RUN, {"event": "failed", "reason": "QuorumLost", "message": "m"})
    assert transient["outcome"]["retriable"] is True
    lost = status_patch(RUN, {"event": "failed", "reason": "PeerLost", "message": "m"})
    assert lost["outcome"]["retriable"] is True  # the operator restarts every pod
    sites = [{"name": "a", "clients": 2}, {"name": "b", "clients": 2}]
    at_sites = RUN.model_copy(update={"spec": RUN.spec.model_copy(update={"sites": sites})})
    lost_there = status_patch(at_sites, {"event": "failed", "reason": "PeerLost", "message": "m"})
    assert lost_there["outcome"]["retriable"] is False  # the sites' pods are not its to restart
    assert status_patch(RUN, {"event": "progress"}) == {}


def test_merge_coalesces_nested_patches() -> None:
    pending = {"round": 1, "privacy": {"epsilon": 0.5, "delta": 1e-5}}
    merge(pending, {"round": 2, "privacy": {"epsilon": 0.7}})
    assert pending == {"round": 2, "privacy": {"epsilon": 0.7, "delta": 1e-5}}


def test_ready_reports_what_epsilon_bounds_with_or_without_a_budget() -> None:
    # Prepare: the server's ready event carries its ledger's claim.
    claim = {"adjacency": "ReplaceOne", "amplification": "SamplingWithoutReplacement"}
    without_budget = parse_manifest(
        {
            "apiVersion": "fedcore.dev/v1alpha1",
            "kind": "FederatedRun",
            "metadata": {"name": "demo"},
            "spec": {"protocol": {"name": "dp-fedavg"}, "clients": {"count": 4}, "rounds": 10},
        }
    )
    # Execute
    with_budget = status_patch(RUN, {"event": "ready", "start_round": 1, "time": 0, **claim})
    bare = status_patch(without_budget, {"event": "ready", "start_round": 1, "time": 0, **claim})
    # Assert
    assert with_budget["privacy"] == {"delta": 1e-5, "targetEpsilon": 8.0, **claim}
    assert bare["privacy"] == claim

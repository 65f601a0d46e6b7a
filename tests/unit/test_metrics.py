"""The metrics catalogue: names, labels and the docs that list them."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from fedcore.observe.metrics import RoleMetrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def exported_names(metrics: RoleMetrics) -> set[str]:
    names = set()
    for family in metrics.registry.collect():
        for sample in family.samples:
            if not sample.name.endswith(("_created", "_bucket", "_count", "_sum")):
                names.add(sample.name)
    return names


def test_role_metrics_every_exported_name_is_documented() -> None:
    # Prepare
    metrics = RoleMetrics("run-a", "server")
    metrics.rejected("malformed", sender="client-0")
    # Execute
    names = exported_names(metrics) | {
        "fedcore_round_duration_seconds",
        "fedcore_checkpoint_duration_seconds",
    }
    text = DOC.read_text(encoding="utf-8")
    # Assert
    assert all(name.startswith("fedcore_") for name in names)
    missing = sorted(name for name in names if f"`{name}`" not in text)
    assert missing == []


def test_role_metrics_labels_are_bounded_to_run_role_and_reason() -> None:
    # Prepare
    metrics = RoleMetrics("run-a", "client")
    metrics.count_bytes(100, 50)
    metrics.rejected("stale")
    # Execute
    labels = {
        key
        for family in metrics.registry.collect()
        for sample in family.samples
        for key in sample.labels
    }
    # Assert
    assert labels <= {"run", "role", "reason", "le", "version"}


def test_a_sender_is_named_only_once_it_was_refused() -> None:
    # Prepare
    metrics = RoleMetrics("run-c", "server")
    metrics.rejected("stale")  # no sender known
    # Execute
    before = generate_latest(metrics.registry).decode()
    metrics.rejected("bound", sender="client-3")
    metrics.rejected("bound", sender="client-3")
    after = generate_latest(metrics.registry).decode()
    # Assert
    assert 'sender="' not in before
    assert (
        'fedcore_rejected_messages_by_sender_total{reason="bound",role="server",run="run-c",'
        'sender="client-3"} 2.0'
    ) in after
    assert 'fedcore_rejected_messages_total{reason="bound",role="server",run="run-c"} 2.0' in after
    assert after.count('sender="') == 2  # the counter and its _created sample, one sender


def test_role_metrics_counts_bytes_and_rejections_in_exposition() -> None:
    # Prepare
    metrics = RoleMetrics("run-b", "server")
    # Execute
    metrics.count_bytes(1000, 250)
    metrics.rejected("upload")
    metrics.rejected("upload")
    text = generate_latest(metrics.registry).decode()
    # Assert
    assert 'fedcore_bytes_sent_total{role="server",run="run-b"} 1000.0' in text
    assert 'fedcore_bytes_received_total{role="server",run="run-b"} 250.0' in text
    assert 'fedcore_rejected_messages_total{reason="upload",role="server",run="run-b"} 2.0' in text

"""A pod's events kept in the checkpoint store (fedcore/roles/_history.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedcore.checkpoint import LocalObjectStore
from fedcore.errors import CheckpointError
from fedcore.observe.events import EventLog
from fedcore.roles._history import HISTORY_FOLDER, StoreHistory, attempt_name, read_history


def test_an_attempts_events_reach_the_store_at_each_checkpoint_and_at_the_end(
    tmp_path: Path,
) -> None:
    store = LocalObjectStore(tmp_path / "store")
    history = StoreHistory(store, attempt="20261126T070000Z-1")
    events = EventLog(None, listeners=[history])
    events.emit("ready", role="server", start_round=1)
    events.emit("round", round=1)
    file = tmp_path / "store" / HISTORY_FOLDER / "20261126T070000Z-1.jsonl"
    assert not file.exists()  # nothing worth a write yet
    events.emit("checkpoint", round=1, location="round-00000001")
    assert [json.loads(line)["event"] for line in file.read_text().splitlines()] == [
        "ready",
        "round",
        "checkpoint",
    ]
    events.emit("round", round=2)  # lost if the pod dies now: after the last checkpoint
    assert len(file.read_text().splitlines()) == 3
    events.close()  # the attempt ends: everything is written
    assert len(file.read_text().splitlines()) == 4
    # A second attempt (the replaced pod) has a file of its own; both read back in order.
    second = StoreHistory(store, attempt="20261126T070500Z-7")
    second({"event": "ready", "time": 1.0, "start_round": 2})
    second({"event": "finished", "time": 2.0, "reason": "RoundsCompleted"})
    (tmp_path / "store" / HISTORY_FOLDER / "20261126T070500Z-7.jsonl").open("a").write("{torn")
    attempts = read_history(store)
    assert list(attempts) == ["20261126T070000Z-1", "20261126T070500Z-7"]
    assert [event["event"] for event in attempts["20261126T070500Z-7"]] == ["ready", "finished"]


class RefusingStore(LocalObjectStore):
    def put(self, key: str, data: bytes) -> None:
        raise CheckpointError("the store is down")

    def child(self, name: str) -> RefusingStore:
        return RefusingStore(self.root / name)


def test_a_store_that_refuses_never_stops_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    history = StoreHistory(RefusingStore(tmp_path), attempt="a")
    history({"event": "checkpoint", "time": 0.0, "round": 1})  # logged, not raised
    assert "Could not keep this attempt's events" in caplog.text
    assert "the store is down" in caplog.text


def test_attempt_names_sort_by_start_time() -> None:
    import datetime as dt

    early = attempt_name(dt.datetime(2026, 11, 26, 7, 0, 0, tzinfo=dt.UTC))
    late = attempt_name(dt.datetime(2026, 11, 26, 7, 0, 1, tzinfo=dt.UTC))
    assert early.startswith("20261126T070000Z-") and early < late

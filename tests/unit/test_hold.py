"""The server's hold point for fault-injection tests (fedcore/roles/_hold.py)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from fedcore.errors import RunAborted
from fedcore.observe.events import EventLog
from fedcore.roles._hold import FILE_VARIABLE, ROUND_VARIABLE, HoldPoint


def events_in(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_without_both_variables_it_does_nothing(tmp_path: Path) -> None:
    # Prepare: a hold file that exists, but only one of the two variables set
    (tmp_path / "hold").touch()
    log = tmp_path / "events.jsonl"
    for environ in ({ROUND_VARIABLE: "1"}, {FILE_VARIABLE: str(tmp_path / "hold")}, {}):
        hold = HoldPoint(EventLog(log), environ)
        # Execute: would wait forever (300 s) if it held
        hold.after_round(1)
        # Assert
        assert hold.points == {}
    assert events_in(log) == []


def test_it_holds_only_after_its_round_and_until_the_file_is_gone(tmp_path: Path) -> None:
    # Prepare
    flag, log = tmp_path / "hold", tmp_path / "events.jsonl"
    flag.touch()
    hold = HoldPoint(EventLog(log), {ROUND_VARIABLE: "2", FILE_VARIABLE: str(flag)})
    hold.after_round(1)  # not its round: returns at once, with no event
    assert events_in(log) == []

    def release_once_held() -> None:
        while not events_in(log):
            threading.Event().wait(0.01)
        flag.unlink()

    releaser = threading.Thread(target=release_once_held)
    releaser.start()
    # Execute
    hold.after_round(2)
    releaser.join()
    # Assert: it announced the hold first, and returned only once the file was gone
    assert [(e["event"], e["round"]) for e in events_in(log)] == [("held", 2)]
    assert not flag.exists()


def test_several_points_hold_in_turn_each_on_its_own_file(tmp_path: Path) -> None:
    # Prepare: two points; only the second one's file exists
    log = tmp_path / "events.jsonl"
    template = str(tmp_path / "hold-{point}")
    (tmp_path / "hold-3.2").touch()
    hold = HoldPoint(EventLog(log), {ROUND_VARIABLE: "1.0, 3.2", FILE_VARIABLE: template})
    assert hold.points == {(1, 0): tmp_path / "hold-1.0", (3, 2): tmp_path / "hold-3.2"}
    # Execute: the first point's file is gone, so it passes at once; stage 1 is no point
    hold.after_stage(1, 0)
    hold.after_stage(1, 1)
    hold.after_round(1)

    def release_once_held_twice() -> None:
        while len(events_in(log)) < 2:
            threading.Event().wait(0.01)
        (tmp_path / "hold-3.2").unlink()

    releaser = threading.Thread(target=release_once_held_twice)
    releaser.start()
    hold.after_stage(3, 2)
    releaser.join()
    # Assert
    held = [(e["round"], e["stage"]) for e in events_in(log)]
    assert held == [(1, 0), (3, 2)]


@pytest.mark.parametrize("value", ["one", "0", "-1", "1.x", "0.1", "1.-1", "1,x", "2.1,"])
def test_a_round_that_is_not_a_round_number_is_a_named_error(tmp_path: Path, value: str) -> None:
    with pytest.raises(RunAborted, match=f"{ROUND_VARIABLE}='{value}' is not a list of round"):
        HoldPoint(EventLog(None), {ROUND_VARIABLE: value, FILE_VARIABLE: str(tmp_path / "h")})

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
        assert hold.path is None
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


@pytest.mark.parametrize("value", ["one", "0", "-1", "1.x", "0.1", "1.-1"])
def test_a_round_that_is_not_a_round_number_is_a_named_error(tmp_path: Path, value: str) -> None:
    with pytest.raises(RunAborted, match=f"{ROUND_VARIABLE}='{value}' is not a round number"):
        HoldPoint(EventLog(None), {ROUND_VARIABLE: value, FILE_VARIABLE: str(tmp_path / "h")})

"""Ctrl-C stops every role; `--simulate` gives the process run's result in one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration._runs import fedcore, last_json, write_manifest

pytestmark = pytest.mark.integration


def descendants(root: int) -> set[int]:
    """Every live process below ``root``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("spawn", ["fork", "exec"])
def test_ctrl_c_stops_every_role_and_exits_130(tmp_path: Path, spawn: str) -> None:
    # Prepare
    manifest = write_manifest(
        tmp_path / "run.yaml", rounds=100_000, clients={"count": 2}, checkpoint={"everyRounds": 0}
    )
    work = tmp_path / "work"
    runner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedcore",
            "run",
            str(manifest),
            "--json",
            "--quiet",
            "--workdir",
            str(work),
            "--spawn",
            spawn,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As from a terminal: a shell running this suite in the background makes its children
        # ignore SIGINT, and Python keeps an inherited "ignore" (no KeyboardInterrupt at all).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        _interrupt_and_check(runner, work)
    finally:
        if runner.poll() is None:  # never leave a 100,000-round run behind
            runner.kill()
            runner.communicate()


def _interrupt_and_check(runner: subprocess.Popen[str], work: Path) -> None:
    deadline = time.monotonic() + 180
    events = work / "events.jsonl"
    while time.monotonic() < deadline and not (events.exists() and '"round"' in events.read_text()):
        assert runner.poll() is None, runner.communicate()
        time.sleep(0.1)
    roles = descendants(runner.pid)
    # Execute
    runner.send_signal(signal.SIGINT)
    stdout, stderr = runner.communicate(timeout=60)
    # Assert
    assert runner.returncode == 130, stderr
    assert "interrupted (Ctrl-C)" in stderr
    assert json.loads(stdout.strip().splitlines()[-1])["reason"] == "Interrupted"
    assert len(roles) >= 3  # server and two clients (and, with fork, the forkserver)
    time.sleep(0.5)
    assert [pid for pid in roles if alive(pid)] == []


def test_simulate_gives_the_same_accuracy_as_the_process_run(tmp_path: Path) -> None:
    # Prepare
    manifest = write_manifest(tmp_path / "run.yaml", rounds=3)
    # Execute
    simulated = fedcore("run", str(manifest), "--simulate", "--json", cwd=tmp_path)
    real = fedcore(
        "run", str(manifest), "--json", "--quiet", "--workdir", str(tmp_path / "w"), cwd=tmp_path
    )
    # Assert
    assert simulated.returncode == 0 and real.returncode == 0, simulated.stderr + real.stderr
    assert last_json(simulated.stdout)["mode"] == "simulation"
    assert last_json(simulated.stdout)["accuracy"] == last_json(real.stdout)["accuracy"]
    assert not (tmp_path / "runs").exists()  # a simulation starts no roles and writes no run

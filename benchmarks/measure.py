"""Shared measuring helpers: whole-process-tree memory with a guard, load, and the machine."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import platform
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_ASSETS = ROOT / "docs" / "benchmarks"


def _process_table() -> dict[int, tuple[int, int]]:
    """Every process's (parent pid, session id), from /proc."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            table[int(entry)] = (int(fields[1]), int(fields[3]))
        except (OSError, IndexError, ValueError):
            continue
    return table


def _pss(pid: int) -> int:
    """The proportional set size of one process in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds ``pid`` has used, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    # Fields after the command name: state is field 3, utime 14 and stime 15 (proc(5)).
    return (int(fields[11]) + int(fields[12])) / _TICKS


def tree_members(roots: Iterable[int]) -> set[int]:
    """The pids under ``roots`` or in their sessions (see ``tree_pss``)."""
    wanted = set(roots)
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    stack = [pid for pid, (_, sid) in table.items() if sid in wanted or pid in wanted]
    members: set[int] = set()
    while stack:
        pid = stack.pop()
        if pid not in members:
            members.add(pid)
            stack.extend(children.get(pid, []))
    return members


def tree_pss(roots: Iterable[int]) -> tuple[int, int]:
    """Summed PSS and count of the processes under ``roots`` or in their sessions.

    A process counts when one of its ancestors is a root or when its session id is a root's
    pid (what ``start_new_session=True`` gives), so daemons that re-parent to init but stay in
    the session (Ray's) are counted too. PSS shares each page among the processes mapping it.
    """
    members = tree_members(roots)
    return sum(_pss(pid) for pid in members), len(members)


def mem_available() -> int:
    """The kernel's estimate of memory available to new work, in bytes."""
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class TreeSampler:
    """Samples the memory of a set of process trees in a thread; stops them past a guard.

    With ``count``, it also collects the pids of the processes whose command line contains
    that text (``seen``), e.g. how many ClientApp processes Flower started.

    Args:
        interval: seconds between samples.
        max_bytes: the summed PSS past which the guard trips.
        min_available: the machine's MemAvailable under which the guard trips (it protects the
            other work on a shared machine).
    """

    def __init__(
        self,
        *,
        interval: float = 0.1,
        max_bytes: int | None = None,
        min_available: int | None = None,
        count: str | None = None,
    ) -> None:
        self.roots: list[int] = []
        self.seen: set[int] = set()
        self._count = count
        self.peak = 0
        self.peak_processes = 0
        self.tripped: str | None = None
        self._cpu: dict[int, float] = {}
        self.peaks: dict[int, int] = {}
        """Each process's own peak PSS in bytes."""
        self.outputs: dict[int, str] = {}
        """Where each process's standard output went (a role's log file names the role)."""
        self._interval = interval
        self._max = max_bytes
        self._min_available = min_available
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def add(self, pid: int) -> None:
        """Counts ``pid``'s tree (and session) from now on."""
        self.roots.append(pid)

    def start(self) -> TreeSampler:
        """Starts sampling."""
        self._thread.start()
        return self

    @property
    def cpu_seconds(self) -> float:
        """User + system CPU seconds of every process seen, as of its last sample.

        Unlike ``RUSAGE_CHILDREN`` it counts processes that nobody waited for (a forkserver's
        children, daemons); what a process used after its last sample (at most ``interval``)
        is lost.
        """
        return sum(self._cpu.values())

    def stop(self) -> int:
        """Stops sampling; returns the peak summed PSS in bytes."""
        self._done.set()
        self._thread.join()
        return self.peak

    def _loop(self) -> None:
        while not self._done.is_set():
            members = tree_members(list(self.roots))
            sizes = {pid: _pss(pid) for pid in members}
            total, count = sum(sizes.values()), len(members)
            for pid, size in sizes.items():
                self.peaks[pid] = max(size, self.peaks.get(pid, 0))
                with contextlib.suppress(OSError):  # the latest: a fork redirects it later
                    self.outputs[pid] = os.readlink(f"/proc/{pid}/fd/1")
            for pid in members:
                used = process_cpu_seconds(pid)
                if used is not None:
                    self._cpu[pid] = max(used, self._cpu.get(pid, 0.0))
            if self._count is not None:
                for pid in members - self.seen:
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as handle:
                            if self._count.encode() in handle.read():
                                self.seen.add(pid)
                    except OSError:
                        continue
            if total > self.peak:
                self.peak, self.peak_processes = total, count
            if self.tripped is None:
                if self._max is not None and total > self._max:
                    self.tripped = (
                        f"memory guard: {total / 2**30:.1f} GiB over {count} processes "
                        f"(limit {self._max / 2**30:.0f} GiB)"
                    )
                elif self._min_available is not None and mem_available() < self._min_available:
                    self.tripped = (
                        f"memory guard: the machine had under "
                        f"{self._min_available / 2**30:.0f} GiB available "
                        f"({total / 2**30:.1f} GiB over {count} processes)"
                    )
            self._done.wait(self._interval)


def stop_group(process: subprocess.Popen[bytes] | subprocess.Popen[str], grace: float = 10) -> None:
    """Stops a process started with ``start_new_session=True`` and its whole process group."""
    stop_groups([process], grace)


def stop_groups(
    processes: Iterable[subprocess.Popen[bytes] | subprocess.Popen[str]], grace: float = 10
) -> None:
    """SIGTERM to every group at once, ``grace`` seconds in all, then SIGKILL to what is left."""
    import signal

    alive = list(processes)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for process in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
        deadline = time.monotonic() + wait
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if p.poll() is None]
            time.sleep(0.1)
        if not alive:
            return


def load() -> str:
    """The 1, 5 and 15 minute load averages, as text."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} / {five:.1f} / {fifteen:.1f}"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or "unknown CPU": the shared VM is not always the
    same machine, and its ratios move with it (docs/benchmarks.md)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def machine() -> str:
    """One line naming the machine, the versions and the date."""
    import numpy
    import torch

    import fedcore

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{dt.date.today().isoformat()}, {platform.machine()} {cpu_model()}, "
        f"{os.cpu_count()} cores, "
        f"{memory:.0f} GiB, Linux {platform.release()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, numpy {numpy.__version__}, fedcore {fedcore.__version__}"
    )


def wall() -> float:
    """Seconds since the epoch (comparable across processes)."""
    return time.time()


def save_data(name: str, data: dict[str, object]) -> None:
    """Keeps a benchmark's numbers as docs/benchmarks/NAME.json (run_all plots from them)."""
    import json

    DOC_ASSETS.mkdir(parents=True, exist_ok=True)
    (DOC_ASSETS / f"{name}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")

"""Starting role processes for the local runner: exec'd commands or forks of a warm template.

``exec`` starts each role as ``python -m fedcore <role> ...``, exactly as a pod runs it.
``fork`` (the default for ``fedcore run``) forks each role from a forkserver that imported
torch and fedcore once, so ten clients start in seconds instead of each importing torch on two
cores. Both give every role its own OS process, its own session (process group) and a log file.

What a role process runs is given as a ``RoleEntry`` (a command to exec, a function named
``module:function`` to call in a fork): the launcher never imports the command line itself.
"""

from __future__ import annotations

import ctypes
import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

SpawnMode = Literal["fork", "exec"]

PRELOAD = ("fedcore.local.preload",)
"""Modules the forkserver imports once, before any role is forked from it."""
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RoleEntry:
    """How a started process becomes a role, given its arguments (``server --manifest ...``).

    Attributes:
        module: exec'd roles run ``python -m <module> <args>``.
        main: forked roles call this ``module:function`` with ``args``; its module is
            imported in the forkserver once, before the first fork.
        prepare: the arguments (after ``python -m <module>``, before the manifest) of the
            command that fills this machine's data cache beside the roles; none: no such step.
    """

    module: str
    main: str
    prepare: tuple[str, ...] = ()

    @property
    def main_module(self) -> str:
        """The module that holds ``main``."""
        return self.main.partition(":")[0]


FEDCORE_ROLES = RoleEntry(
    module="fedcore", main="fedcore.cli:role_main", prepare=("data", "prepare")
)
"""The ``fedcore`` command's roles (``fedcore server | client | kdc``)."""


class RoleProcess(Protocol):
    """What the runner needs of a started role."""

    @property
    def pid(self) -> int:
        """The process id (also its process-group id)."""

    def poll(self) -> int | None:
        """Returns the exit code, or None while running."""

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the exit code; raises subprocess.TimeoutExpired after ``timeout``."""


class ExecRole:
    """A role started as a fresh ``python -m <entry.module>`` process."""

    def __init__(
        self, entry: RoleEntry, args: Sequence[str], log_path: Path, env: Mapping[str, str]
    ) -> None:
        with log_path.open("wb") as log:
            self._process = subprocess.Popen(
                dying_with_parent([sys.executable, "-m", entry.module, *args]),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env),
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self._process.pid

    def poll(self) -> int | None:
        return self._process.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._process.wait(timeout)


class ForkedRole:
    """A role forked from the warm forkserver."""

    def __init__(
        self, entry: RoleEntry, args: Sequence[str], log_path: Path, env: Mapping[str, str]
    ) -> None:
        context = multiprocessing.get_context("forkserver")
        self._process = context.Process(
            target=forked_role,
            args=(entry.main, list(args), str(log_path), dict(env)),
            daemon=False,
        )
        self._process.start()

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired("fedcore role", timeout or 0)
        return code


def warm_up(mode: SpawnMode, entry: RoleEntry = FEDCORE_ROLES) -> None:
    """Starts the forkserver now, when roles will be forked from it (``mode`` fork): it
    imports torch and fedcore (seconds) while the caller does its own work (reading the
    manifest, issuing certificates), instead of when the first role is started. Idempotent."""
    if mode != "fork":
        return
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload([*PRELOAD, entry.main_module])
    forkserver.ensure_running()


def start_role(
    mode: SpawnMode,
    entry: RoleEntry,
    args: Sequence[str],
    log_path: Path,
    env: Mapping[str, str],
) -> RoleProcess:
    """Starts one role, ``entry`` given ``args``; its output goes to ``log_path``."""
    if mode == "fork":
        multiprocessing.set_forkserver_preload([*PRELOAD, entry.main_module])
        return ForkedRole(entry, args, log_path, env)
    return ExecRole(entry, args, log_path, env)


_DEATH_SHIM = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM); "  # PR_SET_PDEATHSIG
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def dying_with_parent(argv: Sequence[str]) -> list[str]:
    """``argv`` behind a shim that asks Linux to SIGTERM the process when its parent dies, then
    execs ``argv`` in place (same PID); ``argv`` itself elsewhere.

    A shim rather than ``preexec_fn``: Popen runs a ``preexec_fn`` between fork and exec, where
    a parent with gRPC threads running (an embedding program, a test process) can have gRPC's
    fork handlers abort the child. Without it, Popen starts the child with vfork.
    """
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _DEATH_SHIM, *argv]


def die_with_parent() -> None:
    """Asks Linux to SIGTERM this process when its parent dies (no orphaned roles if the
    runner is killed with SIGKILL); a no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def forked_role(main: str, args: list[str], log_path: str, env: dict[str, str]) -> None:
    """The body of a forked role: own session, output to its log, then ``main(args)``."""
    os.setsid()
    die_with_parent()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    module, _, function = main.partition(":")
    getattr(importlib.import_module(module), function)(args)

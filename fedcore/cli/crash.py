"""The last-resort handler: an unexpected exception becomes one line on stderr and a log file.

No Python traceback reaches the user of ``fedcore``. An exception that is not a
``FedcoreError``, a click usage error or an interrupt is reported as::

    InternalError: <type>: <message> (details in <path>)

with exit code :data:`EXIT_INTERNAL` (70, ``EX_SOFTWARE`` of sysexits.h), and the full
traceback is written to ``<path>``: the run's ``logs/`` folder when the command knows it
(``fedcore run`` once the run's folder exists), else :func:`default_log_dir`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import tempfile
import traceback
from pathlib import Path

import click

from fedcore.errors import CheckpointInvalid

EXIT_FAILURE = 1
"""A refusal or a failed run: a FedcoreError (bad manifest, a role failed, a run aborted)."""
EXIT_USAGE = 2
"""click's own usage errors (a missing argument, an unknown option, a file that does not exist)."""
EXIT_CHECKPOINT_INVALID = CheckpointInvalid.EXIT_CODE
"""A role cannot restore the checkpoint it must resume from (``CheckpointInvalid``;
``EX_DATAERR``): starting it again would read the same checkpoint, so the operator ends the run
instead of recreating the pod."""

EXIT_INTERNAL = 70
"""An unexpected exception: a bug in fedcore (``EX_SOFTWARE``)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C or SIGTERM during ``fedcore run`` (128 + SIGINT)."""
EXIT_TERMINATED = 143
"""A role process stopped by SIGTERM (a deleted pod) or SIGINT (128 + SIGTERM)."""
EXIT_BROKEN_PIPE = 141
"""Whoever read the output went away (``fedcore checkpoint list | head``): 128 + SIGPIPE, as
a Unix tool killed by the signal would end."""

TERMINATION_LOG_ENV = "FEDCORE_TERMINATION_LOG"
"""Names the file a failed role writes its one-line error to: the pod's termination message
path, which the operator sets (Kubernetes then shows the line in the pod's status)."""

TERMINATION_MESSAGE_BYTES = 2048
"""The most bytes of that line (Kubernetes keeps 4096 per container)."""

LOG_DIR_KEY = "fedcore.log_dir"
"""The ``click.Context.meta`` key under which a command names its run's log folder."""

MAX_MESSAGE = 300
"""The most characters of the exception's message shown on the one line."""


def default_log_dir() -> Path:
    """Where internal-error logs go when no run folder is known.

    ``$XDG_CACHE_HOME/fedcore/logs`` (default ``~/.cache/fedcore/logs``).
    """
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "fedcore" / "logs"


def one_line(text: str, limit: int = MAX_MESSAGE) -> str:
    """Collapses ``text`` to one line of at most ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _message_of(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a broken __str__ must not hide the original error
        return "<the message could not be read>"


def write_log(exc: BaseException, log_dir: Path | None) -> Path | None:
    """Writes the traceback of ``exc`` to a new file; returns its path, or None if none could be
    written.

    Tries ``log_dir`` (when given and it already exists), then :func:`default_log_dir`, then a
    ``fedcore-<uid>`` folder in the system's temporary directory.
    """
    now = datetime.datetime.now(datetime.UTC)
    name = f"internal-error-{now.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.log"
    text = "".join(
        [
            f"time: {now.isoformat()}\n",
            f"command: {' '.join(sys.argv)}\n",
            f"python: {sys.version.split()[0]}\n\n",
            *traceback.format_exception(exc),
        ]
    )
    candidates = [log_dir] if log_dir is not None and log_dir.is_dir() else []
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    candidates += [default_log_dir(), Path(tempfile.gettempdir()) / f"fedcore-{uid}"]
    for folder in candidates:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / name
            path.write_text(text, encoding="utf-8")
        except OSError:
            continue
        return path.resolve()
    return None


def report_internal_error(exc: BaseException, log_dir: Path | None = None) -> None:
    """Prints the one line for an unexpected ``exc``, logs its traceback, exits 70.

    Raises:
        SystemExit: always, with :data:`EXIT_INTERNAL`.
    """
    path = write_log(exc, log_dir)
    where = f"details in {path}" if path is not None else "no log could be written"
    line = f"{type(exc).__name__}: {one_line(_message_of(exc))} ({where})"
    with contextlib.suppress(Exception):  # stderr itself broken: nothing more can be said
        click.echo(f"{click.style('InternalError', fg='red', bold=True)}: {line}", err=True)
    sys.exit(EXIT_INTERNAL)


def output_closed() -> None:
    """Ends the command quietly when the reader of its output went away (a ``BrokenPipeError``
    writing to stdout): no error line, no log, exit :data:`EXIT_BROKEN_PIPE`. Stdout is pointed
    at the null device first, so that the interpreter's last flush does not fail again.

    Raises:
        SystemExit: always.
    """
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
    sys.exit(EXIT_BROKEN_PIPE)


def raise_interrupt(*_: object) -> None:
    """A SIGTERM handler that stops the command as Ctrl-C does (``KeyboardInterrupt``)."""
    raise KeyboardInterrupt


def write_termination_message(text: str) -> None:
    """Writes ``text``, on one line and bounded, to the file ``$FEDCORE_TERMINATION_LOG``
    names (nothing without it); a file that cannot be written is no further error."""
    path = os.environ.get(TERMINATION_LOG_ENV)
    if not path:
        return
    line = one_line(text, TERMINATION_MESSAGE_BYTES).encode()[:TERMINATION_MESSAGE_BYTES]
    with contextlib.suppress(OSError), open(path, "wb") as file:
        file.write(line)

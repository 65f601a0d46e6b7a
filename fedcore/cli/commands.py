"""The ``fedcore`` command: run a manifest locally, validate one, or start one role."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import gc
import json
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape

from fedcore.cli.crash import (
    EXIT_CHECKPOINT_INVALID,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    LOG_DIR_KEY,
    one_line,
    output_closed,
    raise_interrupt,
    report_internal_error,
    write_termination_message,
)
from fedcore.errors import FedcoreError, RunAborted, SpecError, SpecIssue
from fedcore.local.threads import ROLE_THREADS

if TYPE_CHECKING:
    from fedcore.checkpoint import Checkpointer, ObjectStore

stderr = Console(stderr=True)

ROLE_OPTIONS = {
    "manifest": click.option(
        "--manifest",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        required=True,
        envvar="FEDCORE_MANIFEST",
        help="The FederatedRun manifest file.",
    ),
    "tls-dir": click.option(
        "--tls-dir",
        type=click.Path(file_okay=False, path_type=Path),
        required=True,
        envvar="FEDCORE_TLS_DIR",
        help="The folder holding this role's ca.crt, tls.crt and tls.key.",
    ),
    "workdir": click.option(
        "--workdir",
        type=click.Path(file_okay=False, path_type=Path),
        default=Path("."),
        envvar="FEDCORE_WORKDIR",
        show_default=True,
        help="The run's folder for checkpoints and the final model.",
    ),
    "metrics-port": click.option(
        "--metrics-port",
        type=click.IntRange(0, 65535),
        default=0,
        envvar="FEDCORE_METRICS_PORT",
        help="Serve Prometheus /metrics on this port (0: do not serve).",
    ),
    "metrics-address": click.option(
        "--metrics-address",
        default="127.0.0.1",
        envvar="FEDCORE_METRICS_ADDRESS",
        show_default=True,
        help="The address /metrics binds to.",
    ),
    "events": click.option(
        "--events",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Append progress events as JSON lines to this file.",
    ),
    "threads": click.option(
        "--threads",
        type=click.IntRange(1, 1024),
        default=1,
        envvar="FEDCORE_THREADS",
        show_default=True,
        help="Torch threads in this process.",
    ),
    "revoked-sites": click.option(
        "--revoked-sites",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        envvar="FEDCORE_REVOKED_SITES",
        help="The hub's file of revoked sites: their clients are refused (server and KDC).",
    ),
    "log-level": click.option(
        "--log-level",
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]),
        default="INFO",
        show_default=True,
        help="How much the role logs.",
    ),
}


def client_links(func: Any) -> Any:
    """Adds the options a client role dials out with (``client`` and ``clients``)."""
    func = click.option(
        "--kdc",
        "kdc_address",
        default=None,
        envvar="FEDCORE_KDC",
        help="host:port of the KDC, for protocols that need one.",
    )(func)
    return click.option(
        "--server",
        "server_address",
        required=True,
        envvar="FEDCORE_SERVER",
        help="host:port of the server.",
    )(func)


def role_options(func: Any, *, without: tuple[str, ...] = ()) -> Any:
    """Adds the options every role command shares (but those named in ``without``)."""
    for name, option in reversed(ROLE_OPTIONS.items()):
        if name not in without:
            func = option(func)
    return func


def role_config(options: dict[str, Any]) -> Any:
    """Builds a RoleConfig from the shared options."""
    from fedcore.roles import RoleConfig

    return RoleConfig(
        manifest=options["manifest"],
        tls_dir=options["tls_dir"],
        workdir=options["workdir"],
        metrics_port=options["metrics_port"],
        metrics_address=options["metrics_address"],
        events=options["events"],
        threads=options["threads"],
        revoked_sites=options.get("revoked_sites"),
    )


@contextlib.contextmanager
def role_errors(role: str) -> Iterator[None]:
    """Turns any error of a role process into one logged line (traceback at DEBUG) and exit 1;
    a checkpoint the role cannot resume from (``CheckpointInvalid``) exits 65
    (`EXIT_CHECKPOINT_INVALID`), which the operator does not retry. In a pod the line also goes
    to its termination message (``write_termination_message``).

    SIGTERM or SIGINT stops the role with exit code 143 (`EXIT_TERMINATED`), logged.
    A role that finished exits 0 at once, without the interpreter's finalization: the role has
    closed its channels and flushed its status by then, and tearing down grpc's C++ threads
    during finalization sometimes aborts the process ("terminate called without an active
    exception", SIGABRT), which turned a finished client into a failed pod that was recreated.
    """
    # A container's first process ignores SIGTERM unless it handles it: a deleted pod's role
    # would go on (a server finishing its rounds and telling the clients "done") until the
    # kubelet's SIGKILL. It stops at once instead, without a goodbye, so that the clients wait
    # for the server's replacement.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    except KeyboardInterrupt:
        logging.getLogger(f"fedcore.{role}").warning("Stopped by SIGTERM or SIGINT.")
        exit_now(EXIT_TERMINATED)
    except SystemExit:
        raise
    except BaseException as exc:
        logger = logging.getLogger(f"fedcore.{role}")
        logger.debug("Traceback of the failure:", exc_info=True)
        logger.error("%s: %s", error_name(exc), exc)
        write_termination_message(f"{error_name(exc)}: {exc}")
        sys.exit(EXIT_CHECKPOINT_INVALID if error_name(exc) == "CheckpointInvalid" else 1)
    exit_now(0)


@contextlib.contextmanager
def imports_uncollected() -> Iterator[None]:
    """Runs a role's imports with Python's cyclic garbage collector off, then freezes what they
    loaded (``gc.freeze``) and turns it back on: torch's import allocates objects by the
    hundred thousand, and the collections they trigger cost a third of its import time (a pod's
    start-up; forked roles find it all imported already)."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def exit_now(code: int) -> None:
    """Flushes the logs and standard streams, unlinks the named semaphores made in this process,
    then ends the process with ``code`` at once (no interpreter teardown)."""
    release_semaphores()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def release_semaphores() -> None:
    """Runs multiprocessing's exit finalizers, as a normal exit would, which ``os._exit`` skips.

    A process started by a fork or the forkserver that makes a multiprocessing lock (numba
    does, to launch the fold kernels' threads) owns a named semaphore in /dev/shm; without its
    finalizer the semaphore stays until the resource tracker removes it, which then warns
    "leaked semaphore objects" on the command's terminal. A no-op where multiprocessing's
    helpers were never imported.
    """
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        with contextlib.suppress(Exception):
            util._run_finalizers(0)


def error_name(exc: BaseException) -> str:
    """What an error is called on the console and in a role's log: a stopped run's reason
    (RunAborted), else the error's type."""
    return exc.reason if isinstance(exc, RunAborted) and exc.reason else type(exc).__name__


def fail(exc: BaseException, code: int = EXIT_FAILURE) -> None:
    """Prints ``Name: message`` in red on stderr and exits with ``code``: for a stopped run
    (RunAborted) the name is its reason, the one ``--json``, the events, the FederatedRun's
    status and the metrics give (``CheckpointFailed``, ``QuorumLost``, ...); else the error's
    type.

    The message is escaped: text from a manifest or an error (``[red]``, ``[/x]``, a regular
    expression's ``[a-z]``) is printed as it is, never read as Rich markup.
    """
    stderr.print(
        f"[bold red]{escape(error_name(exc))}[/]: {escape(str(exc))}",
        markup=True,
        highlight=False,
        soft_wrap=True,
    )
    sys.exit(code)


_CLICK_OUTCOMES = (click.ClickException, click.exceptions.Exit, click.Abort)
"""What click itself reports (usage errors exit 2, ``ctx.exit``, an abort)."""


class FedcoreGroup(click.Group):
    """A click group that turns every FedcoreError into a red one-liner and exit code 1, and
    anything unexpected into one ``InternalError`` line, a log file and exit code 70
    (``fedcore.cli.crash``). Click's own usage errors (exit 2) and interrupts pass through; an
    output whose reader went away (``| head``) ends it quietly (exit 141)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except RunAborted as exc:
            fail(exc, EXIT_INTERRUPTED if exc.reason == "Interrupted" else EXIT_FAILURE)
        except FedcoreError as exc:
            fail(exc)
        except _CLICK_OUTCOMES:
            raise
        except BrokenPipeError:
            output_closed()
        except Exception as exc:
            log_dir = ctx.meta.get(LOG_DIR_KEY)
            report_internal_error(exc, log_dir if isinstance(log_dir, Path) else None)
        return None

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the command; an exception that escapes even ``invoke`` (e.g. one raised while
        printing an error) is reported by the last-resort handler too."""
        try:
            return super().main(*args, **kwargs)
        except _CLICK_OUTCOMES:
            raise
        except BrokenPipeError:
            output_closed()
        except Exception as exc:
            report_internal_error(exc)


@click.group(cls=FedcoreGroup)
@click.version_option(package_name="fedcore")
def main() -> None:
    """fedcore: privacy-preserving federated learning, on one machine or on Kubernetes."""


@main.command()
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the verdict, every error and the summary as one JSON object on stdout.",
)
@click.option(
    "--load-data",
    is_flag=True,
    help="Load and deal the data to report every client's examples also where they do not "
    "follow from counts (Dirichlet, NpzFolder, ByFile); takes seconds, never imports torch.",
)
def validate(manifest: Path, as_json: bool, load_data: bool) -> None:
    """Validates MANIFEST and prints what it would run, with every default resolved.

    Exits 0 when the manifest is valid and 1 when it is not.
    """
    from fedcore.cli.summary import describe, summary_lines
    from fedcore.spec import load_manifest, protocol_facts

    try:
        run = load_manifest(manifest)
        summary = describe(run, load_data=load_data, source=str(manifest))
    except SpecError as exc:
        if not as_json:
            raise
        click.echo(json.dumps(validation_json(manifest, exc.issues, None), allow_nan=False))
        sys.exit(EXIT_FAILURE)
    if as_json:
        click.echo(json.dumps(validation_json(manifest, [], summary), allow_nan=False))
        return
    facts = protocol_facts(run.spec.protocol.name)
    click.echo(
        f"{manifest}: valid FederatedRun {run.metadata.name!r}: protocol "
        f"{facts.name}, {run.spec.clients.count} clients, {run.spec.rounds} rounds"
        f"{', with a KDC' if facts.needs_kdc else ''}."
    )
    for line in summary_lines(summary):
        click.echo(line)


@main.group()
def data() -> None:
    """This machine's data cache."""


@data.command("prepare")
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def data_prepare(manifest: Path) -> None:
    """Parses MANIFEST's data source into this machine's cache, unless it is there already
    (with spec.data.clientData, every client's own source that this machine can read).

    Every role reads its rows from that cache; the first role to miss it parses the source
    (seconds, for scikit-learn's digits mostly importing scikit-learn). `fedcore run` starts
    this in the background while its roles start, so that no role waits on the parse.
    """
    from fedcore.learning.data import load_split
    from fedcore.learning.data._cache import cache_root, parse_count
    from fedcore.roles._common import configure_logging
    from fedcore.spec import load_manifest

    configure_logging("data")
    run = load_manifest(manifest)
    if run.spec.data.client_data is not None:  # on one machine, every client's own source
        from fedcore.learning.data import own_data

        loaded = [own_data(run.spec, index) for index in range(run.spec.clients.count)]
        done = "parsed now" if parse_count() else "already cached"
        click.echo(
            f"{run.metadata.name}: {len(loaded)} clients' own data, "
            f"{sum(len(own.train) for own in loaded):,} training and "
            f"{sum(len(own.test) for own in loaded):,} held-out examples, {done} "
            f"({cache_root()})."
        )
        return
    train, test = load_split(run.spec.data)
    done = "parsed now" if parse_count() else "already cached"
    click.echo(
        f"{run.metadata.name}: {len(train):,} training and {len(test):,} test examples, "
        f"{done} ({cache_root()})."
    )


MAX_JSON_NODES = 200
"""The most values of one offending value that ``validate --json`` copies (an alias bomb's
expansion is cut off, not printed)."""
MAX_JSON_DEPTH = 8
"""How deep ``validate --json`` follows an offending value's lists and mappings."""
MAX_JSON_STRING = 1000
"""The most characters of one string that ``validate --json`` copies."""


def validation_json(
    manifest: Path, issues: list[SpecIssue], summary: dict[str, Any] | None
) -> dict[str, Any]:
    """The ``fedcore validate --json`` object: ``valid``, ``source``, ``errors`` (one per issue:
    ``field``, ``value``, ``message``, ``allowed``) and ``summary`` (None when invalid)."""
    return {
        "valid": not issues,
        "source": str(manifest),
        "errors": [
            {
                "field": issue.path,
                "value": json_safe(issue.value),
                "message": issue.message,
                "allowed": issue.allowed,
            }
            for issue in issues
        ],
        "summary": summary,
    }


def json_safe(value: Any) -> Any:
    """A bounded JSON-able copy of ``value``: at most ``MAX_JSON_NODES`` values and
    ``MAX_JSON_DEPTH`` levels (what is cut off becomes ``"..."``), long strings shortened,
    non-finite numbers and other types written as their ``repr``."""
    budget = [MAX_JSON_NODES]

    def copy(item: Any, depth: int) -> Any:
        budget[0] -= 1
        if budget[0] < 0 or depth > MAX_JSON_DEPTH:
            return "..."
        if item is None or isinstance(item, bool):
            return item
        if isinstance(item, int):
            return item if item.bit_length() <= 63 else f"an integer of {item.bit_length()} bits"
        if isinstance(item, float):
            return item if math.isfinite(item) else repr(item)
        if isinstance(item, str):
            return item if len(item) <= MAX_JSON_STRING else item[:MAX_JSON_STRING] + "..."
        if isinstance(item, list | tuple):
            return [copy(part, depth + 1) for part in item[: max(budget[0], 0) + 1]]
        if isinstance(item, dict):
            pairs = list(item.items())[: max(budget[0], 0) + 1]
            return {str(copy(key, depth + 1)): copy(part, depth + 1) for key, part in pairs}
        return repr(item)[:MAX_JSON_STRING]

    return copy(value, 0)


@main.command()
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The run's folder (default: runs/<name>).",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue from the latest good checkpoint; refused (NoCheckpoint) when there is none.",
)
@click.option(
    "--resume-if-possible",
    is_flag=True,
    help="Continue from the latest good checkpoint if there is one, else start at round 1.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON summary as the last line of stdout."
)
@click.option("--no-metrics", is_flag=True, help="Do not serve /metrics from the roles.")
@click.option(
    "--threads",
    type=click.IntRange(1, 1024),
    default=ROLE_THREADS,
    show_default=True,
    help="Torch threads per role process.",
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option(
    "--spawn",
    type=click.Choice(["fork", "exec"]),
    default="fork",
    show_default=True,
    help="fork: roles fork from a warm forkserver (fast start); exec: each role is a fresh "
    "`python -m fedcore <role>` command, as in a pod.",
)
@click.option(
    "--clients-per-process",
    default="auto",
    show_default=True,
    metavar="N|auto",
    help="Clients that share one process (on one event loop, each with its own key, data and "
    "metrics). auto: one each up to 8 clients per core, then about 2 processes per core; "
    "more per process where the available memory would not hold them (the model's size is "
    "worked out first).",
)
@click.option(
    "--simulate",
    is_flag=True,
    help="Run the protocol's maths in this one process (no network, no roles, no "
    "checkpoints): the same hooks in the same order, for a quick check of a manifest.",
)
@click.option(
    "--site",
    "site_policies",
    multiple=True,
    metavar="NAME=POLICY",
    help="A site's policy file, for a manifest with spec.sites (default: <site>/policy.yaml "
    "beside the manifest). Repeat per site.",
)
def run(
    manifest: Path,
    workdir: Path | None,
    resume: bool,
    resume_if_possible: bool,
    as_json: bool,
    no_metrics: bool,
    threads: int,
    quiet: bool,
    spawn: str,
    clients_per_process: str,
    simulate: bool,
    site_policies: tuple[str, ...],
) -> None:
    """Runs MANIFEST on this machine: KDC, server and clients as processes over mutual TLS.

    With spec.sites: the hub and each site as its own processes, with its own folder, keys
    and policy file (docs/sites.md)."""
    if not simulate:
        from fedcore.local.launch import warm_up

        warm_up("exec" if spawn == "exec" else "fork")  # its imports overlap this process's
    from fedcore.cli.progress import RunProgress
    from fedcore.local.runner import LocalRun
    from fedcore.spec import load_manifest
    from fedcore.spec._validate import local_run_issues

    try:
        spec_run = load_manifest(manifest)
        local_issues = local_run_issues(spec_run)
        if local_issues:
            raise SpecError(local_issues, source=str(manifest))
    except SpecError as exc:
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "phase": "Failed",
                        "rounds": None,
                        "accuracy": None,
                        "wall_seconds": None,
                        "reason": "SpecError",
                        "message": str(exc),
                    }
                )
            )
        raise
    own = spec_run.spec.data.client_data
    if simulate and own is not None and own.bound_by_sites:
        raise click.UsageError(
            "--simulate needs every client's data in one process, but each site binds its "
            "own clients' data (spec.sites); run it without --simulate."
        )
    if simulate:
        _simulate(spec_run, as_json=as_json)
        return
    folder = workdir or Path("runs") / spec_run.metadata.name
    # An internal error's traceback goes to the run's logs/ once the runner has made it.
    click.get_current_context().meta[LOG_DIR_KEY] = folder / "logs"
    local: Any
    if spec_run.spec.sites is not None:
        local = _consortium(
            spec_run,
            manifest,
            folder,
            site_policies,
            resume=resume or resume_if_possible,
            require_checkpoint=not resume_if_possible,
        )
    else:
        if site_policies:
            raise click.UsageError("--site is for a manifest with spec.sites.")
        local = LocalRun(
            spec_run,
            manifest,
            workdir=folder,
            resume=resume or resume_if_possible,
            require_checkpoint=not resume_if_possible,
            metrics=not no_metrics,
            threads=threads,
            spawn="exec" if spawn == "exec" else "fork",
            clients_per_process=_per_process(clients_per_process),
        )
    signal.signal(signal.SIGTERM, raise_interrupt)
    progress = RunProgress(stderr, spec_run, enabled=not quiet)
    try:
        with progress:
            result = local.execute(on_event=progress.update)
    except FedcoreError as exc:
        if as_json:
            reason = exc.reason if isinstance(exc, RunAborted) else type(exc).__name__
            failed = {
                "phase": "Failed",
                "rounds": spec_run.spec.rounds,
                "accuracy": None,
                "wall_seconds": None,
                "reason": reason,
                "message": str(exc),
            }
            click.echo(json.dumps(failed))
        raise
    except Exception as exc:
        if as_json:
            failed = {
                "phase": "Failed",
                "rounds": spec_run.spec.rounds,
                "accuracy": None,
                "wall_seconds": None,
                "reason": "InternalError",
                "message": one_line(f"{type(exc).__name__}: {exc}"),
            }
            click.echo(json.dumps(failed))
        raise
    summary = result.as_json()
    if not quiet:
        progress.print_summary(summary, getattr(local, "metrics_ports", {}))
    if as_json:
        click.echo(json.dumps(summary))


def _consortium(
    run: Any,
    manifest: Path,
    folder: Path,
    given: tuple[str, ...],
    *,
    resume: bool,
    require_checkpoint: bool,
) -> Any:
    """The hub and the sites of a manifest with spec.sites, on this machine."""
    from fedcore.sites.consortium import ConsortiumRun, site_policies

    policies: dict[str, Path] = {}
    for item in given:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise click.BadParameter(f"{item!r} is not NAME=POLICY.", param_hint="--site")
        policies[name] = Path(path)
    return ConsortiumRun(
        run,
        manifest,
        workdir=folder,
        policies=site_policies(run, manifest, policies),
        resume=resume,
        require_checkpoint=require_checkpoint,
    )


def _simulate(run: Any, *, as_json: bool) -> None:
    """``fedcore run --simulate``: every party in this process; prints the summary."""
    import time

    from fedcore.local.threads import limit_threads
    from fedcore.simulation import simulate

    limit_threads(ROLE_THREADS)
    started = time.monotonic()
    result = simulate(run)
    summary = {
        "phase": "Succeeded",
        "rounds": run.spec.rounds,
        "rounds_completed": result.rounds_completed,
        "reason": result.reason,
        "accuracy": result.accuracy,
        "loss": result.loss,
        "epsilon": result.epsilon,
        "epsilon_claim": result.epsilon_claim,
        "wall_seconds": round(time.monotonic() - started, 4),
        "mode": "simulation",
    }
    if as_json:
        click.echo(json.dumps(summary))
    else:
        stderr.print(
            f"Simulated {escape(run.metadata.name)}: accuracy {result.accuracy:.4f}, loss "
            f"{result.loss:.4f} after {run.spec.rounds} rounds."
        )


@main.command()
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The report's folder (default: runs/<name>/audit).",
)
@click.option(
    "--attacks",
    default=None,
    help="Comma-separated attack names (default: all; none: only the canaries; see docs/audit.md).",
)
@click.option(
    "--canaries",
    type=click.IntRange(4),
    default=None,
    help="Also run the canary audit with this many canaries (e.g. 200): a second simulation "
    "whose measured epsilon goes beside the claimed one.",
)
@click.option(
    "--seed",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="The attacker's randomness.",
)
@click.option(
    "--rounds", type=click.IntRange(1), default=None, help="Simulate only the first ROUNDS rounds."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def audit(
    manifest: Path,
    out: Path | None,
    attacks: str | None,
    seed: int,
    rounds: int | None,
    as_json: bool,
    canaries: int | None,
) -> None:
    """Simulates MANIFEST with an attacker attached; writes a privacy report (Markdown, PNG)."""
    from fedcore.audit import registered_attacks, run_audit
    from fedcore.local.threads import limit_threads
    from fedcore.spec import load_manifest

    spec_run = load_manifest(manifest)
    names = None if attacks is None else [a.strip() for a in attacks.split(",") if a.strip()]
    if names == ["none"]:
        names = []
    unknown = sorted(set(names or []) - set(registered_attacks()))
    if unknown:
        raise click.BadParameter(
            f"unknown attack(s) {', '.join(unknown)}; known: {', '.join(registered_attacks())}.",
            param_hint="--attacks",
        )
    limit_threads(ROLE_THREADS)
    folder = out or Path("runs") / spec_run.metadata.name / "audit"
    if canaries is not None:
        from fedcore.audit.canary.run import check_canaries

        try:
            check_canaries(spec_run.spec, canaries)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--canaries") from None
    report = run_audit(
        spec_run,
        folder,
        attacks=names,
        seed=seed,
        rounds=rounds,
        source=str(manifest),
        canaries=canaries,
    )
    if as_json:
        click.echo(json.dumps(report.as_json()))
        return
    for result in report.results:
        verdict = result.verdict
        if verdict is None:
            line = f"skipped ({result.skipped})"
        else:
            beats = {True: "beats blind guessing", False: "does not beat blind guessing"}
            line = (
                f"{verdict.name} {verdict.value:.3g} [{verdict.low:.3g}, {verdict.high:.3g}]: "
                f"{beats.get(bool(verdict.beats_chance), '')}"
            )
        stderr.print(escape(f"{result.attack}: {line}"), highlight=False, soft_wrap=True)
    if report.canary is not None:
        canary = report.canary
        claimed = "none" if canary.claimed is None else f"{canary.claimed:.3g}"
        line = (
            f"canaries: one-run lower bound {canary.bound.epsilon:.3g} "
            f"({canary.bound.confidence:.0%}), one-shot estimate {canary.estimate.epsilon:.3g} "
            f"[{canary.estimate.low:.3g}, {canary.estimate.high:.3g}], claimed {claimed}: "
            f"{canary.verdict}"
        )
        stderr.print(escape(line), highlight=False, soft_wrap=True)
    stderr.print(escape(f"Report: {report.markdown}"), highlight=False, soft_wrap=True)


def _per_process(value: str) -> int | None:
    """``--clients-per-process``: a positive count, or None for auto."""
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise click.BadParameter(
            f"{value!r} is neither a positive number nor auto.", param_hint="--clients-per-process"
        )
    return int(value)


@main.command()
@role_options
@click.option(
    "--listen",
    default="0.0.0.0:7070",
    envvar="FEDCORE_LISTEN",
    show_default=True,
    help="host:port to serve clients on (port 0: any free port).",
)
@click.option(
    "--resume", is_flag=True, envvar="FEDCORE_RESUME", help="Start from the latest good checkpoint."
)
@click.option(
    "--require-checkpoint",
    is_flag=True,
    envvar="FEDCORE_REQUIRE_CHECKPOINT",
    help="With --resume: refuse to start (NoCheckpoint) when there is no checkpoint, instead of "
    "starting at round 1.",
)
@click.option(
    "--kdc",
    "kdc_address",
    default=None,
    envvar="FEDCORE_KDC",
    help="host:port of the KDC, for protocols whose server calls it (ebscfl).",
)
@click.option(
    "--memory-bytes",
    type=click.IntRange(0),
    default=None,
    envvar="FEDCORE_MEMORY_BYTES",
    help="The memory spec.uploads.storage Auto plans the server with (fedcore run passes what "
    "it planned the run's processes with). Default: the container's limit less its usage, "
    "else the machine's available memory, at the server's start.",
)
def server(
    listen: str,
    resume: bool,
    require_checkpoint: bool,
    kdc_address: str | None,
    memory_bytes: int | None,
    **options: Any,
) -> None:
    """Runs the server role of one run."""
    with imports_uncollected():
        from fedcore.roles import run_server
    from fedcore.roles._common import configure_logging

    configure_logging("server", options["log_level"])
    with role_errors("server"):
        run_server(
            role_config(options),
            listen=listen,
            resume=resume,
            kdc=kdc_address,
            require_checkpoint=require_checkpoint,
            memory_bytes=memory_bytes,
        )


@main.command()
@role_options
@click.option(
    "--index",
    type=click.IntRange(0),
    required=True,
    envvar="FEDCORE_CLIENT_INDEX",
    help="This client's index, 0 to count-1 (its certificate must say the same).",
)
@client_links
@click.option(
    "--peer-listen",
    default=None,
    envvar="FEDCORE_PEER_LISTEN",
    help="host:port to serve peer links on (decentralized protocols).",
)
@click.option(
    "--peer",
    "peer_addresses",
    multiple=True,
    metavar="INDEX=HOST:PORT",
    help="An out-neighbour's peer address (repeat per neighbour; decentralized protocols).",
)
@click.option(
    "--peer-template",
    default=None,
    envvar="FEDCORE_PEER_TEMPLATE",
    help="Peer address of any client, with {index} (e.g. client-{index}.run-clients.ns.svc:7072).",
)
@click.option(
    "--site-binding",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    envvar="FEDCORE_SITE_BINDING",
    help="A site's approval of this run (written by fedcore site serve): the client's data "
    "source, and the floor every task is checked against.",
)
def client(
    index: int,
    server_address: str,
    kdc_address: str | None,
    peer_listen: str | None,
    peer_addresses: tuple[str, ...],
    peer_template: str | None,
    site_binding: Path | None,
    **options: Any,
) -> None:
    """Runs one client role of one run."""
    with imports_uncollected():
        from fedcore.roles import run_client
    from fedcore.roles._common import configure_logging
    from fedcore.roles._peer_duties import PeerSettings

    configure_logging(f"client-{index}", options["log_level"])
    with role_errors(f"client-{index}"):
        peers = None
        if peer_listen is not None:
            addresses: dict[int, str] = {}
            for item in peer_addresses:
                key, sep, address = item.partition("=")
                if not sep or not key.isdigit() or not address:
                    raise click.BadParameter(
                        f"{item!r} is not INDEX=HOST:PORT.", param_hint="--peer"
                    )
                addresses[int(key)] = address
            peers = PeerSettings(peer_listen, addresses, peer_template)
        run_client(
            role_config(options),
            index=index,
            server=server_address,
            kdc=kdc_address,
            peers=peers,
            site_binding=site_binding,
        )


def _members(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> list[Any]:
    """Parses each ``INDEX`` or ``INDEX:METRICS_PORT`` of ``fedcore clients --member`` (a usage
    error naming the bad one, before anything starts)."""
    from fedcore.roles.client_group import Member

    members = []
    for text in values:
        index, colon, port = text.partition(":")
        if not index.isdigit() or (colon and not port.isdigit()) or int(port or 0) > 65535:
            raise click.BadParameter(f"{text!r} is not INDEX or INDEX:METRICS_PORT.")
        members.append(Member(int(index), int(port or 0)))
    return members


@main.command()
@functools.partial(role_options, without=("tls-dir", "metrics-port", "events"))
@click.option(
    "--tls-dir",
    required=True,
    envvar="FEDCORE_TLS_DIR",
    help="Each client's bundle folder, with {index} (e.g. pki/client-{index}).",
)
@click.option(
    "--member",
    "members",
    multiple=True,
    required=True,
    metavar="INDEX[:METRICS_PORT]",
    callback=_members,
    help="A client of this process, and where it serves /metrics (repeat per client).",
)
@client_links
def clients(
    tls_dir: str,
    members: list[Any],
    server_address: str,
    kdc_address: str | None,
    **options: Any,
) -> None:
    """Runs several client roles of one run in this process, on one event loop, each with its
    own key, certificate, data and metrics (fedcore run uses it for many clients on few cores)."""
    from fedcore.roles import RoleConfig
    from fedcore.roles._common import configure_logging

    with imports_uncollected():
        from fedcore.roles.client_group import name_members_in_logs, run_client_group

    configure_logging("%(member)s", options["log_level"])
    name_members_in_logs()
    with role_errors("clients"):
        config = RoleConfig(
            manifest=options["manifest"],
            tls_dir=Path(tls_dir),
            workdir=options["workdir"],
            metrics_address=options["metrics_address"],
            threads=options["threads"],
        )
        run_client_group(config, members, server=server_address, kdc=kdc_address)


@main.command()
@role_options
@click.option(
    "--listen",
    default="0.0.0.0:7071",
    envvar="FEDCORE_LISTEN",
    show_default=True,
    help="host:port to serve key requests on (port 0: any free port).",
)
@click.option(
    "--resume",
    is_flag=True,
    envvar="FEDCORE_RESUME",
    help="Start from the KDC's latest good checkpoint (a restarted KDC).",
)
def kdc(listen: str, resume: bool, **options: Any) -> None:
    """Runs the KDC role of one run (only for protocols that need one)."""
    with imports_uncollected():
        from fedcore.roles import run_kdc
    from fedcore.roles._common import configure_logging

    configure_logging("kdc", options["log_level"])
    with role_errors("kdc"):
        run_kdc(role_config(options), listen=listen, resume=resume)


# ------------------------------------------------------------------------------ checkpoints


@main.group()
def checkpoint() -> None:
    """Inspects, marks and cleans up a run's checkpoints (local folder or S3)."""


CHECKPOINT_ARGS = [
    click.argument("manifest", type=click.Path(exists=True, dir_okay=False, path_type=Path)),
    click.option(
        "--workdir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="The run's folder, which a relative local checkpoint path starts from "
        "(default: runs/<name>).",
    ),
]


def checkpoint_args(func: Any) -> Any:
    """Adds MANIFEST and --workdir."""
    for option in reversed(CHECKPOINT_ARGS):
        func = option(func)
    return func


KEY_OPTIONS = [
    click.option(
        "--key-file",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="The server's checkpoint key (default: $FEDCORE_CHECKPOINT_KEY_FILE, else "
        "<workdir>/keys/checkpoint.key); with --client, that client's own (default: "
        "<workdir>/keys/client-<i>-checkpoint.key).",
    ),
    click.option(
        "--kdc-key-file",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="The KDC's state key (default: $FEDCORE_KDC_STATE_KEY_FILE, else "
        "<workdir>/keys/kdc-state.key).",
    ),
]


def key_options(func: Any) -> Any:
    """Adds --key-file and --kdc-key-file."""
    for option in reversed(KEY_OPTIONS):
        func = option(func)
    return func


KEY_NAMES = {"server": "checkpoint key", "kdc": "KDC state key"}
"""What a key is called in messages, per side (a client's: ``checkpoint key of client <i>``)."""


@dataclass
class RunCheckpoints:
    """A run's checkpoint store and the checkpointers over it, each with its key where found.

    Attributes:
        store: the run's store.
        server: the server's rounds.
        kdc: the KDC's state versions.
        clients: a decentralized protocol's clients' own rounds, by index (empty otherwise).
    """

    store: ObjectStore
    server: Checkpointer
    kdc: Checkpointer
    clients: dict[int, Checkpointer]

    def sides(self) -> list[tuple[str, str, Checkpointer]]:
        """(name, label of a number, checkpointer) of every side: server, KDC, each client."""
        return [
            ("server", "round", self.server),
            ("kdc", "kdc version", self.kdc),
            *((f"client-{i}", f"client {i} round", c) for i, c in self.clients.items()),
        ]


def _checkpointers(
    manifest: Path,
    workdir: Path | None,
    *,
    key_file: Path | None = None,
    kdc_key_file: Path | None = None,
    require: str | None = None,
) -> RunCheckpoints:
    """The run's store and its checkpointers, each with its key when its file exists
    (``require``: ``server``, ``kdc`` or ``client-<i>``, whose key must be there; with
    ``client-<i>``, ``key_file`` is that client's). Keys are only read, never created here:
    a client's only from ``--key-file`` or ``<workdir>/keys/client-<i>-checkpoint.key``."""
    from fedcore.checkpoint import (
        CHECKPOINT_KEY_ENV,
        CHECKPOINT_KEY_NAME,
        KDC_STATE_KEY_ENV,
        KDC_STATE_KEY_NAME,
        KEYS_FOLDER,
        client_checkpoint_key_name,
        client_checkpointer,
        kdc_checkpointer,
        key_file_for,
        open_store,
        read_key,
        server_checkpointer,
    )
    from fedcore.roles._common import spec_fingerprint
    from fedcore.spec import load_manifest, protocol_facts

    run = load_manifest(manifest)
    name = run.metadata.name
    spec = run.spec.checkpoint
    folder = workdir or Path("runs") / name
    store = open_store(spec, name=name, workdir=folder)
    ids = {"run": name, "fingerprint": spec_fingerprint(run)}
    client_key = key_file if require and require.startswith("client-") else None
    files = {
        "server": (key_file if client_key is None else None)
        or key_file_for(CHECKPOINT_KEY_ENV, folder, CHECKPOINT_KEY_NAME),
        "kdc": kdc_key_file or key_file_for(KDC_STATE_KEY_ENV, folder, KDC_STATE_KEY_NAME),
    }
    decentralized = protocol_facts(run.spec.protocol.name).decentralized
    indexes = range(run.spec.clients.count) if decentralized else range(0)
    for index in indexes:
        side = f"client-{index}"
        files[side] = (client_key if side == require else None) or (
            folder / KEYS_FOLDER / client_checkpoint_key_name(index)
        )
    if require is not None and require not in files:
        raise FedcoreError(
            f"Run {name!r} has no client {require.removeprefix('client-')}: its clients are "
            f"0 to {run.spec.clients.count - 1}."
            if decentralized
            else f"Run {name!r} has no checkpoints of {require}: only a decentralized "
            f"protocol's clients keep their own."
        )
    keys = {
        side: read_key(
            path, what=KEY_NAMES.get(side, f"checkpoint key of {side.replace('-', ' ')}")
        )
        if side == require or path.exists()
        else None
        for side, path in files.items()
    }
    return RunCheckpoints(
        store=store,
        server=server_checkpointer(store, spec, key=keys["server"], **ids),
        kdc=kdc_checkpointer(store, spec, key=keys["kdc"], **ids),
        clients={
            index: client_checkpointer(store, spec, index=index, key=keys[f"client-{index}"], **ids)
            for index in indexes
        },
    )


@checkpoint.command("list")
@checkpoint_args
@key_options
@click.option(
    "--verify",
    is_flag=True,
    help="Read every checkpoint and check its signature and checksums (needs the keys).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def checkpoint_list(
    manifest: Path,
    workdir: Path | None,
    key_file: Path | None,
    kdc_key_file: Path | None,
    verify: bool,
    as_json: bool,
) -> None:
    """Lists the run's checkpoints: the server's rounds, the KDC's state versions and, for a
    decentralized protocol, each client's own rounds."""
    from fedcore.errors import CheckpointError

    found = _checkpointers(manifest, workdir, key_file=key_file, kdc_key_file=kdc_key_file)
    report: dict[str, Any] = {"store": found.store.describe(), "server": [], "kdc": []}
    if found.clients:
        report["clients"] = {str(index): [] for index in found.clients}
    bad = 0
    lines: list[str] = []
    for side, label, checkpointer in found.sides():
        client = side.removeprefix("client-")
        entries = report["clients"][client] if client != side else report[side]
        if verify and checkpointer.signed:
            try:
                record = checkpointer.latest_record()
                report.setdefault("latest", {})[side] = None if record is None else record.round
            except CheckpointError as exc:
                report.setdefault("latest", {})[side] = f"BAD: {exc}"
                bad += 1
        for info in checkpointer.entries():
            entry: dict[str, Any] = {
                "version" if side == "kdc" else "round": info.round,
                "bytes": info.bytes,
                "marked": info.marked,
                "location": info.location,
            }
            if verify and not checkpointer.signed:
                entry["verified"] = False
                entry["error"] = (
                    "no key to verify it with (--key-file, --kdc-key-file)"
                    if not side.startswith("client-")
                    else f"no key to verify it with (keys/{side}-checkpoint.key, or "
                    f"`checkpoint rollback --client` with --key-file)"
                )
                bad += 1
            elif verify:
                try:
                    checkpointer.load(info.round)
                    entry["verified"] = True
                except CheckpointError as exc:
                    entry["verified"] = False
                    entry["error"] = str(exc)
                    bad += 1
            entries.append(entry)
            flags = ["marked" if entry["marked"] else ""]
            if verify:
                flags.append("ok" if entry["verified"] else f"BAD: {entry['error']}")
            size = f"{entry['bytes'] / 1e6:.2f} MB" if entry["bytes"] >= 0 else "unreadable"
            text = "  ".join(flag for flag in flags if flag)
            lines.append(f"  {label} {info.round:>8}  {size:>12}  {text}".rstrip())
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo(f"Checkpoints in {report['store']}:")
        for line in lines or ["  (none)"]:
            click.echo(line)
        for side, label, _ in found.sides():
            if side in report.get("latest", {}):
                latest = report["latest"][side]
                click.echo(f"  latest {label} record: {'none' if latest is None else latest}")
    if bad:
        sys.exit(1)


@checkpoint.command("mark")
@checkpoint_args
@click.argument("round_", metavar="ROUND", type=click.IntRange(0))
@click.option("--note", default="", help="Why it is kept (stored with the mark).")
def checkpoint_mark(manifest: Path, workdir: Path | None, round_: int, note: str) -> None:
    """Marks the checkpoint of ROUND to keep: retention never deletes it."""
    _checkpointers(manifest, workdir).server.mark(round_, note)
    click.echo(f"Marked the checkpoint of round {round_} to keep.")


@checkpoint.command("unmark")
@checkpoint_args
@click.argument("round_", metavar="ROUND", type=click.IntRange(0))
def checkpoint_unmark(manifest: Path, workdir: Path | None, round_: int) -> None:
    """Removes the mark of ROUND; retention may then delete it after the next checkpoint."""
    was = _checkpointers(manifest, workdir).server.unmark(round_)
    click.echo(
        f"Unmarked the checkpoint of round {round_}."
        if was
        else f"The checkpoint of round {round_} was not marked."
    )


@checkpoint.command("rollback")
@checkpoint_args
@key_options
@click.argument("round_", metavar="ROUND", type=click.IntRange(0))
@click.option("--kdc", is_flag=True, help="The KDC's state versions, not the server's rounds.")
@click.option(
    "--client",
    "client",
    type=click.IntRange(0),
    default=None,
    help="Client I's own rounds (a decentralized protocol's), not the server's; --key-file is "
    "then that client's key.",
)
@click.option(
    "--adopt-unsigned",
    is_flag=True,
    help="Also take an unsigned checkpoint (from a fedcore before signed checkpoints) whose "
    "sums check, and sign it with the key.",
)
@click.option("--yes", is_flag=True, help="Really do it (without it, only say what would go).")
def checkpoint_rollback(
    manifest: Path,
    workdir: Path | None,
    key_file: Path | None,
    kdc_key_file: Path | None,
    round_: int,
    kdc: bool,
    client: int | None,
    adopt_unsigned: bool,
    yes: bool,
) -> None:
    """Takes the checkpoint of ROUND as the latest, knowingly: checks it with the key, deletes
    every newer checkpoint (tampered or not: copy them away first to keep them) and records
    ROUND as the latest, so that --resume starts from it."""
    if kdc and client is not None:
        raise click.UsageError("Pass --kdc or --client, not both.")
    side = "kdc" if kdc else "server" if client is None else f"client-{client}"
    found = _checkpointers(
        manifest, workdir, key_file=key_file, kdc_key_file=kdc_key_file, require=side
    )
    checkpointer = found.kdc if kdc else found.server if client is None else found.clients[client]
    label = "KDC version" if kdc else "round" if client is None else f"client {client}'s round"
    newer = [n for n in checkpointer.rounds() if n > round_]
    if not yes:
        if not adopt_unsigned:
            checkpointer.load(round_)  # refuses, naming why, if it does not verify
        click.echo(
            f"Would take the checkpoint of {label} {round_} as the latest and delete "
            f"{label}s {newer or 'none'} in {checkpointer.store.describe()}; pass --yes to do it."
        )
        return
    deleted = checkpointer.rollback(round_, adopt_unsigned=adopt_unsigned)
    click.echo(
        f"The checkpoint of {label} {round_} is now the latest; deleted {label}s "
        f"{deleted or 'none'}."
    )


@checkpoint.command("history")
@checkpoint_args
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: attempt -> events.")
def checkpoint_history(manifest: Path, workdir: Path | None, as_json: bool) -> None:
    """Prints the events each server pod kept in the run's checkpoint store: one block per
    attempt (a pod replaced mid-run leaves its events up to its last checkpoint there)."""
    from fedcore.roles._history import read_history

    store = _checkpointers(manifest, workdir).store
    attempts = read_history(store)
    if as_json:
        click.echo(json.dumps({"store": store.describe(), "attempts": attempts}))
        return
    click.echo(f"Events kept in {store.describe()}:")
    if not attempts:
        click.echo("  (none: only pods keep their events there; fedcore run keeps events.jsonl)")
    for name, events in attempts.items():
        click.echo(f"  attempt {name}: {len(events)} events")
        for event in events:
            click.echo(f"    {_event_line(event)}")


def _event_line(event: dict[str, Any]) -> str:
    """One event as ``<UTC time> <event> <a few fields>``."""
    when = dt.datetime.fromtimestamp(float(event.get("time", 0)), dt.UTC).strftime("%H:%M:%S")
    fields = [
        f"{key}={event[key]}"
        for key in ("round", "start_round", "reason", "accuracy", "location", "message")
        if event.get(key) is not None
    ]
    return " ".join([when, str(event.get("event")), *fields])


@checkpoint.command("purge")
@checkpoint_args
@click.option("--yes", is_flag=True, help="Really delete (without it, only list what would go).")
def checkpoint_purge(manifest: Path, workdir: Path | None, yes: bool) -> None:
    """Deletes every object of the run's checkpoint store: server, KDC, clients, marks,
    leftovers."""
    store = _checkpointers(manifest, workdir).store
    keys = store.list("")
    if not yes:
        click.echo(f"Would delete {len(keys)} objects in {store.describe()}; pass --yes to do it.")
        return
    store.delete(keys)
    click.echo(f"Deleted {len(keys)} objects in {store.describe()}.")


def role_main(args: list[str]) -> None:
    """A forked role's entry point (``fedcore.local.launch.FEDCORE_ROLES``): ``fedcore <args>``."""
    main(args, prog_name="fedcore", standalone_mode=True)


def _add_site_commands() -> None:
    """``fedcore hub`` and ``fedcore site`` (``fedcore.cli.sites``)."""
    from fedcore.cli.sites import hub, site

    main.add_command(hub)
    main.add_command(site)


_add_site_commands()

"""The local runner: one FederatedRun as KDC, server and client processes on loopback.

It does on one machine what the operator does on Kubernetes: issues the run's CA and a
certificate per role, starts the KDC (only when the protocol needs one) and waits for it, then
the server and, beside it, the clients (the server listens on a port picked beforehand; a
client that finds it not listening yet retries, as after any loss); follows the server's
progress events; and stops every child on
Ctrl-C or when the server or KDC fails, showing that role's error. A client that exits with an
error before the server has seen its clients join (a bad address, a port taken, a crash at
start) fails the run at once too: the server would otherwise wait
``spec.failurePolicy.connectTimeoutSeconds`` for it. Later, a lost client is the protocol's
dropout policy's business.

A server or KDC that dies without reporting a failure (killed, crashed) is restarted on the
same port with ``--resume``, up to ``spec.failurePolicy.serverRestarts`` / ``kdcRestarts``
times: it continues from its latest checkpoint while the clients reconnect to it. A role that
reported its failure (quorum lost, checkpoint failed, ...) is not restarted.

While it starts, the runner appends a ``starting`` event to ``events.jsonl`` as each phase
begins (``phase``: ``certificates``, ``kdc``, ``server``, ``clients``), interleaved with the
server's own events (``ready``; then ``connected`` as each client connects, and ``joined``),
so that a progress display shows what the start is doing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedcore._files import write_atomically
from fedcore.checkpoint import (
    CHECKPOINT_KEY_ENV,
    CHECKPOINT_KEY_NAME,
    KDC_STATE_KEY_ENV,
    KDC_STATE_KEY_NAME,
    KEYS_FOLDER,
    ROLE_KEY_ENVS,
    client_checkpoint_key_name,
    ensure_key,
)
from fedcore.errors import RoleFailed, RunAborted
from fedcore.local import groups
from fedcore.local.launch import (
    FEDCORE_ROLES,
    RoleEntry,
    RoleProcess,
    SpawnMode,
    dying_with_parent,
    start_role,
    warm_up,
)
from fedcore.local.ports import LOOPBACK, free_port
from fedcore.local.probe import ModelSizeProbe, available_memory_bytes, builtin_model_bytes
from fedcore.local.threads import ROLE_THREADS
from fedcore.observe.events import EventLog, read_events
from fedcore.spec import FederatedRun, FederatedRunSpec, peer_graph, protocol_facts
from fedcore.transport import issue_run_bundles

READY_SECONDS = 120.0
"""How long a role may take to start (imports included) before the run fails."""
STOP_SECONDS = 10.0
"""How long children get after SIGTERM before SIGKILL."""
PROBE_SECONDS = 60.0
"""How long the clients' start waits for the probe's size of the model (``_settle_groups``)."""

ProgressCallback = Callable[[dict[str, Any]], None]


@dataclass
class Child:
    """One role process and where its output goes."""

    name: str
    process: RoleProcess
    log_path: Path
    metrics_port: int

    def tail(self, lines: int = 25) -> str:
        """Returns the last lines of the child's log."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class LocalRunResult:
    """What a finished local run reports (``fedcore run --json`` prints ``as_json()``)."""

    phase: str
    rounds: int
    accuracy: float | None
    loss: float | None
    wall_seconds: float
    startup_seconds: float | None
    round_seconds: list[float] = field(default_factory=list)
    workdir: str = ""
    model: str | None = None
    reason: str | None = None
    message: str | None = None
    epsilon: float | None = None
    epsilon_claim: dict[str, str] | None = None
    """What epsilon bounds: its adjacency and amplification (None without DP)."""
    rounds_completed: int | None = None
    bytes_sent: int | None = None
    bytes_received: int | None = None
    restarts: dict[str, int] = field(default_factory=dict)
    attempt: int = 1
    """Which start of the run folder this was (``events.jsonl`` marks each)."""
    events: str = ""
    """The run's events file (every attempt's, appended)."""
    logs: str = ""
    """This attempt's role logs (earlier attempts' in ``attempt-<n>/`` under it)."""
    evaluation: dict[str, Any] = field(default_factory=dict)
    """The final evaluation's other entries, when reported: evaluated_examples, per_class
    (the clients' evaluation), server_accuracy and server_loss (where Both)."""

    def as_json(self) -> dict[str, Any]:
        """Returns the summary as one JSON-able object."""
        median = statistics.median(self.round_seconds) if self.round_seconds else None
        return {
            "phase": self.phase,
            "rounds": self.rounds,
            "accuracy": self.accuracy,
            "loss": self.loss,
            "wall_seconds": round(self.wall_seconds, 4),
            "startup_seconds": None
            if self.startup_seconds is None
            else round(self.startup_seconds, 4),
            "median_round_seconds": None if median is None else round(median, 6),
            "workdir": self.workdir,
            "model": self.model,
            "rounds_completed": self.rounds_completed,
            "epsilon": self.epsilon,
            "epsilon_claim": self.epsilon_claim,
            "server_bytes_sent": self.bytes_sent,
            "server_bytes_received": self.bytes_received,
            "restarts": dict(self.restarts),
            **self.evaluation,
            "attempt": self.attempt,
            "events": self.events,
            "logs": self.logs,
            "reason": self.reason,
            "message": self.message,
        }


def file_size(path: Path) -> int:
    """The size of ``path`` in bytes, 0 when there is no such file."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def earlier_attempts(events: Path) -> int:
    """How many starts ``events`` (a run's ``events.jsonl``) records: its ``attempt`` events,
    or 1 for a file of a version that wrote none but holds events; 0 when there is none."""
    found, _ = read_events(events)
    marked = sum(1 for event in found if event.get("event") == "attempt")
    return marked or (1 if found else 0)


def keep_earlier_logs(logs: Path, attempt: int) -> None:
    """Moves the files an earlier start left in ``logs`` into ``logs/attempt-<attempt - 1>``,
    so that start ``attempt`` writes fresh logs and none is overwritten."""
    logs.mkdir(parents=True, exist_ok=True)
    earlier = [path for path in logs.iterdir() if path.is_file()]
    if not earlier:
        return
    kept = logs / f"attempt-{max(1, attempt - 1)}"
    kept.mkdir(exist_ok=True)
    for path in earlier:
        path.rename(kept / path.name)


def peer_arguments(spec: FederatedRunSpec) -> dict[int, list[str]]:
    """Each client's peer options on loopback: a free port to listen on, and the address of
    every out-neighbour (``--peer-listen``, ``--peer INDEX=HOST:PORT``)."""
    graph, _ = peer_graph(spec)
    ports = [free_port() for _ in range(spec.clients.count)]
    return {
        index: [
            "--peer-listen",
            f"{LOOPBACK}:{ports[index]}",
            *(
                item
                for to in graph.out_neighbours(index)
                for item in ("--peer", f"{to}={LOOPBACK}:{ports[to]}")
            ),
        ]
        for index in range(spec.clients.count)
    }


class LocalRun:
    """Runs one FederatedRun as local processes.

    Args:
        run: the validated manifest.
        manifest: the manifest file the roles read.
        workdir: the run's folder (PKI, logs, events, checkpoints, final model).
        resume: start the server from the latest checkpoint.
        require_checkpoint: with ``resume``, the server refuses to start (``NoCheckpoint``)
            when there is no checkpoint; else it starts at round 1. Restarts of a dead server
            never require one (it may have died before its first checkpoint).
        metrics: serve /metrics on a free port per role.
        threads: torch threads per role process.
        spawn: ``fork`` roles from a warm forkserver (fast) or ``exec`` each as a command.
        entry: what a role process runs (default: the ``fedcore`` command's roles).
        clients_per_process: clients that share one process (``fedcore clients``); None: as
            ``fedcore.local.groups.clients_per_process`` decides (1 for small runs).
        with_clients: start the clients too; False for a hub, whose sites run them.
        role_args: more arguments for the server and the KDC (e.g. ``--revoked-sites``).
        check: called while the run starts and runs (until its clients joined); it raises
            to stop the run (e.g. a site that refused it, or whose process died).
        memory_bytes: the memory auto fits the processes into (None: what the machine, or
            its container, has available now).
    """

    def __init__(
        self,
        run: FederatedRun,
        manifest: Path,
        *,
        workdir: Path,
        resume: bool = False,
        require_checkpoint: bool = True,
        metrics: bool = True,
        threads: int = ROLE_THREADS,
        spawn: SpawnMode = "fork",
        entry: RoleEntry = FEDCORE_ROLES,
        clients_per_process: int | None = None,
        with_clients: bool = True,
        role_args: tuple[str, ...] = (),
        check: Callable[[], None] | None = None,
        memory_bytes: int | None = None,
    ) -> None:
        self.with_clients = with_clients
        self.role_args = list(role_args)
        self.check = check
        self.run = run
        self.manifest = manifest
        self.workdir = workdir
        self.resume = resume
        self.require_checkpoint = require_checkpoint
        self.metrics = metrics
        self.threads = threads
        self.spawn: SpawnMode = spawn
        self.entry = entry
        decentralized = protocol_facts(run.spec.protocol.name).decentralized
        self.memory_bytes = available_memory_bytes() if memory_bytes is None else memory_bytes
        """The memory auto plans to fit (the machine's available memory unless given)."""
        self._auto = clients_per_process is None
        sized = builtin_model_bytes(run.spec) if self._auto and with_clients else 0
        self.model_bytes = sized or 0
        """The model's bytes as auto planned with them (0 until the model is sized)."""
        self._probe: ModelSizeProbe | None = None
        if clients_per_process is None:
            clients_per_process = self._auto_per_process()
        elif clients_per_process > 1 and decentralized:
            raise RunAborted(
                f"Protocol {run.spec.protocol.name!r} is decentralized: each client serves "
                f"peer links in a process of its own, so --clients-per-process must be 1.",
                reason="InvalidOptions",
            )
        self.client_groups = groups.client_groups(run.spec.clients.count, clients_per_process)
        """The clients of each client process (one each, unless grouped). With auto, settled
        once the model is sized: here for a built-in model, else when the clients start."""
        self.children: dict[str, Child] = {}
        self.events_path = workdir / "events.jsonl"
        self.kdc_events_path = workdir / "kdc-events.jsonl"
        self.metrics_ports: dict[str, int] = {}
        self.restarts: dict[str, int] = {}
        self._launch: dict[str, tuple[list[str], int, Path]] = {}
        self._ports: dict[str, int] = {}
        self._kdc_offset = 0
        self._attempt_offset = 0
        """Where this attempt's events begin in ``events.jsonl`` (earlier attempts' stay)."""
        self._kdc_attempt_offset = 0
        self.attempt = 1
        """Which start of this run folder this is (1, then 2 after a resume, ...)."""
        self._preparer: subprocess.Popen[bytes] | None = None
        self._start_offset = 0
        """How far ``start`` has read ``events.jsonl`` to hand its events to its callback."""
        self._delivered = 0
        """How many events ``start`` handed to its callback (``wait`` does not repeat them)."""
        self._started = time.monotonic()
        self._started_wall = time.time()
        warm_up(spawn, entry)
        if sized is None and not decentralized:
            # Measure the model beside the start (certificates, the server) and settle the
            # groups before the clients start (_settle_groups).
            self._probe = ModelSizeProbe(manifest, timeout=PROBE_SECONDS)

    # ------------------------------------------------------------------------- set-up

    def _announce(self, on_event: ProgressCallback | None, phase: str, **fields: Any) -> None:
        """Appends a ``starting`` event for ``phase`` and hands the new events to ``on_event``."""
        EventLog(self.events_path).emit("starting", phase=phase, **fields)
        self._deliver(on_event)

    def _deliver(self, on_event: ProgressCallback | None) -> None:
        """Hands the events appended since the last call to ``on_event`` (if any)."""
        if on_event is None:
            return
        found, self._start_offset = read_events(self.events_path, self._start_offset)
        self._delivered += len(found)
        for event in found:
            on_event(event)

    def _prepare(self, on_event: ProgressCallback | None = None) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.attempt = earlier_attempts(self.events_path) + 1
        keep_earlier_logs(self.workdir / "logs", self.attempt)
        self._attempt_offset = file_size(self.events_path)
        self._kdc_attempt_offset = file_size(self.kdc_events_path)
        self._start_offset, self._delivered = self._attempt_offset, 0
        self._prepare_data()
        EventLog(self.events_path).emit("attempt", attempt=self.attempt, resume=self.resume)
        pki = self.workdir / "pki"
        if pki.exists():
            shutil.rmtree(pki)  # a fresh CA for every start, resumed or not
        self._announce(on_event, "certificates")
        count = self.run.spec.clients.count
        # Every certificate carries only its own party's role name (client-3.fedcore.invalid),
        # which every caller checks whatever address it dials (the server, the KDC, a peer
        # link): no name such as localhost is shared, so no certificate passes as another's.
        if not self.with_clients:  # a hub: the sites make their clients' keys themselves
            count = 0
        ca, bundles = issue_run_bundles(self.run.metadata.name, num_clients=count)
        for common_name, bundle in bundles.items():
            bundle.write(pki / common_name)
        if not self.with_clients:  # a hub signs its sites' clients' requests with it
            cert_pem, key_pem = ca.to_pem()
            (pki / "ca").mkdir(mode=0o700)
            write_atomically(pki / "ca" / "ca.crt", cert_pem, mode=0o644)
            write_atomically(pki / "ca" / "ca.key", key_pem, mode=0o600)
        shutil.copyfile(self.manifest, self.workdir / "manifest.yaml")
        # Each role's checkpoint key, kept across starts (a resume needs the same one): 0600
        # files in a 0700 folder, each handed to its own role only (role_env).
        for name, _ in self._role_keys().values():
            ensure_key(self.workdir / KEYS_FOLDER / name)

    def _prepare_data(self) -> None:
        """Starts the entry's data preparation (``fedcore data prepare MANIFEST``), its output in
        ``logs/data-prepare.log``: it parses the data source into this machine's cache on the
        core the forkserver's imports leave free, so that no role waits on the parse. Its
        failure is no one's business: a role that then misses the cache parses (and reports)
        the source itself."""
        if not self.entry.prepare:
            return
        command = [sys.executable, "-m", self.entry.module, *self.entry.prepare, str(self.manifest)]
        with (self.workdir / "logs" / "data-prepare.log").open("wb") as log:
            self._preparer = subprocess.Popen(
                dying_with_parent(command),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.role_env("data-prepare"),
            )

    def _role_keys(self) -> dict[str, tuple[str, str]]:
        """The key file (in ``keys/``) and its variable of each role process that has one: the
        server, the KDC, and each client of a decentralized protocol (its own checkpoints)."""
        facts = protocol_facts(self.run.spec.protocol.name)
        keys = {"server": (CHECKPOINT_KEY_NAME, CHECKPOINT_KEY_ENV)}
        if facts.needs_kdc:
            keys["kdc"] = (KDC_STATE_KEY_NAME, KDC_STATE_KEY_ENV)
        if facts.decentralized and self.with_clients:  # a process per client (groups.py)
            for index in range(self.run.spec.clients.count):
                keys[f"client-{index}"] = (client_checkpoint_key_name(index), CHECKPOINT_KEY_ENV)
        return keys

    def role_env(self, name: str) -> dict[str, str]:
        """The environment of the role process ``name``: this one's, with the role's own key
        file (the server's checkpoint key, the KDC's state key, a decentralized client's own
        checkpoint key) and no other role's."""
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(self.threads))
        env["PYTHONUNBUFFERED"] = "1"
        for variable in ROLE_KEY_ENVS:
            env.pop(variable, None)
        if name in self._role_keys():
            key_name, variable = self._role_keys()[name]
            env[variable] = str((self.workdir / KEYS_FOLDER / key_name).absolute())
        return env

    def _role_args(self, role: str, tls_name: str, events: Path | None) -> tuple[list[str], int]:
        port = free_port() if self.metrics else 0
        args = [
            role,
            "--manifest",
            str(self.workdir / "manifest.yaml"),
            "--tls-dir",
            str(self.workdir / "pki" / tls_name),
            "--workdir",
            str(self.workdir),
            "--metrics-port",
            str(port),
            "--threads",
            str(self.threads),
        ]
        if events is not None:
            args += ["--events", str(events)]
        if role in ("server", "kdc"):
            args += self.role_args
        return args, port

    def _spawn(self, name: str, args: list[str], port: int) -> Child:
        log_path = self.workdir / "logs" / f"{name}.log"
        env = self.role_env(name)
        process = start_role(self.spawn, self.entry, args, log_path, env)
        child = Child(name, process, log_path, port)
        self.children[name] = child
        if port:
            self.metrics_ports[name] = port
        return child

    def _wait_ready(self, child: Child, events: Path, offset: int = 0) -> tuple[int, int]:
        """Waits for ``child``'s ready event after ``offset``; returns (port, new offset).

        Raises:
            RunAborted: the role reported its failure (a ``failed`` event): its reason.
            RoleFailed: it exited, or was not ready in time, without saying why.
        """
        deadline = time.monotonic() + READY_SECONDS
        while time.monotonic() < deadline:
            found, offset = read_events(events, offset)
            for event in found:
                if event.get("event") == "ready":
                    return int(event["port"]), offset
                if event.get("event") == "failed":  # it said why: its reason is the run's
                    raise RunAborted(
                        f"The {child.name} failed: {event.get('message')}\n{child.tail()}",
                        reason=str(event.get("reason") or "RoleFailed"),
                        round=event.get("round"),
                    )
            code = child.process.poll()
            if code is not None:
                raise RoleFailed(
                    child.name,
                    f"exited with code {code} while starting:\n{child.tail()}",
                    exit_code=code,
                )
            time.sleep(0.05)
        raise RoleFailed(child.name, f"was not ready after {READY_SECONDS} s:\n{child.tail()}")

    def start(self, on_event: ProgressCallback | None = None) -> None:
        """Issues the PKI and starts the KDC (if needed), the server, then every client.

        Args:
            on_event: called with each event of ``events.jsonl`` as the start goes on (the
                ``starting`` phases and the server's ``ready``); ``wait`` then does not hand
                these to its own callback again.
        """
        self._started = time.monotonic()
        self._started_wall = time.time()
        self._prepare(on_event)
        spec = self.run.spec
        kdc_address = None
        resume = ["--resume"] if self.resume else []
        if protocol_facts(spec.protocol.name).needs_kdc:
            self._announce(on_event, "kdc")
            events = self.kdc_events_path
            args, port = self._role_args("kdc", "kdc", events)
            self._launch["kdc"] = (args, port, events)
            child = self._spawn("kdc", [*args, "--listen", f"{LOOPBACK}:0", *resume], port)
            self._ports["kdc"], self._kdc_offset = self._wait_ready(
                child, events, self._kdc_attempt_offset
            )
            kdc_address = f"{LOOPBACK}:{self._ports['kdc']}"
        args, port = self._role_args("server", "server", self.events_path)
        if kdc_address and protocol_facts(spec.protocol.name).server_uses_kdc:
            args += ["--kdc", kdc_address]
        if self.memory_bytes is not None:  # Auto storage decides as the groups were planned
            args += ["--memory-bytes", str(self.memory_bytes)]
        self._launch["server"] = (args, port, self.events_path)
        self._announce(on_event, "server")
        strict = ["--require-checkpoint"] if self.resume and self.require_checkpoint else []
        # With clients to follow, the server listens on a port picked now, and the clients
        # start beside it instead of after it (they connect once it listens, retrying as
        # they do after any loss): their start overlaps the server's.
        listen = free_port() if self.with_clients else 0
        server = self._spawn(
            "server", [*args, "--listen", f"{LOOPBACK}:{listen}", *resume, *strict], port
        )
        if self.with_clients:
            self._start_clients(on_event, f"{LOOPBACK}:{listen}", kdc_address)
        self._ports["server"], _ = self._wait_ready(server, self.events_path, self._attempt_offset)
        self._deliver(on_event)  # the server's ready (and what came with it) before start returns

    def _start_clients(
        self, on_event: ProgressCallback | None, server_address: str, kdc_address: str | None
    ) -> None:
        """Starts every client process (a client or a group of them each)."""
        spec = self.run.spec
        peers = peer_arguments(spec) if protocol_facts(spec.protocol.name).decentralized else {}
        self._settle_groups()
        planned: dict[str, int] = {}
        if self._auto and self._memory_grouped():  # say why there are fewer processes
            planned = {"model_bytes": self.model_bytes, "memory_bytes": self.memory_bytes or 0}
            per_process = max(len(group) for group in self.client_groups)
            on_disk = groups.uploads_on_disk(
                spec.uploads.storage, self.model_bytes, self.memory_bytes
            )
            needed = groups.planned_bytes(
                spec.clients.count, per_process, self.model_bytes, uploads_on_disk=on_disk
            )
            if needed > groups.MEMORY_FRACTION * (self.memory_bytes or 0):
                planned["needed_bytes"] = int(needed)  # even one process of clients is too many
        self._announce(
            on_event,
            "clients",
            clients=spec.clients.count,
            processes=len(self.client_groups),
            **planned,
        )
        for group in self.client_groups:
            if len(group) == 1:
                (index,) = group
                args, port = self._role_args("client", f"client-{index}", None)
                args += ["--index", str(index), "--server", server_address]
                args += peers.get(index, [])
            else:
                args, port = self._group_args(group)
                args += ["--server", server_address]
            if kdc_address:
                args += ["--kdc", kdc_address]
            self._spawn(groups.group_name(group), args, port)

    def _auto_per_process(self) -> int:
        """``--clients-per-process auto`` for this run, with what is known of its model."""
        spec = self.run.spec
        return groups.clients_per_process(
            spec.clients.count,
            decentralized=protocol_facts(spec.protocol.name).decentralized,
            model_bytes=self.model_bytes,
            memory_bytes=self.memory_bytes,
            storage=spec.uploads.storage,
        )

    def _memory_grouped(self) -> bool:
        """Whether memory put more clients in a process than the cores alone would."""
        spec = self.run.spec
        by_cores = groups.clients_per_process(
            spec.clients.count, decentralized=protocol_facts(spec.protocol.name).decentralized
        )
        return max((len(group) for group in self.client_groups), default=0) > by_cores

    def _settle_groups(self) -> None:
        """With auto and a model only a probe can size: waits for its size (``PROBE_SECONDS``
        at most) and regroups the clients if their processes would not fit the memory."""
        probe, self._probe = self._probe, None
        if probe is None:
            return
        measured = probe.result(PROBE_SECONDS)
        if measured is None:
            return  # unknown: the groups by cores stand, and the roles report a broken model
        self.model_bytes = measured
        self.client_groups = groups.client_groups(
            self.run.spec.clients.count, self._auto_per_process()
        )

    def _group_args(self, group: list[int]) -> tuple[list[str], int]:
        """``fedcore clients`` arguments for ``group``: each member's bundle and metrics port
        (recorded in ``metrics_ports`` under ``client-<i>``); the group's own port is 0."""
        args = [
            "clients",
            "--manifest",
            str(self.workdir / "manifest.yaml"),
            "--tls-dir",
            str(self.workdir / "pki" / "client-{index}"),
            "--workdir",
            str(self.workdir),
            "--threads",
            str(self.threads),
        ]
        for index in group:
            port = free_port() if self.metrics else 0
            if port:
                self.metrics_ports[f"client-{index}"] = port
            args += ["--member", f"{index}:{port}"]
        return args, 0

    # ------------------------------------------------------------------------ running

    def follow(self, on_event: ProgressCallback | None = None) -> Iterator[dict[str, Any]]:
        """Yields the server's events until it exits, restarting a server or KDC that died
        without reporting a failure (within the spec's restart budget).

        Raises:
            RoleFailed: the server or KDC exited with an error and is not restarted.
        """
        offset = self._attempt_offset
        reported = False  # the current server reported a failure
        joined = False  # the server saw its clients join (dropouts are its business from then)
        while True:
            found, offset = read_events(self.events_path, offset)
            reported = reported or any(e.get("event") == "failed" for e in found)
            joined = joined or any(e.get("event") == "joined" for e in found)
            yield from found
            if not joined:
                self._check_clients_started()
                if self.check is not None:
                    self.check()
            server = self.children["server"]
            exited = server.process.poll()
            if exited is not None:
                found, offset = read_events(self.events_path, offset)
                reported = reported or any(e.get("event") == "failed" for e in found)
                yield from found
                if exited == 0:
                    return
                if not reported and self._may_restart("server"):
                    self._restart("server", exited)
                    continue
                raise RoleFailed(
                    "server", f"exited with code {exited}:\n{server.tail()}", exit_code=exited
                )
            kdc = self.children.get("kdc")
            code = None if kdc is None else kdc.process.poll()
            if kdc is not None and code is not None:
                if not self._kdc_reported_failure() and self._may_restart("kdc"):
                    self._restart("kdc", code)
                    continue
                raise RoleFailed("kdc", f"exited with code {code}:\n{kdc.tail()}", exit_code=code)
            time.sleep(0.02)

    def _check_clients_started(self) -> None:
        """Raises RoleFailed for a client that already exited with an error.

        Raises:
            RoleFailed: a client process ended with a non-zero exit code.
        """
        for name, child in self.children.items():
            if not name.startswith("client"):  # client-3, clients-0-24
                continue
            code = child.process.poll()
            if code is not None and code != 0:
                raise RoleFailed(
                    name,
                    f"exited with code {code} before the run's clients joined:\n{child.tail()}",
                    exit_code=code,
                )

    def _may_restart(self, role: str) -> bool:
        policy = self.run.spec.failure_policy
        budget = policy.server_restarts if role == "server" else policy.kdc_restarts
        return role in self._launch and self.restarts.get(role, 0) < budget

    def _kdc_reported_failure(self) -> bool:
        found, self._kdc_offset = read_events(self.kdc_events_path, self._kdc_offset)
        return any(event.get("event") == "failed" for event in found)

    def _restart(self, role: str, exit_code: int) -> None:
        """Starts ``role`` again on its port with ``--resume`` and waits until it is ready.

        The dead process's log is kept as ``logs/<role>.log.<n>``.

        Raises:
            RoleFailed: the restarted role did not come up.
        """
        count = self.restarts.get(role, 0) + 1
        self.restarts[role] = count
        args, metrics_port, events = self._launch[role]
        old = self.children[role]
        with contextlib.suppress(OSError):
            old.log_path.rename(old.log_path.with_name(f"{old.log_path.name}.{count}"))
        EventLog(self.events_path).emit("restarted", role=role, restart=count, exit_code=exit_code)
        offset = events.stat().st_size if events.exists() else 0
        listen = ["--listen", f"{LOOPBACK}:{self._ports[role]}"]
        child = self._spawn(role, [*args, *listen, "--resume"], metrics_port)
        _, offset = self._wait_ready(child, events, offset)
        if role == "kdc":
            self._kdc_offset = offset

    def stop(self, grace: float = STOP_SECONDS) -> None:
        """Stops every child: SIGTERM, then SIGKILL after ``grace`` seconds."""
        if self._preparer is not None:
            if self._preparer.poll() is None:
                self._preparer.kill()
            self._preparer.wait()
        for child in self.children.values():
            if child.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in self.children.values():
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait()

    def wait_clients(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for the clients to exit on their own."""
        deadline = time.monotonic() + timeout
        for name, child in self.children.items():
            if name.startswith("client"):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.process.wait(max(0.0, deadline - time.monotonic()))

    def _events_until_exit(self) -> Iterator[dict[str, Any]]:
        """Like ``follow``, but a server that reported its own failure ends the stream quietly."""
        reported = False
        try:
            for event in self.follow():
                reported = reported or event.get("event") == "failed"
                yield event
        except RoleFailed as exc:
            if not (reported and exc.role == "server"):
                raise

    def execute(self, on_event: ProgressCallback | None = None) -> LocalRunResult:
        """Starts the run, follows it to the end, stops every child; returns the summary.

        Raises:
            RoleFailed: a role failed (its log's tail is in the message).
            RunAborted: the server stopped the run (e.g. quorum lost) or Ctrl-C.
        """
        self._started = time.monotonic()
        self._started_wall = time.time()
        try:
            self.start(on_event)
        except KeyboardInterrupt:
            self.stop()
            raise RunAborted(
                "The run was interrupted (Ctrl-C) while starting; every role was stopped.",
                reason="Interrupted",
            ) from None
        except BaseException:
            self.stop()
            raise
        return self.wait(on_event)

    def wait(self, on_event: ProgressCallback | None = None) -> LocalRunResult:
        """Follows a started run to its end, then stops every child; returns the summary.

        Raises:
            RoleFailed: a role failed (its log's tail is in the message).
            RunAborted: the server stopped the run (e.g. quorum lost) or Ctrl-C.
        """
        result = LocalRunResult(
            phase="Failed",
            rounds=self.run.spec.rounds,
            accuracy=None,
            loss=None,
            wall_seconds=0.0,
            startup_seconds=None,
            workdir=str(self.workdir),
            attempt=self.attempt,
            events=str(self.events_path),
            logs=str(self.workdir / "logs"),
        )
        failed: dict[str, Any] | None = None
        already_delivered = self._delivered  # by start, to its own callback
        try:
            for event in self._events_until_exit():
                kind = event.get("event")
                if kind == "round":
                    result.round_seconds.append(float(event["seconds"]))
                    if result.startup_seconds is None:
                        first_round_began = float(event["time"]) - float(event["seconds"])
                        result.startup_seconds = first_round_began - self._started_wall
                elif kind == "finished":
                    result.phase = "Succeeded"
                    result.accuracy = event.get("accuracy")
                    result.loss = event.get("loss")
                    result.epsilon = event.get("epsilon")
                    result.epsilon_claim = event.get("epsilon_claim")
                    result.reason = event.get("reason")
                    result.rounds_completed = event.get("rounds_completed")
                    result.bytes_sent = event.get("bytes_sent")
                    result.bytes_received = event.get("bytes_received")
                    result.evaluation = {
                        key: event[key]
                        for key in (
                            "evaluated_examples",
                            "per_class",
                            "server_accuracy",
                            "server_loss",
                        )
                        if key in event
                    }
                elif kind == "restarted":
                    result.restarts = dict(self.restarts)
                elif kind == "failed":
                    failed = event
                if already_delivered > 0:
                    already_delivered -= 1
                elif on_event is not None:
                    on_event(event)
            self.wait_clients(STOP_SECONDS)
        except KeyboardInterrupt:
            raise RunAborted(
                "The run was interrupted (Ctrl-C); every role was stopped.", reason="Interrupted"
            ) from None
        finally:
            self.stop()
            result.wall_seconds = time.monotonic() - self._started
        if failed is not None:
            raise RunAborted(
                str(failed.get("message")),
                reason=str(failed.get("reason")),
                round=failed.get("round"),
            )
        model = self.workdir / "model.safetensors"
        result.model = str(model) if model.exists() else None
        if result.model is None and (self.workdir / "models").is_dir():
            result.model = str(self.workdir / "models")  # each client's own (decentralized)
        return result

"""Tests of how the local runner spreads clients over processes (fedcore.local.groups) and of
what a client group refuses (fedcore.roles.client_group); pure logic, no processes."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedcore.errors import FedcoreError, RunAborted
from fedcore.local import groups
from fedcore.local.runner import LocalRun
from fedcore.roles.client_group import MEMBER, member_tls_dir, name_members_in_logs
from fedcore.spec import load_manifest

MANIFEST = """\
apiVersion: fedcore.dev/v1alpha1
kind: FederatedRun
metadata:
  name: groups-test
spec:
  protocol:
    name: {protocol}
  model:
    kind: MLP
    hidden: [8]
  data:
    source:
      kind: Digits
  clients:
    count: {count}
  rounds: 1
"""


@given(clients=st.integers(0, 2000), per_process=st.integers(1, 300))
def test_groups_cover_every_client_once_in_order_and_evenly(clients: int, per_process: int) -> None:
    # Execute
    found = groups.client_groups(clients, per_process)

    # Assert
    assert [index for group in found for index in group] == list(range(clients))
    assert all(1 <= len(group) <= per_process for group in found)
    if found:
        sizes = {len(group) for group in found}
        assert max(sizes) - min(sizes) <= 1
        assert len(found) == -(-clients // per_process)  # as few processes as the cap allows


def test_groups_refuse_a_count_below_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        groups.client_groups(10, 0)


@pytest.mark.parametrize(
    ("clients", "cores", "decentralized", "expected"),
    [
        (10, 2, False, 1),  # the quickstart: a process per client
        (16, 2, False, 1),  # 8 per core still pays
        (17, 2, False, 5),  # beyond: 2 processes per core, 4 of them
        (50, 2, False, 13),
        (200, 2, False, 50),
        (200, 16, False, 7),
        (200, 2, True, 1),  # peer links: a process each, always
    ],
)
def test_auto_clients_per_process(
    clients: int, cores: int, decentralized: bool, expected: int
) -> None:
    assert groups.clients_per_process(clients, cores=cores, decentralized=decentralized) == expected


GB = 10**9


@pytest.mark.parametrize(
    ("clients", "model_bytes", "memory_bytes", "expected"),
    [
        (4, 404_000_000, 23 * GB, 1),  # 101M parameters: a process each fits
        (4, 4_029_000_000, 23 * GB, 4),  # 1B: the server and one process of 4 (as measured)
        (4, 4_029_000_000, 32 * GB, 2),  # room for two processes of clients
        (4, 4_029_000_000, 8 * GB, 4),  # nothing fits: as few processes as can be
        (10, 40_000, 2 * GB, 3),  # a small model on a small machine: the interpreters count
        (50, 40_000, 23 * GB, 13),  # the cores' rule when memory is no bound
    ],
)
def test_auto_fits_the_processes_into_the_memory(
    clients: int, model_bytes: int, memory_bytes: int, expected: int
) -> None:
    # Execute
    found = groups.clients_per_process(
        clients, cores=2, model_bytes=model_bytes, memory_bytes=memory_bytes
    )

    # Assert: the plan fits, and one more process would not (unless memory is no bound)
    assert found == expected
    fits = groups.MEMORY_FRACTION * memory_bytes
    if found < clients:
        assert groups.planned_bytes(clients, found, model_bytes) <= fits
    by_cores = groups.clients_per_process(clients, cores=2)
    if found > by_cores:
        assert groups.planned_bytes(clients, found - 1, model_bytes) > fits


def test_auto_keeps_a_process_per_client_for_peer_links_whatever_the_memory() -> None:
    found = groups.clients_per_process(
        8, cores=2, decentralized=True, model_bytes=10 * GB, memory_bytes=GB
    )
    assert found == 1


def test_available_memory_is_some_of_the_machines() -> None:
    # Prepare
    from fedcore.local.probe import available_memory_bytes

    meminfo = Path("/proc/meminfo").read_text().splitlines()
    total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))

    # Execute
    found = available_memory_bytes()

    # Assert
    assert found is not None and 0 < found <= total


def test_auto_sizes_a_built_in_model_by_arithmetic_and_fits_it_at_once(tmp_path: Path) -> None:
    # Prepare: one byte less memory than the server and a process per client need
    import math

    from fedcore.local.probe import builtin_model_bytes

    manifest = tmp_path / "run.yaml"
    manifest.write_text(MANIFEST.format(protocol="fedavg", count=4))
    run_spec = load_manifest(manifest)
    size = builtin_model_bytes(run_spec.spec)
    assert size == 4 * (64 * 8 + 8 + 8 * 10 + 10)  # digits' 64 pixels, [8], 10 classes
    memory = math.ceil(groups.planned_bytes(4, 1, size) / groups.MEMORY_FRACTION) - 1

    # Execute
    run = LocalRun(run_spec, manifest, workdir=tmp_path / "w", spawn="exec", memory_bytes=memory)

    # Assert: no child to ask, the groups settled when the run was made
    assert run.model_bytes == size
    assert run._probe is None
    assert run.client_groups == [[0, 1], [2, 3]]


def test_group_names_say_which_clients_a_process_runs() -> None:
    assert groups.group_name([3]) == "client-3"
    assert groups.group_name([0, 1, 2]) == "clients-0-2"


def test_member_bundle_folder_fills_in_the_index() -> None:
    assert member_tls_dir(Path("pki/client-{index}"), 7) == Path("pki/client-7")


def test_member_bundle_folder_without_an_index_is_refused() -> None:
    # Every client of the group would otherwise present one shared key.
    with pytest.raises(FedcoreError, match=r"must contain \{index\}"):
        member_tls_dir(Path("pki/client-0"), 7)


def test_decentralized_run_refuses_clients_sharing_a_process(tmp_path: Path) -> None:
    # Prepare
    manifest = tmp_path / "run.yaml"
    manifest.write_text(MANIFEST.format(protocol="lppa", count=4))
    run = load_manifest(manifest)

    # Execute / Assert
    with pytest.raises(RunAborted, match="decentralized") as caught:
        LocalRun(run, manifest, workdir=tmp_path / "w", clients_per_process=2, spawn="exec")
    assert caught.value.reason == "InvalidOptions"


def test_runner_groups_many_clients_and_keeps_small_runs_one_per_process(tmp_path: Path) -> None:
    # Prepare
    small, large = tmp_path / "small.yaml", tmp_path / "large.yaml"
    small.write_text(MANIFEST.format(protocol="fedavg", count=3))
    large.write_text(MANIFEST.format(protocol="fedavg", count=7))

    # Execute
    alone = LocalRun(load_manifest(small), small, workdir=tmp_path / "a", spawn="exec")
    shared = LocalRun(
        load_manifest(large), large, workdir=tmp_path / "b", spawn="exec", clients_per_process=3
    )

    # Assert
    assert alone.client_groups == [[0], [1], [2]]
    assert shared.client_groups == [[0, 1, 2], [3, 4], [5, 6]]


def test_each_client_task_names_itself_in_the_log_lines_it_writes() -> None:
    # Prepare: a handler formatting %(member)s, as `fedcore clients` sets up
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    root = logging.getLogger()
    handler = Collect()
    handler.setFormatter(logging.Formatter("%(member)s %(message)s"))
    root.addHandler(handler)
    name_members_in_logs()
    log = logging.getLogger("test.member")

    async def client(index: int) -> None:
        MEMBER.set(f"client-{index}")
        await asyncio.sleep(0)  # the other task runs in between
        log.warning("step one")
        await asyncio.to_thread(log.warning, "in a thread")
        log.warning("step two")

    async def both() -> None:
        await asyncio.gather(client(1), client(2))

    # Execute
    try:
        asyncio.run(both())
        log.warning("outside")
    finally:
        root.removeHandler(handler)

    # Assert: every line names the task it came from (or, outside any, the thread)
    assert sorted(lines) == sorted(
        [
            *(f"client-{i} {what}" for i in (1, 2) for what in ("step one", "in a thread")),
            "client-1 step two",
            "client-2 step two",
            "MainThread outside",
        ]
    )


def test_the_server_keeps_its_uploads_on_disk_where_four_models_would_not_fit() -> None:
    # Prepare: a 4 GB model; the memory that just holds the server with its uploads in memory
    model = 4 * 10**9
    holds = -(-groups.server_bytes(model) // groups.MEMORY_FRACTION)  # rounded up
    # Execute / Assert: Auto by the memory (unknown memory: in memory), the others as named
    assert not groups.uploads_on_disk("Auto", model, int(holds))
    assert groups.uploads_on_disk("Auto", model, int(holds) - 2)
    assert not groups.uploads_on_disk("Auto", model, None)
    assert groups.uploads_on_disk("Disk", model, None)
    assert not groups.uploads_on_disk("Memory", model, 1)
    assert groups.server_bytes(model) == groups.PROCESS_BYTES + 4 * model
    assert groups.server_bytes(model, uploads_on_disk=True) == groups.PROCESS_BYTES + 2 * model
    # ...and the grouping plans the server so: with a 1 GB model, 6.5 GB hold the server and
    # 2 processes of clients with its uploads on disk, 1 process with them in memory
    small, memory = 10**9, 6_500_000_000
    by_storage = {
        storage: groups.clients_per_process(
            4, cores=2, model_bytes=small, memory_bytes=memory, storage=storage
        )
        for storage in ("Disk", "Memory", "Auto")
    }
    assert by_storage == {"Disk": 2, "Memory": 4, "Auto": 4}

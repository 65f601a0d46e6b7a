"""Several clients per process (``fedcore run --clients-per-process``): real processes, real
mutual TLS, each client still authenticated as itself, the same model bit for bit."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedcore.simulation import simulate
from fedcore.spec import load_manifest
from tests.integration._runs import fedcore, last_json, write_manifest

pytestmark = pytest.mark.integration

CLIENTS = 6


def _run(folder: Path, manifest: Path, per_process: str, cache: Path) -> dict[str, Any]:
    done = fedcore(
        "run",
        str(manifest),
        "--json",
        "--quiet",
        "--clients-per-process",
        per_process,
        "--workdir",
        str(folder),
        cwd=folder.parent,
        env={"FEDCORE_CACHE_DIR": str(cache)},
    )
    assert done.returncode == 0, done.stderr
    return {"summary": last_json(done.stdout), "folder": folder}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same 6-client job run with 3 clients per process and with a process per client,
    each with a data cache of its own that starts empty."""
    base = tmp_path_factory.mktemp("groups")
    manifest = write_manifest(
        base / "run.yaml", clients={"count": CLIENTS}, rounds=3, checkpoint={"everyRounds": 0}
    )
    return {
        "manifest": manifest,
        "grouped": _run(base / "grouped", manifest, "3", base / "cache-grouped"),
        "single": _run(base / "single", manifest, "1", base / "cache-single"),
    }


def _logs(folder: Path) -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted((folder / "logs").glob("*.log"))}


def test_grouped_clients_give_the_model_of_a_process_per_client_bit_for_bit(runs: dict) -> None:
    # Execute
    grouped = load_file(str(runs["grouped"]["folder"] / "model.safetensors"))
    single = load_file(str(runs["single"]["folder"] / "model.safetensors"))
    simulated = simulate(load_manifest(runs["manifest"])).weights

    # Assert
    assert runs["grouped"]["summary"]["phase"] == "Succeeded"
    assert sorted(grouped) == sorted(single) == sorted(simulated)
    for name in grouped:
        assert np.array_equal(grouped[name], single[name]), name
        assert np.array_equal(grouped[name], simulated[name]), name


def test_two_processes_run_the_six_clients_each_authenticated_as_itself(runs: dict) -> None:
    # Execute
    logs = _logs(runs["grouped"]["folder"])

    # Assert: one log per client process, and the server met every client by its certificate
    assert sorted(logs) == ["clients-0-2.log", "clients-3-5.log", "data-prepare.log", "server.log"]
    connected = re.findall(r"Client (\d+) connected\.", logs["server.log"])
    assert sorted(map(int, connected)) == list(range(CLIENTS))
    # ... and each group's lines name the client they are about (all share one thread)
    named = {
        log: sorted(set(re.findall(r"^\S+ \S+ client-(\d+) INFO", text, re.MULTILINE)))
        for log, text in logs.items()
        if log.startswith("clients-")
    }
    assert named == {"clients-0-2.log": ["0", "1", "2"], "clients-3-5.log": ["3", "4", "5"]}


@pytest.mark.parametrize("mode", ["grouped", "single"])
def test_the_data_source_is_parsed_once_however_many_processes_start(runs: dict, mode: str) -> None:
    # Execute: whoever parses logs it (a cache miss): fedcore data prepare, started beside
    # the roles, or the first role to get there; every other process reads the cache
    logs = _logs(runs[mode]["folder"])
    parses = sum(text.count("Parsed the data source") for text in logs.values())

    # Assert
    assert len(logs) == 1 + (3 if mode == "grouped" else CLIENTS + 1)
    assert parses == 1


def test_auto_groups_the_clients_of_a_user_model_to_fit_the_memory(tmp_path: Path) -> None:
    # Prepare: a user's model by import path, and one byte less memory than the server and a
    # process per client need with this model (but enough without it): auto must measure the
    # model to find that 4 processes do not fit, and then puts 2 clients in each of 2.
    import json
    import math

    from fedcore.learning.data import dataset_info
    from fedcore.learning.models import build_model
    from fedcore.local import groups
    from fedcore.local.runner import LocalRun

    model = {"kind": "Import", "importPath": "tests.integration._user_model:mlp"}
    manifest = write_manifest(
        tmp_path / "run.yaml",
        model=model,
        clients={"count": 4},
        rounds=2,
        checkpoint={"everyRounds": 0},
    )
    run_spec = load_manifest(manifest)
    built = build_model(run_spec.spec.model, *dataset_info(run_spec.spec), seed=0)
    size = sum(p.numel() * p.element_size() for p in [*built.parameters(), *built.buffers()])
    memory = math.ceil(groups.planned_bytes(4, 1, size) / groups.MEMORY_FRACTION) - 1
    assert groups.clients_per_process(4, model_bytes=0, memory_bytes=memory) == 1
    run = LocalRun(run_spec, manifest, workdir=tmp_path / "work", memory_bytes=memory)
    assert run.client_groups == [[0], [1], [2], [3]]  # by cores, before the model is measured

    # Execute
    result = run.execute()

    # Assert
    assert result.phase == "Succeeded"
    assert run.client_groups == [[0, 1], [2, 3]]
    events = [json.loads(line) for line in run.events_path.read_text().splitlines()]
    (phase,) = [e for e in events if e.get("phase") == "clients"]
    assert phase["processes"] == 2
    assert phase["model_bytes"] == size and phase["memory_bytes"] == memory
    assert {"clients-0-1.log", "clients-2-3.log"} <= set(_logs(tmp_path / "work"))


def test_the_model_probe_answers_nothing_for_a_model_that_does_not_build(tmp_path: Path) -> None:
    # Prepare: an import path that names no module (the server reports the error itself)
    from fedcore.local.probe import ModelSizeProbe

    manifest = write_manifest(
        tmp_path / "run.yaml", model={"kind": "Import", "importPath": "fc_no_such_module:make"}
    )

    # Execute
    probe = ModelSizeProbe(manifest, timeout=60)

    # Assert: an answer (None), not a hang until the timeout
    assert probe.result(90) is None
    assert not probe._thread.is_alive()


def test_a_run_short_of_memory_starts_its_clients_in_one_process_and_says_so(
    tmp_path: Path,
) -> None:
    # Prepare: a built-in model (sized by arithmetic) and less memory than the server alone
    # is planned to need
    import json

    from fedcore.local import groups
    from fedcore.local.runner import LocalRun

    manifest = write_manifest(
        tmp_path / "run.yaml", clients={"count": 4}, rounds=2, checkpoint={"everyRounds": 0}
    )
    run = LocalRun(load_manifest(manifest), manifest, workdir=tmp_path / "work", memory_bytes=1)

    # Execute
    result = run.execute()

    # Assert: the run goes on, in one process of clients, and its start said it may not fit
    assert result.phase == "Succeeded"
    assert run.client_groups == [[0, 1, 2, 3]]
    events = [json.loads(line) for line in run.events_path.read_text().splitlines()]
    (phase,) = [e for e in events if e.get("phase") == "clients"]
    assert phase["processes"] == 1 and phase["memory_bytes"] == 1
    # ...with its server's uploads on disk (spec.uploads.storage Auto, 1 byte of memory)
    planned = groups.planned_bytes(4, 4, run.model_bytes, uploads_on_disk=True)
    assert phase["needed_bytes"] == int(planned)
    server_log = (tmp_path / "work" / "logs" / "server.log").read_text()
    assert "Keeping each round's uploads on disk" in server_log

"""The quickstart end to end: `fedcore run examples/digits-fedavg.yaml` matches the floor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.numpy import load_file

from benchmarks.floor import run_floor
from tests.integration._runs import fedcore, last_json, write_manifest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "digits-fedavg.yaml"
RUN_SECONDS = 900.0
"""How long one `fedcore run` may take on a loaded two-core machine."""


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of the quickstart manifest through the CLI, as a user would start it."""
    folder = tmp_path_factory.mktemp("quickstart")
    work = folder / "work"
    done = fedcore(
        "run",
        str(EXAMPLE),
        "--json",
        "--quiet",
        "--workdir",
        str(work),
        cwd=folder,
        timeout=RUN_SECONDS,
    )
    return {"process": done, "work": work}


def test_quickstart_run_succeeds_with_json_summary(quickstart: dict[str, Any]) -> None:
    # Prepare
    done = quickstart["process"]
    # Execute
    summary = last_json(done.stdout)
    # Assert
    assert done.returncode == 0, done.stderr
    assert summary["phase"] == "Succeeded"
    assert summary["rounds"] == 20
    assert summary["reason"] == "RoundsCompleted"
    assert Path(summary["model"]) == quickstart["work"] / "model.safetensors"


def test_quickstart_accuracy_is_within_one_point_of_the_floor(quickstart: dict[str, Any]) -> None:
    # Prepare
    summary = last_json(quickstart["process"].stdout)
    # Execute
    floor = run_floor()
    # Assert
    assert summary["accuracy"] == pytest.approx(floor["accuracy"], abs=0.01)


def test_quickstart_releases_model_and_keeps_last_three_checkpoints(
    quickstart: dict[str, Any],
) -> None:
    # Prepare
    work = quickstart["work"]
    checkpoints = work / "checkpoints"
    # Execute
    model = load_file(str(work / "model.safetensors"))
    folders = sorted(path.name for path in checkpoints.iterdir() if path.is_dir())
    published = [
        json.loads((checkpoints / name / "MANIFEST.json").read_text(encoding="utf-8"))
        for name in folders
    ]
    # Assert
    assert model and all(array.size > 0 for array in model.values())
    assert folders == ["round-00000010", "round-00000015", "round-00000020"]
    assert json.loads((checkpoints / "latest-round.json").read_text())["round"] == 20
    assert [manifest["round"] for manifest in published] == [10, 15, 20]
    assert all(manifest["run"] == "digits-fedavg" for manifest in published)


def test_run_spawn_exec_tiny_manifest_succeeds(tmp_path: Path) -> None:
    # Prepare: every role is a fresh `python -m fedcore <role>` process, as in a pod.
    manifest = write_manifest(
        tmp_path / "tiny.yaml", clients={"count": 2}, rounds=2, checkpoint={"everyRounds": 1}
    )
    work = tmp_path / "work"
    # Execute
    done = fedcore(
        "run",
        str(manifest),
        "--json",
        "--quiet",
        "--spawn",
        "exec",
        "--workdir",
        str(work),
        cwd=tmp_path,
        timeout=RUN_SECONDS,
    )
    # Assert
    assert done.returncode == 0, done.stderr
    summary = last_json(done.stdout)
    assert summary["phase"] == "Succeeded"
    assert summary["rounds"] == 2
    assert 0.0 < summary["accuracy"] <= 1.0
    assert (work / "model.safetensors").exists()
    assert sorted(path.name for path in (work / "checkpoints").iterdir()) == [
        "latest-round.json",
        "round-00000001",
        "round-00000002",
    ]
    assert {"server.log", "client-0.log", "client-1.log"} <= {
        path.name for path in (work / "logs").iterdir()
    }

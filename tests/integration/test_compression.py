"""Compressed uploads and broadcasts on real processes over mutual TLS (spec.transport.compression).

One run with Int8 uploads and BFloat16 broadcasts (stochastic rounding) and the same run exact:
the compressed run's released model is simulate()'s bit for bit (the roles and the simulation
round the same values the same way), and the server received about a quarter of the bytes.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedcore.simulation import simulate
from fedcore.spec import load_manifest
from tests.integration._runs import fedcore, write_manifest

pytestmark = pytest.mark.integration

COMPRESSED = {"uploads": "Int8", "broadcasts": "BFloat16", "rounding": "Stochastic"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("compression")
    done: dict[str, Any] = {}
    for name, compression in (("compressed", COMPRESSED), ("exact", None)):
        changes: dict[str, Any] = {"rounds": 3, "checkpoint": {"everyRounds": 0}}
        if compression is not None:
            changes["transport"] = {"compression": compression}
        manifest = write_manifest(folder / f"{name}.yaml", **changes)
        work = folder / name
        result = fedcore("run", str(manifest), "--json", "--workdir", str(work), cwd=folder)
        assert result.returncode == 0, result.stderr[-3000:]
        done[name] = {
            "manifest": manifest,
            "summary": json.loads(result.stdout.strip().splitlines()[-1]),
            "model": load_file(str(work / "model.safetensors")),
        }
    return done


def test_a_compressed_run_releases_the_model_its_simulation_computes(runs: dict) -> None:
    # Execute
    simulated = simulate(load_manifest(runs["compressed"]["manifest"])).weights
    released = runs["compressed"]["model"]

    # Assert: the same rounding of the same values on both sides, bit for bit, and a model
    # that differs from the exact run's (the compression did happen)
    assert runs["compressed"]["summary"]["phase"] == "Succeeded"
    assert sorted(released) == sorted(simulated)
    for name in released:
        assert np.array_equal(released[name], simulated[name]), name
    exact = runs["exact"]["model"]
    assert any(not np.array_equal(released[name], exact[name]) for name in released)


def test_int8_uploads_bring_the_server_a_third_or_less_of_the_bytes(runs: dict) -> None:
    # Execute
    compressed = runs["compressed"]["summary"]["server_bytes_received"]
    exact = runs["exact"]["summary"]["server_bytes_received"]

    # Assert: a quarter of the tensors' bytes plus the same headers and scales
    assert 0 < compressed < exact / 3

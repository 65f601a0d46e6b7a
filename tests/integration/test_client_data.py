"""Clients' own data end to end: S3 prefixes read with per-client credentials from a real S3
server (SeaweedFS), runs whose server holds no data, and the examples."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from fedcore.errors import DataError
from fedcore.learning.data import _cache, _own, own_data
from fedcore.simulation import simulate
from fedcore.spec import load_manifest, parse_manifest
from tests.integration._runs import fedcore, last_json
from tests.integration._s3 import S3Server, start_s3

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "hospital-records"
SITES = 3


def site_keys(site: int) -> tuple[str, str]:
    return f"site-{site}-key", f"site-{site}-secret-{site * 7919}"


@pytest.fixture(scope="module")
def hospitals(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's hospital tables (examples/make_data.py), written once for this module."""
    out = tmp_path_factory.mktemp("example-data")
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_data.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory, hospitals: Path) -> Iterator[S3Server]:
    """SeaweedFS with one identity per site that may read and list only its own prefix, and
    the first three hospitals' tables under site-<i>/."""
    identities = tuple(
        {
            "name": f"site-{site}",
            "credentials": [{"accessKey": site_keys(site)[0], "secretKey": site_keys(site)[1]}],
            "actions": [f"Read:{BUCKET}/site-{site}/*", f"List:{BUCKET}/site-{site}/*"],
        }
        for site in range(SITES)
    )
    server = start_s3(tmp_path_factory.mktemp("s3"), identities=identities)
    admin: Any = server.client()
    admin.create_bucket(Bucket=BUCKET)
    for site in range(SITES):
        source = hospitals / "hospitals" / f"hospital-{site}" / "records.parquet"
        admin.upload_file(str(source), BUCKET, f"site-{site}/records.parquet")
    yield server
    server.stop()


def credentials(folder: Path) -> Path:
    """One credentials folder per site, laid out as the operator mounts its Secret."""
    for site in range(SITES):
        own = folder / f"creds-{site}"
        own.mkdir(parents=True, exist_ok=True)
        access, secret = site_keys(site)
        (own / "AWS_ACCESS_KEY_ID").write_text(access)
        (own / "AWS_SECRET_ACCESS_KEY").write_text(secret)
    return folder


def hospitals_manifest(
    folder: Path, data: dict[str, Any], *, clients: int = SITES, name: str = "hospitals"
) -> Path:
    """The example's manifest with plain FedAvg (deterministic), ``data`` as its sources."""
    manifest = yaml.safe_load((ROOT / "examples" / "hospitals-tabular.yaml").read_text())
    spec = manifest["spec"]
    manifest["metadata"]["name"] = name
    spec["protocol"] = {"name": "fedavg"}
    spec.pop("privacy")
    spec["rounds"] = 4
    spec["clients"] = {"count": clients}
    spec["data"]["clientData"] = data
    spec["checkpoint"] = {"everyRounds": 0}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(manifest), encoding="utf-8")
    return path


def run_cli(manifest: Path, folder: Path) -> subprocess.CompletedProcess[str]:
    """``fedcore run MANIFEST --json`` with its run folder and data cache under ``folder``."""
    return fedcore(
        "run",
        str(manifest),
        "--json",
        "--workdir",
        str(folder / "work"),
        cwd=folder,
        env={"FEDCORE_CACHE_DIR": str(folder / "cache")},
    )


def s3_source(s3: S3Server, creds: Path, prefix: str = "site-{index}/") -> dict[str, Any]:
    return {
        "format": "Parquet",
        "template": {
            "s3": {
                "endpoint": s3.endpoint,
                "bucket": BUCKET,
                "prefix": prefix,
                "credentialsPath": str(creds / "creds-{index}"),
            }
        },
    }


def test_a_client_reads_its_own_prefix_and_is_refused_another_clients(
    s3: S3Server, hospitals: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_cache.CACHE_ENV, str(tmp_path / "cache"))
    _own._LOADED.clear()
    creds = credentials(tmp_path)
    run = load_manifest(hospitals_manifest(tmp_path, s3_source(s3, creds)))
    local = load_manifest(
        hospitals_manifest(
            tmp_path,
            {
                "format": "Parquet",
                "template": {"path": str(hospitals / "hospitals" / "hospital-{index}")},
            },
            name="local",
        )
    )
    for site in range(SITES):
        from_s3 = own_data(run.spec, site)
        from_folder = own_data(local.spec, site)
        np.testing.assert_array_equal(from_s3.train.x, from_folder.train.x)
        np.testing.assert_array_equal(from_s3.test.y, from_folder.test.y)
        rows = pq.read_metadata(hospitals / "hospitals" / f"hospital-{site}" / "records.parquet")
        assert len(from_s3.train) + len(from_s3.test) == rows.num_rows
    # Site 0's credentials on site 1's prefix: refused by the store, named, no secret shown.
    _own._LOADED.clear()
    crossed = load_manifest(
        hospitals_manifest(tmp_path, s3_source(s3, creds, prefix="site-1/"), name="crossed")
    )
    for site in (0, 2):
        with pytest.raises(DataError) as refused:
            own_data(crossed.spec, site)
        message = str(refused.value)
        assert f"Client {site}'s data" in message and "access denied" in message
        assert f"s3://{BUCKET}/site-1/" in message
        assert site_keys(site)[1] not in message and site_keys(site)[0] not in message
    assert len(own_data(crossed.spec, 1).train) > 0  # site 1's own keys read it
    # No credentials at all (the environment has none for this store): refused as well.
    _own._LOADED.clear()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    anonymous = s3_source(s3, creds)
    del anonymous["template"]["s3"]["credentialsPath"]
    run = load_manifest(hospitals_manifest(tmp_path, anonymous, name="anonymous"))
    with pytest.raises(DataError, match=r"Client 0's data: s3://.*cannot be listed"):
        own_data(run.spec, 0)
    _own._LOADED.clear()


def test_a_run_over_s3_sources_equals_the_same_run_over_folders(
    s3: S3Server, hospitals: Path, tmp_path: Path
) -> None:
    """``fedcore run`` with every client reading its own prefix with its own keys: the server
    holds no data, the clients score the model on their own held-out rows, and the result is
    exactly the run of the same tables from folders (simulated in one process)."""
    creds = credentials(tmp_path)
    manifest = hospitals_manifest(tmp_path, s3_source(s3, creds))
    done = run_cli(manifest, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = last_json(done.stdout)
    assert summary["phase"] == "Succeeded"
    local = hospitals_manifest(
        tmp_path,
        {
            "format": "Parquet",
            "template": {"path": str(hospitals / "hospitals" / "hospital-{index}")},
        },
        name="local",
    )
    simulated = simulate(load_manifest(local))
    assert summary["accuracy"] == simulated.accuracy
    assert summary["loss"] == pytest.approx(simulated.loss, rel=1e-12)
    events = [
        json.loads(line) for line in (tmp_path / "work" / "events.jsonl").read_text().splitlines()
    ]
    rounds = [event for event in events if event["event"] == "round"]
    assert [event["evaluated_clients"] for event in rounds] == [SITES] * 4
    held_out = sum(len(own_data(load_manifest(local).spec, site).test) for site in range(SITES))
    assert rounds[-1]["evaluated_examples"] == held_out
    per_class = rounds[-1]["per_class"]
    assert sum(entry["total"] for entry in per_class) == held_out
    assert sum(entry["correct"] for entry in per_class) == round(summary["accuracy"] * held_out)
    # The server never touched the data: its log names no source.
    server_log = (tmp_path / "work" / "logs" / "server.log").read_text()
    assert BUCKET not in server_log and "Parsed the data source" not in server_log


def test_a_client_whose_data_breaks_the_schema_stops_the_run_naming_it(
    hospitals: Path, tmp_path: Path
) -> None:
    sites = tmp_path / "sites"
    for site in range(2):
        shutil.copytree(hospitals / "hospitals" / f"hospital-{site}", sites / f"site-{site}")
    table = pq.read_table(sites / "site-1" / "records.parquet").drop(["mean texture"])
    pq.write_table(table, sites / "site-1" / "records.parquet")
    manifest = hospitals_manifest(
        tmp_path,
        {"format": "Parquet", "template": {"path": str(sites / "site-{index}")}},
        clients=2,
    )
    done = run_cli(manifest, tmp_path)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "Client 1's data" in output and "'mean texture'" in output and "missing" in output


@pytest.mark.parametrize("example", ["digits-imagefolder.yaml", "hospitals-tabular.yaml"])
def test_the_examples_run_with_fedcore_run(example: str, hospitals: Path, tmp_path: Path) -> None:
    """The two examples as a user runs them, from the repository's root, on the data
    examples/make_data.py writes (here into a temporary folder the manifest is pointed at)."""
    manifest = yaml.safe_load((ROOT / "examples" / example).read_text())
    template = manifest["spec"]["data"]["clientData"]["template"]
    template["path"] = template["path"].replace("examples/data", str(hospitals))
    manifest["spec"]["rounds"] = min(manifest["spec"]["rounds"], 5)
    path = tmp_path / example
    path.write_text(yaml.safe_dump(manifest))
    parse_manifest(manifest)
    done = run_cli(path, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = last_json(done.stdout)
    assert summary["phase"] == "Succeeded"
    assert summary["rounds_completed"] == manifest["spec"]["rounds"]
    if example == "digits-imagefolder.yaml":  # deterministic: the simulation gives the same
        assert summary["accuracy"] == simulate(load_manifest(path)).accuracy
    else:  # dp-fedavg with secure noise: the budget is spent as stated
        assert summary["epsilon"] <= manifest["spec"]["privacy"]["targetEpsilon"]
        assert summary["evaluated_examples"] > 0

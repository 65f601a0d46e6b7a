"""Tests of the ``fedcore`` command line: validate, run's refusals, version, role help, kdc."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from fedcore.cli import main
from fedcore.transport import issue_run_bundles

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "digits-fedavg.yaml"

INVALID = {
    "apiVersion": "fedcore.dev/v1alpha1",
    "kind": "FederatedRun",
    "metadata": {"name": "broken"},
    "spec": {
        "protocol": {"name": "fedavg"},
        "model": {"kind": "MLP", "hidden": [8]},
        "data": {"source": {"kind": "Digits"}},
        "clients": {"count": 0},
        "rounds": 2,
        "training": {"batchSize": 32, "optimizer": {"kind": "SGD", "learningRate": 0.1}},
        "bogusField": 3,
    },
}
"""A manifest with two problems: no clients and a field the spec does not have."""


@pytest.fixture
def cli() -> CliRunner:
    """A runner with none of the role options' environment variables set."""
    names = ["MANIFEST", "TLS_DIR", "WORKDIR", "METRICS_PORT", "LISTEN", "CLIENT_INDEX"]
    return CliRunner(env={f"FEDCORE_{name}": None for name in names})


@pytest.fixture
def invalid_manifest(tmp_path: Path) -> Path:
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(INVALID), encoding="utf-8")
    return path


@pytest.fixture
def root_logging() -> Iterator[None]:
    """Restores the root logger after a role command reconfigured it for its CliRunner stream."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)


def test_validate_example_manifest_prints_summary(cli: CliRunner) -> None:
    # Prepare
    args = ["validate", str(EXAMPLE)]
    # Execute
    result = cli.invoke(main, args)
    # Assert
    assert result.exit_code == 0, result.output
    assert "'digits-fedavg'" in result.stdout
    assert "protocol fedavg" in result.stdout
    assert "10 clients" in result.stdout
    assert "20 rounds" in result.stdout
    assert "KDC" not in result.stdout


def test_validate_invalid_manifest_lists_every_field_path(
    cli: CliRunner, invalid_manifest: Path
) -> None:
    # Prepare
    args = ["validate", str(invalid_manifest)]
    # Execute
    result = cli.invoke(main, args)
    # Assert
    assert result.exit_code == 1
    assert "SpecError" in result.stderr
    assert str(invalid_manifest) in result.stderr
    assert "spec.clients.count:" in result.stderr
    assert "spec.bogusField:" in result.stderr
    assert "valid FederatedRun" not in result.stdout


def test_validate_missing_file_is_a_usage_error(cli: CliRunner, tmp_path: Path) -> None:
    # Prepare
    missing = tmp_path / "no-such-manifest.yaml"
    # Execute
    result = cli.invoke(main, ["validate", str(missing)])
    # Assert
    assert result.exit_code == 2
    assert "no-such-manifest.yaml" in result.stderr
    assert "does not exist" in result.stderr


def test_run_invalid_manifest_exits_1_and_creates_no_run_folder(
    cli: CliRunner, invalid_manifest: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the default run folder is runs/<name> under the working directory.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    workdir = tmp_path / "work"
    # Execute
    default_run = cli.invoke(main, ["run", str(invalid_manifest), "--quiet"])
    leftovers = sorted(path.name for path in cwd.iterdir())
    explicit_run = cli.invoke(
        main, ["run", str(invalid_manifest), "--quiet", "--workdir", str(workdir)]
    )
    # Assert
    for result in (default_run, explicit_run):
        assert result.exit_code == 1
        assert "SpecError" in result.stderr
        assert "spec.clients.count" in result.stderr
    assert leftovers == []
    assert not workdir.exists()


def test_main_version_prints_package_version(cli: CliRunner) -> None:
    # Prepare
    args = ["--version"]
    # Execute
    result = cli.invoke(main, args)
    # Assert
    assert result.exit_code == 0
    assert "version 0.1.0" in result.stdout


@pytest.mark.parametrize(
    ("command", "own_options"),
    [
        ("server", ["--listen", "--resume"]),
        ("client", ["--index", "--server", "--kdc", "--server-name"]),
        ("kdc", ["--listen"]),
    ],
)
def test_role_help_lists_shared_and_own_options(
    cli: CliRunner, command: str, own_options: list[str]
) -> None:
    # Prepare
    shared = ["--manifest", "--tls-dir", "--workdir", "--metrics-port", "--events", "--threads"]
    # Execute
    result = cli.invoke(main, [command, "--help"])
    # Assert
    assert result.exit_code == 0, result.output
    for option in shared + own_options:
        assert option in result.stdout, option


def test_client_missing_index_is_a_usage_error(cli: CliRunner, tmp_path: Path) -> None:
    # Prepare
    _, bundles = issue_run_bundles("x", num_clients=1)
    bundles["client-0"].write(tmp_path / "client-0")
    args = ["client", "--manifest", str(EXAMPLE), "--tls-dir", str(tmp_path / "client-0")]
    # Execute
    result = cli.invoke(main, [*args, "--server", "127.0.0.1:1"])
    # Assert
    assert result.exit_code == 2
    assert "--index" in result.stderr


@pytest.mark.usefixtures("root_logging")
def test_kdc_protocol_without_kdc_exits_1_with_message(cli: CliRunner, tmp_path: Path) -> None:
    # Prepare
    _, bundles = issue_run_bundles("x", num_clients=1)
    bundles["kdc"].write(tmp_path / "kdc")
    args = [
        "kdc",
        "--manifest",
        str(EXAMPLE),
        "--tls-dir",
        str(tmp_path / "kdc"),
        "--workdir",
        str(tmp_path),
        "--listen",
        "127.0.0.1:0",
    ]
    # Execute
    result = cli.invoke(main, args)
    # Assert
    assert result.exit_code == 1
    assert "FedcoreError" in result.stderr
    assert "Protocol 'fedavg' has no KDC" in result.stderr


@pytest.mark.usefixtures("root_logging")
def test_client_with_another_clients_certificate_exits_1_naming_both(
    cli: CliRunner, tmp_path: Path
) -> None:
    # Prepare
    _, bundles = issue_run_bundles("x", num_clients=2)
    bundles["client-1"].write(tmp_path / "client-1")
    args = [
        "client",
        "--manifest",
        str(EXAMPLE),
        "--tls-dir",
        str(tmp_path / "client-1"),
        "--workdir",
        str(tmp_path),
        "--index",
        "0",
        "--server",
        "127.0.0.1:1",
    ]
    # Execute
    result = cli.invoke(main, args)
    # Assert
    assert result.exit_code == 1
    assert "started as client 0 but its certificate names 'client-1'" in result.stderr


# ------------------------------------------------------------------------------ checkpoints


@pytest.fixture
def checkpointed(tmp_path: Path) -> dict[str, Any]:
    """A manifest and its run folder holding server checkpoints of rounds 1-3 and one KDC state."""
    from fedcore.checkpoint import kdc_checkpointer, open_store, server_checkpointer
    from fedcore.roles._common import spec_fingerprint
    from fedcore.spec import load_manifest

    manifest = tmp_path / "run.yaml"
    manifest.write_text(EXAMPLE.read_text(encoding="utf-8"), encoding="utf-8")
    run = load_manifest(manifest)
    work = tmp_path / "work"
    store = open_store(run.spec.checkpoint, name=run.metadata.name, workdir=work)
    fingerprint = spec_fingerprint(run)
    server = server_checkpointer(
        store, run.spec.checkpoint, run=run.metadata.name, fingerprint=fingerprint
    )
    for round_ in (1, 2, 3):
        server.save(round_, {"w": np.full(4, float(round_))})
    kdc_checkpointer(
        store, run.spec.checkpoint, run=run.metadata.name, fingerprint=fingerprint
    ).save(1, {"protocol": {"session": "s"}})
    return {"manifest": manifest, "work": work, "folder": work / "checkpoints"}


def test_checkpoint_list_mark_unmark_and_verify_on_the_local_folder(
    cli: CliRunner, checkpointed: dict[str, Any]
) -> None:
    # Prepare
    args = [str(checkpointed["manifest"]), "--workdir", str(checkpointed["work"])]
    # Execute
    marked = cli.invoke(main, ["checkpoint", "mark", *args, "2", "--note", "best"])
    listed = cli.invoke(main, ["checkpoint", "list", *args, "--json"])
    text = cli.invoke(main, ["checkpoint", "list", *args])
    part = checkpointed["folder"] / "round-00000003" / "tensors.safetensors"
    part.write_bytes(part.read_bytes()[:-1] + b"\x7f")
    verified = cli.invoke(main, ["checkpoint", "list", *args, "--verify", "--json"])
    unmarked = cli.invoke(main, ["checkpoint", "unmark", *args, "2"])
    again = cli.invoke(main, ["checkpoint", "unmark", *args, "2"])
    # Assert
    assert marked.exit_code == 0, marked.output
    report = json.loads(listed.output)
    assert [(e["round"], e["marked"]) for e in report["server"]] == [
        (1, False),
        (2, True),
        (3, False),
    ]
    assert [e["version"] for e in report["kdc"]] == [1]
    assert "round        2" in text.output and "marked" in text.output
    assert verified.exit_code == 1
    checks = {e["round"]: e["verified"] for e in json.loads(verified.output)["server"]}
    assert checks == {1: True, 2: True, 3: False}
    assert "fails its checksum" in verified.output
    assert "Unmarked the checkpoint of round 2" in unmarked.output
    assert "was not marked" in again.output


def test_checkpoint_mark_of_a_missing_round_exits_1_naming_what_is_there(
    cli: CliRunner, checkpointed: dict[str, Any]
) -> None:
    # Execute
    done = cli.invoke(
        main,
        [
            "checkpoint",
            "mark",
            str(checkpointed["manifest"]),
            "--workdir",
            str(checkpointed["work"]),
            "9",
        ],
    )
    # Assert
    assert done.exit_code == 1
    assert "no checkpoint of round 9" in done.output
    assert "[1, 2, 3]" in done.output


def test_checkpoint_purge_lists_first_and_deletes_everything_with_yes(
    cli: CliRunner, checkpointed: dict[str, Any]
) -> None:
    # Prepare
    args = [str(checkpointed["manifest"]), "--workdir", str(checkpointed["work"])]
    # Execute
    dry = cli.invoke(main, ["checkpoint", "purge", *args])
    after_dry = sorted(p.name for p in checkpointed["folder"].rglob("*") if p.is_file())
    done = cli.invoke(main, ["checkpoint", "purge", *args, "--yes"])
    # Assert
    assert "Would delete 12 objects" in dry.output
    assert len(after_dry) == 12
    assert "Deleted 12 objects" in done.output
    assert not any(p.is_file() for p in checkpointed["folder"].rglob("*"))

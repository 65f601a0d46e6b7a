"""Tests of the ``fedcore`` command line: validate, run's refusals, version, role help, kdc."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

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

"""Tests of the ``fedcore`` command line: validate, run's refusals, version, role help, kdc."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
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


@pytest.fixture(autouse=True)
def _internal_error_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Internal-error logs of these tests go under tmp_path, not ~/.cache/fedcore."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


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


def test_validate_a_manifest_with_sites_names_them_and_loads_no_site_data(
    cli: CliRunner,
) -> None:
    consortium = EXAMPLE.parent / "sites" / "consortium.yaml"
    result = cli.invoke(main, ["validate", str(consortium)])
    assert result.exit_code == 0, result.output
    assert "sites:    hospital-a (2), hospital-b (1), hospital-c (1)" in result.stdout
    assert "bound by each site" in result.stdout
    summary = json.loads(cli.invoke(main, ["validate", str(consortium), "--json"]).stdout)
    assert summary["summary"]["sites"][0] == {"name": "hospital-a", "clients": 2}
    refused = cli.invoke(main, ["validate", str(consortium), "--load-data"])
    assert refused.exit_code == 1
    assert "only that site can read" in refused.output


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


def test_run_refuses_a_claim_it_cannot_mount_before_starting_anything(
    cli: CliRunner, tmp_path: Path
) -> None:
    manifest = REPO / "examples" / "kubernetes" / "hospitals-tabular.yaml"
    validated = cli.invoke(main, ["validate", str(manifest)])  # valid for Kubernetes
    assert validated.exit_code == 0, validated.output
    work = tmp_path / "work"
    result = cli.invoke(main, ["run", str(manifest), "--quiet", "--json", "--workdir", str(work)])
    assert result.exit_code == 1
    assert "spec.data.clientData: client 0's source is the PersistentVolumeClaim" in result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["reason"] == "SpecError"
    assert not work.exists()


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
        ("client", ["--index", "--server", "--kdc", "--peer-listen"]),
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


def client_args(manifest: Path, tls_dir: Path, workdir: Path, *, index: int) -> list[str]:
    """``fedcore client`` as client ``index`` of ``manifest``, its server an address nobody
    serves (the tests stop it before it would dial)."""
    return [
        "client",
        "--manifest",
        str(manifest),
        "--tls-dir",
        str(tls_dir),
        "--workdir",
        str(workdir),
        "--index",
        str(index),
        "--server",
        "127.0.0.1:1",
    ]


@pytest.mark.usefixtures("root_logging")
def test_client_with_another_clients_certificate_exits_1_naming_both(
    cli: CliRunner, tmp_path: Path
) -> None:
    # Prepare
    _, bundles = issue_run_bundles("x", num_clients=2)
    bundles["client-1"].write(tmp_path / "client-1")
    args = client_args(EXAMPLE, tmp_path / "client-1", tmp_path, index=0)
    # Execute
    result = cli.invoke(main, args)
    # Assert
    assert result.exit_code == 1
    assert "started as client 0 but its certificate names 'client-1'" in result.stderr


# ------------------------------------------------------------------------------ checkpoints


@pytest.fixture
def checkpointed(tmp_path: Path) -> dict[str, Any]:
    """A manifest and its run folder holding server checkpoints of rounds 1-3 and one KDC state."""
    from fedcore.checkpoint import ensure_key, kdc_checkpointer, open_store, server_checkpointer
    from fedcore.roles._common import spec_fingerprint
    from fedcore.spec import load_manifest

    manifest = tmp_path / "run.yaml"
    manifest.write_text(EXAMPLE.read_text(encoding="utf-8"), encoding="utf-8")
    run = load_manifest(manifest)
    work = tmp_path / "work"
    store = open_store(run.spec.checkpoint, name=run.metadata.name, workdir=work)
    fingerprint = spec_fingerprint(run)
    server_key, _ = ensure_key(work / "keys" / "checkpoint.key")  # where the roles keep them
    kdc_key, _ = ensure_key(work / "keys" / "kdc-state.key")
    server = server_checkpointer(
        store, run.spec.checkpoint, run=run.metadata.name, fingerprint=fingerprint, key=server_key
    )
    for round_ in (1, 2, 3):
        server.save(round_, {"w": np.full(4, float(round_))})
    kdc_checkpointer(
        store, run.spec.checkpoint, run=run.metadata.name, fingerprint=fingerprint, key=kdc_key
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


@pytest.fixture
def client_checkpointed(tmp_path: Path) -> dict[str, Any]:
    """The lppa example's run folder: clients 0-7 each with its own key and checkpoints of
    rounds 1-2, but client 3's from before signed checkpoints (unsigned, no key file)."""
    from fedcore.checkpoint import client_checkpointer, ensure_key, open_store
    from fedcore.roles._common import spec_fingerprint
    from fedcore.spec import load_manifest

    manifest = tmp_path / "run.yaml"
    manifest.write_text((REPO / "examples" / "digits-lppa.yaml").read_text(), encoding="utf-8")
    run = load_manifest(manifest)
    work = tmp_path / "work"
    store = open_store(run.spec.checkpoint, name=run.metadata.name, workdir=work)
    ids = {"run": run.metadata.name, "fingerprint": spec_fingerprint(run)}
    for index in range(run.spec.clients.count):
        key = (
            None if index == 3 else ensure_key(work / "keys" / f"client-{index}-checkpoint.key")[0]
        )
        own = client_checkpointer(store, run.spec.checkpoint, index=index, key=key, **ids)
        for round_ in (1, 2):
            own.save(round_, {"round": round_, "protocol": {"w": np.full(3, index + round_)}})
    return {"manifest": manifest, "work": work, "store": work / "checkpoints"}


def test_checkpoint_list_verifies_each_decentralized_clients_own_checkpoints_with_its_key(
    cli: CliRunner, client_checkpointed: dict[str, Any]
) -> None:
    # Prepare: client 5's round 2 changed by a writer of the store.
    args = [str(client_checkpointed["manifest"]), "--workdir", str(client_checkpointed["work"])]
    part = client_checkpointed["store"] / "clients" / "client-5" / "round-00000002" / "state.json"
    data = bytearray(part.read_bytes())
    data[-1] ^= 1
    part.write_bytes(bytes(data))
    # Execute
    listed = cli.invoke(main, ["checkpoint", "list", *args, "--verify", "--json"])
    text = cli.invoke(main, ["checkpoint", "list", *args, "--verify"])
    # Assert: every client's rounds, checked with its own key; the changed one and the
    # unsigned ones (client 3 has no key file) are BAD, and the command exits 1.
    assert listed.exit_code == 1, listed.output
    report = json.loads(listed.stdout)
    verified = {
        (int(i), e["round"]): e["verified"] for i, es in report["clients"].items() for e in es
    }
    bad = {where for where, ok in verified.items() if not ok}
    assert len(verified) == 16 and bad == {(3, 1), (3, 2), (5, 2)}
    assert report["latest"]["client-0"] == 2 and "client-3" not in report["latest"]
    assert report["server"] == [] and report["kdc"] == []
    assert "client 5 round        2" in text.stdout and "fails its checksum" in text.stdout
    assert "client 3 round        1" in text.stdout and "no key to verify it with" in text.stdout


def test_checkpoint_rollback_of_one_client_adopts_its_unsigned_checkpoint_with_its_key(
    cli: CliRunner, client_checkpointed: dict[str, Any]
) -> None:
    # Prepare: client 3's key, as a resumed run would have made it.
    from fedcore.checkpoint import client_checkpointer, ensure_key, open_store
    from fedcore.roles._common import spec_fingerprint
    from fedcore.spec import load_manifest

    run = load_manifest(client_checkpointed["manifest"])

    work = client_checkpointed["work"]
    args = [str(client_checkpointed["manifest"]), "--workdir", str(work)]
    key, _ = ensure_key(work / "keys" / "client-3-checkpoint.key")
    # Execute
    refused = cli.invoke(main, ["checkpoint", "rollback", *args, "1", "--client", "3"])
    dry = cli.invoke(
        main, ["checkpoint", "rollback", *args, "1", "--client", "3", "--adopt-unsigned"]
    )
    done = cli.invoke(
        main,
        ["checkpoint", "rollback", *args, "1", "--client", "3", "--adopt-unsigned", "--yes"],
    )
    both = cli.invoke(main, ["checkpoint", "rollback", *args, "1", "--client", "3", "--kdc"])
    beyond = cli.invoke(main, ["checkpoint", "rollback", *args, "1", "--client", "9"])
    central = cli.invoke(
        main, ["checkpoint", "rollback", str(EXAMPLE), "--workdir", str(work), "1", "--client", "0"]
    )
    # Assert: refused without --adopt-unsigned, naming why; then signed with client 3's key,
    # round 2 deleted, and no other client touched.
    assert refused.exit_code == 1 and "it is unsigned" in refused.output
    assert "delete client 3's rounds [2]" in dry.stdout
    assert done.exit_code == 0, done.output
    assert "client 3's round 1 is now the latest; deleted client 3's rounds [2]" in done.stdout
    own = client_checkpointer(
        open_store(run.spec.checkpoint, name=run.metadata.name, workdir=work),
        run.spec.checkpoint,
        run=run.metadata.name,
        fingerprint=spec_fingerprint(run),
        index=3,
        key=key,
    )
    assert own.rounds() == [1] and own.load(1)["protocol"]["w"].tolist() == [4, 4, 4]
    assert own.latest_record() is not None
    other = client_checkpointed["store"] / "clients" / "client-4"
    assert sorted(p.name for p in other.iterdir() if p.name.startswith("round-")) == [
        "round-00000001",
        "round-00000002",
    ]
    assert both.exit_code == 2 and "Pass --kdc or --client, not both" in both.output
    assert beyond.exit_code == 1
    assert "Run 'digits-lppa' has no client 9: its clients are 0 to 7." in beyond.output
    assert central.exit_code == 1
    assert "only a decentralized protocol's clients" in central.output


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
    assert "Would delete 14 objects" in dry.output  # with the two latest records
    assert len(after_dry) == 14
    assert "Deleted 14 objects" in done.output
    assert not any(p.is_file() for p in checkpointed["folder"].rglob("*"))


# ------------------------------------------------------------------------- error output


def _example_with(path: Path, change: dict[str, Any], example: Path = EXAMPLE) -> Path:
    """Writes an example manifest with ``change`` merged into its spec; returns the path."""
    document = yaml.safe_load(example.read_text(encoding="utf-8"))
    document["spec"].update(change)
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("change", "shown"),
    [
        ({"protocol": {"name": "[red]fedavg"}}, "'[red]fedavg' is not allowed"),
        ({"protocol": {"name": "[/x]"}}, "'[/x]' is not allowed"),
        ({"checkpoint": {"s3": {"bucket": "[Bad]"}}}, "'[Bad]' is not allowed"),
    ],
)
def test_validate_error_text_is_printed_as_it_is_never_as_markup(
    cli: CliRunner, tmp_path: Path, change: dict[str, Any], shown: str
) -> None:
    # Prepare
    from fedcore.spec._checkpoint import S3StoreSpec

    manifest = _example_with(tmp_path / "run.yaml", change)
    bucket_rule = S3StoreSpec.model_json_schema()["properties"]["bucket"]["pattern"]
    # Execute
    result = cli.invoke(main, ["validate", str(manifest)])
    # Assert
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    assert result.stderr.startswith("SpecError: The FederatedRun manifest in ")
    assert shown in result.stderr
    if "checkpoint" in change:
        assert f"matching '{bucket_rule}'" in result.stderr  # not "'^{1,61}$'"
        assert "'^{1,61}$'" not in result.stderr


def test_fail_prints_brackets_of_any_error_unchanged(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Prepare
    from fedcore.cli.commands import fail
    from fedcore.errors import FedcoreError

    text = "[/x] [red]fedavg [bold]x[/] '^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$' \\[done]"
    # Execute
    with pytest.raises(SystemExit) as stopped:
        fail(FedcoreError(text))
    # Assert
    assert stopped.value.code == 1
    assert capsys.readouterr().err == f"FedcoreError: {text}\n"


# -------------------------------------------------------------- the last-resort handler


def _single_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def test_unexpected_exception_is_one_line_a_log_file_and_exit_70(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    import fedcore.spec

    def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("boom [red]\nsecond line")

    monkeypatch.setattr(fedcore.spec, "load_manifest", broken)
    # Execute
    result = cli.invoke(main, ["validate", str(EXAMPLE)])
    # Assert
    assert result.exit_code == 70
    line = _single_line(result.stderr)
    prefix = "InternalError: RuntimeError: boom [red] second line (details in "
    assert line.startswith(prefix) and line.endswith(")")
    log = Path(line[len(prefix) : -1])
    assert log.parent == (tmp_path / "cache" / "fedcore" / "logs").resolve()
    text = log.read_text(encoding="utf-8")
    assert "Traceback (most recent call last)" in text
    assert "in broken" in text
    assert "RuntimeError: boom [red]\nsecond line" in text
    assert result.stdout == ""


def test_unexpected_exception_in_a_run_logs_to_the_run_folder_and_prints_json(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    from fedcore.local.runner import LocalRun

    def broken(self: LocalRun, on_event: Any = None) -> None:
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        raise ValueError("no such thing")

    monkeypatch.setattr(LocalRun, "execute", broken)
    work = tmp_path / "work"
    # Execute
    result = cli.invoke(main, ["run", str(EXAMPLE), "--quiet", "--json", "--workdir", str(work)])
    # Assert
    assert result.exit_code == 70
    line = _single_line(result.stderr)
    assert line.startswith(f"InternalError: ValueError: no such thing (details in {work.resolve()}")
    assert len(list((work / "logs").glob("internal-error-*.log"))) == 1
    assert not (tmp_path / "cache").exists()
    summary = json.loads(_single_line(result.stdout))
    assert summary["phase"] == "Failed"
    assert summary["reason"] == "InternalError"
    assert summary["message"] == "ValueError: no such thing"


def test_ctrl_c_while_a_run_starts_exits_130_not_as_an_internal_error(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    from fedcore.local.runner import LocalRun

    def interrupted(self: LocalRun, on_event: Any = None) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(LocalRun, "start", interrupted)
    # Execute
    result = cli.invoke(main, ["run", str(EXAMPLE), "--quiet", "--workdir", str(tmp_path / "w")])
    # Assert
    assert result.exit_code == 130
    assert "InternalError" not in result.stderr
    assert "interrupted (Ctrl-C) while starting" in result.stderr


def test_ctrl_c_in_validate_keeps_clicks_abort(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    import fedcore.spec

    def interrupted(*_: Any, **__: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(fedcore.spec, "load_manifest", interrupted)
    # Execute
    result = cli.invoke(main, ["validate", str(EXAMPLE)])
    # Assert
    assert result.exit_code == 1
    assert "Aborted!" in result.stderr
    assert "InternalError" not in result.stderr


# ---------------------------------------------------------------------- validate --json


def test_validate_json_of_a_valid_manifest_is_the_verdict_and_the_summary(
    cli: CliRunner,
) -> None:
    # Execute
    result = cli.invoke(main, ["validate", "--json", str(EXAMPLE)])
    # Assert
    assert result.exit_code == 0, result.output
    report = json.loads(_single_line(result.stdout))
    assert report == {
        "valid": True,
        "source": str(EXAMPLE),
        "errors": [],
        "summary": {
            "name": "digits-fedavg",
            "protocol": {
                "name": "fedavg",
                "mode": "aggregator Mean",
                "dropout_policy": "Skip",
                "decentralized": False,
            },
            "roles": {"kdc": 0, "server": 1, "clients": 10, "processes": 11},
            "ports": {
                "server": "picked at start",
                "kdc": None,
                "peers": None,
                "metrics": "picked at start",
            },
            "rounds": 20,
            "clients": {"count": 10, "per_round": 10, "quorum": 10, "sampling": "Seeded"},
            "privacy": {
                "claims_dp": False,
                "accountant": None,
                "target_epsilon": None,
                "target_delta": None,
                "amplification": None,
            },
            "sites": None,
            "data": {
                "source": "Digits",
                "path": None,
                "partition": "IID",
                "alpha": None,
                "examples": 1797,
                "train": 1437,
                "test": 360,
                "per_client": {"min": 143, "median": 144, "max": 144},
                "computed": "counts",
            },
            "evaluation": "Server",
        },
    }
    assert result.stderr == ""


def test_validate_json_of_an_invalid_manifest_lists_every_error_and_exits_1(
    cli: CliRunner, invalid_manifest: Path
) -> None:
    # Execute
    result = cli.invoke(main, ["validate", "--json", str(invalid_manifest)])
    # Assert
    assert result.exit_code == 1
    report = json.loads(_single_line(result.stdout))
    assert set(report) == {"valid", "source", "errors", "summary"}
    assert report["valid"] is False
    assert report["source"] == str(invalid_manifest)
    assert report["summary"] is None
    assert all(set(error) == {"field", "value", "message", "allowed"} for error in report["errors"])
    assert sorted(error["field"] for error in report["errors"]) == [
        "spec.bogusField",
        "spec.clients.count",
    ]
    assert all(error["message"] for error in report["errors"])
    assert result.stderr == ""


def test_validation_json_carries_each_issues_value_and_allowed_bounded() -> None:
    # Prepare
    from fedcore.cli.commands import validation_json
    from fedcore.errors import SpecIssue

    bomb: list[Any] = ["lol"] * 10
    for _ in range(8):
        bomb = [bomb] * 10  # a billion laughs' expansion, shared, not copied
    issues = [
        SpecIssue(
            "spec.rounds",
            "0 is not allowed; allowed: 1 to 1000000.",
            value=0,
            allowed="1 to 1000000",
        ),
        SpecIssue("spec.privacy.targetEpsilon", "inf is not allowed.", value=float("inf")),
        SpecIssue("spec.data", "is too big.", value=bomb),
        SpecIssue("spec.seed", "is too big.", value=2**200),
    ]
    # Execute
    report = validation_json(Path("run.yaml"), issues, None)
    text = json.dumps(report, allow_nan=False)
    # Assert
    assert report["valid"] is False
    assert report["errors"][0] == {
        "field": "spec.rounds",
        "value": 0,
        "message": "0 is not allowed; allowed: 1 to 1000000.",
        "allowed": "1 to 1000000",
    }
    assert report["errors"][1]["value"] == "inf"
    assert report["errors"][1]["allowed"] is None
    assert len(text) < 10_000
    assert "..." in json.dumps(report["errors"][2]["value"])
    assert report["errors"][3]["value"] == "an integer of 201 bits"


# ------------------------------------------------------------------ validate's summary


def test_validate_summary_shows_roles_ports_rounds_privacy_and_data(cli: CliRunner) -> None:
    # Execute
    result = cli.invoke(main, ["validate", str(EXAMPLE)])
    # Assert
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{EXAMPLE}: valid FederatedRun 'digits-fedavg'")
    assert lines[1:] == [
        "  protocol: fedavg (aggregator Mean); dropout policy Skip",
        "  roles:    1 server, 10 clients: 11 processes",
        "  ports:    picked at start: free 127.0.0.1 ports for the server, each role's /metrics "
        "(none with --no-metrics)",
        "  rounds:   20; 10 of 10 clients per round (Seeded sample), quorum 10",
        "  privacy:  no DP claim",
        "  data:     Digits, 1797 examples (1437 training, 360 held out); IID over 10 clients: "
        "143 / 144 / 144 examples per client (min / median / max)",
        "  evaluate: on the server's held-out split",
    ]


def test_validate_summary_of_a_dp_protocol_with_a_kdc(cli: CliRunner, tmp_path: Path) -> None:
    # Prepare
    manifest = _example_with(
        tmp_path / "run.yaml",
        {
            "clients": {"count": 10, "perRound": "50%", "quorum": 4, "sampling": "Secret"},
            "privacy": {"targetEpsilon": 8, "accountant": "RDP"},
        },
        REPO / "examples" / "digits-mpdp.yaml",
    )
    # Execute
    result = cli.invoke(main, ["validate", str(manifest)])
    # Assert
    assert result.exit_code == 0, result.output
    assert "  protocol: mpdp (Hardened); dropout policy Redo" in result.stdout
    assert "  roles:    1 KDC, 1 server, 10 clients: 12 processes\n" in result.stdout
    assert "the server, the KDC, each role's /metrics" in result.stdout
    assert "  rounds:   40; 5 of 10 clients per round (Secret sample), quorum 4" in result.stdout
    assert (
        "  privacy:  (epsilon, delta)-DP, delta 1e-05; budget epsilon 8 (the run stops before "
        "exceeding it); accountant RDP; amplification by the secret sample claimed"
    ) in result.stdout


@pytest.mark.parametrize(
    ("distributed_dp", "claim"),
    [
        (None, "  privacy:  no DP claim"),
        (
            {"noiseMultiplier": 1.0},
            "  privacy:  (epsilon, delta)-DP, delta 1e-05; no budget (epsilon reported every "
            "round); accountant RDP; no amplification claimed",
        ),
    ],
)
def test_validate_summary_claims_dp_for_secagg_only_with_its_noise(
    cli: CliRunner, tmp_path: Path, distributed_dp: dict[str, float] | None, claim: str
) -> None:
    document = yaml.safe_load((REPO / "examples" / "digits-secagg.yaml").read_text())
    if distributed_dp is not None:
        document["spec"]["protocol"]["secagg"]["distributedDp"] = distributed_dp
    manifest = tmp_path / "run.yaml"
    manifest.write_text(yaml.safe_dump(document))
    result = cli.invoke(main, ["validate", str(manifest)])
    assert result.exit_code == 0, result.output
    assert claim + "\n" in result.stdout


def test_validate_summary_says_computed_at_start_unless_the_data_is_loaded(
    cli: CliRunner, tmp_path: Path
) -> None:
    # Prepare
    manifest = _example_with(
        tmp_path / "run.yaml", {"data": {"partition": {"kind": "Dirichlet", "alpha": 0.5}}}
    )
    # Execute
    quick = cli.invoke(main, ["validate", str(manifest)])
    loaded = cli.invoke(main, ["validate", "--load-data", "--json", str(manifest)])
    # Assert
    assert quick.exit_code == 0, quick.output
    assert (
        "Dirichlet(alpha 0.5) over 10 clients: examples per client computed at start "
        "(--load-data computes them now)"
    ) in quick.stdout
    data = json.loads(loaded.stdout)["summary"]["data"]
    assert data["computed"] == "loaded"
    shares = data["per_client"]
    assert 1 <= shares["min"] <= shares["median"] <= shares["max"] <= 1437


@pytest.mark.parametrize(
    ("source", "count", "test_fraction"), [("Digits", 7, 0.25), ("MNISTSubset", 13, 0.2)]
)
def test_summary_counts_equal_the_real_iid_partition(
    source: str, count: int, test_fraction: float
) -> None:
    # Prepare
    from fedcore.cli.summary import describe
    from fedcore.spec import parse_manifest

    document = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    document["spec"]["clients"] = {"count": count}
    document["spec"]["data"] = {"source": {"kind": source}, "testFraction": test_fraction}
    run = parse_manifest(document)
    # Execute
    counted = describe(run)["data"]
    loaded = describe(run, load_data=True)["data"]
    # Assert
    assert counted["computed"] == "counts" and loaded["computed"] == "loaded"
    for key in ("examples", "train", "test", "per_client"):
        assert counted[key] == loaded[key], key


def test_validate_refuses_more_clients_than_training_examples_naming_the_field(
    cli: CliRunner, tmp_path: Path
) -> None:
    # Prepare
    manifest = _example_with(tmp_path / "run.yaml", {"clients": {"count": 5000}})
    # Execute
    result = cli.invoke(main, ["validate", str(manifest)])
    as_json = cli.invoke(main, ["validate", "--json", str(manifest)])
    # Assert
    assert result.exit_code == 1
    assert result.stderr.startswith("SpecError: ")
    assert "spec.clients.count" in result.stderr
    assert as_json.exit_code == 1
    assert "spec.clients.count" in [e["field"] for e in json.loads(as_json.stdout)["errors"]]


@pytest.mark.parametrize(
    ("clients", "min_examples", "field", "allowed"),
    [
        (5000, 1, "spec.clients.count", "1 to 1437"),
        (10, 144, "spec.data.partition.minExamples", "1 to 143"),
    ],
)
def test_summary_refuses_a_partition_that_leaves_a_client_short(
    clients: int, min_examples: int, field: str, allowed: str
) -> None:
    # Prepare: past the validator (which may refuse these itself), straight to the summary.
    from fedcore.cli.summary import describe
    from fedcore.errors import SpecError
    from fedcore.spec import load_manifest

    run = load_manifest(EXAMPLE)
    spec = run.spec
    partition = spec.data.partition.model_copy(update={"min_examples": min_examples})
    changed = spec.model_copy(
        update={
            "clients": spec.clients.model_copy(update={"count": clients}),
            "data": spec.data.model_copy(update={"partition": partition}),
        }
    )
    # Execute
    with pytest.raises(SpecError) as refused:
        describe(run.model_copy(update={"spec": changed}), source="run.yaml")
    # Assert
    (issue,) = refused.value.issues
    assert issue.path == field
    assert issue.allowed == allowed
    assert refused.value.source == "run.yaml"


# ----------------------------------------------------------------- start-up progress


def test_progress_shows_each_start_up_phase_then_the_rounds() -> None:
    # Prepare
    import io

    from rich.console import Console

    from fedcore.cli.progress import RunProgress
    from fedcore.spec import load_manifest

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200, color_system=None)
    recorded = [
        {"event": "starting", "phase": "certificates"},
        {"event": "starting", "phase": "kdc"},
        {"event": "starting", "phase": "server"},
        {"event": "resumed", "round": 2},
        {"event": "ready", "role": "server", "port": 1},
        {"event": "starting", "phase": "clients", "clients": 3},
        {"event": "connected", "client": 1, "connected": 1, "clients": 3},
        {"event": "connected", "client": 0, "connected": 2, "clients": 3},
        {"event": "connected", "client": 2, "connected": 3, "clients": 3},
        {"event": "joined", "clients": 3},
        {"event": "round", "round": 3, "loss": 0.5, "accuracy": 0.75},
        {"event": "connected", "client": 2, "connected": 3, "clients": 3},
    ]
    progress = RunProgress(console, load_manifest(EXAMPLE))
    phases = []
    # Execute
    with progress:
        for event in recorded:
            progress.update(event)
            phases.append(progress.phase)
    # Assert
    assert phases == [
        "issuing the run's CA and a certificate per role",
        "starting the KDC",
        "starting the server (model, held-out data)",
        "starting the server (model, held-out data)",
        "starting the server (model, held-out data)",
        "starting 3 clients (each loads its data): 0/3 connected",
        "clients connected 1/3 (data loaded)",
        "clients connected 2/3 (data loaded)",
        "clients connected 3/3 (data loaded)",
        "3 clients joined; the rounds begin",
        "",
        "",
    ]
    drawn = out.getvalue()
    for phase in filter(None, phases):
        assert phase in drawn, phase
    assert "2/20" in drawn  # resumed after round 2, still starting
    assert "3/20" in drawn and "0.7500" in drawn


def test_clients_phase_says_the_model_and_memory_auto_grouped_them_by() -> None:
    from fedcore.cli.progress import phase_text

    event = {
        "event": "starting",
        "phase": "clients",
        "clients": 4,
        "processes": 1,
        "model_bytes": 4_028_899_368,
        "memory_bytes": 23_100_000_000,
    }
    assert phase_text(event) == (
        "starting 4 clients in 1 process (each loads its data; a 4.03 GB model, 23.1 GB of "
        "memory available): 0/4 connected"
    )
    short = {**event, "memory_bytes": 8_000_000_000, "needed_bytes": 22_000_000_000}
    assert phase_text(short) == (
        "starting 4 clients in 1 process (each loads its data; a 4.03 GB model, 8 GB of "
        "memory available, about 22 GB needed: it may run out of memory): 0/4 connected"
    )


def test_progress_prints_one_line_per_incident_not_per_event() -> None:
    # Prepare: a server restart with its clients reconnecting, a client lost for two rounds,
    # then back
    import io

    from rich.console import Console

    from fedcore.cli.progress import RunProgress
    from fedcore.spec import load_manifest

    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200, color_system=None)
    recorded = [
        {"event": "joined", "clients": 3},
        {"event": "round", "round": 1, "failures": []},
        {"event": "restarted", "role": "server", "restart": 1, "exit_code": -9},
        {"event": "resumed", "round": 1},
        *({"event": "connected", "client": c, "connected": c + 1, "clients": 3} for c in range(3)),
        {"event": "joined", "clients": 3},
        {"event": "round", "round": 2, "failures": [1]},
        {"event": "round", "round": 3, "failures": [1]},
        {"event": "connected", "client": 1, "connected": 3, "clients": 3},
        {"event": "round", "round": 4, "failures": []},
    ]
    progress = RunProgress(console, load_manifest(EXAMPLE))

    # Execute
    with progress:
        for event in recorded:
            progress.update(event)

    # Assert
    lines = [line.strip() for line in out.getvalue().splitlines() if line.strip()]
    incidents = [line for line in lines if not line.startswith("digits-fedavg")]
    assert incidents == [
        "server exited with code -9 without reporting a failure; restarted (1 so far), "
        "resuming from its latest checkpoint",
        "3 clients joined the restarted server",
        "round 2: went on without client(s) 1",
        "client 1 connected again",
        "round 4: every sampled client uploaded again",
    ]


def test_a_stopped_run_is_named_by_its_reason_on_the_console(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the same reason --json, the events and the status give
    from fedcore.errors import RunAborted
    from fedcore.local.runner import LocalRun

    def stopped(self: LocalRun, on_event: Any = None) -> None:
        raise RunAborted(
            "The checkpoint of round 3 could not be written.", reason="CheckpointFailed"
        )

    monkeypatch.setattr(LocalRun, "execute", stopped)

    # Execute
    result = cli.invoke(
        main, ["run", str(EXAMPLE), "--quiet", "--json", "--workdir", str(tmp_path / "w")]
    )

    # Assert
    assert result.exit_code == 1
    assert _single_line(result.stderr).startswith("CheckpointFailed: The checkpoint of round 3")
    assert json.loads(_single_line(result.stdout))["reason"] == "CheckpointFailed"


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_run_refuses_a_bad_clients_per_process_naming_the_option(
    cli: CliRunner, tmp_path: Path, value: str
) -> None:
    # Execute
    result = cli.invoke(
        main,
        [
            "run",
            str(EXAMPLE),
            "--quiet",
            "--clients-per-process",
            value,
            "--workdir",
            str(tmp_path),
        ],
    )

    # Assert: a usage error before anything starts, naming the option and the value
    assert result.exit_code == 2
    assert "--clients-per-process" in result.output and repr(value) in result.output
    assert not (tmp_path / "events.jsonl").exists()


@pytest.mark.parametrize("member", ["x", "3:", "3:port", "3:70000"])
def test_clients_refuses_a_malformed_member_naming_it(
    cli: CliRunner, tmp_path: Path, member: str
) -> None:
    # Execute
    result = cli.invoke(
        main,
        [
            "clients",
            "--manifest",
            str(EXAMPLE),
            "--tls-dir",
            str(tmp_path / "client-{index}"),
            "--member",
            member,
            "--server",
            "127.0.0.1:1",
        ],
    )

    # Assert
    assert result.exit_code == 2
    assert "--member" in result.output and "INDEX or INDEX:METRICS_PORT" in result.output


def test_a_role_stops_on_sigterm_with_exit_143_even_as_a_containers_first_process() -> None:
    # A container's PID 1 ignores a signal it has no handler for: a role must handle SIGTERM
    # itself or a deleted pod's server keeps running (and ends the run) until SIGKILL.
    script = (
        "import os, signal, time\n"
        "from fedcore.cli.commands import role_errors\n"
        "with role_errors('server'):\n"
        "    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "print('not stopped')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 143, result.stderr
    assert "not stopped" not in result.stdout
    assert "Stopped by SIGTERM or SIGINT." in result.stderr


@pytest.mark.parametrize(
    ("raised", "code", "line"),
    [
        (
            "CheckpointInvalid('round 6 is signed with another key')",
            65,
            "CheckpointInvalid: round 6 is signed with another key",
        ),
        (
            "RunAborted('Cannot resume: changed', reason='CheckpointInvalid', round=0)",
            65,
            "CheckpointInvalid: Cannot resume: changed",
        ),
        (
            "CheckpointError('the store\\nis unreachable')",
            1,
            "CheckpointError: the store is unreachable",
        ),
        ("RunAborted('lost', reason='PeerLost', round=3)", 1, "PeerLost: lost"),
    ],
)
def test_a_role_that_cannot_restore_its_checkpoint_exits_65_which_the_operator_does_not_retry(
    raised: str, code: int, line: str, tmp_path: Path
) -> None:
    """... and, in a pod (``FEDCORE_TERMINATION_LOG`` set), writes its error line to its
    termination message, which the pod's status shows."""
    # Prepare
    script = (
        "from fedcore.cli.commands import role_errors\n"
        "from fedcore.errors import CheckpointError, CheckpointInvalid, RunAborted\n"
        "with role_errors('client'):\n"
        f"    raise {raised}\n"
    )
    termination = tmp_path / "termination-log"
    env = {**os.environ, "FEDCORE_TERMINATION_LOG": str(termination)}
    # Execute
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    # Assert
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    assert termination.read_text() == line  # one line: a multi-line message is joined


def test_a_client_says_which_device_it_trains_on(caplog: pytest.LogCaptureFixture) -> None:
    from fedcore.roles._common import choose_device
    from fedcore.spec._roles import RoleSpec

    with caplog.at_level(logging.INFO, logger="fedcore.roles._common"):
        assert choose_device(RoleSpec()) == "cpu"
    assert caplog.messages == ["Training on the CPU."]
    caplog.clear()
    import torch

    with caplog.at_level(logging.INFO, logger="fedcore.roles._common"):
        device = choose_device(RoleSpec(gpus=1))
    if torch.cuda.is_available():  # a GPU machine: it trains there and names the card
        assert device == "cuda"
        assert caplog.messages == [f"Training on cuda: {torch.cuda.get_device_name(0)}."]
    else:  # asking for a GPU where torch sees none says so and falls back
        assert device == "cpu"
        assert caplog.messages == [
            "The role asks for GPUs but none is visible; using the CPU.",
            "Training on the CPU.",
        ]


def test_checkpoint_history_prints_each_pods_events_kept_in_the_store(
    cli: CliRunner, checkpointed: dict[str, Any]
) -> None:
    from fedcore.checkpoint import LocalObjectStore
    from fedcore.roles._history import StoreHistory

    args = [str(checkpointed["manifest"]), "--workdir", str(checkpointed["work"])]
    empty = cli.invoke(main, ["checkpoint", "history", *args])
    assert empty.exit_code == 0 and "(none" in empty.stdout
    store = LocalObjectStore(checkpointed["folder"])
    first = StoreHistory(store, attempt="20261126T070000Z-11")
    first({"event": "ready", "time": 0.0, "start_round": 1})
    first({"event": "checkpoint", "time": 1.0, "round": 3, "location": "round-00000003"})
    second = StoreHistory(store, attempt="20261126T070200Z-12")
    second({"event": "ready", "time": 2.0, "start_round": 4})
    second({"event": "finished", "time": 3.0, "reason": "RoundsCompleted", "accuracy": 0.9})
    text = cli.invoke(main, ["checkpoint", "history", *args])
    as_json = cli.invoke(main, ["checkpoint", "history", *args, "--json"])
    assert text.exit_code == 0, text.output
    lines = text.stdout.splitlines()
    assert lines[1] == "  attempt 20261126T070000Z-11: 2 events"
    assert lines[3] == "    00:00:01 checkpoint round=3 location=round-00000003"
    assert lines[4] == "  attempt 20261126T070200Z-12: 2 events"
    assert lines[6] == "    00:00:03 finished reason=RoundsCompleted accuracy=0.9"
    attempts = json.loads(as_json.stdout)["attempts"]
    assert [e["event"] for e in attempts["20261126T070200Z-12"]] == ["ready", "finished"]
    # Checkpoints are listed as before: the history folder is not a round.
    listed = json.loads(cli.invoke(main, ["checkpoint", "list", *args, "--json"]).stdout)
    assert [entry["round"] for entry in listed["server"]] == [1, 2, 3]


_LOCK_THEN_EXIT = """
import multiprocessing, os, sys
from fedcore.cli.commands import exit_now

def child(ask_exit_now):
    # What numba does before it launches its threads in a forked process: a multiprocessing
    # lock, i.e. a named semaphore in /dev/shm, registered with the resource tracker.
    lock = multiprocessing.get_context().RLock()
    print(lock._semlock.name, flush=True)
    if ask_exit_now:
        exit_now(0)
    os._exit(0)

if __name__ == "__main__":
    multiprocessing.set_start_method("forkserver")
    process = multiprocessing.Process(target=child, args=(sys.argv[1] == "exit_now",))
    process.start()
    process.join()
    sys.exit(process.exitcode)
"""


@pytest.mark.parametrize("how", ["exit_now", "os._exit"])
def test_a_role_ending_with_exit_now_leaves_no_semaphore_behind(how: str, tmp_path: Path) -> None:
    script = tmp_path / "lock_then_exit.py"
    script.write_text(_LOCK_THEN_EXIT)
    # The resource tracker shares stderr: run() returns once it has exited too.
    done = subprocess.run(
        [sys.executable, str(script), how], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    name = done.stdout.strip().lstrip("/")
    assert name
    leaked = "leaked semaphore" in done.stderr
    if how == "exit_now":
        assert not leaked, done.stderr
        assert not Path("/dev/shm", f"sem.{name}").exists()
    else:  # the check can fail: without the finalizers the tracker finds the leak
        assert leaked, done.stderr


def test_output_piped_to_a_reader_that_went_away_ends_quietly_without_a_crash_log(
    tmp_path: Path, client_checkpointed: dict[str, Any]
) -> None:
    # Prepare: `fedcore checkpoint list ... | head -0`: the reader closes its end before the
    # command writes its first line (it is still importing), so the write fails with EPIPE.
    args = [str(client_checkpointed["manifest"]), "--workdir", str(client_checkpointed["work"])]
    home = tmp_path / "home"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    process = subprocess.Popen(
        [sys.executable, "-m", "fedcore", "checkpoint", "list", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    # Execute
    stderr = process.stderr.read().decode()
    code = process.wait(timeout=60)
    # Assert: the exit a Unix tool would give, no error line, no internal-error log.
    assert code == 141, stderr
    assert "InternalError" not in stderr and "Traceback" not in stderr and "Exception" not in stderr
    assert not list(home.rglob("internal-error-*.log"))


@pytest.mark.usefixtures("root_logging")
def test_an_lppa_client_with_a_malformed_key_file_stops_at_start_naming_it(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: client 0's mounted key file holds 63 hex digits (a Secret written by hand).
    _, bundles = issue_run_bundles("digits-lppa", num_clients=8)
    bundles["client-0"].write(tmp_path / "client-0")
    key = tmp_path / "checkpoint.key"
    key.write_text("ab" * 31 + "a\n", encoding="ascii")
    monkeypatch.setenv("FEDCORE_CHECKPOINT_KEY_FILE", str(key))
    manifest = REPO / "examples" / "digits-lppa.yaml"
    args = client_args(manifest, tmp_path / "client-0", tmp_path, index=0)
    args += ["--peer-listen", "127.0.0.1:0", "--peer-template", "127.0.0.1:1"]
    # Execute
    result = cli.invoke(main, args)
    # Assert: before it dials anyone, not at its first checkpoint.
    assert result.exit_code == 1, result.output
    assert "CheckpointKeyError" in result.stderr
    assert "checkpoint key of client 0 (FEDCORE_CHECKPOINT_KEY_FILE)" in result.stderr
    assert "holds 63 hex digits, not 64" in result.stderr

"""`fedcore audit` end to end: the example's report, its figures and its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration._runs import fedcore

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_fedcore_audit_of_the_perturb_example_writes_the_report_and_figures(
    tmp_path: Path,
) -> None:
    # Prepare: the example, cut to its first 30 rounds to keep the test short.
    out = tmp_path / "tmp"
    # Execute
    done = fedcore(
        "audit",
        str(REPO / "examples" / "digits-perturb.yaml"),
        "--out",
        str(out),
        "--rounds",
        "30",
        cwd=tmp_path,
    )
    # Assert
    assert done.returncode == 0, done.stderr
    report = (out / "report.md").read_text()
    data = json.loads((out / "report.json").read_text())
    assert data["protocol"] == "perturb" and data["rounds"] == 30
    results = {r["attack"]: r for r in data["results"]}
    assert set(results) >= {"dlg", "inverting-gradients", "output-noise", "membership-loss"}
    assert results["output-noise"]["beats_chance"] is True  # digest 001 §7b S2
    assert results["correction-leak"]["skipped"] == "applies to mpdp only"
    assert "## Summary" in report and "beats blind guessing" in report
    figures = sorted((out / "figures").glob("*.png"))
    assert len(figures) >= 5
    for figure in figures:
        assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(figures/{figure.name})" in report
    assert "output-noise: agreement, fitted" in done.stderr


@pytest.mark.parametrize(
    ("example", "found"),
    [
        ("digits-ebscfl.yaml", "ebscfl-spectral"),
        ("digits-lppa.yaml", "lppa-neighbour"),
        ("digits-adaptive.yaml", "inverting-gradients"),
    ],
)
def test_fedcore_audit_of_the_new_protocols_examples_runs_their_attacks(
    tmp_path: Path, example: str, found: str
) -> None:
    # Prepare: each example cut to its first 3 rounds
    out = tmp_path / "tmp"
    # Execute
    done = fedcore(
        "audit", str(REPO / "examples" / example), "--out", str(out), "--rounds", "3", cwd=tmp_path
    )
    # Assert: the report lists every attack, the protocol's own ran, the rest say why not
    assert done.returncode == 0, done.stderr
    data = json.loads((out / "report.json").read_text())
    results = {r["attack"]: r for r in data["results"]}
    assert results[found]["skipped"] is None and results[found]["verdict"] is not None
    assert results["correction-leak"]["skipped"] == "applies to mpdp only"
    assert all(r["skipped"] or r["verdict"] for r in results.values())
    if found == "ebscfl-spectral":  # digest 004 §3.3 (2), (3), in the default Repaired mode
        assert results[found]["beats_chance"] is True
    if found == "lppa-neighbour":
        assert "coordinator receives no tensor" in results["dlg"]["skipped"]
    report = (out / "report.md").read_text()
    for figure in sorted((out / "figures").glob("*.png")):
        assert f"(figures/{figure.name})" in report

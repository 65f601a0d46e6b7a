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

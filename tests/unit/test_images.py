"""The container images: pinned bases, non-root users, and an operator image without torch."""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import yaml

import fedcore

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "images/runtime/Dockerfile", ROOT / "images/operator/Dockerfile"]
HEAVY = {"torch", "sklearn", "boto3", "mlxtend", "safetensors", "dp_accounting"}


def test_images_use_pinned_bases_and_run_as_non_root() -> None:
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text()
        defaults = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, flags=re.MULTILINE))
        bases = [
            defaults.get(base[2:-1], base) if base.startswith("${") else base
            for base in re.findall(r"^FROM\s+(\S+)", text, flags=re.MULTILINE)
        ]
        assert bases, dockerfile
        for base in bases:
            _, _, tag = base.partition(":")
            assert tag and tag != "latest" and re.search(r"\d", tag), (dockerfile, base)
        users = re.findall(r"^USER\s+(\S+)", text, flags=re.MULTILINE)
        assert users and users[-1].split(":")[0] == "10001", dockerfile
    assert (ROOT / ".dockerignore").read_text().startswith("#")


def test_image_requirements_pin_what_the_tests_run_with() -> None:
    """The requirements files are what hack/pin_requirements.py makes of this environment."""
    spec = importlib.util.spec_from_file_location(
        "pin_requirements", ROOT / "hack/pin_requirements.py"
    )
    assert spec and spec.loader
    pins = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pins)
    for target in pins.TARGETS:
        assert target.read_text() == pins.render(target), (
            f"{target.relative_to(ROOT)} is stale: python hack/pin_requirements.py --write"
        )
    runtime = pins.pinned(pins.roots(pins.RUNTIME))
    assert runtime["torch"] == metadata.version("torch").split("+")[0]
    assert "pytest" not in runtime and "hypothesis" not in runtime  # no dev extras


def test_chart_versions_follow_the_package() -> None:
    chart = yaml.safe_load((ROOT / "charts/fedcore/Chart.yaml").read_text())
    assert chart["appVersion"] == fedcore.__version__
    values = yaml.safe_load((ROOT / "charts/fedcore/values.yaml").read_text())
    # Empty tags mean "the chart's appVersion", i.e. the package version.
    assert values["operator"]["image"]["tag"] == ""
    assert values["runtime"]["image"]["tag"] == ""


def _closure(requirements: list[str]) -> set[str]:
    """Every distribution the requirements pull in (installed metadata), lower-cased."""
    seen: set[str] = set()
    todo = [re.split(r"[=<>!~\[ ;]", line, maxsplit=1)[0] for line in requirements]
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed here (e.g. a marker for another platform)
        for requirement in requires:
            if "extra ==" in requirement:
                continue
            todo.append(re.split(r"[=<>!~\[ ;(]", requirement, maxsplit=1)[0])
    return seen


def test_operator_image_requirements_cover_what_the_operator_imports() -> None:
    script = (
        "import sys, json, fedcore_operator.__main__, fedcore_operator.runtime;"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    imported = set(yaml.safe_load(out))
    assert not imported & HEAVY, f"the operator imports {sorted(imported & HEAVY)}"
    lines = [
        line.strip()
        for line in (ROOT / "images/operator/requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert all("==" in line for line in lines), "pin every operator requirement"
    available = _closure(lines)
    owners = metadata.packages_distributions()
    missing = sorted(
        {
            dist.lower().replace("_", "-")
            for module in imported
            if not module.startswith("_")  # e.g. setuptools' _distutils_hack, loaded by site
            for dist in owners.get(module, [])
            if dist.lower() != "fedcore"
        }
        - available
    )
    assert not missing, f"images/operator/requirements.txt lacks {missing}"

"""Pins the images' requirements to what the test suite runs with.

`python hack/pin_requirements.py --write` rewrites images/runtime/requirements.txt (every
distribution pyproject.toml's dependencies pull in) and images/operator/requirements.txt (the
same for the distributions that file names: what the operator imports) and
images/build-requirements.txt (what building fedcore's wheel needs), markers evaluated for
the image (Linux, x86_64, CPython 3.11), at the versions installed in this environment.
Without --write it prints them; tests/unit/test_images.py checks the committed files are
current.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "images/runtime/requirements.txt"
OPERATOR = ROOT / "images/operator/requirements.txt"
BUILD = ROOT / "images/build-requirements.txt"
TARGETS = (RUNTIME, OPERATOR, BUILD)
# The image's platform, not necessarily this machine's: markers are evaluated for it.
IMAGE_ENVIRONMENT = {
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "python_version": "3.11",
    "python_full_version": "3.11.2",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
HEADERS = {
    RUNTIME: """\
# The runtime image's requirements: pyproject.toml's dependencies and everything they pull in,
# pinned to the versions the test suite runs with. Generated: python hack/pin_requirements.py
# --write (tests/unit/test_images.py fails when it is stale). torch's local version (+cpu, or
# none for PyPI's CUDA build) comes from the index hack/images.sh gives the build.
""",
    OPERATOR: """\
# The operator image's requirements (no torch): what fedcore_operator imports and everything
# that pulls in, pinned to the versions the test suite runs with. Generated: python
# hack/pin_requirements.py --write; tests/unit/test_images.py checks it covers the operator's
# imports and is current. To add a distribution, add its name here and regenerate.
""",
    BUILD: """\
# What building fedcore's own wheel inside an image needs (pip --no-build-isolation: the
# build reaches no index for it). Generated: python hack/pin_requirements.py --write.
""",
}


def roots(target: Path) -> list[str]:
    """The requirements a file is generated from: pyproject's, or the names the file lists."""
    if target == RUNTIME:
        return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    lines = (line.strip() for line in target.read_text().splitlines())
    return [line.split("==")[0] for line in lines if line and not line.startswith("#")]


def pinned(requirements: list[str]) -> dict[str, str]:
    """name -> installed version for the closure of the requirements."""
    todo = [Requirement(line) for line in requirements]
    pins: dict[str, str] = {}
    while todo:
        requirement = todo.pop()
        if requirement.marker and not requirement.marker.evaluate(
            {**IMAGE_ENVIRONMENT, "extra": ""}
        ):
            continue
        name = canonicalize_name(requirement.name)
        if name in pins:
            continue
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError as missing:
            raise SystemExit(f"{name} is required but not installed here: {missing}") from None
        pins[name] = version.split("+", 1)[0]
        extras = requirement.extras
        for line in metadata.requires(name) or []:
            child = Requirement(line)
            if child.marker and not any(
                child.marker.evaluate({**IMAGE_ENVIRONMENT, "extra": extra})
                for extra in (extras or {""})
            ):
                continue
            todo.append(child)
    return pins


def render(target: Path) -> str:
    """The file's text as this environment pins it."""
    pins = pinned(roots(target))
    return HEADERS[target] + "".join(f"{name}=={pins[name]}\n" for name in sorted(pins))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the files")
    args = parser.parse_args()
    for target in TARGETS:
        text = render(target)
        if args.write:
            target.write_text(text)
            print(f"wrote {target.relative_to(ROOT)} ({text.count('==')} pins)")
        else:
            sys.stdout.write(f"# {target.relative_to(ROOT)}\n{text}")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Sets everything up, then runs the whole test suite (unit and integration) and the linters.
# Exits non-zero when any test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash hack/setup.sh
bash hack/testenv.sh
bash hack/control-plane.sh   # Kubernetes 1.20.2 for tests/kube and tests/node, built once into ~/.cache
# The images tests/node runs in real containers; layers cached in ~/.cache/fedcore-images.
bash hack/images.sh --save "$HOME/.cache/fedcore-images/archives" pause operator runtime
export FEDCORE_REQUIRE_REAL_NODE=1   # there, a missing piece of the real node fails its tier
.venv/bin/ruff check fedcore operator tests benchmarks
.venv/bin/mypy fedcore operator benchmarks
exec .venv/bin/python -m pytest "$@"

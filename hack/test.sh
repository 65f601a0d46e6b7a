#!/usr/bin/env bash
# Sets everything up, then runs the whole test suite (unit and integration) and the linters.
# Exits non-zero when any test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash hack/setup.sh
bash hack/testenv.sh
# Kubernetes 1.20.2 for tests/kube and tests/node (built once into ~/.cache), and the images
# tests/node runs in real containers (layers cached in ~/.cache/fedcore-images): the images
# build (mostly downloads) while the binaries compile.
bash hack/control-plane.sh packages
archives=$HOME/.cache/fedcore-images/archives
mkdir -p "$archives"
bash hack/images.sh --save "$archives" operator runtime >"$archives/build.log" 2>&1 &
images=$!
bash hack/control-plane.sh
bash hack/images.sh --save "$archives" pause >/dev/null
wait "$images" || { tail -40 "$archives/build.log"; echo "hack/images.sh failed: $archives/build.log" >&2; exit 1; }
export FEDCORE_REQUIRE_REAL_NODE=1   # there, a missing piece of the real node fails its tier
.venv/bin/ruff check fedcore operator tests benchmarks
.venv/bin/mypy fedcore operator benchmarks
exec .venv/bin/python -m pytest "$@"

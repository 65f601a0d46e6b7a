#!/usr/bin/env bash
# Creates .venv (if missing) and installs fedcore with its development extras into it.
# Re-running is cheap: the install is skipped while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.fedcore-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    # torch is pinned to 2.13.0 in pyproject.toml: a CPU build that installs from local disk.
    .venv/bin/python -m pip install --quiet -e '.[dev]'
    echo "$want" > "$stamp"
fi
# The example data sets (examples/data, a few MB, seconds; kept once written):
# examples/hospitals-tabular.yaml and examples/digits-imagefolder.yaml read them.
.venv/bin/python examples/make_data.py > /dev/null

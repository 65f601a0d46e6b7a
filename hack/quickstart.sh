#!/usr/bin/env bash
# Sets everything up, then runs examples/digits-fedavg.yaml end to end on this machine:
# a server and 10 clients as processes talking gRPC over mutual TLS on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
bash hack/setup.sh
exec .venv/bin/fedcore run examples/digits-fedavg.yaml "$@"

#!/usr/bin/env bash
# A Kubernetes 1.20 cluster on this machine with one real node, for trying fedcore by hand:
# the tests' control plane (etcd, kube-apiserver, controller-manager, scheduler) and a node
# running containerd, runc, kubelet and kube-proxy on a bridge of its own (tests/node/node.py),
# with fedcore's images built (hack/images.sh) and loaded. Needs root.
#
#   bash hack/cluster.sh up       builds what is missing (cached in ~/.cache), starts the
#                                 cluster in the background, prints `export KUBECONFIG=...`;
#                                 and a Prometheus on 127.0.0.1:9091 (when installed: bash
#                                 hack/testenv.sh) scraping every running pod's `metrics` port
#   bash hack/cluster.sh down     stops it and removes its bridge, containers and files
#   bash hack/cluster.sh status   says whether it runs
#
# On a machine with Docker or kind, use a kind cluster instead (docs/operator.md says how).
set -euo pipefail
cd "$(dirname "$0")/.."
STATE=${FEDCORE_CLUSTER_STATE:-$HOME/.cache/fedcore-cluster}
KUBECONFIG_OUT=$STATE/kubeconfig
PIDFILE=$STATE/cluster.pid
PROM_PIDFILE=$STATE/prometheus.pid
PROM_PORT=${FEDCORE_CLUSTER_PROMETHEUS_PORT:-9091}
mkdir -p "$STATE"

running() { [ -s "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

case "${1:-}" in
    up)
        if running; then echo "cluster: already up; export KUBECONFIG=$KUBECONFIG_OUT"; exit 0; fi
        [ "$(id -u)" -eq 0 ] || { echo "cluster: a real node needs root" >&2; exit 1; }
        bash hack/setup.sh >/dev/null
        bash hack/control-plane.sh
        bash hack/images.sh --save "$HOME/.cache/fedcore-images/archives" pause operator runtime
        rm -f "$KUBECONFIG_OUT"
        nohup .venv/bin/python -m tests.node.node "$KUBECONFIG_OUT" >"$STATE/cluster.log" 2>&1 &
        echo $! > "$PIDFILE"
        for _ in $(seq 1 300); do
            [ -s "$KUBECONFIG_OUT" ] && break
            running || { tail -30 "$STATE/cluster.log" >&2; exit 1; }
            sleep 1
        done
        [ -s "$KUBECONFIG_OUT" ] || { echo "cluster: not up in 300 s; see $STATE/cluster.log" >&2; exit 1; }
        echo "cluster: up (log $STATE/cluster.log)"
        if command -v prometheus >/dev/null; then
            # The node writes the pods' metrics ports to scrape-targets.json every 5 s.
            cat > "$STATE/prometheus.yml" <<PROM
global: {scrape_interval: 5s}
scrape_configs:
  - job_name: fedcore-pods
    file_sd_configs: [{files: ["$STATE/scrape-targets.json"], refresh_interval: 5s}]
PROM
            nohup prometheus --config.file="$STATE/prometheus.yml" --storage.tsdb.path="$STATE/tsdb" \
                --web.listen-address="127.0.0.1:$PROM_PORT" >"$STATE/prometheus.log" 2>&1 &
            echo $! > "$PROM_PIDFILE"
            sleep 1
            if kill -0 "$(cat "$PROM_PIDFILE")" 2>/dev/null; then
                echo "cluster: Prometheus on http://127.0.0.1:$PROM_PORT scrapes every pod's metrics port"
            else
                echo "cluster: Prometheus did not start; see $STATE/prometheus.log" >&2
            fi
        fi
        echo "export KUBECONFIG=$KUBECONFIG_OUT"
        ;;
    down)
        if [ -s "$PROM_PIDFILE" ]; then kill "$(cat "$PROM_PIDFILE")" 2>/dev/null || true; rm -f "$PROM_PIDFILE"; fi
        if running; then
            kill "$(cat "$PIDFILE")"
            for _ in $(seq 1 60); do running || break; sleep 1; done
        fi
        rm -f "$PIDFILE"
        echo "cluster: down"
        ;;
    status)
        if running; then echo "cluster: up; export KUBECONFIG=$KUBECONFIG_OUT"; else echo "cluster: down"; exit 3; fi
        ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
esac

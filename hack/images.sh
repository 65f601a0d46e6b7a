#!/usr/bin/env bash
# Builds fedcore's container images with whatever builder this machine has.
#
#   bash hack/images.sh [options] [operator] [runtime] [runtime-cuda] [pause]   (default: operator runtime)
#
#   operator       ghcr.io/fedcore/fedcore-operator:VERSION   the operator, no torch
#   runtime        ghcr.io/fedcore/fedcore:VERSION            every role's pod, torch's CPU build
#   runtime-cuda   ghcr.io/fedcore/fedcore:VERSION-cuda       the same with torch's CUDA build
#                                                             (the node supplies only the driver)
#   pause          localhost/fedcore-pause:3.4.1              a pod sandbox's pause process, for a
#                                                             node that no registry serves (built
#                                                             by hack/control-plane.sh)
# Options (each also an environment variable):
#   --builder docker|podman|buildah   FEDCORE_BUILDER  default: the first that works, in that order
#   --base IMAGE                      FEDCORE_BASE     default: python:3.11.11-slim-bookworm when
#                                     Docker Hub answers, else a Debian bookworm base this script
#                                     makes with debootstrap (localhost/fedcore-base:bookworm)
#   --local-base                      build on the debootstrap base even when a registry answers
#   --ca-bundle FILE                  FEDCORE_CA_BUNDLE  extra CAs the build's downloads trust
#                                     (a TLS-intercepting proxy's); default: $PIP_CERT or
#                                     $SSL_CERT_FILE when set. Used for the build only, not kept.
#   --index-url URL                   PIP_INDEX_URL    the package index (default PyPI)
#   --torch-index URL                 FEDCORE_TORCH_INDEX  where the CPU build of torch comes from
#                                     (default https://download.pytorch.org/whl/cpu)
#   --wheels DIR                      FEDCORE_WHEELS   wheels to prefer over the indexes (default:
#                                     $PIP_FIND_LINKS when it is a folder)
#   --save DIR                        write each image as DIR/NAME.tar (docker-archive), for
#                                     `ctr images import`, `kind load image-archive` and the like
#
# Builds are cached outside the repository: podman and buildah keep their layers in
# FEDCORE_IMAGES_CACHE (default ~/.cache/fedcore-images), so a rebuild after a code change
# reruns only the steps after the dependencies; the debootstrap base is made once per mirror.
# Docker keeps its own cache. Builds into one cache take turns (a lock file there), and each
# podman or buildah build ends by removing what it made stale: the untagged images a rebuild
# replaced and working containers an interrupted build left, so the cache stays the size of
# the images it holds.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=${FEDCORE_IMAGES_CACHE:-$HOME/.cache/fedcore-images}
VERSION=$(python3 -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['version'])")
UPSTREAM_BASE=python:3.11.11-slim-bookworm
LOCAL_BASE=localhost/fedcore-base:bookworm
PAUSE=localhost/fedcore-pause:3.4.1

builder=${FEDCORE_BUILDER:-}
base=${FEDCORE_BASE:-}
local_base=0
ca_bundle=${FEDCORE_CA_BUNDLE:-${PIP_CERT:-${SSL_CERT_FILE:-}}}
index_url=${PIP_INDEX_URL:-https://pypi.org/simple}
torch_index=${FEDCORE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
wheels=${FEDCORE_WHEELS:-}
if [ -z "$wheels" ] && [ -d "${PIP_FIND_LINKS:-}" ]; then wheels=$PIP_FIND_LINKS; fi
save=""
images=()
while [ $# -gt 0 ]; do
    case "$1" in
        --builder) builder=$2; shift 2 ;;
        --base) base=$2; shift 2 ;;
        --local-base) local_base=1; shift ;;
        --ca-bundle) ca_bundle=$2; shift 2 ;;
        --index-url) index_url=$2; shift 2 ;;
        --torch-index) torch_index=$2; shift 2 ;;
        --wheels) wheels=$2; shift 2 ;;
        --save) save=$2; shift 2 ;;
        operator|runtime|runtime-cuda|pause) images+=("$1"); shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "images: unknown argument $1 (--help lists them)" >&2; exit 2 ;;
    esac
done
[ ${#images[@]} -gt 0 ] || images=(operator runtime)
log() { echo "images: $*" >&2; }

# --- the builder ---------------------------------------------------------------------------
if [ -z "$builder" ]; then
    if command -v docker >/dev/null && docker info >/dev/null 2>&1; then builder=docker
    elif command -v podman >/dev/null && podman info >/dev/null 2>&1; then builder=podman
    elif command -v buildah >/dev/null; then builder=buildah
    else
        echo "images: no docker daemon, podman or buildah here (Debian: apt-get install buildah runc)" >&2
        exit 1
    fi
fi
case "$builder" in
    docker) B=(docker) ;;
    podman|buildah)
        # Layers live outside the repository and survive between builds and CI runs. runc,
        # not crun (which fails on hybrid cgroups), and file limits a sandbox without
        # CAP_SYS_RESOURCE can set.
        mkdir -p "$CACHE/storage"
        B=("$builder" --root "$CACHE/storage" --runroot "/run/fedcore-images-$builder" --storage-driver overlay)
        ;;
    *) echo "images: unknown builder $builder (docker, podman or buildah)" >&2; exit 2 ;;
esac
if [ "$builder" != docker ]; then
    # One build at a time per cache: the clean-up below must not remove another's containers.
    exec 9>"$CACHE/.lock"
    flock 9
fi
build_flags=()
case "$builder" in
    docker) build_flags=(build) ;;
    podman) build_flags=(build --layers --runtime runc --ulimit nofile=4096:4096 --ulimit nproc=4096:4096) ;;
    buildah) build_flags=(bud --layers --runtime runc --ulimit nofile=4096:4096 --ulimit nproc=4096:4096) ;;
esac
image_exists() { "${B[@]}" inspect --type image "$1" >/dev/null 2>&1 || "${B[@]}" image inspect "$1" >/dev/null 2>&1; }
image_id() { "${B[@]}" inspect --format '{{.Id}}' "$1" 2>/dev/null || "${B[@]}" images --format '{{.ID}}' "$1" | head -1; }

# --- the base --------------------------------------------------------------------------------
registry_answers() {
    # Docker Hub answers 401 to an anonymous /v2/ when it is reachable.
    local code
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 8 https://registry-1.docker.io/v2/ || true)
    [ "$code" = 401 ] || [ "$code" = 200 ]
}

debian_mirror() {
    # The mirror this machine's apt uses (deb822 or one-line sources), else Debian's own.
    local mirror
    mirror=$(grep -hoE '^URIs: *http[^ ]*/debian/?$' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | sed 's/^URIs: *//')
    [ -n "$mirror" ] || mirror=$(grep -hoE '^deb +(\[[^]]*\] +)?http[^ ]*/debian/? +bookworm ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
        | head -1 | awk '{print ($2 ~ /^\[/) ? $3 : $2}')
    echo "${mirror:-http://deb.debian.org/debian}"
}

base_key() {
    # The key label of the loaded local base (each builder spells its image config its way).
    local field='.Config.Labels'
    [ "$builder" = buildah ] && field='.OCIv1.Config.Labels'
    "${B[@]}" inspect --type image --format "{{index $field \"org.fedcore.base-key\"}}" "$LOCAL_BASE" 2>/dev/null || true
}

make_local_base() {
    # Debian bookworm, minimal, with python3, its venv module and CA certificates: what the
    # Dockerfiles need from a base. Made once per mirror and kept as an archive in the cache.
    local mirror archive key root
    mirror=$(debian_mirror)
    key=$(printf 'bookworm minbase python3,python3-venv,ca-certificates %s' "$mirror" | sha256sum | cut -c1-16)
    archive="$CACHE/base-bookworm-$key.tar"
    if [ ! -s "$archive" ]; then
        command -v debootstrap >/dev/null || { echo "images: a local base needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
        log "making a Debian bookworm base with debootstrap from $mirror (~3 min, once)"
        root=$(mktemp -d)
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" >"$CACHE/debootstrap.log" 2>&1 \
            || { tail -20 "$CACHE/debootstrap.log" >&2; rm -rf "$root"; exit 1; }
        rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
        tar -C "$root" --numeric-owner --exclude='./proc/*' --exclude='./sys/*' --exclude='./dev/*' -cf "$archive.part" .
        mv "$archive.part" "$archive"
        rm -rf "$root"
    fi
    if ! image_exists "$LOCAL_BASE" || [ "$(base_key)" != "$key" ]; then
        log "loading the base $LOCAL_BASE"
        case "$builder" in
            docker) docker import --change "LABEL org.fedcore.base-key=$key" "$archive" "$LOCAL_BASE" >/dev/null ;;
            podman) "${B[@]}" import --change "LABEL org.fedcore.base-key=$key" "$archive" "$LOCAL_BASE" >/dev/null ;;
            buildah)
                local ctr
                ctr=$("${B[@]}" from scratch)
                "${B[@]}" add "$ctr" "$archive" / >/dev/null
                "${B[@]}" config --label "org.fedcore.base-key=$key" --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
                "${B[@]}" commit --quiet --rm "$ctr" "$LOCAL_BASE" >/dev/null
                ;;
        esac
    fi
    base=$LOCAL_BASE
}

if [ -z "$base" ]; then
    if [ "$local_base" -eq 0 ] && registry_answers; then
        base=$UPSTREAM_BASE
    else
        [ "$local_base" -eq 1 ] || log "Docker Hub does not answer: building on a local Debian base"
        make_local_base
    fi
fi

# --- build -----------------------------------------------------------------------------------
secret=$(mktemp)
staged=0   # whether this invocation linked wheels into images/wheels (and must remove them)
trap 'rm -f "$secret"; [ "$staged" = 0 ] || find "$ROOT/images/wheels" -mindepth 1 ! -name README.md -delete' EXIT
if [ -n "$ca_bundle" ]; then cp "$ca_bundle" "$secret"; fi

stage_wheels() {
    # Links the chosen wheels into images/wheels (the build's bind mount); a CUDA build skips
    # torch's local CPU builds, which would otherwise win over PyPI's.
    local variant=$1 wheel
    staged=1
    find "$ROOT/images/wheels" -mindepth 1 ! -name README.md -delete
    [ -n "$wheels" ] || return 0
    for wheel in "$wheels"/*.whl; do
        [ -e "$wheel" ] || continue
        if [ "$variant" = runtime-cuda ] && [[ "$(basename "$wheel")" == torch-*+cpu-* ]]; then continue; fi
        ln "$wheel" "$ROOT/images/wheels/" 2>/dev/null || cp "$wheel" "$ROOT/images/wheels/"
    done
}

index_answers() { curl -s -o /dev/null --max-time 8 "$1/torch/"; }
has_cpu_torch() { [ -n "$wheels" ] && compgen -G "$wheels/torch-*+cpu-*.whl" >/dev/null; }

build_pause() {
    # The static binary hack/control-plane.sh compiles from Kubernetes' build/pause/linux.
    local binary context
    binary=${FEDCORE_K8S_BIN:-$HOME/.cache/k8s-1.20.2}/pause
    [ -x "$binary" ] || { echo "images: $binary is missing: run bash hack/control-plane.sh" >&2; exit 1; }
    context=$(mktemp -d)
    cp "$binary" "$context/pause"
    printf 'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' > "$context/Dockerfile"
    "${B[@]}" "${build_flags[@]}" -t "$PAUSE" "$context" >&2
    rm -rf "$context"
}

built=()
for image in "${images[@]}"; do
    if [ "$image" = pause ]; then
        build_pause
        built+=("$PAUSE")
        continue
    fi
    case "$image" in
        operator) dockerfile=images/operator/Dockerfile; tag=ghcr.io/fedcore/fedcore-operator:$VERSION; extra=() ;;
        runtime)
            dockerfile=images/runtime/Dockerfile; tag=ghcr.io/fedcore/fedcore:$VERSION
            cpu_index=$torch_index
            if has_cpu_torch && ! index_answers "$torch_index"; then
                log "$torch_index does not answer: torch's CPU build comes from $wheels"
                cpu_index=""
            fi
            extra=(--build-arg "TORCH_INDEX=$cpu_index") ;;
        runtime-cuda) dockerfile=images/runtime/Dockerfile; tag=ghcr.io/fedcore/fedcore:$VERSION-cuda; extra=(--build-arg "TORCH_INDEX=$index_url") ;;
    esac
    stage_wheels "$image"
    log "building $tag with $builder on $base"
    start=$SECONDS
    if [ "$builder" = docker ]; then export DOCKER_BUILDKIT=1; fi
    "${B[@]}" "${build_flags[@]}" -f "$dockerfile" -t "$tag" \
        --build-arg "BASE=$base" --build-arg "PIP_INDEX_URL=$index_url" "${extra[@]}" \
        --secret "id=extra-ca,src=$secret" . >&2
    log "built $tag in $((SECONDS - start)) s"
    built+=("$tag")
done

if [ -n "$save" ]; then
    mkdir -p "$save"
    for tag in "${built[@]}"; do
        name=$(basename "${tag%%:*}")
        case "$tag" in *:"$VERSION"-*) name=$name-${tag##*:"$VERSION"-} ;; esac
        id=$(image_id "$tag")
        if [ -s "$save/$name.tar" ] && [ "$(cat "$save/$name.id" 2>/dev/null)" = "$id" ]; then continue; fi
        log "saving $tag to $save/$name.tar"
        rm -f "$save/$name.tar"
        case "$builder" in
            docker) docker save -o "$save/$name.tar.part" "$tag" ;;
            podman) "${B[@]}" save --format docker-archive -o "$save/$name.tar.part" "$tag" ;;
            buildah) "${B[@]}" push --quiet "$tag" "docker-archive:$save/$name.tar.part:$tag" ;;
        esac
        mv "$save/$name.tar.part" "$save/$name.tar"
        echo "$id" > "$save/$name.id"
    done
fi

if [ "$builder" != docker ]; then
    # Stale layers: a rebuild leaves the image it replaced untagged (hundreds of MB each time).
    # The dependency layers the new tags stand on have children, so the build cache survives.
    "${B[@]}" rm --all >/dev/null 2>&1 || true
    if [ "$builder" = podman ]; then "${B[@]}" image prune -f >/dev/null; else "${B[@]}" rmi --prune >/dev/null 2>&1 || true; fi
fi

for tag in "${built[@]}"; do
    size=$("${B[@]}" inspect --format '{{.Size}}' "$tag" 2>/dev/null || true)
    [ -n "$size" ] || size=$("${B[@]}" images --format '{{.Size}}' "$tag" | head -1)
    echo "$tag $size"
done

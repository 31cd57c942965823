#!/usr/bin/env bash
# Create (or reuse) the project environment in .venv at the repository root and install Loom into it
# with its dev tools. Safe to run again: it only installs what is missing or changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# torch, CPU build. Where pip's configured wheel folder holds the CPU wheel of 2.13.0 (this project's
# machines) it is taken from there; elsewhere set LOOM_TORCH_INDEX=https://download.pytorch.org/whl/cpu.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==2.13.0" ${LOOM_TORCH_INDEX:+--index-url "$LOOM_TORCH_INDEX"}
fi
stamp=.venv/.loom-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || ! .venv/bin/python -c "import loom" 2>/dev/null; then
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
# Trainers whose reward client code tests/interop drives but whose pinned dependencies (transformers,
# deepspeed, flash-attn) cannot share this environment: installed without their dependencies; the
# imports their reward paths need come with the dev extra above.
if ! .venv/bin/python - <<'PY' 2>/dev/null
from importlib.metadata import version
assert version("verl") == "0.9.1" and version("openrlhf") == "0.11.2"
PY
then
  .venv/bin/python -m pip install -q --no-deps "verl==0.9.1" "openrlhf==0.11.2"
fi
# Both wheels also ship a top-level "tests" package, which would shadow this repository's tests/
# (tests.rollout.conftest and the like): a "tests" in site-packages is never ours, so it goes.
.venv/bin/python - <<'PY'
import pathlib, shutil, sysconfig
stray = pathlib.Path(sysconfig.get_paths()["purelib"]) / "tests"
if stray.is_dir():
    shutil.rmtree(stray)
PY
# issue 28: tests/web drive Debian's chromium headless with playwright (dev extra); never
# `playwright install`, which downloads a browser of its own. Installed only where it is missing.
if [ ! -x /usr/bin/chromium ]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=$([ "$(id -u)" -eq 0 ] || echo sudo)
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
  else
    echo "deploy/setup.sh: no apt-get; install chromium at /usr/bin/chromium for tests/web" >&2
  fi
fi

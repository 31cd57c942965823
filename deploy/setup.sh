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
# issue 34: verl's agent loop imports hydra, and hydra-core 1.3 / omegaconf 2.3 need the ANTLR 4.9
# runtime, while math-verify needs 4.13.2 (this venv's). A side interpreter for verl's side of
# tests/interop_rollout/test_verl_rollout.py: a venv inside .venv holding only those three (no deps),
# with a .pth that appends this venv's site-packages after its own, so its ANTLR 4.9 wins there and
# torch, verl and loom come from here (docs/interop-rollout.md, "verl"). Where it cannot be made, the
# verl tests skip and say so.
side=.venv/side-verl
side_pins="hydra-core==1.3.8 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3"
main_sp=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
side_pth="import site; site.addsitedir('$main_sp')"
side_ok() {
  [ -x "$side/bin/python" ] && "$side/bin/python" - "$side_pth" <<'PY' 2>/dev/null
import pathlib, sys, sysconfig
from importlib.metadata import version
pth = pathlib.Path(sysconfig.get_paths()["purelib"]) / "loom-main-venv.pth"
assert pth.read_text().strip() == sys.argv[1]
assert [version(p) for p in ("hydra-core", "omegaconf", "antlr4-python3-runtime")] == ["1.3.8", "2.3.0", "4.9.3"]
import loom  # noqa: F401  (from the main venv, through the .pth)
PY
}
if ! side_ok; then
  rm -rf "$side"
  if .venv/bin/python -m venv --without-pip "$side" \
    && .venv/bin/python -m pip --python "$side/bin/python" install -q --no-deps $side_pins \
    && side_sp=$("$side/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
    && printf '%s\n' "$side_pth" >"$side_sp/loom-main-venv.pth" \
    && "$side/bin/python" -c "
import antlr4, hydra, verl.experimental.agent_loop, loom
from importlib.metadata import version
assert version('antlr4-python3-runtime').startswith('4.9.'), version('antlr4-python3-runtime')
" && side_ok; then
    :
  else
    rm -rf "$side"
    echo "deploy/setup.sh: could not make the verl side interpreter ($side_pins); tests/interop_rollout/test_verl_rollout.py will skip" >&2
  fi
fi
# Environment libraries (docs/environments.md, "Environment libraries"). skyrl-gym shares this venv
# (the envs extra, in dev; it adds only func_timeout). prime's verifiers 0.2.1 (the last line whose
# MultiTurnEnv / ToolEnv are its main API; 0.4 replaced them) pulls openai-agents, whose websockets<17
# would downgrade uvicorn's websockets here: a side interpreter like side-verl, .venv/side-envs, holds
# verifiers and what this venv lacks or holds at another version (no deps: the list is the resolver's
# answer against this venv), with a .pth appending this venv's site-packages. An env worker that
# serves verifiers names runs from it; where it cannot be made, tests/env/test_verifiers_adapter.py
# skips and says so.
envs_side=.venv/side-envs
envs_pins="verifiers==0.2.1 mcp==1.30.0 aiolimiter==1.3.0 anthropic==2.16.0 docstring_parser==0.18.0
  gepa==0.1.4 httpx-sse==0.4.3 loguru==0.7.3 openai-agents==0.24.0 griffelib==2.4.1 websockets==16.1.1
  prime-pydantic-config==0.4.3 prime-sandboxes==0.5.1 connectrpc==0.11.1 protobuf-py==0.1.1
  protobuf-py-ext==0.1.1 aiofiles==25.1.0 prime-tunnel==0.1.15 PyJWT==2.15.1 pyqwest==0.12.0
  pyzmq==27.3.0 renderers==0.1.12 openai-harmony==0.0.8 setproctitle==1.3.8 sse-starlette==3.7.1
  tenacity==9.2.1 tomli_w==1.2.0 tiktoken==0.14.0 tomli==2.5.0"
envs_ok() {
  [ -x "$envs_side/bin/python" ] && "$envs_side/bin/python" - "$side_pth" <<'PY' 2>/dev/null
import pathlib, sys, sysconfig
from importlib.metadata import version
pth = pathlib.Path(sysconfig.get_paths()["purelib"]) / "loom-main-venv.pth"
assert pth.read_text().strip() == sys.argv[1]
assert version("verifiers") == "0.2.1" and version("websockets") == "16.1.1"
import verifiers, skyrl_gym, loom  # noqa: F401  (skyrl_gym and loom from the main venv)
assert verifiers.MultiTurnEnv and verifiers.ToolEnv
PY
}
if ! envs_ok; then
  rm -rf "$envs_side"
  if .venv/bin/python -m venv --without-pip "$envs_side" \
    && .venv/bin/python -m pip --python "$envs_side/bin/python" install -q --no-deps $envs_pins \
    && envs_sp=$("$envs_side/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
    && printf '%s\n' "$side_pth" >"$envs_sp/loom-main-venv.pth" && envs_ok; then
    :
  else
    rm -rf "$envs_side"
    echo "deploy/setup.sh: could not make the environment-library side interpreter ($envs_side); tests/env/test_verifiers_adapter.py will skip" >&2
  fi
fi
# issue 28: tests/web drive Debian's chromium headless with playwright (dev extra); never
# `playwright install`, which downloads a browser of its own. Installed only where it is missing.
if [ ! -x /usr/bin/chromium ]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=$([ "$(id -u)" -eq 0 ] || echo sudo)
    $SUDO apt-get update -qq -o DPkg::Lock::Timeout=600
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 chromium
  else
    echo "deploy/setup.sh: no apt-get; install chromium at /usr/bin/chromium for tests/web" >&2
  fi
fi
# The sandbox tier (docs/sandbox.md) runs model-written programs in bubblewrap; tests/sandbox skip
# only where it is absent. Installed where missing, when root and apt exist.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq -o DPkg::Lock::Timeout=600
    env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 bubblewrap
  elif ! command -v apt-get >/dev/null 2>&1; then
    echo "deploy/setup.sh: no apt-get; install bubblewrap (bwrap) for the sandbox service and tests/sandbox" >&2
  else
    echo "deploy/setup.sh: not root; run 'sudo apt-get install bubblewrap' for the sandbox service and tests/sandbox" >&2
  fi
fi
# The sandbox runs programs with the system interpreter (LOOM_SANDBOX_PYTHON, default /usr/bin/python3).
if [ ! -x /usr/bin/python3 ]; then
  echo "deploy/setup.sh: /usr/bin/python3 is missing; the sandbox's Python runs need it (apt-get install python3)" >&2
fi

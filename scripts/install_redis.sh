#!/usr/bin/env bash
# Installs redis-server (Debian's package) for the tests that share state between gateway
# processes; safe to run again and again. The tests start and stop their own redis-server on a
# free port with a temporary directory: the package's own service is not needed.
#
# CI runs as root; elsewhere sudo is used for apt-get when needed.
set -euo pipefail

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    else
        sudo "$@"
    fi
}

if ! command -v redis-server >/dev/null 2>&1; then
    echo "install_redis: installing Debian package redis-server"
    apt_install() {
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
            --no-install-recommends redis-server >/dev/null
    }
    # Package lists may be missing or stale on a fresh machine: update when the first try fails.
    if ! apt_install; then
        as_root apt-get update -q >/dev/null
        apt_install
    fi
fi

redis-server --version

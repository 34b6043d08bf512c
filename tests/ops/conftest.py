"""PROVISIONAL live fixtures for tests/ops/test_live_dashboards.py.

``vllm_worker_url`` (a real vLLM CPU worker) and ``live_gateway_url`` (the gateway in front of
it, as its own process) are meant to live, session-scoped, in tests/conftest.py, shared with the
other worker tests; once they are there, delete this file.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.ops.support import LIVE_API_KEY_SHA256, REPO


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="session")
def vllm_worker_url() -> Iterator[str]:
    """A vLLM CPU worker serving the tiny model on a free port (or the one at $VLLM_WORKER_URL)."""
    if os.environ.get("VLLM_WORKER_URL"):
        yield os.environ["VLLM_WORKER_URL"]
        return
    # Imported here so that only the live tests depend on the launcher.
    from scripts.vllm_worker import VllmWorker

    worker = VllmWorker(port=_free_port())
    worker.start()
    try:
        worker.wait_ready(timeout=600)
        yield worker.url
    finally:
        worker.stop()


@pytest.fixture(scope="session")
def live_gateway_url(
    vllm_worker_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """``python -m app`` on a free port in front of the worker, ready (/readyz 200)."""
    port = _free_port()
    env = {
        **os.environ,
        "GATEWAY_HOST": "127.0.0.1",
        "GATEWAY_PORT": str(port),
        "GATEWAY_WORKERS": vllm_worker_url,
        "GATEWAY_ACCESS_LOG": "false",
        # Fewer slots than the load's concurrency, so some requests wait in the admission queue
        # (the queue panels need that).
        "GATEWAY_MAX_RUNNING_PER_WORKER": "2",
        # A key of the top tier, so the load can use every tier.
        "GATEWAY_API_KEYS": json.dumps(
            [{"sha256": LIVE_API_KEY_SHA256, "tier": "interactive", "name": "live-tests"}]
        ),
    }
    log_path = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "app"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                pytest.fail(f"gateway exited: {log_path.read_text()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"gateway not ready in 60 s: {log_path.read_text()[-4000:]}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=35)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

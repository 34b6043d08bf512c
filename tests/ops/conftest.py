"""Live fixture for tests/ops/test_live_dashboards.py: the gateway as its own process.

The real vLLM worker it fronts (``vllm_worker_url``) comes from tests/conftest.py. The gateway
runs as a scaled-out pod does: two processes (one /metrics in prometheus_client's
multiprocess mode) sharing state through a redis-server of its own, so the dashboards are
checked against what several processes export.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from app.settings import DEFAULT_TIERS, TierSpec
from scripts.processes import stop_process
from scripts.redis_server import RedisServer
from scripts.vllm_worker import MODEL_DIR, TINY_LLAMA_HARDWARE
from tests.ops.support import LIVE_API_KEY_SHA256, REPO
from tests.servers import free_port

# The least TTFT target (and queue wait) and TPOT target of the live stack's tiers.
_LIVE_TTFT_S = 30.0
_LIVE_TPOT_S = 1.0


def _slow_worker_targets(tier: TierSpec) -> dict[str, object]:
    """``tier`` with its targets and queue wait raised to what a slow CPU worker meets."""
    ttft = max(tier.ttft_slo_s, _LIVE_TTFT_S)
    tpot = None if tier.tpot_slo_s is None else max(tier.tpot_slo_s, _LIVE_TPOT_S)
    update = {"ttft_slo_s": ttft, "max_queue_wait_s": ttft, "tpot_slo_s": tpot}
    return tier.model_copy(update=update).model_dump()


@pytest.fixture(scope="session")
def live_gateway_url(
    vllm_worker_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """``python -m app`` on a free port in front of the worker, ready (/readyz 200)."""
    port = free_port()
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    redis.start()
    env = {
        **os.environ,
        "GATEWAY_HOST": "127.0.0.1",
        "GATEWAY_PORT": str(port),
        "GATEWAY_WORKERS": vllm_worker_url,
        "GATEWAY_ACCESS_LOG": "false",
        # The Workers dashboard's predicted prefix-cache hit rate needs prefix-aware routing;
        # its KV event panels, the worker's events followed (prompts tokenized here).
        "GATEWAY_ROUTING": "prefix_aware",
        "GATEWAY_KV_EVENTS": "true",
        "GATEWAY_TOKENIZERS": f"tiny-llama={MODEL_DIR}",
        "GATEWAY_PROCESSES": "2",
        "GATEWAY_REDIS_URL": redis.url,
        # Roofline figures, so the Workers dashboard's bandwidth panels have data.
        "GATEWAY_HARDWARE": json.dumps(TINY_LLAMA_HARDWARE),
        # Fewer slots than the load's concurrency, so some requests wait in the admission queue
        # (the queue panels need that).
        "GATEWAY_MAX_RUNNING_PER_WORKER": "2",
        # The default tiers with targets a CPU worker of a loaded CI machine meets: with 2
        # slots, an interactive request's default 1 s queue wait expired behind two slow
        # streams (503 queue_timeout), and the load must go through whatever the machine.
        "GATEWAY_TIERS": json.dumps([_slow_worker_targets(t) for t in DEFAULT_TIERS]),
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
        stop_process(process, grace=35)
        redis.stop()

"""SIGTERM with streams running: the real ``python -m app`` process, a fixed-timing worker.

The drain delay is set longer than the grace period here, so that the gateway still accepts
connections (and its /metrics can be read) after it cut the long stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.fake_worker import FakeWorker, WorkerConfig
from bench.worker_http import bound_port
from tests.servers import free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.asyncio(loop_scope="session")


def _chat(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": True,
    }


async def _stream(client: httpx.AsyncClient, max_tokens: int, started: asyncio.Event) -> bytes:
    raw = b""
    async with client.stream("POST", "/v1/chat/completions", json=_chat(max_tokens)) as r:
        assert r.status_code == 200
        async for data in r.aiter_raw():
            raw += data
            started.set()
    return raw


async def test_sigterm_turns_not_ready_drains_and_cuts_what_outlives_the_grace(
    tmp_path: Path,
) -> None:
    fake = FakeWorker(WorkerConfig(ttft_ms=20.0, itl_ms=50.0, tokens=8))
    server = await fake.serve("127.0.0.1", 0)
    port = free_port()
    env = {
        **os.environ,
        "GATEWAY_WORKERS": f"http://127.0.0.1:{bound_port(server)}",
        "GATEWAY_HOST": "127.0.0.1",
        "GATEWAY_PORT": str(port),
        "GATEWAY_DRAIN_DELAY_S": "3.0",
        "GATEWAY_SHUTDOWN_GRACE_S": "1.5",
        "GATEWAY_ACCESS_LOG": "true",
    }
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log_file:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app", cwd=ROOT, env=env, stdout=log_file, stderr=log_file
        )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if (await client.get("/readyz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "gateway did not get ready"
                await asyncio.sleep(0.1)
            long_started, short_started = asyncio.Event(), asyncio.Event()
            long = asyncio.create_task(_stream(client, 400, long_started))  # 20 s
            short = asyncio.create_task(_stream(client, 20, short_started))  # 1 s
            await asyncio.wait_for(long_started.wait(), 5)
            await asyncio.wait_for(short_started.wait(), 5)
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            # Not ready at once, while requests are still accepted and served.
            while (await client.get("/readyz")).status_code != 503:
                assert time.monotonic() - signalled < 0.1
                await asyncio.sleep(0.005)
            assert (await client.get("/health")).status_code == 503  # vLLM's check, too
            late = await _stream(client, 4, asyncio.Event())
            assert late.endswith(b"data: [DONE]\n\n")
            # A stream that ends within the grace period ends as usual.
            assert (await short).endswith(b"data: [DONE]\n\n")
            # One that outlives it is cut with an in-band error and no [DONE].
            cut = await long
            cut_after = time.monotonic() - signalled
            assert b"[DONE]" not in cut
            last = cut.rstrip().rsplit(b"\n\n", 1)[-1]
            assert last.startswith(b"data: ")
            assert json.loads(last[6:])["error"]["code"] == "gateway_shutdown"
            assert 1.3 < cut_after < 2.5
            metrics = (await client.get("/metrics")).text
        assert 'outcome="gateway_shutdown"' in metrics
        # The cut is the gateway's doing: it never counts against the worker's health.
        worker = f"127.0.0.1:{bound_port(server)}"
        assert f'gateway_worker_ejections_total{{worker="{worker}"}} 0.0' in metrics
        assert f'gateway_worker_up{{worker="{worker}"}} 1.0' in metrics
        assert 'gateway_requests_total{endpoint="chat",model="fake-model",outcome="ok"' in metrics
        await asyncio.wait_for(process.wait(), 15)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        server.close()
        await server.wait_closed()
    assert "status=503 outcome=gateway_shutdown" in log_path.read_text()

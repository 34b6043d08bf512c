"""``make run``'s stack (scripts/run_stack.py), end to end: a real vLLM worker, the gateway.

It prints where to send requests once ready, serves the OpenAI SDK, routes on the worker's KV
cache events with the prompts tokenized by the gateway, and stops everything on SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from openai import OpenAI

from scripts.vllm_worker import free_port
from tests.test_real_worker import scrape, total

pytestmark = pytest.mark.worker

ROOT = Path(__file__).parent.parent
SYSTEM = "You are a helpful assistant who answers briefly and politely. " * 30


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    """The stack's output, line by line, read in a thread (so waiting on it can time out)."""
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _ready(lines: queue.Queue[str], within_s: float) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        seen.append(line)
        if "Ctrl-C stops everything" in line:  # the banner's last line
            return seen
    raise AssertionError("the stack never said it was ready:\n" + "".join(seen[-40:]))


def _poll(url: str, check: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    """The gateway's metrics once ``check`` holds for them (within 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        page = asyncio.run(scrape(url))
        if check(page):
            return page
        assert time.monotonic() < deadline, "not within 30 s"
        time.sleep(0.5)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_make_runs_stack_serves_the_sdk_on_kv_events_and_stops_on_sigterm() -> None:
    gateway, worker = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "scripts.run_stack", "--gateway-port", str(gateway),
            "--worker-port", str(worker), "--prometheus-port", str(free_port()),
            "--no-prometheus",
        ],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        seen = "".join(_ready(_lines(proc), 600))
        url = f"http://127.0.0.1:{gateway}"
        assert f"OpenAI SDK: OpenAI(base_url='{url}/v1'" in seen
        # The worker's event source is read with its models, its block size from its first
        # load scrape: until both are in, prompts are routed on the approximate index alone.
        _poll(
            url,
            lambda page: (
                total(page, "gateway_worker_kv_index_complete") == 1
                and any(k.startswith("gateway_worker_kv_cache_usage_ratio{") for k in page)
            ),
        )
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="tiny-llama",
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Hi!"},
            ],
            max_tokens=8,
            stream=True,
        )
        chunks = [c for c in stream if c.choices and c.choices[0].delta.content]
        assert chunks
        # Routed on the worker's own events, the prompt tokenized by the gateway.
        page = _poll(url, lambda page: total(page, "gateway_worker_kv_events_total") > 0)
        assert total(page, "gateway_prompt_tokenizations_total", result="local") == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert code == 0
    assert not _listening(gateway)
    assert not _listening(worker)

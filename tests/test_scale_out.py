"""Two gateway processes, a REAL redis-server and the REAL vLLM CPU worker: one view.

Each test runs the gateway as it runs in production (``python -m app`` with
``GATEWAY_PROCESSES=2``) and reads which process served what from its log. Requests are spread
over both processes by the kernel (every request on a new connection), or pinned to one (a
keep-alive connection stays with the process that accepted it).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.http.server import collect_on_a_timer
from scripts.redis_server import RedisServer
from tests.pod import Pod, running_pod
from tests.test_real_worker import scrape, total, wait_idle

MODEL = "tiny-llama"
MESSAGES: list[dict[str, str]] = [{"role": "user", "content": "Tell me about queues."}]
KEYS: dict[str, dict[str, object]] = {
    "conc": {"tier": "standard", "max_concurrency": 4},
    "tpm": {"tier": "standard", "tokens_per_minute": 800},
    "interactive": {"tier": "interactive"},
    "batch": {"tier": "batch"},
}


def _secret(name: str) -> str:
    return f"sk-scale-out-{name}"


def _env(worker: str, redis: RedisServer | None, **extra: str) -> dict[str, str]:
    keys = [
        {"sha256": hashlib.sha256(_secret(name).encode()).hexdigest(), "name": name} | spec
        for name, spec in KEYS.items()
    ]
    env = {
        "GATEWAY_WORKERS": worker,
        "GATEWAY_API_KEYS": json.dumps(keys),
        "GATEWAY_ACCESS_LOG": "true",
        **extra,
    }
    if redis is not None:
        env["GATEWAY_REDIS_URL"] = redis.url
    return env


@pytest.fixture
def pod(vllm_worker_url: str, redis_server: RedisServer, tmp_path: Path) -> Iterator[Pod]:
    """Two gateway processes sharing state through the redis-server.

    With a budget of 250 ms for Redis calls: on this shared 2-core machine, with the worker,
    both processes and 20 clients busy, a process's event loop is now and then more than the
    default 50 ms late, and the process then runs on its own until its next sync (the
    fallback, tested with the default budget below).
    """
    env = _env(vllm_worker_url, redis_server, GATEWAY_REDIS_TIMEOUT_S="0.25")
    with running_pod(env, tmp_path / "gateway.log") as running:
        yield running


async def _chat(
    client: httpx.AsyncClient,
    url: str,
    key: str,
    max_tokens: int,
    stream: bool = True,
    request_id: str | None = None,
) -> tuple[int, dict[str, Any], float | None]:
    """One chat completion: ``(status, usage or error body, seconds to the first content)``."""
    headers = {"authorization": f"Bearer {_secret(key)}"}
    if request_id:
        headers["x-request-id"] = request_id
    body: dict[str, Any] = {
        "model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "ignore_eos": True,
        "stream": stream,
    }  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    sent = time.monotonic()
    first: float | None = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200 or not stream:
            payload = json.loads(await r.aread())
            return r.status_code, payload.get("usage") or payload, time.monotonic() - sent
        usage: dict[str, Any] = {}
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line and first is None:
                first = time.monotonic() - sent
            if line.startswith("data: {") and '"usage":{' in line:
                usage = json.loads(line[6:])["usage"]
        return r.status_code, usage, first


async def _busiest(worker: str, stop: asyncio.Event) -> float:
    """The most requests the worker ran or held (running + waiting) at once, until ``stop``."""
    most = 0.0
    while not stop.is_set():
        page = await scrape(worker)
        busy = total(page, "vllm:num_requests_running") + total(page, "vllm:num_requests_waiting")
        most = max(most, busy)
        await asyncio.sleep(0.02)
    return most


async def test_a_keys_concurrency_of_4_holds_at_the_worker_across_both_processes(
    pod: Pod, vllm_worker_url: str
) -> None:
    """20 clients of one key with a concurrency of 4, 10 on each process's connections: the
    worker (its own vllm:num_requests_running + waiting, sampled every 20 ms) never runs more
    than 4 of them."""
    clients = await _pinned(pod, 10)
    try:
        assert len(clients) == 2, clients
        assert min(map(len, clients.values())) >= 10, clients
        stop = asyncio.Event()
        sampler = asyncio.create_task(_busiest(vllm_worker_url, stop))
        statuses: dict[int, list[int]] = {pid: [] for pid in clients}
        until = time.monotonic() + 4.0

        async def client_loop(pid: int, client: httpx.AsyncClient) -> None:
            while time.monotonic() < until:
                status, _, _ = await _chat(client, pod.url, "conc", 64)
                statuses[pid].append(status)
                # A served client waits too: sent again at once, it would take the slot its
                # own request just gave back before any other client could, and the four
                # slots would stay with whichever process first got them.
                await asyncio.sleep(0.02)

        await asyncio.gather(
            *(client_loop(pid, c) for pid, group in clients.items() for c in group[:10])
        )
        stop.set()
        busiest = await sampler
    finally:
        await _close(clients)
    for seen in statuses.values():
        assert set(seen) <= {200, 429}, statuses
        assert seen.count(200) >= 3, statuses  # both processes admitted the key's requests
    assert busiest <= 4, f"the worker ran {busiest} of the key's requests at once"
    assert busiest == 4  # the limit was reached, so a breach would have shown
    await wait_idle(vllm_worker_url, within_s=5)


async def test_a_keys_tokens_per_minute_are_cut_at_the_limit_summed_over_both_processes(
    pod: Pod, vllm_worker_url: str
) -> None:
    """A key of 800 tokens a minute, requests of ~113 tokens through each process in turn:
    the first 429 comes once both processes together served about 800 (each alone would
    have let 800 through)."""
    clients = await _pinned(pod, 1)
    used = 0
    served = 0
    started = time.monotonic()
    try:
        assert len(clients) == 2, clients
        turns = [group[0] for group in clients.values()]
        async with asyncio.timeout(60):
            while True:
                client = turns[served % 2]
                status, usage, _ = await _chat(client, pod.url, "tpm", 100, stream=False)
                if status == 429:
                    assert usage["error"]["code"] == "key_quota"
                    break
                assert status == 200, usage
                used += int(usage["total_tokens"])
                served += 1
    finally:
        await _close(clients)
    took = time.monotonic() - started
    per_request = used / served
    # The bucket refills 13.3 tokens/s meanwhile, and may go into debt by one request.
    most = 800 + 800 / 60 * took + 2 * per_request
    assert 800 - per_request <= used <= most, (used, served, took)
    await wait_idle(vllm_worker_url, within_s=5)


async def _pinned(pod: Pod, each: int) -> dict[int, list[httpx.AsyncClient]]:
    """At least ``each`` single-connection clients per process, grouped by the process.

    Connections are opened eight at a time until each process has accepted enough: an idle
    process that wins the race for the listening socket tends to win it again and again.
    """
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    clients: dict[int, list[httpx.AsyncClient]] = {}
    for round_ in range(50):
        if len(clients) == 2 and min(map(len, clients.values())) >= each:
            break
        made = [httpx.AsyncClient(timeout=60, limits=limits) for _ in range(8)]
        ids = [f"pin-{os.getpid()}-{round_}-{n}-{time.monotonic_ns()}" for n in range(8)]
        await asyncio.gather(
            *(
                c.get(f"{pod.url}/v1/models", headers={"x-request-id": i})
                for c, i in zip(made, ids, strict=True)
            )
        )
        deadline = time.monotonic() + 5
        for client, request_id in zip(made, ids, strict=True):
            while (pid := pod.served_by(request_id)) is None:
                assert time.monotonic() < deadline, "the probe was never logged"
                await asyncio.sleep(0.02)
            clients.setdefault(pid, []).append(client)
    return clients


async def _close(clients: dict[int, list[httpx.AsyncClient]]) -> None:
    for group in clients.values():
        for client in group:
            await client.aclose()


async def test_overload_through_both_processes_keeps_interactive_ahead_of_batch(
    vllm_worker_url: str, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Batch floods the worker through one process, interactive arrives through the other:
    the slots kept for interactive are kept fleet-wide, so interactive meets its TTFT."""
    env = _env(vllm_worker_url, redis_server, GATEWAY_MAX_RUNNING_PER_WORKER="4")
    with running_pod(env, tmp_path / "gateway.log") as pod:
        clients = await _pinned(pod, 6)
        try:
            assert len(clients) == 2, {pid: len(c) for pid, c in clients.items()}
            batch_side, interactive_side = sorted(clients.values(), key=len, reverse=True)
            until = time.monotonic() + 8.0
            batch: list[int] = []
            interactive: list[tuple[int, float | None]] = []
            settled = until - 4.5

            async def batch_loop(client: httpx.AsyncClient) -> None:
                while time.monotonic() < until:
                    status, _, _ = await _chat(client, pod.url, "batch", 160)
                    batch.append(status)
                    if status != 200:
                        await asyncio.sleep(0.1)

            async def interactive_loop(client: httpx.AsyncClient) -> None:
                await asyncio.sleep(2.0)  # the batch flood first
                while time.monotonic() < until:
                    sent = time.monotonic()
                    status, _, ttft = await _chat(client, pod.url, "interactive", 8)
                    # A running request cannot be preempted: the slots kept for interactive
                    # free up as batch requests end, within the first 1.5 s (one batch answer).
                    if sent >= settled:
                        interactive.append((status, ttft))
                    await asyncio.sleep(0.25)

            await asyncio.gather(
                *(batch_loop(c) for c in batch_side[:6]),
                *(interactive_loop(c) for c in interactive_side[:2]),
            )
        finally:
            await _close(clients)
    met = [s == 200 and ttft is not None and ttft <= 1.0 for s, ttft in interactive]
    assert len(met) >= 8, interactive
    assert sum(met) / len(met) >= 0.9, interactive
    assert batch.count(200) >= 4, batch  # batch still runs, in the slots interactive leaves
    await wait_idle(vllm_worker_url, within_s=10)


async def test_redis_killed_mid_run_falls_back_and_restarted_is_shared_again(
    redis_server: RedisServer, vllm_worker_url: str, tmp_path: Path
) -> None:
    """Requests keep flowing through both processes while Redis is gone (no 5xx, on each
    process's own limits), gateway_shared_state_up drops to 0, and comes back to 1 (both
    processes publishing again) once Redis is restarted. The default 50 ms budget."""
    # The pod is timed to within a second: this process's own full collections (a large heap
    # late in the suite) are kept out of the timed part, as running_gateway does.
    restore_gc = collect_on_a_timer(asyncio.get_running_loop())
    try:
        with running_pod(_env(vllm_worker_url, redis_server), tmp_path / "gateway.log") as pod:
            await _redis_killed_and_restarted(pod, redis_server)
    finally:
        restore_gc()
    await wait_idle(vllm_worker_url, within_s=5)


async def _redis_killed_and_restarted(pod: Pod, redis_server: RedisServer) -> None:
    statuses: list[int] = []
    stop = asyncio.Event()

    async def traffic() -> None:
        while not stop.is_set():
            async with httpx.AsyncClient(timeout=30) as client:
                status, _, _ = await _chat(client, pod.url, "conc", 16)
            statuses.append(status)

    async def shared_up() -> float:
        return total(await scrape(pod.url), "gateway_shared_state_up")

    async def until(check: Any, within_s: float) -> float:
        deadline = time.monotonic() + within_s
        while not await check():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        return within_s - (deadline - time.monotonic())

    assert await shared_up() == 1
    assert redis_server.command("ZCARD", "goodput:processes") == b":2"
    runners = [asyncio.create_task(traffic()) for _ in range(3)]
    try:
        await asyncio.sleep(1.0)
        redis_server.kill()
        before = len(statuses)
        down_after = await until(lambda: _is(shared_up, 0), 3.0)
        await asyncio.sleep(1.5)
        during = statuses[before:]
        redis_server.start()
        up_after = await until(lambda: _is(shared_up, 1), 5.0)
        await asyncio.sleep(0.5)
    finally:
        stop.set()
        await asyncio.gather(*runners)
    # Served meanwhile on each process's part of the key's limit of 4 (2 each): 429s when
    # three clients land on one process, never an error.
    assert during.count(200) >= 5, during
    assert set(statuses) <= {200, 429}, statuses
    assert down_after < 1.0, down_after
    assert up_after < 3.0, up_after
    # Shared again: both processes publish their state to the restarted Redis.
    assert redis_server.command("ZCARD", "goodput:processes") == b":2"
    assert pod.text().count("Redis answers") >= 4  # at start, and again after the restart


async def _is(read: Any, value: float) -> bool:
    return bool(await read() == value)


async def test_a_process_killed_with_sigkill_is_replaced_and_the_other_keeps_serving(
    pod: Pod, vllm_worker_url: str
) -> None:
    """kill -9 of one process: the other serves every request meanwhile, the pod's /metrics
    answers with its totals (the dead process's counts included), and a new process takes
    the dead one's place."""
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(6):
            assert (await _chat(client, pod.url, "conc", 8))[0] == 200
    page = await scrape(pod.url)
    assert total(page, "gateway_requests_total", endpoint="chat") == 6
    gaps = total(page, "gateway_inter_token_latency_seconds_count")
    assert gaps >= 6
    first, second = pod.children()
    os.kill(first, signal.SIGKILL)
    statuses = []
    for _ in range(8):
        async with httpx.AsyncClient(timeout=30) as client:  # new connections
            statuses.append((await _chat(client, pod.url, "conc", 8))[0])
    assert statuses == [200] * 8
    page = await scrape(pod.url)
    assert total(page, "gateway_requests_total", endpoint="chat") == 14
    # The histogram of inter-token gaps (merged per token batch, app.observe.metrics.BatchHistogram)
    # keeps the dead process's samples and adds the new ones.
    assert total(page, "gateway_inter_token_latency_seconds_count") >= gaps + 8
    deadline = time.monotonic() + 30
    while len(pod.children()) < 2 or len(pod.ready()) < 3:
        assert time.monotonic() < deadline, pod.text()[-2000:]
        await asyncio.sleep(0.1)
    assert second in pod.children()
    assert first not in pod.children()
    assert "ended (exit code -9): starting another" in pod.text()
    await wait_idle(vllm_worker_url, within_s=5)

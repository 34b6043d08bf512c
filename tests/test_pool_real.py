"""The worker pool against TWO real vLLM CPU workers: spread, model union, death and return.

The session's worker (``vllm_worker_url``) serves ``tiny-llama``. This module starts a second
one serving both ``tiny-llama`` and ``tiny-llama-b``, so that ``/v1/models`` is a union and a
request for ``tiny-llama-b`` has exactly one place to go. The second worker is the one killed
(SIGKILL of its whole process group, as an OOM kill or a node loss would) and restarted.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from scripts.vllm_worker import VllmWorker
from tests.servers import free_port, running_gateway, settings_for
from tests.test_real_worker import scrape, total, wait_idle
from tests.worker_watch import serving

MODEL = "tiny-llama"
ONLY_B = "tiny-llama-b"
PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def worker_b(request: pytest.FixtureRequest) -> Iterator[VllmWorker]:
    """A second real worker, serving the shared model and one of its own."""
    worker = VllmWorker(
        port=free_port(), extra_args=["--served-model-name", MODEL, ONLY_B], kv_cache_gib=1
    )
    with serving(request, worker):
        yield worker


def _label(url: str) -> str:
    return url.removeprefix("http://")


@dataclass
class Stream:
    """What a client saw of one streamed chat completion."""

    content_events: int = 0
    error: dict[str, object] | None = None
    done: bool = False


async def _stream(
    client: httpx.AsyncClient, url: str, max_tokens: int, seen: asyncio.Event | None = None
) -> Stream:
    body = {
        "model": MODEL,
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    result = Stream()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                result.done = True
                continue
            event = json.loads(data)
            if "error" in event:
                result.error = event["error"]
                continue
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                result.content_events += 1
                if seen is not None and result.content_events >= 5:
                    seen.set()
    return result


async def _wait_for(url: str, name: str, worker: str, wanted: float, within_s: float) -> float:
    """Poll the gateway's /metrics until ``name{worker=...}`` equals ``wanted``."""
    deadline = time.monotonic() + within_s
    while True:
        value = total(await scrape(url), name, worker=worker)
        if value == wanted or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
async def pool_url(vllm_worker_url: str, worker_b: VllmWorker) -> AsyncIterator[str]:
    """A gateway in front of both workers, round robin so that each gets half of a burst."""
    settings = settings_for(
        f"{vllm_worker_url},{worker_b.url}",
        routing="round_robin",
        # Admission's limits would hold some requests back and reorder who goes where; these
        # tests are about the pool, so every request is relayed at once.
        admission=False,
        # Slower than a request, so that right after the kill it is the requests that find B
        # dead (failover, ejection), not the probe.
        probe_interval_s=2.0,
        eject_after_failures=2,
        eject_base_s=1.0,
    )
    async with running_gateway(settings) as url:
        async with httpx.AsyncClient() as client:
            deadline = time.monotonic() + 30
            while True:
                models = (await client.get(f"{url}/v1/models")).json()["data"]
                if {m["id"] for m in models} == {MODEL, ONLY_B}:
                    break
                assert time.monotonic() < deadline, models
                await asyncio.sleep(0.2)
        yield url


async def test_models_are_the_union_and_a_model_goes_only_where_it_is_served(
    pool_url: str, vllm_worker_url: str, worker_b: VllmWorker
) -> None:
    sdk = openai.AsyncOpenAI(base_url=f"{pool_url}/v1", api_key="unused", max_retries=0)
    try:
        models = {m.id: m for m in (await sdk.models.list()).data}
        assert set(models) == {MODEL, ONLY_B}
        # vLLM's own fields survive the union.
        extra = models[ONLY_B].model_extra or {}
        assert extra.get("max_model_len") == 1024
        before = await scrape(pool_url)
        for _ in range(4):
            # (vLLM answers with its first served name, ``tiny-llama``, whatever was asked.)
            done = await sdk.chat.completions.create(model=ONLY_B, messages=PROMPT, max_tokens=4)  # type: ignore[arg-type]
            assert done.choices[0].message.content is not None
        after = await scrape(pool_url)
    finally:
        await sdk.close()
    routed = "gateway_worker_routed_requests_total"
    a, b = _label(vllm_worker_url), _label(worker_b.url)
    assert total(after, routed, worker=b) - total(before, routed, worker=b) == 4
    assert total(after, routed, worker=a) == total(before, routed, worker=a)


async def test_traffic_reaches_both_workers(
    pool_url: str, vllm_worker_url: str, worker_b: VllmWorker
) -> None:
    before = await scrape(pool_url)
    async with httpx.AsyncClient(timeout=60) as client:
        results = await asyncio.gather(*(_stream(client, pool_url, 16) for _ in range(8)))
    assert all(r.done and r.error is None and r.content_events > 0 for r in results)
    after = await scrape(pool_url)
    routed = "gateway_worker_routed_requests_total"
    for worker in (_label(vllm_worker_url), _label(worker_b.url)):
        share = total(after, routed, worker=worker) - total(before, routed, worker=worker)
        assert share == 4, (worker, share)


async def test_a_killed_worker_ends_its_streams_in_band_is_ejected_and_returns(
    pool_url: str, vllm_worker_url: str, worker_b: VllmWorker
) -> None:
    a, b = _label(vllm_worker_url), _label(worker_b.url)
    routed = "gateway_worker_routed_requests_total"
    before = await scrape(pool_url)
    sdk = openai.AsyncOpenAI(base_url=f"{pool_url}/v1", api_key="unused", max_retries=0)
    async with httpx.AsyncClient(timeout=120) as client:
        # Six long streams, three on each worker; once every one is producing, kill worker B
        # and at once send ten new requests, half of which the round robin sends to B.
        seen = [asyncio.Event() for _ in range(6)]
        streams = [asyncio.create_task(_stream(client, pool_url, 600, event)) for event in seen]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in seen)), 60)
        assert worker_b.pid is not None
        os.killpg(worker_b.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        fresh = [
            asyncio.create_task(
                sdk.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4)  # type: ignore[arg-type]
            )
            for _ in range(10)
        ]
        replies = await asyncio.gather(*fresh)
        served_s = time.monotonic() - killed_at
        results = await asyncio.gather(*streams)
        after = await scrape(pool_url)

        # The streams on B end with an in-band error and no [DONE]; those on A finish.
        broken = [r for r in results if r.error is not None]
        finished = [r for r in results if r.done]
        assert len(broken) == 3, results
        assert len(finished) == 3, results
        for r in broken:
            assert not r.done
            assert r.content_events >= 5
            assert r.error is not None
            assert r.error["type"]
            assert r.error["message"]
        assert all(r.content_events >= 500 and r.error is None for r in finished)
        errors = "gateway_requests_total"
        assert (
            total(after, errors, outcome="upstream_error")
            - total(before, errors, outcome="upstream_error")
            == 3
        )

        # Every new request succeeded: those routed to B failed over to A before any byte,
        # and the failures ejected B.
        assert all(reply.choices[0].message.content is not None for reply in replies)
        assert (
            total(after, "gateway_worker_failovers_total", worker=b)
            - total(before, "gateway_worker_failovers_total", worker=b)
            >= 1
        )
        assert (
            total(after, "gateway_worker_ejections_total", worker=b)
            - total(before, "gateway_worker_ejections_total", worker=b)
            >= 1
        )
        assert total(after, "gateway_worker_up", worker=b) == 0
        # The active probe keeps it out after the ejection ends; the gateway stays ready.
        await asyncio.sleep(3)
        assert total(await scrape(pool_url), "gateway_worker_up", worker=b) == 0
        assert (await client.get(f"{pool_url}/readyz")).status_code == 200
        # B was the only worker for its own model: a 503 the SDK raises, not a hang.
        try:
            with pytest.raises(openai.InternalServerError) as unavailable:
                await sdk.chat.completions.create(model=ONLY_B, messages=PROMPT, max_tokens=4)  # type: ignore[arg-type]
            assert unavailable.value.status_code == 503
        finally:
            await sdk.close()

        # Restarted on the same address, B is probed back in and gets its share again.
        worker_b.stop()
        restarted = VllmWorker(
            port=worker_b.port, extra_args=["--served-model-name", MODEL, ONLY_B]
        )
        restarted.start()
        try:
            restarted.wait_ready(timeout=600)
            assert await _wait_for(pool_url, "gateway_worker_up", b, 1, within_s=15) == 1
            back = await scrape(pool_url)
            again = await asyncio.gather(*(_stream(client, pool_url, 8) for _ in range(4)))
            assert all(r.done and r.error is None for r in again)
            later = await scrape(pool_url)
            assert total(later, routed, worker=b) - total(back, routed, worker=b) == 2
            assert total(later, routed, worker=a) - total(back, routed, worker=a) == 2
            await wait_idle(vllm_worker_url, within_s=5)
        finally:
            restarted.stop()
    print(f"after the kill, ten new requests were all served within {served_s:.2f} s")

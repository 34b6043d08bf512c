"""Routing on a real vLLM CPU worker's own KV cache events.

This module starts E: the tiny model with a cache of 16 blocks of 128 tokens (two prompts of
~900 tokens), publishing its KV cache events over ZMQ with a replay endpoint. The gateway routes
between E and the session's worker B (which publishes none) under ``prefix_aware``, admission
off. Requests sent to E directly stand for another gateway replica's or tenant's traffic: the
gateway never routed them, and learns of them only from E's events.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from scripts.vllm_worker import VllmWorker, kv_events_args
from tests.servers import free_port, running_gateway, settings_for
from tests.test_prefix_real import _label
from tests.test_real_worker import scrape, total
from tests.worker_watch import serving

MODEL = "tiny-llama"
WORDS = ("river", "stone", "light", "green", "cloud", "north", "table", "small", "open", "field")
ROUTED = "gateway_worker_routed_requests_total"
PREDICTED = "gateway_worker_predicted_prefix_hit_tokens_total"
BLOCKS = "gateway_worker_kv_index_blocks"
CACHED = "gateway_worker_cached_prompt_tokens_total"
MISSED = "gateway_worker_prefix_missed_tokens_total"
TOLD = "gateway_worker_cache_told_prompt_tokens_total"
HITS = "vllm:prefix_cache_hits_total"


def _system(seed: int) -> str:
    """About 900 tokens of the tiny model's tokenizer: 7 whole blocks of 128."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(360))


def _events_worker(port: int, pub: int, replay: int) -> VllmWorker:
    return VllmWorker(
        port=port, extra_args=["--num-gpu-blocks-override", "16", *kv_events_args(pub, replay)]
    )


@pytest.fixture(scope="module")
def ports() -> tuple[int, int, int]:
    """E's HTTP, event and replay ports (a restarted E takes the same)."""
    return free_port(), free_port(), free_port()


@pytest.fixture(scope="module")
def worker_e(request: pytest.FixtureRequest, ports: tuple[int, int, int]) -> Iterator[VllmWorker]:
    """E: 16 cache blocks, its KV cache events published with a replay endpoint."""
    with serving(request, _events_worker(*ports)) as worker:
        yield worker


@pytest.fixture(scope="module")
async def gateway(vllm_worker_url: str, worker_e: VllmWorker) -> AsyncIterator[str]:
    """prefix_aware in front of E and B; E's events followed as /kv_event_sources says.

    The prompts are tokenized by the gateway (the model's files, as ``make run`` sets up):
    their blocks are found in E's events only if they are cut exactly as E cut them.
    """
    from scripts.vllm_worker import MODEL_DIR

    settings = settings_for(
        f"{worker_e.url},{vllm_worker_url}",
        routing="prefix_aware",
        admission=False,
        load_interval_s=0.2,
        kv_events=True,
        tokenizers={MODEL: MODEL_DIR},
    )
    async with running_gateway(settings) as url:
        # E's index (B, the session's worker, publishes too: its history may be past replay).
        e = _label(worker_e.url)
        await _until(
            url, lambda page: total(page, "gateway_worker_kv_index_complete", worker=e) == 1
        )
        yield url


async def _until(url: str, check: Any, within_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + within_s
    while True:
        page = await scrape(url)
        if check(page):
            return page
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.1)


async def _settled(url: str, label: str) -> None:
    """Wait until E's events stop coming (all it published is applied)."""
    last = -1.0
    while True:
        page = await scrape(url)
        now = total(page, "gateway_worker_kv_events_total", worker=label)
        if now == last:
            return
        last = now
        await asyncio.sleep(0.3)


async def _chat(client: httpx.AsyncClient, url: str, system: str, question: str) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 2,
    }
    response = await client.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


async def _hits(workers: list[str]) -> float:
    return sum([total(await scrape(w), HITS) for w in workers])


async def test_a_prefix_cached_by_others_goes_where_the_events_say_until_it_is_evicted(
    gateway: str, worker_e: VllmWorker, vllm_worker_url: str
) -> None:
    e, workers = _label(worker_e.url), [worker_e.url, vllm_worker_url]
    shared = _system(700)
    async with httpx.AsyncClient(timeout=120) as client:
        # Another replica's request puts the prefix in E's cache: the gateway routed nothing.
        await _chat(client, worker_e.url, shared, "Where does it start?")
        await _until(gateway, lambda page: total(page, BLOCKS, worker=e) >= 6)
        # Each of the gateway's requests sharing it goes to E, predicted and found cached.
        before, hits = await scrape(gateway), await _hits(workers)
        for question in ("What comes next?", "And then?", "How does it end?"):
            await _chat(client, gateway, shared, question)
        after = await scrape(gateway)
        assert total(after, ROUTED, worker=e) - total(before, ROUTED, worker=e) == 3
        local = "gateway_prompt_tokenizations_total"
        assert total(after, local, result="local") - total(before, local, result="local") == 3
        predicted = total(after, PREDICTED, worker=e) - total(before, PREDICTED, worker=e)
        found = await _hits(workers) - hits
        assert found >= 3 * 6 * 128, found
        assert predicted >= 3 * 6 * 128 * 0.8, predicted
        # The worker's usage told the gateway what it found, request by request: the same
        # count as its own metrics (counted as each request is recorded, after its answer).
        told = await _until(
            gateway, lambda page: total(page, TOLD) - total(before, TOLD) >= 3 * 7 * 128
        )
        assert total(told, CACHED, worker=e) - total(before, CACHED, worker=e) == found
        assert total(told, MISSED) - total(before, MISSED) == 0  # no credit given in vain
        # Other traffic on E evicts it (three prompts of 8 blocks through a cache of 16).
        for seed in (701, 702, 703):
            await _chat(client, worker_e.url, _system(seed), "Something else.")
        await _settled(gateway, e)
        # Now no worker holds it, and the gateway predicts no hit where it routed it three
        # times (its own guess would): the worker that serves it finds none either.
        before, hits = await scrape(gateway), await _hits(workers)
        await _chat(client, gateway, shared, "Once more?")
        after = await scrape(gateway)
        assert total(after, PREDICTED) - total(before, PREDICTED) == 0
        assert await _hits(workers) - hits == 0
        told = await _until(gateway, lambda page: total(page, TOLD) > total(before, TOLD))
        assert total(told, CACHED) - total(before, CACHED) == 0
        assert total(after, "gateway_worker_kv_event_batches_lost_total", worker=e) == 0


async def test_a_restarted_worker_starts_with_an_empty_index(
    gateway: str, worker_e: VllmWorker, ports: tuple[int, int, int], request: pytest.FixtureRequest
) -> None:
    e = _label(worker_e.url)
    async with httpx.AsyncClient(timeout=120) as client:
        await _chat(client, worker_e.url, _system(710), "Hello?")
        await _until(gateway, lambda page: total(page, BLOCKS, worker=e) >= 6)
    worker_e.stop()
    await _until(gateway, lambda page: total(page, "gateway_worker_up", worker=e) == 0)
    with serving(request, _events_worker(*ports)) as again:
        # Back up: its history read again from sequence 0, which starts over: empty, complete.
        page = await _until(gateway, lambda page: total(page, "gateway_worker_up", worker=e) == 1)
        page = await _until(gateway, lambda page: total(page, BLOCKS, worker=e) == 0)
        assert total(page, "gateway_worker_kv_index_complete", worker=e) == 1
        async with httpx.AsyncClient(timeout=120) as client:
            await _chat(client, again.url, _system(711), "Hello again?")
        await _until(gateway, lambda page: total(page, BLOCKS, worker=e) >= 6)

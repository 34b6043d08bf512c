"""The simulated GPU-scale worker: vLLM's bytes and metrics, and an engine that batches."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import pytest

from app.fleet.loadsignals import held_back, parse_load
from bench.sim_worker import Engine, EngineConfig, serve

# Fast steps: 2 ms each, plus 0.5 ms a running sequence, plus 20 us a prefill token.
FAST = EngineConfig(step_a_ms=2.0, step_b_ms=0.5, step_c_us=20.0, tokens_per_word=1.0)


async def _started(config: EngineConfig) -> tuple[str, Engine, asyncio.Server]:
    server, engine = await serve("127.0.0.1", 0, config)
    port = server.sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}", engine, server


async def _stream(
    client: httpx.AsyncClient, words: int = 4, tokens: int = 8, **more: Any
) -> tuple[list[dict[str, Any]], list[float], float]:
    """A streamed chat: its events, each event's arrival, and the request's start."""
    body = {
        "model": FAST.model, "stream": True, "max_tokens": tokens,
        "messages": [{"role": "user", "content": " ".join(["w"] * words)}], **more,
    }  # fmt: skip
    events: list[dict[str, Any]] = []
    arrivals: list[float] = []
    start = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                arrivals.append(time.perf_counter())
                data = line[6:]
                events.append({"done": True} if data == "[DONE]" else json.loads(data))
    return events, arrivals, start


@pytest.fixture
async def sim() -> AsyncIterator[tuple[httpx.AsyncClient, Engine]]:
    url, engine, server = await _started(FAST)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        yield client, engine
    server.close()


async def test_a_stream_has_vllms_shape_and_its_usage(
    sim: tuple[httpx.AsyncClient, Engine],
) -> None:
    client, _ = sim
    events, _, _ = await _stream(client, tokens=5, stream_options={"include_usage": True})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = [e for e in events[1:] if e.get("choices") and e["choices"][0]["delta"].get("content")]
    assert len(tokens) == 5
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"] == {"prompt_tokens": 4, "total_tokens": 9, "completion_tokens": 5}
    assert events[-1] == {"done": True}
    answer = (
        await client.post(
            "/v1/chat/completions",
            json={"model": FAST.model, "messages": [{"role": "user", "content": "a b"}],
                  "max_tokens": 3},
        )
    ).json()  # fmt: skip
    assert answer["usage"]["completion_tokens"] == 3
    assert answer["choices"][0]["finish_reason"] == "length"


async def test_the_step_slows_as_the_batch_grows_and_ttft_with_the_prompt(
    sim: tuple[httpx.AsyncClient, Engine],
) -> None:
    client, _ = sim
    _, alone, _ = await _stream(client, tokens=12)
    gap_alone = (alone[-2] - alone[2]) / 9  # between tokens, the role chunk and [DONE] aside
    batch = await asyncio.gather(*(_stream(client, tokens=12) for _ in range(30)))
    gap_batch = min((a[-2] - a[2]) / 9 for _, a, _ in batch)
    # 2 + 0.5 ms alone; about 2 + 30 x 0.5 = 17 ms with 30 running.
    assert gap_alone < 0.008
    assert gap_batch > 2 * gap_alone
    assert gap_batch > 0.010
    _, short, start_short = await _stream(client, words=10, tokens=2)
    _, long, start_long = await _stream(client, words=3000, tokens=2)  # 60 ms more prefill
    assert (long[0] - start_long) - (short[0] - start_short) > 0.04


async def test_max_num_seqs_bounds_the_batch_and_the_page_says_why_requests_wait() -> None:
    url, engine, server = await _started(replace(FAST, max_num_seqs=2, step_a_ms=20.0))
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        runs = [asyncio.create_task(_stream(client, tokens=10)) for _ in range(5)]
        await asyncio.sleep(0.1)
        page = (await client.get("/metrics")).text
        load = parse_load(page, 0.0)
        assert (load.running, load.waiting, load.capacity_waiting) == (2, 3, 3)
        assert 0 < load.kv_cache_usage < 0.01
        assert load.kv_tokens == FAST.num_gpu_blocks * FAST.block_size
        await asyncio.sleep(0.1)  # steps run: the batch is still the two, the rest held back
        later = parse_load((await client.get("/metrics")).text, 0.1)
        assert held_back(load, later, 1.0, later.running, 0.8)
        assert later.generated is not None
        assert load.generated is not None
        assert later.generated > load.generated
        await asyncio.gather(*runs)
        page = (await client.get("/metrics")).text
    server.close()
    assert parse_load(page, 0.0).running == 0
    assert parse_load(page, 0.0).generated == 5 * 10
    assert 'vllm:request_success_total{model_name="sim-llama-8b",engine="0",' in page
    assert "vllm:time_to_first_token_seconds_count" in page
    assert engine.free_blocks == FAST.num_gpu_blocks


async def test_a_full_kv_cache_preempts_and_every_request_still_completes() -> None:
    # 10 blocks of 16 tokens; three requests of 20 + 40 tokens need 4 blocks each at the end.
    url, engine, server = await _started(replace(FAST, num_gpu_blocks=10))
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        runs = await asyncio.gather(*(_stream(client, words=20, tokens=40) for _ in range(3)))
        page = (await client.get("/metrics")).text
    server.close()
    assert engine.preemptions > 0
    preempted = f"{float(engine.preemptions)}\n"
    assert f'vllm:num_preemptions_total{{model_name="sim-llama-8b",engine="0"}} {preempted}' in page
    for events, _, _ in runs:
        text = "".join(
            e["choices"][0]["delta"].get("content", "") for e in events if e.get("choices")
        )
        assert text.count("tok") == 40  # every token, once, in order, recomputation or not
    assert engine.free_blocks == 10


async def test_priority_scheduling_serves_the_lower_priority_value_first() -> None:
    config = replace(FAST, max_num_seqs=1, scheduling="priority")
    url, _, server = await _started(config)
    finished: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def run(name: str, priority: int, tokens: int) -> None:
            await _stream(client, tokens=tokens, priority=priority)
            finished.append(name)

        first = asyncio.create_task(run("holding", 0, 30))
        await asyncio.sleep(0.02)
        late = asyncio.create_task(run("late", 5, 2))
        await asyncio.sleep(0.01)
        urgent = asyncio.create_task(run("urgent", -1, 2))
        await asyncio.gather(first, late, urgent)
    server.close()
    assert finished == ["holding", "urgent", "late"]


async def test_a_client_that_leaves_frees_its_slot_at_once() -> None:
    url, engine, server = await _started(replace(FAST, max_num_seqs=1))
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        body = {
            "model": FAST.model, "stream": True, "max_tokens": 2000,
            "messages": [{"role": "user", "content": "hi"}],
        }  # fmt: skip
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for _ in response.aiter_lines():
                break  # the first token came: leave
        await asyncio.sleep(0.02)
        assert engine.running == []
        started = time.perf_counter()
        await _stream(client, tokens=3)  # runs at once, not after 2,000 tokens
        assert time.perf_counter() - started < 1.0
    server.close()
    assert engine.free_blocks == FAST.num_gpu_blocks


@dataclass(frozen=True, slots=True)
class _Recorded(EngineConfig):
    """The fast engine, noting every step's batch and prefill tokens."""

    steps: list[tuple[int, int]] = field(default_factory=list)

    def step_s(self, running: int, prefill_tokens: int) -> float:
        self.steps.append((running, prefill_tokens))
        return EngineConfig.step_s(self, running, prefill_tokens)


async def test_a_decode_step_costs_no_prefill_time() -> None:
    config = _Recorded(step_a_ms=2.0, step_b_ms=0.5, step_c_us=20.0, tokens_per_word=1.0)
    url, _, server = await _started(config)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        await asyncio.gather(*(_stream(client, words=100, tokens=6) for _ in range(8)))
    server.close()
    # One step prefills the eight prompts (and makes their first tokens); five decode.
    assert config.steps == [(8, 800)] + [(8, 0)] * 5


async def test_a_request_waits_until_the_kv_cache_has_blocks_for_its_prompt() -> None:
    # 4 blocks of 16 tokens: a 40-token prompt takes 3 (its 10 tokens a 4th), so the second
    # request waits for the first to end.
    url, engine, server = await _started(replace(FAST, num_gpu_blocks=4, step_a_ms=20.0))
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        runs = [asyncio.create_task(_stream(client, words=40, tokens=10)) for _ in range(2)]
        await asyncio.sleep(0.1)
        load = parse_load((await client.get("/metrics")).text, 0.0)
        assert (load.running, load.waiting, load.capacity_waiting) == (1, 1, 1)
        assert load.kv_cache_usage == 0.75
        await asyncio.gather(*runs)
    server.close()
    assert engine.preemptions == 0
    assert engine.free_blocks == 4


async def test_ttft_grows_with_the_requests_queued_ahead() -> None:
    url, _, server = await _started(replace(FAST, max_num_seqs=1))
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        runs = await asyncio.gather(*(_stream(client, tokens=10) for _ in range(4)))
    server.close()
    ttfts = sorted(arrivals[0] - start for _, arrivals, start in runs)
    # Each waits for the ten steps (2.5 ms each) of every request ahead of it.
    assert all(later - earlier > 0.015 for earlier, later in itertools.pairwise(ttfts))


async def test_the_engine_judges_requests_that_send_slo_headers_by_its_own_times(
    sim: tuple[httpx.AsyncClient, Engine],
) -> None:
    client, engine = sim
    body = {"model": FAST.model, "messages": [{"role": "user", "content": "a b"}], "max_tokens": 4}

    async def judged() -> dict[str, float]:
        page = (await client.get("/metrics")).text
        return {
            result: float(line.rsplit(" ", 1)[1])
            for result in ("met", "missed")
            for line in page.splitlines()
            if line.startswith(f'sim_slo_requests_total{{result="{result}"}}')
        }

    await client.post("/v1/chat/completions", json=body)  # no headers: not judged
    assert await judged() == {"met": 0.0, "missed": 0.0}
    # A step takes at least 2 ms: a 0.5 ms first token is out of reach, 10 s is not.
    slow = {"x-slo-ttft-ms": "0.5"}
    await client.post("/v1/chat/completions", json=body, headers=slow)
    await client.post("/v1/chat/completions", json=body, headers={"x-slo-ttft-ms": "10000"})
    tight_pace = {"x-slo-ttft-ms": "10000", "x-slo-tpot-ms": "0.1"}
    await client.post("/v1/chat/completions", json=body, headers=tight_pace)
    assert await judged() == {"met": 1.0, "missed": 2.0}
    bad = await client.post("/v1/chat/completions", json=body, headers={"x-slo-tpot-ms": "x"})
    assert bad.status_code == 400
    assert engine.judged == {"met": 1, "missed": 2}

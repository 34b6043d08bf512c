"""The rest of the OpenAI surface through the gateway, in front of REAL vLLM CPU workers.

Two workers, one gateway: the session's ``tiny-llama`` (chat, Responses API, tokenizer) and
``tiny-embed``, the same model folder served by vLLM's pooling runner (embeddings, score,
rerank, pooling). Driven by the OpenAI SDK where it has the call, plain HTTP elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from tests.servers import running_gateway, settings_for
from tests.test_real_worker import assert_worker_aborted, scrape, total, wait_idle

CHAT_MODEL = "tiny-llama"
EMBED_MODEL = "tiny-embed"


@pytest.fixture(scope="module")
async def gateway_url(vllm_worker_url: str, vllm_pooling_url: str) -> AsyncIterator[str]:
    """The gateway in front of both real workers, browsers at one origin allowed."""
    settings = settings_for(
        f"{vllm_worker_url},{vllm_pooling_url}", cors_origins="https://chat.example.com"
    )
    async with running_gateway(settings) as url:
        yield url


async def test_sdk_embeddings_through_the_gateway_count_prompt_tokens_and_e2e(
    sdk: openai.AsyncOpenAI, gateway_url: str, vllm_pooling_url: str
) -> None:
    before = await scrape(gateway_url)
    result = await sdk.embeddings.create(model=EMBED_MODEL, input=["hello world", "the fox"])
    assert [item.index for item in result.data] == [0, 1]
    assert all(len(item.embedding) == 128 for item in result.data)  # the model's hidden size
    async with httpx.AsyncClient() as client:  # the worker's own answer, for comparison
        direct = (
            await client.post(
                f"{vllm_pooling_url}/v1/embeddings",
                json={"model": EMBED_MODEL, "input": ["hello world", "the fox"]},
            )
        ).json()
    assert [item.embedding for item in result.data] == [d["embedding"] for d in direct["data"]]
    after = await scrape(gateway_url)
    labels = {"model": EMBED_MODEL, "tier": "standard"}

    def grew(name: str, **more: str) -> float:
        return total(after, name, **labels, **more) - total(before, name, **labels, **more)

    assert grew("gateway_requests_total", endpoint="embeddings", outcome="ok") == 1
    assert grew("gateway_prompt_tokens_total") == result.usage.prompt_tokens > 0
    assert grew("gateway_e2e_request_latency_seconds_count") == 1
    assert grew("gateway_time_to_first_token_seconds_count") == 0  # nothing is streamed
    assert grew("gateway_slo_requests_total", result="met") == 1


@pytest.mark.parametrize(
    ("path", "body", "key"),
    [
        ("/v1/score", {"text_1": "hello", "text_2": ["world", "fox"]}, "data"),
        ("/score", {"queries": "hello", "documents": ["world", "fox"]}, "data"),
        ("/v1/rerank", {"query": "hello", "documents": ["world", "fox"]}, "results"),
        ("/v2/rerank", {"query": "hello", "documents": ["world", "fox"], "top_n": 1}, "results"),
        ("/pooling", {"input": "hello world"}, "data"),
    ],
)
async def test_score_rerank_and_pooling_answer_as_the_worker_does(
    gateway_url: str, vllm_pooling_url: str, path: str, body: dict[str, object], key: str
) -> None:
    before = await scrape(gateway_url)
    async with httpx.AsyncClient(timeout=30) as client:
        through = await client.post(f"{gateway_url}{path}", json={"model": EMBED_MODEL, **body})
        direct = await client.post(f"{vllm_pooling_url}{path}", json={"model": EMBED_MODEL, **body})
    assert through.status_code == direct.status_code == 200, through.text
    assert through.json()[key] == direct.json()[key]
    after = await scrape(gateway_url)
    endpoint = {"/v1/score": "score", "/score": "score", "/pooling": "pooling"}.get(path, "rerank")
    requests = "gateway_requests_total"
    assert (
        total(after, requests, endpoint=endpoint, model=EMBED_MODEL, outcome="ok")
        - total(before, requests, endpoint=endpoint, model=EMBED_MODEL, outcome="ok")
        == 1
    )
    prompt = "gateway_prompt_tokens_total"
    assert (
        total(after, prompt, model=EMBED_MODEL) - total(before, prompt, model=EMBED_MODEL)
        == through.json()["usage"]["prompt_tokens"]
    )


async def test_sdk_responses_stream_arrives_event_by_event_and_counts_one_ttft(
    sdk: openai.AsyncOpenAI, gateway_url: str, vllm_worker_url: str
) -> None:
    before = await scrape(gateway_url)
    stream = await sdk.responses.create(
        model=CHAT_MODEL,
        input="Tell me a story.",
        stream=True,
        max_output_tokens=16,
        extra_body={"ignore_eos": True},  # a vLLM extension: passes through the gateway
    )
    events = []
    async for event in stream:
        events.append((time.perf_counter(), event))
    types = [event.type for _, event in events]
    # vLLM 0.32's event sequence: created, in_progress, the item and part added, the deltas,
    # the done events, and response.completed (incomplete_details: max_output_tokens).
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-1] == "response.completed"
    deltas = [(at, e) for at, e in events if e.type == "response.output_text.delta"]
    print(f"\n{len(deltas)} text deltas for 16 tokens")
    # A random-weight model's tokens are often pieces of one character or special tokens,
    # which vLLM sends with a later delta or not at all: 3 deltas for 16 tokens were seen,
    # sampled and greedy alike. Each delta after the first is one ITL observation below.
    assert len(deltas) >= 2
    completed = events[-1][1]
    usage = completed.response.usage  # type: ignore[union-attr]
    assert usage is not None
    after = await scrape(gateway_url)
    labels = {"model": CHAT_MODEL, "tier": "standard"}

    def grew(name: str, **more: str) -> float:
        return total(after, name, **labels, **more) - total(before, name, **labels, **more)

    assert grew("gateway_time_to_first_token_seconds_count") == 1
    assert grew("gateway_inter_token_latency_seconds_count") == len(deltas) - 1
    assert grew("gateway_requests_total", endpoint="responses", outcome="ok") == 1
    assert grew("gateway_prompt_tokens_total") == usage.input_tokens
    assert grew("gateway_completion_tokens_total") == usage.output_tokens == 16
    assert grew("gateway_slo_requests_total") == 1
    await wait_idle(vllm_worker_url, 5)


async def test_responses_events_reach_the_client_one_by_one(
    gateway_url: str, vllm_worker_url: str
) -> None:
    body = {
        "model": CHAT_MODEL,
        "input": "Tell me a story.",
        "stream": True,
        "max_output_tokens": 32,
        "ignore_eos": True,
    }
    reads: list[tuple[float, bytes]] = []
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", f"{gateway_url}/v1/responses", json=body) as response:
            async for data in response.aiter_raw():
                reads.append((time.perf_counter(), data))
    with_delta = [(at, data) for at, data in reads if b"output_text.delta" in data]
    deltas = sum(data.count(b"event: response.output_text.delta\n") for _, data in with_delta)
    # Each delta was handed on as the worker produced it (a few ms apart on this CPU), so the
    # client read them one at a time, over the generation, not in a burst at its end.
    assert deltas >= 24
    assert len(with_delta) >= 0.8 * deltas, [data.count(b"delta\n") for _, data in with_delta]
    assert with_delta[-1][0] - with_delta[0][0] > 0.001 * deltas
    assert all(data.endswith(b"\n\n") for _, data in reads)  # whole events, never split
    await wait_idle(vllm_worker_url, 5)


async def test_sdk_responses_not_streamed(sdk: openai.AsyncOpenAI) -> None:
    response = await sdk.responses.create(model=CHAT_MODEL, input="Say hello.", max_output_tokens=8)
    assert response.output_text
    assert response.usage is not None
    assert response.usage.output_tokens == 8


async def test_tokenize_and_detokenize_round_trip(gateway_url: str) -> None:
    text = "hello world, the quick brown fox"
    async with httpx.AsyncClient(base_url=gateway_url, timeout=30) as client:
        tokenized = await client.post(
            "/tokenize", json={"model": CHAT_MODEL, "prompt": text, "add_special_tokens": False}
        )
        assert tokenized.status_code == 200, tokenized.text
        ids = tokenized.json()["tokens"]
        assert tokenized.json()["count"] == len(ids) > 1
        assert tokenized.json()["max_model_len"] == 1024
        detokenized = await client.post("/detokenize", json={"model": CHAT_MODEL, "tokens": ids})
        assert detokenized.status_code == 200, detokenized.text
        assert detokenized.json()["prompt"] == text
        # The embedding model's tokenizer is served too (the same files).
        r = await client.post("/tokenize", json={"model": EMBED_MODEL, "prompt": text})
        assert r.status_code == 200
        version = (await client.get("/version")).json()
    assert version == {"version": "0.32.0"}


async def test_models_keep_every_field_vllm_sends(
    gateway_url: str, vllm_worker_url: str, vllm_pooling_url: str
) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        through = (await client.get(f"{gateway_url}/v1/models")).json()["data"]
        direct = [
            card
            for url in (vllm_worker_url, vllm_pooling_url)
            for card in (await client.get(f"{url}/v1/models")).json()["data"]
        ]
    assert [card["id"] for card in through] == [EMBED_MODEL, CHAT_MODEL]
    for card in through:
        same = next(c for c in direct if c["id"] == card["id"])
        # The worker's card as it sent it (created and the permission's id are per call).
        assert set(card) == set(same) >= {"max_model_len", "root", "parent", "permission"}
        assert (card["max_model_len"], card["root"], card["parent"]) == (
            same["max_model_len"],
            same["root"],
            same["parent"],
        )


async def test_a_disconnect_mid_responses_stream_stops_the_worker(
    gateway_url: str, vllm_worker_url: str
) -> None:
    """A client that leaves a Responses stream stops the generation on the worker: as
    ``test_client_disconnect_aborts_the_worker_request``, proven from the worker's counters."""
    await wait_idle(vllm_worker_url, 5)
    before, gateway_before = await scrape(vllm_worker_url), await scrape(gateway_url)
    # ~900 tokens that no end-of-sequence token can cut short: seconds of work.
    body = {
        "model": CHAT_MODEL,
        "input": "Go on.",
        "stream": True,
        "max_output_tokens": 900,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", f"{gateway_url}/v1/responses", json=body) as response:
            assert response.status_code == 200
            async for data in response.aiter_raw():
                if b"output_text.delta" in data:
                    break  # the client closes its connection mid-stream
    took = await assert_worker_aborted(vllm_worker_url, before, max_tokens=900)
    gateway = await scrape(gateway_url)
    cancelled = {"endpoint": "responses", "outcome": "client_cancelled"}
    counted = total(gateway, "gateway_requests_total", **cancelled) - total(
        gateway_before, "gateway_requests_total", **cancelled
    )
    assert counted == 1
    print(f"worker idle {took * 1000:.0f} ms after the client went away")


async def test_browser_preflight_gets_the_configured_origin(gateway_url: str) -> None:
    headers = {
        "origin": "https://chat.example.com",
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    async with httpx.AsyncClient(base_url=gateway_url, timeout=10) as client:
        r = await client.options("/v1/embeddings", headers=headers)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://chat.example.com"
        assert r.headers["x-request-id"]
        r = await client.post(
            "/v1/embeddings",
            json={"model": EMBED_MODEL, "input": "x"},
            headers={"origin": "https://chat.example.com"},
        )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://chat.example.com"
    assert "x-request-id" in r.headers["access-control-expose-headers"]

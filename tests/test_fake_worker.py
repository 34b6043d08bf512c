"""The benchmark's fake worker: vLLM's stream shape, max_tokens, usage, pacing and disconnects.

Timing assertions are lower bounds only (the worker never writes early); nothing here fails
because a shared machine was slow.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.fake_worker import FakeWorker, WorkerConfig, token_text
from bench.sse_client import SSEConnection
from bench.worker_http import bound_port

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "fake-model"
CFG = WorkerConfig(ttft_ms=20.0, itl_ms=5.0, tokens=6, model=MODEL)


@pytest.fixture(scope="session")
async def worker() -> AsyncIterator[tuple[FakeWorker, int]]:
    fake = FakeWorker(CFG)
    server = await fake.serve("127.0.0.1", 0)
    try:
        yield fake, bound_port(server)
    finally:
        server.close()
        await server.wait_closed()


async def _raw_exchange(port: int, method: str, path: str, body: Any = None) -> RawResponse:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        payload = b"" if body is None else json.dumps(body).encode()
        writer.write(
            f"{method} {path} HTTP/1.1\r\nhost: test\r\ncontent-length: {len(payload)}\r\n"
            "connection: close\r\n\r\n".encode()
            + payload
        )
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    return RawResponse(data)


class RawResponse:
    """A whole HTTP/1.1 response, de-chunked by hand so that chunk boundaries can be checked."""

    def __init__(self, data: bytes) -> None:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        self.status = int(lines[0].split(" ")[1])
        self.headers = {
            k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])
        }
        self.chunks: list[bytes] = []
        if self.headers.get("transfer-encoding") == "chunked":
            while True:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line, 16)
                if size == 0:
                    break
                self.chunks.append(rest[:size])
                assert rest[size : size + 2] == b"\r\n"
                rest = rest[size + 2 :]
            self.body = b"".join(self.chunks)
        else:
            self.body = rest[: int(self.headers["content-length"])]

    def events(self) -> list[bytes]:
        """Each chunk is exactly one SSE event; returns the ``data:`` payloads."""
        out = []
        for chunk in self.chunks:
            assert chunk.startswith(b"data: ")
            assert chunk.endswith(b"\n\n")
            assert chunk.count(b"\n\n") == 1
            out.append(chunk[len(b"data: ") : -2])
        return out


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "one two three"}], **extra}


async def test_chat_stream_is_shaped_like_vllm(worker: tuple[FakeWorker, int]) -> None:
    _, port = worker
    body = _chat(stream=True, max_tokens=4, stream_options={"include_usage": True})
    resp = await _raw_exchange(port, "POST", "/v1/chat/completions", body)
    assert resp.status == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["transfer-encoding"] == "chunked"
    events = resp.events()
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 1 + 4 + 1  # role, tokens, usage

    role, *tokens, usage = chunks
    assert role["id"].startswith("chatcmpl-")
    assert list(role) == ["id", "object", "created", "model", "choices"]
    assert role["object"] == "chat.completion.chunk"
    assert role["model"] == MODEL
    assert role["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    for i, tok in enumerate(tokens):
        assert tok["id"] == role["id"]
        assert tok["object"] == "chat.completion.chunk"
        (choice,) = tok["choices"]
        assert choice["delta"] == {"content": token_text(i)}
        assert choice["logprobs"] is None
        assert choice["finish_reason"] == ("length" if i == 3 else None)
    assert usage["id"] == role["id"]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 3, "total_tokens": 7, "completion_tokens": 4}


async def test_completions_stream_has_no_role_chunk(worker: tuple[FakeWorker, int]) -> None:
    _, port = worker
    body = {"model": MODEL, "prompt": "a b", "stream": True, "max_tokens": 3}
    resp = await _raw_exchange(port, "POST", "/v1/completions", body)
    events = resp.events()
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 3  # no usage chunk unless asked
    for i, chunk in enumerate(chunks):
        assert chunk["id"].startswith("cmpl-")
        assert chunk["object"] == "text_completion"
        (choice,) = chunk["choices"]
        assert choice["index"] == 0
        assert choice["text"] == token_text(i)
        assert choice["logprobs"] is None
        assert choice["finish_reason"] == ("length" if i == 2 else None)


async def test_tokens_default_and_max_tokens_override(worker: tuple[FakeWorker, int]) -> None:
    _, port = worker
    conn = SSEConnection("127.0.0.1", port)
    try:
        for body, expected in (
            (_chat(stream=True), CFG.tokens),
            (_chat(stream=True, max_tokens=9), 9),
            (_chat(stream=True, max_completion_tokens=2), 2),
            (_chat(stream=True, max_tokens=1), 1),
        ):
            res = await conn.request("POST", "/v1/chat/completions", json.dumps(body).encode())
            assert res.ok, res
            assert len(res.content_times) == expected
            assert res.events == 1 + expected + 1  # role chunk and [DONE]
    finally:
        await conn.close()


async def test_tokens_are_paced_from_the_request(worker: tuple[FakeWorker, int]) -> None:
    _, port = worker
    n = 12
    conn = SSEConnection("127.0.0.1", port)
    try:
        body = json.dumps(_chat(stream=True, max_tokens=n)).encode()
        res = await conn.request("POST", "/v1/chat/completions", body)
    finally:
        await conn.close()
    assert res.ok
    times = res.content_times
    assert len(times) == n
    assert times == sorted(times)
    ttft = res.ttft
    assert ttft is not None
    assert ttft >= CFG.ttft_ms / 1000 * 0.9
    assert times[-1] - times[0] >= (n - 1) * CFG.itl_ms / 1000 * 0.9


async def test_keep_alive_serves_requests_in_turn(worker: tuple[FakeWorker, int]) -> None:
    fake, port = worker
    accepted = fake.stats.connections
    conn = SSEConnection("127.0.0.1", port)
    try:
        first = await conn.request("POST", "/v1/completions", b'{"stream":true,"max_tokens":2}')
        assert conn.connected
        second = await conn.request("GET", "/health")
        third = await conn.request("POST", "/v1/chat/completions", b'{"stream":true}')
        assert conn.connected
    finally:
        await conn.close()
    assert fake.stats.connections == accepted + 1
    assert first.ok
    assert second.status == 200
    assert third.ok
    assert len(third.content_times) == CFG.tokens


async def test_pipelined_requests_are_answered_in_order(worker: tuple[FakeWorker, int]) -> None:
    _, port = worker
    stream = json.dumps(_chat(stream=True, max_tokens=3)).encode()
    whole = json.dumps(_chat(max_tokens=2)).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n%b"
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%b" % (len(stream), stream, len(whole), whole)
        )
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    first_end = data.index(b"0\r\n\r\n") + 5
    first, second = RawResponse(data[:first_end]), RawResponse(data[first_end:])
    assert first.events()[-1] == b"[DONE]"
    assert len(first.events()) == 1 + 3 + 1
    assert second.status == 200
    assert json.loads(second.body)["usage"]["completion_tokens"] == 2


async def test_non_streaming_returns_one_json_with_usage(worker: tuple[FakeWorker, int]) -> None:
    _, port = worker
    resp = await _raw_exchange(port, "POST", "/v1/chat/completions", _chat(max_tokens=3))
    assert resp.status == 200
    assert resp.headers["content-type"] == "application/json"
    data = json.loads(resp.body)
    assert data["object"] == "chat.completion"
    (choice,) = data["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == "".join(token_text(i) for i in range(3))
    assert choice["finish_reason"] == "length"
    assert data["usage"] == {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3}

    resp = await _raw_exchange(port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
    data = json.loads(resp.body)
    assert data["object"] == "text_completion"
    assert data["choices"][0]["text"] == token_text(0) + token_text(1)


async def test_bad_requests_get_vllm_errors(worker: tuple[FakeWorker, int]) -> None:
    _, port = worker
    resp = await _raw_exchange(port, "POST", "/v1/chat/completions", {"model": "other"})
    assert resp.status == 404
    assert json.loads(resp.body)["error"]["type"] == "NotFoundError"
    resp = await _raw_exchange(port, "POST", "/v1/chat/completions", _chat(max_tokens=0))
    assert resp.status == 400
    too_long = _chat(max_tokens=CFG.max_model_len)  # plus the prompt: over the context
    resp = await _raw_exchange(port, "POST", "/v1/chat/completions", too_long)
    assert resp.status == 400
    assert "maximum context length" in json.loads(resp.body)["error"]["message"]
    assert (await _raw_exchange(port, "GET", "/nope")).status == 404


async def test_models_and_health(worker: tuple[FakeWorker, int]) -> None:
    _, port = worker
    assert (await _raw_exchange(port, "GET", "/health")).status == 200
    models = json.loads((await _raw_exchange(port, "GET", "/v1/models")).body)
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == card["root"] == MODEL
    assert card["object"] == "model"
    assert card["owned_by"] == "vllm"
    assert card["parent"] is None
    assert card["max_model_len"] == CFG.max_model_len


def _gauges(text: bytes) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        if family.name == "fake_worker_connections":
            continue
        assert family.type == "gauge"
        for sample in family.samples:
            assert sample.labels == {"model_name": MODEL}
            out[sample.name] = sample.value
    return out


async def _poll(condition: Callable[[], bool]) -> None:
    # A liveness wait, not a timing assertion: only a hung worker takes 10 s. The worker's
    # counters are plain ints (no event to wait on), hence the polling.
    async with asyncio.timeout(10):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


async def test_metrics_count_streams_in_flight() -> None:
    fake = FakeWorker(WorkerConfig(ttft_ms=1, itl_ms=10, model=MODEL))
    server = await fake.serve("127.0.0.1", 0)
    port = bound_port(server)
    try:
        idle = _gauges((await _raw_exchange(port, "GET", "/metrics")).body)
        assert idle == {
            "vllm:num_requests_running": 0.0,
            "vllm:num_requests_waiting": 0.0,
            "vllm:kv_cache_usage_perc": 0.0,
        }
        body = json.dumps(_chat(stream=True, max_tokens=100)).encode()
        conns = [SSEConnection("127.0.0.1", port) for _ in range(2)]
        streams = [asyncio.create_task(c.request("POST", "/v1/completions", body)) for c in conns]
        await _poll(lambda: fake.stats.started == 2)
        busy = _gauges((await _raw_exchange(port, "GET", "/metrics")).body)
        assert busy["vllm:num_requests_running"] == 2.0
        assert busy["vllm:kv_cache_usage_perc"] > 0
        results = await asyncio.gather(*streams)
        for conn in conns:
            await conn.close()
        assert all(r.ok for r in results)
        await _poll(lambda: fake.stats.running == 0)
        after = _gauges((await _raw_exchange(port, "GET", "/metrics")).body)
        assert after["vllm:num_requests_running"] == 0.0
    finally:
        server.close()
        await server.wait_closed()


async def test_client_disconnect_stops_generation() -> None:
    fake = FakeWorker(WorkerConfig(ttft_ms=1, itl_ms=5, model=MODEL))
    server = await fake.serve("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", bound_port(server))
        body = json.dumps(_chat(stream=True, max_tokens=1000)).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n%b"
            % (len(body), body)
        )
        received = b""
        async with asyncio.timeout(10):
            while b'"content":" tok' not in received:
                received += await reader.read(65536)
        assert fake.stats.running == 1
        writer.close()
        await _poll(lambda: fake.stats.running == 0)
        assert fake.stats.cancelled == 1
        assert fake.stats.completed == 0
    finally:
        server.close()
        await server.wait_closed()


async def test_openai_sdk_reads_the_stream(worker: tuple[FakeWorker, int]) -> None:
    _, port = worker
    http = openai.DefaultAsyncHttpxClient(trust_env=False)  # never via a proxy
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", http_client=http
    ) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        text = ""
        usage = None
        finish = []
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish.append(chunk.choices[0].finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage
    assert text == "".join(token_text(i) for i in range(5))
    assert finish[-1] == "length"
    assert usage is not None
    assert usage.completion_tokens == 5

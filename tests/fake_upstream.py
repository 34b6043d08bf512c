"""Scripted workers behind httpx.MockTransport, for failures a real vLLM cannot make on demand."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

MODEL = "fake-model"
Handler = Callable[[httpx.Request, dict[str, Any]], Awaitable[httpx.Response]]


def chunk(content: str | None, *, role: bool = False, finish: str | None = None) -> bytes:
    """One vLLM-shaped chat chunk as an SSE event."""
    delta: dict[str, Any] = {}
    if role:
        delta = {"role": "assistant", "content": ""}
    elif content is not None:
        delta = {"content": content}
    payload = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def usage_chunk(prompt: int, completion: int) -> bytes:
    """The usage-only chunk vLLM sends before [DONE]."""
    payload = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        },
    }
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


class FakeWorker:
    """A worker whose generation endpoint runs ``handler``; it also serves ``/v1/models``."""

    def __init__(self, handler: Handler, cards: list[dict[str, Any]] | None = None) -> None:
        self.handler = handler
        self.cards = cards
        self.requests: list[dict[str, Any]] = []
        self.received: list[tuple[str, bytes]] = []
        """Every request's path and exact body bytes, in order."""
        self.cancelled = asyncio.Event()
        self.healthy = True
        self.running = 0
        self.transport = httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        """Answer one request as a vLLM worker would."""
        if not self.healthy:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/v1/models":
            card = {"id": MODEL, "object": "model", "root": MODEL, "max_model_len": 1024}
            cards = [card] if self.cards is None else self.cards
            return httpx.Response(200, json={"object": "list", "data": cards})
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if request.url.path == "/kv_event_sources":
            return httpx.Response(200, json={})  # publishes no KV cache events
        if request.url.path == "/metrics":
            page = (
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="{MODEL}"}} {self.running}\n'
                "# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0\n'
            )
            return httpx.Response(200, text=page)
        raw = await request.aread()
        self.received.append((request.url.path, raw))
        content_type = request.headers.get("content-type", "")
        body = json.loads(raw) if content_type.startswith("application/json") else {}
        self.requests.append(body)
        try:
            return await self.handler(request, body)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    def sse(self, events: AsyncIterator[bytes]) -> httpx.Response:
        """A streaming response whose generator records being cancelled."""

        async def guarded() -> AsyncGenerator[bytes, None]:
            try:
                async for event in events:
                    yield event
            except (asyncio.CancelledError, GeneratorExit):
                self.cancelled.set()
                raise

        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=WorkerStream(guarded())
        )


class WorkerStream(httpx.AsyncByteStream):
    """A streamed body that stops its generator when the gateway closes the response.

    A real worker sees its connection close; a plain generator behind httpx.MockTransport would
    only notice when it is next pulled, or garbage-collected.
    """

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        self._events = events

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for event in self._events:
            yield event

    async def aclose(self) -> None:
        """The gateway closed the response: the generation stops."""
        await self._events.aclose()


async def tokens(n: int, gap: float = 0.0, usage: bool = True) -> AsyncIterator[bytes]:
    """A complete, well-formed stream of ``n`` tokens."""
    yield chunk(None, role=True)
    for i in range(n):
        if gap:
            await asyncio.sleep(gap)
        yield chunk(f" t{i}", finish="length" if i == n - 1 else None)
    if usage:
        yield usage_chunk(3, n)
    yield DONE


def fleet(workers: dict[str, FakeWorker]) -> httpx.MockTransport:
    """One transport for several fake workers, told apart by ``host:port``."""

    async def handle(request: httpx.Request) -> httpx.Response:
        return await workers[f"{request.url.host}:{request.url.port}"].handle(request)

    return httpx.MockTransport(handle)

"""Scripted workers behind httpx.MockTransport, for failures a real vLLM cannot make on demand."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
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

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[dict[str, Any]] = []
        self.cancelled = asyncio.Event()
        self.transport = httpx.MockTransport(self._handle)

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            card = {"id": MODEL, "object": "model", "root": MODEL, "max_model_len": 1024}
            return httpx.Response(200, json={"object": "list", "data": [card]})
        body = json.loads(await request.aread())
        self.requests.append(body)
        try:
            return await self.handler(request, body)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    def sse(self, events: AsyncIterator[bytes]) -> httpx.Response:
        """A streaming response whose generator records being cancelled."""

        async def guarded() -> AsyncIterator[bytes]:
            try:
                async for event in events:
                    yield event
            except (asyncio.CancelledError, GeneratorExit):
                self.cancelled.set()
                raise

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=guarded())


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

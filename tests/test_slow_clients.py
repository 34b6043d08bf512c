"""Clients that stop reading: their cost, never the worker's (issue 21, finding 1).

Scripted workers (tests/fake_upstream.py): a real vLLM worker cannot be made to stream 32 KB
events without end, and these tests need to see exactly when the gateway cancels each stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import statistics
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.fake_upstream import DONE, FakeWorker, WorkerStream, chunk, tokens
from tests.servers import running_gateway, settings_for

WORKER = "http://fake-worker:8100"
LONG = 100_000
"""``max_tokens`` of a request the scripted worker answers with an endless stream of big events."""
EVENT_TEXT = "x" * 32_768
pytestmark = pytest.mark.asyncio(loop_scope="session")


@dataclass
class LongStream:
    """What the worker saw of one endless stream."""

    sent_bytes: int = 0
    last_event_at: float = 0.0
    cancelled_at: float | None = None


class Streams:
    """A worker answering ``LONG`` requests with 32 KB events every 20 ms, until cancelled, and the
    others with 5 tokens 10 ms apart after 20 ms."""

    def __init__(self) -> None:
        self.long: list[LongStream] = []
        self.all_cancelled = asyncio.Event()
        self.all_started = asyncio.Event()
        self.expected = 0

    async def handle(self, request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if body.get("max_tokens") != LONG:
            await asyncio.sleep(0.02)
            short = tokens(5, gap=0.01)
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=short)
        stream = LongStream()
        self.long.append(stream)
        if len(self.long) >= self.expected:
            self.all_started.set()
        return _sse(self._endless(stream))

    async def _endless(self, stream: LongStream) -> AsyncGenerator[bytes, None]:
        loop = asyncio.get_running_loop()
        try:
            yield chunk(None, role=True)
            for _ in range(5_000):  # 100 s at most
                event = chunk(EVENT_TEXT)
                stream.sent_bytes += len(event)
                stream.last_event_at = loop.time()
                yield event
                await asyncio.sleep(0.02)
            yield DONE
        except (asyncio.CancelledError, GeneratorExit):
            stream.cancelled_at = loop.time()
            if sum(s.cancelled_at is not None for s in self.long) >= self.expected:
                self.all_cancelled.set()
            raise


def _sse(events: AsyncGenerator[bytes, None]) -> httpx.Response:
    # Closing the response stops the generator, as closing a worker's connection would.
    return httpx.Response(
        200, headers={"content-type": "text/event-stream"}, stream=WorkerStream(events)
    )


def _body(max_tokens: int) -> bytes:
    return json.dumps(
        {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
         "stream": True, "max_tokens": max_tokens}
    ).encode()  # fmt: skip


async def _non_reading_client(
    url: str, headers: dict[str, str] | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that sends a long streaming request and then reads nothing.

    Its receive buffer is small, so that what fills up is the gateway's side, which is what the
    test measures.
    """
    port = int(url.rsplit(":", 1)[1])
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    body = _body(LONG)
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    writer.write(
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}\r\n".encode()
        + body
    )
    await writer.drain()
    return reader, writer


def _metric(metrics: str, prefix: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(prefix)
    )


async def _normal_clients(client: httpx.AsyncClient, until: asyncio.Event) -> list[float]:
    """Eight clients streaming 5-token answers back to back until ``until``: their TTFTs."""
    ttfts: list[float] = []
    loop = asyncio.get_running_loop()

    async def one(client: httpx.AsyncClient) -> None:
        while not until.is_set():
            sent = loop.time()
            first = None
            async with client.stream("POST", "/v1/chat/completions", content=_body(20)) as r:
                assert r.status_code == 200
                async for data in r.aiter_raw():
                    if first is None and b'"content":" t' in data:
                        first = loop.time() - sent
            assert first is not None
            ttfts.append(first)

    await asyncio.gather(*(one(client) for _ in range(8)))
    return ttfts


async def test_non_reading_clients_are_cut_and_the_worker_is_not_blamed() -> None:
    streams = Streams()
    streams.expected = 20
    worker = FakeWorker(streams.handle)
    stall = 2.0
    # The idle timeout is long enough to show which timeout ended the stalled streams.
    settings = settings_for(WORKER, client_stall_timeout_s=stall, idle_timeout_s=5.0)
    async with (
        running_gateway(settings, worker.transport) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        # The same clients alone first: what this (shared) machine gives them.
        alone = asyncio.Event()
        asyncio.get_running_loop().call_later(1.5, alone.set)
        baseline = await _normal_clients(client, alone)
        normal = asyncio.create_task(_normal_clients(client, streams.all_cancelled))
        stalled = []
        for _ in range(20):  # over a second, as clients come: not all in one instant
            stalled.append(await _non_reading_client(url))
            await asyncio.sleep(0.05)
        try:
            await asyncio.wait_for(streams.all_cancelled.wait(), 60)
        finally:
            ttfts = await normal
        await asyncio.sleep(0.2)
        metrics = (await client.get("/metrics")).text
        ready = await client.get("/readyz")
        for _, writer in stalled:
            writer.close()
    # The slow readers' streams were cancelled at the worker within the stall timeout (+1 s)
    # of the gateway's last read from it: when its send to the client started to block.
    blocked = [s.cancelled_at - s.last_event_at for s in streams.long if s.cancelled_at]
    buffered = [s.sent_bytes for s in streams.long]
    print(
        f"\nblocked before the cut: max {max(blocked):.2f} s; bytes the gateway took per stalled "
        f"stream: min {min(buffered)}, median {statistics.median(buffered):.0f}, "
        f"max {max(buffered)}; normal TTFT p50 / p99 alone {_ms(baseline)}, beside the stalled "
        f"{_ms(ttfts)}"
    )
    assert len(blocked) == 20
    assert max(blocked) < stall + 1.0
    assert min(blocked) >= stall * 0.9
    # What a stalled stream holds is bounded by the server's and the kernel's buffers: 64 KiB
    # in uvicorn's transport and the gateway's socket send buffer (2 x 128 KiB), plus an event.
    assert max(buffered) < 512 * 1024
    assert len(ttfts) >= 100
    # The 100 ms; on a machine too loaded to give even the clients alone that, no
    # worse than half as much again as they had alone.
    assert _p99(ttfts) < max(0.1, 1.5 * _p99(baseline))
    assert 'gateway_worker_ejections_total{worker="fake-worker:8100"} 0.0' in metrics
    assert 'gateway_worker_up{worker="fake-worker:8100"} 1.0' in metrics
    assert ready.status_code == 200
    served = len(baseline) + len(ttfts)
    assert _metric(metrics, 'gateway_requests_total{endpoint="chat"') == 20 + served
    assert (
        _metric(metrics, 'gateway_requests_total{endpoint="chat",model="fake-model",outcome="ok"')
        == served
    )
    stalled_count = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("gateway_requests_total{") and 'outcome="client_stalled"' in line
    )
    assert stalled_count == 20
    assert _metric(metrics, "gateway_in_flight_requests{") == 0
    assert _metric(metrics, "gateway_worker_in_flight_requests{") == 0


async def test_a_non_reading_client_holds_its_keys_concurrency_until_it_is_cut() -> None:
    streams = Streams()
    streams.expected = 2
    worker = FakeWorker(streams.handle)
    key = "sk-slow-reader"
    digest = hashlib.sha256(key.encode()).hexdigest()
    spec = {"sha256": digest, "name": "slow", "max_concurrency": 2}
    stall = 1.0
    settings = settings_for(
        WORKER, client_stall_timeout_s=stall, idle_timeout_s=5.0, api_keys=[spec]
    )
    auth = {"authorization": f"Bearer {key}"}
    async with running_gateway(settings, worker.transport) as url:
        stalled = [await _non_reading_client(url, auth) for _ in range(2)]
        async with httpx.AsyncClient(base_url=url, headers=auth, timeout=30) as client:
            await asyncio.wait_for(streams.all_started.wait(), 10)
            # Both of the key's slots are held by streams nobody reads: a third request is the
            # key's own 429, not a worker's or the fleet's problem.
            refused = await client.post("/v1/chat/completions", content=_body(5))
            loop = asyncio.get_running_loop()
            give_up = loop.time() + 15
            while loop.time() < give_up:
                ok = await client.post("/v1/chat/completions", content=_body(5))
                if ok.status_code != 429:
                    break
                await asyncio.sleep(0.05)
            freed_at = loop.time()
        for _, writer in stalled:
            writer.close()
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "key_quota"
    # The stall timeout's cut gave the key its slots back, soon after the streams blocked.
    assert ok.status_code == 200
    assert freed_at - max(s.last_event_at for s in streams.long) < stall + 1.0


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.1f} / {_p99(values) * 1000:.1f} ms ({len(values)})"


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]

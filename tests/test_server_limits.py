"""The server's limits on what clients hold and send (issue 21, findings 2 and 3).

Header and body deadlines, header size and count, keep-alive and the connection cap, all through
the server the gateway runs in production (app.http.server), against a scripted worker.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.fake_upstream import FakeWorker
from tests.servers import running_gateway, settings_for
from tests.test_gateway_fake import _ok

WORKER = "http://fake-worker:8100"
pytestmark = pytest.mark.asyncio(loop_scope="session")


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


class RawResponse:
    """A whole HTTP/1.1 response read until the server closed the connection."""

    def __init__(self, data: bytes) -> None:
        head, _, self.body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split(" ")[1]) if lines[0] else 0
        self.headers = {
            k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])
        }

    def error(self) -> dict[str, Any]:
        """The OpenAI error object of the body."""
        error: dict[str, Any] = json.loads(self.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return error


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    data = b""
    while chunk := await reader.read(65536):
        data += chunk
    return data


async def test_slowloris_connections_are_closed_by_the_header_timeout() -> None:
    timeout = 1.0
    settings = settings_for(WORKER, header_timeout_s=timeout)
    head = b"GET /v1/models HTTP/1.1\r\nhost: gw\r\nx-slow: " + b"a" * 100 + b"\r\n\r\n"
    async with running_gateway(settings, FakeWorker(_ok).transport) as url:
        loop = asyncio.get_running_loop()

        async def slowloris() -> tuple[float, RawResponse]:
            reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
            started = loop.time()

            async def trickle() -> None:
                for byte in head:  # one byte every 0.5 s: the head would take a minute
                    writer.write(bytes([byte]))
                    await asyncio.sleep(0.5)

            sender = asyncio.create_task(trickle())
            try:
                data = await asyncio.wait_for(_read_all(reader), timeout + 5)
            finally:
                sender.cancel()
                writer.close()
            return loop.time() - started, RawResponse(data)

        results = await asyncio.gather(*(slowloris() for _ in range(300)))
        async with httpx.AsyncClient(base_url=url) as client:
            healthy = await client.get("/v1/models")
    took = [t for t, _ in results]
    print(f"\n300 slowloris connections closed after {min(took):.2f}-{max(took):.2f} s")
    assert max(took) < timeout + 1.0
    assert min(took) >= timeout * 0.9
    for _, response in results:
        assert response.status == 408
        assert response.error()["code"] == "request_timeout"
        assert response.headers["connection"] == "close"
        assert response.headers["x-request-id"]
    assert healthy.status_code == 200


async def test_a_connection_that_sends_nothing_is_closed_silently() -> None:
    settings = settings_for(WORKER, header_timeout_s=0.5)
    async with running_gateway(settings, FakeWorker(_ok).transport) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        data = await asyncio.wait_for(_read_all(reader), 3)
        writer.close()
    assert data == b""


async def test_a_one_megabyte_header_gets_431_within_100_ms() -> None:
    async with running_gateway(settings_for(WORKER), FakeWorker(_ok).transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            await client.get("/healthz")  # the connection is open: time the header alone
            loop = asyncio.get_running_loop()
            sent = loop.time()
            r = await client.get("/healthz", headers={"x-big": "a" * 1_000_000})
            took = loop.time() - sent
            after = await client.get("/healthz")
    print(f"\n1 MB header: {r.status_code} after {took * 1000:.1f} ms")
    assert r.status_code == 431
    assert took < 0.1
    error = r.json()["error"]
    assert error["code"] == "request_header_fields_too_large"
    assert set(error) == {"message", "type", "param", "code"}
    assert r.headers["x-request-id"]
    assert r.headers["connection"] == "close"
    assert after.status_code == 200


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({f"x-h{i}": "v" for i in range(10_000)}, 431),  # 10,000 headers: over the bytes too
        ({f"x-h{i}": "v" for i in range(30)}, 431),  # few bytes, over the count
        ({f"x-h{i}": "v" for i in range(10)}, 200),
        ({"x-big": "b" * 3000}, 431),
        ({"x-big": "b" * 1000}, 200),
    ],
)
async def test_header_count_and_size_are_bounded(headers: dict[str, str], status: int) -> None:
    settings = settings_for(WORKER, max_headers=20, max_header_bytes=2048)
    async with running_gateway(settings, FakeWorker(_ok).transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.get("/healthz", headers=headers)
    assert r.status_code == status
    if status == 431:
        assert r.json()["error"]["code"] == "request_header_fields_too_large"


async def test_connections_beyond_the_cap_get_a_fast_503() -> None:
    cap = 8
    settings = settings_for(WORKER, max_connections=cap)
    async with running_gateway(settings, FakeWorker(_ok).transport) as url:
        held = [await asyncio.open_connection("127.0.0.1", _port(url)) for _ in range(cap)]
        await asyncio.sleep(0.1)
        async with httpx.AsyncClient(base_url=url) as client:
            loop = asyncio.get_running_loop()
            sent = loop.time()
            refused = await client.post(
                "/v1/chat/completions", json={"model": "fake-model", "messages": []}
            )
            took = loop.time() - sent
            for _, writer in held:
                writer.close()
            await asyncio.sleep(0.1)
            served = await client.get("/v1/models")
            metrics = (await client.get("/metrics")).text
    print(f"\nover the cap: {refused.status_code} after {took * 1000:.1f} ms")
    assert refused.status_code == 503
    assert took < 0.1
    error = refused.json()["error"]
    assert error["code"] == "gateway_saturated"
    assert set(error) == {"message", "type", "param", "code"}
    assert refused.headers["retry-after"] == "1"
    assert refused.headers["connection"] == "close"
    assert refused.headers["x-request-id"]
    assert served.status_code == 200
    assert 'gateway_saturated_total{resource="client_connections"} 1.0' in metrics


async def test_a_slow_body_gets_408_and_the_connection_is_closed() -> None:
    worker = FakeWorker(_ok)
    settings = settings_for(WORKER, body_timeout_s=0.5)
    async with running_gateway(settings, worker.transport) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"model": '
        )
        loop = asyncio.get_running_loop()
        sent = loop.time()
        response = RawResponse(await asyncio.wait_for(_read_all(reader), 5))
        took = loop.time() - sent
        writer.close()
    assert response.status == 408
    assert response.error()["code"] == "request_timeout"
    assert response.headers["connection"] == "close"
    assert 0.45 < took < 1.5
    assert worker.requests == []


async def test_an_idle_keep_alive_connection_is_closed_after_its_timeout() -> None:
    settings = settings_for(WORKER, keep_alive_timeout_s=1)
    async with running_gateway(settings, FakeWorker(_ok).transport) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")
        loop = asyncio.get_running_loop()
        sent = loop.time()
        data = await asyncio.wait_for(_read_all(reader), 5)
        took = loop.time() - sent
        writer.close()
    assert data.startswith(b"HTTP/1.1 200")
    assert 0.9 < took < 2.0

"""The pool's probes over the gateway's own HTTP/1.1 client, against real sockets on loopback.

Each scripted worker answers a probe with the bytes a test gives it, so that what the pool reads
(an ``httpx.Response``, or the ``httpx.HTTPError`` it catches) is checked for every way a worker
answers: whole, with an error status, late, not at all, or with a broken head.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import httpx
import pytest

from app.fleet.probes import Prober
from app.fleet.wire import WireClient
from app.settings import WorkerSpec
from tests.servers import free_port

Script = Callable[[bytes], bytes | None]
"""The raw answer to one request's head (None: answer nothing, keep the connection open)."""


class ScriptedWorker:
    """A loopback server answering every request with what ``script`` makes of its head."""

    def __init__(self, script: Script, close: bool) -> None:
        self.script = script
        self.close = close
        """Close the connection after each answer."""
        self.heads: list[bytes] = []
        self.connections = 0
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                answer = self.script(head)
                if answer is None:
                    await reader.read()  # until the client gives up and closes
                    return
                writer.write(answer)
                await writer.drain()
                if self.close:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


Serve = Callable[..., Awaitable[ScriptedWorker]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[asyncio.Server] = []

    async def start(script: Script, close: bool = False) -> ScriptedWorker:
        worker = ScriptedWorker(script, close)
        server = await asyncio.start_server(worker.handle, "127.0.0.1", 0)
        worker.port = server.sockets[0].getsockname()[1]
        servers.append(server)
        return worker

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def prober() -> Iterator[Prober]:
    """A prober whose kept connections are closed after the test (their servers' too)."""
    wire = WireClient(1.0)
    yield Prober(wire)
    wire.close()


def _ok(body: bytes, status: bytes = b"200 OK") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)


def _spec(port: int, api_key: str | None = None) -> WorkerSpec:
    return WorkerSpec.model_validate({"url": f"http://127.0.0.1:{port}", "api_key": api_key})


async def test_a_probe_reads_the_whole_answer_and_keeps_its_connection(serve: Serve) -> None:
    worker = await serve(lambda head: _ok(b'{"data": []}'))
    wire = WireClient(1.0)
    prober = Prober(wire)
    for _ in range(3):
        response = await prober.get(_spec(worker.port, "sk-worker"), "/v1/models", 1.0)
        assert response.status_code == 200
        assert response.json() == {"data": []}
    assert worker.connections == 1  # kept alive between probes
    assert worker.heads[0].startswith(b"GET /v1/models HTTP/1.1\r\n")
    assert b"authorization: Bearer sk-worker\r\n" in worker.heads[0]
    assert wire.idle_connections() == 1
    wire.close()


@pytest.mark.parametrize("status", [b"503 Service Unavailable", b"404 Not Found", b"302 Found"])
async def test_a_status_other_than_2xx_raises_httpx_status_error(
    serve: Serve, prober: Prober, status: bytes
) -> None:
    worker = await serve(lambda head: _ok(b"not ready", status))
    with pytest.raises(httpx.HTTPStatusError) as caught:
        await prober.get(_spec(worker.port), "/health", 1.0)
    assert caught.value.response.status_code == int(status[:3])
    # The request is made only for a failure: it still names the probe.
    assert str(caught.value.request.url) == f"http://127.0.0.1:{worker.port}/health"


async def test_a_worker_that_never_answers_times_out_as_a_read(serve: Serve) -> None:
    worker = await serve(lambda head: None)
    with pytest.raises(httpx.ReadTimeout) as caught:
        await Prober(WireClient(1.0)).get(_spec(worker.port), "/health", 0.2)
    assert str(caught.value.request.url) == f"http://127.0.0.1:{worker.port}/health"


async def test_a_refused_connection_is_a_connect_error() -> None:
    with pytest.raises(httpx.ConnectError):
        await Prober(WireClient(1.0)).get(_spec(free_port()), "/health", 1.0)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nok\r\n0\r\n\r\n",
        b"NOT HTTP AT ALL\r\n\r\n",
    ],
    ids=["two content-lengths", "cut short", "bad chunk size", "not http"],
)
async def test_a_broken_or_cut_answer_is_a_protocol_error(serve: Serve, answer: bytes) -> None:
    worker = await serve(lambda head: answer, close=True)
    with pytest.raises(httpx.RemoteProtocolError):
        await Prober(WireClient(1.0)).get(_spec(worker.port), "/metrics", 1.0)


async def test_a_worker_that_stops_mid_answer_times_out_as_a_read(serve: Serve) -> None:
    worker = await serve(lambda head: b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort")
    with pytest.raises(httpx.ReadTimeout):
        await Prober(WireClient(1.0)).get(_spec(worker.port), "/metrics", 0.2)

"""The relay's own HTTP/1.1 client (``app/fleet/wire.py``) against workers on real sockets.

Each worker here is a raw asyncio server that writes scripted bytes, so that what the client
does with every kind of response, good or malformed, is seen on a real connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import uvloop

from app.fleet.wire import (
    ConnectFailed,
    ConnectionClosed,
    ConnectTimeout,
    ProtocolError,
    WireClient,
)
from tests.garbage import saved_garbage

REQUEST = b"POST /v1/x HTTP/1.1\r\nhost: w\r\ncontent-length: 2\r\n\r\n{}"
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def worker(serve: Serve) -> AsyncIterator[tuple[int, list[int]]]:
    """A raw worker on a free port; yields the port and the count of connections it accepted."""
    accepted: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await serve(reader, writer)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], accepted
    finally:
        server.close()


async def _request(client: WireClient, port: int) -> bytes:
    response = await client.request("127.0.0.1", port, False, lambda: [REQUEST])
    try:
        return await response.read()
    finally:
        response.close()


async def _read_request(reader: asyncio.StreamReader) -> None:
    await reader.readuntil(b"\r\n\r\n")
    await reader.readexactly(2)


async def _answer_all(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        await _read_request(reader)
        writer.write(OK)
        await writer.drain()


async def test_a_connection_is_kept_for_the_next_request_and_closed_when_idle() -> None:
    client = WireClient(2.0, keepalive_s=0.2)
    async with worker(_answer_all) as (port, accepted):
        assert await _request(client, port) == b"{}"
        assert await _request(client, port) == b"{}"
        assert accepted == [1]
        assert client.idle_connections() == 1
        await asyncio.sleep(0.4)  # past the keep-alive: closed by the client
        assert client.idle_connections() == 0
        assert await _request(client, port) == b"{}"
        assert accepted == [1, 1]
    client.close()


async def test_a_kept_connection_is_closed_a_keep_alive_after_its_last_use_not_its_first() -> None:
    loop = asyncio.get_running_loop()
    closed: asyncio.Future[float] = loop.create_future()

    async def answer_then_note_the_close(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            await _answer_all(reader, writer)
        finally:
            closed.set_result(loop.time())

    client = WireClient(2.0, keepalive_s=0.3)
    async with worker(answer_then_note_the_close) as (port, accepted):
        start = last_use = loop.time()
        while last_use - start < 0.5:  # in use past the first keep-alive's end
            assert await _request(client, port) == b"{}"
            last_use = loop.time()
            await asyncio.sleep(0.02)
        assert accepted == [1]
        await asyncio.sleep(0.15)  # idle, within the keep-alive since its last use
        assert client.idle_connections() == 1
        assert await asyncio.wait_for(closed, 2.0) - last_use >= 0.29  # once idle that long
        assert client.idle_connections() == 0
    client.close()


async def test_a_closed_connection_is_freed_with_its_last_reference_not_by_the_collector() -> None:
    with saved_garbage() as garbage:
        client = WireClient(2.0, keepalive_s=0.05)
        async with worker(_answer_all) as (port, _):
            for _ in range(3):
                assert await _request(client, port) == b"{}"
                await asyncio.sleep(0.15)  # past the keep-alive: closed by the client
        client.close()
    assert [o for o in garbage if type(o).__name__ == "_Connection"] == []


async def test_a_kept_connection_the_worker_closed_is_replaced_once_unseen() -> None:
    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(OK)
        await writer.drain()
        # Closes only once the next request is on its way: as a keep-alive timeout racing it.
        await reader.read(1)

    client = WireClient(2.0)
    async with worker(answer_once) as (port, accepted):
        assert await _request(client, port) == b"{}"
        assert await _request(client, port) == b"{}"  # sent again on a new connection
        assert accepted == [1, 1]
    client.close()


async def test_a_body_read_in_part_closes_its_connection() -> None:
    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n")
        await writer.drain()
        await reader.read(1)  # until the client goes
        closed.set()

    closed = asyncio.Event()
    client = WireClient(2.0)
    async with worker(stream) as (port, _):
        response = await client.request("127.0.0.1", port, False, lambda: [REQUEST])
        pieces: list[bytes] = []
        first = asyncio.get_running_loop().create_future()

        def sink(piece: bytes) -> Awaitable[None]:
            pieces.append(piece)
            return first

        assert await response.push(sink) is first
        response.close()  # as when the client disconnects: the worker sees the close
        await asyncio.wait_for(closed.wait(), 2)
    assert pieces == [b"ab"]
    assert client.idle_connections() == 0
    client.close()


@pytest.mark.parametrize(
    "head",
    [
        b"content-length: 2\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        b"content-length: 2\r\ncontent-length: 2\r\n\r\n{}",
        b"transfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        b"x-a: 1\r\n folded\r\ncontent-length: 2\r\n\r\n{}",
        b"x-a: 1\x002\r\ncontent-length: 2\r\n\r\n{}",
        b"x-big: " + b"a" * 70_000 + b"\r\ncontent-length: 2\r\n\r\n{}",
    ],
    ids=["cl-and-te", "two-cl", "bad-chunk-size", "obs-fold", "nul", "huge-head"],
)
async def test_a_malformed_response_is_the_workers_protocol_error(head: bytes) -> None:
    async def malformed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + head)
        await writer.drain()
        await reader.read(1)

    client = WireClient(2.0)
    async with worker(malformed) as (port, _):
        with pytest.raises(ProtocolError):
            await asyncio.wait_for(_request(client, port), 2)
        assert client.idle_connections() == 0
    client.close()


async def test_a_connection_dropped_before_the_answer_is_closed() -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.transport.abort()

    client = WireClient(2.0)
    async with worker(drop) as (port, _):
        with pytest.raises(ConnectionClosed):
            await _request(client, port)
    client.close()


async def test_a_body_ended_by_the_connection_is_whole() -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it")
        await writer.drain()

    client = WireClient(2.0)
    async with worker(until_close) as (port, _):
        assert await _request(client, port) == b"all of it"
        assert client.idle_connections() == 0
    client.close()


async def test_a_refused_connect_and_a_slow_one_are_told_apart() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(ConnectFailed) as refused:
            await _request(WireClient(2.0), port)
    cause = refused.value.__cause__
    assert isinstance(cause, OSError)
    assert cause.errno == errno.ECONNREFUSED

    async def never(*args: object) -> tuple[asyncio.BaseTransport, asyncio.Protocol]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    with pytest.raises(ConnectTimeout):
        await _request(WireClient(0.05, connector=never), 1)


async def test_a_large_upload_is_written_as_the_worker_takes_it() -> None:
    size = 8 * 1024 * 1024
    got = asyncio.Event()

    async def slow_reader(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(0.2)  # the client's writes back up meanwhile
        await reader.readexactly(size)
        got.set()
        writer.write(OK)
        await writer.drain()

    head = b"POST /v1/x HTTP/1.1\r\nhost: w\r\ncontent-length: %d\r\n\r\n" % size
    pieces = [b"x" * (1024 * 1024)] * 8
    client = WireClient(2.0)
    async with worker(slow_reader) as (port, _):
        response = await client.request("127.0.0.1", port, False, lambda: [head, *pieces])
        assert got.is_set()
        assert await response.read() == b"{}"
        response.close()
    client.close()


def test_the_client_runs_on_uvloop_as_in_production() -> None:
    # uvloop's transports are not asyncio.Transport subclasses, and its callbacks run their own
    # way: the gateway runs there, so the client's reuse, chunking and strictness are seen there.
    events = [b'data: {"n":%d}\n\n' % i for i in range(3)]

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in (b"%x\r\n%s\r\n" % (len(e), e) for e in events):
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + answer * 2)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async def malformed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        await reader.read(1)

    async def scenario() -> None:
        client = WireClient(2.0)
        async with worker(stream) as (port, accepted):
            for event in events:
                response = await client.request("127.0.0.1", port, False, lambda: [REQUEST])
                pieces: list[bytes] = []
                assert await response.push(pieces.append) is None
                response.close()
                assert pieces == [event, event]  # two chunks in one write, still two
            assert accepted == [1]
        async with worker(malformed) as (port, _):
            with pytest.raises(ProtocolError):
                await _request(client, port)
        client.close()

    uvloop.run(scenario())

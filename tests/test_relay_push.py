"""Events relayed in the worker connection's own callback: no task wakes up per event.

The relay's client pushes each chunk of a body to the relay as its parser reads it
(:meth:`app.fleet.wire.Response.push`), and the relay sends it with the server's ``send`` run up to
its first wait (:func:`app.http.front.send_now`). These tests hold both to what a task-driven read
and an awaited send would have done: the same pieces in the same order, errors raised as the
client's, a send that must wait finished later, a cancellation delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

import pytest
from starlette.types import Message

from app.fleet.wire import ConnectionClosed, Response, WireClient
from app.http.writer import send_now

EVENTS = [b'data: {"n":%d}\n\n' % i for i in range(6)]


class PacedWorker:
    """A worker on a real socket: the response's head, then its chunks a few ms apart.

    Two of them go out in one write, as they reach a relay that fell behind. With ``dies`` the
    connection drops after the third chunk, halfway through the fourth.
    """

    def __init__(self, dies: bool = False) -> None:
        self.dies = dies
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            await writer.drain()
            chunks = [b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS]
            for i, write in enumerate([chunks[0], chunks[1], chunks[2] + chunks[3], *chunks[4:]]):
                await asyncio.sleep(0.01)
                if self.dies and i == 3:
                    writer.write(chunks[4][:9])
                    await writer.drain()
                    writer.transport.abort()
                    return
                writer.write(write)
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()


REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nhost: w\r\ncontent-length: 2\r\n\r\n{}"


async def _response(client: WireClient, port: int) -> Response:
    return await client.request("127.0.0.1", port, False, lambda: [REQUEST])


async def _pushed(port: int, sink_result: dict[int, Awaitable[None]] | None = None) -> list[bytes]:
    """The pieces a sink was handed, asserting each came outside any task."""
    pieces: list[bytes] = []
    pending_at = sink_result or {}

    def sink(data: bytes) -> Awaitable[None] | None:
        assert asyncio.current_task() is None, "pushed from a task, not the network callback"
        pieces.append(data)
        return pending_at.get(len(pieces))

    client = WireClient(2.0)
    response = await _response(client, port)
    try:
        while (pending := await response.push(sink)) is not None:
            await pending
    finally:
        response.close()
        client.close()
    return pieces


async def test_each_chunk_is_pushed_by_itself_in_the_network_callback() -> None:
    async with PacedWorker() as port:
        pieces = await _pushed(port)
    assert pieces == EVENTS  # two chunks read together are still handed on one by one


async def test_a_sink_that_must_wait_stops_the_push_until_it_was_awaited() -> None:
    waited: list[int] = []

    async def later() -> None:
        await asyncio.sleep(0.05)  # the worker's next chunks arrive meanwhile, and wait
        waited.append(1)

    async with PacedWorker() as port:
        pieces = await _pushed(port, {2: later()})
    assert waited == [1]
    assert pieces == EVENTS  # nothing lost, nothing reordered


async def test_a_connection_dropped_mid_body_raises_the_clients_error() -> None:
    async with PacedWorker(dies=True) as port:
        with pytest.raises(ConnectionClosed):
            await _pushed(port)


async def test_a_fault_of_the_sink_is_raised_to_the_pusher_not_to_the_parser() -> None:
    client = WireClient(2.0)
    async with PacedWorker() as port:
        response = await _response(client, port)

        def sink(data: bytes) -> None:
            raise ZeroDivisionError

        try:
            with pytest.raises(ZeroDivisionError):
                await response.push(sink)
        finally:
            response.close()
            client.close()


async def test_send_now_finishes_a_send_that_does_not_wait() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    assert send_now(send, {"type": "a"}) is None
    assert sent == [{"type": "a"}]


async def test_send_now_leaves_a_waiting_send_to_be_finished_later() -> None:
    writable = asyncio.Event()
    sent: list[Message] = []

    async def send(message: Message) -> None:
        await writable.wait()  # uvicorn's send, while the client's buffer is full
        sent.append(message)

    pending = send_now(send, {"type": "a"})
    assert pending is not None
    assert sent == []
    finish = asyncio.ensure_future(pending)
    await asyncio.sleep(0.01)
    assert sent == []
    writable.set()
    await asyncio.wait_for(finish, 1)
    assert sent == [{"type": "a"}]


async def test_a_waiting_send_sees_the_cancellation_of_the_task_finishing_it() -> None:
    cleaned: list[str] = []

    async def send(message: Message) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append(message["type"])

    pending = send_now(send, {"type": "a"})
    assert pending is not None
    finish = asyncio.ensure_future(pending)
    await asyncio.sleep(0.01)
    finish.cancel()
    with pytest.raises(asyncio.CancelledError):
        await finish
    assert cleaned == ["a"]

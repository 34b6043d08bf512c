"""Events relayed in the worker connection's own callback: no task wakes up per event.

The worker transport pushes each piece of a body to the relay as aiohttp's parser reads it
(:meth:`app.upstream._Chunks.push`), and the relay sends it with the server's ``send`` run up to
its first wait (:func:`app.relay.send_now`). These tests hold both to what a task-driven read
and an awaited send would have done: the same pieces in the same order, errors raised as
httpx's, a send that must wait finished later, a cancellation delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

import aiohttp
import httpx
import pytest
from starlette.types import Message

from app.relay import send_now
from app.upstream import _PushingWaiter, chunk_pusher, chunk_reader, make_client
from tests.servers import settings_for

EVENTS = [b'data: {"n":%d}\n\n' % i for i in range(6)]


class PacedWorker:
    """A worker on a real socket: the response's head, then its chunks a few ms apart.

    Two of them go out in one write, as they reach a relay that fell behind. With ``dies`` the
    connection drops after the third chunk, halfway through the fourth.
    """

    def __init__(self, dies: bool = False) -> None:
        self.dies = dies
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1/chat/completions"

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


async def _pushed(url: str, sink_result: dict[int, Awaitable[None]] | None = None) -> list[bytes]:
    """The pieces a sink was handed, asserting each came outside any task."""
    pieces: list[bytes] = []
    pending_at = sink_result or {}

    def sink(data: bytes) -> Awaitable[None] | None:
        assert asyncio.current_task() is None, "pushed from a task, not the network callback"
        pieces.append(data)
        return pending_at.get(len(pieces))

    async with (
        make_client(settings_for("http://unused:1")) as client,
        client.stream("POST", url, content=b"{}") as response,
    ):
        pusher = chunk_pusher(response)
        assert pusher is not None, "the worker transport's bodies can be pushed"
        read = chunk_reader(response)
        while True:
            if pusher.ready:
                data = await read()
                if not data:
                    break
                pieces.append(data)
                continue
            pending = await pusher.push(sink)
            if pending is None:
                break
            await pending
    return pieces


async def test_each_chunk_is_pushed_by_itself_in_the_network_callback() -> None:
    async with PacedWorker() as url:
        pieces = await _pushed(url)
    assert pieces == EVENTS  # two chunks read together are still handed on one by one


async def test_a_sink_that_must_wait_stops_the_push_until_it_was_awaited() -> None:
    waited: list[int] = []

    async def later() -> None:
        await asyncio.sleep(0.05)  # the worker's next chunks arrive meanwhile, and wait
        waited.append(1)

    async with PacedWorker() as url:
        pieces = await _pushed(url, {2: later()})
    assert waited == [1]
    assert pieces == EVENTS  # nothing lost, nothing reordered


async def test_a_connection_dropped_mid_body_raises_httpx_error() -> None:
    async with PacedWorker(dies=True) as url:
        with pytest.raises(httpx.TransportError):
            await _pushed(url)


async def test_a_fault_of_the_sink_is_raised_to_the_pusher_not_to_aiohttp() -> None:
    async with (
        PacedWorker() as url,
        make_client(settings_for("http://unused:1")) as client,
        client.stream("POST", url, content=b"{}") as response,
    ):
        pusher = chunk_pusher(response)
        assert pusher is not None

        def sink(data: bytes) -> None:
            raise ZeroDivisionError

        with pytest.raises(ZeroDivisionError):
            await pusher.push(sink)


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


async def test_data_the_reader_takes_in_while_handing_a_piece_on_is_pushed_too() -> None:
    # Reading resumes aiohttp's protocol, which may feed what it held at once, while the waiter
    # is away: that piece is pushed in the same callback, not left until the next one comes.
    class Protocol:
        connected = True

        def __init__(self) -> None:
            self.held = [b"held back"]

        def pause_reading(self) -> None:
            pass

        def resume_reading(self) -> None:
            if self.held:
                reader.feed_data(self.held.pop())

    loop = asyncio.get_running_loop()
    reader = aiohttp.StreamReader(Protocol(), 2**16, loop=loop)  # type: ignore[arg-type]
    pieces: list[bytes] = []
    done: asyncio.Future[Awaitable[None] | None] = loop.create_future()
    reader._waiter = _PushingWaiter(reader, lambda d: pieces.append(d), done)  # type: ignore[assignment]
    reader.feed_data(b"first")
    assert pieces == [b"first", b"held back"]
    assert not reader._buffer

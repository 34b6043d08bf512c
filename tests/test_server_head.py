"""A response's head goes out with its first body bytes, in one write (app.server.HeadWithBody).

uvicorn writes the head as soon as the app sends ``http.response.start``; the gateway holds it
for the body's first bytes, so that a client is woken once, with headers and the first event.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.server import HeadWithBody
from tests.fake_upstream import FakeWorker
from tests.servers import running_gateway, settings_for
from tests.test_gateway_fake import _ok

pytestmark = pytest.mark.asyncio(loop_scope="session")

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENT = b'1a\r\ndata: {"choices":[]}\n\n\r\n'


class Recording(asyncio.Transport):
    """A transport that keeps what is written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> None:
        assert not self.closed, "written after close"
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0


async def test_the_head_is_written_with_the_first_body_bytes() -> None:
    real = Recording()
    transport = HeadWithBody(real, asyncio.get_running_loop())
    transport.write(HEAD)
    assert real.writes == []
    transport.write(EVENT)
    transport.write(b"0\r\n\r\n")
    assert real.writes == [HEAD + EVENT, b"0\r\n\r\n"]
    await asyncio.sleep(0)  # the turn's end finds nothing left to write
    assert real.writes == [HEAD + EVENT, b"0\r\n\r\n"]
    assert transport.get_write_buffer_size() == 0  # the rest is the connection's own


async def test_a_head_with_no_body_after_it_goes_out_at_the_turn_s_end() -> None:
    """A HEAD answer, or an app that awaits between the head and its body."""
    real = Recording()
    transport = HeadWithBody(real, asyncio.get_running_loop())
    transport.write(HEAD)
    await asyncio.sleep(0)
    assert real.writes == [HEAD]
    transport.write(EVENT)
    assert real.writes == [HEAD, EVENT]


async def test_an_interim_continue_is_not_the_head() -> None:
    real = Recording()
    transport = HeadWithBody(real, asyncio.get_running_loop())
    transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert real.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    transport.write(HEAD)
    transport.write(EVENT)
    assert real.writes == [b"HTTP/1.1 100 Continue\r\n\r\n", HEAD + EVENT]


async def test_a_close_writes_the_held_head_first() -> None:
    real = Recording()
    transport = HeadWithBody(real, asyncio.get_running_loop())
    transport.write(HEAD)
    transport.close()
    assert real.writes == [HEAD]
    assert real.closed
    assert transport.is_closing()
    await asyncio.sleep(0)
    assert real.writes == [HEAD]


async def test_a_head_only_answer_reaches_the_client_through_the_server() -> None:
    """uvicorn writes no body at all for HEAD: the held head must still go out, at once."""
    settings = settings_for("http://fake-worker:8100")
    async with running_gateway(settings, FakeWorker(_ok).transport) as url:
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"HEAD /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")  # the connection still serves
        again = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        writer.close()
    assert head.startswith(b"HTTP/1.1 ")
    assert b"x-request-id: " in head
    assert again.startswith(b"HTTP/1.1 200")

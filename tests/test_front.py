"""The front end (app.http.front): HTTP/1.1 on a client connection, driven byte by byte.

A :class:`FrontProtocol` is fed the client's bytes and writes to a recording transport, so each
test sees exactly what goes on the wire: the head with the first body bytes in one write, a
whole answer with its length, a stream in chunks, requests answered in order, and the requests
that must be refused with a 400 and the connection closed (no request smuggling).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from app.http.body import BODY_KEY, read_body
from app.http.connection import ClientLimits
from app.http.exchange import Exchange
from app.http.front import (
    ABORT_KEY,
    FIRST_BYTE_KEY,
    HOOKS_KEY,
    FrontHooks,
    FrontProtocol,
    front_protocol,
)
from app.http.writer import WRITER_KEY, AsgiWriter
from tests.fake_upstream import MODEL, FakeWorker
from tests.garbage import saved_garbage
from tests.servers import running_gateway, settings_for
from tests.test_gateway_fake import _ok

pytestmark = pytest.mark.asyncio(loop_scope="session")

LIMITS = ClientLimits(
    header_timeout_s=5.0, max_header_bytes=8192, max_headers=50, send_buffer_bytes=0,
    keep_alive_s=5.0, max_connections=None,
)  # fmt: skip


class Recording(asyncio.Transport):
    """A client connection's transport that keeps what is written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = self.aborted = self.eof = False
        self.paused = False
        self.gone = asyncio.Event()
        """Set when the connection is closed or aborted."""
        self.wrote = asyncio.Event()
        """Set by each write."""

    def write(self, data: Any) -> None:
        assert not self.closed, "written after close"
        self.writes.append(bytes(data))
        self.wrote.set()

    def close(self) -> None:
        self.closed = True
        self.gone.set()

    def abort(self) -> None:
        self.closed = self.aborted = True
        self.gone.set()

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("10.0.0.9", 5000), "sockname": ("127.0.0.1", 8000)}.get(name)

    @property
    def wire(self) -> bytes:
        return b"".join(self.writes)


class Refusals:
    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def __call__(self, rid: str, path: str, status: int, seconds: float) -> None:
        self.seen.append((path, status))


def connect(
    app: Any, limits: ClientLimits = LIMITS, refusals: Refusals | None = None
) -> tuple[FrontProtocol, Recording]:
    hooks = FrontHooks(lambda: 42.0, lambda headers: "rid-1", refusals or Refusals())
    protocol = front_protocol(app, limits)(app_state={HOOKS_KEY: hooks})
    transport = Recording()
    protocol.connection_made(transport)
    return protocol, transport


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers the method, path and body it was sent, as one whole body."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    answer = b"%s %s %s" % (scope["method"].encode(), scope["path"].encode(), body)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": answer})


async def test_a_whole_answer_goes_out_in_one_write_with_its_length() -> None:
    protocol, transport = connect(echo)
    protocol.data_received(b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi")
    await settle()
    assert transport.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nPOST /a hi"]
    assert not transport.closed  # kept alive


async def test_the_scope_carries_the_first_byte_time_the_abort_and_the_writer() -> None:
    seen: list[Scope] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope)
        await echo(scope, receive, send)

    protocol, transport = connect(app)
    protocol.data_received(b"GET /p%20q?x=1 HTTP/1.1\r\nHost: x\r\nX-A: b \r\n\r\n")
    await settle()
    scope = seen[0]
    assert scope[FIRST_BYTE_KEY] == 42.0
    assert scope[ABORT_KEY] == transport.abort
    assert isinstance(scope[WRITER_KEY], Exchange)
    assert (scope["path"], scope["raw_path"], scope["query_string"]) == ("/p q", b"/p%20q", b"x=1")
    assert scope["headers"] == [(b"host", b"x"), (b"x-a", b"b")]
    assert scope["client"] == ("10.0.0.9", 5000)


async def test_a_stream_s_head_goes_out_with_its_first_chunk_and_each_write_is_a_chunk() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        writer = scope[WRITER_KEY]
        writer.start(200, [(b"content-type", b"text/event-stream")])
        assert transport.writes == []  # held for the body
        assert writer.write(b"data: 1\n\n") is None
        assert writer.write(b"data: 2\n\n") is None
        assert writer.end(b"") is None

    protocol, transport = connect(app)
    protocol.data_received(b"POST /s HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    await settle()
    assert transport.writes == [
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
        b"\r\n\r\n9\r\ndata: 1\n\n\r\n",
        b"9\r\ndata: 2\n\n\r\n",
        b"0\r\n\r\n",
    ]


async def test_a_write_waits_while_the_client_does_not_read() -> None:
    written: list[object] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        writer = scope[WRITER_KEY]
        writer.start(200, [])
        assert writer.write(b"a") is None
        protocol.pause_writing()
        pending = writer.write(b"b")
        assert pending is not None
        written.append(len(transport.writes))  # not written yet
        protocol.resume_writing()
        await pending
        written.append(len(transport.writes))
        assert writer.end(b"") is None

    protocol, transport = connect(app)
    protocol.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await settle()
    assert written == [1, 2]
    assert transport.writes[1:] == [b"1\r\nb\r\n", b"0\r\n\r\n"]


async def test_asgi_s_head_goes_out_at_the_turn_s_end_when_no_body_follows() -> None:
    release = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await release.wait()
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    protocol, transport = connect(app)
    protocol.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await settle()
    assert transport.writes == [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"]
    release.set()
    await settle()
    assert transport.writes[1:] == [b"1\r\nx\r\n", b"0\r\n\r\n"]


async def test_head_and_no_content_answers_have_no_body() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        status = 204 if scope["path"] == "/none" else 200
        headers = [] if status == 204 else [(b"content-length", b"5")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if status == 204 else b"hello"})

    protocol, transport = connect(app)
    protocol.data_received(
        b"HEAD / HTTP/1.1\r\nhost: x\r\n\r\nGET /none HTTP/1.1\r\nhost: x\r\n\r\n"
    )
    await settle()
    assert transport.wire == (
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n"
    )


async def test_pipelined_requests_are_answered_in_order() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/slow":
            await asyncio.sleep(0.05)
        await echo(scope, receive, send)

    protocol, transport = connect(app)
    protocol.data_received(
        b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n"
        b"POST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\nB"
        b"GET /c HTTP/1.1\r\nhost: x\r\n\r\n"
    )
    await asyncio.sleep(0.1)
    await settle()
    assert transport.wire == (
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nGET /slow "
        b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nPOST /b B"
        b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\nGET /c "
    )


async def test_an_expect_continue_is_answered_when_the_body_is_asked_for() -> None:
    protocol, transport = connect(echo)
    protocol.data_received(
        b"POST /u HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 3\r\n\r\n"
    )
    await settle()
    assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    protocol.data_received(b"abc")
    await settle()
    assert transport.writes[1].endswith(b"POST /u abc")


async def test_a_body_that_arrived_whole_is_read_at_once_else_as_it_arrives() -> None:
    """read_body takes a body the exchange holds whole (BODY_KEY); a split one it receives."""
    bodies: list[bytes] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        source = scope[BODY_KEY]
        whole = source.arrived_body()
        bodies.append(b"whole:" + whole if whole is not None else b"parts")
        assert source.arrived_body() is None  # taken once
        raw = await read_body(Request(scope, receive), 100, 5.0) if whole is None else b""
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": raw})

    protocol, transport = connect(app)
    protocol.data_received(b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi")
    await settle()
    protocol.data_received(b"POST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\nab")
    await settle()
    protocol.data_received(b"cd")
    await settle()
    assert bodies == [b"whole:hi", b"parts"]
    assert transport.wire.endswith(b"content-length: 4\r\n\r\nabcd")


async def test_a_connection_close_request_is_answered_then_closed() -> None:
    protocol, transport = connect(echo)
    protocol.data_received(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    await settle()
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK\r\nconnection: close\r\n")
    assert transport.closed


async def test_a_fault_before_the_answer_is_a_500_in_openai_s_shape() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise ZeroDivisionError

    protocol, transport = connect(app)
    protocol.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await settle()
    head, _, body = transport.wire.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 500 ")
    assert json.loads(body)["error"]["type"] == "server_error"
    assert transport.closed


async def test_a_kept_connection_s_next_head_gets_a_whole_deadline_of_its_own() -> None:
    # One head timer a connection, left running past a head's end: a later head is still
    # refused only header_timeout_s after its own first byte.
    loop = asyncio.get_running_loop()
    protocol, transport = connect(echo, dataclasses.replace(LIMITS, header_timeout_s=0.3))
    protocol.data_received(b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n")
    await settle()
    assert len(transport.writes) == 1
    await asyncio.sleep(0.2)
    protocol.data_received(b"GET /b HTTP/1.1\r\nho")  # a head begun, not ended
    begun = loop.time()
    await asyncio.sleep(0.2)  # past the first head's deadline, not this one's
    assert not transport.closed
    assert len(transport.writes) == 1
    transport.wrote.clear()
    await asyncio.wait_for(transport.wrote.wait(), 2.0)
    assert loop.time() - begun >= 0.29
    assert transport.writes[1].startswith(b"HTTP/1.1 408 ")
    assert transport.eof  # half-closed after the refusal


async def test_a_kept_connection_closes_a_keep_alive_after_its_last_answer() -> None:
    loop = asyncio.get_running_loop()
    protocol, transport = connect(echo, dataclasses.replace(LIMITS, keep_alive_s=0.3))
    protocol.data_received(b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n")
    await settle()
    await asyncio.sleep(0.2)
    protocol.data_received(b"GET /b HTTP/1.1\r\nhost: x\r\n\r\n")
    await settle()
    answered = loop.time()
    assert len(transport.writes) == 2
    await asyncio.sleep(0.2)  # past a keep-alive from the first answer, not from the last
    assert not transport.closed
    await asyncio.wait_for(transport.gone.wait(), 2.0)
    assert loop.time() - answered >= 0.29
    assert len(transport.writes) == 2  # closed idle, with nothing written


async def answer_with_head(headers: list[tuple[bytes, bytes]]) -> tuple[list[str], Recording]:
    """What an app starting its answer with ``headers`` sent, and its refusals."""
    refused: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        writer = scope[WRITER_KEY]
        try:
            writer.start(200, headers)
        except RuntimeError as exc:
            refused.append(str(exc))
            raise
        assert writer.end(b"") is None

    protocol, transport = connect(app)
    protocol.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await settle()
    return refused, transport


@pytest.mark.parametrize(
    ("headers", "bad"),
    [
        ([(b"x-ok", b"1"), (b"x-a", b"b\r\nset-cookie: evil")], b"x-a"),
        ([(b"x-ok", b"1"), (b"x-b", b"nul\x00")], b"x-b"),
        ([(b"x c", b"1"), (b"x-ok", b"1")], b"x c"),
        ([(b"x-ok", b"1"), (b"x:d", b"1")], b"x:d"),
        ([(b"x-ok", b"1"), (b"x-e\n", b"1")], b"x-e\n"),
    ],
    ids=["crlf-in-value", "nul-in-value", "space-in-name", "colon-in-name", "lf-in-name"],
)
async def test_a_response_header_that_would_break_the_head_is_refused(
    headers: list[tuple[bytes, bytes]], bad: bytes
) -> None:
    refused, transport = await answer_with_head(headers)
    assert refused == [f"invalid response header {bad!r}"]
    assert b"evil" not in transport.wire
    assert transport.wire.startswith(b"HTTP/1.1 500 ")


async def test_tabs_and_visible_bytes_are_valid_in_a_response_header() -> None:
    refused, transport = await answer_with_head(
        [(b"x-a", b"one\ttwo \xe9"), (b"X-B!#$%&'*+.^_`|~9", b"")]
    )
    assert refused == []
    assert transport.writes == [
        b"HTTP/1.1 200 OK\r\nx-a: one\ttwo \xe9\r\nx-b!#$%&'*+.^_`|~9: \r\n"
        b"content-length: 0\r\n\r\n"
    ]


async def test_a_disconnect_reaches_receive_and_stops_writes() -> None:
    got: list[Any] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()  # the (empty) body
        got.append(await receive())
        got.append(scope[WRITER_KEY].write(b"late"))

    protocol, transport = connect(app)
    protocol.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await settle()
    protocol.connection_lost(None)
    await settle()
    assert got == [{"type": "http.disconnect"}, None]
    assert transport.writes == []


SMUGGLING = {
    "content-length and transfer-encoding": (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n"
        b"transfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    ),
    "two content-lengths": (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n"
        b"content-length: 4\r\n\r\nabcd"
    ),
    "a bad chunk size": (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        b"zz\r\nabc\r\n0\r\n\r\n"
    ),
    "an obsolete line fold": b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-a: b\r\n  c\r\n\r\n",
    "a NUL in a header": b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-a: b\x00c\r\n\r\n",
    "a bad request line": b"GET /healthz HTTP/9\r\nhost: x\r\n\r\n",
    "a target that is no URL": b"GET http://a:99999/ HTTP/1.1\r\nhost: x\r\n\r\n",
}


@pytest.mark.parametrize("raw", SMUGGLING.values(), ids=SMUGGLING.keys())
async def test_a_malformed_request_gets_400_and_the_connection_closed(raw: bytes) -> None:
    served: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        served.append(scope["path"])
        while (await receive())["type"] != "http.disconnect":
            pass

    refusals = Refusals()
    protocol, transport = connect(app, refusals=refusals)
    protocol.data_received(raw + b"GET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n")
    await settle()
    head, _, body = transport.wire.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert b"connection: close" in head
    assert b"x-request-id: rid-1" in head
    assert json.loads(body)["error"]["code"] == "invalid_http_request"
    assert transport.eof  # half-closed: the client reads the answer, then the close
    assert "/smuggled" not in served
    assert [status for _, status in refusals.seen] == [400]
    protocol.data_received(b"GET /after HTTP/1.1\r\nhost: x\r\n\r\n")  # read and dropped
    await settle()
    assert "/after" not in served
    protocol.connection_lost(None)


async def test_a_malformed_request_after_a_good_one_is_refused_after_its_answer() -> None:
    protocol, transport = connect(echo)
    protocol.data_received(
        b"POST /first HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\n1"
        + SMUGGLING["two content-lengths"]
    )
    await settle()
    first, second = transport.writes[0], b"".join(transport.writes[1:])
    assert first == b"HTTP/1.1 200 OK\r\ncontent-length: 13\r\n\r\nPOST /first 1"
    assert second.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    protocol.connection_lost(None)


async def test_the_asgi_writer_sends_messages_with_the_start_before_the_first_part() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "http.disconnect"}

    writer = AsgiWriter(send, receive)
    writer.start(201, [(b"a", b"b")])
    assert writer.write(b"x") is None
    assert writer.end(b"") is None
    assert [m["type"] for m in sent] == [
        "http.response.start", "http.response.body", "http.response.body",
    ]  # fmt: skip
    assert (sent[0]["status"], sent[1]["more_body"], sent[2]["more_body"]) == (201, True, False)


async def test_malformed_requests_get_400_from_the_running_gateway() -> None:
    settings = settings_for("http://fake-worker:8100")
    async with running_gateway(settings, FakeWorker(_ok).transport) as url:
        port = int(url.rsplit(":", 1)[1])
        for raw in SMUGGLING.values():
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(raw)
            answer = await asyncio.wait_for(reader.read(), 5)  # to the close
            writer.close()
            assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), raw
            assert answer.count(b"HTTP/1.1 ") == 1


async def test_a_head_only_answer_reaches_the_client_through_the_server() -> None:
    """No body is written for HEAD: the head must still go out, and the connection serve on."""
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


async def test_a_served_exchange_is_freed_with_its_last_reference_not_by_the_collector() -> None:
    """The scope holds its exchange (the writer, the body): served, the exchange lets go of it.

    Else each request's exchange, scope, headers, state and trace (about eleven objects) waited
    for the collector as a reference cycle.
    """
    settings = settings_for("http://fake-worker:8100")
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    async with running_gateway(settings, FakeWorker(_ok).transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.get("/healthz")).status_code == 200  # the connection is open
            with saved_garbage() as garbage:
                for stream in (True, False, True):
                    chat = json.loads(body) | {"stream": stream}
                    async with client.stream("POST", "/v1/chat/completions", json=chat) as r:
                        await r.aread()
                        assert r.status_code == 200
                assert (await client.get("/healthz")).status_code == 200
    assert [o for o in garbage if isinstance(o, Exchange)] == []


async def test_a_closed_connection_is_freed_with_its_last_reference_not_by_the_collector() -> None:
    """A client that opens a connection per request leaves no cycle per connection behind."""
    settings = settings_for("http://fake-worker:8100")
    async with running_gateway(settings, FakeWorker(_ok).transport) as url:
        port = int(url.rsplit(":", 1)[1])
        with saved_garbage() as garbage:
            for _ in range(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /healthz HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n")
                assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 200")
                writer.close()
                await writer.wait_closed()
            await asyncio.sleep(0.05)  # the server's side of the last close
    assert [o for o in garbage if isinstance(o, FrontProtocol)] == []


async def test_pipelined_requests_are_answered_in_order_by_the_running_gateway() -> None:
    settings = settings_for("http://fake-worker:8100")
    async with running_gateway(settings, FakeWorker(_ok).transport) as url:
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET /healthz HTTP/1.1\r\nhost: gw\r\nx-request-id: one\r\n\r\n"
            b"GET /nowhere HTTP/1.1\r\nhost: gw\r\nx-request-id: two\r\n\r\n"
            b"GET /healthz HTTP/1.1\r\nhost: gw\r\nx-request-id: three\r\nconnection: close\r\n\r\n"
        )
        wire = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    heads = [part for part in wire.split(b"HTTP/1.1 ")[1:]]
    assert [head[:3] for head in heads] == [b"200", b"404", b"200"]
    assert [b"x-request-id: " + rid in head for rid, head in zip(
        (b"one", b"two", b"three"), heads, strict=True
    )] == [True, True, True]  # fmt: skip


async def test_a_watcher_hears_of_a_disconnect_before_the_answer_is_complete_only() -> None:
    heard: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        writer = scope[WRITER_KEY]
        writer.watch(lambda: heard.append(scope["path"]))
        if scope["path"] == "/done":
            writer.start(200, [])
            writer.end(b"ok")
        await asyncio.sleep(1)

    protocol, _ = connect(app)
    protocol.data_received(b"GET /done HTTP/1.1\r\nhost: x\r\n\r\n")
    await settle()
    protocol.connection_lost(None)  # after the answer: nothing to hear
    protocol, _ = connect(app)
    protocol.data_received(b"GET /open HTTP/1.1\r\nhost: x\r\n\r\n")
    await settle()
    protocol.connection_lost(None)
    await settle()
    assert heard == ["/open"]


async def test_the_asgi_writer_watches_receive_for_the_disconnect() -> None:
    messages = asyncio.Queue[dict[str, Any]]()
    heard: list[bool] = []

    async def send(message: Any) -> None:
        pass

    writer = AsgiWriter(send, messages.get)
    writer.watch(lambda: heard.append(True))
    messages.put_nowait({"type": "http.request", "body": b"", "more_body": False})
    await settle()
    assert heard == []
    messages.put_nowait({"type": "http.disconnect"})
    await settle()
    assert heard == [True]
    stop = writer.watch(lambda: heard.append(False))
    stop()
    messages.put_nowait({"type": "http.disconnect"})
    await settle()
    assert heard == [True]

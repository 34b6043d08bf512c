"""The gateway's HTTP/1.1 front end: every client connection, on asyncio and httptools.

uvicorn runs the process, the lifespan and the signals, and hands each accepted connection to
:class:`FrontProtocol` (its documented ``http=`` option takes a protocol class). From there the
connection is the gateway's own: httptools' request parser, one :class:`Exchange` per request,
answered in order (pipelined requests wait their turn), kept alive between requests.

Every request reaches the ASGI app (FastAPI, the trace, the relay) with a standard ``http``
scope. A response can be written two ways, one exchange's bytes either way:

* ASGI's ``send`` (every route): the head is held until the first body bytes, so that they go
  out in one write, or until the end of the loop's turn if nothing follows;
* the exchange itself, found in the scope under :data:`WRITER_KEY` (:class:`ResponseWriter`):
  :meth:`Exchange.write` frames a chunk and hands it to the socket at once, in the caller's own
  callback, with no message, task or coroutine per event, and returns something to await only
  when the client's connection holds writes back (``pause_writing``). The relay streams this
  way; under another server it falls back to ``send`` (:class:`AsgiWriter`).

What clients may hold and send is bounded here:

* the head (request line and headers) must be complete ``header_timeout_s`` after the
  connection opened (its first request) or after the request's first byte (later requests on a
  keep-alive connection): 408, and the connection is closed;
* the head may take ``max_header_bytes`` and ``max_headers`` fields: 431, and closed. The bytes
  are counted as they arrive, before httptools has gathered them (it joins the pieces of a long
  header by copying, which a huge header turns quadratic);
* a request httptools refuses (both Content-Length and Transfer-Encoding, two Content-Lengths,
  a bad chunk size, an obsolete line fold, a NUL in a header, a malformed request line) gets a
  400 and the connection is closed, after the requests before it were answered: nothing after a
  malformed message is read as a request (no request smuggling);
* a request body is read ahead by at most 64 KiB (reading pauses until the app takes it);
* an idle kept-alive connection is closed after ``keep_alive_s``;
* the kernel's send buffer of each connection is fixed at ``send_buffer_bytes`` (not
  autotuned, up to megabytes), and :data:`ABORT_KEY` in the scope drops a connection at once:
  with them the relay cuts a client that stops reading;
* a request on a connection beyond ``max_connections`` is marked (:data:`OVER_CAPACITY_KEY`)
  for :mod:`app.http.trace` to answer 503 ``gateway_saturated`` in OpenAI's shape.

A refusal is written in OpenAI's error shape with an ``x-request-id``, reported to
:class:`FrontHooks` (counted and logged like every response), and the connection is
half-closed: what the client still sends is read and dropped for a moment (a lingering close),
so that it reads the answer rather than a reset.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import os
import re
import socket
import types
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, cast
from urllib.parse import unquote

import httptools
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import error_body

log = logging.getLogger(__name__)

FIRST_BYTE_KEY = "gateway.first_byte"
"""Scope key: the gateway clock's reading when the request's first byte was read."""
ABORT_KEY = "gateway.abort"
"""Scope key of a callable that drops the request's connection at once, unflushed."""
OVER_CAPACITY_KEY = "gateway.over_capacity"
"""Scope key set when the request's connection is beyond the connection cap."""
WRITER_KEY = "gateway.writer"
"""Scope key of the request's :class:`ResponseWriter` (the exchange itself)."""
HOOKS_KEY = "gateway.front"
"""Key of the :class:`FrontHooks` in the lifespan's state."""

# After a refusal, how long what the client still sends is read and dropped before the
# connection is dropped.
_LINGER_S = 2.0
# A request body read ahead of the app beyond this pauses reading (as uvicorn does).
_BODY_HIGH_WATER = 65536
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"
# Response splitting: no control character in a header, no separator in a name.
_BAD_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_BAD_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode()


_STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """What one client connection may take."""

    header_timeout_s: float
    max_header_bytes: int
    max_headers: int
    send_buffer_bytes: int
    keep_alive_s: float
    max_connections: int | None


@dataclass(frozen=True, slots=True)
class FrontHooks:
    """What the front end asks of the app, put in the lifespan's state under :data:`HOOKS_KEY`.

    ``clock`` stamps each request's first byte; ``request_id`` names a request from its
    headers; ``refused`` records a request refused before it reached the app (request id, path,
    status, seconds since its head began).
    """

    clock: Callable[[], float]
    request_id: Callable[[Iterable[tuple[bytes, bytes]]], str]
    refused: Callable[[str, str, int, float], None]


class ResponseWriter(Protocol):
    """One response, written without ASGI messages: a head, then body parts, then the end.

    The head is held until the first body bytes. :meth:`write` and :meth:`end` hand their bytes
    to the connection now and return None, or, when the connection holds writes back, return
    an awaitable that writes them once it may: the caller awaits it before writing more.
    """

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Set the response's status and headers (written with the first body bytes)."""

    def write(self, data: bytes) -> Awaitable[None] | None:
        """Write one part of the body (one HTTP chunk)."""

    def end(self, data: bytes) -> Awaitable[None] | None:
        """Write the body's last part: the response is complete."""

    def watch(self, gone: Callable[[], None]) -> Callable[[], None]:
        """Call ``gone`` when the client disconnects before the response is complete.

        Called soon if it did already. Returns what stops watching.
        """


class AsgiWriter:
    """A :class:`ResponseWriter` over ASGI's ``send``, for a server that offers no writer.

    Each part is one ``http.response.body`` message, sent with :func:`send_now`; a task
    waits on ``receive`` for the disconnect.
    """

    __slots__ = ("_receive", "_send", "_start")

    def __init__(self, send: Send, receive: Receive) -> None:
        self._send = send
        self._receive = receive
        self._start: Message | None = None

    def watch(self, gone: Callable[[], None]) -> Callable[[], None]:
        """Call ``gone`` once ``receive`` says the client disconnected."""

        async def wait() -> None:
            while (await self._receive())["type"] != "http.disconnect":
                pass
            gone()

        task = asyncio.get_running_loop().create_task(wait())

        def stop() -> None:
            task.cancel()

        return stop

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Keep the start message for the first body part."""
        self._start = {"type": "http.response.start", "status": status, "headers": headers}

    def write(self, data: bytes) -> Awaitable[None] | None:
        """Send one body part."""
        return self._body(data, True)

    def end(self, data: bytes) -> Awaitable[None] | None:
        """Send the last body part."""
        return self._body(data, False)

    def _body(self, data: bytes, more: bool) -> Awaitable[None] | None:
        message: Message = {"type": "http.response.body", "body": data, "more_body": more}
        start, self._start = self._start, None
        if start is not None:
            pending = send_now(self._send, start)
            if pending is not None:
                return _chained(pending, self._send, message)
        return send_now(self._send, message)


def send_now(send: Send, message: Message) -> Awaitable[None] | None:
    """Run ``send(message)`` up to its first wait: None if it finished, else what finishes it.

    A server's send returns without waiting unless the client's connection holds writes back,
    so a sender outside any task can send; the rare send that must wait is finished by
    awaiting what this returns.
    """
    sending = send(message)
    if type(sending) is not types.CoroutineType:  # an ABC's isinstance costs more than a send
        return sending
    try:
        waits_on = sending.send(None)
    except StopIteration:
        return None
    return _resumed(sending, waits_on)


async def _resumed(sending: Coroutine[Any, Any, None], waits_on: Any) -> None:
    """Finish a coroutine that stopped at its first wait, on what it was waiting for.

    What it waited on (an asyncio future, or None for a bare yield) is waited for here; the
    coroutine is then resumed and takes the future's outcome itself, as its own ``await`` does.
    A cancellation of this task is delivered to the coroutine where it waits.
    """
    while True:
        try:
            if waits_on is None:
                await asyncio.sleep(0)
            else:
                # Not awaited itself: a future the coroutine's await has yielded refuses a
                # second await. A future of this task's own settles with it.
                await _settled(waits_on)
        except BaseException as exc:
            try:
                waits_on = sending.throw(exc)
            except StopIteration:
                return
            continue
        try:
            waits_on = sending.send(None)
        except StopIteration:
            return


def _settled(future: asyncio.Future[Any]) -> asyncio.Future[None]:
    """A new future that completes, with no result, once ``future`` is done (whatever its end)."""
    done: asyncio.Future[None] = future.get_loop().create_future()

    def settle(_: asyncio.Future[Any]) -> None:
        if not done.done():
            done.set_result(None)

    future.add_done_callback(settle)
    return done


async def _chained(first: Awaitable[None], send: Send, message: Message) -> None:
    await first
    await send(message)


class Exchange:
    """One request and its response on a client connection: ASGI's and the direct interface.

    The request's body is buffered as it arrives and handed to ``receive``; the response is
    written through ``send`` or, without messages, through :meth:`start`, :meth:`write` and
    :meth:`end` (:class:`ResponseWriter`). Once the connection is lost nothing is written and
    ``receive`` answers ``http.disconnect``.
    """

    __slots__ = (
        "_chunked", "_conn", "_continue", "_event", "_gone", "_head", "_left", "_no_body", "body",
        "complete", "disconnected", "keep_alive", "more_body", "scope", "started",
    )  # fmt: skip

    def __init__(
        self, conn: FrontProtocol, scope: Scope, keep_alive: bool, expect_continue: bool
    ) -> None:
        self._conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self._continue = expect_continue
        self._event = asyncio.Event()
        self.body = bytearray()
        self.more_body = True
        self.disconnected = False
        self.started = False
        """The app gave the response's status and headers."""
        self.complete = False
        self._head: bytes | None = None
        self._chunked: bool | None = None
        self._left = 0
        self._no_body = scope["method"] == "HEAD"
        self._gone: Callable[[], None] | None = None

    # The request side.

    def received(self) -> None:
        """More of the request arrived, or it ended, or the connection did."""
        self._event.set()

    async def receive(self) -> Message:
        """ASGI's ``receive``: the body as it arrives, then ``http.disconnect`` at the end."""
        conn = self._conn
        if self._continue:
            self._continue = False
            if not conn.closing():
                conn.transport.write(_CONTINUE)
        if not self.disconnected and not self.complete:
            conn.resume_reading()
            await self._event.wait()
            self._event.clear()
        if self.disconnected or self.complete:
            return {"type": "http.disconnect"}
        body, self.body = bytes(self.body), bytearray()
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    # The response side.

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Set the status and headers; they are written with the body's first bytes."""
        if self.started:
            raise RuntimeError("the response was started already")
        self.started = True
        self._continue = False  # answered before the body was asked for: no 100 now
        self._head = self._compose(status, headers)

    def write(self, data: bytes) -> Awaitable[None] | None:
        """Write ``data`` as one chunk of the body (see :class:`ResponseWriter`)."""
        if not data or self.complete or self._no_body or self.disconnected:
            return None
        if self._chunked is None:
            self.chunk_by_default()
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        else:
            self._count(len(data))
        return self._out(data, False)

    def end(self, data: bytes) -> Awaitable[None] | None:
        """Write the last of the body: the response is complete (see :class:`ResponseWriter`)."""
        if self.complete:
            return None
        if self._chunked is None and self._head is not None:
            # Nothing was written yet and no length given: the whole body is here, so the
            # response says its length instead of being chunked.
            self._chunked = False
            self._left = len(data)
            self._head = self._head[:-2] + b"content-length: %d\r\n\r\n" % len(data)
        if self._no_body:
            data = b""
        elif self._chunked:
            data = (b"%x\r\n%b\r\n" % (len(data), data) if data else b"") + _LAST_CHUNK
        else:
            self._count(len(data))
            if self._left:
                raise RuntimeError("the response's body is shorter than its Content-Length")
        return self._out(data, True)

    async def send(self, message: Message) -> None:
        """ASGI's ``send``."""
        kind = message["type"]
        if kind == "http.response.start":
            self.start(message["status"], list(message.get("headers", ())))
            # A body usually follows at once; if not, the head goes out at the turn's end.
            self._conn.loop.call_soon(self._flush)
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not self.started:
            raise RuntimeError("http.response.body sent before http.response.start")
        if self.complete:
            raise RuntimeError("http.response.body sent after the response was complete")
        body = message.get("body", b"")
        pending = self.write(body) if message.get("more_body", False) else self.end(body)
        if pending is not None:
            await pending

    def _compose(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        """The head's bytes; notes how the body is delimited and whether the connection stays."""
        parts = [_STATUS_LINES.get(status) or _status_line(status)]
        close = False
        for name, value in headers:
            if _BAD_NAME.search(name) or _BAD_VALUE.search(value):
                raise RuntimeError(f"invalid response header {name!r}")
            name = name.lower()
            if name == b"content-length" and self._chunked is None:
                self._chunked = False
                self._left = int(value)
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self._chunked = True
            elif name == b"connection" and b"close" in value.lower():
                self.keep_alive, close = False, True
            parts += (name, b": ", value, b"\r\n")
        if not self.keep_alive and not close:
            parts.append(b"connection: close\r\n")
        if status < 200 or status in (204, 304):
            self._no_body = True
        if self._no_body and self._chunked is None:
            self._chunked = False  # no body, so neither a length nor chunks
        parts.append(b"\r\n")
        return b"".join(parts)

    def chunk_by_default(self) -> None:
        """A body is coming in parts: say so in the head if the app gave no length."""
        if self._chunked is None and self._head is not None:
            self._chunked = True
            self._head = self._head[:-2] + b"transfer-encoding: chunked\r\n\r\n"

    def _count(self, size: int) -> None:
        if size > self._left:
            raise RuntimeError("the response's body is longer than its Content-Length")
        self._left -= size

    def _out(self, data: bytes, last: bool) -> Awaitable[None] | None:
        head = self._head
        if head is not None:
            self._head = None
            data = head + data
        if last:
            self.complete = True
        conn = self._conn
        if self.disconnected or conn.closing():
            if last:
                conn.answered(self)
            return None
        if conn.write_paused:
            return self._later(data, last)
        conn.transport.write(data)
        if last:
            conn.answered(self)
        return None

    async def _later(self, data: bytes, last: bool) -> None:
        conn = self._conn
        if conn.write_paused:
            await conn.drained()
        if not self.disconnected and not conn.closing():
            conn.transport.write(data)
        if last:
            conn.answered(self)

    def _flush(self) -> None:
        """Write a head that no body followed within the turn."""
        head = self._head
        if head is None or self.disconnected:
            return
        self.chunk_by_default()
        head = self._head
        if head is not None and not self._conn.write_paused and not self._conn.closing():
            self._head = None
            self._conn.transport.write(head)

    async def run(self, app: ASGIApp) -> None:
        """Serve the request with ``app``; a fault is logged, then answered or the link cut."""
        try:
            await app(self.scope, self.receive, self.send)
        except asyncio.CancelledError:
            if not self.complete:
                self._conn.abort()  # the server stopped it: no answer can be finished
            raise
        except Exception as exc:
            log.error("the ASGI app failed a request", exc_info=exc)
            if not self.started and not self.disconnected:
                await self._internal_error()
            elif not self.complete:
                self._conn.abort()
        else:
            if not self.started and not self.disconnected:
                log.error("the ASGI app returned without starting a response")
                await self._internal_error()
            elif not self.complete and not self.disconnected:
                log.error("the ASGI app returned without completing its response")
                self._conn.abort()

    async def _internal_error(self) -> None:
        body = json.dumps(
            error_body("The gateway failed this request.", "server_error", None, "internal_error")
        ).encode()
        self.keep_alive = False
        self.start(500, [(b"content-type", b"application/json")])
        pending = self.end(body)
        if pending is not None:
            await pending

    def watch(self, gone: Callable[[], None]) -> Callable[[], None]:
        """Call ``gone`` if the connection is lost before the response is complete."""
        if self.disconnected:
            self._conn.loop.call_soon(gone)
        else:
            self._gone = gone
        return self._unwatch

    def _unwatch(self) -> None:
        self._gone = None

    def gone(self) -> None:
        """The connection was lost: nothing more is written; ``receive`` says so."""
        if not self.complete:
            self.disconnected = True
            watcher, self._gone = self._gone, None
            if watcher is not None:
                watcher()
        self._event.set()


class FrontProtocol(asyncio.Protocol):
    """One client connection (see the module's doc).

    Made per server by :func:`front_protocol`, which sets :attr:`serves` and :attr:`limits`.
    uvicorn creates one per connection with its configuration, its server state (the
    connections and request tasks it waits for at shutdown) and the lifespan's state.
    """

    serves: ClassVar[tuple[ASGIApp]]
    """The ASGI app (in a tuple: a function stored on a class would become a method)."""
    limits: ClassVar[ClientLimits]

    def __init__(
        self,
        config: Any = None,
        server_state: Any = None,
        app_state: dict[str, Any] | None = None,
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.loop = _loop or asyncio.get_running_loop()
        self.app_state: dict[str, Any] = app_state if app_state is not None else {}
        hooks = self.app_state.get(HOOKS_KEY)
        self._hooks = hooks if isinstance(hooks, FrontHooks) else None
        self._connections: set[Any] = getattr(server_state, "connections", set())
        self._tasks: set[asyncio.Task[None]] = getattr(server_state, "tasks", set())
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._server: tuple[str, int] | None = None
        self._client: tuple[str, int] | None = None
        self._exchange: Exchange | None = None
        """The request being answered."""
        self._reading: Exchange | None = None
        """The request whose head or body is being read (later than the one answered, when
        pipelined)."""
        self._pipeline: deque[Exchange] = deque()
        self._keep_alive: asyncio.TimerHandle | None = None
        # The head being read.
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._continue = False
        self._first_byte: float | None = None
        self._in_head = True
        self._head_bytes = 0
        """Bytes received while the head was incomplete (a read may carry some of the body)."""
        self._head_size = 0
        """The head's bytes as httptools reported them."""
        self._head_fields = 0
        self._head_started = 0.0
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._refused = False
        self._refusal: bytes | None = None
        """A refusal waiting for the answers to the requests before it."""

    # The transport's side.

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Bound the kernel's send buffer; start the first request's header deadline."""
        # uvloop's transports are not asyncio.Transport instances, though they act as such.
        self.transport = cast(asyncio.Transport, transport)
        self._connections.add(self)
        sock = transport.get_extra_info("socket")
        size = self.limits.send_buffer_bytes
        if size and sock is not None:
            # Fixed, not autotuned: what a client that stops reading holds stays small, and its
            # stall shows in the relay's writes soon (see app.relay.serve).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        self._server = _address(transport.get_extra_info("sockname"))
        self._client = _address(transport.get_extra_info("peername"))
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the timers; tell the requests in flight; let waiting writes go."""
        self._connections.discard(self)
        for timer in (self._head_timer, self._linger, self._keep_alive):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._linger = self._keep_alive = None
        for exchange in (self._exchange, self._reading, *self._pipeline):
            if exchange is not None:
                exchange.gone()
        self._pipeline.clear()
        self.write_paused = False
        self._release_drain()

    def eof_received(self) -> bool | None:
        """The client half-closed: answer what it asked, then close (return None)."""
        return None

    def pause_writing(self) -> None:
        """The transport's buffer is over its high-water mark: writes wait."""
        self.write_paused = True

    def resume_writing(self) -> None:
        """The buffer drained: waiting writes go."""
        self.write_paused = False
        self._release_drain()

    def drained(self) -> Awaitable[None]:
        """What completes once the connection takes writes again (or is lost)."""
        if self._drain is None:
            self._drain = self.loop.create_future()
        return self._drain

    def _release_drain(self) -> None:
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    def closing(self) -> bool:
        """Whether the connection is closing or closed."""
        return self.transport.is_closing()

    def abort(self) -> None:
        """Drop the connection at once, unflushed."""
        self.transport.abort()

    def resume_reading(self) -> None:
        """Read the client again (the app takes the body that was read ahead)."""
        if self._reading_paused and self._refusal is None:
            self._reading_paused = False
            self.transport.resume_reading()

    def _pause_reading(self) -> None:
        if not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        """Count the head's bytes before the parser sees them; parse; refuse what is bad."""
        if self._refused:
            return  # the lingering close: read, dropped
        if self._keep_alive is not None:
            self._keep_alive.cancel()
            self._keep_alive = None
        if self._in_head:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "Protocol upgrades are not served here.", "invalid_request")
        except httptools.HttpParserError as exc:
            if not self._refused:
                log.info("malformed request from %s: %s", self._client, exc)
                self._refuse(400, f"Malformed HTTP request: {exc}.", "invalid_http_request")
            return
        # Checked after the parser ran: a read that ends the head may carry the body too.
        limit = self.limits.max_header_bytes
        if self._in_head and not self._refused and self._head_bytes > limit:
            self._too_large(f"The request's headers are larger than {limit} bytes.")

    # The parser's callbacks. After a refusal the parser still runs to the end of the read it
    # was given (httptools cannot be paused): every callback then does nothing.

    def on_message_begin(self) -> None:
        """A request's first bytes were read: note the time; start its header deadline."""
        if self._refused:
            return
        self._url = b""
        self._headers = []
        self._continue = False
        self._first_byte = self._hooks.clock() if self._hooks is not None else None
        if self._head_timer is None:
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        """Gather the URL, counting its bytes."""
        if not self._refused and self._fits(len(url)):
            self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        """Gather a header; refuse past the limits on fields and bytes."""
        if self._refused:
            return
        self._head_fields += 1
        if self._head_fields > self.limits.max_headers:
            self._too_large(f"The request has more than {self.limits.max_headers} headers.")
        elif self._fits(len(name) + len(value) + 4):  # with ": " and CRLF
            name = name.lower()
            # llhttp keeps trailing white space, which is not part of a field's value.
            value = value.rstrip(b" \t")
            if name == b"expect" and value.lower() == b"100-continue":
                self._continue = True
            self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        """The head is in: stop its deadline; start the exchange, or queue it behind another."""
        if self._refused:
            return
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        parser = self.parser
        version = parser.get_http_version()
        try:
            url = httptools.parse_url(self._url)
        except httptools.HttpParserInvalidURLError:
            self._refuse(400, "The request's target is not a valid URL.", "invalid_http_request")
            return
        raw_path = url.path
        path = raw_path.decode("latin-1")
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": version,
            "server": self._server,
            "client": self._client,
            "scheme": "http",
            "method": parser.get_method().decode("ascii"),
            "root_path": "",
            "path": unquote(path) if "%" in path else path,
            "raw_path": raw_path,
            "query_string": url.query or b"",
            "headers": self._headers,
            "state": self.app_state.copy(),
            ABORT_KEY: self.transport.abort,
        }
        if self._first_byte is not None:
            scope[FIRST_BYTE_KEY] = self._first_byte
        cap = self.limits.max_connections
        if cap is not None and len(self._connections) > cap:
            scope[OVER_CAPACITY_KEY] = True
        keep_alive = version != "1.0" and parser.should_keep_alive()
        exchange = Exchange(self, scope, keep_alive, self._continue)
        scope[WRITER_KEY] = exchange
        self._reading = exchange
        if self._exchange is None:
            self._begin(exchange)
        else:
            # Pipelined: answered after the one before it; read no further meanwhile.
            self._pause_reading()
            self._pipeline.append(exchange)

    def on_body(self, body: bytes) -> None:
        """Buffer a piece of the body for the app; pause reading past the read-ahead bound."""
        exchange = self._reading
        if self._refused or exchange is None or exchange.complete:
            return
        exchange.body += body
        if len(exchange.body) > _BODY_HIGH_WATER:
            self._pause_reading()
        exchange.received()

    def on_message_complete(self) -> None:
        """The request is read; what arrives next is the next request's head."""
        if self._refused:
            return
        exchange, self._reading = self._reading, None
        if exchange is not None:
            exchange.more_body = False
            exchange.received()
        self._in_head, self._head_bytes, self._head_size, self._head_fields = True, 0, 0, 0

    # Exchanges.

    def _begin(self, exchange: Exchange) -> None:
        self._exchange = exchange
        task = self.loop.create_task(exchange.run(self.serves[0]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def answered(self, exchange: Exchange) -> None:
        """``exchange``'s response is complete: close, or start the next, or wait idle."""
        exchange.received()  # its receive answers http.disconnect from now on
        if exchange is not self._exchange:
            return
        self._exchange = None
        if not exchange.keep_alive:
            self._close()
            return
        if self.closing():
            return
        if self._pipeline:
            self._begin(self._pipeline.popleft())
            if not self._pipeline:
                self.resume_reading()
        elif self._refusal is not None:
            self._write_refusal()
        else:
            self.resume_reading()
            if self._reading is None and self._keep_alive is None:
                self._keep_alive = self.loop.call_later(
                    self.limits.keep_alive_s, self._idle_timed_out
                )

    def shutdown(self) -> None:
        """The server is stopping: close now if idle, else after the answer in progress."""
        exchange = self._exchange
        if exchange is None:
            self._close()
        else:
            exchange.keep_alive = False
            self._pipeline.clear()

    def _close(self) -> None:
        if not self.closing():
            self.transport.close()

    def _idle_timed_out(self) -> None:
        self._keep_alive = None
        if self._exchange is None and self._reading is None:
            self._close()

    # Limits and refusals.

    def _fits(self, size: int) -> bool:
        """Add ``size`` bytes to the head; refuse it when that is too many."""
        self._head_size += size
        limit = self.limits.max_header_bytes
        if self._head_size <= limit:
            return True
        self._too_large(f"The request's headers are larger than {limit} bytes.")
        return False

    def _too_large(self, message: str) -> None:
        self._refuse(431, message, "request_header_fields_too_large")

    def _arm_head_timer(self) -> None:
        self._head_started = self.loop.time()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._refused or self.closing():
            return
        if self._head_bytes == 0 and self._exchange is None:
            self._close()  # a connection that never sent a byte: no request to answer
            return
        timeout = self.limits.header_timeout_s
        self._refuse(
            408, f"The request's headers did not arrive within {timeout:g} s.", "request_timeout"
        )

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` in OpenAI's error shape after the answers before it, and close."""
        self._refused = True
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        reading = self._reading
        if reading is not None and reading is not self._exchange:
            self._pipeline = deque(e for e in self._pipeline if e is not reading)
            reading.gone()
        self._reading = None
        if self.closing():
            return
        hooks = self._hooks
        rid = hooks.request_id(self._headers) if hooks is not None else os.urandom(16).hex()
        body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
        self._refusal = (
            _STATUS_LINES[status] + b"content-type: application/json\r\n"
            b"content-length: %d\r\nx-request-id: %b\r\nconnection: close\r\n\r\n%b"
            % (len(body), rid.encode(), body)
        )
        if hooks is not None:
            path = self._url.partition(b"?")[0]  # as sent: it may be no valid URL
            seconds = self.loop.time() - self._head_started
            hooks.refused(rid, path.decode("latin-1"), status, seconds)
        active = self._exchange
        if active is None:
            self._write_refusal()
        elif active is reading:
            # The request being answered is the malformed one: its app hears a disconnect,
            # and its client the refusal, unless its answer had begun.
            self._exchange = None
            active.gone()
            if active.started:
                self.abort()
            else:
                self._write_refusal()
        else:
            # Answered in order: after the response in progress (and none after it).
            self._pipeline.clear()
            active.keep_alive = active.keep_alive and status != 408
            self._pause_reading()
            if status == 408:
                self._refusal = None  # a late pipelined head: finish the answer, then close

    def _write_refusal(self) -> None:
        refusal, self._refusal = self._refusal, None
        transport = self.transport
        if refusal is None or transport.is_closing():
            return
        transport.write(refusal)
        if transport.can_write_eof():
            transport.write_eof()
        # Lingering: what the client still sends is read and dropped, for a while.
        self._refused = True
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        self._linger = self.loop.call_later(_LINGER_S, transport.abort)


def _address(value: Any) -> tuple[str, int] | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return str(value[0]), int(value[1])
    return None


def front_protocol(app: ASGIApp, limits: ClientLimits) -> type[FrontProtocol]:
    """:class:`FrontProtocol` serving ``app`` within ``limits`` (one instance per connection)."""

    class Front(FrontProtocol):
        pass

    Front.serves = (app,)
    Front.limits = limits
    return Front

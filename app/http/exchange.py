"""One request and its response on a client connection (:class:`Exchange`).

The exchange is both ASGI's ``receive`` and ``send`` and the direct
:class:`app.http.writer.ResponseWriter` of its request. It frames what the app writes (a length
or chunks, a head that goes out with the first body bytes) and hands it to its connection's
transport at once. It asks of the connection only what :class:`Connection` names, so it knows
nothing of parsing or of the connection's limits.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Protocol

from starlette.types import ASGIApp, Message, Scope

from app.api.errors import error_body

log = logging.getLogger(__name__)

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"
# Response splitting: no control character in a header, no separator in a name.
_BAD_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_BAD_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")


def status_line(status: int) -> bytes:
    """A response's status line for ``status``, with its reason phrase (none if unknown)."""
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode()


STATUS_LINES = {status: status_line(status) for status in range(100, 600)}
"""Every status line from 100 to 599, made once (a response's head is built per request)."""


class Connection(Protocol):
    """What an exchange asks of its client connection (:mod:`app.http.connection`).

    ``write_paused``: the transport's buffer is over its high-water mark and writes wait for
    :meth:`drained`. The exchange tells :meth:`answered` once its response is complete.
    """

    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    write_paused: bool

    def closing(self) -> bool:
        """Whether the connection is closing or closed."""

    def abort(self) -> None:
        """Drop the connection at once, unflushed."""

    def resume_reading(self) -> None:
        """Read the client again: the app takes the body that was read ahead."""

    def drained(self) -> Awaitable[None]:
        """What completes once the connection takes writes again (or is lost)."""

    def answered(self, exchange: Exchange) -> None:
        """``exchange``'s response is complete."""


class Exchange:
    """One request and its response on a client connection: ASGI's and the direct interface.

    The request's body is buffered as it arrives and handed to ``receive``; the response is
    written through ``send`` or, without messages, through :meth:`start`, :meth:`write` and
    :meth:`end` (:class:`app.http.writer.ResponseWriter`). Once the connection is lost nothing is
    written and ``receive`` answers ``http.disconnect``.
    """

    __slots__ = (
        "_chunked", "_conn", "_continue", "_event", "_gone", "_head", "_left", "_no_body",
        "_signalled", "_taken", "body",
        "complete", "disconnected", "keep_alive", "more_body", "scope", "started",
    )  # fmt: skip

    def __init__(
        self, conn: Connection, scope: Scope, keep_alive: bool, expect_continue: bool
    ) -> None:
        self._conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self._continue = expect_continue
        # Made only when receive must wait: a relayed body has usually arrived whole.
        self._event: asyncio.Event | None = None
        self._signalled = False
        self.body = bytearray()
        self.more_body = True
        self._taken = False
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
        if self._event is None:
            self._signalled = True
        else:
            self._event.set()

    def arrived_body(self) -> bytes | None:
        """The request's whole body, taken at once if all of it has arrived.

        None while more is to come, or once any of it was received: then :meth:`receive`
        (:class:`app.http.body.ArrivedBody`).
        """
        if self.more_body or self.disconnected or self.complete or self._continue or self._taken:
            return None
        self._taken = True
        body, self.body = bytes(self.body), bytearray()
        return body

    async def receive(self) -> Message:
        """ASGI's ``receive``: the body as it arrives, then ``http.disconnect`` at the end."""
        conn = self._conn
        if self._continue:
            self._continue = False
            if not conn.closing():
                conn.transport.write(_CONTINUE)
        if not self.disconnected and not self.complete:
            conn.resume_reading()
            if self._signalled:  # something came since the last receive: no wait
                self._signalled = False
            else:
                if self._event is None:
                    self._event = asyncio.Event()
                await self._event.wait()
                self._event.clear()
        if self.disconnected or self.complete:
            return {"type": "http.disconnect"}
        self._taken = True
        body, self.body = bytes(self.body), bytearray()
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    # The response side.

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Set the status and headers; they are written with the body's first bytes."""
        if self.started:
            raise RuntimeError("the response was started already")
        # Composed first: a head refused (a field that would break it) leaves the response
        # unstarted, and the fault is answered with a 500.
        self._head = self._compose(status, headers)
        self.started = True
        self._continue = False  # answered before the body was asked for: no 100 now

    def write(self, data: bytes) -> Awaitable[None] | None:
        """Write ``data`` as one chunk of the body (:class:`~app.http.writer.ResponseWriter`)."""
        if not data or self.complete or self._no_body or self.disconnected:
            return None
        if self._chunked is None:
            self.chunk_by_default()
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        else:
            self._count(len(data))
        # :meth:`_out` for a part that is not the last, inline: the relay writes every event
        # here, and this saves two interpreted calls on each.
        head = self._head
        if head is not None:
            self._head = None
            data = head + data
        conn = self._conn
        transport = conn.transport
        if transport.is_closing():
            return None
        if conn.write_paused:
            return self._later(data, False)
        transport.write(data)
        return None

    def end(self, data: bytes) -> Awaitable[None] | None:
        """Write the last of the body: the response is complete (see :meth:`write`)."""
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
        parts = [STATUS_LINES.get(status) or status_line(status)]
        close = False
        # One scan of all names and one of all values: the joints ("-" in a name, a tab in a
        # value) are allowed there, so a joined scan finds exactly what a field's own would.
        if _BAD_NAME.search(b"-".join([name for name, _ in headers])) or _BAD_VALUE.search(
            b"\t".join([value for _, value in headers])
        ):
            bad = next(n for n, v in headers if _BAD_NAME.search(n) or _BAD_VALUE.search(v))
            raise RuntimeError(f"invalid response header {bad!r}")
        for name, value in headers:
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
        """Serve the request with ``app``; a fault is logged, then answered or the link cut.

        Once served, the exchange lets go of its scope: the scope holds the exchange (the app's
        writer and body), and the pair would otherwise wait for the collector, with the scope's
        headers, state and trace, instead of going with the last reference.
        """
        try:
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
        finally:
            self.scope = {}

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
        self.received()

"""The gateway's HTTP/1.1 front end: every client connection, on asyncio and httptools.

uvicorn runs the process, the lifespan and the signals, and hands each accepted connection to
:class:`FrontProtocol` (its documented ``http=`` option takes a protocol class). From there the
connection is the gateway's own: httptools' request parser (here), one
:class:`~app.http.exchange.Exchange` per request, answered in order (pipelined requests wait
their turn) and kept alive between requests (:mod:`app.http.connection`).

Every request reaches the ASGI app (FastAPI, the trace, the relay) with a standard ``http``
scope. A response can be written two ways, one exchange's bytes either way:

* ASGI's ``send`` (every route): the head is held until the first body bytes, so that they go
  out in one write, or until the end of the loop's turn if nothing follows;
* the exchange itself, found in the scope under :data:`WRITER_KEY` (:mod:`app.http.writer`):
  its ``write`` frames a chunk and hands it to the socket at once, in the caller's own callback,
  with no message, task or coroutine per event, and returns something to await only when the
  client's connection holds writes back (``pause_writing``). The relay streams this way; under
  another server it falls back to ``send`` (:class:`AsgiWriter`).

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
import json
import logging
import os
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import httptools
from starlette.types import ASGIApp

from app.api.errors import error_body
from app.http.body import BODY_KEY
from app.http.connection import ClientConnection, ClientLimits
from app.http.exchange import STATUS_LINES, Exchange
from app.http.writer import WRITER_KEY

__all__ = [
    "ABORT_KEY", "FIRST_BYTE_KEY", "HOOKS_KEY", "OVER_CAPACITY_KEY", "FrontHooks", "FrontProtocol",
    "front_protocol",
]  # fmt: skip

log = logging.getLogger(__name__)

FIRST_BYTE_KEY = "gateway.first_byte"
"""Scope key: the gateway clock's reading when the request's first byte was read."""
ABORT_KEY = "gateway.abort"
"""Scope key of a callable that drops the request's connection at once, unflushed."""
OVER_CAPACITY_KEY = "gateway.over_capacity"
"""Scope key set when the request's connection is beyond the connection cap."""
HOOKS_KEY = "gateway.front"
"""Key of the :class:`FrontHooks` in the lifespan's state."""

# A request body read ahead of the app beyond this pauses reading (as uvicorn does).
_BODY_HIGH_WATER = 65536
# What a closed connection's parser calls back: nothing (it has none of the callbacks).
_CLOSED = object()


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


class FrontProtocol(ClientConnection):
    """One client connection's HTTP/1.1: its requests parsed, their heads bounded (module doc).

    The transport and the exchanges' order are :class:`~app.http.connection.ClientConnection`'s;
    here the client's bytes become requests: each head is counted against the limits as it
    arrives and timed, a request's scope is built once its head is in, and a request that breaks
    a limit or HTTP's grammar is refused after the answers before it, and the connection closed.
    """

    def __init__(
        self,
        config: Any = None,
        server_state: Any = None,
        app_state: dict[str, Any] | None = None,
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        hooks = self.app_state.get(HOOKS_KEY)
        self._hooks = hooks if isinstance(hooks, FrontHooks) else None
        self.parser = httptools.HttpRequestParser(self)
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

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Take the transport (:class:`ClientConnection`); start the first head's deadline."""
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the head's deadline; then as :class:`ClientConnection` does."""
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)
        # The parser calls back into this protocol, which holds it: a connection per request
        # would leave that pair (and its transport) to the collector. Nothing is read now.
        self.parser = httptools.HttpRequestParser(_CLOSED)

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
        scope[WRITER_KEY] = scope[BODY_KEY] = exchange
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
            STATUS_LINES[status] + b"content-type: application/json\r\n"
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


def front_protocol(app: ASGIApp, limits: ClientLimits) -> type[FrontProtocol]:
    """:class:`FrontProtocol` serving ``app`` within ``limits`` (one instance per connection)."""

    class Front(FrontProtocol):
        pass

    Front.serves = (app,)
    Front.limits = limits
    return Front

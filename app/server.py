"""The HTTP server: uvicorn (httptools, uvloop) with limits on what clients may hold and send.

uvicorn's own options give the keep-alive timeout (``timeout_keep_alive``) and the connection
cap (``limit_concurrency``). With the httptools parser it has no header read timeout and no
bound on header size or count, so :class:`GatewayProtocol`, a small subclass of its httptools
protocol, adds them:

* the head (request line and headers) must be complete ``header_timeout_s`` after the
  connection opened (its first request) or after the request's first byte (later requests on a
  keep-alive connection): 408, and the connection is closed;
* the head may take ``max_header_bytes`` and ``max_headers`` fields: 431, and closed. The
  bytes are counted as httptools reports the URL and each header, and also as they arrive,
  before httptools has gathered them: it joins the pieces of a long header by copying, which a
  huge header turns quadratic, starving the event loop;
* the moment each request's first byte was read is noted in its scope (:mod:`app.arrival`);
* a request on a connection beyond ``limit_concurrency`` is marked in its scope and answered by
  :mod:`app.trace` with an OpenAI-shaped 503 ``gateway_saturated`` that is counted and logged;
  uvicorn's own answer would be a bare text 503 that the app never sees;
* a response's head (status line and headers) is written together with its first body bytes
  (:class:`HeadWithBody`), not on its own;
* each connection's kernel send buffer is fixed at ``client_send_buffer_bytes`` (not
  autotuned, up to megabytes), and a way to drop it is put in the request's scope: with it the
  relay cuts a client that stops reading (:mod:`app.relay`).

A refusal is written in OpenAI's error shape with an ``x-request-id``, counted and logged like
every response. The connection is then half-closed, and what the client still sends is read and
dropped for a moment (a lingering close), so that it reads the answer rather than a reset.
"""

from __future__ import annotations

import asyncio
import gc
import http
import json
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.arrival import FIRST_BYTE_KEY
from app.errors import error_body
from app.settings import Settings
from app.shutdown import Shutdown
from app.state import STATE_KEY, GatewayState
from app.trace import (
    ABORT_KEY,
    OVER_CAPACITY_KEY,
    endpoint_label,
    plain_outcome,
    request_id,
)

log = logging.getLogger(__name__)

# How long uvicorn waits beyond the gateway's own grace period before it cancels what is left:
# by then the gateway has cut every request with an error its client can read.
_CANCEL_MARGIN_S = 5.0
# After a refusal, how long what the client still sends is read and dropped before the
# connection is dropped.
_LINGER_S = 2.0
# How often the whole heap is collected (see GatewayServer.startup).
_FULL_COLLECTION_S = 300.0
_NEVER = 2**30


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """What one client connection may take."""

    header_timeout_s: float
    max_header_bytes: int
    max_headers: int
    send_buffer_bytes: int


class GatewayProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline and bounds on the head.

    Subclassed per server by :func:`protocol_class`, which sets :attr:`limits`.
    """

    limits: ClassVar[ClientLimits]

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        # Taken over from uvicorn, whose answer would bypass the app (see the module's doc).
        self._max_connections, self.limit_concurrency = self.limit_concurrency, None
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

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Bound the kernel's send buffer; start the first request's header deadline."""
        super().connection_made(transport)
        size = self.limits.send_buffer_bytes
        sock = transport.get_extra_info("socket")
        if size and sock is not None:
            # Fixed, not autotuned: what a client that stops reading holds stays small, and its
            # stall shows in the relay's sends soon (see app.relay).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop this connection's timers."""
        for timer in (self._head_timer, self._linger):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._linger = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Count the head's bytes before the parser sees them; refuse a head over the limit."""
        if self._refused:
            return  # the lingering close: read, dropped
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        # Checked after the parser ran: a read that ends the head may carry the body too.
        limit = self.limits.max_header_bytes
        if self._in_head and not self._refused and self._head_bytes > limit:
            self._refuse(431, f"The request's headers are larger than {limit} bytes.")

    # After a refusal the parser still runs to the end of the read it was given (httptools
    # cannot be paused, and an exception from a callback makes uvicorn log a parser error):
    # every callback below then does nothing.

    def on_message_begin(self) -> None:
        """A request's first bytes were read: note the time (:mod:`app.arrival`).

        A later request on a keep-alive connection starts its header deadline here.
        """
        if self._refused:
            return
        super().on_message_begin()
        state = self.app_state.get(STATE_KEY)
        if isinstance(state, GatewayState):
            self.scope[FIRST_BYTE_KEY] = state.clock()  # type: ignore[literal-required]
        if self._head_timer is None:
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        """Count the URL's bytes."""
        if not self._refused and self._fits(len(url)):
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        """Count the fields and their bytes; refuse past either limit."""
        if self._refused:
            return
        self._head_fields += 1
        if self._head_fields > self.limits.max_headers:
            self._refuse(431, f"The request has more than {self.limits.max_headers} headers.")
        elif self._fits(len(name) + len(value) + 4):  # with ": " and CRLF
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        """The head is in: stop its deadline; mark a request beyond the connection cap."""
        if self._refused:
            return
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        cap = self._max_connections
        if cap is not None and len(self.connections) > cap:
            self.scope[OVER_CAPACITY_KEY] = True  # type: ignore[literal-required]
        self.scope[ABORT_KEY] = self.transport.abort  # type: ignore[literal-required]
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not before:
            cycle.transport = HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]

    def on_body(self, body: bytes) -> None:
        """Pass the body on, unless the request was refused."""
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        """What arrives next is the next request's head."""
        if self._refused:
            return
        super().on_message_complete()
        self._in_head, self._head_bytes, self._head_size, self._head_fields = True, 0, 0, 0

    def send_400_response(self, msg: str) -> None:
        """Answer a parser error as uvicorn does, unless the request was refused already."""
        if not self._refused:
            super().send_400_response(msg)

    def _fits(self, size: int) -> bool:
        """Add ``size`` bytes to the head; refuse it when that is too many."""
        self._head_size += size
        limit = self.limits.max_header_bytes
        if self._head_size <= limit:
            return True
        self._refuse(431, f"The request's headers are larger than {limit} bytes.")
        return False

    def _arm_head_timer(self) -> None:
        self._head_started = self.loop.time()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._refused or self.transport.is_closing():
            return
        if self._head_bytes == 0:
            self.transport.close()  # a connection that never sent a byte: no request to answer
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # A pipelined request is late while the one before it is still answered: let that
            # answer finish, then close.
            self._refused = True
            cycle.keep_alive = False
            return
        timeout = self.limits.header_timeout_s
        self._refuse(408, f"The request's headers did not arrive within {timeout:g} s.")

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` in OpenAI's error shape, record it, and close gracefully."""
        self._refused = True
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        transport = self.transport
        if transport.is_closing():
            return
        code = "request_timeout" if status == 408 else "request_header_fields_too_large"
        rid = request_id(self.headers or ())
        body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
        phrase = http.HTTPStatus(status).phrase
        transport.write(
            f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nx-request-id: {rid}\r\nconnection: close\r\n\r\n"
            .encode() + body
        )  # fmt: skip
        if transport.can_write_eof():
            transport.write_eof()
        self._linger = self.loop.call_later(_LINGER_S, transport.abort)
        state = self.app_state.get(STATE_KEY)
        if isinstance(state, GatewayState):
            url = getattr(self, "url", b"") or b""
            endpoint = endpoint_label(url.partition(b"?")[0].decode("latin-1"))
            seconds = self.loop.time() - self._head_started
            state.recorder.plain(rid, endpoint, status, plain_outcome(status, endpoint), seconds)


class HeadWithBody:
    """One response's view of its connection's transport: the head waits for the body.

    uvicorn writes a response's status line and headers as soon as the app sends
    ``http.response.start``, and its first body bytes in a second write: a system call and a
    wake-up of the client more than needed, on every response. ASGI asks a server not to start
    sending before the first body message. The head is held until the next write, a close, or
    the end of the loop's current turn, whichever comes first, so nothing waits on it longer
    than the code that sent it runs.
    """

    __slots__ = ("_held", "_loop", "_transport", "_waiting")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._waiting = True
        """The head has not been written yet (an interim ``100 Continue`` does not count)."""

    def write(self, data: bytes) -> None:
        """Write ``data``, holding the response's head to go out with what follows it."""
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif self._waiting and not data.startswith(b"HTTP/1.1 100 "):
            self._waiting = False
            self._held = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        """Write what is held, then close the connection."""
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        """Whether the connection is closing or closed."""
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def protocol_class(settings: Settings) -> type[GatewayProtocol]:
    """:class:`GatewayProtocol` with ``settings``' limits (uvicorn creates one per connection)."""

    class Protocol(GatewayProtocol):
        limits = ClientLimits(
            settings.header_timeout_s, settings.max_header_bytes, settings.max_headers,
            settings.client_send_buffer_bytes,
        )  # fmt: skip

    return Protocol


def server_config(app: Any, settings: Settings, **options: Any) -> uvicorn.Config:
    """The uvicorn configuration that serves ``app``; ``options`` override its entries."""
    values: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "loop": "uvloop",
        "http": protocol_class(settings),
        "access_log": False,  # the gateway logs every request itself (app.record)
        "log_level": settings.log_level.lower(),
        "timeout_keep_alive": settings.keep_alive_timeout_s,
        "limit_concurrency": settings.max_connections,
        # Counted from when the listener closes, after the drain delay.
        "timeout_graceful_shutdown": max(
            1, round(settings.shutdown_grace_s - settings.drain_delay_s + _CANCEL_MARGIN_S)
        ),
    }
    values.update(options)
    return uvicorn.Config(app, **values)


def collect_on_a_timer(
    loop: asyncio.AbstractEventLoop, every_s: float = _FULL_COLLECTION_S
) -> Callable[[], None]:
    """Keep full garbage collections out of requests; return what undoes it.

    Everything built so far (modules, the app, its lifespan's state) lives as long as the
    process: frozen, out of the collector's sight, a full collection no longer walks it
    (~70,000 objects, 50 ms on a 2-vCPU VM, paid by whichever request was allocating). The
    oldest generation then holds every running stream's objects (~150 each); Python starts a
    full collection whenever it grew by a quarter, so while streams ramp up it walks them over
    and over: at 6,000 streams that stopped the event loop for 0.8-1.4 s at a time, connects to
    the workers timed out and healthy workers were ejected. Full collections run every
    ``every_s`` instead; the young generations, where most cycles die, are collected as before.
    """
    gc.freeze()
    young, middle, oldest = gc.get_threshold()
    gc.set_threshold(young, middle, _NEVER)
    handle: asyncio.TimerHandle | None = None

    def collect() -> None:
        nonlocal handle
        gc.collect()
        handle = loop.call_later(every_s, collect)

    def undo() -> None:
        if handle is not None:
            handle.cancel()
        gc.set_threshold(young, middle, oldest)
        gc.unfreeze()

    handle = loop.call_later(every_s, collect)
    return undo


class GatewayServer(uvicorn.Server):
    """uvicorn's server with a drain (:mod:`app.shutdown`).

    The first SIGTERM or SIGINT starts the drain, and the listener closes only after its delay;
    a second signal stops at once.
    """

    def __init__(self, config: uvicorn.Config, shutdown: Shutdown) -> None:
        super().__init__(config)
        self._shutdown = shutdown
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Remember the loop the signal handler hands the drain to; freeze the start-up heap."""
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        collect_on_a_timer(self._loop)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Start the drain, or stop now if it had started."""
        loop = self._loop
        if self._shutdown.draining or loop is None:
            super().handle_exit(sig, frame)
            return
        # A signal handler runs between two bytecodes of the loop's thread: hand over safely.
        loop.call_soon_threadsafe(self._drain, sig)

    def _drain(self, sig: int) -> None:
        assert self._loop is not None
        self._shutdown.begin(self._loop)
        self._loop.call_later(self._shutdown.drain_delay_s, super().handle_exit, sig, None)

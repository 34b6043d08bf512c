"""A client connection's transport and its exchanges, answered in order (:class:`ClientConnection`).

The transport's side of the front end (:mod:`app.http.front`): the kernel's send buffer, reading
paused and resumed, writes held back while the client does not read, one :class:`Exchange` per
request answered at a time (pipelined ones wait their turn), the idle keep-alive and the
lingering close after a refusal. What the client's bytes mean (parsing, the head's limits, which
requests are refused) is the subclass's, :class:`app.http.front.FrontProtocol`.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from starlette.types import ASGIApp

from app.http.exchange import Exchange

# After a refusal, how long what the client still sends is read and dropped before the
# connection is dropped.
_LINGER_S = 2.0


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """What one client connection may take."""

    header_timeout_s: float
    max_header_bytes: int
    max_headers: int
    send_buffer_bytes: int
    keep_alive_s: float
    max_connections: int | None


class ClientConnection(asyncio.Protocol):
    """One client connection's transport and exchanges (the :class:`Exchange`'s connection).

    Made per server by :func:`app.http.front.front_protocol`, which sets :attr:`serves` and
    :attr:`limits`. uvicorn creates one per connection with its configuration, its server state
    (the connections and request tasks it waits for at shutdown) and the lifespan's state.
    Reading stays paused while a refusal waits to be written: nothing after a refused request is
    read as a request.
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
        self._connections: set[Any] = getattr(server_state, "connections", set())
        self._tasks: set[asyncio.Task[None]] = getattr(server_state, "tasks", set())
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
        self._linger: asyncio.TimerHandle | None = None
        self._refused = False
        """A request was refused: what the client still sends is read and dropped."""
        self._refusal: bytes | None = None
        """A refusal waiting for the answers to the requests before it."""

    # The transport's side.

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Bound the kernel's send buffer; note both ends' addresses."""
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

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the timers; tell the requests in flight; let waiting writes go."""
        self._connections.discard(self)
        for timer in (self._linger, self._keep_alive):
            if timer is not None:
                timer.cancel()
        self._linger = self._keep_alive = None
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

    def _write_refusal(self) -> None:
        """Write the refusal waiting, half-close, and read and drop what follows a while."""
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

"""HTTP/1.1 to the workers over asyncio Protocols, parsed by httptools: the relay's own client.

The relayed requests' path to the workers and back, on public APIs only (asyncio's Protocol and
Transport, httptools' parser). The rules:

* One request at a time per connection. A connection goes back to its worker's idle pool only
  when its response was read to the end, the worker kept it alive, and it was not closed; an
  idle one is closed after ``keepalive_s`` (under the 5 s after which vLLM's server closes it
  itself, so a request is never sent on a connection the worker is closing at that moment). A
  request that finds its reused connection closed before any byte of the answer came is sent
  again once, on a new connection: the worker never saw it.
* A body is handed on in the connection's own ``data_received`` callback, without a task, a
  future or a coroutine per piece, as the parser yields it: a chunk that came in one read is
  one piece (a streaming worker writes each SSE event as one chunk), one cut across reads
  comes in pieces, and the caller finds its own boundaries (the relay's are the events).
* Backpressure: a sink that cannot take more at once returns an awaitable; reading the worker
  stops (``pause_reading``) until the caller has awaited it and pushes again. Only what one read
  of the socket held more is kept meanwhile. Uploads wait while the worker's socket is full.
* The worker's bytes are parsed strictly: a response with both Content-Length and
  Transfer-Encoding, two Content-Lengths, a bad chunk size, an obsolete line fold or a NUL in a
  header is :class:`ProtocolError`, the worker's fault, and its connection is closed.

Errors form one tree (:class:`WireError`), each raised ``from`` its cause. The network sits
behind :data:`Connector`: tests connect to an in-memory worker instead of a socket.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import ssl
from collections.abc import Awaitable, Callable, Iterable
from typing import Final, cast
from urllib.parse import urlsplit

import httptools

_MAX_HEAD_BYTES: Final = 64 * 1024
_KEEPALIVE_S: Final = 4.0


class WireError(Exception):
    """Talking to a worker failed below HTTP's semantics."""


class ConnectFailed(WireError):
    """No connection could be opened (refused, unreachable, out of descriptors: see the cause)."""


class ConnectTimeout(WireError):
    """The connection was not open within the connect timeout."""


class ProtocolError(WireError):
    """The worker's bytes are not a valid HTTP/1.1 response."""


class ConnectionClosed(WireError):
    """The connection ended before the response did."""


Sink = Callable[[bytes], "Awaitable[None] | None"]
"""Takes a piece of a worker's body at once; returns an awaitable when it must wait first."""

ProtocolFactory = Callable[[], asyncio.Protocol]
Connector = Callable[
    [ProtocolFactory, str, int, "ssl.SSLContext | None"],
    Awaitable[tuple[asyncio.BaseTransport, asyncio.Protocol]],
]
"""Opens a connection to ``host:port`` (TLS with the context, if any) for the protocol made."""

# What a closed connection's parser calls back: nothing (it has none of the callbacks).
_CLOSED = object()


async def tcp_connect(
    factory: ProtocolFactory, host: str, port: int, tls: ssl.SSLContext | None
) -> tuple[asyncio.BaseTransport, asyncio.Protocol]:
    """The real network: ``loop.create_connection``."""
    loop = asyncio.get_running_loop()
    return await loop.create_connection(factory, host, port, ssl=tls)


@functools.lru_cache(maxsize=1024)
def endpoint(
    base_url: str, path: str, api_key: str | None, method: bytes = b"POST"
) -> tuple[str, int, bool, bytes]:
    """A worker endpoint's host, port, TLS, and the head every request to it starts with.

    Built once: the request line, ``host``, the worker's key (never the client's) and identity
    encoding, so that the bytes sent are the gateway's own. The head is open: the caller adds
    its own fields and the blank line that ends it.
    """
    url = urlsplit(f"{base_url}{path}")
    tls = url.scheme == "https"
    host = url.hostname or "localhost"
    port = url.port or (443 if tls else 80)
    target = url.path + (f"?{url.query}" if url.query else "")
    head = b"%s %s HTTP/1.1\r\nhost: %s\r\naccept-encoding: identity\r\n" % (
        method, target.encode("ascii"), url.netloc.encode("ascii"),
    )  # fmt: skip
    if api_key:
        head += b"authorization: Bearer %s\r\n" % api_key.encode("latin-1")
    return host, port, tls, head


class Response:
    """A worker's response: its status and headers once its head came, then its body.

    Read the body with :meth:`push` (streams) or :meth:`read` (whole), once; then :meth:`close`.
    """

    __slots__ = ("_conn", "_ended", "_error", "_pieces", "_waiter", "headers", "sink", "status")

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        """The head's fields, names in lower case, in the order the worker sent them."""
        self._pieces: collections.deque[bytes] = collections.deque()
        self.sink: Sink | None = None
        """What takes the body's pieces now, while :meth:`push` waits (None: they are kept)."""
        self._waiter: asyncio.Future[Awaitable[None] | None] | None = None
        self._ended = False
        self._error: WireError | None = None

    def header(self, name: bytes) -> bytes | None:
        """The first value of the field ``name`` (lower case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def complete(self) -> bool:
        """Whether the whole body was received."""
        return self._ended

    async def push(self, sink: Sink) -> Awaitable[None] | None:
        """Hand the body to ``sink`` as it arrives, in the connection's callback.

        Returns None at the body's end, or what ``sink`` returned when it could not take more
        at once: nothing more is handed on, and the worker is not read, until the caller has
        awaited that and calls again. A connection error is raised (:class:`WireError`) after
        the pieces that came before it; a fault of ``sink`` is raised as it is.
        """
        while self._pieces:
            pending = sink(self._pieces.popleft())
            if pending is not None:
                return pending
        if self._error is not None:
            raise self._error
        if self._ended:
            return None
        waiter: asyncio.Future[Awaitable[None] | None] = self._conn.loop.create_future()
        self._waiter = waiter
        self.sink = sink
        self._conn.resume()
        try:
            return await waiter
        finally:
            self.sink = self._waiter = None

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body (at most ``limit`` bytes of it, if given, then what has come)."""
        parts: list[bytes] = []
        if limit is None:
            while await self.push(parts.append) is not None:
                pass
            return b"".join(parts)
        size = 0
        enough = self._conn.loop.create_future()
        enough.set_result(None)

        def take(piece: bytes) -> Awaitable[None] | None:
            nonlocal size
            parts.append(piece)
            size += len(piece)
            return enough if size > limit else None

        while size <= limit and await self.push(take) is not None:
            pass
        return b"".join(parts)

    def close(self) -> None:
        """Done with the response: its connection is kept for the next request if it can be."""
        self._conn.finish(self)

    # The connection calls these, from its parser's callbacks.

    def keep(self, piece: bytes) -> None:
        """A piece of the body came while nothing takes it: kept until the next :meth:`push`.

        While :attr:`sink` is set, the connection hands each piece to it instead, and calls
        :meth:`stop` when the sink cannot take more.
        """
        self._pieces.append(piece)

    def stop(self, outcome: Awaitable[None] | Exception) -> None:
        """The sink cannot take more now: reading stops, and :meth:`push` returns ``outcome``.

        An awaitable to wait for before pushing again, or the sink's fault, raised by it.
        """
        self.sink = None
        self._conn.pause()
        self._settle(outcome)

    def _settle(self, outcome: Awaitable[None] | BaseException | None) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if isinstance(outcome, BaseException):
            waiter.set_exception(outcome)
        else:
            waiter.set_result(outcome)

    def end(self) -> None:
        """The body ended."""
        self._ended = True
        if self.sink is not None:
            self.sink = None
            self._settle(None)

    def fail(self, error: WireError) -> None:
        """The connection failed before the body ended."""
        if self._ended or self._error is not None:
            return
        self._error = error
        if self.sink is not None:
            self.sink = None
            self._settle(error)


class _Connection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection to a worker, carrying one request at a time."""

    def __init__(self, pool: _Pool) -> None:
        # Made in the loop's own callback (the connector's protocol factory). Kept: on Python
        # 3.11 each get_running_loop() is a getpid() system call, and a request asked several.
        self.loop = asyncio.get_running_loop()
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self._head: asyncio.Future[Response] | None = None
        self._head_bytes = 0
        self._keep_alive = False
        self._received = False
        """Any byte of the current request's answer came."""
        self._writable: asyncio.Future[None] | None = None
        self._paused = False
        self.closed = False
        self.idle_timer: asyncio.TimerHandle | None = None

    # asyncio's callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport (uvloop's are not ``asyncio.Transport`` subclasses, but alike)."""
        self.transport = cast("asyncio.Transport", transport)

    def data_received(self, data: bytes) -> None:
        """Parse the worker's bytes, handing the body on as it comes."""
        if self.response is None:
            self.abort()  # bytes nobody asked for: the connection is no good
            return
        self._received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._broken(ProtocolError("the worker switched protocols"))
        except httptools.HttpParserError as exc:
            self._broken(ProtocolError(f"invalid response from the worker: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        """The connection ended: a response still coming fails (or ends, if read to close)."""
        self.closed = True
        # The parser calls back into this connection, which holds it: the pair would be left
        # to the collector. Nothing is read now.
        self._parser = httptools.HttpResponseParser(_CLOSED)
        self._pool.forget(self)
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        response = self.response
        if response is None:
            return
        if self._head is not None and not self._head.done():
            error = ConnectionClosed("the worker closed the connection before answering")
            error.__cause__ = exc
            self._head.set_exception(error)
        elif self._delimited_by_close(response):
            response.end()
        else:
            error = ConnectionClosed("the worker closed the connection mid-response")
            error.__cause__ = exc
            response.fail(error)

    def pause_writing(self) -> None:
        """The worker's socket is full: uploads wait."""
        if self._writable is None or self._writable.done():
            self._writable = self.loop.create_future()

    def resume_writing(self) -> None:
        """Uploads may write again."""
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # httptools' callbacks

    def on_status(self, status: bytes) -> None:
        """Count the status line's bytes."""
        self._count(len(status))

    def on_header(self, name: bytes, value: bytes) -> None:
        """Keep the head's fields (not the trailers')."""
        self._count(len(name) + len(value))
        response = self.response
        if response is not None and self._head is not None and not self._head.done():
            response.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        """The head is in: the request's caller gets the response."""
        response, head = self.response, self._head
        if response is None or head is None or head.done():
            return
        response.status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()
        head.set_result(response)

    # No chunk callbacks: the parser then calls into Python once per piece of body, not three
    # times per chunk. A chunk cut across reads comes as two pieces; the relay's event
    # splitter, not the chunking, says where an event ends.

    def on_body(self, body: bytes) -> None:
        """A piece of the body: to the response's sink at once, or kept for its next push."""
        response = self.response
        if response is None:
            return
        sink = response.sink
        if sink is None:
            response.keep(body)
            return
        try:
            pending = sink(body)
        except Exception as exc:  # a fault of the sink's must not reach the parser
            response.stop(exc)
            return
        if pending is not None:
            response.stop(pending)

    def on_message_complete(self) -> None:
        """The response ended."""
        if self.response is not None:
            self.response.end()

    # The pool's and the response's side

    async def send(self, data: Iterable[bytes]) -> Response:
        """Write a request (its pieces waiting while the worker's socket is full); its head."""
        if self.closed or self.transport is None:
            raise ConnectionClosed("the connection closed before the request was sent")
        self.response = Response(self)
        head: asyncio.Future[Response] = self.loop.create_future()
        self._head = head
        self._head_bytes = 0
        self._received = False
        # The parser goes on to the next response on a kept connection (after an error the
        # connection is closed, never reused).
        for piece in data:
            if self.closed:
                break
            self.transport.write(piece)
            writable = self._writable
            if writable is not None and not writable.done():
                await writable
        return await head

    @property
    def received(self) -> bool:
        """Whether any byte of the current request's answer came."""
        return self._received

    def pause(self) -> None:
        """Stop reading the worker until :meth:`resume`."""
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        """Read the worker again."""
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def finish(self, response: Response) -> None:
        """The caller is done with ``response``: keep the connection, or close it."""
        if response is not self.response:
            return
        self.response = self._head = None
        if response.complete and self._keep_alive and not self.closed:
            self.resume()  # a sink that waited on the last chunk left it paused
            self._pool.keep(self)
        else:
            self.abort()

    def drop(self) -> None:
        """Give up on the request under way (cancelled, or failed): the connection is closed."""
        head = self._head
        self.response = self._head = None
        if head is not None and not head.done():
            head.cancel()
        self.abort()

    def abort(self) -> None:
        """Drop the connection at once (a worker mid-answer sees it and aborts the request)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > _MAX_HEAD_BYTES:
            raise httptools.HttpParserError(f"response head over {_MAX_HEAD_BYTES} bytes")

    def _broken(self, error: ProtocolError) -> None:
        head, response = self._head, self.response
        if head is not None and not head.done():
            head.set_exception(error)
        elif response is not None:
            response.fail(error)
        self.abort()

    def _delimited_by_close(self, response: Response) -> bool:
        """A head without Content-Length or chunking: the body ends with the connection."""
        framing = (b"content-length", b"transfer-encoding")
        return all(name not in framing for name, _ in response.headers)


class _Pool:
    """One worker's idle connections, newest last; taking or forgetting one costs O(1)."""

    def __init__(self, keepalive_s: float) -> None:
        # A dict as an ordered set: a connection that closes is forgotten without a scan of
        # thousands of idle ones (their keep-alives end together after a burst).
        self.idle: dict[_Connection, None] = {}
        self._keepalive_s = keepalive_s

    def take(self) -> _Connection | None:
        while self.idle:
            conn, _ = self.idle.popitem()
            _disarm(conn)
            if not conn.closed:
                return conn
        return None

    def keep(self, conn: _Connection) -> None:
        conn.idle_timer = conn.loop.call_later(self._keepalive_s, conn.abort)
        self.idle[conn] = None

    def forget(self, conn: _Connection) -> None:
        _disarm(conn)
        self.idle.pop(conn, None)

    def close(self) -> None:
        while self.idle:
            conn, _ = self.idle.popitem()
            _disarm(conn)
            conn.abort()


def _disarm(conn: _Connection) -> None:
    """Stop an idle connection's keep-alive timer."""
    if conn.idle_timer is not None:
        conn.idle_timer.cancel()
        conn.idle_timer = None


class WireClient:
    """The relay's client: a pool of kept-alive connections per worker (host, port, TLS).

    The pools have no limit of their own: the relay's budget of worker connections is checked
    before a request is sent (:class:`app.fleet.upstream.UpstreamSlots`).
    """

    def __init__(
        self,
        connect_timeout_s: float,
        *,
        keepalive_s: float = _KEEPALIVE_S,
        connector: Connector = tcp_connect,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        """How long a connect may take."""
        self._keepalive_s = keepalive_s
        self._connector = connector
        self._pools: dict[tuple[str, int, bool], _Pool] = {}
        self._tls: ssl.SSLContext | None = None

    async def request(
        self, host: str, port: int, tls: bool, data: Callable[[], Iterable[bytes]]
    ) -> Response:
        """Send the request ``data()`` makes (head and body); the response once its head came.

        ``data`` is called again if the request must be sent once more on a new connection.
        """
        key = (host, port, tls)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(self._keepalive_s)
        conn = pool.take()
        if conn is not None:
            try:
                return await self._send(conn, data())
            except ConnectionClosed:
                if conn.received:
                    raise
                # The worker closed the kept connection as the request went out: it never saw
                # it. Once more, on a new connection.
        conn = await self._connect(pool, host, port, tls)
        return await self._send(conn, data())

    async def _send(self, conn: _Connection, data: Iterable[bytes]) -> Response:
        try:
            return await conn.send(data)
        except BaseException:
            conn.drop()  # cancelled mid-request, or failed: its state is unknown
            raise

    async def _connect(self, pool: _Pool, host: str, port: int, tls: bool) -> _Connection:
        context = self._tls_context() if tls else None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, protocol = await self._connector(lambda: _Connection(pool), host, port, context)
        except TimeoutError as exc:
            raise ConnectTimeout(f"no connection to {host}:{port} within the timeout") from exc
        except OSError as exc:
            raise ConnectFailed(f"no connection to {host}:{port}: {exc}") from exc
        assert isinstance(protocol, _Connection)
        return protocol

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def close(self) -> None:
        """Close every idle connection (those in use close as their requests end)."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def idle_connections(self) -> int:
        """Connections kept for the next request, over every worker."""
        return sum(len(pool.idle) for pool in self._pools.values())

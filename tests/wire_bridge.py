"""An in-memory network for the relay's client: HTTP/1.1 bytes in, an httpx transport's answer out.

The relay talks to workers through :class:`app.fleet.wire.WireClient`, whose network is a
:data:`app.fleet.wire.Connector`. :func:`bridge` gives one whose every connection is served by an
httpx transport (the scripted workers of :mod:`tests.fake_upstream`, behind
``httpx.MockTransport``): the request bytes the client writes are parsed (httptools), handed to the
transport as an ``httpx.Request``, and its response written back as the HTTP/1.1 bytes a server
would send, a chunk per piece of a streamed body, at the pace the body comes and only while the
client reads.

What a worker does to its connection the transport says by raising: any ``httpx.TransportError``
drops the connection (before the head or mid-body), with the error as its cause. A client that
closes its connection closes the response, so a scripted worker sees its generation stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Any

import httptools
import httpx

from app.fleet.wire import Connector, ProtocolFactory

# Fields a server sets itself for the body it writes; the transport's own are not passed on.
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"connection"})


def bridge(transport: httpx.AsyncBaseTransport) -> Connector:
    """A connector whose connections are answered by ``transport``."""

    async def connect(
        factory: ProtocolFactory, host: str, port: int, tls: ssl.SSLContext | None
    ) -> tuple[asyncio.BaseTransport, asyncio.Protocol]:
        protocol = factory()
        conn = _Conn(protocol, transport, "https" if tls else "http", host, port)
        protocol.connection_made(conn)
        return conn, protocol

    return connect


class _Conn(asyncio.Transport):
    """One connection: requests parsed as they are written, answered one after another."""

    def __init__(
        self,
        protocol: asyncio.Protocol,
        transport: httpx.AsyncBaseTransport,
        scheme: str,
        host: str,
        port: int,
    ) -> None:
        super().__init__()
        self._protocol = protocol
        self._transport = transport
        self._origin = f"{scheme}://{host}:{port}"
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._queue: asyncio.Queue[httpx.Request] = asyncio.Queue()
        self._reading = asyncio.Event()
        self._reading.set()
        self._closing = False
        self._server = asyncio.get_running_loop().create_task(self._serve())

    # What the client's protocol calls.

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes of a request."""
        if not self._closing:
            self._parser.feed_data(bytes(data))

    def is_closing(self) -> bool:
        """Whether the connection is closing or closed."""
        return self._closing

    def close(self) -> None:
        """Close: the response being written stops."""
        self.abort()

    def abort(self) -> None:
        """Drop the connection: the response being written stops, its body is closed."""
        if self._closing:
            return
        self._closing = True
        self._server.cancel()
        asyncio.get_running_loop().call_soon(self._protocol.connection_lost, None)

    def pause_reading(self) -> None:
        """The client takes nothing more for now."""
        self._reading.clear()

    def resume_reading(self) -> None:
        """The client reads again."""
        self._reading.set()

    def is_reading(self) -> bool:
        """Whether the client reads."""
        return self._reading.is_set()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """Nothing a socket would tell."""
        return default

    def get_write_buffer_size(self) -> int:
        """Everything written was taken at once."""
        return 0

    # httptools' callbacks for the request.

    def on_url(self, url: bytes) -> None:
        """Gather the target."""
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        """Gather a field."""
        self._headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        """Gather the body."""
        self._body.append(body)

    def on_message_complete(self) -> None:
        """A whole request: queue it for the transport."""
        method = self._parser.get_method().decode()
        request = httpx.Request(
            method,
            self._origin + self._url.decode(),
            headers=self._headers,
            content=b"".join(self._body),
        )
        self._url, self._headers, self._body = b"", [], []
        self._queue.put_nowait(request)

    # The server's side.

    async def _serve(self) -> None:
        while True:
            request = await self._queue.get()
            try:
                response = await self._transport.handle_async_request(request)
            except httpx.TransportError as exc:
                self._drop(exc)
                return
            try:
                await self._answer(response)
            except httpx.TransportError as exc:
                self._drop(exc)
                return
            finally:
                with contextlib.suppress(Exception):
                    await response.aclose()

    async def _answer(self, response: httpx.Response) -> None:
        head = [b"HTTP/1.1 %d %s\r\n" % (response.status_code, response.reason_phrase.encode())]
        head += [
            b"%s: %s\r\n" % (name, value)
            for name, value in response.headers.raw
            if name.lower() not in _FRAMING
        ]
        if response.is_stream_consumed:
            # A body given whole (``content=``, ``json=``): sent with its length, as vLLM does.
            body = response.content
            head.append(b"content-length: %d\r\n\r\n" % len(body))
            await self._deliver(b"".join(head) + body)
            return
        head.append(b"transfer-encoding: chunked\r\n\r\n")
        await self._deliver(b"".join(head))
        async for piece in response.aiter_raw():
            if piece:
                await self._deliver(b"%x\r\n%s\r\n" % (len(piece), piece))
        await self._deliver(b"0\r\n\r\n")

    async def _deliver(self, data: bytes) -> None:
        await self._reading.wait()
        if not self._closing:
            self._protocol.data_received(data)

    def _drop(self, exc: BaseException) -> None:
        if self._closing:
            return
        self._closing = True
        self._protocol.connection_lost(ConnectionResetError(str(exc)))

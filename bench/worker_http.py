"""The HTTP/1.1 server side of the bench's workers, :mod:`bench.fake_worker` and the sim's.

A bare ``asyncio.Protocol`` (:mod:`bench.sim_worker` too): one keep-alive connection answering
its requests one at a time, in order.

A worker subclasses :class:`WorkerConnection`: :meth:`~WorkerConnection.dispatch` answers a
request (with :meth:`~WorkerConnection.reply`, or later, holding :attr:`~WorkerConnection.busy`
true until its answer is written and then calling :meth:`~WorkerConnection.resume`), and
:meth:`~WorkerConnection.lost` drops what a request in flight holds when its client goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any, Final, cast

MAX_HEAD: Final = 64 * 1024
MAX_BODY: Final = 8 * 1024 * 1024
_REASONS: Final = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
}


def dumps(obj: Any) -> bytes:
    """Compact JSON, as vLLM writes it."""
    return json.dumps(obj, separators=(",", ":")).encode()


def error_body(status: int, message: str, err_type: str, param: str | None = None) -> bytes:
    """The error body vLLM sends."""
    return dumps({"error": {"message": message, "type": err_type, "param": param, "code": status}})


def parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    """Request line and headers (names lower-cased; a repeated header keeps the last value)."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError("bad request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError("bad header line")
        headers[name.strip().lower()] = value.strip()
    return parts[0], parts[1], parts[2], headers


def dechunk(buf: bytearray, start: int) -> tuple[bytes, int] | None:
    """A chunked body starting at ``start``: (body, end offset), or None while incomplete."""
    body = bytearray()
    pos = start
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        try:
            size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
        except ValueError as exc:
            raise ValueError("bad chunk size") from exc
        pos = eol + 2
        if size == 0:
            # Trailers (rarely sent) end at an empty line.
            end = buf.find(b"\r\n\r\n", pos - 2)
            if end < 0:
                return None
            return bytes(body), end + 4
        if len(buf) < pos + size + 2:
            return None
        body += buf[pos : pos + size]
        pos += size + 2
        if len(body) > MAX_BODY:
            raise ValueError("body too large")


class WorkerConnection(asyncio.Protocol):
    """One client connection of a bench worker: requests parsed, bounded and answered in order.

    Rules: a head over 64 KiB is a 431, a body over 8 MiB a 413, any other malformed request a
    400, each closing the connection; HTTP/1.0 keeps alive only when asked, HTTP/1.1 unless
    told to close; while :attr:`busy` the next request waits in the buffer.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        """The client's transport; None once the connection is lost."""
        self.keep_alive = True
        """Whether the connection stays open after the current request's answer."""
        self.buf = bytearray()
        self.headers: dict[str, str] = {}
        """The headers of the request being dispatched (names lower-cased)."""

    @property
    def busy(self) -> bool:
        """Whether a request is still being answered (the next one waits)."""
        return False

    def dispatch(self, method: str, path: str, body: bytes) -> None:
        """Answer one request (``path`` without its query)."""
        raise NotImplementedError

    def lost(self) -> None:
        """The client went: drop what its request in flight holds."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the client's transport."""
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        """The client went: nothing more is written; see :meth:`lost`."""
        self.transport = None
        self.lost()

    def data_received(self, data: bytes) -> None:
        """Buffer ``data``; answer what is complete unless a request is being answered."""
        self.buf += data
        if not self.busy:
            self.resume()

    def resume(self) -> None:
        """Answer every complete request in the buffer until one keeps the connection busy."""
        while not self.busy and self.transport is not None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD:
                    self.reply_and_close(431, "request head too large")
                return
            try:
                method, target, version, headers = parse_head(bytes(self.buf[:end]))
                request = self._body(headers, end + 4)
            except _TooLarge:
                self.reply_and_close(413, "body too large")
                return
            except ValueError as exc:
                self.reply_and_close(400, str(exc))
                return
            if request is None:
                return
            body, consumed = request
            del self.buf[:consumed]
            connection = headers.get("connection", "").lower()
            self.keep_alive = (
                connection == "keep-alive" if version == "HTTP/1.0" else connection != "close"
            )
            self.headers = headers
            self.dispatch(method, target.split("?", 1)[0], body)

    def _body(self, headers: dict[str, str], start: int) -> tuple[bytes, int] | None:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            return dechunk(self.buf, start)
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError as exc:
            raise ValueError("bad content-length") from exc
        if length > MAX_BODY:
            raise _TooLarge
        if len(self.buf) < start + length:
            return None
        return bytes(self.buf[start : start + length]), start + length

    def reply(
        self, status: int, body: bytes, *, content_type: str | None = "application/json"
    ) -> None:
        """A whole answer with its length; the connection closed after it unless kept alive."""
        transport = self.transport
        if transport is None:
            return
        head = f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"
        if content_type is not None:
            head += f"content-type: {content_type}\r\n"
        head += f"content-length: {len(body)}\r\n"
        if not self.keep_alive:
            head += "connection: close\r\n"
        transport.write(head.encode() + b"\r\n" + body)
        if not self.keep_alive:
            transport.close()

    def reply_and_close(self, status: int, message: str) -> None:
        """An error answer in vLLM's shape, then the connection closed."""
        self.keep_alive = False
        self.reply(status, error_body(status, message, "BadRequestError"))
        self.buf.clear()


class _TooLarge(ValueError):
    """A body over :data:`MAX_BODY`."""


def bound_port(server: asyncio.Server) -> int:
    """The TCP port ``server`` listens on (useful after asking for port 0)."""
    port: int = server.sockets[0].getsockname()[1]
    return port


def run_until_interrupted(
    name: str, host: str, start: Callable[[], Awaitable[asyncio.Server]]
) -> None:
    """Run the server ``start`` makes, on uvloop where installed, until interrupted.

    Prints ``<name> listening on http://<host>:<port>`` first: the benchmarks read the port
    from that line when they passed port 0.
    """

    async def forever() -> None:
        server = await start()
        print(f"{name} listening on http://{host}:{bound_port(server)}", flush=True)
        async with server:
            await server.serve_forever()

    run: Callable[..., Any] = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        run = uvloop.run
    with contextlib.suppress(KeyboardInterrupt):
        run(forever())

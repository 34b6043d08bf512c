"""A minimal keep-alive HTTP/1.1 SSE client that timestamps content chunks as they arrive.

Built on raw asyncio streams rather than httpx so that the client's own per-chunk cost (and
therefore its contribution to measured latency) stays small and identical for every target. SSE
events are never JSON-decoded: a *content chunk* is an event whose bytes hold ``"content":"``
or ``"text":"`` followed by a character other than a quote, which excludes vLLM's role-only
chunk (``"content":""``), the usage chunk and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import time
from dataclasses import dataclass, field
from typing import Final

CONTENT_RE: Final = re.compile(rb'"(?:content|text)":\s?"[^"]')
_READ_SIZE: Final = 65536
_ERROR_BODY_KEEP: Final = 2048


class ProtocolError(Exception):
    """The server's response could not be parsed as HTTP/1.1."""


@dataclass(slots=True)
class StreamResult:
    """One request's outcome and, for a stream, when each content chunk arrived."""

    t_sent: float
    """``time.perf_counter()`` just before the request was written."""
    t_end: float = 0.0
    """``time.perf_counter()`` once the response was read (or failed)."""
    status: int = 0
    content_times: list[float] = field(default_factory=list)
    """Arrival time of each content chunk (the time its bytes were read from the socket)."""
    events: int = 0
    """Every ``data:`` event, content or not, including ``[DONE]``."""
    max_content_per_http_chunk: int = 0
    """Most content events carried by one HTTP chunk: above 1 means someone batched them."""
    done: bool = False
    """``data: [DONE]`` was received."""
    error: str | None = None
    body: bytes = b""
    """The start of a non-200 response's body, for diagnostics."""

    @property
    def ok(self) -> bool:
        """A 200 stream that ended with ``[DONE]``."""
        return self.status == 200 and self.done and self.error is None

    @property
    def ttft(self) -> float | None:
        """Request written to first content chunk, in seconds."""
        return self.content_times[0] - self.t_sent if self.content_times else None

    def itls(self) -> list[float]:
        """Gaps between consecutive content chunks, in seconds."""
        times = self.content_times
        return [b - a for a, b in itertools.pairwise(times)]


class SSEConnection:
    """One keep-alive connection; ``stream`` sends a request and reads its whole response."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._buf = bytearray()

    @property
    def connected(self) -> bool:
        """Whether a connection is open (it may still have been closed by the peer)."""
        return self._writer is not None and not self._writer.is_closing()

    async def connect(self) -> None:
        """Open the TCP connection (asyncio sets TCP_NODELAY on it)."""
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._buf.clear()

    async def close(self) -> None:
        """Close the connection, if open."""
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> StreamResult:
        """Send one request on this connection (reconnecting if needed) and read the response.

        Never raises for network or protocol failures: they end up in ``StreamResult.error``
        and the connection is dropped, to be reopened by the next call.
        """
        if not self.connected:
            await self.connect()
        assert self._writer is not None
        head = f"{method} {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
        if body or method == "POST":
            head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        for name, value in (headers or {}).items():
            head += f"{name}: {value}\r\n"
        data = head.encode() + b"\r\n" + body
        result = StreamResult(t_sent=time.perf_counter())
        try:
            self._writer.write(data)
            keep_alive = await self._read_response(result)
        except (OSError, ProtocolError, asyncio.IncompleteReadError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            keep_alive = False
        except asyncio.CancelledError:
            await self.close()
            raise
        result.t_end = time.perf_counter()
        if not keep_alive:
            await self.close()
        return result

    async def _fill(self) -> float:
        """Read whatever has arrived into the buffer; returns the arrival time."""
        assert self._reader is not None
        data = await self._reader.read(_READ_SIZE)
        if not data:
            raise ProtocolError("connection closed mid-response")
        self._buf += data
        return time.perf_counter()

    async def _read_response(self, result: StreamResult) -> bool:
        """Read one response into ``result``; returns whether the connection can be reused."""
        buf = self._buf
        while (end := buf.find(b"\r\n\r\n")) < 0:
            await self._fill()
        lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
        del buf[: end + 4]
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ProtocolError(f"bad status line {lines[0]!r}")
        result.status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        keep_alive = headers.get("connection", "").lower() != "close"
        sse = _SSEScanner(result)
        if headers.get("transfer-encoding", "").lower() == "chunked":
            await self._read_chunked(sse)
        elif "content-length" in headers:
            remaining = int(headers["content-length"])
            while len(buf) < remaining:
                await self._fill()
            sse.feed(bytes(buf[:remaining]), time.perf_counter())
            del buf[:remaining]
        else:
            # Close-delimited body: everything until EOF.
            assert self._reader is not None
            rest = await self._reader.read()
            sse.feed(bytes(buf) + rest, time.perf_counter())
            buf.clear()
            keep_alive = False
        if result.status != 200:
            result.body = sse.raw[:_ERROR_BODY_KEEP]
        return keep_alive

    async def _read_chunked(self, sse: _SSEScanner) -> None:
        buf = self._buf
        arrived = time.perf_counter()
        pos = 0
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                del buf[:pos]
                pos = 0
                arrived = await self._fill()
                continue
            try:
                size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
            except ValueError as exc:
                raise ProtocolError(f"bad chunk size {bytes(buf[pos:eol])[:40]!r}") from exc
            need = eol + 2 + size + 2
            if len(buf) < need:
                del buf[:pos]
                pos = 0
                arrived = await self._fill()
                continue
            if size == 0:
                # No trailers are expected: the terminator is "0\r\n\r\n".
                del buf[:need]
                return
            sse.feed(bytes(buf[eol + 2 : eol + 2 + size]), arrived)
            pos = need


class _SSEScanner:
    """Splits a byte stream into SSE events and records content chunks, without JSON."""

    __slots__ = ("_pending", "_result", "raw")

    def __init__(self, result: StreamResult) -> None:
        self._result = result
        self._pending = b""
        self.raw = b""

    def feed(self, payload: bytes, arrived: float) -> None:
        result = self._result
        if result.status != 200 and len(self.raw) < _ERROR_BODY_KEEP:
            self.raw += payload
        data = self._pending + payload
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        events = data.split(b"\n\n")
        self._pending = events.pop()
        in_chunk = 0
        for event in events:
            if b"data:" not in event:
                continue  # comments and keep-alives
            result.events += 1
            if CONTENT_RE.search(event) is not None:
                result.content_times.append(arrived)
                in_chunk += 1
            elif event.rstrip().endswith(b"data: [DONE]"):
                result.done = True
        if in_chunk > result.max_content_per_http_chunk:
            result.max_content_per_http_chunk = in_chunk

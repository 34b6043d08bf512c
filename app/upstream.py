"""Talking to a worker: one shared httpx client, and errors mapped onto the gateway's tree.

The network sits behind httpx's transport seam: tests pass an ``httpx.MockTransport`` (or an
ASGI app) for failures a real worker cannot produce on demand. In production the transport is
aiohttp's connection pool (through ``httpx-aiohttp``): httpcore's pool walked every pooled
connection, with a syscall each, for every request, so its cost per request grew with the
number of streams (at 128 streams half the gateway's CPU went there).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import logging
import resource
import typing
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport
from httpx_aiohttp.transport import AiohttpResponseStream

from app.errors import (
    GatewayError,
    GatewaySaturated,
    UpstreamClientError,
    UpstreamError,
    UpstreamInvalidResponse,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from app.looplag import fired_late
from app.metrics import EVENT_LOOP, UPSTREAM_CONNECTIONS, GatewayMetrics
from app.protocol import Upload
from app.settings import Settings
from app.workers import Worker

# Error bodies are read to pass the worker's message on; a runaway one is cut here.
_MAX_ERROR_BODY = 64 * 1024
# Idle connections to a worker are closed after this long: under the 5 s after which vLLM's
# server (uvicorn) closes them itself, so a request is never sent on a connection the worker is
# closing at that moment.
_KEEPALIVE_S = 4.0
log = logging.getLogger(__name__)

# Descriptors kept for everything but streams: the listener, probes and scrapes of every
# worker, log files, the event loop's own.
_RESERVED_FDS = 256
# What running out of file descriptors (or kernel socket buffers) looks like: the gateway's
# own limit, never a worker's fault.
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS})


class UpstreamSlots:
    """The gateway's own budget of requests open to the workers (one connection each).

    Checked before a request is sent: with the budget spent, the request is answered 503
    ``gateway_saturated`` at once, instead of waiting on the connection pool and then being
    blamed on a healthy worker.
    """

    __slots__ = ("_metrics", "in_use", "limit")

    def __init__(self, limit: int, metrics: GatewayMetrics) -> None:
        self.limit = limit
        self.in_use = 0
        self._metrics = metrics

    def take(self) -> None:
        """Take one slot, or raise :class:`GatewaySaturated`."""
        if self.in_use >= self.limit:
            raise self.saturated()
        self.in_use += 1

    def give(self) -> None:
        """Give a slot back."""
        self.in_use -= 1

    def saturated(self) -> GatewaySaturated:
        """The error for a spent budget, counted in ``gateway_saturated_total``."""
        return self._refusal(
            UPSTREAM_CONNECTIONS,
            f"The gateway has all {self.limit} of its connections to the workers in use "
            "(GATEWAY_MAX_UPSTREAM_CONNECTIONS)",
        )

    def late(self, seconds: float) -> GatewaySaturated:
        """The error for a connect the gateway's own busy loop let time out (``seconds`` taken)."""
        return self._refusal(
            EVENT_LOOP, f"The gateway was too busy to connect to a worker in time ({seconds:.1f} s)"
        )

    def exhausted(self, cause: OSError) -> GatewaySaturated:
        """The error for a connection the system would not give (out of file descriptors)."""
        return self._refusal(
            UPSTREAM_CONNECTIONS,
            f"The gateway could not open a connection to a worker ({cause.strerror or cause})",
        )

    def _refusal(self, resource: str, why: str) -> GatewaySaturated:
        self._metrics.saturated.labels(resource).inc()
        return GatewaySaturated(f"{why}; retry shortly.", 1.0)


def connection_budget(configured: int) -> int:
    """The relay's budget of worker connections: ``configured``, or what descriptors allow.

    Every stream holds two descriptors, its client's connection and its worker's. With fewer
    descriptors than that, the budget is cut to what fits (and said so in the log), so that the
    gateway runs out of its own budget, a fast 503 gateway_saturated, before it runs out of
    descriptors in the middle of accepting or connecting.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    fits = max(1, (soft - _RESERVED_FDS) // 2)
    if fits >= configured:
        return configured
    log.warning(
        "GATEWAY_MAX_UPSTREAM_CONNECTIONS=%d needs about %d file descriptors but the limit is %d: "
        "at most %d streams at once (raise the hard limit, e.g. ulimit -Hn)",
        configured, 2 * configured + _RESERVED_FDS, soft, fits,
    )  # fmt: skip
    return fits


class _WorkerTransport(AiohttpTransport):
    """aiohttp's pool, with its errors mapped onto httpx's as httpcore raised them.

    ``httpx-aiohttp`` maps every ``aiohttp.ClientConnectionError`` to ``ConnectTimeout``; a
    worker that drops the connection before answering is not a slow connect.
    """

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request``; the response's body is streamed."""
        try:
            response = await super().handle_async_request(request)
        except httpx.TransportError as exc:
            cause = exc.__cause__
            if isinstance(cause, aiohttp.ServerDisconnectedError):
                raise httpx.RemoteProtocolError(str(cause), request=request) from cause
            if isinstance(cause, aiohttp.ClientOSError) and not isinstance(
                cause, aiohttp.ClientConnectorError
            ):
                raise httpx.ReadError(str(cause), request=request) from cause
            raise
        if isinstance(response.stream, AiohttpResponseStream):
            chunks = _Chunks(response.stream)
            response.stream = chunks
            response.extensions[_READ_CHUNK] = chunks.read
            if chunks.pushes:
                response.extensions[_PUSH] = chunks
        return response


class _Chunks(httpx.AsyncByteStream):
    """A worker's body, handed on HTTP chunk by HTTP chunk, as the worker wrote it.

    A streaming worker writes each SSE event as one HTTP chunk. When the relay falls behind,
    several arrive in one socket read; handing the read on whole would merge them into one
    chunk to the client (re-chunking the stream). aiohttp's ``readchunk`` stops at each
    chunk's end, so every event is sent on by itself. (``httpx-aiohttp`` iterates
    ``iter_chunked(16384)``: a bounded read that gathers a list and joins it, for every event.)
    """

    def __init__(self, stream: AiohttpResponseStream) -> None:
        self._stream = stream
        self._reader = reader = stream._aiohttp_response.content
        self._readchunk = reader.readchunk
        # Pushing stands in for the reader's waiter, a slot of aiohttp's own StreamReader.
        self.pushes = type(reader) is aiohttp.StreamReader and hasattr(reader, "_waiter")

    async def read(self) -> bytes:
        """The next HTTP chunk of the body; ``b""`` at its end."""
        try:
            while True:
                chunk, chunk_end = await self._readchunk()
                if chunk or not chunk_end:
                    return chunk
        except _READ_ERRORS as exc:
            raise _mapped(exc) from exc

    @property
    def ready(self) -> bool:
        """Whether :meth:`read` has something to return at once (data, the end or an error)."""
        reader = self._reader
        return bool(reader._buffer) or reader.is_eof() or reader.exception() is not None

    async def push(self, sink: ChunkSink) -> Awaitable[None] | None:
        """Hand the body to ``sink`` as it arrives, in the network callback itself.

        Returns ``None`` at the body's end, or what ``sink`` returned when it could not take
        more at once (a send that must wait): nothing more is pushed until the caller has
        awaited that and called again (what arrives meanwhile waits in aiohttp's buffer, which
        pauses the socket when full). An error of the connection is raised as :meth:`read`
        raises it, one of ``sink``'s own as it is. Call only when not :attr:`ready`.
        """
        reader = self._reader
        done: asyncio.Future[Awaitable[None] | None] = asyncio.get_running_loop().create_future()
        waiter = _PushingWaiter(reader, sink, done)
        reader._waiter = waiter  # type: ignore[assignment]
        try:
            return await done
        except _READ_ERRORS as exc:
            raise _mapped(exc) from exc
        finally:
            waiter.sink = None
            if reader._waiter is waiter:  # type: ignore[comparison-overlap]
                reader._waiter = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while chunk := await self.read():
            yield chunk

    async def aclose(self) -> None:
        """Release the connection (to the pool, if the body was read to its end)."""
        await self._stream.aclose()


_READ_CHUNK = "gateway.read_chunk"
_PUSH = "gateway.push"

ChunkSink = Callable[[bytes], "Awaitable[None] | None"]
"""Takes a piece of a worker's body at once; returns an awaitable when it must wait first."""


_READ_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError)


def _mapped(exc: aiohttp.ClientError) -> httpx.TransportError:
    """The error aiohttp raised while reading a body, as httpx's."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return httpx.RemoteProtocolError(str(exc))
    return httpx.ReadError(str(exc))


class _PushingWaiter:
    """Stands where aiohttp's StreamReader keeps the future of a read waiting for data.

    The reader "wakes" its waiter from the connection's ``data_received``, after each piece of
    the body (``feed_data``), each chunk's end and the body's end (``feed_eof``), or with the
    connection's error (``set_exception``), and forgets it then. This one takes what was fed
    at once and hands it to the sink, in that same callback, then stands in again: no future,
    no task wake-up, no read coroutine per piece. Only the piece just fed is ever buffered
    here, so pieces (the worker's events) are handed on one by one, as ``readchunk`` would.
    """

    __slots__ = ("_done", "_reader", "sink")

    def __init__(
        self,
        reader: aiohttp.StreamReader,
        sink: ChunkSink,
        done: asyncio.Future[Awaitable[None] | None],
    ) -> None:
        self._reader = reader
        self.sink: ChunkSink | None = sink
        self._done = done

    def done(self) -> bool:
        """Never done: the reader only wakes a waiter that is not."""
        return False

    def set_result(self, _: object) -> None:
        """The reader has something for us: hand it on, then wait for the next piece."""
        sink, reader, done = self.sink, self._reader, self._done
        if sink is None or done.done():
            return
        try:
            # Reading resumes aiohttp's protocol, which may feed what it held back at once,
            # while this waiter is away: that is handed on too, piece by piece.
            while reader._buffer:
                pending = sink(reader.read_nowait())
                if pending is not None:
                    done.set_result(pending)
                    return
            if reader.is_eof():
                done.set_result(None)
                return
        except Exception as exc:  # a fault of the sink's must not reach aiohttp's parser
            done.set_exception(exc)
            return
        reader._waiter = self  # type: ignore[assignment]

    def set_exception(self, exc: BaseException) -> None:
        """The connection failed: the push ends with its error."""
        if self.sink is not None and not self._done.done():
            self._done.set_exception(exc)


def chunk_reader(response: httpx.Response) -> Callable[[], Awaitable[bytes]]:
    """A streamed response's ``read()``: its next chunk as the worker wrote it, ``b""`` at the end.

    From the worker transport, its chunks are read with no async iterator between: httpx's
    ``aiter_raw`` stacks three async generators, and every chunk a stream waits for then
    holds an awaitable of each (with their frames) until it comes. At 10,000 streams at a
    token a second those were a hundred thousand objects, always young, that each collection
    of the young generation walked: 30-120 ms pauses of the event loop. Any other transport
    (tests) is read through ``aiter_raw``.
    """
    read = response.extensions.get(_READ_CHUNK)
    if read is not None:
        return cast("Callable[[], Awaitable[bytes]]", read)
    chunks = response.aiter_raw()

    async def next_chunk() -> bytes:
        return await anext(chunks, b"")

    return next_chunk


def chunk_pusher(response: httpx.Response) -> ChunkPusher | None:
    """What pushes a streamed response's body to a sink as it arrives, when its transport can.

    Only the worker transport's bodies can be pushed (any other is read with
    :func:`chunk_reader`).
    """
    pusher = response.extensions.get(_PUSH)
    return cast("ChunkPusher", pusher) if pusher is not None else None


class ChunkPusher(typing.Protocol):
    """A body that can be pushed (:meth:`_Chunks.push`)."""

    @property
    def ready(self) -> bool:
        """Whether a read would return at once."""

    async def push(self, sink: ChunkSink) -> Awaitable[None] | None:
        """Push the body to ``sink`` until its end (None) or until ``sink`` must wait."""


def worker_transport() -> httpx.AsyncBaseTransport:
    """The transport to the workers: aiohttp's pool, created on the first request's loop.

    The pool itself has no limit: :class:`UpstreamSlots` is the relay's budget, checked before
    a request is sent, and probes, load scrapes and model discovery (a few per worker) must
    never wait behind streams.
    """

    def session() -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_S)
        return aiohttp.ClientSession(connector=connector, trust_env=False)

    return _WorkerTransport(client=session)


def make_client(
    settings: Settings, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """The client for every worker request (``transport`` replaces the network in tests).

    No read timeout: the relay enforces first-token and idle timeouts itself, because the
    first token can legitimately take far longer than the gap between two tokens.
    """
    return _WorkerClient(
        transport=transport or worker_transport(),
        timeout=httpx.Timeout(
            connect=settings.connect_timeout_s,
            read=None,
            write=settings.connect_timeout_s,
            pool=settings.connect_timeout_s,
        ),
        follow_redirects=False,
        trust_env=False,
    )


class _NoCookies(httpx.Cookies):
    """A cookie jar that keeps nothing."""

    def extract_cookies(self, response: httpx.Response) -> None:
        """Keep none of ``response``'s cookies."""


class _WorkerClient(httpx.AsyncClient):
    """httpx's client without a cookie jar.

    One client serves every client's requests: a cookie a worker set would be sent on with
    everyone's next requests. And httpx reads every response's headers for cookies through
    ``urllib``'s request and cookie jar objects, a cost on every request for nothing.
    """

    @property
    def cookies(self) -> httpx.Cookies:
        """Always empty."""
        return _NO_COOKIES

    @cookies.setter
    def cookies(self, cookies: object) -> None:
        pass


_NO_COOKIES = _NoCookies()


@contextlib.asynccontextmanager
async def worker_response(
    client: httpx.AsyncClient,
    slots: UpstreamSlots,
    worker: Worker,
    path: str,
    body: bytes | Upload,
    request_id: str,
) -> AsyncIterator[httpx.Response]:
    """Send a request to ``worker``; yield its response once the status line arrived.

    ``body`` is JSON, or an upload sent chunk by chunk as the client's bytes were kept (with
    their ``content-type``, whose boundary the form needs). The response's body is not read
    (the caller streams it); the response is closed, and its slot given back, when the block
    ends. A worker's 4xx is raised as :class:`UpstreamClientError`
    carrying the worker's own message; a 5xx, a broken connection or a response that is not
    OpenAI-shaped as the matching :class:`UpstreamError`; the gateway's own connection budget
    spent as :class:`GatewaySaturated`.
    """
    slots.take()
    try:
        response = await _send(client, slots, worker, path, body, request_id)
        try:
            yield response
        finally:
            await response.aclose()
    finally:
        slots.give()


async def _send(
    client: httpx.AsyncClient,
    slots: UpstreamSlots,
    worker: Worker,
    path: str,
    body: bytes | Upload,
    request_id: str,
) -> httpx.Response:
    spec = worker.spec
    url, template = _endpoint(spec.base_url, path, spec.api_key)
    headers = template.copy()
    headers["x-request-id"] = request_id
    if isinstance(body, Upload):
        headers["content-type"] = body.content_type
        # With the length given, the upload is sent as it came, not chunk-encoded.
        headers["content-length"] = str(body.size)
        request = httpx.Request("POST", url, headers=headers, content=_chunks_of(body))
    else:
        # The request's headers are all given, so httpx need not work any out: building a
        # request with ``content=`` looked each one up again, on every request.
        headers["content-length"] = str(len(body))
        request = httpx.Request("POST", url, headers=headers, stream=httpx.ByteStream(body))
        request.read()
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        response = await client.send(request, stream=True)
    except httpx.PoolTimeout as exc:
        raise slots.saturated() from exc
    except httpx.TimeoutException as exc:
        if isinstance(exc, httpx.ConnectTimeout):
            now = loop.time()
            if fired_late(started, now, client.timeout.connect):
                raise slots.late(now - started) from exc
            raise UpstreamUnavailable(
                f"Worker {worker.label} could not be reached in time."
            ) from exc
        raise UpstreamTimeout(f"Worker {worker.label} did not answer in time.") from exc
    except httpx.ConnectError as exc:
        exhausted = _exhausted(exc)
        if exhausted is not None:
            raise slots.exhausted(exhausted) from exc
        raise UpstreamUnavailable(f"Worker {worker.label} is not reachable.") from exc
    except httpx.TransportError as exc:
        raise UpstreamInvalidResponse(
            f"Worker {worker.label} closed the connection: {type(exc).__name__}."
        ) from exc
    if response.status_code < 400:
        return response
    try:
        raise await _status_error(worker, response)
    finally:
        await response.aclose()


async def _chunks_of(upload: Upload) -> AsyncIterator[bytes]:
    for chunk in upload.chunks:
        yield chunk


async def worker_get(
    client: httpx.AsyncClient, workers: list[Worker], path: str, timeout_s: float
) -> httpx.Response:
    """``GET path`` from the first of ``workers`` that answers it with 200 (e.g. ``/version``).

    Raises :class:`UpstreamUnavailable` when none does.
    """
    for worker in workers:
        spec = worker.spec
        headers = {"authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        try:
            response = await client.get(
                f"{spec.base_url}{path}", headers=headers, timeout=timeout_s
            )
        except httpx.HTTPError as exc:
            log.warning("GET %s from worker %s failed: %s", path, worker.label, exc)
            continue
        if response.status_code == 200:
            return response
    raise UpstreamUnavailable(f"No worker answered {path}.")


@functools.lru_cache(maxsize=1024)
def _endpoint(base_url: str, path: str, api_key: str | None) -> tuple[httpx.URL, httpx.Headers]:
    """A worker endpoint's URL and the headers every request to it carries, built once.

    Not ``client.build_request``: its default headers (httpx's user agent, gzip) are not
    wanted. The worker's key, never the client's; identity encoding, so that the bytes relayed
    are the worker's own. httpx parses a string URL in Python, so that is done once too.
    """
    url = httpx.URL(f"{base_url}{path}")
    headers = {
        "host": url.netloc.decode("ascii"),
        "content-type": "application/json",
        "accept-encoding": "identity",
    }
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return url, httpx.Headers(headers)


def _exhausted(exc: BaseException) -> OSError | None:
    """The "out of descriptors" error behind ``exc``, if that is why it failed."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno in _EXHAUSTED:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


async def _status_error(worker: Worker, response: httpx.Response) -> GatewayError:
    raw = response.content if response.is_stream_consumed else b""
    try:
        async for chunk in _unread(response):
            raw += chunk
            if len(raw) > _MAX_ERROR_BODY:
                break
    except httpx.TransportError:
        pass
    body = error_object(raw, response.status_code)
    if 400 <= response.status_code < 500:
        return UpstreamClientError(response.status_code, body)
    message = str(body["error"].get("message") or "")
    return UpstreamStatusError(
        f"Worker {worker.label} failed with status {response.status_code}: {message}"
    )


async def _unread(response: httpx.Response) -> AsyncIterator[bytes]:
    if not response.is_stream_consumed:
        async for chunk in response.aiter_raw():
            yield chunk


def error_object(raw: bytes, status: int) -> dict[str, Any]:
    """A worker's error body in the OpenAI shape, whatever shape vLLM's version sent it in."""
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict) and "message" in err:
            return {
                "error": {
                    "message": str(err.get("message")),
                    "type": err.get("type") or "invalid_request_error",
                    "param": err.get("param"),
                    "code": err.get("code", status),
                }
            }
        if "message" in payload:  # older vLLM: {"object": "error", "message", "type", ...}
            return {
                "error": {
                    "message": str(payload["message"]),
                    "type": payload.get("type") or "invalid_request_error",
                    "param": payload.get("param"),
                    "code": payload.get("code", status),
                }
            }
    text = raw.decode("utf-8", "replace").strip()[:500]
    return {
        "error": {
            "message": text or f"Worker returned status {status}.",
            "type": "invalid_request_error" if status < 500 else "server_error",
            "param": None,
            "code": status,
        }
    }


__all__ = [
    "ChunkPusher", "ChunkSink", "UpstreamError", "UpstreamSlots", "chunk_pusher", "chunk_reader",
    "connection_budget", "error_object", "make_client", "worker_get", "worker_response",
]  # fmt: skip

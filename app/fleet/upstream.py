"""Talking to a worker: the relay's requests, the control plane's, and errors on the gateway's tree.

Relayed requests go through the gateway's own HTTP/1.1 client (:mod:`app.fleet.wire`): each worker
chunk handed on in its connection's callback. Probes, load scrapes, model discovery and
``/version`` go through one httpx client. Both networks sit behind seams: tests pass an httpx
transport for the control plane and a :data:`app.fleet.wire.Connector` for the relay.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import httpx

from app.api.errors import (
    GatewayError,
    GatewaySaturated,
    UpstreamClientError,
    UpstreamError,
    UpstreamInvalidResponse,
    UpstreamStatusError,
    UpstreamUnavailable,
)
from app.api.protocol import Upload
from app.fleet.wire import (
    ConnectFailed,
    Connector,
    ConnectTimeout,
    Response,
    WireClient,
    WireError,
    endpoint,
    tcp_connect,
)
from app.fleet.workers import Worker
from app.observe.looplag import fired_late
from app.observe.metrics import EVENT_LOOP, UPSTREAM_CONNECTIONS, GatewayMetrics
from app.settings import Settings

# The control plane's pool: unbounded, and idle connections closed under the 5 s after which
# vLLM's server closes them, so that a probe never goes out on one it is closing.
_CONTROL_LIMITS = httpx.Limits(max_connections=None, keepalive_expiry=4.0)
# Error bodies are read to pass the worker's message on; a runaway one is cut here.
_MAX_ERROR_BODY = 64 * 1024
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


def descriptors_fit(descriptors: int) -> int:
    """The streams a process limited to ``descriptors`` holds at once (at least one).

    Every stream holds two descriptors, its client's connection and its worker's, beside those
    the gateway keeps for everything else (listening socket, probes, logs, Redis).
    """
    return max(1, (descriptors - _RESERVED_FDS) // 2)


def connection_budget(configured: int) -> int:
    """The relay's budget of worker connections: ``configured``, or what descriptors allow.

    With fewer descriptors than ``configured`` streams need (:func:`descriptors_fit`), the
    budget is cut to what fits (and said so in the log), so that the gateway runs out of its own
    budget, a fast 503 gateway_saturated, before it runs out of descriptors in the middle of
    accepting or connecting.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    fits = descriptors_fit(soft)
    if fits >= configured:
        return configured
    log.warning(
        "GATEWAY_MAX_UPSTREAM_CONNECTIONS=%d needs about %d file descriptors but the limit is %d: "
        "at most %d streams at once (raise the hard limit, e.g. ulimit -Hn)",
        configured, 2 * configured + _RESERVED_FDS, soft, fits,
    )  # fmt: skip
    return fits


def make_wire(settings: Settings, connector: Connector | None = None) -> WireClient:
    """The relay's client (``connector`` replaces the network in tests)."""
    return WireClient(settings.connect_timeout_s, connector=connector or tcp_connect)


def make_client(
    settings: Settings, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """The control plane's client: probes, load scrapes, discovery, ``/version``.

    ``transport`` replaces the network in tests. Its pool has no limit: those requests (a few
    per worker) never wait behind each other.
    """
    return _WorkerClient(
        transport=transport or httpx.AsyncHTTPTransport(limits=_CONTROL_LIMITS),
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


class WorkerRequest:
    """A request to ``worker``: sent on entering ``async with``, its response once its head came.

    ``body`` is JSON, or an upload sent chunk by chunk as the client's bytes were kept (with
    their ``content-type``, whose boundary the form needs). The response's body is not read
    (the caller streams it); the response is closed, and its slot given back, when the block
    ends, whatever happened: its connection is kept for the next request only if the body was
    read to its end. A worker's 4xx is raised as :class:`UpstreamClientError` carrying the
    worker's own message; a 5xx, a broken connection or a response that is not HTTP as the
    matching :class:`UpstreamError`; the gateway's own connection budget or descriptors spent
    as :class:`GatewaySaturated`. A class rather than a generator-based context manager: one
    object per request, and no async generator for the event loop to track.
    """

    __slots__ = (
        "_body", "_loop", "_path", "_request_id", "_response", "_slots", "_wire", "_worker",
    )  # fmt: skip

    def __init__(
        self,
        wire: WireClient,
        slots: UpstreamSlots,
        worker: Worker,
        path: str,
        body: bytes | Upload,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._wire, self._slots, self._worker, self._loop = wire, slots, worker, loop
        self._path, self._body, self._request_id = path, body, request_id
        self._response: Response | None = None

    async def __aenter__(self) -> Response:
        slots = self._slots
        slots.take()
        try:
            response = await self._send()
        except BaseException:
            slots.give()
            raise
        self._response = response
        return response

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._response is not None:
                self._response.close()
        finally:
            self._slots.give()

    async def _send(self) -> Response:
        wire, slots, worker, body = self._wire, self._slots, self._worker, self._body
        spec = worker.spec
        host, port, tls, head = endpoint(spec.base_url, self._path, spec.api_key)
        rid = self._request_id.encode("latin-1")

        def data() -> Iterable[bytes]:
            if isinstance(body, Upload):
                # With the length given, the upload is sent as it came, not chunk-encoded.
                fields = b"content-type: %s\r\ncontent-length: %d\r\nx-request-id: %s\r\n\r\n" % (
                    body.content_type.encode("latin-1"), body.size, rid,
                )  # fmt: skip
                return [head + fields, *body.chunks]
            fields = (
                b"content-type: application/json\r\ncontent-length: %d\r\nx-request-id: %s\r\n\r\n"
            )
            return [head + fields % (len(body), rid) + body]

        loop = self._loop
        started = loop.time()
        try:
            response = await wire.request(host, port, tls, data)
        except ConnectTimeout as exc:
            now = loop.time()
            if fired_late(started, now, wire.connect_timeout_s):
                raise slots.late(now - started) from exc
            raise UpstreamUnavailable(
                f"Worker {worker.label} could not be reached in time."
            ) from exc
        except ConnectFailed as exc:
            exhausted = _exhausted(exc)
            if exhausted is not None:
                raise slots.exhausted(exhausted) from exc
            raise UpstreamUnavailable(f"Worker {worker.label} is not reachable.") from exc
        except WireError as exc:
            raise UpstreamInvalidResponse(
                f"Worker {worker.label} closed the connection: {type(exc).__name__}."
            ) from exc
        if response.status < 400:
            return response
        try:
            raise await _status_error(worker, response)
        finally:
            response.close()


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


async def _status_error(worker: Worker, response: Response) -> GatewayError:
    try:
        raw = await response.read(_MAX_ERROR_BODY)
    except WireError:
        raw = b""
    status = response.status
    body = error_object(raw, status)
    if 400 <= status < 500:
        return UpstreamClientError(status, body)
    message = str(body["error"].get("message") or "")
    return UpstreamStatusError(f"Worker {worker.label} failed with status {status}: {message}")


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
    "UpstreamError", "UpstreamSlots", "WorkerRequest", "connection_budget", "descriptors_fit",
    "error_object",
    "make_client", "make_wire", "worker_get",
]  # fmt: skip

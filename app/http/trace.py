"""Every request's id and trace: the first and the last step of each request's path.

A pure ASGI middleware (nothing is buffered). Each request gets one id: the client's
``x-request-id`` when it is short and plain, else a new one. It is kept in the scope
(:func:`request_trace`) for the routes and the relay, which send it to the worker and log it,
and it is on every response.

Requests relayed by model (``POST`` to a path of :data:`app.api.protocol.ENDPOINT_PATHS`) are
recorded by :mod:`app.relay.record`, from the route or the relay, and their sends pass through
untouched: nothing is added per streamed event. Every other response is recorded here, once,
with the status actually sent: other routes (CORS preflights included), unknown paths,
404/405, a request on a connection over the server's cap (answered here), and a 500 raised
before a relayed request reached its route's recording. Refusals made before a request has a
scope (431, 408 on its headers, 400 for a malformed request) are recorded through
:class:`app.http.front.FrontHooks`.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import GatewayError, GatewaySaturated, InternalError
from app.api.outcome import Outcome
from app.api.protocol import ENDPOINT_PATHS
from app.http.front import OVER_CAPACITY_KEY
from app.observe.timing import Clock

log = logging.getLogger(__name__)

TRACE_KEY = "gateway.trace"
"""Scope key of the request's :class:`RequestTrace`."""
CLIENT_CONNECTIONS = "client_connections"
"""The ``resource`` of ``gateway_saturated_total`` for the server's connection cap."""

RELAYED_PATHS = frozenset(ENDPOINT_PATHS)
_ENDPOINTS = {
    **{path: endpoint.value for path, endpoint in ENDPOINT_PATHS.items()},
    "/v1/models": "models",
    "/version": "version",
    "/healthz": "healthz",
    "/readyz": "readyz",
    "/metrics": "metrics",
}
OTHER_ENDPOINT = "other"
"""The ``endpoint`` label of every path the gateway does not serve, so labels stay bounded."""

# A client's request id is echoed only if it is short and plain, so logs stay clean.
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


@dataclass(frozen=True, slots=True)
class TraceHooks:
    """What the trace needs of the running gateway, put in the lifespan's state by it.

    The trace is the lowest layer a request meets: it reaches the gateway through these, never
    through the gateway's state, so nothing it imports sits above it.
    """

    clock: Clock
    record: Callable[[str, str, int, Outcome, float], None]
    """Record a response no relay records: request id, endpoint label, status, outcome, seconds."""
    over_capacity: Callable[[], None]
    """Count a request refused because the server's connection cap was reached."""


TRACE_HOOKS_KEY = "gateway.trace_hooks"
"""Lifespan-state key of the :class:`TraceHooks`."""


class RequestTrace:
    """One request's id, and whether :mod:`app.relay.record` has taken over recording it."""

    __slots__ = ("recorded", "request_id")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.recorded = False


def request_id(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The client's ``x-request-id`` if it is short and plain, else a new one."""
    for name, value in headers:
        if name == b"x-request-id":
            if _REQUEST_ID.fullmatch(value):
                return value.decode()
            break
    return new_request_id()


def new_request_id() -> str:
    """128 random bits in hex, as ``uuid4().hex`` less its version digits.

    From ``random`` (seeded by the system at start-up in every process): an id names a
    request, it guards nothing; ``os.urandom`` is a system call per request.
    """
    return f"{random.getrandbits(128):032x}"


def request_trace(scope: Scope) -> RequestTrace:
    """The request's trace, as the middleware set it (made here if it did not run)."""
    trace = scope.get(TRACE_KEY)
    if not isinstance(trace, RequestTrace):
        trace = scope[TRACE_KEY] = RequestTrace(request_id(scope.get("headers", ())))
    return trace


def endpoint_label(path: str) -> str:
    """The bounded ``endpoint`` label of a path."""
    return _ENDPOINTS.get(path, OTHER_ENDPOINT)


def plain_outcome(status: int, endpoint: str) -> Outcome:
    """The outcome of a response that is no generation request's, from its status."""
    if status < 400 or (endpoint == "readyz" and status == 503):
        return Outcome.OK  # /readyz answering "not ready" did what it is for
    if status == 408:
        return Outcome.CLIENT_STALLED
    if status < 500:
        return Outcome.INVALID_REQUEST
    return Outcome.INTERNAL_ERROR


def error_message(error: GatewayError, request_id: str, close: bool = False) -> Message:
    """The ``http.response.start`` message of ``error``'s JSON answer."""
    headers = [
        (b"content-type", b"application/json"),
        (b"x-request-id", request_id.encode()),
        *((k.encode(), v.encode()) for k, v in error.headers().items()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    return {"type": "http.response.start", "status": error.status_code, "headers": headers}


class TraceMiddleware:
    """Gives every request its id and makes sure every response is counted and logged once."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one request (other scope types pass through)."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        trace = RequestTrace(request_id(scope["headers"]))
        scope[TRACE_KEY] = trace
        state = _state(scope)
        path = scope["path"]
        if scope.get(OVER_CAPACITY_KEY):
            await self._over_capacity(send, trace, state, path)
        elif scope["method"] == "POST" and path in RELAYED_PATHS:
            await self._relayed(scope, receive, send, trace, state)
        else:
            await self._other(scope, receive, send, trace, state)

    async def _relayed(
        self, scope: Scope, receive: Receive, send: Send, trace: RequestTrace,
        state: TraceHooks | None,
    ) -> None:  # fmt: skip
        """The Recorder records these; only an error before it took over is answered here."""
        start = None if state is None else state.clock()
        try:
            await self.app(scope, receive, send)
        except Exception:
            if trace.recorded:
                raise
            log.exception("request %s failed before the relay", trace.request_id)
            await _answer(send, _internal_error(), trace.request_id)
            _record(state, start, trace, scope["path"], 500, Outcome.INTERNAL_ERROR)

    async def _other(
        self, scope: Scope, receive: Receive, send: Send, trace: RequestTrace,
        state: TraceHooks | None,
    ) -> None:  # fmt: skip
        start = None if state is None else state.clock()
        rid = trace.request_id.encode()
        status = 0

        async def traced(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", ()))
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    headers.append((b"x-request-id", rid))
                message = {**message, "headers": headers}
            await send(message)

        outcome = None
        try:
            await self.app(scope, receive, traced)
        except Exception:
            if status:
                _record(state, start, trace, scope["path"], status, Outcome.INTERNAL_ERROR)
                raise  # the answer was started: the server logs it and breaks the connection
            log.exception("request %s failed", trace.request_id)
            outcome = Outcome.INTERNAL_ERROR
        if not status:
            await _answer(send, _internal_error(), trace.request_id)
            status = 500
        path = scope["path"]
        outcome = outcome or plain_outcome(status, endpoint_label(path))
        _record(state, start, trace, path, status, outcome)

    @staticmethod
    async def _over_capacity(
        send: Send, trace: RequestTrace, state: TraceHooks | None, path: str
    ) -> None:
        """A request on a connection beyond the server's cap: 503 at once, and close."""
        error = GatewaySaturated(
            "The gateway has as many client connections open as it takes; retry shortly.",
            retry_after_s=1.0,
        )
        await _answer(send, error, trace.request_id, close=True)
        if state is not None:
            state.over_capacity()
        _record(state, None, trace, path, error.status_code, error.outcome)


def _internal_error() -> InternalError:
    return InternalError("The gateway failed to answer this request; it was logged.")


async def _answer(send: Send, error: GatewayError, request_id: str, close: bool = False) -> None:
    await send(error_message(error, request_id, close))
    await send({"type": "http.response.body", "body": error.to_json(), "more_body": False})


def _state(scope: Scope) -> TraceHooks | None:
    """The running gateway's hooks (None before its lifespan ran: nothing is recorded then)."""
    state: Any = scope.get("state")
    found = state.get(TRACE_HOOKS_KEY) if isinstance(state, dict) else None
    return found if isinstance(found, TraceHooks) else None


def _record(
    state: TraceHooks | None, start: float | None, trace: RequestTrace, path: str,
    status: int, outcome: Outcome,
) -> None:  # fmt: skip
    if state is None:
        return
    seconds = 0.0 if start is None else state.clock() - start
    state.record(trace.request_id, endpoint_label(path), status, outcome, seconds)

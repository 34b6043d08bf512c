"""The application factory: ``create_app(settings)`` wires the request path together."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from app.admission.auth import Authenticator
from app.admission.limits import Limits
from app.admission.queue import AdmissionController
from app.admission.shared import SharedState
from app.api.errors import error_body
from app.fleet.discovery import LoopResolver, Resolver
from app.fleet.localtokens import load_tokenizers
from app.fleet.predictor import PromptSizer
from app.fleet.routing import Router
from app.fleet.tokens import Tokenizer
from app.fleet.upstream import UpstreamSlots, connection_budget, make_client, make_wire
from app.fleet.wire import Connector, WireClient
from app.fleet.workers import WorkerPool
from app.http.front import HOOKS_KEY, FrontHooks
from app.http.server import GatewayServer, server_config
from app.http.trace import (
    CLIENT_CONNECTIONS,
    RELAYED_PATHS,
    TRACE_HOOKS_KEY,
    TraceHooks,
    TraceMiddleware,
    endpoint_label,
    plain_outcome,
    request_id,
)
from app.internals import assumptions_held
from app.observe.goodput import GoodputTracker
from app.observe.logs import BatchedLines
from app.observe.looplag import LoopLagProbe
from app.observe.metrics import GatewayMetrics
from app.observe.timing import Clock, default_clock
from app.relay.record import Recorder
from app.relay.serve import RelayDeps
from app.routes import relay_handler, router
from app.settings import Settings
from app.shutdown import Shutdown
from app.state import STATE_KEY, GatewayState

log = logging.getLogger(__name__)

# How long the event loop's log lines below warnings wait to be written together.
_LOG_BATCH_S = 0.1

CORS_EXPOSED_HEADERS = [
    "x-request-id", "retry-after", "retry-after-ms", "x-gateway-tier", "x-gateway-queue-ms",
]  # fmt: skip
"""Response headers a browser's script may read (with ``GATEWAY_CORS_ORIGINS`` set)."""


def create_app(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    connector: Connector | None = None,
    clock: Clock = default_clock,
    resolver: Resolver | None = None,
    shutdown: Shutdown | None = None,
    control: Connector | None = None,
) -> FastAPI:
    """Build a gateway app.

    ``connector`` replaces the relay's network to the workers, ``control`` the pool's (probes,
    load scrapes, discovery; by default ``connector``'s), ``transport`` that of ``/version``,
    and ``resolver`` the DNS (tests);
    ``shutdown`` is the drain the server starts on SIGTERM (:mod:`app.shutdown`).
    """
    drain = shutdown or Shutdown(settings.drain_delay_s, settings.shutdown_grace_s)
    parts = functools.partial(
        _Parts.build, settings, transport, connector, control or connector, clock, resolver
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, object]]:
        async with _running(parts(), drain) as state:
            yield state

    app = GatewayApp(
        title="Goodput Gateway",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    _mount(app, settings)
    return app


@dataclass(frozen=True, slots=True)
class _Parts:
    """The gateway's parts, built afresh by every lifespan (one per server process)."""

    settings: Settings
    clock: Clock
    metrics: GatewayMetrics
    shared: SharedState | None
    auth: Authenticator
    client: httpx.AsyncClient
    wire: WireClient
    probes: WireClient
    """The pool's own connections to the workers (probes, scrapes, discovery)."""
    pool: WorkerPool
    router: Router
    lag: LoopLagProbe
    limits: Limits
    admission: AdmissionController
    goodput: GoodputTracker
    sizer: PromptSizer
    recorder: Recorder

    @classmethod
    def build(
        cls,
        settings: Settings,
        transport: httpx.AsyncBaseTransport | None,
        connector: Connector | None,
        control: Connector | None,
        clock: Clock,
        resolver: Resolver | None,
    ) -> _Parts:
        """Every part, wired to the others; nothing runs yet."""
        metrics = GatewayMetrics(settings)
        shared = None
        if settings.redis_url:
            shared = SharedState(
                settings.redis_url, settings.redis_timeout_s, settings.redis_sync_interval_s,
                clock, metrics.shared_state_up,
            )  # fmt: skip
        auth = Authenticator(settings, clock, shared)
        auth.log_mode()
        client = make_client(settings, transport)
        wire = make_wire(settings, connector)
        probes = make_wire(settings, control)
        pool = WorkerPool(settings, probes, metrics, clock, resolver or LoopResolver())
        tokenizer = None
        if pool.kv_events is not None:
            cache = int(settings.kv_tokens_cache_mb * 2**20)
            local = load_tokenizers(settings.tokenizers, cache)
            tokenizer = Tokenizer(wire, settings.kv_tokenize_timeout_s, cache, local)
        router = Router(settings, pool, metrics=metrics, tokenizer=tokenizer)
        lag = LoopLagProbe(metrics.loop_lag)
        limits = Limits(settings, metrics, lag)
        admission = AdmissionController(settings, router, limits, metrics, clock)
        goodput = GoodputTracker(metrics, settings.tiers, clock)
        sizer = PromptSizer()
        recorder = Recorder(settings, metrics, goodput)
        return cls(
            settings, clock, metrics, shared, auth, client, wire, probes, pool, router, lag,
            limits, admission, goodput, sizer, recorder,
        )  # fmt: skip


@asynccontextmanager
async def _running(parts: _Parts, drain: Shutdown) -> AsyncIterator[dict[str, object]]:
    """Run ``parts`` for one lifespan: start them, yield the lifespan's state, stop them all."""
    settings, metrics, pool, shared = parts.settings, parts.metrics, parts.pool, parts.shared
    limits, admission, goodput, lag = parts.limits, parts.admission, parts.goodput, parts.lag
    for name, missing in assumptions_held().items():
        metrics.library_assumption.labels(name).set(0 if missing else 1)
    lag.start()
    exporter: asyncio.Task[None] | None = None
    try:
        await pool.start(first_wait=settings.connect_timeout_s)
        if shared is not None:
            admission.demand.fleet = admission.shares.fleet = shared.arrivals
            # Shared from the first request on.
            await shared.sync(pool, admission.demand, admission.shares)
            shared.start(pool, admission.demand, admission.shares)
        if metrics.multiprocess:
            # Gauges refreshed at export time are refreshed by the process that answers
            # /metrics only: every process refreshes its own, for the merge to read.
            exporter = asyncio.create_task(
                _every(
                    1.0,
                    pool.export,
                    lambda: limits.export(pool),
                    goodput.export,
                    lambda: admission.shares.export(metrics, settings.tiers),
                ),
                name="metrics-export",
            )
        log.info(
            "gateway ready: %d worker(s), %d healthy, models %s, routing %s, admission %s, "
            "state %s",
            len(pool.workers), sum(w.up for w in pool.workers.values()),
            sorted(pool.served_models()), settings.routing,
            "on" if settings.admission else "off",
            "local" if shared is None else "shared through Redis"
            if shared.up else "shared through Redis (not answering yet)",
        )  # fmt: skip
        unbatch = _batch_log_lines(asyncio.get_running_loop())
        try:
            yield _state(parts, drain)
        finally:
            unbatch()
    finally:
        lag.stop()
        if exporter is not None:
            exporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await exporter
        if shared is not None:
            await shared.stop()
        await admission.stop()
        await parts.router.close()
        await pool.stop()
        parts.wire.close()
        parts.probes.close()
        await parts.client.aclose()


def _state(parts: _Parts, drain: Shutdown) -> dict[str, object]:
    """The lifespan's state: the front end's and the trace's hooks, and the gateway's state."""
    settings, clock, metrics, recorder = parts.settings, parts.clock, parts.metrics, parts.recorder
    slots = UpstreamSlots(connection_budget(settings.max_upstream_connections), metrics)
    deps = RelayDeps(
        settings,
        parts.auth,
        parts.sizer,
        parts.wire,
        parts.pool,
        parts.router,
        metrics,
        parts.admission,
        recorder,
        slots,
        drain,
    )

    def refused(rid: str, path: str, status: int, seconds: float) -> None:
        endpoint = endpoint_label(path)
        recorder.plain(rid, endpoint, status, plain_outcome(status, endpoint), seconds)

    def over_capacity() -> None:
        metrics.saturated.labels(CLIENT_CONNECTIONS).inc()

    return {
        HOOKS_KEY: FrontHooks(clock, request_id, refused),
        TRACE_HOOKS_KEY: TraceHooks(clock, recorder.plain, over_capacity),
        STATE_KEY: GatewayState(
            settings,
            parts.client,
            parts.pool,
            metrics,
            clock,
            parts.router,
            parts.sizer,
            parts.auth,
            parts.goodput,
            recorder,
            deps,
            drain,
        ),
    }


def _mount(app: GatewayApp, settings: Settings) -> None:
    """Mount the routes, the middleware and the error handlers on ``app``."""
    app.include_router(router)
    relayed = relay_handler(writes=not settings.cors_origins)  # CORS wraps ``send``
    if settings.cors_origins:
        # Inside the trace: a preflight it answers still gets an id and a log line. Bearer
        # keys, not cookies: no credentials.
        cors: dict[str, Any] = {
            "allow_origins": settings.cors_origins,
            "allow_methods": ["GET", "POST"],
            "allow_headers": ["*"],
            "expose_headers": CORS_EXPOSED_HEADERS,
            "max_age": 600,
        }
        app.add_middleware(CORSMiddleware, **cors)
        relayed = CORSMiddleware(relayed, **cors)
    app.add_middleware(TraceMiddleware)
    app.relay_with(TraceMiddleware(relayed))
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)


class GatewayApp(FastAPI):
    """FastAPI, with the paths it relays by model served by their own handler.

    Every request to a relayed path (:data:`app.api.protocol.ENDPOINT_PATHS`) goes to the trace
    and from it to the relay's handler (:func:`app.routes.relay_handler`): not through
    FastAPI's and Starlette's middleware stack (telemetry, body limit, error middleware), the
    route table or FastAPI's request handler, which add work to every request and wrappers to
    every streamed event's ``send``. Every other request takes the whole stack, with the same
    trace inside it.
    """

    _relayed: ASGIApp | None = None

    def relay_with(self, handler: ASGIApp) -> None:
        """Serve every request to a relayed path with ``handler``."""
        self._relayed = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI connection scope."""
        relayed = self._relayed
        if relayed is not None and scope["type"] == "http" and scope["path"] in RELAYED_PATHS:
            await relayed(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def _batch_log_lines(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """Batch the lines of the root logger's :class:`BatchedLines`; returns what ends it."""
    undos = [
        handler.batch(loop, _LOG_BATCH_S)
        for handler in logging.getLogger().handlers
        if isinstance(handler, BatchedLines)
    ]

    def undo() -> None:
        for each in undos:
            each()

    return undo


async def _every(interval_s: float, *jobs: Callable[[], None]) -> None:
    """Run ``jobs`` every ``interval_s`` until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        for job in jobs:
            job()


# OpenAI's error objects carry a string code (or null), never a number.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
    return JSONResponse(
        error_body(str(exc.detail), error_type, None, code),
        status_code=exc.status_code,
        headers=exc.headers,
    )


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return JSONResponse(
        error_body(str(exc.errors()), "invalid_request_error", None, "invalid_request"),
        status_code=400,
    )


def configure_logging(settings: Settings, processes: bool = False) -> None:
    """Log lines to stderr; with several processes each line says which one (its pid).

    While a gateway's lifespan runs, the lines its event loop logs below warnings are written
    in batches (:class:`app.observe.logs.BatchedLines`).
    """
    pid = " [%(process)d]" if processes else ""
    # What the format does not print is not looked up for every record (the process id is a
    # system call on each).
    logging.logThreads = False
    logging.logMultiprocessing = False
    logging.logProcesses = processes
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s{pid} %(name)s: %(message)s",
        handlers=[BatchedLines(sys.stderr)],
        force=True,
    )
    # httpx logs every request at INFO: several lines a second per worker from the load scrapes
    # and health probes alone. Failures are logged by the gateway itself.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def build_server(settings: Settings) -> GatewayServer:
    """The gateway's server for ``settings``: the app, its drain, uvicorn's configuration."""
    shutdown = Shutdown(settings.drain_delay_s, settings.shutdown_grace_s)
    config = server_config(create_app(settings, shutdown=shutdown), settings)
    return GatewayServer(config, shutdown)

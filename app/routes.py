"""HTTP routes: thin handlers that hand each request to the serving layer.

Every endpoint relayed by model (:data:`app.api.protocol.ENDPOINT_PATHS`: generation, embeddings,
score, rerank, pooling, tokenizer, transcriptions, with vLLM's aliases) is one handler made by
:func:`_relayed`; what differs between them is their :class:`~app.api.protocol.Endpoint`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from app.admission.ticket import Ticket
from app.api.errors import GatewayError, error_body
from app.api.protocol import (
    ENDPOINT_PATHS,
    NO_TARGETS,
    Cost,
    Endpoint,
    ParsedRequest,
    endpoint_fields,
    fairness_id,
    parse_form,
    parse_request,
    slo_targets,
)
from app.fleet.upstream import worker_get
from app.http.arrival import arrival
from app.http.body import read_body, read_form
from app.http.front import ABORT_KEY
from app.http.trace import request_trace
from app.http.writer import WRITER_KEY, ResponseWriter
from app.observe.timing import RequestTimer
from app.relay.record import RequestEnd
from app.relay.serve import Relay, RequestContext, error_response
from app.state import GatewayState, get_state

# Handlers read the state with get_state rather than through Depends: FastAPI's dependency
# solving per request cost more than the rest of the handler.
router = APIRouter()


def relay_handler(writes: bool) -> ASGIApp:
    """The ASGI app of every relayed path (:data:`app.api.protocol.ENDPOINT_PATHS`).

    :class:`app.gateway.GatewayApp` calls it, behind the trace (and CORS, when configured), in
    place of FastAPI for those paths: a POST is relayed, any other method is answered 405.
    With ``writes``, nothing wraps ``send`` on the way, and the relay writes to the front
    end's :class:`~app.http.writer.ResponseWriter` when the server offers one.
    """

    async def handle(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            await _not_allowed(scope, receive, send)
            return
        request = Request(scope, receive)
        writer = scope.get(WRITER_KEY) if writes else None
        endpoint = ENDPOINT_PATHS[scope["path"]]
        response = await _relay(request, get_state(request), endpoint, writer)
        await response(scope, receive, send)

    return handle


async def _not_allowed(scope: Scope, receive: Receive, send: Send) -> None:
    body = error_body("Method Not Allowed", "invalid_request_error", None, "method_not_allowed")
    await JSONResponse(body, status_code=405, headers={"allow": "POST"})(scope, receive, send)


async def _relay(
    request: Request, state: GatewayState, endpoint: Endpoint, writer: ResponseWriter | None
) -> ASGIApp:
    timer = RequestTimer(state.clock, arrival(request, state.clock))
    trace = request_trace(request.scope)
    request_id = trace.request_id
    header = _header_reader(request.scope)
    model = ""
    tier = state.settings.default_tier
    try:
        identity = state.auth.identify(
            header("authorization"),
            header(state.settings.tier_header),
            fairness_id(header),
        )
        tier = identity.tier.name
        targets = NO_TARGETS
        if state.settings.slo_headers:
            targets = slo_targets(header)
        parsed = await _parse(request, state, endpoint)
        if not parsed.model:
            parsed.model = state.router.default_model()
        model = parsed.model
        state.router.candidates(model)  # unknown model: 404 now, before any waiting
        # What the request costs the engine: its prompt's prefill, then (generation only) up to
        # max_tokens of decode; the tokenizer's answers cost none.
        cost = endpoint.cost
        own_tokens = 0.0
        if cost is not Cost.NONE:
            own_tokens = state.sizer.estimate(state.pool.model_label(model), parsed.size)
        charged = own_tokens
        if cost is Cost.DECODE:
            charged += float(parsed.max_tokens or 0) * parsed.n
        await state.auth.acquire(identity, charged)
    except GatewayError as exc:
        summary = timer.summary(None)
        end = RequestEnd(
            request_id, endpoint.value, state.pool.model_label(model),
            state.auth.tiers[tier], exc.status_code, exc.outcome, summary,
            timer.clock() - timer.arrival,
        )  # fmt: skip
        trace.recorded = True
        state.recorder.refused(end, exc)
        response = error_response(exc)
        response.headers["x-request-id"] = request_id
        return response
    route = state.router.route_key(_session(header, parsed, state.settings.affinity_header), parsed)
    if route.prefix is not None and state.pool.kv_events is not None:  # events followed
        route = await state.router.tokenized(route, parsed)
    ticket = Ticket(
        identity.tier.with_targets(targets.ttft_s, targets.tpot_s),
        model,
        own_tokens,
        route,
        timer.arrival,
        parsed.max_tokens,
        own_ttft=targets.ttft_s is not None,
        fairness=identity.fairness if state.settings.fair_share else "",
        weight=identity.weight,
    )
    scope = request.scope
    ctx = RequestContext(
        parsed, timer, request_id, identity, ticket, charged, scope.get(ABORT_KEY), writer
    )  # fmt: skip
    trace.recorded = True  # the relay records it, however it ends
    return Relay(state.relay_deps, ctx)


async def _parse(request: Request, state: GatewayState, endpoint: Endpoint) -> ParsedRequest:
    settings, path = state.settings, request.scope["path"]
    if endpoint.form:
        wanted = frozenset(endpoint_fields(endpoint).model_fields)
        upload, fields = await read_form(
            request, settings.max_body_bytes, settings.body_timeout_s, wanted
        )
        return parse_form(endpoint, fields, upload, path)
    raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
    return parse_request(endpoint, raw, path)


@router.get("/version", response_model=None)
async def version(request: Request) -> Response:
    """The workers' vLLM version, as the first healthy worker answers ``/version``."""
    state = get_state(request)
    now = state.pool.now()
    healthy = [worker for worker in state.pool.workers.values() if worker.healthy(now)]
    try:
        answer = await worker_get(
            state.client, healthy, "/version", state.settings.connect_timeout_s
        )
    except GatewayError as exc:
        return error_response(exc)
    return Response(answer.content, media_type=answer.headers.get("content-type"))


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """The models the workers serve, with the cards they publish."""
    state = get_state(request)
    return {"object": "list", "data": state.pool.model_cards()}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get("/health", response_model=None)
async def health(request: Request) -> Response:
    """The health check vLLM serves: 200, empty, while the gateway can serve; else 503.

    It can serve as ``/readyz`` says. Clients that check a vLLM server before a run ask this
    path (guidellm's backend validation).
    """
    return Response(status_code=200 if _ready(get_state(request)) else 503)


@router.get("/readyz", response_model=None)
async def readyz(request: Request) -> JSONResponse:
    """Ready when at least one worker answered its last probe, and not draining."""
    state = get_state(request)
    now = state.pool.now()
    workers = {label: worker.healthy(now) for label, worker in state.pool.workers.items()}
    draining, ready = state.shutdown.draining, _ready(state)
    status = "ready" if ready else "draining" if draining else "no worker reachable"
    return JSONResponse({"status": status, "workers": workers}, status_code=200 if ready else 503)


@router.get("/metrics", response_model=None)
async def metrics(request: Request) -> PlainTextResponse:
    """Prometheus exposition of the gateway's metrics."""
    state = get_state(request)
    state.pool.export()
    admission = state.relay_deps.admission
    admission.limits.export(state.pool)
    admission.shares.export(state.metrics, state.settings.tiers)
    state.goodput.export()
    return PlainTextResponse(
        generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST
    )


def _ready(state: GatewayState) -> bool:
    """Whether the gateway can serve: a worker answered its last probe, and it is not draining."""
    return state.pool.ready() and not state.shutdown.draining


def _session(
    header: Callable[[str], str | None], parsed: ParsedRequest, name: str | None
) -> str | None:
    if name:
        value = header(name)
        if value:
            return value
        if parsed.user:
            return parsed.user
    return None


# The names handlers look up (the code's own and the settings'), as ASGI spells them.
_FIELD_NAMES: dict[str, bytes] = {}


def _header_reader(scope: Scope) -> Callable[[str], str | None]:
    """Reads the request's headers by name, the first of a repeated one, as Starlette's do.

    One dict per request: Starlette's ``Headers`` scans every field on each lookup, and a
    relayed request looks up seven or more.
    """
    fields: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        fields.setdefault(name, value)  # ASGI gives the names in lower case

    def get(name: str) -> str | None:
        key = _FIELD_NAMES.get(name)
        if key is None:
            key = _FIELD_NAMES[name] = name.lower().encode("latin-1")
        value = fields.get(key)
        return None if value is None else value.decode("latin-1")

    return get

"""HTTP routes: thin handlers that hand each request to the serving layer."""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from app.admission import Ticket
from app.body import read_body
from app.errors import GatewayError
from app.protocol import Endpoint, ParsedRequest, parse_request
from app.record import RequestEnd
from app.relay import Relay, RequestContext, error_response
from app.state import GatewayState, get_state
from app.timing import RequestTimer

router = APIRouter()
State = Annotated[GatewayState, Depends(get_state)]

# A client's request id is echoed only if it is short and plain, so logs stay clean.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request, state: State) -> Response:
    """Relay a chat completion, streamed or not."""
    return await _generate(request, state, Endpoint.CHAT)


@router.post("/v1/completions", response_model=None)
async def completions(request: Request, state: State) -> Response:
    """Relay a text completion, streamed or not."""
    return await _generate(request, state, Endpoint.COMPLETIONS)


async def _generate(request: Request, state: GatewayState, endpoint: Endpoint) -> Response:
    timer = RequestTimer(state.clock)
    request_id = _request_id(request)
    model = ""
    tier = state.settings.default_tier
    try:
        identity = state.auth.identify(
            request.headers.get("authorization"), request.headers.get(state.settings.tier_header)
        )
        tier = identity.tier.name
        raw = await read_body(request, state.settings.max_body_bytes)
        parsed = parse_request(endpoint, raw)
        model = parsed.model
        state.router.candidates(model)  # unknown model: 404 now, before any waiting
        own_tokens = state.sizer.estimate(state.pool.model_label(model), parsed.size)
        charged = own_tokens + float(parsed.max_tokens or 0)
        state.auth.acquire(identity, charged)
    except GatewayError as exc:
        summary = timer.summary(None)
        end = RequestEnd(
            request_id, endpoint.value, state.pool.model_label(model),
            state.auth.tiers[tier], exc.status_code, exc.outcome, summary,
            timer.clock() - timer.arrival,
        )  # fmt: skip
        state.recorder.refused(end, exc)
        response = error_response(exc)
        response.headers["x-request-id"] = request_id
        return response
    ticket = Ticket(
        identity.tier,
        model,
        own_tokens,
        state.router.affinity(
            _affinity_key(request, parsed, state.settings.affinity_header), parsed
        ),
        timer.arrival,
    )
    ctx = RequestContext(parsed, timer, request_id, identity, ticket, charged)
    return Relay(state.relay_deps, ctx)


@router.get("/v1/models")
async def models(state: State) -> dict[str, Any]:
    """The models the workers serve, with the cards they publish."""
    return {"object": "list", "data": state.pool.model_cards()}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get("/readyz", response_model=None)
async def readyz(state: State) -> JSONResponse:
    """Ready when at least one worker answered its last probe, and not draining."""
    now = state.pool.now()
    workers = {label: worker.healthy(now) for label, worker in state.pool.workers.items()}
    draining = state.shutdown.draining
    ready = state.pool.ready() and not draining
    status = "ready" if ready else "draining" if draining else "no worker reachable"
    return JSONResponse({"status": status, "workers": workers}, status_code=200 if ready else 503)


@router.get("/metrics", response_model=None)
async def metrics(state: State) -> PlainTextResponse:
    """Prometheus exposition of the gateway's metrics."""
    state.pool.export()
    state.relay_deps.admission.limits.export(state.pool)
    state.goodput.export()
    return PlainTextResponse(
        generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST
    )


def _affinity_key(request: Request, parsed: ParsedRequest, header: str | None) -> str | None:
    if header:
        value = request.headers.get(header)
        if value:
            return value
        if parsed.user:
            return parsed.user
    return None


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id")
    if given is not None and _REQUEST_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex

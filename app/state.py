"""The gateway's typed state, created by the lifespan and handed to every request."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from starlette.requests import Request

from app.admission.auth import Authenticator
from app.fleet.predictor import PromptSizer
from app.fleet.routing import Router
from app.fleet.workers import WorkerPool
from app.observe.goodput import GoodputTracker
from app.observe.metrics import GatewayMetrics
from app.observe.timing import Clock
from app.relay.record import Recorder
from app.relay.serve import RelayDeps
from app.settings import Settings
from app.shutdown import Shutdown


@dataclass(frozen=True, slots=True)
class GatewayState:
    """Everything a request handler may use; lives as long as the app's lifespan."""

    settings: Settings
    client: httpx.AsyncClient
    pool: WorkerPool
    metrics: GatewayMetrics
    clock: Clock
    router: Router
    sizer: PromptSizer
    auth: Authenticator
    goodput: GoodputTracker
    recorder: Recorder
    relay_deps: RelayDeps
    shutdown: Shutdown


STATE_KEY = "gateway"


def get_state(request: Request) -> GatewayState:
    """The state the lifespan yielded, typed.

    Called by the handlers themselves: as a FastAPI dependency, a plain ``def`` runs in
    FastAPI's thread pool, a hand-off to another thread and back on every request.
    """
    # The lifespan's state as ASGI hands it to each request (its ``state`` scope key): read
    # there, not through Starlette's ``request.state``, which wraps it in an object per request.
    lifespan = request.scope.get("state")
    state = lifespan.get(STATE_KEY) if isinstance(lifespan, dict) else None
    if not isinstance(state, GatewayState):
        raise RuntimeError("the gateway's lifespan has not run")
    return state

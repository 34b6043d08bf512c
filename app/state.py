"""The gateway's typed state, created by the lifespan and handed to every request."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from starlette.requests import Request

from app.auth import Authenticator
from app.goodput import GoodputTracker
from app.metrics import GatewayMetrics
from app.predictor import PromptSizer
from app.record import Recorder
from app.relay import RelayDeps
from app.routing import Router
from app.settings import Settings
from app.shutdown import Shutdown
from app.timing import Clock
from app.workers import WorkerPool


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
    state = getattr(request.state, STATE_KEY, None)
    if not isinstance(state, GatewayState):
        raise RuntimeError("the gateway's lifespan has not run")
    return state

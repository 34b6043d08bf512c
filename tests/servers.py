"""Running the gateway under a real uvicorn server inside the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import uvicorn

from app.fleet.wire import Connector
from app.gateway import create_app
from app.http.server import collect_on_a_timer, server_config
from app.settings import Settings
from scripts.vllm_worker import free_port as free_port  # re-exported: the suite takes it here
from tests.wire_bridge import bridge


@contextlib.asynccontextmanager
async def running_gateway(
    settings: Settings,
    transport: httpx.AsyncBaseTransport | None = None,
    connector: Connector | None = None,
) -> AsyncIterator[str]:
    """Serve a gateway on a free port; yield its base URL; shut it down afterwards.

    ``transport`` answers every request to the workers: the control plane's, and the relay's
    (both through :func:`tests.wire_bridge.bridge`), unless ``connector`` replaces the relay's
    network.
    """
    control = None if transport is None else bridge(transport)
    if connector is None:
        connector = control
    port = free_port()
    config = server_config(
        create_app(settings, transport=transport, connector=connector, control=control),
        settings,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="on",
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    # The collector as the real server runs it (GatewayServer.startup): a full collection of
    # the test process's heap otherwise pauses the loop for 150 ms mid-test.
    restore_gc = collect_on_a_timer(asyncio.get_running_loop())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("gateway exited during start-up")
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        restore_gc()
        server.should_exit = True
        await asyncio.wait_for(task, 30)


def settings_for(workers: str, **overrides: object) -> Settings:
    """Gateway settings for tests: the given workers, quick probes, no access log."""
    values: dict[str, object] = {
        "workers": workers,
        "access_log": False,
        "discovery_interval_s": 0.5,
        "connect_timeout_s": 2.0,
    }
    values.update(overrides)
    return Settings.model_validate(values)

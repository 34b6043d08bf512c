"""The HTTP server: uvicorn's process, lifespan and signals, the gateway's own front end.

uvicorn runs the process, the lifespan and the signals; :mod:`app.http.front` serves every client
connection.

uvicorn's documented ``http=`` option takes the protocol class; the limits on what clients may
hold and send come from the settings (:func:`client_limits`). :class:`GatewayServer` adds the
drain on SIGTERM (:mod:`app.shutdown`) and the garbage-collection policy.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from app.http.connection import ClientLimits
from app.http.front import front_protocol
from app.settings import Settings
from app.shutdown import Shutdown

log = logging.getLogger(__name__)

# How long uvicorn waits beyond the gateway's own grace period before it cancels what is left:
# by then the gateway has cut every request with an error its client can read.
_CANCEL_MARGIN_S = 5.0
# How often the whole heap is collected (see GatewayServer.startup).
_FULL_COLLECTION_S = 300.0
_NEVER = 2**30


def client_limits(settings: Settings) -> ClientLimits:
    """What each client connection may take, from ``settings``."""
    return ClientLimits(
        header_timeout_s=settings.header_timeout_s,
        max_header_bytes=settings.max_header_bytes,
        max_headers=settings.max_headers,
        send_buffer_bytes=settings.client_send_buffer_bytes,
        keep_alive_s=settings.keep_alive_timeout_s,
        max_connections=settings.max_connections,
    )


def server_config(app: Any, settings: Settings, **options: Any) -> uvicorn.Config:
    """The uvicorn configuration that serves ``app``; ``options`` override its entries."""
    values: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "loop": "uvloop",
        "http": front_protocol(app, client_limits(settings)),
        "access_log": False,  # the gateway logs every request itself (app.relay.record)
        "log_level": settings.log_level.lower(),
        # Counted from when the listener closes, after the drain delay.
        "timeout_graceful_shutdown": max(
            1, round(settings.shutdown_grace_s - settings.drain_delay_s + _CANCEL_MARGIN_S)
        ),
    }
    values.update(options)
    return uvicorn.Config(app, **values)


def collect_on_a_timer(
    loop: asyncio.AbstractEventLoop, every_s: float = _FULL_COLLECTION_S
) -> Callable[[], None]:
    """Keep full garbage collections out of requests; return what undoes it.

    Everything built so far (modules, the app, its lifespan's state) lives as long as the
    process: frozen, out of the collector's sight, a full collection no longer walks it
    (~70,000 objects, 50 ms on a 2-vCPU VM, paid by whichever request was allocating). The
    oldest generation then holds every running stream's objects (~150 each); Python starts a
    full collection whenever it grew by a quarter, so while streams ramp up it walks them over
    and over: at 6,000 streams that stopped the event loop for 0.8-1.4 s at a time, connects to
    the workers timed out and healthy workers were ejected. Full collections run every
    ``every_s`` instead; the young generations, where most cycles die, are collected as before.
    """
    gc.freeze()
    young, middle, oldest = gc.get_threshold()
    gc.set_threshold(young, middle, _NEVER)
    handle: asyncio.TimerHandle | None = None

    def collect() -> None:
        nonlocal handle
        gc.collect()
        handle = loop.call_later(every_s, collect)

    def undo() -> None:
        if handle is not None:
            handle.cancel()
        gc.set_threshold(young, middle, oldest)
        gc.unfreeze()

    handle = loop.call_later(every_s, collect)
    return undo


class GatewayServer(uvicorn.Server):
    """uvicorn's server with a drain (:mod:`app.shutdown`).

    The first SIGTERM or SIGINT starts the drain, and the listener closes only after its delay;
    a second signal stops at once.
    """

    def __init__(self, config: uvicorn.Config, shutdown: Shutdown) -> None:
        super().__init__(config)
        self._shutdown = shutdown
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Remember the loop the signal handler hands the drain to; freeze the start-up heap."""
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        collect_on_a_timer(self._loop)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Start the drain, or stop now if it had started."""
        loop = self._loop
        if self._shutdown.draining or loop is None:
            super().handle_exit(sig, frame)
            return
        # A signal handler runs between two bytecodes of the loop's thread: hand over safely.
        loop.call_soon_threadsafe(self._drain, sig)

    def _drain(self, sig: int) -> None:
        assert self._loop is not None
        self._shutdown.begin(self._loop)
        self._loop.call_later(self._shutdown.drain_delay_s, super().handle_exit, sig, None)

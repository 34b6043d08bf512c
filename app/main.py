"""Command line entry point: ``goodput-gateway`` (or ``python -m app``)."""

from __future__ import annotations

import asyncio
import gc
import logging
import resource
import socket
from types import FrameType

import uvicorn

from app.app import create_app
from app.settings import Settings
from app.shutdown import Shutdown

log = logging.getLogger(__name__)

# How often the whole heap is collected (see GatewayServer.startup).
_FULL_COLLECTION_S = 300.0
_NEVER = 2**30

# How long uvicorn waits beyond the gateway's own grace period before it cancels what is left:
# by then the gateway has cut every request with an error its client can read.
_CANCEL_MARGIN_S = 5.0


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
        # Everything built so far (modules, the app, its lifespan's state) lives as long as the
        # process: out of the collector's sight, a full collection no longer walks it (~70,000
        # objects, 50 ms on a 2-vCPU VM, paid by whichever request was allocating).
        gc.freeze()
        # The oldest generation holds every running stream's objects (~150 each). Python starts
        # a full collection whenever it grew by a quarter, so while streams ramp up it walks
        # them over and over: at 6,000 streams that stopped the event loop for 0.8-1.4 s at a
        # time, connects to the workers timed out and healthy workers were ejected. Full
        # collections now run on a timer instead; the young generations, where most cycles
        # die, are collected as before.
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, _NEVER)
        self._loop.call_later(_FULL_COLLECTION_S, self._collect)

    def _collect(self) -> None:
        assert self._loop is not None
        gc.collect()
        self._loop.call_later(_FULL_COLLECTION_S, self._collect)

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


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft limit on open files to the hard limit; ``(before, after)``.

    Every stream holds two descriptors (its client's connection and its worker's); soft limits
    are often 1,024, a fifth of what a fleet of 8 workers x 256 streams needs.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft, soft
    return soft, hard


def main() -> None:
    """Read settings from the environment and serve with uvicorn, uvloop and httptools."""
    settings = Settings()
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # httpx logs every request at INFO: several lines a second per worker from the load scrapes
    # and health probes alone. Failures are logged by the gateway itself.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    before, after = raise_fd_limit()
    if after != before:
        log.info("open files: soft limit raised from %d to the hard limit, %d", before, after)
    else:
        log.info("open files: limit %d", after)
    shutdown = Shutdown(settings.drain_delay_s, settings.shutdown_grace_s)
    config = uvicorn.Config(
        create_app(settings, shutdown=shutdown),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level=settings.log_level.lower(),
        # Counted from when the listener closes, after the drain delay.
        timeout_graceful_shutdown=max(
            1, round(settings.shutdown_grace_s - settings.drain_delay_s + _CANCEL_MARGIN_S)
        ),
    )
    GatewayServer(config, shutdown).run()


if __name__ == "__main__":
    main()

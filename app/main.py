"""Command line entry point: ``goodput-gateway`` (or ``python -m app``)."""

from __future__ import annotations

import logging
import resource

from app.app import create_app
from app.server import GatewayServer, server_config
from app.settings import Settings
from app.shutdown import Shutdown
from app.supervisor import process_count, supervise

log = logging.getLogger(__name__)


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


def configure_logging(settings: Settings, processes: bool = False) -> None:
    """Log lines to stderr; with several processes each line says which one (its pid)."""
    pid = " [%(process)d]" if processes else ""
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s{pid} %(name)s: %(message)s",
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


def main() -> None:
    """Read settings from the environment and serve with uvicorn, uvloop and httptools.

    From one process, or from ``GATEWAY_PROCESSES`` under :mod:`app.supervisor`.
    """
    settings = Settings()
    processes = process_count(settings.processes)
    configure_logging(settings, processes > 1)
    before, after = raise_fd_limit()
    if after != before:
        log.info("open files: soft limit raised from %d to the hard limit, %d", before, after)
    else:
        log.info("open files: limit %d", after)
    if processes > 1:
        supervise(settings, processes)
    else:
        build_server(settings).run()


if __name__ == "__main__":
    main()

"""Command line entry point: ``goodput-gateway`` (or ``python -m app``)."""

from __future__ import annotations

import logging

from app.app import create_app
from app.server import GatewayServer, server_config
from app.settings import Settings
from app.shutdown import Shutdown


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
    shutdown = Shutdown(settings.drain_delay_s, settings.shutdown_grace_s)
    config = server_config(create_app(settings, shutdown=shutdown), settings)
    GatewayServer(config, shutdown).run()


if __name__ == "__main__":
    main()

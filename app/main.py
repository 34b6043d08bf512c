"""Command line entry point: ``goodput-gateway`` (or ``python -m app``)."""

from __future__ import annotations

import logging

import uvicorn

from app.app import create_app
from app.settings import Settings


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
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=30,
    )


if __name__ == "__main__":
    main()

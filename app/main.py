"""Command line entry point: ``goodput-gateway`` (or ``python -m app``)."""

from __future__ import annotations

import logging
import resource
import sys

from app.gateway import build_server, configure_logging
from app.settings import Settings
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
        sys.exit(supervise(settings, processes))
    else:
        build_server(settings).run()


if __name__ == "__main__":
    main()

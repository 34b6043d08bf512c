"""Where workers come from: the static list in settings and a DNS name (a headless Service).

The resolver is a seam: tests pass their own, production resolves through the event loop's
``getaddrinfo``.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Protocol

from pydantic import HttpUrl

from app.settings import Settings, WorkerSpec


class Resolver(Protocol):
    """Resolves a host name to the addresses behind it."""

    async def resolve(self, host: str) -> list[str]:
        """Every address ``host`` resolves to now (empty if none)."""
        ...


class LoopResolver:
    """Resolution through the event loop (``getaddrinfo`` in its executor, never blocking)."""

    async def resolve(self, host: str) -> list[str]:
        """Every TCP address of ``host``."""
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
        return sorted({str(info[4][0]) for info in infos})


def split_host_port(target: str) -> tuple[str, int]:
    """``host:port`` (port defaults to 8000, vLLM's) into its parts."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return target, 8000
    return host.strip("[]"), int(port)


async def discover(settings: Settings, resolver: Resolver) -> list[WorkerSpec]:
    """The workers that exist now: the static ones, then one per address of ``worker_dns``.

    Raises ``OSError`` when the name cannot be resolved, so a DNS hiccup is not mistaken for
    every worker leaving.
    """
    specs = list(settings.workers)
    if settings.worker_dns:
        host, port = split_host_port(settings.worker_dns)
        for address in await resolver.resolve(host):
            shown = f"[{address}]" if ":" in address else address
            specs.append(WorkerSpec(url=HttpUrl(f"http://{shown}:{port}"), name=f"{shown}:{port}"))
    return specs

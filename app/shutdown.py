"""Graceful drain: on SIGTERM, turn not-ready, keep serving a while, then let streams finish.

1. ``/readyz`` answers 503 at once, while the gateway still accepts requests for
   ``GATEWAY_DRAIN_DELAY_S``: load balancers that poll readiness (not only Kubernetes, whose
   endpoints controller reacts to the pod's deletion) stop sending before the listener closes.
2. The server then stops accepting and waits for the requests in flight.
3. A request still running ``GATEWAY_SHUTDOWN_GRACE_S`` after the signal is cut by the gateway
   itself: a stream ends with an in-band ``gateway_shutdown`` error event and no ``[DONE]``, an
   unanswered request gets 503 ``gateway_shutdown``; either is counted as such, never as ok.

A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

log = logging.getLogger(__name__)


class Cuttable(Protocol):
    """A request in flight that can be ended by the shutdown deadline."""

    def cut(self) -> None:
        """End the request now, telling its client why."""


class Shutdown:
    """The drain's state, shared by the server (which starts it) and the app (which obeys it)."""

    def __init__(self, drain_delay_s: float, grace_s: float) -> None:
        self.drain_delay_s = drain_delay_s
        self.grace_s = grace_s
        self.draining = False
        """Set at the first signal: ``/readyz`` answers 503 from then on."""
        self.expired = False
        """Set when the grace period is over: running requests are being cut."""
        self._running: set[Cuttable] = set()

    def begin(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start draining now: not ready; requests past the grace period get cut."""
        if self.draining:
            return
        self.draining = True
        log.info(
            "draining: not ready now, accepting for %.1f s more, cutting requests still running "
            "after %.1f s", self.drain_delay_s, self.grace_s,
        )  # fmt: skip
        loop.call_later(self.grace_s, self.expire)

    def expire(self) -> None:
        """The grace period is over: cut every request still running."""
        self.expired = True
        if self._running:
            log.warning("shutdown grace period over: cutting %d request(s)", len(self._running))
        for request in list(self._running):
            request.cut()

    def enter(self, request: Cuttable) -> None:
        """``request`` runs until :meth:`leave`; it is cut at once when the grace is over."""
        if self.expired:
            request.cut()
        self._running.add(request)

    def leave(self, request: Cuttable) -> None:
        """``request`` is over."""
        self._running.discard(request)

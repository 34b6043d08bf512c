"""A request's hold on one worker, reported to it through the worker's own slot methods.

Only :meth:`app.fleet.workers.Worker.took`, ``prefilled`` and ``gave_back`` change a worker's
load counters, and only a lease calls them.

Admission takes a lease when it dispatches a request (so the next decision, in the same pass,
already sees the slot taken), the relay marks the first output on it (the prefill is over) and
releases it when the attempt ends, whatever the outcome. A failover releases one lease and
takes another on the next worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.fleet.workers import Worker
from app.observe.metrics import GatewayMetrics

# Tokens a stream must have decoded before its own pace projects its TPOT: over its first few
# gaps the pace is mostly noise, and the worker's pooled pace stands in for it.
_OWN_PACE_TOKENS = 8.0


@dataclass(frozen=True, slots=True)
class Choice:
    """The chosen worker and what the choice was based on."""

    worker: Worker
    predicted_ttft_s: float
    prefill_work: float
    cached_tokens: float = 0.0
    """Prompt tokens the worker is expected to find in its prefix cache (``prefix_aware``)."""


class Lease:
    """One attempt's slot on ``choice.worker``: in flight, prefilling, tokens ahead, per tier."""

    __slots__ = (
        "_metrics", "choice", "decode_load", "dispatched", "first", "first_occupancy", "gaps",
        "max_tokens", "own_tokens", "prefill_peers", "released", "tier", "worker",
    )  # fmt: skip

    def __init__(
        self,
        choice: Choice,
        tier: str,
        own_tokens: float,
        now: float,
        metrics: GatewayMetrics,
        max_tokens: int | None = None,
    ) -> None:
        self.choice = choice
        self.worker = worker = choice.worker
        self.tier = tier
        self.max_tokens = max_tokens
        """The most tokens the client asked for (None: as many as the model writes)."""
        # What the worker must prefill: the prompt less what its prefix cache should hold.
        self.own_tokens = own_tokens = max(0.0, own_tokens - choice.cached_tokens)
        self.dispatched = now
        """When the request left for the worker (the relay moves it to the actual send)."""
        self.first: float | None = None
        self.first_occupancy = 0.0
        self.gaps = 0
        """Output events after the first, each one gap of the worker's pace."""
        self.decode_load: float | None = None
        """Mean requests on the worker from first output to the end, this one included."""
        self.released = False
        self._metrics = metrics
        self.prefill_peers = worker.took(tier, own_tokens, now)
        """How many were prefilling on the worker when this one joined, itself included."""
        metrics.worker_routed.labels(worker.label).inc()
        metrics.worker_in_flight.labels(worker.label).set(worker.in_flight)

    def first_output(self, at: float) -> bool:
        """The worker produced its first output (or its whole answer) at ``at``.

        Returns False if that was known already.
        """
        if self.first is not None or self.released:
            return False
        self.first = at
        worker = self.worker
        self.first_occupancy = worker.occupancy(at)
        worker.prefilled(self, self.own_tokens)
        return True

    def output_gap(self, gap: float, at: float) -> float | None:
        """A later output event came ``gap`` after the previous one, at ``at``.

        Returns the worker's pace reading if this gap closes a window
        (:meth:`app.fleet.limiter.DecodePace.gap`). The stream counts as decoding from its first
        gap.
        """
        pace = self.worker.pace
        if self.gaps == 0 and self.first is not None:
            pace.started(self.first)
        self.gaps += 1
        return pace.gap(gap, at)

    def decoded(self, now: float, events: int) -> tuple[float, float]:
        """``(seconds, tokens)`` of decode after the first of the ``events`` with output."""
        if self.first is None or events < 2:
            return 0.0, 0.0
        return now - self.first, (events - 1) * self.worker.pace.tokens_per_event

    def stall_room(self, now: float, aim_s: float, typical: float | None) -> float:
        """Seconds of stall the stream can still take and end within ``aim_s`` per token.

        A stream's TPOT is its mean pace over its life, so a stall of ``s`` seconds, whenever it
        comes, adds ``s`` over its decode tokens to it. Its pace so far (the gap it is in now
        included) stands for the rest of it: the room is the decode tokens it is expected to
        have after the first, times the aim less that pace. Expected: ``typical`` (its tier's
        mean, None if not learnt yet) up to what the client asked for, and more than it has
        had. Infinite when that is unknown or before the stream decodes.
        """
        first = self.first
        if first is None or not self.gaps or self.released:
            return math.inf
        pace = self.worker.pace
        done = self.gaps * pace.tokens_per_event
        limit = None if self.max_tokens is None else self.max_tokens - 1.0
        expected = typical if limit is None else limit if typical is None else min(typical, limit)
        if expected is None:
            return math.inf
        own = (now - first) / done
        pooled = pace.so_far(now) if done < _OWN_PACE_TOKENS else None
        return (aim_s - (own if pooled is None else pooled)) * max(expected, done + 1.0)

    def release(self, now: float) -> bool:
        """The attempt is over at ``now``; False if it was released already."""
        if self.released:
            return False
        self.released = True
        worker = self.worker
        if self.first is not None and now > self.first:
            self.decode_load = (worker.occupancy(now) - self.first_occupancy) / (now - self.first)
        if self.gaps and self.first is not None:
            worker.pace.ended(self.first, self.gaps)
        worker.gave_back(self, self.own_tokens, self.first is not None, now)
        self._metrics.worker_in_flight.labels(worker.label).set(worker.in_flight)
        return True

"""Per-request timing on a monotonic clock: queue time, TTFT, ITL, TPOT, E2E and overhead.

Definitions follow the standard benchmark clients (vLLM bench, aiperf, guidellm), and the
timestamps are taken where the client's would be: *arrival* is when the HTTP server read the
request's first byte (:mod:`app.http.arrival`), and an event's time is when its bytes were handed to
the client's socket (the relay's ``send`` returned), not when the worker's bytes came in.

* queue time: arrival to the first dispatch upstream (the admission queue);
* failover: time spent on attempts that failed before the first byte (not queue, not overhead);
* TTFT: arrival to the first event that carries output (the role-only chunk does not count);
* ITL: the gap between consecutive output events, divided by the tokens the later one carries;
* TPOT: (E2E - TTFT) / (completion tokens - 1);
* E2E: arrival to the last output event (not the usage chunk or ``[DONE]``).

The hot path (``output``) only appends a timestamp; everything else is computed once, at the end.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

Clock = Callable[[], float]
"""Seconds on a monotonic clock. ``time.perf_counter`` in production, a fake in tests."""

default_clock: Clock = time.perf_counter


@dataclass(frozen=True, slots=True)
class TimingSummary:
    """What one finished request measured; ``None`` where a figure does not apply."""

    queue_s: float | None
    ttft_s: float | None
    e2e_s: float | None
    tpot_s: float | None
    itl_s: list[float] = field(default_factory=list)
    output_events: int = 0
    overhead_s: float = 0.0
    failover_s: float = 0.0


class RequestTimer:
    """Collects the timestamps of one request; ``summary`` turns them into latencies."""

    __slots__ = (
        "_attempt_at", "_failed_at", "_failover", "_outputs", "_overhead", "_queued", "arrival",
        "clock", "dispatched", "output",
    )  # fmt: skip

    def __init__(self, clock: Clock = default_clock, arrival: float | None = None) -> None:
        self.clock = clock
        self.arrival = clock() if arrival is None else arrival
        self.dispatched: float | None = None
        self._queued = 0.0
        self._outputs = array("d")
        self.output: Callable[[float], None] = self._outputs.append
        """Record an event that carries output, handed to the client at the time given.

        The array's own ``append``: the relay calls it for every token, and a method of ours
        around it doubled that call's cost."""
        self._overhead = 0.0
        self._failover = 0.0
        self._attempt_at = 0.0
        self._failed_at: float | None = None

    def queued(self, seconds: float) -> None:
        """Time spent waiting for admission: queue time, but not the gateway's own overhead."""
        self._queued += seconds

    def dispatch(self) -> float:
        """Mark the moment the request is sent upstream (again, after a failed attempt)."""
        now = self.clock()
        if self.dispatched is None:
            self.dispatched = now
            self._overhead += max(0.0, now - self.arrival - self._queued)
        elif self._failed_at is not None:
            # Choosing the next worker is the gateway's own time; the dead attempt is not.
            self._overhead += max(0.0, now - self._failed_at)
        self._attempt_at = now
        return now

    def attempt_failed(self) -> None:
        """The attempt sent at the last :meth:`dispatch` failed before the first byte."""
        now = self.clock()
        self._failover += max(0.0, now - self._attempt_at)
        self._failed_at = now

    def add_overhead(self, seconds: float) -> None:
        """Add time spent in the gateway's own code (e.g. between receiving and relaying)."""
        self._overhead += seconds

    @property
    def first_output(self) -> float | None:
        """When the first output event was sent, if one was."""
        return self._outputs[0] if self._outputs else None

    @property
    def last_output(self) -> float:
        """When the latest output event was sent (call only once one was)."""
        return self._outputs[-1]

    @property
    def output_events(self) -> int:
        """How many output events were sent."""
        return len(self._outputs)

    def summary(self, completion_tokens: int | None, end: float | None = None) -> TimingSummary:
        """Latencies of the request, given the worker's ``usage.completion_tokens``.

        ``end`` is when a non-streamed response arrived; streamed requests end at their last
        output event. When the worker did not report usage, each event counts as one token.
        """
        queue = None if self.dispatched is None else self.dispatched - self.arrival
        outputs = self._outputs
        if not outputs:
            e2e = None if end is None else end - self.arrival
            return TimingSummary(queue, None, e2e, None, [], 0, self._overhead, self._failover)
        n_events = len(outputs)
        tokens = completion_tokens if completion_tokens and completion_tokens > 0 else n_events
        ttft = outputs[0] - self.arrival
        e2e = outputs[-1] - self.arrival
        tpot = (e2e - ttft) / (tokens - 1) if tokens > 1 else None
        # An event may carry several tokens (speculative decoding, stream intervals); the byte
        # scan cannot tell how many, so each gap is shared by the average tokens per event.
        per_event = max(1.0, (tokens - 1) / (n_events - 1)) if n_events > 1 else 1.0
        itl = [(outputs[i] - outputs[i - 1]) / per_event for i in range(1, n_events)]
        return TimingSummary(queue, ttft, e2e, tpot, itl, n_events, self._overhead, self._failover)

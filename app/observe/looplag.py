"""Event-loop lag: how late the loop runs a callback that was due at a known time.

Everything the gateway does for every request runs on one event loop. When the loop is busy,
a request's bytes wait in the socket and an event's bytes wait before they are written, and no
timestamp the gateway takes can see it: the client's clock does. A callback scheduled every
``interval_s`` and observed on how late it ran (on ``loop.time()``, the clock the loop schedules
by) measures that wait as ``gateway_event_loop_lag_seconds``. With uvloop, libuv's timers have a
resolution of one millisecond, so lags below it are timer rounding, not load.
"""

from __future__ import annotations

import asyncio
from collections import deque

from prometheus_client import Histogram

# A timeout that fired more than this share of its length after it was due fired late.
LATE_FRACTION = 0.25

LAG_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5,
)  # fmt: skip


class LoopLagProbe:
    """Observes the lag of a callback rescheduled every ``interval_s`` on the running loop.

    One timer per gateway, whatever the traffic: nothing on the per-request path.
    """

    def __init__(self, histogram: Histogram, interval_s: float = 0.25, recent: int = 4) -> None:
        self._histogram = histogram
        self._interval = interval_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._recent: deque[float] = deque(maxlen=recent)

    @property
    def late(self) -> float:
        """The largest lag of the last few ticks (a second's worth by default)."""
        return max(self._recent, default=0.0)

    def start(self) -> None:
        """Start probing the running loop."""
        self._loop = asyncio.get_running_loop()
        self._schedule(self._loop.time())

    def stop(self) -> None:
        """Stop probing."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self, now: float) -> None:
        assert self._loop is not None
        self._due = now + self._interval
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        self.observe(max(0.0, now - self._due))
        self._schedule(now)

    def observe(self, lag: float) -> None:
        """Record one tick ``lag`` seconds late."""
        self._histogram.observe(lag)
        self._recent.append(lag)


def fired_late(started: float, now: float, timeout_s: float | None) -> bool:
    """Whether a timeout of ``timeout_s`` that ran from ``started`` fired late, at ``now``.

    A timer runs late only while the loop is busy, and then what it guarded (a connect, a
    probe's answer) may well have come in time and waited behind the loop's backlog: libuv runs
    the timers that are due before it polls for I/O, so after a stall the timeout wins. Such a
    timeout is the gateway's own failure, not the worker's: seen at 9,800 streams ramping up on
    one process, the loop 1-2.5 s late, connects to healthy workers "timed out" by the thousand
    and every worker was ejected. Times are ``loop.time()``.
    """
    return timeout_s is not None and now - started > timeout_s * (1.0 + LATE_FRACTION)

"""How fast queued work leaves: the drain rate behind early rejections and Retry-After.

Requests leave the workers as fast as they arrive while nothing waits, so completions seen then
measure the traffic, not what the workers can do: a rate learnt from sequential requests once
turned away the burst that followed. Only completions while the admission queue was backlogged
count, over the time it was backlogged; until there are enough of those the rate is unknown,
and a queued request waits for its deadline instead of being turned away on a guess.
"""

from __future__ import annotations

from collections import deque

_WINDOW_S = 10.0
# The least backlogged time and completions that make a rate.
_MIN_BACKLOG_S = 0.5
_MIN_COMPLETIONS = 3


class DrainRate:
    """Completions per second while requests were queued, over the last ``window_s``."""

    __slots__ = ("_busy", "_completions", "_since", "_window")

    def __init__(self, window_s: float = _WINDOW_S) -> None:
        self._window = window_s
        self._completions: deque[float] = deque()
        self._busy: deque[tuple[float, float]] = deque()
        """Closed backlogged spans ``(start, end)``."""
        self._since: float | None = None
        """Start of the open backlogged span, if the queue is backlogged now."""

    def backlogged(self, queued: bool, now: float) -> None:
        """The queue became non-empty (``queued``) or empty at ``now``."""
        if queued and self._since is None:
            self._since = now
        elif not queued and self._since is not None:
            self._busy.append((self._since, now))
            self._since = None

    def completed(self, now: float) -> None:
        """A request left its worker at ``now``; it counts if the queue is backlogged."""
        if self._since is not None:
            self._completions.append(now)

    def rate(self, now: float) -> float:
        """Requests leaving per second while backlogged; 0 when too little is known."""
        horizon = now - self._window
        completions, busy = self._completions, self._busy
        while completions and completions[0] < horizon:
            completions.popleft()
        while busy and busy[0][1] < horizon:
            busy.popleft()
        span = sum(end - max(start, horizon) for start, end in busy)
        if self._since is not None:
            span += now - max(self._since, horizon)
        if span < _MIN_BACKLOG_S or len(completions) < _MIN_COMPLETIONS:
            return 0.0
        return len(completions) / span

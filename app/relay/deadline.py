"""A deadline for a block of code that moves later on every event at no cost per event.

``asyncio.timeout``'s ``reschedule`` cancels its timer and pushes a new one onto the loop's
heap; a relay moves its idle deadline on every event of every stream, so that was a heap push
(and a cancelled handle left on the heap) per event. Here the timer stays where it is when the
deadline moves later; when it fires early it goes back to sleep until the current deadline.
A deadline that follows the events (an idle timeout) is not moved at all: the timer asks
:attr:`Deadline.renew` what it is when it fires.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType

_TICK_S = 0.001


class Deadline:
    """Like ``asyncio.timeout_at``: the block is cancelled at ``when`` and raises TimeoutError.

    :meth:`move` sets a new deadline; moving it earlier than the timer reschedules the timer,
    moving it later only records it. While :attr:`renew` is set, the timer asks it for the
    deadline when it fires, and a later one than :attr:`when` replaces it. ``wake`` (loop
    time), if earlier than ``when``, is when the timer first wakes: a deadline that will be
    moved to about ``wake`` from now, then later, is then never rescheduled on the way.
    """

    __slots__ = ("_at", "_cancelling", "_expired", "_handle", "_loop", "_task", "renew", "when")

    def __init__(
        self, when: float, wake: float | None = None, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self.when = when
        self._loop = asyncio.get_running_loop() if loop is None else loop
        self._task: asyncio.Task[object] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._at = when if wake is None else min(when, wake)
        self._expired = False
        self._cancelling = 0
        self.renew: Callable[[], float] | None = None
        """The deadline as it stands when the timer fires (loop time), if it follows events."""

    def move(self, when: float) -> None:
        """The block now ends at ``when`` (loop time)."""
        self.when = when
        if when < self._at and self._handle is not None:
            self._handle.cancel()
            self._arm(when)

    def _arm(self, at: float) -> None:
        self._at = at
        self._handle = self._loop.call_at(at, self._fire)

    def _fire(self) -> None:
        self._handle = None
        if self.renew is not None:
            self.when = max(self.when, self.renew())
        # A timer may fire up to a tick (1 ms on uvloop) before its time; only a deadline moved
        # later since it was set puts it back to sleep.
        if self._loop.time() < self.when - _TICK_S:
            self._arm(self.when)
            return
        self._expired = True
        assert self._task is not None
        self._task.cancel()

    async def __aenter__(self) -> Deadline:
        task = asyncio.current_task(self._loop)
        if task is None:
            raise RuntimeError("Deadline must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._arm(self._at)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        # As asyncio.timeout does: only our own cancellation becomes a TimeoutError; one from
        # outside (the client left, the shutdown cut the request) goes on as it came.
        if (
            self._expired
            and exc_type is asyncio.CancelledError
            and self._task is not None
            and self._task.uncancel() <= self._cancelling
        ):
            raise TimeoutError from exc


def earliest(a: float, b: float | None) -> float:
    """The earlier of two deadlines, ``b`` None for none."""
    return a if b is None or a < b else b

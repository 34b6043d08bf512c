"""The relay's idle deadline: moved on every event for the cost of a float store, or none."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from app.relay.deadline import Deadline

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_deadline_that_is_not_moved_times_the_block_out() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TimeoutError):
        async with Deadline(start + 0.05):
            await asyncio.sleep(1)
    assert 0.04 <= loop.time() - start < 0.5


async def test_moving_the_deadline_later_keeps_the_block_alive_until_the_new_one() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def five_events_then_silence() -> None:
        async with Deadline(start + 0.05) as deadline:
            for _ in range(5):
                await asyncio.sleep(0.03)
                deadline.move(loop.time() + 0.05)  # an event arrived: the idle clock restarts
            await asyncio.sleep(1)

    with pytest.raises(TimeoutError):
        await five_events_then_silence()
    # Five events 30 ms apart, then 50 ms of silence: ~200 ms, far past the first deadline.
    assert loop.time() - start >= 0.18


async def test_a_renewed_deadline_follows_the_events_without_being_moved() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    last_event = start

    async def five_events_then_silence() -> None:
        nonlocal last_event
        # An idle timeout of 200 ms against events 30 ms apart: a busy machine's late
        # wake-ups (the whole suite runs beside it) stay far inside it.
        async with Deadline(start + 0.2) as deadline:
            deadline.renew = lambda: last_event + 0.2  # asked only when the timer fires
            for _ in range(5):
                await asyncio.sleep(0.03)
                last_event = loop.time()
            await asyncio.sleep(2)

    with pytest.raises(TimeoutError):
        await five_events_then_silence()
    # As when moved: five events 30 ms apart, then 200 ms of silence, past the first deadline.
    assert 0.33 <= loop.time() - start < 1.5
    assert loop.time() - last_event >= 0.195


async def test_a_renewal_never_brings_the_deadline_forward() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def renewed_to_the_past() -> None:
        async with Deadline(start + 0.1) as deadline:
            deadline.renew = lambda: start  # long past: the deadline that was set stands
            await asyncio.sleep(1)

    with pytest.raises(TimeoutError):
        await renewed_to_the_past()
    assert loop.time() - start >= 0.09


async def test_moving_the_deadline_earlier_brings_the_timeout_forward() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def moved_earlier() -> None:
        async with Deadline(start + 10) as deadline:
            deadline.move(loop.time() + 0.05)
            await asyncio.sleep(1)

    with pytest.raises(TimeoutError):
        await moved_earlier()
    assert loop.time() - start < 0.5


async def test_a_cancellation_from_outside_is_not_turned_into_a_timeout() -> None:
    loop = asyncio.get_running_loop()

    async def body() -> None:
        async with Deadline(loop.time() + 10):
            await asyncio.sleep(10)

    task = asyncio.create_task(body())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_block_that_ends_in_time_is_left_alone() -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    start = loop.time()
    ran = False
    async with Deadline(start + 0.2) as deadline:
        await asyncio.sleep(0.01)
        deadline.move(loop.time() + 0.2)  # later: the timer stays armed for the first one
        ran = True
    # The block ran to its end, raised no TimeoutError, and left no cancellation on the task.
    assert ran
    assert task.cancelling() == 0
    try:
        await asyncio.sleep(0.25)  # past both deadlines
    except asyncio.CancelledError:
        pytest.fail("the deadline's timer fired into the task after its block had ended")
    assert loop.time() - start >= 0.25
    assert task.cancelling() == 0


async def test_an_early_wake_neither_times_out_nor_reschedules_the_moves_after_it() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    armed: list[float] = []
    call_at = loop.call_at

    def counting_call_at(
        when: float, callback: Callable[[], object], *args: Any, **kwargs: Any
    ) -> asyncio.TimerHandle:
        if getattr(callback, "__name__", "") == "_fire":  # the deadline's, not the sleep's
            armed.append(when - start)
        return call_at(when, callback, *args, **kwargs)

    # The relay's shape: a far first deadline, woken early at the soonest a move could set.
    async with Deadline(start + 10, wake=start + 0.05) as deadline:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(loop, "call_at", counting_call_at)
            deadline.move(start + 5)  # the first token: a later deadline, no new timer
            deadline.move(loop.time() + 0.2)  # the end: later than the wake, no new timer
            assert armed == []
            await asyncio.sleep(0.1)  # the wake fires, and only puts the timer back to sleep
            assert len(armed) == 1
            assert armed[0] > 0.19

    async def moved_before_the_wake() -> None:
        async with Deadline(loop.time() + 10, wake=loop.time() + 0.2) as deadline:
            deadline.move(loop.time() + 0.05)  # earlier than the wake: the timer moves
            await asyncio.sleep(1)

    start = loop.time()
    with pytest.raises(TimeoutError):
        await moved_before_the_wake()
    assert 0.04 <= loop.time() - start < 0.15

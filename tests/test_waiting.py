"""The admission queue's order and what a dispatch pass reads of it."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from app.admission.ticket import Ticket
from app.admission.waiting import WaitQueue
from app.fleet.routing import NO_KEY
from app.settings import DEFAULT_TIERS, TierSpec

TIERS = {tier.name: tier for tier in DEFAULT_TIERS}


def _ticket(tier: str, deadline: float, seq: int, model: str = "m") -> Ticket:
    return Ticket(TIERS[tier], model, 10.0, NO_KEY, 0.0, seq=seq, deadline=deadline)


def test_tickets_are_in_tier_then_deadline_then_arrival_order() -> None:
    queue = WaitQueue(Counter())
    b = _ticket("batch", 1.0, 0)
    s_late = _ticket("standard", 9.0, 1)
    s_soon = _ticket("standard", 3.0, 2)
    i = _ticket("interactive", 50.0, 3)
    s_tie = _ticket("standard", 3.0, 4)
    for ticket in (b, s_late, s_soon, i, s_tie):
        queue.add(ticket)
    assert list(queue) == [i, s_soon, s_tie, s_late, b]
    assert len(queue) == 5
    assert queue
    assert queue.priorities() == [0, 1, 2]
    assert queue.tier(1) == [s_soon, s_tie, s_late]
    assert queue.first(1) is s_soon
    assert queue.first(2) is b
    assert queue.first(7) is None
    assert queue.nearest_deadline() == 1.0
    assert s_tie in queue
    assert _ticket("standard", 3.0, 4) not in queue
    assert "x" not in queue


def test_removing_a_ticket_updates_what_each_tier_waits_for() -> None:
    counts: Counter[tuple[str, int]] = Counter()
    queue = WaitQueue(counts)
    a1, a2 = _ticket("standard", 1.0, 0, "a"), _ticket("standard", 2.0, 1, "a")
    b1 = _ticket("standard", 3.0, 2, "b")
    for ticket in (a1, a2, b1):
        queue.add(ticket)
    assert queue.models(1) == {"a", "b"}
    assert queue.models(0) == set()
    assert counts == {("a", 1): 2, ("b", 1): 1}
    queue.remove(b1)
    assert queue.models(1) == {"a"}
    assert counts == {("a", 1): 2}
    queue.remove(a1)
    queue.remove(a2)
    assert not queue
    assert queue.priorities() == []
    assert queue.nearest_deadline() == math.inf
    with pytest.raises(ValueError, match="not queued"):
        queue.remove(a1)


def test_the_least_urgent_sheddable_ticket_is_the_lowest_tiers_latest() -> None:
    queue = WaitQueue(Counter())
    unsheddable = TierSpec(
        name="bulk", priority=3, ttft_slo_s=60.0, max_queue_wait_s=60.0, sheddable=False
    )
    first, last = _ticket("batch", 5.0, 0), _ticket("batch", 8.0, 1)
    bulk = Ticket(unsheddable, "m", 10.0, NO_KEY, 0.0, seq=2, deadline=9.0)
    standard = _ticket("standard", 1.0, 3)
    for ticket in (first, last, bulk, standard):
        queue.add(ticket)
    assert queue.least_urgent(below=1) is last  # past the unsheddable tier below it
    assert queue.least_urgent(below=2) is None  # only tiers below batch may be shed for it
    assert queue.least_urgent(below=0) is last

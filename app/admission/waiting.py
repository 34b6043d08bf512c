"""The admission queue's order: tier priority first, then the earliest deadline, then arrival.

What a dispatch pass needs of it costs what the pass changes, not the queue's depth. Within a
tier the requests are in deadline order, so those whose deadline has passed are the tier's first
(:meth:`WaitQueue.first`), and the earliest deadline of all is among the tiers' first. The models
each tier waits for are counted: once every one is blocked (strict priority within a model: one
request that finds no room blocks the rest of its model), the tier's other requests need not be
looked at. A pass over every queued request on each finished one (a backlog of 1,800 at 1.5x of
the simulated GPU fleet's capacity, some 40 passes a second) was work for nothing.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterator

from app.admission.ticket import Ticket


class WaitQueue:
    """The queued tickets, in queue order (:attr:`app.admission.ticket.Ticket.key`).

    A ticket's key must not change while it is queued. ``counts`` is kept as tickets come and
    go: the tickets queued per (model, tier priority), a model's entry gone at zero
    (:attr:`app.admission.demand.TierDemand.queued`, which others read).
    """

    __slots__ = ("_counts", "_keys", "_tickets")

    def __init__(self, counts: Counter[tuple[str, int]]) -> None:
        self._tickets: list[Ticket] = []
        self._keys: list[tuple[int, float, int]] = []
        self._counts = counts

    def __len__(self) -> int:
        return len(self._tickets)

    def __bool__(self) -> bool:
        return bool(self._tickets)

    def __iter__(self) -> Iterator[Ticket]:
        return iter(self._tickets)

    def __contains__(self, ticket: object) -> bool:
        if not isinstance(ticket, Ticket):
            return False
        index = bisect.bisect_left(self._keys, ticket.key)
        return index < len(self._tickets) and self._tickets[index] is ticket

    def add(self, ticket: Ticket) -> None:
        """Queue ``ticket`` in its place."""
        index = bisect.bisect(self._keys, ticket.key)
        self._keys.insert(index, ticket.key)
        self._tickets.insert(index, ticket)
        self._counts[(ticket.model, ticket.tier.priority)] += 1

    def remove(self, ticket: Ticket) -> None:
        """Take ``ticket`` out of the queue (it must be in it)."""
        index = bisect.bisect_left(self._keys, ticket.key)
        if index >= len(self._tickets) or self._tickets[index] is not ticket:
            raise ValueError("the ticket is not queued")
        del self._tickets[index]
        del self._keys[index]
        key = (ticket.model, ticket.tier.priority)
        self._counts[key] -= 1
        if not self._counts[key]:
            del self._counts[key]

    def priorities(self) -> list[int]:
        """The priorities of the tiers with requests queued, highest tier first."""
        return sorted({priority for _, priority in self._counts})

    def models(self, priority: int) -> set[str]:
        """The models the requests of tier ``priority`` wait for."""
        return {model for model, p in self._counts if p == priority}

    def tier(self, priority: int) -> list[Ticket]:
        """Tier ``priority``'s queued tickets, earliest deadline first (a copy)."""
        lo = self._start(priority)
        return self._tickets[lo : self._start(priority + 1, lo)]

    def first(self, priority: int) -> Ticket | None:
        """Tier ``priority``'s ticket of the earliest deadline; None if none is queued."""
        lo = self._start(priority)
        if lo < len(self._tickets) and self._tickets[lo].tier.priority == priority:
            return self._tickets[lo]
        return None

    def nearest_deadline(self) -> float:
        """The earliest deadline of a queued ticket (infinite while none is queued)."""
        firsts = (self.first(priority) for priority in self.priorities())
        return min((t.deadline for t in firsts if t is not None), default=math.inf)

    def least_urgent(self, below: int) -> Ticket | None:
        """The sheddable ticket of a tier below priority ``below`` to drop first, if any.

        The last in queue order: the lowest tier's, of the latest deadline.
        """
        for ticket in reversed(self._tickets):
            if ticket.tier.priority <= below:
                return None
            if ticket.tier.sheddable:
                return ticket
        return None

    def _start(self, priority: int, lo: int = 0) -> int:
        return bisect.bisect_left(self._keys, (priority, -math.inf, -1), lo)

"""Fair shares between the fairness ids of one tier, when its requests must wait.

A fairness id is the API key's name by default, or what a key allowed to set it sends in
``x-gateway-fairness-id`` (llm-d: ``x-llm-d-inference-fairness-id``). Nothing changes while
requests are admitted at once: only the order in which a tier's queued requests take the slots
that come free. The next slot goes to the id whose requests running in the tier, with this
one, over its weight, are fewest; between ids at equal share, and among one id's own requests,
the earliest deadline goes first. So an id that floods waits behind one that sends a request
now and then, which the one priority queue ordered by deadline alone did not do: there the light
user waited as long as the flooder (1.9 s at p50 against 1.8 s, a fake worker with 8 slots and
keys sending 48 and 4 streams).

The count of an id's running requests is this process's, plus what the fleet's other
processes last published through Redis (:mod:`app.admission.shared`), so every process gives
the shares of the whole fleet; with Redis away, each gives them by its own.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

from app.admission.ticket import Ticket
from app.observe.metrics import GatewayMetrics
from app.settings import TierSpec

_PUBLISHED_IDS = 100
"""The most ids per tier a process publishes (those with the most running): a bounded state."""


class FleetUsage(Protocol):
    """The fleet's other processes' running requests per fairness id, as last read."""

    def running(self, priority: int, now: float) -> Mapping[str, int]:
        """Requests of each id running elsewhere in the tier of ``priority`` (empty: unknown)."""


class FairShare:
    """Running and queued requests per tier and fairness id; the fair order of a tier's queue."""

    __slots__ = ("fleet", "queued", "running", "weights")

    def __init__(self) -> None:
        self.running: defaultdict[int, Counter[str]] = defaultdict(Counter)
        """Per tier priority, this process's admitted requests per id that have not ended."""
        self.queued: defaultdict[int, Counter[str]] = defaultdict(Counter)
        """Per tier priority, this process's queued requests per id."""
        self.weights: dict[str, float] = {}
        """The weight of each id with requests queued."""
        self.fleet: FleetUsage | None = None

    def started(self, ticket: Ticket) -> None:
        """``ticket`` was admitted: it runs until :meth:`ended` (once)."""
        if not ticket.running:
            ticket.running = True
            self.running[ticket.tier.priority][ticket.fairness] += 1

    def ended(self, ticket: Ticket) -> None:
        """``ticket``'s request ended (a ticket that never ran is ignored)."""
        if ticket.running:
            ticket.running = False
            counts = self.running[ticket.tier.priority]
            counts[ticket.fairness] -= 1
            if counts[ticket.fairness] <= 0:
                del counts[ticket.fairness]

    def enqueued(self, ticket: Ticket, delta: int) -> None:
        """``ticket`` joined (+1) or left (-1) the queue."""
        counts = self.queued[ticket.tier.priority]
        counts[ticket.fairness] += delta
        self.weights[ticket.fairness] = ticket.weight
        if counts[ticket.fairness] <= 0:
            del counts[ticket.fairness]
            if not any(ticket.fairness in c for c in self.queued.values()):
                del self.weights[ticket.fairness]

    def usage(self, priority: int, fairness: str, now: float) -> int:
        """Requests of ``fairness`` running in the tier, here and (as last read) elsewhere."""
        here = self.running[priority].get(fairness, 0)
        if self.fleet is None:
            return here
        return here + self.fleet.running(priority, now).get(fairness, 0)

    def ahead(self, ticket: Ticket) -> int:
        """How many of its tier's queued requests go before ``ticket`` were it queued now.

        The waiting ids take the slots in proportion to their weights, so its id's queue and it
        leave at its weight's part of the drain: while the others' requests last, as many as
        (its queued + 1) x the waiting ids' weights / its own go first, less itself. One id
        alone: its whole queue.
        """
        queued = self.queued[ticket.tier.priority]
        mine = queued.get(ticket.fairness, 0)
        total = sum(queued.values())
        weights = sum(self.weights.get(fid, 1.0) for fid in queued if fid != ticket.fairness)
        turns = (mine + 1) * (weights + ticket.weight) / ticket.weight - 1
        return min(total, math.ceil(turns - 1e-9))

    def order(self, tickets: Iterable[Ticket], now: float) -> Iterator[Ticket]:
        """One tier's queued ``tickets`` (in deadline order) in the order they take slots.

        Lazily: the id of a ticket the caller admitted counts it when its next one is weighed,
        so one pass hands the slots out in turn.
        """
        lines: dict[str, list[Ticket]] = {}
        for ticket in tickets:
            lines.setdefault(ticket.fairness, []).append(ticket)
        if len(lines) <= 1:
            yield from next(iter(lines.values()), [])
            return
        heap: list[tuple[float, float, int, str, int]] = []

        def push(fid: str, index: int) -> None:
            ticket = lines[fid][index]
            # The share it would hold with this slot: by the share it holds now, an id of
            # weight 1 running one tied with one of weight 10 running ten, won the tie by its
            # older deadline and ran two (w1 had 5% of the slots against its 1.8%).
            share = (self.usage(ticket.tier.priority, fid, now) + 1) / ticket.weight
            heapq.heappush(heap, (share, ticket.deadline, ticket.seq, fid, index))

        for fid in lines:
            push(fid, 0)
        while heap:
            _, _, _, fid, index = heapq.heappop(heap)
            yield lines[fid][index]
            if index + 1 < len(lines[fid]):
                push(fid, index + 1)

    def local_running(self) -> dict[int, dict[str, int]]:
        """Running requests here per tier priority and id, to publish (bounded)."""
        return {
            priority: dict(counts.most_common(_PUBLISHED_IDS))
            for priority, counts in self.running.items()
            if counts
        }

    def waiting(self, priority: int) -> tuple[int, float]:
        """The tier's waiting ids, and the share of its running requests the top one holds."""
        queued = self.queued[priority]
        running = self.running[priority]
        total = sum(running.values())
        top = max((running.get(fid, 0) for fid in queued), default=0)
        return len(queued), (top / total if total else 0.0)

    def export(self, metrics: GatewayMetrics, tiers: Iterable[TierSpec]) -> None:
        """Set the fairness gauges of ``tiers`` (ids waiting, the top waiting id's share)."""
        for tier in tiers:
            waiting, top = self.waiting(tier.priority)
            metrics.fairness_waiting_ids.labels(tier.name).set(waiting)
            metrics.fairness_top_share.labels(tier.name).set(top)

"""SLO-aware admission: admit, queue or reject each request, highest tier first.

Below saturation admission changes nothing: a request goes to the worker the router picks, at
once. It acts only when no worker has room (:mod:`app.admission.room`: the worker says it is full, a
limit learnt from latencies is reached, the slots kept for higher tiers are all that is left,
or a lower tier's prompt would delay a higher tier's first token or stall its stream).

When no worker has room, the request waits in one priority queue (higher tier first, earliest
deadline first within a tier) as long as waiting can still meet its TTFT target (leaving, after
the wait, the worker's recent time to first token), up to the tier's maximum wait. It is turned
away at once, with 429 and a reason, when its prompt alone would miss the target on an idle
worker (``prompt_too_long``), when the work queued ahead will not have left by its deadline at
the rate queued work drains (``deadline_unreachable``; :mod:`app.admission.drain`), or when the
queue is full (``queue_full``; a sheddable request of a lower tier is dropped instead, if there is
one). A queued request whose deadline passes gets 503 (``queue_timeout``).

Capacity freed by a finished request or a completed prefill wakes the dispatcher at once; a
short periodic tick catches deadlines and predictions that change with time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging

from app.admission.demand import TierDemand
from app.admission.drain import DrainRate
from app.admission.fairshare import FairShare
from app.admission.limits import Limits
from app.admission.placement import Placement
from app.admission.room import Room
from app.admission.ticket import Ticket
from app.admission.waiting import WaitQueue
from app.api.errors import GatewayError, Overloaded, QueueTimeout, Shed, UpstreamUnavailable
from app.api.outcome import Decision, Reason
from app.fleet.lease import Choice, Lease
from app.fleet.routing import Router
from app.fleet.workers import Worker
from app.observe.metrics import GatewayMetrics
from app.observe.timing import Clock
from app.settings import Settings, TierSpec

log = logging.getLogger(__name__)

_TICK_S = 0.05
_MAX_RETRY_AFTER_S = 60.0


class AdmissionController:
    """Decides, for every request, whether it runs now, waits, or is turned away."""

    def __init__(
        self,
        settings: Settings,
        router: Router,
        limits: Limits,
        metrics: GatewayMetrics,
        clock: Clock,
    ) -> None:
        self._settings = settings
        self._router = router
        self._metrics = metrics
        self._clock = clock
        self._seq = itertools.count()
        self._poked = False
        self._ticker: asyncio.Task[None] | None = None
        self.room = Room(settings, limits, TierDemand(clock, limits.tpot_aim), clock)
        self._queue = WaitQueue(self.room.demand.queued)
        self.drain = DrainRate()
        self.placer = Placement(router, self.room)
        """Where a request can run now."""
        self.shares = FairShare()
        """Who of a tier goes next when its requests wait (:mod:`app.admission.fairshare`)."""

    @property
    def limits(self) -> Limits:
        """The workers' learnt limits (the room's, which judges by them)."""
        return self.room.limits

    @property
    def demand(self) -> TierDemand:
        """What each tier is expected to need (the room's, which keeps slots by it)."""
        return self.room.demand

    def lease(self, choice: Choice, ticket: Ticket) -> Lease:
        """Take a slot on ``choice.worker`` for ``ticket`` now."""
        return Lease(
            choice, ticket.tier.name, ticket.own_tokens, self._clock(), self._metrics,
            ticket.max_tokens,
        )  # fmt: skip

    # Admission ----------------------------------------------------------------------------

    async def admit(self, ticket: Ticket) -> tuple[Lease, float]:
        """``(a lease on the chosen worker, seconds spent queued)``; raises when turned away."""
        tier = ticket.tier.name
        try:
            if not self._settings.admission:
                choice = self._router.choose(ticket.model, ticket.own_tokens, ticket.route)
                self._decide(ticket.tier, Decision.ADMITTED)
                return self.lease(choice, ticket), 0.0
            now = self._clock()
            self.demand.arrived(ticket.tier.priority, now)
            self.limits.arrived(ticket.tier, now)
            workers = self._router.candidates(ticket.model)
            fastest = self.placer.min_service(ticket, workers)
            # A target of the request's own is judged only when it must wait: below saturation
            # it is served at once, and counted as missed if it misses.
            if fastest > ticket.tier.ttft_slo_s and not ticket.own_ttft:
                # Even an idle worker would miss the target: no wait helps, a lower tier would.
                raise self._refuse(
                    ticket,
                    Reason.PROMPT_TOO_LONG,
                    f"This prompt is predicted to take {fastest:.1f} s to its first token, over "
                    f"the '{tier}' tier's {ticket.tier.ttft_slo_s:g} s target; use a lower tier.",
                )
            if not self._waiting_ahead(ticket) and not self.demand.yields(ticket.tier, now):
                room = self.placer.choose(ticket, now, workers)
                if room is not None:
                    self.demand.waited(ticket.tier.priority, 0.0)
                    return self._admitted(room, ticket), 0.0
            margin = self.placer.start_margin(ticket, fastest, now, workers)
        except UpstreamUnavailable:
            self._decide(ticket.tier, Decision.REJECTED, Reason.NO_WORKER, shortage=False)
            raise
        latest_start = ticket.arrival + ticket.tier.ttft_slo_s - margin
        ticket.deadline = min(ticket.arrival + ticket.tier.max_queue_wait_s, latest_start)
        # Waiting only to be told no at the deadline helps nobody: if the work ahead of it,
        # at the rate queued work drains, will not be gone by then, say so now.
        if ticket.deadline <= now or now + self._expected_wait(ticket, now) > ticket.deadline:
            raise self._refuse(
                ticket,
                Reason.DEADLINE_UNREACHABLE,
                f"The gateway cannot meet {_whose(ticket)} {ticket.tier.ttft_slo_s:g} s "
                "time-to-first-token target now; retry later or use a lower tier.",
            )
        if len(self._queue) >= self._settings.max_queue_length and not self._shed_for(ticket):
            raise self._refuse(ticket, Reason.QUEUE_FULL, "The admission queue is full.")
        return await self._wait(ticket, now)

    def _refuse(self, ticket: Ticket, reason: Reason, message: str) -> Overloaded:
        shortage = reason is not Reason.PROMPT_TOO_LONG
        self._decide(ticket.tier, Decision.REJECTED, reason, shortage=shortage)
        return Overloaded(message, self.retry_after(ticket), reason=reason)

    async def _wait(self, ticket: Ticket, now: float) -> tuple[Lease, float]:
        ticket.seq = next(self._seq)
        future = ticket.future = asyncio.get_running_loop().create_future()
        self._insert(ticket)
        self._decide(ticket.tier, Decision.QUEUED)
        self._ensure_ticker()
        try:
            lease = await future
        except asyncio.CancelledError:
            if ticket in self._queue:
                self._remove(ticket)
                self._decide(ticket.tier, Decision.CANCELLED)
            elif future.done() and not future.cancelled() and future.exception() is None:
                # Dispatched, but its request was cancelled before it could run: give back.
                future.result().release(self._clock())
                self.finished(ticket)
            self.poke()
            raise
        waited = self._clock() - now
        self.demand.waited(ticket.tier.priority, waited)
        self._metrics.queue_wait.labels(ticket.tier.name).observe(waited)
        return lease, waited

    def _waiting_ahead(self, ticket: Ticket) -> bool:
        """Whether a queued request of the same model and at least this tier waits already."""
        priority, queued = ticket.tier.priority, self.demand.queued
        return any(n for (model, p), n in queued.items() if model == ticket.model and p <= priority)

    def _shed_for(self, ticket: Ticket) -> bool:
        """Drop the least urgent sheddable lower-tier request, if any (the queue is full)."""
        victim = self._queue.least_urgent(ticket.tier.priority)
        if victim is None:
            return False
        self._remove(victim)
        self._decide(victim.tier, Decision.SHED, Reason.SHED)
        if victim.future is not None and not victim.future.done():
            message = "This request was shed to make room for more urgent work; retry later."
            victim.future.set_exception(Shed(message, self.retry_after(victim)))
        return True

    def finished(self, ticket: Ticket) -> None:
        """An admitted ``ticket``'s request ended: its fairness id runs one fewer."""
        self.shares.ended(ticket)

    # Dispatch -----------------------------------------------------------------------------

    def poke(self) -> None:
        """Capacity may have freed up: run the dispatcher soon (once, however often poked)."""
        if self._queue and not self._poked:
            self._poked = True
            asyncio.get_running_loop().call_soon(self.dispatch)

    def completed(
        self, tier: str, held_s: float, decode_s: float = 0.0, decoded: float = 0.0,
        worker: Worker | None = None,
    ) -> None:  # fmt: skip
        """A request of ``tier`` left ``worker`` after a hold of ``held_s``: counted, dispatch.

        ``decode_s`` of it went to ``decoded`` tokens after the first (``TierDemand.held``).
        """
        pace = None if worker is None else self.limits.full_pace(worker)
        self.demand.held(self.room.priorities[tier], held_s, decode_s, decoded, pace)
        self.drain.completed(self._clock())
        self.poke()

    def dispatch(self) -> None:
        """One pass over the queue, now; :meth:`poke` schedules it and the ticker runs it.

        Expired requests leave with 503, and each queued one, highest tier first, goes to a
        worker with room; within a tier in the fair order of :mod:`app.admission.fairshare`.
        Nobody overtakes a blocked request of its own model, and once every model a tier waits
        for is blocked the tier's other requests are not looked at (:mod:`app.admission.waiting`).
        """
        self._poked = False
        now = self._clock()
        blocked: set[str] = set()
        queue = self._queue
        for priority in queue.priorities():
            while (first := queue.first(priority)) is not None and _gone(first, now):
                self._offer(first, now, blocked)  # it leaves, expired or cancelled
            models = queue.models(priority)
            if not models or models <= blocked:
                continue
            tickets = queue.tier(priority)
            if self.demand.yields(tickets[0].tier, now):
                continue  # a tier above is short of capacity: this one leaves it the room
            for ticket in self.shares.order(tickets, now):
                self._offer(ticket, now, blocked)
                if models <= blocked:
                    break

    def _offer(self, ticket: Ticket, now: float, blocked: set[str]) -> None:
        """Expire ``ticket``, or admit it where there is room, or mark its model blocked."""
        future = ticket.future
        if future is None or future.done():
            self._remove(ticket)
            return
        if ticket.deadline <= now:
            self._remove(ticket)
            self._decide(ticket.tier, Decision.EXPIRED, Reason.QUEUE_TIMEOUT)
            self.demand.waited(ticket.tier.priority, now - ticket.arrival)
            future.set_exception(
                QueueTimeout(
                    f"The request waited {now - ticket.arrival:.2f} s in the '"
                    f"{ticket.tier.name}' queue without capacity to meet its SLO.",
                    self.retry_after(ticket),
                )
            )
            return
        # Strict priority within a model: nobody overtakes a blocked request of its model.
        if ticket.model in blocked or self.demand.yields(ticket.tier, now):
            return
        try:
            choice = self.placer.choose(ticket, now)
        except GatewayError:
            choice = None  # no healthy worker right now: wait for one until the deadline
        if choice is None:
            blocked.add(ticket.model)
            return
        self._remove(ticket)
        # The lease takes the slot now, so the next request in this same pass sees it.
        future.set_result(self._admitted(choice, ticket))

    def _admitted(self, choice: Choice, ticket: Ticket) -> Lease:
        """Admit ``ticket`` on ``choice``: counted, running in its fairness id's share, leased."""
        self._decide(ticket.tier, Decision.ADMITTED)
        self.shares.started(ticket)
        return self.lease(choice, ticket)

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="admission")

    async def _tick(self) -> None:
        while self._queue:
            nearest = self._queue.nearest_deadline()
            await asyncio.sleep(max(0.0, min(_TICK_S, nearest - self._clock())))
            self.dispatch()

    async def stop(self) -> None:
        """Stop the ticker; queued requests are failed by their own cancellation."""
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    # Bookkeeping --------------------------------------------------------------------------

    def _insert(self, ticket: Ticket) -> None:
        self._queue.add(ticket)
        self.shares.enqueued(ticket, 1)
        self._metrics.queue_depth.labels(ticket.tier.name).inc()
        if len(self._queue) == 1:
            self.drain.backlogged(True, self._clock())

    def _remove(self, ticket: Ticket) -> None:
        self._queue.remove(ticket)
        self.shares.enqueued(ticket, -1)
        self._metrics.queue_depth.labels(ticket.tier.name).dec()
        if not self._queue:
            self.drain.backlogged(False, self._clock())

    def _decide(
        self,
        tier: TierSpec,
        decision: Decision,
        reason: Reason = Reason.NONE,
        shortage: bool = True,
    ) -> None:
        self._metrics.decide(tier.name, decision, reason)
        if shortage and decision in (Decision.REJECTED, Decision.EXPIRED):
            # Capacity is short for this tier: lower tiers yield for a while.
            self.demand.short(tier.priority, self._clock())

    def _ahead(self, ticket: Ticket) -> int:
        """Queued requests that go before ``ticket`` (higher tiers, its tier's turns), plus itself.

        Within its tier, slots go round the fairness ids waiting
        (:meth:`app.admission.fairshare.FairShare.ahead`): a light id's request does not wait for
        a flooding one's whole queue.
        """
        priority = ticket.tier.priority
        higher = sum(n for (_, p), n in self.demand.queued.items() if p < priority)
        return 1 + higher + self.shares.ahead(ticket)

    def _expected_wait(self, ticket: Ticket, now: float) -> float:
        """Seconds until the requests queued ahead of ``ticket``, and then it, get a slot.

        Zero while the drain rate is unknown (no evidence of a wait yet).
        """
        rate = self.drain.rate(now)
        return 0.0 if rate <= 0 else self._ahead(ticket) / rate

    def retry_after(self, ticket: Ticket) -> float:
        """When capacity for this request is likely: the work ahead of it over the drain rate."""
        rate = self.drain.rate(self._clock())
        if rate <= 0:
            return min(_MAX_RETRY_AFTER_S, ticket.tier.max_queue_wait_s)
        return min(_MAX_RETRY_AFTER_S, max(0.1, self._ahead(ticket) / rate))


def _gone(ticket: Ticket, now: float) -> bool:
    """Whether ``ticket``'s deadline has passed, or its request went (no one waits on it)."""
    return ticket.deadline <= now or ticket.future is None or ticket.future.done()


def _whose(ticket: Ticket) -> str:
    """Whose TTFT target ``ticket`` is held to, for a refusal's message."""
    return "this request's own" if ticket.own_ttft else f"the '{ticket.tier.name}' tier's"

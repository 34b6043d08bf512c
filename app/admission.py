"""SLO-aware admission: admit, queue or reject each request, highest tier first.

For a request the controller picks the worker with the lowest predicted TTFT (the prefill
work ahead of it plus its own prompt, at the worker's learnt prefill speed) among those under
both of their limits, which follow the latencies requests actually get there
(:mod:`app.limiter`): the concurrency limit grows while streams keep the strictest TPOT target
and shrinks when they do not, so running streams keep their pace; the prefill limit does the
same for the worker's own time to first token, so the backlog waits in the gateway's queue,
where tiers apply, rather than first come, first served inside vLLM.

A lower tier leaves free the running slots the tiers above it are expected to need (Little's
law over their recent arrivals and how long their requests hold a slot; requests cannot be
preempted, so capacity handed to a lower tier stays taken until its requests finish).

When no worker has room, the request waits in one priority queue (higher tier first,
earliest deadline first within a tier) as long as waiting can still meet its TTFT target
(leaving, after the wait, the worker's recent time to first token), up to the tier's maximum
wait. When it cannot (its prefill alone is too long, or the requests
queued ahead of it will not have left by its deadline at the observed drain rate), it is
rejected at once with 429 and a Retry-After computed from that drain rate; a queued request
whose deadline passes gets 503 and a Retry-After. A full queue sheds a sheddable request of a
lower tier to make room for a more urgent one.

Capacity freed by a finished request or a completed prefill wakes the dispatcher at once; a
short periodic tick catches deadlines and predictions that change with time.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import math
from collections import Counter, deque
from dataclasses import dataclass, field

from app.errors import GatewayError, Overloaded, QueueTimeout, Shed
from app.metrics import GatewayMetrics
from app.routing import Choice, Router
from app.settings import Settings, TierSpec
from app.timing import Clock
from app.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

_TICK_S = 0.05
_DRAIN_WINDOW_S = 10.0
_MAX_RETRY_AFTER_S = 60.0
# The window over which higher tiers' arrival rates set the capacity kept for them.
_ACTIVE_S = 10.0
# Recent spans whose arrival rate counts when it is higher than the window's: a surge is read
# within half a second instead of over two, while the slots handed to lower tiers meanwhile
# would stay taken until their requests finish.
_SURGE_SPANS_S = (0.5, 1.0, 2.0)
# The fewest arrivals in a surge span that say anything (one alone is no rate).
_SURGE_MIN_ARRIVALS = 3
# The shortest span arrival rates are measured over (fewer arrivals say too little).
_MIN_SPAN_S = 1.0
# Weight of a finished request in the running average of how long a tier's requests hold a slot.
_HELD_WEIGHT = 0.1
_NOT_COMPUTED: tuple[float, dict[int, float]] = (-math.inf, {})
# How long lower tiers yield after a higher tier had a request turned away.
_SHORTAGE_S = 2.0


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's place in admission."""

    tier: TierSpec
    model: str
    own_tokens: float
    affinity: str | None
    arrival: float
    seq: int = 0
    deadline: float = math.inf
    future: asyncio.Future[Choice] | None = field(default=None, repr=False)

    @property
    def key(self) -> tuple[int, float, int]:
        """Queue order: tier priority, then earliest deadline, then arrival."""
        return (self.tier.priority, self.deadline, self.seq)


class AdmissionController:
    """Decides, for every request, whether it runs now, waits, or is turned away."""

    def __init__(
        self,
        settings: Settings,
        pool: WorkerPool,
        router: Router,
        metrics: GatewayMetrics,
        clock: Clock,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._router = router
        self._metrics = metrics
        self._clock = clock
        self._queue: list[Ticket] = []
        self._keys: list[tuple[int, float, int]] = []
        self._seq = itertools.count()
        self._completions: deque[float] = deque()
        self._reserved: dict[Ticket, Choice] = {}
        self._poked = False
        self._ticker: asyncio.Task[None] | None = None
        targets = [t.tpot_slo_s for t in settings.tiers if t.tpot_slo_s is not None]
        self._tpot_target = min(targets) if targets else None
        self._tpot_aim = (
            None if self._tpot_target is None else settings.ttft_headroom * self._tpot_target
        )
        self._ttft_target = min(t.ttft_slo_s for t in settings.tiers)
        self._priorities = {t.name: t.priority for t in settings.tiers}
        self._arrivals: deque[tuple[float, int]] = deque()
        self._short_until: dict[int, float] = {}
        self._held: dict[int, float] = {}
        self._expected: tuple[float, dict[int, float]] = _NOT_COMPUTED

    # Capacity -----------------------------------------------------------------------------

    def cap(self, worker: Worker) -> int:
        """The most requests ``worker`` may run now: its feedback-steered limit."""
        return min(self._settings.max_running_per_worker, worker.limit.limit)

    def prefill_cap(self, worker: Worker) -> int:
        """The most requests that may be prefilling on ``worker`` at once."""
        return min(self._settings.max_running_per_worker, worker.prefill_limit.limit)

    def learn(
        self,
        worker: Worker,
        worker_ttft_s: float | None,
        tpot_s: float | None,
        prefill_peers: int,
        decode_load: float | None = None,
    ) -> None:
        """Steer ``worker``'s limits by a finished stream's latencies.

        The running limit follows TPOT against the strictest TPOT target. The prefill limit
        follows the worker's own part of TTFT (dispatch to first token) against half the
        strictest TTFT target, the other half being left for the wait in the queue: requests
        dispatched into vLLM wait there first come, first served, so the gateway keeps the
        worker's prefill queue short and the backlog in its own queue, where tiers apply.
        Each grows while latencies are within the target times the TTFT headroom and is cut
        when one is over the target. ``prefill_peers`` is how many were prefilling with it
        (itself included), ``decode_load`` how many ran with it on average while it decoded: a
        TPOT within the aim lets the running limit rise at once to the load that would take
        TPOT to the aim (:meth:`app.limiter.ConcurrencyLimit.on_result`). The prefill limit
        does not project so: prompts differ in length, so one short prefill says little.
        """
        headroom = self._settings.ttft_headroom
        now = self._clock()
        if tpot_s is not None and self._tpot_target is not None:
            target = self._tpot_target
            worker.limit.on_result(
                tpot_s, headroom * target, target, worker.in_flight + 1, now, decode_load
            )
        if worker_ttft_s is not None:
            target = self._ttft_target / 2
            worker.prefill_limit.on_result(
                worker_ttft_s, headroom * target, target, prefill_peers, now
            )

    def paced(self, worker: Worker, pace_s: float, now: float) -> None:
        """``worker``'s streams advanced ``pace_s`` per token over the last few seconds.

        Slower than the strictest TPOT target: the batch has outgrown it now, so the running
        limit is cut at once (from what runs there) instead of when the streams that live
        through it end, seconds later (:class:`app.limiter.DecodePace`).
        """
        self._metrics.worker_decode_pace.labels(worker.label).set(pace_s)
        if self._tpot_target is not None and pace_s > self._tpot_target:
            worker.limit.cut(worker.in_flight, now)

    def export(self) -> None:
        """Refresh each worker's concurrency limit and learnt latency model (before an export)."""
        metrics = self._metrics
        for worker in self._pool.workers.values():
            label = worker.label
            latency = worker.latency
            metrics.worker_concurrency_limit.labels(label).set(self.cap(worker))
            metrics.worker_prefill_limit.labels(label).set(self.prefill_cap(worker))
            metrics.worker_prefilling.labels(label).set(worker.prefilling)
            slope = latency.prefill.slope
            metrics.worker_prefill_rate.labels(label).set(1.0 / slope if slope > 0 else 0.0)
            metrics.worker_decode_step.labels(label).set(latency.decode.predict(1))
            metrics.worker_decode_per_sequence.labels(label).set(latency.decode.slope)

    def _reserved_on(self, worker: Worker) -> int:
        return sum(1 for c in self._reserved.values() if c.worker is worker)

    def _recent_arrivals(self) -> deque[tuple[float, int]]:
        """``(time, priority)`` of the requests of the last ``_ACTIVE_S`` seconds."""
        since = self._clock() - _ACTIVE_S
        arrivals = self._arrivals
        while arrivals and arrivals[0][0] < since:
            arrivals.popleft()
        return arrivals

    def _expected_slots(self, now: float) -> dict[int, float]:
        """Per tier priority, how many running slots its requests are expected to hold.

        Little's law: arrival rate x how long one of its requests holds a slot. The rate is the
        largest of the last ``_ACTIVE_S`` seconds' (over the span actually observed, at least
        ``_MIN_SPAN_S``) and of each of the last ``_SURGE_SPANS_S`` (those with at least
        ``_SURGE_MIN_ARRIVALS`` arrivals of the tier, or of all tiers together, shared out by
        the tier's part of the window's arrivals): the long window alone would read the first
        seconds of a surge as the trickle before it, and slots handed to a lower tier meanwhile
        stay taken until its requests finish. Computed once per ``now`` (a dispatch pass asks for
        every queued request and every worker) and again after an arrival or a completion.
        """
        if self._expected[0] == now:
            return self._expected[1]
        recent = self._recent_arrivals()
        expected: dict[int, float] = {}
        if recent:
            span = max(_MIN_SPAN_S, min(_ACTIVE_S, now - recent[0][0]))
            counts = Counter(p for _, p in recent)
            rates = {p: n / span for p, n in counts.items()}
            shares = {p: n / len(recent) for p, n in counts.items()}
            for window in _SURGE_SPANS_S:
                latest: Counter[int] = Counter()
                for at, priority in reversed(recent):
                    if at < now - window:
                        break
                    latest[priority] += 1
                for priority, count in latest.items():
                    if count >= _SURGE_MIN_ARRIVALS:
                        rates[priority] = max(rates[priority], count / window)
                # All tiers' arrivals, shared out by each tier's part of the window: a surge of
                # every tier shows in the total three times sooner than in a 30% tier's own.
                pooled = sum(latest.values())
                if pooled >= _SURGE_MIN_ARRIVALS:
                    for priority, share in shares.items():
                        rates[priority] = max(rates[priority], pooled / window * share)
            fallback = max(self._held.values(), default=0.0)
            for priority, rate in rates.items():
                expected[priority] = rate * self._held.get(priority, fallback)
        self._expected = (now, expected)
        return expected

    def _kept_for_higher(self, worker: Worker, tier: TierSpec, workers: int, now: float) -> int:
        """Running slots of ``worker`` that ``tier`` must leave free for the tiers above it.

        Zero when no tier above had requests in the last ``_ACTIVE_S`` seconds, else at least
        one. What the tiers above are expected to hold (:meth:`_expected_slots`), spread over
        ``workers``, plus two standard deviations (Poisson arrivals) for their bursts, less what
        they hold on this worker now: their next requests then start at once instead of
        waiting for a lower tier's request to finish (it cannot be preempted).
        """
        higher = [v for p, v in self._expected_slots(now).items() if p < tier.priority]
        if not higher:
            return 0
        expected = sum(higher) / max(workers, 1)
        needed = math.ceil(expected + 2 * math.sqrt(expected))
        running = sum(
            n for name, n in worker.tier_in_flight.items() if self._priorities[name] < tier.priority
        )
        return max(1, needed - running)

    def _full(
        self,
        worker: Worker,
        tier: TierSpec | None = None,
        workers: int = 1,
        now: float | None = None,
    ) -> bool:
        """Whether ``worker`` (one of ``workers`` serving the model) takes no more of ``tier``.

        Running or prefilling at its limit. Below a tier that has had requests in the last
        ``_ACTIVE_S`` seconds, the limits are lower: the running slots that tier is expected
        to need (:meth:`_kept_for_higher`) and one prefill slot are kept free for it, leaving
        a lower tier at least the last slot of an otherwise empty worker.
        """
        reserved = self._reserved_on(worker)
        cap, prefill_cap = self.cap(worker), self.prefill_cap(worker)
        if tier is None:
            kept = 0
        else:
            now = self._clock() if now is None else now
            kept = self._kept_for_higher(worker, tier, workers, now)
        if kept:
            cap -= min(cap - 1, kept)
            prefill_cap -= min(prefill_cap - 1, 1)
        return worker.in_flight + reserved >= cap or worker.prefilling + reserved >= prefill_cap

    def _try(self, ticket: Ticket, now: float) -> Choice | None:
        """The worker to run ``ticket`` on now (lowest predicted TTFT among those with room).

        None when every worker is at one of its limits. The predicted TTFT picks the worker
        but does not hold a request back: under load the fitted prefill model was seen to
        overestimate, which kept interactive requests queued until their deadline while the
        workers had room. The measured-latency limits are what keep TTFT and TPOT in bounds.
        """
        candidates = self._router.candidates(ticket.model)
        n = len(candidates)
        full = frozenset(w.label for w in candidates if self._full(w, ticket.tier, n, now))
        if len(full) == len(candidates):
            return None
        return self._router.choose(ticket.model, ticket.own_tokens, ticket.affinity, full)

    def _min_service(self, ticket: Ticket) -> float:
        """TTFT of the request on the fastest idle worker: no wait can make it shorter."""
        best = math.inf
        for worker in self._router.candidates(ticket.model):
            best = min(best, worker.latency.prefill.predict(ticket.own_tokens))
        return best

    def _start_margin(self, ticket: Ticket, fastest: float) -> float:
        """Time to leave, between leaving the queue and the TTFT target, for the first token.

        On the best worker, the larger of the idle prefill (``fastest``) and its recent times
        to first token (:attr:`app.workers.Worker.recent_ttft`): under load a request is
        prefilled behind others. A request dispatched later than this would likely miss its
        target anyway, and would hold a slot for its whole answer that one that can still
        meet its target could have had (seen: of 274 interactive requests at 9 req/s, 17 ran
        and got their first token 1.0-1.4 s after arriving).
        """
        candidates = self._router.candidates(ticket.model)
        return min(
            (max(fastest, worker.recent_ttft.value()) for worker in candidates), default=fastest
        )

    # Admission ----------------------------------------------------------------------------

    async def admit(self, ticket: Ticket) -> tuple[Choice, float]:
        """``(worker choice, seconds spent queued)``; raises when the request is turned away."""
        tier = ticket.tier.name
        if not self._settings.admission:
            direct = self._router.choose(ticket.model, ticket.own_tokens, ticket.affinity)
            self._decide(tier, "admitted")
            return direct, 0.0
        now = self._clock()
        self._arrivals.append((now, ticket.tier.priority))
        self._expected = _NOT_COMPUTED
        fastest = self._min_service(ticket)
        if fastest > ticket.tier.ttft_slo_s:
            # Even an idle worker would miss the target: no wait helps, a lower tier would.
            self._decide(tier, "rejected", shortage=False)
            raise Overloaded(
                f"This prompt is predicted to take {fastest:.1f} s to its first token, over the "
                f"'{tier}' tier's {ticket.tier.ttft_slo_s:g} s target; use a lower tier.",
                self._retry_after(ticket),
            )
        if not self._waiting_ahead(ticket) and not self._yields(ticket.tier, now):
            choice = self._try(ticket, now)
            if choice is not None:
                self._decide(tier, "admitted")
                return choice, 0.0
        latest_start = ticket.arrival + ticket.tier.ttft_slo_s - self._start_margin(ticket, fastest)
        ticket.deadline = min(ticket.arrival + ticket.tier.max_queue_wait_s, latest_start)
        # Waiting only to be told no at the deadline helps nobody: if the work ahead of it,
        # at the rate requests are leaving the workers, will not be gone by then, say so now.
        if ticket.deadline <= now or now + self._expected_wait(ticket) > ticket.deadline:
            self._decide(tier, "rejected")
            raise Overloaded(
                f"The gateway cannot meet the '{tier}' tier's {ticket.tier.ttft_slo_s:g} s "
                "time-to-first-token target now; retry later or use a lower tier.",
                self._retry_after(ticket),
            )
        if len(self._queue) >= self._settings.max_queue_length and not self._shed_for(ticket):
            self._decide(tier, "rejected")
            raise Overloaded("The admission queue is full; retry later.", self._retry_after(ticket))
        return await self._wait(ticket, now)

    async def _wait(self, ticket: Ticket, now: float) -> tuple[Choice, float]:
        ticket.seq = next(self._seq)
        ticket.future = asyncio.get_running_loop().create_future()
        self._insert(ticket)
        self._decide(ticket.tier.name, "queued")
        self._ensure_ticker()
        try:
            choice = await ticket.future
        except asyncio.CancelledError:
            if ticket in self._queue:
                self._remove(ticket)
                self._decide(ticket.tier.name, "cancelled")
            self._unreserve(ticket)
            self.poke()
            raise
        self._unreserve(ticket)
        waited = self._clock() - now
        self._metrics.queue_wait.labels(ticket.tier.name).observe(waited)
        return choice, waited

    def _unreserve(self, ticket: Ticket) -> None:
        choice = self._reserved.pop(ticket, None)
        if choice is not None:
            choice.worker.prefill_tokens_ahead -= ticket.own_tokens

    def _waiting_ahead(self, ticket: Ticket) -> bool:
        """Whether a queued request of the same model and at least this tier waits already."""
        return any(
            t.model == ticket.model and t.tier.priority <= ticket.tier.priority for t in self._queue
        )

    def _shed_for(self, ticket: Ticket) -> bool:
        """Drop the least urgent sheddable request of a lower tier, if there is one."""
        victims = [
            t for t in self._queue if t.tier.sheddable and t.tier.priority > ticket.tier.priority
        ]
        if not victims:
            return False
        victim = max(victims, key=lambda t: t.key)
        self._remove(victim)
        self._decide(victim.tier.name, "shed")
        if victim.future is not None and not victim.future.done():
            victim.future.set_exception(
                Shed(
                    "This request was shed to make room for more urgent work; retry later.",
                    self._retry_after(victim),
                )
            )
        return True

    # Dispatch -----------------------------------------------------------------------------

    def poke(self) -> None:
        """Capacity may have freed up: run the dispatcher soon (once, however often poked)."""
        if self._queue and not self._poked:
            self._poked = True
            asyncio.get_running_loop().call_soon(self._dispatch)

    def completed(
        self, tier: str, held_s: float, decode_s: float = 0.0, decoded: float = 0.0
    ) -> None:
        """A request of ``tier`` left its worker after holding a slot for ``held_s`` seconds.

        Counted for the drain rate and the tier's expected demand; then dispatch. ``decode_s``
        of the hold went to ``decoded`` tokens after the first. The hold counted for the
        tier's demand is at least what it would have been at the TPOT aim: the slots kept for
        a tier matter when the workers are at their limits, which hold TPOT near the aim, and
        holds learnt at a lighter load say too little. Seen: holds of ~3.5 s from a warm-up
        at capacity kept too few slots in the first seconds of a 3x surge; standard requests
        took 4-9 of them at 3.5-5 s and held them to 9-10 s, while interactive requests,
        then holding ~5.5 s each, filled every other slot and were turned away.
        """
        aim = self._tpot_aim
        if aim is not None and decoded > 0 and decode_s < decoded * aim:
            held_s += decoded * aim - decode_s
        now = self._clock()
        priority = self._priorities[tier]
        previous = self._held.get(priority)
        self._held[priority] = (
            held_s if previous is None else previous + _HELD_WEIGHT * (held_s - previous)
        )
        self._expected = _NOT_COMPUTED
        self._completions.append(now)
        while self._completions and self._completions[0] < now - _DRAIN_WINDOW_S:
            self._completions.popleft()
        self.poke()

    def _dispatch(self) -> None:
        self._poked = False
        now = self._clock()
        blocked: set[str] = set()
        for ticket in list(self._queue):
            future = ticket.future
            if future is None or future.done():
                self._remove(ticket)
                continue
            if ticket.deadline <= now:
                self._remove(ticket)
                self._decide(ticket.tier.name, "expired")
                future.set_exception(
                    QueueTimeout(
                        f"The request waited {now - ticket.arrival:.2f} s in the '"
                        f"{ticket.tier.name}' queue without capacity to meet its SLO.",
                        self._retry_after(ticket),
                    )
                )
                continue
            # Strict priority within a model: nobody overtakes a blocked request of its model.
            if ticket.model in blocked or self._yields(ticket.tier, now):
                continue
            try:
                choice = self._try(ticket, now)
            except GatewayError:
                choice = None  # no healthy worker right now: wait for one until the deadline
            if choice is None:
                blocked.add(ticket.model)
                continue
            self._remove(ticket)
            # Until its task runs and takes the worker, the slot and prefill work are held here
            # so the next request in this same pass sees them.
            self._reserved[ticket] = choice
            choice.worker.prefill_tokens_ahead += ticket.own_tokens
            self._decide(ticket.tier.name, "admitted")
            future.set_result(choice)

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="admission")

    async def _tick(self) -> None:
        while self._queue:
            nearest = min(t.deadline for t in self._queue)
            await asyncio.sleep(max(0.0, min(_TICK_S, nearest - self._clock())))
            self._dispatch()

    async def stop(self) -> None:
        """Stop the ticker; queued requests are failed by their own cancellation."""
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    # Bookkeeping --------------------------------------------------------------------------

    def _insert(self, ticket: Ticket) -> None:
        index = bisect.bisect(self._keys, ticket.key)
        self._keys.insert(index, ticket.key)
        self._queue.insert(index, ticket)
        self._metrics.queue_depth.labels(ticket.tier.name).inc()

    def _remove(self, ticket: Ticket) -> None:
        index = self._queue.index(ticket)
        del self._queue[index]
        del self._keys[index]
        self._metrics.queue_depth.labels(ticket.tier.name).dec()

    def _decide(self, tier: str, decision: str, shortage: bool = True) -> None:
        self._metrics.admission_decisions.labels(tier, decision).inc()
        if shortage and decision in ("rejected", "expired"):
            # Capacity is short for this tier: lower tiers yield for a while.
            priority = self._priorities[tier]
            self._short_until[priority] = self._clock() + _SHORTAGE_S

    def _yields(self, tier: TierSpec, now: float) -> bool:
        """Whether ``tier`` must leave free capacity to a higher tier that is short of it."""
        return any(
            until > now for priority, until in self._short_until.items() if priority < tier.priority
        )

    def drain_rate(self) -> float:
        """Requests leaving the workers per second, over the last few seconds."""
        now = self._clock()
        recent = [t for t in self._completions if t >= now - _DRAIN_WINDOW_S]
        if len(recent) < 2:
            return 0.0
        return len(recent) / max(now - recent[0], 1.0)

    def _expected_wait(self, ticket: Ticket) -> float:
        """Seconds until the requests queued ahead of ``ticket``, and then it, get a slot.

        Zero while nothing has been seen to leave the workers (no evidence of a wait yet).
        """
        rate = self.drain_rate()
        if rate <= 0:
            return 0.0
        ahead = 1 + sum(1 for t in self._queue if t.tier.priority <= ticket.tier.priority)
        return ahead / rate

    def _retry_after(self, ticket: Ticket) -> float:
        """When capacity for this request is likely: the work ahead of it over the drain rate."""
        ahead = 1 + sum(1 for t in self._queue if t.tier.priority <= ticket.tier.priority)
        rate = self.drain_rate()
        if rate <= 0:
            return min(_MAX_RETRY_AFTER_S, ticket.tier.max_queue_wait_s)
        return min(_MAX_RETRY_AFTER_S, max(0.1, ahead / rate))

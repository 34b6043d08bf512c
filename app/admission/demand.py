"""What each tier is expected to need: the running slots a lower tier must leave free.

Requests cannot be preempted, so a slot handed to a lower tier stays taken until its request
finishes. A lower tier therefore leaves free the slots the tiers above it are expected to need:
Little's law over their recent arrivals and how long one of their requests holds a slot. And
for a short while after a higher tier had a request turned away, lower tiers wait.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Mapping
from typing import Protocol

from app.observe.timing import Clock
from app.settings import TierSpec

# The window over which higher tiers' arrival rates set the capacity kept for them.
_ACTIVE_S = 10.0
# Recent spans whose arrival rate counts when it is higher than the window's: a surge is read
# within half a second instead of over two, while the slots handed to lower tiers meanwhile
# would stay taken until their requests finish. The longer spans keep a surge read as one
# until it fills the window (see TierDemand.expected_slots).
_SURGE_SPANS_S = (0.5, 1.0, 2.0, 4.0, 8.0)
# The fewest arrivals in a surge span that say anything (one alone is no rate).
_SURGE_MIN_ARRIVALS = 3
# How many standard deviations (Poisson) a surge span's count must stand above what the window's
# rate would bring in that span: arrivals at a third of capacity, read over half a second,
# otherwise look like a rate above capacity a fifth of the time by chance alone.
_SURGE_Z = 4.0
# The shortest span arrival rates are measured over (fewer arrivals say too little).
_MIN_SPAN_S = 1.0
# Weight of a finished request in the running average of how long a tier's requests hold a slot.
_HELD_WEIGHT = 0.1
# How long lower tiers yield after a higher tier had a request turned away.
_SHORTAGE_S = 2.0
_NOT_COMPUTED: tuple[float, dict[int, float]] = (-math.inf, {})
WINDOWS_S = (_ACTIVE_S, *_SURGE_SPANS_S)
"""Every window arrivals are counted over: the long one, then the surge spans."""


class _Window:
    """Arrivals per tier priority over the last ``span`` seconds, kept as they come and go."""

    __slots__ = ("arrivals", "counts", "span")

    def __init__(self, span: float) -> None:
        self.span = span
        self.arrivals: deque[tuple[float, int]] = deque()
        self.counts: Counter[int] = Counter()

    def add(self, at: float, priority: int) -> None:
        self.arrivals.append((at, priority))
        self.counts[priority] += 1

    def at(self, now: float) -> Counter[int]:
        """The counts of the span ending at ``now`` (older arrivals leave)."""
        arrivals, counts, since = self.arrivals, self.counts, now - self.span
        while arrivals and arrivals[0][0] < since:
            _, priority = arrivals.popleft()
            counts[priority] -= 1
        return counts


class ArrivalCounts(Protocol):
    """Arrivals and queued requests at the rest of the fleet (other processes and replicas).

    As last read (:mod:`app.admission.shared` reads them from Redis). :class:`TierDemand` adds the
    arrivals to its own in every window: the slots kept for a tier are then kept for its
    arrivals fleet-wide.
    """

    def counts(self, span_s: float, now: float) -> Mapping[int, int]:
        """Arrivals elsewhere per tier priority over the last ``span_s`` (empty: unknown)."""

    def oldest_age(self, now: float) -> float:
        """Seconds since the oldest arrival elsewhere within the last ``WINDOWS_S[0]`` (0: none)."""

    def queued(self, model: str, now: float) -> Mapping[int, int]:
        """Requests for ``model`` queued elsewhere per tier priority (empty: none, or unknown)."""


class TierDemand:
    """Per tier priority: recent arrivals, how long a request holds a slot, recent shortages."""

    def __init__(self, clock: Clock, tpot_aim: float | None) -> None:
        self._clock = clock
        self._started = clock()
        self._tpot_aim = tpot_aim
        self._window = _Window(_ACTIVE_S)
        self._spans = [_Window(span) for span in _SURGE_SPANS_S]
        self._held: dict[int, float] = {}
        """Per tier priority: the mean hold, counted at least at the TPOT aim (slots kept)."""
        self._held_seen: dict[int, float] = {}
        """Per tier priority: the mean hold as measured (whether the pool will saturate)."""
        self._waited: dict[int, float] = {}
        """Per tier priority: the mean wait in the queue (0 for a request let in at once)."""
        self._decoded: dict[int, float] = {}
        """Per tier priority: the mean tokens a stream had after its first."""
        self._short_at: dict[int, float] = {}
        """Per tier priority: when it last had a request turned away."""
        self._rates: tuple[float, dict[int, float]] = _NOT_COMPUTED
        self.queued: Counter[tuple[str, int]] = Counter()
        """Requests queued here per (model, tier priority): admission's queue keeps it
        (:class:`app.admission.waiting.WaitQueue`), others read it."""
        self.fleet: ArrivalCounts | None = None
        """The rest of the fleet's arrivals, added to this process's own (None: alone)."""

    def local_counts(self, now: float) -> tuple[dict[float, Counter[int]], float]:
        """What this process publishes to the rest of the fleet.

        Its own arrivals per tier priority in each window of ``WINDOWS_S``, and the seconds
        since the oldest one of the long window (0 when none).
        """
        counts = {w.span: w.at(now) for w in (self._window, *self._spans)}
        arrivals = self._window.arrivals
        return counts, now - arrivals[0][0] if arrivals else 0.0

    def local_queued(self) -> dict[str, dict[int, int]]:
        """What this process publishes of its queue: per model, requests per tier priority."""
        published: dict[str, dict[int, int]] = {}
        for (model, priority), n in self.queued.items():
            if n:
                published.setdefault(model, {})[priority] = n
        return published

    def queued_elsewhere(self, model: str, tier: TierSpec, now: float) -> int:
        """Requests for ``model`` of the tiers above ``tier`` queued at the rest of the fleet.

        In one process a lower tier never overtakes a queued higher one (strict priority); a
        process that saw only its own queue handed every slot freed on a shared worker to its
        own batch before another process's queued interactive requests could see the slot (a
        sync later), and those waited out their TTFT target (a flood of batch requests through
        one process, interactive through the other, with the worker's slots all taken).
        """
        if self.fleet is None:
            return 0
        return sum(n for p, n in self.fleet.queued(model, now).items() if p < tier.priority)

    def _counts(self, window: _Window, now: float) -> Counter[int]:
        """The window's arrivals here, plus the rest of the fleet's when they are known."""
        counts = window.at(now)
        fleet = None if self.fleet is None else self.fleet.counts(window.span, now)
        if not fleet:
            return counts
        return counts + Counter(fleet)

    def _first(self, now: float) -> float:
        """Since when arrivals were counted (the start of the span rates are measured over).

        When this process began, or the oldest arrival of the long window, here or elsewhere in
        the fleet, if that came before. Not the oldest arrival alone: after a quiet spell that
        is the latest few, and over the second since them an interactive and a standard request
        read as a rate of one a second each, four times a CPU worker's capacity, which kept ten
        of its slots for the top tier and queued the standard request behind a single stream
        (0.75x of capacity).
        """
        arrivals = self._window.arrivals
        first = min(self._started, arrivals[0][0]) if arrivals else self._started
        if self.fleet is not None:
            first = min(first, now - self.fleet.oldest_age(now))
        return first

    def higher_arrived(self, tier: TierSpec, now: float) -> bool:
        """Whether a tier above ``tier`` had a request in the last ``_ACTIVE_S`` seconds.

        Here or, when known, elsewhere in the fleet: exactly when :meth:`arrival_rates` has a
        rate for a tier above. When none did, nothing is kept for one
        (:meth:`kept_for_higher` is 0) and no prompt is held for one, and the rates need not be
        computed: a request of the top tier, or of any tier while the tiers above are quiet,
        skips them.
        """
        mine = tier.priority
        return any(n for p, n in self._counts(self._window, now).items() if p < mine)

    def arrived(self, priority: int, now: float) -> None:
        """A request of tier ``priority`` arrived at ``now``."""
        self._window.add(now, priority)
        for span in self._spans:
            span.add(now, priority)
        self._rates = _NOT_COMPUTED

    def held(
        self,
        priority: int,
        held_s: float,
        decode_s: float,
        decoded: float,
        full_pace_s: float | None = None,
    ) -> None:
        """A request of tier ``priority`` left its worker after holding a slot ``held_s``.

        ``decode_s`` of the hold went to ``decoded`` tokens after the first; ``full_pace_s``
        is the TPOT its worker is expected to decode at while running its limit
        (:meth:`app.admission.limits.Limits.full_pace`; None: the TPOT aim). Two averages are
        kept. The slots kept for a tier count its hold at least as it would have been at that
        pace: they matter when the workers are at their limits, and holds learnt at a lighter
        load (a warm-up, the first seconds of a surge) kept too few. Not at the aim alone: a
        worker whose batch its engine bounds decodes far under the aim when full, and holds
        counted at the aim (seen: 8 times the measured ones at 1.5x of the simulated GPU
        fleet's capacity) kept more slots for interactive than the workers ran, and lower tiers
        waited on idle workers. Whether the pool is expected to saturate counts the holds as
        measured: at a light load streams decode well under the aim, and the aim's holds (seen:
        2.3 times the measured ones) expected more slots than the workers ran, and kept slots
        at 0.75x of capacity that queued lower tiers for seconds on idle workers.
        """
        _average(self._held_seen, priority, held_s)
        if decoded > 0:
            _average(self._decoded, priority, decoded)
        pace = self._tpot_aim if full_pace_s is None else full_pace_s
        if pace is not None and decoded > 0 and decode_s < decoded * pace:
            held_s += decoded * pace - decode_s
        _average(self._held, priority, held_s)

    def mean_hold(self, priority: int) -> float | None:
        """Tier ``priority``'s mean hold of a slot, counted at least at the full pace.

        What the slots kept for the tier are reckoned with; None before any request of it ended.
        """
        return self._held.get(priority)

    def waited(self, priority: int, waited_s: float) -> None:
        """A request of tier ``priority`` left the queue after ``waited_s`` (0: never queued)."""
        _average(self._waited, priority, waited_s)

    def typical_decode(self, priority: int) -> float | None:
        """The mean tokens after the first of tier ``priority``'s streams (None: none seen)."""
        return self._decoded.get(priority)

    def short(self, priority: int, now: float) -> None:
        """Tier ``priority`` had a request turned away: lower tiers yield for a while."""
        self._short_at[priority] = now

    def yields(self, tier: TierSpec, now: float) -> bool:
        """Whether ``tier`` must leave free capacity to a higher tier that is short of it."""
        return any(
            now - at < _SHORTAGE_S
            for priority, at in self._short_at.items()
            if priority < tier.priority
        )

    def expected_slots(self, now: float) -> dict[int, float]:
        """Per tier priority, how many running slots its requests are expected to hold.

        Little's law: arrival rate x how long one of its requests holds a slot. The rate is the
        last ``_ACTIVE_S`` seconds' (over as much of them as was observed, at least
        ``_MIN_SPAN_S``: :meth:`_first`),
        or the rate of one of the last ``_SURGE_SPANS_S`` when that is higher and cannot be
        chance: the span saw at least ``_SURGE_MIN_ARRIVALS`` arrivals of the tier, ``_SURGE_Z``
        standard deviations more than the window's rate brings in such a span; or, over spans of
        at least ``_MIN_SPAN_S``, all tiers' arrivals together (shared out by each tier's part of
        the window's arrivals) stood that far above the rate of the rest of the window. The long
        window alone would read the first seconds of a surge as the trickle before it. The rates are
        computed once per ``now`` (a dispatch pass asks for every queued request and every
        worker) and again after an arrival. The hold is counted at the TPOT aim (:meth:`held`).
        """
        return self._expected(now, self._held)

    def _expected(self, now: float, held: Mapping[int, float]) -> dict[int, float]:
        """Per tier priority: its arrival rate now x its mean hold in ``held``."""
        rates = self.arrival_rates(now)
        fallback = max(held.values(), default=0.0)
        return {p: rate * held.get(p, fallback) for p, rate in rates.items()}

    def arrival_rates(self, now: float) -> dict[int, float]:
        """Per tier priority, the arrival rate :meth:`expected_slots` describes (once per now)."""
        if self._rates[0] == now:
            return self._rates[1]
        counts = self._counts(self._window, now)
        total = sum(counts.values())
        rates: dict[int, float] = {}
        if total:
            first = self._first(now)
            span = max(_MIN_SPAN_S, min(_ACTIVE_S, now - first))
            rates = {p: n / span for p, n in counts.items() if n}
            shares = {p: n / total for p, n in counts.items() if n}
            for window in self._spans:
                latest = self._counts(window, now)
                for priority, count in latest.items():
                    if _surge(count, counts[priority] / span * window.span):
                        rates[priority] = max(rates[priority], count / window.span)
                # All tiers' arrivals, shared out by each tier's part of the window: a surge of
                # every tier shows in the total three times sooner than in a 30% tier's own.
                # Judged against the rest of the window, before the span: a window that holds
                # the surge's own first seconds takes them for the usual rate, and a lasting
                # step up reads as a slow climb that reaches the new rate only once it fills
                # the window (docs/admission.md).
                before = span - window.span
                pooled = sum(latest.values())
                if (
                    window.span >= _MIN_SPAN_S
                    and before >= _MIN_SPAN_S
                    and _surge(pooled, (total - pooled) / before * window.span)
                ):
                    for priority, share in shares.items():
                        rates[priority] = max(rates[priority], pooled / window.span * share)
        self._rates = (now, rates)
        return rates

    def expected_total(self, now: float) -> float:
        """How many requests all tiers together are expected to have in, queued or running.

        Little's law over the waits in the queue and the holds as measured (:meth:`held`), not
        at the TPOT aim. The waits count: clients that send their next request when the last
        one ends (a batch job of fixed concurrency) arrive only as fast as requests finish, so
        over the holds alone the slots they are expected to hold are at most what the workers
        run, however many wait, and the pool read as saturated only by chance (seen: 6 batch
        streams on 4 slots read as 3.3-4.5 slots, and interactive requests of another gateway
        process waited out their TTFT target while batch took every slot).
        """
        waited = self._waited
        waiting = sum(rate * waited.get(p, 0.0) for p, rate in self.arrival_rates(now).items())
        return sum(self._expected(now, self._held_seen).values()) + waiting

    def kept_for_higher(self, tier: TierSpec, workers: int, running_above: int, now: float) -> int:
        """Running slots of one of ``workers`` that ``tier`` must leave free for the tiers above.

        What the tiers above are expected to hold (:meth:`expected_slots`) over the whole pool,
        spread over ``workers``, less ``running_above``, what they hold on this worker now; at
        least one while any tier above had a request in the window, zero when none did. Their
        next requests then start at once instead of waiting for a lower tier's request to
        finish.

        No margin for their bursts: the top tier is never held back by lower tiers' requests
        (it goes past the running limit by as many of them as run), so what is kept only holds
        the batch near the aim while the tiers above arrive at their expected rate. A margin of
        two standard deviations, on a worker of a few slots, kept nearly all of them for a tier
        that held a third on average, and the worker idled while lower tiers were turned away
        (docs/admission.md).

        Kept for as long as they are expected, not only after a higher tier had a request
        turned away: kept for 10 s after each refusal, lower tiers filled the workers the
        moment it lapsed and the interactive streams running beside them went over their TPOT
        target (3x capacity, ``make bench-admission``'s workers).
        """
        higher = [slots for p, slots in self.expected_slots(now).items() if p < tier.priority]
        if not higher:
            return 0
        needed = math.ceil(sum(higher) / max(workers, 1))
        return max(1, needed - running_above)


def _average(means: dict[int, float], priority: int, value: float) -> None:
    """Move ``means[priority]`` towards ``value`` (the first value is taken as it is)."""
    previous = means.get(priority)
    means[priority] = value if previous is None else previous + _HELD_WEIGHT * (value - previous)


def _surge(count: int, usual: float) -> bool:
    """Whether ``count`` arrivals in a span where ``usual`` were expected cannot be chance."""
    return count >= _SURGE_MIN_ARRIVALS and count >= usual + _SURGE_Z * math.sqrt(max(usual, 1.0))

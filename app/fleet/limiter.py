"""A worker's concurrency limit, steered by the latencies its requests actually get.

Decode slows as the batch grows and prefill of new arrivals stalls the running streams, so the
number of requests a worker can run while keeping a TPOT target depends on the model, the
hardware, the prompt mix and the arrival rate. Rather than trusting a fitted model of all that
(fits were seen to swing by 10x under load), the limit is found by feedback, as TCP finds a
window (additive increase, multiplicative decrease):

* a request whose latency was within the aim (the target times the headroom) while it ran at
  the limit (its mean load, or the count in flight when no load is given, at least the limit
  less one) raises the limit by one: in a surge, requests finishing had run under the lighter
  load of seconds before, and raising the limit on their word let the batch outgrow the TPOT
  target;
* a request that missed the target (TPOT over the TPOT target, or the worker's own time to
  first token over its share of the TTFT target: see :mod:`app.admission.limits`) cuts it by
  ``decrease``, or by target / latency when that is lower (down to a half: far over the
  target, a 10% cut a second took many seconds to come down), at most once per
  ``cooldown_s`` since one overload is seen by every request that lived through it, and from
  the load the miss was measured at when that is lower: the larger of the count in flight
  and the load the stream (or the pace window) ran under (:meth:`ConcurrencyLimit.cut`);
* a worker that holds requests back for capacity sets the limit to the most it ran while
  doing so in the last seconds (:meth:`ConcurrencyLimit.hold`);
* so does the worker's live pace (:class:`DecodePace`) when its running streams, together,
  advance slower than the TPOT target: a finished stream tells of a batch it joined seconds
  before;
* a request between the aim and the target changes nothing;
* given the ``load`` it ran under, a request within the aim also lets the limit rise at once to
  that load scaled by aim / latency, unless the limit was cut in the last ``settle_s``, and no
  higher than a ``ceiling`` (the learnt decode line's load, or the request's own load when
  higher: :mod:`app.admission.limits`). A decode step grows with the batch at most in proportion (a
  fixed cost plus a cost per sequence), so that load would keep the aim if decode were all; the
  prefills of more arrivals stall the steps too, which the line, fitted across loads, measures.
  Additive increase alone needs a request's whole lifetime per step: after a calm spell a surge
  found the limit where the calm had left it (10 per worker, against ~26 once settled) and
  interactive requests were turned away for its first 3 s.
"""

from __future__ import annotations

import math
from collections import deque

# The deepest single cut, however far over its target a latency was.
_DEEPEST_CUT = 0.5
# How long a worker's running count, read while it held requests back, stands for what it can
# run (ConcurrencyLimit.hold).
_HOLD_WINDOW_S = 10.0
# Gaps that make an early pace reading: many streams' worth, so one stalled step says little.
_EARLY_GAPS = 100


class ConcurrencyLimit:
    """Additive-increase / multiplicative-decrease limit on one worker's running requests."""

    __slots__ = (
        "_cooldown", "_decrease", "_draining", "_held", "_holds", "_initial", "_last_cut",
        "_settle", "_value", "limit", "maximum", "measured", "minimum",
    )  # fmt: skip

    def __init__(
        self,
        initial: float,
        maximum: float,
        minimum: float = 1.0,
        decrease: float = 0.9,
        cooldown_s: float = 1.0,
        settle_s: float = 5.0,
    ) -> None:
        self.maximum = maximum
        self.minimum = minimum
        self._value = self._initial = max(minimum, min(maximum, initial))
        self.limit = max(1, math.floor(self._value + 1e-9))
        """The whole number of requests that may run (kept with :attr:`value`: read far more
        often than it changes)."""
        self._decrease = decrease
        self._cooldown = cooldown_s
        self._settle = settle_s
        self._last_cut = -math.inf
        self._draining = False
        self._held = math.inf
        self._holds: deque[tuple[float, float]] = deque()
        self.measured = False
        """Whether a measurement lowered the limit: a miss, the live pace, the worker queueing."""

    @property
    def value(self) -> float:
        """The limit, fractional: it grows and shrinks by fractions of a request."""
        return self._value

    @value.setter
    def value(self, value: float) -> None:
        self._value = value
        self.limit = max(1, math.floor(value + 1e-9))

    def cut(self, in_flight: float, now: float, over: float = 1.0) -> bool:
        """A miss at ``now`` with ``in_flight`` running: cut, at most once per cooldown.

        Returns whether the limit fell.

        From the lower of the limit and ``in_flight``, as TCP cuts from the data in flight
        rather than from its window: a limit the load has not reached holds nothing back, and
        cutting it alone left the batch as it was. ``over`` is latency / target: the cut is
        ``decrease``, or 1 / ``over`` when deeper (at most to a half).

        Not while more run than the last cut left room for and they have not drained to it
        since: that cut has not taken effect yet (nothing of the tiers below the top is
        admitted until the excess drains, and the top tier's own requests stay within the
        limit), and the misses seen meanwhile are the excess's. Cutting on them again took a
        worker settling near 25 down to 2 after a surge, and turned requests away for the ten
        seconds it took to grow back. Once drained, more may run again (a tier borrows past
        the limit, :meth:`app.admission.room.Room.full`), and their misses cut: skipped
        for as long as more ran than the limit, they left a limit standing through the very
        overloads borrowing let in.
        """
        self._observe(in_flight)
        if self._draining:
            return False
        if now - self._last_cut < self._cooldown:
            return False
        before = self.value
        factor = min(self._decrease, max(_DEEPEST_CUT, 1.0 / over if over > 0 else 1.0))
        self.value = max(self.minimum, min(self.value, in_flight) * factor)
        self._last_cut = now
        self._draining = True
        self.measured = True
        return self.value < before

    def reset(self) -> None:
        """Back to where it started, unmeasured: the evidence that lowered it no longer holds."""
        self.value = self._initial
        self._last_cut = -math.inf
        self._draining = False
        self._held = math.inf
        self._holds.clear()
        self.measured = False

    def lift(self, to: float, now: float) -> None:
        """Raise the limit to ``to`` (within the maximum), unless cut in the last ``settle_s``.

        A cut's evidence stands a while before a projection overrides it. Never past what the
        worker was last seen to run while holding requests back (:meth:`hold`): a projection
        scales a TPOT within the aim to a batch the worker will not run (simulated workers of
        64 sequences had their limits lifted from 64 to 256 five seconds after each hold, and
        the excess waited in the workers' own queues, where no tier or deadline applies).
        Growth one result at a time (:meth:`on_result`) may still pass it, slowly.
        """
        to = min(to, self._held)
        if to > self.value and now - self._last_cut >= self._settle:
            self.value = min(self.maximum, to)

    def hold(self, running: float, now: float) -> bool:
        """The worker runs ``running`` and holds the rest back: its limit is what it can run.

        That is the most it was read to run while holding requests back in the last
        ``_HOLD_WINDOW_S``: a batch at its cap runs fewer for a step now and then (sequences
        end together, or a long prompt's chunk takes the step's token budget), and a page read
        at such a step set the limit below the cap; lifts never pass it (:meth:`lift`), so
        simulated workers of 64 sequences were held at 52-60 for minutes. Returns whether the
        limit fell; the reading is also the most a projection lifts it to.
        """
        holds = self._holds
        holds.append((now, running))
        while holds[0][0] < now - _HOLD_WINDOW_S:
            holds.popleft()
        most = max(ran for _, ran in holds)
        self._held = most
        if most >= self.value:
            return False
        self.measured = True
        return self._lower(most, now)

    def project(self, to: float, now: float) -> bool:
        """A projection (the learnt decode line's) says ``to`` keep the aim: lower to it.

        Only while no measurement has lowered the limit: a projection is not evidence, and
        once measured a limit falls only on measurements. Returns whether the limit fell.
        """
        if self.measured or to >= self.value:
            return False
        return self._lower(to, now)

    def _observe(self, in_flight: float) -> None:
        """``in_flight`` run now: at or under the limit, the excess over the last cut drained."""
        if in_flight <= self.value:
            self._draining = False

    def _lower(self, to: float, now: float) -> bool:
        before = self.value
        self.value = max(self.minimum, to)
        self._last_cut = now
        self._draining = True
        return self.value < before

    def on_result(
        self,
        latency: float,
        aim: float,
        target: float,
        in_flight: float,
        now: float,
        load: float | None = None,
        ceiling: float = math.inf,
    ) -> bool:
        """Learn from one finished request's ``latency``; ``in_flight`` includes it.

        At most ``aim``: room to grow (by one if it ran at the limit, by 1 / limit at or past what
        the worker ran while holding requests back within the last ``_HOLD_WINDOW_S``; to ``load``
        x aim / latency, at most ``ceiling``, if that is more and no cut is recent, ``load`` being
        the mean number of requests it shared the worker with, itself included). Over
        ``target``: a miss, cut. In between: no change. Cutting only on real misses, rather than
        on every request over the aim, lets the limit settle where the latency spread straddles
        the aim instead of well below it (which on a compute-bound worker gave up throughput for
        no SLO gain). Returns whether the limit fell (only a miss lowers it).
        """
        self._observe(in_flight)
        if latency > target:
            # The miss happened at the load it ran under, however few run as it ends.
            return self.cut(
                in_flight if load is None else max(in_flight, load), now, latency / target
            )
        if latency > aim:
            return False
        # Only a request that ran at the limit says the limit is safe: one that finishes now
        # decoded under the load of its lifetime, which in a surge was well below today's.
        ran_at = in_flight if load is None else load
        if ran_at >= self.limit - 1:
            # Past what the worker ran while holding requests back, by one per limit's worth
            # of results, as TCP grows past its slow-start threshold. One per result took
            # simulated workers of 64 sequences to 75-87 within seconds of each hold, and the
            # excess waited in their own queues, where no tier or deadline applies. Once it
            # held nothing back for _HOLD_WINDOW_S, by one per result again: a hold read at 12
            # running at half the fleet's capacity left a limit growing by one per 2.4 s for
            # minutes, and what a worker can run grows when its requests get shorter.
            # A finite _held means a hold was read (hold() appends before it sets _held).
            slow = self.value >= self._held and now - self._holds[-1][0] <= _HOLD_WINDOW_S
            self.value = min(self.maximum, self.value + (1.0 / self.value if slow else 1.0))
        if load is not None and latency > 0:
            self.lift(min(load * aim / latency, ceiling), now)
        return False


class DecodePace:
    """How fast a worker's running streams advance now: the mean gap between output events.

    A finished stream's TPOT tells the limit about a batch it joined seconds before (a
    64-token answer at 100 ms per token tells 6.5 s after it started). The gaps between the
    output events of every stream on the worker tell it within a few seconds, averaged over
    tens of streams. The window is ``window_s``, about half a short answer's life, because a
    stream's TPOT is its mean pace over its life: over 1-s windows, prefill stalls of new
    arrivals pushed single readings over the target while whole streams kept within it, and
    the cuts cost more requests turned away than the misses they saved. An event may carry
    several tokens (speculative decoding, stream intervals): gaps are per token at the ratio
    learnt from finished streams. It also keeps where the streams running now stand on their
    own TPOT (:meth:`so_far`), which a reading must miss too to cut
    (:meth:`app.admission.limits.Limits.paced`).
    """

    __slots__ = (
        "_count", "_live", "_live_first", "_live_gaps", "_min_gaps", "_since", "_sum", "_window",
        "alarm", "load", "tokens_per_event",
    )  # fmt: skip

    def __init__(self, window_s: float = 3.0, min_gaps: int = 20) -> None:
        self._window = window_s
        self._min_gaps = min_gaps
        self._since = -math.inf
        self._sum = 0.0
        self._count = 0
        self.tokens_per_event = 1.0
        self.alarm = math.inf
        """A pace per token so slow that a window closes early on it (see :meth:`gap`)."""
        self.load = 0.0
        """How many streams ran, on average, over the window of the latest reading."""
        # The streams decoding now: how many, the sum of their first outputs' times and
        # their gaps since. Kept as sums so that reading them costs nothing per stream.
        self._live = 0
        self._live_first = 0.0
        self._live_gaps = 0

    def gap(self, seconds: float, now: float) -> float | None:
        """Add one stream's gap since its previous output event, received at ``now``.

        Returns the mean gap per token over the window that ``now`` closes (at least
        ``window_s`` long, with at least ``min_gaps`` gaps), else None. A window closes after
        a third of its length already when ``_EARLY_GAPS`` gaps say the pace is slower than
        ``alarm``: a surge onto a worker whose limit no miss has lowered yet grows the batch by
        dozens a second, and a full window let in twice what the worker could keep at pace.
        """
        self._sum += seconds
        self._count += 1
        self._live_gaps += 1
        elapsed = now - self._since
        if elapsed < self._window and not (
            elapsed >= self._window / 3
            and self._count >= _EARLY_GAPS
            and self._sum > self.alarm * self.tokens_per_event * self._count
        ):
            return None
        reading = None
        if self._count >= self._min_gaps and math.isfinite(self._since):
            reading = self._sum / self._count / self.tokens_per_event
            # Each running stream's gaps tile the time it ran: their sum over the window's
            # length is the mean number of streams the reading is of.
            self.load = self._sum / elapsed
        self._since = now
        self._sum = 0.0
        self._count = 0
        return reading

    def started(self, first: float) -> None:
        """A stream whose first output came at ``first`` has its first gap: it decodes."""
        self._live += 1
        self._live_first += first

    def ended(self, first: float, gaps: int) -> None:
        """A decoding stream (first output at ``first``, ``gaps`` gaps since) ended."""
        self._live -= 1
        self._live_first -= first
        self._live_gaps -= gaps
        if self._live <= 0:  # exact again, whatever rounding the sums gathered
            self._live, self._live_first, self._live_gaps = 0, 0.0, 0

    def so_far(self, now: float) -> float | None:
        """The decoding streams' TPOT so far, pooled (None with fewer than ``min_gaps`` gaps).

        Their time since their first outputs (the gap each is in now included) over the tokens
        they have had since. A stream's TPOT, what the target measures, is its mean pace over
        its life: this is where the streams running now stand on it.
        """
        if self._live <= 0 or self._live_gaps < self._min_gaps:
            return None
        return (self._live * now - self._live_first) / self._live_gaps / self.tokens_per_event

    def observe_stream(self, tokens: int, events: int) -> None:
        """Learn tokens per output event from a finished stream."""
        if tokens > 1 and events > 1:
            ratio = max(1.0, (tokens - 1) / (events - 1))
            self.tokens_per_event += 0.1 * (ratio - self.tokens_per_event)

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
* a request that missed the target (TPOT over the strictest TPOT target, or the worker's own
  time to first token over its share of the strictest TTFT target) cuts it by ``decrease``, or
  by target / latency when that is lower (down to a half: far over the target, a 10% cut a
  second took many seconds to come down), at most once per ``cooldown_s`` since one overload
  is seen by every request that lived through it, and from the count in flight when that is
  lower (:meth:`ConcurrencyLimit.cut`);
* a worker that holds requests back for capacity sets the limit to what it runs
  (:meth:`ConcurrencyLimit.hold`);
* so does the worker's live pace (:class:`DecodePace`) when its running streams, together,
  advance slower than the TPOT target: a finished stream tells of a batch it joined seconds
  before;
* a request between the aim and the target changes nothing;
* given the ``load`` it ran under, a request within the aim also lets the limit rise at once to
  that load scaled by aim / latency, unless the limit was cut in the last ``settle_s``. TPOT
  grows with the batch at most in proportion (a decode step is a fixed cost plus a cost per
  sequence), so that load would still be within the aim. Additive increase alone needs a
  request's whole lifetime per step: after a calm spell a surge found the limit where the calm
  had left it (10 per worker, against ~26 once settled) and interactive requests were turned
  away for its first 3 s.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from app.metrics import GatewayMetrics
from app.settings import Settings

if TYPE_CHECKING:
    from app.workers import Worker, WorkerPool

# The deepest single cut, however far over its target a latency was.
_DEEPEST_CUT = 0.5


class ConcurrencyLimit:
    """Additive-increase / multiplicative-decrease limit on one worker's running requests."""

    __slots__ = (
        "_cooldown", "_decrease", "_last_cut", "_settle", "maximum", "minimum", "value",
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
        self.value = max(minimum, min(maximum, initial))
        self._decrease = decrease
        self._cooldown = cooldown_s
        self._settle = settle_s
        self._last_cut = -math.inf

    @property
    def limit(self) -> int:
        """The whole number of requests that may run."""
        return max(1, math.floor(self.value + 1e-9))

    def cut(self, in_flight: float, now: float, over: float = 1.0) -> None:
        """A miss at ``now`` with ``in_flight`` running: cut, at most once per cooldown.

        From the lower of the limit and ``in_flight``, as TCP cuts from the data in flight
        rather than from its window: a limit the load has not reached holds nothing back, and
        cutting it alone left the batch as it was. ``over`` is latency / target: the cut is
        ``decrease``, or 1 / ``over`` when deeper (at most to a half).
        """
        if now - self._last_cut >= self._cooldown:
            factor = min(self._decrease, max(_DEEPEST_CUT, 1.0 / over if over > 0 else 1.0))
            self.value = max(self.minimum, min(self.value, in_flight) * factor)
            self._last_cut = now

    def hold(self, running: float, now: float) -> None:
        """The worker runs ``running`` and holds the rest back: that is its limit now."""
        if running < self.value:
            self.value = max(self.minimum, running)
            self._last_cut = now

    def on_result(
        self,
        latency: float,
        aim: float,
        target: float,
        in_flight: float,
        now: float,
        load: float | None = None,
    ) -> None:
        """Learn from one finished request's ``latency``; ``in_flight`` includes it.

        At most ``aim``: room to grow (by one if it ran at the limit; to ``load`` x aim /
        latency if that is more and no cut is recent, ``load`` being the mean number of
        requests it shared the worker with, itself included). Over ``target``: a miss, cut.
        In between: no change. Cutting only on real misses, rather than on every request over
        the aim, lets the limit settle where the latency spread straddles the aim instead of
        well below it (which on a compute-bound worker gave up throughput for no SLO gain).
        """
        if latency > target:
            self.cut(in_flight, now, latency / target)
            return
        if latency > aim:
            return
        # Only a request that ran at the limit says the limit is safe: one that finishes now
        # decoded under the load of its lifetime, which in a surge was well below today's.
        ran_at = in_flight if load is None else load
        if ran_at >= self.limit - 1:
            self.value = min(self.maximum, self.value + 1.0)
        if load is not None and latency > 0 and now - self._last_cut >= self._settle:
            self.value = max(self.value, min(self.maximum, load * aim / latency))


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
    learnt from finished streams.
    """

    __slots__ = ("_count", "_min_gaps", "_since", "_sum", "_window", "tokens_per_event")

    def __init__(self, window_s: float = 3.0, min_gaps: int = 20) -> None:
        self._window = window_s
        self._min_gaps = min_gaps
        self._since = -math.inf
        self._sum = 0.0
        self._count = 0
        self.tokens_per_event = 1.0

    def gap(self, seconds: float, now: float) -> float | None:
        """Add one stream's gap since its previous output event, received at ``now``.

        Returns the mean gap per token over the window that ``now`` closes (at least
        ``window_s`` long, with at least ``min_gaps`` gaps), else None.
        """
        self._sum += seconds
        self._count += 1
        if now - self._since < self._window:
            return None
        reading = None
        if self._count >= self._min_gaps and math.isfinite(self._since):
            reading = self._sum / self._count / self.tokens_per_event
        self._since = now
        self._sum = 0.0
        self._count = 0
        return reading

    def observe_stream(self, tokens: int, events: int) -> None:
        """Learn tokens per output event from a finished stream."""
        if tokens > 1 and events > 1:
            ratio = max(1.0, (tokens - 1) / (events - 1))
            self.tokens_per_event += 0.1 * (ratio - self.tokens_per_event)


class Limits:
    """Admission's two limits on every worker, steered by the latencies its requests get.

    The running limit follows TPOT against the strictest TPOT target. The prefill limit follows
    the worker's own part of TTFT (dispatch to first token) against half the strictest TTFT
    target, the other half being left for the wait in the queue: requests dispatched into vLLM
    wait there first come, first served, so under load the gateway keeps the worker's prefill
    queue short and the backlog in its own queue, where tiers apply. Each grows while latencies
    are within the target times the headroom (the aim) and is cut when one is over the target.
    """

    def __init__(self, settings: Settings, metrics: GatewayMetrics) -> None:
        self._settings = settings
        self._metrics = metrics
        targets = [t.tpot_slo_s for t in settings.tiers if t.tpot_slo_s is not None]
        self.tpot_target = min(targets) if targets else None
        """The strictest TPOT target; the running limit keeps it."""
        self.tpot_aim = (
            None if self.tpot_target is None else settings.ttft_headroom * self.tpot_target
        )
        self._ttft_target = min(t.ttft_slo_s for t in settings.tiers)

    def cap(self, worker: Worker) -> int:
        """The most requests ``worker`` may run now (this gateway's and others' together).

        Its feedback-steered limit, at most the hard cap and what its KV cache holds of
        requests of the typical size.
        """
        fit = worker.kv_fit()
        most = min(self._settings.max_running_per_worker, worker.limit.limit)
        return most if fit >= most else max(1, math.floor(fit))

    def prefill_cap(self, worker: Worker) -> int:
        """The most requests that may be prefilling on ``worker`` at once."""
        return min(self._settings.max_running_per_worker, worker.prefill_limit.limit)

    def learn(
        self,
        worker: Worker,
        worker_ttft_s: float | None,
        tpot_s: float | None,
        prefill_peers: int,
        now: float,
        decode_load: float | None = None,
    ) -> None:
        """Steer ``worker``'s limits by a finished stream's latencies.

        ``prefill_peers`` is how many were prefilling with it (itself included), ``decode_load``
        how many ran with it on average while it decoded: a TPOT within the aim lets the running
        limit rise at once to the load that would take TPOT to the aim
        (:meth:`ConcurrencyLimit.on_result`). The prefill limit does not project so: prompts
        differ in length, so one short prefill says little.
        """
        headroom = self._settings.ttft_headroom
        if tpot_s is not None and self.tpot_target is not None:
            target = self.tpot_target
            running = worker.in_flight + 1 + self._others(worker, now)
            worker.limit.on_result(tpot_s, headroom * target, target, running, now, decode_load)
        if worker_ttft_s is not None:
            target = self._ttft_target / 2
            worker.prefill_limit.on_result(
                worker_ttft_s, headroom * target, target, prefill_peers, now
            )

    def paced(self, worker: Worker, pace_s: float, now: float) -> None:
        """``worker``'s streams advanced ``pace_s`` per token over the last few seconds.

        Slower than the strictest TPOT target: the batch has outgrown it now, so the running
        limit is cut at once (from what runs there) instead of when the streams that live
        through it end, seconds later (:class:`DecodePace`).
        """
        self._metrics.worker_decode_pace.labels(worker.label).set(pace_s)
        target = self.tpot_target
        if target is not None and pace_s > target:
            running = worker.in_flight + self._others(worker, now)
            worker.limit.cut(running, now, pace_s / target)

    def occupied(self, worker: Worker, now: float) -> float:
        """What counts against ``worker``'s running limit: ours in flight plus others'."""
        return worker.in_flight + self._others(worker, now)

    def _others(self, worker: Worker, now: float) -> float:
        return worker.others(now, self._settings.load_max_age_s)

    def saturated(self, worker: Worker, now: float) -> bool:
        """Whether ``worker`` says it is full (:meth:`app.workers.Worker.saturated`)."""
        s = self._settings
        return worker.saturated(now, s.load_max_age_s, s.saturation_waiting, s.saturation_kv_cache)

    def export(self, pool: WorkerPool) -> None:
        """Refresh each worker's limits and learnt latency model (before an export)."""
        metrics = self._metrics
        for worker in pool.workers.values():
            label = worker.label
            latency = worker.latency
            metrics.worker_concurrency_limit.labels(label).set(self.cap(worker))
            metrics.worker_prefill_limit.labels(label).set(self.prefill_cap(worker))
            metrics.worker_prefilling.labels(label).set(worker.prefilling)
            slope = latency.prefill.slope
            metrics.worker_prefill_rate.labels(label).set(1.0 / slope if slope > 0 else 0.0)
            metrics.worker_decode_step.labels(label).set(latency.decode.predict(1))
            metrics.worker_decode_per_sequence.labels(label).set(latency.decode.slope)

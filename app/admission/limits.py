"""Admission's two limits on every worker, steered by the latencies its requests get.

The limit arithmetic is :mod:`app.fleet.limiter`'s; this module applies it to the pool's workers
against the tiers' targets, and reads the workers' own saturation signals.
"""

from __future__ import annotations

import math

from app.api.outcome import LimitCut
from app.fleet.workers import Worker, WorkerPool
from app.observe.looplag import LoopLagProbe
from app.observe.metrics import GatewayMetrics
from app.settings import Settings, TierSpec, strictest_tpot_s

# The least spread of the loads finished streams ran at before the learnt decode line bounds
# the running limit (a line through loads of 1 and 2 says nothing of 25).
_MIN_LOAD_SPREAD = 4.0
# The waits on the event loop between a request's dispatch and its first event's arrival
# (connect, send, response head, first chunk): a loop running late delays each of them.
_LOOP_WAITS = 4
# A tier's targets are kept while it had a request in the last this long (see Limits.targets).
_TIER_ACTIVE_S = 60.0
# The most a stream's mean load may be for it to have decoded alone (Limits.learn).
_ALONE_LOAD = 1.25


class Limits:
    """Admission's two limits on every worker, steered by the latencies its requests get.

    The running limit follows TPOT against the strictest TPOT target of the tiers in play
    (:meth:`targets`). The prefill limit follows the worker's own part of TTFT (dispatch to
    first token) against half their strictest TTFT target, the other half being left for the
    wait in the queue: requests dispatched into vLLM wait there in arrival order (by tier too
    with its priority scheduling, but never turned away, nor given up on at a deadline), so
    under load the gateway keeps the worker's prefill queue short and the backlog in its own
    queue, where tiers and deadlines apply. Each grows while latencies are within the target
    times the headroom (the aim) and is cut when one is over the target.
    """

    def __init__(
        self, settings: Settings, metrics: GatewayMetrics, lag: LoopLagProbe | None = None
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._lag = lag
        strictest = settings.strictest_tpot_s
        self.tpot_aim = None if strictest is None else settings.tpot_headroom * strictest
        """The strictest tier's TPOT aim, whether it is in play or not."""
        self._last_arrival: dict[str, float] = {}

    def arrived(self, tier: TierSpec, now: float) -> None:
        """A request of ``tier`` arrived: its targets are in play (:meth:`targets`)."""
        self._last_arrival[tier.name] = now

    def targets(self, now: float, worker: Worker | None = None) -> tuple[float | None, float]:
        """The TPOT target (None: no tier has one) and the TTFT target the limits keep now.

        The strictest of the tiers that had a request in the last ``_TIER_ACTIVE_S`` seconds,
        or of every tier before any request came. A tier with no requests has nothing to
        miss: keeping its targets would hold every other tier to them (without API keys every
        request is standard, and interactive's stricter TPOT would cut workers that serve the
        standard target with room to spare; docs/admission.md). A tier that comes back
        after a pause finds the limits set for the others, and its first misses cut them, as
        any miss does. On ``worker``, a TPOT target under the fastest it is known to reach
        (:attr:`app.fleet.workers.Worker.floor_tpot`) is out of its reach: no limit brings its
        streams back within it, and steering by it cut a worker whose pace does not depend on
        its batch to one stream at a time, while the other tiers' targets were met. The
        strictest target it reaches is kept instead, or none.
        """
        tiers = self._settings.tiers
        since = now - _TIER_ACTIVE_S
        active = [t for t in tiers if self._last_arrival.get(t.name, -math.inf) > since]
        playing = active or tiers
        tpot = strictest_tpot_s(playing)
        if worker is not None and tpot is not None and not self.reachable(worker, tpot):
            tpot = strictest_tpot_s(
                t
                for t in playing
                if t.tpot_slo_s is not None and self.reachable(worker, t.tpot_slo_s)
            )
        return tpot, min(t.ttft_slo_s for t in playing)

    def reachable(self, worker: Worker, target_s: float) -> bool:
        """Whether ``worker`` is known to reach a TPOT of ``target_s`` (:meth:`targets`)."""
        return target_s >= worker.floor_tpot

    def cap(self, worker: Worker) -> int:
        """The most requests ``worker`` may run now (this gateway's and others' together).

        Its feedback-steered limit, at most the hard cap and what its KV cache holds of
        requests of the typical size.
        """
        return _within_fit(worker, min(self._settings.max_running_per_worker, worker.limit.limit))

    def hard_cap(self, worker: Worker) -> int:
        """The most ``worker`` may ever run: the hard cap, at most what its KV cache holds."""
        return _within_fit(worker, self._settings.max_running_per_worker)

    def seen_bound(self, worker: Worker, at_aim: bool = False) -> int | None:
        """What ``worker`` was seen to serve, while no measurement has set its limit.

        A limit no miss, pace reading or queueing has lowered yet is the hard cap or the KV
        cache's fit, far above what a worker keeps within the TPOT target; the most it ran
        while a stream decoded there within the aim but at least half as slowly (a load that
        told something of the aim) is a measurement, and each stream that kept the aim at it
        raises it by one, as the limit grows (:meth:`learn`). ``at_aim``: that load scaled by
        the aim over the stream's TPOT, which TPOT, growing at most in proportion to the batch,
        still keeps within the aim. None once the limit is measured, or before any such
        stream: a cold burst, or one after light traffic, is not held back by a guess.
        """
        seen = worker.served_at_aim if at_aim else worker.served_within_aim
        if worker.limit.measured or seen < 1.0:
            return None
        return math.floor(seen)

    def proven_cap(self, worker: Worker, at_aim: bool = False) -> int:
        """:meth:`cap`, at most :meth:`seen_bound`: the slots the worker is known to serve."""
        cap, seen = self.cap(worker), self.seen_bound(worker, at_aim)
        return cap if seen is None else min(cap, seen)

    def top_cap(self, worker: Worker) -> int:
        """The most of the top tier's own requests ``worker`` may run.

        :meth:`cap`, or the load the worker was seen to serve with a stream within the aim
        (:attr:`app.fleet.workers.Worker.served_within_aim`) when that is higher, within
        :meth:`hard_cap`: a cut often reads seconds of prefill stalls that the streams living
        through them absorb, and the top tier held under it was turned away while they went on
        within their targets.
        """
        seen = min(self.hard_cap(worker), math.floor(worker.served_within_aim))
        return max(self.cap(worker), seen)

    def stretched_cap(self, worker: Worker) -> int:
        """The most ``worker`` may run when the extra requests keep TPOT within its target.

        The running limit is steered to keep TPOT at the aim (the target x the headroom), and
        TPOT grows at most in proportion to the batch, so the limit / headroom still keeps
        the target. Bounded, as :meth:`cap` is, by the hard cap and the KV-cache fit.
        """
        limit = worker.limit.value / self._settings.tpot_headroom
        return _within_fit(
            worker, min(self._settings.max_running_per_worker, math.floor(limit + 1e-9))
        )

    def _decode_fit(self, worker: Worker, aim: float) -> float:
        """How many running requests keep TPOT at the aim, by the worker's learnt decode line.

        Only once streams finished across a range of loads (their spread at least
        ``_MIN_LOAD_SPREAD``) and TPOT was seen to grow with load: sequential or light traffic
        says nothing of the slope, and a worker whose pace does not depend on its batch has no
        such bound. It lowers a limit above it that no measurement has set yet, lifts one a
        cut left below it once the cut has settled, and bounds how far one stream's own
        projection lifts a limit (:meth:`learn`); holding the load under it narrows the loads
        seen, so it is not a standing cap.
        """
        line = worker.latency.decode
        if line.spread < _MIN_LOAD_SPREAD or line.slope <= 0:
            return math.inf
        return max(1.0, (aim - line.intercept) / line.slope)

    def full_pace(self, worker: Worker) -> float | None:
        """The TPOT ``worker``'s streams are expected to decode at while it runs its limit.

        At most the TPOT aim (None: no tier has a TPOT target). The learnt decode line at
        :meth:`proven_cap` once loads spread as :meth:`_decode_fit` asks (a flat line: its
        level); with loads too alike for a slope, the line's level at them if they were at
        least half the limit, else the aim. A worker whose engine bounds its batch
        (``max_num_seqs``, the KV cache) decodes far under the aim when full (the simulated
        GPU workers: 35 ms a token against 320), and holds counted at the aim kept nine times
        the slots the tier above held (:meth:`app.admission.demand.TierDemand.held`).
        """
        aim = self.tpot_aim
        if aim is None:
            return None
        line, cap = worker.latency.decode, self.proven_cap(worker)
        if line.spread >= _MIN_LOAD_SPREAD:
            return min(aim, line.predict(cap))
        if line.observed and line.mean_x >= cap / 2:
            return min(aim, line.predict(line.mean_x))
        return aim

    def prefill_cap(self, worker: Worker) -> int:
        """The most requests that may be prefilling on ``worker`` at once."""
        return min(self._settings.max_running_per_worker, worker.prefill_limit.limit)

    def learn(
        self, worker: Worker, tpot_s: float | None, now: float, decode_load: float | None = None
    ) -> None:
        """Steer ``worker``'s running limit by a finished stream's TPOT.

        ``decode_load`` is how many ran with it on average while it decoded: a TPOT within the
        aim lets the running limit rise at once to the load that would take TPOT to the aim
        (:meth:`app.fleet.limiter.ConcurrencyLimit.on_result`). The prefill limit learns from the
        stream's first token when it comes (:meth:`first_token`).
        """
        headroom = self._settings.tpot_headroom
        others = self._others(worker, now)
        before = tpot_target = self.targets(now, worker)[0]
        if tpot_s is not None:
            # A stream that decoded alone (other gateways' requests counted) measured the
            # worker's own pace.
            alone = decode_load is not None and decode_load + others <= _ALONE_LOAD
            worker.saw_tpot(tpot_s, alone)
            tpot_target = self.targets(now, worker)[0]
        if before is not None and (tpot_target is None or tpot_target > before):
            # The strictest target went out of reach: its cuts were no evidence of a batch too
            # big, and the loads seen within its aim say nothing of the target kept now.
            worker.limit.reset()
            worker.reset_served()
        if tpot_s is not None and tpot_target is not None:
            target = tpot_target
            aim = headroom * target
            running = worker.in_flight + 1 + others
            # Until the batch first outgrows the target, the limit stands where it started: the
            # decode line learnt from streams at a range of loads says where that will be, so
            # the first surge is not let in whole. Only a stream within the aim asks the line:
            # one over it measured the crossing itself, and a line through the prior and a pace
            # flat at the aim crosses it right where the first streams ran, far below the load
            # the worker keeps within the target.
            bound = self._decode_fit(worker, aim) if tpot_s <= aim else math.inf
            if decode_load is not None:
                # The stream itself kept the aim at its load: a measurement outranks the
                # line's projection (fitted across arrival rates, whose prefill stalls differ).
                bound = max(bound, decode_load)
                if tpot_s <= aim:
                    # Its own mean load is this process's requests; others' ran there too.
                    worker.saw_served(decode_load + others, tpot_s, aim)
            # The stream's own projection lifts the limit no further than the bound.
            if worker.limit.on_result(tpot_s, aim, target, running, now, decode_load, bound):
                self._metrics.limit_cut(worker.label, LimitCut.TPOT_MISS)
            # The line lowers only a limit no measurement has lowered yet (the first surge's):
            # a projection under a measured limit queues what the worker serves in time.
            if worker.limit.project(bound, now):
                self._metrics.limit_cut(worker.label, LimitCut.DECODE_LINE)
            elif math.isfinite(bound):
                # Below the line's load, once a cut has settled: the line learnt across loads
                # says how many keep the aim, where additive growth alone needs a request's
                # life a step and light traffic (never at the limit) takes no step at all.
                worker.limit.lift(bound, now)

    def first_token(
        self, worker: Worker, worker_ttft_s: float, prefill_peers: int, now: float
    ) -> None:
        """Steer ``worker``'s prefill limit by a request's time from dispatch to first output.

        ``prefill_peers`` is how many were prefilling with it (itself included). Learnt when
        the first token comes, not when the answer ends: a surge's late first tokens then cut
        the limit within its first seconds instead of an answer's life later, while the
        prefills it let in still hold lower tiers' requests at the worker. The prefill limit
        does not project as the running limit does: prompts differ in length, so one short
        prefill says little.
        """
        _, ttft_target = self.targets(now)
        headroom = self._settings.ttft_headroom
        target = ttft_target / 2
        # A miss that prefilled alone was a long prompt: fewer prefills at once would not have
        # sped it, and cutting for it held lower tiers behind every prefill.
        if (
            not self._own_delay(worker_ttft_s - target)
            and not (prefill_peers <= 1 and worker_ttft_s > target)
            and worker.prefill_limit.on_result(
                worker_ttft_s, headroom * target, target, prefill_peers, now
            )
        ):
            self._metrics.limit_cut(worker.label, LimitCut.TTFT_MISS)

    def _own_delay(self, excess_s: float) -> bool:
        """Whether the gateway's own lateness may account for a first token ``excess_s`` late.

        The gateway times the worker's first token when its event loop gets round to reading
        it: a loop running late (the gateway itself saturated) delays each of the waits on the
        way there and back. A prefill miss that delay accounts for is the gateway's, not the
        worker's, and cutting the worker's prefill limit for it turns away what the worker
        could serve. Such a result neither cuts nor raises the limit.
        """
        return excess_s > 0 and self._lag is not None and _LOOP_WAITS * self._lag.late >= excess_s

    def paced(self, worker: Worker, pace_s: float, now: float) -> None:
        """``worker``'s streams advanced ``pace_s`` per token over the last few seconds.

        Slower than the TPOT target (:meth:`targets`): the batch has outgrown it now, so the
        running limit is cut at once (from what runs there) instead of when the streams that
        live through it end, seconds later (:class:`app.fleet.limiter.DecodePace`). Only if the
        running streams' TPOT so far misses the target too: a stream's TPOT is its mean over
        its life, and streams that ran for seconds absorb a window of a few prefill stalls.
        """
        self._metrics.worker_decode_pace.labels(worker.label).set(pace_s)
        target, _ = self.targets(now, worker)
        if target is not None and pace_s > target:
            so_far = worker.pace.so_far(now)
            if so_far is not None and so_far <= target:
                return
            # From the load the reading is of: the window may close as the batch it measured
            # has drained (seen: a window of a surge's end closed by the next request's first
            # gap, with one running, cut a worker to 1).
            running = max(self.occupied(worker, now), worker.pace.load)
            if worker.limit.cut(running, now, pace_s / target):
                self._metrics.limit_cut(worker.label, LimitCut.DECODE_PACE)

    def occupied(self, worker: Worker, now: float) -> float:
        """What counts against ``worker``'s running limit: ours in flight plus others'."""
        return worker.in_flight + self._others(worker, now)

    def _others(self, worker: Worker, now: float) -> float:
        return worker.others(now, self._settings.load_max_age_s)

    def saturated(self, worker: Worker, now: float) -> bool:
        """Whether ``worker`` says it is full (:meth:`app.fleet.workers.Worker.saturated`)."""
        s = self._settings
        return worker.saturated(now, s.load_max_age_s, s.saturation_kv_cache)

    def export(self, pool: WorkerPool) -> None:
        """Refresh each worker's limits and learnt latency model (before an export)."""
        metrics = self._metrics
        for worker in pool.workers.values():
            label = worker.label
            latency = worker.latency
            metrics.worker_concurrency_limit.labels(label).set(self.cap(worker))
            metrics.worker_proven_concurrency.labels(label).set(self.seen_bound(worker) or 0)
            metrics.worker_prefill_limit.labels(label).set(self.prefill_cap(worker))
            metrics.worker_prefilling.labels(label).set(worker.prefilling)
            slope = latency.prefill.slope
            metrics.worker_prefill_rate.labels(label).set(1.0 / slope if slope > 0 else 0.0)
            metrics.worker_decode_step.labels(label).set(latency.decode.predict(1))
            metrics.worker_decode_per_sequence.labels(label).set(latency.decode.slope)


def _within_fit(worker: Worker, most: int) -> int:
    """``most``, at most what ``worker``'s KV cache holds of requests of the typical size."""
    fit = worker.kv_fit()
    return most if fit >= most else max(1, math.floor(fit))

"""Admission, keys and goodput on a fake clock: order, deadlines, shedding, limits."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import pytest

from app.admission.auth import Authenticator, TokenBucket
from app.admission.limits import Limits
from app.admission.queue import AdmissionController
from app.admission.ticket import Ticket
from app.api.errors import (
    AuthenticationFailed,
    Overloaded,
    QueueTimeout,
    RateLimited,
    Shed,
    TierNotAllowed,
)
from app.api.outcome import DECISION_REASONS, SloResult
from app.fleet.lease import Choice, Lease
from app.fleet.limiter import ConcurrencyLimit, DecodePace
from app.fleet.loadsignals import LoadSample
from app.fleet.predictor import OnlineLinear, RecentQuantile
from app.fleet.routing import NO_KEY, Router
from app.fleet.wire import WireClient
from app.fleet.workers import Worker, WorkerPool
from app.observe.goodput import GoodputTracker, slo_result
from app.observe.metrics import GatewayMetrics
from app.observe.timing import TimingSummary
from app.settings import Settings, TierSpec, WorkerSpec
from tests.conftest import FakeClock
from tests.fake_upstream import MODEL
from tests.servers import settings_for


class NoDns:
    async def resolve(self, host: str) -> list[str]:
        return []


def _controller(
    clock: FakeClock, **overrides: object
) -> tuple[AdmissionController, WorkerPool, GatewayMetrics, Settings]:
    settings = settings_for("http://a:1", **overrides)
    metrics = GatewayMetrics(settings)
    client = WireClient(1.0)  # never asked: these tests probe nothing
    pool = WorkerPool(settings, client, metrics, clock, NoDns())
    worker = pool.workers["a:1"]
    worker.up = True
    worker.models = {MODEL}
    worker.cards = {MODEL: {"id": MODEL}}
    load_fresh(worker, clock)
    router = Router(settings, pool)
    limits = Limits(settings, metrics)
    return AdmissionController(settings, router, limits, metrics, clock), pool, metrics, settings


def load_fresh(worker: object, clock: FakeClock) -> None:
    from app.fleet.loadsignals import LoadSample

    worker.load = LoadSample(0, 0, 0.0, clock.now)  # type: ignore[attr-defined]


def _tier(settings: Settings, name: str) -> TierSpec:
    return next(t for t in settings.tiers if t.name == name)


def _ticket(settings: Settings, clock: FakeClock, tier: str, tokens: float = 10) -> Ticket:
    return Ticket(_tier(settings, tier), MODEL, tokens, NO_KEY, clock.now)


def _decisions(
    metrics: GatewayMetrics, tier: str, decision: str, reason: str | None = None
) -> float:
    """Decisions of ``tier``, of every reason unless one is given."""
    total = 0.0
    for metric in metrics.registry.collect():
        for sample in metric.samples:
            labels = sample.labels
            if (
                sample.name == "gateway_admission_decisions_total"
                and labels["tier"] == tier
                and labels["decision"] == decision
                and reason in (None, labels["reason"])
            ):
                total += sample.value
    return total


def _arrive(admission: AdmissionController, arrivals: Iterable[tuple[float, int]]) -> None:
    for at, priority in arrivals:
        admission.demand.arrived(priority, at)


async def test_idle_worker_admits_at_once_and_the_cap_follows_measured_latency() -> None:
    clock = FakeClock()
    admission, pool, metrics, settings = _controller(clock, initial_running_per_worker=8)
    worker = pool.workers["a:1"]
    worker.prefill_limit = ConcurrencyLimit(initial=2, maximum=256)
    choice, waited = await admission.admit(_ticket(settings, clock, "interactive"))
    assert choice.worker is worker
    assert waited == 0.0
    assert admission.limits.cap(worker) == 8
    # Streams within the TPOT target (50 ms <= 0.8 x 100 ms) while the limit was binding: +1.
    worker.in_flight = 7
    for _ in range(4):
        admission.limits.learn(worker, 0.05, clock.now)
        worker.in_flight = admission.limits.cap(worker) - 1
    assert admission.limits.cap(worker) == 12
    # Not binding (few requests running): no evidence that more would fit, no change.
    worker.in_flight = 2
    admission.limits.learn(worker, 0.05, clock.now)
    assert admission.limits.cap(worker) == 12
    # Over the aim but within the 100 ms target, while binding: no change either way.
    worker.in_flight = 11
    admission.limits.learn(worker, 0.09, clock.now)
    assert admission.limits.cap(worker) == 12
    # Over the target: one cut by 10%, then none until a second has passed.
    admission.limits.learn(worker, 0.12, clock.now)
    assert admission.limits.cap(worker) == 10
    admission.limits.learn(worker, 0.12, clock.now)
    assert admission.limits.cap(worker) == 10
    # The prefill limit follows the worker's TTFT against half the strictest TTFT target
    # (aim 0.8 x 1 s / 2): quick first tokens while it was binding raise it, one over the
    # 0.5 s target cuts it, one in between changes nothing.
    assert admission.limits.prefill_cap(worker) == 2
    admission.limits.first_token(worker, 0.2, 2, clock.now)
    admission.limits.first_token(worker, 0.2, 3, clock.now)
    assert admission.limits.prefill_cap(worker) == 4
    clock.advance(1.0)
    admission.limits.first_token(worker, 0.45, 4, clock.now)
    assert admission.limits.prefill_cap(worker) == 4
    admission.limits.first_token(worker, 0.6, 4, clock.now)
    assert admission.limits.prefill_cap(worker) == 3
    assert admission.limits.cap(worker) == 10
    # A worker at its prefill limit takes no more requests, though it has running slots;
    # but the top tier's are not held back for it.
    interactive, batch = _tier(settings, "interactive"), _tier(settings, "batch")
    worker.in_flight, worker.prefilling = 3, 3
    assert admission.room.full(worker)
    assert admission.room.full(worker, _tier(settings, "standard"))
    assert not admission.room.full(worker, interactive)
    worker.prefilling = 2
    assert not admission.room.full(worker)
    # Below the top tier, one prefill slot stays free for it while it has requests (and the
    # pool is expected to saturate: ``full`` is asked as if it were).
    assert not admission.room.full(worker, interactive)
    assert admission.room.full(worker, batch)
    assert not admission.room.full(worker, batch, reserving=False)
    # With one interactive arrival and nothing finished yet, one running slot is kept for it.
    worker.prefilling = 0
    worker.in_flight = 8
    assert not admission.room.full(worker, batch)
    worker.in_flight = 9
    assert admission.room.full(worker, batch)
    assert not admission.room.full(worker, interactive)
    worker.in_flight = worker.prefilling = 0
    # The hard cap bounds it.
    capped, pool2, _, _ = _controller(clock, max_running_per_worker=3)
    assert capped.limits.cap(pool2.workers["a:1"]) == 3
    assert _decisions(metrics, "interactive", "admitted") == 1


def test_the_running_limit_keeps_the_tpot_headroom_and_the_prefill_limit_the_ttft_one() -> None:
    clock = FakeClock()
    admission, pool, _, _ = _controller(
        clock, initial_running_per_worker=8, tpot_headroom=0.6, ttft_headroom=0.8
    )
    limits, worker = admission.limits, pool.workers["a:1"]
    worker.prefill_limit = ConcurrencyLimit(initial=2, maximum=256)
    assert limits.tpot_aim == pytest.approx(0.06)
    # 70 ms at the limit: within 0.8 of the 100 ms target but not within 0.6: no growth.
    worker.in_flight = 7
    limits.learn(worker, 0.07, clock.now)
    assert limits.cap(worker) == 8
    limits.learn(worker, 0.05, clock.now)
    assert limits.cap(worker) == 9
    # A stretch past the limit keeps the target at this aim: 9 / 0.6.
    assert limits.stretched_cap(worker) == 15
    # First tokens within 0.8 of half the 1 s target (0.35 s) while binding still raise the
    # prefill limit, which keeps the TTFT headroom.
    limits.first_token(worker, 0.35, 2, clock.now)
    assert limits.prefill_cap(worker) == 3


def test_lower_tiers_leave_the_slots_higher_tiers_are_expected_to_need() -> None:
    """Little's law: arrival rate x how long a request holds a slot, over the pool; what the
    higher tiers do not hold already is kept free."""
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock)
    worker = pool.workers["a:1"]
    worker.limit.value = 20
    names = ("interactive", "standard", "batch")
    interactive, standard, batch = (_tier(settings, name) for name in names)
    # No higher-tier traffic: batch may fill the worker.
    worker.in_flight = 19
    assert not admission.room.full(worker, batch)
    # Interactive requests hold a slot 4 s and arrive once a second for 10 s: the window says
    # 10/9 per second (3 in the last 2 s is no surge). 4.44 expected -> 5 slots kept: batch
    # and standard stop at 20 - 5 = 15.
    admission.completed("interactive", 4.0)
    for t in range(10):
        admission.demand.arrived(interactive.priority, clock.now - 9 + t)
    for tier in (batch, standard):
        worker.in_flight = 14
        assert not admission.room.full(worker, tier)
        worker.in_flight = 15
        assert admission.room.full(worker, tier)
    assert not admission.room.full(worker, interactive)
    # Slots interactive holds already count: with 3 of its requests running, 2 more are kept.
    worker.tier_in_flight["interactive"] = 3
    worker.in_flight = 17
    assert not admission.room.full(worker, batch)
    worker.in_flight = 18
    assert admission.room.full(worker, batch)
    # Spread over two workers: 4.44 / 2 = 2.22 slots, 3 a worker.
    worker.tier_in_flight["interactive"] = 0
    worker.in_flight = 16
    assert not admission.room.full(worker, batch, workers=2)
    worker.in_flight = 17
    assert admission.room.full(worker, batch, workers=2)
    # A surge (9 more in the last instant) is seen at once: 18/s x 4 s = 72 expected, more
    # than the worker has; a lower tier only gets the last slot of an otherwise empty worker.
    _arrive(admission, [(clock.now, interactive.priority) for _ in range(9)])
    clock.advance(0.01)
    worker.in_flight = 0
    assert not admission.room.full(worker, batch)
    worker.in_flight = 1
    assert admission.room.full(worker, batch)
    # Ten quiet seconds later nothing is kept any more.
    clock.advance(10.5)
    worker.in_flight = 19
    assert not admission.room.full(worker, batch)


def test_an_idle_worker_has_room_for_every_tier_however_its_limits_stand() -> None:
    """What lets admission skip weighing the workers when all are idle (Room.idle)."""
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock)
    worker, room = pool.workers["a:1"], admission.room
    interactive = _tier(settings, "interactive")
    admission.completed("interactive", 30.0)  # long holds: a surge keeps every slot...
    _arrive(admission, [(clock.now, interactive.priority) for _ in range(40)])
    clock.advance(0.01)
    worker.limit.cut(40, clock.now)  # ...the running limit is cut...
    worker.limit.value = 1
    worker.prefill_limit = ConcurrencyLimit(initial=1, maximum=256)  # ...so is the prefill one
    worker.saw_served(1.0, 0.09, 0.08)
    worker.load = LoadSample(0, 0, 0.5, clock.now, kv_tokens=10.0)  # and the KV cache fits 1
    assert room.idle(worker, clock.now)
    for tier in settings.tiers:
        for reserving in (True, False):
            for tokens in (0.0, 1e6):
                assert not room.full(worker, tier, 4, clock.now, reserving, tokens), tier.name
    # Anything running, or the worker saying it is full, and it is not idle.
    worker.in_flight = 1
    assert not room.idle(worker, clock.now)
    worker.in_flight = 0
    worker.load = LoadSample(0, 0, 0.99, clock.now)
    assert not room.idle(worker, clock.now)


def test_slots_are_kept_from_what_a_worker_was_seen_to_serve_not_an_unmeasured_limit() -> None:
    clock = FakeClock()
    admission, pool, metrics, settings = _controller(clock)
    limits, worker = admission.limits, pool.workers["a:1"]
    interactive, batch = _tier(settings, "interactive"), _tier(settings, "batch")

    def proven_gauge() -> float | None:
        limits.export(pool)
        return metrics.registry.get_sample_value(
            "gateway_worker_proven_concurrency", {"worker": "a:1"}
        )

    # Interactive holds a slot 4 s and arrives once a second: 5 slots kept for it.
    admission.completed("interactive", 4.0)
    for t in range(10):
        admission.demand.arrived(interactive.priority, clock.now - 9 + t)
    # Nothing measured yet: kept from the hard cap, 256 - 5.
    worker.in_flight = 250
    assert not admission.room.full(worker, batch)
    # Light traffic (two at 25 ms a token, the bare decode step) says nothing of the aim.
    limits.learn(worker, 0.025, clock.now, 2.0)
    assert limits.proven_cap(worker) == limits.proven_cap(worker, at_aim=True) == 256
    assert proven_gauge() == 0
    # A stream kept the 80 ms aim at a mean load of 20 (50 ms a token): the limit, never
    # lowered, stays 256, but what is kept comes out of the 20 the worker was seen to serve.
    limits.learn(worker, 0.05, clock.now, 20.0)
    assert limits.cap(worker) == 256
    assert limits.proven_cap(worker) == 20
    assert proven_gauge() == 20
    worker.in_flight = 14
    assert not admission.room.full(worker, batch)
    worker.in_flight = 15
    assert admission.room.full(worker, batch)
    assert not admission.room.full(worker, interactive)
    # Below saturation the unmeasured limit stands: a lower tier is held back by nothing.
    worker.in_flight = 100
    assert not admission.room.full(worker, batch, reserving=False)
    # Whether the pool saturates is judged against what the worker would run at the aim:
    # 20 x 80 / 50 = 32. Expected slots between 20 and 32 keep nothing back.
    assert limits.proven_cap(worker, at_aim=True) == 32
    ticket = _ticket(settings, clock, "batch")
    _arrive(admission, [(clock.now + k / 6, interactive.priority) for k in range(18)])
    clock.advance(3.0)
    assert 20 <= admission.demand.expected_total(clock.now) < 32
    worker.in_flight = 15
    assert admission.placer.choose(ticket, clock.now) is not None
    # Once a measurement set the limit, it is what slots are kept from.
    worker.limit.cut(40, clock.now)
    assert limits.seen_bound(worker) is None
    assert limits.proven_cap(worker) == limits.proven_cap(worker, at_aim=True) == 36
    assert proven_gauge() == 0


def test_a_stream_within_the_aim_at_the_seen_bound_raises_it_by_one() -> None:
    """The seen bound grows as the running limit does. Slots kept out of it hold the batch at
    it, the streams living there run at most at it, and without growth it never rose."""
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock)
    limits, worker = admission.limits, pool.workers["a:1"]
    interactive, batch = _tier(settings, "interactive"), _tier(settings, "batch")
    admission.completed("interactive", 4.0)
    for t in range(10):
        admission.demand.arrived(interactive.priority, clock.now - 9 + t)
    # Light traffic sets no bound, so none grows from it.
    limits.learn(worker, 0.025, clock.now, 2.0)
    assert limits.seen_bound(worker) is None
    # Seen to serve 6 (50 ms a token, within the 80 ms aim). Four interactive streams run and
    # one more slot is kept for the tier: the batch stops at 5.
    limits.learn(worker, 0.05, clock.now, 6.0)
    assert limits.seen_bound(worker) == 6
    worker.tier_in_flight["interactive"] = 4
    worker.in_flight = 5
    assert admission.room.full(worker, batch)
    # A stream that ran at the bound (a mean load of 5, one under it) within the aim: 7.
    limits.learn(worker, 0.06, clock.now, 5.0)
    assert limits.seen_bound(worker) == 7
    assert limits.proven_cap(worker, at_aim=True) >= 7
    assert not admission.room.full(worker, batch)
    # A stream under the bound, or one over the aim, tells nothing of it.
    limits.learn(worker, 0.06, clock.now, 5.5)
    limits.learn(worker, 0.09, clock.now, 7.0)
    assert limits.seen_bound(worker) == 7
    # At the bound at the bare decode step, well within the aim: room for one more.
    limits.learn(worker, 0.02, clock.now, 6.0)
    assert limits.seen_bound(worker) == 8
    # Once a measurement set the limit the bound no longer applies, and only loads seen raise
    # what the top tier goes past a cut by.
    worker.limit.cut(10, clock.now)
    limits.learn(worker, 0.06, clock.now, 7.5)
    assert worker.served_within_aim == 8


def test_slots_are_kept_for_higher_tiers_only_when_the_pool_is_expected_to_saturate() -> None:
    """Below saturation a lower tier takes any free slot: nothing is held back on a guess."""
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock)
    worker = pool.workers["a:1"]
    worker.limit.value = 20
    interactive = _tier(settings, "interactive")
    batch = _ticket(settings, clock, "batch")
    admission.completed("interactive", 4.0)
    for t in range(10):
        admission.demand.arrived(interactive.priority, clock.now - 9 + t)
    admission.demand.short(interactive.priority, clock.now)
    # 10/9 per second x 4 s = 4.4 slots expected in all, of the worker's 20: the 5 that full
    # would keep for interactive are not kept; batch runs in the 19th.
    worker.in_flight = 18
    assert admission.room.full(worker, batch.tier)
    assert admission.placer.choose(batch, clock.now) is not None
    # Three within 0.2 s: under the old rule the last half second said 6/s (24 slots); at 1/s
    # three in half a second is chance, and still nothing is held back.
    _arrive(admission, [(clock.now + 0.1 * k, interactive.priority) for k in range(3)])
    clock.advance(0.21)
    assert admission.demand.expected_total(clock.now) < 20
    assert admission.placer.choose(batch, clock.now) is not None
    # A surge: 36 more in the next second, more slots expected than the worker runs. Now the
    # slots are kept, and batch waits while interactive gets in.
    _arrive(admission, [(clock.now + k / 36, interactive.priority) for k in range(36)])
    clock.advance(1.0)
    assert admission.placer.choose(batch, clock.now) is None
    assert admission.placer.choose(_ticket(settings, clock, "interactive"), clock.now) is not None


def test_slots_stay_kept_while_a_higher_tier_is_expected_not_only_after_a_refusal() -> None:
    """Kept only for 10 s after a higher tier's refusal, the slots went to lower tiers the moment
    that lapsed, and the higher tier's streams beside them missed their TPOT target."""
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock)
    worker = pool.workers["a:1"]
    worker.limit.value = 20
    interactive, batch = _tier(settings, "interactive"), _tier(settings, "batch")
    admission.completed("interactive", 4.0)
    # 2/s for 10 s, 4 s each: 8.2 slots expected. Nothing of interactive was ever turned
    # away, and 9 slots are kept: batch stops at 11.
    _arrive(admission, [(clock.now - 9.75 + t / 2, interactive.priority) for t in range(20)])
    assert admission.demand.kept_for_higher(batch, 1, 0, clock.now) == 9
    worker.in_flight = 10
    assert not admission.room.full(worker, batch)
    worker.in_flight = 11
    assert admission.room.full(worker, batch)
    # A refusal 10 s ago changes nothing either way, while the arrivals go on.
    admission.demand.short(interactive.priority, clock.now)
    clock.advance(10.5)
    _arrive(admission, [(clock.now - 9.75 + t / 2, interactive.priority) for t in range(20)])
    assert admission.demand.kept_for_higher(batch, 1, 0, clock.now) == 8  # 2/s over 10 s
    worker.in_flight = 11
    assert not admission.room.full(worker, batch)
    worker.in_flight = 12
    assert admission.room.full(worker, batch)
    # Once interactive stops arriving, nothing is kept.
    clock.advance(10.5)
    worker.in_flight = 19
    assert not admission.room.full(worker, batch)


def test_slots_kept_for_a_tier_follow_its_hold_at_the_tpot_aim_not_a_lighter_load() -> None:
    # Default targets: strictest TPOT 100 ms, aim 80 ms. Interactive arrives at 1/s.
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock)
    worker = pool.workers["a:1"]
    worker.limit.value = 40
    interactive, batch = _tier(settings, "interactive"), _tier(settings, "batch")
    for t in range(10):
        admission.demand.arrived(interactive.priority, clock.now - 9 + t)
    admission.demand.short(interactive.priority, clock.now)
    # Learnt at a light load: 0.3 s to the first token, then 63 tokens at 40 ms (2.82 s held).
    # At the aim those tokens take 5.04 s: 5.34 s held. At 10/9 per second 5.93 slots are
    # expected and 6 are kept: batch stops at 34. Counting the 2.82 s seen would keep 4 and
    # let it run to 36.
    admission.completed("interactive", 2.82, decode_s=2.52, decoded=63)
    assert admission.demand.expected_slots(clock.now)[interactive.priority] == pytest.approx(
        (0.3 + 63 * 0.08) * 10 / 9
    )
    worker.in_flight = 33
    assert not admission.room.full(worker, batch)
    worker.in_flight = 34
    assert admission.room.full(worker, batch)
    # A stream that decoded slower than the aim counts as it was.
    admission, _, _, _ = _controller(clock)
    admission.demand.arrived(interactive.priority, clock.now)
    admission.completed("interactive", 6.6, decode_s=6.3, decoded=63)
    assert admission.demand.mean_hold(interactive.priority) == pytest.approx(6.6)


def test_higher_arrived_says_whether_the_rates_have_a_tier_above() -> None:
    clock = FakeClock()
    admission, _, _, settings = _controller(clock)
    demand = admission.demand
    top, middle, low = (_tier(settings, n) for n in ("interactive", "standard", "batch"))
    demand.arrived(middle.priority, clock.now)
    assert not demand.higher_arrived(middle, clock.now)
    assert demand.higher_arrived(low, clock.now)
    assert not demand.higher_arrived(top, clock.now)
    for tier in (top, middle, low):
        above = any(p < tier.priority for p in demand.arrival_rates(clock.now))
        assert demand.higher_arrived(tier, clock.now) == above
    clock.advance(10.5)  # out of the window
    assert not demand.higher_arrived(low, clock.now)
    assert not demand.arrival_rates(clock.now)

    class Elsewhere:
        def counts(self, span_s: float, now: float) -> dict[int, int]:
            return {top.priority: 2}

        def oldest_age(self, now: float) -> float:
            return 1.0

        def queued(self, model: str, now: float) -> dict[int, int]:
            return {}

    demand.fleet = Elsewhere()
    clock.advance(0.1)  # the rates are computed once per now
    assert demand.higher_arrived(middle, clock.now)
    assert top.priority in demand.arrival_rates(clock.now)


def test_a_hold_counts_at_the_pace_its_worker_decodes_at_when_full_not_past_the_aim() -> None:
    # Default targets: aim 80 ms a token. 0.3 s to the first token, then 63 tokens at 25 ms.
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock)
    worker = pool.workers["a:1"]
    worker.limit.value = 40
    top = _tier(settings, "interactive").priority
    # Before the worker's decode line is known: the aim, 0.3 + 63 x 80 ms.
    admission.completed("interactive", 1.875, decode_s=1.575, decoded=63, worker=worker)
    assert admission.demand.mean_hold(top) == pytest.approx(0.3 + 63 * 0.08)
    # A worker whose batch grows TPOT by 0.5 ms a stream from 20 ms decodes at 40 ms when it
    # runs its limit of 40 (its engine, not TPOT, bounds it): the hold counts at 40 ms.
    for load in range(2, 60, 4):
        worker.latency.observe_tpot(load, 0.02 + 0.0005 * load)
    assert admission.limits.full_pace(worker) == pytest.approx(0.04, rel=1e-3)
    admission, _, _, _ = _controller(clock)
    admission.completed("interactive", 1.875, decode_s=1.575, decoded=63, worker=worker)
    assert admission.demand.mean_hold(top) == pytest.approx(0.3 + 63 * 0.04, rel=1e-3)
    # A stream that decoded slower than that counts as it was.
    admission.completed("interactive", 3.6, decode_s=3.3, decoded=63, worker=worker)
    assert admission.demand.mean_hold(top) == pytest.approx(2.82 + 0.1 * (3.6 - 2.82), rel=1e-3)
    # A steeper line crosses the aim under the limit: the aim bounds the pace.
    worker.limit.value = 200
    assert admission.limits.full_pace(worker) == pytest.approx(0.08)
    # A pace its batch does not set (an engine's max_num_seqs below the limit): the level.
    worker.limit.value = 40
    for load in range(2, 60, 4):
        worker.latency.observe_tpot(load, 0.035)
    level = admission.limits.full_pace(worker)
    assert level is not None
    assert 0.035 <= level < 0.04
    # Loads too alike for a slope: their level if they filled half the limit, else the aim.
    flat = Worker(WorkerSpec(url="http://b:1"))
    for _ in range(200):
        flat.latency.observe_tpot(30.0, 0.05)
    assert flat.latency.decode.spread < 4
    flat.limit.value = 40
    assert admission.limits.full_pace(flat) == pytest.approx(0.05, rel=0.05)
    flat.limit.value = 80
    assert admission.limits.full_pace(flat) == pytest.approx(0.08)


def test_whether_the_pool_will_saturate_is_judged_from_the_holds_as_measured() -> None:
    # Interactive and standard arrive at 2/s each for 10 s; their streams took 2.82 s (0.3 s to
    # the first token, 63 tokens at 40 ms). As measured, 2 x 2 x 2.82 = 11.6 slots are expected
    # of the worker's 20: no saturation, so batch takes any free slot. At the TPOT aim (80 ms
    # a token) the same arrivals would "expect" 2 x 2 x 5.34 = 21.9 and keep slots for them.
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock)
    worker = pool.workers["a:1"]
    worker.limit.value = 20
    batch = _ticket(settings, clock, "batch")
    top, middle = (_tier(settings, name).priority for name in ("interactive", "standard"))
    for name in ("interactive", "standard"):
        admission.completed(name, 2.82, decode_s=2.52, decoded=63)

    def arrive(per_second: int) -> None:
        """Both tiers at ``per_second`` each over the 10 s before now."""
        times = [clock.now - 9.75 + t / per_second for t in range(10 * per_second)]
        _arrive(admission, [(at, p) for at in times for p in (top, middle)])

    arrive(2)
    assert admission.demand.expected_total(clock.now) == pytest.approx(2 * 20 / 9.75 * 2.82)
    assert sum(admission.demand.expected_slots(clock.now).values()) > 20
    worker.in_flight = 19
    assert admission.placer.choose(batch, clock.now) is not None
    # Twice the arrivals: 23 slots as measured, more than the worker runs. Now batch leaves
    # the slots the tiers above are expected to need, sized at the aim.
    clock.advance(10.0)
    arrive(4)
    admission.demand.short(top, clock.now)
    # Watched for all of the last 10 s (its first arrival came 9.75 s ago): 40 in 10 s.
    assert admission.demand.expected_total(clock.now) == pytest.approx(2 * 40 / 10 * 2.82)
    worker.in_flight = 10
    assert admission.placer.choose(batch, clock.now) is None


def test_a_closed_loop_flood_reads_as_saturation_by_its_waits() -> None:
    """Six batch clients on 4 slots, each sending its next request as the last ends: they
    arrive only as fast as requests finish (10/s, 0.4 s each), so the holds alone expect 4.0
    slots of 4 at most. Their waits in the queue (a third of them wait 0.4 s) say the pool is
    saturated, and batch leaves a slot to interactive."""
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock, max_running_per_worker=4)
    worker = pool.workers["a:1"]
    top, low = (_tier(settings, name).priority for name in ("interactive", "batch"))
    admission.completed("batch", 0.4)
    # 9 a second watched over 10 s (the gateway's start diluting the rate, as seen).
    _arrive(admission, [(clock.now - 9.9 + t / 9, low) for t in range(90)])
    _arrive(admission, [(clock.now - 1.9 + t, top) for t in range(2)])
    assert admission.demand.expected_total(clock.now) == pytest.approx((90 + 2) / 9.9 * 0.4)
    assert not admission.placer.reserving(4, clock.now)
    worker.in_flight = 3
    assert admission.placer.choose(_ticket(settings, clock, "batch"), clock.now) is not None
    for _ in range(30):
        admission.demand.waited(low, 0.0)
        admission.demand.waited(low, 0.0)
        admission.demand.waited(low, 0.4)
    assert admission.demand.expected_total(clock.now) > 4
    assert admission.placer.reserving(4, clock.now)
    assert admission.placer.choose(_ticket(settings, clock, "batch"), clock.now) is None
    assert admission.placer.choose(_ticket(settings, clock, "interactive"), clock.now) is not None


class QueuedElsewhere:
    """The rest of the fleet as :mod:`app.admission.shared` reads it: no arrivals, these queued."""

    def __init__(self, queued: dict[str, dict[int, int]]) -> None:
        self._queued = queued

    def counts(self, span_s: float, now: float) -> dict[int, int]:
        return {}

    def oldest_age(self, now: float) -> float:
        return 0.0

    def queued(self, model: str, now: float) -> dict[int, int]:
        return self._queued.get(model, {})


def test_a_lower_tier_leaves_the_next_slots_to_higher_tiers_queued_elsewhere() -> None:
    """Another gateway process has interactive requests queued for the model: batch here does
    not take the slots they wait for, even the last, as it would not overtake them in one
    queue; a higher tier here is not held back by lower ones queued there."""
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock, max_running_per_worker=4)
    worker = pool.workers["a:1"]
    top, middle = (_tier(settings, name).priority for name in ("interactive", "standard"))
    worker.in_flight = 2
    batch, standard = _ticket(settings, clock, "batch"), _ticket(settings, clock, "standard")
    assert admission.placer.choose(batch, clock.now) is not None
    admission.demand.fleet = QueuedElsewhere({MODEL: {top: 2}, "other-model": {top: 5}})
    assert admission.demand.queued_elsewhere(MODEL, batch.tier, clock.now) == 2
    assert admission.placer.choose(batch, clock.now) is None
    assert admission.placer.choose(standard, clock.now) is None
    worker.in_flight = 1
    assert admission.placer.choose(batch, clock.now) is not None
    # Only tiers above count: standard queued there holds batch here, not interactive.
    worker.in_flight = 3
    admission.demand.fleet = QueuedElsewhere({MODEL: {middle: 1}})
    assert admission.placer.choose(batch, clock.now) is None
    assert admission.placer.choose(standard, clock.now) is not None
    assert admission.placer.choose(_ticket(settings, clock, "interactive"), clock.now) is not None


def test_a_tier_may_run_past_the_limit_by_the_slots_lower_tiers_hold() -> None:
    """A running request cannot be preempted: a higher tier goes past the limit by what lower
    tiers run, the top tier as far as the hard cap, a middle one as far as the TPOT target."""
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock)
    worker = pool.workers["a:1"]
    worker.limit.value = 20  # TPOT at the aim (0.8 x target): 25 keep the target
    interactive, standard, batch = (
        _tier(settings, name) for name in ("interactive", "standard", "batch")
    )
    assert admission.limits.stretched_cap(worker) == 25
    # At the limit with only interactive running, nobody gets more.
    worker.in_flight = 20
    worker.tier_in_flight["interactive"] = 20
    for tier in (interactive, standard, batch):
        assert admission.room.full(worker, tier, reserving=False)
    # Three of them batch: interactive and standard may run three more, batch may not.
    worker.tier_in_flight["interactive"], worker.tier_in_flight["batch"] = 17, 3
    assert not admission.room.full(worker, standard, reserving=False)
    worker.in_flight = 23
    assert admission.room.full(worker, interactive, reserving=False)
    assert admission.room.full(worker, batch, reserving=False)
    # A middle tier never goes past the stretched cap, however many lower-tier requests run;
    # the top tier counts only its own against the limit (a cut left 24 running on 20).
    worker.tier_in_flight["interactive"], worker.tier_in_flight["batch"] = 5, 19
    worker.in_flight = 24
    assert not admission.room.full(worker, standard, reserving=False)
    worker.in_flight = 25
    assert admission.room.full(worker, standard, reserving=False)
    assert not admission.room.full(worker, interactive, reserving=False)
    worker.in_flight, worker.tier_in_flight["interactive"] = 39, 20
    assert admission.room.full(worker, interactive, reserving=False)
    # A worker seen to serve 23 with a stream within the aim: the top tier's own count goes
    # to 23 under a limit cut to 20, the others' limits stay.
    aim = admission.limits.tpot_aim
    assert aim is not None
    worker.saw_served(23.4, aim, aim)  # a stream at the aim, with 23.4 running on average
    assert not admission.room.full(worker, interactive, reserving=False)
    worker.tier_in_flight["interactive"] = 23
    worker.in_flight = 42
    assert admission.room.full(worker, interactive, reserving=False)
    worker.in_flight = worker.tier_in_flight["interactive"] = 22
    worker.tier_in_flight["batch"] = 0
    assert not admission.room.full(worker, interactive, reserving=False)
    assert admission.room.full(worker, standard, reserving=False)
    worker.in_flight = worker.tier_in_flight["interactive"] = 23
    assert admission.room.full(worker, interactive, reserving=False)
    worker.reset_served()
    worker.tier_in_flight["batch"] = 19
    # Nor past what the KV cache holds: 22 requests of 1,000 tokens.
    pool.record_tokens(worker, 900, 100)
    worker.load = LoadSample(0, 0, 0.0, clock.now, kv_tokens=22_000)
    assert admission.limits.stretched_cap(worker) == admission.limits.hard_cap(worker) == 22
    worker.in_flight, worker.tier_in_flight["interactive"] = 22, 3
    assert admission.room.full(worker, interactive, reserving=False)
    worker.in_flight = 21
    assert not admission.room.full(worker, interactive, reserving=False)


def test_lower_tiers_streams_of_other_gateway_processes_count_as_lower_tiers() -> None:
    """Another process runs 20 batch streams on the worker, the limit: the top tier here goes
    past it by as many as it would by its own process's, and batch here does not."""
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock)
    worker = pool.workers["a:1"]
    worker.limit.value = 20
    interactive, batch = _tier(settings, "interactive"), _tier(settings, "batch")
    worker.set_fleet_others(20, clock.now, 1.0, {"batch": 20})
    assert admission.limits.occupied(worker, clock.now) == 20
    assert not admission.room.full(worker, interactive, reserving=False)
    assert admission.room.full(worker, batch, reserving=False)
    # Interactive streams there are the tier's own: no way past the limit.
    worker.set_fleet_others(20, clock.now, 1.0, {"interactive": 20})
    assert admission.room.full(worker, interactive, reserving=False)
    # A tier this process does not know (another configuration, mid-rollout) counts as
    # nobody's, and a reading gone stale not at all.
    worker.set_fleet_others(20, clock.now, 1.0, {"gold": 20})
    assert admission.room.full(worker, interactive, reserving=False)
    worker.set_fleet_others(20, clock.now, 1.0, {"batch": 20})
    assert worker.fleet_tier_in_flight(clock.now + 2.0) == {}


def test_a_surge_is_read_from_the_shortest_span_where_it_cannot_be_chance() -> None:
    clock = FakeClock()
    admission, _, _, _ = _controller(clock)
    admission.completed("interactive", 4.0)  # its requests hold a slot 4 s
    top = 0
    # A trickle: one arrival a second for 10 s reads as 1/s.
    for t in range(10):
        admission.demand.arrived(top, clock.now - 9.5 + t)
    assert admission.demand.expected_slots(clock.now)[top] == pytest.approx(10 / 9.5 * 4)
    # Three more within 0.2 s: at about 1/s, three in half a second happen by chance (fewer
    # than 4 standard deviations above the half arrival expected); the rate stays the window's.
    clock.advance(0.3)
    _arrive(admission, [(clock.now - 0.3 + 0.1 * i, top) for i in range(3)])
    assert admission.demand.expected_slots(clock.now)[top] == pytest.approx(13 / 9.8 * 4)
    # Three more: six in the last half second cannot be chance: 12/s, 48 slots at once (the
    # last second, 7 arrivals, says only 7/s).
    _arrive(admission, [(clock.now, top) for _ in range(3)])
    assert admission.demand.expected_slots(clock.now)[top] == pytest.approx(6 / 0.5 * 4)
    # A second later the last second is empty and 7 in the last 2 s are no surge at 1.5/s.
    clock.advance(1.0)
    assert admission.demand.expected_slots(clock.now)[top] == pytest.approx(15 / 9.8 * 4)


def test_after_a_quiet_spell_a_few_arrivals_are_read_over_the_time_watched() -> None:
    clock = FakeClock()
    admission, _, _, settings = _controller(clock)
    for name in ("interactive", "standard"):
        admission.completed(name, 6.0, decode_s=5.5, decoded=63)
    top, middle = (_tier(settings, name).priority for name in ("interactive", "standard"))
    pair = [(top, -0.6), (middle, 0.0)]
    # Just started, the gateway has watched nothing before them: over a second, 1/s each.
    _arrive(admission, [(clock.now + offset, p) for p, offset in pair])
    assert admission.demand.arrival_rates(clock.now) == {top: 1.0, middle: 1.0}
    assert admission.placer.reserving(4, clock.now)
    # After twenty quiet seconds the same pair is two arrivals in the 10 s watched, not a
    # rate of one a second each: 1.2 slots expected of 4, nothing kept back.
    clock.advance(20.0)
    _arrive(admission, [(clock.now + offset, p) for p, offset in pair])
    rates = admission.demand.arrival_rates(clock.now)
    assert rates == {top: pytest.approx(0.1), middle: pytest.approx(0.1)}
    assert admission.demand.expected_total(clock.now) == pytest.approx(1.2)
    assert not admission.placer.reserving(4, clock.now)
    # Nor is an interactive request likely during a lower tier's 2-s prefill (0.2 expected).
    assert not admission.room.higher_likely(_tier(settings, "standard"), 1, 2.0, clock.now)


def test_a_surge_of_every_tier_is_read_from_all_arrivals_by_each_tiers_share() -> None:
    clock = FakeClock()
    admission, _, _, _ = _controller(clock)
    admission.completed("interactive", 4.0)  # its requests hold a slot 4 s
    top, middle = 0, 1
    # Ten quiet seconds: one top and two middle arrivals a second; top is a third of them.
    for t in range(10):
        at = clock.now - 9.6 + t
        _arrive(admission, [(at, top), (at, middle), (at + 0.25, middle)])
    assert admission.demand.expected_slots(clock.now)[top] == pytest.approx(10 / 9.6 * 4)
    # Every tier surges: 9 arrivals in the last 0.3 s, only two of them top. Two alone say
    # nothing, but with the three quiet ones before them all tiers brought 12 in the last
    # second, against 27 in the 8.9 s before it (3/s): 12/s, of which the top tier's part is
    # its share of the 10-s window's arrivals, 12 of 39: 12 x 12 / 39 per second, each
    # holding 4 s.
    clock.advance(0.3)
    surge = [top, middle, middle, middle, top, middle, middle, middle, middle]
    _arrive(admission, [(clock.now - 0.3 + 0.03 * i, p) for i, p in enumerate(surge)])
    assert admission.demand.expected_slots(clock.now)[top] == pytest.approx(12 / 1 * 12 / 39 * 4)


def test_a_lasting_surge_is_read_at_its_own_rate_not_blended_with_the_window() -> None:
    clock = FakeClock()
    admission, _, _, _ = _controller(clock)
    admission.completed("interactive", 4.0)  # its requests hold a slot 4 s
    top, middle = 0, 1
    # Ten quiet seconds at 3/s (a third of them top), then three at 9/s.
    quiet = [(clock.now - 13 + t / 3, top if t % 3 == 0 else middle) for t in range(30)]
    surge = [(clock.now - 3 + t / 9, top if t % 3 == 0 else middle) for t in range(27)]
    _arrive(admission, quiet + surge)
    # The 10-s window alone says 48 arrivals (7 s quiet, 3 s of surge): 4.8/s. The last 4 s
    # brought 30 against 18 in the 6 s before them (3/s, 12 expected): 7.5/s, a third top.
    rate = admission.demand.expected_slots(clock.now)[top] / 4
    assert rate == pytest.approx(30 / 4 * 16 / 48)


def test_concurrency_limit_never_leaves_its_bounds() -> None:
    limit = ConcurrencyLimit(initial=2, maximum=4, minimum=1, decrease=0.5, cooldown_s=0)
    for _ in range(10):
        limit.on_result(0.05, 0.08, 0.1, 100, 0.0)
    assert limit.limit == 4
    for t in range(10):
        limit.on_result(0.2, 0.08, 0.1, 1, float(t))
    assert limit.limit == 1


def test_limit_rises_at_once_to_the_load_its_pace_allows_but_not_right_after_a_cut() -> None:
    limit = ConcurrencyLimit(initial=8, maximum=40, cooldown_s=1.0, settle_s=5.0)
    # Streams that shared the worker with 9 others on average ran at 30 ms per token: TPOT
    # grows at most in proportion to load, so 10 x 80 / 30 = 26.7 would stay within 80 ms.
    # Not binding (3 running), yet the measured pace says so: the limit goes to 26.
    limit.on_result(0.03, 0.08, 0.1, 3, 0.0, load=10.0)
    assert limit.limit == 26
    # A smaller projection never lowers it; one over the aim projects nothing.
    limit.on_result(0.05, 0.08, 0.1, 3, 0.1, load=10.0)
    limit.on_result(0.09, 0.08, 0.1, 3, 0.2, load=5.0)
    assert limit.limit == 26
    # A miss with 26 running cuts (26 x 0.9); for ``settle_s`` after it only +1 steps apply,
    # since the streams finishing now ran before the cut, and only for one that ran at the limit.
    limit.on_result(0.105, 0.08, 0.1, 26, 1.0, load=26.0)
    assert limit.limit == 23
    limit.on_result(0.02, 0.08, 0.1, 30, 5.9, load=20.0)
    assert limit.limit == 23
    limit.on_result(0.02, 0.08, 0.1, 3, 5.9, load=22.5)
    assert limit.limit == 24
    # Settled: the projection applies again, capped at the maximum.
    limit.on_result(0.02, 0.08, 0.1, 3, 6.0, load=20.0)
    assert limit.limit == 40


def test_a_miss_cuts_from_what_runs_when_that_is_below_the_limit() -> None:
    limit = ConcurrencyLimit(initial=30, maximum=40, cooldown_s=1.0)
    # 20 running under a limit of 30 missed: cutting 30 to 27 would hold nothing back.
    limit.cut(20, 0.0)
    assert limit.limit == 18
    limit.cut(25, 0.5)  # within the cooldown: the same overload, seen again
    assert limit.limit == 18
    # More running than the last cut left room for: that cut has not taken effect yet (the
    # excess is draining), so the misses of the excess cut nothing more.
    limit.cut(30, 1.0)
    assert limit.limit == 18
    limit.cut(19, 2.0)
    assert limit.limit == 18
    limit.cut(18, 3.0)  # down to the limit and still missing: cut again, from the limit
    assert limit.limit == 16
    # Drained to the limit (a stream ends with 15 running), then borrowed past it again
    # (higher tiers over lower tiers' slots): a miss now is the new load's, and cuts.
    limit.on_result(0.09, 0.08, 0.1, 15, 4.0)
    limit.cut(20, 5.0)
    assert limit.limit == 14  # from the limit, 16 x 0.9
    # Before any cut, a limit below what runs (other replicas' requests) is cut from itself.
    fresh = ConcurrencyLimit(initial=20, maximum=40)
    fresh.cut(30, 0.0)
    assert fresh.limit == 18


def test_a_pace_window_closes_early_when_the_streams_are_far_past_the_alarm() -> None:
    pace = DecodePace(window_s=3.0, min_gaps=20)
    pace.alarm = 0.125
    assert pace.gap(0.05, 0.0) is None  # opens the first window
    # 100 gaps of 200 ms within the first second: past the alarm, but the window is young.
    assert all(pace.gap(0.2, 0.5 + k / 1000) is None for k in range(100))
    # A third of the window gone and 100+ gaps past the alarm: read now, not at 3 s.
    assert pace.gap(0.2, 1.01) == pytest.approx(0.2)
    # Slow, but under the alarm: the window runs its full length.
    assert all(pace.gap(0.11, 1.5 + k / 100) is None for k in range(150))
    assert pace.gap(0.11, 4.02) == pytest.approx(0.11)


def test_decode_pace_reads_the_mean_gap_per_token_once_per_window() -> None:
    pace = DecodePace(window_s=1.0, min_gaps=4)
    assert pace.gap(0.05, 0.0) is None  # opens the first window
    assert [pace.gap(0.05, t) for t in (0.2, 0.4, 0.6)] == [None, None, None]
    assert pace.gap(0.09, 1.0) == pytest.approx((0.05 * 3 + 0.09) / 4)
    # Too few gaps in a window (an idle worker) say nothing.
    assert pace.gap(0.5, 2.5) is None
    # Two tokens per event (speculative decoding): the same gaps are half as long per token.
    for _ in range(50):
        pace.observe_stream(tokens=65, events=33)
    assert pace.tokens_per_event == pytest.approx(2.0, rel=0.01)
    for t in (2.7, 2.9, 3.1):
        pace.gap(0.1, t)
    assert pace.gap(0.1, 3.6) == pytest.approx(0.05, rel=0.01)


async def test_a_lower_tier_prompt_waits_while_the_prefill_ahead_would_delay_higher_ones() -> None:
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock)
    worker = pool.workers["a:1"]
    line = worker.latency.prefill = OnlineLinear(0.0, 0.001)  # 1 ms a prompt token
    standard, batch = _tier(settings, "standard"), _tier(settings, "batch")
    interactive = _tier(settings, "interactive")
    worker.prefilling, worker.prefill_tokens_ahead = 1, 300.0
    # No higher tier in play: a standard prompt joins whatever prefills.
    assert not admission.room.full(worker, standard, tokens=900)
    # Nor before the prefill rate was learnt from a few first tokens (the prior is a guess).
    _arrive(admission, [(clock.now, interactive.priority)])
    assert not admission.room.full(worker, standard, tokens=900)
    for _ in range(8):
        line.observe(300.0, 0.3)
    # With interactive arrivals (2 a second: one expected in a step of 0.25 s or more),
    # standard and batch prompts keep the prefill ahead within 0.8 x 1 s / 2 = 0.4 s (400
    # tokens here); interactive itself is not held for it.
    _arrive(admission, [(clock.now, interactive.priority)])
    assert not admission.room.full(worker, standard, tokens=90)
    assert admission.room.full(worker, standard, tokens=110)
    assert admission.room.full(worker, batch, tokens=110, reserving=False)
    assert not admission.room.full(worker, interactive, tokens=900)
    # The first prompt always goes, however long.
    worker.prefilling, worker.prefill_tokens_ahead = 0, 0.0
    assert not admission.room.full(worker, standard, tokens=900)
    # Below standard alone (arriving once a second), batch keeps standard's 0.8 x 5 s / 2 = 2 s.
    clock.advance(11.0)
    _arrive(admission, [(clock.now - 9.0 + k, standard.priority) for k in range(10)])
    worker.prefilling, worker.prefill_tokens_ahead = 1, 300.0
    assert not admission.room.full(worker, standard, tokens=900)
    assert not admission.room.full(worker, batch, tokens=1650)
    assert admission.room.full(worker, batch, tokens=1750)
    # Interactive requests arriving twice in the 10 s watched: one is unlikely in a 0.41 s
    # step (0.08 of one expected), and the standard prompt goes.
    clock.advance(11.0)
    _arrive(admission, [(clock.now - 9.0, interactive.priority), (clock.now, interactive.priority)])
    assert not admission.room.full(worker, standard, tokens=110)
    # Arriving every 0.75 s they are likely (0.53 expected): it waits.
    clock.advance(11.0)
    _arrive(admission, [(clock.now - 9.0 + 0.75 * k, interactive.priority) for k in range(13)])
    assert admission.room.full(worker, standard, tokens=110)

    # Through admission: a standard request waits for the interactive prompt's first output.
    worker.prefilling, worker.prefill_tokens_ahead = 0, 0.0
    lease, _ = await admission.admit(_ticket(settings, clock, "interactive", tokens=300))
    queued = asyncio.create_task(admission.admit(_ticket(settings, clock, "standard", 300)))
    await asyncio.sleep(0)
    assert not queued.done()
    clock.advance(0.3)
    lease.first_output(clock.now)
    admission.poke()
    second, waited = await asyncio.wait_for(queued, 1.0)
    assert second.worker is worker
    assert waited == pytest.approx(0.3)


def test_a_lower_tier_prompt_waits_while_its_prefill_would_stall_a_higher_stream() -> None:
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock)
    worker = pool.workers["a:1"]
    line = worker.latency.prefill = OnlineLinear(0.0, 0.001)  # 1 ms a prompt token
    for _ in range(8):
        line.observe(300.0, 0.3)
    standard, batch = _tier(settings, "standard"), _tier(settings, "batch")
    interactive = _tier(settings, "interactive")
    ticket = _ticket(settings, clock, "interactive", 300)
    ticket.max_tokens = 65
    stream = admission.lease(Choice(worker, 0.0, 0.0), ticket)
    stream.first_output(clock.now)
    assert worker.decoding == {stream}
    for _ in range(20):
        clock.advance(0.06)
        stream.output_gap(0.06, clock.now)
    # 60 ms a token so far, 64 tokens after the first: (0.9 x 100 ms - 60 ms) x 64 = 1.92 s of
    # stall it can take. No interactive arrivals, nothing prefilling: only this rule holds.
    assert stream.stall_room(clock.now, 0.09, None) == pytest.approx(1.92)
    assert not admission.room.full(worker, standard, reserving=False, tokens=1900)
    assert admission.room.full(worker, standard, reserving=False, tokens=1950)
    assert admission.room.full(worker, batch, reserving=False, tokens=1950)
    # A prompt prefilling ahead stalls it too.
    worker.prefill_tokens_ahead = 1000.0
    assert admission.room.full(worker, standard, reserving=False, tokens=1000)
    worker.prefill_tokens_ahead = 0.0
    # The top tier is not held for its own streams.
    assert not admission.room.full(worker, interactive, tokens=5000)
    # Slower since: 75 ms a token so far leaves 0.96 s.
    for _ in range(20):
        clock.advance(0.09)
        stream.output_gap(0.09, clock.now)
    assert not admission.room.full(worker, standard, reserving=False, tokens=900)
    assert admission.room.full(worker, standard, reserving=False, tokens=1000)
    # Interactive streams seen to end after 20 tokens: 40 done, at least 41 expected.
    admission.demand.held(interactive.priority, 2.0, 1.5, 20.0)
    assert stream.stall_room(clock.now, 0.09, 20.0) == pytest.approx(0.015 * 41)
    assert admission.room.full(worker, standard, reserving=False, tokens=700)
    # A stream whose length is not known (no max_tokens, none of its tier ended) holds nothing.
    stream.max_tokens = None
    admission.room.demand = type(admission.demand)(clock, None)
    assert not admission.room.full(worker, standard, reserving=False, tokens=5000)
    # Released, it stalls no more.
    stream.max_tokens = 65
    assert admission.room.full(worker, standard, reserving=False, tokens=1000)
    stream.release(clock.now)
    assert not worker.decoding
    assert not admission.room.full(worker, standard, reserving=False, tokens=5000)


def test_the_prefill_limit_holds_a_lower_tier_only_while_a_higher_one_would_wait() -> None:
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock)
    worker = pool.workers["a:1"]
    worker.prefill_limit = ConcurrencyLimit(initial=1, maximum=256)
    standard, batch = _tier(settings, "standard"), _tier(settings, "batch")
    interactive = _tier(settings, "interactive")
    first = admission.lease(Choice(worker, 0.0, 0.0), _ticket(settings, clock, "standard", 300))
    assert (worker.prefilling, worker.tier_prefilling["standard"]) == (1, 1)
    # Before the prefill rate was learnt too: batch waits for the standard prompt prefilling,
    # and a standard prompt, with no higher tier near, joins it.
    assert worker.latency.prefill.observed == 0
    assert admission.room.full(worker, batch, reserving=False, tokens=300)
    assert not admission.room.full(worker, standard, reserving=False, tokens=300)
    line = worker.latency.prefill = OnlineLinear(0.0, 0.001)  # 1 ms a prompt token
    for _ in range(8):
        line.observe(300.0, 0.3)
    # Then, with no higher tier arriving, a standard prompt joins the one prefilling, and
    # batch, below the standard prompt prefilling, waits for it.
    assert not admission.room.full(worker, standard, reserving=False, tokens=300)
    assert admission.room.full(worker, batch, reserving=False, tokens=300)
    # Interactive arriving once in 9 s: 0.2 a second, 0.12 expected in the 0.6 s of prefill.
    _arrive(admission, [(clock.now - 9.0, interactive.priority), (clock.now, interactive.priority)])
    assert not admission.room.full(worker, standard, reserving=False, tokens=300)
    # Twice a second: 1.2 expected, and the prompt waits.
    _arrive(admission, [(clock.now, interactive.priority)] * 20)
    assert admission.room.full(worker, standard, reserving=False, tokens=300)
    # Once an interactive request prefills, it waits whatever the rate.
    clock.advance(11.0)
    first.first_output(clock.now)
    assert worker.tier_prefilling["standard"] == 0
    assert not admission.room.full(worker, standard, reserving=False, tokens=300)
    admission.lease(Choice(worker, 0.0, 0.0), _ticket(settings, clock, "interactive", 300))
    assert admission.room.full(worker, standard, reserving=False, tokens=300)
    assert not admission.room.full(worker, interactive, tokens=300)


async def test_a_worker_whose_streams_slow_past_the_tpot_target_is_cut_at_once() -> None:
    clock = FakeClock()
    admission, pool, metrics, _ = _controller(clock, max_running_per_worker=64)
    worker = pool.workers["a:1"]
    worker.limit = ConcurrencyLimit(initial=40, maximum=64)
    worker.in_flight = 30
    admission.limits.paced(worker, 0.09, clock.now)  # within the 100 ms target: nothing changes
    assert admission.limits.cap(worker) == 40
    admission.limits.paced(worker, 0.11, clock.now)
    assert admission.limits.cap(worker) == 27  # 30 running x 0.9
    pace = metrics.registry.get_sample_value(
        "gateway_worker_decode_pace_seconds", {"worker": worker.label}
    )
    assert pace == pytest.approx(0.11)
    # Its pace readings close early past a quarter over the strictest TPOT target.
    assert worker.pace.alarm == pytest.approx(0.125)


def test_limit_grows_by_one_only_on_a_stream_that_ran_at_the_limit() -> None:
    limit = ConcurrencyLimit(initial=20, maximum=40, settle_s=5.0)
    limit.on_result(0.105, 0.08, 0.1, 20, 0.0, load=20.0)  # a cut: 18, and no projection
    # A surge: the worker is at its limit now, but the stream finishing decoded beside 9
    # others on average; its pace says nothing about 18, so the limit stays.
    limit.on_result(0.075, 0.08, 0.1, 18, 1.0, load=9.0)
    assert limit.limit == 18
    # One that decoded beside 17 others (the limit less one) did run there: +1.
    limit.on_result(0.075, 0.08, 0.1, 5, 1.0, load=17.0)
    assert limit.limit == 19
    # Without a load, the count in flight at its end stands for it.
    limit.on_result(0.075, 0.08, 0.1, 18, 1.0)
    assert limit.limit == 20
    limit.on_result(0.075, 0.08, 0.1, 10, 1.0)
    assert limit.limit == 20


def test_worker_occupancy_integrates_in_flight_over_time() -> None:
    worker = Worker(WorkerSpec(url="http://a:1"))
    worker.add_in_flight(1, 10.0)
    worker.add_in_flight(2, 12.0)
    start = worker.occupancy(12.0)
    worker.add_in_flight(-1, 13.0)
    # From 12 s to 14 s: 3 requests for 1 s, then 2 for 1 s: 2.5 on average.
    assert (worker.occupancy(14.0) - start) / 2.0 == pytest.approx(2.5)
    assert worker.occupancy(14.0) == pytest.approx(2.0 + 3.0 + 2.0)


async def test_full_worker_queues_by_tier_then_deadline_and_dispatches_when_freed() -> None:
    clock = FakeClock()
    admission, pool, metrics, settings = _controller(clock, max_running_per_worker=1)
    worker = pool.workers["a:1"]
    worker.in_flight = 1  # the only slot is taken
    order: list[str] = []
    leases: list[Lease] = []

    async def run(name: str, tier: str) -> None:
        lease, _ = await admission.admit(_ticket(settings, clock, tier))
        order.append(name)
        leases.append(lease)  # it holds the slot until released

    tasks = []
    for name, tier in [("b1", "batch"), ("s1", "standard"), ("i1", "interactive"),
                       ("s2", "standard")]:  # fmt: skip
        tasks.append(asyncio.create_task(run(name, tier)))
        await asyncio.sleep(0)
        clock.advance(0.01)
    await asyncio.sleep(0)
    assert metrics.registry.get_sample_value("gateway_queue_depth", {"tier": "standard"}) == 2
    worker.in_flight = 0  # the request that held the slot ends
    admission.completed("batch", 1.0)
    for _ in range(4):
        await asyncio.sleep(0.001)
        await asyncio.sleep(0.001)
        assert worker.in_flight == 1  # one at a time
        leases[-1].release(clock.now)
        admission.completed("batch", 1.0)
    await asyncio.gather(*tasks)
    assert order == ["i1", "s1", "s2", "b1"]
    assert _decisions(metrics, "batch", "queued") == 1
    assert worker.in_flight == worker.prefilling == 0


async def test_queued_request_past_its_deadline_gets_503_with_retry_after() -> None:
    clock = FakeClock()
    admission, pool, metrics, settings = _controller(clock, max_running_per_worker=1)
    pool.workers["a:1"].in_flight = 1
    task = asyncio.create_task(admission.admit(_ticket(settings, clock, "interactive")))
    await asyncio.sleep(0)
    clock.advance(5.0)
    admission.dispatch()
    with pytest.raises(QueueTimeout) as caught:
        await task
    assert caught.value.status_code == 503
    assert int(caught.value.headers()["retry-after"]) >= 1
    assert _decisions(metrics, "interactive", "expired") == 1
    # Capacity was short for interactive: for a while, lower tiers leave freed capacity to it.
    pool.workers["a:1"].in_flight = 0
    batch = asyncio.create_task(admission.admit(_ticket(settings, clock, "batch")))
    await asyncio.sleep(0)
    assert not batch.done()
    assert _decisions(metrics, "batch", "queued") == 1
    interactive, _ = await admission.admit(_ticket(settings, clock, "interactive"))
    assert interactive.worker is pool.workers["a:1"]
    interactive.release(clock.now)
    clock.advance(2.5)  # the shortage is over: the batch request runs
    admission.dispatch()
    choice, waited = await batch
    assert choice.worker is pool.workers["a:1"]
    assert waited == pytest.approx(2.5)


class CountingPlacement:
    """Admission's placement, with the requests it was asked to place noted."""

    def __init__(self, placer: object) -> None:
        self._placer = placer
        self.asked: list[str] = []

    def choose(self, ticket: Ticket, *args: object) -> object:
        self.asked.append(ticket.tier.name)
        return self._placer.choose(ticket, *args)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._placer, name)


async def test_a_dispatch_pass_looks_past_a_blocked_model_only_for_expired_requests() -> None:
    clock = FakeClock()
    admission, pool, metrics, settings = _controller(clock, max_running_per_worker=1)
    worker = pool.workers["a:1"]
    worker.in_flight = 1
    batch = [
        asyncio.create_task(admission.admit(_ticket(settings, clock, "batch"))) for _ in range(30)
    ]
    await asyncio.sleep(0)
    clock.advance(58.0)
    standard = [
        asyncio.create_task(admission.admit(_ticket(settings, clock, "standard")))
        for _ in range(30)
    ]
    await asyncio.sleep(0)
    assert _decisions(metrics, "batch", "queued") == _decisions(metrics, "standard", "queued") == 30
    counting = CountingPlacement(admission.placer)
    admission.placer = counting  # type: ignore[assignment]
    # The batch requests' 60 s are up, the standard ones' 5 s are not: one pass expires every
    # batch request behind the blocked standard tier, and asks where to place one request.
    clock.advance(2.5)
    admission.dispatch()
    assert counting.asked == ["standard"]
    await asyncio.sleep(0)
    assert all(isinstance(task.exception(), QueueTimeout) for task in batch)
    assert _decisions(metrics, "batch", "expired") == 30
    assert not any(task.done() for task in standard)
    # A slot frees: the first standard request takes it, the next finds the model blocked.
    worker.in_flight = 0
    admission.dispatch()
    assert counting.asked == ["standard"] * 3
    await asyncio.sleep(0)
    assert sum(task.done() for task in standard) == 1
    clock.advance(5.0)
    admission.dispatch()
    await asyncio.sleep(0)
    assert sum(isinstance(task.exception(), QueueTimeout) for task in standard) == 29
    assert _decisions(metrics, "standard", "expired") == 29
    assert metrics.registry.get_sample_value("gateway_queue_depth", {"tier": "standard"}) == 0


async def test_a_queued_request_leaves_the_queue_in_time_for_the_workers_recent_ttft() -> None:
    clock = FakeClock()
    admission, pool, metrics, settings = _controller(clock, max_running_per_worker=1)
    worker = pool.workers["a:1"]

    async def queued(recent_ttft: float, waited: float) -> asyncio.Task[tuple[Lease, float]]:
        """An interactive request queued behind a busy worker, ``waited`` seconds later."""
        worker.in_flight = 1
        for _ in range(50):
            worker.recent_ttft.observe(recent_ttft, clock.now)
        task = asyncio.create_task(admission.admit(_ticket(settings, clock, "interactive")))
        await asyncio.sleep(0)
        clock.advance(waited)
        admission.dispatch()
        return task

    # Recent first tokens came 0.1 s after dispatch: up to 0.9 s in the queue can still work.
    quick = await queued(0.1, 0.6)
    assert not quick.done()
    worker.in_flight = 0
    admission.dispatch()
    await quick
    # Now they come 0.6 s after dispatch (prefill behind others): dispatched after 0.4 s in
    # the queue, a request would most likely miss its 1 s target, so it leaves with a 503.
    slow = await queued(0.6, 0.45)
    with pytest.raises(QueueTimeout):
        await asyncio.wait_for(slow, 1.0)
    assert _decisions(metrics, "interactive", "expired") == 1


def test_recent_quantile_reads_only_the_last_observations() -> None:
    recent = RecentQuantile(0.8, size=5, window_s=10.0)
    assert recent.value(0.0, default=0.25) == 0.25
    for t, value in enumerate((5.0, 1.0, 4.0, 2.0, 3.0)):
        recent.observe(value, float(t))
    assert recent.value(4.0) == 5.0  # nearest rank: the 5th of 5 at q=0.8 (index 4)
    for t, value in enumerate((0.1, 0.2, 0.3, 0.4), start=5):
        recent.observe(value, float(t))  # 5.0, 1.0, 4.0, 2.0 fall out of the window
    assert recent.value(8.0) == 3.0
    recent.observe(0.5, 9.0)
    assert recent.value(9.0) == 0.5
    # Observations older than the window age out: an overload's slow first token does not
    # stand for a worker that has been quick since.
    recent.observe(9.0, 12.0)
    recent.observe(0.1, 20.0)
    assert recent.value(21.0) == 9.0  # 9.0 (t=12) and 0.1 (t=20) are within the last 10 s
    assert recent.value(22.5) == 0.1
    assert recent.value(30.5, default=0.25) == 0.25


async def test_a_request_that_cannot_meet_its_ttft_even_by_waiting_is_rejected_429() -> None:
    clock = FakeClock()
    admission, _, metrics, settings = _controller(clock)
    # 50k tokens at the prior 0.2 ms/token: 10 s of prefill against a 1 s TTFT target.
    with pytest.raises(Overloaded) as caught:
        await admission.admit(_ticket(settings, clock, "interactive", tokens=50_000))
    assert caught.value.status_code == 429
    assert "retry-after-ms" in caught.value.headers()
    assert _decisions(metrics, "interactive", "rejected") == 1
    # The same prompt fits the batch tier's 60 s target.
    await admission.admit(_ticket(settings, clock, "batch", tokens=50_000))


def _own(settings: Settings, clock: FakeClock, tier: str, ttft_s: float, **more: float) -> Ticket:
    """A ticket of ``tier`` whose request sent its own TTFT target (``x-slo-ttft-ms``)."""
    spec = _tier(settings, tier).with_targets(ttft_s, None)
    return Ticket(spec, MODEL, more.get("tokens", 10), NO_KEY, clock.now, own_ttft=True)


async def test_a_requests_own_unreachable_target_is_served_at_once_below_saturation() -> None:
    clock = FakeClock()
    admission, pool, metrics, settings = _controller(clock, max_running_per_worker=1)
    # 50k tokens would be refused at the tier's own 1 s target (the test above); the
    # request's own 10 ms target is as far out of reach, yet with room it runs at once.
    lease, waited = await admission.admit(_own(settings, clock, "interactive", 0.01, tokens=50e3))
    assert (lease.worker, waited) == (pool.workers["a:1"], 0.0)
    assert _decisions(metrics, "interactive", "admitted") == 1
    # Saturated (the only slot taken): now the unreachable deadline is refused at once.
    with pytest.raises(Overloaded) as caught:
        await admission.admit(_own(settings, clock, "interactive", 0.01, tokens=50e3))
    assert caught.value.code == "deadline_unreachable"
    assert "this request's own 0.01 s" in caught.value.message
    lease.release(clock.now)


async def test_own_ttft_targets_order_a_tiers_queue_by_deadline() -> None:
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock, max_running_per_worker=1)
    worker = pool.workers["a:1"]
    worker.in_flight = 1
    order: list[str] = []

    async def run(name: str, ticket: Ticket) -> None:
        lease, _ = await admission.admit(ticket)
        order.append(name)
        lease.release(clock.now)

    # Same tier, later arrival, but a 2 s target against the tier's 5 s: it goes first.
    first = asyncio.create_task(run("tier", _ticket(settings, clock, "standard")))
    await asyncio.sleep(0)
    clock.advance(0.01)
    second = asyncio.create_task(run("own", _own(settings, clock, "standard", 2.0)))
    await asyncio.sleep(0)
    worker.in_flight = 0
    admission.completed("standard", 1.0)
    await asyncio.gather(first, second)
    assert order == ["own", "tier"]


def test_a_tier_with_a_requests_own_targets_keeps_everything_else() -> None:
    settings = settings_for("http://a:1")
    interactive = _tier(settings, "interactive")
    own = interactive.with_targets(0.2, 0.03)
    assert (own.ttft_slo_s, own.tpot_slo_s) == (0.2, 0.03)
    assert own.model_dump(exclude={"ttft_slo_s", "tpot_slo_s"}) == interactive.model_dump(
        exclude={"ttft_slo_s", "tpot_slo_s"}
    )
    assert interactive.with_targets(None, None) is interactive
    assert interactive.with_targets(None, 0.5).ttft_slo_s == interactive.ttft_slo_s
    # Batch has no TPOT target of its own; a request may bring one.
    assert _tier(settings, "batch").with_targets(None, 0.05).tpot_slo_s == 0.05

    def timing(ttft: float, tpot: float) -> TimingSummary:
        return TimingSummary(0.0, ttft, 2.0, tpot, [], 10, 0.0)

    assert slo_result(interactive, timing(0.5, 0.05), 10, True) == "met"
    assert slo_result(own, timing(0.5, 0.05), 10, True) == "missed_both"
    assert slo_result(own, timing(0.1, 0.02), 10, True) == "met"


async def test_retry_after_follows_the_drain_rate_measured_while_requests_queue() -> None:
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock, max_running_per_worker=1)
    pool.workers["a:1"].in_flight = 1
    queued = [asyncio.create_task(admission.admit(_ticket(settings, clock, "batch")))
              for _ in range(5)]  # fmt: skip
    await asyncio.sleep(0)
    for _ in range(21):  # 2 requests/s leave the full worker while the batch requests wait
        admission.completed("batch", 1.0)
        clock.advance(0.5)
    assert admission.drain.rate(clock.now) == pytest.approx(2.0, rel=0.1)
    # An interactive request that must be rejected has the 5 batch requests behind it, not
    # ahead: Retry-After ~ 1 / 2 per s.
    assert admission.retry_after(_ticket(settings, clock, "interactive")) == pytest.approx(0.5)
    assert admission.retry_after(_ticket(settings, clock, "batch")) == pytest.approx(3.0)
    # The worker is full and 2 requests/s leave it: an interactive request (1 s target) can
    # wait 0.5 s for a slot, and is queued; a second one would wait 1 s, past its deadline,
    # so it is told at once (429), with that wait as its Retry-After.
    first = asyncio.create_task(admission.admit(_ticket(settings, clock, "interactive")))
    await asyncio.sleep(0)
    assert not first.done()
    with pytest.raises(Overloaded) as caught:
        await admission.admit(_ticket(settings, clock, "interactive"))
    assert caught.value.status_code == 429
    assert caught.value.code == "deadline_unreachable"
    assert caught.value.headers()["retry-after-ms"] == "1000"
    queued.append(first)
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)


async def test_completions_while_nothing_queues_say_nothing_of_the_drain_rate() -> None:
    """Sequential traffic finishes as fast as it arrives: that is no capacity figure."""
    clock = FakeClock()
    admission, _, _, _ = _controller(clock)
    for _ in range(64):
        admission.completed("standard", 0.3)
        clock.advance(0.1)
    assert admission.drain.rate(clock.now) == 0.0


async def test_full_queue_sheds_sheddable_work_and_cancelled_requests_leave() -> None:
    clock = FakeClock()
    admission, pool, metrics, settings = _controller(
        clock, max_running_per_worker=1, max_queue_length=2
    )
    pool.workers["a:1"].in_flight = 1
    b1 = asyncio.create_task(admission.admit(_ticket(settings, clock, "batch")))
    s1 = asyncio.create_task(admission.admit(_ticket(settings, clock, "standard")))
    await asyncio.sleep(0)
    i1 = asyncio.create_task(admission.admit(_ticket(settings, clock, "interactive")))
    await asyncio.sleep(0)
    with pytest.raises(Shed) as caught:
        await b1
    assert caught.value.headers()["x-gateway-shed"] == "true"
    # Nothing sheddable is left: another standard request is rejected outright.
    with pytest.raises(Overloaded):
        await admission.admit(_ticket(settings, clock, "standard"))
    s1.cancel()
    await asyncio.gather(s1, return_exceptions=True)
    assert _decisions(metrics, "standard", "cancelled") == 1
    assert metrics.registry.get_sample_value("gateway_queue_depth", {"tier": "standard"}) == 0
    i1.cancel()
    await asyncio.gather(i1, return_exceptions=True)


async def test_admission_off_relays_everything_at_once() -> None:
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock, admission=False, max_running_per_worker=1)
    pool.workers["a:1"].in_flight = 50
    choice, waited = await admission.admit(_ticket(settings, clock, "interactive", 50_000))
    assert choice.worker.label == "a:1"
    assert waited == 0.0


def test_every_tiers_admission_series_is_exported_at_zero_before_its_first_request() -> None:
    # Prometheus's rate() sees only increases between two scrapes: a series first scraped
    # after a burst of queued requests would show no queue wait for that burst.
    settings = settings_for("http://a:1")
    sample = GatewayMetrics(settings).registry.get_sample_value
    for tier in settings.tiers:
        labels = {"tier": tier.name}
        assert sample("gateway_queue_wait_seconds_count", labels) == 0
        assert sample("gateway_queue_wait_seconds_bucket", {**labels, "le": "+Inf"}) == 0
        assert sample("gateway_ttft_prediction_error_seconds_count", labels) == 0
        assert sample("gateway_queue_depth", labels) == 0
        for decision, reasons in DECISION_REASONS.items():
            for reason in reasons:
                decided = {**labels, "decision": decision, "reason": reason}
                assert sample("gateway_admission_decisions_total", decided) == 0


def _key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def test_keys_map_to_tiers_and_may_only_ask_for_lower_ones(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps([{"sha256": _key("batch-key"), "tier": "batch"}]))
    settings = settings_for(
        "http://a:1",
        api_keys=[{"sha256": _key("chat-key"), "tier": "interactive", "name": "chat-app"}],
        api_keys_file=str(keys_file),
    )
    auth = Authenticator(settings, FakeClock())
    assert auth.enabled
    assert auth.identify("Bearer chat-key", None).tier.name == "interactive"
    assert auth.identify("Bearer chat-key", "batch").tier.name == "batch"
    assert auth.identify("bearer batch-key", None).tier.name == "batch"
    with pytest.raises(TierNotAllowed) as caught:
        auth.identify("Bearer batch-key", "interactive")
    assert caught.value.status_code == 403
    for header in (None, "Bearer wrong-key", "Basic chat-key"):
        with pytest.raises(AuthenticationFailed) as failed:
            auth.identify(header, None)
        assert failed.value.status_code == 401
        assert "chat-key" not in failed.value.message
    # Without keys everything runs in the default tier; lower tiers may be asked for.
    open_auth = Authenticator(settings_for("http://a:1"), FakeClock())
    assert open_auth.identify(None, None).tier.name == "standard"
    assert open_auth.identify(None, "batch").tier.name == "batch"
    with pytest.raises(TierNotAllowed):
        open_auth.identify(None, "interactive")


async def test_per_key_concurrency_and_tokens_per_minute() -> None:
    clock = FakeClock()
    settings = settings_for(
        "http://a:1",
        api_keys=[{"sha256": _key("k"), "max_concurrency": 2, "tokens_per_minute": 600}],
    )
    auth = Authenticator(settings, clock)
    me = auth.identify("Bearer k", None)
    await auth.acquire(me, 100)
    await auth.acquire(me, 100)
    with pytest.raises(RateLimited) as caught:
        await auth.acquire(me, 100)
    assert caught.value.code == "key_quota"
    auth.release(me, 100, 100)
    auth.release(me, 100, 800)  # used far more than estimated: 700 more tokens owed
    # 600 - 200 - 700 = -300 tokens: at 10 tokens/s the key is out of debt in ~30 s.
    with pytest.raises(RateLimited) as limited:
        await auth.acquire(me, 50)
    assert limited.value.retry_after_s == pytest.approx(30.1)
    assert limited.value.headers()["retry-after"] == "31"
    clock.advance(20)
    with pytest.raises(RateLimited):
        await auth.acquire(me, 50)
    clock.advance(11)
    await auth.acquire(me, 50)


def test_token_bucket_refills_to_capacity_only() -> None:
    clock = FakeClock()
    bucket = TokenBucket(60, clock)
    bucket.charge(90)
    assert bucket.level == pytest.approx(-30)
    assert bucket.wait() == pytest.approx(31)
    clock.advance(1000)
    assert bucket.level == pytest.approx(60)


def test_slo_results_and_goodput_ratio() -> None:
    clock = FakeClock()
    settings = settings_for("http://a:1")
    interactive = _tier(settings, "interactive")
    batch = _tier(settings, "batch")

    def timing(ttft: float, tpot: float | None, e2e: float = 2.0) -> TimingSummary:
        return TimingSummary(0.0, ttft, e2e, tpot, [], 10, 0.0)

    assert slo_result(interactive, timing(0.5, 0.05), 10, True) == "met"
    assert slo_result(interactive, timing(1.5, 0.05), 10, True) == "missed_ttft"
    assert slo_result(interactive, timing(0.5, 0.15), 10, True) == "missed_tpot"
    assert slo_result(interactive, timing(1.5, 0.15), 10, True) == "missed_both"
    assert slo_result(batch, timing(30, 5.0), 10, True) == "met"  # batch has no TPOT target
    # Non-streamed: 1 s + 9 x 0.1 s budget.
    assert slo_result(interactive, timing(0, None, e2e=1.8), 10, False) == "met"
    assert slo_result(interactive, timing(0, None, e2e=2.0), 10, False) == "missed_e2e"
    metrics = GatewayMetrics(settings)
    tracker = GoodputTracker(metrics, settings.tiers, clock, window_s=60)
    for result in ("met", "met", "met", "missed_ttft", "rejected"):
        tracker.record(MODEL, "interactive", SloResult(result), 10)
    assert tracker.ratio("interactive") == pytest.approx(0.6)
    clock.advance(61)
    tracker.record(MODEL, "interactive", SloResult.MET, 10)
    assert tracker.ratio("interactive") == 1.0
    tracker.export()
    sample = metrics.registry.get_sample_value
    assert sample("gateway_goodput_ratio", {"tier": "interactive"}) == 1.0
    assert sample("gateway_goodput_tokens_total", {"model": MODEL, "tier": "interactive"}) == 40
    assert sample("gateway_tier_slo_ttft_seconds", {"tier": "interactive"}) == 1.0
    assert sample("gateway_tier_slo_tpot_seconds", {"tier": "batch"}) is None


def test_decode_pace_pools_the_running_streams_tpot_so_far() -> None:
    pace = DecodePace(min_gaps=4)
    assert pace.so_far(1.0) is None  # nothing decodes
    pace.started(0.0)
    pace.started(1.0)
    for at in (0.1, 0.2, 1.1, 1.2, 1.3):
        pace.gap(0.1, at)
    # 2 s (0 to 2) and 1 s (1 to 2) of decode over 5 tokens, the open gaps included.
    assert pace.so_far(2.0) == pytest.approx(3.0 / 5)
    pace.ended(0.0, 2)
    assert pace.so_far(2.0) is None  # 3 gaps left: too few to say
    pace.gap(0.1, 2.0)
    assert pace.so_far(2.0) == pytest.approx(1.0 / 4)
    pace.ended(1.0, 4)
    assert pace.so_far(2.0) is None


def test_a_tpot_target_a_worker_misses_alone_no_longer_steers_it() -> None:
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock)
    worker = pool.workers["a:1"]
    limits = admission.limits
    interactive, standard = _tier(settings, "interactive"), _tier(settings, "standard")
    limits.arrived(interactive, clock.now)
    limits.arrived(standard, clock.now)
    assert limits.targets(clock.now, worker)[0] == pytest.approx(0.1)
    # A worker at 120 ms a token whatever its batch: every stream misses interactive's 100 ms
    # target, and the cuts take the limit down to one stream at a time.
    for _ in range(10):
        clock.advance(1.1)
        limits.learn(worker, 0.12, clock.now, decode_load=2.0)
    assert limits.cap(worker) == 1
    assert worker.limit.measured
    # Slower than the target with a batch says nothing of the worker alone...
    assert limits.reachable(worker, 0.1)
    # ...but a stream that decoded alone does: interactive's target is out of reach there, the
    # cuts made for it go, and standard's 200 ms target steers the limit now.
    limits.learn(worker, 0.12, clock.now, decode_load=1.0)
    assert not limits.reachable(worker, 0.1)
    assert limits.reachable(worker, 0.2)
    assert limits.targets(clock.now, worker)[0] == pytest.approx(0.2)
    assert limits.targets(clock.now)[0] == pytest.approx(0.1)
    assert limits.cap(worker) == settings.max_running_per_worker
    assert not worker.limit.measured
    for _ in range(5):
        clock.advance(1.1)
        limits.learn(worker, 0.12, clock.now, decode_load=3.0)
    assert limits.cap(worker) == settings.max_running_per_worker
    # A lower tier's prompt is not held for the stall of a stream whose target is out of reach.
    line = worker.latency.prefill = OnlineLinear(0.0, 0.001)
    for _ in range(8):
        line.observe(300.0, 0.3)
    ticket = _ticket(settings, clock, "interactive", 300)
    ticket.max_tokens = 65
    stream = admission.lease(Choice(worker, 0.0, 0.0), ticket)
    stream.first_output(clock.now)
    for _ in range(20):
        clock.advance(0.12)
        stream.output_gap(0.12, clock.now)
    assert stream.stall_room(clock.now, 0.09, None) < 0
    assert not admission.room.full(worker, standard, reserving=False, tokens=100)
    # A faster stream at any load shows the target within reach again: it steers once more,
    # and the prompt waits for the stream's sake.
    limits.learn(worker, 0.08, clock.now, decode_load=2.0)
    assert limits.reachable(worker, 0.1)
    assert limits.targets(clock.now, worker)[0] == pytest.approx(0.1)
    assert admission.room.full(worker, standard, reserving=False, tokens=100)

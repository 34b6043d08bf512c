"""State shared through a REAL redis-server: key limits, in-flight counts and arrivals.

Each "process" here is what one gateway process holds (its Authenticator, worker pool and tier
demand with their own SharedState), several of them in this test's event loop against one
redis-server. The redis-server is killed, paused and restarted to see the fallback.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry, Gauge

from app.admission.auth import Authenticator, Identity
from app.admission.demand import TierDemand
from app.admission.fairshare import FairShare
from app.admission.shared import SharedState
from app.admission.ticket import Ticket
from app.api.errors import RateLimited
from app.fleet.discovery import LoopResolver
from app.fleet.routing import NO_KEY
from app.fleet.wire import WireClient
from app.fleet.workers import WorkerPool
from app.observe.metrics import GatewayMetrics
from app.observe.timing import default_clock
from app.settings import Settings
from scripts.redis_server import RedisServer
from tests.servers import settings_for

KEY = "sk-shared-test"
WORKER = "http://w1:8000"


def _settings(**key_limits: int) -> Settings:
    spec = {"sha256": hashlib.sha256(KEY.encode()).hexdigest(), "tier": "standard", **key_limits}
    return settings_for(WORKER, api_keys=[spec])


@dataclass
class Process:
    """What one gateway process holds of the shared state."""

    shared: SharedState
    auth: Authenticator
    pool: WorkerPool
    demand: TierDemand
    gauge: Gauge
    shares: FairShare

    @property
    def me(self) -> Identity:
        return self.auth.identify(f"Bearer {KEY}", None)

    @property
    def up(self) -> float:
        (metric,) = self.gauge.collect()
        return float(metric.samples[0].value)

    async def sync(self) -> None:
        await self.shared.sync(self.pool, self.demand, self.shares)


@pytest.fixture
async def processes(redis_server: RedisServer) -> AsyncIterator[list[Process]]:
    """Three processes, each with its own link to the same redis-server, keyed alike."""
    made: list[Process] = []
    client = WireClient(1.0)
    for _ in range(3):
        settings = _settings(max_concurrency=4, tokens_per_minute=6000)
        gauge = Gauge("gateway_shared_state_up", "up", registry=CollectorRegistry())
        shared = SharedState(redis_server.url, 0.05, 0.2, default_clock, gauge, lease_ttl_s=1.0)
        metrics = GatewayMetrics(settings)
        pool = WorkerPool(settings, client, metrics, default_clock, LoopResolver())
        demand = TierDemand(default_clock, None)
        demand.fleet = shared.arrivals
        auth = Authenticator(settings, default_clock, shared)
        shares = FairShare()
        shares.fleet = shared.arrivals
        process = Process(shared, auth, pool, demand, gauge, shares)
        made.append(process)
    for process in made * 2:  # the second round: each knows of all three
        await process.sync()
    try:
        yield made
    finally:
        for process in made:
            await process.shared.stop()
        client.close()


async def test_a_keys_concurrency_holds_across_processes(processes: list[Process]) -> None:
    a, b, _ = processes
    await a.auth.acquire(a.me, 10)
    await a.auth.acquire(a.me, 10)
    await b.auth.acquire(b.me, 10)
    await b.auth.acquire(b.me, 10)
    # Four in flight between them: the fifth is refused wherever it arrives.
    for process in (a, b):
        with pytest.raises(RateLimited) as refused:
            await process.auth.acquire(process.me, 10)
        assert refused.value.code == "key_quota"
        assert "Concurrency limit of 4" in refused.value.message
    # One ends in b: a may run it (the release reaches Redis without waiting for the sync).
    b.auth.release(b.me, 10, 10)
    await asyncio.sleep(0.05)
    await a.auth.acquire(a.me, 10)
    with pytest.raises(RateLimited):
        await b.auth.acquire(b.me, 10)
    assert a.up == b.up == 1


async def test_a_dead_processs_slots_come_back_after_the_lease(processes: list[Process]) -> None:
    a, b, c = processes
    for _ in range(3):
        await a.auth.acquire(a.me, 10)
    await b.auth.acquire(b.me, 10)
    with pytest.raises(RateLimited):
        await c.auth.acquire(c.me, 10)
    # a dies without releasing anything; b lives on and refreshes its own count every sync.
    await a.shared.stop()
    deadline = time.monotonic() + 3
    while True:
        await b.sync()
        try:
            await c.auth.acquire(c.me, 10)
            break
        except RateLimited:
            assert time.monotonic() < deadline, "a dead process's slots were never freed"
            await asyncio.sleep(0.1)
    # Freed after the lease (1 s here), and only a's: b's one and c's three fill the limit.
    for _ in range(2):
        await c.auth.acquire(c.me, 10)
    with pytest.raises(RateLimited):
        await c.auth.acquire(c.me, 10)


async def test_tokens_per_minute_are_one_bucket_for_the_fleet(processes: list[Process]) -> None:
    a, b, c = processes
    # 6,000 tokens a minute: a takes 4,000 up front, b 2,500 (the bucket may go into debt by
    # one request), and c finds it empty.
    await a.auth.acquire(a.me, 4000)
    await b.auth.acquire(b.me, 2500)
    with pytest.raises(RateLimited) as refused:
        await c.auth.acquire(c.me, 100)
    assert "Tokens-per-minute limit of 6000" in refused.value.message
    # 500 tokens in debt at 100 tokens/s: out of it in about 5 s.
    assert 4.5 < refused.value.retry_after_s < 5.5
    # a used only 1,000 of its 4,000: the 3,000 come back to everybody.
    a.auth.release(a.me, 4000, 1000)
    await asyncio.sleep(0.05)
    await c.auth.acquire(c.me, 100)


async def test_redis_down_falls_back_within_the_budget_and_recovers(
    processes: list[Process], redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    a, b, _ = processes
    await a.auth.acquire(a.me, 10)
    await b.auth.acquire(b.me, 10)
    redis_server.kill()
    caplog.set_level(logging.WARNING, logger="app.admission.shared")
    # The first request of a after Redis went away pays at most the budget, then a is on
    # its own, with its part of the key's 4: two of the three processes it last saw get 1
    # each... a has its 1 already: refused, at once, never an error.
    started = time.monotonic()
    with pytest.raises(RateLimited):
        await a.auth.acquire(a.me, 10)
    assert time.monotonic() - started < 0.15
    assert a.shared.share(4) == 1
    a.auth.release(a.me, 10, 10)
    await a.auth.acquire(a.me, 10)
    with pytest.raises(RateLimited):
        await a.auth.acquire(a.me, 10)
    for _ in range(3):
        await a.sync()
    assert a.up == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "own limits" in warnings[0].getMessage()
    # Redis comes back empty (a restart): the next sync says so, and republishes a's one;
    # with b's one, the key has room for two more, fleet-wide again.
    redis_server.start()
    await a.sync()
    assert a.up == 1
    await b.sync()
    await b.auth.acquire(b.me, 10)
    await b.auth.acquire(b.me, 10)
    with pytest.raises(RateLimited):
        await b.auth.acquire(b.me, 10)


async def test_a_slow_redis_costs_one_request_the_budget_then_nothing(
    processes: list[Process], redis_server: RedisServer
) -> None:
    a, _, _ = processes
    redis_server.pause()  # connections open, nobody answers
    try:
        started = time.monotonic()
        await a.auth.acquire(a.me, 10)
        first = time.monotonic() - started
        started = time.monotonic()
        with pytest.raises(RateLimited):  # its part of the key's 4 is 1, taken by the first
            await a.auth.acquire(a.me, 10)
        second = time.monotonic() - started
        await a.sync()
    finally:
        redis_server.resume()
    assert first < 0.15, first
    assert second < 0.01, second  # down: no Redis call at all
    assert a.up == 0
    await a.sync()
    assert a.up == 1


async def test_each_process_sees_the_others_requests_on_a_worker(
    processes: list[Process],
) -> None:
    a, b, c = processes
    label = next(iter(a.pool.workers))
    b.pool.workers[label].in_flight = 5
    b.pool.workers[label].tier_in_flight.update(interactive=1, batch=4)
    c.pool.workers[label].in_flight = 2
    c.pool.workers[label].tier_in_flight.update(batch=2, standard=0)
    await b.sync()
    await c.sync()
    await a.sync()
    now = default_clock()
    worker = a.pool.workers[label]
    assert worker.fleet_others == 7
    assert worker.fleet_tier_in_flight(now) == {"interactive": 1, "batch": 6}
    assert worker.fleet_tier_in_flight(now + 1.0) == {}
    assert worker.others(now, 2.0) == 7  # no load scrape: the fleet's count alone
    # Gone stale (no sync for a while): the fleet's count no longer counts.
    assert worker.others(now + 1.0, 2.0) == 0


async def test_arrivals_elsewhere_keep_slots_for_a_higher_tier_here(
    processes: list[Process],
) -> None:
    a, b, _ = processes
    tiers = {t.name: t for t in _settings().tiers}
    now = default_clock()
    for _ in range(20):
        b.demand.arrived(tiers["interactive"].priority, now)
        b.demand.held(tiers["interactive"].priority, 2.0, 0.0, 0.0)
    # Without the fleet's arrivals a keeps nothing for interactive requests it never sees.
    assert a.demand.kept_for_higher(tiers["batch"], 1, 0, now) == 0
    await b.sync()
    await a.sync()
    assert a.demand.kept_for_higher(tiers["batch"], 1, 0, default_clock()) > 0


async def test_requests_queued_elsewhere_are_read_per_model_and_tier(
    processes: list[Process],
) -> None:
    a, b, c = processes
    tiers = {t.name: t for t in _settings().tiers}
    top, middle = tiers["interactive"].priority, tiers["standard"].priority
    b.demand.queued[("m", top)] = 2
    b.demand.queued[("m", middle)] = 0  # none left: not published
    c.demand.queued[("m", middle)] = 3
    c.demand.queued[("other", top)] = 1
    for process in (b, c, a):
        await process.sync()
    now = default_clock()
    assert a.demand.queued_elsewhere("m", tiers["batch"], now) == 5
    assert a.demand.queued_elsewhere("m", tiers["standard"], now) == 2
    assert a.demand.queued_elsewhere("m", tiers["interactive"], now) == 0
    assert a.demand.queued_elsewhere("other", tiers["batch"], now) == 1
    # Its own queue is not counted as elsewhere: b sees c's 3 alone.
    await b.sync()
    assert b.demand.queued_elsewhere("m", tiers["batch"], default_clock()) == 3
    # Once dispatched, gone from the next reading; and a stale reading counts for nothing.
    c.demand.queued[("m", middle)] = 0
    await c.sync()
    await b.sync()
    assert b.demand.queued_elsewhere("m", tiers["batch"], default_clock()) == 0
    assert a.demand.queued_elsewhere("m", tiers["batch"], now + 1.0) == 0


async def test_every_process_weighs_the_fleets_running_requests_per_fairness_id(
    processes: list[Process],
) -> None:
    a, b, _ = processes
    tier = next(t for t in _settings().tiers if t.name == "standard")
    flood = [Ticket(tier, "m", 10, NO_KEY, 0.0, fairness="flood") for _ in range(3)]
    light = Ticket(tier, "m", 10, NO_KEY, 0.0, fairness="light")
    for ticket in flood:
        a.shares.started(ticket)
    await a.sync()
    await b.sync()
    now = default_clock()
    assert b.shares.usage(tier.priority, "flood", now) == 3
    # In b, whose own queue holds one of each, the light id goes first, whatever the deadlines.
    queued = [Ticket(tier, "m", 10, NO_KEY, 0.0, fairness="flood", deadline=1.0), light]
    light.deadline = 2.0
    assert [t.fairness for t in b.shares.order(queued, now)] == ["light", "flood"]
    # Two of a's end: published at the next sync.
    for ticket in flood[:2]:
        a.shares.ended(ticket)
    await a.sync()
    await b.sync()
    assert b.shares.usage(tier.priority, "flood", default_clock()) == 1

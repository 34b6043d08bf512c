"""State shared by every gateway process and replica through Redis (``GATEWAY_REDIS_URL``).

Three things hold fleet-wide instead of per process:

* **per-key limits**: a key's concurrency and tokens per minute. Each request's check and
  charge is one Lua script, so one round trip, within ``GATEWAY_REDIS_TIMEOUT_S``. Concurrency is
  counted per process: every process writes its own count of the key's requests under its own
  field, with an expiry it refreshes every sync, so the slots of a process that died are free
  again within ``LEASE_TTL_S`` and a restarted Redis is refilled within one sync. The tokens
  per minute are the same token bucket as :class:`app.admission.auth.TokenBucket`, kept in Redis: a
  request is charged its estimate when admitted and corrected with its real usage at its end,
  and a key may go into debt by one request.
* **requests in flight per worker**, and of them per tier: every
  ``GATEWAY_REDIS_SYNC_INTERVAL_S`` each process publishes its own, with a short expiry, and
  reads everybody else's (:attr:`app.fleet.workers.Worker.fleet_others`): admission's saturation
  view is the fleet's, within a sync or two rather than a load scrape, and so are the tiers it
  weighs on a worker (what a tier above already runs there, what a lower tier holds).
* **each tier's recent arrivals and queued requests**, in the same sync, read by
  :class:`app.admission.demand.TierDemand` through :class:`FleetArrivals`: the capacity kept for a
  higher tier is kept for the arrivals of the whole fleet, and a lower tier leaves the next slots of
  a worker to the higher tiers' requests queued in other processes, as it would in one queue.
* **each tier's running requests per fairness id** (the ids with the most, bounded), read by
  :class:`app.admission.fairshare.FairShare` through :class:`FleetArrivals`: a queue hands slots
  out by the fleet's shares, not its own process's.

Nothing here is on a request's path but the key check, and only for keys with a limit. Redis
down, slow or restarted never costs a request: every call has the timeout budget, and the
first one that fails or is late turns the shared state down (logged once, the gauge
``gateway_shared_state_up`` at 0). Requests then use this process's own limits and views at
once, without trying Redis; the sync keeps trying every interval and turns it up again when
Redis answers. Standalone Redis only (the scripts read keys they are not given, which Redis
Cluster refuses).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import Gauge
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from app.admission.demand import TierDemand
from app.admission.fairshare import FairShare
from app.fleet.workers import WorkerPool
from app.observe.timing import Clock

log = logging.getLogger(__name__)

LEASE_TTL_S = 5.0
"""How long a process's count of a key's requests outlives it (refreshed every sync)."""
_PREFIX = "goodput:"
# Connections per process: a burst of keyed requests waits for one (within the budget) rather
# than opening hundreds.
_MAX_CONNECTIONS = 32
# A process's published state expires after this many syncs (it died, or stalls), and what
# this process read of the others counts for nothing after as long.
_STALE_SYNCS = 5

# Shared by the key scripts: the time, and a process's count of a key's requests, written only
# if no newer one (a higher sequence number) is there: releases and acquisitions run on
# different connections and may arrive out of order.
_COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function publish(key, proc, seq, count, ttl)
  local cur = redis.call('HGET', key, proc)
  if cur then
    local old = tonumber(string.match(cur, '^(%d+):'))
    if old and old > seq then return end
  end
  redis.call('HSET', key, proc, seq .. ':' .. count .. ':' .. (now + ttl))
  redis.call('PEXPIRE', key, 2 * ttl)
end
local function refill(key, tpm)
  local b = redis.call('HMGET', key, 'level', 'at')
  local level = tonumber(b[1]) or tpm
  local at = tonumber(b[2]) or now
  return math.min(tpm, level + math.max(0, now - at) * tpm / 60000.0)
end
local function store(key, tpm, level)
  redis.call('HSET', key, 'level', tostring(level), 'at', now)
  -- Kept until full again (and a minute more): a key's debt is not forgiven early.
  redis.call('PEXPIRE', key, math.ceil((tpm - level) * 60000.0 / tpm) + 60000)
end
"""

# KEYS: concurrency hash, token bucket hash. ARGV: process, sequence, this process's count of
# the key's requests with this one, concurrency limit (0: none), lease ttl ms, tokens per minute
# (0: none), tokens to charge. Returns {1} or {0, 'concurrency'} or {0, 'tpm', wait ms}.
_ACQUIRE = (
    _COMMON
    + """
local proc, seq, own = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local limit, ttl = tonumber(ARGV[4]), tonumber(ARGV[5])
local tpm, charge = tonumber(ARGV[6]), tonumber(ARGV[7])
if limit > 0 then
  local others = 0
  local fields = redis.call('HGETALL', KEYS[1])
  for i = 1, #fields, 2 do
    if fields[i] ~= proc then
      local count, expires = string.match(fields[i + 1], '^%d+:(%d+):(%d+)$')
      if expires == nil or tonumber(expires) < now then
        redis.call('HDEL', KEYS[1], fields[i])
      else
        others = others + tonumber(count)
      end
    end
  end
  if others + own > limit then
    return {0, 'concurrency'}
  end
end
if tpm > 0 then
  local level = refill(KEYS[2], tpm)
  if level <= 0 then
    return {0, 'tpm', math.ceil((1 - level) * 60000.0 / tpm)}
  end
  store(KEYS[2], tpm, level - charge)
end
if limit > 0 then
  publish(KEYS[1], proc, seq, own, ttl)
end
return {1}
"""
)

# KEYS: concurrency hash, token bucket hash. ARGV: process, sequence, this process's count now
# (-1: no concurrency limit), lease ttl ms, tokens per minute (0: none), tokens to add to the
# charge (negative: give back).
_RELEASE = (
    _COMMON
    + """
local count, tpm, delta = tonumber(ARGV[3]), tonumber(ARGV[5]), tonumber(ARGV[6])
if count >= 0 then
  publish(KEYS[1], ARGV[1], tonumber(ARGV[2]), count, tonumber(ARGV[4]))
end
if tpm > 0 and delta ~= 0 then
  store(KEYS[2], tpm, refill(KEYS[2], tpm) - delta)
end
return 1
"""
)

# KEYS: the set of live processes. ARGV: key prefix of process states, process, state ttl ms,
# lease ttl ms, this process's state, then (concurrency hash, sequence, count) of every key
# whose count is republished. Returns {now ms, another process's state as 'published ms|json',
# ...}.
_SYNC = (
    _COMMON
    + """
local prefix, proc, ttl, lease = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + ttl, proc)
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
redis.call('SET', prefix .. proc, now .. '|' .. ARGV[5], 'PX', ttl)
for i = 6, #ARGV, 3 do
  publish(ARGV[i], proc, tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), lease)
end
local out = {tostring(now)}
for _, other in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if other ~= proc then
    local state = redis.call('GET', prefix .. other)
    if state then table.insert(out, state) end
  end
end
return out
"""
)


@dataclass(frozen=True, slots=True)
class Verdict:
    """Redis's answer to a key's request: admitted, or which limit it is over."""

    ok: bool
    limit: str = ""
    """``concurrency`` or ``tpm`` when refused."""
    wait_s: float = 0.0
    """For ``tpm``: when the key's bucket is out of debt."""


class FleetArrivals:
    """Other processes' recent arrivals, queued and running requests, as last read from Redis.

    An :class:`~app.admission.demand.ArrivalCounts` by its methods, not by inheritance: that
    protocol is compiled (:mod:`scripts.compile`), and an interpreted class cannot derive from it.
    """

    def __init__(self) -> None:
        self._counts: dict[float, Counter[int]] = {}
        self._oldest = 0.0
        self._queued: dict[str, Counter[int]] = {}
        self._running: dict[int, Counter[str]] = {}
        self._until = -math.inf

    def update(
        self,
        counts: dict[float, Counter[int]],
        oldest_age: float,
        now: float,
        fresh_s: float,
        queued: dict[str, Counter[int]],
        running: dict[int, Counter[str]] | None = None,
    ) -> None:
        """Take a new reading at ``now``, good for ``fresh_s``."""
        self._counts = counts
        self._oldest = oldest_age
        self._queued = queued
        self._running = running or {}
        self._until = now + fresh_s

    def running(self, priority: int, now: float) -> Mapping[str, int]:
        """Requests running elsewhere per fairness id in a tier; empty when stale."""
        if now > self._until:
            return {}
        return self._running.get(priority, {})

    def counts(self, span_s: float, now: float) -> Mapping[int, int]:
        """Arrivals per tier priority elsewhere over the last ``span_s``; empty when stale."""
        if now > self._until:
            return {}
        return self._counts.get(span_s, {})

    def oldest_age(self, now: float) -> float:
        """Seconds since the oldest arrival elsewhere in the long window (0: none, or stale)."""
        return 0.0 if now > self._until else self._oldest

    def queued(self, model: str, now: float) -> Mapping[int, int]:
        """Requests for ``model`` queued elsewhere per tier priority; empty when stale."""
        if now > self._until:
            return {}
        return self._queued.get(model, {})


class SharedState:
    """One process's link to the fleet through Redis; see the module's documentation."""

    def __init__(
        self,
        url: str,
        timeout_s: float,
        interval_s: float,
        clock: Clock,
        up_gauge: Gauge | None = None,
        lease_ttl_s: float = LEASE_TTL_S,
    ) -> None:
        self.process = uuid.uuid4().hex[:16]
        self._timeout = timeout_s
        self._interval = interval_s
        self._clock = clock
        self._gauge = up_gauge
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=_MAX_CONNECTIONS,
            timeout=None,  # the budget below bounds the wait for a connection too
            socket_connect_timeout=timeout_s,
            socket_timeout=max(1.0, timeout_s),
            # One retry at once, on a new connection: after a restart of Redis every pooled
            # connection is dead, and that alone should not turn the shared state down.
            retry=Retry(NoBackoff(), 1),
        )
        self._redis = aioredis.Redis(connection_pool=pool)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._release = self._redis.register_script(_RELEASE)
        self._sync = self._redis.register_script(_SYNC)
        self._seq = itertools.count(1)
        self._lease_ttl_ms = round(lease_ttl_s * 1000)
        self._state_ttl_ms = round(_STALE_SYNCS * interval_s * 1000)
        self.up = False
        self._down_logged = False
        self.arrivals = FleetArrivals()
        self.processes = 1
        """Gateway processes in the fleet (this one included), as last read from Redis."""
        self._task: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()
        self._keys: dict[str, Callable[[], tuple[int, int | None]]] = {}
        """Keys with a concurrency limit: their hash, and their count here and limit now."""
        self._dirty: set[str] = set()
        self._set_gauge(0)

    # Up and down ------------------------------------------------------------------------------

    def _set_gauge(self, value: int) -> None:
        if self._gauge is not None:
            self._gauge.set(value)

    def _failed(self, what: str, exc: BaseException) -> None:
        """A call failed or was late: down until the sync reaches Redis again (logged once)."""
        if self.up or not self._down_logged:
            log.warning(
                "shared state: Redis %s (%s); this process uses its own limits and views until "
                "it answers again", what, _describe(exc),
            )  # fmt: skip
            self._down_logged = True
        self.up = False
        self._set_gauge(0)

    def _answered(self) -> None:
        if not self.up:
            log.info("shared state: Redis answers; limits and views are the fleet's")
            self._down_logged = False
        self.up = True
        self._set_gauge(1)

    async def _call(self, what: str, call: Any) -> Any:
        """Await a Redis call within the budget; None when it failed (and the state is down)."""
        try:
            async with asyncio.timeout(self._timeout):
                return await call
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(what, exc)
            return None

    # Key limits -------------------------------------------------------------------------------

    def track_key(self, key_hash: str, counts: Callable[[], tuple[int, int | None]]) -> None:
        """Republish ``key_hash``'s count of requests here with every sync (see the module)."""
        self._keys[key_hash] = counts

    def share(self, limit: int) -> int:
        """The part of a key's concurrency ``limit`` this process holds while Redis is away.

        The limit split evenly between the processes last seen (at least one each), so that a
        Redis that is down or slow does not multiply a key's limit by the size of the fleet.
        """
        return max(1, limit // self.processes)

    async def acquire(
        self,
        key_hash: str,
        own: int,
        concurrency: int | None,
        tokens_per_minute: int | None,
        charge: float,
    ) -> Verdict | None:
        """Check and charge a key's request fleet-wide; None when Redis did not answer in time.

        ``own`` is this process's count of the key's requests with this one.
        """
        if not self.up:
            return None
        self._dirty.add(key_hash)
        args = (
            self.process, next(self._seq), own, concurrency or 0, self._lease_ttl_ms,
            tokens_per_minute or 0, round(charge),
        )  # fmt: skip
        reply = await self._call(
            "did not answer a key's check in time",
            self._acquire(keys=_key_names(key_hash), args=args),
        )
        if reply is None:
            return None
        if int(reply[0]) == 1:
            return Verdict(True)
        limit = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
        wait = int(reply[2]) / 1000 if len(reply) > 2 else 0.0
        return Verdict(False, limit, wait)

    def release(
        self, key_hash: str, own: int, concurrency: int | None, tokens_per_minute: int | None,
        extra_tokens: float,
    ) -> None:  # fmt: skip
        """A key's request ended: publish this process's count, correct the charge (no wait)."""
        self._dirty.add(key_hash)
        if not self.up or (concurrency is None and (not tokens_per_minute or not extra_tokens)):
            return
        args = (
            self.process, next(self._seq), own if concurrency else -1,
            self._lease_ttl_ms, tokens_per_minute or 0, round(extra_tokens),
        )  # fmt: skip
        call = self._release(keys=_key_names(key_hash), args=args)
        task = asyncio.get_running_loop().create_task(self._call("did not take a release", call))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    # The sync ---------------------------------------------------------------------------------

    def start(self, pool: WorkerPool, demand: TierDemand, shares: FairShare | None = None) -> None:
        """Publish and read the fleet's state every interval until :meth:`stop`."""
        self._task = asyncio.get_running_loop().create_task(
            self._run(pool, demand, shares), name="shared-state"
        )

    async def _run(self, pool: WorkerPool, demand: TierDemand, shares: FairShare | None) -> None:
        while True:
            try:
                await self.sync(pool, demand, shares)
            except Exception:  # a background job must survive anything one round throws
                log.exception("shared state: sync failed; retrying next round")
            await asyncio.sleep(self._interval)

    async def sync(
        self, pool: WorkerPool, demand: TierDemand, shares: FairShare | None = None
    ) -> None:
        """One round: publish this process's state, read the others', republish key counts."""
        now = self._clock()
        counts, oldest = demand.local_counts(now)
        state = {
            "w": {label: w.in_flight for label, w in pool.workers.items() if w.in_flight},
            "t": {
                label: {tier: n for tier, n in w.tier_in_flight.items() if n}
                for label, w in pool.workers.items()
                if w.in_flight
            },
            "a": {f"{s:g}": {str(p): n for p, n in c.items() if n} for s, c in counts.items()},
            "o": round(oldest, 3),
            "q": {
                model: {str(p): n for p, n in by_tier.items()}
                for model, by_tier in demand.local_queued().items()
            },
        }
        if shares is not None and (running := shares.local_running()):
            state["f"] = {str(p): ids for p, ids in running.items()}
        # Every key with requests here, and every key whose count changed since the last
        # round: a refused acquisition, a lost release, a restarted Redis are all mended here.
        refreshed = [h for h, count in self._keys.items() if count()[0] or h in self._dirty]
        args: list[str | int] = [
            f"{_PREFIX}process:", self.process, self._state_ttl_ms, self._lease_ttl_ms,
            json.dumps(state, separators=(",", ":")),
        ]  # fmt: skip
        for key_hash in refreshed:
            own, limit = self._keys[key_hash]()
            if limit is not None:
                args += [_key_names(key_hash)[0], next(self._seq), own]
        reply = await self._call(
            "is unreachable", self._sync(keys=[f"{_PREFIX}processes"], args=args)
        )
        if reply is None:
            return
        self._dirty.difference_update(refreshed)
        self._answered()
        self._read(reply, pool, now)

    def _read(self, reply: list[bytes], pool: WorkerPool, now: float) -> None:
        """Take the other processes' states: requests per worker, arrivals and queues per tier."""
        redis_now = int(reply[0])
        workers: Counter[str] = Counter()
        tiers: dict[str, Counter[str]] = {}
        spans: dict[float, Counter[int]] = {}
        queued: dict[str, Counter[int]] = {}
        running: dict[int, Counter[str]] = {}
        oldest = 0.0
        for raw in reply[1:]:
            published, _, text = raw.partition(b"|")
            try:
                state = json.loads(text)
                age = max(0.0, (redis_now - int(published)) / 1000)
                workers.update(state["w"])
                for label, counts in state.get("t", {}).items():
                    tiers.setdefault(label, Counter()).update(
                        {str(t): int(n) for t, n in counts.items()}
                    )
                for span, counts in state["a"].items():
                    into = spans.setdefault(float(span), Counter())
                    into.update({int(p): int(n) for p, n in counts.items()})
                if state["o"]:
                    oldest = max(oldest, float(state["o"]) + age)
                for model, counts in state.get("q", {}).items():
                    into = queued.setdefault(str(model), Counter())
                    into.update({int(p): int(n) for p, n in counts.items()})
                for priority, ids in state.get("f", {}).items():
                    by_id = running.setdefault(int(priority), Counter())
                    by_id.update({str(fid): int(n) for fid, n in ids.items()})
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a state this version cannot read: leave it out
        self.processes = len(reply)  # the others' states, and this one's
        fresh = _STALE_SYNCS * self._interval
        for label, worker in pool.workers.items():
            worker.set_fleet_others(float(workers.get(label, 0)), now, fresh, tiers.get(label, {}))
        self.arrivals.update(spans, oldest, now, fresh, queued, running)

    async def stop(self) -> None:
        """Stop the sync and close the connections."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._pending:
            await asyncio.wait(self._pending, timeout=self._timeout)
        with contextlib.suppress(RedisError, OSError):
            await self._redis.aclose()


def _key_names(key_hash: str) -> list[str]:
    return [f"{_PREFIX}key:{key_hash}:concurrency", f"{_PREFIX}key:{key_hash}:tokens"]


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

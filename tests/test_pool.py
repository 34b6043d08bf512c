"""Worker pool: passive health on a fake clock, routing policies, DNS discovery, failover."""

from __future__ import annotations

import asyncio
import json
import random
import ssl
import time
from typing import Any

import httpx
import pytest

from app.api.errors import ModelNotFound
from app.fleet.routing import RouteKey, Router
from app.fleet.wire import Connector, ProtocolFactory, WireClient
from app.fleet.workers import Worker, WorkerPool
from app.observe.metrics import GatewayMetrics
from app.settings import Settings
from tests.conftest import FakeClock
from tests.fake_upstream import MODEL, FakeWorker, chunk, fleet, tokens
from tests.servers import running_gateway, settings_for
from tests.wire_bridge import bridge


class FakeResolver:
    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)

    async def resolve(self, host: str) -> list[str]:
        if self.addresses == ["fail"]:
            raise OSError("name resolution failed")
        return list(self.addresses)


def _pool(settings: Settings, clock: FakeClock, resolver: FakeResolver | None = None) -> WorkerPool:
    client = WireClient(1.0)  # never asked: these tests probe nothing
    return WorkerPool(settings, client, GatewayMetrics(settings), clock, resolver or FakeResolver())


def _metric(pool: WorkerPool, name: str, worker: str) -> float | None:
    value = pool.metrics.registry.get_sample_value(name, {"worker": worker})
    return value


def test_repeated_failures_eject_with_growing_backoff_and_the_worker_returns() -> None:
    clock = FakeClock()
    settings = settings_for("http://a:1,http://b:2", eject_after_failures=3, eject_base_s=1.0)
    pool = _pool(settings, clock)
    a = pool.workers["a:1"]
    a.up = True
    for _ in range(2):
        pool.report_failure(a, "upstream_status_error")
    assert a.healthy(clock.now)
    pool.report_failure(a, "upstream_status_error")
    assert not a.healthy(clock.now)
    assert _metric(pool, "gateway_worker_ejected", "a:1") == 1
    assert _metric(pool, "gateway_worker_ejections_total", "a:1") == 1
    clock.advance(1.01)
    assert a.healthy(clock.now)
    for _ in range(3):  # fails again soon after: the backoff doubles
        pool.report_failure(a, "timeout")
    clock.advance(1.5)
    assert not a.healthy(clock.now)
    clock.advance(0.6)
    assert a.healthy(clock.now)
    # A success resets the streak; a long healthy spell resets the backoff.
    pool.report_failure(a, "x")
    pool.report_success(a)
    pool.report_failure(a, "x")
    pool.report_failure(a, "x")
    assert a.healthy(clock.now)
    clock.advance(settings.eject_max_s + 1)
    pool.report_success(a)
    assert a.ejections == 0


def test_routing_policies() -> None:
    clock = FakeClock()
    settings = settings_for("http://a:1,http://b:2,http://c:3", affinity_slack_s=0.05)
    pool = _pool(settings, clock)
    for worker in pool.workers.values():
        worker.up = True
        worker.models = {MODEL}
        worker.cards = {MODEL: {"id": MODEL}}
    a, b, c = (pool.workers[k] for k in ("a:1", "b:2", "c:3"))
    router = Router(settings, pool, random.Random(7))
    # Predicted TTFT: the worker with the least prefill work ahead wins.
    a.prefill_tokens_ahead, b.prefill_tokens_ahead, c.prefill_tokens_ahead = 4000, 100, 2000
    assert router.choose(MODEL, 50).worker is b
    b.prefill_tokens_ahead = 9000
    assert router.choose(MODEL, 50).worker is c
    # A longer prompt is predicted to take longer on the same worker.
    assert router.predict(c, 1000)[0] > router.predict(c, 10)[0]
    # Affinity: a key sticks to one worker while it is not much slower than the best...
    for w in (a, b, c):
        w.prefill_tokens_ahead = 0
    pinned = {router.choose(MODEL, 50, key=RouteKey("session-1")).worker for _ in range(10)}
    assert len(pinned) == 1
    (home,) = pinned
    # ...and falls back when its worker is overloaded.
    home.prefill_tokens_ahead = 50_000
    assert router.choose(MODEL, 50, key=RouteKey("session-1")).worker is not home
    # Exclusion (failover) and unknown models.
    assert router.choose(MODEL, 50, exclude=frozenset({"a:1", "b:2"})).worker is c
    with pytest.raises(ModelNotFound, match="does not exist"):
        router.choose("nope", 10)
    # Round robin visits each worker in turn.
    rr = Router(settings_for("http://a:1,http://b:2,http://c:3", routing="round_robin"), pool)
    assert {rr.choose(MODEL, 1).worker.label for _ in range(3)} == {"a:1", "b:2", "c:3"}
    # Least outstanding never picks the busiest of two.
    lo = Router(settings_for("http://a:1,http://b:2", routing="least_outstanding"), pool)
    a.in_flight, b.in_flight, c.in_flight = 5, 1, 9
    picks = {lo.choose(MODEL, 1).worker.label for _ in range(30)}
    assert "c:3" not in picks


def test_near_equal_predictions_go_to_the_least_loaded_worker() -> None:
    """A worker that learnt a fast prefill (its prefix cache hit) does not take all traffic."""
    clock = FakeClock()
    settings = settings_for("http://a:1,http://b:2")
    pool = _pool(settings, clock)
    a, b = pool.workers["a:1"], pool.workers["b:2"]
    for worker in (a, b):
        worker.up = True
        worker.models = {MODEL}
    router = Router(settings, pool, random.Random(3))
    for _ in range(50):  # a's first answers came from its prefix cache: 20 ms whatever the work
        a.latency.observe_ttft(800.0, 0.02)
    assert router.rank(a, 700) + 0.1 < router.rank(b, 700) < router.rank(a, 700) + 0.25
    a.in_flight = 1
    assert router.choose(MODEL, 700).worker is b  # within the 0.25-s slack: less loaded wins
    b.in_flight = 5
    assert router.choose(MODEL, 700).worker is a
    # A real difference (a prefill queue) still decides, whatever the load.
    a.in_flight, b.in_flight = 30, 0
    b.prefill_tokens_ahead = 20_000
    assert router.rank(b, 700) > router.rank(a, 700) + 0.25
    assert router.choose(MODEL, 700).worker is a


def test_stale_load_counts_as_busy() -> None:
    clock = FakeClock()
    settings = settings_for("http://a:1,http://b:2")
    pool = _pool(settings, clock)
    router = Router(settings, pool)
    a, b = pool.workers["a:1"], pool.workers["b:2"]
    for worker in (a, b):
        worker.up = True
        worker.models = {MODEL}
    from app.fleet.loadsignals import LoadSample

    a.load = LoadSample(running=0, waiting=0, kv_cache_usage=0.1, at=clock.now)
    b.load = LoadSample(running=0, waiting=0, kv_cache_usage=0.1, at=clock.now - 60)
    assert router.rank(b, 10) > router.rank(a, 10) + 1.0
    assert {router.choose(MODEL, 10).worker.label for _ in range(20)} == {"a:1"}
    # Admission still gets a finite prediction for the stale worker (the gateway's own counts),
    # so a worker whose /metrics cannot be read keeps serving when it is the only one.
    assert router.predict(b, 10)[0] == router.predict(a, 10)[0]
    assert router.choose(MODEL, 10, exclude=frozenset({"a:1"})).predicted_ttft_s < 1.0


async def test_dns_discovery_adds_and_drains_workers() -> None:
    clock = FakeClock()
    resolver = FakeResolver("10.0.0.1", "10.0.0.2")
    settings = Settings.model_validate(
        {"workers": [], "worker_dns": "vllm-workers.ns.svc:8000", "access_log": False}
    )
    pool = _pool(settings, clock, resolver)
    await pool.rediscover()
    assert sorted(pool.workers) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert pool.workers["10.0.0.1:8000"].spec.base_url == "http://10.0.0.1:8000"
    gone = pool.workers["10.0.0.1:8000"]
    gone.in_flight = 1
    resolver.addresses = ["10.0.0.2"]
    await pool.rediscover()
    assert gone.draining  # still finishing its stream, but takes no new ones
    assert not gone.healthy(clock.now)
    resolver.addresses = ["fail"]  # a DNS failure keeps the current workers
    await pool.rediscover()
    assert "10.0.0.1:8000" in pool.workers
    resolver.addresses = ["10.0.0.2", "10.0.0.3"]
    gone.in_flight = 0
    await pool.rediscover()
    assert sorted(pool.workers) == ["10.0.0.2:8000", "10.0.0.3:8000"]
    assert _metric(pool, "gateway_worker_up", "10.0.0.1:8000") is None


async def test_a_models_series_are_exported_at_zero_once_a_worker_serves_it() -> None:
    # Prometheus's rate() sees only increases between two scrapes: a model's series that
    # first appeared with its first burst of requests would show no rate for that burst.
    settings = settings_for("http://a:1")
    models = httpx.Response(200, json={"object": "list", "data": [{"id": "m1"}]})
    client = WireClient(1.0, connector=bridge(httpx.MockTransport(lambda r: models)))
    pool = WorkerPool(settings, client, GatewayMetrics(settings), FakeClock(), FakeResolver())
    await pool.rediscover()
    sample = pool.metrics.registry.get_sample_value
    interactive = {"model": "m1", "tier": "interactive"}
    assert sample("gateway_time_to_first_token_seconds_count", interactive) is None
    await pool.probe_models(next(iter(pool.workers.values())))
    for tier in settings.tiers:
        labels = {"model": "m1", "tier": tier.name}
        for histogram in ("time_to_first_token", "time_per_output_token", "queue_time"):
            assert sample(f"gateway_{histogram}_seconds_count", labels) == 0
            assert sample(f"gateway_{histogram}_seconds_bucket", {**labels, "le": "+Inf"}) == 0
        assert sample("gateway_goodput_tokens_total", labels) == 0
        assert sample("gateway_completion_tokens_total", labels) == 0
        for result in ("met", "missed_ttft", "missed_tpot", "missed_both", "rejected", "errored"):
            assert sample("gateway_slo_requests_total", {**labels, "result": result}) == 0
        for endpoint in ("chat", "completions"):
            done = {**labels, "endpoint": endpoint, "status_class": "2xx", "outcome": "ok"}
            assert sample("gateway_requests_total", done) == 0
    assert sample("gateway_overhead_seconds_count", {"model": "m1"}) == 0
    client.close()


async def _ok(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=tokens(3))


async def _fail500(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
    return httpx.Response(500, json={"error": {"message": "engine dead", "code": 500}})


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            **extra}  # fmt: skip


async def _stream(client: httpx.AsyncClient, **extra: Any) -> tuple[int, bytes]:
    async with client.stream("POST", "/v1/chat/completions", json=_chat(**extra)) as r:
        return r.status_code, await r.aread()


async def test_failover_before_first_byte_and_ejection() -> None:
    bad, good = FakeWorker(_fail500), FakeWorker(_ok)
    transport = fleet({"bad:1": bad, "good:2": good})
    settings = settings_for("http://bad:1,http://good:2", routing="round_robin")
    async with running_gateway(settings, transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            results = [await _stream(client) for _ in range(6)]
            metrics = (await client.get("/metrics")).text
    assert all(status == 200 and body.endswith(b"data: [DONE]\n\n") for status, body in results)
    assert 1 <= len(bad.requests) <= 3  # ejected after 3 failures: no more traffic
    assert len(good.requests) == 6
    assert f'gateway_worker_failovers_total{{worker="bad:1"}} {len(bad.requests)}.0' in metrics
    assert 'gateway_worker_ejected{worker="bad:1"} 1.0' in metrics
    assert 'gateway_worker_up{worker="good:2"} 1.0' in metrics


async def test_no_failover_for_worker_4xx_or_after_bytes_were_sent() -> None:
    async def refuse(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "prompt too long", "code": 400}})

    async def die(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        async def events() -> Any:
            yield chunk(None, role=True)
            yield chunk(" a")
            raise httpx.ReadError("connection reset")

        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=events())  # fmt: skip

    for handler, check in ((refuse, b"prompt too long"), (die, b"upstream_invalid_response")):
        first, second = FakeWorker(handler), FakeWorker(_ok)
        transport = fleet({"first:1": first, "second:2": second})
        settings = settings_for("http://first:1,http://second:2", routing="round_robin")
        async with running_gateway(settings, transport) as url:
            async with httpx.AsyncClient(base_url=url) as client:
                statuses = []
                for _ in range(2):
                    status, body = await _stream(client)
                    statuses.append(status)
                    if check in body:
                        break
        assert check in body
        assert len(first.requests) == 1
        assert len(second.requests) <= 1  # only its own turn, never a retry


async def test_requests_only_reach_workers_serving_their_model() -> None:
    other = FakeWorker(_ok)

    async def models_other(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "other-model"}]})
        return await other.handle(request)

    mine = FakeWorker(_ok)

    async def route(request: httpx.Request) -> httpx.Response:
        if request.url.host == "x":
            return await models_other(request)
        return await mine.handle(request)

    settings = settings_for("http://x:1,http://y:2")
    async with running_gateway(settings, httpx.MockTransport(route)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            ids = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
            for _ in range(4):
                assert (await _stream(client))[0] == 200
    assert ids == [MODEL, "other-model"]
    assert len(mine.requests) == 4
    assert other.requests == []
    assert json.loads(json.dumps(ids))


def _histogram_sum(metrics: str, name: str) -> float:
    line = next(x for x in metrics.splitlines() if x.startswith(f"{name}_sum{{"))
    return float(line.rsplit(" ", 1)[1])


async def test_failover_time_is_its_own_not_queue_time_or_overhead() -> None:
    async def slow_500(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        await asyncio.sleep(1.0)
        return await _fail500(request, body)

    bad, good = FakeWorker(slow_500), FakeWorker(_ok)
    transport = fleet({"bad:1": bad, "good:2": good})
    settings = settings_for("http://bad:1,http://good:2", routing="round_robin")
    async with running_gateway(settings, transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            status, _ = await _stream(client)
            metrics = (await client.get("/metrics")).text
    assert status == 200
    assert len(bad.requests) == 1
    assert _histogram_sum(metrics, "gateway_failover_seconds") == pytest.approx(1.0, abs=0.3)
    assert _histogram_sum(metrics, "gateway_overhead_seconds") < 0.2
    assert _histogram_sum(metrics, "gateway_queue_time_seconds") < 0.2


async def test_the_first_token_timeout_runs_from_arrival_across_attempts() -> None:
    async def slow_500(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        await asyncio.sleep(0.7)
        return await _fail500(request, body)

    async def hang(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        await asyncio.sleep(10)
        return await _ok(request, body)

    transport = fleet({"bad:1": FakeWorker(slow_500), "hung:2": FakeWorker(hang)})
    settings = settings_for(
        "http://bad:1,http://hung:2", routing="round_robin", first_token_timeout_s=1.0
    )
    async with running_gateway(settings, transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            started = asyncio.get_running_loop().time()
            status, body = await _stream(client)
            took = asyncio.get_running_loop().time() - started
    assert status == 504
    assert json.loads(body)["error"]["code"] == "upstream_timeout"
    assert took == pytest.approx(1.0, abs=0.25)  # not 0.7 + 1.0 s


def _one_worker(clock: FakeClock, **overrides: Any) -> tuple[WorkerPool, Worker]:
    """A pool of one worker, up, ejected after 3 failures."""
    pool = _pool(settings_for("http://a:1", eject_after_failures=3, **overrides), clock)
    a = pool.workers["a:1"]
    a.up = True
    return pool, a


def test_requests_sent_before_an_ejection_do_not_eject_the_worker_again() -> None:
    # Thousands in flight fail of one fault: one ejection, at the first backoff.
    clock = FakeClock()
    pool, a = _one_worker(clock, eject_base_s=1.0)
    sent = clock.now
    clock.advance(2.0)  # they time out together
    for _ in range(3 * 1100):
        pool.report_failure(a, "no_worker", sent)
    assert a.ejections == 1
    assert a.ejected_until == pytest.approx(clock.now + 1.0)
    clock.advance(1.5)  # back, and the stragglers of the burst still do not count
    pool.report_failure(a, "no_worker", sent)
    assert a.failures == 0
    assert a.healthy(clock.now)
    for _ in range(3):  # requests sent after the ejection do
        pool.report_failure(a, "no_worker", clock.now)
    assert a.ejections == 2
    assert not a.healthy(clock.now)


def test_thousands_of_ejections_keep_the_backoff_at_its_longest() -> None:
    clock = FakeClock()
    pool, a = _one_worker(clock, eject_max_s=30.0)
    for _ in range(3 * 1100):
        clock.advance(0.001)
        pool.report_failure(a, "no_worker", clock.now)
    assert a.ejected_until == pytest.approx(clock.now + 30.0)


def _stalled_connect(stall_s: float) -> Connector:
    """A network whose connects block the event loop for ``stall_s`` and then never complete.

    As a long pause of a busy gateway's loop looks: the connect's timeout is due while the loop
    is stuck, and it fires (late) once the loop runs again, before anything else it had waiting.
    """

    async def stalls(
        factory: ProtocolFactory, host: str, port: int, tls: ssl.SSLContext | None
    ) -> tuple[asyncio.BaseTransport, asyncio.Protocol]:
        time.sleep(stall_s)  # noqa: ASYNC251 - the point: nothing else may run meanwhile
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return stalls


@pytest.mark.parametrize(("stall_s", "stays_up"), [(1.4, True), (0.0, False)])
async def test_a_probe_that_timed_out_late_of_the_gateways_busy_loop_keeps_the_worker_up(
    stall_s: float, stays_up: bool
) -> None:
    settings = settings_for("http://a:1", connect_timeout_s=1.0)
    wire = WireClient(settings.connect_timeout_s, connector=_stalled_connect(stall_s))
    pool = WorkerPool(settings, wire, GatewayMetrics(settings), FakeClock(), FakeResolver())
    a = pool.workers["a:1"]
    a.up, a.cards = True, {MODEL: {"id": MODEL}}
    await pool.probe_health(a)
    assert a.up is stays_up


@pytest.mark.parametrize(("stall_s", "code", "ejected"), [
    (1.4, "gateway_saturated", 0.0), (0.0, "no_worker", 1.0),
])  # fmt: skip
async def test_a_connect_the_gateways_busy_loop_let_time_out_is_its_own(
    stall_s: float, code: str, ejected: float
) -> None:
    # The relay's connect blocks the loop, as a busy gateway's does, then never completes.
    stalls = _stalled_connect(stall_s)
    worker = FakeWorker(lambda r, b: asyncio.sleep(0))  # type: ignore[arg-type,return-value]
    settings = settings_for("http://w:1", connect_timeout_s=1.0, eject_after_failures=1)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with (
        running_gateway(settings, worker.transport, stalls) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        r = await client.post("/v1/chat/completions", json=body)
        metrics = (await client.get("/metrics")).text
    assert r.status_code == 503
    assert r.json()["error"]["code"] == code
    saturated = 1.0 if code == "gateway_saturated" else 0.0
    assert ("retry-after" in r.headers) is bool(saturated)
    assert f'gateway_saturated_total{{resource="event_loop"}} {saturated}' in metrics
    assert f'gateway_worker_ejections_total{{worker="w:1"}} {ejected}' in metrics

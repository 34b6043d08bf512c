"""Below saturation admission changes nothing; at saturation it acts on the worker's own word.

Fake clock, no network: the worker's load is set as a scrape would set it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.admission.limits import Limits
from app.admission.ticket import Ticket
from app.api.errors import Overloaded, QueueTimeout, Shed
from app.api.outcome import LimitCut, Outcome, SloResult
from app.fleet.lease import Lease
from app.fleet.limiter import ConcurrencyLimit
from app.fleet.loadsignals import LoadSample, held_back, parse_load
from app.fleet.prefix import BLOCK_CHARS, PromptPrefix
from app.fleet.routing import RouteKey
from app.fleet.wire import WireClient
from app.fleet.workers import Worker, WorkerPool
from app.observe.goodput import judge
from app.observe.looplag import LoopLagProbe
from app.observe.metrics import GatewayMetrics
from app.observe.timing import TimingSummary
from app.settings import TierSpec
from tests.conftest import FakeClock
from tests.fake_upstream import MODEL
from tests.servers import settings_for
from tests.test_admission import NoDns, _controller, _decisions, _ticket, _tier
from tests.wire_bridge import bridge

SAMPLES = Path(__file__).parent / "data" / "vllm_samples"


def test_the_workers_capacity_signals_are_read_from_its_metrics_page() -> None:
    sample = parse_load((SAMPLES / "metrics_busy.txt").read_text(), at=1.0)
    assert sample.running == 1
    assert sample.waiting == 0
    assert sample.capacity_waiting == 0
    # cache_config_info's kv_cache_size_tokens: 16384 blocks of 128 tokens.
    assert sample.kv_tokens == 16384 * 128


def _reference_load(text: str) -> dict[str, float]:
    """The sums parse_load makes, from prometheus-client's own parser (the reference)."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:num_requests_waiting_by_reason":
                if sample.labels.get("reason") != "capacity":
                    continue
            elif sample.name == "vllm:cache_config_info":
                sums["kv_tokens"] = sums.get("kv_tokens", 0.0) + float(
                    sample.labels["kv_cache_size_tokens"]
                )
                sums["block_size"] = float(sample.labels["block_size"])
                continue
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def test_the_load_read_from_a_page_is_what_prometheus_clients_parser_reads() -> None:
    # Two engines (data-parallel ranks), a label value with escapes, a timestamp, the first
    # line a sample, and a series whose name starts like a read one's.
    page = (
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        "# HELP vllm:num_requests_waiting Waiting.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m \\"x\\" \\\\ y"} 2.0 1700000000000\n'
        'vllm:num_requests_waiting{engine="1",model_name="m \\"x\\" \\\\ y"} 5.0\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="1",model_name="m"} 4.0\n'
        "# TYPE vllm:num_requests_waiting_by_reason gauge\n"
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 1.0\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="deferred"} 7.0\n'
        'vllm:num_requests_waiting_by_reason{engine="1",reason="capacity"} 2.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.75\n'
        "# TYPE vllm:generation_tokens counter\n"
        'vllm:generation_tokens_total{engine="0"} 100.0\n'
        'vllm:generation_tokens_created{engine="0"} 1.7e+09\n'
        'vllm:generation_tokens_total{engine="1"} 50.0\n'
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="1024"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",kv_cache_size_tokens="2048"} 1.0\n'
    )
    for text in (page, (SAMPLES / "metrics_busy.txt").read_text()):
        sample, reference = parse_load(text, at=1.0), _reference_load(text)
        assert sample.running == reference["vllm:num_requests_running"]
        assert sample.waiting == reference["vllm:num_requests_waiting"]
        assert sample.capacity_waiting == reference["vllm:num_requests_waiting_by_reason"]
        assert sample.generated == reference["vllm:generation_tokens_total"]
        assert sample.kv_tokens == reference["kv_tokens"]
        assert sample.block_size == reference["block_size"]
    sample = parse_load(page, at=1.0)
    assert (sample.running, sample.waiting, sample.capacity_waiting) == (7, 7, 3)
    assert (sample.kv_cache_usage, sample.generated, sample.kv_tokens) == (0.75, 150, 3072)
    with pytest.raises(ValueError, match="num_requests_running"):
        parse_load("# TYPE vllm:num_requests_running gauge\n", at=1.0)
    with pytest.raises(ValueError, match="could not convert"):
        parse_load("vllm:num_requests_running 1.0\nvllm:num_requests_waiting many\n", at=1.0)


async def test_a_cold_burst_of_64_on_an_idle_worker_is_all_admitted_at_once() -> None:
    clock = FakeClock()
    admission, pool, metrics, settings = _controller(clock)
    tiers = ("interactive", "standard", "batch")
    results = await asyncio.gather(
        *(admission.admit(_ticket(settings, clock, tiers[i % 3], 300)) for i in range(64))
    )
    assert [waited for _, waited in results] == [0.0] * 64
    assert pool.workers["a:1"].in_flight == 64
    for tier in tiers:
        assert _decisions(metrics, tier, "queued") == 0
        assert _decisions(metrics, tier, "rejected") == 0


async def test_sequential_traffic_teaches_no_limit_that_turns_away_the_next_burst() -> None:
    clock = FakeClock()
    admission, pool, metrics, settings = _controller(clock)
    worker = pool.workers["a:1"]
    for _ in range(64):  # one at a time: 20 ms to the first token, 32 tokens at 10 ms
        lease, waited = await admission.admit(_ticket(settings, clock, "standard", 300))
        assert waited == 0.0
        clock.advance(0.02)
        lease.first_output(clock.now)
        clock.advance(0.31)
        lease.release(clock.now)
        admission.limits.learn(worker, 0.01, clock.now, lease.decode_load)
        admission.limits.first_token(worker, 0.02, 1, clock.now)
        admission.completed("standard", 0.33, 0.31, 31)
        clock.advance(0.01)
    assert admission.limits.cap(worker) >= 64
    results = await asyncio.gather(
        *(admission.admit(_ticket(settings, clock, "standard", 300)) for _ in range(32))
    )
    assert [waited for _, waited in results] == [0.0] * 32
    assert _decisions(metrics, "standard", "rejected") == 0
    assert _decisions(metrics, "standard", "queued") == 0


async def test_a_saturated_worker_queues_lower_tiers_and_sheds_them_with_reasons() -> None:
    clock = FakeClock()
    admission, pool, metrics, settings = _controller(clock, max_queue_length=2)
    worker = pool.workers["a:1"]
    # The worker holds 5 requests back for capacity, and its first tokens come late.
    for at, generated in ((-0.5, 100), (0.0, 110)):  # two pages, a step between, 5 held back
        worker.saw_load(LoadSample(10, 5, 0.3, clock.now + at, 5, generated=generated), 0, 1.0, 0.8)
    for _ in range(50):
        worker.recent_ttft.observe(0.7, clock.now)
    batch = asyncio.create_task(admission.admit(_ticket(settings, clock, "batch")))
    standard = asyncio.create_task(admission.admit(_ticket(settings, clock, "standard")))
    await asyncio.sleep(0)
    assert not batch.done()
    assert not standard.done()
    # The queue is full: an interactive request takes the sheddable batch request's place.
    interactive = asyncio.create_task(admission.admit(_ticket(settings, clock, "interactive")))
    await asyncio.sleep(0)
    with pytest.raises(Shed) as shed:
        await batch
    assert shed.value.code == "shed"
    assert _decisions(metrics, "batch", "shed", "shed") == 1
    # Nothing sheddable is left: the next standard request is told at once why.
    with pytest.raises(Overloaded) as full:
        await admission.admit(_ticket(settings, clock, "standard"))
    assert full.value.code == "queue_full"
    assert _decisions(metrics, "standard", "rejected", "queue_full") == 1
    # Its deadline leaves 0.7 s for the first token: the interactive request expires.
    clock.advance(0.31)
    admission.dispatch()
    with pytest.raises(QueueTimeout) as expired:
        await interactive
    assert expired.value.code == "queue_timeout"
    assert _decisions(metrics, "interactive", "expired", "queue_timeout") == 1
    # The worker stops holding requests back; interactive was short of capacity 2 s ago, so
    # lower tiers have let it go first until now: the standard request runs.
    clock.advance(2.0)
    worker.saw_load(LoadSample(4, 0, 0.1, clock.now, capacity_waiting=0), 0, 1.0, 0.8)
    admission.dispatch()
    lease, waited = await standard
    assert lease.worker is worker
    assert waited == pytest.approx(2.31)


async def test_a_prompt_too_long_for_its_tier_is_refused_with_that_reason() -> None:
    clock = FakeClock()
    admission, _, metrics, settings = _controller(clock)
    with pytest.raises(Overloaded) as caught:
        await admission.admit(_ticket(settings, clock, "interactive", 50_000))
    assert caught.value.code == "prompt_too_long"
    assert _decisions(metrics, "interactive", "rejected", "prompt_too_long") == 1


async def test_a_prompt_an_idle_worker_would_serve_in_time_is_not_refused_after_load() -> None:
    clock = FakeClock()
    admission, pool, metrics, settings = _controller(clock)
    prefill = pool.workers["a:1"].latency.prefill
    # Under load each first token also waited 0.6 s of decode steps and queueing: the line
    # learnt carries that in its intercept.
    for _ in range(200):
        for work in (500.0, 1500.0, 3000.0):
            prefill.observe(work, 0.6 + 0.0006 * work)
    assert prefill.predict(900) > 1.0
    lease, waited = await admission.admit(_ticket(settings, clock, "interactive", 900))
    assert waited == 0.0
    assert _decisions(metrics, "interactive", "rejected") == 0
    lease.release(clock.now)
    with pytest.raises(Overloaded) as caught:
        await admission.admit(_ticket(settings, clock, "interactive", 2_000))
    assert caught.value.code == "prompt_too_long"


async def test_a_prompt_is_judged_too_long_by_what_the_worker_has_not_cached() -> None:
    clock = FakeClock()
    admission, pool, metrics, settings = _controller(clock)
    worker = pool.workers["a:1"]
    for _ in range(200):  # 2 ms a token not cached, as routing records the work
        for work in (100.0, 300.0, 600.0):
            worker.latency.prefill.observe(work, 0.002 * work)
    shared = list(range(7))  # a system prompt of 7 blocks, then 3 of the user's own
    first = RouteKey(prefix=PromptPrefix([*shared, 100, 101, 102], 10 * BLOCK_CHARS))
    second = RouteKey(prefix=PromptPrefix([*shared, 200, 201, 202], 10 * BLOCK_CHARS))
    interactive = _tier(settings, "interactive")
    # 800 tokens at 2 ms: 1.6 s, over the 1 s target, with nothing cached.
    with pytest.raises(Overloaded) as caught:
        await admission.admit(Ticket(interactive, MODEL, 800, first, clock.now))
    assert caught.value.code == "prompt_too_long"
    lease, _ = await admission.admit(Ticket(_tier(settings, "batch"), MODEL, 800, first, clock.now))
    lease.release(clock.now)
    # The worker holds the shared 7 blocks now: 240 tokens to prefill, 0.48 s.
    lease, waited = await admission.admit(Ticket(interactive, MODEL, 800, second, clock.now))
    assert waited == 0.0
    assert lease.worker is worker
    assert _decisions(metrics, "interactive", "rejected", "prompt_too_long") == 1


async def test_other_replicas_requests_and_the_kv_cache_count_against_the_limit() -> None:
    clock = FakeClock()
    admission, pool, _, settings = _controller(clock)
    worker = pool.workers["a:1"]
    worker.limit.value = 24
    # Scraped with 4 of ours in flight: 30 running, so 26 are other replicas'. Ours dispatched
    # since (the credit) are in in_flight already.
    worker.own_at_scrape = 4
    worker.load = LoadSample(30, 0, 0.2, clock.now)
    interactive = _tier(settings, "interactive")
    assert admission.limits.occupied(worker, clock.now) == 26
    assert admission.room.full(worker, interactive)
    worker.load = LoadSample(14, 0, 0.2, clock.now)  # 10 of others'
    assert not admission.room.full(worker, interactive)
    # Stale figures say nothing of others: only our own count.
    clock.advance(settings.load_max_age_s + 0.1)
    assert admission.limits.occupied(worker, clock.now) == 0
    # A KV cache of 20,000 tokens holds 20 requests of 1,000 tokens: that caps the limit.
    worker.load = LoadSample(0, 0, 0.0, clock.now, kv_tokens=20_000)
    worker.context_tokens = 1_000
    assert admission.limits.cap(worker) == 20
    # A KV cache 80% full is saturated.
    worker.load = LoadSample(3, 0, 0.85, clock.now)
    assert admission.room.full(worker, interactive)


def _busy_page(running: int, capacity_waiting: int, generated: int) -> str:
    """The sample busy page with these figures."""
    page = (SAMPLES / "metrics_busy.txt").read_text()
    return (
        page.replace(
            'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 1.0',
            f'vllm:num_requests_running{{engine="0",model_name="tiny-llama"}} {running}.0',
        )
        .replace(
            'model_name="tiny-llama",reason="capacity"} 0.0',
            f'model_name="tiny-llama",reason="capacity"}} {capacity_waiting}.0',
        )
        .replace(
            'vllm:generation_tokens_total{engine="0",model_name="tiny-llama"} 18439.0',
            f'vllm:generation_tokens_total{{engine="0",model_name="tiny-llama"}} {generated}.0',
        )
    )


async def test_a_worker_holding_requests_back_for_capacity_sets_its_limit_to_what_it_runs() -> None:
    pages = [
        _busy_page(12, 3, 100),  # one page says little: a step's arrivals wait too
        _busy_page(12, 3, 100),  # no step ran since: still that step's arrivals
        _busy_page(12, 3, 112),  # a step ran, 3 still held back, no more running: full at 12
        _busy_page(12, 3, 124),  # the same: nothing more to cut
    ]
    settings = settings_for("http://a:1")
    clock = FakeClock()
    client = WireClient(
        1.0, connector=bridge(httpx.MockTransport(lambda r: httpx.Response(200, text=pages.pop(0))))
    )
    metrics = GatewayMetrics(settings)
    pool = WorkerPool(settings, client, metrics, clock, NoDns())
    worker = pool.workers["a:1"]
    limits = Limits(settings, metrics)
    assert worker.limit.limit == settings.max_running_per_worker
    await pool.scrape_load(worker)
    assert worker.load is not None
    assert (worker.load.capacity_waiting, worker.load.generated) == (3, 100)
    for _ in range(2):
        assert worker.limit.limit == settings.max_running_per_worker
        assert not limits.saturated(worker, clock.now)
        clock.advance(0.5)
        await pool.scrape_load(worker)
    assert worker.limit.limit == 12
    assert limits.saturated(worker, clock.now)
    assert _cuts(metrics, "worker_queueing") == 1
    clock.advance(0.5)
    await pool.scrape_load(worker)
    assert limits.saturated(worker, clock.now)
    assert _cuts(metrics, "worker_queueing") == 1
    client.close()


@pytest.mark.parametrize(
    ("before", "after", "held"),
    [
        ((12, 3, 100), (12, 3, 112), True),
        ((12, 3, 100), (11, 4, 112), True),  # running fell, still holding back: full
        ((8, 3, 100), (12, 2, 112), False),  # running grew: it is still taking them in
        ((12, 3, 100), (12, 3, 100), False),  # no step between: one long step's arrivals
        ((12, 0, 100), (12, 3, 112), False),  # a first sight of waiting
        ((12, 3, 100), (12, 0, 112), False),
    ],
)
def test_holding_back_is_seen_on_two_pages_with_a_step_between(
    before: tuple[int, int, int], after: tuple[int, int, int], held: bool
) -> None:
    first = parse_load(_busy_page(*before), 1.0)
    second = parse_load(_busy_page(*after), 1.5)
    assert held_back(first, second, 1.0, 12, 0.8) is held
    assert not held_back(None, second, 1.0, 12, 0.8)
    assert not held_back(second, second, 1.0, 12, 0.8)  # the same sample twice


def test_without_a_generated_count_two_pages_in_a_row_suffice() -> None:
    first = LoadSample(12, 3, 0.5, 1.0, capacity_waiting=3)
    assert held_back(first, LoadSample(12, 3, 0.5, 1.5, capacity_waiting=3), 1.0, 12, 0.8)
    assert not held_back(first, LoadSample(13, 3, 0.5, 1.5, capacity_waiting=3), 1.0, 13, 0.8)
    assert not held_back(
        LoadSample(12, 3, 0.5, 1.0), LoadSample(12, 3, 0.5, 1.5), 1.0, 12, 0.8
    )  # an engine that does not say why it waits


@pytest.mark.parametrize(
    ("running", "most", "kv", "held"),
    [
        (64, 64, 0.1, True),  # at the most it ever ran: its cap
        (52, 64, 0.1, True),  # sequences ended together this step: still near it
        (25, 45, 0.1, False),  # far under it: prompts wait for a step's token budget
        (25, 45, 0.85, True),  # its KV cache is full: that is its cap now
    ],
)
def test_holding_back_far_under_the_most_it_ran_is_a_step_budget_not_a_cap(
    running: int, most: int, kv: float, held: bool
) -> None:
    first = LoadSample(running, 3, kv, 1.0, capacity_waiting=3, generated=100)
    second = LoadSample(running, 3, kv, 1.5, capacity_waiting=3, generated=112)
    assert held_back(first, second, 1.0, most, 0.8) is held


async def test_a_worker_far_under_its_peak_keeps_its_limit_through_budget_waits() -> None:
    clock = FakeClock()
    pool = _controller(clock)[1]
    worker = pool.workers["a:1"]
    # It ran 45 at once; later, at 25, two pages show prompts waiting on a step's budget.
    worker.saw_load(LoadSample(45, 0, 0.1, clock.now - 2, 0, generated=50), 0, 1.0, 0.8)
    for at, generated in ((-0.5, 100), (0.0, 110)):
        sample = LoadSample(25, 4, 0.1, clock.now + at, 4, generated=generated)
        assert not worker.saw_load(sample, 0, 1.0, 0.8)
    assert worker.most_running == 45
    # Back at its peak, the same pages are its cap.
    for at, generated in ((0.5, 120), (1.0, 130)):
        sample = LoadSample(45, 4, 0.1, clock.now + at, 4, generated=generated)
        held = worker.saw_load(sample, 0, 1.0, 0.8)
    assert held


def test_goodput_counts_what_the_service_could_have_served() -> None:
    tier = TierSpec(name="t", priority=0, ttft_slo_s=1.0, tpot_slo_s=0.1, max_queue_wait_s=1.0)
    none = TimingSummary(None, None, None, None)
    late = TimingSummary(0.0, 1.5, 2.0, 0.05)
    quick = TimingSummary(0.0, 0.2, 0.5, 0.05)
    # A key over its own quota is the client's limit: not counted.
    assert judge(Outcome.RATE_LIMITED, tier, none, None, True, 0.0, None) is None
    assert judge(Outcome.REJECTED, tier, none, None, True, 0.0, None) is SloResult.REJECTED
    # A client that gave up: a miss once its TTFT target had passed, else not counted.
    cancelled = Outcome.CLIENT_CANCELLED
    assert judge(cancelled, tier, none, None, True, 0.5, None) is None
    assert judge(cancelled, tier, none, None, True, 1.2, None) is SloResult.MISSED_TTFT
    assert judge(cancelled, tier, late, None, True, 2.0, None) is SloResult.MISSED_TTFT
    assert judge(cancelled, tier, quick, None, True, 3.0, None) is None
    # Non-streamed: its budget is 1 s + 0.1 s x (max_tokens - 1).
    assert judge(cancelled, tier, none, None, False, 1.5, 11) is None
    assert judge(cancelled, tier, none, None, False, 2.5, 11) is SloResult.MISSED_E2E
    slow = TimingSummary(0.0, None, 2.5, None)
    assert judge(Outcome.OK, tier, slow, 11, False, 2.5, None) is SloResult.MISSED_E2E
    assert judge(Outcome.INVALID_REQUEST, tier, none, None, True, 0.0, None) is None


def test_a_lease_is_released_once_whatever_happens() -> None:
    clock = FakeClock()
    admission, pool, metrics, settings = _controller(clock)
    worker = pool.workers["a:1"]
    choice = admission.placer.choose(_ticket(settings, clock, "standard"), clock.now)
    assert choice is not None
    lease = Lease(choice, "standard", 10, clock.now, metrics)
    assert (worker.in_flight, worker.prefilling, worker.tier_in_flight["standard"]) == (1, 1, 1)
    assert lease.first_output(clock.now + 0.1)
    assert not lease.first_output(clock.now + 0.2)
    assert (worker.in_flight, worker.prefilling) == (1, 0)
    assert lease.release(clock.now + 1)
    assert not lease.release(clock.now + 2)
    assert (worker.in_flight, worker.prefilling, worker.tier_in_flight["standard"]) == (0, 0, 0)
    assert worker.prefill_tokens_ahead == 0


def test_the_learnt_decode_line_lowers_an_untested_limit_but_light_traffic_does_not() -> None:
    clock = FakeClock()
    admission, pool, _, _ = _controller(clock)
    limits, worker = admission.limits, pool.workers["a:1"]
    # Sequential traffic: every stream ran alone. Nothing is known of how TPOT grows.
    for _ in range(50):
        worker.latency.observe_tpot(1.0, 0.03)
        limits.learn(worker, 0.03, clock.now, 1.0)
        limits.first_token(worker, 0.02, 1, clock.now)
    assert limits.cap(worker) == 256
    # A worker whose pace does not depend on its batch (a fixed-timing worker): no bound.
    for load in range(1, 60):
        worker.latency.observe_tpot(float(load), 0.01)
        limits.learn(worker, 0.01, clock.now, float(load))
        limits.first_token(worker, 0.02, 1, clock.now)
    assert limits.cap(worker) == 256
    # Streams at 5-40 running, TPOT = 20 ms + 2 ms per running stream: 30 keep the 80 ms aim.
    admission, pool, _, _ = _controller(clock)
    limits, worker = admission.limits, pool.workers["a:1"]
    for _ in range(3):
        for load in range(5, 41, 5):
            tpot = 0.02 + 0.002 * load
            worker.latency.observe_tpot(float(load), tpot)
            limits.learn(worker, tpot, clock.now, float(load))
            limits.first_token(worker, 0.02, 1, clock.now)
    assert limits.cap(worker) == pytest.approx(30, abs=2)


def _learn_line(worker: Worker) -> None:
    """Streams at loads 5-40 taught ``worker`` TPOT = 20 ms + 2 ms per running stream."""
    for load in range(5, 41, 5):
        worker.latency.observe_tpot(float(load), 0.02 + 0.002 * load)


def _lined(clock: FakeClock) -> tuple[Limits, Worker, GatewayMetrics]:
    """A controller's limits, its worker with the line of :func:`_learn_line`, its metrics.

    At the 80 ms aim that line says 30 (29 with its prior).
    """
    admission, pool, metrics, _ = _controller(clock)
    worker = pool.workers["a:1"]
    _learn_line(worker)
    return admission.limits, worker, metrics


def _cuts(metrics: GatewayMetrics, cause: str) -> float:
    return sum(
        sample.value
        for metric in metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "gateway_worker_limit_cuts_total" and sample.labels["cause"] == cause
    )


def test_every_lowering_of_a_limit_is_counted_under_its_cause() -> None:
    clock = FakeClock()
    admission, pool, metrics, _ = _controller(clock)
    limits, worker = admission.limits, pool.workers["a:1"]
    worker.add_in_flight(20, clock.now)
    # Within the aim: nothing falls, nothing is counted.
    limits.learn(worker, 0.03, clock.now, 20.0)
    limits.first_token(worker, 0.05, 1, clock.now)
    assert sum(_cuts(metrics, c) for c in LimitCut) == 0
    # A finished stream over the 100 ms TPOT target.
    limits.learn(worker, 0.15, clock.now, 20.0)
    assert _cuts(metrics, "tpot_miss") == 1
    # The worker's running streams together slower than the target, a cooldown later and
    # once the load is under the first cut's limit.
    clock.advance(1.5)
    worker.add_in_flight(-15, clock.now)
    limits.paced(worker, 0.2, clock.now)
    assert _cuts(metrics, "decode_pace") == 1
    # The worker's own first token far over its 0.5 s share of the TTFT target.
    limits.first_token(worker, 2.0, 4, clock.now)
    assert _cuts(metrics, "ttft_miss") == 1
    # A decode line learnt over loads 5-40 (20 ms + 2 ms a stream) under a limit above 30.
    limits, worker, metrics = _lined(clock)
    limits.learn(worker, 0.03, clock.now, 5.0)
    assert _cuts(metrics, "decode_line") == 1
    assert limits.cap(worker) == pytest.approx(30, abs=2)
    assert sum(_cuts(metrics, c) for c in LimitCut) == 1


def test_a_pace_flat_just_over_the_aim_is_not_bounded_by_the_prior() -> None:
    clock = FakeClock()
    admission, pool, _, _ = _controller(clock)
    limits, worker = admission.limits, pool.workers["a:1"]
    # Streams that ran at 110-400 all at 81 ms, over the 80 ms aim and within the 100 ms
    # target: the line through the prior's 20 ms at loads 0 and 1 crosses the aim at about
    # their load, but the streams measured the worker there themselves.
    for i in range(30):
        load, tpot = 110.0 + 10 * i, 0.081
        worker.latency.observe_tpot(load, tpot)
        limits.learn(worker, tpot, clock.now, load)
        limits.first_token(worker, 0.02, 1, clock.now)
    assert limits.cap(worker) == 256


def test_the_limits_keep_the_targets_of_the_tiers_that_have_requests() -> None:
    clock = FakeClock()
    admission, pool, metrics, settings = _controller(clock)
    limits, worker = admission.limits, pool.workers["a:1"]
    standard, interactive = _tier(settings, "standard"), _tier(settings, "interactive")
    worker.add_in_flight(20, clock.now)
    # Before any request, the strictest tier's: interactive's 100 ms and 1 s.
    assert limits.targets(clock.now) == (0.1, 1.0)
    # Only standard requests (the tier of every request when no keys are set): 200 ms and
    # 5 s. Streams at 150 ms a token and a worker's first token in 2 s meet them.
    limits.arrived(standard, clock.now)
    assert limits.targets(clock.now) == (0.2, 5.0)
    limits.learn(worker, 0.15, clock.now, 20.0)
    limits.first_token(worker, 2.0, 4, clock.now)
    limits.paced(worker, 0.15, clock.now)
    assert sum(_cuts(metrics, c) for c in LimitCut) == 0
    assert limits.cap(worker) == 256
    # An interactive request comes: 150 ms a token misses its 100 ms target.
    clock.advance(1)
    limits.arrived(interactive, clock.now)
    limits.learn(worker, 0.15, clock.now, 20.0)
    assert _cuts(metrics, "tpot_miss") == 1
    assert limits.cap(worker) < 20
    # A minute without interactive requests: standard's targets again.
    clock.advance(59)
    assert limits.targets(clock.now) == (0.1, 1.0)
    clock.advance(1)
    limits.arrived(standard, clock.now)
    assert limits.targets(clock.now) == (0.2, 5.0)


def test_a_limit_below_the_learnt_decode_line_rises_to_it_once_its_cut_settled() -> None:
    clock = FakeClock()
    limits, worker, _ = _lined(clock)
    # A surge's miss cut the limit to 6; then light traffic, 2 running, 25 ms per token.
    worker.limit = ConcurrencyLimit(initial=256, maximum=256, settle_s=5.0)
    worker.limit.cut(6.7, clock.now)
    assert limits.cap(worker) == 6
    limits.learn(worker, 0.025, clock.now + 1, 2.0)
    limits.first_token(worker, 0.02, 1, clock.now + 1)
    assert limits.cap(worker) == 6  # the cut stands a while
    # Once it settled, the line says how many keep the aim: light traffic never runs at the
    # limit, and 2 x 80 / 25 ms projects only 6.
    limits.learn(worker, 0.025, clock.now + 5, 2.0)
    limits.first_token(worker, 0.02, 1, clock.now + 5)
    assert limits.cap(worker) == pytest.approx(30, abs=2)


def test_a_first_token_the_gateway_itself_read_late_does_not_cut_the_prefill_limit() -> None:
    clock = FakeClock()
    _, pool, metrics, settings = _controller(clock)
    worker = pool.workers["a:1"]
    probe = LoopLagProbe(metrics.loop_lag)
    limits = Limits(settings, metrics, probe)
    # The worker's share of the 1 s interactive TTFT target is 0.5 s.
    worker.prefill_limit = ConcurrencyLimit(initial=16, maximum=256)
    # The gateway's loop ran 100 ms late: four waits of it account for a first token 0.3 s
    # over the share, so the worker is not blamed for it.
    for lag in (0.02, 0.1, 0.05):
        probe.observe(lag)
    limits.first_token(worker, 0.8, 16, clock.now)
    assert limits.prefill_cap(worker) == 16
    # Not for one 0.7 s over: that much is the worker's.
    limits.first_token(worker, 1.2, 16, clock.now)
    assert limits.prefill_cap(worker) < 16
    # Once the loop keeps time again (the last four ticks on time), a late first token is the
    # worker's.
    worker.prefill_limit = ConcurrencyLimit(initial=16, maximum=256)
    for _ in range(4):
        probe.observe(0.0005)
    limits.first_token(worker, 0.8, 16, clock.now)
    assert limits.prefill_cap(worker) < 16


def test_the_decode_line_does_not_cut_below_a_load_a_stream_kept_the_aim_at() -> None:
    clock = FakeClock()
    # The line, learnt at a higher arrival rate (more prefill stalls): 30 at the 80 ms aim.
    limits, worker, metrics = _lined(clock)
    # Now a stream ran at 36 at 70 ms a token: the worker keeps the aim there, whatever the
    # line projects. The limit is not cut below the load it ran at.
    limits.learn(worker, 0.07, clock.now, 36.0)
    limits.first_token(worker, 0.2, 1, clock.now)
    assert _cuts(metrics, "decode_line") == 1
    assert limits.cap(worker) == 36
    # A stream from the lighter load of seconds before still meets the line: down to 30.
    limits.learn(worker, 0.05, clock.now, 12.0)
    limits.first_token(worker, 0.2, 1, clock.now)
    assert limits.cap(worker) == pytest.approx(30, abs=2)


def test_a_long_prompt_prefilled_alone_does_not_cut_the_prefill_limit() -> None:
    clock = FakeClock()
    admission, pool, metrics, _ = _controller(clock)
    limits, worker = admission.limits, pool.workers["a:1"]
    worker.prefill_limit = ConcurrencyLimit(initial=16, maximum=256)
    # The worker's share of the 1 s interactive TTFT target is 0.5 s. A prompt that alone
    # took 0.8 s to its first token is long; fewer prefills at once would not have sped it.
    limits.first_token(worker, 0.8, 1, clock.now)
    assert limits.prefill_cap(worker) == 16
    assert _cuts(metrics, "ttft_miss") == 0
    # Three prefilling together, one 0.8 s: the worker's prefill queue is too long.
    limits.first_token(worker, 0.8, 3, clock.now)
    assert limits.prefill_cap(worker) < 16
    assert _cuts(metrics, "ttft_miss") == 1


def test_once_a_miss_set_the_limit_the_decode_line_no_longer_lowers_it() -> None:
    clock = FakeClock()
    limits, worker, metrics = _lined(clock)
    # 60 running, a stream at 110 ms a token over the 100 ms target: cut by 10% to 54.
    worker.limit = ConcurrencyLimit(initial=256, maximum=256)
    worker.add_in_flight(60, clock.now)
    limits.learn(worker, 0.11, clock.now, 60.0)
    limits.first_token(worker, 0.2, 1, clock.now)
    assert limits.cap(worker) == 54
    assert _cuts(metrics, "tpot_miss") == 1
    # Streams from the lighter load of seconds before, within the aim: the line projects 30,
    # but nothing measured says 54 is too many. Only a measurement lowers a measured limit.
    clock.advance(2)
    limits.learn(worker, 0.03, clock.now, 12.0)
    limits.first_token(worker, 0.2, 1, clock.now)
    assert limits.cap(worker) == 54
    assert _cuts(metrics, "decode_line") == 0
    # The worker's live pace over the target is one.
    worker.add_in_flight(-6, clock.now)
    limits.paced(worker, 0.12, clock.now)
    assert limits.cap(worker) < 54
    assert _cuts(metrics, "decode_pace") == 1
    # So is the worker holding requests back; the line's own lowering is not.
    worker.limit = ConcurrencyLimit(initial=256, maximum=256)
    assert worker.limit.project(40, clock.now)
    assert not worker.limit.measured
    assert worker.limit.hold(35, clock.now)
    assert worker.limit.measured


def test_a_miss_cuts_from_the_load_it_was_measured_at_not_what_runs_as_it_ends() -> None:
    clock = FakeClock()
    admission, pool, metrics, _ = _controller(clock)
    limits, worker = admission.limits, pool.workers["a:1"]
    # A stream that decoded under a mean load of 20 at 110 ms a token, over the 100 ms
    # target, ends as the last of its batch: cut by 10% from 20, not from the 1 running.
    worker.limit = ConcurrencyLimit(initial=256, maximum=256)
    limits.learn(worker, 0.11, clock.now, 20.0)
    limits.first_token(worker, 0.2, 1, clock.now)
    assert limits.cap(worker) == 18
    # The worker's pace: 10 streams at 150 ms a token, read when 100 gaps (1.5 s) say it is
    # over the target, while the gateway counts one running (the others another replica's,
    # not yet scraped, or already ended). Cut from the 10 it measured.
    worker.limit = ConcurrencyLimit(initial=256, maximum=256)
    worker.add_in_flight(1, clock.now)
    worker.pace.gap(0.15, clock.now)
    readings = []
    for _ in range(10):
        clock.advance(0.15)
        readings += [worker.pace.gap(0.15, clock.now) for _ in range(10)]
    assert [r for r in readings if r is not None] == [pytest.approx(0.15)]
    assert worker.pace.load == pytest.approx(10)
    limits.paced(worker, 0.15, clock.now)
    assert limits.cap(worker) == 6  # 10 x 100 / 150 ms
    assert _cuts(metrics, "decode_pace") == 1


def test_a_stream_within_the_aim_lifts_the_limit_no_further_than_the_decode_line() -> None:
    clock = FakeClock()
    limits, worker, _ = _lined(clock)
    # A limit a miss set (the line no longer lowers it), settled since.
    worker.limit = ConcurrencyLimit(initial=20, maximum=256)
    assert worker.limit.cut(20, clock.now)
    clock.advance(6)
    # A stream at a mean load of 12, 20 ms a token: in proportion, 48 would keep the aim,
    # but the line, which has seen what more streams cost, says 29 (with its prior).
    limits.learn(worker, 0.02, clock.now, 12.0)
    limits.first_token(worker, 0.2, 1, clock.now)
    assert limits.cap(worker) == 29
    # A stream that kept the aim at 35 is a measurement: the limit rises past the line to it.
    limits.learn(worker, 0.07, clock.now, 35.0)
    limits.first_token(worker, 0.2, 1, clock.now)
    assert limits.cap(worker) == 35


async def test_a_slow_pace_window_cuts_only_when_the_streams_own_tpot_so_far_misses() -> None:
    clock = FakeClock()
    admission, pool, metrics, settings = _controller(clock)
    limits, worker = admission.limits, pool.workers["a:1"]
    leases = [
        (await admission.admit(_ticket(settings, clock, "interactive", 300)))[0] for _ in range(10)
    ]
    clock.advance(0.3)
    for lease in leases:
        lease.first_output(clock.now)

    def decode(gaps: int, gap: float) -> None:
        for _ in range(gaps):
            clock.advance(gap)
            for lease in leases:
                lease.output_gap(gap, clock.now)

    # 3 s at 50 ms a token, then a 1.2-s prefill stall at 300 ms: a window over the 100 ms
    # target, while each stream stands at 4.2 s over 64 tokens (66 ms) on its own TPOT.
    decode(60, 0.05)
    decode(4, 0.3)
    assert worker.pace.so_far(clock.now) == pytest.approx(4.2 / 64)
    limits.paced(worker, 0.3, clock.now)
    assert _cuts(metrics, "decode_pace") == 0
    assert limits.cap(worker) == 256
    # The same stall on streams that have just begun: their TPOT so far (240 ms) misses.
    for lease in leases:
        lease.release(clock.now)
    assert worker.pace.so_far(clock.now) is None
    leases = [
        (await admission.admit(_ticket(settings, clock, "interactive", 300)))[0] for _ in range(10)
    ]
    clock.advance(0.3)
    for lease in leases:
        lease.first_output(clock.now)
    decode(1, 0.05)
    decode(4, 0.3)
    assert worker.pace.so_far(clock.now) == pytest.approx(1.25 / 5)
    limits.paced(worker, 0.3, clock.now)
    assert _cuts(metrics, "decode_pace") == 1
    assert limits.cap(worker) == 5  # 10 running x 100 / 300 ms, at most halved


def test_a_worker_holding_back_is_limited_to_the_most_it_ran_so_in_the_last_seconds() -> None:
    limit = ConcurrencyLimit(initial=256, maximum=256, settle_s=5.0)
    assert limit.hold(64, 0.0)
    assert limit.limit == 64
    # A page read as several sequences ended in one step: 58 running, still holding back.
    # It ran 64 so five seconds ago: that is still what it can run.
    assert not limit.hold(58, 5.0)
    assert limit.limit == 64
    limit.lift(512, 9.0)
    assert limit.limit == 64
    # Ten seconds on, only lower readings stand (its cache filled, say): the limit follows.
    assert limit.hold(40, 14.0)
    assert limit.limit == 58
    assert limit.hold(40, 15.5)
    assert limit.limit == 40


async def test_the_limit_a_worker_holding_back_sets_is_the_larger_of_the_two_pages() -> None:
    pages = [_busy_page(12, 3, 100), _busy_page(10, 5, 112)]
    settings = settings_for("http://a:1")
    clock = FakeClock()
    client = WireClient(
        1.0, connector=bridge(httpx.MockTransport(lambda r: httpx.Response(200, text=pages.pop(0))))
    )
    pool = WorkerPool(settings, client, GatewayMetrics(settings), clock, NoDns())
    worker = pool.workers["a:1"]
    await pool.scrape_load(worker)
    clock.advance(0.5)
    await pool.scrape_load(worker)
    # Both pages held requests back; it ran 12 at the first: 10 was a step's dip.
    assert worker.limit.limit == 12
    client.close()


def test_a_projection_lifts_a_limit_no_higher_than_the_worker_ran_while_holding_back() -> None:
    limit = ConcurrencyLimit(initial=256, maximum=256, settle_s=5.0)
    # The worker held requests back running 64 (its max_num_seqs): the limit is 64.
    assert limit.hold(64, 0.0)
    assert limit.limit == 64
    # Streams well within the aim project 8x that; settled or not, 64 is what it runs.
    limit.lift(512, 6.0)
    assert limit.limit == 64
    # Streams within the aim at the limit still grow it (the cap may have grown), but past
    # what it ran while holding back by one per limit's worth of them, not one each.
    results = next(
        n for n in range(1, 200) if limit.on_result(0.1, 0.8, 1.0, 64, 9.0) or limit.limit > 64
    )
    assert limit.limit == 65
    assert 60 <= results <= 70
    # Over ten seconds after the hold, with none since: one each again.
    limit.on_result(0.1, 0.8, 1.0, 65, 10.5)
    assert limit.limit == 66
    # Holding back at 70 later: projections may lift to 70 (but not yet: held at 66 first).
    assert not limit.hold(70, 12.0)
    limit.lift(512, 20.0)
    assert limit.limit == 70
    # Reset (the evidence no longer holds): projections are bounded by the maximum only.
    limit.reset()
    assert limit.cut(100, 30.0)
    assert limit.limit == 90
    limit.lift(200, 40.0)
    assert limit.limit == 200

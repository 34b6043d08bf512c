"""What the gateway exports for alerts and dashboards, and its fail-closed keys file.

SLO objectives per tier, a live goodput gauge that cannot go stale, worker counts that exist at
zero, the peak figures MFU and MBU are measured against.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from app.admission.auth import Authenticator
from app.api.outcome import SloResult
from app.fleet.wire import WireClient
from app.fleet.workers import WorkerPool
from app.observe.goodput import GoodputTracker
from app.observe.metrics import GatewayMetrics, Labelled
from app.settings import Settings
from tests.conftest import FakeClock
from tests.fake_upstream import MODEL
from tests.servers import settings_for
from tests.test_pool import FakeResolver


def test_each_tiers_objective_is_exported() -> None:
    settings = settings_for("http://a:1")
    metrics = GatewayMetrics(settings)
    GoodputTracker(metrics, settings.tiers, FakeClock())
    sample = metrics.registry.get_sample_value
    assert sample("gateway_slo_objective", {"tier": "interactive"}) == 0.995
    assert sample("gateway_slo_objective", {"tier": "standard"}) == 0.995
    assert sample("gateway_slo_objective", {"tier": "batch"}) == 0.95
    tiers = [{"name": "gold", "priority": 0, "ttft_slo_s": 1, "max_queue_wait_s": 1,
              "objective": 0.999}]  # fmt: skip
    custom = settings_for("http://a:1", tiers=tiers, default_tier="gold")
    metrics = GatewayMetrics(custom)
    GoodputTracker(metrics, custom.tiers, FakeClock())
    assert metrics.registry.get_sample_value("gateway_slo_objective", {"tier": "gold"}) == 0.999


def test_the_live_goodput_gauge_reads_nan_once_its_window_is_empty() -> None:
    """A tier whose last request left the window must not keep showing its last figure."""
    clock = FakeClock()
    settings = settings_for("http://a:1")
    metrics = GatewayMetrics(settings)
    tracker = GoodputTracker(metrics, settings.tiers, clock, window_s=60)

    def ratio() -> float | None:
        tracker.export()
        return metrics.registry.get_sample_value("gateway_goodput_ratio", {"tier": "interactive"})

    before = ratio()
    assert before is not None
    assert math.isnan(before)
    tracker.record(MODEL, "interactive", SloResult.MET, 10)
    tracker.record(MODEL, "interactive", SloResult.MISSED_TTFT, 10)
    assert ratio() == 0.5
    clock.advance(61)
    after = ratio()
    assert after is not None
    assert math.isnan(after)
    assert b'gateway_goodput_ratio{tier="interactive"} NaN' in generate_latest(metrics.registry)


async def test_worker_counts_are_exported_even_when_no_worker_is_known() -> None:
    """No worker known must be a series reading 0, not a missing one an alert cannot see."""
    resolver = FakeResolver()
    settings = Settings.model_validate(
        {"workers": [], "worker_dns": "vllm-workers.ns.svc:8000", "access_log": False}
    )
    metrics = GatewayMetrics(settings)
    client = WireClient(1.0)  # never asked: these tests probe nothing
    clock = FakeClock()
    pool = WorkerPool(settings, client, metrics, clock, resolver)
    sample = metrics.registry.get_sample_value
    await pool.rediscover()
    pool.export()
    assert sample("gateway_workers_known") == 0
    assert sample("gateway_workers_healthy") == 0
    resolver.addresses = ["10.0.0.1", "10.0.0.2"]
    await pool.rediscover()
    pool.workers["10.0.0.1:8000"].up = True
    pool.export()
    assert sample("gateway_workers_known") == 2
    assert sample("gateway_workers_healthy") == 1
    for _ in range(settings.eject_after_failures):
        pool.report_failure(pool.workers["10.0.0.1:8000"], "test")
    pool.export()
    assert sample("gateway_workers_healthy") == 0
    client.close()


def test_peak_figures_are_exported_per_worker() -> None:
    """MFU and MBU divide the engine's counters by these; no model figures are needed."""
    workers = json.dumps(
        [
            {"url": "http://a:1"},
            {"url": "http://b:1", "hardware": {"memory_bandwidth_gbs": 2039, "peak_tflops": 312}},
        ]
    )
    settings = settings_for(workers, hardware={"memory_bandwidth_gbs": 3350, "peak_tflops": 989.5})
    metrics = GatewayMetrics(settings)
    client = WireClient(1.0)  # never asked: these tests probe nothing
    WorkerPool(settings, client, metrics, FakeClock(), FakeResolver()).export()
    sample = metrics.registry.get_sample_value
    assert sample("gateway_worker_peak_flops_per_second", {"worker": "a:1"}) == 989.5e12
    assert sample("gateway_worker_memory_bandwidth_bytes_per_second", {"worker": "a:1"}) == 3350e9
    assert sample("gateway_worker_peak_flops_per_second", {"worker": "b:1"}) == 312e12
    assert sample("gateway_worker_memory_bandwidth_bytes_per_second", {"worker": "b:1"}) == 2039e9
    # Without the model described there is no estimated roofline (the engine counts its own).
    assert sample("gateway_worker_decode_roofline_tokens_per_second", {"worker": "a:1"}) is None


def test_a_keys_file_that_lists_no_keys_or_is_missing_refuses_to_start(tmp_path: Path) -> None:
    """A deployment that did not fill its keys Secret must fail closed, not serve openly."""
    empty = tmp_path / "api-keys.json"
    empty.write_text("[]\n")
    with pytest.raises(ValueError, match="lists no API keys, so the gateway refuses to start"):
        Authenticator(settings_for("http://a:1", api_keys_file=str(empty)), FakeClock())
    missing = tmp_path / "absent.json"
    with pytest.raises(ValueError, match=r"absent\.json cannot be read"):
        Authenticator(settings_for("http://a:1", api_keys_file=str(missing)), FakeClock())
    # Without a keys file (make run) the gateway runs without keys, as before.
    assert not Authenticator(settings_for("http://a:1"), FakeClock()).enabled


def test_a_kept_child_is_dropped_with_its_series() -> None:
    registry = CollectorRegistry()
    counter = Labelled(
        prometheus_client.Counter("kept", "A counter.", ["worker"], registry=registry)
    )
    counter.labels("w0").inc(3)
    assert counter.labels("w0") is counter.labels("w0")
    assert registry.get_sample_value("kept_total", {"worker": "w0"}) == 3
    counter.remove("w0")
    assert registry.get_sample_value("kept_total", {"worker": "w0"}) is None
    counter.labels("w0").inc()
    assert registry.get_sample_value("kept_total", {"worker": "w0"}) == 1
    counter.remove("w1")  # never made: nothing to drop
    assert registry.get_sample_value("kept_total", {"worker": "w0"}) == 1

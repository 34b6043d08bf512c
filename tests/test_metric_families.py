"""The gateway's own labelled counters and gauges expose what prometheus_client's would."""

from __future__ import annotations

import re
from enum import StrEnum

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from app.observe.families import CounterFamily, GaugeFamily
from app.observe.metrics import GatewayMetrics
from tests.servers import settings_for


class Cause(StrEnum):
    PACE = "decode_pace"
    QUEUE = "worker_queueing"


def _text(registry: CollectorRegistry) -> str:
    # _created is the wall clock at a child's creation: the same line, not the same time.
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", generate_latest(registry).decode())


def test_counters_and_gauges_expose_the_same_text_as_prometheus_clients() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    counters = (
        CounterFamily("cuts", "Limit cuts.", ("worker", "cause"), ours),
        prometheus_client.Counter("cuts", "Limit cuts.", ("worker", "cause"), registry=theirs),
    )
    gauges = (
        GaugeFamily("in_flight", "In flight.", ("worker",), ours),
        prometheus_client.Gauge("in_flight", "In flight.", ("worker",), registry=theirs),
    )
    for counter in counters:
        counter.labels("a:1", Cause.PACE).inc()
        counter.labels("a:1", Cause.PACE).inc(2.5)
        counter.labels("b:2", Cause.QUEUE)  # made at zero
        counter.labels("b:2", "decode_pace").inc(7)
    for gauge in gauges:
        gauge.labels("a:1").set(3)
        gauge.labels("a:1").inc()
        gauge.labels("a:1").dec(0.5)
        gauge.labels("b:2").set(-1e-7)
        gauge.labels("c:3").inc(12345678.9)
    counters[0].remove("b:2", Cause.QUEUE)
    counters[1].remove("b:2", Cause.QUEUE)
    gauges[0].remove("c:3")
    gauges[1].remove("c:3")
    assert _text(ours) == _text(theirs)
    assert 'cuts_total{cause="decode_pace",worker="a:1"} 3.5' in _text(ours)
    assert ours.get_sample_value("in_flight", {"worker": "a:1"}) == 3.5


def test_a_child_is_one_per_label_set_and_its_rules_are_prometheus_clients() -> None:
    registry = CollectorRegistry()
    counter = CounterFamily("kept", "A counter.", ("worker",), registry)
    assert counter.labels("w0") is counter.labels("w0")
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("w0").inc(-1)
    with pytest.raises(ValueError, match="takes labels"):
        counter.labels("w0", "extra")
    with pytest.raises(KeyError):
        counter.remove("never-made")
    counter.labels("w0").inc(3)
    counter.remove("w0")
    assert registry.get_sample_value("kept_total", {"worker": "w0"}) is None
    counter.labels("w0").inc()
    assert registry.get_sample_value("kept_total", {"worker": "w0"}) == 1


def test_the_gateways_labelled_metrics_are_its_own_in_one_process() -> None:
    metrics = GatewayMetrics(settings_for("http://a:1"))
    assert isinstance(metrics.requests, CounterFamily)
    assert isinstance(metrics.worker_in_flight, GaugeFamily)
    metrics.worker_in_flight.labels("a:1").set(2)
    text = generate_latest(metrics.registry).decode()
    assert 'gateway_worker_in_flight_requests{worker="a:1"} 2.0' in text

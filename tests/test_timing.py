"""Timing definitions on a fake clock."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from app.metrics import BatchHistogram
from app.timing import RequestTimer


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_streamed_request_timings() -> None:
    clock = FakeClock()
    timer = RequestTimer(clock)
    clock.now += 0.002
    timer.dispatch()
    # Role chunk at +0.05 is not output; tokens at +0.1, +0.12, +0.15, +0.16.
    for t in (0.1, 0.12, 0.15, 0.16):
        timer.output(100.0 + t)
    s = timer.summary(completion_tokens=4)
    assert s.queue_s == pytest.approx(0.002)
    assert s.ttft_s == pytest.approx(0.1)
    assert s.e2e_s == pytest.approx(0.16)
    assert s.tpot_s == pytest.approx(0.06 / 3)
    assert s.itl_s == pytest.approx([0.02, 0.03, 0.01])
    assert s.output_events == 4
    assert s.overhead_s == pytest.approx(0.002)


def test_events_carrying_several_tokens_share_their_gap() -> None:
    clock = FakeClock()
    timer = RequestTimer(clock)
    for t in (0.1, 0.2, 0.3):  # three events, but the worker reports 5 tokens
        timer.output(100.0 + t)
    s = timer.summary(completion_tokens=5)
    assert s.tpot_s == pytest.approx(0.2 / 4)
    assert s.itl_s == pytest.approx([0.05, 0.05])
    assert sum(s.itl_s) * 2 == pytest.approx(s.e2e_s - s.ttft_s)  # type: ignore[operator]


def test_without_usage_each_event_is_one_token() -> None:
    timer = RequestTimer(FakeClock())
    timer.output(100.5)
    timer.output(100.7)
    s = timer.summary(completion_tokens=None)
    assert s.tpot_s == pytest.approx(0.2)
    assert s.itl_s == pytest.approx([0.2])


def test_single_token_has_no_tpot_and_unary_ends_at_response() -> None:
    timer = RequestTimer(FakeClock())
    timer.output(100.3)
    assert timer.summary(completion_tokens=1).tpot_s is None
    unary = RequestTimer(FakeClock())
    s = unary.summary(completion_tokens=10, end=101.25)
    assert s.e2e_s == pytest.approx(1.25)
    assert s.ttft_s is None
    assert s.tpot_s is None


def test_admission_wait_counts_as_queue_not_overhead() -> None:
    clock = FakeClock()
    timer = RequestTimer(clock)
    timer.queued(0.5)
    clock.now += 0.501
    timer.dispatch()
    timer.add_overhead(0.0002)
    s = timer.summary(None)
    assert s.queue_s == pytest.approx(0.501)
    assert s.overhead_s == pytest.approx(0.0012)


def test_a_failed_attempt_is_failover_time_not_queue_or_overhead() -> None:
    clock = FakeClock()
    timer = RequestTimer(clock)
    clock.now += 0.3
    timer.queued(0.3)  # waited 0.3 s for admission
    clock.now += 0.001
    timer.dispatch()  # 1 ms of the gateway's own
    clock.now += 2.0
    timer.attempt_failed()  # the worker answered 500 after 2 s
    clock.now += 0.002
    timer.dispatch()  # 2 ms choosing the next worker
    timer.output(clock.now + 0.05)
    s = timer.summary(completion_tokens=1)
    assert s.queue_s == pytest.approx(0.301)
    assert s.overhead_s == pytest.approx(0.003)
    assert s.failover_s == pytest.approx(2.0)
    assert s.ttft_s == pytest.approx(2.353)


def test_batched_itl_histogram_exposes_what_prometheus_client_would() -> None:
    bounds = [0.001, 0.005, 0.01, 0.1, 1.0]
    gaps = [0.0005, 0.001, 0.004, 0.005, 0.0051, 0.2, 5.0, 0.01]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batched = BatchHistogram("gateway_x_seconds", "doc", ["model"], bounds, ours)
    plain = Histogram("gateway_x_seconds", "doc", ["model"], buckets=bounds, registry=theirs)
    batched.labels("m").observe_all(gaps[:5])
    for gap in gaps[5:]:
        batched.labels("m").observe(gap)
    for gap in gaps:
        plain.labels("m").observe(gap)

    def text(registry: CollectorRegistry) -> str:
        # _created is a wall-clock timestamp: only its presence is compared.
        return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", generate_latest(registry).decode())

    assert text(ours) == text(theirs)
    batched.remove("m")
    assert "gateway_x_seconds_count" not in text(ours)

"""Timing definitions on a fake clock."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from starlette.types import Message

from app.gateway import create_app
from app.http.arrival import FIRST_BYTE_KEY
from app.observe.looplag import LAG_BUCKETS, LoopLagProbe
from app.observe.metrics import BatchHistogram
from app.observe.timing import RequestTimer
from app.state import STATE_KEY
from tests.conftest import FakeClock
from tests.fake_upstream import MODEL, FakeWorker, tokens
from tests.servers import running_gateway, settings_for
from tests.wire_bridge import bridge


def test_streamed_request_timings() -> None:
    clock = FakeClock(100.0)
    timer = RequestTimer(clock)
    clock.advance(0.002)
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
    clock = FakeClock(100.0)
    timer = RequestTimer(clock)
    for t in (0.1, 0.2, 0.3):  # three events, but the worker reports 5 tokens
        timer.output(100.0 + t)
    s = timer.summary(completion_tokens=5)
    assert s.tpot_s == pytest.approx(0.2 / 4)
    assert s.itl_s == pytest.approx([0.05, 0.05])
    assert sum(s.itl_s) * 2 == pytest.approx(s.e2e_s - s.ttft_s)  # type: ignore[operator]


def test_without_usage_each_event_is_one_token() -> None:
    timer = RequestTimer(FakeClock(100.0))
    timer.output(100.5)
    timer.output(100.7)
    s = timer.summary(completion_tokens=None)
    assert s.tpot_s == pytest.approx(0.2)
    assert s.itl_s == pytest.approx([0.2])


def test_single_token_has_no_tpot_and_unary_ends_at_response() -> None:
    timer = RequestTimer(FakeClock(100.0))
    timer.output(100.3)
    assert timer.summary(completion_tokens=1).tpot_s is None
    unary = RequestTimer(FakeClock(100.0))
    s = unary.summary(completion_tokens=10, end=101.25)
    assert s.e2e_s == pytest.approx(1.25)
    assert s.ttft_s is None
    assert s.tpot_s is None


def test_admission_wait_counts_as_queue_not_overhead() -> None:
    clock = FakeClock(100.0)
    timer = RequestTimer(clock)
    timer.queued(0.5)
    clock.advance(0.501)
    timer.dispatch()
    timer.add_overhead(0.0002)
    s = timer.summary(None)
    assert s.queue_s == pytest.approx(0.501)
    assert s.overhead_s == pytest.approx(0.0012)


def test_a_failed_attempt_is_failover_time_not_queue_or_overhead() -> None:
    clock = FakeClock(100.0)
    timer = RequestTimer(clock)
    clock.advance(0.3)
    timer.queued(0.3)  # waited 0.3 s for admission
    clock.advance(0.001)
    timer.dispatch()  # 1 ms of the gateway's own
    clock.advance(2.0)
    timer.attempt_failed()  # the worker answered 500 after 2 s
    clock.advance(0.002)
    timer.dispatch()  # 2 ms choosing the next worker
    timer.output(clock.now + 0.05)
    s = timer.summary(completion_tokens=1)
    assert s.queue_s == pytest.approx(0.301)
    assert s.overhead_s == pytest.approx(0.003)
    assert s.failover_s == pytest.approx(2.0)
    assert s.ttft_s == pytest.approx(2.353)


def test_batched_itl_histogram_exposes_what_prometheus_client_would() -> None:
    # Bounds in every form of Go's float text: fractions, integers, exponents from 1e7 on.
    bounds = [2.5e-05, 0.001, 0.005, 0.01, 0.1, 1.0, 120, 1234567.0, 1e7, 25000000.0]
    gaps = [0.0005, 0.001, 0.004, 0.005, 0.0051, 0.2, 5.0, 0.01, 2e7, 3e7]
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


# Where the gateway's timestamps are taken: the request's first byte, and each event once its
# bytes are handed to the socket.

WORKER = "http://fake-worker:8100"
_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def _stream_3(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=tokens(3))


async def test_ttft_runs_from_the_first_byte_to_the_event_handed_to_the_socket() -> None:
    """Driven as uvicorn drives it, on a fake clock: each write to the client takes 1 s."""
    clock = FakeClock(100.0)
    worker = FakeWorker(_stream_3)
    app = create_app(
        settings_for(WORKER), transport=worker.transport, connector=bridge(worker.transport),
        clock=clock,
    )  # fmt: skip
    lifespan_in: asyncio.Queue[Message] = asyncio.Queue()
    lifespan_out: asyncio.Queue[Message] = asyncio.Queue()
    state: dict[str, Any] = {}
    lifespan = asyncio.create_task(
        app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": state},
            lifespan_in.get, lifespan_out.put)
    )  # fmt: skip
    await lifespan_in.put({"type": "lifespan.startup"})
    assert (await lifespan_out.get())["type"] == "lifespan.startup.complete"
    # The protocol noted the first byte at 99.0; the handler runs at 100.0.
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000), "state": dict(state), FIRST_BYTE_KEY: 99.0,
    }  # fmt: skip
    sent: list[Message] = []
    messages = [{"type": "http.request", "body": json.dumps(_BODY).encode(), "more_body": False}]
    finished = asyncio.Event()

    async def receive() -> Message:
        if messages:
            return messages.pop(0)
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            if message.get("body"):
                clock.advance(1.0)  # the socket takes a second to take the bytes
            if not message.get("more_body"):
                finished.set()

    await app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert body.count(b"data: ") == 5  # role chunk, 3 tokens, [DONE]
    metrics = state[STATE_KEY].metrics
    await lifespan_in.put({"type": "lifespan.shutdown"})
    assert (await lifespan_out.get())["type"] == "lifespan.shutdown.complete"
    await lifespan
    # Role chunk written 100-101; the first token came at 101 and was handed over at 102.
    labels = {"model": MODEL, "tier": "standard"}
    ttft = metrics.registry.get_sample_value("gateway_time_to_first_token_seconds_sum", labels)
    e2e = metrics.registry.get_sample_value("gateway_e2e_request_latency_seconds_sum", labels)
    itl = metrics.registry.get_sample_value("gateway_inter_token_latency_seconds_sum", labels)
    assert ttft == pytest.approx(102.0 - 99.0)
    assert e2e == pytest.approx(104.0 - 99.0)
    assert itl == pytest.approx(2.0)


async def test_the_http_protocol_notes_when_the_first_byte_was_read() -> None:
    """A request whose headers take 0.3 s to arrive: its TTFT counts them, as the client's does."""
    worker = FakeWorker(_stream_3)
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps(_BODY).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\n")
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(
            b"host: gateway\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        answer = await reader.read()
        writer.close()
        await writer.wait_closed()
        async with httpx.AsyncClient(base_url=url) as client:
            metrics = (await client.get("/metrics")).text
    assert answer.startswith(b"HTTP/1.1 200")
    assert answer.count(b"data: ") == 5
    ttft = _sample(metrics, "gateway_time_to_first_token_seconds_sum")
    assert 0.3 <= ttft < 1.0
    # The gateway ran long enough for the loop-lag probe (every 0.25 s) to report.
    assert _sample(metrics, "gateway_event_loop_lag_seconds_count") >= 1


def _sample(page: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


async def test_the_loop_lag_probe_sees_a_blocked_loop() -> None:
    histogram = Histogram("lag", "lag", buckets=LAG_BUCKETS, registry=CollectorRegistry())
    probe = LoopLagProbe(histogram, interval_s=0.02)
    probe.start()
    try:
        await asyncio.sleep(0.01)
        # A callback that hogs the loop: the probe's tick falls due meanwhile.
        asyncio.get_running_loop().call_soon(time.sleep, 0.2)
        await asyncio.sleep(0.25)
    finally:
        probe.stop()
    samples = {s.name: s.value for m in histogram.collect() for s in m.samples if not s.labels}
    assert samples["lag_count"] >= 2
    assert 0.15 <= samples["lag_sum"] < 0.3

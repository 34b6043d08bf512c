"""Every response leaves one trace, and carries its request id (issue 21 finding 5, issue 22).

One access-log line and one ``gateway_requests_total`` count per response, with the status that
was sent, whatever answered it: a route, the router (404/405), the server's limits (408, 431,
503 over the connection cap), the recorder of generation requests, or an error before the relay.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from app.api.protocol import Endpoint, ParsedRequest, parse_request
from app.api.sse import EventKind, classify
from tests.fake_upstream import MODEL, FakeWorker, chunk, tokens
from tests.servers import running_gateway, settings_for
from tests.test_gateway_fake import _ok

WORKER = "http://fake-worker:8100"
KEY = "sk-trace"
pytestmark = pytest.mark.asyncio(loop_scope="session")


def _chat(stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream,
            **extra}  # fmt: skip


def _classes(metrics: str) -> Counter[str]:
    """``gateway_requests_total`` summed by status class."""
    counts: Counter[str] = Counter()
    for line in metrics.splitlines():
        if line.startswith("gateway_requests_total{"):
            status_class = re.search(r'status_class="(\w+)"', line)
            assert status_class is not None
            counts[status_class.group(1)] += int(float(line.rsplit(" ", 1)[1]))
    return counts


async def _raw(url: str, data: bytes, wait: float = 5.0) -> tuple[int, dict[str, str]]:
    """Send ``data`` on a new connection; the status and headers of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    writer.write(data)
    try:
        raw = b""
        while chunk_ := await asyncio.wait_for(reader.read(65536), wait):
            raw += chunk_
    finally:
        writer.close()
    head = raw.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])}
    return int(head[0].split(" ")[1]), headers


async def test_every_response_is_logged_and_counted_once_with_the_status_sent(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = asyncio.Event()

    async def handler(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if body.get("max_tokens") == 99:  # held open until released: the key's one slot

            async def held() -> AsyncIterator[bytes]:
                yield chunk(None, role=True)
                await release.wait()
                async for event in tokens(2):
                    yield event

            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  content=held())  # fmt: skip
        return await _ok(request, body)

    def failing_parse(endpoint: Endpoint, raw: bytes, path: str | None = None) -> ParsedRequest:
        if b'"boom"' in raw:
            raise RuntimeError("a bug before the relay")
        return parse_request(endpoint, raw, path)

    monkeypatch.setattr("app.routes.parse_request", failing_parse)
    spec = {"sha256": hashlib.sha256(KEY.encode()).hexdigest(), "max_concurrency": 1}
    settings = settings_for(
        WORKER, api_keys=[spec], access_log=True, max_body_bytes=1000, header_timeout_s=0.5,
        body_timeout_s=0.5, max_connections=20,
    )  # fmt: skip
    auth = {"authorization": f"Bearer {KEY}"}
    sent: dict[str, int] = {}  # request id -> status received
    caplog.set_level(logging.INFO, logger="app.access")
    async with (
        running_gateway(settings, FakeWorker(handler).transport) as url,
        httpx.AsyncClient(base_url=url, headers=auth) as client,
    ):

        async def call(rid: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
            headers = {"x-request-id": rid, **kwargs.pop("headers", {})}
            r = await client.request(method, path, headers=headers, **kwargs)
            assert r.headers["x-request-id"] == rid
            sent[rid] = r.status_code
            return r

        before = _classes((await call("scrape-1", "GET", "/metrics")).text)
        await call("healthz", "GET", "/healthz")
        await call("readyz", "GET", "/readyz")
        await call("models", "GET", "/v1/models")
        await call("unknown-path", "GET", "/v1/nothing")
        await call("wrong-method", "GET", "/v1/chat/completions")
        await call("unary", "POST", "/v1/chat/completions", json=_chat(stream=False))
        await call("stream", "POST", "/v1/chat/completions", json=_chat())
        await call("completions", "POST", "/v1/completions",
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2})  # fmt: skip
        await call("bad-json", "POST", "/v1/chat/completions", content=b"{nope")
        await call("unknown-model", "POST", "/v1/chat/completions", json={**_chat(), "model": "x"})
        await call("too-large", "POST", "/v1/chat/completions", content=b"x" * 5000)
        await call("no-key", "POST", "/v1/chat/completions", json=_chat(),
                   headers={"authorization": ""})  # fmt: skip
        await call("higher-tier", "POST", "/v1/chat/completions", json=_chat(),
                   headers={"x-gateway-tier": "interactive"})  # fmt: skip
        boom = await call("boom", "POST", "/v1/chat/completions", json={**_chat(), "boom": 1})
        assert boom.json()["error"]["code"] == "internal_error"
        async with client.stream(
            "POST", "/v1/chat/completions", json=_chat(max_tokens=99),
            headers={"x-request-id": "holder"},
        ) as holder:  # fmt: skip
            await call("key-quota", "POST", "/v1/chat/completions", json=_chat())
            release.set()
            await holder.aread()
            sent["holder"] = holder.status_code
        big = await call("big-header", "GET", "/healthz", headers={"x-big": "a" * 1_000_000})
        assert big.headers["connection"] == "close"
        for rid, data, wait in [
            ("slow-head", b"GET /healthz HTTP/1.1\r\nx-request-id: slow-head\r\nhost: g", 5.0),
            ("slow-body", b"POST /v1/completions HTTP/1.1\r\nx-request-id: slow-body\r\n"
             b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: 50\r\n\r\n{", 5.0),
        ]:  # fmt: skip
            status, headers = await _raw(url, data, wait)
            assert headers["x-request-id"] == rid
            sent[rid] = status
        # Over the connection cap: connections that send nothing are closed without a trace.
        held = [
            await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
            for _ in range(20)
        ]
        status, headers = await _raw(
            url, b"GET /v1/models HTTP/1.1\r\nx-request-id: capped\r\n\r\n"
        )
        for _, writer in held:
            writer.close()
        assert headers["x-request-id"] == "capped"
        sent["capped"] = status
        await asyncio.sleep(0.2)
        after = _classes((await call("scrape-2", "GET", "/metrics")).text)
        await asyncio.sleep(0.2)
    assert sorted(set(sent.values())) == [200, 400, 401, 403, 404, 405, 408, 413, 429, 431, 500,
                                          503]  # fmt: skip
    # One log line per response, with its id and the status that was sent.
    logged: dict[str, list[int]] = {}
    for record in caplog.records:
        if record.name == "app.access":
            rid, _, rest = record.getMessage().partition(" ")
            found = re.search(r" status=(\d+) ", rest)
            assert found is not None
            logged.setdefault(rid, []).append(int(found.group(1)))
    assert logged == {rid: [status] for rid, status in sent.items()}
    # One count per response (the last scrape's own is not in it yet).
    expected = Counter(f"{s // 100}xx" for rid, s in sent.items() if rid != "scrape-2")
    assert after - before == expected


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/models", None),
        ("GET", "/healthz", None),
        ("GET", "/readyz", None),
        ("GET", "/metrics", None),
        ("GET", "/v1/unknown", None),
        ("POST", "/unknown", b"{}"),
        ("GET", "/v1/chat/completions", None),
        ("DELETE", "/v1/models", None),
        ("POST", "/v1/chat/completions", json.dumps(_chat()).encode()),
        ("POST", "/v1/chat/completions", json.dumps(_chat(stream=False)).encode()),
        ("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi"}).encode()),
        ("POST", "/v1/chat/completions", b"{not json"),
        ("POST", "/v1/completions", json.dumps({"model": "nope", "prompt": "hi"}).encode()),
    ],
)
async def test_every_route_answers_with_the_request_id(
    method: str, path: str, body: bytes | None
) -> None:
    worker = FakeWorker(_ok)
    seen: list[str] = []
    handle = worker.handle

    async def record(request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/") and request.method == "POST":
            seen.append(request.headers["x-request-id"])
        return await handle(request)

    transport = httpx.MockTransport(record)
    async with running_gateway(settings_for(WORKER), transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            given = await client.request(
                method, path, content=body, headers={"x-request-id": "client-id.1:a_b-c"}
            )
            made = await client.request(method, path, content=body)
            unsafe = await client.request(
                method, path, content=body, headers={"x-request-id": "a b\tc" + "x" * 200}
            )
    assert given.headers["x-request-id"] == "client-id.1:a_b-c"
    for response in (made, unsafe):
        assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])
    assert made.headers["x-request-id"] != unsafe.headers["x-request-id"]
    # The worker was sent the id the client got back: one id per request.
    ids = [r.headers["x-request-id"] for r in (given, made, unsafe)]
    assert seen in ([], ids)


@pytest.mark.parametrize("started", [False, True])
async def test_a_fault_in_the_relay_is_a_500_logged_as_sent(
    started: bool, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_classify(event: bytes) -> EventKind:
        if b" t1" in event or (not started and b'"role"' in event):
            raise RuntimeError("a bug in the relay")
        return classify(event)

    monkeypatch.setattr("app.relay.stream.classify", failing_classify)
    caplog.set_level(logging.INFO, logger="app.access")
    settings = settings_for(WORKER, access_log=True)
    async with running_gateway(settings, FakeWorker(_ok).transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post(
                "/v1/chat/completions", json=_chat(), headers={"x-request-id": "faulty"}
            )
            metrics = (await client.get("/metrics")).text
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "app.access"]
    line = next(line for line in lines if line.startswith("faulty "))
    assert "outcome=internal_error" in line
    assert 'outcome="internal_error"' in metrics
    if started:  # the stream had begun: an in-band error ends it, without [DONE]
        assert r.status_code == 200
        assert b'"code": "internal_error"' in r.content
        assert b"[DONE]" not in r.content
        assert " status=500 " in line  # as for every in-band error: the error's status
    else:
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "internal_error"
        assert r.headers["x-request-id"] == "faulty"
        assert " status=500 " in line


async def test_a_fault_in_counting_or_learning_gives_every_slot_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The key's concurrency slot and the worker's lease come back whatever the metrics do.

    With a key allowed one request at a time, a second request after a first whose counting
    and learning both failed is served, not turned away for a slot the first still holds.
    """
    from app.observe.metrics import GatewayMetrics
    from app.relay.feedback import Feedback

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug in the metrics")

    monkeypatch.setattr(GatewayMetrics, "count", broken)
    monkeypatch.setattr(Feedback, "served", broken)
    spec = {"sha256": hashlib.sha256(KEY.encode()).hexdigest(), "max_concurrency": 1}
    settings = settings_for(WORKER, api_keys=[spec])
    auth = {"authorization": f"Bearer {KEY}"}
    caplog.set_level(logging.CRITICAL)  # the faults are logged as errors; not this test's point
    async with (
        running_gateway(settings, FakeWorker(_ok).transport) as url,
        httpx.AsyncClient(base_url=url, headers=auth) as client,
    ):
        for _ in range(3):
            r = await client.post("/v1/chat/completions", json=_chat())
            assert r.status_code == 200, r.text
            assert b"[DONE]" in r.content
        metrics = (await client.get("/metrics")).text
    lines = metrics.splitlines()
    in_flight = [line for line in lines if line.startswith("gateway_worker_in_flight")]
    assert in_flight, "the worker's in-flight gauge is exported"
    assert all(line.endswith(" 0.0") for line in in_flight), in_flight


async def test_the_workers_cached_tokens_are_counted_beside_what_routing_predicted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker's usage tells the prompt tokens it found cached (``--enable-prompt-tokens-
    details``): counted per worker, logged beside the prediction, and a prediction above what
    was found is counted as missed. The first answer is streamed, the second whole."""
    found = iter([0, 100])

    async def answer(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        usage = {"prompt_tokens": 900, "total_tokens": 902, "completion_tokens": 2,
                 "prompt_tokens_details": {"cached_tokens": next(found)}}  # fmt: skip
        if not body.get("stream"):
            message = {"role": "assistant", "content": "t0 t1"}
            return httpx.Response(200, json={
                "id": "c1", "object": "chat.completion", "created": 1, "model": MODEL,
                "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
                "usage": usage,
            })  # fmt: skip

        async def events() -> AsyncIterator[bytes]:
            async for event in tokens(2, usage=False):
                if event.startswith(b"data: [DONE]"):
                    payload = {"id": "c1", "object": "chat.completion.chunk", "created": 1,
                               "model": MODEL, "choices": [], "usage": usage}  # fmt: skip
                    yield b"data: " + json.dumps(payload, separators=(",", ":")).encode()
                    yield b"\n\n"
                yield event

        return worker.sse(events())

    worker = FakeWorker(answer)
    caplog.set_level(logging.INFO, logger="app.access")
    settings = settings_for(WORKER, access_log=True, routing="prefix_aware")
    system = " ".join(f"word{i % 97}" for i in range(700))  # ~5,000 characters
    body = {"model": MODEL, "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": "hi"}]}  # fmt: skip
    async with running_gateway(settings, worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            for i, stream in enumerate((True, False)):
                r = await client.post(
                    "/v1/chat/completions", json={**body, "stream": stream},
                    headers={"x-request-id": f"cached-{i}"},
                )  # fmt: skip
                assert r.status_code == 200
            metrics = (await client.get("/metrics")).text
    lines = {
        rec.getMessage().split(" ", 1)[0]: rec.getMessage()
        for rec in caplog.records
        if rec.name == "app.access"
    }
    assert "cached_tokens=0 predicted_cached=0" in lines["cached-0"]
    second = re.search(r"cached_tokens=100 predicted_cached=(\d+)$", lines["cached-1"])
    assert second is not None, lines["cached-1"]
    predicted = int(second[1])
    assert predicted > 100  # the whole system prompt, routed here a moment ago

    def sample(name: str) -> float:
        found = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", metrics, re.M)
        assert found is not None, name
        return float(found[1])

    assert sample("gateway_worker_cached_prompt_tokens_total") == 100
    assert sample("gateway_worker_cache_told_prompt_tokens_total") == 1800
    # The log gives the prediction in whole tokens.
    assert 0 <= sample("gateway_worker_prefix_missed_tokens_total") - (predicted - 100) < 1

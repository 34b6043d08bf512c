"""The gateway against scripted workers: input errors, worker failures, disconnects, usage."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import ssl
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from pydantic import TypeAdapter

from app.fleet.wire import ProtocolFactory
from app.settings import TierSpec
from tests.fake_upstream import DONE, MODEL, FakeWorker, chunk, tokens, usage_chunk
from tests.servers import running_gateway, settings_for
from tests.test_endpoints import _metric

WORKER = "http://fake-worker:8100"
pytestmark = pytest.mark.asyncio(loop_scope="session")


_LAX_BOOL = TypeAdapter(bool | None)  # vLLM's type for "stream"


async def _ok(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
    if _LAX_BOOL.validate_python(body.get("stream")):
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=tokens(4))
    return httpx.Response(
        200,
        json={
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        },
    )


def _chat(stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream,
            **extra}  # fmt: skip


async def _events(response: httpx.Response) -> list[bytes]:
    raw = b""
    async for data in response.aiter_raw():
        raw += data
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e]


@pytest.fixture
async def ok_gateway() -> AsyncIterator[tuple[str, FakeWorker]]:
    worker = FakeWorker(_ok)
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        yield url, worker


async def test_stream_relays_every_event_and_hides_usage_unless_asked(
    ok_gateway: tuple[str, FakeWorker],
) -> None:
    url, worker = ok_gateway
    async with httpx.AsyncClient(base_url=url) as client:
        async with client.stream("POST", "/v1/chat/completions", json=_chat()) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["cache-control"] == "no-cache"
            assert r.headers["x-accel-buffering"] == "no"
            events = await _events(r)
        # The gateway asked the worker for usage, but the client did not: it is not forwarded.
        assert worker.requests[-1]["stream_options"] == {"include_usage": True}
        assert events == [chunk(None, role=True)] + [
            chunk(f" t{i}", finish="length" if i == 3 else None) for i in range(4)
        ] + [DONE]
        body = _chat(stream_options={"include_usage": True})
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            events = await _events(r)
        assert b'"usage":{"prompt_tokens":3' in events[-2]
        metrics = (await client.get("/metrics")).text
    assert 'gateway_completion_tokens_total{model="fake-model",tier="standard"} 8.0' in metrics
    assert (
        'gateway_requests_total{endpoint="chat",model="fake-model",outcome="ok",'
        'status_class="2xx",tier="standard"} 2.0' in metrics
    )
    assert (
        'gateway_time_to_first_token_seconds_count{model="fake-model",tier="standard"} 2.0'
        in metrics
    )
    assert (
        'gateway_inter_token_latency_seconds_count{model="fake-model",tier="standard"} 6.0'
        in metrics
    )


async def test_a_cookie_a_worker_sets_is_never_sent_with_later_requests() -> None:
    seen: list[httpx.Headers] = []

    async def sets_cookie(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        seen.append(request.headers)
        response = await _ok(request, body)
        response.headers["set-cookie"] = "session=one-clients-secret; Path=/"
        return response

    worker = FakeWorker(sets_cookie)
    async with (
        running_gateway(settings_for(WORKER), worker.transport) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        for _ in range(2):
            r = await client.post("/v1/chat/completions", json=_chat(stream=False))
            assert r.status_code == 200
    assert len(seen) == 2
    assert "cookie" not in seen[1]
    # What the worker is sent: the gateway's own headers, not httpx's defaults.
    assert "user-agent" not in seen[1]
    assert seen[1]["accept-encoding"] == "identity"


async def test_a_worker_is_sent_its_own_key_the_request_id_and_the_bodys_length() -> None:
    seen: list[httpx.Request] = []

    async def records(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        seen.append(request)
        return await _ok(request, body)

    worker = FakeWorker(records)
    workers = json.dumps([{"url": WORKER, "api_key": "worker-secret"}])
    async with (
        running_gateway(settings_for(workers), worker.transport) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        for request_id in ("first-one", "second-one"):
            r = await client.post(
                "/v1/chat/completions",
                json=_chat(stream=False),
                headers={"authorization": "Bearer client-key", "x-request-id": request_id},
            )
            assert r.status_code == 200
    assert len(seen) == 2
    for request, request_id in zip(seen, ("first-one", "second-one"), strict=True):
        assert sorted(request.headers.keys()) == [
            "accept-encoding", "authorization", "content-length", "content-type", "host",
            "x-request-id",
        ]  # fmt: skip
        assert request.headers["host"] == httpx.URL(WORKER).netloc.decode()
        assert request.headers["authorization"] == "Bearer worker-secret"  # never the client's
        assert request.headers["x-request-id"] == request_id
        assert request.headers["content-type"] == "application/json"
        assert request.headers["accept-encoding"] == "identity"
        assert int(request.headers["content-length"]) == len(request.content)
        assert json.loads(request.content)["model"]


async def test_unknown_fields_pass_through_and_non_stream_works(
    ok_gateway: tuple[str, FakeWorker],
) -> None:
    url, worker = ok_gateway
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.post(
            "/v1/chat/completions", json=_chat(stream=False, ignore_eos=True, top_k=3)
        )
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 4
    assert worker.requests[-1]["ignore_eos"] is True
    assert worker.requests[-1]["top_k"] == 3
    assert "stream_options" not in worker.requests[-1]


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        (b"{not json", 400, "invalid_json", None),
        (b'{"model": "fake-model", "messages": [{"content": "\xff\xfe"}]}', 400, "invalid_utf8",
         None),
        (b"[1, 2]", 400, "invalid_json", None),
        (b'{"model": "fake-model"}', 400, "missing_required_parameter", "messages"),
        (b'{"model": 5, "messages": []}', 400, "invalid_type", "model"),
        (b'{"model": "fake-model", "messages": "hi"}', 400, "invalid_type", "messages"),
        # What vLLM's lax types refuse too: "maybe" is no bool, 4.5 no int.
        (b'{"model": "fake-model", "messages": [], "stream": "maybe"}', 400, "invalid_type",
         "stream"),
        (b'{"model": "fake-model", "messages": [], "max_tokens": "4.5"}', 400, "invalid_type",
         "max_tokens"),
        (b'{"model": "fake-model", "messages": [], "max_tokens": -1}', 400, "invalid_type",
         "max_tokens"),
        (b'{"model": "fake-model", "messages": [], "stream": true, "stream_options": '
         b'{"continuous_usage_stats": "maybe"}}', 400, "invalid_type",
         "stream_options.continuous_usage_stats"),
        (b'{"model": "nope", "messages": []}', 404, "model_not_found", "model"),
        (b'{"model": "fake-model", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
         "invalid_json", None),
        # Issue 21's decode edge cases: each a 400, never a 500.
        (b'{"model": "fake-model", "messages": [], "max_tokens": 1' + b"0" * 400 + b"}", 400,
         "invalid_type", "max_tokens"),
        (b'{"model": "fake-model", "messages": [], "max_completion_tokens": 2147483648}', 400,
         "invalid_type", "max_completion_tokens"),
        (b'{"model": "fake-model", "messages": [], "seed": ' + b"7" * 5000 + b"}", 400,
         "invalid_json", None),
        (b'{"model": "fake-model", "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
         "invalid_unicode", None),
        (b'{"model": "fake-model", "messages": [], "user": "a\\udfffb"}', 400, "invalid_unicode",
         None),
    ],
)  # fmt: skip
async def test_bad_input_gets_openai_shaped_errors(
    ok_gateway: tuple[str, FakeWorker], body: bytes, status: int, code: str, param: str | None
) -> None:
    url, worker = ok_gateway
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.post("/v1/chat/completions", content=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert worker.requests == []


@pytest.mark.parametrize(
    ("fields", "stream"),
    [
        ({"max_tokens": 4.0}, False),
        ({"max_tokens": "4", "max_completion_tokens": " 4 "}, False),
        ({"stream": "false"}, False),
        ({"stream": 0}, False),
        ({"stream": "yes"}, True),
        ({"stream": 1, "stream_options": {"include_usage": "yes"}}, True),
        ({"n": "2", "user": "someone"}, False),
        ({"model": None}, False),
        ({"model": "", "stream": True}, True),
    ],
)
async def test_what_vllms_lax_types_accept_is_relayed_as_sent(
    ok_gateway: tuple[str, FakeWorker], fields: dict[str, Any], stream: bool
) -> None:
    """vLLM's pydantic models coerce these; the gateway reads them alike and forwards the bytes."""
    url, worker = ok_gateway
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream") is stream
    if stream and "stream_options" not in fields:
        # Usage asked for the gateway's own count, not passed to the client.
        assert worker.requests[-1] == {**body, "stream_options": {"include_usage": True}}
        assert b'"usage"' not in r.content
    else:
        assert worker.requests[-1] == body


async def test_a_request_without_model_goes_to_the_only_model_or_is_a_400() -> None:
    """vLLM serves its first model when none is named; a fleet of several models has none."""
    worker = FakeWorker(_ok)
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/chat/completions", json={"messages": [], "max_tokens": 2})
            metrics = (await client.get("/metrics")).text
    assert r.status_code == 200
    assert worker.requests[-1] == {"messages": [], "max_tokens": 2}  # sent as it came
    assert f'gateway_requests_total{{endpoint="chat",model="{MODEL}",outcome="ok"' in metrics

    async def two_models(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            card = {"id": request.url.host, "object": "model"}
            return httpx.Response(200, json={"object": "list", "data": [card]})
        return httpx.Response(200, text="")

    settings = settings_for("http://model-a:8100,http://model-b:8100")
    async with running_gateway(settings, httpx.MockTransport(two_models)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "model"
    assert error["code"] == "missing_required_parameter"
    assert "model-a, model-b" in error["message"]


async def test_oversized_body_is_refused_without_reading_it() -> None:
    worker = FakeWorker(_ok)
    settings = settings_for(WORKER, max_body_bytes=1000)
    async with running_gateway(settings, worker.transport) as url, httpx.AsyncClient() as client:
        r = await client.post(f"{url}/v1/completions", content=b"x" * 5000)
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"

        async def chunked() -> AsyncIterator[bytes]:
            for _ in range(50):
                yield b"y" * 100

        r = await client.post(f"{url}/v1/completions", content=chunked())
        assert r.status_code == 413
        r = await client.get(f"{url}/v1/nothing")
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "not_found"


async def test_worker_4xx_reaches_the_client_with_its_message() -> None:
    async def refuse(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        return httpx.Response(
            400,
            json={"error": {"message": "max_tokens is too large", "type": "BadRequestError",
                            "param": "max_tokens", "code": 400}},
        )  # fmt: skip

    worker = FakeWorker(refuse)
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/chat/completions", json=_chat())
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "max_tokens is too large"
    assert r.json()["error"]["param"] == "max_tokens"


async def test_worker_500_before_first_byte_is_a_502() -> None:
    async def fail(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        return httpx.Response(500, text="Internal Server Error")

    worker = FakeWorker(fail)
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/chat/completions", json=_chat())
            metrics = (await client.get("/metrics")).text
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_status_error"
    assert "Internal Server Error" in r.json()["error"]["message"]
    assert 'outcome="upstream_error",status_class="5xx",tier="standard"} 1.0' in metrics


async def test_worker_dying_mid_stream_gives_an_in_band_error_and_no_done() -> None:
    async def die(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        async def events() -> AsyncIterator[bytes]:
            yield chunk(None, role=True)
            yield chunk(" a")
            yield chunk(" b")[:20]  # half an event, then the connection drops
            raise httpx.RemoteProtocolError("peer closed connection")

        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=events())  # fmt: skip

    worker = FakeWorker(die)
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            async with client.stream("POST", "/v1/chat/completions", json=_chat()) as r:
                assert r.status_code == 200
                events = await _events(r)
            metrics = (await client.get("/metrics")).text
    assert events[:2] == [chunk(None, role=True), chunk(" a")]
    error = json.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_invalid_response"
    assert DONE not in events
    assert 'outcome="upstream_error"' in metrics


async def test_stream_that_ends_without_done_is_an_error() -> None:
    async def truncated(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        async def events() -> AsyncIterator[bytes]:
            yield chunk(None, role=True)
            yield chunk(" a")

        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=events())  # fmt: skip

    worker = FakeWorker(truncated)
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            async with client.stream("POST", "/v1/chat/completions", json=_chat()) as r:
                events = await _events(r)
    assert b'"error"' in events[-1]
    assert DONE not in events


async def test_hang_before_first_token_is_a_504_and_hang_mid_stream_an_in_band_timeout() -> None:
    async def hang(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        async def events() -> AsyncIterator[bytes]:
            if body["max_tokens"] == 0:
                await asyncio.sleep(3600)
            yield chunk(None, role=True)
            yield chunk(" a")
            await asyncio.sleep(3600)
            yield DONE

        return worker.sse(events())

    worker = FakeWorker(hang)
    settings = settings_for(WORKER, first_token_timeout_s=0.5, idle_timeout_s=0.3)
    async with running_gateway(settings, worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/chat/completions", json=_chat(max_tokens=0))
            assert r.status_code == 504
            assert r.json()["error"]["code"] == "upstream_timeout"
            assert "first token" in r.json()["error"]["message"]
            await asyncio.wait_for(worker.cancelled.wait(), 1)
            worker.cancelled.clear()
            async with client.stream("POST", "/v1/chat/completions", json=_chat(max_tokens=5)) as r:
                assert r.status_code == 200
                events = await _events(r)
            await asyncio.wait_for(worker.cancelled.wait(), 1)
            metrics = (await client.get("/metrics")).text
    assert events[1] == chunk(" a")
    assert b'"upstream_timeout"' in events[-1]
    assert 'outcome="timeout",status_class="5xx",tier="standard"} 2.0' in metrics


async def test_a_stream_longer_than_the_idle_timeout_is_not_cut_while_events_come() -> None:
    async def steady(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        async def events() -> AsyncIterator[bytes]:
            yield chunk(None, role=True)
            for i in range(12):  # 1.2 s of events 0.1 s apart, with a 0.3 s idle timeout
                await asyncio.sleep(0.1)
                yield chunk(f" {i}")
            yield DONE

        return worker.sse(events())

    worker = FakeWorker(steady)
    settings = settings_for(WORKER, first_token_timeout_s=0.5, idle_timeout_s=0.3)
    async with running_gateway(settings, worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            body = _chat(max_tokens=12)
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                events = await _events(r)
    assert events[-1] == DONE
    assert events[1:-1] == [chunk(f" {i}") for i in range(12)]


async def test_unreachable_worker_is_a_503_and_not_ready() -> None:
    from tests.servers import free_port

    settings = settings_for(f"http://127.0.0.1:{free_port()}", connect_timeout_s=0.5)
    async with running_gateway(settings) as url, httpx.AsyncClient(base_url=url) as client:
        r = await client.post("/v1/chat/completions", json=_chat())
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "no_worker"
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/health")).status_code == 503  # vLLM's: can it serve?


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_cancels_the_worker_request(stream: bool) -> None:
    started = asyncio.Event()

    async def slow(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if not body["stream"]:
            started.set()
            await asyncio.sleep(3600)

        async def events() -> AsyncIterator[bytes]:
            yield chunk(None, role=True)
            for i in range(10_000):
                started.set()
                yield chunk(f" {i}")
                await asyncio.sleep(0.01)

        return worker.sse(events())

    worker = FakeWorker(slow)
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:

            async def call() -> None:
                async with client.stream(
                    "POST", "/v1/chat/completions", json=_chat(stream=stream)
                ) as r:
                    async for _ in r.aiter_raw():
                        pass

            task = asyncio.create_task(call())
            await asyncio.wait_for(started.wait(), 5)
            await asyncio.sleep(0.1)
            task.cancel()  # drops the connection
            await asyncio.wait_for(worker.cancelled.wait(), 1.0)
            await asyncio.sleep(0.05)
            metrics = (await client.get("/metrics")).text
    assert 'outcome="client_cancelled",status_class="4xx",tier="standard"} 1.0' in metrics
    assert 'gateway_in_flight_requests{model="fake-model",tier="standard"} 0.0' in metrics


async def test_models_lists_worker_cards_with_vllm_fields(
    ok_gateway: tuple[str, FakeWorker],
) -> None:
    url, _ = ok_gateway
    async with httpx.AsyncClient(base_url=url) as client:
        models = (await client.get("/v1/models")).json()
        ready = await client.get("/readyz")
        health = await client.get("/health")
    assert (health.status_code, health.content) == (200, b"")  # as vLLM answers it
    assert models["object"] == "list"
    assert models["data"][0]["root"] == MODEL
    assert models["data"][0]["max_model_len"] == 1024
    assert ready.status_code == 200


async def test_a_stream_slower_than_the_tpot_target_cuts_its_workers_limit_while_it_runs() -> None:
    async def slow(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        # 120 ms per token against the interactive tier's TPOT target of 100 ms.
        stream = tokens(40, gap=0.12)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream)

    def gauge(metrics: str, name: str) -> float:
        line = next(x for x in metrics.splitlines() if x.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    def limit(metrics: str) -> float:
        return gauge(metrics, "gateway_worker_concurrency_limit")

    worker = FakeWorker(slow)
    settings = settings_for(WORKER, default_tier="interactive")
    async with running_gateway(settings, worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            before = limit((await client.get("/metrics")).text)
            async with client.stream("POST", "/v1/chat/completions", json=_chat()) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith('data: {"id"')
                    if seen == 36:  # over 3 s of its pace read, and the stream not yet over
                        break
                metrics = (await client.get("/metrics")).text
    assert before >= 2
    assert limit(metrics) < before
    assert gauge(metrics, "gateway_worker_decode_pace_seconds") == pytest.approx(0.12, rel=0.25)


async def test_a_full_connection_pool_is_the_gateways_own_503_never_the_workers() -> None:
    async def slow(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        stream = tokens(20, gap=0.05)  # a second per stream
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream)

    worker = FakeWorker(slow)
    settings = settings_for(WORKER, max_upstream_connections=4)
    async with running_gateway(settings, worker.transport) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:

            async def one() -> tuple[int, dict[str, Any] | None, float]:
                sent = asyncio.get_running_loop().time()
                async with client.stream("POST", "/v1/chat/completions", json=_chat()) as r:
                    body = await r.aread()
                    took = asyncio.get_running_loop().time() - sent
                    error = json.loads(body)["error"] if r.status_code != 200 else None
                    return r.status_code, error, took

            results = await asyncio.gather(*(one() for _ in range(10)))
            metrics = (await client.get("/metrics")).text
            ready = await client.get("/readyz")
    statuses = sorted(status for status, _, _ in results)
    assert statuses == [200] * 4 + [503] * 6
    for status, error, took in results:
        if status == 503:
            assert error is not None
            assert error["code"] == "gateway_saturated"
            assert took < 0.5  # at once, not after a pool timeout
    assert 'gateway_saturated_total{resource="upstream_connections"} 6.0' in metrics
    assert 'gateway_worker_ejections_total{worker="fake-worker:8100"} 0.0' in metrics
    assert 'gateway_worker_up{worker="fake-worker:8100"} 1.0' in metrics
    assert 'outcome="gateway_saturated"' in metrics
    assert ready.status_code == 200


async def test_a_refusal_is_logged_as_a_decision_with_its_reason_not_a_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = FakeWorker(_ok)
    settings = settings_for(WORKER, default_tier="interactive")
    long = {"role": "user", "content": "word " * 60_000}
    async with running_gateway(settings, worker.transport) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            with caplog.at_level(logging.INFO, logger="app.relay.serve"):
                refused = await client.post("/v1/chat/completions", json=_chat(messages=[long]))
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "prompt_too_long"
    assert not worker.requests
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "app.relay.serve"]
    request_id = refused.headers["x-request-id"]
    assert (logging.INFO, f"request {request_id} refused with 429 prompt_too_long: "
            f"{refused.json()['error']['message']}") in lines  # fmt: skip
    assert not [line for level, line in lines if level >= logging.WARNING]


async def test_router_errors_carry_string_codes(ok_gateway: tuple[str, FakeWorker]) -> None:
    url, _ = ok_gateway
    async with httpx.AsyncClient(base_url=url) as client:
        missing = await client.get("/v1/nothing-here")
        wrong = await client.get("/v1/chat/completions")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    assert wrong.status_code == 405
    assert wrong.json()["error"]["code"] == "method_not_allowed"


async def test_twenty_client_disconnects_do_not_eject_the_worker() -> None:
    async def slow(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if not body.get("stream"):
            return await _ok(request, body)
        stream = tokens(40, gap=0.05)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream)

    worker = FakeWorker(slow)
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:

            async def leave_early() -> None:
                async with client.stream("POST", "/v1/chat/completions", json=_chat()) as r:
                    async for _ in r.aiter_raw():
                        break  # the first bytes arrived: go away

            await asyncio.gather(*(leave_early() for _ in range(20)))
            await asyncio.sleep(0.2)
            metrics = (await client.get("/metrics")).text
            ok = await client.post("/v1/chat/completions", json=_chat(stream=False))
    assert 'gateway_worker_ejections_total{worker="fake-worker:8100"} 0.0' in metrics
    assert 'gateway_worker_up{worker="fake-worker:8100"} 1.0' in metrics
    cancelled = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("gateway_requests_total{") and 'outcome="client_cancelled"' in line
    )
    assert cancelled == 20
    assert ok.status_code == 200


async def test_out_of_file_descriptors_is_the_gateways_own_503_never_the_workers() -> None:
    connects = 0

    async def no_descriptors(
        factory: ProtocolFactory, host: str, port: int, tls: ssl.SSLContext | None
    ) -> tuple[asyncio.BaseTransport, asyncio.Protocol]:
        # What a connect looks like when the process has no descriptor left for the socket.
        nonlocal connects
        connects += 1
        raise OSError(errno.EMFILE, "Too many open files")

    worker = FakeWorker(_ok)
    async with (
        running_gateway(settings_for(WORKER), worker.transport, no_descriptors) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        answers = [await client.post("/v1/chat/completions", json=_chat()) for _ in range(6)]
        metrics = (await client.get("/metrics")).text
    for answer in answers:
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "gateway_saturated"
        assert "retry-after" in answer.headers
    assert connects == 6  # tried once each: no failover, since no worker failed
    assert 'gateway_saturated_total{resource="upstream_connections"} 6.0' in metrics
    assert 'gateway_worker_ejections_total{worker="fake-worker:8100"} 0.0' in metrics
    assert 'gateway_worker_up{worker="fake-worker:8100"} 1.0' in metrics


async def test_a_key_with_non_ascii_characters_matches_on_its_utf8_bytes() -> None:
    key = "sk-clé-Größe-鍵-🔑"
    spec = {"sha256": hashlib.sha256(key.encode()).hexdigest(), "name": "unicode"}
    settings = settings_for(WORKER, api_keys=[spec])
    async with running_gateway(settings, FakeWorker(_ok).transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            ok = await client.post(
                "/v1/chat/completions",
                json=_chat(stream=False),
                headers={b"authorization": b"Bearer " + key.encode()},  # its UTF-8 bytes
            )
            wrong = await client.post(
                "/v1/chat/completions",
                json=_chat(stream=False),
                headers={b"authorization": b"Bearer " + key[:-1].encode()},
            )
    assert ok.status_code == 200
    assert wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"


async def test_late_first_tokens_cut_the_prefill_limit_before_their_answers_end() -> None:
    """A surge's late first tokens lower the worker's prefill limit while they still stream:
    learnt at the end of each answer, the limit would stand while their excess held it."""
    release = asyncio.Event()

    async def late_first_token(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        async def events() -> AsyncIterator[bytes]:
            # The worker's share of the tier's 0.4 s TTFT target is 0.2 s.
            await asyncio.sleep(0.3)
            yield chunk(" a")
            await release.wait()
            yield chunk(" b", finish="length")
            yield usage_chunk(3, 2)
            yield DONE

        return worker.sse(events())

    worker = FakeWorker(late_first_token)
    tier = TierSpec(name="standard", priority=0, ttft_slo_s=0.4, max_queue_wait_s=1.0)
    settings = settings_for(WORKER, tiers=(tier,))
    async with (
        running_gateway(settings, worker.transport) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):

        async def stream() -> list[bytes]:
            async with client.stream("POST", "/v1/chat/completions", json=_chat()) as r:
                assert r.status_code == 200
                return await _events(r)

        streams = [asyncio.create_task(stream()) for _ in range(3)]
        cuts = limit = 0.0
        for _ in range(100):
            await asyncio.sleep(0.05)
            text = (await client.get("/metrics")).text
            cuts = _metric(text, "gateway_worker_limit_cuts_total", cause="ttft_miss")
            limit = _metric(text, "gateway_worker_prefill_concurrency_limit")
            if cuts:
                break
        # Three prefilled together, each first token 0.1 s over the share: cut, mid-answer.
        assert cuts >= 1
        assert limit < 256
        assert not any(task.done() for task in streams)
        release.set()
        for events in await asyncio.gather(*streams):
            assert events[-1] == DONE


async def test_the_tier_goes_to_the_worker_as_vllms_priority() -> None:
    """vLLM's ``priority`` carries the tier, relative to the default tier (standard) whose
    requests go as the client sent them, byte for byte; a client's own ``priority`` may put
    its request later, never earlier; with ``worker_priority`` off nothing is added."""
    keys = {"interactive": "sk-chat-app", "standard": "sk-backend"}
    specs = [
        {"sha256": hashlib.sha256(k.encode()).hexdigest(), "name": t, "tier": t}
        for t, k in keys.items()
    ]

    async def sent(settings_extra: dict[str, Any], tier: str, **body: Any) -> Any:
        worker = FakeWorker(_ok)
        settings = settings_for(WORKER, api_keys=specs, **settings_extra)
        headers = {"authorization": f"Bearer {keys['standard' if tier == 'batch' else tier]}"}
        if tier == "batch":
            headers["x-gateway-tier"] = "batch"
        raw = json.dumps(_chat(stream=False, **body)).encode()
        async with running_gateway(settings, worker.transport) as url:
            async with httpx.AsyncClient(base_url=url) as client:
                answer = await client.post("/v1/chat/completions", content=raw, headers=headers)
        assert answer.status_code == 200, answer.text
        ((_, received),) = worker.received
        return "as sent" if received == raw else json.loads(received)["priority"]

    assert await sent({}, "standard") == "as sent"
    assert await sent({}, "interactive") == -1
    assert await sent({}, "batch") == 1
    assert await sent({}, "interactive", priority=3) == "as sent"  # later: the client's own
    assert await sent({}, "standard", priority=-5) == 0  # earlier than its tier: not
    assert await sent({}, "standard", priority="-5") == 0  # however vLLM would read it
    assert await sent({}, "interactive", priority=-2.0) == -1
    assert await sent({}, "standard", priority="soon") == "as sent"  # the worker's 400
    assert await sent({}, "batch", priority=0) == 1
    assert await sent({"worker_priority": False}, "interactive") == "as sent"
    assert await sent({"worker_priority": False}, "standard", priority=-5) == "as sent"

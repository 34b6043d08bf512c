"""The rest of the OpenAI surface against scripted workers: every path, its timing and cost.

A real vLLM CPU worker serves most of these (tests/test_endpoints_real.py); here are what it
cannot do on demand (fail before the first byte, fail mid-stream, hold a request) and what the
CPU build cannot serve at all (speech to text, LoRA adapters), answered with vLLM 0.32's own
response bodies (tests/data/vllm_samples).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.api.protocol import ENDPOINT_PATHS, Cost, Endpoint
from tests.fake_upstream import MODEL, FakeWorker, fleet, tokens
from tests.servers import running_gateway, settings_for
from tests.test_relay_bytes import CASES, RecordedWorker, _as_direct, _relayed

pytestmark = pytest.mark.asyncio(loop_scope="session")

WORKER = "http://fake-worker:8100"
SAMPLES = Path(__file__).parent / "data" / "vllm_samples"
USAGE = {"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0}

# A JSON body for each path (vLLM's shape; the gateway reads only model and user).
_BODIES: dict[Endpoint, dict[str, Any]] = {
    Endpoint.EMBEDDINGS: {"input": ["a b", "c"], "encoding_format": "float"},
    Endpoint.SCORE: {"text_1": "a", "text_2": ["b", "c"]},
    Endpoint.RERANK: {"query": "a", "documents": ["b", "c"], "top_n": 1},
    Endpoint.POOLING: {"input": "a b"},
    Endpoint.TOKENIZE: {"prompt": "a b", "add_special_tokens": False},
    Endpoint.DETOKENIZE: {"tokens": [5, 6]},
    Endpoint.RESPONSES: {"input": "hi", "max_output_tokens": 3},
}


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of ``name`` whose labels include ``labels`` (0 if absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line[: line.index("}")]))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def response_event(kind: str, **payload: Any) -> bytes:
    """One Responses API event as vLLM 0.32 writes it (``event:`` line, then the data)."""
    data = {**payload, "type": kind}
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _completed(kind: str = "response.completed") -> bytes:
    usage = {"input_tokens": 9, "output_tokens": 3, "total_tokens": 12}
    return response_event(kind, response={"id": "resp_1", "status": "completed", "usage": usage})


async def response_events(
    deltas: int, gap: float = 0.0, end: bytes | None = None
) -> AsyncIterator[bytes]:
    """A Responses stream as vLLM 0.32 sends it (see test_endpoints_real for the real one)."""
    yield response_event("response.created", response={"id": "resp_1", "status": "in_progress"})
    yield response_event("response.in_progress", response={"id": "resp_1"})
    yield response_event("response.output_item.added", item={"id": "msg_1"}, output_index=0)
    part = {"text": "", "type": "output_text"}
    yield response_event("response.content_part.added", part=part, item_id="msg_1")
    for i in range(deltas):
        if gap:
            await asyncio.sleep(gap)
        yield response_event("response.output_text.delta", delta=f" w{i}", item_id="msg_1")
    yield response_event("response.output_text.done", text="...", item_id="msg_1")
    yield _completed() if end is None else end


async def _answer(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
    """A worker answering each path as vLLM 0.32 does (usage as each endpoint reports it)."""
    path = request.url.path
    if path == "/v1/responses":
        if body.get("stream"):
            worker = request.extensions["worker"]
            return worker.sse(response_events(3))  # type: ignore[no-any-return]
        usage = {"input_tokens": 9, "output_tokens": 3, "total_tokens": 12}
        return httpx.Response(200, json={"id": "resp_1", "object": "response", "usage": usage})
    if path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        usage = {"prompt_tokens": 7, "total_tokens": 7}  # rerank sends no completion_tokens
        return httpx.Response(200, json={"id": "score-1", "results": [], "usage": usage})
    if path in ("/tokenize", "/detokenize"):
        return httpx.Response(200, json={"count": 2, "tokens": [5, 6], "max_model_len": 1024})
    if path == "/v1/audio/transcriptions":
        return httpx.Response(
            200,
            content=(SAMPLES / "transcription.json").read_bytes(),
            headers={"content-type": "application/json"},
        )
    return httpx.Response(200, json={"id": "x", "object": "list", "data": [], "usage": USAGE})


class Worker(FakeWorker):
    """A fake worker that hands itself to its handler (for ``sse``)."""

    async def handle(self, request: httpx.Request) -> httpx.Response:
        request.extensions["worker"] = self
        return await super().handle(request)


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[str, Worker]]:
    worker = Worker(_answer)
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        yield url, worker


@pytest.mark.parametrize(
    "path",
    sorted(
        set(ENDPOINT_PATHS)
        - {"/v1/chat/completions", "/v1/completions", "/v1/audio/transcriptions"}
    ),
)
async def test_each_path_is_relayed_by_model_untouched_to_the_same_path(
    gateway: tuple[str, Worker], path: str
) -> None:
    url, worker = gateway
    endpoint = ENDPOINT_PATHS[path]
    # Odd spacing and key order: the worker must get the client's bytes, not a re-encoding.
    raw = b'{"model" :"fake-model",  "user":"u1", ' + json.dumps(_BODIES[endpoint])[1:].encode()
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"]
        assert worker.received[-1] == (path, raw)
        metrics = (await client.get("/metrics")).text
    ok = {"endpoint": endpoint.value, "model": MODEL, "outcome": "ok"}
    assert _metric(metrics, "gateway_requests_total", **ok) == 1
    tokens_in = _metric(metrics, "gateway_prompt_tokens_total", model=MODEL)
    slo = _metric(metrics, "gateway_slo_requests_total", model=MODEL, result="met")
    e2e = _metric(metrics, "gateway_e2e_request_latency_seconds_count", model=MODEL)
    if endpoint.cost is Cost.NONE:
        # The tokenizer's answers: counted, but no service level, no latency histograms.
        assert (tokens_in, slo, e2e) == (0, 0, 0)
        assert _metric(metrics, "gateway_admission_decisions_total", decision="admitted") == 0
    else:
        # Prompt tokens from usage (rerank's has no completion_tokens); the whole answer's
        # latency, judged against the tier (a prefill-only one on its TTFT target).
        assert tokens_in == (9 if endpoint is Endpoint.RESPONSES else 7)
        assert (slo, e2e) == (1, 1)
        assert _metric(metrics, "gateway_admission_decisions_total", decision="admitted") == 1


async def test_unknown_paths_stay_404_and_other_methods_405(gateway: tuple[str, Worker]) -> None:
    url, worker = gateway
    async with httpx.AsyncClient(base_url=url) as client:
        for path in (
            "/v1/classify",
            "/v1/embeddings/x",
            "/v1/responses/resp_1/cancel",
            "/v3/rerank",
        ):
            r = await client.post(path, json={"model": MODEL})
            assert r.status_code == 404, path
            assert r.json()["error"]["code"] == "not_found"
        r = await client.get("/v1/embeddings")
        assert r.status_code == 405
        r = await client.options(
            "/v1/embeddings",
            headers={"origin": "http://ui.example", "access-control-request-method": "POST"},
        )
        assert r.status_code == 405  # CORS is off by default
    assert worker.received == []


async def test_unknown_model_is_404_before_any_worker_is_asked(
    gateway: tuple[str, Worker],
) -> None:
    url, worker = gateway
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.post("/v1/embeddings", json={"model": "nope", "input": "a"})
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found"
        # No model: the only one served, as vLLM does.
        r = await client.post("/tokenize", json={"prompt": "a"})
        assert r.status_code == 200
        r = await client.post("/v1/embeddings", json={"model": 3, "input": "a"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "model"
    assert [path for path, _ in worker.received] == ["/tokenize"]


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-slo-ttft-ms", "0"),
        ("x-slo-ttft-ms", "-20"),
        ("x-slo-tpot-ms", "fast"),
        ("x-slo-tpot-ms", "1e3"),
        ("x-llm-d-slo-ttft-ms", "nan"),
        ("x-llm-d-slo-tpot-ms", "3600001"),
    ],
)
async def test_a_bad_slo_header_is_a_400_naming_it_before_any_worker_is_asked(
    gateway: tuple[str, Worker], header: str, value: str
) -> None:
    url, worker = gateway
    async with httpx.AsyncClient(base_url=url) as client:
        r = await client.post(
            "/v1/embeddings", json={"model": MODEL, "input": "a"}, headers={header: value}
        )
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (header, "invalid_header_value")
    assert header in error["message"]
    assert worker.received == []


@pytest.mark.parametrize("honoured", [True, False])
async def test_slo_headers_judge_goodput_unless_turned_off(honoured: bool) -> None:
    worker = Worker(_answer)
    settings = settings_for(WORKER, slo_headers=honoured)
    async with running_gateway(settings, worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            headers = {"x-slo-ttft-ms": "0.001", "x-slo-tpot-ms": "abc"}
            r = await client.post(
                "/v1/embeddings", json={"model": MODEL, "input": "a"}, headers=headers
            )
            assert r.status_code == (400 if honoured else 200)
            del headers["x-slo-tpot-ms"]
            r = await client.post(
                "/v1/embeddings", json={"model": MODEL, "input": "a"}, headers=headers
            )
            assert r.status_code == 200
            metrics = (await client.get("/metrics")).text
    # A microsecond for the whole answer: missed when honoured, the tier's 5 s otherwise.
    missed = _metric(metrics, "gateway_slo_requests_total", model=MODEL, result="missed_e2e")
    met = _metric(metrics, "gateway_slo_requests_total", model=MODEL, result="met")
    assert (missed, met) == ((1, 0) if honoured else (0, 2))


async def test_responses_stream_is_relayed_event_by_event_and_timed_on_its_deltas() -> None:
    gap = 0.05

    async def answer(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        return worker.sse(response_events(4, gap=gap))

    worker = FakeWorker(answer)
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            body = {"model": MODEL, "input": "hi", "stream": True}
            arrivals: list[tuple[float, bytes]] = []
            raw = json.dumps(body).encode()
            async with client.stream("POST", "/v1/responses", content=raw) as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                async for data in r.aiter_raw():
                    arrivals.append((asyncio.get_running_loop().time(), data))
            metrics = (await client.get("/metrics")).text
    # Untouched: the client gets exactly the worker's events, the usage-bearing end included.
    expected = [event async for event in response_events(4)]
    assert b"".join(data for _, data in arrivals) == b"".join(expected)
    deltas = [at for at, data in arrivals if b"output_text.delta" in data]
    assert len(deltas) == 4  # each delta arrived in a read of its own, as the worker sent it
    assert all(later - earlier > gap / 2 for earlier, later in itertools.pairwise(deltas))
    # TTFT is the first delta (not response.created); ITL the gaps between the deltas.
    assert _metric(metrics, "gateway_time_to_first_token_seconds_count", model=MODEL) == 1
    ttft = _metric(metrics, "gateway_time_to_first_token_seconds_sum", model=MODEL)
    assert ttft >= gap
    assert _metric(metrics, "gateway_inter_token_latency_seconds_count", model=MODEL) == 3
    assert _metric(metrics, "gateway_inter_token_latency_seconds_sum", model=MODEL) >= 3 * gap * 0.8
    assert _metric(metrics, "gateway_prompt_tokens_total", model=MODEL) == 9
    assert _metric(metrics, "gateway_completion_tokens_total", model=MODEL) == 3
    assert _metric(metrics, "gateway_slo_requests_total", model=MODEL, result="met") == 1
    # Nothing was added to the request: the Responses API always reports its usage.
    assert worker.received[-1][1] == raw


async def test_responses_stream_cut_short_or_failed_is_an_error_not_ok() -> None:
    ends = iter([b"", response_event("response.failed", response={"id": "resp_1"})])

    async def answer(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        return worker.sse(response_events(2, end=next(ends)))

    worker = FakeWorker(answer)
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            body = {"model": MODEL, "input": "hi", "stream": True}
            cut = (await client.post("/v1/responses", json=body)).content
            failed = (await client.post("/v1/responses", json=body)).content
            metrics = (await client.get("/metrics")).text
    # No response.completed: the stream was cut, and the client is told in-band.
    assert cut.endswith(b"\n\n")
    assert b'"error"' in cut.rsplit(b"\n\n", 2)[-2]
    assert b"response.completed" in cut.rsplit(b"\n\n", 2)[-2]  # the message names what's missing
    # response.failed ends the stream: relayed as it is, nothing added after it.
    assert failed.endswith(response_event("response.failed", response={"id": "resp_1"}))
    errors = _metric(
        metrics, "gateway_requests_total", endpoint="responses", outcome="upstream_error"
    )
    assert errors == 2
    assert _metric(metrics, "gateway_slo_requests_total", model=MODEL, result="errored") == 2


async def test_a_disconnect_mid_responses_stream_cancels_the_worker_request() -> None:
    async def answer(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        return worker.sse(response_events(1000, gap=0.01))

    worker = FakeWorker(answer)
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            body = {"model": MODEL, "input": "hi", "stream": True}
            async with client.stream("POST", "/v1/responses", json=body) as r:
                async for data in r.aiter_raw():
                    if b"output_text.delta" in data:
                        break
            await asyncio.wait_for(worker.cancelled.wait(), 5)
            metrics = (await client.get("/metrics")).text
    cancelled = _metric(
        metrics, "gateway_requests_total", endpoint="responses", outcome="client_cancelled"
    )
    assert cancelled == 1


async def test_embeddings_fail_over_before_the_first_byte_and_4xx_is_the_workers() -> None:
    def broken(status: int) -> FakeWorker:
        async def answer(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
            return httpx.Response(
                status,
                json={"error": {"message": f"worker says {status}", "type": "x", "code": status}},
            )

        return FakeWorker(answer)

    a, b = broken(500), FakeWorker(_answer)
    settings = settings_for("http://a:1,http://b:1", routing="round_robin")
    async with running_gateway(settings, fleet({"a:1": a, "b:1": b})) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            for _ in range(2):
                r = await client.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
                assert r.status_code == 200, r.text
            assert len(b.received) == 2
            assert len(a.received) >= 1
            metrics = (await client.get("/metrics")).text
        assert _metric(metrics, "gateway_worker_failovers_total", worker="a:1") >= 1
    c = broken(400)
    async with running_gateway(settings_for(WORKER), c.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/score", json={"model": MODEL, "text_1": "x"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "worker says 400"
    assert len(c.received) == 1  # a 4xx is never retried


def _form(fields: list[tuple[str, str]], audio: bytes, boundary: str = "b0undary") -> bytes:
    """A multipart/form-data body as a client would send it (``file`` among the fields)."""
    parts = []
    for name, value in fields:
        if name == "file":
            parts.append(
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
                f'filename="a.wav"\r\nContent-Type: audio/wav\r\n\r\n'.encode()
                + audio
                + b"\r\n"
            )
        else:
            parts.append(
                f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
                f"{value}\r\n".encode()
            )
    return b"".join(parts) + f"--{boundary}--\r\n".encode()


async def test_a_transcription_upload_goes_to_the_worker_as_it_came_routed_by_its_form() -> None:
    # The model field after a file that holds a look-alike of it: only the real field counts.
    audio = b"RIFF" + b'name="model"\r\n\r\nnope' + bytes(range(256)) * 4000
    body = _form([("file", ""), ("language", "en"), ("model", MODEL)], audio)
    worker = Worker(_answer)
    other = Worker(_answer, cards=[{"id": "other-model", "object": "model"}])
    settings = settings_for("http://a:1,http://b:1")
    async with running_gateway(settings, fleet({"a:1": worker, "b:1": other})) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            headers = {"content-type": "multipart/form-data; boundary=b0undary"}
            r = await client.post("/v1/audio/transcriptions", content=body, headers=headers)
            assert r.status_code == 200, r.text
            assert r.content == (SAMPLES / "transcription.json").read_bytes()
            assert worker.received == [("/v1/audio/transcriptions", body)]
            assert other.received == []
            # The same upload streamed in small pieces (chunked, no length given).
            pieces = [body[i : i + 1000] for i in range(0, len(body), 1000)]

            async def trickle() -> AsyncIterator[bytes]:
                for piece in pieces:
                    yield piece

            r = await client.post("/v1/audio/transcriptions", content=trickle(), headers=headers)
            assert r.status_code == 200, r.text
            assert worker.received[-1] == ("/v1/audio/transcriptions", body)
            metrics = (await client.get("/metrics")).text
    assert _metric(metrics, "gateway_requests_total", endpoint="transcriptions", outcome="ok") == 2


async def test_a_transcription_is_refused_when_its_form_is_not_one_or_too_large() -> None:
    worker = Worker(_answer)
    settings = settings_for(WORKER, max_body_bytes=50_000)
    async with running_gateway(settings, worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            path = "/v1/audio/transcriptions"
            form = {"content-type": "multipart/form-data; boundary=b0undary"}
            r = await client.post(path, json={"model": MODEL})
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "invalid_content_type"
            big = _form([("model", MODEL), ("file", "")], bytes(60_000))
            r = await client.post(path, content=big, headers=form)
            assert r.status_code == 413

            async def chunked() -> AsyncIterator[bytes]:
                yield big[:30_000]
                yield big[30_000:]

            r = await client.post(path, content=chunked(), headers=form)
            assert r.status_code == 413  # no length given: cut when it crosses the limit
            r = await client.post(path, content=big[:1000], headers=form)
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "invalid_form"
            r = await client.post(
                path, content=_form([("model", MODEL), ("stream", "maybe")], b""), headers=form
            )
            assert r.status_code == 400
            assert r.json()["error"]["param"] == "stream"
    assert worker.received == []


async def test_a_streamed_transcription_is_relayed_and_timed_like_chat() -> None:
    stream = (SAMPLES / "transcription_stream_usage.txt").read_bytes()

    async def events() -> AsyncIterator[bytes]:
        for event in stream.split(b"\n\n")[:-1]:
            yield event + b"\n\n"

    async def answer(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        return worker.sse(events())

    worker = FakeWorker(answer)
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            form = _form(
                [
                    ("model", MODEL),
                    ("stream", "true"),
                    ("stream_include_usage", "true"),
                    ("file", ""),
                ],
                b"RIFF....",
            )
            headers = {"content-type": "multipart/form-data; boundary=b0undary"}
            r = await client.post("/v1/audio/transcriptions", content=form, headers=headers)
            metrics = (await client.get("/metrics")).text
    assert r.content == stream
    assert _metric(metrics, "gateway_time_to_first_token_seconds_count", model=MODEL) == 1
    assert _metric(metrics, "gateway_completion_tokens_total", model=MODEL) == 4


async def test_version_is_answered_by_a_worker() -> None:
    worker = FakeWorker(_answer)
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.get("/version")
            assert r.status_code == 200
            assert r.json() == {"version": "0.32.0"}
            worker.healthy = False
            for _ in range(100):
                if (await client.get("/readyz")).status_code == 503:
                    break
                await asyncio.sleep(0.05)
            r = await client.get("/version")
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "no_worker"
            metrics = (await client.get("/metrics")).text
    assert _metric(metrics, "gateway_requests_total", endpoint="version", outcome="ok") == 1


async def test_lora_adapters_are_models_with_their_parent_routed_to_the_workers_serving_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # vLLM 0.32's /v1/models with --enable-lora --lora-modules tiny-lora=...: the CPU build
    # here cannot load an adapter onto the random-weight model, so the page is vLLM's own
    # ModelList as that worker would send it (tests/data/vllm_samples/README.md).
    page = json.loads((SAMPLES / "models_lora.json").read_text())
    with_lora = Worker(_answer, cards=page["data"])
    base_only = Worker(_answer, cards=[page["data"][0]])
    settings = settings_for("http://a:1,http://b:1", routing="round_robin")
    async with running_gateway(settings, fleet({"a:1": with_lora, "b:1": base_only})) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            models = (await client.get("/v1/models")).json()
            assert models["data"] == page["data"]  # every field, as vLLM sent it
            for _ in range(4):
                r = await client.post("/v1/embeddings", json={"model": "tiny-lora", "input": "x"})
                assert r.status_code == 200
            for _ in range(4):
                r = await client.post("/tokenize", json={"model": "tiny-llama", "prompt": "x"})
                assert r.status_code == 200
            metrics = (await client.get("/metrics")).text
    assert [path for path, _ in with_lora.received].count("/v1/embeddings") == 4
    assert all(path == "/tokenize" for path, _ in base_only.received)
    assert len(base_only.received) == 2  # the base model goes to both
    assert _metric(metrics, "gateway_requests_total", model="tiny-lora", endpoint="embeddings") == 4


async def test_cors_preflight_gets_the_configured_origin_an_id_and_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = FakeWorker(_answer)
    origin = "https://chat.example.com"
    settings = settings_for(WORKER, cors_origins=f"{origin}, http://other.example", access_log=True)
    async with running_gateway(settings, worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            with caplog.at_level(logging.INFO, logger="app.access"):
                preflight = {
                    "origin": origin,
                    "access-control-request-method": "POST",
                    "access-control-request-headers": "authorization, content-type, x-stainless-os",
                }
                r = await client.options("/v1/responses", headers=preflight)
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == origin
            assert "POST" in r.headers["access-control-allow-methods"]
            assert "x-stainless-os" in r.headers["access-control-allow-headers"]
            request_id = r.headers["x-request-id"]
            lines = [rec.getMessage() for rec in caplog.records if rec.name == "app.access"]
            assert len([line for line in lines if request_id in line]) == 1
            r = await client.options(
                "/v1/responses", headers={**preflight, "origin": "https://evil.example"}
            )
            assert r.status_code == 400
            assert "access-control-allow-origin" not in r.headers
            # The answer itself: the browser may read the gateway's headers.
            r = await client.post(
                "/v1/embeddings", json={"model": MODEL, "input": "x"}, headers={"origin": origin}
            )
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == origin
            exposed = {h.strip() for h in r.headers["access-control-expose-headers"].split(",")}
            assert exposed == {
                "x-request-id",
                "retry-after",
                "retry-after-ms",
                "x-gateway-tier",
                "x-gateway-queue-ms",
            }
            metrics = (await client.get("/metrics")).text
    preflights = _metric(metrics, "gateway_requests_total", endpoint="responses", model="")
    assert preflights == 2


async def test_cors_origins_read_as_a_json_list_or_comma_separated() -> None:
    assert settings_for(WORKER, cors_origins='["https://a.example", "*"]').cors_origins == [
        "https://a.example",
        "*",
    ]
    assert settings_for(
        WORKER, cors_origins="https://a.example, https://b.example"
    ).cors_origins == [
        "https://a.example",
        "https://b.example",
    ]
    assert settings_for(WORKER).cors_origins == []


async def test_tokenizer_requests_pass_a_full_worker_while_engine_work_queues() -> None:
    release = asyncio.Event()

    started = asyncio.Event()

    async def answer(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            started.set()

            async def held() -> AsyncIterator[bytes]:
                await release.wait()
                async for event in tokens(2):
                    yield event

            return worker.sse(held())
        return await _answer(request, body)

    worker = Worker(answer)
    settings = settings_for(WORKER, max_running_per_worker=1)
    async with running_gateway(settings, worker.transport) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
            running = asyncio.create_task(client.post("/v1/chat/completions", json=chat))
            await asyncio.wait_for(started.wait(), 5)
            # The worker's one slot is taken: an embedding (a prefill) waits for it ...
            queued = asyncio.create_task(
                client.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
            )
            await asyncio.sleep(0.2)
            assert not queued.done()
            # ... while the tokenizer, which no engine slot serves, answers at once.
            r = await client.post("/tokenize", json={"model": MODEL, "prompt": "x"})
            assert r.status_code == 200
            assert r.headers["x-gateway-queue-ms"] == "0.0"
            release.set()
            assert (await running).status_code == 200
            r = await queued
            assert r.status_code == 200
            assert float(r.headers["x-gateway-queue-ms"]) >= 150


async def test_a_burst_of_embeddings_does_not_starve_interactive_chat() -> None:
    """Embeddings are prefills that hold a slot; a higher tier's chat still goes first."""
    hold = 0.15

    async def answer(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        await asyncio.sleep(hold)  # each embedding holds its slot this long
        if request.url.path == "/v1/chat/completions":
            return worker.sse(tokens(2))
        return await _answer(request, body)

    worker = Worker(answer)
    keys = [
        {"sha256": hashlib.sha256(b"sk-rag").hexdigest(), "name": "rag", "tier": "standard"},
        {"sha256": hashlib.sha256(b"sk-chat").hexdigest(), "name": "chat", "tier": "interactive"},
    ]
    settings = settings_for(WORKER, api_keys=keys, max_running_per_worker=2)
    async with running_gateway(settings, worker.transport) as url:
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            rag = {"authorization": "Bearer sk-rag"}
            burst = [
                asyncio.create_task(
                    client.post(
                        "/v1/embeddings", json={"model": MODEL, "input": f"d{i}"}, headers=rag
                    )
                )
                for i in range(12)
            ]
            await asyncio.sleep(hold / 2)  # the burst holds both slots, the rest queue
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
            r = await client.post(
                "/v1/chat/completions", json=chat, headers={"authorization": "Bearer sk-chat"}
            )
            assert r.status_code == 200
            chat_done = asyncio.get_running_loop().time()
            done_before = sum(task.done() for task in burst)
            results = await asyncio.gather(*burst)
    assert all(res.status_code == 200 for res in results)
    # The chat took the first slot that came free: it waited for at most the two embeddings
    # running when it came, not for the ten queued before it.
    assert float(r.headers["x-gateway-queue-ms"]) < 2.5 * hold * 1000
    assert done_before <= 4, done_before
    order = [path for path, _ in worker.received]
    assert order.index("/v1/chat/completions") <= 4, order
    assert chat_done > 0


class _ChatAndEmbeddings(RecordedWorker):
    """A recorded chat worker that also answers embeddings (which carry no fingerprint)."""

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/embeddings":
            return httpx.Response(200, json={"object": "list", "data": [], "usage": USAGE})
        return await super().handle(request)


async def test_an_embedding_answer_does_not_change_what_chat_streams_carry() -> None:
    """Only chat and text completions tell the worker's ``system_fingerprint``.

    An embedding has none; taken as the worker's, chat streams would lose the fingerprint the
    relay puts back on their finish chunks.
    """
    case = CASES["chat_length_absent"]
    worker = _ChatAndEmbeddings({case["upstream_request"].encode(): _as_direct(case)})
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            body = {"model": "tiny-llama", "input": "x"}
            assert (await client.post("/v1/embeddings", json=body)).status_code == 200
        relayed = await _relayed(url, case)
    assert worker.unexpected == []
    assert relayed == case["direct"].encode()

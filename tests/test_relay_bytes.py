"""The client gets the bytes vLLM would have sent it, replayed from recordings of a real worker.

``tests/data/vllm_streams/streams.json`` (``python -m scripts.record_streams``) holds, for every
``stream_options`` combination, n=2, logprobs, and finish on length and on stop, chat and
completions: the worker's stream for the client's own request (``direct``) and for the request
the gateway sends in its place (``upstream``). A scripted worker serves the ``upstream`` bytes,
one event per write as vLLM sends them, with the ids and timestamps of the ``direct`` stream; the
gateway's answer must be the ``direct`` stream, byte for byte. The gateway's only changes to a
stream are its documented ones: it asks for usage, and takes the usage chunk out again (and puts
back the ``system_fingerprint`` that vLLM moves onto it) when the client did not ask for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.servers import running_gateway, settings_for

WORKER = "http://recorded-worker:8100"
RECORDED = json.loads(
    (Path(__file__).parent / "data" / "vllm_streams" / "streams.json").read_text(encoding="utf-8")
)
CASES: dict[str, dict[str, Any]] = {case["name"]: case for case in RECORDED["cases"]}
_ID = re.compile(rb'"id":"([^"]+)","object":"[^"]+","created":(\d+)')


def _events(raw: bytes) -> list[bytes]:
    return [event + b"\n\n" for event in raw.split(b"\n\n") if event]


def _as_direct(case: dict[str, Any]) -> list[bytes]:
    """The worker's answer to the gateway's request, with the direct stream's id and time."""
    direct, upstream = case["direct"].encode(), case["upstream"].encode()
    mine, theirs = _ID.search(direct), _ID.search(upstream)
    assert mine is not None
    assert theirs is not None
    events = []
    for event in _events(upstream):
        event = event.replace(b'"id":"' + theirs[1] + b'"', b'"id":"' + mine[1] + b'"')
        event = event.replace(b'"created":' + theirs[2], b'"created":' + mine[2])
        events.append(event)
    return events


def _canonical(body: bytes) -> str:
    return json.dumps(json.loads(body), sort_keys=True)


class RecordedWorker:
    """Answers each request with the recorded stream whose request it is."""

    def __init__(self, answers: dict[bytes, list[bytes]]) -> None:
        # By what the request says, not its bytes: members the gateway adds may go anywhere.
        self.answers = {_canonical(request): events for request, events in answers.items()}
        self.unexpected: list[bytes] = []
        self.transport = httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        """Serve /v1/models, /health, /metrics, and the recorded streams."""
        if request.url.path == "/v1/models":
            card = {"id": "tiny-llama", "object": "model", "root": "tiny-llama"}
            return httpx.Response(200, json={"object": "list", "data": [card]})
        if request.url.path in ("/health", "/metrics"):
            return httpx.Response(200, text="")
        body = await request.aread()
        events = self.answers.get(_canonical(body))
        if events is None:
            self.unexpected.append(body)
            return httpx.Response(500, json={"error": {"message": "not a recorded request"}})

        async def stream() -> AsyncIterator[bytes]:
            for event in events:
                yield event

        return httpx.Response(
            200, headers={"content-type": "text/event-stream; charset=utf-8"}, content=stream()
        )


async def _relayed(url: str, case: dict[str, Any]) -> bytes:
    async with (
        httpx.AsyncClient(base_url=url, timeout=10) as client,
        client.stream(
            "POST",
            case["path"],
            content=case["request"].encode(),
            headers={"content-type": "application/json"},
        ) as response,
    ):
        assert response.status_code == 200, await response.aread()
        return b"".join([data async for data in response.aiter_raw()])


def test_the_recordings_cover_every_case_the_issue_names() -> None:
    names = set(CASES)
    for endpoint in ("chat", "text"):
        for options in (
            "absent", "empty", "usage", "usage_false", "continuous", "usage_false_continuous",
            "usage_continuous", "usage_continuous_false",
        ):  # fmt: skip
            assert f"{endpoint}_length_{options}" in names
        for kind in ("n2", "logprobs", "stop"):
            assert {f"{endpoint}_{kind}_absent", f"{endpoint}_{kind}_usage"} <= names
    finishes = {
        reason
        for case in CASES.values()
        for reason in re.findall(r'"finish_reason":"(\w+)"', case["direct"])
    }
    assert finishes == {"length", "stop"}


@pytest.mark.parametrize("name", sorted(CASES))
async def test_the_client_gets_what_vllm_would_have_sent_it(name: str) -> None:
    case = CASES[name]
    direct = case["direct"].encode()
    worker = RecordedWorker({case["upstream_request"].encode(): _as_direct(case)})
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        # The first stream from a worker: its fingerprint is learnt on the way; then known.
        first = await _relayed(url, case)
        second = await _relayed(url, case)
    assert worker.unexpected == [], "the gateway sent the worker a request not recorded"
    assert first == direct
    assert second == direct


async def test_a_worker_that_always_sends_usage_is_relayed_as_it_is() -> None:
    """vLLM's ``--enable-force-include-usage`` sends usage in every chunk whatever was asked."""
    forced = CASES["chat_length_usage_continuous"]
    asked_nothing = CASES["chat_length_absent"]
    events = _events(forced["upstream"].encode())
    worker = RecordedWorker({asked_nothing["upstream_request"].encode(): events})
    async with running_gateway(settings_for(WORKER), worker.transport) as url:
        relayed = await _relayed(url, asked_nothing)
    assert relayed == forced["upstream"].encode()


class OneWriteWorker:
    """A worker on a real socket that writes a whole stream's HTTP chunks in one write.

    As a worker's events reach a relay that fell behind: several in one socket read.
    """

    def __init__(self, events: list[bytes], dies: bool = False) -> None:
        self.events = events
        self.dies = dies
        """Drop the connection after the events, with no last chunk."""
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length:\s*(\d+)", head)
                await reader.readexactly(int(length[1]) if length else 0)
                path = head.split(b" ", 2)[1]
                if path.startswith(b"/v1/models"):
                    card = {"id": "tiny-llama", "object": "model", "root": "tiny-llama"}
                    body = json.dumps({"object": "list", "data": [card]}).encode()
                    writer.write(_response(b"application/json", body))
                elif not path.startswith(b"/v1/chat/completions"):
                    writer.write(_response(b"text/plain", b""))
                else:
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                        b"transfer-encoding: chunked\r\n\r\n"
                        + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in self.events)
                        + (b"" if self.dies else b"0\r\n\r\n")
                    )
                    if self.dies:
                        await writer.drain()
                        writer.transport.abort()
                        return
                await writer.drain()
        writer.close()


def _response(content_type: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type
        + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    )  # fmt: skip


async def _http_chunks(url: str, body: bytes) -> list[bytes]:
    """The HTTP chunks of the gateway's answer to ``body``, read off the socket as sent."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    )
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), raw
    chunks: list[bytes] = []
    while True:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return chunks
        chunks.append(rest[:n])
        rest = rest[n + 2 :]


async def test_events_that_arrive_together_leave_as_the_chunks_the_worker_wrote() -> None:
    """Never re-chunked: each event the worker wrote as a chunk reaches the client as one."""
    case = CASES["chat_length_usage"]
    events = _as_direct(case)
    async with OneWriteWorker(events) as worker_url:
        async with running_gateway(settings_for(worker_url)) as url:
            chunks = await _http_chunks(url, case["request"].encode())
    assert len(events) > 3
    assert chunks == _events(case["direct"].encode())


async def test_a_worker_that_drops_the_connection_mid_stream_gets_an_in_band_error() -> None:
    """On a real socket, through the worker transport's own chunk reader."""
    case = CASES["chat_length_usage"]
    events = _as_direct(case)[:3]  # the role chunk and two tokens, then the connection drops
    async with OneWriteWorker(events, dies=True) as worker_url:
        async with running_gateway(settings_for(worker_url)) as url:
            chunks = await _http_chunks(url, case["request"].encode())
            async with httpx.AsyncClient(base_url=url) as client:
                metrics = (await client.get("/metrics")).text
    assert chunks[:3] == events
    error = json.loads(chunks[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_invalid_response"
    assert not any(b"[DONE]" in c for c in chunks)
    assert 'outcome="upstream_error"' in metrics


async def test_a_worker_that_drops_the_connection_after_its_end_leaves_the_answer_whole() -> None:
    """No error after [DONE]: the client has its whole answer, and it counts as given."""
    case = CASES["chat_length_usage"]
    async with OneWriteWorker(_as_direct(case), dies=True) as worker_url:
        async with running_gateway(settings_for(worker_url)) as url:
            chunks = await _http_chunks(url, case["request"].encode())
            async with httpx.AsyncClient(base_url=url) as client:
                for _ in range(100):  # the request is counted just after its body ends
                    metrics = (await client.get("/metrics")).text
                    if re.search(r"gateway_requests_total\{[^}]*\} 1\.0", metrics):
                        break
                    await asyncio.sleep(0.02)
    assert chunks == _events(case["direct"].encode())
    assert re.search(r'gateway_requests_total\{[^}]*outcome="ok"[^}]*\} 1\.0', metrics)
    assert re.search(r"gateway_failover_seconds_count\{[^}]*\} 0\.0", metrics)

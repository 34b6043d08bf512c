"""A fixed-timing, OpenAI-compatible streaming worker that costs next to no CPU.

It stands in for vLLM when measuring what the gateway adds: token ``i`` (0-based) of a stream is
written at ``t0 + ttft + i * itl``, where ``t0`` is when the request was fully read. Every write
is a timer callback scheduled at an absolute ``loop.call_at`` deadline, so lateness never
accumulates, and the HTTP/1.1 server is a bare ``asyncio.Protocol`` (on uvloop when installed):
no framework, no per-token coroutine, no JSON encoding on the token path.

The SSE events copy vLLM's byte for byte (compact JSON, ``data: ...\\n\\n``, one HTTP chunk per
event): a role-only chunk right before the first token, one token per chunk, the last token
carrying ``finish_reason``, an optional usage chunk, then ``data: [DONE]``.

Run ``python -m bench.fake_worker --port 8100 --ttft-ms 20 --itl-ms 10 --tokens 32``, or start it
inside a test with :func:`serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from bench.worker_http import (
    WorkerConnection,
    dumps,
    error_body,
    run_until_interrupted,
)

_DONE: Final = b"data: [DONE]\n\n"
_CHUNK_END: Final = b"\r\n"
_LAST_CHUNK: Final = b"0\r\n\r\n"


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """The worker's fixed behaviour."""

    ttft_ms: float = 20.0
    """Request fully read to first token (and the role chunk just before it)."""
    itl_ms: float = 10.0
    """Between consecutive tokens."""
    tokens: int = 32
    """Tokens per response when the request sets no ``max_tokens``."""
    model: str = "fake-model"
    max_model_len: int = 1024
    max_num_seqs: int = 256
    """Capacity behind ``vllm:kv_cache_usage_perc``: running requests / this."""


def token_text(i: int) -> str:
    """The text of token ``i``: never empty, never starting with a quote, JSON-safe as is."""
    return f" tok{i}"


def prompt_tokens(body: dict[str, Any]) -> int:
    """A deterministic stand-in for the prompt's token count: its whitespace-separated words."""
    words = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                words += len(content.split())
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        words += len(part["text"].split())
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        words += len(prompt.split())
    elif isinstance(prompt, list):
        words += sum(len(p.split()) if isinstance(p, str) else 1 for p in prompt)
    return max(1, words)


def http_chunk(payload: bytes) -> bytes:
    """``payload`` framed as one HTTP/1.1 chunk."""
    return b"%x\r\n%b\r\n" % (len(payload), payload)


class WorkerStats:
    """Counters shared by every connection of one worker (read by ``/metrics`` and tests)."""

    __slots__ = ("cancelled", "completed", "connections", "running", "started")

    def __init__(self) -> None:
        self.connections = 0
        """TCP connections accepted: shows whether a client reuses keep-alive connections."""
        self.running = 0
        """Generations in flight (streamed or not)."""
        self.started = 0
        self.completed = 0
        self.cancelled = 0
        """Generations stopped because the client went away."""


class _Stream:
    """One generation's timer chain; each tick writes one event and schedules the next."""

    __slots__ = (
        "_chat",
        "_created",
        "_done_cb",
        "_handle",
        "_head",
        "_i",
        "_include_usage",
        "_itl",
        "_loop",
        "_model",
        "_n",
        "_prompt",
        "_rid",
        "_t_first",
        "_tail",
        "_tail_last",
        "_transport",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        transport: asyncio.Transport,
        *,
        chat: bool,
        rid: str,
        model_json: str,
        n: int,
        prompt: int,
        include_usage: bool,
        t_first: float,
        itl: float,
        done_cb: Callable[[bool], None],
    ) -> None:
        self._loop = loop
        self._transport = transport
        self._chat = chat
        self._rid = rid
        self._model = model_json
        self._created = int(time.time())
        self._n = n
        self._prompt = prompt
        self._include_usage = include_usage
        self._t_first = t_first
        self._itl = itl
        self._done_cb = done_cb
        self._i = 0
        # Everything around the token text is fixed for the stream: build it once.
        obj = "chat.completion.chunk" if chat else "text_completion"
        prefix = (
            f'{{"id":"{rid}","object":"{obj}","created":{self._created},'
            f'"model":{model_json},"choices":[{{"index":0,'
        )
        if chat:
            self._head = (prefix + '"delta":{"content":').encode()
            self._tail = b'},"logprobs":null,"finish_reason":null}]}'
            self._tail_last = b'},"logprobs":null,"finish_reason":"length","stop_reason":null}]}'
        else:
            self._head = (prefix + '"text":').encode()
            self._tail = b',"logprobs":null,"finish_reason":null}]}'
            self._tail_last = b',"logprobs":null,"finish_reason":"length","stop_reason":null}]}'
        self._handle: asyncio.TimerHandle | None = loop.call_at(t_first, self._tick)

    def _tick(self) -> None:
        transport = self._transport
        if transport.is_closing():
            self.cancel()
            return
        i = self._i
        if i == 0 and self._chat:
            role = (
                f'{{"id":"{self._rid}","object":"chat.completion.chunk","created":{self._created},'
                f'"model":{self._model},"choices":[{{"index":0,"delta":{{"role":"assistant",'
                f'"content":""}},"logprobs":null,"finish_reason":null}}]}}'
            ).encode()
            transport.write(http_chunk(b"data: " + role + b"\n\n"))
        last = i == self._n - 1
        text = dumps(token_text(i))
        event = b"data: " + self._head + text + (self._tail_last if last else self._tail) + b"\n\n"
        transport.write(http_chunk(event))
        if not last:
            self._i = i + 1
            # Absolute deadlines: a late tick does not push back the ones after it.
            self._handle = self._loop.call_at(self._t_first + self._i * self._itl, self._tick)
            return
        self._handle = None
        if self._include_usage:
            obj = "chat.completion.chunk" if self._chat else "text_completion"
            usage = (
                f'{{"id":"{self._rid}","object":"{obj}","created":{self._created},'
                f'"model":{self._model},"choices":[],"usage":{{"prompt_tokens":{self._prompt},'
                f'"total_tokens":{self._prompt + self._n},"completion_tokens":{self._n}}}}}'
            ).encode()
            transport.write(http_chunk(b"data: " + usage + b"\n\n"))
        transport.write(http_chunk(_DONE) + _LAST_CHUNK)
        self._done_cb(True)

    def cancel(self) -> None:
        """Stop generating (the client is gone)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
            self._done_cb(False)


class _Connection(WorkerConnection):
    """One keep-alive HTTP/1.1 connection; requests are answered one at a time, in order."""

    def __init__(self, worker: FakeWorker) -> None:
        super().__init__()
        self._worker = worker
        self._loop = asyncio.get_running_loop()
        self._busy = False
        self._stream: _Stream | None = None
        self._delayed: asyncio.TimerHandle | None = None

    @property
    def busy(self) -> bool:
        """Whether a generation is being answered."""
        return self._busy

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._worker.stats.connections += 1

    def lost(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
        if self._delayed is not None:
            self._delayed.cancel()
            self._delayed = None
            self._finish_generation(completed=False)

    def dispatch(self, method: str, path: str, body: bytes) -> None:
        worker = self._worker
        if path in ("/v1/chat/completions", "/v1/completions"):
            if method != "POST":
                self.reply(405, error_body(405, "Method Not Allowed", "BadRequestError"))
                return
            self._generate(path == "/v1/chat/completions", body)
        elif path == "/health":
            self.reply(200, b"", content_type=None)
        elif path == "/v1/models":
            self.reply(200, worker.models_body)
        elif path == "/metrics":
            self.reply(200, worker.metrics_text(), content_type="text/plain; version=0.0.4")
        else:
            self.reply(404, error_body(404, "Not Found", "NotFoundError"))

    def _generate(self, chat: bool, raw: bytes) -> None:
        worker = self._worker
        cfg = worker.config
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as exc:
            self.reply(400, error_body(400, f"invalid JSON body: {exc}", "BadRequestError"))
            return
        model = body.get("model", cfg.model)
        if model != cfg.model:
            message = f"The model `{model}` does not exist."
            self.reply(404, error_body(404, message, "NotFoundError", "model"))
            return
        n = body.get("max_completion_tokens") if chat else None
        if n is None:
            n = body.get("max_tokens")
        if n is None:
            n = cfg.tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            self.reply(400, error_body(400, "max_tokens must be at least 1", "BadRequestError"))
            return
        prompt = prompt_tokens(body)
        if prompt + n > cfg.max_model_len:
            message = (
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                f"you requested {prompt + n} tokens ({prompt} in the messages, {n} in the "
                "completion). Please reduce the length of the messages or completion."
            )
            self.reply(400, error_body(400, message, "BadRequestError"))
            return
        stream = body.get("stream") is True
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        rid = ("chatcmpl-" if chat else "cmpl-") + worker.next_id()
        # A benchmark may pace one request differently from the worker's default (vLLM
        # ignores these fields; the gateway passes unknown fields through).
        ttft_ms, itl_ms = body.get("fake_ttft_ms", cfg.ttft_ms), body.get("fake_itl_ms", cfg.itl_ms)
        if not all(isinstance(v, int | float) and 0 <= v <= 3_600_000 for v in (ttft_ms, itl_ms)):
            self.reply(
                400, error_body(400, "fake_ttft_ms/fake_itl_ms: bad value", "BadRequestError")
            )
            return
        t0 = self._loop.time()
        t_first = t0 + ttft_ms / 1000.0
        itl = itl_ms / 1000.0
        self._busy = True
        worker.stats.running += 1
        worker.stats.started += 1
        if stream:
            assert self.transport is not None
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n"
                + (b"" if self.keep_alive else b"connection: close\r\n")
                + b"\r\n"
            )
            self._stream = _Stream(
                self._loop,
                self.transport,
                chat=chat,
                rid=rid,
                model_json=json.dumps(cfg.model),
                n=n,
                prompt=prompt,
                include_usage=include_usage,
                t_first=t_first,
                itl=itl,
                done_cb=self._stream_done,
            )
            return
        text = "".join(token_text(i) for i in range(n))
        usage = {"prompt_tokens": prompt, "total_tokens": prompt + n, "completion_tokens": n}
        choice: dict[str, Any]
        if chat:
            reply = {"role": "assistant", "content": text, "tool_calls": []}
            choice = {"index": 0, "message": reply}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason="length", stop_reason=None)
        payload = dumps(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": cfg.model,
                "choices": [choice],
                "usage": usage,
            }
        )
        self._delayed = self._loop.call_at(t_first + (n - 1) * itl, self._nonstream_done, payload)

    def _nonstream_done(self, payload: bytes) -> None:
        self._delayed = None
        self._finish_generation(completed=True)
        self._busy = False
        self.reply(200, payload)
        if self.buf:
            self.resume()  # a pipelined request arrived meanwhile

    def _stream_done(self, completed: bool) -> None:
        self._stream = None
        self._finish_generation(completed=completed)
        if not completed:
            return
        self._busy = False
        if not self.keep_alive:
            if self.transport is not None:
                self.transport.close()
            return
        if self.buf:
            self.resume()  # a pipelined request arrived meanwhile

    def _finish_generation(self, *, completed: bool) -> None:
        stats = self._worker.stats
        stats.running -= 1
        if completed:
            stats.completed += 1
        else:
            stats.cancelled += 1


class FakeWorker:
    """The fake worker: its config, its counters, and the server factory."""

    def __init__(self, config: WorkerConfig | None = None) -> None:
        self.config = config or WorkerConfig()
        self.stats = WorkerStats()
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(6)
        cfg = self.config
        card = {
            "id": cfg.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": cfg.model,
            "parent": None,
            "max_model_len": cfg.max_model_len,
        }
        self.models_body = dumps({"object": "list", "data": [card]})

    def next_id(self) -> str:
        """A unique request id suffix (cheaper than a uuid per request)."""
        return f"{self._id_prefix}{next(self._ids):08x}"

    def metrics_text(self) -> bytes:
        """The three vLLM gauges the gateway reads, for this worker's in-flight generations.

        Also ``fake_worker_connections_total``, which the overhead benchmark reads.
        """
        cfg = self.config
        running = self.stats.running
        kv = min(1.0, running / cfg.max_num_seqs)
        label = f'{{model_name="{cfg.model}"}}'
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{label} {float(running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{label} 0.0\n"
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{label} {kv}\n"
            "# HELP fake_worker_connections_total TCP connections accepted.\n"
            "# TYPE fake_worker_connections_total counter\n"
            f"fake_worker_connections_total {self.stats.connections}\n"
        ).encode()

    async def serve(self, host: str, port: int) -> asyncio.Server:
        """Listen on ``host:port`` (0 picks a free port) on the running loop."""
        loop = asyncio.get_running_loop()
        return await loop.create_server(lambda: _Connection(self), host, port, backlog=1024)


async def serve(host: str, port: int, cfg: WorkerConfig | None = None) -> asyncio.Server:
    """Start a :class:`FakeWorker` on the running loop; close the returned server to stop it."""
    return await FakeWorker(cfg).serve(host, port)


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.fake_worker", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--itl-ms", type=float, default=10.0)
    parser.add_argument("--tokens", type=int, default=32, help="when max_tokens is not given")
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="capacity behind vllm:kv_cache_usage_perc"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    args = _parse_args(argv)
    cfg = WorkerConfig(
        ttft_ms=args.ttft_ms,
        itl_ms=args.itl_ms,
        tokens=args.tokens,
        model=args.model,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
    )
    run_until_interrupted("fake_worker", args.host, lambda: serve(args.host, args.port, cfg))


if __name__ == "__main__":
    main()

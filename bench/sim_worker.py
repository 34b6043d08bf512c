"""A simulated GPU-scale vLLM worker: a continuous-batching engine model behind vLLM's API.

It stands in for vLLM on a GPU when measuring admission at the scale where it matters (64-256
sequences at once), on a machine without one. One asyncio loop runs the engine one step at a
time, as vLLM V1's scheduler does:

* Each step schedules, within ``max_num_batched_tokens``, one token for every running sequence
  that decodes, then the prefill chunks of the sequences still prefilling, then new sequences
  from the waiting queue (FIFO, or by the request's ``priority`` field under
  ``--scheduling-policy priority``) while fewer than ``max_num_seqs`` run and the KV cache has
  the blocks for the chunk it would prefill (chunked prefill: a long prompt takes several steps).
* A step takes ``a + b x running + c x prefill tokens scheduled`` (x ``time_scale``); at its end
  every decoding sequence has one more token, and a sequence whose prompt was all prefilled has
  its first. Each token is written as it is made (every ``stream_interval`` tokens, as vLLM's
  ``--stream-interval``), in vLLM's SSE bytes (:mod:`bench.fake_worker`).
* A sequence that needs a KV block when none is free preempts the sequence admitted last (the
  least urgent under priority scheduling), which gives back its blocks and waits, at the head
  of the queue, to prefill its prompt and what it had generated again (vLLM's recompute).
* A client that disconnects aborts its sequence at once: its blocks and its slot are free for
  the next step.

``/metrics`` has the names the gateway reads (running, waiting, waiting by reason, KV-cache
usage, ``cache_config_info``) and TTFT and inter-token histograms, preemptions and successes.
The prompt's length is the words of its text, times ``tokens_per_word``.

Defaults: Llama-3.1-8B in bf16 on one H100 80GB (docs/sim-worker.md says where each comes
from). Run ``python -m bench.sim_worker --port 8200``, or start it in a test with :func:`serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import heapq
import itertools
import json
import math
import secrets
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from bench.fake_worker import http_chunk, prompt_tokens, token_text
from bench.worker_http import WorkerConnection, dumps, error_body, run_until_interrupted

_DONE: Final = b"data: [DONE]\n\n"
_LAST_CHUNK: Final = b"0\r\n\r\n"
_TTFT_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS: Final = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The simulated engine: its limits, its step-time model and its pacing."""

    model: str = "sim-llama-8b"
    max_model_len: int = 8192
    max_num_seqs: int = 256
    """Sequences that may run at once (vLLM's ``--max-num-seqs``)."""
    max_num_batched_tokens: int = 8192
    """Tokens a step may compute: one per decoding sequence, the rest prefill chunks."""
    num_gpu_blocks: int = 28_000
    block_size: int = 16
    step_a_ms: float = 6.0
    """The step's fixed cost: reading the weights once (memory-bound decode at batch 1)."""
    step_b_ms: float = 0.06
    """Per running sequence: its KV cache read and its share of the sampling."""
    step_c_us: float = 45.0
    """Per prefill token scheduled (compute-bound)."""
    scheduling: str = "fcfs"
    """``fcfs`` or ``priority`` (the request's ``priority`` field, lower first)."""
    stream_interval: int = 1
    time_scale: float = 1.0
    """Every simulated duration is multiplied by this."""
    tokens_per_word: float = 1.3
    default_max_tokens: int = 128

    def step_s(self, running: int, prefill_tokens: int) -> float:
        """How long a step with ``running`` sequences and ``prefill_tokens`` prefilled takes."""
        ms = self.step_a_ms + self.step_b_ms * running + self.step_c_us * prefill_tokens / 1000
        return ms * self.time_scale / 1000.0


class Histogram:
    """A Prometheus histogram's cumulative buckets, as vLLM exports them."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        """Count ``value``."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def text(self, name: str, label: str) -> str:
        """The histogram's exposition lines."""
        lines = [f"# TYPE {name} histogram"]
        seen = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            seen += count
            le = "+Inf" if bound == math.inf else repr(bound)
            lines.append(f'{name}_bucket{{{label},le="{le}"}} {float(seen)}')
        lines += [f"{name}_count{{{label}}} {float(seen)}", f"{name}_sum{{{label}}} {self.total}"]
        return "\n".join(lines) + "\n"


class Seq:
    """One request in the engine: its prompt, what is computed and made of it, its blocks."""

    __slots__ = (
        "arrival", "blocks", "chat", "computed", "conn", "created", "epoch", "first_at",
        "generated", "include_usage", "last_at", "max_tokens", "priority", "prompt", "rid",
        "running", "sent", "slo", "stream",
    )  # fmt: skip

    def __init__(
        self, conn: _Connection, *, prompt: int, max_tokens: int, priority: int, chat: bool,
        stream: bool, include_usage: bool, rid: str, arrival: float,
    ) -> None:  # fmt: skip
        self.conn: _Connection | None = conn
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.priority = priority
        self.chat = chat
        self.stream = stream
        self.include_usage = include_usage
        self.rid = rid
        self.arrival = arrival
        self.created = int(time.time())
        self.computed = 0
        """Tokens whose KV is in the cache (prompt and generated ones)."""
        self.generated = 0
        self.sent = 0
        """Generated tokens written to the client."""
        self.blocks = 0
        self.running = False
        self.epoch = 0
        """Bumped when preempted or aborted: a step scheduled before it no longer applies."""
        self.first_at: float | None = None
        self.last_at = 0.0
        self.slo: tuple[float, float] | None = None
        """TTFT and TPOT targets (s) the request sent as ``x-slo-*-ms`` headers: the engine
        judges it by them when it ends (the worker's own count, beside a client's)."""

    @property
    def target(self) -> int:
        """Tokens to compute before the next token can be made: the prompt and all so far."""
        return self.prompt + self.generated

    @property
    def decoding(self) -> bool:
        """Whether only the token it made last is not in the cache: its next step is a decode.

        A decode computes that one token and makes the next, and costs no prefill time.
        """
        return self.generated > 0 and self.computed == self.target - 1


class Engine:
    """The continuous-batching engine (see the module's doc)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.waiting: deque[Seq] | list[tuple[int, int, Seq]] = (
            [] if config.scheduling == "priority" else deque()
        )
        self.running: list[Seq] = []
        self.free_blocks = config.num_gpu_blocks
        self.preemptions = 0
        self.successes = 0
        self.judged = {"met": 0, "missed": 0}
        """Requests that sent SLO headers, by whether the engine's own times met them."""
        self.generated = 0
        self.ttft = Histogram(_TTFT_BUCKETS)
        self.itl = Histogram(_ITL_BUCKETS)
        self._order = itertools.count()
        self._loop = asyncio.get_running_loop()
        self._step: asyncio.Handle | None = None
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(6)

    def next_id(self) -> str:
        """A unique request id suffix."""
        return f"{self._id_prefix}{next(self._ids):08x}"

    # The waiting queue.

    def _push(self, seq: Seq, front: bool = False) -> None:
        waiting = self.waiting
        if isinstance(waiting, deque):
            waiting.appendleft(seq) if front else waiting.append(seq)
        else:
            order = -next(self._order) if front else next(self._order)
            heapq.heappush(waiting, (seq.priority, order, seq))

    def _peek(self) -> Seq | None:
        waiting = self.waiting
        if not waiting:
            return None
        return waiting[0] if isinstance(waiting, deque) else waiting[0][2]

    def _pop(self) -> None:
        waiting = self.waiting
        if isinstance(waiting, deque):
            waiting.popleft()
        else:
            heapq.heappop(waiting)

    # Requests.

    def add(self, seq: Seq) -> None:
        """A request arrived: it waits for the next step that has room for it."""
        self._push(seq)
        self._wake()

    def abort(self, seq: Seq) -> None:
        """Its client left: free its slot and blocks now."""
        seq.conn = None
        seq.epoch += 1
        if seq.running:
            seq.running = False
            self.running.remove(seq)
            self.free_blocks += seq.blocks
            seq.blocks = 0
        elif isinstance(self.waiting, deque):
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
        else:
            kept = [item for item in self.waiting if item[2] is not seq]
            heapq.heapify(kept)
            self.waiting = kept

    # Steps.

    def _wake(self) -> None:
        if self._step is None:
            self._step = self._loop.call_soon(self._run_step)

    def _blocks_for(self, seq: Seq, tokens: int) -> int:
        """New blocks ``seq`` needs to hold ``tokens`` more tokens of KV."""
        size = self.config.block_size
        return max(0, math.ceil((seq.computed + tokens) / size) - seq.blocks)

    def _preempt_for(self, needy: Seq) -> bool:
        """Free blocks by preempting the running sequence admitted last (or least urgent)."""
        victims = [s for s in self.running if s is not needy]
        if not victims:
            return False
        victim = (
            max(victims, key=lambda s: (s.priority, self.running.index(s)))
            if self.config.scheduling == "priority"
            else victims[-1]
        )
        self.running.remove(victim)
        self.free_blocks += victim.blocks
        victim.blocks, victim.computed, victim.running = 0, 0, False
        victim.epoch += 1
        self.preemptions += 1
        self._push(victim, front=True)
        return True

    def _run_step(self) -> None:
        """Schedule one step; its results land when its time is up."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        decode: list[tuple[Seq, int]] = []
        chunks: list[tuple[Seq, int, int]] = []
        for seq in list(self.running):
            if not seq.running or budget <= 0:
                continue  # preempted meanwhile
            want = 1 if seq.decoding else min(seq.target - seq.computed, budget)
            need = self._blocks_for(seq, want)
            while need > self.free_blocks and self._preempt_for(seq):
                pass
            if need > self.free_blocks:
                continue
            self.free_blocks -= need
            seq.blocks += need
            budget -= want
            if seq.decoding:
                decode.append((seq, seq.epoch))
            else:
                chunks.append((seq, want, seq.epoch))
        while budget > 0 and (head := self._peek()) is not None:
            seq = head
            if len(self.running) >= cfg.max_num_seqs:
                break
            want = min(seq.target - seq.computed, budget)
            need = self._blocks_for(seq, want)
            if need > self.free_blocks:
                break
            self._pop()
            self.free_blocks -= need
            seq.blocks += need
            budget -= want
            self.running.append(seq)
            seq.running = True
            chunks.append((seq, want, seq.epoch))
        if not decode and not chunks:
            self._step = None
            return
        prefill = sum(n for _, n, _ in chunks)
        took = cfg.step_s(len(self.running), prefill)
        self._step = self._loop.call_later(took, self._end_step, decode, chunks)

    def _end_step(self, decode: list[tuple[Seq, int]], chunks: list[tuple[Seq, int, int]]) -> None:
        now = self._loop.time()
        for seq, epoch in decode:
            if seq.epoch == epoch:
                seq.computed += 1
                self._made(seq, now)
        for seq, n, epoch in chunks:
            if seq.epoch == epoch:
                seq.computed += n
                if seq.computed >= seq.target:  # the prompt (and all before) is in
                    self._made(seq, now)
        self._step = None
        if self.running or self.waiting:
            self._run_step()

    def _made(self, seq: Seq, now: float) -> None:
        """``seq`` made a token at ``now``: write it (or hold it, by the stream interval)."""
        seq.generated += 1
        self.generated += 1
        if seq.first_at is None:
            seq.first_at = now
            self.ttft.observe(now - seq.arrival)
        else:
            self.itl.observe(now - seq.last_at)
        seq.last_at = now
        last = seq.generated >= seq.max_tokens
        conn = seq.conn
        if conn is not None and seq.stream:
            interval = self.config.stream_interval
            if last or seq.sent == 0 or seq.generated - seq.sent >= interval:
                conn.send_tokens(seq, last)
        if last:
            seq.running = False
            seq.epoch += 1
            self.running.remove(seq)
            self.free_blocks += seq.blocks
            seq.blocks = 0
            self.successes += 1
            if seq.slo is not None:
                self.judged[_met(seq)] += 1
            if conn is not None:
                conn.finish(seq)

    # Metrics.

    def metrics_text(self) -> bytes:
        """The engine's gauges, counters and histograms, under vLLM's names."""
        cfg = self.config
        label = f'model_name="{cfg.model}",engine="0"'
        waiting = len(self.waiting)
        # vLLM 0.32 counts as "deferred" only requests held for reasons the model has not (KV
        # transfer, LoRA, grammar): every other waiting request waits for capacity.
        capacity = waiting
        used = 1.0 - self.free_blocks / cfg.num_gpu_blocks
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{label}}} {float(len(self.running))}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{label}}} {float(waiting)}\n"
            "# TYPE vllm:num_requests_waiting_by_reason gauge\n"
            f'vllm:num_requests_waiting_by_reason{{{label},reason="capacity"}} {float(capacity)}\n'
            f'vllm:num_requests_waiting_by_reason{{{label},reason="deferred"}} '
            f"{float(waiting - capacity)}\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{label}}} {used}\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{cfg.block_size}",enable_prefix_caching='
            f'"False",engine="0",num_gpu_blocks="{cfg.num_gpu_blocks}"}} 1.0\n'
            "# TYPE vllm:num_preemptions_total counter\n"
            f"vllm:num_preemptions_total{{{label}}} {float(self.preemptions)}\n"
            "# TYPE vllm:generation_tokens counter\n"
            f"vllm:generation_tokens_total{{{label}}} {float(self.generated)}\n"
            "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{{label},finished_reason="length"}} '
            f"{float(self.successes)}\n"
        )
        text += "# TYPE sim_slo_requests counter\n" + "".join(
            f'sim_slo_requests_total{{result="{result}"}} {float(n)}\n'
            for result, n in self.judged.items()
        )
        text += self.ttft.text("vllm:time_to_first_token_seconds", label)
        text += self.itl.text("vllm:inter_token_latency_seconds", label)
        return text.encode()


def _targets(headers: dict[str, str]) -> tuple[float, float] | None:
    """The TTFT and TPOT targets (s) of ``x-slo-ttft-ms`` / ``x-slo-tpot-ms``; None if neither.

    A missing one is no target (an hour). Raises ValueError for a value that is no number.
    """
    ttft, tpot = headers.get("x-slo-ttft-ms"), headers.get("x-slo-tpot-ms")
    if ttft is None and tpot is None:
        return None
    return (
        3600.0 if ttft is None else float(ttft) / 1000,
        3600.0 if tpot is None else float(tpot) / 1000,
    )


def _met(seq: Seq) -> str:
    """Whether ``seq`` met its SLO by the engine's own times.

    Its first token's time after arrival, and the mean gap from its first token to its last
    (each written to the client when made).
    """
    assert seq.slo is not None
    assert seq.first_at is not None
    ttft, tpot = seq.slo
    gaps = seq.generated - 1
    pace = (seq.last_at - seq.first_at) / gaps if gaps > 0 else 0.0
    return "met" if seq.first_at - seq.arrival <= ttft and pace <= tpot else "missed"


class _Connection(WorkerConnection):
    """One keep-alive HTTP/1.1 connection; one request at a time, in order."""

    def __init__(self, engine: Engine, models_body: bytes) -> None:
        super().__init__()
        self._engine = engine
        self._models = models_body
        self._seq: Seq | None = None
        self._model_json = json.dumps(engine.config.model)

    @property
    def busy(self) -> bool:
        """Whether a generation is being answered."""
        return self._seq is not None

    def lost(self) -> None:
        if self._seq is not None:
            self._engine.abort(self._seq)
            self._seq = None

    def dispatch(self, method: str, path: str, body: bytes) -> None:
        if path in ("/v1/chat/completions", "/v1/completions"):
            if method != "POST":
                self.reply(405, error_body(405, "Method Not Allowed", "BadRequestError"))
            else:
                self._generate(path == "/v1/chat/completions", body)
        elif path == "/reset_prefix_cache" and method == "POST":
            self.reply(200, b"", content_type=None)  # no prefix cache: nothing to empty
        elif path == "/health":
            self.reply(200, b"", content_type=None)
        elif path == "/v1/models":
            self.reply(200, self._models)
        elif path == "/metrics":
            text = self._engine.metrics_text()
            self.reply(200, text, content_type="text/plain; version=0.0.4")
        else:
            self.reply(404, error_body(404, "Not Found", "NotFoundError"))

    def _generate(self, chat: bool, raw: bytes) -> None:
        engine = self._engine
        cfg = engine.config
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as exc:
            self.reply(400, error_body(400, f"invalid JSON body: {exc}", "BadRequestError"))
            return
        n = body.get("max_completion_tokens") if chat else None
        n = body.get("max_tokens") if n is None else n
        n = cfg.default_max_tokens if n is None else n
        priority = body.get("priority", 0)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            self.reply(400, error_body(400, "max_tokens must be at least 1", "BadRequestError"))
            return
        if not isinstance(priority, int) or isinstance(priority, bool):
            self.reply(400, error_body(400, "priority must be an integer", "BadRequestError"))
            return
        prompt = max(1, round(prompt_tokens(body) * cfg.tokens_per_word))
        if prompt + n > cfg.max_model_len:
            message = (
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                f"you requested {prompt + n} tokens."
            )
            self.reply(400, error_body(400, message, "BadRequestError"))
            return
        stream = body.get("stream") is True
        options = body.get("stream_options")
        rid = ("chatcmpl-" if chat else "cmpl-") + engine.next_id()
        try:
            slo = _targets(self.headers)
        except ValueError as exc:
            self.reply(400, error_body(400, f"bad SLO header: {exc}", "BadRequestError"))
            return
        self._seq = seq = Seq(
            self, prompt=prompt, max_tokens=n, priority=priority, chat=chat, stream=stream,
            include_usage=isinstance(options, dict) and options.get("include_usage") is True,
            rid=rid, arrival=asyncio.get_running_loop().time(),
        )  # fmt: skip
        seq.slo = slo
        if stream and self.transport is not None:
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n"
                + (b"" if self.keep_alive else b"connection: close\r\n")
                + b"\r\n"
            )
        engine.add(seq)

    def send_tokens(self, seq: Seq, last: bool) -> None:
        """Write the tokens made since the last write as one event (vLLM's SSE bytes)."""
        transport = self.transport
        if transport is None:
            return
        out = []
        if seq.sent == 0 and seq.chat:
            out.append(self._event(seq, '"delta":{"role":"assistant","content":""}', "null"))
        text = json.dumps("".join(token_text(i) for i in range(seq.sent, seq.generated)))
        seq.sent = seq.generated
        member = f'"delta":{{"content":{text}}}' if seq.chat else f'"text":{text}'
        finish = '"length","stop_reason":null' if last else "null"
        out.append(self._event(seq, member, finish))
        transport.write(b"".join(http_chunk(event) for event in out))

    def _event(self, seq: Seq, member: str, finish: str) -> bytes:
        obj = "chat.completion.chunk" if seq.chat else "text_completion"
        return (
            f'data: {{"id":"{seq.rid}","object":"{obj}","created":{seq.created},'
            f'"model":{self._model_json},"choices":[{{"index":0,{member},"logprobs":null,'
            f'"finish_reason":{finish}}}]}}\n\n'
        ).encode()

    def finish(self, seq: Seq) -> None:
        """The sequence is done: end its stream (usage, [DONE]) or send its whole answer."""
        self._seq = None
        transport = self.transport
        if transport is None:
            return
        usage = {
            "prompt_tokens": seq.prompt,
            "total_tokens": seq.prompt + seq.generated,
            "completion_tokens": seq.generated,
        }
        if seq.stream:
            obj = "chat.completion.chunk" if seq.chat else "text_completion"
            tail = b""
            if seq.include_usage:
                payload = {
                    "id": seq.rid, "object": obj, "created": seq.created,
                    "model": self._engine.config.model, "choices": [], "usage": usage,
                }  # fmt: skip
                tail = http_chunk(b"data: " + dumps(payload) + b"\n\n")
            transport.write(tail + http_chunk(_DONE) + _LAST_CHUNK)
        else:
            text = "".join(token_text(i) for i in range(seq.generated))
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if seq.chat
                else {"index": 0, "text": text}
            )
            choice.update(logprobs=None, finish_reason="length", stop_reason=None)
            obj = "chat.completion" if seq.chat else "text_completion"
            payload = {
                "id": seq.rid, "object": obj, "created": seq.created,
                "model": self._engine.config.model, "choices": [choice], "usage": usage,
            }  # fmt: skip
            self.reply(200, dumps(payload))
        if not self.keep_alive:
            transport.close()
        elif self.buf:
            self.resume()  # a pipelined request arrived meanwhile


async def serve(
    host: str, port: int, config: EngineConfig | None = None
) -> tuple[asyncio.Server, Engine]:
    """Start a simulated worker on the running loop; close the server to stop it."""
    engine = Engine(config or EngineConfig())
    cfg = engine.config
    card = {
        "id": cfg.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
        "root": cfg.model, "parent": None, "max_model_len": cfg.max_model_len,
    }  # fmt: skip
    models = dumps({"object": "list", "data": [card]})
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(engine, models), host, port, backlog=4096)
    return server, engine


@contextlib.contextmanager
def running_sims(count: int, args: Sequence[str] = ()) -> Iterator[list[str]]:
    """``count`` simulated workers as processes (``args``: their command line), their URLs."""
    processes: list[subprocess.Popen[str]] = []
    try:
        urls = []
        for _ in range(count):
            process = subprocess.Popen(
                [sys.executable, "-m", "bench.sim_worker", "--port", "0", *args],
                cwd=Path(__file__).resolve().parent.parent,
                stdout=subprocess.PIPE,
                text=True,
            )
            processes.append(process)
            assert process.stdout is not None
            line = process.stdout.readline()
            if "listening on" not in line:
                raise RuntimeError(f"a simulated worker did not start: {line!r}")
            urls.append(line.rsplit(" ", 1)[1].strip())
        yield urls
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(10)


def config_from(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration the command line asks for."""
    return replace(
        EngineConfig(),
        model=args.model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size, step_a_ms=args.step_a_ms, step_b_ms=args.step_b_ms,
        step_c_us=args.step_c_us, scheduling=args.scheduling_policy,
        stream_interval=args.stream_interval, time_scale=args.time_scale,
    )  # fmt: skip


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = EngineConfig()
    parser = argparse.ArgumentParser(prog="python -m bench.sim_worker", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200, help="0 picks a free port")
    parser.add_argument("--model", default=d.model)
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--num-gpu-blocks", type=int, default=d.num_gpu_blocks)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--step-a-ms", type=float, default=d.step_a_ms)
    parser.add_argument("--step-b-ms", type=float, default=d.step_b_ms)
    parser.add_argument("--step-c-us", type=float, default=d.step_c_us)
    parser.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    parser.add_argument("--stream-interval", type=int, default=d.stream_interval)
    parser.add_argument("--time-scale", type=float, default=d.time_scale)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    args = _parse_args(argv)

    async def start() -> asyncio.Server:
        server, _ = await serve(args.host, args.port, config_from(args))
        return server

    run_until_interrupted("sim_worker", args.host, start)


if __name__ == "__main__":
    main()

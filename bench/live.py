"""What the real-worker benchmarks share: vLLM workers, a gateway process, a timed client.

The benchmarks run REAL vLLM CPU workers. The shipped ``tiny-llama`` is so small that on a CPU
its prefill and decode are faster than the client and gateway can stream events, so nothing a
router or admission controller does would show; the benchmarks use ``bench-llama`` instead:
the same architecture and tokenizer, 8 layers x 512 wide (27 M random bf16 weights), which on
one core of this machine prefills ~3,300 tokens/s and decodes one step in ~7 ms for one
sequence and ~24 ms for 32: a slow accelerator in miniature, with the same two phases.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Final

import httpx

from bench.overhead import proc_cpu_s
from scripts.processes import stop_process
from scripts.vllm_worker import MODEL_DIR, ROOT, RUN_DIR, VllmWorker, kv_events_args

BENCH_MODEL: Final = "bench-llama"
BENCH_MODEL_DIR: Final = ROOT / "models" / "bench-llama"
RESULTS: Final = ROOT / "bench" / "results"
_CONTENT: Final = re.compile(rb'"(?:content|text)":\s?"[^"]')
_TEXT: Final = (
    "the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak "
    "tree and count the stars above the quiet river that runs past the sleeping town"
)
_WORDS: Final = tuple(_TEXT.split())
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def unwind_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit, so that every worker and gateway started gets stopped."""

    def _raise(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)


def log(message: str) -> None:
    """Progress on stderr, so stdout keeps only the tables."""
    print(message, file=sys.stderr, flush=True)


def prompt_text(words: int, rng: random.Random) -> str:
    """A prompt of ``words`` words (about 1.7 tokens each with the tiny tokenizer)."""
    start = rng.randrange(len(_WORDS))
    return " ".join(_WORDS[(start + i) % len(_WORDS)] for i in range(words))


def fresh_text(words: int, rng: random.Random) -> str:
    """``words`` words drawn at random: text no earlier prompt shares (no prefix-cache hits)."""
    return " ".join(rng.choices(_WORDS, k=words))


def bench_worker(
    port: int,
    cpus: str | None = None,
    *,
    dev_mode: bool = False,
    kv_blocks: int | None = None,
    kv_events: tuple[int, int] | None = None,
) -> VllmWorker:
    """A worker serving ``bench-llama`` with the tiny model's tokenizer.

    ``dev_mode`` turns on vLLM's development endpoints (``POST /reset_prefix_cache``), so that
    a benchmark can start each run with an empty prefix cache. ``kv_blocks`` sets the size of
    the KV cache in blocks of 128 tokens (default: 1 GiB, 1,024 blocks). ``kv_events``: the
    ports it publishes its KV cache events and replays them on (ZMQ, bound on every address).
    """
    extra = ["--tokenizer", str(MODEL_DIR)]
    if kv_blocks is not None:
        extra += ["--num-gpu-blocks-override", str(kv_blocks)]
    if kv_events is not None:
        extra += kv_events_args(*kv_events)
    return VllmWorker(
        port=port,
        model_name=BENCH_MODEL,
        model_dir=BENCH_MODEL_DIR,
        max_model_len=2048,
        cpus=cpus,
        extra_args=extra,
        env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"} if dev_mode else None,
    )


async def reset_prefix_caches(workers: Sequence[str]) -> None:
    """Empty the workers' prefix caches (vLLM's development endpoint); they must be idle.

    Runs that replay the same prompts start even: otherwise the second finds the first's
    prompts cached and prefills them faster. Each worker then answers a one-token prompt: vLLM
    publishes its KV cache events (the clearing among them) from an engine step, so an idle
    worker's followers would go on seeing the emptied blocks until its next request.
    """
    async with httpx.AsyncClient(timeout=30) as client:
        for worker in workers:
            response = await client.post(f"{worker}/reset_prefix_cache")
            response.raise_for_status()
            models = (await client.get(f"{worker}/v1/models")).json()["data"]
            body = {"model": models[0]["id"], "prompt": "x", "max_tokens": 1}
            response = await client.post(f"{worker}/v1/completions", json=body)
            response.raise_for_status()


@contextlib.contextmanager
def running_workers(workers: Sequence[VllmWorker]) -> Iterator[list[VllmWorker]]:
    """Start every worker (one after the other, they share the CPUs), stop them all after."""
    started: list[VllmWorker] = []
    try:
        for worker in workers:
            log(f"starting {worker.model_name} worker on {worker.url} (about a minute)")
            worker.start()
            started.append(worker)
            worker.wait_ready(timeout=600)
        yield started
    finally:
        for worker in started:
            worker.stop()


def _ready(url: str) -> bool:
    try:
        with _NO_PROXY.open(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def running_gateway(
    env: Mapping[str, str], port: int, name: str, cpu: list[float] | None = None
) -> Iterator[str]:
    """``python -m app`` with ``env`` on ``port`` until the block ends; yields its URL.

    ``cpu``, when given, gets the CPU seconds the gateway (its processes) spent, read as the
    block ends.
    """
    log_path = RUN_DIR / f"bench-gateway-{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {
        **os.environ,
        "GATEWAY_HOST": "127.0.0.1",
        "GATEWAY_PORT": str(port),
        "GATEWAY_ACCESS_LOG": "false",
        **env,
    }
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "app"],
            cwd=ROOT,
            env=full_env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while not _ready(f"{url}/readyz"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start; see {log_path}")
            time.sleep(0.2)
        yield url
    finally:
        if cpu is not None:
            cpu.append(proc_cpu_s(process.pid))  # its children's too (GATEWAY_PROCESSES)
        stop_process(process, grace=30)


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it."""

    tag: str
    sent: float
    status: int = 0
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    completion_tokens: int = 0
    retry_after: float | None = None
    queue_ms: float | None = None
    """The gateway's ``x-gateway-queue-ms``: how long admission held the request."""
    error: str | None = None
    """Why the request did not end with ``[DONE]``: an error event or a transport failure."""
    lost: bool = False
    """No HTTP response at all (connection failed or timed out): what must never happen."""

    @property
    def ok(self) -> bool:
        """A 200 stream that finished."""
        return self.status == 200 and self.error is None and self.e2e is not None

    def ended(self, done: bool, last: float) -> None:
        """A stream read to its end: an error if it had no ``[DONE]``, else E2E and TPOT.

        ``last`` is when its last content event arrived.
        """
        if not done and self.error is None:
            self.error = "stream ended without [DONE]"
        if self.error is None:
            self.e2e = last - self.sent
            if self.ttft is not None and self.completion_tokens > 1:
                self.tpot = (self.e2e - self.ttft) / (self.completion_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        """The outcome as JSON-ready values."""
        return {
            "tag": self.tag,
            "sent": self.sent,
            "status": self.status,
            "ttft": self.ttft,
            "tpot": self.tpot,
            "e2e": self.e2e,
            "completion_tokens": self.completion_tokens,
            "retry_after": self.retry_after,
            "queue_ms": self.queue_ms,
            "error": self.error,
            "lost": self.lost,
        }


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    *,
    model: str,
    prompt: str,
    max_tokens: int,
    tag: str = "",
    headers: Mapping[str, str] | None = None,
    outcome: Outcome | None = None,
) -> Outcome:
    """One streamed chat completion, timed on this process's monotonic clock.

    TTFT is send to first content event; TPOT is (E2E - TTFT) / (tokens - 1) with the tokens
    from the usage chunk. Events are told apart by a byte scan; only the usage chunk is parsed.
    Given an ``outcome``, fills that one as the stream goes, so that a caller can watch it.
    """
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    if outcome is None:
        outcome = Outcome(tag=tag, sent=sent)
    else:
        outcome.sent = sent
    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=dict(headers or {})
        ) as response:
            outcome.status = response.status_code
            queued = response.headers.get("x-gateway-queue-ms")
            outcome.queue_ms = float(queued) if queued else None
            if response.status_code != 200:
                answer = await response.aread()
                value = response.headers.get("retry-after")
                outcome.retry_after = float(value) if value else None
                outcome.error = f"http {response.status_code} {_error_code(answer)}"
                return outcome
            last = sent
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                raw = line[6:].encode()
                if raw == b"[DONE]":
                    done = True
                elif raw.startswith(b'{"error"'):
                    outcome.error = json.loads(raw)["error"].get("type", "error")
                elif _CONTENT.search(raw):
                    last = time.perf_counter()
                    if outcome.ttft is None:
                        outcome.ttft = last - sent
                elif b'"usage":{' in raw:
                    usage = json.loads(raw).get("usage") or {}
                    outcome.completion_tokens = int(usage.get("completion_tokens") or 0)
            outcome.ended(done, last)
    except httpx.HTTPError as exc:
        outcome.error = type(exc).__name__
        outcome.lost = outcome.status == 0
    return outcome


def _error_code(body: bytes) -> str:
    """The ``code`` of an OpenAI-shaped error body (``-`` when there is none)."""
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return "-"
    return str(error.get("code") or "-") if isinstance(error, dict) else "-"


def arrival_times(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Offsets (s) of a Poisson process of ``rate`` per second over ``duration_s``."""
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def write_json(name: str, payload: Mapping[str, Any]) -> Path:
    """Write ``bench/results/<name>.json`` and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=lambda v: None) + "\n")
    return path

"""CPU cost of mapping a prompt to a worker's KV cache blocks, per request, at long prompts.

``python -m bench.kv_mapping [--chars 16000] [--requests 200] [--workers 2 8]``

Routing on the workers' KV cache events (:mod:`app.fleet.kvevents`) needs each request's prompt
as the worker's tokens (:mod:`app.fleet.tokens`): asked of a worker's ``/tokenize`` the first
time, from the cache after. This runs a real ``bench-llama`` CPU worker and measures, in this
process (the gateway's side only: the worker's own CPU is not the gateway's), for a chat
request of about 4,000 tokens (``--chars`` characters):

* ``asked``: the worker asked (the request's body rendered, the HTTP exchange over the relay's
  client, the answer's 4,000 ids decoded and its blocks' keys chained and kept), then matched
  against every worker's index;
* ``cached``: the same prompt again: rendered, looked up, matched (the keys chained once);
* ``tokenized here``: each prompt rendered and tokenized in this process from the model's files
  (``GATEWAY_TOKENIZERS``), its shared system prompt encoded once, then matched; the first
  three checked against the worker's ``/tokenize``;
* ``its next turn``: each conversation with an answer and a question more (about 60 words
  each), tokenized here: only the new messages are encoded.

Timed as this process's CPU time (``time.process_time``) over ``--requests`` sequential
requests; each worker's index holds half of the prompt's blocks among 5,000 others. A
benchmark, not a test: it always exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from collections.abc import Sequence
from typing import Any

import httpx

from app.api.protocol import Endpoint, parse_request
from app.fleet.kvindex import KVIndex
from app.fleet.localtokens import LocalTokenizer
from app.fleet.tokens import Tokenizer, tokenize_body
from app.fleet.wire import WireClient
from app.settings import WorkerSpec
from bench.live import BENCH_MODEL, bench_worker, prompt_text, running_workers, write_json
from bench.overhead import free_port
from bench.prefix_cost import chat_body
from scripts.vllm_worker import MODEL_DIR

TARGET_US = 1000.0


def _indexes(workers: int, tokens: list[int], size: int) -> list[KVIndex]:
    """Indexes holding 5,000 other blocks each, and the first half of the prompt's."""
    indexes = []
    rng = random.Random(7)
    for i in range(workers):
        index = KVIndex(max_blocks=1_000_000)
        base = i * 10_000_000
        for n in range(5_000):
            index.stored([base + n], None, [rng.randrange(32_000) for _ in range(size)], size)
        half = len(tokens) // size // 2
        hashes = [base + 5_000 + k for k in range(half)]
        index.stored(hashes, None, tokens[: half * size], size)
        index.complete = True
        indexes.append(index)
    return indexes


async def measure(url: str, chars: int, requests: int, workers: int, size: int) -> dict[str, Any]:
    """CPU µs per request, asked and cached, for ``workers`` indexes of ``size``-token blocks."""
    rng = random.Random(1)
    system = " ".join(rng.choice(("river", "stone", "light", "green")) for _ in range(400))
    bodies = [chat_body(chars, random.Random(100 + i), system) for i in range(requests)]
    spec = WorkerSpec.model_validate({"url": url})
    sizes = {size}
    first = parse_request(Endpoint.CHAT, chat_body(chars, random.Random(99), system))
    first.model = BENCH_MODEL
    probe = tokenize_body(first)
    async with httpx.AsyncClient(timeout=30) as client:  # the set-up only: not measured
        answer = await client.post(f"{url}/tokenize", json=probe)
        indexes = _indexes(workers, answer.json()["tokens"], size)
    wire = WireClient(5.0)
    tokenizer = Tokenizer(wire, 30.0, 256 * 2**20)
    parsed = []
    for raw in bodies:
        request = parse_request(Endpoint.CHAT, raw)
        request.model = BENCH_MODEL
        parsed.append(request)
    matched = 0
    lengths = []
    started = time.process_time()
    for request in parsed:
        tokens, body = tokenizer.cached(request, sizes)
        assert tokens is None
        assert body is not None
        tokens = await tokenizer.ask(spec, BENCH_MODEL, body, sizes)
        assert tokens is not None
        lengths.append(len(tokens))
        keys = tokens.blocks(size)
        matched += sum(index.match(keys, 0.0) for index in indexes)
    asked = (time.process_time() - started) / requests
    started = time.process_time()
    for request in parsed:
        tokens, body = tokenizer.cached(request, sizes)
        assert tokens is not None
        keys = tokens.blocks(size)
        matched += sum(index.match(keys, 0.0) for index in indexes)
    cached = (time.process_time() - started) / requests
    # Tokenized in this process from the model's files: the system prompt's piece is encoded
    # once, each request's own text every time (no two requests share it).
    local = LocalTokenizer(MODEL_DIR)
    mapped = Tokenizer(wire, 30.0, 256 * 2**20, {BENCH_MODEL: local})
    started = time.process_time()
    for request in parsed:
        tokens, how = await mapped.tokens(request, sizes, spec)
        assert how == "local"
        assert tokens is not None
        keys = tokens.blocks(size)
        matched += sum(index.match(keys, 0.0) for index in indexes)
    here = (time.process_time() - started) / requests
    # Each conversation's next turn: its earlier messages' pieces are known, the two new
    # messages are encoded (the whole prompt's keys chained again).
    following = [_next_turn(request, random.Random(500 + i)) for i, request in enumerate(parsed)]
    started = time.process_time()
    for request in following:
        tokens, how = await mapped.tokens(request, sizes, spec)
        assert how == "local"
        assert tokens is not None
        matched += sum(index.match(tokens.blocks(size), 0.0) for index in indexes)
    turn = (time.process_time() - started) / requests
    await mapped.close()
    same = True
    for request in parsed[:3]:
        theirs = await _worker_ids(url, request)
        same = same and local.chat(tokenize_body(request) or {}) == theirs
    wire.close()
    assert matched > 0
    return {
        "workers": workers,
        "block_size": size,
        "prompt_tokens": sum(lengths) / len(lengths),
        "asked_us": asked * 1e6,
        "cached_us": cached * 1e6,
        "local_us": here * 1e6,
        "local_turn_us": turn * 1e6,
        "local_same": same,
    }


def _next_turn(request: Any, rng: random.Random) -> Any:
    """``request`` with an answer and a new question of about 60 words each appended."""
    body = json.loads(request.raw)
    body["messages"] += [
        {"role": "assistant", "content": prompt_text(60, rng)},
        {"role": "user", "content": prompt_text(60, rng)},
    ]
    following = parse_request(Endpoint.CHAT, json.dumps(body).encode())
    following.model = BENCH_MODEL
    return following


async def _worker_ids(url: str, request: Any) -> list[int]:
    async with httpx.AsyncClient(timeout=30) as client:
        answer = await client.post(f"{url}/tokenize", json=tokenize_body(request))
        ids: list[int] = answer.json()["tokens"]
        return ids


def _table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| workers | block tokens | prompt tokens | CPU asked µs | CPU cached µs "
        "| CPU tokenized here µs | its next turn µs | same ids |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workers']} | {r['block_size']} | {r['prompt_tokens']:.0f} "
            f"| {r['asked_us']:.0f} | {r['cached_us']:.0f} | {r['local_us']:.0f} "
            f"| {r['local_turn_us']:.0f} "
            f"| {'yes' if r['local_same'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Start a worker, measure, print the table and the verdict, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--chars", type=int, default=16_000)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--worker", help="URL of a running bench-llama worker instead of one")
    args = parser.parse_args(argv)
    rows = []
    with contextlib.ExitStack() as stack:
        url = args.worker
        if url is None:
            started = stack.enter_context(running_workers([bench_worker(free_port())]))
            url = started[0].url
        for workers in args.workers:
            for size in args.block_sizes:
                rows.append(asyncio.run(measure(url, args.chars, args.requests, workers, size)))
    print(_table(rows))
    worst = max(r["asked_us"] for r in rows)
    verdict = "PASS" if worst < TARGET_US else "MISS"
    print(f"\nworst added CPU per request: {worst:.0f} µs ({verdict}, target {TARGET_US:.0f} µs)")
    print(f"written to {write_json('kv-mapping', {'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()

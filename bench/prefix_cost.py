"""CPU cost of prefix-aware routing per request, at long prompts: what the index adds.

``python -m bench.prefix_cost [--chars 16000] [--workers 2 8] [--requests 2000]``

A chat request of about 4,000 tokens (``--chars`` characters of text: a shared system prompt,
then turns of a conversation) is parsed once, as the gateway does anyway; then, on the
gateway's own objects (a pool of healthy workers whose prefix indexes already hold thousands
of other prompts, with one worker holding half of this prompt):

* ``prefix``: reading the prompt's text and hashing its blocks (:meth:`Router.route_key`);
* ``choose``: :meth:`Router.choose` under ``prefix_aware``, against the same call under
  ``predicted_ttft``; the difference is the index lookups, the insertion and the counters.

Two cases: the same prompt again and again (every block found and moved to the front), and a
new prompt every time (every block inserted, as many evicted at the cap). Timed as the CPU time
of this thread (``time.thread_time``), ``--rounds`` rounds alternating the policies; the table
gives the median round's mean per request. A benchmark, not a test: it always exits 0.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from app.api.protocol import Endpoint, parse_request
from app.fleet import prefix as index
from app.fleet.lease import Choice
from app.fleet.routing import RouteKey, Router
from app.fleet.wire import WireClient
from app.fleet.workers import WorkerPool
from app.observe.metrics import GatewayMetrics
from app.settings import Settings
from bench.live import prompt_text, write_json

MODEL = "bench-llama"
TARGET_US = 50.0


def chat_body(chars: int, rng: random.Random, system: str) -> bytes:
    """A chat request of ``chars`` characters of text: ``system``, then alternating turns."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    total = len(system)
    role = "user"
    while total < chars:
        text = prompt_text(rng.randint(40, 120), rng)[: chars - total]
        messages.append({"role": role, "content": text})
        total += len(text)
        role = "assistant" if role == "user" else "user"
    body = {"model": MODEL, "messages": messages, "max_tokens": 32, "stream": True}
    return json.dumps(body).encode()


class _NoClock:
    def __call__(self) -> float:
        return 1000.0


def _pool(settings: Settings, metrics: GatewayMetrics) -> WorkerPool:
    client = WireClient(1.0)  # never asked: these tests probe nothing
    pool = WorkerPool(settings, client, metrics, _NoClock(), _NoResolver())
    for worker in pool.workers.values():
        worker.up = True
        worker.models = {MODEL}
        worker.cards = {MODEL: {"id": MODEL}}
    return pool


class _NoResolver:
    async def resolve(self, host: str) -> list[str]:
        return []


def _cpu_us(job: Callable[[], object], n: int) -> float:
    start = time.thread_time()
    for _ in range(n):
        job()
    return (time.thread_time() - start) / n * 1e6


def measure(chars: int, workers: int, requests: int, rounds: int, seed: int) -> dict[str, Any]:
    """Per-request CPU (µs) of each step, for ``workers`` workers at ``chars``-char prompts."""
    rng = random.Random(seed)
    system = prompt_text(1200, rng)[: chars * 3 // 8]
    urls = ",".join(f"http://w{i}:8000" for i in range(workers))
    settings = {
        name: Settings.model_validate({"workers": urls, "routing": name, "access_log": False})
        for name in ("prefix_aware", "predicted_ttft")
    }
    metrics = GatewayMetrics(settings["prefix_aware"])
    pool = _pool(settings["prefix_aware"], metrics)
    routers = {name: Router(s, pool, random.Random(seed), metrics) for name, s in settings.items()}
    aware = routers["prefix_aware"]
    same = parse_request(Endpoint.CHAT, chat_body(chars, rng, system))
    own_tokens = same.size / 4.0
    # Other traffic: thousands of prompts already indexed on every worker.
    for _ in range(300):
        other = parse_request(Endpoint.CHAT, chat_body(chars // 2, rng, prompt_text(900, rng)))
        aware.choose(MODEL, own_tokens, aware.route_key(None, other))
    half = parse_request(Endpoint.CHAT, chat_body(chars // 2, random.Random(seed), system))
    aware.choose(MODEL, own_tokens, aware.route_key(None, half))
    # A prompt sharing nothing for every request of every round (only the keys are kept).
    keys_fresh = [
        [
            aware.route_key(
                None, parse_request(Endpoint.CHAT, chat_body(chars, rng, prompt_text(1200, rng)))
            )
            for _ in range(requests)
        ]
        for _ in range(rounds)
    ]
    key_same = aware.route_key(None, same)
    assert key_same.prefix is not None
    blocks = len(key_same.prefix.blocks)

    samples: dict[str, list[float]] = {
        k: [] for k in ("text", "prefix", "choose_ttft", "choose_same", "choose_new")
    }
    ttft = routers["predicted_ttft"]
    for round_ in range(rounds):
        samples["text"].append(
            _cpu_us(lambda: index.prompt_text(Endpoint.CHAT, same.body), requests)
        )
        samples["prefix"].append(_cpu_us(lambda: aware.route_key(None, same), requests))
        samples["choose_ttft"].append(_cpu_us(lambda: ttft.choose(MODEL, own_tokens), requests))
        samples["choose_same"].append(
            _cpu_us(lambda: aware.choose(MODEL, own_tokens, key_same), requests)
        )
        fresh_keys = iter(keys_fresh[round_])

        def choose_new(keys: Iterator[RouteKey] = fresh_keys) -> Choice:
            return aware.choose(MODEL, own_tokens, next(keys))

        samples["choose_new"].append(_cpu_us(choose_new, requests))
    median = {k: statistics.median(v) for k, v in samples.items() if v}
    index_bytes = sum(w.prefixes.nbytes() for w in pool.workers.values())
    entries = sum(len(w.prefixes) for w in pool.workers.values())
    added_same = median["prefix"] + median["choose_same"] - median["choose_ttft"]
    added_new = median["prefix"] + median["choose_new"] - median["choose_ttft"]
    return {
        "prompt_chars": key_same.prefix.chars,
        "blocks": blocks,
        "workers": workers,
        "text_us": median["text"],
        "prefix_us": median["prefix"],
        "choose_ttft_us": median["choose_ttft"],
        "choose_same_us": median["choose_same"],
        "choose_new_us": median["choose_new"],
        "added_same_us": added_same,
        "added_new_us": added_new,
        "index_entries": entries,
        "index_bytes": index_bytes,
        "samples": samples,
    }


def _table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| workers | prompt chars | blocks | text µs | prefix (text + hashes) µs "
        "| choose, predicted_ttft µs "
        "| choose, prefix_aware, same prompt µs | choose, prefix_aware, new prompt µs "
        "| added per request µs (same / new) | index entries | index MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workers']} | {r['prompt_chars']:,} | {r['blocks']} | {r['text_us']:.1f} "
            f"| {r['prefix_us']:.1f} "
            f"| {r['choose_ttft_us']:.1f} | {r['choose_same_us']:.1f} | {r['choose_new_us']:.1f} "
            f"| {r['added_same_us']:.1f} / {r['added_new_us']:.1f} | {r['index_entries']:,} "
            f"| {r['index_bytes'] / 2**20:.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Measure, print a table and the verdict against the 50 µs target, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--chars", type=int, default=16_000, help="prompt text, characters")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--requests", type=int, default=1000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    rows = [measure(args.chars, n, args.requests, args.rounds, args.seed) for n in args.workers]
    print(_table(rows))
    worst = max(max(r["added_same_us"], r["added_new_us"]) for r in rows)
    verdict = "PASS" if worst <= TARGET_US else "MISS"
    print(f"\nworst added CPU per request: {worst:.1f} µs ({verdict}, target {TARGET_US:.0f} µs)")
    path = write_json("prefix_cost", {"args": vars(args), "rows": rows})
    print(f"written to {path}")


if __name__ == "__main__":
    main()

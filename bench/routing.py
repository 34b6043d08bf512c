"""Routing benchmark: predicted-TTFT routing against round robin, two real workers, skewed load.

``python -m bench.routing [--duration 30] [--rate 4] [--background 2]`` (``make bench-routing``)

Two real vLLM CPU workers serve ``bench-llama`` (see :mod:`bench.live`), one core each. Worker A
also gets a steady stream of long prompts (~1,200 tokens, ``--background`` at a time) sent to it
directly, as another gateway replica or tenant would: its prefill is always busy. Short chat
requests (~70-token prompts, 32 tokens out) arrive through the gateway as a Poisson process.
For each policy, a fresh gateway (admission off, so only the routing differs) gets the same
arrival times and prompts; the client measures TTFT and TPOT. It prints a markdown table and
writes ``bench/results/routing.json``. A benchmark, not a test: it always exits 0 when it ran.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Sequence
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.live import (
    BENCH_MODEL,
    Outcome,
    arrival_times,
    bench_worker,
    log,
    prompt_text,
    running_gateway,
    running_workers,
    stream_chat,
    unwind_on_sigterm,
    write_json,
)
from bench.overhead import free_port, percentile
from scripts.vllm_worker import cpu_binding

POLICIES = ("round_robin", "least_outstanding", "predicted_ttft")


async def _routed(url: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(f"{url}/metrics")).text
    shares: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gateway_worker_routed_requests_total":
                shares[sample.labels["worker"]] = sample.value
    return shares


async def _background(url: str, stop: asyncio.Event, words: int, seed: int) -> int:
    """Long prompts straight to one worker, back to back, until ``stop``."""
    rng = random.Random(seed)
    sent = 0
    async with httpx.AsyncClient(timeout=120) as client:
        while not stop.is_set():
            await stream_chat(
                client, url, model=BENCH_MODEL, prompt=prompt_text(words, rng), max_tokens=8
            )
            sent += 1
    return sent


async def _measure(
    gateway: str, offsets: Sequence[float], prompts: Sequence[str], max_tokens: int
) -> list[Outcome]:
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()

        async def one(offset: float, prompt: str) -> Outcome:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            return await stream_chat(
                client, gateway, model=BENCH_MODEL, prompt=prompt, max_tokens=max_tokens
            )

        return await asyncio.gather(*(one(o, p) for o, p in zip(offsets, prompts, strict=True)))


async def _run_policy(
    args: argparse.Namespace, policy: str, workers: Sequence[str], seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    offsets = arrival_times(args.rate, args.duration, rng)
    prompts = [prompt_text(rng.randint(30, 50), rng) for _ in offsets]
    warmup = arrival_times(args.rate, 5.0, rng)
    env = {
        "GATEWAY_WORKERS": ",".join(workers),
        "GATEWAY_ROUTING": policy,
        "GATEWAY_ADMISSION": "false",
    }
    stop = asyncio.Event()
    with running_gateway(env, free_port(), f"routing-{policy}") as gateway:
        loaders = [
            asyncio.create_task(_background(workers[0], stop, args.background_words, seed + i))
            for i in range(args.background)
        ]
        try:
            await asyncio.sleep(2)  # the background load is running before anything is measured
            # Warm-up: the gateway learns each worker's speed from its own traffic.
            await _measure(gateway, warmup, [prompts[0]] * len(warmup), args.max_tokens)
            before = await _routed(gateway)
            log(f"{policy}: {len(offsets)} requests over {args.duration:.0f} s")
            outcomes = await _measure(gateway, offsets, prompts, args.max_tokens)
            after = await _routed(gateway)
        finally:
            stop.set()
            background = sum(await asyncio.gather(*loaders))
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft * 1000 for o in ok if o.ttft is not None]
    tpots = [o.tpot * 1000 for o in ok if o.tpot is not None]
    loaded = workers[0].removeprefix("http://")
    routed = {w: after.get(w, 0.0) - before.get(w, 0.0) for w in after}
    return {
        "policy": policy,
        "requests": len(outcomes),
        "ok": len(ok),
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p99": percentile(ttfts, 99),
        "tpot_ms_p50": percentile(tpots, 50),
        "tpot_ms_p99": percentile(tpots, 99),
        "share_to_loaded_worker": routed.get(loaded, 0.0) / max(1.0, sum(routed.values())),
        "background_requests": background,
    }


def _table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| policy | requests ok | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms "
        "| share to loaded worker |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['ok']}/{r['requests']} | {r['ttft_ms_p50']:.1f} "
            f"| {r['ttft_ms_p99']:.1f} | {r['tpot_ms_p50']:.1f} | {r['tpot_ms_p99']:.1f} "
            f"| {100 * r['share_to_loaded_worker']:.0f}% |"
        )
    return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    parser.add_argument("--rate", type=float, default=4.0, help="measured requests per second")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--background", type=int, default=2, help="long prompts at a time on A")
    parser.add_argument("--background-words", type=int, default=700)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args(argv)


async def _main(args: argparse.Namespace, workers: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for policy in args.policies:
        rows.append(await _run_policy(args, policy, workers, args.seed))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """Run every policy against the same two workers; print and save the results."""
    args = _parse_args(argv)
    unwind_on_sigterm()
    specs = [bench_worker(free_port(), cpu_binding(i, 2)) for i in range(2)]
    with running_workers(specs) as workers:
        urls = [w.url for w in workers]
        rows = asyncio.run(_main(args, urls))
    print(
        f"\nTwo {BENCH_MODEL} workers, one core each; worker A also runs {args.background} "
        f"long prompts (~{int(args.background_words * 1.7)} tokens) at a time sent to it "
        f"directly. Through the gateway: Poisson {args.rate}/s for {args.duration:.0f} s, "
        f"~70-token prompts, {args.max_tokens} tokens out.\n"
    )
    print(_table(rows))
    path = write_json("routing", {"args": vars(args), "rows": rows})
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()

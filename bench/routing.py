"""Routing benchmark: the routing policies on two real vLLM CPU workers serving ``bench-llama``.

``python -m bench.routing [--workload prefix|skewed] ...`` (``make bench-routing``)

Two real vLLM CPU workers serve ``bench-llama`` (see :mod:`bench.live`), one core each, with
vLLM's prefix caching on (its default). Each policy gets a fresh gateway (admission off, so
only the routing differs) and the same requests. It prints a markdown table and writes
``bench/results/routing-<workload>.json``. A benchmark, not a test: it always exits 0 when it ran.

``prefix`` (the default): users in multi-turn conversations over shared system prompts
(:mod:`bench.conversations`: 8 prompts of ~1,500 tokens, 64 users, 5 turns each, 32 tokens
out), Poisson arrivals at ``--load`` (0.7) times the capacity, on workers whose KV cache holds
the working set once but not twice (``--kv-blocks``, see ``PREFIX_KV_BLOCKS``). The capacity is
measured first (``--capacity`` takes a figure instead): ``--concurrency`` clients send as
many other users' turns, in rounds as the measured run's, back to back through a
``round_robin`` gateway (both workers busy), and the completed requests per second between
the 10th and the 90th percentile of their ends are the capacity. Policies:
``round_robin``, ``predicted_ttft``, ``affinity`` (``predicted_ttft`` with each user's
``x-session-id``), ``prefix_aware`` (no session id, on the gateway's own guess of what each
worker caches) and ``prefix_kv`` (``prefix_aware`` on the workers' KV cache events, which
the started workers publish, the prompts tokenized by the gateway from the model's files;
``prefix_kv_asked``, only when named, asks the workers' ``/tokenize`` instead). Before each
policy both workers' prefix
caches are emptied (vLLM's ``/reset_prefix_cache``) and 16 one-turn users, not measured, show
the service its system prompts; the workers' hit rate is read from their
``vllm:prefix_cache_hits_total`` / ``_queries_total`` before and after the measured requests.

``skewed``: worker A also gets a steady stream of long prompts (~1,200 tokens, ``--background``
at a time) sent to it directly, as another gateway replica or tenant would: its prefill is
always busy. Short chat requests (~70-token prompts, 32 tokens out) arrive through the gateway
as a Poisson process at ``--rate``; the table gives the share routed to the loaded worker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.conversations import make_users, run_closed, run_open, schedule
from bench.live import (
    BENCH_MODEL,
    Outcome,
    arrival_times,
    bench_worker,
    log,
    prompt_text,
    reset_prefix_caches,
    running_gateway,
    running_workers,
    stream_chat,
    unwind_on_sigterm,
    write_json,
)
from bench.overhead import free_port, percentile
from scripts.vllm_worker import MODEL_DIR, cpu_binding

# The prefix workload's KV cache per worker, in 128-token blocks (22,528 tokens): the eight
# system prompts (88 whole blocks) and the conversations active within a round fit in the two
# workers' caches once, not in each twice. With vLLM's default here (1 GiB, 1,024 blocks)
# every policy finds almost everything cached after the first round; GPU workers under load
# are nearer this regime, their KV cache shared by hundreds of running sequences.
PREFIX_KV_BLOCKS = 176
SKEWED_POLICIES = ("round_robin", "least_outstanding", "predicted_ttft", "prefix_aware")
PREFIX_POLICIES = (
    "round_robin", "predicted_ttft", "affinity", "prefix_aware", "prefix_kv", "prefix_kv_asked",
)  # fmt: skip
# What `python -m bench.routing` runs without --policies (prefix_kv_asked: on request).
DEFAULT_PREFIX_POLICIES = PREFIX_POLICIES[:-1]


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


def _skewed_table(rows: Sequence[dict[str, Any]]) -> str:
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


async def _metric_sums(url: str, names: Sequence[str]) -> dict[str, float]:
    """Each of ``names`` summed over its series on the page at ``url``/metrics."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"{url}/metrics")).text
    sums = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return sums


async def _by_label(url: str, name: str, label: str) -> dict[str, float]:
    """The samples named ``name`` on the page at ``url``/metrics, by their ``label``."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"{url}/metrics")).text
    return {
        sample.labels[label]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and label in sample.labels
    }


_VLLM_CACHE = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
_PREDICTED = (
    "gateway_worker_predicted_prefix_hit_tokens_total",
    "gateway_worker_prefix_query_tokens_total",
    # Counted as each request is recorded, from the worker's usage (its cached tokens).
    "gateway_worker_prefix_missed_tokens_total",
)


async def _cache_counters(workers: Sequence[str]) -> dict[str, dict[str, float]]:
    return {w: await _metric_sums(w, _VLLM_CACHE) for w in workers}


def _prefix_env(workers: Sequence[str], policy: str) -> dict[str, str]:
    kv = policy.startswith("prefix_kv")
    routing = "predicted_ttft" if policy == "affinity" else "prefix_aware" if kv else policy
    env = {
        "GATEWAY_WORKERS": ",".join(workers),
        "GATEWAY_ROUTING": routing,
        "GATEWAY_ADMISSION": "false",
        # prefix_aware on its own guess; prefix_kv on the workers' KV cache events, the
        # prompts tokenized by the gateway (prefix_kv_asked: by the workers' /tokenize).
        "GATEWAY_KV_EVENTS": "true" if kv else "false",
    }
    if policy == "prefix_kv":
        env["GATEWAY_TOKENIZERS"] = f"{BENCH_MODEL}={MODEL_DIR}"
    return env


async def _warm_gateway(gateway: str, seed: int) -> None:
    """A few short requests, so the gateway has seen each worker's speed (as in production)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(8):
            await stream_chat(
                client, gateway, model=BENCH_MODEL, prompt=prompt_text(40, rng), max_tokens=8
            )


async def _calibrate(args: argparse.Namespace, workers: Sequence[str]) -> dict[str, Any]:
    """Completed requests/s of the workload when clients keep the fleet busy.

    Other users as many as the measured run's, their turns in rounds as its schedule sends
    them: the same mix of prompt lengths and cached shares (every first turn of three times
    the users, in 40 s, made prompts shorter and more cached: 88% found against 77-81%
    measured, and 0.7x of that was past capacity at 110 blocks). The rate is taken between the
    10th and the 90th percentile of the completions, without the ramp and the drain.
    """
    users = make_users(args.users, args.systems, args.system_words, args.turns, args.seed + 50)
    await reset_prefix_caches(workers)
    with running_gateway(_prefix_env(workers, "round_robin"), free_port(), "capacity") as gw:
        await _warm_gateway(gw, args.seed)
        log(f"capacity: {args.concurrency} clients back to back, {len(users)} users")
        outcomes = await run_closed(
            gw, users, args.turns, args.concurrency, args.max_tokens, args.calibrate
        )
    ends = sorted(o.sent + o.e2e for o in outcomes if o.ok and o.e2e is not None)
    first, last = len(ends) // 10, len(ends) - 1 - len(ends) // 10
    span = ends[last] - ends[first] if last > first else math.nan
    return {
        "capacity_rps": (last - first) / span if span > 0 else math.nan,
        "requests": len(outcomes),
        "ok": sum(o.ok for o in outcomes),
        "concurrency": args.concurrency,
        "seconds": ends[-1] - ends[0] if ends else math.nan,
    }


async def _run_prefix_policy(
    args: argparse.Namespace, policy: str, workers: Sequence[str], rate: float
) -> dict[str, Any]:
    everyone = make_users(
        args.warmup + args.users, args.systems, args.system_words, args.turns, args.seed
    )
    warmup, users = everyone[: args.warmup], everyone[args.warmup :]
    plan = schedule(args.users, args.turns, rate, args.seed + 1)
    await reset_prefix_caches(workers)
    with contextlib.ExitStack() as stack:
        # Replicas behind a load balancer without affinity: each takes every other request.
        gws = [
            stack.enter_context(
                running_gateway(_prefix_env(workers, policy), free_port(), f"prefix-{policy}-{i}")
            )
            for i in range(args.replicas)
        ]
        for gw in gws:
            await _warm_gateway(gw, args.seed)
        # Steady state: the service has seen every system prompt before (as the policy placed
        # them); a cold start is a transient every policy pays once.
        sessions = policy == "affinity"
        await run_open(
            gws, warmup, schedule(len(warmup), 1, rate, args.seed + 2), args.max_tokens, sessions
        )
        before = await _cache_counters(workers)
        routed_before = await _summed(gws, _routed)
        predicted_before = await _summed(gws, lambda gw: _metric_sums(gw, _PREDICTED))
        mapped_before = await _summed(gws, _tokenizations)
        log(f"{policy}: {len(plan)} requests at {rate:.2f}/s over {len(gws)} gateway(s)")
        outcomes, elapsed = await run_open(gws, users, plan, args.max_tokens, sessions)
        await asyncio.sleep(0.5)  # the last answers recorded (the missed credit)
        after = await _cache_counters(workers)
        routed_after = await _summed(gws, _routed)
        predicted = await _summed(gws, lambda gw: _metric_sums(gw, _PREDICTED))
        mapped = await _summed(gws, _tokenizations)
    mapped = {k: v - mapped_before.get(k, 0.0) for k, v in mapped.items()}
    if mapped:
        log(f"{policy}: prompts mapped to tokens {mapped}")
    predicted = {k: v - predicted_before[k] for k, v in predicted.items()}
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft * 1000 for o in ok if o.ttft is not None]
    tpots = [o.tpot * 1000 for o in ok if o.tpot is not None]
    hits = sum(after[w][_VLLM_CACHE[0]] - before[w][_VLLM_CACHE[0]] for w in workers)
    queries = sum(after[w][_VLLM_CACHE[1]] - before[w][_VLLM_CACHE[1]] for w in workers)
    routed = {w: routed_after.get(w, 0.0) - routed_before.get(w, 0.0) for w in routed_after}
    return {
        "policy": policy,
        "requests": len(outcomes),
        "ok": len(ok),
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p90": percentile(ttfts, 90),
        "ttft_ms_p99": percentile(ttfts, 99),
        "tpot_ms_p50": percentile(tpots, 50),
        "worker_hit_rate": hits / queries if queries else math.nan,
        "predicted_hit_rate": (
            predicted[_PREDICTED[0]] / predicted[_PREDICTED[1]]
            if predicted[_PREDICTED[1]]
            else math.nan
        ),
        # Of the tokens predicted cached, those the worker's usage said it did not find.
        "missed_credit": (
            predicted[_PREDICTED[2]] / predicted[_PREDICTED[0]]
            if predicted[_PREDICTED[0]]
            else math.nan
        ),
        "throughput_rps": len(ok) / elapsed,
        "output_tokens_per_s": sum(o.completion_tokens for o in ok) / elapsed,
        "max_share": max(routed.values()) / max(1.0, sum(routed.values())),
        "seconds": elapsed,
        "tokenizations": mapped,
    }


async def _tokenizations(gateway: str) -> dict[str, float]:
    return await _by_label(gateway, "gateway_prompt_tokenizations_total", "result")


async def _summed(
    gateways: Sequence[str], read: Callable[[str], Awaitable[dict[str, float]]]
) -> dict[str, float]:
    """What ``read`` gives for each gateway replica, summed key by key."""
    total: dict[str, float] = {}
    for gateway in gateways:
        for key, value in (await read(gateway)).items():
            total[key] = total.get(key, 0.0) + value
    return total


def _prefix_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| policy | requests ok | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | worker prefix-cache "
        "hit rate | router's predicted hit rate | of it not found | throughput req/s "
        "| busier worker's share |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        predicted, missed = r["predicted_hit_rate"], r.get("missed_credit", math.nan)
        lines.append(
            f"| {r['policy']} | {r['ok']}/{r['requests']} | {r['ttft_ms_p50']:.0f} "
            f"| {r['ttft_ms_p99']:.0f} | {r['tpot_ms_p50']:.1f} "
            f"| {100 * r['worker_hit_rate']:.1f}% "
            f"| {'-' if math.isnan(predicted) else f'{100 * predicted:.1f}%'} "
            f"| {'-' if math.isnan(missed) else f'{100 * missed:.1f}%'} "
            f"| {r['throughput_rps']:.2f} | {100 * r['max_share']:.0f}% |"
        )
    return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--workload", choices=("prefix", "skewed"), default="prefix")
    parser.add_argument("--policies", nargs="+", help="default: every policy of the workload")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--workers",
        help="URL,URL of two running bench-llama workers (the prefix workload needs them "
        "started with VLLM_SERVER_DEV_MODE=1) instead of starting two",
    )
    parser.add_argument(
        "--kv-blocks",
        type=int,
        help="KV cache of each started worker, in 128-token blocks (default: "
        f"{PREFIX_KV_BLOCKS} for the prefix workload, vLLM's 1 GiB for the skewed one)",
    )
    prefix = parser.add_argument_group("prefix workload")
    prefix.add_argument("--users", type=int, default=64)
    prefix.add_argument("--systems", type=int, default=8, help="shared system prompts")
    prefix.add_argument(
        "--system-words", type=int, default=790, help="words per system prompt (~1,500 tokens)"
    )
    prefix.add_argument("--turns", type=int, default=5, help="turns per user")
    prefix.add_argument(
        "--warmup", type=int, default=16, help="one-turn users before each measured run"
    )
    prefix.add_argument("--load", type=float, default=0.7, help="arrival rate / capacity")
    prefix.add_argument("--capacity", type=float, help="req/s, instead of measuring it")
    prefix.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="gateway replicas, taking the requests in turn (a load balancer without affinity)",
    )
    prefix.add_argument(
        "--calibrate", type=float, default=180.0, help="seconds at most to measure it"
    )
    prefix.add_argument("--concurrency", type=int, default=24, help="clients measuring it")
    skewed = parser.add_argument_group("skewed workload")
    skewed.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    skewed.add_argument("--rate", type=float, default=4.0, help="measured requests per second")
    skewed.add_argument("--background", type=int, default=2, help="long prompts at a time on A")
    skewed.add_argument("--background-words", type=int, default=700)
    args = parser.parse_args(argv)
    if args.kv_blocks is None and args.workload == "prefix":
        args.kv_blocks = PREFIX_KV_BLOCKS
    known = PREFIX_POLICIES if args.workload == "prefix" else SKEWED_POLICIES
    default = DEFAULT_PREFIX_POLICIES if args.workload == "prefix" else SKEWED_POLICIES
    args.policies = args.policies or list(default)
    if unknown := set(args.policies) - set(known):
        parser.error(f"not a policy of the {args.workload} workload: {sorted(unknown)}")
    return args


async def _main_skewed(args: argparse.Namespace, workers: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for policy in args.policies:
        rows.append(await _run_policy(args, policy, workers, args.seed))
    return rows


async def _main_prefix(args: argparse.Namespace, workers: Sequence[str]) -> dict[str, Any]:
    calibration = None
    capacity = args.capacity
    if capacity is None:
        calibration = await _calibrate(args, workers)
        capacity = calibration["capacity_rps"]
    log(f"capacity {capacity:.2f} req/s; offered {args.load * capacity:.2f} req/s")
    rows = [
        await _run_prefix_policy(args, policy, workers, args.load * capacity)
        for policy in args.policies
    ]
    return {"capacity_rps": capacity, "calibration": calibration, "rows": rows}


def main(argv: Sequence[str] | None = None) -> None:
    """Run every policy against the same two workers; print and save the results."""
    args = _parse_args(argv)
    unwind_on_sigterm()
    with contextlib.ExitStack() as stack:
        if args.workers:
            urls = args.workers.split(",")
        else:
            blocks = args.kv_blocks
            specs = [
                bench_worker(
                    free_port(),
                    cpu_binding(i, 2),
                    dev_mode=True,
                    kv_blocks=blocks,
                    kv_events=(free_port(), free_port()),
                )
                for i in range(2)
            ]
            urls = [w.url for w in stack.enter_context(running_workers(specs))]
        if args.workload == "prefix":
            report = asyncio.run(_main_prefix(args, urls))
        else:
            report = {"rows": asyncio.run(_main_skewed(args, urls))}
    if args.workload == "prefix":
        capacity = report["capacity_rps"]
        print(
            f"\nTwo {BENCH_MODEL} workers, one core each, prefix caching on, KV cache "
            f"{args.kv_blocks} blocks of 128 tokens each. {args.systems} system prompts of "
            f"~1,500 tokens shared by {args.users} users, {args.turns} turns each, "
            f"{args.max_tokens} tokens out, after {args.warmup} one-turn users; Poisson "
            f"arrivals at {args.load:g} x capacity ({capacity:.2f} req/s, round robin) = "
            f"{args.load * capacity:.2f} req/s.\n"
        )
        print(_prefix_table(report["rows"]))
    else:
        print(
            f"\nTwo {BENCH_MODEL} workers, one core each; worker A also runs {args.background} "
            f"long prompts (~{int(args.background_words * 1.7)} tokens) at a time sent to it "
            f"directly. Through the gateway: Poisson {args.rate}/s for {args.duration:.0f} s, "
            f"~70-token prompts, {args.max_tokens} tokens out.\n"
        )
        print(_skewed_table(report["rows"]))
    path = write_json(f"routing-{args.workload}", {"args": vars(args), **report})
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()

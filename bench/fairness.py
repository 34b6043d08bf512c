"""Fair-share benchmark: keys of one tier sharing a saturated worker (``make bench-fairness``).

``python -m bench.fairness [--seconds 20]``

A fake worker (:mod:`bench.fake_worker`: 20 ms to the first token, then a token every 20 ms)
behind the gateway with every key in tier ``standard``; each client stream sends
its next request as soon as the last one ends (closed loop), asking for 0.5-1.5x the case's
answer length (12 tokens, 10 in case 2) so that requests do not end in lock step.

1. **Flood and light** (issue 69's case): the running limit 8; one key keeps 48 streams open,
   the other 4. Run with fair share on and off (``GATEWAY_FAIR_SHARE``): each key's queue wait
   (``x-gateway-queue-ms``) p50 / p99 and the flood's goodput (its requests that met the
   tier's TTFT and TPOT targets, per second). Targets: the light key's p50 at most a tenth of
   the flood's and under the tier's TTFT target; the flood's goodput at least 0.95x off.
2. **Weights 1..10**: ten keys of weights 1 to 10, 20 streams each, on a running limit of 55,
   a worker taking 500 ms to the first token (then 5-15 tokens):
   each key's share of the requests admitted after the first quarter and before the clients
   stop, against its weight's share. Target: every key within 10% of its weight's share.

Prints markdown tables and PASS/MISS; a benchmark, not a test: it exits 0 when it ran.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from app.settings import DEFAULT_TIERS
from bench.live import running_gateway
from bench.overhead import free_port, http_status, percentile
from scripts.processes import stop_process

ROOT = Path(__file__).resolve().parent.parent

MODEL = "fake-model"
STANDARD = next(t for t in DEFAULT_TIERS if t.name == "standard")


@dataclass
class KeyRun:
    """What one key's streams got."""

    waits_ms: list[float] = field(default_factory=list)
    met: int = 0
    done: int = 0
    admitted_at: list[float] = field(default_factory=list)
    """When each of its requests got its response head (relative to the run's start)."""


@contextmanager
def fake_worker(ttft_ms: float = 20.0) -> Iterator[str]:
    """The fake worker in a process of its own (its CPU is not the client's)."""
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable, "-m", "bench.fake_worker", "--port", str(port), "--ttft-ms",
            f"{ttft_ms:g}", "--itl-ms", "20", "--tokens", "12", "--model", MODEL,
        ],
        cwd=ROOT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while http_status(f"{url}/v1/models") != 200:
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("the fake worker did not start")
            time.sleep(0.1)
        yield url
    finally:
        stop_process(process, grace=5)


def _keys(weights: Mapping[str, float]) -> tuple[dict[str, str], str]:
    """Bearer keys per name, and ``GATEWAY_API_KEYS`` for them (tier standard)."""
    keys = {name: f"sk-fair-{name}" for name in weights}
    specs = [
        {
            "sha256": hashlib.sha256(key.encode()).hexdigest(),
            "name": name, "tier": "standard", "weight": weights[name],
        }
        for name, key in keys.items()
    ]  # fmt: skip
    return keys, json.dumps(specs)


async def closed_loop(
    url: str,
    keys: Mapping[str, str],
    streams: Mapping[str, int],
    seconds: float,
    tokens: int = 12,
) -> dict[str, KeyRun]:
    """Each key's ``streams`` send back to back for ``seconds``; what each key got."""
    runs = {name: KeyRun() for name in streams}
    rng = random.Random(7)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    template = {
        "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": True,
        "stream_options": {"include_usage": True}, "max_tokens": tokens,
    }  # fmt: skip
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        start = time.perf_counter()
        stop = start + seconds

        async def loop(name: str) -> None:
            run = runs[name]
            headers = {"authorization": f"Bearer {keys[name]}"}
            body = {**template}
            while time.perf_counter() < stop:
                # Answers of 0.5-1.5x ``tokens``: requests of one length end in lock step, and
                # so do the queue's deadlines, which left the queue empty for moments.
                body["max_tokens"] = rng.randint(max(1, tokens // 2), tokens * 3 // 2)
                sent = time.perf_counter()
                first: float | None = None
                events = 0
                async with client.stream(
                    "POST", f"{url}/v1/chat/completions", json=body, headers=headers
                ) as response:
                    if response.status_code != 200:
                        await response.aread()
                        await asyncio.sleep(0.05)
                        continue
                    run.admitted_at.append(time.perf_counter() - start)
                    run.waits_ms.append(float(response.headers["x-gateway-queue-ms"]))
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and '"content"' in line:
                            events += 1
                            if first is None:
                                first = time.perf_counter()
                end = time.perf_counter()
                run.done += 1
                if first is not None and events > 1:
                    tpot = (end - first) / (events - 1)
                    ok_tpot = STANDARD.tpot_slo_s is None or tpot <= STANDARD.tpot_slo_s
                    run.met += int(first - sent <= STANDARD.ttft_slo_s and ok_tpot)

        await asyncio.gather(*(loop(n) for n, count in streams.items() for _ in range(count)))
    return runs


def flood_and_light(worker: str, seconds: float) -> dict[str, dict[str, KeyRun]]:
    """Case 1 with fair share on and off."""
    keys, spec = _keys({"flood": 1.0, "light": 1.0})
    results = {}
    for mode in ("on", "off"):
        env = {
            "GATEWAY_WORKERS": worker, "GATEWAY_API_KEYS": spec,
            "GATEWAY_MAX_RUNNING_PER_WORKER": "8", "GATEWAY_INITIAL_RUNNING_PER_WORKER": "8",
            "GATEWAY_FAIR_SHARE": "true" if mode == "on" else "false",
        }  # fmt: skip
        with running_gateway(env, free_port(), f"fairness-{mode}") as url:
            results[mode] = asyncio.run(closed_loop(url, keys, {"flood": 48, "light": 4}, seconds))
    return results


def weighted(worker: str, seconds: float) -> dict[str, KeyRun]:
    """Case 2: ten keys of weights 1..10 on 55 slots."""
    weights = {f"w{w}": float(w) for w in range(1, 11)}
    keys, spec = _keys(weights)
    env = {
        "GATEWAY_WORKERS": worker, "GATEWAY_API_KEYS": spec,
        "GATEWAY_MAX_RUNNING_PER_WORKER": "55", "GATEWAY_INITIAL_RUNNING_PER_WORKER": "55",
    }  # fmt: skip
    with running_gateway(env, free_port(), "fairness-weights") as url:
        return asyncio.run(closed_loop(url, keys, dict.fromkeys(weights, 20), seconds, 10))


def report(
    cases: Mapping[str, dict[str, KeyRun]], shares: dict[str, KeyRun], seconds: float
) -> list[str]:
    """The tables and PASS/MISS lines of both cases."""
    lines = [
        "| fair share | key | streams | queue wait p50 / p99 ms | requests | goodput req/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for mode, runs in cases.items():
        for name, run in runs.items():
            lines.append(
                f"| {mode} | {name} | {48 if name == 'flood' else 4} "
                f"| {percentile(run.waits_ms, 50):.0f} / {percentile(run.waits_ms, 99):.0f} "
                f"| {run.done} | {run.met / seconds:.2f} |"
            )
    on, off = cases["on"], cases["off"]
    light, flood = percentile(on["light"].waits_ms, 50), percentile(on["flood"].waits_ms, 50)
    ratio = on["flood"].met / off["flood"].met if off["flood"].met else float("inf")
    lines += [
        "",
        _check(light <= flood / 10, f"light p50 {light:.0f} ms <= flood p50 {flood:.0f} / 10"),
        _check(
            light <= 1000 * STANDARD.ttft_slo_s,
            f"light p50 under the tier's TTFT target {STANDARD.ttft_slo_s:g} s",
        ),
        _check(ratio >= 0.95, f"flood goodput on / off {ratio:.2f}x >= 0.95x"),
        f"all keys' goodput on / off: {sum(r.met for r in on.values()) / seconds:.2f} / "
        f"{sum(r.met for r in off.values()) / seconds:.2f} req/s",
        "",
        "| key | weight share | admitted share | off by |",
        "|---|---:|---:|---:|",
    ]
    # Admitted while every key kept sending: the first quarter (all sent at once, first come
    # first served) and the tail (queues draining after the clients stop) left out.
    later = {n: sum(seconds / 4 <= t < seconds for t in r.admitted_at) for n, r in shares.items()}
    total_w = sum(int(n[1:]) for n in shares)
    total = sum(later.values()) or 1
    worst = 0.0
    for name, count in later.items():
        want = int(name[1:]) / total_w
        got = count / total
        off_by = abs(got - want) / want
        worst = max(worst, off_by)
        lines.append(f"| {name} | {100 * want:.1f}% | {100 * got:.1f}% | {100 * off_by:.1f}% |")
    lines += [
        "",
        _check(worst <= 0.10, f"every weight within 10% of its share: worst {100 * worst:.1f}%"),
    ]
    return lines


def _check(ok: bool, text: str) -> str:
    return f"{'PASS' if ok else 'MISS'} {text}"


def main(argv: Sequence[str] | None = None) -> None:
    """Run both cases; print the tables and checks."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds per run")
    args = parser.parse_args(argv)
    with fake_worker() as worker:
        cases = flood_and_light(worker, args.seconds)
    # Case 2's requests last ~0.7 s in few events: 200 streams of many events each made this
    # client too slow to keep every key backlogged (a key with nothing queued gives its turn
    # away), which measured the client, not the shares.
    with fake_worker(ttft_ms=500.0) as worker:
        shares = weighted(worker, args.seconds)
    print(f"\nFake worker: 20 ms TTFT, 20 ms a token; {args.seconds:g} s per run.\n")
    print("\n".join(report(cases, shares, args.seconds)))


if __name__ == "__main__":
    main()

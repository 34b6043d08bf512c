"""Admission benchmark: SLO-aware admission on and off over the whole load range, real workers.

``python -m bench.admission [--duration 40] [--seeds 5]`` (``make bench-admission``)

Real vLLM CPU workers serve ``bench-llama`` (see :mod:`bench.live`): two where the machine has
a core for each besides the last, which is left to the gateway and this client; one on a
2-core machine (:func:`scripts.vllm_worker.separate_cpus`: two on one core serve half as
much). Three API keys map to the gateway's default tiers (interactive: TTFT 1 s, TPOT
100 ms; standard: TTFT 5 s, TPOT 200 ms; batch: TTFT 60 s).
Every request streams a chat completion of a prompt (a shared ~340-token system prompt and a
user message of ~35-220 tokens of its own, see :func:`chat_prompt`) and 64 tokens out.

1. Capacity (after a warm-up at full batch): Poisson arrivals of interactive requests at 6, 7,
   8, ... req/s (or 5, 4, ..., 1, 0.5, 0.25 if 6 fails) through the gateway with admission
   off, each step two runs of ``--calibrate`` seconds with different arrivals; the capacity is
   the highest rate (to half a step) at which 90% of the requests of both runs sent after
   the first quarter of each met the interactive SLO (``--capacity`` takes a figure instead);
   a step is given up, its requests cancelled, once more than 10% of them missed.
2. The sweep: at 0.25, 0.5, 0.75, 1, 1.5, 2 and 3 x capacity, the same Poisson arrivals (a
   30/50/20 interactive/standard/batch mix, ``--duration`` seconds) through a fresh gateway
   with admission on and off (plain pass-through), each after a short warm-up at capacity
   and with the workers' prefix caches emptied first (the second run would otherwise find
   the first's prompts cached). Which mode goes first alternates from one comparison to the
   next, so a machine that slows down over the session does not favour either. At 3x,
   ``--seeds`` arrival sequences in all; at the other loads, ``--repeats`` replays each.
3. Cold start: a fresh gateway, no warm-up, 64 streams at once (on and off).
4. Bursty: a fresh gateway, no warm-up, 5 s at 2x capacity then 5 s at 0.25x, four times.

With ``--processes N`` every gateway serves from N processes (``GATEWAY_PROCESSES``) sharing
state through a redis-server started for the session (``GATEWAY_REDIS_URL``, emptied before
each gateway): the same runs and targets, through a scaled-out pod.

Per run it reports goodput (requests that met every SLO of their tier, per second of
arrivals), SLO attainment (met / sent), TTFT and TPOT p50/p99 of the answered requests,
rejections (429/503 answers) and lost requests (no HTTP answer at all). Prints markdown tables
and PASS/MISS against the targets; writes ``bench/results/admission.json``. A benchmark, not a
test: it always exits 0 when it ran.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import random
import secrets
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
from prometheus_client.parser import text_string_to_metric_families

from app.settings import DEFAULT_TIERS, TierSpec
from bench.live import (
    BENCH_MODEL,
    Outcome,
    arrival_times,
    bench_worker,
    fresh_text,
    log,
    reset_prefix_caches,
    running_gateway,
    running_workers,
    stream_chat,
    unwind_on_sigterm,
    write_json,
)
from bench.overhead import free_port, percentile
from bench.sim_worker import EngineConfig, running_sims
from scripts.redis_server import RedisServer
from scripts.vllm_worker import separate_cpus

DEFAULT_TIER_MAP: Final = {tier.name: tier for tier in DEFAULT_TIERS}
TIERS: dict[str, TierSpec] = dict(DEFAULT_TIER_MAP)
"""The tiers requests are judged by (and the gateway is given): the defaults, or scaled."""
SIM_MAX_RPS = 1000.0
"""The capacity search's ceiling with simulated workers."""


def use_scaled_tiers(scale: float) -> None:
    """Judge (and configure) by the default tiers with every target and wait times ``scale``."""
    for name, tier in DEFAULT_TIER_MAP.items():
        TIERS[name] = tier.model_copy(
            update={
                "ttft_slo_s": tier.ttft_slo_s * scale,
                "tpot_slo_s": None if tier.tpot_slo_s is None else tier.tpot_slo_s * scale,
                "max_queue_wait_s": tier.max_queue_wait_s * scale,
            }
        )


MIX = (("interactive", 0.3), ("standard", 0.5), ("batch", 0.2))
MAX_TOKENS = 64
WARMUP_STREAMS = 64
CALIBRATION_ATTAINMENT = 0.9
CALIBRATION_RUNS = 2
CLIENT_POOLS = 64
"""Connection pools the client spreads its requests over (see :func:`drive`)."""
CLIENT_BUSY = 0.8
"""A client process busier than this share of a run measures its own lateness too."""
CALIBRATION_LIFETIMES = 5.0
"""A calibration run shorter than this many request lifetimes at capacity overestimates it."""
CALIBRATION_START_RPS = 6.0
CALIBRATION_MIN_RPS = 0.25
CALIBRATION_MAX_RPS = 30.0
SEARCH_GEOMETRIC_RPS = 30.0
"""Above this rate the capacity search doubles (and then bisects) instead of stepping by 1."""
GIVE_UP_CHECK_S = 0.1
LOADS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
SEEDED_LOADS = (1.5, 2.0, 3.0)
"""Loads run with ``--seeds`` arrival sequences each (the others replay one ``--repeats``)."""
COLD_BURST = 64
BURSTY = ((5.0, 2.0), (5.0, 0.25)) * 4
"""(seconds, x capacity) spans of the bursty run."""
DIURNAL = (0.2, 0.5, 1.0, 1.5, 2.0, 2.5, 2.5, 2.0, 1.5, 1.0, 0.5, *(0.2,) * 5)
"""x capacity of the diurnal run's windows (``--diurnal-window`` seconds each).

The day ends with five light windows: the peak leaves a queue (the arrivals above capacity
that were not refused) that the light load's spare capacity drains only over a few windows,
and only the light windows after it drained are judged.
"""
LIGHT = 0.75
"""At or below this x capacity, admission must change nothing."""
SYSTEM_PROMPT: Final = fresh_text(200, random.Random(0))
"""The start every prompt shares (~340 tokens), as a chat application's system prompt."""
USER_WORDS: Final = (20, 130)
"""The range of a user message's words (~35-220 tokens), drawn uniformly."""


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of the workload: when, which tier, what prompt."""

    offset: float
    tier: str
    prompt: str


def chat_prompt(rng: random.Random) -> str:
    """The shared system prompt, then a user message of its own that no other prompt shares.

    Only the system prompt is ever found in a worker's prefix cache, so a prompt's prefill costs
    the same at a run's start as at its end, and as in the calibration. Prompts that were
    rotations of one short text (33 different starts) were all cached within half a run: TTFT
    medians fell by half after 25 s, and the first half of every run was served more slowly
    than the capacity calibrated on warm caches said. User messages of 100-400 words (~500
    tokens to prefill each) brought the capacity to 1 req/s: 10 requests in a 40-s run at
    0.25x, too few to compare anything.
    """
    return f"{SYSTEM_PROMPT} {fresh_text(rng.randint(*USER_WORDS), rng)}"


def workload(rate: float, duration: float, rng: random.Random) -> list[Arrival]:
    """Poisson arrivals with the tier mix and :func:`chat_prompt` prompts (~375-560 tokens)."""
    names = [name for name, _ in MIX]
    weights = [share for _, share in MIX]
    return [
        Arrival(offset, rng.choices(names, weights)[0], chat_prompt(rng))
        for offset in arrival_times(rate, duration, rng)
    ]


def sent(arrivals: list[Arrival], tiers: frozenset[str] | None) -> list[Arrival]:
    """The arrivals of ``tiers`` (all when None), at the times the whole mix drew them.

    Filtering the mixed sequence, rather than drawing one of those tiers alone, replays the
    very requests they met in the mixed run: what is left of a tier's misses is its own bursts',
    the rest the other tiers'.
    """
    return arrivals if tiers is None else [a for a in arrivals if a.tier in tiers]


def met_slo(outcome: Outcome, tier: TierSpec) -> bool:
    """Whether an answered request met every SLO of its tier."""
    if not outcome.ok or outcome.ttft is None or outcome.ttft > tier.ttft_slo_s:
        return False
    return tier.tpot_slo_s is None or (outcome.tpot is not None and outcome.tpot <= tier.tpot_slo_s)


def certain_miss(outcome: Outcome, tier: TierSpec, now: float) -> bool:
    """Whether a request, answered or still running at ``now``, can no longer meet its SLO.

    An answered one is judged by :func:`met_slo`; one still running misses once its first
    token is later than the target, whether it has come yet or not; an unsent one (``sent``
    still ahead) does not.
    """
    if outcome.e2e is not None or outcome.error is not None:
        return not met_slo(outcome, tier)
    if outcome.sent > now:
        return False
    first = outcome.ttft if outcome.ttft is not None else now - outcome.sent
    return first > tier.ttft_slo_s


async def drive(
    gateway: str,
    arrivals: Sequence[Arrival],
    keys: Mapping[str, str],
    give_up: Callable[[Sequence[Outcome], float], bool] | None = None,
) -> list[Outcome]:
    """Send every arrival at its time (open loop); wait for every answer.

    ``give_up(outcomes, now)`` is asked every ``GIVE_UP_CHECK_S`` while requests run (an
    outcome not sent yet has ``sent`` = inf); once it says so, the requests still running are
    cancelled (their streams closed, which the gateway passes on to the worker) and the rest
    are never sent.
    """
    outcomes = [Outcome(tag=a.tier, sent=math.inf) for a in arrivals]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with contextlib.AsyncExitStack() as stack:
        # httpcore's pool looks at every connection it holds to place each request: with
        # thousands of streams in flight in one pool that took 87% of this process's CPU
        # (py-spy, 1.5x on the simulated workers at x4), and the client measured its own
        # lateness. Many small pools keep that scan short.
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(timeout=600, limits=limits))
            for _ in range(CLIENT_POOLS)
        ]
        start = time.perf_counter()

        async def one(arrival: Arrival, outcome: Outcome, client: httpx.AsyncClient) -> None:
            await asyncio.sleep(max(0.0, start + arrival.offset - time.perf_counter()))
            await stream_chat(
                client,
                gateway,
                model=BENCH_MODEL,
                prompt=arrival.prompt,
                max_tokens=MAX_TOKENS,
                tag=arrival.tier,
                headers={"authorization": f"Bearer {keys[arrival.tier]}"},
                outcome=outcome,
            )

        everything = asyncio.gather(
            *(
                one(a, o, clients[k % CLIENT_POOLS])
                for k, (a, o) in enumerate(zip(arrivals, outcomes, strict=True))
            )
        )
        while give_up is not None and not everything.done():
            await asyncio.wait([everything], timeout=GIVE_UP_CHECK_S)
            if not everything.done() and give_up(outcomes, time.perf_counter()):
                everything.cancel()
                await asyncio.wait([everything])
                if not everything.cancelled():
                    everything.exception()  # the cancellation just asked for: retrieved
                return outcomes
        await everything
    return outcomes


_SAMPLED = (
    "gateway_worker_concurrency_limit",
    "gateway_worker_proven_concurrency",
    "gateway_worker_prefill_concurrency_limit",
    "gateway_worker_in_flight_requests",
    "gateway_worker_prefilling_requests",
    "gateway_queue_depth",
    "gateway_in_flight_requests",
    "gateway_worker_limit_cuts_total",
    "gateway_worker_decode_pace_seconds",
    "gateway_worker_decode_step_seconds",
    "gateway_worker_decode_seconds_per_sequence",
)


def parse_sample(text: str) -> dict[str, float]:
    """Admission's gauges and limit cuts, keyed ``name{worker or tier}`` (and ``,cause``)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in _SAMPLED:
                continue
            labels = sample.labels
            owner = labels.get("worker") or labels.get("tier", "")
            if "cause" in labels:
                owner = f"{owner},{labels['cause']}"
            key = f"{sample.name}{{{owner}}}"
            values[key] = values.get(key, 0.0) + sample.value
    return values


async def sample_gateway(gateway: str, period: float, into: list[dict[str, float]]) -> None:
    """Every ``period`` seconds until cancelled, append admission's gauges (a timeline)."""
    async with httpx.AsyncClient(timeout=5) as client:
        start = time.perf_counter()
        while True:
            try:
                response = await client.get(f"{gateway}/metrics")
                into.append({"t": time.perf_counter() - start, **parse_sample(response.text)})
            except httpx.HTTPError:
                pass
            await asyncio.sleep(period)


async def closed_loop(
    gateway: str, streams: int, seconds: float, key: str, rng: random.Random
) -> list[Outcome]:
    """``streams`` clients sending back to back for ``seconds``; every finished outcome."""
    stop = time.perf_counter() + seconds
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(timeout=600) as client:

        async def loop() -> None:
            while time.perf_counter() < stop:
                outcomes.append(
                    await stream_chat(
                        client,
                        gateway,
                        model=BENCH_MODEL,
                        prompt=chat_prompt(rng),
                        max_tokens=MAX_TOKENS,
                        headers={"authorization": f"Bearer {key}"},
                    )
                )

        await asyncio.gather(*(loop() for _ in range(streams)))
    return outcomes


def steady(arrivals: Sequence[Arrival], seconds: float) -> list[bool]:
    """Per arrival, whether a calibration run of ``seconds`` counts it (steady state).

    Those sent in the first quarter, while the batch fills from empty, are left out.
    """
    return [a.offset >= seconds / 4 for a in arrivals]


async def attainment_at(
    gateway: str,
    arrivals: Sequence[Arrival],
    seconds: float,
    keys: Mapping[str, str],
    allowed_misses: float = math.inf,
) -> dict[str, float]:
    """Interactive requests at ``arrivals``' times: the share meeting the SLO.

    Counted over the requests sent after the first quarter of the ``seconds`` (steady state).
    Once more than ``allowed_misses`` of those have certainly missed (:func:`certain_miss`),
    the run is given up (``abandoned``: the rate has failed, and an overload's backlog would
    otherwise take minutes to drain on a slow worker).
    """
    strict = TIERS["interactive"]
    counted = steady(arrivals, seconds)

    def missed(outcomes: Sequence[Outcome], now: float) -> int:
        return sum(
            c and certain_miss(o, strict, now) for c, o in zip(counted, outcomes, strict=True)
        )

    def give_up(outcomes: Sequence[Outcome], now: float) -> bool:
        return missed(outcomes, now) > allowed_misses

    everything = await drive(gateway, arrivals, keys, give_up)
    rate = len(arrivals) / seconds
    misses = missed(everything, time.perf_counter())
    if misses > allowed_misses:
        log(f"calibration: {rate:.1f} req/s: given up after {misses} of {sum(counted)} missed")
        return {"rps": rate, "sent": sum(counted), "missed": misses, "abandoned": 1.0}
    outcomes = [o for o, c in zip(everything, counted, strict=True) if c]
    met = sum(met_slo(o, strict) for o in outcomes) / max(len(outcomes), 1)
    ok = [o for o in outcomes if o.ok]
    ttft = percentile([o.ttft for o in ok if o.ttft is not None], 90)
    tpot = percentile([o.tpot for o in ok if o.tpot is not None], 90)
    log(f"calibration: {rate:.1f} req/s: {100 * met:.1f}% met the interactive SLO, TTFT p90 "
        f"{ttft * 1000:.0f} ms, TPOT p90 {tpot * 1000:.1f} ms")  # fmt: skip
    return {"rps": rate, "sent": len(outcomes), "missed": misses, "attainment": met,
            "ttft_p90_s": ttft, "tpot_p90_s": tpot}  # fmt: skip


async def calibrate(
    gateway: str,
    seconds: float,
    keys: Mapping[str, str],
    rng: random.Random,
    most: float = CALIBRATION_MAX_RPS,
    geometric: float = SEARCH_GEOMETRIC_RPS,
) -> tuple[float, list[dict[str, float]]]:
    """Capacity: the highest Poisson rate at which 90% of requests meet the interactive SLO.

    The definition DistServe uses for goodput per GPU. Through the gateway with admission off
    (plain pass-through), Poisson arrivals of interactive requests from
    ``CALIBRATION_START_RPS`` up (or down, if it fails) in steps of 1 req/s, halves below 1,
    then the half step between the last passing and the first failing rate
    (:func:`search_capacity`). Each step is ``CALIBRATION_RUNS`` runs of ``seconds`` with
    different arrivals, every answer awaited before the next run, and passes when 90% of their
    requests together met the SLO; it fails as soon as more than 10% of them have certainly
    missed (the rest are then cancelled). Runs must be long enough for an overload's backlog
    to build up: 15-second steps were seen to pass at 11 req/s where 40 seconds at 10 req/s
    left 22% within the SLO. And one run is not enough: near the knee a pass-through either
    keeps up or its backlog runs away, depending on the bursts in that one sequence (on this
    machine 40-s runs at 9.5 req/s met 99-100% in some runs, 1-64% in others).
    Returns the capacity and every run's figures.
    """
    steps: list[dict[str, float]] = []

    async def step(rate: float) -> bool:
        draws = [
            [Arrival(a.offset, "interactive", a.prompt) for a in workload(rate, seconds, rng)]
            for _ in range(CALIBRATION_RUNS)
        ]
        counted = sum(sum(steady(arrivals, seconds)) for arrivals in draws)
        allowed: float = math.floor(counted * (1 - CALIBRATION_ATTAINMENT) + 1e-9)
        runs: list[dict[str, float]] = []
        for arrivals in draws:
            runs.append(await attainment_at(gateway, arrivals, seconds, keys, allowed))
            allowed -= runs[-1]["missed"]
            if runs[-1].get("abandoned"):
                steps.extend(runs)
                return False
        steps.extend(runs)
        sent = sum(run["sent"] for run in runs)
        met = sum(run["attainment"] * run["sent"] for run in runs) / max(sent, 1)
        log(f"calibration: {rate:.1f} req/s: {100 * met:.1f}% over {len(runs)} runs")
        return met >= CALIBRATION_ATTAINMENT

    return await search_capacity(step, most, geometric), steps


def calibration_too_short(
    steps: Sequence[Mapping[str, float]], capacity: float, seconds: float
) -> str | None:
    """A warning when the calibration's runs were too short for the capacity they found.

    A request holds its slot for its whole lifetime (its TTFT and ``MAX_TOKENS`` at its TPOT):
    until the first ones end, a run fills the workers' slots without any backlog, and an
    overload shows only once its backlog outgrows the TTFT target. Runs under
    ``CALIBRATION_LIFETIMES`` lifetimes then pass rates no long run sustains (seen: 30-s runs
    at x16 on the simulated workers, where a request lived 22 s, found 18 req/s; the fleet
    served 9-10 a second over 160-s runs).
    """
    at = [s for s in steps if s.get("rps") == capacity and "tpot_p90_s" in s]
    if not at:
        return None
    lifetime = max(s["ttft_p90_s"] + MAX_TOKENS * s["tpot_p90_s"] for s in at)
    if seconds >= CALIBRATION_LIFETIMES * lifetime:
        return None
    return (
        f"WARNING: calibration runs of {seconds:g} s are under {CALIBRATION_LIFETIMES:g} "
        f"request lifetimes at the capacity found ({lifetime:.1f} s each): the capacity is "
        f"likely too high; calibrate for at least {CALIBRATION_LIFETIMES * lifetime:.0f} s "
        "(--calibrate) or with a smaller --time-scale"
    )


async def search_capacity(
    passes: Callable[[float], Awaitable[bool]],
    most: float = CALIBRATION_MAX_RPS,
    geometric: float = SEARCH_GEOMETRIC_RPS,
) -> float:
    """The highest rate ``passes``, searched as :func:`calibrate` says (0: none down to the floor).

    Up or down from ``CALIBRATION_START_RPS`` in steps of 1 req/s; below 1 req/s in halves
    (a slow CPU may serve less than one of the benchmark's requests a second) down to
    ``CALIBRATION_MIN_RPS``; then the midpoint between the last passing and the first failing
    rate, when they are at least 0.5 req/s apart.
    """
    passed: dict[float, bool] = {}
    rate = CALIBRATION_START_RPS
    while CALIBRATION_MIN_RPS <= rate <= most and rate not in passed:
        passed[rate] = await passes(rate)
        if passed[rate]:
            rate = rate + 1.0 if 1.0 <= rate < geometric else rate * 2
        else:
            rate = rate - 1.0 if 1.0 < rate <= geometric else rate / 2
    best = max((r for r, ok in passed.items() if ok), default=0.0)
    failed = min((r for r, ok in passed.items() if not ok and r > best), default=math.inf)
    # Then halve the gap between the last pass and the first failure, down to 0.5 req/s (a
    # tenth of the rate above SEARCH_GEOMETRIC_RPS, where the search doubled).
    while (
        best > 0
        and failed < math.inf
        and failed - best >= (0.5 if best <= geometric else best / 10)
    ):
        middle = (best + failed) / 2
        if await passes(middle):
            best = middle
        else:
            failed = middle
        if best <= geometric:
            break  # the step search above was fine-grained already: one midpoint, as before
    return best


def summarize(outcomes: Sequence[Outcome], duration: float) -> dict[str, dict[str, Any]]:
    """Per tier (and ``all``): goodput, attainment, latency percentiles, rejections, losses."""
    rows: dict[str, dict[str, Any]] = {}
    for name in [*TIERS, "all"]:
        mine = [o for o in outcomes if name in ("all", o.tag)]
        answered = [o for o in mine if o.ok]
        met = [o for o in mine if met_slo(o, TIERS[o.tag])]
        ttfts = [o.ttft * 1000 for o in answered if o.ttft is not None]
        tpots = [o.tpot * 1000 for o in answered if o.tpot is not None]
        rejected = [o for o in mine if o.status in (429, 503)]
        queued = [o.queue_ms for o in answered if o.queue_ms is not None]
        rows[name] = {
            "sent": len(mine),
            "answered_ok": len(answered),
            "met_slo": len(met),
            "goodput_rps": len(met) / duration,
            "attainment": len(met) / len(mine) if mine else None,
            "ttft_ms_p50": percentile(ttfts, 50),
            "ttft_ms_p99": percentile(ttfts, 99),
            "tpot_ms_p50": percentile(tpots, 50),
            "tpot_ms_p99": percentile(tpots, 99),
            "queue_ms_p99": percentile(queued, 99),
            "queued": sum(q >= 1.0 for q in queued),
            "rejected": len(rejected),
            "rejected_pct": 100 * len(rejected) / len(mine) if mine else None,
            "rejected_reasons": dict(Counter(_reason(o) for o in rejected)),
            "other_errors": len(mine) - len(answered) - len(rejected),
            "lost": sum(o.lost for o in mine),
            "retry_after_s": sorted({o.retry_after for o in rejected if o.retry_after}),
        }
    return rows


def _reason(outcome: Outcome) -> str:
    """The error code of a refused request (``http 429 deadline_unreachable``'s last word)."""
    return (outcome.error or "-").rsplit(" ", 1)[-1]


def _reasons(row: Mapping[str, Any]) -> str:
    """`` (code count, ...)`` of a row's refusals, most frequent first; empty when none."""
    reasons = sorted(row.get("rejected_reasons", {}).items(), key=lambda kv: -kv[1])
    return f" ({', '.join(f'{code} {n}' for code, n in reasons)})" if reasons else ""


def _pct(share: float | None) -> str:
    """A share 0..1 as a percentage without its sign (``-`` when unknown)."""
    return _fmt(None if share is None else 100 * share)


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    return f"{value:.{digits}f}"


def table(modes: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """One markdown table: a row per mode and tier."""
    lines = [
        "| admission | tier | sent | goodput req/s | SLO attainment | TTFT p50 / p99 ms "
        "| TPOT p50 / p99 ms | queued >= 1 ms | queue p99 ms | rejected | other errors | lost |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, rows in modes.items():
        for tier, r in rows.items():
            lines.append(
                f"| {mode} | {tier} | {r['sent']} | {_fmt(r['goodput_rps'], 2)} "
                f"| {_pct(r['attainment'])}% | {_fmt(r['ttft_ms_p50'], 0)} / "
                f"{_fmt(r['ttft_ms_p99'], 0)} | {_fmt(r['tpot_ms_p50'])} / "
                f"{_fmt(r['tpot_ms_p99'])} | {r['queued']} | {_fmt(r['queue_ms_p99'])} "
                f"| {_fmt(r['rejected_pct'])}% | {r['other_errors']} "
                f"| {r['lost']} |"
            )
    return "\n".join(lines)


def sweep_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """A row per run: goodput and rejections on and off, interactive attainment, losses."""
    lines = [
        "| run | offered req/s | goodput on / off req/s | on / off | rejected on / off "
        "| queued on (p99 ms) | interactive attainment on / off "
        "| interactive TTFT p99 on / off ms | lost |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        on, off = run["results"]["on"], run["results"]["off"]
        a_on, a_off = on["interactive"]["attainment"], off["interactive"]["attainment"]
        lines.append(
            f"| {run['name']} | {_fmt(run['offered_rps'])} "
            f"| {_fmt(on['all']['goodput_rps'], 2)} / {_fmt(off['all']['goodput_rps'], 2)} "
            f"| {_fmt(_ratio(run), 2)}x | {on['all']['rejected']}{_reasons(on['all'])} / "
            f"{off['all']['rejected']} "
            f"| {on['all']['queued']} ({_fmt(on['all']['queue_ms_p99'])}) "
            f"| {_pct(a_on)}% / "
            f"{_pct(a_off)}% "
            f"| {_fmt(on['interactive']['ttft_ms_p99'], 0)} / "
            f"{_fmt(off['interactive']['ttft_ms_p99'], 0)} "
            f"| {on['all']['lost'] + off['all']['lost']} |"
        )
    return "\n".join(lines)


def _ratio(*runs: Mapping[str, Any]) -> float:
    """Goodput on / off, pooled over ``runs`` (replays of one load)."""
    on = sum(run["results"]["on"]["all"]["goodput_rps"] for run in runs)
    off = sum(run["results"]["off"]["all"]["goodput_rps"] for run in runs)
    if off <= 0:
        return math.inf if on > 0 else 1.0
    return float(on / off)


def _points(runs: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Runs by point: a load's replays together (not a seeded load's seeds), each extra alone."""
    points: dict[str, list[Mapping[str, Any]]] = {}
    for run in runs:
        load = run.get("load")
        key = f"{load:g}x" if load is not None and load not in SEEDED_LOADS else run["name"]
        points.setdefault(key, []).append(run)
    return points


def _point_ratio(name: str, runs: Sequence[Mapping[str, Any]]) -> str:
    replays = f" ({len(runs)} runs)" if len(runs) > 1 else ""
    return f"{name}{replays} {_ratio(*runs):.2f}x"


def checks(runs: Sequence[Mapping[str, Any]], queue_ms: float = 1.0) -> list[str]:
    """PASS/MISS lines against the targets (``queue_ms``: the queue-time p99 target when light)."""
    lines = []

    def check(ok: bool, text: str) -> None:
        lines.append(f"{'PASS' if ok else 'MISS'} {text}")

    light = [r for r in runs if r.get("load") is not None and r["load"] <= LIGHT]
    rejected = sum(r["results"]["on"]["all"]["rejected"] for r in light)
    check(rejected == 0, f"no rejection at or below {LIGHT:g}x capacity: {rejected}")
    queued = {r["name"]: r["results"]["on"]["all"]["queue_ms_p99"] for r in light}
    check(
        all(q is not None and q < queue_ms for q in queued.values()),
        f"queue time p99 under {queue_ms:g} ms at or below {LIGHT:g}x: "
        + ", ".join(f"{name} {_fmt(q, 2)} ms" for name, q in queued.items()),
    )
    points = _points(runs)
    worse = [_point_ratio(k, p) for k, p in _points(light).items() if _ratio(*p) < 1.0]
    check(not worse, f"goodput on >= off at or below {LIGHT:g}x: {worse or 'every point'}")
    low = [_point_ratio(k, p) for k, p in points.items() if _ratio(*p) < 0.98]
    check(not low, f"goodput on >= 0.98x off at every point: {low or 'every point'}")
    for load in SEEDED_LOADS:
        seeds = [r for r in runs if r.get("load") == load]
        if not seeds:
            continue
        ratios = [_ratio(r) for r in seeds]
        check(
            min(ratios) >= 2.0,
            f"goodput on / off at {load:g}x >= 2x at every seed: "
            + ", ".join(f"{x:.2f}x" for x in ratios),
        )
        attained = sorted(
            100 * (r["results"]["on"]["interactive"]["attainment"] or 0.0) for r in seeds
        )
        median = attained[len(attained) // 2]
        check(
            median >= 95 and attained[0] >= 92,
            f"interactive attainment at {load:g}x over {len(attained)} seeds: median "
            f"{median:.1f}%, lowest {attained[0]:.1f}% (targets 95%, 92%)",
        )
    for run in runs:
        if "windows" not in run:
            continue
        calm = [w for w in run["windows"] if w["load"] < LIGHT and w["drained"]]
        refused = {f"{w['start_s']:.0f} s": w["on"]["all"]["rejected"] for w in calm}
        check(
            not any(refused.values()),
            f"{run['name']}: no rejection in a window under {LIGHT:g}x once the peak's backlog "
            f"drained: {refused or 'no such window'}",
        )
    lost = sum(r["results"][m]["all"]["lost"] for r in runs for m in ("on", "off"))
    check(lost == 0, f"every request answered: {lost} lost")
    return lines


def diurnal_windows(
    arrivals: Sequence[Arrival], result: Mapping[str, Any], span: float, capacity: float
) -> list[dict[str, Any]]:
    """Per window of the diurnal run: its load and, per mode, what its arrivals got.

    ``drained``: the gateway with admission on had an empty queue at some sample between the
    last window above ``LIGHT`` (the previous peak) and this window's start; a light window
    before any peak counts as drained.
    """
    windows: list[dict[str, Any]] = []
    timeline = result["timeline"].get("on", [])
    peak_end = -math.inf
    for k, load in enumerate(DIURNAL):
        start, end = k * span, (k + 1) * span
        row: dict[str, Any] = {"window": k, "start_s": start, "end_s": end, "load": load}
        row["offered_rps"] = load * capacity
        for mode, requests in result["requests"].items():
            picked = [
                Outcome(**r)
                for a, r in zip(arrivals, requests, strict=True)
                if start <= a.offset < end
            ]
            row[mode] = summarize(picked, span)
        if load > LIGHT:
            peak_end = end
            row["drained"] = False
        else:
            row["drained"] = peak_end == -math.inf or any(
                peak_end <= sample["t"] <= start and _queued(sample) == 0 for sample in timeline
            )
        windows.append(row)
    return windows


def _queued(sample: Mapping[str, float]) -> float:
    """Requests in the gateway's queue, all tiers, in one timeline sample."""
    return sum(v for k, v in sample.items() if k.startswith("gateway_queue_depth{"))


def windows_table(windows: Sequence[Mapping[str, Any]]) -> str:
    """A row per diurnal window: load, goodput and refusals on and off, interactive SLO."""
    lines = [
        "| window | x capacity | sent | goodput on / off req/s | rejected on / off "
        "| interactive attainment on / off | queue p99 on ms | backlog drained |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for w in windows:
        on, off = w["on"], w["off"]
        a_on, a_off = on["interactive"]["attainment"], off["interactive"]["attainment"]
        lines.append(
            f"| {w['start_s']:.0f}-{w['end_s']:.0f} s "
            f"| {w['load']:g} | {on['all']['sent']} "
            f"| {_fmt(on['all']['goodput_rps'], 2)} / {_fmt(off['all']['goodput_rps'], 2)} "
            f"| {on['all']['rejected']} / {off['all']['rejected']} "
            f"| {_pct(a_on)}% / "
            f"{_pct(a_off)}% "
            f"| {_fmt(on['all']['queue_ms_p99'])} | {'yes' if w['drained'] else 'no'} |"
        )
    return "\n".join(lines)


class Bench:
    """The gateways and client of one benchmark session."""

    def __init__(
        self, args: argparse.Namespace, urls: Sequence[str], redis: RedisServer | None = None
    ) -> None:
        self.args = args
        self.urls = urls
        self.redis = redis
        self.keys = {tier: f"sk-bench-{tier}-{secrets.token_hex(8)}" for tier in TIERS}
        key_specs = [
            {"sha256": hashlib.sha256(k.encode()).hexdigest(), "tier": t, "name": f"bench-{t}"}
            for t, k in self.keys.items()
        ]
        self.env = {"GATEWAY_WORKERS": ",".join(urls), "GATEWAY_API_KEYS": json.dumps(key_specs)}
        if TIERS != DEFAULT_TIER_MAP:  # scaled for simulated workers: the gateway's too
            self.env["GATEWAY_TIERS"] = json.dumps([t.model_dump() for t in TIERS.values()])
            self.env["GATEWAY_FIRST_TOKEN_TIMEOUT_S"] = str(120.0 * args.time_scale)
        self.compared = 0
        if redis is not None:
            self.env["GATEWAY_PROCESSES"] = str(args.processes)
            self.env["GATEWAY_REDIS_URL"] = redis.url

    @contextlib.contextmanager
    def gateway(self, mode: str, name: str, cpu: list[float] | None = None) -> Iterator[str]:
        """A fresh gateway with admission ``on`` or ``off`` (and a Redis emptied for it).

        ``cpu`` gets the gateway's CPU seconds as the block ends (its processes' together).
        """
        env = {**self.env, "GATEWAY_ADMISSION": "true" if mode == "on" else "false"}
        if self.redis is not None:
            self.redis.command("FLUSHALL")
        with running_gateway(env, free_port(), f"admission-{name}-{mode}", cpu) as url:
            if self.redis is not None:
                await_processes(self.redis, self.args.processes)
            yield url

    async def compare(
        self,
        name: str,
        arrivals: Sequence[Arrival],
        duration: float,
        warmup: Sequence[Arrival] = (),
    ) -> dict[str, Any]:
        """The same arrivals through a fresh gateway with admission on and off.

        The modes' order alternates from one comparison to the next.
        """
        results: dict[str, dict[str, Any]] = {}
        raw: dict[str, list[dict[str, Any]]] = {}
        timelines: dict[str, list[dict[str, float]]] = {}
        cut_counts: dict[str, dict[str, float]] = {}
        client_cpu: dict[str, float] = {}
        gateway_cpu: dict[str, float] = {}
        modes = self.args.modes.split(",")
        self.compared += 1
        for mode in modes if self.compared % 2 else modes[::-1]:
            await reset_prefix_caches(self.urls)
            spent: list[float] = []
            with self.gateway(mode, name, spent) as gateway:
                if warmup:
                    await drive(gateway, warmup, self.keys)
                timeline = timelines[mode] = []
                sampler = asyncio.create_task(sample_gateway(gateway, 0.25, timeline))
                started, cpu = time.perf_counter(), time.process_time()
                try:
                    outcomes = await drive(gateway, arrivals, self.keys)
                finally:
                    sampler.cancel()
                took = time.perf_counter() - started
                busy = (time.process_time() - cpu) / max(took, 1e-9)
            results[mode] = summarize(outcomes, duration)
            gateway_cpu[mode] = spent[0] if spent else math.nan
            client_cpu[mode] = busy
            cuts = cut_counts[mode] = limit_cuts(timeline)
            raw[mode] = [o.as_dict() for o in outcomes]
            on = results[mode]["all"]
            told = ", ".join(f"{cause} {n:g}" for cause, n in sorted(cuts.items())) or "none"
            log(f"{name} {mode}: goodput {on['goodput_rps']:.2f} req/s, {on['rejected']} "
                f"rejected, {on['lost']} lost, all answered after {took:.0f} s; "
                f"limit cuts: {told}; this client's CPU {100 * busy:.0f}%, the gateway's "
                f"{gateway_cpu[mode]:.1f} s")  # fmt: skip
            if busy > CLIENT_BUSY:
                log(f"WARNING: {name} {mode}: this client was busy {100 * busy:.0f}% of the run: "
                    "its own pace, not the gateway's, may be what was measured (fewer events: "
                    "the sims' --stream-interval)")  # fmt: skip
        return {
            "name": name, "results": results, "requests": raw, "timeline": timelines,
            "limit_cuts": cut_counts, "client_cpu": client_cpu, "gateway_cpu_s": gateway_cpu,
        }  # fmt: skip


def limit_cuts(timeline: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Admission's limit cuts during a run, by cause over all workers (first to last sample)."""
    if not timeline:
        return {}
    first, last = timeline[0], timeline[-1]
    cuts: dict[str, float] = {}
    for key, value in last.items():
        if key.startswith("gateway_worker_limit_cuts_total{"):
            cause = key[:-1].rsplit(",", 1)[1]
            cuts[cause] = cuts.get(cause, 0.0) + value - first.get(key, 0.0)
    return {cause: n for cause, n in cuts.items() if n}


def await_processes(redis: RedisServer, processes: int, timeout: float = 60.0) -> None:
    """Wait until all of a gateway's ``processes`` publish to Redis (every one serves)."""
    deadline = time.monotonic() + timeout
    while redis.command("ZCARD", "goodput:processes") != f":{processes}".encode():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway's {processes} processes never all reached Redis")
        time.sleep(0.1)


@contextlib.contextmanager
def shared_state(processes: int) -> Iterator[RedisServer | None]:
    """A redis-server for the session's gateways when they run several processes."""
    if processes <= 1:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as directory:
        redis = RedisServer(Path(directory))
        redis.start()
        try:
            yield redis
        finally:
            redis.stop()


async def run(
    args: argparse.Namespace, urls: Sequence[str], redis: RedisServer | None = None
) -> dict[str, Any]:
    """Calibrate, then compare admission on and off over the load range and the extra runs."""
    bench = Bench(args, urls, redis)
    rng = random.Random(args.seed)
    steps: list[dict[str, float]] = []
    with bench.gateway("off", "calibration") as gw:
        # Warm-up at the largest batch: vLLM's CPU build compiles its graphs per batch shape on
        # first use, which would otherwise slow the first calibration steps down.
        await closed_loop(gw, WARMUP_STREAMS * len(urls), 15, bench.keys["standard"], rng)
        if args.capacity is None:
            if args.engine == "vllm":
                capacity, steps = await calibrate(gw, args.calibrate, bench.keys, rng)
            else:  # a simulated GPU fleet: double from the start rate, then bisect
                capacity, steps = await calibrate(
                    gw, args.calibrate, bench.keys, rng, SIM_MAX_RPS, geometric=0.0
                )
            if capacity <= 0:
                raise SystemExit(
                    f"calibration: no rate down to {CALIBRATION_MIN_RPS:g} req/s met the "
                    f"interactive SLO for {100 * CALIBRATION_ATTAINMENT:.0f}% of requests; "
                    "these workers are too slow for the benchmark's workload"
                )
        else:
            capacity = args.capacity
    log(f"capacity {capacity:.2f} req/s")
    short = calibration_too_short(steps, capacity, args.calibrate)
    if short is not None:
        log(short)
    warmup = workload(capacity, 8, random.Random(args.seed + 2))
    runs: list[dict[str, Any]] = []
    loads = [float(x) for x in args.loads.split(",")]
    tiers = None if args.tiers is None else frozenset(args.tiers.split(","))
    for load in loads:
        seeded = load in SEEDED_LOADS
        for k in range(args.seeds if seeded else args.repeats):
            seed = args.seed + 1 + 100 * k * seeded
            arrivals = sent(workload(load * capacity, args.duration, random.Random(seed)), tiers)
            name = f"{load:g}x" + ("" if not k else f" seed {seed}" if seeded else f" #{k + 1}")
            result = await bench.compare(name, arrivals, args.duration, warmup)
            runs.append({**result, "load": load, "seed": seed, "offered_rps": load * capacity})
            _so_far(runs, capacity)
    if not args.skip_extra:
        # Cold start: a fresh gateway's first traffic is a burst, all at once.
        burst_rng = random.Random(args.seed + 3)
        names, weights = [name for name, _ in MIX], [share for _, share in MIX]
        burst = [
            Arrival(0.0, burst_rng.choices(names, weights)[0], chat_prompt(burst_rng))
            for _ in range(args.cold_burst)
        ]
        result = await bench.compare(f"cold burst of {len(burst)}", burst, 1.0)
        runs.append({**result, "load": None, "offered_rps": float(len(burst))})
        _so_far(runs, capacity)
        bursty: list[Arrival] = []
        at = 0.0
        for k, (span, load) in enumerate(BURSTY):
            part = workload(load * capacity, span, random.Random(args.seed + 10 + k))
            bursty.extend(Arrival(at + a.offset, a.tier, a.prompt) for a in part)
            at += span
        result = await bench.compare("bursty 2x / 0.25x", bursty, at)
        runs.append({**result, "load": None, "offered_rps": len(bursty) / at})
        _so_far(runs, capacity)
    if args.diurnal_window > 0:
        span = args.diurnal_window
        diurnal: list[Arrival] = []
        for k, load in enumerate(DIURNAL):
            part = workload(load * capacity, span, random.Random(args.seed + 30 + k))
            diurnal.extend(Arrival(k * span + a.offset, a.tier, a.prompt) for a in part)
        total = span * len(DIURNAL)
        result = await bench.compare("diurnal 0.2x -> 2.5x -> 0.2x", diurnal, total)
        result["windows"] = diurnal_windows(diurnal, result, span, capacity)
        runs.append({**result, "load": None, "offered_rps": len(diurnal) / total})
    return {
        "args": vars(args),
        "capacity_rps": capacity,
        "calibration": steps,
        "tiers": {name: tier.model_dump() for name, tier in TIERS.items()},
        "runs": runs,
    }


def _so_far(runs: Sequence[Mapping[str, Any]], capacity: float) -> None:
    """Write the runs done so far (``admission-partial.json``): a session cut short keeps them."""
    brief = [{k: v for k, v in r.items() if k not in ("requests", "timeline")} for r in runs]
    write_json("admission-partial", {"capacity_rps": capacity, "runs": brief})


def sim_max_num_seqs(sim_args: str) -> int:
    """The ``--max-num-seqs`` the simulated workers are given (theirs by default)."""
    words = sim_args.replace("=", " ").split()
    if "--max-num-seqs" in words:
        return int(words[words.index("--max-num-seqs") + 1])
    return EngineConfig().max_num_seqs


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    parser.add_argument(
        "--loads", default=",".join(f"{x:g}" for x in LOADS), help="x capacity, comma-separated"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=5,
        help=f"arrival sequences at {', '.join(f'{x:g}x' for x in SEEDED_LOADS)}",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="comparisons of the same arrivals below 3x"
    )
    parser.add_argument("--modes", default="on,off", help="on,off (the comparison), on or off")
    parser.add_argument(
        "--skip-extra", action="store_true", help="no cold-start burst and bursty runs"
    )
    parser.add_argument(
        "--cold-burst",
        type=int,
        default=None,
        help=f"streams sent at once to a fresh gateway (default {COLD_BURST}; simulated "
        "workers: as many as the fleet runs at once, workers x max_num_seqs)",
    )
    parser.add_argument(
        "--diurnal-window",
        type=float,
        default=15.0,
        help="seconds per window of the diurnal run (0.2x -> 2.5x -> 0.2x in 16 windows); "
        "0: no diurnal run",
    )
    parser.add_argument("--calibrate", type=float, default=40.0, help="seconds per calibration run")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--capacity", type=float, help="req/s to take as capacity instead of calibrating"
    )
    parser.add_argument(
        "--workers",
        help="comma-separated URLs of running workers serving bench-llama, started with "
        "VLLM_SERVER_DEV_MODE=1 (default: start two)",
    )
    parser.add_argument(
        "--tiers",
        help="send only these tiers' requests of each load's arrivals (comma-separated), "
        "to see what a tier meets without the others on the same arrival times",
    )
    parser.add_argument(
        "--engine",
        choices=("vllm", "sim"),
        default="vllm",
        help="real vLLM CPU workers, or simulated GPU-scale ones (bench.sim_worker)",
    )
    parser.add_argument(
        "--sim-workers", type=int, default=4, help="simulated workers (--engine sim)"
    )
    parser.add_argument(
        "--sim-args",
        default="--max-num-seqs 64 --stream-interval 8",
        help="the simulated workers' command line beyond their port (--engine sim); 8 tokens "
        "an event keep the client's and the gateway's event rate within a 2-core machine; "
        "they schedule by priority unless this gives --scheduling-policy (fcfs: vLLM's default)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=4.0,
        help="--engine sim: every simulated duration, the tiers' targets and waits and the "
        "gateway's first-token timeout are multiplied by this (the machine's CPU then keeps up)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="gateway processes (GATEWAY_PROCESSES), sharing state through a redis-server",
    )
    args = parser.parse_args(argv)
    if args.cold_burst is None:
        sim = args.engine == "sim"
        args.cold_burst = args.sim_workers * sim_max_num_seqs(args.sim_args) if sim else COLD_BURST
    if args.tiers is not None and (unknown := set(args.tiers.split(",")) - TIERS.keys()):
        parser.error(f"--tiers: no tier named {', '.join(sorted(unknown))}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark; print the tables and checks; write the JSON file."""
    args = _parse_args(argv)
    unwind_on_sigterm()
    # Up to two workers, each on cores of its own among all CPUs but one: at several times
    # capacity the gateway and this client need a core of their own, or they, not the
    # workers, are the bottleneck.
    with shared_state(args.processes) as redis:
        if args.engine == "sim":
            scale = args.time_scale
            use_scaled_tiers(scale)
            sim_args = [
                *args.sim_args.split(),
                "--model",
                BENCH_MODEL,
                "--time-scale",
                f"{scale:g}",
            ]
            if "--scheduling-policy" not in sim_args:
                sim_args += ["--scheduling-policy", "priority"]  # as bench_worker's vLLM workers
            fleet = (
                f"{args.sim_workers} simulated workers (bench.sim_worker {' '.join(sim_args)}; "
                f"every duration and target x{scale:g})"
            )
            with running_sims(args.sim_workers, sim_args) as urls:
                report = asyncio.run(run(args, urls, redis))
        elif args.workers:
            fleet = "The workers given"
            report = asyncio.run(run(args, args.workers.split(","), redis))
        else:
            cpus = separate_cpus(2)
            fleet = f"{len(cpus)} {BENCH_MODEL} worker(s) on cores of their own ({cpus})"
            specs = [bench_worker(free_port(), each, dev_mode=True) for each in cpus]
            with running_workers(specs) as workers:
                report = asyncio.run(run(args, [w.url for w in workers], redis))
    pod = (
        f"a gateway of {args.processes} processes sharing state through Redis"
        if args.processes > 1
        else "a one-process gateway"
    )
    print(
        f"\n{fleet} (the last core is the gateway's and the client's), {pod}. "
        "Capacity (highest Poisson rate at which 90% of interactive requests "
        f"met their SLO through a pass-through gateway): {report['capacity_rps']:.2f} req/s. "
        f"Each run: the same arrivals through a fresh gateway with admission on and off; "
        f"{args.duration:.0f} s of Poisson arrivals per load, 30% interactive / 50% standard / "
        f"20% batch{f' (only {args.tiers} sent)' if args.tiers else ''}, ~375-560-token prompts "
        f"(~340 shared), {MAX_TOKENS} tokens out. "
        "Goodput = requests meeting every SLO of their tier per second of arrivals.\n"
    )
    top = next((r for r in report["runs"] if r.get("load") == max(LOADS)), None)
    if args.modes == "on,off":
        print(sweep_table(report["runs"]))
        for each in report["runs"]:
            if "windows" in each:
                print(f"\n{each['name']}, by window of {args.diurnal_window:g} s:\n")
                print(windows_table(each["windows"]))
    for shown in report["runs"] if args.modes != "on,off" else [top] if top else []:
        print(f"\nPer tier at {shown['name']}:\n")
        print(table(shown["results"]))
    if args.modes == "on,off":
        print()
        print("\n".join(checks(report["runs"], 5.0 if args.engine == "sim" else 1.0)))
    path = write_json(
        "admission" if args.processes <= 1 else f"admission-processes{args.processes}", report
    )
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()

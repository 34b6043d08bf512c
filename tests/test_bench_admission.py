"""The admission benchmark's reading of the gateway's metrics, and its verdicts."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import pytest

from bench.admission import (
    DIURNAL,
    MAX_TOKENS,
    TIERS,
    Arrival,
    _parse_args,
    calibration_too_short,
    certain_miss,
    checks,
    diurnal_windows,
    drive,
    limit_cuts,
    parse_sample,
    search_capacity,
    sent,
    workload,
)
from bench.fake_worker import FakeWorker, WorkerConfig
from bench.live import BENCH_MODEL, Outcome
from bench.worker_http import bound_port

_PAGE = """\
# TYPE gateway_worker_limit_cuts_total counter
gateway_worker_limit_cuts_total{worker="a:1",cause="ttft_miss"} 2.0
gateway_worker_limit_cuts_total{worker="a:1",cause="decode_line"} 0.0
gateway_worker_limit_cuts_total{worker="b:1",cause="ttft_miss"} 1.0
# TYPE gateway_worker_concurrency_limit gauge
gateway_worker_concurrency_limit{worker="a:1"} 12.0
"""


def test_limit_cuts_are_sampled_per_worker_and_cause_and_summed_over_a_run() -> None:
    first = parse_sample(_PAGE)
    assert first["gateway_worker_limit_cuts_total{a:1,ttft_miss}"] == 2
    assert first["gateway_worker_concurrency_limit{a:1}"] == 12
    last = parse_sample(
        _PAGE.replace('cause="ttft_miss"} 2.0', 'cause="ttft_miss"} 5.0').replace(
            'cause="decode_line"} 0.0', 'cause="decode_line"} 4.0'
        )
    )
    # Only what happened between the run's first and last sample, over all workers.
    assert limit_cuts([first, {"t": 1.0}, last]) == {"ttft_miss": 3, "decode_line": 4}
    assert limit_cuts([first, first]) == {}
    assert limit_cuts([]) == {}


def _run(name: str, load: float | None, on: float, off: float) -> dict[str, Any]:
    def mode(goodput: float) -> dict[str, Any]:
        everything = {"goodput_rps": goodput, "rejected": 0, "queue_ms_p99": 0.0, "lost": 0}
        return {"all": everything, "interactive": {"attainment": 1.0}}

    return {"name": name, "load": load, "results": {"on": mode(on), "off": mode(off)}}


def test_replays_of_a_load_are_judged_together_and_3x_seeds_each_alone() -> None:
    # Two replays at 0.75x: one run worse with admission, one better, 4.6 against 4.5 pooled.
    runs = [
        _run("0.75x", 0.75, 4.2, 4.4), _run("0.75x #2", 0.75, 4.4, 4.1),
        _run("3x", 3.0, 8.0, 3.9), _run("3x seed 108", 3.0, 7.0, 3.9),
    ]  # fmt: skip
    lines = checks(runs)
    assert "PASS goodput on >= off at or below 0.75x: every point" in lines
    assert "PASS goodput on >= 0.98x off at every point: every point" in lines
    assert "MISS goodput on / off at 3x >= 2x at every seed: 2.05x, 1.79x" in lines
    # Both replays worse (8.2 against 8.5 req/s): the point is.
    runs[1] = _run("0.75x #2", 0.75, 4.0, 4.1)
    assert "MISS goodput on >= off at or below 0.75x: ['0.75x (2 runs) 0.96x']" in checks(runs)


def test_the_diurnal_run_is_judged_by_window_once_the_peaks_backlog_drained() -> None:
    # One request per window; each refused with admission on, served without.
    arrivals = [Arrival(10.0 * k + 5.0, "batch", "hi") for k in range(len(DIURNAL))]
    refused = {"tag": "batch", "sent": 0.0, "status": 429, "error": "http 429 queue_full"}
    served = {"tag": "batch", "sent": 0.0, "status": 200, "ttft": 0.1, "e2e": 1.0}
    peak_ends = 10.0 * max(k for k, load in enumerate(DIURNAL) if load > 0.75) + 10.0
    result = {
        "requests": {"on": [refused] * len(DIURNAL), "off": [served] * len(DIURNAL)},
        # The queue empties 5 s after the last window above 0.75x ends.
        "timeline": {
            "on": [
                {"t": peak_ends - 1.0, "gateway_queue_depth{batch}": 3.0},
                {"t": peak_ends + 5.0, "gateway_queue_depth{batch}": 0.0},
            ]
        },
    }
    windows = diurnal_windows(arrivals, result, 10.0, 4.0)
    assert [w["load"] for w in windows] == list(DIURNAL)
    assert windows[1]["offered_rps"] == pytest.approx(2.0)
    assert windows[0]["on"]["all"]["rejected"] == 1
    assert windows[0]["off"]["all"]["goodput_rps"] == pytest.approx(0.1)
    drained = [w["start_s"] for w in windows if w["drained"]]
    # Light windows before the peak, and the light ones after the queue emptied.
    after = [w["start_s"] for w in windows if w["start_s"] >= peak_ends + 10.0]
    assert len(after) >= 2
    assert drained == [0.0, 10.0, *after]
    run = {"name": "diurnal", "load": None, "windows": windows, "results": {
        mode: {"all": {"rejected": 0, "lost": 0, "goodput_rps": 1.0}} for mode in ("on", "off")
    }}  # fmt: skip
    judged = ", ".join(f"'{start:.0f} s': 1" for start in drained)
    assert (
        "MISS diurnal: no rejection in a window under 0.75x once the peak's backlog drained: "
        f"{{{judged}}}"
    ) in checks([run])


@pytest.mark.parametrize(
    ("knee", "capacity", "tried"),
    [
        (9.7, 9.5, [6.0, 7.0, 8.0, 9.0, 10.0, 9.5]),
        (3.2, 3.0, [6.0, 5.0, 4.0, 3.0, 3.5]),
        (0.6, 0.5, [6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.75]),
        (0.8, 0.75, [6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.75]),
        (0.1, 0.0, [6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.25]),
    ],
    ids=["up", "down", "below-1", "below-1-half-step", "none"],
)
def test_capacity_search_steps_down_below_one_request_a_second(
    knee: float, capacity: float, tried: list[float]
) -> None:
    seen: list[float] = []

    async def passes(rate: float) -> bool:
        seen.append(rate)
        return rate <= knee

    assert asyncio.run(search_capacity(passes)) == capacity
    assert seen == tried


def test_capacity_search_doubles_above_its_step_range_then_bisects() -> None:
    """A simulated GPU fleet serves far more than the CPU workers' steps of 1 req/s reach."""
    seen: list[float] = []

    async def passes(rate: float) -> bool:
        seen.append(rate)
        return rate <= 100.0

    found = asyncio.run(search_capacity(passes, most=1000.0))
    assert seen[:25] == [float(r) for r in range(6, 31)]
    assert seen[25:] == [60.0, 120.0, 90.0, 105.0, 97.5]
    assert found == 97.5  # within a tenth of the knee


def test_a_calibration_shorter_than_five_request_lifetimes_is_flagged() -> None:
    # At x16 on the simulated workers a request lived ~22 s (TPOT ~0.34 s, 64 tokens).
    at_capacity = {"rps": 18.0, "ttft_p90_s": 1.0, "tpot_p90_s": 0.34, "attainment": 0.95}
    steps = [{"rps": 12.0, "ttft_p90_s": 0.5, "tpot_p90_s": 0.2}, at_capacity]
    lifetime = 1.0 + MAX_TOKENS * 0.34
    warning = calibration_too_short(steps, 18.0, 30.0)
    assert warning is not None
    assert f"{5 * lifetime:.0f} s" in warning
    assert calibration_too_short(steps, 18.0, 5 * lifetime + 1) is None
    # No step at the capacity (given with --capacity): nothing to judge by.
    assert calibration_too_short(steps, 20.0, 30.0) is None


def test_tiers_sent_alone_keep_the_times_and_prompts_the_whole_mix_drew() -> None:
    mixed = workload(3.0, 40, random.Random(108))
    alone = sent(mixed, frozenset({"interactive"}))
    assert alone == [a for a in mixed if a.tier == "interactive"]
    assert 0 < len(alone) < len(mixed)
    assert sent(mixed, None) is mixed
    assert _parse_args(["--tiers", "interactive,batch"]).tiers == "interactive,batch"
    with pytest.raises(SystemExit):
        _parse_args(["--tiers", "interactive,premium"])


def test_a_request_is_a_certain_miss_once_its_first_token_is_late_or_it_failed() -> None:
    tier = TIERS["interactive"]  # TTFT 1 s, TPOT 100 ms
    running = Outcome(tag="interactive", sent=10.0)
    assert not certain_miss(Outcome(tag="interactive", sent=float("inf")), tier, now=99.0)
    assert not certain_miss(running, tier, now=10.9)
    assert certain_miss(running, tier, now=11.1)  # no first token after 1.1 s
    running.ttft = 0.4
    assert not certain_miss(running, tier, now=30.0)  # on time; its TPOT is not known yet
    running.ttft = 1.2
    assert certain_miss(running, tier, now=11.3)
    answered = Outcome(tag="interactive", sent=10.0, status=200, ttft=0.5, tpot=0.05, e2e=3.7)
    assert not certain_miss(answered, tier, now=14.0)
    answered.tpot = 0.15
    assert certain_miss(answered, tier, now=14.0)
    failed = Outcome(tag="interactive", sent=10.0, status=503, error="http 503 shed")
    assert certain_miss(failed, tier, now=10.1)


async def test_a_drive_given_up_cancels_what_runs_and_sends_nothing_more() -> None:
    fake = FakeWorker(WorkerConfig(ttft_ms=1500.0, itl_ms=10.0, model=BENCH_MODEL))
    server = await fake.serve("127.0.0.1", 0)
    url = f"http://127.0.0.1:{bound_port(server)}"
    early = [Arrival(0.05 * k, "interactive", "hello there") for k in range(4)]
    late = [Arrival(60.0, "interactive", "hello there") for _ in range(2)]

    def give_up(outcomes: Sequence[Outcome], now: float) -> bool:
        return any(certain_miss(o, TIERS["interactive"], now) for o in outcomes)

    try:
        outcomes = await drive(url, early + late, {"interactive": "sk-x"}, give_up)
        for _ in range(100):  # the worker sees each closed stream a moment later
            if fake.stats.cancelled == len(early):
                break
            await asyncio.sleep(0.02)
    finally:
        server.close()
        await server.wait_closed()
    assert fake.stats.started == len(early)
    assert fake.stats.cancelled == len(early)
    assert fake.stats.completed == 0
    assert all(o.ttft is None for o in outcomes)
    assert [o.sent for o in outcomes[len(early) :]] == [float("inf")] * len(late)


def test_the_sim_fleet_s_cold_burst_fills_every_seat_it_has() -> None:
    assert _parse_args([]).cold_burst == 64
    assert _parse_args(["--engine", "sim"]).cold_burst == 4 * 64  # the default sim args
    sim = ["--engine", "sim", "--sim-workers", "2", "--sim-args=--max-num-seqs=32"]
    assert _parse_args(sim).cold_burst == 64
    assert _parse_args(["--engine", "sim", "--sim-args=--stream-interval 8"]).cold_burst == 4 * 256
    assert _parse_args(["--engine", "sim", "--cold-burst", "10"]).cold_burst == 10

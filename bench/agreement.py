"""Agreement: vLLM's own benchmark client against the gateway's histograms, at 1 to 64 streams.

``python -m bench.agreement [--streams 1,4,16,64] [--worker URL] [--aiperf PATH]``
``python -m bench.agreement --goodput 200 [--streams 4,16]``: goodput as the client counts it
(:func:`goodput`) beside the gateway's ``gateway_slo_requests_total``.
``python -m bench.agreement --goodput 600 --engine sim [--rate 22] [--sim-args ARGS]``: the same
against a simulated GPU-scale worker (:mod:`bench.sim_worker`), at the first tokens of an 8B
model on an H100 under load: 1,024 prompt and 128 output tokens, Poisson arrivals.
``--guidellm PATH`` runs guidellm 0.8 (installed apart, in a venv of its own: it pulls in
torch) as ``--goodput``'s client instead of vLLM's.

``vllm.benchmarks.serve`` (from the worker's venv) runs through the gateway against a real vLLM
CPU worker serving ``tiny-llama`` (started here, pinned to every CPU but the last, unless
``--worker`` names a running one): chat requests of 64 random prompt tokens and 48 output
tokens, at each number of concurrent streams. A fresh gateway per level (admission off, so
that every request is served as it comes) exports TTFT and ITL
with buckets 0.25 ms wide, so its p50 is read to a fraction of a millisecond; the table sets
it beside the p50 the client reports, with the gateway's queue time and event-loop lag.
``--aiperf PATH`` runs NVIDIA's aiperf (an ``aiperf`` executable installed apart, for example
``pip install aiperf`` in a venv of its own: it is not a dependency of this project) instead of
vLLM's client, with the same prompt and answer lengths.
A benchmark, not a test: it prints a markdown table and writes ``bench/results/agreement.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.live import log, running_gateway, running_workers, unwind_on_sigterm, write_json
from bench.overhead import free_port
from bench.sim_worker import EngineConfig, running_sims
from scripts.vllm_worker import MODEL_DIR, WORKER_PYTHON, VllmWorker, worker_env

MODEL = "tiny-llama"


@dataclass(frozen=True)
class Requests:
    """What the client sends: the served model, prompt and answer lengths, arrivals."""

    model: str = MODEL
    input_len: int = 64
    output_len: int = 48
    rate: float | None = None
    """Poisson arrivals a second (vllm bench's ``--request-rate``); None: back to back."""


CPU_REQUESTS = Requests()
"""The tiny-llama CPU worker's requests: a first token in 10-40 ms."""
_FINE = [round(i * 0.00025, 5) for i in range(1, 1201)] + [0.5, 1.0, 2.5, 5.0, 10.0, 60.0]
_RUNNER = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


def quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """``histogram_quantile`` of cumulative ``(upper bound, count)`` pairs, as PromQL does it."""
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


async def _page(url: str) -> str:
    """The gateway's ``/metrics`` page."""
    async with httpx.AsyncClient(timeout=10) as client:
        return (await client.get(f"{url}/metrics")).text


def _histograms(text: str) -> dict[str, list[tuple[float, float]]]:
    found: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                into = found.setdefault(sample.name[: -len("_bucket")], {})
                into[bound] = into.get(bound, 0.0) + sample.value
    return {name: sorted(bounds.items()) for name, bounds in found.items()}


def _bench(
    gateway: str, streams: int, prompts: int, out: Path, *more: str,
    requests: Requests = CPU_REQUESTS,
) -> dict[str, Any]:  # fmt: skip
    rate = [] if requests.rate is None else ["--request-rate", str(requests.rate)]
    args = [
        "--backend", "openai-chat", "--base-url", gateway, "--endpoint", "/v1/chat/completions",
        "--model", requests.model, "--tokenizer", str(MODEL_DIR), "--dataset-name", "random",
        "--random-input-len", str(requests.input_len),
        "--random-output-len", str(requests.output_len), "--ignore-eos", *rate,
        "--num-prompts", str(prompts), "--max-concurrency", str(streams), "--seed", "7",
        "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
        "--disable-tqdm", *more,
    ]  # fmt: skip
    done = subprocess.run(
        [str(WORKER_PYTHON), "-c", _RUNNER, *args],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _aiperf(aiperf: str, gateway: str, streams: int, prompts: int, out: Path) -> dict[str, Any]:
    """The run of aiperf at ``streams`` concurrent streams, as :func:`_bench`'s result keys."""
    args = [
        "profile", "--model", MODEL, "--url", gateway, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", str(MODEL_DIR), "--prompt-input-tokens-mean", "64",
        "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", "48",
        "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
        "--concurrency", str(streams), "--request-count", str(prompts), "--random-seed", "7",
        "--output-artifact-dir", str(out), "--ui-type", "none", "--no-server-metrics",
        "--no-gpu-telemetry",
    ]  # fmt: skip
    done = subprocess.run([aiperf, *args], capture_output=True, text=True, timeout=900, check=False)
    exported = sorted(out.rglob("*aiperf.json"))
    if done.returncode != 0 or not exported:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    metrics: dict[str, Any] = json.loads(exported[0].read_text())
    return {
        "completed": metrics["request_count"]["avg"],
        "median_ttft_ms": metrics["time_to_first_token"]["p50"],
        "median_itl_ms": metrics["inter_token_latency"]["p50"],
    }


def measure(worker: str, streams: int, aiperf: str | None = None) -> dict[str, Any]:
    """One level: a fresh gateway, the client's run through it, both p50s."""
    env = {
        "GATEWAY_WORKERS": worker,
        "GATEWAY_TTFT_BUCKETS": json.dumps(_FINE),
        "GATEWAY_ITL_BUCKETS": json.dumps(_FINE),
        "GATEWAY_QUEUE_BUCKETS": json.dumps(_FINE),
        # Measurement, not admission: every request goes to the worker at once.
        "GATEWAY_ADMISSION": "false",
    }
    prompts = max(48, 4 * streams)
    with running_gateway(env, free_port(), f"agreement-{streams}") as url:
        # A warm-up, so that neither side's first connection counts.
        with tempfile.TemporaryDirectory() as tmp:
            _bench(url, min(streams, 4), 8, Path(tmp) / "warmup.json")
        before = _histograms(asyncio.run(_page(url)))
        with tempfile.TemporaryDirectory() as tmp:
            if aiperf is None:
                client = _bench(url, streams, prompts, Path(tmp) / "bench.json")
            else:
                client = _aiperf(aiperf, url, streams, prompts, Path(tmp))
        after = _histograms(asyncio.run(_page(url)))

    def p(name: str, q: float) -> float:
        return _grown_quantile(before, after, name, q)

    return {
        "streams": streams,
        "requests": client["completed"],
        "bench_ttft_p50_ms": client["median_ttft_ms"],
        "gateway_ttft_p50_ms": p("gateway_time_to_first_token_seconds", 0.5),
        "bench_itl_p50_ms": client["median_itl_ms"],
        "gateway_itl_p50_ms": p("gateway_inter_token_latency_seconds", 0.5),
        "gateway_queue_p50_ms": p("gateway_queue_time_seconds", 0.5),
        "loop_lag_p50_ms": p("gateway_event_loop_lag_seconds", 0.5),
        "loop_lag_p90_ms": p("gateway_event_loop_lag_seconds", 0.9),
    }


_TTFT = "gateway_time_to_first_token_seconds"


def _grown_quantile(
    before: dict[str, list[tuple[float, float]]],
    after: dict[str, list[tuple[float, float]]],
    name: str,
    q: float,
) -> float:
    """The ``q`` quantile in ms of what histogram ``name`` counted between two scrapes."""
    if name not in after:  # a gateway without that histogram
        return float("nan")
    old = dict(before.get(name, []))
    delta = [(bound, count - old.get(bound, 0.0)) for bound, count in after[name]]
    return quantile(delta, q) * 1000


def _slo_counts(text: str, name: str = "gateway_slo_requests_total") -> dict[str, float]:
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                result = sample.labels["result"]
                counts[result] = counts.get(result, 0.0) + sample.value
    return counts


def _tpots_ms(result: dict[str, Any]) -> list[float]:
    """Each request's TPOT as vllm bench serve judges goodput: (latency - TTFT) / (tokens - 1)."""
    runs = zip(result["latencies"], result["ttfts"], result["output_lens"], strict=True)
    return [(end - ttft) / max(1, n - 1) * 1000 for end, ttft, n in runs]


@dataclass(frozen=True)
class ClientRun:
    """One run of a benchmark client: its request count, goodput count and per-request times."""

    completed: int
    good: int
    ttfts_ms: list[float]
    tpots_ms: list[float]
    """As the client judges TPOT for goodput."""
    ttft_p50_ms: float


class Client(Protocol):
    """A benchmark client, as :func:`goodput` runs it."""

    def __call__(
        self, gateway: str, streams: int, prompts: int, requests: Requests, targets: Targets
    ) -> ClientRun:
        """Run ``prompts`` requests through ``gateway``, the targets also sent as headers."""


Targets = tuple[float, float]
"""TTFT and TPOT targets in ms."""


def vllm_bench(
    gateway: str, streams: int, prompts: int, requests: Requests, targets: Targets
) -> ClientRun:
    """``vllm bench serve --goodput``, the targets also in one ``--header``."""
    ttft, tpot = targets
    with tempfile.TemporaryDirectory() as tmp:
        run = _bench(
            gateway, streams, prompts, Path(tmp) / "run.json", "--save-detailed",
            "--goodput", f"ttft:{ttft:.3f}", f"tpot:{tpot:.3f}",
            # One --header with both: vllm bench keeps only its last --header.
            "--header", f"x-slo-ttft-ms={ttft:.3f}", f"x-slo-tpot-ms={tpot:.3f}",
            requests=requests,
        )  # fmt: skip
    good = round(run["request_goodput"] * run["duration"])
    ttfts = [t * 1000 for t in run["ttfts"]]
    return ClientRun(run["completed"], good, ttfts, _tpots_ms(run), run["median_ttft_ms"])


def guidellm(executable: str) -> Client:
    """The guidellm 0.8 client: ``executable``, installed apart (not a dependency here).

    Its goodput SLO (``metrics.slo``) judges TPOT by the inter-token latency (first to last
    token over tokens - 1); the targets go as headers through its backend's ``extras``.
    Arrivals: Poisson at the rate, or ``streams`` concurrent streams back to back.
    """

    def run(
        gateway: str, streams: int, prompts: int, requests: Requests, targets: Targets
    ) -> ClientRun:
        ttft, tpot = targets
        profile: dict[str, Any] = (
            {"kind": "concurrent", "streams": [streams]}
            if requests.rate is None
            else {"kind": "poisson", "rate": [requests.rate], "max_concurrency": streams}
        )
        headers = {"x-slo-ttft-ms": f"{ttft:.3f}", "x-slo-tpot-ms": f"{tpot:.3f}"}
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out.json"
            spec = {
                "backend": {
                    "kind": "openai_http", "target": gateway, "model": requests.model,
                    "request_format": "/v1/chat/completions", "extras": {"headers": headers},
                },
                "profile": profile,
                "constraints": [{"kind": "max_requests", "count": prompts}],
                "data": [{
                    "kind": "synthetic_text", "prompt_tokens": requests.input_len,
                    "output_tokens": requests.output_len,
                }],
                "tokenizer": {"kind": "huggingface_auto", "model": str(MODEL_DIR)},
                "seed": {"kind": "static", "value": 7},
                "metrics": {"kind": "generative", "slo": {"ttft_ms": ttft, "tpot_ms": tpot}},
                "outputs": [{"kind": "json", "path": str(out)}],
            }  # fmt: skip
            scenario = Path(tmp) / "scenario.json"
            scenario.write_text(json.dumps({"metadata": {"name": "agreement"}, "spec": spec}))
            done = subprocess.run(
                [executable, "run", "-c", str(scenario), "--disable-progress"],
                capture_output=True, text=True, timeout=900, check=False,
            )  # fmt: skip
            if done.returncode != 0 or not out.exists():
                raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
            (result,) = json.loads(out.read_text())["benchmarks"]
        stats = result["requests"]["successful"]
        metrics = result["metrics"]
        good = round(metrics["slo_attainment"] * metrics["slo_determined_requests"])
        ttfts = [r["time_to_first_token_ms"] for r in stats]
        ordered = sorted(ttfts)
        return ClientRun(
            len(stats), good, ttfts, [r["inter_token_latency_ms"] for r in stats],
            ordered[len(ordered) // 2],
        )  # fmt: skip

    return run


_LOOSE_MS = 3_600_000.0
"""A target no request misses (an hour)."""


def _target_pairs(
    client: Client, url: str, streams: int, prompts: int, requests: Requests
) -> list[tuple[str, float, float]]:
    """The targets each comparison runs (name, TTFT, TPOT in ms), from a first run to ``url``.

    That run's TTFT median alone (half the requests miss it), its TPOT median alone, both
    p90s, and both loose (an hour).
    """
    loose = _LOOSE_MS
    first = client(url, streams, prompts, requests, (loose, loose))
    ttfts, tpots = sorted(first.ttfts_ms), sorted(first.tpots_ms)
    return [
        ("TTFT p50", ttfts[len(ttfts) // 2], loose),
        ("TPOT p50", loose, tpots[len(tpots) // 2]),
        ("both p90", ttfts[len(ttfts) * 9 // 10], tpots[len(tpots) * 9 // 10]),
        ("loose", loose, loose),
    ]


def _row(
    judge: str,
    requests: Requests,
    streams: int,
    targets: tuple[str, float, float],
    run: ClientRun,
    met: float,
    gateway_ttft_p50_ms: float,
) -> dict[str, Any]:
    """One comparison: the client's good requests beside those ``judge`` counted as met."""
    name, ttft, tpot = targets
    return {
        "engine": requests.model, "rate": requests.rate, "judge": judge,
        "streams": streams, "targets": name, "ttft_ms": ttft, "tpot_ms": tpot,
        "requests": run.completed, "client_good": run.good, "gateway_met": met,
        "disagree_share": abs(run.good - met) / max(run.completed, 1),
        "client_ttft_p50_ms": run.ttft_p50_ms, "gateway_ttft_p50_ms": gateway_ttft_p50_ms,
    }  # fmt: skip


def goodput(
    worker: str,
    streams: int,
    prompts: int,
    requests: Requests = CPU_REQUESTS,
    client: Client = vllm_bench,
) -> list[dict[str, Any]]:
    """A client's goodput (vllm bench's by default) beside ``gateway_slo_requests_total``.

    The same targets go to the client and, as ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` headers,
    to the gateway, which judges each request by them. The targets come from a first run of
    the same client: its TTFT median alone (half the requests miss it), its TPOT median
    alone, both p90s, and both loose (an hour). Admission off: every request is served as it
    comes. Each row also has both sides' TTFT p50 (the gateway's from buckets 0.25 ms wide):
    a TTFT target splits the requests alike only where the two clocks agree.
    """
    env = {
        "GATEWAY_WORKERS": worker,
        "GATEWAY_ADMISSION": "false",
        "GATEWAY_TTFT_BUCKETS": json.dumps(_FINE),
    }
    rows: list[dict[str, Any]] = []
    with running_gateway(env, free_port(), f"goodput-{streams}") as url:
        for name, ttft, tpot in _target_pairs(client, url, streams, prompts, requests):
            page = asyncio.run(_page(url))
            before, histograms = _slo_counts(page), _histograms(page)
            run = client(url, streams, prompts, requests, (ttft, tpot))
            page = asyncio.run(_page(url))
            after, grown = _slo_counts(page), _histograms(page)
            ttft_p50 = _grown_quantile(histograms, grown, _TTFT, 0.5)
            met = after.get("met", 0.0) - before.get("met", 0.0)
            rows.append(_row("gateway", requests, streams, (name, ttft, tpot), run, met, ttft_p50))
    return rows


def goodput_direct(
    worker: str,
    streams: int,
    prompts: int,
    requests: Requests,
    client: Client = vllm_bench,
) -> list[dict[str, Any]]:
    """The floor of :func:`goodput`: the client straight to a simulated worker, which judges.

    The same runs and targets as :func:`goodput`, without the gateway: the simulated worker
    judges each request that sent SLO headers by its engine's own times (its first token's
    time after the request arrived, the mean gap from first to last token) and counts them in
    ``sim_slo_requests_total``. No server-side count can agree with the client better than the
    engine's own, whose clock starts when the request is in and stops when the token is written.
    """
    rows: list[dict[str, Any]] = []
    for name, ttft, tpot in _target_pairs(client, worker, streams, prompts, requests):
        before = _slo_counts(asyncio.run(_page(worker)), "sim_slo_requests_total")
        run = client(worker, streams, prompts, requests, (ttft, tpot))
        after = _slo_counts(asyncio.run(_page(worker)), "sim_slo_requests_total")
        met = after.get("met", 0.0) - before.get("met", 0.0)
        rows.append(_row("worker", requests, streams, (name, ttft, tpot), run, met, math.nan))
    return rows


def _ms(value: float) -> str:
    return "1 h" if value >= _LOOSE_MS else f"{value:.2f} ms"


def _p50(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.2f} ms"


def goodput_table(rows: Sequence[dict[str, Any]]) -> str:
    """The goodput comparison as a markdown table."""
    lines = [
        "| worker | arrivals | streams | judged by | targets | TTFT target | TPOT target "
        "| requests | client good | met | apart | TTFT p50 client / gateway |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        arrivals = "back to back" if r["rate"] is None else f"{r['rate']:g}/s"
        lines.append(
            f"| {r['engine']} | {arrivals} | {r['streams']} | {r['judge']}"
            f" | {r['targets']}"
            f" | {_ms(r['ttft_ms'])} | {_ms(r['tpot_ms'])}"
            f" | {r['requests']} | {r['client_good']} | {r['gateway_met']:.0f}"
            f" | {100 * r['disagree_share']:.1f}%"
            f" | {r['client_ttft_p50_ms']:.2f} / {_p50(r['gateway_ttft_p50_ms'])} |"
        )
    return "\n".join(lines)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The markdown table of the results."""
    lines = [
        "| streams | TTFT p50 bench | TTFT p50 gateway | ITL p50 bench | ITL p50 gateway "
        "| gateway queue p50 | loop lag p50 / p90 |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['streams']} | {r['bench_ttft_p50_ms']:.2f} ms"
            f" | {r['gateway_ttft_p50_ms']:.2f} ms"
            f" | {r['bench_itl_p50_ms']:.2f} ms | {r['gateway_itl_p50_ms']:.2f} ms"
            f" | {r['gateway_queue_p50_ms']:.2f} ms"
            f" | {r['loop_lag_p50_ms']:.1f} / {r['loop_lag_p90_ms']:.1f} ms |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every level; print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.agreement")
    parser.add_argument("--streams", default="1,4,16,64")
    parser.add_argument("--worker", default=None, help="a running tiny-llama worker's URL")
    parser.add_argument("--aiperf", default=None, help="an aiperf executable, as the client")
    parser.add_argument(
        "--guidellm", default=None, help="--goodput: a guidellm executable, as the client"
    )
    parser.add_argument(
        "--engine",
        choices=("vllm", "sim"),
        default="vllm",
        help="--goodput's worker: the tiny-llama CPU worker, or a simulated GPU-scale one",
    )
    parser.add_argument(
        "--rate", type=float, default=22.0, help="--engine sim: Poisson arrivals a second"
    )
    parser.add_argument(
        "--sim-args", default="", help="--engine sim: the simulated worker's command line"
    )
    parser.add_argument(
        "--goodput",
        type=int,
        default=0,
        metavar="PROMPTS",
        help="compare vllm bench serve's goodput with the gateway's SLO count instead, "
        "with this many requests per run",
    )
    parser.add_argument(
        "--direct",
        action="store_true",
        help="--goodput --engine sim: also send the client straight to the simulated worker, "
        "which counts by its own times (the floor of the comparison)",
    )
    args = parser.parse_args(argv)
    unwind_on_sigterm()
    levels = [int(level) for level in args.streams.split(",")]
    rows: list[dict[str, Any]] = []
    if args.goodput:
        requests = CPU_REQUESTS
        if args.engine == "sim":
            requests = Requests(EngineConfig().model, 1024, 128, args.rate)
        with contextlib.ExitStack() as stack:
            if args.worker:
                url = args.worker
            elif args.engine == "sim":
                url = stack.enter_context(running_sims(1, args.sim_args.split()))[0]
            else:
                url = stack.enter_context(running_workers([VllmWorker(port=free_port())]))[0].url
            client = vllm_bench if args.guidellm is None else guidellm(args.guidellm)
            for level in levels:
                rows += goodput(url, level, args.goodput, requests, client)
                if args.direct and args.engine == "sim":
                    rows += goodput_direct(url, level, args.goodput, requests, client)
        for row in rows:
            log(json.dumps(row))
        print(goodput_table(rows))
        name = "vllm" if args.guidellm is None else "guidellm"
        write_json(f"goodput-agreement-{args.engine}-{name}", {"client": name, "rows": rows})
        return 0
    if args.worker:
        rows = [measure(args.worker, level, args.aiperf) for level in levels]
    else:
        with running_workers([VllmWorker(port=free_port())]) as (worker,):
            rows = [measure(worker.url, level, args.aiperf) for level in levels]
    for row in rows:
        log(json.dumps(row))
    print(table(rows))
    write_json("agreement", {"client": "aiperf" if args.aiperf else "vllm", "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

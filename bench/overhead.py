"""Gateway overhead benchmark: the same streams sent straight to a worker and through the gateway.

``python -m bench.overhead [--requests N] [--out bench/results/overhead.json] [--direct-only]``

A fixed-timing fake worker (:mod:`bench.fake_worker`) and the gateway (``python -m app``) run
as two subprocesses; this process is the client. For 1 and 32 concurrent streams (one keep-alive
connection each, every stream ``max_tokens`` 32, back to back) it measures TTFT, ITL and content
chunks per second, DIRECT to the worker and VIA the gateway, alternating the two in ABBA order
over a few rounds so that drift on a shared machine lands on both equally. The worker's timing
is fixed, so any difference is what the gateway adds.

By default the connections' first requests are spread over one stream's length, so the load is
steady rather than one synchronized burst (``--arrival burst`` measures that case instead), and
chunks/s is counted over the span in which every connection had a stream going. A second table
gives each process's CPU use during the measurement, to show which one was the bottleneck.

It prints markdown tables and PASS/MISS against the overhead targets, writes a JSON file, and
always exits 0: it is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import math
import os
import platform
import re
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Final, Literal, TypeVar

from bench.sse_client import SSEConnection, StreamResult

ROOT: Final = Path(__file__).resolve().parent.parent
_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
HOST: Final = "127.0.0.1"
MODEL: Final = "fake-model"
CHAT_PATH: Final = "/v1/chat/completions"
STREAM_TIMEOUT_S: Final = 30.0
Mode = Literal["direct", "gateway"]
_T = TypeVar("_T")

# Targets: what the gateway may add on top of the worker.
ADDED_TTFT_P50_MS: Final = {1: 1.0, 32: 2.0}
ITL_P50_TOLERANCE: Final = 0.05
CHUNK_RATE_MIN_RATIO: Final = 0.95


# ---------------------------------------------------------------------------------------------
# Statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(slots=True)
class Cell:
    """Every sample for one (mode, concurrency) pair, pooled over the rounds."""

    mode: Mode
    concurrency: int
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    steady_chunks: int = 0
    """Content chunks that arrived while every connection was busy (see :class:`Round`)."""
    steady_s: float = 0.0
    window_s: float = 0.0
    sent: int = 0
    ok: int = 0
    chunks_per_stream: dict[int, int] = field(default_factory=dict)
    """How many streams (value) carried each number of content chunks (key)."""
    max_content_per_http_chunk: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    rounds: list[dict[str, float]] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds each process (client, worker, gateway) spent inside the measured windows."""
    worker_connections: int = 0
    """TCP connections the worker accepted inside the measured windows."""

    def add_round(self, rnd: Round) -> None:
        """Fold one round's streams into the cell."""
        for name, seconds in rnd.cpu_s.items():
            self.cpu_s[name] = self.cpu_s.get(name, 0.0) + seconds
        self.worker_connections += rnd.worker_connections
        ttfts: list[float] = []
        for res in rnd.results:
            self.sent += 1
            if res.ok:
                self.ok += 1
            else:
                reason = res.error or f"HTTP {res.status}" + ("" if res.done else " (no [DONE])")
                if res.body:
                    reason += f": {res.body[:200].decode('utf-8', 'replace')}"
                self.errors[reason] = self.errors.get(reason, 0) + 1
            n = len(res.content_times)
            self.chunks_per_stream[n] = self.chunks_per_stream.get(n, 0) + 1
            self.max_content_per_http_chunk = max(
                self.max_content_per_http_chunk, res.max_content_per_http_chunk
            )
            ttft = res.ttft
            if ttft is not None:
                ttfts.append(ttft)
            self.itl_s.extend(res.itls())
        self.ttft_s.extend(ttfts)
        self.steady_chunks += rnd.steady_chunks
        self.steady_s += rnd.steady_s
        self.window_s += rnd.window_s
        self.rounds.append(
            {
                "ttft_p50_ms": percentile(ttfts, 50) * 1000,
                "chunks_per_s": rnd.steady_chunks / rnd.steady_s if rnd.steady_s else math.nan,
                "steady_s": rnd.steady_s,
                "window_s": rnd.window_s,
            }
        )

    @property
    def chunks_per_s(self) -> float:
        """Content chunks received per second, all streams together, while all were running."""
        return self.steady_chunks / self.steady_s if self.steady_s > 0 else math.nan

    def cpu_percent(self) -> dict[str, float]:
        """Each process's CPU use over the measured windows, in % of one core."""
        if self.window_s <= 0:
            return {}
        return {name: 100 * sec / self.window_s for name, sec in self.cpu_s.items()}

    def ms(self, values: list[float], q: float) -> float:
        """A percentile of ``values`` (seconds) in milliseconds."""
        return percentile(values, q) * 1000

    def to_json(self) -> dict[str, Any]:
        """The cell's summary (no raw samples)."""
        return {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "requests_sent": self.sent,
            "requests_ok": self.ok,
            "errors": self.errors,
            "ttft_ms": {f"p{q}": self.ms(self.ttft_s, q) for q in (50, 90, 99)}
            | {"mean": 1000 * sum(self.ttft_s) / len(self.ttft_s) if self.ttft_s else math.nan},
            "itl_ms": {f"p{q}": self.ms(self.itl_s, q) for q in (50, 90, 99)},
            "chunks_per_s": self.chunks_per_s,
            "steady_content_chunks": self.steady_chunks,
            "steady_s": self.steady_s,
            "window_s": self.window_s,
            "content_chunks_per_stream": {
                str(k): v for k, v in sorted(self.chunks_per_stream.items())
            },
            "max_content_events_per_http_chunk": self.max_content_per_http_chunk,
            "cpu_percent_of_one_core": self.cpu_percent(),
            "worker_connections_opened": self.worker_connections,
            "rounds": self.rounds,
        }


# ---------------------------------------------------------------------------------------------
# Load generation


def chat_body(max_tokens: int) -> bytes:
    """The request every stream sends, to either target."""
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Count to thirty-two."}],
            "stream": True,
            "max_tokens": max_tokens,
        },
        separators=(",", ":"),
    ).encode()


async def _stream_loop(
    conn: SSEConnection, body: bytes, count: int, start_at: float
) -> list[StreamResult]:
    results: list[StreamResult] = []
    delay = start_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    for _ in range(count):
        try:
            async with asyncio.timeout(STREAM_TIMEOUT_S):
                res = await conn.request("POST", CHAT_PATH, body)
        except TimeoutError:
            now = time.perf_counter()
            res = StreamResult(t_sent=now, t_end=now, error="timed out")
            await conn.close()
        results.append(res)
    return results


CpuProbe = Callable[[], dict[str, float]]
"""Cumulative CPU seconds of every process taking part, by name."""

_CONNECTIONS_RE: Final = re.compile(rb"^fake_worker_connections_total (\d+)", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Probes:
    """Side measurements taken around each measured window."""

    cpu: CpuProbe
    worker_port: int

    async def worker_connections(self) -> int:
        """Connections the fake worker has accepted so far, this probe's own included."""
        reader, writer = await asyncio.open_connection(HOST, self.worker_port)
        try:
            writer.write(b"GET /metrics HTTP/1.1\r\nhost: worker\r\nconnection: close\r\n\r\n")
            data = await reader.read(-1)
        finally:
            writer.close()
        match = _CONNECTIONS_RE.search(data)
        return int(match.group(1)) if match else 0


@dataclass(frozen=True, slots=True)
class Round:
    """One round at one concurrency against one target."""

    results: list[StreamResult]
    window_s: float
    """First request sent to last response read."""
    steady_s: float
    """From the last connection's first send to the first connection's last byte: the span in
    which every connection had a stream going (the whole window at concurrency 1)."""
    steady_chunks: int
    """Content chunks that arrived within the steady span."""
    cpu_s: dict[str, float]
    """CPU seconds each process spent in the window."""
    worker_connections: int
    """TCP connections the worker accepted during the window (the gateway's health and load
    probes included)."""


def _steady(per_conn: list[list[StreamResult]]) -> tuple[float, int]:
    begin = max(rs[0].t_sent for rs in per_conn)
    end = min(rs[-1].t_end for rs in per_conn)
    if end <= begin:
        # Too few streams per connection to overlap: fall back to the whole window.
        begin = min(rs[0].t_sent for rs in per_conn)
        end = max(rs[-1].t_end for rs in per_conn)
    chunks = sum(1 for rs in per_conn for r in rs for t in r.content_times if begin <= t <= end)
    return end - begin, chunks


async def run_round(
    port: int,
    concurrency: int,
    per_stream: int,
    body: bytes,
    probes: Probes,
    spacing_s: float,
) -> Round:
    """``concurrency`` connections each run ``per_stream`` streams back to back.

    Connection ``k`` sends its first request ``k * spacing_s`` after the first one (0: all at
    once). Connecting happens before the window opens.
    """
    conns = [SSEConnection(HOST, port) for _ in range(concurrency)]
    try:
        await asyncio.gather(*(c.connect() for c in conns))
        conns_before = await probes.worker_connections()
        # A collection mid-window would add client-side pauses of its own to the samples.
        gc.collect()
        gc.disable()
        try:
            cpu_before = probes.cpu()
            start = time.perf_counter()
            per_conn = await asyncio.gather(
                *(
                    _stream_loop(c, body, per_stream, start + k * spacing_s)
                    for k, c in enumerate(conns)
                )
            )
            window = time.perf_counter() - start
            cpu_after = probes.cpu()
        finally:
            gc.enable()
        # Minus one: the probe's own connection.
        opened = await probes.worker_connections() - conns_before - 1
    finally:
        await asyncio.gather(*(c.close() for c in conns))
    used = {name: cpu_after[name] - cpu_before.get(name, 0.0) for name in cpu_after}
    steady_s, steady_chunks = _steady(per_conn)
    results = [r for rs in per_conn for r in rs]
    return Round(results, window, steady_s, steady_chunks, used, opened)


async def measure(
    targets: dict[Mode, int],
    concurrencies: Sequence[int],
    requests: int,
    rounds: int,
    max_tokens: int,
    log: Callable[[str], None],
    probes: Probes,
    stream_s: float,
    burst: bool,
) -> dict[tuple[Mode, int], Cell]:
    """Warm up every target, then alternate targets in ABBA order for ``rounds`` rounds.

    Unless ``burst``, the connections' first requests are spread over ``stream_s`` (one
    stream's nominal length), so that requests arrive evenly rather than all at once.
    """
    body = chat_body(max_tokens)

    def spacing(conc: int) -> float:
        return 0.0 if burst else stream_s / conc

    for mode, port in targets.items():
        for conc in concurrencies:
            results = (await run_round(port, conc, 2, body, probes, spacing(conc))).results
            bad = [r for r in results if not r.ok]
            if bad:
                first = bad[0]
                log(
                    f"warm-up {mode} x{conc}: {len(bad)}/{len(results)} streams failed, e.g. "
                    f"{first.error or first.status} {first.body[:200]!r}"
                )
    cells = {(m, c): Cell(m, c) for m in targets for c in concurrencies}
    per_round = max(1, math.ceil(requests / rounds))
    modes = list(targets)
    for r in range(rounds):
        order = modes if r % 2 == 0 else modes[::-1]
        for conc in concurrencies:
            for mode in order:
                rnd = await run_round(targets[mode], conc, per_round, body, probes, spacing(conc))
                cells[mode, conc].add_round(rnd)
        log(f"round {r + 1}/{rounds} done")
    return cells


# ---------------------------------------------------------------------------------------------
# Subprocesses


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if the benchmark dies without cleaning up."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def http_status(url: str, timeout: float = 1.0) -> int | None:
    """GET ``url`` (never through a proxy); the status, or None when nothing answered."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as resp:
            status: int = resp.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


class Stack:
    """The fake worker and (unless direct-only) the gateway, as subprocesses; stopped on exit."""

    def __init__(
        self,
        *,
        gateway: bool,
        ttft_ms: float,
        itl_ms: float,
        logdir: Path,
        gateway_env: dict[str, str],
        log: Callable[[str], None],
    ) -> None:
        self._want_gateway = gateway
        self._ttft_ms = ttft_ms
        self._itl_ms = itl_ms
        self._gateway_env = gateway_env
        self._log = log
        self.logdir = logdir
        logdir.mkdir(parents=True, exist_ok=True)
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.worker_port = 0
        self.gateway_port = 0

    def _spawn(self, name: str, args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        logfile = open(self.logdir / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it
        kwargs.setdefault("stdout", logfile)
        proc = subprocess.Popen(
            args,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stderr=logfile,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            **kwargs,
        )
        logfile.close()
        self._procs.append((name, proc))
        return proc

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The end of a subprocess's output."""
        path = self.logdir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def start(self) -> None:
        """Start the worker, then the gateway in front of it, and wait until both are ready."""
        worker = self._spawn(
            "worker",
            [
                sys.executable,
                "-m",
                "bench.fake_worker",
                "--host",
                HOST,
                "--port",
                "0",
                "--ttft-ms",
                str(self._ttft_ms),
                "--itl-ms",
                str(self._itl_ms),
                "--model",
                MODEL,
            ],
            stdout=subprocess.PIPE,
        )
        self.worker_port = self._read_worker_port(worker)
        self._wait_ready("worker", f"http://{HOST}:{self.worker_port}/health", 10.0)
        if not self._want_gateway:
            return
        self.gateway_port = free_port()
        env = (
            os.environ
            | {
                "GATEWAY_HOST": HOST,
                "GATEWAY_PORT": str(self.gateway_port),
                "GATEWAY_WORKERS": f"http://{HOST}:{self.worker_port}",
                "GATEWAY_ACCESS_LOG": "false",
            }
            | self._gateway_env
        )
        self._spawn("gateway", [sys.executable, "-m", "app"], env=env)
        self._wait_ready("gateway", f"http://{HOST}:{self.gateway_port}/readyz", 60.0)

    def _read_worker_port(self, proc: subprocess.Popen[bytes]) -> int:
        assert proc.stdout is not None
        deadline = time.monotonic() + 10.0
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None:
                raise RuntimeError(f"fake worker did not start:\n{self.log_tail('worker')}")
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if ready:
                # os.read, not the buffered file: a buffered read could swallow bytes that
                # select() then no longer reports as ready.
                line += os.read(proc.stdout.fileno(), 256)
        # "fake_worker listening on http://127.0.0.1:PORT"
        return int(line.decode().rsplit(":", 1)[1])

    def _wait_ready(self, name: str, url: str, timeout_s: float) -> None:
        proc = dict(self._procs)[name]
        deadline = time.monotonic() + timeout_s
        status: int | None = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with code {proc.returncode}:\n{self.log_tail(name)}"
                )
            status = http_status(url)
            if status == 200:
                return
            time.sleep(0.1)
        raise RuntimeError(
            f"{name} not ready after {timeout_s:.0f}s ({url} -> {status}):\n{self.log_tail(name)}"
        )

    def cpu_seconds(self) -> dict[str, float]:
        """Cumulative CPU (user + system) seconds of this process and of each subprocess."""
        out = {"client": time.process_time()}
        for name, proc in self._procs:
            with contextlib.suppress(OSError, IndexError, ValueError):
                # Fields 14 and 15 of /proc/PID/stat, counted after the ")" ending the name.
                stat = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[name] = (int(stat[11]) + int(stat[12])) / _CLOCK_TICKS
        return out

    def stop(self) -> None:
        """Stop every subprocess, newest first (the gateway before its worker)."""
        for name, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._log(f"{name} ignored SIGTERM; killing it")
                    proc.kill()
                    proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self._procs.clear()

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------
# Report


def _fmt(value: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def table(cells: dict[tuple[Mode, int], Cell]) -> str:
    """The results as a markdown table."""
    lines = [
        "| streams | path | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | chunks/s "
        "| ok/sent |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (mode, conc), cell in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(
            f"| {conc} | {mode} | {_fmt(cell.ms(cell.ttft_s, 50))} | "
            f"{_fmt(cell.ms(cell.ttft_s, 99))} | {_fmt(cell.ms(cell.itl_s, 50))} | "
            f"{_fmt(cell.ms(cell.itl_s, 99))} | {_fmt(cell.chunks_per_s, 0)} | "
            f"{cell.ok}/{cell.sent} |"
        )
    return "\n".join(lines)


def process_table(cells: dict[tuple[Mode, int], Cell]) -> str:
    """Per process: CPU use and the worker's new connections per stream.

    CPU use during the measured windows shows which process was the bottleneck; connections the
    worker accepted per stream show whether the gateway reuses keep-alive connections.
    """
    names = ["client", "worker", "gateway"]
    lines = [
        "| streams | path | "
        + " | ".join(f"{n} CPU %" for n in names)
        + " | worker conns opened / stream |",
        "|---:|---|" + "---:|" * (len(names) + 1),
    ]
    for (mode, conc), cell in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        used = cell.cpu_percent()
        row = " | ".join(_fmt(used[n], 0) if n in used else "-" for n in names)
        per_stream = cell.worker_connections / cell.sent if cell.sent else math.nan
        lines.append(f"| {conc} | {mode} | {row} | {_fmt(per_stream, 3)} |")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Check:
    """One target: the measured value, the verdict and how to print it."""

    name: str
    value: float
    target: str
    passed: bool
    text: str

    def line(self) -> str:
        """One summary line."""
        verdict = "PASS" if self.passed else "MISS"
        return f"{verdict}  {self.name:<38} {self.text:>12}   (target {self.target})"


def checks(
    cells: dict[tuple[Mode, int], Cell], concurrencies: Sequence[int], tokens: int
) -> list[Check]:
    """Gateway against direct, for every target, at every concurrency."""
    out: list[Check] = []
    for conc in concurrencies:
        direct, gateway = cells["direct", conc], cells["gateway", conc]
        added = gateway.ms(gateway.ttft_s, 50) - direct.ms(direct.ttft_s, 50)
        limit = ADDED_TTFT_P50_MS.get(conc, max(ADDED_TTFT_P50_MS.values()))
        out.append(
            Check(
                f"added TTFT p50 @ {conc} stream(s)",
                added,
                f"<= {limit:g} ms",
                added <= limit,
                f"{added:+.3f} ms",
            )
        )
    for conc in concurrencies:
        direct, gateway = cells["direct", conc], cells["gateway", conc]
        ratio = gateway.ms(gateway.itl_s, 50) / direct.ms(direct.itl_s, 50)
        out.append(
            Check(
                f"ITL p50 gateway/direct @ {conc}",
                ratio,
                f"within {ITL_P50_TOLERANCE:.0%}",
                abs(ratio - 1) <= ITL_P50_TOLERANCE,
                f"{ratio:.3f}",
            )
        )
    for conc in concurrencies:
        direct, gateway = cells["direct", conc], cells["gateway", conc]
        ratio = gateway.chunks_per_s / direct.chunks_per_s
        out.append(
            Check(
                f"chunk rate gateway/direct @ {conc}",
                ratio,
                f">= {CHUNK_RATE_MIN_RATIO:.0%}",
                ratio >= CHUNK_RATE_MIN_RATIO,
                f"{ratio:.3f}",
            )
        )
    for conc in concurrencies:
        direct, gateway = cells["direct", conc], cells["gateway", conc]
        same = set(gateway.chunks_per_stream) == set(direct.chunks_per_stream) == {tokens}
        seen = "/".join(str(k) for k in sorted(gateway.chunks_per_stream)) or "none"
        out.append(
            Check(
                f"content chunks per stream @ {conc}",
                float(same),
                f"all {tokens}, as direct",
                same,
                f"gateway {seen}",
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# Entry point


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.overhead", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=40,
        help="streams each connection runs per (path, concurrency), split over the rounds",
    )
    parser.add_argument("--rounds", type=int, default=4, help="direct/gateway alternations")
    parser.add_argument(
        "--concurrency", default="1,32", help="comma-separated concurrent stream counts"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--arrival",
        choices=["staggered", "burst"],
        default="staggered",
        help="staggered: the connections start one stream-length/N apart (steady state); "
        "burst: all N send their first request at once, and stay in lock-step",
    )
    parser.add_argument("--ttft-ms", type=float, default=20.0, help="the fake worker's TTFT")
    parser.add_argument("--itl-ms", type=float, default=10.0, help="the fake worker's ITL")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "overhead.json")
    parser.add_argument(
        "--logs",
        type=Path,
        default=ROOT / "bench" / "results" / "logs",
        help="where the worker's and gateway's output goes",
    )
    parser.add_argument(
        "--gateway-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment for the gateway, e.g. GATEWAY_LOG_LEVEL=warning (repeatable)",
    )
    parser.add_argument(
        "--direct-only", action="store_true", help="measure the worker alone (no gateway)"
    )
    args = parser.parse_args(argv)
    for item in args.gateway_env:
        if "=" not in item:
            parser.error(f"--gateway-env wants NAME=VALUE, got {item!r}")
    return args


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _runner() -> asyncio.Runner:
    """A runner on uvloop when installed: the client's own overhead is then smaller."""
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def _sigterm(signum: int, frame: FrameType | None) -> None:
    # Unwind normally so that Stack.__exit__ stops the subprocesses.
    raise KeyboardInterrupt


async def _cancel_on_sigterm(work: Coroutine[Any, Any, _T]) -> _T:
    """Await ``work``; SIGTERM cancels it cleanly rather than raising inside a loop callback."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await work
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        # remove_signal_handler restored SIG_DFL; outside the loop, unwind as before.
        signal.signal(signal.SIGTERM, _sigterm)


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run the benchmark described by ``args``; returns the JSON report (None on failure)."""
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    gateway = not args.direct_only
    gateway_env = dict(item.split("=", 1) for item in args.gateway_env)
    started = time.time()
    load_before = _loadavg()
    _log(f"starting fake worker{' and gateway' if gateway else ''}")
    try:
        with Stack(
            gateway=gateway,
            ttft_ms=args.ttft_ms,
            itl_ms=args.itl_ms,
            logdir=args.logs,
            gateway_env=gateway_env,
            log=_log,
        ) as stack:
            targets: dict[Mode, int] = {"direct": stack.worker_port}
            if gateway:
                targets["gateway"] = stack.gateway_port
            _log(f"targets: {targets}; measuring")
            work = measure(
                targets,
                concurrencies,
                args.requests,
                args.rounds,
                args.max_tokens,
                _log,
                Probes(stack.cpu_seconds, stack.worker_port),
                (args.ttft_ms + (args.max_tokens - 1) * args.itl_ms) / 1000,
                args.arrival == "burst",
            )
            with _runner() as runner:
                try:
                    cells = runner.run(_cancel_on_sigterm(work))
                except asyncio.CancelledError:
                    raise KeyboardInterrupt from None
        _log(f"worker and gateway output: {args.logs}/")
    except RuntimeError as exc:
        _log(f"FAILED: {exc}")
        return None
    print()
    print(f"## Gateway overhead ({'via gateway' if gateway else 'direct only'})")
    print()
    print(
        f"fake worker: TTFT {args.ttft_ms:g} ms, ITL {args.itl_ms:g} ms, "
        f"max_tokens {args.max_tokens}; {args.requests} streams per connection per cell over "
        f"{args.rounds} rounds; {args.arrival} arrivals; {os.cpu_count()} CPUs, "
        f"1-min load average {_fmt(load_before)} before, {_fmt(_loadavg())} after"
    )
    print()
    print(table(cells))
    print()
    print(process_table(cells))
    print()
    summary: list[Check] = []
    if gateway:
        summary = checks(cells, concurrencies, args.max_tokens)
        print("```")
        for check in summary:
            print(check.line())
        print("```")
    for cell in cells.values():
        if cell.errors:
            _log(f"{cell.mode} x{cell.concurrency} errors: {cell.errors}")
        if cell.max_content_per_http_chunk > 1:
            _log(
                f"{cell.mode} x{cell.concurrency}: up to {cell.max_content_per_http_chunk} "
                "content events arrived in one HTTP chunk (batched)"
            )
    return {
        "benchmark": "gateway_overhead",
        "mode": "gateway" if gateway else "direct_only",
        "started_at": started,
        "duration_s": time.time() - started,
        "config": {
            "requests_per_connection": args.requests,
            "rounds": args.rounds,
            "concurrency": concurrencies,
            "max_tokens": args.max_tokens,
            "worker_ttft_ms": args.ttft_ms,
            "worker_itl_ms": args.itl_ms,
            "arrival": args.arrival,
            "gateway_env": gateway_env,
        },
        "environment": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            # Other work on a shared machine shows up here, and in the numbers.
            "loadavg_1min_before": load_before,
            "loadavg_1min_after": _loadavg(),
        },
        "cells": [cell.to_json() for cell in cells.values()],
        "targets": [
            {"name": c.name, "value": c.value, "target": c.target, "pass": c.passed}
            for c in summary
        ],
    }


def _loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def _nan_to_none(value: Any) -> Any:
    """NaN (a percentile of no samples) is not JSON: write it as null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> None:
    """Command line entry point; exits 0 whatever the numbers say."""
    args = _parse_args(argv)
    with _sigterm_unwinds():
        try:
            report = run(args)
        except KeyboardInterrupt:
            _log("interrupted; subprocesses stopped")
            return
    if report is not None:
        out: Path = args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(_nan_to_none(report), indent=2, allow_nan=False) + "\n")
        _log(f"wrote {out}")


if __name__ == "__main__":
    main()

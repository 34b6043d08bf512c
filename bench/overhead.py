"""Gateway overhead benchmark: the same streams sent straight to the workers and via the gateway.

``python -m bench.overhead [--concurrency 1,32,128,512,1024] [--memory-streams 10000]
[--profile 32,128] [--out bench/results/overhead.json]``

Fixed-timing fake workers (:mod:`bench.fake_worker`, one process each), the gateway
(``python -m app``, one process) and the load client (:mod:`bench.load_client`, several
processes) run side by side. For each number of concurrent streams (one keep-alive connection
each, streams back to back, first requests staggered over one stream's length so that the load
is steady) it measures, DIRECT to the workers and VIA the gateway, alternating the two in ABBA
order: TTFT and ITL percentiles, content events per second while every connection was busy,
the content-event count of every stream and the most content events in one HTTP chunk (event
boundaries), and every process's CPU time from ``/proc``. The gateway's CPU per relayed event is
its user + system time over the round divided by the content events its clients received.

The workers' pace is fixed: TTFT 20 ms, a token every 10 ms, 32 tokens. Above 128 streams the
pace per stream is slowed so that all streams together stay at ``--max-rate`` tokens per second
(12,800: 128 streams at 10 ms): one Python process cannot relay 100,000 events a second, and
the whole benchmark shares two cores. Requests and events per second then stay constant from
128 streams up, and only the concurrency grows, which is what the flatness check is about.

``--memory-streams N`` (default 10,000) also opens N streams at one token a second through a
fresh gateway (admission off: a 1 s TPOT is far over every tier's target), reads the gateway's
RSS with and without them, and sends probe requests through the gateway and directly while they
run; as many as one gateway process can hold with room for the probes, where the machine's
descriptor limit is under two a stream. ``--profile 32,128`` records the gateway with py-spy in
one extra round at each of those concurrencies and prints its top functions.

Two references relay the same rounds in front of the same workers, so that what relaying costs
on this machine is measured beside what it costs in the gateway: the project's minimal Python
relay (``python-relay``, :mod:`bench.reference_relay`, uvloop and httptools doing a data plane's
work per event and nothing more; ``--no-floor`` skips it) and, with ``--reference`` (by default
``.venv-router``'s, which ``make bench`` installs), vLLM's Rust router (``vllm-router``, round
robin).

It prints markdown tables and PASS/MISS against the targets of issue 66, writes a JSON file,
and always exits 0: it is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import json
import math
import os
import platform
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Final

from app.fleet.upstream import descriptors_fit
from bench.load_client import ClientPool, RoundSpec, ShardResult, merge
from scripts.vllm_worker import free_port as free_port  # re-exported: the benches take it here

ROOT: Final = Path(__file__).resolve().parent.parent
_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
HOST: Final = "127.0.0.1"
MODEL: Final = "fake-model"
CHAT_PATH: Final = "/v1/chat/completions"
STREAM_TIMEOUT_S: Final = 30.0
Mode = str
"""``direct``, ``gateway``, ``gateway-b`` (the same gateway at another commit or setting) or
``vllm-router`` (the reference)."""
REFERENCE: Final = "vllm-router"
FLOOR: Final = "python-relay"
"""The project's own minimal relay (:mod:`bench.reference_relay`): the floor of a Python relay."""
REFERENCE_BIN: Final = ROOT / ".venv-router" / "bin" / "vllm-router"

# Targets of issue 66, as ratios within one run: what the gateway may add on top of the workers,
# against the project's minimal Python relay (the floor) and vLLM's Rust router.
ADDED_TTFT_P50_MS: Final = 1.0
ITL_P50_TOLERANCE: Final = 0.05
RATE_MIN_RATIO: Final = 0.95
CPU_FLAT_RATIO: Final = 1.5
CPU_OF_FLOOR_RATIO: Final = 1.5
CPU_OF_REFERENCE_RATIO: Final = 1.0
MEMORY_RSS_MAX_MIB: Final = 1024.0
MEMORY_PROBE_P99_MS: Final = 100.0
MEMORY_PROBE_ROOM: Final = 16
"""Worker connections of the gateway's budget the memory run leaves to its probes."""


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
    """Every sample for one (mode, streams) pair, pooled over the rounds."""

    mode: Mode
    streams: int
    itl_ms: float
    """The workers' pace per stream in this cell."""
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    steady_events: int = 0
    steady_s: float = 0.0
    content_events: int = 0
    window_s: float = 0.0
    sent: int = 0
    ok: int = 0
    content_per_stream: dict[int, int] = field(default_factory=dict)
    max_content_per_http_chunk: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds by part (client, workers, gateway, machine, ...) inside the rounds."""
    worker_connections: int = 0
    rounds: list[dict[str, float]] = field(default_factory=list)

    def add(self, res: ShardResult, steady_s: float, window_s: float, cpu: dict[str, float],
            worker_connections: int) -> None:  # fmt: skip
        """Fold one round in."""
        self.ttft_s.extend(res.ttft)
        self.itl_s.extend(res.itl)
        self.steady_events += res.steady_events
        self.steady_s += steady_s
        self.content_events += res.content_events
        self.window_s += window_s
        self.sent += res.sent
        self.ok += res.ok
        for k, v in res.content_per_stream.items():
            self.content_per_stream[k] = self.content_per_stream.get(k, 0) + v
        self.max_content_per_http_chunk = max(
            self.max_content_per_http_chunk, res.max_content_per_http_chunk
        )
        for k2, v2 in res.errors.items():
            self.errors[k2] = self.errors.get(k2, 0) + v2
        for name, seconds in cpu.items():
            self.cpu_s[name] = self.cpu_s.get(name, 0.0) + seconds
        self.worker_connections += worker_connections
        gw = cpu.get(self.mode) if self.mode != "direct" else None
        self.rounds.append(
            {
                "ttft_p50_ms": percentile(list(res.ttft), 50) * 1000,
                "events_per_s": res.steady_events / steady_s if steady_s > 0 else math.nan,
                "cpu_us_per_event": (
                    gw / res.content_events * 1e6
                    if gw is not None and res.content_events
                    else math.nan
                ),
                "window_s": window_s,
            }
        )

    @property
    def events_per_s(self) -> float:
        """Content events per second, all streams together, while every connection was busy."""
        return self.steady_events / self.steady_s if self.steady_s > 0 else math.nan

    @property
    def cpu_us_per_event(self) -> float:
        """The gateway's CPU time per content event it relayed, in microseconds."""
        gw = self.cpu_s.get(self.mode) if self.mode != "direct" else None
        if gw is None or not self.content_events:
            return math.nan
        return gw / self.content_events * 1e6

    def cpu_percent(self) -> dict[str, float]:
        """Each part's CPU use over the rounds, in % of one core."""
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
            "streams": self.streams,
            "worker_itl_ms": self.itl_ms,
            "requests_sent": self.sent,
            "requests_ok": self.ok,
            "errors": self.errors,
            "ttft_ms": {f"p{q}": self.ms(self.ttft_s, q) for q in (50, 90, 99)},
            "itl_ms": {f"p{q}": self.ms(self.itl_s, q) for q in (50, 90, 99)},
            "events_per_s": self.events_per_s,
            "content_events": self.content_events,
            "cpu_us_per_event": self.cpu_us_per_event,
            "content_events_per_stream": {
                str(k): v for k, v in sorted(self.content_per_stream.items())
            },
            "max_content_events_per_http_chunk": self.max_content_per_http_chunk,
            "cpu_percent_of_one_core": self.cpu_percent(),
            "worker_connections_opened": self.worker_connections,
            "window_s": self.window_s,
            "rounds": self.rounds,
        }


# ---------------------------------------------------------------------------------------------
# Processes


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if the benchmark dies without cleaning up."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _child_setup(nofile: int) -> Callable[[], None]:
    """Before exec: die with the parent, and allow ``nofile`` descriptors (:func:`nofile_for`)."""

    def setup() -> None:
        _die_with_parent()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = nofile_for(nofile)
        if wanted > soft:
            # The gateway sizes its connection budget by the soft limit (connection_budget).
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, max(wanted, hard)))

    return setup


def nofile_for(wanted: int) -> int:
    """The soft descriptor limit a child asking for ``wanted`` runs with.

    At least this process's own; ``wanted`` if the hard limit allows it or this process may
    raise it (root, where the machine lets it), else the hard limit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if wanted <= soft:
        return soft
    if hard == resource.RLIM_INFINITY or wanted <= hard:
        return wanted
    try:  # whether this process may raise its hard limit (root with CAP_SYS_RESOURCE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, wanted))
    except (ValueError, OSError):
        return hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return wanted


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


def http_text(url: str, timeout: float = 2.0) -> str:
    """GET ``url`` and return its body ('' when nothing answered)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as resp:
            body: bytes = resp.read()
            return body.decode("utf-8", "replace")
    except (OSError, ValueError):
        return ""


def proc_children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (of any of its threads)."""
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                children.extend(int(c) for c in (task / "children").read_text().split())
    return children


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its children; NaN when it is gone.

    A gateway with ``GATEWAY_PROCESSES`` above 1 relays in its children: their time counts,
    the live ones' as they run and the ended ones' once reaped.
    """
    try:
        # Fields 14-17 of /proc/PID/stat (own and reaped children's user and system time),
        # counted after the ")" ending the name.
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return math.nan
    own = sum(int(x) for x in stat[11:15]) / _CLOCK_TICKS
    return own + sum(
        cpu for child in proc_children(pid) if not math.isnan(cpu := proc_cpu_s(child))
    )


def proc_rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` and its children in MiB (shared pages in each)."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return math.nan
    own = pages * _PAGE / 2**20
    return own + sum(
        rss for child in proc_children(pid) if not math.isnan(rss := proc_rss_mib(child))
    )


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (every state but idle and iowait)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    ticks = [int(x) for x in fields[:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / _CLOCK_TICKS


class Stack:
    """Fake workers and (unless direct-only) the gateway, as subprocesses; stopped on exit."""

    def __init__(
        self,
        *,
        workers: int,
        gateway: bool,
        logdir: Path,
        gateway_env: dict[str, str],
        log: Callable[[str], None],
        max_num_seqs: int,
        nofile: int = 0,
        b_root: Path | None = None,
        b_env: dict[str, str] | None = None,
        reference: Path | None = None,
        floor: bool = False,
    ) -> None:
        self._b_root = b_root
        self._reference = reference
        self._floor = floor
        self._b_env = b_env
        self._workers = workers
        self._want_gateway = gateway
        self._gateway_env = gateway_env
        self._log = log
        self._max_num_seqs = max_num_seqs
        self._nofile = nofile
        self.logdir = logdir
        logdir.mkdir(parents=True, exist_ok=True)
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.worker_ports: list[int] = []
        self.gateway_ports: dict[str, int] = {}
        """Every relay under test, by name: the gateway(s) and the reference."""

    @property
    def gateway_port(self) -> int:
        """The port of the gateway under test."""
        return self.gateway_ports["gateway"]

    def _spawn(
        self, name: str, args: list[str], cwd: Path = ROOT, **kwargs: Any
    ) -> subprocess.Popen[bytes]:
        logfile = open(self.logdir / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it
        kwargs.setdefault("stdout", logfile)
        proc = subprocess.Popen(
            args,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stderr=logfile,
            preexec_fn=_child_setup(self._nofile) if sys.platform == "linux" else None,
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
        """Start the workers, then the gateway in front of them; wait until all are ready."""
        for i in range(self._workers):
            name = f"worker{i}"
            command = [
                sys.executable, "-m", "bench.fake_worker", "--host", HOST, "--port", "0",
                "--model", MODEL, "--max-num-seqs", str(self._max_num_seqs),
            ]  # fmt: skip
            proc = self._spawn(name, command, stdout=subprocess.PIPE)
            port = self._read_worker_port(name, proc)
            self.worker_ports.append(port)
            self._wait_ready(name, f"http://{HOST}:{port}/health", 10.0)
        if self._want_gateway:
            self._start_gateway("gateway", ROOT, self._gateway_env)
        if self._want_gateway and (self._b_root is not None or self._b_env):
            b_env = self._gateway_env | (self._b_env or {})
            self._start_gateway("gateway-b", self._b_root or ROOT, b_env)
        if self._reference is not None:
            self._start_reference(self._reference)
        if self._floor:
            self._start_floor()

    def _start_gateway(self, name: str, root: Path, extra: dict[str, str]) -> None:
        port = self.gateway_ports[name] = free_port()
        env = (
            os.environ
            | {
                "GATEWAY_HOST": HOST,
                "GATEWAY_PORT": str(port),
                "GATEWAY_WORKERS": ",".join(f"http://{HOST}:{p}" for p in self.worker_ports),
                "GATEWAY_ACCESS_LOG": "false",
                "PYTHONPATH": str(root),
            }
            | extra
        )
        self._spawn(name, [sys.executable, "-m", "app"], cwd=root, env=env)
        self._wait_ready(name, f"http://{HOST}:{port}/readyz", 60.0)

    def _start_reference(self, executable: Path) -> None:
        """Start the reference, vLLM's Rust router, in front of the same workers (round robin)."""
        port = self.gateway_ports[REFERENCE] = free_port()
        urls = [f"http://{HOST}:{p}" for p in self.worker_ports]
        command = [
            str(executable), "--host", HOST, "--port", str(port), "--worker-urls", *urls,
            "--policy", "round_robin", "--log-level", "warning",
            "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
        ]  # fmt: skip
        self._spawn(REFERENCE, command)
        self._wait_ready(REFERENCE, f"http://{HOST}:{port}/health", 60.0)

    def _start_floor(self) -> None:
        """Start the minimal Python relay in front of the same workers (round robin)."""
        port = self.gateway_ports[FLOOR] = free_port()
        urls = ",".join(f"http://{HOST}:{p}" for p in self.worker_ports)
        command = [
            sys.executable, "-m", "bench.reference_relay", "--host", HOST, "--port", str(port),
            "--workers", urls,
        ]  # fmt: skip
        self._spawn(FLOOR, command)
        self._wait_ready(FLOOR, f"http://{HOST}:{port}/health", 30.0)

    def _read_worker_port(self, name: str, proc: subprocess.Popen[bytes]) -> int:
        assert proc.stdout is not None
        deadline = time.monotonic() + 10.0
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None:
                raise RuntimeError(f"fake worker did not start:\n{self.log_tail(name)}")
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

    def check_alive(self) -> None:
        """Raise if a subprocess has exited (on a shared machine, someone may have killed it)."""
        for name, proc in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with code {proc.returncode} mid-run:\n{self.log_tail(name)}"
                )

    def pid(self, name: str) -> int:
        """Process id of a subprocess."""
        return dict(self._procs)[name].pid

    def cpu_seconds(self) -> dict[str, float]:
        """Cumulative CPU seconds of the gateway and of the workers (summed and the busiest)."""
        out: dict[str, float] = {}
        for name, proc in self._procs:
            out[name] = proc_cpu_s(proc.pid)
        return out

    def worker_connections(self) -> int:
        """TCP connections the workers have accepted so far."""
        total = 0
        for port in self.worker_ports:
            text = http_text(f"http://{HOST}:{port}/metrics")
            match = re.search(r"^fake_worker_connections_total (\d+)", text, re.MULTILINE)
            total += int(match.group(1)) if match else 0
        return total

    def worker_running(self) -> int:
        """Generations in flight on all workers."""
        total = 0.0
        for port in self.worker_ports:
            text = http_text(f"http://{HOST}:{port}/metrics")
            match = re.search(r"^vllm:num_requests_running\{[^}]*\} ([\d.]+)", text, re.MULTILINE)
            total += float(match.group(1)) if match else 0.0
        return int(total)

    def stop(self) -> None:
        """Stop every subprocess, newest first (the gateway before its workers).

        Each gateway's metrics are kept first, in ``<logdir>/<name>-metrics.txt``: its
        admission decisions and limits tell why it refused or queued what it did.
        """
        for name, port in self.gateway_ports.items():
            if dict(self._procs).get(name) is not None:
                with contextlib.suppress(OSError):
                    text = http_text(f"http://{HOST}:{port}/metrics")
                    (self.logdir / f"{name}-metrics.txt").write_text(text)
        for name, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
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
# Rounds


def chat_body(max_tokens: int, ttft_ms: float, itl_ms: float) -> bytes:
    """The request every stream sends, to either target (the fake worker's pace in the body)."""
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Count to thirty-two."}],
            "stream": True,
            "max_tokens": max_tokens,
            "fake_ttft_ms": ttft_ms,
            "fake_itl_ms": itl_ms,
        },
        separators=(",", ":"),
    ).encode()


@dataclass(frozen=True, slots=True)
class Load:
    """One round's load."""

    streams: int
    duration_s: float
    max_tokens: int
    ttft_ms: float
    itl_ms: float

    @property
    def stream_s(self) -> float:
        """One stream's nominal length."""
        return (self.ttft_ms + (self.max_tokens - 1) * self.itl_ms) / 1000


@dataclass(slots=True)
class RoundOut:
    """What one round measured."""

    result: ShardResult
    steady_s: float
    window_s: float
    cpu: dict[str, float]
    worker_connections: int


class Bench:
    """The client processes and the stack, and the bookkeeping of one round."""

    def __init__(self, stack: Stack, clients: ClientPool) -> None:
        self.stack = stack
        self.clients = clients

    def cpu(self) -> dict[str, float]:
        """Cumulative CPU seconds by part: every process of ours, and the whole machine."""
        out = self.stack.cpu_seconds()
        for i, pid in enumerate(self.clients.pids):
            out[f"client{i}"] = proc_cpu_s(pid)
        out["bench"] = time.process_time()
        out["machine"] = machine_busy_s()
        return out

    def round(
        self, ports: Sequence[int], load: Load, *, count_connections: bool = True
    ) -> RoundOut:
        """One round of ``load`` against ``ports``."""
        body = chat_body(load.max_tokens, load.ttft_ms, load.itl_ms)
        conns_before = self.stack.worker_connections() if count_connections else 0
        stream_s = load.stream_s
        # Time to open the connections before the first request.
        prep = 0.2 + load.streams / 2000
        start_at = time.perf_counter() + prep
        spacing = stream_s / load.streams
        stop_at = start_at + stream_s + load.duration_s
        spec = RoundSpec(
            host=HOST, ports=tuple(ports), path=CHAT_PATH, body=body, first_index=0,
            connections=load.streams, start_at=start_at, spacing_s=spacing, stop_at=stop_at,
            steady_from=start_at + stream_s, steady_to=stop_at, timeout_s=STREAM_TIMEOUT_S,
        )  # fmt: skip
        self.stack.check_alive()
        before = self.cpu()
        began = time.perf_counter()
        results = self.clients.run(spec, load.streams)
        window = time.perf_counter() - began
        after = self.cpu()
        cpu = {name: after[name] - before[name] for name in after if name in before}
        # Less the probes' own connections, one per worker.
        opened = (
            self.stack.worker_connections() - conns_before - len(self.stack.worker_ports)
            if count_connections
            else 0
        )
        return RoundOut(merge(results), stop_at - (start_at + stream_s), window, cpu, opened)


def itl_for(streams: int, itl_ms: float, max_rate: float) -> float:
    """The workers' pace per stream: ``itl_ms``, slowed to hold all streams at ``max_rate``."""
    return max(itl_ms, streams * 1000.0 / max_rate) if max_rate > 0 else itl_ms


def measure(
    bench: Bench,
    targets: dict[Mode, list[int]],
    args: argparse.Namespace,
    concurrencies: Sequence[int],
    log: Callable[[str], None],
) -> dict[tuple[Mode, int], Cell]:
    """Warm up every target, then alternate the targets in ABBA order for ``args.rounds``."""

    def load(streams: int, duration: float) -> Load:
        itl = itl_for(streams, args.itl_ms, args.max_rate)
        return Load(streams, duration, args.max_tokens, args.ttft_ms, itl)

    for mode, ports in targets.items():
        for conc in sorted({min(concurrencies), max(concurrencies)}):
            out = bench.round(ports, load(conc, 0.5), count_connections=False)
            bad = out.result.sent - out.result.ok
            if bad:
                log(f"warm-up {mode} x{conc}: {bad}/{out.result.sent} failed: {out.result.errors}")
    cells = {
        (m, c): Cell(m, c, itl_for(c, args.itl_ms, args.max_rate))
        for m in targets
        for c in concurrencies
    }
    modes = list(targets)
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else modes[::-1]
        for conc in concurrencies:
            duration = args.duration_single if conc == 1 else args.duration
            for mode in order:
                out = bench.round(targets[mode], load(conc, duration))
                cells[mode, conc].add(
                    out.result, out.steady_s, out.window_s, out.cpu, out.worker_connections
                )
                gw = cells[mode, conc].rounds[-1]
                log(
                    f"round {r + 1} {mode} x{conc}: {out.result.ok}/{out.result.sent} ok, "
                    f"{gw['events_per_s']:.0f} ev/s, TTFT p50 {gw['ttft_p50_ms']:.2f} ms"
                    + (f", {gw['cpu_us_per_event']:.1f} us/event" if mode != "direct" else "")
                )
    return cells


PER_REQUEST_STREAMS: Final = 32
PER_REQUEST_TOKENS: Final = 2


def per_request(
    bench: Bench, targets: dict[Mode, list[int]], args: argparse.Namespace,
    log: Callable[[str], None],
) -> dict[Mode, float]:  # fmt: skip
    """CPU µs per request of every relay, with answers of 2 tokens at 32 streams (ABBA rounds).

    So short an answer makes what a request costs (parsing, routing, opening the worker
    request, the access line) outweigh what its events cost.
    """
    load = Load(PER_REQUEST_STREAMS, args.duration, PER_REQUEST_TOKENS, args.ttft_ms, args.itl_ms)
    relays = [mode for mode in targets if mode != "direct"]
    cpu = dict.fromkeys(relays, 0.0)
    done = dict.fromkeys(relays, 0)
    for r in range(args.rounds):
        for mode in relays if r % 2 == 0 else relays[::-1]:
            out = bench.round(targets[mode], load, count_connections=False)
            cpu[mode] += out.cpu.get(mode, math.nan)
            done[mode] += out.result.ok
            log(f"per request round {r + 1} {mode}: {out.result.ok}/{out.result.sent} ok")
    return {mode: 1e6 * cpu[mode] / done[mode] if done[mode] else math.nan for mode in relays}


def per_request_checks(costs: dict[Mode, float]) -> list[Check]:
    """The gateway's CPU per request against the router's (issue 66: at most the router's)."""
    gw, router = costs.get("gateway"), costs.get(REFERENCE)
    if gw is None or router is None:
        return []
    times = gw / router
    name = f"CPU per request gateway/{REFERENCE} @ {PER_REQUEST_STREAMS}"
    return [Check(name, times, "<= 1.00x", times <= 1.0, f"{gw:.0f}/{router:.0f} µs")]


# ---------------------------------------------------------------------------------------------
# Memory per stream


@dataclass(slots=True)
class MemoryResult:
    """The many-streams run."""

    streams: int
    asked: int
    """The streams asked for: more than ``streams`` when the descriptors did not fit them."""
    rss_idle_mib: float
    rss_loaded_mib: float
    running_at_sample: int
    streams_ok: int
    streams_sent: int
    probe_gateway_ms: dict[str, float]
    probe_direct_ms: dict[str, float]
    probes: int
    gateway_cpu_percent: float
    nofile_soft: int
    errors: dict[str, int]

    @property
    def per_stream_kib(self) -> float:
        """Gateway RSS added per stream."""
        return (self.rss_loaded_mib - self.rss_idle_mib) * 1024 / max(1, self.running_at_sample)


def _nofile_of(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                return int(line.split()[3])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def streams_that_fit(asked: int) -> tuple[int, int]:
    """``(streams, descriptor limit)`` of a gateway process started here for ``asked`` streams.

    The streams are what it can hold at once beside the memory run's probes (two descriptors
    a stream).
    """
    nofile = nofile_for(2 * asked + 1024)
    return min(asked, descriptors_fit(nofile) - MEMORY_PROBE_ROOM), nofile


def memory_run(args: argparse.Namespace, log: Callable[[str], None]) -> MemoryResult | None:
    """``args.memory_streams`` streams at 1 token/s through a fresh gateway, with probes.

    As many of them as the gateway's descriptors hold with room for the probes: beyond that
    they would be refused (503, the gateway's own budget spent) and so would the probes.
    """
    asked = args.memory_streams
    n, limit = streams_that_fit(asked)
    if n < asked:
        log(
            f"memory: {asked:,} streams need over {2 * asked:,} descriptors in one process (two "
            f"a stream); this machine allows {limit:,}: {n:,} streams, with room for the probes"
        )
    ramp_s = n / args.connect_rate
    probe_s = args.memory_probe_s
    hold_s = ramp_s + 2.0 + probe_s + 2.0
    tokens = math.ceil(hold_s) + 1
    env = {
        "GATEWAY_ADMISSION": "false",
        "GATEWAY_MAX_UPSTREAM_CONNECTIONS": str(n + 64),
        # The client connections too (default 4,096): beyond it the gateway answers 503 at once.
        "GATEWAY_MAX_CONNECTIONS": str(n + 64),
        # The load client opens every connection before the first request: one that sends no
        # byte within the header timeout (10 s) is closed, as a slow client's would be.
        "GATEWAY_HEADER_TIMEOUT_S": str(math.ceil(ramp_s) + 10),
        "GATEWAY_LOG_LEVEL": "warning",
    } | dict(item.split("=", 1) for item in args.gateway_env)
    log(f"memory: {n} streams at 1 token/s, ramp {ramp_s:.1f} s, probes for {probe_s:.0f} s")
    with (
        Stack(
            workers=args.workers, gateway=True, logdir=args.logs / "memory", gateway_env=env,
            log=log, max_num_seqs=max(n, 1024), nofile=2 * asked + 1024,
        ) as stack,
        contextlib.closing(ClientPool(args.clients)) as pool,
        contextlib.closing(ClientPool(1)) as probe_gw,
        contextlib.closing(ClientPool(1)) as probe_direct,
    ):  # fmt: skip
        gw_pid = stack.pid("gateway")
        warm = Load(8, 0.5, 4, args.ttft_ms, args.itl_ms)
        Bench(stack, pool).round([stack.gateway_port], warm, count_connections=False)
        time.sleep(1.0)
        rss_idle = proc_rss_mib(gw_pid)
        body = chat_body(tokens, args.ttft_ms, 1000.0)
        start_at = time.perf_counter() + 0.3
        spacing = 1.0 / args.connect_rate
        stop_at = start_at + n * spacing + 0.5
        spec = RoundSpec(
            host=HOST, ports=(stack.gateway_port,), path=CHAT_PATH, body=body, first_index=0,
            connections=n, start_at=start_at, spacing_s=spacing, stop_at=stop_at,
            steady_from=0.0, steady_to=0.0, timeout_s=tokens + STREAM_TIMEOUT_S,
            connect_rate=args.connect_rate,
        )  # fmt: skip
        pool.start(spec, n)
        probe_from = start_at + ramp_s + 2.0
        probe_to = probe_from + probe_s
        probe_body = chat_body(1, args.ttft_ms, args.itl_ms)

        def probe_spec(port: int) -> RoundSpec:
            return RoundSpec(
                host=HOST, ports=(port,), path=CHAT_PATH, body=probe_body, first_index=0,
                connections=1, start_at=probe_from, spacing_s=0.0, stop_at=probe_to,
                steady_from=0.0, steady_to=0.0, timeout_s=STREAM_TIMEOUT_S, pause_s=0.05,
            )  # fmt: skip

        probe_gw.start(probe_spec(stack.gateway_port), 1)
        probe_direct.start(probe_spec(stack.worker_ports[0]), 1)
        time.sleep(max(0.0, probe_from - time.perf_counter()))
        cpu_before, t_before = proc_cpu_s(gw_pid), time.perf_counter()
        time.sleep(probe_s / 2)
        rss_loaded = proc_rss_mib(gw_pid)
        running = stack.worker_running()
        time.sleep(max(0.0, probe_to - time.perf_counter()))
        cpu_pct = 100 * (proc_cpu_s(gw_pid) - cpu_before) / (time.perf_counter() - t_before)
        gw_probe = merge(probe_gw.collect())
        direct_probe = merge(probe_direct.collect())
        log(f"memory: probes done; waiting for the {n} streams to end")
        streams = merge(pool.collect())
        nofile = _nofile_of(gw_pid)

    def ms(res: ShardResult) -> dict[str, float]:
        values = list(res.ttft)
        return {f"p{q}": percentile(values, q) * 1000 for q in (50, 99)}

    return MemoryResult(
        streams=n,
        asked=asked,
        rss_idle_mib=rss_idle,
        rss_loaded_mib=rss_loaded,
        running_at_sample=running,
        streams_ok=streams.ok,
        streams_sent=streams.sent,
        probe_gateway_ms=ms(gw_probe),
        probe_direct_ms=ms(direct_probe),
        probes=gw_probe.sent,
        gateway_cpu_percent=cpu_pct,
        nofile_soft=nofile,
        errors=streams.errors | gw_probe.errors,
    )


# ---------------------------------------------------------------------------------------------
# Profiles


def profile_round(
    bench: Bench, args: argparse.Namespace, streams: int, log: Callable[[str], None]
) -> dict[str, Any] | None:
    """One gateway round at ``streams`` under py-spy; the top functions by own and total time."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        log("py-spy not found (pip install py-spy): no profile")
        return None
    load = Load(
        streams, args.duration, args.max_tokens, args.ttft_ms,
        itl_for(streams, args.itl_ms, args.max_rate),
    )  # fmt: skip
    out = args.logs / f"profile-{streams}.txt"
    length = load.stream_s * 2 + load.duration_s + 0.2 + streams / 2000
    command = [
        py_spy, "record", "--pid", str(bench.stack.pid("gateway")), "--rate", "250",
        "--nonblocking", "--format", "raw", "--output", str(out),
        "--duration", str(math.ceil(length)),
    ]  # fmt: skip
    spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    bench.round([bench.stack.gateway_port], load, count_connections=False)
    spy.wait(timeout=60)
    if not out.exists():
        log(f"py-spy wrote no profile for x{streams}")
        return None
    return summarize_profile(out.read_text())


def _frame_name(frame: str) -> str:
    # "function (path/to/module.py:123)" -> "function (module.py)"
    name, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    parts = path.split("/")
    short = "/".join(parts[-2:]) if len(parts) > 1 else path
    return f"{name} ({short})"


def summarize_profile(raw: str, top: int = 15) -> dict[str, Any]:
    """Own and total shares of the samples, by function, from py-spy's collapsed stacks."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = [_frame_name(f) for f in stack.split(";")]
        if frames and frames[0].startswith("process "):
            frames = frames[1:]
        frames = [f for f in frames if not f.startswith("thread ")]
        if not frames:
            continue
        samples += count
        own[frames[-1]] += count
        for name in set(frames):
            total[name] += count
    return {
        "samples": samples,
        "own": [(name, n / samples) for name, n in own.most_common(top)] if samples else [],
        "total": [(name, n / samples) for name, n in total.most_common(top * 2)] if samples else [],
    }


# ---------------------------------------------------------------------------------------------
# Report


def _fmt(value: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.{digits}f}"


def table(cells: dict[tuple[Mode, int], Cell]) -> str:
    """The results as a markdown table, direct beside the gateway."""
    lines = [
        "| streams | path | TTFT p50 ms | TTFT p99 ms | added p50 / p99 ms | ITL p50 ms "
        "| ITL p99 ms | events/s | of direct | CPU per event | ok/sent |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (mode, conc), cell in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        direct = cells.get(("direct", conc))
        if mode != "direct" and direct is not None:
            added = (
                f"{cell.ms(cell.ttft_s, 50) - direct.ms(direct.ttft_s, 50):+.2f} / "
                f"{cell.ms(cell.ttft_s, 99) - direct.ms(direct.ttft_s, 99):+.2f}"
            )
            share = f"{100 * cell.events_per_s / direct.events_per_s:.1f}%"
            cpu = f"{_fmt(cell.cpu_us_per_event, 1)} µs"
        else:
            added, share, cpu = "–", "100%" if mode == "direct" else "–", "–"
        lines.append(
            f"| {conc} | {mode} | {_fmt(cell.ms(cell.ttft_s, 50))} | "
            f"{_fmt(cell.ms(cell.ttft_s, 99))} | {added} | {_fmt(cell.ms(cell.itl_s, 50))} | "
            f"{_fmt(cell.ms(cell.itl_s, 99))} | {_fmt(cell.events_per_s, 0)} | {share} | {cpu} | "
            f"{cell.ok}/{cell.sent} |"
        )
    return "\n".join(lines)


def process_table(cells: dict[tuple[Mode, int], Cell]) -> str:
    """Per part: CPU use in % of one core, and the workers' new connections per stream.

    The machine has two cores (200%). "others" is what the machine spent beyond this benchmark's
    processes: other people's work on a shared machine.
    """
    lines = [
        "| streams | worker ITL ms | path | clients % (busiest) | workers % (busiest) "
        "| gateway % | machine % | others % | worker conns / stream |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (mode, conc), cell in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        used = cell.cpu_percent()
        clients = [v for k, v in used.items() if k.startswith("client")]
        workers = [v for k, v in used.items() if k.startswith("worker")]
        relays = sum(
            v for k, v in used.items() if k.startswith("gateway") or k in (REFERENCE, FLOOR)
        )
        ours = sum(clients) + sum(workers) + relays + used.get("bench", 0.0)
        machine = used.get("machine", math.nan)
        per_stream = cell.worker_connections / cell.sent if cell.sent else math.nan
        lines.append(
            f"| {conc} | {cell.itl_ms:g} | {mode} | {_fmt(sum(clients), 0)} "
            f"({_fmt(max(clients, default=math.nan), 0)}) | {_fmt(sum(workers), 0)} "
            f"({_fmt(max(workers, default=math.nan), 0)}) | "
            f"{_fmt(used[mode], 0) if mode in used else '–'} | {_fmt(machine, 0)} | "
            f"{_fmt(max(0.0, machine - ours), 0)} | {_fmt(per_stream, 3)} |"
        )
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
        return f"{verdict}  {self.name:<40} {self.text:>16}   (target {self.target})"


def checks(
    cells: dict[tuple[Mode, int], Cell], concurrencies: Sequence[int], tokens: int
) -> list[Check]:
    """Gateway against direct and the references, for every target of issue 66.

    Ratios within this run: CPU per event against the minimal Python relay (:data:`FLOOR`) and
    vllm-router, added TTFT p99 against the router's.
    """
    out: list[Check] = []
    for conc in concurrencies:
        direct, gw = cells["direct", conc], cells["gateway", conc]
        floor, router = cells.get((FLOOR, conc)), cells.get((REFERENCE, conc))
        added = gw.ms(gw.ttft_s, 50) - direct.ms(direct.ttft_s, 50)
        if conc == 1:
            limit = ADDED_TTFT_P50_MS
            out.append(Check(f"added TTFT p50 @ {conc}", added, f"<= {limit:g} ms",
                             added <= limit, f"{added:+.3f} ms"))  # fmt: skip
        added99 = gw.ms(gw.ttft_s, 99) - direct.ms(direct.ttft_s, 99)
        if router is not None:
            theirs = router.ms(router.ttft_s, 99) - direct.ms(direct.ttft_s, 99)
            out.append(Check(f"added TTFT p99 gateway - {REFERENCE} @ {conc}", added99 - theirs,
                             "<= 0 ms", added99 <= theirs,
                             f"{added99:+.2f} vs {theirs:+.2f} ms"))  # fmt: skip
        ratio = gw.ms(gw.itl_s, 50) / direct.ms(direct.itl_s, 50)
        out.append(Check(f"ITL p50 gateway/direct @ {conc}", ratio,
                         f"within {ITL_P50_TOLERANCE:.0%}", abs(ratio - 1) <= ITL_P50_TOLERANCE,
                         f"{ratio:.3f}"))  # fmt: skip
        rate = gw.events_per_s / direct.events_per_s
        if conc >= 128:
            out.append(Check(f"event rate gateway/direct @ {conc}", rate,
                             f">= {RATE_MIN_RATIO:.0%}", rate >= RATE_MIN_RATIO,
                             f"{rate:.3f}"))  # fmt: skip
        if conc >= 32:
            cpu = gw.cpu_us_per_event
            for name, ref, most in ((FLOOR, floor, CPU_OF_FLOOR_RATIO),
                                    (REFERENCE, router, CPU_OF_REFERENCE_RATIO)):  # fmt: skip
                if ref is None:
                    continue
                times = cpu / ref.cpu_us_per_event
                out.append(Check(f"CPU per event gateway/{name} @ {conc}", times,
                                 f"<= {most:.2f}x", times <= most,
                                 f"{cpu:.1f}/{ref.cpu_us_per_event:.1f} µs"))  # fmt: skip
        same = set(gw.content_per_stream) == set(direct.content_per_stream) == {tokens}
        whole = gw.max_content_per_http_chunk == 1
        seen = "/".join(str(k) for k in sorted(gw.content_per_stream)) or "none"
        out.append(Check(f"events per stream, 1 per chunk @ {conc}", float(same and whole),
                         f"all {tokens}, unmerged", same and whole,
                         f"{seen}, max {gw.max_content_per_http_chunk}"))  # fmt: skip
    flat = [cells["gateway", c].cpu_us_per_event for c in concurrencies if c >= 32]
    if len(flat) >= 2:
        ratio = max(flat) / min(flat)
        out.append(Check(f"CPU per event flat, {min(c for c in concurrencies if c >= 32)}-"
                         f"{max(concurrencies)} streams", ratio,
                         f"max/min <= {CPU_FLAT_RATIO:g}", ratio <= CPU_FLAT_RATIO,
                         f"{ratio:.2f}"))  # fmt: skip
    return out


def memory_table(mem: MemoryResult) -> str:
    """The many-streams run as a markdown table."""
    return "\n".join(
        [
            "| streams | running | gateway RSS idle | RSS with streams | per stream "
            "| probe TTFT p50 / p99 via gateway | direct | gateway CPU | ok/sent |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| {mem.streams:,} | {mem.running_at_sample:,} | {mem.rss_idle_mib:.0f} MiB | "
            f"{mem.rss_loaded_mib:.0f} MiB | {mem.per_stream_kib:.1f} KiB | "
            f"{_fmt(mem.probe_gateway_ms['p50'])} / {_fmt(mem.probe_gateway_ms['p99'])} ms | "
            f"{_fmt(mem.probe_direct_ms['p50'])} / {_fmt(mem.probe_direct_ms['p99'])} ms | "
            f"{mem.gateway_cpu_percent:.0f}% | {mem.streams_ok:,}/{mem.streams_sent:,} |",
        ]
        + (
            [
                "",
                f"{mem.asked:,} streams were asked for: one process with this machine's limit of "
                f"{mem.nofile_soft:,} descriptors holds {mem.streams:,} beside the probes.",
            ]
            if mem.streams < mem.asked
            else []
        )
    )


def memory_checks(mem: MemoryResult) -> list[Check]:
    """The many-streams targets (at 10,000 streams)."""
    p99 = mem.probe_gateway_ms["p99"]
    return [
        Check(f"RSS with {mem.streams:,} streams", mem.rss_loaded_mib,
              f"< {MEMORY_RSS_MAX_MIB:g} MiB", mem.rss_loaded_mib < MEMORY_RSS_MAX_MIB,
              f"{mem.rss_loaded_mib:.0f} MiB"),
        Check(f"probe TTFT p99 with {mem.streams:,} streams", p99,
              f"< {MEMORY_PROBE_P99_MS:g} ms", p99 < MEMORY_PROBE_P99_MS, f"{p99:.1f} ms"),
        Check(f"all {mem.streams:,} streams served", float(mem.streams_ok),
              # The workers' count includes the probes running at that moment.
              f"{mem.streams:,} ok", mem.streams_ok == mem.streams <= mem.running_at_sample,
              f"{mem.streams_ok:,} ok, {mem.running_at_sample:,} ran"),
    ]  # fmt: skip


def profile_text(streams: int, prof: dict[str, Any]) -> str:
    """A profile's top functions as a markdown table."""
    lines = [
        f"Gateway profile at {streams} streams ({prof['samples']} samples):",
        "",
        "| own % | function | | total % | function |",
        "|---:|---|---|---:|---|",
    ]
    rows = max(len(prof["own"]), 15)
    for i in range(rows):
        own = prof["own"][i] if i < len(prof["own"]) else ("", math.nan)
        tot = prof["total"][i] if i < len(prof["total"]) else ("", math.nan)
        lines.append(
            f"| {_fmt(100 * own[1], 1)} | {own[0]} | | {_fmt(100 * tot[1], 1)} | {tot[0]} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Entry point


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.overhead", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--concurrency", default="1,32,128,512,1024",
                        help="comma-separated concurrent stream counts")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2, help="direct/gateway alternations")
    parser.add_argument(
        "--duration",
        type=float,
        default=3.0,
        help="seconds each round sends new streams after all have started",
    )
    parser.add_argument(
        "--duration-single",
        type=float,
        default=5.0,
        help="the same at 1 stream (TTFT percentiles need samples)",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ttft-ms", type=float, default=20.0, help="the fake workers' TTFT")
    parser.add_argument("--itl-ms", type=float, default=10.0, help="the fake workers' ITL")
    parser.add_argument(
        "--max-rate",
        type=float,
        default=12800.0,
        help="tokens/s of all streams together; above it each stream is slowed (0: never)",
    )
    parser.add_argument("--workers", type=int, default=4, help="fake worker processes")
    parser.add_argument("--clients", type=int, default=2, help="load client processes")
    parser.add_argument(
        "--memory-streams",
        type=int,
        default=10000,
        help="streams at 1 token/s for the memory run (0: skip it)",
    )
    parser.add_argument("--memory-only", action="store_true", help="only the memory run")
    parser.add_argument("--memory-probe-s", type=float, default=10.0)
    parser.add_argument(
        "--connect-rate",
        type=float,
        default=2000.0,
        help="new streams per second in the memory run",
    )
    parser.add_argument(
        "--profile",
        default="",
        help="comma-separated stream counts to profile the gateway at (py-spy)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "overhead.json")
    parser.add_argument(
        "--logs",
        type=Path,
        default=ROOT / "bench" / "results" / "logs",
        help="where the workers' and gateway's output goes",
    )
    parser.add_argument(
        "--gateway-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment for the gateway (repeatable)",
    )
    parser.add_argument(
        "--b-ref",
        default="",
        help="also run a second gateway (gateway-b) from this git commit, "
        "alternating with the others: an A/B in one run",
    )
    parser.add_argument(
        "--b-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also run gateway-b with this extra environment (repeatable)",
    )
    parser.add_argument(
        "--reference",
        default="auto",
        help="vllm-router executable measured beside the gateway as the reference "
        "(auto: .venv-router's, from scripts/install_router.sh, when present; none: skip)",
    )
    parser.add_argument(
        "--no-per-request", action="store_true", help="skip the CPU-per-request rounds"
    )
    parser.add_argument(
        "--no-floor", action="store_true", help=f"skip the minimal Python relay ({FLOOR})"
    )
    parser.add_argument("--direct-only", action="store_true",
                        help="measure the workers alone (no gateway)")  # fmt: skip
    args = parser.parse_args(argv)
    for item in args.gateway_env + args.b_env:
        if "=" not in item:
            parser.error(f"--gateway-env wants NAME=VALUE, got {item!r}")
    return args


def _export(ref: str, logs: Path) -> Path:
    """The tree of git commit ``ref``, extracted next to the logs (for gateway-b).

    Its modules are compiled as ``make install`` compiles the working tree's, where that commit
    has ``scripts/compile.py``: an A/B must not set compiled code against interpreted.
    """
    dest = logs / f"tree-{ref.replace('/', '_')}"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", ref, "app", "scripts", "pyproject.toml"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref, *listed], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    if (dest / "scripts" / "compile.py").exists():
        subprocess.run(
            [sys.executable, "-m", "scripts.compile"], cwd=dest, check=True,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
    return dest


def _reference(option: str) -> Path | None:
    """The reference router's executable that ``--reference`` names, if it is there."""
    if option == "none":
        return None
    path = REFERENCE_BIN if option == "auto" else Path(option)
    if os.access(path, os.X_OK):
        return path
    _log(f"no {REFERENCE} at {path} (scripts/install_router.sh installs it): measuring without")
    return None


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _sigterm(signum: int, frame: FrameType | None) -> None:
    # Unwind normally so that the stack's __exit__ stops the subprocesses.
    raise KeyboardInterrupt


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
    gateway_env = {
        # Enough for the largest load on every worker: admission runs, and queues nothing.
        "GATEWAY_MAX_RUNNING_PER_WORKER": str(max(256, max(concurrencies))),
        "GATEWAY_LOG_LEVEL": "warning",
    } | dict(item.split("=", 1) for item in args.gateway_env)
    b_env = dict(item.split("=", 1) for item in args.b_env)
    b_root = _export(args.b_ref, args.logs) if args.b_ref else None
    reference = _reference(args.reference) if gateway else None
    started = time.time()
    load_before = _loadavg()
    cells: dict[tuple[Mode, int], Cell] = {}
    profiles: dict[int, dict[str, Any]] = {}
    mem: MemoryResult | None = None
    costs: dict[Mode, float] = {}
    try:
        if not args.memory_only:
            _log(f"starting {args.workers} fake worker(s){' and the gateway' if gateway else ''}")
            with (
                Stack(
                    workers=args.workers, gateway=gateway, logdir=args.logs,
                    gateway_env=gateway_env, log=_log, max_num_seqs=max(1024, *concurrencies),
                    nofile=4 * max(concurrencies) + 1024, b_root=b_root, b_env=b_env,
                    reference=reference, floor=gateway and not args.no_floor,
                ) as stack,
                contextlib.closing(ClientPool(args.clients)) as clients,
            ):  # fmt: skip
                bench = Bench(stack, clients)
                targets: dict[Mode, list[int]] = {"direct": stack.worker_ports}
                for name, port in stack.gateway_ports.items():
                    targets[name] = [port]
                _log(f"targets: {targets}; measuring")
                cells = measure(bench, targets, args, concurrencies, _log)
                if gateway and not args.no_per_request:
                    costs = per_request(bench, targets, args, _log)
                for conc in [int(c) for c in args.profile.split(",") if c.strip()]:
                    if gateway:
                        prof = profile_round(bench, args, conc, _log)
                        if prof is not None:
                            profiles[conc] = prof
        if gateway and args.memory_streams > 0:
            mem = memory_run(args, _log)
    except RuntimeError as exc:
        _log(f"FAILED: {exc}")
        return None
    summary: list[Check] = []
    if cells:
        print()
        print(f"## Gateway overhead ({'via gateway' if gateway else 'direct only'})")
        print()
        print(
            f"fake workers: {args.workers}, TTFT {args.ttft_ms:g} ms, ITL {args.itl_ms:g} ms "
            f"(slowed above {args.max_rate:,.0f} tokens/s in all), max_tokens {args.max_tokens}; "
            f"{args.clients} client processes; {args.rounds} ABBA rounds of {args.duration:g} s "
            f"({args.duration_single:g} s at 1 stream); {os.cpu_count()} CPUs, 1-min load "
            f"average {_fmt(load_before)} before, {_fmt(_loadavg())} after"
        )
        print()
        print(table(cells))
        print()
        print(process_table(cells))
        print()
        if costs:
            print(
                f"CPU per request ({PER_REQUEST_TOKENS}-token answers, {PER_REQUEST_STREAMS} "
                "streams): " + ", ".join(f"{mode} {_fmt(us, 0)} µs" for mode, us in costs.items())
            )
            print()
        if gateway:
            summary = checks(cells, concurrencies, args.max_tokens) + per_request_checks(costs)
    if mem is not None:
        print(memory_table(mem))
        print()
        summary += memory_checks(mem)
    if summary:
        print("```")
        for check in summary:
            print(check.line())
        print("```")
    for conc, prof in profiles.items():
        print()
        print(profile_text(conc, prof))
    for cell in cells.values():
        if cell.errors:
            _log(f"{cell.mode} x{cell.streams} errors: {cell.errors}")
    if mem is not None and mem.errors:
        _log(f"memory run errors: {mem.errors}")
    return {
        "benchmark": "gateway_overhead",
        "mode": "gateway" if gateway else "direct_only",
        "started_at": started,
        "duration_s": time.time() - started,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "environment": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            # Other work on a shared machine shows up here, and in the numbers.
            "loadavg_1min_before": load_before,
            "loadavg_1min_after": _loadavg(),
        },
        "cells": [cell.to_json() for cell in cells.values()],
        "cpu_us_per_request": costs,
        "memory": None
        if mem is None
        else {
            "streams": mem.streams,
            "streams_asked": mem.asked,
            "running": mem.running_at_sample,
            "rss_idle_mib": mem.rss_idle_mib,
            "rss_loaded_mib": mem.rss_loaded_mib,
            "per_stream_kib": mem.per_stream_kib,
            "probe_gateway_ms": mem.probe_gateway_ms,
            "probe_direct_ms": mem.probe_direct_ms,
            "probes": mem.probes,
            "streams_ok": mem.streams_ok,
            "gateway_cpu_percent": mem.gateway_cpu_percent,
            "gateway_nofile_soft": mem.nofile_soft,
            "errors": mem.errors,
        },
        "profiles": profiles,
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
    if isinstance(value, list | tuple):
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

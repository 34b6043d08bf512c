"""How many processes ``GATEWAY_PROCESSES`` asks for, and the supervisor that runs them."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from app.settings import Settings
from app.supervisor import STARTUP_FAILED, Supervisor, bind, process_count


def test_auto_is_one_per_core_within_the_containers_cpu_limit(tmp_path: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    limit = tmp_path / "cpu.max"
    limit.write_text("max 100000\n")  # no limit: every core this process may run on
    assert process_count("auto", limit, tmp_path) == cores
    limit.write_text("50000 100000\n")  # half a CPU: one process
    assert process_count("auto", limit) == 1
    limit.write_text(f"{cores * 4 * 100000} 100000\n")  # more CPU than cores: the cores
    assert process_count("auto", limit) == cores
    absent = tmp_path / "absent"
    assert process_count("auto", absent, absent) == cores  # no cgroup
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")  # cgroup v1, no limit
    assert process_count("auto", absent, v1) == cores
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")  # cgroup v1, half a CPU
    assert process_count("auto", absent, v1) == 1
    assert process_count(3, limit) == 3


def test_processes_must_be_a_count_or_auto() -> None:
    assert Settings(workers="http://a:1", processes="auto").processes == "auto"
    assert Settings(workers="http://a:1", processes="4").processes == 4
    for wrong in ("0", "many"):
        with pytest.raises(ValueError, match="processes"):
            Settings(workers="http://a:1", processes=wrong)


# The supervisor itself, with small children of the tests' own (the gateway's children are
# exercised by tests/test_scale_out.py).


def _answer_pid(sock: socket.socket) -> None:
    """A child: answer each connection with its pid; drain on SIGTERM, stop on a second."""
    terms = 0

    def on_term(signum: int, frame: object) -> None:
        nonlocal terms
        terms += 1
        if terms >= 2:
            os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    sock.listen(16)
    while True:
        try:
            conn, _ = sock.accept()
        except InterruptedError:
            continue
        with conn:
            conn.sendall(f"{os.getpid()} {terms}".encode())


def _fail_to_start(sock: socket.socket) -> None:
    os._exit(STARTUP_FAILED)


def _ask(port: int) -> tuple[int, int]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        pid, terms = conn.recv(64).decode().split()
    return int(pid), int(terms)


def _until(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_children_serve_one_port_and_one_killed_is_replaced(tmp_path: Path) -> None:
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    supervisor = Supervisor(_answer_pid, sock, 2, str(tmp_path), check_s=0.05)
    codes: list[int] = []
    runner = threading.Thread(target=lambda: codes.append(supervisor.run()))
    runner.start()
    try:
        _until(lambda: len(supervisor.children) == 2 and _answers(port))
        first = {c.pid for c in supervisor.children}
        assert _ask(port)[0] in first
        victim = supervisor.children[0].pid
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        _until(lambda: victim not in {c.pid for c in supervisor.children})
        now = {c.pid for c in supervisor.children}
        assert len(now) == 2
        assert victim not in now
        assert (first - {victim}) <= now
        # The port stays served throughout: the replacement listens on the same socket.
        _until(lambda: _ask(port)[0] in now)
    finally:
        _stop(supervisor, runner)
        sock.close()
    assert codes == [0]
    assert all(c.exitcode is not None for c in supervisor.children)


def _stop(supervisor: Supervisor, runner: threading.Thread) -> None:
    # Two signals sent at once may arrive as one: send until the children are gone.
    deadline = time.monotonic() + 30
    while runner.is_alive() and time.monotonic() < deadline:
        supervisor.stop()
        runner.join(0.5)


def test_sigterm_is_passed_on_each_time_first_to_drain_then_to_stop() -> None:
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    supervisor = Supervisor(_answer_pid, sock, 1, check_s=0.05)
    codes: list[int] = []
    runner = threading.Thread(target=lambda: codes.append(supervisor.run()))
    runner.start()
    try:
        _until(lambda: bool(supervisor.children) and _answers(port))
        supervisor.stop()
        # Drained, not gone: the child saw one SIGTERM and still answers; not replaced.
        _until(lambda: _ask(port)[1] == 1)
        [child] = supervisor.children
        assert child.is_alive()
        supervisor.stop()
        runner.join(30)
    finally:
        _stop(supervisor, runner)
        sock.close()
    assert codes == [0]
    assert child.exitcode == 0


def _answers(port: int) -> bool:
    try:
        _ask(port)
    except OSError:
        return False
    return True


def test_a_child_that_cannot_start_stops_the_supervisor() -> None:
    sock = bind("127.0.0.1", 0)
    supervisor = Supervisor(_fail_to_start, sock, 2, check_s=0.05)
    try:
        assert supervisor.run() == STARTUP_FAILED
    finally:
        sock.close()
    assert supervisor.failed
    assert all(c.exitcode is not None for c in supervisor.children)

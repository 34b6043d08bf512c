"""Several gateway processes on one port (``GATEWAY_PROCESSES``): the gateway's own supervisor.

One Python process uses one core. The supervisor binds the listening socket once and hands it
to every child (spawned, not forked: a child starts from a clean interpreter, with no loop or
thread of the parent's), checks every half second that each child is alive and replaces one
that died. A child that ends before its server started (its app or its settings are broken)
stops them all, since every replacement would fail the same way. Each child runs exactly what
``python -m app`` runs with one process (:func:`app.gateway.build_server`): the gateway's own
server, with its drain on SIGTERM, its garbage-collection policy and its protocol class, so a
rollout drains every process. SIGTERM or SIGINT to the supervisor is passed on to every child
(the first starts each child's drain, a second stops it at once) and the supervisor waits for
them; SIGHUP, SIGTTIN and SIGTTOU are ignored (restart the pod, or change the setting).

The children share one ``/metrics``: the supervisor makes a private temporary directory for
prometheus_client's multiprocess mode (:mod:`app.observe.metrics`), hands it to the children in
``PROMETHEUS_MULTIPROC_DIR``, drops a dead child's live gauges and removes the directory when
it exits. A dead child's counts stay in the pod's totals. What else the processes share (key
limits, requests in flight, arrivals) goes through Redis (:mod:`app.admission.shared`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import signal
import socket
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.context import SpawnProcess
from pathlib import Path
from types import FrameType

from prometheus_client.multiprocess import mark_process_dead

from app.gateway import build_server, configure_logging
from app.observe.metrics import MULTIPROCESS_DIR
from app.settings import Settings

log = logging.getLogger(__name__)

STARTUP_FAILED = 3
"""A child's exit code when its server never started (its app or settings are broken)."""


_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = Path("/sys/fs/cgroup/cpu")


def process_count(
    setting: int | str, cgroup: Path = _CGROUP_V2, cgroup_v1: Path = _CGROUP_V1
) -> int:
    """How many processes ``GATEWAY_PROCESSES`` asks for: ``auto`` is one per core.

    The cores this process may run on, and no more than its container's CPU limit (cgroup v2
    ``cpu.max``, or v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``, rounded up): a pod
    limited to 2 CPUs on a 64-core node gets 2.
    """
    if setting != "auto":
        return int(setting)
    cores = len(os.sched_getaffinity(0))
    quota = _cpu_quota(cgroup, cgroup_v1)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def _cpu_quota(cgroup: Path, cgroup_v1: Path) -> float | None:
    """The container's CPU limit in CPUs, if it has one."""
    try:
        quota, period = cgroup.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((cgroup_v1 / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup_v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def bind(host: str, port: int) -> socket.socket:
    """The listening socket every child serves from, bound (each child's server listens on it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve_child(sock: socket.socket) -> None:
    """One child: the gateway's server, built from the environment, on the supervisor's socket.

    Ends with :data:`STARTUP_FAILED` when the server never started.
    """
    settings = Settings()
    configure_logging(settings, processes=True)
    server = build_server(settings)
    try:
        server.run(sockets=[sock])
    except Exception:
        log.exception("the gateway's server failed")
    finally:
        if not server.started:
            # What stopped it (uvicorn exits on a failed lifespan) was logged already.
            os._exit(STARTUP_FAILED)


class Supervisor:
    """``processes`` children running ``target(sock)``, kept alive until :meth:`stop`.

    Rules: a child that died is replaced, its live gauges dropped from ``metrics_dir``; a child
    that exited with :data:`STARTUP_FAILED` stops the supervisor; :meth:`stop` passes SIGTERM
    to every child each time it is called (the gateway drains on the first, stops on the
    second), and :meth:`run` returns once every child has exited.
    """

    def __init__(
        self,
        target: Callable[[socket.socket], None],
        sock: socket.socket,
        processes: int,
        metrics_dir: str | None = None,
        check_s: float = 0.5,
    ) -> None:
        self._target = target
        self._sock = sock
        self._count = processes
        self._metrics_dir = metrics_dir
        self._check_s = check_s
        self._context = multiprocessing.get_context("spawn")
        self._stopping = threading.Event()
        self.children: list[SpawnProcess] = []
        """The children running now (replaced ones are dropped)."""
        self.failed = False
        """Whether a child failed to start (and so the supervisor stopped)."""

    def _spawn(self) -> SpawnProcess:
        child = self._context.Process(target=self._target, args=(self._sock,), daemon=False)
        child.start()
        return child

    def run(self) -> int:
        """Start the children, keep them alive until stopped; 0, or :data:`STARTUP_FAILED`."""
        self.children = [self._spawn() for _ in range(self._count)]
        while not self._stopping.wait(self._check_s):
            self._keep_alive()
        for child in self.children:
            child.join()
        return STARTUP_FAILED if self.failed else 0

    def _keep_alive(self) -> None:
        for index, child in enumerate(self.children):
            if child.is_alive() or self._stopping.is_set():
                continue
            child.join()
            if self._metrics_dir is not None and child.pid is not None:
                mark_process_dead(child.pid, self._metrics_dir)  # type: ignore[no-untyped-call]
            if child.exitcode == STARTUP_FAILED:
                log.error("gateway process %s failed to start: stopping", child.pid)
                self.failed = True
                self._signal_all()
                self._stopping.set()
                return
            log.warning(
                "gateway process %s ended (exit code %s): starting another",
                child.pid, child.exitcode,
            )  # fmt: skip
            self.children[index] = self._spawn()

    def stop(self) -> None:
        """Stop keeping the children alive and pass SIGTERM to each one still running."""
        self._stopping.set()
        self._signal_all()

    def _signal_all(self) -> None:
        for child in self.children:
            if child.pid is not None and child.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGTERM)


def supervise(settings: Settings, processes: int) -> int:
    """Serve ``settings``' port from ``processes`` gateway processes until a signal ends them.

    Returns the exit code: 0, or :data:`STARTUP_FAILED` when a child could not start.
    """
    with tempfile.TemporaryDirectory(prefix="gateway-metrics-") as metrics_dir:
        # Read by prometheus_client when a child imports it: children spawned from now on
        # write their samples there.
        os.environ[MULTIPROCESS_DIR] = metrics_dir
        sock = bind(settings.host, settings.port)
        supervisor = Supervisor(serve_child, sock, processes, metrics_dir)

        def on_stop(signum: int, frame: FrameType | None) -> None:
            log.info("%s: stopping the gateway processes", signal.Signals(signum).name)
            # Called between two bytecodes of the main thread, which may be inside Event.wait
            # holding the lock Event.set takes: set it from another thread.
            threading.Thread(target=supervisor.stop, daemon=True).start()

        def on_ignored(signum: int, frame: FrameType | None) -> None:
            log.warning(
                "%s ignored: restart the pod, or set GATEWAY_PROCESSES to change the processes",
                signal.Signals(signum).name,
            )

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, on_stop)
        for signum in (signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU):
            signal.signal(signum, on_ignored)
        log.info("serving from %d gateway processes", processes)
        try:
            return supervisor.run()
        finally:
            sock.close()
            os.environ.pop(MULTIPROCESS_DIR, None)

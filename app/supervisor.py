"""Several gateway processes on one port (``GATEWAY_PROCESSES``): uvicorn's supervisor.

One Python process uses one core. uvicorn's own multiprocess supervisor binds the listening
socket once and hands it to every child (spawned, not forked), pings each child every half
second and replaces one that died or stopped answering; SIGTERM or SIGINT to the supervisor
sends SIGTERM to every child and waits for them. Here each child runs exactly what
``python -m app`` runs with one process (:func:`app.gateway.build_server`): the gateway's own
server, with its drain on SIGTERM, its garbage-collection policy and its protocol class, so a
rollout drains every process.

The children share one ``/metrics``: the supervisor makes a private temporary directory for
prometheus_client's multiprocess mode (:mod:`app.observe.metrics`), hands it to the children in
``PROMETHEUS_MULTIPROC_DIR``, drops a dead child's live gauges and removes the directory when
it exits. A dead child's counts stay in the pod's totals. What else the processes share (key
limits, requests in flight, arrivals) goes through Redis (:mod:`app.admission.shared`).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import tempfile
from pathlib import Path

import uvicorn
from prometheus_client.multiprocess import mark_process_dead
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors.multiprocess import Multiprocess, Process

from app.gateway import build_server, configure_logging
from app.observe.metrics import MULTIPROCESS_DIR
from app.settings import Settings

log = logging.getLogger(__name__)


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


class GatewayProcess(Process):
    """One child: the gateway's own server, built in the child from its environment."""

    @property
    def server(self) -> uvicorn.Server:
        """The child's :class:`app.http.server.GatewayServer` (built on first use, in the child)."""
        if self._server is None:
            settings = Settings()
            configure_logging(settings, processes=True)
            self._server = build_server(settings)
        return self._server

    def target(self, sockets: list[socket.socket] | None = None) -> None:
        """Run the server (in the child) on the supervisor's socket."""
        # Built before the health-check thread that uvicorn starts may ask for it.
        _ = self.server
        super().target(sockets)


class GatewaySupervisor(Multiprocess):
    """uvicorn's :class:`~uvicorn.supervisors.multiprocess.Multiprocess` with gateway children.

    Of uvicorn's signals, SIGHUP (restart every child) and SIGTTIN/SIGTTOU (one more or one
    fewer) are ignored: restart the pod, or change ``GATEWAY_PROCESSES``.
    """

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket], metrics_dir: str):
        super().__init__(config, sockets)
        self._metrics_dir = metrics_dir

    def _spawn(self) -> GatewayProcess:
        process = GatewayProcess(self.config, self.sockets)
        process.start()
        return process

    def init_processes(self) -> None:
        """Start the children."""
        for _ in range(self.processes_num):
            self.processes.append(self._spawn())

    def keep_subprocess_alive(self) -> None:
        """Replace a child that died or stopped answering (uvicorn's, with gateway children)."""
        if self.should_exit.is_set():
            return
        for index, process in enumerate(self.processes):
            if process.is_alive(timeout=self.config.timeout_worker_healthcheck):
                continue
            process.kill()  # it may hang rather than be dead
            process.join()
            if process.pid is not None:
                mark_process_dead(process.pid, self._metrics_dir)  # type: ignore[no-untyped-call]
            if process.exitcode == STARTUP_FAILURE:
                # Its app or settings are broken: every replacement would fail the same way.
                log.error("gateway process %s failed to start: stopping", process.pid)
                self.should_exit.set()
                return
            if self.should_exit.is_set():
                return
            log.warning(
                "gateway process %s ended (exit code %s): starting another",
                process.pid, process.exitcode,
            )  # fmt: skip
            self.processes[index] = self._spawn()

    def handle_hup(self) -> None:
        """Ignored (see the class)."""
        log.warning("SIGHUP ignored: restart the pod to restart the gateway's processes")

    def handle_ttin(self) -> None:
        """Ignored (see the class)."""
        log.warning("SIGTTIN ignored: set GATEWAY_PROCESSES to change the number of processes")

    def handle_ttou(self) -> None:
        """Ignored (see the class)."""
        self.handle_ttin()


def supervise(settings: Settings, processes: int) -> None:
    """Serve ``settings``' port from ``processes`` gateway processes until a signal ends them."""
    with tempfile.TemporaryDirectory(prefix="gateway-metrics-") as metrics_dir:
        # Read by prometheus_client when a child imports it: children spawned from now on
        # write their samples there.
        os.environ[MULTIPROCESS_DIR] = metrics_dir
        config = uvicorn.Config(
            "app.main:main",  # never loaded here: each child builds its own app
            host=settings.host,
            port=settings.port,
            workers=processes,
            log_level=settings.log_level.lower(),
        )
        sock = config.bind_socket()
        log.info("serving from %d gateway processes", processes)
        try:
            GatewaySupervisor(config, [sock], metrics_dir).run()
        finally:
            sock.close()
            os.environ.pop(MULTIPROCESS_DIR, None)

"""A gateway "pod" for tests: ``python -m app`` with ``GATEWAY_PROCESSES`` processes.

Run as in production (the supervisor of :mod:`app.supervisor`), on a free port, with its log in
a file: the log says which process (pid) served each request, and the supervisor's children
are found through ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from scripts.processes import stop_process
from tests.servers import free_port

ROOT = Path(__file__).resolve().parent.parent
_ACCESS = re.compile(r"\[(\d+)\] app\.access: (\S+) \S+ .*? status=(\d+)")
_READY = re.compile(r"\[(\d+)\] app\.gateway: gateway ready")
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class Pod:
    """A running gateway of several processes."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        """Its log so far."""
        return self.log.read_text(errors="replace")

    def children(self) -> list[int]:
        """The gateway processes the supervisor runs now (not multiprocessing's helpers)."""
        pid = self.process.pid
        try:
            listed = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return []
        found = []
        for child in map(int, listed):
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.append(child)
        return found

    def ready(self) -> set[int]:
        """Processes that said they are ready (since the pod started)."""
        return {int(pid) for pid in _READY.findall(self.text())}

    def served(self, status: int | None = None) -> Counter[int]:
        """Requests each process logged (answered ``status``, if given)."""
        return Counter(
            int(pid)
            for pid, _, code in _ACCESS.findall(self.text())
            if status is None or int(code) == status
        )

    def served_by(self, request_id: str) -> int | None:
        """The process that logged the request ``request_id``."""
        for pid, rid, _ in _ACCESS.findall(self.text()):
            if rid == request_id:
                return int(pid)
        return None


def _answers(url: str) -> bool:
    try:
        with _NO_PROXY.open(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def running_pod(env: Mapping[str, str], log: Path, processes: int = 2) -> Iterator[Pod]:
    """The gateway with ``env`` (``GATEWAY_*``) from ``processes`` processes, for the block."""
    port = free_port()
    full = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    full.update(
        {
            "GATEWAY_HOST": "127.0.0.1",
            "GATEWAY_PORT": str(port),
            "GATEWAY_PROCESSES": str(processes),
            "GATEWAY_DRAIN_DELAY_S": "0",
            "GATEWAY_SHUTDOWN_GRACE_S": "5",
            "GATEWAY_DISCOVERY_INTERVAL_S": "0.5",
            **env,
        }
    )
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app"], cwd=ROOT, env=full, stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    pod = Pod(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + 60
        while len(pod.ready()) < processes or not _answers(f"{pod.url}/readyz"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start:\n{pod.text()[-3000:]}")
            time.sleep(0.1)
        yield pod
    finally:
        stop_process(proc, grace=20)

"""Stopping a child process: politely first, then for sure."""

from __future__ import annotations

import subprocess
from typing import Any


def stop_process(proc: subprocess.Popen[Any], grace: float = 20) -> None:
    """SIGTERM ``proc``; SIGKILL it if it is still running after ``grace`` seconds; reap it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

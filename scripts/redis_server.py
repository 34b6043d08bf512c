"""A real redis-server on a free port, in a directory of its own, for tests and benchmarks.

Installed by ``make redis`` (Debian's package; ``make test`` and ``make unit`` run it). Tests
kill, pause and restart it to see the gateway fall back and recover; the admission benchmark
shares it between its gateway processes (``--processes``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from scripts.processes import stop_process


class RedisServer:
    """One redis-server, no persistence, listening on 127.0.0.1 only."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run `make redis`")
        self._binary = binary
        self.directory = directory
        self.port = port or _free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Where the gateway finds it."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        """Start it and wait until it answers PING."""
        self.directory.mkdir(parents=True, exist_ok=True)
        log = (self.directory / "redis.log").open("ab")
        self._proc = subprocess.Popen(
            [
                self._binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.directory), "--save", "", "--appendonly", "no",
                "--protected-mode", "yes", "--daemonize", "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout
        while not self.ping():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.directory / "redis.log").read_text()[-2000:]
                raise RuntimeError(f"redis-server did not start:\n{tail}")
            time.sleep(0.02)

    def ping(self) -> bool:
        """Whether it answers PING now."""
        return self.command("PING") == b"+PONG"

    def command(self, *words: str) -> bytes | None:
        """Send one inline command; its reply's first line (None when nobody answers)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(" ".join(words).encode() + b"\r\n")
                return sock.recv(65536).split(b"\r\n", 1)[0]
        except OSError:
            return None

    def kill(self) -> None:
        """SIGKILL: gone at once, with everything it held."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing answers."""
        if self._proc is not None:
            os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self._proc is not None:
            os.kill(self._proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Stop it (politely, then for sure)."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self.resume()  # a paused server would not hear SIGTERM
            stop_process(self._proc, grace=5)
            self._proc = None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port

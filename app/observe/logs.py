"""Log lines written in batches while the event loop runs, whole lines per write.

With the access log on (the default), every request leaves a line, and writing each one as it
comes is a system call per request on the event loop's thread. :class:`BatchedLines` keeps the
lines the loop's own thread logs and writes them together a moment later (at most
``interval_s``), never holding back a warning or an error, nor what another thread logs: those
are written at once, after what was kept, so the order of the lines stays the order of the
records. Each write carries whole lines and at most ``PIPE_BUF`` bytes, so the lines of
several gateway processes sharing one pipe (a container's stderr) never interleave.

Batching runs only between :meth:`BatchedLines.batch` and its undo (the gateway's lifespan);
before and after, every line is written as it comes. A process killed outright loses what it
kept, at most ``interval_s`` of lines; a shutdown writes them.
"""

from __future__ import annotations

import asyncio
import logging
import select
import threading
from collections.abc import Callable
from typing import TextIO

PIPE_BUF = select.PIPE_BUF
"""The most bytes a write to a pipe puts there without interleaving (POSIX: 512 at least)."""


class BatchedLines(logging.StreamHandler[TextIO]):
    """A stream handler whose event-loop lines go to the stream in batches (see the module)."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self._lines: list[str] = []
        self._size = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0
        self._interval = 0.0
        self._pending: asyncio.TimerHandle | None = None

    def batch(self, loop: asyncio.AbstractEventLoop, interval_s: float) -> Callable[[], None]:
        """Keep the lines ``loop``'s thread logs for up to ``interval_s``; returns the undo.

        Called on ``loop``'s thread; the undo writes what is kept and ends the batching.
        """
        self.acquire()
        try:
            self._loop, self._thread, self._interval = loop, threading.get_ident(), interval_s
        finally:
            self.release()

        def undo() -> None:
            self.acquire()
            try:
                self._loop = None
                if self._pending is not None:
                    self._pending.cancel()
                    self._pending = None
            finally:
                self.release()
            self.flush()

        return undo

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the record's line, or write it (and what was kept) now."""
        try:
            line = self.format(record) + self.terminator
        except Exception:  # as logging.StreamHandler does: a bad record never raises
            self.handleError(record)
            return
        self._lines.append(line)
        self._size += len(line)
        loop = self._loop
        if (
            loop is None
            or record.levelno >= logging.WARNING
            or threading.get_ident() != self._thread
            or self._size >= 16 * PIPE_BUF
        ):
            self._write()
        elif self._pending is None:
            self._pending = loop.call_later(self._interval, self._due)

    def flush(self) -> None:
        """Write what is kept, then flush the stream (as :class:`logging.StreamHandler` does)."""
        self.acquire()
        try:
            self._write()
            if self.stream and hasattr(self.stream, "flush"):
                self.stream.flush()
        finally:
            self.release()

    def _due(self) -> None:
        self.acquire()
        try:
            self._pending = None
            self._write()
        finally:
            self.release()

    def _write(self) -> None:
        """Write the kept lines, whole, in writes of at most ``PIPE_BUF`` bytes (the lock held).

        A line longer than that is written alone (as it would have been without batching).
        """
        lines = self._lines
        if not lines:
            return
        self._lines, self._size = [], 0
        stream = self.stream
        try:
            chunk: list[str] = []
            size = 0
            for line in lines:
                # Lengths in characters: an access line is ASCII, and a write of a line longer
                # in bytes than counted here is only as atomic as it was without batching.
                if chunk and size + len(line) > PIPE_BUF:
                    stream.write("".join(chunk))
                    stream.flush()
                    chunk, size = [], 0
                chunk.append(line)
                size += len(line)
            stream.write("".join(chunk))
            stream.flush()
        except Exception:
            self.handleError(logging.makeLogRecord({"msg": "log lines lost", "args": ()}))

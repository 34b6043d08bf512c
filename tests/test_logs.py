"""Log lines in batches: kept on the loop's thread, written whole, in order, never lost."""

from __future__ import annotations

import asyncio
import io
import logging
import threading
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from app.gateway import configure_logging
from app.observe.logs import PIPE_BUF, BatchedLines
from app.settings import Settings
from tests.servers import running_gateway, settings_for


class Writes(io.StringIO):
    """A stream that remembers each write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


@pytest.fixture
def logger() -> Iterator[tuple[logging.Logger, BatchedLines, Writes]]:
    stream = Writes()
    handler = BatchedLines(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log = logging.getLogger(f"test_logs.{id(stream)}")
    log.propagate = False
    log.setLevel(logging.DEBUG)
    log.addHandler(handler)
    yield log, handler, stream
    log.removeHandler(handler)


@pytest.fixture
async def batching(
    logger: tuple[logging.Logger, BatchedLines, Writes],
) -> AsyncIterator[tuple[logging.Logger, BatchedLines, Writes]]:
    """The logger with batching on, and an interval no test waits for."""
    undo = logger[1].batch(asyncio.get_running_loop(), 60.0)
    yield logger
    undo()


def test_flush_flushes_the_stream_even_with_nothing_kept() -> None:
    stream = Writes()
    flushes: list[None] = []
    stream.flush = lambda: flushes.append(None)  # type: ignore[method-assign]
    BatchedLines(stream).flush()
    assert flushes == [None]


def test_without_batching_each_line_is_written_as_it_comes(
    logger: tuple[logging.Logger, BatchedLines, Writes],
) -> None:
    log, _, stream = logger
    log.info("one")
    assert stream.writes == ["INFO one\n"]
    log.info("two")
    assert stream.writes == ["INFO one\n", "INFO two\n"]


async def test_the_loops_lines_wait_for_the_interval_then_go_in_one_write(
    logger: tuple[logging.Logger, BatchedLines, Writes],
) -> None:
    log, handler, stream = logger
    undo = handler.batch(asyncio.get_running_loop(), 0.05)
    try:
        for n in range(5):
            log.info("line %d", n)
        assert stream.getvalue() == ""
        await asyncio.sleep(0.15)
        assert stream.writes == ["".join(f"INFO line {n}\n" for n in range(5))]
    finally:
        undo()


async def test_a_warning_goes_at_once_after_the_lines_before_it(
    batching: tuple[logging.Logger, BatchedLines, Writes],
) -> None:
    log, handler, stream = batching
    log.info("before")
    log.warning("trouble")
    assert stream.getvalue() == "INFO before\nWARNING trouble\n"
    log.info("after")
    assert stream.getvalue() == "INFO before\nWARNING trouble\n"
    handler.flush()
    assert stream.getvalue().endswith("INFO after\n")


async def test_another_threads_line_goes_at_once_in_order(
    batching: tuple[logging.Logger, BatchedLines, Writes],
) -> None:
    log, _, stream = batching
    log.info("loop")
    thread = threading.Thread(target=log.info, args=("helper",))
    thread.start()
    thread.join()
    assert stream.getvalue() == "INFO loop\nINFO helper\n"


async def test_undo_writes_what_was_kept_and_ends_the_batching(
    logger: tuple[logging.Logger, BatchedLines, Writes],
) -> None:
    log, handler, stream = logger
    undo = handler.batch(asyncio.get_running_loop(), 60.0)
    log.info("kept")
    undo()
    assert stream.getvalue() == "INFO kept\n"
    log.info("then")
    assert stream.getvalue() == "INFO kept\nINFO then\n"


async def test_writes_hold_whole_lines_within_pipe_buf(
    logger: tuple[logging.Logger, BatchedLines, Writes],
) -> None:
    log, handler, stream = logger
    lines = [f"request {n} " + "x" * (n % 300) for n in range(200)]
    undo = handler.batch(asyncio.get_running_loop(), 60.0)
    for line in lines:
        log.info(line)
    log.info("y" * (PIPE_BUF + 10))  # longer than a pipe's atomic write: alone
    handler.flush()
    undo()
    assert stream.getvalue() == "".join(f"INFO {line}\n" for line in lines) + (
        "INFO " + "y" * (PIPE_BUF + 10) + "\n"
    )
    assert len(stream.writes) > 1
    for write in stream.writes:
        assert write.endswith("\n")
        assert len(write) <= PIPE_BUF or write.count("\n") == 1


async def test_a_burst_is_written_before_it_grows_past_its_bound(
    batching: tuple[logging.Logger, BatchedLines, Writes],
) -> None:
    log, _, stream = batching
    for n in range(2_000):
        log.info("burst %d %s", n, "z" * 60)
    written = len(stream.getvalue())
    assert written > 0
    assert 2_000 * 70 - written < 16 * PIPE_BUF + 100


async def test_a_stream_that_fails_is_reported_not_raised(
    batching: tuple[logging.Logger, BatchedLines, Writes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log, handler, stream = batching
    reported: list[logging.LogRecord] = []
    monkeypatch.setattr(handler, "handleError", reported.append)

    def broken(text: str) -> int:
        raise OSError("the pipe's reader went away")

    monkeypatch.setattr(stream, "write", broken)
    log.info("kept")
    log.warning("written now")  # raises inside the handler only
    assert len(reported) == 1
    handler.flush()  # nothing kept any more
    assert len(reported) == 1


def test_configure_logging_batches_through_the_root_logger() -> None:
    root = logging.getLogger()
    before = (root.handlers[:], root.level)
    flags = (logging.logThreads, logging.logMultiprocessing, logging.logProcesses)
    try:
        configure_logging(Settings(workers="http://127.0.0.1:9"), processes=False)
        assert [type(h) for h in root.handlers] == [BatchedLines]
        assert not logging.logThreads
        assert not logging.logProcesses
        configure_logging(Settings(workers="http://127.0.0.1:9"), processes=True)
        assert logging.logProcesses  # the lines say which process
    finally:
        root.handlers[:] = before[0]
        root.setLevel(before[1])
        logging.logThreads, logging.logMultiprocessing, logging.logProcesses = flags


async def test_a_running_gateway_batches_its_access_lines_and_writes_them_at_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("app.gateway._LOG_BATCH_S", 60.0)  # nothing written but by the shutdown
    stream = Writes()
    handler = BatchedLines(stream)
    handler.setFormatter(logging.Formatter("%(name)s %(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        async with running_gateway(settings_for("http://127.0.0.1:9", access_log=True)) as url:
            async with httpx.AsyncClient() as client:
                for _ in range(3):
                    assert (await client.get(f"{url}/healthz")).status_code == 200
            # Answered, not written yet: the loop's lines wait for the batch.
            assert "healthz" not in stream.getvalue()
        # The shutdown wrote what was kept, the three lines in one write.
        written = [line for line in stream.getvalue().splitlines() if "healthz" in line]
        assert len(written) == 3
        assert all(line.startswith("app.access ") for line in written)
        assert len([w for w in stream.writes if "healthz" in w]) == 1
    finally:
        root.removeHandler(handler)
        root.setLevel(level)

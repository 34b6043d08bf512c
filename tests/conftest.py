"""Fixtures shared by the whole suite: one real vLLM CPU worker per test session.

Tests that use ``vllm_worker_url`` are marked ``worker`` automatically, so ``make unit``
(``pytest -m "not worker"``) runs without vLLM.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest

from scripts.compile import stale
from scripts.redis_server import RedisServer
from tests.servers import free_port
from tests.worker_watch import serving


def pytest_sessionstart(session: pytest.Session) -> None:
    """The suite tests what ships: the decision modules compiled, none older than its source.

    Python imports a module's extension before its source, so a source edited since
    ``make compile`` would go untested, the stale extension running in its place.
    """
    missing = stale()
    if missing:
        pytest.exit(
            "compiled modules missing or older than their sources (run `make compile`): "
            + ", ".join(missing),
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


@pytest.fixture(scope="session")
def vllm_worker_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A real vLLM CPU worker serving ``tiny-llama`` (or the one at ``$VLLM_WORKER_URL``).

    Started once per session (about a minute) and stopped, with every process it spawned, at
    the end. Tests must leave it idle: no request of theirs may still run when they return.
    """
    if os.environ.get("VLLM_WORKER_URL"):
        yield os.environ["VLLM_WORKER_URL"].rstrip("/")
        return
    # Imported here so that the unit tests do not depend on the launcher.
    from scripts.vllm_worker import VllmWorker, kv_events_args

    # It publishes its KV cache events, as `make run`'s worker does: only a gateway told to
    # follow them (the live stack's) subscribes.
    events = kv_events_args(free_port(), free_port())
    with serving(request, VllmWorker(port=free_port(), extra_args=events)) as worker:
        yield worker.url


@pytest.fixture(scope="session")
def vllm_pooling_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A real vLLM CPU worker serving ``tiny-embed`` (or the one at ``$VLLM_POOLING_URL``).

    The ``tiny-llama`` folder served by vLLM's pooling runner (``--runner pooling --convert
    embed``), in the dtype the launcher picks for it (fp32): embeddings, score, rerank and
    pooling. Eager mode: it starts ~10 s sooner, and its speed matters to no test. Started once
    per session, only when a test asks for it.
    """
    if os.environ.get("VLLM_POOLING_URL"):
        yield os.environ["VLLM_POOLING_URL"].rstrip("/")
        return
    from scripts.vllm_worker import VllmWorker

    pooling = VllmWorker(
        port=free_port(), model_name="tiny-embed", runner="pooling", extra_args=["--enforce-eager"]
    )
    with serving(request, pooling) as worker:
        yield worker.url


_WORKER_FIXTURES = frozenset({"vllm_worker_url", "vllm_pooling_url"})


class FakeClock:
    """A clock that moves only when the test moves it: the gateway's ``Clock`` (float seconds).

    Read or set :attr:`now` directly; :meth:`advance` moves it on. ``start`` is arbitrary but
    never 0, so that a time mistaken for a duration (or the reverse) shows in a test.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move the clock on by ``seconds``; returns the new time."""
        self.now += seconds
        return self.now


@pytest.fixture
async def sdk(gateway_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    """The OpenAI SDK pointed at the module's ``gateway_url``; no retries, so errors surface
    as they are."""
    client = openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server of this test's own (``make redis`` installs it), stopped after it."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that needs a real worker, directly or through another fixture."""
    for item in items:
        if _WORKER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.worker)

"""A pytest plugin that says so at once when a real worker dies during the suite.

Without it, a vLLM worker that dies (its engine crashed on a request, say) shows as a cascade of
connection errors and time-outs in every later test that uses it, and its log, which says why,
is nowhere in the report. With it:

* the test during which a watched worker died fails as it would, and its report carries a
  section naming the worker, how it ended and the last lines of its log;
* every later test that asks for that worker's fixture fails in its set-up at once, naming the
  test it died in, instead of waiting on a server that is gone.

A fixture that provides a worker runs it in :func:`serving` (or registers it with :func:`watch`)
under its own name. Stopping a worker on purpose (``stop()``) is never a death.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import pytest


class Watched(Protocol):
    """What the watch needs of a worker (:class:`scripts.vllm_worker.VllmWorker` has it)."""

    @property
    def url(self) -> str:
        """The worker's base URL."""

    def death(self, *, probe: bool = False) -> str | None:
        """How the worker ended, or None while it may still serve."""

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of its log."""

    def start(self) -> None:
        """Launch it."""

    def wait_ready(self, timeout: float = 300) -> None:
        """Block until it serves."""

    def stop(self, grace: float = 20) -> None:
        """End it, on purpose."""


@dataclass(frozen=True, slots=True)
class Death:
    """A watched worker's end, as first seen."""

    fixture: str
    how: str
    test: str
    log: str

    def describe(self) -> str:
        """The report's words: which worker, how it ended, in which test, and its log's tail."""
        return (
            f"the vLLM worker of fixture {self.fixture!r} died during {self.test}: {self.how}\n"
            f"last lines of its log:\n{self.log}"
        )


@dataclass(slots=True)
class WorkerWatch:
    """The workers being watched, by the fixture that provides each, and those seen dead."""

    workers: dict[str, Watched] = field(default_factory=dict)
    deaths: dict[str, Death] = field(default_factory=dict)

    def check(self, names: list[str], test: str, *, probe: bool) -> list[Death]:
        """The deaths among the workers of ``names``, first noting any new one in ``test``."""
        found: list[Death] = []
        for name in names:
            worker = self.workers.get(name)
            if worker is None:
                continue
            if name not in self.deaths:
                how = worker.death(probe=probe)
                if how is None:
                    continue
                self.deaths[name] = Death(name, how, test, worker.log_tail())
            found.append(self.deaths[name])
        return found


_WATCH = pytest.StashKey[WorkerWatch]()


def _watch_of(config: pytest.Config) -> WorkerWatch:
    return config.stash.setdefault(_WATCH, WorkerWatch())


def watch(request: pytest.FixtureRequest, worker: Watched) -> None:
    """Watch ``worker`` as what the requesting fixture provides, until the session ends."""
    _watch_of(request.config).workers[request.fixturename or ""] = worker


W = TypeVar("W", bound=Watched)


@contextlib.contextmanager
def serving(request: pytest.FixtureRequest, worker: W) -> Iterator[W]:
    """Start ``worker``, watched as the requesting fixture's, and stop it when the block ends."""
    worker.start()
    watch(request, worker)
    try:
        worker.wait_ready(timeout=600)
        yield worker
    finally:
        worker.stop()


def _used(item: pytest.Item) -> list[str]:
    return list(getattr(item, "fixturenames", ()))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail a test at once when a worker it needs has died already."""
    watch_ = _watch_of(item.config)
    deaths = watch_.check(_used(item), "an earlier test or its set-up", probe=False)
    if deaths:
        pytest.fail("\n\n".join(death.describe() for death in deaths), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Add to a failed test's report the end of every worker it uses that died during it."""
    report = yield
    if report.failed:
        for death in _watch_of(item.config).check(_used(item), item.nodeid, probe=True):
            # A death seen before this test is in its set-up's failure already.
            if death.test == item.nodeid:
                report.sections.append((f"vLLM worker {death.fixture} died", death.describe()))
    return report

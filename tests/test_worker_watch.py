"""A real worker process that dies during the suite is named at once, with its log's tail.

The suite is run in a pytest of its own (pytester), its worker a real :class:`VllmWorker`
started with an interpreter that has no vLLM: it dies as soon as it starts, as a worker whose
engine crashed would, with the reason in its log.
"""

from __future__ import annotations

import time

import pytest

from scripts.vllm_worker import ROOT

CONFTEST = """
import sys
from pathlib import Path

import pytest

from scripts.vllm_worker import VllmWorker
from tests.servers import free_port
from tests.worker_watch import watch


@pytest.fixture(scope="session")
def doomed(request, tmp_path_factory):
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text("{}")
    worker = VllmWorker(
        free_port(), python=Path(sys.executable), model_dir=model, cpus="nobind",
        log_path=model / "worker.log",
    )
    worker.start()
    watch(request, worker)
    yield worker
    worker.stop()


@pytest.fixture
def gateway(doomed):
    return doomed.url
"""

TESTS = """
import time
import urllib.request


def test_a_request_to_it(doomed):
    deadline = time.monotonic() + 30
    while doomed.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    urllib.request.urlopen(f"{doomed.url}/health", timeout=5)


def test_a_later_one(gateway):
    time.sleep(60)  # a test that would wait on the dead worker


def test_one_without_it():
    pass


def test_another_one_using_it(doomed):
    pass
"""


def test_a_dead_worker_fails_its_test_with_its_log_and_later_ones_at_once(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_doomed=TESTS)
    started = time.monotonic()
    result = pytester.runpytest_subprocess(
        "-p", "tests.worker_watch", "-p", "no:cacheprovider", "-rA"
    )
    took = time.monotonic() - started

    result.assert_outcomes(passed=1, failed=1, errors=2)
    out = result.stdout.str()
    # The failed test says which worker died, how, and why, in the worker's own log.
    result.stdout.fnmatch_lines(
        [
            "*vLLM worker doomed died*",
            "*the vLLM worker of fixture 'doomed' died during "
            "test_doomed.py::test_a_request_to_it: exited with 1*",
            "*last lines of its log:*",
            "*No module named 'vllm'*",
        ]
    )
    # The later tests that need it fail in their set-up, naming the test it died in, and do not
    # wait: not the 60 s the test would have slept.
    assert "ERROR test_doomed.py::test_a_later_one" in out
    assert "ERROR test_doomed.py::test_another_one_using_it" in out
    assert out.count("died during test_doomed.py::test_a_request_to_it") >= 3
    assert took < 45
    assert "PASSED test_doomed.py::test_one_without_it" in out


def test_a_worker_stopped_on_purpose_is_not_dead(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_stopped="""
def test_stop_it(doomed):
    doomed.stop()


def test_after_it(doomed):
    assert doomed.death(probe=True) is None
"""
    )
    result = pytester.runpytest_subprocess("-p", "tests.worker_watch", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)

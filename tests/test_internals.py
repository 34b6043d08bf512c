"""The start-up check of the libraries' undocumented parts (``app/internals.py``)."""

from __future__ import annotations

import asyncio
import logging
import re
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest

from app import internals
from app.internals import ASSUMPTIONS, Assumption, check
from tests.fake_upstream import FakeWorker
from tests.servers import running_gateway, settings_for

WORKER = "http://w1:8000"


async def test_every_assumption_holds_in_the_versions_installed() -> None:
    assert check(asyncio.get_running_loop()) == {a.name: [] for a in ASSUMPTIONS}


async def test_a_release_without_a_server_state_member_is_named_and_costed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class LaterServerState:
        """What a release that stopped tracking the protocols' tasks would give."""

        def __init__(self) -> None:
            self.connections: set[object] = set()

    monkeypatch.setattr(internals, "ServerState", LaterServerState)
    with caplog.at_level(logging.WARNING, logger="app.internals"):
        found = check(asyncio.get_running_loop())
    name = "uvicorn_protocol_contract"
    assert found[name] == ["tasks"]
    assert all(not missing for other, missing in found.items() if other != name)
    [record] = caplog.records
    assert f"{name} does not hold (uvicorn" in record.getMessage()
    assert "missing tasks" in record.getMessage()
    assert "may not wait for the requests in flight" in record.getMessage()


async def test_a_check_that_raises_does_not_hold(caplog: pytest.LogCaptureFixture) -> None:
    def broken(loop: asyncio.AbstractEventLoop) -> list[str]:
        raise TypeError("takes no such argument")

    with caplog.at_level(logging.WARNING, logger="app.internals"):
        found = check(asyncio.get_running_loop(), (Assumption("x", "lib", "a cost", broken),))
    assert found == {"x": ["TypeError: takes no such argument"]}
    assert "x does not hold (lib" in caplog.text


async def test_the_gateway_exports_each_assumption(monkeypatch: pytest.MonkeyPatch) -> None:
    held: dict[str, list[str]] = {a.name: [] for a in ASSUMPTIONS}
    held["uvicorn_protocol_contract"] = ["tasks"]
    held["another_assumption"] = []
    monkeypatch.setattr("app.gateway.assumptions_held", lambda: held)
    worker = FakeWorker(_models_only)
    async with (
        running_gateway(settings_for(WORKER), worker.transport) as url,
        httpx.AsyncClient() as client,
    ):
        text = (await client.get(f"{url}/metrics")).text
    values = dict(re.findall(r'gateway_library_assumption\{assumption="(\w+)"\} (\S+)', text))
    assert values == {
        name: "0.0" if name == "uvicorn_protocol_contract" else "1.0" for name in held
    }


async def _models_only(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
    return httpx.Response(404, json={"error": {"message": "not here"}})


async def test_the_check_runs_once_a_process() -> None:
    first = internals.assumptions_held()
    assert internals.assumptions_held() == first
    assert set(first) == {a.name for a in ASSUMPTIONS}


def _bounds() -> dict[str, str]:
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    return dict(re.findall(r'"([a-z-]+)(?:\[\w+\])?>=[^,"]+,<([0-9.]+)"', text))


@pytest.mark.parametrize(
    "package",
    ["uvicorn", "httptools", "starlette", "fastapi", "prometheus-client", "httpx"],
)
def test_each_library_leant_on_is_bounded_above_the_version_installed(package: str) -> None:
    bound = _bounds().get(package)
    assert bound is not None, f"{package} has no upper bound in pyproject.toml"
    installed = tuple(int(part) for part in version(package).split(".")[:2])
    assert installed < tuple(int(part) for part in bound.split("."))

"""The libraries' undocumented parts the gateway leans on, checked once at start-up.

The front end's protocol class stands on how uvicorn builds it and waits for its connections,
and the server's drain on methods of uvicorn's ``Server`` it overrides, which no release
promises to keep.
``pyproject.toml`` bounds each of those libraries at the newest minor release the suite passed
on; this check covers an install that bypasses the bounds (a pinned image, ``--no-deps``). Each
assumption that does not hold in the versions installed is logged as a warning at start-up,
naming what is missing and what it costs, and exported as
``gateway_library_assumption{assumption}`` 0 (1 where it holds): never a silent slower path.

Rules: a check only looks (it constructs throw-away objects, never sends a byte); it names the
missing attributes, so the log says what changed.
"""

from __future__ import annotations

import asyncio
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from uvicorn.server import ServerState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Assumption:
    """One undocumented part of a library, what stands on it, and how to see it holds.

    ``missing`` returns the names it looked for and did not find (empty: it holds).
    """

    name: str
    library: str
    cost: str
    missing: Callable[[asyncio.AbstractEventLoop], list[str]]


def _lacks(target: object, names: tuple[str, ...]) -> list[str]:
    return [name for name in names if not hasattr(target, name)]


def _protocol_contract(loop: asyncio.AbstractEventLoop) -> list[str]:
    """How uvicorn hands a connection to :class:`app.http.front.FrontProtocol`, and waits for it."""
    state = _lacks(ServerState(), ("connections", "tasks"))
    server = [
        f"Server.startup: {name}"
        for name in _code_names(uvicorn.Server.startup, ("http_protocol_class", "server_state"))
    ]
    return state + server


def _server_hooks(loop: asyncio.AbstractEventLoop) -> list[str]:
    """What :class:`app.http.server.GatewayServer` overrides and reads of uvicorn's ``Server``."""
    missing = _lacks(uvicorn.Server, ("startup", "handle_exit"))
    missing += [f"Server: {n}" for n in _code_names(uvicorn.Server.__init__, ("started",))]
    serve = [f"Server.serve: {n}" for n in _code_names(uvicorn.Server.serve, ("capture_signals",))]
    return missing + serve


def _code_names(function: Callable[..., object], names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` that ``function``'s code (functions nested in it too) does not use."""
    used: set[str] = set()
    codes = [getattr(function, "__code__")]  # noqa: B009
    while codes:
        code = codes.pop()
        used.update(code.co_names)
        codes.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
    return [name for name in names if name not in used]


ASSUMPTIONS = (
    Assumption(
        "uvicorn_protocol_contract", "uvicorn",
        "a graceful shutdown may not wait for the requests in flight",
        _protocol_contract,
    ),
    Assumption(
        "uvicorn_server_hooks", "uvicorn",
        "SIGTERM may stop the gateway without its drain, and GATEWAY_PROCESSES above 1 may "
        "restart a process that failed to start",
        _server_hooks,
    ),
)  # fmt: skip


def check(
    loop: asyncio.AbstractEventLoop, assumptions: tuple[Assumption, ...] = ASSUMPTIONS
) -> dict[str, list[str]]:
    """Check every assumption; log each that does not hold; the missing names of each.

    A check that raises counts as not holding, its error named.
    """
    found: dict[str, list[str]] = {}
    for assumption in assumptions:
        try:
            missing = assumption.missing(loop)
        except Exception as exc:
            missing = [f"{type(exc).__name__}: {exc}"]
        found[assumption.name] = missing
        if missing:
            log.warning(
                "%s does not hold (%s, installed outside the bounds in pyproject.toml?): "
                "missing %s; so %s",
                assumption.name, assumption.library, ", ".join(missing), assumption.cost,
            )  # fmt: skip
    return found


_held: dict[str, list[str]] = {}


def assumptions_held() -> dict[str, list[str]]:
    """:func:`check` of :data:`ASSUMPTIONS` on the running loop, done (and logged) once a process.

    The installed libraries do not change while a process runs; a process that starts many apps
    (the tests) checks and warns once.
    """
    if not _held:
        _held.update(check(asyncio.get_running_loop()))
    return dict(_held)

"""How the pool reads its workers: the GETs, one of a kind per worker at a time, every round.

:class:`Prober` owns the network side of the pool's background work (:mod:`app.fleet.workers`):
a GET with the worker's key over the gateway's own HTTP/1.1 client (:mod:`app.fleet.wire`, a
pool of its own, apart from the relay's and not counted in its budget), the rule that a slow
worker never has two probes of one kind running, the rounds that repeat every interval whatever
one round throws, and the judgement of a probe that timed out late of the gateway's own busy
loop. What a probe's answer means for a worker (up, its models, its load) is the pool's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import httpx

from app.fleet.wire import (
    ConnectFailed,
    ConnectionClosed,
    ConnectTimeout,
    ProtocolError,
    WireClient,
    WireError,
    endpoint,
)
from app.observe.looplag import fired_late
from app.settings import WorkerSpec

log = logging.getLogger(__name__)

_W = TypeVar("_W")
# A worker's /metrics page with many models and LoRA adapters runs to a few hundred KiB; a body
# past this is not a page the pool can use.
_MAX_BODY = 16 * 2**20


def _request(spec: WorkerSpec, path: str) -> httpx.Request:
    """The probe as httpx's exceptions name it."""
    return httpx.Request("GET", f"{spec.base_url}{path}")


class Prober:
    """The pool's probes and background rounds, over the gateway's own HTTP/1.1 client.

    A probe's answer and failures are httpx's types (``httpx.Response``, ``httpx.HTTPError``'s
    tree), as the pool reads them: a connect that fails is ``ConnectError``, one that takes
    too long ``ConnectTimeout``, an answer not whole within the probe's time ``ReadTimeout``,
    a broken or cut answer ``RemoteProtocolError``, an error status ``HTTPStatusError``.
    """

    def __init__(self, wire: WireClient) -> None:
        self._wire = wire
        self._running: set[tuple[object, str]] = set()
        """(worker, kind) of every probe running now."""
        self._tasks: list[asyncio.Task[None]] = []

    async def get(self, spec: WorkerSpec, path: str, limit_s: float) -> httpx.Response:
        """GET ``path`` from the worker, whole within ``limit_s``; an error status raises.

        The ``httpx.Request`` that httpx's exceptions carry is made only for a failure: parsing
        its URL took about 40% of a probe that succeeded, and the pool probes every worker
        several times a second.
        """
        host, port, tls, head = endpoint(spec.base_url, path, spec.api_key, b"GET")
        whole_head = (head + b"\r\n",)  # no body: the head ends here, in one write
        try:
            async with asyncio.timeout(limit_s):
                answer = await self._wire.request(host, port, tls, lambda: whole_head)
                try:
                    body = await answer.read(_MAX_BODY)
                    whole = answer.complete
                finally:
                    answer.close()
        except TimeoutError as exc:
            why = f"no whole answer within {limit_s:g} s"
            raise httpx.ReadTimeout(why, request=_request(spec, path)) from exc
        except ConnectTimeout as exc:
            raise httpx.ConnectTimeout(str(exc), request=_request(spec, path)) from exc
        except ConnectFailed as exc:
            raise httpx.ConnectError(str(exc), request=_request(spec, path)) from exc
        except (ProtocolError, ConnectionClosed) as exc:
            raise httpx.RemoteProtocolError(str(exc), request=_request(spec, path)) from exc
        except WireError as exc:
            raise httpx.TransportError(str(exc), request=_request(spec, path)) from exc
        if not whole:
            raise httpx.RemoteProtocolError(
                f"an answer over {_MAX_BODY} bytes", request=_request(spec, path)
            )
        if not 200 <= answer.status < 300:  # raise_for_status raises for each of these
            httpx.Response(
                answer.status, headers=answer.headers, content=body, request=_request(spec, path)
            ).raise_for_status()
        return httpx.Response(answer.status, headers=answer.headers, content=body)

    async def each(
        self, what: str, workers: Iterable[_W], probe: Callable[[_W], Awaitable[None]]
    ) -> None:
        """Run ``probe`` on every worker at once, except where a ``what`` probe still runs."""
        await asyncio.gather(
            *(self._once(w, what, functools.partial(probe, w)) for w in list(workers))
        )

    async def _once(self, worker: object, what: str, probe: Callable[[], Awaitable[None]]) -> None:
        # A slow worker must not pile up probes of the same kind.
        key = (worker, what)
        if key in self._running:
            return
        self._running.add(key)
        try:
            await probe()
        finally:
            self._running.discard(key)

    def timed_out_late(
        self, label: str, error: BaseException, started: float, timeout: float
    ) -> bool:
        """Whether a probe started at ``started`` (loop time) timed out late of the gateway.

        A timeout the gateway's own busy loop explains (:func:`app.observe.looplag.fired_late`)
        says nothing of the worker: its state is kept.
        """
        now = asyncio.get_running_loop().time()
        if isinstance(error, httpx.TimeoutException) and fired_late(started, now, timeout):
            log.info(
                "probe of worker %s timed out %.1f s late: the gateway was busy, the worker's "
                "state is kept", label, now - started - timeout,
            )  # fmt: skip
            return True
        return False

    def start(self, rounds: Iterable[tuple[str, float, Callable[[], Awaitable[None]]]]) -> None:
        """Run each ``(name, interval, job)`` every ``interval`` seconds until :meth:`stop`."""
        self._tasks = [
            asyncio.create_task(self._every(interval, job), name=name)
            for name, interval, job in rounds
        ]

    async def _every(self, interval: float, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await job()
            except Exception:  # a background job must survive anything one round throws
                log.exception("background job failed; retrying next round")

    async def stop(self) -> None:
        """Stop the background rounds."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

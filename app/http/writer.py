"""The response-writer seam: one response written without ASGI messages, or over ``send``.

The front end (:mod:`app.http.front`) puts its exchange in the scope under :data:`WRITER_KEY`; it
writes each part to the socket in the caller's own callback and returns something to await only
when the client's connection holds writes back. Under another server the relay writes through
:class:`AsgiWriter` instead, over ASGI's ``send``, and :func:`send_now` runs that ``send`` outside
any task.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from starlette.types import Message, Receive, Send

WRITER_KEY = "gateway.writer"
"""Scope key of the request's :class:`ResponseWriter` (the front end's exchange itself)."""


class ResponseWriter(Protocol):
    """One response, written without ASGI messages: a head, then body parts, then the end.

    The head is held until the first body bytes. :meth:`write` and :meth:`end` hand their bytes
    to the connection now and return None, or, when the connection holds writes back, return
    an awaitable that writes them once it may: the caller awaits it before writing more.
    """

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Set the response's status and headers (written with the first body bytes)."""

    def write(self, data: bytes) -> Awaitable[None] | None:
        """Write one part of the body (one HTTP chunk)."""

    def end(self, data: bytes) -> Awaitable[None] | None:
        """Write the body's last part: the response is complete."""

    def watch(self, gone: Callable[[], None]) -> Callable[[], None]:
        """Call ``gone`` when the client disconnects before the response is complete.

        Called soon if it did already. Returns what stops watching.
        """


class AsgiWriter:
    """A :class:`ResponseWriter` over ASGI's ``send``, for a server that offers no writer.

    Each part is one ``http.response.body`` message, sent with :func:`send_now`; a task
    waits on ``receive`` for the disconnect.
    """

    __slots__ = ("_receive", "_send", "_start")

    def __init__(self, send: Send, receive: Receive) -> None:
        self._send = send
        self._receive = receive
        self._start: Message | None = None

    def watch(self, gone: Callable[[], None]) -> Callable[[], None]:
        """Call ``gone`` once ``receive`` says the client disconnected."""

        async def wait() -> None:
            while (await self._receive())["type"] != "http.disconnect":
                pass
            gone()

        task = asyncio.get_running_loop().create_task(wait())

        def stop() -> None:
            task.cancel()

        return stop

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Keep the start message for the first body part."""
        self._start = {"type": "http.response.start", "status": status, "headers": headers}

    def write(self, data: bytes) -> Awaitable[None] | None:
        """Send one body part."""
        return self._body(data, True)

    def end(self, data: bytes) -> Awaitable[None] | None:
        """Send the last body part."""
        return self._body(data, False)

    def _body(self, data: bytes, more: bool) -> Awaitable[None] | None:
        message: Message = {"type": "http.response.body", "body": data, "more_body": more}
        start, self._start = self._start, None
        if start is not None:
            pending = send_now(self._send, start)
            if pending is not None:
                return _chained(pending, self._send, message)
        return send_now(self._send, message)


def send_now(send: Send, message: Message) -> Awaitable[None] | None:
    """Run ``send(message)`` up to its first wait: None if it finished, else what finishes it.

    A server's send returns without waiting unless the client's connection holds writes back,
    so a sender outside any task can send; the rare send that must wait is finished by
    awaiting what this returns.
    """
    sending = send(message)
    if type(sending) is not types.CoroutineType:  # an ABC's isinstance costs more than a send
        return sending
    try:
        waits_on = sending.send(None)
    except StopIteration:
        return None
    return _resumed(sending, waits_on)


async def _resumed(sending: Coroutine[Any, Any, None], waits_on: Any) -> None:
    """Finish a coroutine that stopped at its first wait, on what it was waiting for.

    What it waited on (an asyncio future, or None for a bare yield) is waited for here; the
    coroutine is then resumed and takes the future's outcome itself, as its own ``await`` does.
    A cancellation of this task is delivered to the coroutine where it waits.
    """
    while True:
        try:
            if waits_on is None:
                await asyncio.sleep(0)
            else:
                # Not awaited itself: a future the coroutine's await has yielded refuses a
                # second await. A future of this task's own settles with it.
                await _settled(waits_on)
        except BaseException as exc:
            try:
                waits_on = sending.throw(exc)
            except StopIteration:
                return
            continue
        try:
            waits_on = sending.send(None)
        except StopIteration:
            return


def _settled(future: asyncio.Future[Any]) -> asyncio.Future[None]:
    """A new future that completes, with no result, once ``future`` is done (whatever its end)."""
    done: asyncio.Future[None] = future.get_loop().create_future()

    def settle(_: asyncio.Future[Any]) -> None:
        if not done.done():
            done.set_result(None)

    future.add_done_callback(settle)
    return done


async def _chained(first: Awaitable[None], send: Send, message: Message) -> None:
    await first
    await send(message)

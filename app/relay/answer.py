"""The answer to the client: what has been sent of it, and the only way to send it more.

Rules: the head goes once, with the request's id, its tier and its time queued; events go out
whole, as one chunk per send, and their output events are timed when their bytes are handed to
the client's socket (the moment the client can have them, not when the worker's came in); the
answer counts as given once the stream's end marker went out; its body ends once.
"""

from __future__ import annotations

from collections.abc import Awaitable

from app.http.writer import ResponseWriter
from app.observe.timing import RequestTimer

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class Answer:
    """One response to the client, over the front end's :class:`ResponseWriter`."""

    __slots__ = (
        "_out",
        "_request_id",
        "_tier",
        "_timer",
        "answered",
        "ended",
        "queued_s",
        "started",
    )

    def __init__(
        self, out: ResponseWriter, timer: RequestTimer, request_id: str, tier: str
    ) -> None:
        self._out = out
        self._timer = timer
        self._request_id = request_id.encode()
        self._tier = tier.encode()
        self.queued_s = 0.0
        """Time the request waited for admission, sent as ``x-gateway-queue-ms``."""
        self.started = False
        """The head was sent: no other status can be given now."""
        self.answered = False
        """The stream's end marker ([DONE], or the Responses API's last event) reached the
        client: it has the whole answer, whatever the worker's connection does after."""
        self.ended = False
        """The body's last part was sent."""

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the status and headers; the response counts as started from here."""
        self.started = True
        self._out.start(
            status,
            [
                *headers,
                (b"x-request-id", self._request_id),
                (b"x-gateway-tier", self._tier),
                (b"x-gateway-queue-ms", b"%.1f" % (self.queued_s * 1000)),
            ],
        )

    def send(self, events: list[bytes], outputs: int, done: bool) -> Awaitable[None] | None:
        """Send whole events now, as one chunk; an awaitable that finishes it if it must wait.

        ``outputs`` of them carry output; ``done``: the stream's end marker is among them. A
        stream's head (200, SSE) goes with its first events.
        """
        if not self.started:
            self.start(200, SSE_HEADERS)
        pending = self._out.write(events[0] if len(events) == 1 else b"".join(events))
        if pending is not None:
            return self._sent_later(pending, outputs, done)
        self._sent(outputs, done)
        return None

    async def send_all(self, events: list[bytes], outputs: int) -> None:
        """Send whole events, waiting as long as it takes."""
        pending = self.send(events, outputs, self.answered)
        if pending is not None:
            await pending

    async def end(self, body: bytes) -> None:
        """Send the last part of the body: the response is complete after this."""
        self.ended = True
        pending = self._out.end(body)
        if pending is not None:
            await pending

    def _sent(self, outputs: int, done: bool) -> None:
        """The events are on the socket: their outputs are timed now."""
        if outputs:
            timer = self._timer
            sent = timer.clock()
            for _ in range(outputs):
                timer.output(sent)
        self.answered = done

    async def _sent_later(self, pending: Awaitable[None], outputs: int, done: bool) -> None:
        await pending
        self._sent(outputs, done)

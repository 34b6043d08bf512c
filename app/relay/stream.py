"""The stream pump: a worker's SSE body cut into whole events, classified, sent on and timed.

Each piece of the worker's body is handled in the worker connection's own callback: its whole
events are classified by a byte scan (output, usage, end, error), written to the client at
once as one chunk, and their hand-off to the socket timed. The client gets exactly the worker's
events, with two repairs only: the usage chunk the gateway asked for on the client's behalf is
dropped, and the ``system_fingerprint`` vLLM then leaves off finish chunks is put back.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

from app.api.protocol import Events, ParsedRequest
from app.api.sse import (
    FINISH,
    EventKind,
    EventSplitter,
    cached_tokens,
    classify,
    classify_response,
    event_fingerprint,
    event_json,
    parse_usage,
    usage_cached,
    usage_counts,
    with_fingerprint,
)
from app.fleet.lease import Lease
from app.observe.timing import RequestTimer
from app.relay.deadline import Deadline, earliest
from app.relay.feedback import Feedback

Send = Callable[[list[bytes], int, bool], Awaitable[None] | None]
"""Sends whole events now, as one chunk: ``(events, output events among them, the stream's
end came)``; returns an awaitable that finishes the send if it must wait for the client."""


class StreamPump:
    """One attempt's stream: the worker's bytes cut into events, classified, timed and sent on.

    :meth:`feed` takes each piece of the worker's body as it arrives and sends its whole
    events at once, in the worker connection's own callback when the transport pushes
    (:meth:`app.fleet.wire.Response.push`): no task wakes up for an event. Only a send that must
    wait (the client is not reading) is left to the relay's task.

    What the stream told is kept on the pump for the relay to read once the attempt ends
    (:attr:`tokens`, :attr:`erred`, :attr:`done`); what its outputs teach goes to
    :class:`~app.relay.feedback.Feedback` as they come.
    """

    __slots__ = (
        "_clock",
        "_deadline",
        "_deadline_at",
        "_feedback",
        "_first",
        "_idle",
        "_keep_usage",
        "_kind_of",
        "_last_read",
        "_lease",
        "_loop",
        "_restore",
        "_send",
        "_splitter",
        "_total_at",
        "_waiting",
        "_worker",
        "cached",
        "done",
        "erred",
        "held",
        "held_outputs",
        "last_received",
        "overhead_s",
        "responses",
        "tokens",
    )  # fmt: skip

    def __init__(
        self, send: Send, feedback: Feedback, request: ParsedRequest, timer: RequestTimer,
        idle_s: float, lease: Lease, deadline: Deadline, deadline_at: float,
        total_at: float | None, loop: asyncio.AbstractEventLoop,
    ) -> None:  # fmt: skip
        self._send, self._feedback, self._lease, self._worker = send, feedback, lease, lease.worker
        self._deadline, self._deadline_at, self._total_at = deadline, deadline_at, total_at
        self._loop = loop
        self._clock = timer.clock
        self._idle = idle_s
        self._keep_usage = request.wants_usage
        # The worker was asked for a usage chunk the client did not ask for; vLLM then also
        # leaves ``system_fingerprint`` off each finish chunk, so the relay puts it back.
        self._restore = not self._keep_usage
        # The Responses API ends with a typed event that carries the usage, not with [DONE].
        self.responses = request.endpoint.events is Events.RESPONSES
        self._kind_of = classify_response if self.responses else classify
        self._splitter = EventSplitter()
        self._first = True
        self.done = False
        """The stream's end marker came."""
        self.erred = False
        """The worker sent an error event: the request is the worker's failure."""
        self.tokens: tuple[int, int] | None = None
        """The prompt and completion tokens the worker's usage told (None: it told none)."""
        self.cached: int | None = None
        """The prompt tokens the worker found in its prefix cache, if its usage told them."""
        self.last_received: float | None = None
        """When the latest output event came from the worker."""
        self._last_read = 0.0
        self._waiting = False
        self.held: list[bytes] | None = None
        """Events held, in order, from a finish chunk until the usage chunk tells the worker's
        fingerprint: only while the gateway has not seen this worker's yet."""
        self.held_outputs = 0
        self.overhead_s = 0.0
        """The gateway's own time on this attempt's events (added to the timer at its end)."""

    def read_deadline(self) -> float:
        """The deadline while the relay waits for the worker: first token, or the next event."""
        if self.last_received is None:
            return earliest(self._deadline_at, self._total_at)
        since = self._clock() - self._last_read
        return earliest(self._loop.time() + self._idle - since, self._total_at)

    def resumed(self) -> None:
        """A send that had to wait is done: the worker's deadline applies again."""
        self._waiting = False
        self._last_read = self._clock()  # the wait was the client's: not the worker's idle time
        self._deadline.move(self.read_deadline())

    def _renewed(self) -> float:
        # The idle deadline follows every piece of the worker's body without being moved per
        # event: its timer asks here when it fires. Not while a send waits for the client
        # (the stall timeout's time) and not before the first token (its own deadline).
        if self._waiting:
            return -math.inf
        return self.read_deadline()

    def feed(self, data: bytes) -> Awaitable[None] | None:
        """Relay the whole events ``data`` completes; what finishes the send if it must wait."""
        worker = self._worker
        received = self._last_read = self._clock()
        events = self._splitter.feed(data)
        if not events:
            return None
        if self._first:
            self._first = False
            head = events[0]
            if self._restore and b'"usage"' in head and classify(head) is not EventKind.USAGE:
                # The worker sends usage whatever was asked (--enable-force-include-usage): so
                # it does to the client directly.
                self._keep_usage, self._restore = True, False
        restore, kind_of, held = self._restore, self._kind_of, self.held
        before = self.last_received  # the previous output's arrival, None before the first
        out: list[bytes] = []
        outputs = seen = 0
        for event in events:
            kind = kind_of(event)
            if kind is EventKind.OUTPUT:
                self.last_received = received
                seen += 1
            elif kind is EventKind.USAGE:
                self._count(parse_usage(event))
                self._cached(cached_tokens(event))
                if restore:
                    learnt = event_fingerprint(event)
                    worker.learn_fingerprint(learnt)
                    if held is not None:
                        out.extend(_restored(held, learnt))
                        outputs, held, self.held_outputs = outputs + self.held_outputs, None, 0
                if not self._keep_usage:
                    continue
            elif kind is EventKind.DONE:
                self.done = True
                if self.responses:
                    payload = event_json(event)
                    self._count(usage_counts(payload))
                    self._cached(usage_cached(payload))
            elif kind is EventKind.ERROR:
                self.erred = True
                self.done = self.done or self.responses  # response.failed ends its stream
            if restore and FINISH in event:
                member = worker.fingerprint
                if member is not None:
                    event = with_fingerprint(event, member)
                elif held is None:
                    held = []
            if held is not None:
                if kind is not EventKind.DONE and kind is not EventKind.ERROR:
                    held.append(event)
                    self.held_outputs += kind is EventKind.OUTPUT
                    continue
                out.extend(held)  # no usage chunk came: the fingerprint is unknown
                outputs, held, self.held_outputs = outputs + self.held_outputs, None, 0
            out.append(event)
            outputs += kind is EventKind.OUTPUT
        self.held = held
        try:
            pending = self._send(out, outputs, self.done) if out else None
        finally:
            # What the outputs teach (the first token's TTFT, the pace) is learnt once they
            # are on their way: the client's first token does not wait for the bookkeeping.
            if seen:
                self._feedback.outputs(self._lease, seen, before, received)
        if before is None and seen:
            # The first token: from now on the deadline is the idle timeout's, which may be
            # sooner than the first token's (moved once a waiting send is done, if one waits).
            self._deadline.renew = self._renewed
            if pending is None:
                self._deadline.move(self.read_deadline())
        if pending is not None:
            self._waiting = True
        self.overhead_s += self._clock() - received
        return pending

    def _count(self, tokens: tuple[int, int] | None) -> None:
        if tokens is not None:
            self.tokens = tokens

    def _cached(self, tokens: int | None) -> None:
        if tokens is not None:
            self.cached = tokens


def _restored(held: list[bytes], member: bytes) -> list[bytes]:
    """Held events with the fingerprint put back on their finish chunks."""
    return [with_fingerprint(event, member) if FINISH in event else event for event in held]

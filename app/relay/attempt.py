"""One attempt: the request sent to one worker, and the client answered from its response.

An attempt raises a :class:`~app.api.errors.GatewayError` for what went wrong (the relay
decides whether to fail over); what it learnt of the answer as it went (the worker's token
counts, an error event in its stream, when the answer was handed over) is kept on a
:class:`Told` the relay gives it, so a failure half-way keeps what came before it.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from app.api.errors import ClientStalled, UpstreamInvalidResponse, UpstreamTimeout
from app.api.protocol import ParsedRequest, Upload
from app.api.sse import fingerprint_member, usage_cached, usage_counts
from app.fleet.lease import Lease
from app.fleet.upstream import UpstreamSlots, WorkerRequest
from app.fleet.wire import WireClient, WireError
from app.observe.timing import RequestTimer
from app.relay.answer import Answer
from app.relay.deadline import Deadline, earliest
from app.relay.feedback import Feedback
from app.relay.stream import StreamPump
from app.settings import Settings


@dataclass(slots=True)
class Told:
    """What one attempt learnt of the answer, for the request's record."""

    tokens: tuple[int, int] | None = None
    """The prompt and completion tokens the worker's usage told (None: it told none)."""
    cached: int | None = None
    """Of the prompt tokens, those the worker's usage said it found in its prefix cache."""
    erred: bool = False
    """The worker sent an error event in its stream: the request is the worker's failure."""
    status: int | None = None
    """The worker's status, relayed (None: the stream's 200, or nothing relayed)."""
    end: float | None = None
    """When a whole (non-streamed) answer was handed to the client's socket."""


class Attempts:
    """A request's attempts: each on the worker of its lease, answering through ``answer``."""

    __slots__ = (
        "_body", "_feedback", "_loop", "_priority", "_request", "_request_id", "_settings",
        "_slots", "_timer", "_wire",
    )  # fmt: skip

    def __init__(
        self, settings: Settings, wire: WireClient, slots: UpstreamSlots, request: ParsedRequest,
        timer: RequestTimer, request_id: str, feedback: Feedback, priority: int | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:  # fmt: skip
        self._loop = loop  # the request's, handed down: asking for it is a system call (3.11)
        self._settings, self._wire, self._slots = settings, wire, slots
        self._request, self._timer, self._request_id = request, timer, request_id
        self._feedback = feedback
        self._priority = priority
        self._body: bytes | Upload | None = None

    async def stream(self, answer: Answer, lease: Lease, told: Told) -> None:
        """Relay the worker's event stream as it comes, every event timed."""
        settings, timer, loop = self._settings, self._timer, self._loop
        clock = timer.clock
        # The first-token timeout runs from arrival, across attempts: a client waits at most
        # that long whatever failed over on the way.
        deadline_at = loop.time() + settings.first_token_timeout_s - (clock() - timer.arrival)
        total_at = (
            None
            if settings.request_timeout_s is None
            else loop.time() + settings.request_timeout_s - (clock() - timer.arrival)
        )
        stall = settings.client_stall_timeout_s
        sending = False
        stream: StreamPump | None = None
        try:
            # The timer first wakes when the soonest of the deadlines set below could end:
            # moved later from there (the first token's, the idle one's, the end's), it is
            # never rescheduled, which costs a timer each.
            wake = loop.time() + min(stall, settings.idle_timeout_s)
            async with (
                Deadline(earliest(deadline_at, total_at), wake, loop) as deadline,
                self._response(lease) as upstream,
            ):
                stream = StreamPump(
                    answer.send, self._feedback, self._request, timer, settings.idle_timeout_s,
                    lease, deadline, deadline_at, total_at, loop,
                )  # fmt: skip
                # Each event is relayed in the worker connection's own callback.
                while (pending := await upstream.push(stream.feed)) is not None:
                    # A send waits while the client does not read (the server's write buffer
                    # is full): the stall timeout's time, never the worker's.
                    sending = True
                    deadline.move(earliest(loop.time() + stall, total_at))
                    await pending
                    sending = False
                    stream.resumed()
                sending = True  # the end of the body waits for a client that does not read, too
                deadline.renew = None
                deadline.move(earliest(loop.time() + stall, total_at))
                if stream.held:
                    await answer.send_all(stream.held, stream.held_outputs)
                if not stream.done:
                    raise UpstreamInvalidResponse(
                        f"Worker {lease.worker.label} closed the stream before its end "
                        f"({'response.completed' if stream.responses else '[DONE]'})."
                    )
                await answer.end(b"")
        except TimeoutError as exc:
            if sending:
                raise ClientStalled(
                    f"The client read nothing for {stall:g} s; its stream was cut."
                ) from exc
            started = stream is not None and stream.last_received is not None
            what = "the next event" if started else "the first token"
            raise UpstreamTimeout(
                f"Worker {lease.worker.label} timed out waiting for {what}."
            ) from exc
        except WireError as exc:
            raise UpstreamInvalidResponse(
                f"Worker {lease.worker.label} broke off the stream: {type(exc).__name__}."
            ) from exc
        finally:
            if stream is not None:
                timer.add_overhead(stream.overhead_s)
                told.tokens, told.cached, told.erred = stream.tokens, stream.cached, stream.erred

    async def unary(self, answer: Answer, lease: Lease, told: Told) -> None:
        """Read the worker's whole answer, then hand it to the client in one write."""
        settings, timer = self._settings, self._timer
        worker = lease.worker
        timeout = settings.nonstream_timeout_s
        if settings.request_timeout_s is not None:
            timeout = min(timeout, settings.request_timeout_s - (timer.clock() - timer.arrival))
        try:
            async with asyncio.timeout(timeout), self._response(lease) as upstream:
                raw = await upstream.read()
                status = upstream.status
                content_type = upstream.header(b"content-type") or b"application/json"
        except TimeoutError as exc:
            raise UpstreamTimeout(f"Worker {worker.label} did not answer in time.") from exc
        except WireError as exc:
            raise UpstreamInvalidResponse(
                f"Worker {worker.label} broke off the response: {type(exc).__name__}."
            ) from exc
        received = timer.clock()
        payload: Any = None
        # A transcription may be asked for as text (srt, vtt): the worker then says so.
        if b"json" in content_type or not self._request.endpoint.form:
            try:
                payload = json.loads(raw)
            except ValueError as exc:
                raise UpstreamInvalidResponse(
                    f"Worker {worker.label} sent a response that is not JSON."
                ) from exc
        self._feedback.first_output(lease, received)
        told.tokens, told.cached = usage_counts(payload), usage_cached(payload)
        if self._request.endpoint.chunks:
            worker.learn_fingerprint(fingerprint_member(payload))
        told.status = status
        answer.start(status, [(b"content-type", content_type)])
        await answer.end(raw)
        told.end = timer.clock()  # handed to the socket: when the client can have it

    def _response(self, lease: Lease) -> WorkerRequest:
        """The worker's response to this request, sent now (the dispatch time is marked)."""
        lease.dispatched = self._timer.dispatch()
        return WorkerRequest(
            self._wire, self._slots, lease.worker, self._request.path, self._upstream_body(),
            self._request_id, self._loop,
        )  # fmt: skip

    def _upstream_body(self) -> bytes | Upload:
        """The body sent to every worker tried (made once, on the first dispatch)."""
        if self._body is None:
            upload = self._request.upload
            self._body = (
                upload if upload is not None else self._request.upstream_body(self._priority)
            )
        return self._body

"""The relay: sends a request to its worker and passes the answer back, timing every event.

A :class:`Relay` is the ASGI response of every request relayed by model (the endpoints of
:mod:`app.api.protocol`), whatever it costs: what differs between endpoints is read from its
:class:`~app.api.protocol.Endpoint` (its worker path, how its stream's events are recognised,
whether it is admitted and whether the worker's latency models learn from it).

It opens the worker request itself, so everything that can fail before the first byte reaches
the client (worker down, worker 4xx/5xx, first-token timeout) is still answered with a proper
status code. Once the first event was sent, a failure becomes an in-band
``data: {"error": ...}`` event and the stream closes without ``[DONE]``.

Streams are relayed event by event as they arrive: no buffering, no merging, no splitting. A
client that disconnects cancels the worker request at once (the worker sees its connection
close and aborts the generation). From the worker transport, each piece of the body is relayed
in the worker connection's own callback and written to the client's socket there, through the
front end's :class:`~app.http.front.ResponseWriter` (ASGI's ``send`` under another server): no task
wakes up per event, and only a write that must wait for the client is left to the request's
task.

A client that stops reading is its own problem, never the worker's. Its stream's buffer is
bounded by the front end: a write waits once the client's transport holds more than its
write high-water mark (64 KiB), beyond what the kernel's socket send buffer holds (see
``client_send_buffer_bytes``). A send blocked for ``client_stall_timeout_s`` ends the stream as
``client_stalled``: the worker request is cancelled, the slot freed, the connection dropped,
and the worker's health is not touched. The worker's idle timeout counts only the time the
relay was ready to read the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.admission.auth import Identity
from app.admission.queue import AdmissionController, Ticket
from app.api.errors import (
    ClientStalled,
    GatewayError,
    GatewaySaturated,
    GatewayShutdown,
    InternalError,
    UpstreamClientError,
    UpstreamInvalidResponse,
    UpstreamTimeout,
    error_body,
)
from app.api.outcome import Outcome
from app.api.protocol import Cost, ParsedRequest, Upload
from app.api.sse import (
    fingerprint_member,
    usage_counts,
)
from app.fleet.lease import Choice, Lease
from app.fleet.routing import Router
from app.fleet.upstream import UpstreamSlots, worker_response
from app.fleet.wire import Response as WorkerResponse
from app.fleet.wire import WireClient, WireError
from app.fleet.workers import WorkerPool
from app.http.front import AsgiWriter, ResponseWriter
from app.observe.metrics import GatewayMetrics
from app.observe.timing import RequestTimer
from app.relay.deadline import Deadline, earliest
from app.relay.feedback import Feedback
from app.relay.record import Recorder, RequestEnd
from app.relay.stream import StreamPump
from app.settings import Settings
from app.shutdown import Shutdown

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's convention: the client went away before the answer was complete

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


@dataclass(slots=True)
class RelayDeps:
    """What every relay needs from the running app."""

    settings: Settings
    wire: WireClient
    pool: WorkerPool
    router: Router
    metrics: GatewayMetrics
    admission: AdmissionController
    recorder: Recorder
    slots: UpstreamSlots
    shutdown: Shutdown


@dataclass(slots=True)
class RequestContext:
    """Everything known about one generation request when its relay starts."""

    request: ParsedRequest
    timer: RequestTimer
    request_id: str
    identity: Identity
    ticket: Ticket
    charged_tokens: float
    """Tokens charged to the key's per-minute allowance up front (corrected at the end)."""
    abort: Callable[[], None] | None = None
    """Drops the client's connection at once, unflushed (the server's, when it offers one)."""
    writer: ResponseWriter | None = None
    """Writes the response to the connection itself; None: through ASGI's ``send`` (a
    middleware may wrap it)."""


class Relay:
    """The ASGI app that serves one relayed request end to end, its response included."""

    def __init__(self, deps: RelayDeps, ctx: RequestContext) -> None:
        self._deps = deps
        self._ctx = ctx
        self._request = ctx.request
        self._timer = ctx.timer
        self._request_id = ctx.request_id
        self._tier = ctx.identity.tier.name
        self._model_label = deps.pool.model_label(ctx.request.model)
        self._status = 200
        self._outcome = Outcome.OK
        self._started = False
        self._tokens: tuple[int, int] | None = None
        self._end: float | None = None
        self._lease: Lease | None = None
        self._queued_s = 0.0
        self._task: asyncio.Task[Any] | None = None
        self._serving = False
        self._stopped = False
        """This relay cancelled its task (``_cancelling`` other cancellations were pending)."""
        self._cancelling = 0
        self._cut = False
        self._ended = False
        # The stream's end marker ([DONE], or the Responses API's last event) reached the
        # client: it has the whole answer, whatever the worker's connection does after.
        self._answered = False
        # Tokenizer-only requests use no engine: never queued, and nothing is learnt from them.
        self._engine = ctx.request.endpoint.cost is not Cost.NONE
        self._feedback = Feedback(
            deps.pool, deps.admission, deps.metrics, self._tier,
            engine=self._engine, stream=ctx.request.stream,
        )  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve the request, cancelling the worker request if the client disconnects.

        The request is served in the caller's task. The client's disconnect and the shutdown's
        cut cancel it while it is being served (:meth:`_stop`), and only then; the cancellation
        is taken back once the serving has unwound, so the end is still answered, released and
        recorded. A cancellation from anyone else (the server giving up) goes on as it came.
        """
        deps = self._deps
        in_flight = deps.metrics.in_flight.labels(self._model_label, self._tier)
        in_flight.inc()
        task = self._task = asyncio.current_task()
        out = self._ctx.writer or AsgiWriter(send, receive)
        unwatch = None
        try:
            self._serving = True
            try:
                unwatch = out.watch(self._client_gone)
                deps.shutdown.enter(self)
                await self._serve(out)
            except asyncio.CancelledError:
                if not self._stopped or task is None or task.uncancel() > self._cancelling:
                    raise
            finally:
                self._serving = False
            if self._cut and not self._ended:
                await self._fail(
                    out, GatewayShutdown("The gateway is shutting down; retry elsewhere."), None
                )
        except OSError:
            # The client vanished while we were writing to it.
            self._client_closed()
        except Exception as error:
            # A fault in the gateway's own code: a 500 (in-band once started), logged and
            # counted as what it is, never as the status the relay had hoped to send.
            log.error("request %s failed in the relay", self._request_id, exc_info=error)
            if not self._ended:
                with contextlib.suppress(OSError):
                    await self._fail(out, InternalError("The gateway failed this request."), None)
            self._outcome = Outcome.INTERNAL_ERROR
        finally:
            if unwatch is not None:
                unwatch()
            deps.shutdown.leave(self)
            in_flight.dec()
            self._finish()

    def cut(self) -> None:
        """The shutdown's grace period is over: stop, and tell the client (in-band if started)."""
        if self._serving and not self._cut:
            self._cut = True
            self._stop()

    def _client_gone(self) -> None:
        """The client disconnected: stop serving it (the worker's request is cancelled)."""
        if self._serving and not self._cut:
            self._client_closed()
            self._stop()

    def _stop(self) -> None:
        task = self._task
        if task is not None and not task.done() and not self._stopped:
            self._stopped = True
            self._cancelling = task.cancelling()
            task.cancel()

    def _client_closed(self) -> None:
        self._status, self._outcome = CLIENT_CLOSED, Outcome.CLIENT_CANCELLED

    async def _serve(self, out: ResponseWriter) -> None:
        """Wait for admission, then try workers until one answers.

        Fails over only before the client got a byte, so no text is ever duplicated.
        """
        deps, ticket = self._deps, self._ctx.ticket
        try:
            if self._engine:
                lease, self._queued_s = await deps.admission.admit(ticket)
            else:
                choice = deps.router.choose(ticket.model, 0.0, ticket.route)
                lease = deps.admission.lease(choice, ticket)
        except GatewayError as error:
            await self._fail(out, error, None)
            return
        self._timer.queued(self._queued_s)
        tried = {lease.worker.label}
        once = self._stream_once if self._request.stream else self._unary_once
        while True:
            self._lease = lease
            try:
                await once(out, lease)
                return
            except (UpstreamClientError, GatewaySaturated) as error:
                # The client's mistake, or the gateway's own limit: never the worker's fault.
                await self._fail(out, error, None)
                return
            except ClientStalled as error:
                self._outcome = error.outcome  # not the worker's fault either
                self._drop_client()
                return
            except GatewayError as error:
                deps.pool.report_failure(lease.worker, error.code or "error", lease.dispatched)
                if self._answered:  # after the whole answer: nothing to fail over
                    await self._fail(out, error, error.__cause__)
                    return
                self._timer.attempt_failed()
                retry = None
                if not self._started and len(tried) < deps.settings.max_attempts:
                    retry = self._next_choice(frozenset(tried))
                if retry is None:
                    await self._fail(out, error, error.__cause__)
                    return
                log.warning(
                    "request %s failing over from worker %s to %s: %s",
                    self._request_id, lease.worker.label, retry.worker.label, error.message,
                )  # fmt: skip
                deps.metrics.worker_failovers.labels(lease.worker.label).inc()
                lease = deps.admission.lease(retry, ticket)
                tried.add(lease.worker.label)
            finally:
                self._release(self._lease)

    def _drop_client(self) -> None:
        """Drop the connection of a client that reads nothing (a graceful close would wait)."""
        if self._ctx.abort is not None:
            self._ctx.abort()

    def _release(self, lease: Lease) -> None:
        timer = self._timer
        self._feedback.released(lease, timer.clock(), timer.output_events)

    def _next_choice(self, exclude: frozenset[str]) -> Choice | None:
        ticket = self._ctx.ticket
        try:
            return self._deps.router.choose(ticket.model, ticket.own_tokens, ticket.route, exclude)
        except GatewayError:
            return None

    async def _stream_once(self, out: ResponseWriter, lease: Lease) -> None:
        deps, timer = self._deps, self._timer
        settings = deps.settings
        loop = asyncio.get_running_loop()
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
        self._tokens = None
        try:
            async with (
                Deadline(earliest(deadline_at, total_at)) as deadline,
                self._response(lease) as upstream,
            ):
                stream = StreamPump(
                    functools.partial(self.send_events, out), self._feedback, self._request,
                    timer, settings.idle_timeout_s, lease, deadline, deadline_at, total_at,
                )  # fmt: skip
                # Each event is relayed in the worker connection's own callback.
                while (pending := await upstream.push(stream.feed)) is not None:
                    # A send waits while the client does not read (the server's write buffer
                    # is full): the stall timeout's time, never the worker's.
                    sending = True
                    deadline.move(earliest(loop.time() + stall, total_at))
                    await pending
                    sending = False
                    deadline.move(stream.read_deadline())
                sending = True  # the end of the body waits for a client that does not read, too
                deadline.move(earliest(loop.time() + stall, total_at))
                if stream.held:
                    await self._relay(out, stream.held, stream.held_outputs)
                if not stream.done:
                    raise UpstreamInvalidResponse(
                        f"Worker {lease.worker.label} closed the stream before its end "
                        f"({'response.completed' if stream.responses else '[DONE]'})."
                    )
                await self._end_body(out, b"")
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
                if stream.tokens is not None:
                    self._tokens = stream.tokens
                if stream.erred:  # an error event: the request is the worker's failure
                    self._status, self._outcome = 502, Outcome.UPSTREAM_ERROR

    async def _relay(self, out: ResponseWriter, events: list[bytes], outputs: int) -> None:
        """Send whole events, ``outputs`` of them carrying output, waiting as long as it takes."""
        pending = self.send_events(out, events, outputs, self._answered)
        if pending is not None:
            await pending

    def send_events(
        self, out: ResponseWriter, events: list[bytes], outputs: int, done: bool
    ) -> Awaitable[None] | None:
        """Send whole events now, as one chunk; an awaitable that finishes it if it must wait.

        The output events are timed when the write returns, their bytes handed to the socket:
        the moment the client can have them, not when the worker's bytes came in.
        """
        if not self._started:
            self._start(out, 200, _SSE_HEADERS)
        pending = out.write(events[0] if len(events) == 1 else b"".join(events))
        if pending is not None:
            return self._sent_later(pending, outputs, done)
        timer = self._timer
        if outputs:
            sent, output = timer.clock(), timer.output
            for _ in range(outputs):
                output(sent)
        self._answered = done
        return None

    def _sent(self, outputs: int, done: bool) -> None:
        timer = self._timer
        sent = timer.clock()
        for _ in range(outputs):
            timer.output(sent)
        self._answered = done

    async def _sent_later(self, pending: Awaitable[None], outputs: int, done: bool) -> None:
        await pending
        self._sent(outputs, done)

    def _response(self, lease: Lease) -> contextlib.AbstractAsyncContextManager[WorkerResponse]:
        """The worker's response to this request, sent now (the dispatch time is marked)."""
        deps = self._deps
        lease.dispatched = self._timer.dispatch()
        return worker_response(
            deps.wire, deps.slots, lease.worker, self._request.path, self._upstream_body,
            self._request_id,
        )  # fmt: skip

    async def _unary_once(self, out: ResponseWriter, lease: Lease) -> None:
        deps, timer = self._deps, self._timer
        worker = lease.worker
        timeout = deps.settings.nonstream_timeout_s
        if deps.settings.request_timeout_s is not None:
            timeout = min(
                timeout, deps.settings.request_timeout_s - (timer.clock() - timer.arrival)
            )
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
        self._tokens = usage_counts(payload)
        if self._request.endpoint.chunks:
            worker.fingerprint = fingerprint_member(payload)
        self._start(out, status, [(b"content-type", content_type)])
        await self._end_body(out, raw)
        self._end = timer.clock()  # handed to the socket: when the client can have it

    @functools.cached_property
    def _upstream_body(self) -> bytes | Upload:
        upload = self._request.upload
        if upload is not None:
            return upload
        tier = self._ctx.identity.tier
        return self._request.upstream_body(self._deps.settings.worker_priority_of(tier))

    def _start(self, out: ResponseWriter, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Give the response's status and headers; the response counts as started from here."""
        self._started = True
        self._status = status
        out.start(
            status,
            [
                *headers,
                (b"x-request-id", self._request_id.encode()),
                (b"x-gateway-tier", self._tier.encode()),
                (b"x-gateway-queue-ms", b"%.1f" % (self._queued_s * 1000)),
            ],
        )

    async def _fail(
        self, out: ResponseWriter, error: GatewayError, cause: BaseException | None
    ) -> None:
        """Report ``error``: as the response if nothing was sent yet, else in-band.

        A client that has the whole answer (its end marker sent) gets only the end of the
        body: an error after [DONE] would contradict it. The error is logged, and the request
        keeps the outcome of an answer given.
        """
        if not self._answered:
            self._outcome = error.outcome
        worker = self._lease.worker.label if self._lease else "-"
        if error.outcome is Outcome.REJECTED:
            # Admission's decision, not a failure: expected under load, once per refused
            # request. The access line and gateway_admission_decisions_total count them; this
            # line says why.
            log.info(
                "request %s refused with %d %s: %s",
                self._request_id, error.status_code, error.code, error.message,
            )  # fmt: skip
        elif not isinstance(error, UpstreamClientError):
            log.warning(
                "request %s to worker %s failed: %s (%s)",
                self._request_id, worker, error.message, _describe(cause),
            )  # fmt: skip
        if not self._started:
            body = error.to_json()
            headers = [
                (b"content-type", b"application/json"),
                *((k.encode(), v.encode()) for k, v in error.headers().items()),
            ]
            self._start(out, error.status_code, headers)
            await self._end_body(out, body)
            return
        if not self._answered:
            self._status = error.status_code
        # An error ends the stream without [DONE], so clients cannot mistake it for a complete
        # answer; after [DONE], the body just ends.
        event = b"" if self._answered else b"data: " + error.to_json() + b"\n\n"
        try:
            async with asyncio.timeout(self._deps.settings.client_stall_timeout_s):
                await self._end_body(out, event)
        except TimeoutError:
            self._drop_client()

    async def _end_body(self, out: ResponseWriter, body: bytes) -> None:
        """Send the last part of the body: the response is complete after this."""
        self._ended = True
        pending = out.end(body)
        if pending is not None:
            await pending

    def _finish(self) -> None:
        ctx, timer, tokens = self._ctx, self._timer, self._tokens
        summary = timer.summary(None if tokens is None else tokens[1], end=self._end)
        end = RequestEnd(
            request_id=self._request_id,
            endpoint=self._request.endpoint.value,
            model=self._model_label,
            tier=ctx.identity.tier,
            status=self._status,
            outcome=self._outcome,
            timing=summary,
            waited_s=timer.clock() - timer.arrival,
            tokens=tokens,
            request=self._request,
            identity=ctx.identity,
            charged_tokens=ctx.charged_tokens,
            lease=self._lease,
        )
        self._deps.recorder.finish(end)


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "no cause"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def error_response(error: GatewayError) -> Response:
    """A plain JSON response for an error raised before a relay starts."""
    return Response(
        content=error.to_json(),
        status_code=error.status_code,
        media_type="application/json",
        headers=error.headers(),
    )


__all__ = ["CLIENT_CLOSED", "Relay", "RelayDeps", "error_body", "error_response"]

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
front end's :class:`~app.http.writer.ResponseWriter` (ASGI's ``send`` under another server): no task
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
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.admission.auth import Authenticator, Identity
from app.admission.queue import AdmissionController
from app.admission.ticket import Ticket
from app.api.errors import (
    ClientStalled,
    GatewayError,
    GatewaySaturated,
    GatewayShutdown,
    InternalError,
    UpstreamClientError,
    error_body,
)
from app.api.outcome import Outcome
from app.api.protocol import Cost, ParsedRequest
from app.fleet.lease import Choice, Lease
from app.fleet.predictor import PromptSizer
from app.fleet.routing import Router
from app.fleet.upstream import UpstreamSlots
from app.fleet.wire import WireClient
from app.fleet.workers import WorkerPool
from app.http.writer import AsgiWriter, ResponseWriter
from app.observe.metrics import GatewayMetrics
from app.observe.timing import RequestTimer
from app.relay.answer import Answer
from app.relay.attempt import Attempts, Told
from app.relay.feedback import Feedback
from app.relay.record import Recorder, RequestEnd, learns
from app.settings import Settings, TierSpec
from app.shutdown import Shutdown

log = logging.getLogger(__name__)

Attempt = Callable[[Answer, Lease, Told], Awaitable[None]]
"""One attempt of :class:`~app.relay.attempt.Attempts` (a stream or a whole answer)."""

CLIENT_CLOSED = 499  # nginx's convention: the client went away before the answer was complete


@dataclass(slots=True)
class RelayDeps:
    """What every relay needs from the running app."""

    settings: Settings
    auth: Authenticator
    sizer: PromptSizer
    wire: WireClient
    pool: WorkerPool
    router: Router
    metrics: GatewayMetrics
    admission: AdmissionController
    recorder: Recorder
    slots: UpstreamSlots
    shutdown: Shutdown
    _priorities: dict[str, int | None] = field(init=False)

    def __post_init__(self) -> None:
        tiers = self.settings.tiers
        self._priorities = {t.name: self.settings.worker_priority_of(t) for t in tiers}

    def worker_priority(self, tier: TierSpec) -> int | None:
        """:meth:`app.settings.Settings.worker_priority_of`, worked out once per tier."""
        try:
            return self._priorities[tier.name]
        except KeyError:
            return self.settings.worker_priority_of(tier)


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
        self._told = Told()
        """What the latest attempt learnt of the answer."""
        self._lease: Lease | None = None
        self._task: asyncio.Task[Any] | None = None
        self._serving = False
        self._stopped = False
        """This relay cancelled its task (``_cancelling`` other cancellations were pending)."""
        self._cancelling = 0
        self._cut = False
        # Tokenizer-only requests use no engine: never queued, and nothing is learnt from them.
        self._engine = ctx.request.endpoint.cost is not Cost.NONE
        self._feedback = Feedback(
            deps.pool, deps.admission, deps.metrics, deps.sizer, self._tier,
            engine=self._engine, stream=ctx.request.stream,
        )  # fmt: skip
        # Made in the request's task. Kept: on Python 3.11 each get_running_loop() (and
        # current_task() without a loop) is a getpid() system call; a request asked nine.
        self._loop = asyncio.get_running_loop()
        self._attempts = Attempts(
            deps.settings, deps.wire, deps.slots, ctx.request, ctx.timer, ctx.request_id,
            self._feedback, deps.worker_priority(ctx.identity.tier), self._loop,
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
        task = self._task = asyncio.current_task(self._loop)
        out = self._ctx.writer or AsgiWriter(send, receive)
        answer = Answer(out, self._timer, self._request_id, self._tier)
        unwatch = None
        try:
            self._serving = True
            try:
                unwatch = out.watch(self._client_gone)
                deps.shutdown.enter(self)
                await self._serve(answer)
            except asyncio.CancelledError:
                if not self._stopped or task is None or task.uncancel() > self._cancelling:
                    raise
            finally:
                self._serving = False
            if self._cut and not answer.ended:
                await self._fail(
                    answer, GatewayShutdown("The gateway is shutting down; retry elsewhere."), None
                )
        except OSError:
            # The client vanished while we were writing to it.
            self._client_closed()
        except Exception as error:
            # A fault in the gateway's own code: a 500 (in-band once started), logged and
            # counted as what it is, never as the status the relay had hoped to send.
            log.error("request %s failed in the relay", self._request_id, exc_info=error)
            if not answer.ended:
                with contextlib.suppress(OSError):
                    await self._fail(
                        answer, InternalError("The gateway failed this request."), None
                    )
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

    async def _serve(self, answer: Answer) -> None:
        """Wait for admission, then try workers until one answers.

        Fails over only before the client got a byte, so no text is ever duplicated. Every
        lease is given back when its attempt ends, whatever happened.
        """
        deps, ticket = self._deps, self._ctx.ticket
        try:
            if self._engine:
                lease, answer.queued_s = await deps.admission.admit(ticket)
            else:
                choice = deps.router.choose(ticket.model, 0.0, ticket.route)
                lease = deps.admission.lease(choice, ticket)
        except GatewayError as error:
            await self._fail(answer, error, None)
            return
        try:
            await self._attempts_on(answer, lease)
        finally:
            deps.admission.finished(ticket)  # its fairness id runs one fewer

    async def _attempts_on(self, answer: Answer, lease: Lease) -> None:
        """Try ``lease``'s worker, then others until one answers (failover before a byte)."""
        deps, ticket = self._deps, self._ctx.ticket
        self._timer.queued(answer.queued_s)
        tried = {lease.worker.label}
        once = self._attempts.stream if self._request.stream else self._attempts.unary
        while True:
            self._lease = lease
            try:
                await self._attempt(once, answer, lease)
                return
            except (UpstreamClientError, GatewaySaturated) as error:
                # The client's mistake, or the gateway's own limit: never the worker's fault.
                await self._fail(answer, error, None)
                return
            except ClientStalled as error:
                self._outcome = error.outcome  # not the worker's fault either
                self._drop_client()
                return
            except GatewayError as error:
                deps.pool.report_failure(lease.worker, error.code or "error", lease.dispatched)
                if answer.answered:  # after the whole answer: nothing to fail over
                    await self._fail(answer, error, error.__cause__)
                    return
                self._timer.attempt_failed()
                retry = None
                if not answer.started and len(tried) < deps.settings.max_attempts:
                    retry = self._next_choice(frozenset(tried))
                if retry is None:
                    await self._fail(answer, error, error.__cause__)
                    return
                log.warning(
                    "request %s failing over from worker %s to %s: %s",
                    self._request_id, lease.worker.label, retry.worker.label, error.message,
                )  # fmt: skip
                deps.metrics.worker_failovers.labels(lease.worker.label).inc()
                lease = deps.admission.lease(retry, ticket)
                tried.add(lease.worker.label)
            finally:
                timer = self._timer
                self._feedback.released(self._lease, timer.clock(), timer.output_events)

    async def _attempt(self, once: Attempt, answer: Answer, lease: Lease) -> None:
        """Run one attempt; what it told of the answer goes to the request's record."""
        told = self._told = Told()
        try:
            await once(answer, lease, told)
        finally:
            if told.status is not None:
                self._status = told.status
            if told.erred:  # an error event: the request is the worker's failure
                self._status, self._outcome = 502, Outcome.UPSTREAM_ERROR

    def _drop_client(self) -> None:
        """Drop the connection of a client that reads nothing (a graceful close would wait)."""
        if self._ctx.abort is not None:
            self._ctx.abort()

    def _next_choice(self, exclude: frozenset[str]) -> Choice | None:
        ticket = self._ctx.ticket
        try:
            return self._deps.router.choose(ticket.model, ticket.own_tokens, ticket.route, exclude)
        except GatewayError:
            return None

    async def _fail(self, answer: Answer, error: GatewayError, cause: BaseException | None) -> None:
        """Report ``error``: as the response if nothing was sent yet, else in-band.

        A client that has the whole answer (its end marker sent) gets only the end of the
        body: an error after [DONE] would contradict it. The error is logged, and the request
        keeps the outcome of an answer given.
        """
        if not answer.answered:
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
        if not answer.started:
            headers = [
                (b"content-type", b"application/json"),
                *((k.encode(), v.encode()) for k, v in error.headers().items()),
            ]
            self._status = error.status_code
            answer.start(error.status_code, headers)
            await answer.end(error.to_json())
            return
        if not answer.answered:
            self._status = error.status_code
        # An error ends the stream without [DONE], so clients cannot mistake it for a complete
        # answer; after [DONE], the body just ends.
        event = b"" if answer.answered else b"data: " + error.to_json() + b"\n\n"
        try:
            async with asyncio.timeout(self._deps.settings.client_stall_timeout_s):
                await answer.end(event)
        except TimeoutError:
            self._drop_client()

    def _finish(self) -> None:
        """Give back the key's slot, then learn from the request and count it.

        The lease was given back when its attempt ended; the key's concurrency slot and the
        tokens charged up front go back here, first, whatever learning and counting do after.
        """
        ctx, tokens = self._ctx, self._told.tokens
        used = None if tokens is None else sum(tokens)
        try:
            self._deps.auth.release(ctx.identity, ctx.charged_tokens, used)
        finally:
            self._learn_and_count()

    def _learn_and_count(self) -> None:
        ctx, timer, told, deps = self._ctx, self._timer, self._told, self._deps
        tokens = told.tokens
        summary = timer.summary(None if tokens is None else tokens[1], end=told.end)
        end = RequestEnd(
            request_id=self._request_id,
            endpoint=self._request.endpoint.value,
            model=self._model_label,
            tier=ctx.ticket.tier,  # with the request's own targets, if it sent any
            status=self._status,
            outcome=self._outcome,
            timing=summary,
            waited_s=timer.clock() - timer.arrival,
            tokens=tokens,
            cached_tokens=told.cached,
            request=self._request,
            lease=self._lease,
        )
        try:
            if self._lease is not None and learns(end):
                self._feedback.served(
                    self._lease, self._model_label, self._request, summary, tokens, self._outcome
                )
        finally:
            deps.recorder.finish(end)


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

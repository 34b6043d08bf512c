"""The relay: sends a request to its worker and passes the answer back, timing every event.

A :class:`Relay` is the ASGI response of a generation request. It opens the worker request
itself, so everything that can fail before the first byte reaches the client (worker down,
worker 4xx/5xx, first-token timeout) is still answered with a proper status code. Once the
first event was sent, a failure becomes an in-band ``data: {"error": ...}`` event and the
stream closes without ``[DONE]``.

Streams are relayed event by event as they arrive: no buffering, no merging, no splitting. A
client that disconnects cancels the worker request at once (the worker sees its connection
close and aborts the generation).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from app.admission import AdmissionController, Ticket
from app.auth import Authenticator, Identity
from app.errors import (
    GatewayError,
    UpstreamClientError,
    UpstreamInvalidResponse,
    UpstreamTimeout,
    error_body,
)
from app.goodput import GoodputTracker, slo_result
from app.metrics import GatewayMetrics
from app.predictor import PromptSizer
from app.protocol import ParsedRequest
from app.routing import Choice, Router
from app.settings import Settings, TierSpec
from app.sse import EventKind, EventSplitter, classify, parse_usage, usage_counts
from app.timing import RequestTimer, TimingSummary
from app.upstream import open_response
from app.workers import WorkerPool

log = logging.getLogger("app.access")

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
    client: httpx.AsyncClient
    pool: WorkerPool
    router: Router
    metrics: GatewayMetrics
    sizer: PromptSizer
    admission: AdmissionController
    auth: Authenticator
    goodput: GoodputTracker


class _Attempt:
    """One try of a request on one worker: keeps the worker's load accounting right."""

    __slots__ = (
        "choice", "decode_load", "dispatched", "first", "first_occupancy", "own_tokens",
        "prefill_peers", "tier", "worker",
    )  # fmt: skip

    def __init__(
        self, deps: RelayDeps, choice: Choice, own_tokens: float, now: float, tier: str
    ) -> None:
        self.choice = choice
        self.tier = tier
        self.worker = worker = choice.worker
        self.own_tokens = own_tokens
        self.dispatched = now
        self.first: float | None = None
        self.first_occupancy = 0.0
        self.decode_load: float | None = None
        """Mean requests on the worker from first output to the end, this one included."""
        worker.add_in_flight(1, now)
        worker.tier_in_flight[tier] += 1
        worker.prefilling += 1
        self.prefill_peers = worker.prefilling
        worker.prefill_tokens_ahead += own_tokens
        deps.metrics.worker_routed.labels(worker.label).inc()
        deps.metrics.worker_in_flight.labels(worker.label).set(worker.in_flight)

    def first_output(self, deps: RelayDeps, at: float) -> None:
        """The worker produced its first output (or its whole answer): prefill is over."""
        if self.first is not None:
            return
        self.first = at
        worker = self.worker
        self.first_occupancy = worker.occupancy(at)
        worker.prefill_tokens_ahead -= self.own_tokens
        worker.prefilling -= 1
        deps.pool.report_success(worker)
        ttft = at - self.dispatched
        worker.latency.observe_ttft(self.choice.prefill_work, ttft)
        worker.recent_ttft.observe(ttft)
        deps.metrics.worker_ttft.labels(worker.label).observe(ttft)
        deps.metrics.prediction_error.labels(self.tier).observe(
            abs(ttft - self.choice.predicted_ttft_s)
        )
        deps.admission.poke()  # the prefill is done: capacity may be free for a queued request

    def output_gap(self, deps: RelayDeps, gap: float, at: float) -> None:
        """A later output event came ``gap`` seconds after the previous one, at ``at``."""
        worker = self.worker
        pace = worker.pace.gap(gap, at)
        if pace is not None:
            deps.admission.paced(worker, pace, at)

    def decoded(self, now: float, events: int) -> tuple[float, float]:
        """``(seconds, tokens)`` of decode after the first of the ``events`` with output."""
        if self.first is None or events < 2:
            return 0.0, 0.0
        return now - self.first, (events - 1) * self.worker.pace.tokens_per_event

    def release(self, deps: RelayDeps, now: float) -> None:
        """The attempt is over at ``now``, whatever its outcome."""
        worker = self.worker
        if self.first is not None and now > self.first:
            self.decode_load = (worker.occupancy(now) - self.first_occupancy) / (now - self.first)
        worker.add_in_flight(-1, now)
        worker.tier_in_flight[self.tier] -= 1
        if self.first is None:
            worker.prefill_tokens_ahead -= self.own_tokens
            worker.prefilling -= 1
        deps.metrics.worker_in_flight.labels(worker.label).set(worker.in_flight)


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


class Relay(Response):
    """The ASGI response that serves one generation request end to end."""

    def __init__(self, deps: RelayDeps, ctx: RequestContext) -> None:
        # Response.__init__ is not called: this response writes its own status and headers.
        self.background = None
        self._deps = deps
        self._ctx = ctx
        self._request = ctx.request
        self._timer = ctx.timer
        self._request_id = ctx.request_id
        self._tier = ctx.identity.tier.name
        self._model_label = deps.pool.model_label(ctx.request.model)
        self._status = 200
        self._outcome = "ok"
        self._started = False
        self._tokens: tuple[int, int] | None = None
        self._end: float | None = None
        self._attempt: _Attempt | None = None
        self._queued_s = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve the request, cancelling the worker request if the client disconnects."""
        in_flight = self._deps.metrics.in_flight.labels(self._model_label, self._tier)
        in_flight.inc()
        relay = asyncio.ensure_future(self._serve(send))
        watcher = asyncio.ensure_future(_client_gone(receive))
        try:
            await asyncio.wait((relay, watcher), return_when=asyncio.FIRST_COMPLETED)
            if not relay.done():
                self._client_closed()
                relay.cancel()
                await asyncio.wait((relay,))
            if relay.cancelled():
                pass
            elif isinstance(relay.exception(), OSError):
                # The client vanished while we were writing to it.
                self._client_closed()
            else:
                relay.result()
        finally:
            relay.cancel()
            watcher.cancel()
            in_flight.dec()
            self._finish()

    def _client_closed(self) -> None:
        self._status, self._outcome = CLIENT_CLOSED, "client_cancelled"

    async def _serve(self, send: Send) -> None:
        """Wait for admission, then try workers until one answers.

        Fails over only before the client got a byte, so no text is ever duplicated.
        """
        deps, ticket = self._deps, self._ctx.ticket
        try:
            choice, self._queued_s = await deps.admission.admit(ticket)
        except GatewayError as error:
            await self._fail(send, error, None)
            return
        self._timer.queued(self._queued_s)
        tried = {choice.worker.label}
        once = self._stream_once if self._request.stream else self._unary_once
        while True:
            attempt = _Attempt(deps, choice, ticket.own_tokens, self._timer.clock(), self._tier)
            self._attempt = attempt
            try:
                await once(send, attempt)
                return
            except UpstreamClientError as error:
                await self._fail(send, error, None)
                return
            except GatewayError as error:
                deps.pool.report_failure(attempt.worker, error.code or "error")
                retry = None
                if not self._started and len(tried) < deps.settings.max_attempts:
                    retry = self._next_choice(frozenset(tried))
                if retry is None:
                    await self._fail(send, error, error.__cause__)
                    return
                log.warning(
                    "request %s failing over from worker %s to %s: %s",
                    self._request_id, attempt.worker.label, retry.worker.label, error.message,
                )  # fmt: skip
                deps.metrics.worker_failovers.labels(attempt.worker.label).inc()
                choice = retry
                tried.add(choice.worker.label)
            finally:
                now = self._timer.clock()
                attempt.release(deps, now)
                deps.admission.completed(
                    self._tier,
                    now - attempt.dispatched,
                    *attempt.decoded(now, self._timer.output_events),
                )

    def _next_choice(self, exclude: frozenset[str]) -> Choice | None:
        ticket = self._ctx.ticket
        try:
            return self._deps.router.choose(
                ticket.model, ticket.own_tokens, ticket.affinity, exclude
            )
        except GatewayError:
            return None

    async def _stream_once(self, send: Send, attempt: _Attempt) -> None:
        deps, timer, request = self._deps, self._timer, self._request
        settings = deps.settings
        loop = asyncio.get_running_loop()
        clock = timer.clock
        deadline_at = loop.time() + settings.first_token_timeout_s
        total_at = (
            None
            if settings.request_timeout_s is None
            else loop.time() + settings.request_timeout_s - (clock() - timer.arrival)
        )
        idle = settings.idle_timeout_s
        keep_usage = request.wants_usage
        splitter = EventSplitter()
        worker = attempt.worker
        upstream: httpx.Response | None = None
        done = False
        self._tokens = None
        try:
            async with asyncio.timeout_at(_earliest(deadline_at, total_at)) as deadline:
                timer.dispatch()
                upstream = await open_response(
                    deps.client, worker, request.endpoint.path, self._upstream_body,
                    self._request_id,
                )  # fmt: skip
                async for data in upstream.aiter_raw():
                    received = clock()
                    events = splitter.feed(data)
                    if not events:
                        continue
                    out: list[bytes] = []
                    for event in events:
                        kind = classify(event)
                        if kind is EventKind.OUTPUT:
                            if not timer.output_events:
                                attempt.first_output(deps, received)
                            else:
                                attempt.output_gap(deps, received - timer.last_output, received)
                            timer.output(received)
                        elif kind is EventKind.USAGE:
                            self._tokens = parse_usage(event) or self._tokens
                            if not keep_usage:
                                continue
                        elif kind is EventKind.DONE:
                            done = True
                        elif kind is EventKind.ERROR:
                            self._status, self._outcome = 502, "upstream_error"
                        out.append(event)
                    if out:
                        if not self._started:
                            await self._start(send, 200, _SSE_HEADERS)
                        body = out[0] if len(out) == 1 else b"".join(out)
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                    if timer.output_events:
                        deadline.reschedule(_earliest(loop.time() + idle, total_at))
                    timer.add_overhead(clock() - received)
            if not done:
                raise UpstreamInvalidResponse(
                    f"Worker {worker.label} closed the stream before [DONE]."
                )
        except TimeoutError as exc:
            what = "the first token" if timer.output_events == 0 else "the next event"
            raise UpstreamTimeout(f"Worker {worker.label} timed out waiting for {what}.") from exc
        except httpx.TransportError as exc:
            raise UpstreamInvalidResponse(
                f"Worker {worker.label} broke off the stream: {type(exc).__name__}."
            ) from exc
        finally:
            if upstream is not None:
                await upstream.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _unary_once(self, send: Send, attempt: _Attempt) -> None:
        deps, timer = self._deps, self._timer
        worker = attempt.worker
        timeout = deps.settings.nonstream_timeout_s
        if deps.settings.request_timeout_s is not None:
            timeout = min(
                timeout, deps.settings.request_timeout_s - (timer.clock() - timer.arrival)
            )
        upstream: httpx.Response | None = None
        try:
            async with asyncio.timeout(timeout):
                timer.dispatch()
                upstream = await open_response(
                    deps.client, worker, self._request.endpoint.path, self._upstream_body,
                    self._request_id,
                )  # fmt: skip
                raw = await upstream.aread()
        except TimeoutError as exc:
            raise UpstreamTimeout(f"Worker {worker.label} did not answer in time.") from exc
        except httpx.TransportError as exc:
            raise UpstreamInvalidResponse(
                f"Worker {worker.label} broke off the response: {type(exc).__name__}."
            ) from exc
        finally:
            if upstream is not None:
                await upstream.aclose()
        self._end = timer.clock()
        try:
            payload: Any = json.loads(raw)
        except ValueError as exc:
            raise UpstreamInvalidResponse(
                f"Worker {worker.label} sent a response that is not JSON."
            ) from exc
        attempt.first_output(deps, self._end)
        self._tokens = usage_counts(payload)
        content_type = upstream.headers.get("content-type", "application/json").encode()
        await self._start(send, upstream.status_code, [(b"content-type", content_type)])
        await send({"type": "http.response.body", "body": raw, "more_body": False})

    @functools.cached_property
    def _upstream_body(self) -> bytes:
        return self._request.upstream_body()

    async def _start(self, send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._started = True
        self._status = status
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    *headers,
                    (b"x-request-id", self._request_id.encode()),
                    (b"x-gateway-tier", self._tier.encode()),
                    (b"x-gateway-queue-ms", b"%.1f" % (self._queued_s * 1000)),
                ],
            }
        )

    async def _fail(self, send: Send, error: GatewayError, cause: BaseException | None) -> None:
        """Report ``error``: as the response if nothing was sent yet, else in-band."""
        self._outcome = error.outcome
        worker = self._attempt.worker.label if self._attempt else "-"
        if not isinstance(error, UpstreamClientError):
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
            await self._start(send, error.status_code, headers)
            self._status = error.status_code
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        self._status = error.status_code
        event = b"data: " + error.to_json() + b"\n\n"
        # The stream ends without [DONE], so clients cannot mistake it for a complete answer.
        await send({"type": "http.response.body", "body": event, "more_body": False})

    def _finish(self) -> None:
        deps, ctx = self._deps, self._ctx
        tokens = self._tokens
        summary = self._timer.summary(None if tokens is None else tokens[1], end=self._end)
        model = self._model_label
        endpoint = self._request.endpoint.value
        metrics = deps.metrics
        metrics.count(model, self._tier, endpoint, self._status, self._outcome, tokens)
        deps.auth.release(ctx.identity, ctx.charged_tokens, None if tokens is None else sum(tokens))
        attempt = self._attempt
        if self._outcome != "client_cancelled":
            result = _slo_result(self._outcome, ctx.identity.tier, summary, tokens, ctx.request)
            if result is not None:
                deps.goodput.record(model, self._tier, result, tokens[1] if tokens else None)
        if self._outcome in ("ok", "client_cancelled"):
            metrics.observe(model, self._tier, summary, self._request.stream)
            if attempt is not None:
                label = attempt.worker.label
                worker_itl = metrics.worker_itl.labels(label)
                for gap in summary.itl_s:
                    worker_itl.observe(gap)
                if tokens is not None:
                    metrics.worker_completion_tokens.labels(label).inc(tokens[1])
                    deps.sizer.observe(model, self._request.size, tokens[0])
                    deps.pool.record_tokens(attempt.worker, *tokens)
                    attempt.worker.pace.observe_stream(tokens[1], summary.output_events)
                load = attempt.decode_load
                if self._outcome == "ok" and summary.tpot_s is not None and load is not None:
                    attempt.worker.latency.observe_tpot(load, summary.tpot_s)
                if self._outcome == "ok" and self._request.stream:
                    worker_ttft = (
                        None if attempt.first is None else attempt.first - attempt.dispatched
                    )
                    deps.admission.learn(
                        attempt.worker, worker_ttft, summary.tpot_s, attempt.prefill_peers, load
                    )
        if deps.settings.access_log:
            log.info(
                "%s %s model=%s tier=%s worker=%s status=%d outcome=%s queue_ms=%s ttft_ms=%s "
                "tpot_ms=%s e2e_ms=%s events=%d prompt_tokens=%s completion_tokens=%s",
                self._request_id, endpoint, model, self._tier,
                attempt.worker.label if attempt else "-", self._status, self._outcome,
                _ms(summary.queue_s), _ms(summary.ttft_s), _ms(summary.tpot_s),
                _ms(summary.e2e_s), summary.output_events,
                *(tokens if tokens is not None else (None, None)),
            )  # fmt: skip


def _slo_result(
    outcome: str,
    tier: TierSpec,
    summary: TimingSummary,
    tokens: tuple[int, int] | None,
    request: ParsedRequest,
) -> str | None:
    if outcome == "ok":
        return slo_result(tier, summary, tokens[1] if tokens else None, request.stream)
    if outcome == "rejected":
        return "rejected"
    if outcome in ("upstream_error", "timeout"):
        return "errored"
    return None  # the client's own mistake: no SLO applies


def _earliest(a: float, b: float | None) -> float:
    return a if b is None or a < b else b


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "no cause"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _client_gone(receive: Receive) -> None:
    """Return when the client disconnects (the body was read already)."""
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


def error_response(error: GatewayError) -> Response:
    """A plain JSON response for an error raised before a relay starts."""
    return Response(
        content=error.to_json(),
        status_code=error.status_code,
        media_type="application/json",
        headers=error.headers(),
    )


__all__ = ["CLIENT_CLOSED", "Relay", "RelayDeps", "error_body", "error_response"]

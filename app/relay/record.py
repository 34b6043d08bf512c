"""The end of a request, recorded in one place.

Metrics, goodput, the key's allowance, what the worker's models learn, and the access-log line.

Every request relayed by model that got as far as its route ends here exactly once, whether the
relay served it or it was refused before (bad body, unknown key, key quota, no worker). Every other
response is recorded by :meth:`Recorder.plain` (from :mod:`app.http.trace` and
:mod:`app.http.server`), so that each response leaves one access-log line and one
``gateway_requests_total`` count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from app.api.errors import GatewayError, RateLimited, UpstreamUnavailable
from app.api.outcome import Decision, Outcome, Reason
from app.api.protocol import Endpoint, ParsedRequest
from app.fleet.lease import Lease
from app.observe.goodput import GoodputTracker, judge
from app.observe.metrics import GatewayMetrics
from app.observe.timing import TimingSummary
from app.settings import Settings, TierSpec

log = logging.getLogger("app.access")

# The endpoints whose requests count towards the tiers' SLOs (the tokenizer's do not).
_JUDGED = frozenset(endpoint.value for endpoint in Endpoint if endpoint.judged)


@dataclass(slots=True)
class RequestEnd:
    """What one finished request leaves behind."""

    request_id: str
    endpoint: str
    model: str
    """A bounded label: a served model or ``other``."""
    tier: TierSpec
    status: int
    outcome: Outcome
    timing: TimingSummary
    waited_s: float
    """Arrival to the end."""
    tokens: tuple[int, int] | None = None
    """``(prompt, completion)`` from the worker's usage."""
    cached_tokens: int | None = None
    """Of the prompt, the tokens the worker found in its prefix cache (None: not told)."""
    request: ParsedRequest | None = None
    lease: Lease | None = None
    """The last attempt's lease (released already)."""


def learns(end: RequestEnd) -> bool:
    """Whether ``end``'s latencies describe the service.

    A judged endpoint's request, served (or cancelled by its client while served): the latency
    histograms and the workers' models take only those.
    """
    return (
        end.endpoint in _JUDGED
        and end.outcome in (Outcome.OK, Outcome.CLIENT_CANCELLED)
        and end.request is not None
    )


class Recorder:
    """Records the end of every request (:meth:`finish`)."""

    def __init__(
        self, settings: Settings, metrics: GatewayMetrics, goodput: GoodputTracker
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._goodput = goodput

    def refused(self, end: RequestEnd, error: GatewayError) -> None:
        """A request turned away before admission saw it: its key's quota, or no worker."""
        if isinstance(error, RateLimited):
            self._metrics.decide(end.tier.name, Decision.REJECTED, Reason.KEY_QUOTA)
        elif isinstance(error, UpstreamUnavailable):
            self._metrics.decide(end.tier.name, Decision.REJECTED, Reason.NO_WORKER)
        self.finish(end)

    def finish(self, end: RequestEnd) -> None:
        """Count one finished request, whatever its outcome: metrics, goodput, the access line.

        It only counts: the slots the request held were given back before (the relay's), and
        what it teaches admission and the fleet is :class:`app.relay.feedback.Feedback`'s.
        """
        metrics, tier, tokens, request = self._metrics, end.tier.name, end.tokens, end.request
        metrics.count(end.model, tier, end.endpoint, end.status, end.outcome, tokens)
        stream = request is not None and request.stream
        max_tokens = None if request is None else request.max_tokens
        completion = None if tokens is None else tokens[1]
        # The tokenizer's answers are counted, but they are no service level: their latencies
        # would only dilute the model's histograms, and the engine learns nothing from them.
        judged = end.endpoint in _JUDGED
        result = None
        if judged:
            # A prefill-only answer is not streamed and has no completion tokens: judged on its
            # whole latency against the TTFT target (:func:`app.observe.goodput.judge`).
            result = judge(
                end.outcome, end.tier, end.timing, completion, stream, end.waited_s, max_tokens
            )
        if result is not None:
            self._goodput.record(end.model, tier, result, completion)
        lease, cached = end.lease, end.cached_tokens
        if lease is not None and cached is not None and tokens is not None:
            # The worker's own count for this gateway's requests, beside what routing predicted
            # for each: a prediction over what was found gave a cache credit in vain.
            worker = lease.worker.label
            metrics.worker_prefix_found.labels(worker).inc(cached)
            metrics.worker_prefix_told.labels(worker).inc(tokens[0])
            missed = lease.choice.cached_tokens - cached
            if missed > 0:
                metrics.worker_prefix_missed.labels(worker).inc(missed)
        if learns(end):
            metrics.observe(end.model, tier, end.timing, stream)
            if end.lease is not None:
                worker = end.lease.worker.label
                metrics.worker_itl.labels(worker).observe_all(end.timing.itl_s)
                if tokens is not None:
                    metrics.worker_completion_tokens.labels(worker).inc(tokens[1])
        if self._settings.access_log:
            self._log(end)

    def plain(
        self, request_id: str, endpoint: str, status: int, outcome: Outcome, seconds: float
    ) -> None:
        """Record a response that is no generation request's (or one refused before its route).

        It has no model or tier: both labels are empty, so per-tier series are not inflated by
        probes and scrapes.
        """
        self._metrics.count("", "", endpoint, status, outcome, None)
        if self._settings.access_log:
            log.info(
                _LINE, request_id, endpoint, "-", "-", "-", status, outcome, "-", "-", "-",
                _ms(seconds), 0, None, None, "-", "-",
            )  # fmt: skip

    @staticmethod
    def _log(end: RequestEnd) -> None:
        timing, tokens = end.timing, end.tokens
        log.info(
            _LINE,
            end.request_id, end.endpoint, end.model, end.tier.name,
            end.lease.worker.label if end.lease else "-", end.status, end.outcome,
            _ms(timing.queue_s), _ms(timing.ttft_s), _ms(timing.tpot_s), _ms(timing.e2e_s),
            timing.output_events, *(tokens if tokens is not None else (None, None)),
            "-" if end.cached_tokens is None else end.cached_tokens,
            "-" if end.lease is None else int(end.lease.choice.cached_tokens),
        )  # fmt: skip


_LINE = (
    "%s %s model=%s tier=%s worker=%s status=%d outcome=%s queue_ms=%s ttft_ms=%s tpot_ms=%s "
    "e2e_ms=%s events=%d prompt_tokens=%s completion_tokens=%s cached_tokens=%s "
    "predicted_cached=%s"
)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"

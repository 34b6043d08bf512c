"""Goodput: requests that met every SLO of their tier, counted live.

What counts (the denominator):

* A streamed answer meets its tier when TTFT <= the TTFT target and TPOT <= the TPOT target
  (a tier without a TPOT target, or a one-token answer, has only the first).
* A non-streamed answer has no TTFT of its own: it meets its tier when its whole latency fits
  the budget the targets allow it, TTFT target + TPOT target x (tokens - 1), and misses on
  that E2E (``missed_e2e``).
* Turned away by admission (429/503 of the gateway's queue) or by the gateway's own limits
  (503 ``gateway_saturated``) counts as ``rejected``; a worker's failure or time-out as
  ``errored``.
* A client that gave up counts as a miss when its wait had already missed: a stream after its
  TTFT target passed without a first token (or with a late one), a non-streamed request after
  its whole budget (for ``max_tokens``, when given) passed. A client that left earlier is not
  counted: nothing was missed yet.
* Not counted at all: the client's own mistakes (4xx) and its key's own quota (a key over its
  limit is the client's limit, not a shortfall of the service).
"""

from __future__ import annotations

import math
from collections import deque

from app.api.outcome import Outcome, SloResult
from app.observe.metrics import GatewayMetrics
from app.observe.timing import Clock, TimingSummary
from app.settings import TierSpec


def slo_result(
    tier: TierSpec, timing: TimingSummary, tokens: int | None, stream: bool
) -> SloResult:
    """Which of the tier's SLOs an answered request met: ``met`` or the ``missed_*`` kind."""
    if not stream:
        if timing.e2e_s is None:
            return SloResult.ERRORED
        return SloResult.MET if timing.e2e_s <= _budget(tier, tokens) else SloResult.MISSED_E2E
    ttft_ok = timing.ttft_s is not None and timing.ttft_s <= tier.ttft_slo_s
    tpot_ok = tier.tpot_slo_s is None or timing.tpot_s is None or timing.tpot_s <= tier.tpot_slo_s
    if ttft_ok and tpot_ok:
        return SloResult.MET
    if not ttft_ok and not tpot_ok:
        return SloResult.MISSED_BOTH
    return SloResult.MISSED_TPOT if ttft_ok else SloResult.MISSED_TTFT


def judge(
    outcome: Outcome,
    tier: TierSpec,
    timing: TimingSummary,
    tokens: int | None,
    stream: bool,
    waited_s: float,
    max_tokens: int | None,
) -> SloResult | None:
    """The SLO result a finished request counts as, or None when it does not count.

    ``waited_s`` is arrival to the end, ``max_tokens`` what the client asked for (the budget
    of a non-streamed request its client gave up on).
    """
    if outcome is Outcome.OK:
        return slo_result(tier, timing, tokens, stream)
    if outcome in (Outcome.REJECTED, Outcome.GATEWAY_SATURATED):
        return SloResult.REJECTED
    if outcome in (
        Outcome.UPSTREAM_ERROR,
        Outcome.TIMEOUT,
        Outcome.GATEWAY_SHUTDOWN,
        Outcome.INTERNAL_ERROR,
    ):
        return SloResult.ERRORED
    if outcome is Outcome.CLIENT_CANCELLED:
        if not stream:
            return SloResult.MISSED_E2E if waited_s > _budget(tier, max_tokens) else None
        if timing.ttft_s is not None:
            return SloResult.MISSED_TTFT if timing.ttft_s > tier.ttft_slo_s else None
        return SloResult.MISSED_TTFT if waited_s > tier.ttft_slo_s else None
    return None


def _budget(tier: TierSpec, tokens: int | None) -> float:
    """The latency a whole answer of ``tokens`` may take in ``tier``."""
    return tier.ttft_slo_s + (tier.tpot_slo_s or 0.0) * max(0, (tokens or 1) - 1)


class GoodputTracker:
    """Counts SLO results per model and tier, and keeps a sliding-window goodput ratio."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        tiers: tuple[TierSpec, ...],
        clock: Clock,
        window_s: float = 60.0,
    ) -> None:
        self._metrics = metrics
        self._clock = clock
        self._window = window_s
        self._recent: dict[str, deque[tuple[float, bool]]] = {t.name: deque() for t in tiers}
        for tier in tiers:
            metrics.tier_objective.labels(tier.name).set(tier.objective)
            metrics.goodput_ratio.labels(tier.name).set(math.nan)
            metrics.tier_ttft_slo.labels(tier.name).set(tier.ttft_slo_s)
            if tier.tpot_slo_s is not None:
                metrics.tier_tpot_slo.labels(tier.name).set(tier.tpot_slo_s)

    def record(
        self, model: str, tier: str, result: SloResult, completion_tokens: int | None
    ) -> None:
        """Count one request's result."""
        self._metrics.slo_requests.labels(model, tier, result).inc()
        if result is SloResult.MET and completion_tokens:
            self._metrics.goodput_tokens.labels(model, tier).inc(completion_tokens)
        recent = self._recent.get(tier)
        if recent is not None:
            recent.append((self._clock(), result is SloResult.MET))

    def ratio(self, tier: str) -> float | None:
        """Share of the tier's requests in the window that met every SLO (None if none)."""
        recent = self._recent[tier]
        horizon = self._clock() - self._window
        while recent and recent[0][0] < horizon:
            recent.popleft()
        if not recent:
            return None
        return sum(1 for _, met in recent if met) / len(recent)

    def export(self) -> None:
        """Refresh the live goodput gauges (just before an export).

        A tier with no request in the window reads NaN ("no data"), never its last figure.
        """
        for tier in self._recent:
            ratio = self.ratio(tier)
            self._metrics.goodput_ratio.labels(tier).set(math.nan if ratio is None else ratio)

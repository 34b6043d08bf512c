"""Goodput: requests that met every SLO of their tier, counted live.

A streamed request meets its tier when TTFT <= the TTFT target and TPOT <= the TPOT target (a
tier without a TPOT target, or a one-token answer, has only the first). A non-streamed request
has no TTFT of its own; it meets its tier when its whole latency fits the budget the targets
allow it: TTFT target + TPOT target x (tokens - 1). Rejected and failed requests count against
goodput; a request whose client went away is not counted at all.
"""

from __future__ import annotations

from collections import deque

from app.metrics import GatewayMetrics
from app.settings import TierSpec
from app.timing import Clock, TimingSummary


def slo_result(tier: TierSpec, timing: TimingSummary, tokens: int | None, stream: bool) -> str:
    """Which of the tier's SLOs a finished request met: ``met`` or the ``missed_*`` kind."""
    if not stream:
        if timing.e2e_s is None:
            return "errored"
        budget = tier.ttft_slo_s + (tier.tpot_slo_s or 0.0) * max(0, (tokens or 1) - 1)
        return "met" if timing.e2e_s <= budget else "missed_ttft"
    ttft_ok = timing.ttft_s is not None and timing.ttft_s <= tier.ttft_slo_s
    tpot_ok = tier.tpot_slo_s is None or timing.tpot_s is None or timing.tpot_s <= tier.tpot_slo_s
    if ttft_ok and tpot_ok:
        return "met"
    if not ttft_ok and not tpot_ok:
        return "missed_both"
    return "missed_tpot" if ttft_ok else "missed_ttft"


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
            metrics.tier_ttft_slo.labels(tier.name).set(tier.ttft_slo_s)
            if tier.tpot_slo_s is not None:
                metrics.tier_tpot_slo.labels(tier.name).set(tier.tpot_slo_s)

    def record(self, model: str, tier: str, result: str, completion_tokens: int | None) -> None:
        """Count one request's result."""
        self._metrics.slo_requests.labels(model, tier, result).inc()
        if result == "met" and completion_tokens:
            self._metrics.goodput_tokens.labels(model, tier).inc(completion_tokens)
        recent = self._recent.get(tier)
        if recent is not None:
            recent.append((self._clock(), result == "met"))

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
        """Refresh the live goodput gauges (just before an export)."""
        for tier in self._recent:
            ratio = self.ratio(tier)
            if ratio is not None:
                self._metrics.goodput_ratio.labels(tier).set(ratio)

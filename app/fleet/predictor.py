"""Online latency models of a worker, learnt from the gateway's own measurements.

Two straight lines per worker, each fitted by exponentially weighted least squares:

* prefill: ``TTFT = base + per_token * prefill_tokens``, where ``prefill_tokens`` is the work the
  worker has to prefill before this request's first token (its prompt plus the prompts of the
  requests dispatched before it that have not produced a first token yet), scaled up by the
  running batch because decode steps share the worker with prefill;
* decode: ``TPOT = step + per_seq * running``: a decode step gets slower as the batch grows.

Both start from priors (pseudo-observations) so they predict something sane before any data,
and forget old data so they follow a worker whose speed changes.

Routing uses the prefill line to rank workers; both lines are exported as gauges. Admission
does not gate on them (see :mod:`app.fleet.limiter`): under load the fits were seen to swing by 10x.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass


class OnlineLinear:
    """``y = intercept + slope * x`` fitted online, with exponential forgetting."""

    __slots__ = (
        "_decay", "_n", "_prior_intercept", "_prior_slope", "_x", "_xx", "_xy", "_y", "intercept",
        "observed", "slope",
    )  # fmt: skip

    def __init__(self, intercept: float, slope: float, decay: float = 0.98) -> None:
        self._decay = decay
        self._prior_intercept = intercept
        self._prior_slope = slope
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        # Two pseudo-points on the prior line, weighted as a handful of real observations.
        for x in (0.0, 1.0):
            for _ in range(3):
                self._add(x, intercept + slope * x)
        self.observed = 0
        """Observations so far, the prior's pseudo-points not counted."""
        self.slope = slope
        """The fitted slope, never negative (latency does not fall as work grows)."""
        self.intercept = intercept
        """The fitted intercept, never negative."""
        self._fit()

    def observe(self, x: float, y: float) -> None:
        """Add one observation; older ones weigh ``decay`` times less each time."""
        self.observed += 1
        self._add(x, y)
        self._fit()

    def _add(self, x: float, y: float) -> None:
        d = self._decay
        self._n = self._n * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y

    def _fit(self) -> None:
        # Fitted when an observation comes, not when read: routing and admission read the
        # line for every worker several times per request, and it learns once per request.
        denom = self._n * self._xx - self._x * self._x
        if denom <= 1e-12 * max(1.0, self._n * self._xx):
            slope = self._prior_slope
        else:
            slope = max(0.0, (self._n * self._xy - self._x * self._y) / denom)
        self.slope = slope
        self.intercept = max(0.0, (self._y - slope * self._x) / self._n)

    def predict(self, x: float) -> float:
        """``intercept + slope * x``."""
        return self.intercept + self.slope * x

    @property
    def mean_x(self) -> float:
        """The weighted mean of the observed ``x`` (the prior's pseudo-points included)."""
        return self._x / self._n

    @property
    def spread(self) -> float:
        """The weighted standard deviation of the observed ``x``: how well the slope is known."""
        mean = self._x / self._n
        return math.sqrt(max(0.0, self._xx / self._n - mean * mean))


class RecentQuantile:
    """A quantile of the last ``size`` observations of the last ``window_s`` seconds.

    For example a worker's recent times to first token. Kept sorted as they come, so reading
    the quantile is one index. Observations age out: an overload's slow first tokens would
    otherwise stand for the next 50 requests, which at a light load take a minute to come,
    and turn requests away on a worker that has long been idle.
    """

    __slots__ = ("_order", "_quantile", "_size", "_sorted", "_window")

    def __init__(self, quantile: float, size: int = 50, window_s: float = 10.0) -> None:
        self._quantile = quantile
        self._size = size
        self._window = window_s
        self._order: deque[tuple[float, float]] = deque()
        """``(when, value)`` in the order observed."""
        self._sorted: list[float] = []

    def observe(self, value: float, now: float) -> None:
        """Add ``value`` seen at ``now``, forgetting the oldest once the window is full."""
        self._forget(now)
        if len(self._order) == self._size:
            self._drop()
        self._order.append((now, value))
        bisect.insort(self._sorted, value)

    def value(self, now: float, default: float = 0.0) -> float:
        """The quantile of the window (nearest rank), or ``default`` when it is empty."""
        self._forget(now)
        ordered = self._sorted
        if not ordered:
            return default
        return ordered[min(len(ordered) - 1, int(self._quantile * len(ordered)))]

    def _forget(self, now: float) -> None:
        order, since = self._order, now - self._window
        while order and order[0][0] < since:
            self._drop()

    def _drop(self) -> None:
        _, value = self._order.popleft()
        del self._sorted[bisect.bisect_left(self._sorted, value)]


# Decode steps and prefill share the worker: each running sequence slows prefill a little.
_PREFILL_INTERFERENCE_PER_RUNNING = 0.02


@dataclass(slots=True)
class WorkerLoad:
    """The load a new request would meet on a worker."""

    prefill_tokens_ahead: float
    """Prompt tokens dispatched to the worker that have not produced a first token yet."""
    running: float
    """Requests being decoded (the larger of the gateway's count and the worker's own)."""
    waiting: float
    """Requests the worker reports as queued (from its /metrics)."""


class LatencyModel:
    """Predicts TTFT and TPOT on one worker; learns from every finished request."""

    __slots__ = ("decode", "prefill")

    def __init__(
        self,
        prefill_base_s: float = 0.03,
        prefill_s_per_token: float = 0.0002,
        decode_step_s: float = 0.02,
        decode_s_per_seq: float = 0.001,
    ) -> None:
        self.prefill = OnlineLinear(prefill_base_s, prefill_s_per_token)
        self.decode = OnlineLinear(decode_step_s, decode_s_per_seq)

    @staticmethod
    def prefill_work(own_tokens: float, load: WorkerLoad) -> float:
        """The prefill work (in effective tokens) ahead of and including this request."""
        return (own_tokens + load.prefill_tokens_ahead) * (
            1.0 + _PREFILL_INTERFERENCE_PER_RUNNING * load.running
        )

    def predict_ttft(self, own_tokens: float, load: WorkerLoad) -> float:
        """Expected time to first token if the request were dispatched now."""
        return self.prefill.predict(self.prefill_work(own_tokens, load))

    def observe_ttft(self, work: float, ttft: float) -> None:
        """Learn from a measured TTFT and the prefill work it was dispatched behind."""
        self.prefill.observe(work, ttft)

    def observe_tpot(self, running: float, tpot: float) -> None:
        """Learn from a measured TPOT and the mean batch it decoded in."""
        self.decode.observe(running, tpot)


class PromptSizer:
    """Estimates a prompt's tokens from its request body's size, per model.

    The gateway does not tokenize; the ratio of prompt tokens to body bytes is learnt from the
    ``usage`` of finished requests (chat templates and JSON framing included).
    """

    __slots__ = ("_alpha", "_prior", "_ratio")

    def __init__(self, bytes_per_token: float = 4.0, alpha: float = 0.05) -> None:
        self._prior = 1.0 / bytes_per_token
        self._alpha = alpha
        self._ratio: dict[str, float] = {}

    def estimate(self, model: str, body_bytes: int) -> float:
        """Expected prompt tokens of a request whose body is ``body_bytes`` long."""
        return body_bytes * self._ratio.get(model, self._prior)

    def observe(self, model: str, body_bytes: int, prompt_tokens: int) -> None:
        """Learn from a finished request's real prompt token count."""
        if body_bytes <= 0:
            return
        ratio = prompt_tokens / body_bytes
        old = self._ratio.get(model)
        self._ratio[model] = ratio if old is None else old + self._alpha * (ratio - old)

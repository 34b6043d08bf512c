"""What a relayed request teaches admission and the fleet while it runs, and the slot it gives back.

The relay's attempts report what happened (the first output, the gaps between outputs, the
end); :class:`Feedback` turns each report into what the workers' models, the learnt limits
and admission's demand take from it. It only learns: counting (metrics of the finished
request, goodput, the access line) is :mod:`app.relay.record`'s, at the end.
"""

from __future__ import annotations

from app.admission.queue import AdmissionController
from app.api.outcome import Outcome
from app.api.protocol import ParsedRequest
from app.fleet.lease import Lease
from app.fleet.predictor import PromptSizer
from app.fleet.workers import WorkerPool
from app.observe.metrics import GatewayMetrics
from app.observe.timing import TimingSummary


class Feedback:
    """One request's reports to admission and the fleet.

    ``engine``: the request runs on the engine (the tokenizer's answers do not, and nothing of
    their latency is learnt). ``stream``: its first token is a streamed one, which the prefill
    limit learns from.
    """

    __slots__ = ("_admission", "_engine", "_metrics", "_pool", "_sizer", "_stream", "_tier")

    def __init__(
        self,
        pool: WorkerPool,
        admission: AdmissionController,
        metrics: GatewayMetrics,
        sizer: PromptSizer,
        tier: str,
        *,
        engine: bool,
        stream: bool,
    ) -> None:
        self._pool = pool
        self._sizer = sizer
        self._admission = admission
        self._metrics = metrics
        self._tier = tier
        self._engine = engine
        self._stream = stream

    def first_output(self, lease: Lease, at: float) -> None:
        """The worker produced its first output (or its whole answer) at ``at``: prefill is over.

        Only the first report of a lease counts.
        """
        if not lease.first_output(at):
            return
        worker = lease.worker
        self._pool.report_success(worker)
        if not self._engine:
            return  # the tokenizer's answer: no prefill to learn from
        ttft = at - lease.dispatched
        if self._stream:
            self._admission.limits.first_token(worker, ttft, lease.prefill_peers, at)
        worker.latency.observe_ttft(lease.choice.prefill_work, ttft)
        worker.recent_ttft.observe(ttft, at)
        self._metrics.worker_ttft.labels(worker.label).observe(ttft)
        self._metrics.prediction_error.labels(self._tier).observe(
            abs(ttft - lease.choice.predicted_ttft_s)
        )
        self._admission.poke()  # the prefill is done: capacity may be free for a queued request

    def outputs(self, lease: Lease, count: int, before: float | None, received: float) -> None:
        """``count`` output events came together at ``received``; the previous one at ``before``.

        The first (``before`` None) ends the prefill; every later one is a gap of the worker's
        pace (those after the first of a batch, gaps of zero).
        """
        if before is None:
            self.first_output(lease, received)
        else:
            self._gap(lease, received - before, received)
        for _ in range(count - 1):
            self._gap(lease, 0.0, received)

    def _gap(self, lease: Lease, gap: float, at: float) -> None:
        pace = lease.output_gap(gap, at)
        if pace is not None:
            self._admission.limits.paced(lease.worker, pace, at)

    def released(self, lease: Lease, now: float, output_events: int) -> None:
        """The attempt on ``lease`` ended at ``now``: its slot is given back, once.

        Its hold tells the tier's demand (engine requests only), and admission dispatches.
        """
        if not lease.release(now):
            return
        if self._engine:
            self._admission.completed(
                self._tier, now - lease.dispatched, *lease.decoded(now, output_events), lease.worker
            )
        else:
            self._admission.poke()  # its slot is free; its hold says nothing of the tier's demand

    def served(
        self,
        lease: Lease,
        model: str,
        request: ParsedRequest,
        timing: TimingSummary,
        tokens: tuple[int, int] | None,
        outcome: Outcome,
    ) -> None:
        """What the worker's models and limits learn from a request it served to the end.

        ``model`` is the bounded label the prompt sizer learns under. Only requests whose
        latencies describe the service (:func:`app.relay.record.learns`) are given here.
        """
        worker = lease.worker
        if tokens is not None:
            if request.upload is None:  # an upload's size is audio, not prompt text
                self._sizer.observe(model, request.size, tokens[0])
            self._pool.record_tokens(worker, *tokens)
            worker.pace.observe_stream(tokens[1], timing.output_events)
        if outcome is not Outcome.OK:
            return
        load = lease.decode_load
        if timing.tpot_s is not None and load is not None:
            worker.latency.observe_tpot(load, timing.tpot_s)
        if request.stream:
            # The prefill limit learnt from the first token when it came (the relay).
            self._admission.limits.learn(worker, timing.tpot_s, self._pool.now(), load)

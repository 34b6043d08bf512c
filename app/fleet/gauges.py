"""The pool's workers in the gateway's metrics: their series, their state, what is exported.

:class:`WorkerGauges` owns how a worker shows in :class:`app.observe.metrics.GatewayMetrics`:
every per-worker series starts at 0 when the worker joins (so ``rate()`` and ``increase()`` see
a series before the first event), goes when it leaves, shows up or ejected as the pool's
verdicts say, and the figures that depend on time or on several readings are refreshed just
before an export. The pool (:mod:`app.fleet.workers`) decides; this module only shows.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Protocol

from app.api.outcome import LimitCut
from app.fleet.kvindex import KVIndex
from app.fleet.predictor import WorkerLoad
from app.fleet.prefix import PrefixIndex
from app.observe.metrics import GatewayMetrics
from app.settings import Settings, WorkerSpec


class GaugedWorker(Protocol):
    """What the export reads of a worker (:class:`app.fleet.workers.Worker`)."""

    @property
    def label(self) -> str:
        """The worker's name in every series."""

    @property
    def spec(self) -> WorkerSpec:
        """How it was configured (its hardware, if given)."""

    @property
    def prefixes(self) -> PrefixIndex:
        """The prompt prefixes routed to it."""

    @property
    def kv(self) -> KVIndex | None:
        """The blocks its KV cache events say it holds (None: not followed)."""

    @property
    def context_tokens(self) -> float:
        """Its typical prompt + completion tokens."""

    def healthy(self, now: float) -> bool:
        """Whether new requests may go to it."""

    def current_load(self, now: float, max_age: float) -> tuple[WorkerLoad, bool]:
        """The load a request would meet there, and whether it is fresh."""


class WorkerGauges:
    """Each worker's series in the gateway's metrics (see the module's doc)."""

    def __init__(self, settings: Settings, metrics: GatewayMetrics) -> None:
        self._settings = settings
        self._metrics = metrics

    def added(self, label: str, models: Iterable[str]) -> None:
        """A worker joined: its series start (down, not ejected, every counter at 0)."""
        metrics = self._metrics
        metrics.worker_up.labels(label).set(0)
        metrics.worker_ejected.labels(label).set(0)
        for counter in (
            metrics.worker_ejections,
            metrics.worker_failovers,
            metrics.worker_routed,
            metrics.worker_completion_tokens,
            metrics.worker_prefix_queries,
            metrics.worker_prefix_hits,
        ):
            counter.labels(label)
        for cause in LimitCut:
            metrics.worker_limit_cuts.labels(label, cause)
        for model in models:
            metrics.start_model(model)

    def removed(self, label: str) -> None:
        """A worker left: its series go."""
        self._metrics.forget_worker(label)

    def state(self, label: str, up: bool, ejected: bool) -> None:
        """Show the worker up (taking requests) or not, and ejected or not."""
        self._metrics.worker_up.labels(label).set(1 if up else 0)
        self._metrics.worker_ejected.labels(label).set(1 if ejected else 0)

    def export(self, workers: Collection[GaugedWorker], now: float) -> None:
        """Refresh the gauges that depend on time or on several figures (before an export)."""
        metrics, settings = self._metrics, self._settings
        metrics.set_load_age(now)
        metrics.workers_known.set(len(workers))
        metrics.workers_healthy.set(sum(1 for w in workers if w.healthy(now)))
        index_bytes = 0
        for worker in workers:
            index_bytes += worker.prefixes.nbytes()
            metrics.worker_prefix_blocks.labels(worker.label).set(len(worker.prefixes))
            kv = worker.kv
            if kv is not None:
                index_bytes += kv.nbytes()
                metrics.worker_kv_blocks.labels(worker.label).set(len(kv))
                metrics.worker_kv_complete.labels(worker.label).set(1 if kv.complete else 0)
                metrics.kv_followed(worker.label)
            hardware = worker.spec.hardware or settings.hardware
            if hardware is not None:
                metrics.set_hardware(worker.label, hardware)
                load, _ = worker.current_load(now, settings.load_max_age_s)
                # Sequences are on average half-way through their answers.
                context = max(1.0, worker.context_tokens / 2)
                metrics.set_roofline(worker.label, hardware, load.running, context)
        metrics.prefix_index_bytes.set(index_bytes)

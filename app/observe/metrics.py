"""Prometheus metrics of the gateway, in the ``gateway_`` namespace, on a registry of its own.

Label values are bounded by construction: ``model`` is a served model name or ``other``,
``endpoint`` and ``outcome`` are enums, ``status_class`` is ``2xx``..``5xx``, ``worker`` is a
configured worker's label. Nothing a client controls freely becomes a label.

With several processes (``GATEWAY_PROCESSES``), prometheus_client's multiprocess mode gives one
``/metrics`` for the pod: every process writes its samples to files in the directory
``PROMETHEUS_MULTIPROC_DIR`` (made by :mod:`app.supervisor`), and whichever process answers
``/metrics`` merges them all. Counters and histograms add up; each gauge says how its
processes' values combine (``multiprocess_mode``; ``live*`` modes forget a process that died):
counts of requests add up (``livesum``), a worker's limits and learnt figures are the largest
any process has (``livemax``), a scraped figure is the latest (``livemostrecent``).
"""

from __future__ import annotations

import bisect
import contextlib
import os
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Self

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client import utils as prometheus_utils
from prometheus_client import values as prometheus_values
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from app.api.outcome import DECISION_REASONS, Decision, LimitCut, Reason, SloResult
from app.api.protocol import Endpoint
from app.observe.looplag import LAG_BUCKETS
from app.observe.timing import TimingSummary
from app.settings import OVERHEAD_BUCKETS, Hardware, Settings

# How prometheus_client writes a bucket bound ("+Inf", "0.005", "1.0").
_go_float: Callable[[float], str] = prometheus_utils.floatToGoString

OTHER_MODEL = "other"
MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client's variable: the directory every process writes its samples to."""


def multiprocess_dir() -> str | None:
    """The directory of prometheus_client's multiprocess mode, if this process runs in it.

    prometheus_client chooses where samples go (memory or files) when it is imported, from the
    environment the supervisor gave the process.
    """
    path = os.environ.get(MULTIPROCESS_DIR)
    return path if path and os.path.isdir(path) else None


class _KeptChildren(MetricWrapperBase):
    """A labelled metric whose children are kept by their label values once made.

    prometheus_client's ``labels`` checks the values, converts each to ``str`` and takes a lock
    on every call, and a request makes about twenty such calls for label values that repeat:
    here they are one dict lookup.
    """

    _kept: dict[tuple[object, ...], Any]

    def labels(self, *labelvalues: object, **labelkwargs: object) -> Self:
        """The child for these label values (prometheus_client's, made on first use)."""
        kept = self.__dict__.get("_kept")
        if kept is None:
            kept = self._kept = {}
        child = kept.get(labelvalues)
        if child is None:
            child = super().labels(*labelvalues, **labelkwargs)
            if not labelkwargs:
                kept[labelvalues] = child
        return child

    def remove(self, *labelvalues: Any) -> None:
        """Drop a child's series (and the child kept for it)."""
        self.__dict__.get("_kept", {}).pop(labelvalues, None)
        super().remove(*labelvalues)

    def remove_by_labels(self, labels: dict[str, str]) -> None:
        """Drop the series these labels match (and every kept child: they are made again)."""
        self.__dict__.pop("_kept", None)
        super().remove_by_labels(labels)

    def clear(self) -> None:
        """Drop every child's series."""
        self.__dict__.pop("_kept", None)
        super().clear()


class Counter(_KeptChildren, prometheus_client.Counter):
    """prometheus_client's counter, its children kept (:class:`_KeptChildren`)."""


class Gauge(_KeptChildren, prometheus_client.Gauge):
    """prometheus_client's gauge, its children kept (:class:`_KeptChildren`)."""


class Histogram(_KeptChildren, prometheus_client.Histogram):
    """prometheus_client's histogram, its children kept (:class:`_KeptChildren`)."""


UPSTREAM_CONNECTIONS = "upstream_connections"
"""The ``resource`` of ``gateway_saturated_total``: the gateway's connections to the workers."""
EVENT_LOOP = "event_loop"
"""The ``resource`` of ``gateway_saturated_total``: the gateway's event loop, too busy to connect
to a worker in time."""


class BatchHistogram(Collector):
    """A labelled histogram whose children take a request's samples in one call.

    For the per-token series (ITL): prometheus_client's Histogram takes a lock and scans its
    bounds once per sample, 31 times per 32-token stream and series. Here a request's gaps are
    counted with a binary search each, without locks (the gateway runs on one event loop).
    The exposition is the same as prometheus_client's histogram, ``_created`` included.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != float("inf"):
            bounds.append(float("inf"))
        self._bounds = tuple(bounds)
        self._les = tuple(_go_float(b) for b in bounds)
        self._children: dict[tuple[str, ...], BatchHistogramChild] = {}
        self._files = multiprocess_dir() is not None
        registry.register(self)

    def labels(self, *values: str) -> BatchHistogramChild:
        """The child for these label values (created at zero on first use)."""
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name} takes labels {self._labelnames}")
            if self._files:
                child = FileBatchHistogramChild(
                    self._bounds, self._les, self._name, self._documentation, self._labelnames,
                    values,
                )  # fmt: skip
            else:
                child = BatchHistogramChild(self._bounds)
            self._children[values] = child
        return child

    def remove(self, *values: str) -> None:
        """Drop a child's series."""
        del self._children[values]

    def describe(self) -> list[Metric]:
        """The metric without samples (so registering does not collect)."""
        return [Metric(self._name, self._documentation, "histogram")]

    def collect(self) -> Iterator[Metric]:
        """The histogram's samples, as prometheus_client's Histogram exposes them."""
        metric = Metric(self._name, self._documentation, "histogram")
        names = self._labelnames
        for values, child in list(self._children.items()):
            labels = dict(zip(names, values, strict=True))
            total = 0
            for le, count in zip(self._les, child.counts, strict=True):
                total += count
                metric.add_sample(f"{self._name}_bucket", {**labels, "le": le}, total)
            metric.add_sample(f"{self._name}_count", labels, total)
            metric.add_sample(f"{self._name}_sum", labels, child.sum)
            metric.add_sample(f"{self._name}_created", labels, child.created)
        yield metric


class BatchHistogramChild:
    """One label set of a :class:`BatchHistogram`."""

    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()  # a wall-clock timestamp, as Prometheus' _created is

    def observe(self, value: float) -> None:
        """Count one sample."""
        self.counts[bisect.bisect_left(self._bounds, value)] += 1
        self.sum += value

    def observe_all(self, values: Iterable[float]) -> None:
        """Count every sample of ``values``."""
        bounds, counts, find = self._bounds, self.counts, bisect.bisect_left
        total = 0.0
        for value in values:
            counts[find(bounds, value)] += 1
            total += value
        self.sum += total


class FileBatchHistogramChild(BatchHistogramChild):
    """A :class:`BatchHistogramChild` in multiprocess mode: its counts live in the files.

    Written as prometheus_client's Histogram writes them (one value per bucket, not
    cumulative, and the sum), so the multiprocess collector merges them with the other
    processes'. A request's samples are counted first, then each bucket they fell in is
    written once.
    """

    __slots__ = ("_bucket_values", "_sum_value")

    def __init__(
        self,
        bounds: tuple[float, ...],
        les: tuple[str, ...],
        name: str,
        documentation: str,
        labelnames: tuple[str, ...],
        labelvalues: tuple[str, ...],
    ) -> None:
        super().__init__(bounds)
        value = prometheus_values.ValueClass
        self._sum_value = value(
            "histogram", name, f"{name}_sum", labelnames, labelvalues, documentation
        )
        self._bucket_values = [
            value(
                "histogram",
                name,
                f"{name}_bucket",
                (*labelnames, "le"),
                (*labelvalues, le),
                documentation,
            )
            for le in les
        ]

    def observe(self, value: float) -> None:
        """Count one sample."""
        self._bucket_values[bisect.bisect_left(self._bounds, value)].inc(1)
        self._sum_value.inc(value)

    def observe_all(self, values: Iterable[float]) -> None:
        """Count every sample of ``values``."""
        bounds, find = self._bounds, bisect.bisect_left
        hits: Tally[int] = Tally()
        total = 0.0
        for value in values:
            hits[find(bounds, value)] += 1
            total += value
        for index, count in hits.items():
            self._bucket_values[index].inc(count)
        if hits:
            self._sum_value.inc(total)


class GatewayMetrics:
    """Every metric the gateway exports, registered on ``registry``.

    In multiprocess mode (:func:`multiprocess_dir`) they are registered on a registry of this
    process that is never exposed; :attr:`registry`, the one ``/metrics`` exposes, then merges
    every process's files.
    """

    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None) -> None:
        path = multiprocess_dir()
        self.multiprocess = path is not None
        if path is not None:
            self.registry = CollectorRegistry()
            MultiProcessCollector(self.registry, path)  # type: ignore[no-untyped-call]
            reg = CollectorRegistry()
        else:
            self.registry = registry if registry is not None else CollectorRegistry()
            reg = self.registry
        by_model = ["model"]
        by_tier = ["model", "tier"]
        self.requests = Counter(
            "gateway_requests",
            "Finished requests by model, endpoint, status class and outcome.",
            ["model", "tier", "endpoint", "status_class", "outcome"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "gateway_prompt_tokens", "Prompt tokens, from the worker's usage.", by_tier,
            registry=reg,
        )  # fmt: skip
        self.completion_tokens = Counter(
            "gateway_completion_tokens", "Completion tokens, from the worker's usage.", by_tier,
            registry=reg,
        )  # fmt: skip
        self.in_flight = Gauge(
            "gateway_in_flight_requests",
            "Requests being served now.",
            by_tier,
            multiprocess_mode="livesum",
            registry=reg,
        )
        self.ttft = Histogram(
            "gateway_time_to_first_token_seconds",
            "Arrival to the first streamed event carrying output.",
            by_tier, buckets=settings.ttft_buckets, registry=reg,
        )  # fmt: skip
        self.itl = BatchHistogram(
            "gateway_inter_token_latency_seconds",
            "Gap between consecutive output events, per token they carry.",
            by_tier, buckets=settings.itl_buckets, registry=reg,
        )  # fmt: skip
        self.tpot = Histogram(
            "gateway_time_per_output_token_seconds",
            "(E2E - TTFT) / (completion tokens - 1), per streamed request.",
            by_tier, buckets=settings.tpot_buckets, registry=reg,
        )  # fmt: skip
        self.e2e = Histogram(
            "gateway_e2e_request_latency_seconds",
            "Arrival to the last output event (streamed) or to the whole response.",
            by_tier, buckets=settings.e2e_buckets, registry=reg,
        )  # fmt: skip
        self.queue = Histogram(
            "gateway_queue_time_seconds",
            "Arrival to dispatch to a worker.",
            by_tier, buckets=settings.queue_buckets, registry=reg,
        )  # fmt: skip
        self.overhead = Histogram(
            "gateway_overhead_seconds",
            "Time spent in the gateway's own code per request, not waiting on worker or client.",
            by_model, buckets=OVERHEAD_BUCKETS, registry=reg,
        )  # fmt: skip
        self.loop_lag = Histogram(
            "gateway_event_loop_lag_seconds",
            "How late the event loop ran a callback due at a known time (probed every 0.25 s).",
            buckets=LAG_BUCKETS, registry=reg,
        )  # fmt: skip
        self.failover = Histogram(
            "gateway_failover_seconds",
            "Time a request lost on attempts that failed before its first byte (failed over).",
            by_model, buckets=settings.queue_buckets, registry=reg,
        )  # fmt: skip
        by_worker = ["worker"]
        self.worker_up = Gauge(
            "gateway_worker_up", "1 if the worker is healthy: answers its probe, not ejected.",
            by_worker, multiprocess_mode="livemax", registry=reg,
        )  # fmt: skip
        self.worker_ejected = Gauge(
            "gateway_worker_ejected", "1 while passive health keeps the worker out of rotation.",
            by_worker, multiprocess_mode="livemax", registry=reg,
        )  # fmt: skip
        self.worker_ejections = Counter(
            "gateway_worker_ejections", "Times the worker was ejected after repeated failures.",
            by_worker, registry=reg,
        )  # fmt: skip
        self.worker_routed = Counter(
            "gateway_worker_routed_requests", "Requests (attempts) sent to the worker.",
            by_worker, registry=reg,
        )  # fmt: skip
        self.worker_failovers = Counter(
            "gateway_worker_failovers",
            "Requests moved to another worker after failing here before their first byte.",
            by_worker, registry=reg,
        )  # fmt: skip
        self.worker_running = Gauge(
            "gateway_worker_running_requests", "vllm:num_requests_running, as last scraped.",
            by_worker, multiprocess_mode="livemostrecent", registry=reg,
        )  # fmt: skip
        self.worker_waiting = Gauge(
            "gateway_worker_waiting_requests", "vllm:num_requests_waiting, as last scraped.",
            by_worker, multiprocess_mode="livemostrecent", registry=reg,
        )  # fmt: skip
        self.worker_kv_cache = Gauge(
            "gateway_worker_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc (0..1), as scraped.",
            by_worker, multiprocess_mode="livemostrecent", registry=reg,
        )  # fmt: skip
        self.worker_load_age = Gauge(
            "gateway_worker_load_age_seconds", "Age of the worker's load figures at export time.",
            by_worker, multiprocess_mode="livemin", registry=reg,
        )  # fmt: skip
        self.worker_in_flight = Gauge(
            "gateway_worker_in_flight_requests", "Requests the gateway has open on the worker.",
            by_worker, multiprocess_mode="livesum", registry=reg,
        )  # fmt: skip
        self.worker_ttft = Histogram(
            "gateway_worker_time_to_first_token_seconds",
            "Dispatch to first output event, per worker.",
            by_worker, buckets=settings.ttft_buckets, registry=reg,
        )  # fmt: skip
        self.worker_itl = BatchHistogram(
            "gateway_worker_inter_token_latency_seconds", "Inter-token latency, per worker.",
            by_worker, buckets=settings.itl_buckets, registry=reg,
        )  # fmt: skip
        self.worker_completion_tokens = Counter(
            "gateway_worker_completion_tokens", "Completion tokens generated by the worker.",
            by_worker, registry=reg,
        )  # fmt: skip
        self.worker_roofline = Gauge(
            "gateway_worker_decode_roofline_tokens_per_second",
            "Memory-bandwidth limit of the worker's decode tokens/s for its current batch.",
            by_worker, multiprocess_mode="livemostrecent", registry=reg,
        )  # fmt: skip
        self.worker_bandwidth = Gauge(
            "gateway_worker_memory_bandwidth_bytes_per_second",
            "The worker's configured memory bandwidth (per GPU).", by_worker,
            multiprocess_mode="livemax", registry=reg,
        )  # fmt: skip
        self.worker_peak_flops = Gauge(
            "gateway_worker_peak_flops_per_second",
            "The worker's configured peak FLOP/s (per GPU).", by_worker,
            multiprocess_mode="livemax", registry=reg,
        )  # fmt: skip
        self.worker_concurrency_limit = Gauge(
            "gateway_worker_concurrency_limit",
            "Most requests admission lets run on the worker (keeps the TPOT target of the tiers "
            "in play).",
            by_worker, multiprocess_mode="livemax", registry=reg,
        )  # fmt: skip
        self.worker_proven_concurrency = Gauge(
            "gateway_worker_proven_concurrency",
            "Requests the worker was seen to serve within the TPOT aim while its concurrency "
            "limit is unmeasured (slots kept for higher tiers come out of it); 0 once the "
            "limit is measured or before any such load.",
            by_worker, multiprocess_mode="livemax", registry=reg,
        )  # fmt: skip
        self.worker_decode_pace = Gauge(
            "gateway_worker_decode_pace_seconds",
            "Mean gap per token between output events of the worker's running streams, over "
            "the last few seconds (cuts the concurrency limit when over the TPOT target).",
            by_worker, multiprocess_mode="livemax", registry=reg,
        )  # fmt: skip
        self.worker_limit_cuts = Counter(
            "gateway_worker_limit_cuts",
            "Times admission lowered the worker's running or prefill limit, by cause.",
            ["worker", "cause"], registry=reg,
        )  # fmt: skip
        self.worker_prefill_limit = Gauge(
            "gateway_worker_prefill_concurrency_limit",
            "Most requests admission lets prefill on the worker at once (keeps TTFT short).",
            by_worker, multiprocess_mode="livemax", registry=reg,
        )  # fmt: skip
        self.worker_prefilling = Gauge(
            "gateway_worker_prefilling_requests",
            "Requests sent to the worker that have not produced their first token yet.",
            by_worker, multiprocess_mode="livesum", registry=reg,
        )  # fmt: skip
        self.worker_prefill_rate = Gauge(
            "gateway_worker_prefill_tokens_per_second",
            "Learnt prefill speed of the worker (inverse of the TTFT model's per-token slope).",
            by_worker, multiprocess_mode="livemax", registry=reg,
        )  # fmt: skip
        self.worker_decode_step = Gauge(
            "gateway_worker_decode_step_seconds",
            "Learnt TPOT model: time per decode step with one sequence running.",
            by_worker, multiprocess_mode="livemax", registry=reg,
        )  # fmt: skip
        self.worker_decode_per_sequence = Gauge(
            "gateway_worker_decode_seconds_per_sequence",
            "Learnt TPOT model: how much each running sequence adds to a decode step.",
            by_worker, multiprocess_mode="livemax", registry=reg,
        )  # fmt: skip
        self.worker_prefix_queries = Counter(
            "gateway_worker_prefix_query_tokens",
            "Estimated prompt tokens routed to the worker by the prefix_aware policy.",
            by_worker, registry=reg,
        )  # fmt: skip
        self.worker_prefix_hits = Counter(
            "gateway_worker_predicted_prefix_hit_tokens",
            "Of those, the tokens prefix_aware routing predicted the worker had cached: over "
            "gateway_worker_prefix_query_tokens, the predicted prefix-cache hit rate.",
            by_worker, registry=reg,
        )  # fmt: skip
        self.worker_prefix_blocks = Gauge(
            "gateway_worker_prefix_index_blocks",
            "Blocks of recent prompts the prefix_aware index remembers for the worker.",
            by_worker, multiprocess_mode="livemax", registry=reg,
        )  # fmt: skip
        self.prefix_index_bytes = Gauge(
            "gateway_prefix_index_bytes",
            "Memory held by the prefix_aware index of all workers (capped by "
            "GATEWAY_PREFIX_INDEX_MB per gateway process).",
            multiprocess_mode="livesum",
            registry=reg,
        )
        by_tier_only = ["tier"]
        self.admission_decisions = Counter(
            "gateway_admission_decisions",
            "Admission decisions (admitted, queued, rejected, shed, expired, cancelled) and, for "
            "those that turn a request away, why.",
            ["tier", "decision", "reason"], registry=reg,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "gateway_queue_depth", "Requests waiting in the admission queue.", by_tier_only,
            multiprocess_mode="livesum", registry=reg,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds", "Time spent in the admission queue by queued requests.",
            by_tier_only, buckets=settings.queue_buckets, registry=reg,
        )  # fmt: skip
        self.prediction_error = Histogram(
            "gateway_ttft_prediction_error_seconds",
            "|actual - predicted| TTFT from dispatch, for the admission predictor.",
            by_tier_only, buckets=settings.ttft_buckets, registry=reg,
        )  # fmt: skip
        self.slo_requests = Counter(
            "gateway_slo_requests",
            "Requests by SLO result: met, missed_ttft, missed_tpot, missed_both, missed_e2e, "
            "rejected, errored.",
            ["model", "tier", "result"], registry=reg,
        )  # fmt: skip
        self.goodput_tokens = Counter(
            "gateway_goodput_tokens", "Completion tokens of requests that met every SLO.",
            by_tier, registry=reg,
        )  # fmt: skip
        self.goodput_ratio = Gauge(
            "gateway_goodput_ratio", "Share of requests meeting every SLO over the last minute.",
            by_tier_only, multiprocess_mode="liveall", registry=reg,
        )  # fmt: skip
        self.tier_ttft_slo = Gauge(
            "gateway_tier_slo_ttft_seconds", "The tier's TTFT target.", by_tier_only,
            multiprocess_mode="livemax", registry=reg,
        )  # fmt: skip
        self.tier_objective = Gauge(
            "gateway_slo_objective",
            "Share of the tier's requests that must meet every SLO (the goodput objective).",
            by_tier_only, multiprocess_mode="livemax", registry=reg,
        )  # fmt: skip
        self.tier_tpot_slo = Gauge(
            "gateway_tier_slo_tpot_seconds", "The tier's TPOT target.", by_tier_only,
            multiprocess_mode="livemax", registry=reg,
        )  # fmt: skip
        self.saturated = Counter(
            "gateway_saturated",
            "Requests answered 503 gateway_saturated because the gateway's own resource ran out.",
            ["resource"], registry=reg,
        )  # fmt: skip
        self.saturated.labels(UPSTREAM_CONNECTIONS)
        self.saturated.labels(EVENT_LOOP)
        # Unlabelled, so they exist at zero: an alert on "no worker" needs a series that says 0.
        self.workers_known = Gauge(
            "gateway_workers_known", "Workers the gateway knows (configured or discovered).",
            multiprocess_mode="livemax", registry=reg,
        )  # fmt: skip
        self.workers_healthy = Gauge(
            "gateway_workers_healthy", "Workers that may take requests now: up, not ejected, "
            "not draining.", multiprocess_mode="livemax", registry=reg,
        )  # fmt: skip
        # Only with Redis configured: without it there is nothing shared to be down.
        self.shared_state_up = (
            Gauge(
                "gateway_shared_state_up",
                "1 while Redis (GATEWAY_REDIS_URL) answers: key limits and admission's views are "
                "the fleet's. 0 while the gateway uses its own (the lowest of its processes).",
                multiprocess_mode="livemin",
                registry=reg,
            )
            if settings.redis_url
            else None
        )
        self.library_assumption = Gauge(
            "gateway_library_assumption",
            "1 where an undocumented part of a library the gateway leans on is as expected, 0 "
            "where not (logged at start-up with what it costs).",
            ["assumption"], multiprocess_mode="livemin", registry=reg,
        )  # fmt: skip
        for tier in settings.tiers:
            # Exported at zero from the start: rate() counts only increases between scrapes, so
            # a series that first appears with its first burst of events shows no rate for it.
            self.queue_depth.labels(tier.name).set(0)
            self.queue_wait.labels(tier.name)
            self.prediction_error.labels(tier.name)
            for decision, reasons in DECISION_REASONS.items():
                for reason in reasons:
                    self.admission_decisions.labels(tier.name, decision, reason)
        self._worker_metrics = (
            self.worker_up, self.worker_ejected, self.worker_ejections, self.worker_routed,
            self.worker_failovers, self.worker_running, self.worker_waiting, self.worker_kv_cache,
            self.worker_load_age, self.worker_in_flight, self.worker_ttft, self.worker_itl,
            self.worker_completion_tokens, self.worker_roofline, self.worker_bandwidth,
            self.worker_peak_flops, self.worker_concurrency_limit, self.worker_proven_concurrency,
            self.worker_decode_pace, self.worker_prefill_limit, self.worker_prefill_rate,
            self.worker_decode_step, self.worker_decode_per_sequence,
            self.worker_prefix_queries, self.worker_prefix_hits, self.worker_prefix_blocks,
        )  # fmt: skip
        self._load_at: dict[str, float] = {}
        self._tiers = tuple(tier.name for tier in settings.tiers)
        self._models: set[str] = set()

    def start_model(self, model: str) -> None:
        """Export ``model``'s series at zero, once, when a worker is first seen to serve it.

        rate() counts only increases between scrapes, so a series that first appears with the
        first burst of a model's requests would show no rate for that burst (the tier-only
        series start at zero for the same reason). Error series of ``gateway_requests`` are
        left to appear with their first error: one per outcome and status class would be
        mostly zeros that never move.
        """
        if model in self._models:
            return
        self._models.add(model)
        self.overhead.labels(model)
        self.failover.labels(model)
        per_tier = (
            self.prompt_tokens, self.completion_tokens, self.in_flight, self.ttft, self.itl,
            self.tpot, self.e2e, self.queue, self.goodput_tokens,
        )  # fmt: skip
        for tier in self._tiers:
            for metric in per_tier:
                metric.labels(model, tier)
            for endpoint in Endpoint:
                self.requests.labels(model, tier, endpoint.value, "2xx", "ok")
            for result in SloResult:
                self.slo_requests.labels(model, tier, result)

    def limit_cut(self, worker: str, cause: LimitCut) -> None:
        """Count one lowering of ``worker``'s running or prefill limit."""
        self.worker_limit_cuts.labels(worker, cause).inc()

    def decide(self, tier: str, decision: Decision, reason: Reason = Reason.NONE) -> None:
        """Count one admission decision."""
        self.admission_decisions.labels(tier, decision, reason).inc()

    def observe(self, model: str, tier: str, timing: TimingSummary, stream: bool) -> None:
        """Record a finished request's latencies; ``model`` must already be a bounded label."""
        if timing.queue_s is not None:
            self.queue.labels(model, tier).observe(timing.queue_s)
        self.overhead.labels(model).observe(timing.overhead_s)
        if timing.failover_s > 0:
            self.failover.labels(model).observe(timing.failover_s)
        if timing.e2e_s is not None:
            self.e2e.labels(model, tier).observe(timing.e2e_s)
        if not stream:
            return
        if timing.ttft_s is not None:
            self.ttft.labels(model, tier).observe(timing.ttft_s)
        if timing.tpot_s is not None:
            self.tpot.labels(model, tier).observe(timing.tpot_s)
        self.itl.labels(model, tier).observe_all(timing.itl_s)

    def count(
        self,
        model: str,
        tier: str,
        endpoint: str,
        status: int,
        outcome: str,
        tokens: tuple[int, int] | None,
    ) -> None:
        """Count a finished request and its tokens."""
        self.requests.labels(model, tier, endpoint, f"{status // 100}xx", outcome).inc()
        if tokens is not None:
            self.prompt_tokens.labels(model, tier).inc(tokens[0])
            self.completion_tokens.labels(model, tier).inc(tokens[1])

    def record_load(
        self, worker: str, running: float, waiting: float, kv_cache_usage: float, at: float
    ) -> None:
        """Export a worker's scraped load, read at ``at``."""
        self.worker_running.labels(worker).set(running)
        self.worker_waiting.labels(worker).set(waiting)
        self.worker_kv_cache.labels(worker).set(kv_cache_usage)
        self._load_at[worker] = at

    def set_load_age(self, now: float) -> None:
        """Refresh the load-age gauges (called just before an export)."""
        for worker, at in self._load_at.items():
            self.worker_load_age.labels(worker).set(max(0.0, now - at))

    def set_hardware(self, worker: str, hardware: Hardware) -> None:
        """Export the worker's peak figures, which MFU and MBU are measured against."""
        self.worker_bandwidth.labels(worker).set(hardware.memory_bandwidth_gbs * 1e9)
        if hardware.peak_tflops is not None:
            self.worker_peak_flops.labels(worker).set(hardware.peak_tflops * 1e12)

    def set_roofline(self, worker: str, hardware: Hardware, running: float, context: float) -> None:
        """Export the decode roofline of a batch of ``running`` sequences of ``context`` tokens.

        Each decode step reads every weight once and the KV cache of every sequence, and yields
        one token per sequence: tokens/s <= running x bandwidth / bytes read per step. Needs
        the model described (``model_params_billion``); the fallback for engines that do not
        count their own bytes.
        """
        weights = hardware.weight_bytes
        if weights is None:
            return
        batch = max(running, 1.0)
        bandwidth = hardware.memory_bandwidth_gbs * 1e9
        step_bytes = weights + hardware.kv_bytes_per_token * context * batch
        self.worker_roofline.labels(worker).set(batch * bandwidth / step_bytes)

    def forget_worker(self, worker: str) -> None:
        """Drop a removed worker's series, so departed workers do not pile up.

        prometheus_client's multiprocess mode cannot drop a series: there its gauges go to 0
        (not up, nothing in flight) and stay until the process ends.
        """
        self._load_at.pop(worker, None)
        for metric in self._worker_metrics:
            if not self.multiprocess:
                with contextlib.suppress(KeyError):
                    metric.remove(worker)
            elif isinstance(metric, Gauge):
                metric.labels(worker).set(0)
        if not self.multiprocess:
            for cause in LimitCut:
                with contextlib.suppress(KeyError):
                    self.worker_limit_cuts.remove(worker, cause)

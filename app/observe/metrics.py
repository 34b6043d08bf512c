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
import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from app.api.outcome import DECISION_REASONS, Decision, LimitCut, Reason, SloResult
from app.api.protocol import Endpoint
from app.observe.families import CounterFamily, GaugeFamily
from app.observe.looplag import LAG_BUCKETS
from app.observe.timing import TimingSummary
from app.settings import OVERHEAD_BUCKETS, Hardware, Settings


def go_float(value: float) -> str:
    """A bucket bound as Prometheus's text format writes it ("+Inf", "0.005", "1.0", "1e+07").

    Python's shortest repr, but in exponent form from ten million on, as Go writes floats:
    the ``le`` labels of :class:`BatchHistogram` must be those of prometheus_client's own
    histograms, whose samples they are merged with in multiprocess mode.
    """
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


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


Child = TypeVar(
    "Child", prometheus_client.Counter, prometheus_client.Gauge, prometheus_client.Histogram
)


class Labelled(Generic[Child]):
    """A labelled prometheus_client metric whose children are kept by their label values.

    prometheus_client's ``labels`` checks the values, converts each to ``str`` and takes a lock
    on every call, and a request makes about twenty such calls for label values that repeat:
    here they are one dict lookup. Only the metric's documented methods are used (``labels``,
    ``remove``), through the metric it holds: nothing of prometheus_client is subclassed.
    """

    __slots__ = ("_kept", "metric")

    def __init__(self, metric: Child) -> None:
        self.metric: Child = metric
        """prometheus_client's metric (registered, exposed as it is)."""
        self._kept: dict[tuple[str, ...], Child] = {}

    def labels(self, *values: str) -> Child:
        """The child for these label values (prometheus_client's, made on first use)."""
        child = self._kept.get(values)
        if child is None:
            child = self._kept[values] = self.metric.labels(*values)
        return child

    def remove(self, *values: str) -> None:
        """Drop a child's series (and the child kept for it)."""
        self._kept.pop(values, None)
        self.metric.remove(*values)


Counter = CounterFamily | Labelled[prometheus_client.Counter]
"""A labelled counter: the gateway's own (:class:`~app.observe.families.CounterFamily`), or in
multiprocess mode prometheus_client's (:class:`Labelled`)."""
Gauge = GaugeFamily | Labelled[prometheus_client.Gauge]
"""A labelled gauge: the gateway's own (:class:`~app.observe.families.GaugeFamily`), or in
multiprocess mode prometheus_client's (:class:`Labelled`)."""


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
        self._les = tuple(go_float(b) for b in bounds)
        self._children: dict[tuple[str, ...], BatchHistogramChild] = {}
        self._forwarded: dict[tuple[str, ...], EachSampleChild] = {}
        # In multiprocess mode prometheus_client's histogram keeps the samples (in the files the
        # pod's /metrics merges); it is registered nowhere, as the files are what is read.
        self._files = (
            None
            if multiprocess_dir() is None
            else prometheus_client.Histogram(
                name, documentation, labelnames, buckets=bounds, registry=None
            )
        )
        registry.register(self)

    def labels(self, *values: str) -> BatchHistogramChild | EachSampleChild:
        """The child for these label values (created at zero on first use)."""
        child = self._children.get(values) or self._forwarded.get(values)
        if child is not None:
            return child
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name} takes labels {self._labelnames}")
        if self._files is not None:
            forwarded = self._forwarded[values] = EachSampleChild(self._files.labels(*values))
            return forwarded
        counted = self._children[values] = BatchHistogramChild(self._bounds)
        return counted

    def remove(self, *values: str) -> None:
        """Drop a child's series (in multiprocess mode, the child: the files keep its samples)."""
        if self._files is not None:
            del self._forwarded[values]
        else:
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


class EachSampleChild:
    """A :class:`BatchHistogram`'s child in multiprocess mode: prometheus_client's, per sample.

    prometheus_client's own histogram writes the files the pod's ``/metrics`` merges (its
    documented multiprocess mode); no public API writes them for a whole batch, so a request's
    samples go to it one by one. Nothing is counted here.
    """

    __slots__ = ("_child",)

    def __init__(self, child: prometheus_client.Histogram) -> None:
        self._child = child

    def observe(self, value: float) -> None:
        """Count one sample."""
        self._child.observe(value)

    def observe_all(self, values: Iterable[float]) -> None:
        """Count every sample of ``values``."""
        observe = self._child.observe
        for value in values:
            observe(value)


MetricKind = Literal["counter", "gauge", "histogram", "batch_histogram"]
"""A labelled ``histogram`` and a ``batch_histogram`` are both a :class:`BatchHistogram`; the
kinds keep docs/metrics.md's word for a histogram whose samples come a request's at once."""
GaugeMode = Literal[
    "all", "liveall", "min", "livemin", "max", "livemax", "sum", "livesum", "mostrecent",
    "livemostrecent",
]  # fmt: skip
"""How prometheus_client's multiprocess mode combines a gauge's values over the processes."""


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric of :class:`GatewayMetrics`, and its row of docs/metrics.md.

    ``python -m scripts.metrics_table`` prints the table of docs/metrics.md from :data:`METRICS`.
    """

    attr: str
    """The attribute of :class:`GatewayMetrics` that holds the metric."""
    kind: MetricKind
    name: str
    """The name given to prometheus_client (a counter's series get ``_total``)."""
    help_text: str
    labels: tuple[str, ...] = ()
    buckets: str | tuple[float, ...] | None = None
    """A histogram's bounds, or the :class:`Settings` attribute that holds them."""
    multiprocess_mode: GaugeMode | None = None
    """A gauge's (see the module's docstring)."""
    only_with: str | None = None
    """A :class:`Settings` attribute: without it set, the metric does not exist (``None``)."""
    doc: str = ""
    """The metric's meaning in docs/metrics.md (markdown)."""

    @property
    def exported_name(self) -> str:
        """The name Prometheus shows (a counter's with ``_total``)."""
        return f"{self.name}_total" if self.kind == "counter" else self.name

    def build(
        self, settings: Settings, registry: CollectorRegistry
    ) -> (
        Counter | Gauge | BatchHistogram | prometheus_client.Counter | prometheus_client.Gauge
        | prometheus_client.Histogram | None
    ):  # fmt: skip
        """The metric, registered on ``registry`` (``None`` if ``settings`` leave it out).

        A labelled one is the gateway's own (:mod:`app.observe.families`, and
        :class:`BatchHistogram` for histograms), whose children take no lock; in multiprocess
        mode a labelled counter or gauge is prometheus_client's, which writes the files the
        pod's ``/metrics`` merges (:class:`Labelled`). One without labels is prometheus_client's
        own.
        """
        if self.only_with is not None and not getattr(settings, self.only_with):
            return None
        own = bool(self.labels) and multiprocess_dir() is None
        if self.kind == "counter":
            if own:
                return CounterFamily(self.name, self.help_text, self.labels, registry)
            counter = prometheus_client.Counter(
                self.name, self.help_text, self.labels, registry=registry
            )
            return Labelled(counter) if self.labels else counter
        if self.kind == "gauge":
            if own:
                return GaugeFamily(self.name, self.help_text, self.labels, registry)
            mode = self.multiprocess_mode or "all"
            gauge = prometheus_client.Gauge(
                self.name, self.help_text, self.labels, multiprocess_mode=mode, registry=registry
            )
            return Labelled(gauge) if self.labels else gauge
        bounds = getattr(settings, self.buckets) if isinstance(self.buckets, str) else self.buckets
        if bounds is None:
            raise ValueError(f"{self.name}: a histogram needs buckets")
        if self.kind == "histogram" and not self.labels:
            return prometheus_client.Histogram(
                self.name, self.help_text, buckets=bounds, registry=registry
            )
        return BatchHistogram(self.name, self.help_text, self.labels, bounds, registry)


# In the order of docs/metrics.md's table.
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "requests",
        "counter",
        "gateway_requests",
        "Finished requests by model, endpoint, status class and outcome.",
        ("model", "tier", "endpoint", "status_class", "outcome"),
        doc=(
            "every response, counted once (and logged once, with the status sent); outcome is "
            "`ok`, `client_cancelled`, `client_stalled` (the client stopped reading its "
            "stream, or sent its request too slowly: 408), `upstream_error`, `timeout`, "
            "`rejected` (admission), `rate_limited` (the key's quota), `gateway_saturated`, "
            "`gateway_shutdown`, `invalid_request` or `internal_error` (a fault in the "
            "gateway: 500); endpoint is the relayed endpoint (`chat`, `completions`, "
            "`responses`, `transcriptions`, `embeddings`, `score`, `rerank`, `pooling`, "
            "`tokenize`, `detokenize`: each covers its vLLM aliases, see docs/api.md), or "
            "`models`, `version`, `healthz`, `readyz`, `metrics` or `other` (any other path). "
            "Responses that are no relayed request's (probes, scrapes, CORS preflights, "
            "404/405, 408/431 before a route) have empty `model` and `tier`"
        ),
    ),
    MetricSpec(
        "prompt_tokens",
        "counter",
        "gateway_prompt_tokens",
        "Prompt tokens, from the worker's usage.",
        ("model", "tier"),
        doc="prompt tokens from the worker's `usage`",
    ),
    MetricSpec(
        "completion_tokens",
        "counter",
        "gateway_completion_tokens",
        "Completion tokens, from the worker's usage.",
        ("model", "tier"),
        doc="completion tokens from the worker's `usage`",
    ),
    MetricSpec(
        "in_flight",
        "gauge",
        "gateway_in_flight_requests",
        "Requests being served now.",
        ("model", "tier"),
        multiprocess_mode="livesum",
        doc="requests being served now",
    ),
    MetricSpec(
        "ttft",
        "histogram",
        "gateway_time_to_first_token_seconds",
        "Arrival to the first streamed event carrying output.",
        ("model", "tier"),
        buckets="ttft_buckets",
        doc=(
            "arrival (the request's first byte read) to the first event carrying output handed "
            "to the client's socket ([docs/timing.md](timing.md))"
        ),
    ),
    MetricSpec(
        "itl",
        "batch_histogram",
        "gateway_inter_token_latency_seconds",
        "Gap between consecutive output events, per token they carry.",
        ("model", "tier"),
        buckets="itl_buckets",
        doc="gap between output events, per token they carry",
    ),
    MetricSpec(
        "tpot",
        "histogram",
        "gateway_time_per_output_token_seconds",
        "(E2E - TTFT) / (completion tokens - 1), per streamed request.",
        ("model", "tier"),
        buckets="tpot_buckets",
        doc="(E2E − TTFT) / (completion tokens − 1)",
    ),
    MetricSpec(
        "e2e",
        "histogram",
        "gateway_e2e_request_latency_seconds",
        "Arrival to the last output event (streamed) or to the whole response.",
        ("model", "tier"),
        buckets="e2e_buckets",
        doc=(
            "arrival to the last output event (or whole response) handed to the client's "
            "socket; every endpoint but the tokenizer's (an embedding's is its whole answer, "
            "docs/api.md)"
        ),
    ),
    MetricSpec(
        "queue",
        "histogram",
        "gateway_queue_time_seconds",
        "Arrival to dispatch to a worker.",
        ("model", "tier"),
        buckets="queue_buckets",
        doc="arrival to the first dispatch to a worker",
    ),
    MetricSpec(
        "overhead",
        "histogram",
        "gateway_overhead_seconds",
        "Time spent in the gateway's own code per request, not waiting on worker or client.",
        ("model",),
        buckets=OVERHEAD_BUCKETS,
        doc="time in the gateway's own code per request (not queue, not failed attempts)",
    ),
    MetricSpec(
        "failover",
        "histogram",
        "gateway_failover_seconds",
        "Time a request lost on attempts that failed before its first byte (failed over).",
        ("model",),
        buckets="queue_buckets",
        doc="time lost on attempts that failed before the first byte",
    ),
    MetricSpec(
        "loop_lag",
        "histogram",
        "gateway_event_loop_lag_seconds",
        "How late the event loop ran a callback due at a known time (probed every 0.25 s).",
        (),
        buckets=LAG_BUCKETS,
        doc=(
            "how late the event loop ran a callback due at a known time, probed every 0.25 s: "
            "time every request and event waited for the loop, which no other timestamp sees "
            "(below 1 ms it is uvloop's timer resolution)"
        ),
    ),
    MetricSpec(
        "admission_decisions",
        "counter",
        "gateway_admission_decisions",
        (
            "Admission decisions (admitted, queued, rejected, shed, expired, cancelled) and, "
            "for those that turn a request away, why."
        ),
        ("tier", "decision", "reason"),
        doc=(
            "decision `admitted`, `queued`, `rejected`, `shed`, `expired`, `cancelled`; reason "
            "`none`, `deadline_unreachable`, `queue_full`, `prompt_too_long`, `key_quota`, "
            "`no_worker`, `queue_timeout`, `shed`"
        ),
    ),
    MetricSpec(
        "saturated",
        "counter",
        "gateway_saturated",
        "Requests answered 503 gateway_saturated because the gateway's own resource ran out.",
        ("resource",),
        doc=(
            "requests answered 503 `gateway_saturated` because the gateway's own resource ran "
            "out: `upstream_connections` (to the workers), `client_connections` "
            "(`GATEWAY_MAX_CONNECTIONS`) or `event_loop` (a connect to a worker timed out "
            "late: the loop was too busy to see it complete)"
        ),
    ),
    MetricSpec(
        "queue_depth",
        "gauge",
        "gateway_queue_depth",
        "Requests waiting in the admission queue.",
        ("tier",),
        multiprocess_mode="livesum",
        doc="requests waiting in the admission queue",
    ),
    MetricSpec(
        "fairness_waiting_ids",
        "gauge",
        "gateway_fairness_waiting_ids",
        "Fairness ids (API keys, or the ids keys may set) with requests waiting in the queue.",
        ("tier",),
        multiprocess_mode="livemax",
        doc="fairness ids with requests waiting, per tier (queued requests share the slots "
        "that come free between them)",
    ),
    MetricSpec(
        "fairness_top_share",
        "gauge",
        "gateway_fairness_top_share",
        "Of the tier's running requests, the share of the waiting fairness id that holds most.",
        ("tier",),
        multiprocess_mode="livemax",
        doc="0-1: the most of a tier's running requests one id with requests waiting holds "
        "(near 1 while one id floods and others wait: fair share is handing slots to the "
        "others)",
    ),
    MetricSpec(
        "queue_wait",
        "histogram",
        "gateway_queue_wait_seconds",
        "Time spent in the admission queue by queued requests.",
        ("tier",),
        buckets="queue_buckets",
        doc="time queued, for queued requests",
    ),
    MetricSpec(
        "prediction_error",
        "histogram",
        "gateway_ttft_prediction_error_seconds",
        "|actual - predicted| TTFT from dispatch, for the admission predictor.",
        ("tier",),
        buckets="ttft_buckets",
        doc="|actual − predicted| TTFT from dispatch",
    ),
    MetricSpec(
        "slo_requests",
        "counter",
        "gateway_slo_requests",
        (
            "Requests by SLO result: met, missed_ttft, missed_tpot, missed_both, missed_e2e, "
            "rejected, errored."
        ),
        ("model", "tier", "result"),
        doc=(
            "`met`, `missed_ttft`, `missed_tpot`, `missed_both`, `missed_e2e` (non-streamed), "
            "`rejected`, `errored`; what counts is defined in "
            "[docs/admission.md](docs/admission.md#goodputs-denominator)"
        ),
    ),
    MetricSpec(
        "goodput_tokens",
        "counter",
        "gateway_goodput_tokens",
        "Completion tokens of requests that met every SLO.",
        ("model", "tier"),
        doc="completion tokens of requests that met every SLO",
    ),
    MetricSpec(
        "goodput_ratio",
        "gauge",
        "gateway_goodput_ratio",
        "Share of requests meeting every SLO over the last minute.",
        ("tier",),
        multiprocess_mode="liveall",
        doc=(
            "share of the last minute's requests that met every SLO, as admission sees it; NaN "
            "(no data) when the tier had no request in the last minute, never the last figure. "
            "Dashboards and alerts compute goodput from `gateway_slo_requests_total` instead, "
            "over their own windows"
        ),
    ),
    MetricSpec(
        "tier_ttft_slo",
        "gauge",
        "gateway_tier_slo_ttft_seconds",
        "The tier's TTFT target.",
        ("tier",),
        multiprocess_mode="livemax",
        doc="the configured TTFT target",
    ),
    MetricSpec(
        "tier_tpot_slo",
        "gauge",
        "gateway_tier_slo_tpot_seconds",
        "The tier's TPOT target.",
        ("tier",),
        multiprocess_mode="livemax",
        doc="the configured TPOT target",
    ),
    MetricSpec(
        "tier_objective",
        "gauge",
        "gateway_slo_objective",
        "Share of the tier's requests that must meet every SLO (the goodput objective).",
        ("tier",),
        multiprocess_mode="livemax",
        doc=(
            "the configured objective (`objective` in `GATEWAY_TIERS`): the share of requests "
            "that must meet every SLO; the burn-rate alerts' error budget is 1 minus it"
        ),
    ),
    # Unlabelled, so they exist at zero: an alert on "no worker" needs a series that says 0.
    MetricSpec(
        "workers_known",
        "gauge",
        "gateway_workers_known",
        "Workers the gateway knows (configured or discovered).",
        (),
        multiprocess_mode="livemax",
        doc=(
            'workers the gateway knows; exported from the start, so "no worker" reads 0 rather '
            "than no series"
        ),
    ),
    MetricSpec(
        "workers_healthy",
        "gauge",
        "gateway_workers_healthy",
        "Workers that may take requests now: up, not ejected, not draining.",
        (),
        multiprocess_mode="livemax",
        doc=(
            "workers that may take requests now (up, not ejected, not draining); exported from "
            'the start, so "no worker" reads 0 rather than no series'
        ),
    ),
    MetricSpec(
        "worker_up",
        "gauge",
        "gateway_worker_up",
        "1 if the worker is healthy: answers its probe, not ejected.",
        ("worker",),
        multiprocess_mode="livemax",
        doc="healthy",
    ),
    MetricSpec(
        "worker_ejected",
        "gauge",
        "gateway_worker_ejected",
        "1 while passive health keeps the worker out of rotation.",
        ("worker",),
        multiprocess_mode="livemax",
        doc="ejected by passive health",
    ),
    MetricSpec(
        "worker_routed",
        "counter",
        "gateway_worker_routed_requests",
        "Requests (attempts) sent to the worker.",
        ("worker",),
        doc="attempts sent",
    ),
    MetricSpec(
        "worker_failovers",
        "counter",
        "gateway_worker_failovers",
        "Requests moved to another worker after failing here before their first byte.",
        ("worker",),
        doc="requests moved away",
    ),
    MetricSpec(
        "worker_ejections",
        "counter",
        "gateway_worker_ejections",
        "Times the worker was ejected after repeated failures.",
        ("worker",),
        doc="ejections",
    ),
    MetricSpec(
        "worker_running",
        "gauge",
        "gateway_worker_running_requests",
        "vllm:num_requests_running, as last scraped.",
        ("worker",),
        multiprocess_mode="livemostrecent",
        doc="the worker's own running requests, as last scraped",
    ),
    MetricSpec(
        "worker_waiting",
        "gauge",
        "gateway_worker_waiting_requests",
        "vllm:num_requests_waiting, as last scraped.",
        ("worker",),
        multiprocess_mode="livemostrecent",
        doc="the worker's own waiting requests, as last scraped",
    ),
    MetricSpec(
        "worker_kv_cache",
        "gauge",
        "gateway_worker_kv_cache_usage_ratio",
        "vllm:kv_cache_usage_perc (0..1), as scraped.",
        ("worker",),
        multiprocess_mode="livemostrecent",
        doc="the worker's own KV cache usage (0..1), as last scraped",
    ),
    MetricSpec(
        "worker_load_age",
        "gauge",
        "gateway_worker_load_age_seconds",
        "Age of the worker's load figures at export time.",
        ("worker",),
        multiprocess_mode="livemin",
        doc="age of those figures",
    ),
    MetricSpec(
        "worker_in_flight",
        "gauge",
        "gateway_worker_in_flight_requests",
        "Requests the gateway has open on the worker.",
        ("worker",),
        multiprocess_mode="livesum",
        doc="requests the gateway has open on the worker",
    ),
    MetricSpec(
        "worker_ttft",
        "histogram",
        "gateway_worker_time_to_first_token_seconds",
        "Dispatch to first output event, per worker.",
        ("worker",),
        buckets="ttft_buckets",
        doc="TTFT measured per worker (from dispatch)",
    ),
    MetricSpec(
        "worker_itl",
        "batch_histogram",
        "gateway_worker_inter_token_latency_seconds",
        "Inter-token latency, per worker.",
        ("worker",),
        buckets="itl_buckets",
        doc="inter-token latency measured per worker",
    ),
    MetricSpec(
        "worker_completion_tokens",
        "counter",
        "gateway_worker_completion_tokens",
        "Completion tokens generated by the worker.",
        ("worker",),
        doc="decode output, for tokens/s",
    ),
    MetricSpec(
        "worker_peak_flops",
        "gauge",
        "gateway_worker_peak_flops_per_second",
        "The worker's configured peak FLOP/s (per GPU).",
        ("worker",),
        multiprocess_mode="livemax",
        doc=(
            "the worker's configured peak per GPU (`GATEWAY_HARDWARE`'s `peak_tflops`), which "
            "MFU divides vLLM's `vllm:estimated_*_per_gpu_total` by"
        ),
    ),
    MetricSpec(
        "worker_bandwidth",
        "gauge",
        "gateway_worker_memory_bandwidth_bytes_per_second",
        "The worker's configured memory bandwidth (per GPU).",
        ("worker",),
        multiprocess_mode="livemax",
        doc=(
            "the worker's configured peak per GPU (`GATEWAY_HARDWARE`'s "
            "`memory_bandwidth_gbs`), which MBU divides vLLM's "
            "`vllm:estimated_*_per_gpu_total` by"
        ),
    ),
    MetricSpec(
        "worker_roofline",
        "gauge",
        "gateway_worker_decode_roofline_tokens_per_second",
        "Memory-bandwidth limit of the worker's decode tokens/s for its current batch.",
        ("worker",),
        multiprocess_mode="livemostrecent",
        doc=(
            "memory-bandwidth limit of decode tokens/s for the current batch, estimated from "
            "the configured model (`model_params_billion` ...); the MBU fallback for engines "
            "without vLLM's counters"
        ),
    ),
    MetricSpec(
        "worker_concurrency_limit",
        "gauge",
        "gateway_worker_concurrency_limit",
        (
            "Most requests admission lets run on the worker (keeps the TPOT target of the "
            "tiers in play)."
        ),
        ("worker",),
        multiprocess_mode="livemax",
        doc=(
            "admission's running limit for the worker: the hard cap until latency or the "
            "worker says otherwise"
        ),
    ),
    MetricSpec(
        "worker_prefill_limit",
        "gauge",
        "gateway_worker_prefill_concurrency_limit",
        "Most requests admission lets prefill on the worker at once (keeps TTFT short).",
        ("worker",),
        multiprocess_mode="livemax",
        doc=(
            "admission's prefill limit for the worker: the hard cap until latency or the "
            "worker says otherwise"
        ),
    ),
    MetricSpec(
        "worker_proven_concurrency",
        "gauge",
        "gateway_worker_proven_concurrency",
        (
            "Requests the worker was seen to serve within the TPOT aim while its concurrency "
            "limit is unmeasured (slots kept for higher tiers come out of it); 0 once the "
            "limit is measured or before any such load."
        ),
        ("worker",),
        multiprocess_mode="livemax",
        doc=(
            "while the running limit is unmeasured, the most the worker was seen to run with a "
            "stream's TPOT within the aim: slots kept for higher tiers come out of it, not the "
            "limit; 0 once the limit is measured or before such a load"
        ),
    ),
    MetricSpec(
        "worker_limit_cuts",
        "counter",
        "gateway_worker_limit_cuts",
        "Times admission lowered the worker's running or prefill limit, by cause.",
        ("worker", "cause"),
        doc=(
            "times admission lowered the worker's running limit (`tpot_miss`, `decode_pace`, "
            "`decode_line`, `worker_queueing`) or prefill limit (`ttft_miss`); every cause "
            "starts at 0"
        ),
    ),
    MetricSpec(
        "worker_decode_pace",
        "gauge",
        "gateway_worker_decode_pace_seconds",
        (
            "Mean gap per token between output events of the worker's running streams, over "
            "the last few seconds (cuts the concurrency limit when over the TPOT target)."
        ),
        ("worker",),
        multiprocess_mode="livemax",
        doc=(
            "mean gap per token between the output events of the worker's running streams over "
            "the last 3 s; over the TPOT target the limits keep it cuts the running limit at "
            "once"
        ),
    ),
    MetricSpec(
        "worker_prefilling",
        "gauge",
        "gateway_worker_prefilling_requests",
        "Requests sent to the worker that have not produced their first token yet.",
        ("worker",),
        multiprocess_mode="livesum",
        doc=(
            "requests sent to the worker that have not produced their first token yet (counted "
            "against the prefill limit)"
        ),
    ),
    MetricSpec(
        "worker_prefill_rate",
        "gauge",
        "gateway_worker_prefill_tokens_per_second",
        "Learnt prefill speed of the worker (inverse of the TTFT model's per-token slope).",
        ("worker",),
        multiprocess_mode="livemax",
        doc="the latency model learnt online: prefill speed",
    ),
    MetricSpec(
        "worker_decode_step",
        "gauge",
        "gateway_worker_decode_step_seconds",
        "Learnt TPOT model: time per decode step with one sequence running.",
        ("worker",),
        multiprocess_mode="livemax",
        doc="the latency model learnt online: decode step time with one sequence",
    ),
    MetricSpec(
        "worker_decode_per_sequence",
        "gauge",
        "gateway_worker_decode_seconds_per_sequence",
        "Learnt TPOT model: how much each running sequence adds to a decode step.",
        ("worker",),
        multiprocess_mode="livemax",
        doc="the latency model learnt online: what each running sequence adds",
    ),
    MetricSpec(
        "worker_prefix_queries",
        "counter",
        "gateway_worker_prefix_query_tokens",
        "Estimated prompt tokens routed to the worker by the prefix_aware policy.",
        ("worker",),
        doc="under `prefix_aware` routing: estimated prompt tokens routed to the worker",
    ),
    MetricSpec(
        "worker_prefix_hits",
        "counter",
        "gateway_worker_predicted_prefix_hit_tokens",
        (
            "Of those, the tokens prefix_aware routing predicted the worker had cached: over "
            "gateway_worker_prefix_query_tokens, the predicted prefix-cache hit rate."
        ),
        ("worker",),
        doc=(
            "under `prefix_aware` routing: of `gateway_worker_prefix_query_tokens_total`, the "
            "tokens predicted to be in the worker's prefix cache; their ratio is the predicted "
            "hit rate, to set beside vLLM's `vllm:prefix_cache_hits_total` / "
            "`vllm:prefix_cache_queries_total`"
        ),
    ),
    MetricSpec(
        "worker_prefix_found",
        "counter",
        "gateway_worker_cached_prompt_tokens",
        (
            "Prompt tokens the worker found in its prefix cache, as its usage told "
            "(vLLM's --enable-prompt-tokens-details)."
        ),
        ("worker",),
        doc=(
            "prompt tokens of this gateway's requests that the worker found in its prefix "
            "cache, as its usage's `prompt_tokens_details.cached_tokens` told (vLLM started "
            "with `--enable-prompt-tokens-details`); over "
            "`gateway_worker_cache_told_prompt_tokens_total`, the worker's hit rate on exactly "
            "the requests routing predicted for"
        ),
    ),
    MetricSpec(
        "worker_prefix_told",
        "counter",
        "gateway_worker_cache_told_prompt_tokens",
        "Prompt tokens of the requests whose usage told their cached tokens.",
        ("worker",),
        doc="prompt tokens of the requests whose usage told their cached tokens",
    ),
    MetricSpec(
        "worker_prefix_missed",
        "counter",
        "gateway_worker_prefix_missed_tokens",
        "Tokens routing predicted the worker had cached that its usage said it did not find.",
        ("worker",),
        doc=(
            "under `prefix_aware` routing: of the requests whose usage told their cached "
            "tokens, those predicted to be cached that the worker did not find (evicted before "
            "the prefill, or never there): cache credit given in vain"
        ),
    ),
    MetricSpec(
        "worker_prefix_blocks",
        "gauge",
        "gateway_worker_prefix_index_blocks",
        "Blocks of recent prompts the prefix_aware index remembers for the worker.",
        ("worker",),
        multiprocess_mode="livemax",
        doc=(
            "blocks of 256 characters of recent prompts the `prefix_aware` index remembers for "
            "the worker"
        ),
    ),
    MetricSpec(
        "worker_kv_events",
        "counter",
        "gateway_worker_kv_events",
        "KV cache events of the worker applied to its block index (prefix_aware routing).",
        ("worker",),
        doc=(
            "KV cache events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) the worker "
            "published and the gateway applied to its block index"
        ),
    ),
    MetricSpec(
        "worker_kv_lost",
        "counter",
        "gateway_worker_kv_event_batches_lost",
        "Batches of the worker's KV cache events missed and not replayed: its index restarted.",
        ("worker",),
        doc=(
            "batches of the worker's KV cache events missed and not replayed: its block index "
            "started over, incomplete (routing then reads the approximate index beside it)"
        ),
    ),
    MetricSpec(
        "worker_kv_lag",
        "histogram",
        "gateway_worker_kv_event_lag_seconds",
        "From the worker publishing a batch of KV cache events to the gateway applying it.",
        ("worker",),
        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        doc=(
            "from the worker stamping a batch of KV cache events to the gateway applying it "
            "(the two machines' wall clocks)"
        ),
    ),
    MetricSpec(
        "worker_kv_blocks",
        "gauge",
        "gateway_worker_kv_index_blocks",
        "KV cache blocks the worker's events say it holds.",
        ("worker",),
        multiprocess_mode="livemax",
        doc="KV cache blocks the worker's own events say it holds (`prefix_aware` routing)",
    ),
    MetricSpec(
        "worker_kv_complete",
        "gauge",
        "gateway_worker_kv_index_complete",
        "1 if the worker's block index has every event since its cache was empty.",
        ("worker",),
        multiprocess_mode="livemin",
        doc=(
            "1 if the worker's block index holds every event since its cache was last empty "
            "(routing trusts it alone), 0 if events were missed"
        ),
    ),
    MetricSpec(
        "prompt_tokenizations",
        "counter",
        "gateway_prompt_tokenizations",
        "Prompts mapped to tokens for prefix_aware routing on KV events, by how.",
        ("result",),
        doc=(
            "prompts mapped to the worker's tokens for routing on KV events: `cached` (a prompt "
            "seen before), `partial` (routed on an earlier turn's, the whole asked in the "
            "background), `local` (tokenized by the gateway, `GATEWAY_TOKENIZERS`), `asked` "
            "(the request waited for the worker's `/tokenize`), `failed` (routed on the "
            "approximate index)"
        ),
    ),
    MetricSpec(
        "prefix_index_bytes",
        "gauge",
        "gateway_prefix_index_bytes",
        (
            "Memory held by the prefix_aware indexes of all workers, approximate and from KV "
            "events (each capped by GATEWAY_PREFIX_INDEX_MB per gateway process)."
        ),
        (),
        multiprocess_mode="livesum",
        doc=(
            "memory held by the `prefix_aware` indexes, approximate and from KV events, all "
            "workers together (each capped by `GATEWAY_PREFIX_INDEX_MB`)"
        ),
    ),
    MetricSpec(
        "prompt_tokens_cache_bytes",
        "gauge",
        "gateway_prompt_tokens_cache_bytes",
        (
            "Memory held by the prompts' tokens kept for routing on KV events (block keys, "
            "and the pieces tokenized by the gateway; each capped by GATEWAY_KV_TOKENS_CACHE_MB)."
        ),
        (),
        multiprocess_mode="livesum",
        doc=(
            "memory held by the prompts' tokens kept for routing on KV events: their block keys, "
            "and the pieces of rendered prompts the gateway tokenized (`GATEWAY_TOKENIZERS`); "
            "each capped by `GATEWAY_KV_TOKENS_CACHE_MB`, the pieces per model"
        ),
    ),
    # Only with Redis configured: without it there is nothing shared to be down.
    MetricSpec(
        "shared_state_up",
        "gauge",
        "gateway_shared_state_up",
        (
            "1 while Redis (GATEWAY_REDIS_URL) answers: key limits and admission's views are "
            "the fleet's. 0 while the gateway uses its own (the lowest of its processes)."
        ),
        (),
        multiprocess_mode="livemin",
        only_with="redis_url",
        doc=(
            "only with `GATEWAY_REDIS_URL`: 1 while Redis answers within "
            "`GATEWAY_REDIS_TIMEOUT_S` (key limits and admission's views are the fleet's), 0 "
            "while the gateway runs on its own (the lowest of its processes); "
            "`GatewaySharedStateDown` fires after a minute at 0"
        ),
    ),
    MetricSpec(
        "library_assumption",
        "gauge",
        "gateway_library_assumption",
        (
            "1 where an undocumented part of a library the gateway leans on is as expected, 0 "
            "where not (logged at start-up with what it costs)."
        ),
        ("assumption",),
        multiprocess_mode="livemin",
        doc=(
            "1 where an undocumented part of a library the gateway leans on holds in the "
            "versions installed, 0 where it does not (logged at start-up, with what it costs): "
            "`uvicorn_protocol_contract`, `uvicorn_server_hooks`. `pyproject.toml` bounds "
            "those libraries at the "
            "releases the suite passed on; a 0 means an install outside the bounds"
        ),
    ),
)
"""Every metric of :class:`GatewayMetrics`, each built by :meth:`MetricSpec.build`."""


class GatewayMetrics:
    """Every metric the gateway exports, registered on ``registry``.

    In multiprocess mode (:func:`multiprocess_dir`) they are registered on a registry of this
    process that is never exposed; :attr:`registry`, the one ``/metrics`` exposes, then merges
    every process's files.
    """

    requests: Counter
    prompt_tokens: Counter
    completion_tokens: Counter
    in_flight: Gauge
    ttft: BatchHistogram
    itl: BatchHistogram
    tpot: BatchHistogram
    e2e: BatchHistogram
    queue: BatchHistogram
    overhead: BatchHistogram
    failover: BatchHistogram
    loop_lag: prometheus_client.Histogram
    admission_decisions: Counter
    saturated: Counter
    queue_depth: Gauge
    fairness_waiting_ids: Gauge
    fairness_top_share: Gauge
    queue_wait: BatchHistogram
    prediction_error: BatchHistogram
    slo_requests: Counter
    goodput_tokens: Counter
    goodput_ratio: Gauge
    tier_ttft_slo: Gauge
    tier_tpot_slo: Gauge
    tier_objective: Gauge
    workers_known: prometheus_client.Gauge
    workers_healthy: prometheus_client.Gauge
    worker_up: Gauge
    worker_ejected: Gauge
    worker_routed: Counter
    worker_failovers: Counter
    worker_ejections: Counter
    worker_running: Gauge
    worker_waiting: Gauge
    worker_kv_cache: Gauge
    worker_load_age: Gauge
    worker_in_flight: Gauge
    worker_ttft: BatchHistogram
    worker_itl: BatchHistogram
    worker_completion_tokens: Counter
    worker_peak_flops: Gauge
    worker_bandwidth: Gauge
    worker_roofline: Gauge
    worker_concurrency_limit: Gauge
    worker_prefill_limit: Gauge
    worker_proven_concurrency: Gauge
    worker_limit_cuts: Counter
    worker_decode_pace: Gauge
    worker_prefilling: Gauge
    worker_prefill_rate: Gauge
    worker_decode_step: Gauge
    worker_decode_per_sequence: Gauge
    worker_prefix_queries: Counter
    worker_prefix_hits: Counter
    worker_prefix_found: Counter
    worker_prefix_told: Counter
    worker_prefix_missed: Counter
    worker_prefix_blocks: Gauge
    worker_kv_events: Counter
    worker_kv_lost: Counter
    worker_kv_lag: BatchHistogram
    worker_kv_blocks: Gauge
    worker_kv_complete: Gauge
    prompt_tokenizations: Counter
    prefix_index_bytes: prometheus_client.Gauge
    prompt_tokens_cache_bytes: prometheus_client.Gauge
    shared_state_up: prometheus_client.Gauge | None
    library_assumption: Gauge

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
        for spec in METRICS:
            setattr(self, spec.attr, spec.build(settings, reg))
        self.saturated.labels(UPSTREAM_CONNECTIONS)
        self.saturated.labels(EVENT_LOOP)
        for tier in settings.tiers:
            # Exported at zero from the start: rate() counts only increases between scrapes, so
            # a series that first appears with its first burst of events shows no rate for it.
            self.queue_depth.labels(tier.name).set(0)
            self.fairness_waiting_ids.labels(tier.name).set(0)
            self.fairness_top_share.labels(tier.name).set(0)
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
            self.worker_prefix_queries, self.worker_prefix_hits, self.worker_prefix_found,
            self.worker_prefix_told, self.worker_prefix_missed, self.worker_prefix_blocks,
            self.worker_kv_events, self.worker_kv_lost, self.worker_kv_lag, self.worker_kv_blocks,
            self.worker_kv_complete,
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

    def kv_events(self, worker: str, events: int, lag_s: float | None) -> None:
        """``events`` of a batch of ``worker``'s KV cache events, published ``lag_s`` ago.

        A replayed batch (``lag_s`` None) is counted, its age is not a lag.
        """
        self.worker_kv_events.labels(worker).inc(events)
        if lag_s is not None:
            self.worker_kv_lag.labels(worker).observe(lag_s)

    def kv_followed(self, worker: str) -> None:
        """``worker``'s events are followed: its counters exist (at 0) before anything comes."""
        self.worker_kv_events.labels(worker)
        self.worker_kv_lost.labels(worker)

    def kv_events_lost(self, worker: str, batches: int) -> None:
        """``batches`` of ``worker``'s KV cache events were missed and not replayed."""
        self.worker_kv_lost.labels(worker).inc(batches)

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
            elif isinstance(metric, Labelled):
                child = metric.labels(worker)
                if isinstance(child, prometheus_client.Gauge):
                    child.set(0)
        if not self.multiprocess:
            for cause in LimitCut:
                with contextlib.suppress(KeyError):
                    self.worker_limit_cuts.remove(worker, cause)

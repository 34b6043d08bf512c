"""The worker pool: who the workers are, whether they are healthy, how loaded they are.

Background tasks keep it current: discovery (static list + DNS, and each worker's
``/v1/models``), an active ``/health`` probe, and a ``/metrics`` scrape for load. Requests
report their outcome back (passive health): consecutive failures eject a worker for a backoff
that doubles on repeat; a worker that answers its probe after the backoff returns.

Model cards are kept as the worker sent them (vLLM's ``root`` and ``max_model_len`` included),
because benchmark clients read them from the gateway's ``/v1/models``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import Counter
from typing import Any, Protocol

import httpx

from app.api.outcome import LimitCut
from app.fleet.discovery import Resolver, discover
from app.fleet.gauges import WorkerGauges
from app.fleet.kvevents import KVEvents, SourceUnknown, find_source
from app.fleet.kvindex import ENTRY_BYTES as KV_ENTRY_BYTES
from app.fleet.kvindex import KVIndex
from app.fleet.limiter import ConcurrencyLimit, DecodePace
from app.fleet.loadsignals import LoadSample, held_back, parse_load
from app.fleet.predictor import LatencyModel, RecentQuantile, WorkerLoad
from app.fleet.prefix import PrefixIndex
from app.fleet.probes import Prober
from app.fleet.wire import WireClient
from app.observe.metrics import OTHER_MODEL, GatewayMetrics
from app.observe.timing import Clock
from app.settings import Settings, WorkerSpec

log = logging.getLogger(__name__)
# Ejection backoff doubles at most this many times (far past any GATEWAY_EJECT_MAX_S).
_MAX_DOUBLINGS = 32

# How far past the strictest TPOT target a worker's pace closes its reading window early.
_PACE_ALARM = 1.25
# The time over which recent_load averages a worker's requests in flight.
_RECENT_S = 10.0


class DecodingStream(Protocol):
    """A request past its first output on a worker (its lease): a prefill there stalls it."""

    tier: str

    def stall_room(self, now: float, aim_s: float, typical: float | None) -> float:
        """Seconds of stall it can take and still end within ``aim_s`` a token."""
        ...


class Worker:
    """One vLLM worker and what the gateway knows about it."""

    def __init__(
        self,
        spec: WorkerSpec,
        limit: ConcurrencyLimit | None = None,
        prefill_limit: ConcurrencyLimit | None = None,
    ) -> None:
        self.spec = spec
        self.label = spec.label
        self.models: set[str] = set(spec.models)
        self.cards: dict[str, dict[str, Any]] = {}
        self.up = False
        self.last_seen: float | None = None
        self.draining = False
        self.in_flight = 0
        self.tier_in_flight: Counter[str] = Counter()
        """Of ``in_flight``, how many per tier (admission keeps capacity for higher tiers)."""
        self.prefill_tokens_ahead = 0.0
        self.tier_prefilling: Counter[str] = Counter()
        """Of ``prefilling``, how many per tier (a lower tier's prompt waits for a higher one)."""
        self.failures = 0
        self.ejections = 0
        self.ejected_until: float | None = None
        self.last_ejected: float | None = None
        self.load: LoadSample | None = None
        self.held_back = False
        """Whether its last two load samples say it holds requests back for capacity
        (:func:`app.fleet.loadsignals.held_back`): it runs all it can."""
        self.most_running = 0.0
        """The most it has been read to run since it was last seen up (a cap shows here)."""
        self.latency = LatencyModel()
        self.limit = limit or ConcurrencyLimit(initial=256, maximum=256)
        """How many requests admission lets run here, steered by their measured TPOT."""
        self.prefilling = 0
        """Requests sent here that have not produced their first token yet."""
        self.decoding: set[DecodingStream] = set()
        """Leases of the requests here past their first output: a prefill stalls their decode."""
        self.served_within_aim = 0.0
        """The most it ran (a stream's mean load) with a stream's TPOT in half the aim to it."""
        self.served_at_aim = 0.0
        """Those loads scaled by the aim over the stream's TPOT: what would decode at the aim."""
        self.floor_tpot = 0.0
        """The fastest TPOT it is known to reach: its last lone stream's, or faster if seen
        since (0: not measured). A target under it is out of reach (``Limits.targets``)."""
        self.pace = DecodePace()
        """The live gap between output events of its running streams (steers ``limit``)."""
        self.recent_ttft = RecentQuantile(0.8)
        """The 80th percentile of its last times to first token (dispatch to first output)."""
        self.prefill_limit = prefill_limit or ConcurrencyLimit(initial=256, maximum=256)
        """How many may be prefilling at once, steered by their measured time to first token."""
        self.context_tokens = 0.0
        """Running average of prompt + completion tokens per request (for the roofline)."""
        self.own_at_scrape = 0
        """``in_flight`` when ``load`` was read: the rest of what it counted is others'."""
        self.fleet_others = 0.0
        """Requests the fleet's other gateway processes have open here, as last read from Redis."""
        self.fleet_until = -math.inf
        """Until when ``fleet_others`` counts (a reading goes stale when Redis is not read)."""
        self.fleet_tiers: dict[str, int] = {}
        """Of ``fleet_others``, how many per tier (as ``tier_in_flight`` is of ``in_flight``)."""
        self.fingerprint: bytes | None = None
        """Its ``system_fingerprint`` as a JSON member (empty if it sends none); None: not seen."""
        self.prefixes = PrefixIndex()
        """Prompt prefixes recently routed here (``prefix_aware`` routing)."""
        self.kv: KVIndex | None = None
        """The blocks its KV cache events say it holds (None: its events are not followed)."""
        self._occupancy = 0.0
        self._occupancy_at = 0.0
        self._recent = 0.0
        self._recent_at = -math.inf

    def occupancy(self, now: float) -> float:
        """Request-seconds run here up to ``now``: ``in_flight`` integrated over time.

        Two readings give the mean number of requests a stream shared the worker with.
        """
        return self._occupancy + self.in_flight * (now - self._occupancy_at)

    def recent_load(self, now: float) -> float:
        """``in_flight`` averaged over about the last ``_RECENT_S`` seconds (decaying).

        Where a new prefix is placed decides where its traffic goes for as long as it is held;
        a worker's share of the traffic shows in its mean load, not in its count of the moment.
        """
        elapsed = now - self._recent_at
        if elapsed <= 0:
            return self._recent
        kept = math.exp(-elapsed / _RECENT_S)
        return self._recent * kept + self.in_flight * (1.0 - kept)

    def prefill_seconds(self, tokens: float) -> float:
        """Seconds the prompts prefilling here and one of ``tokens`` more take to prefill.

        At the learnt rate per uncached token, without the fitted intercept
        (:meth:`app.admission.queue.AdmissionController._min_service` says why).
        """
        return self.latency.prefill.slope * (self.prefill_tokens_ahead + tokens)

    # What admission's limits (app.admission.limits) and the relay learn of the worker: only
    # these methods change the facts below.

    def reset_served(self) -> None:
        """Forget the loads seen served within the aim: they were of a target no longer kept."""
        self.served_within_aim = self.served_at_aim = 0.0

    def saw_served(self, served: float, tpot_s: float, aim: float) -> None:
        """A stream kept the TPOT aim (``tpot_s`` <= ``aim``) at load ``served``: learn from it.

        Only a batch that slowed a stream towards the aim (to half of it or more) sets the
        seen load: at a light load TPOT is the bare decode step, and a bound learnt there would
        hold the next burst's lower tiers to the few that ran then. While the bound applies
        (:meth:`app.admission.limits.Limits.seen_bound`: no measurement has set ``limit``), a
        stream within the aim that ran at it raises it by one, as the running limit grows: the
        bound holds the batch at what was seen, and the mean load of the streams living at it is
        at most the bound, so it grew only when the top tier went past it. On a worker pacing
        120 ms a token whatever its batch, two interactive streams set it at 2 and standard
        requests, with a slot kept for interactive out of it, ran only on an otherwise empty
        worker (11 of 80 served, 80 with admission off).
        """
        seen = self.served_within_aim
        if tpot_s >= aim / 2:
            self.served_within_aim = max(seen, served)
            self.served_at_aim = max(self.served_at_aim, served * aim / tpot_s)
        if seen >= 1.0 and not self.limit.measured and served >= math.floor(seen) - 1:
            self.served_within_aim = max(self.served_within_aim, math.floor(seen) + 1.0)
            self.served_at_aim = max(self.served_at_aim, self.served_within_aim)

    def saw_tpot(self, tpot_s: float, alone: bool) -> None:
        """A stream finished at ``tpot_s`` a token: learn the fastest TPOT the worker reaches.

        A stream that decoded ``alone`` measured the worker's own pace (no batch is smaller)
        and sets it; any faster stream lowers it.
        """
        self.floor_tpot = tpot_s if alone else min(self.floor_tpot, tpot_s)

    def learn_fingerprint(self, member: bytes) -> None:
        """Its ``system_fingerprint``, as a JSON member, was seen in an answer (empty: none)."""
        self.fingerprint = member

    # A request's slot: the lease (app.fleet.lease) reports its life here, and only these
    # methods change the load counters below.

    def took(self, tier: str, prefill_tokens: float, now: float) -> int:
        """A request of ``tier`` took a slot at ``now``, ``prefill_tokens`` to prefill.

        Returns how many prefill here now, itself included.
        """
        self.add_in_flight(1, now)
        self.tier_in_flight[tier] += 1
        self.prefilling += 1
        self.tier_prefilling[tier] += 1
        self.prefill_tokens_ahead += prefill_tokens
        return self.prefilling

    def prefilled(self, stream: DecodingStream, prefill_tokens: float) -> None:
        """``stream`` (of ``stream.tier``) had its first output: it decodes from now on."""
        self.prefill_tokens_ahead -= prefill_tokens
        self.prefilling -= 1
        self.tier_prefilling[stream.tier] -= 1
        self.decoding.add(stream)

    def gave_back(
        self, stream: DecodingStream, prefill_tokens: float, prefilled: bool, now: float
    ) -> None:
        """``stream``'s slot came back at ``now`` (``prefilled``: after its first output)."""
        self.add_in_flight(-1, now)
        self.tier_in_flight[stream.tier] -= 1
        self.decoding.discard(stream)
        if not prefilled:
            self.prefill_tokens_ahead -= prefill_tokens
            self.prefilling -= 1
            self.tier_prefilling[stream.tier] -= 1

    def add_in_flight(self, delta: int, now: float) -> None:
        """Count ``delta`` requests in (or out of) ``in_flight`` at ``now``."""
        self._occupancy = self.occupancy(now)
        self._occupancy_at = now
        self._recent = self.recent_load(now)
        self._recent_at = now
        self.in_flight += delta

    def others(self, now: float, max_age: float) -> float:
        """Requests on the worker that are not this gateway process's.

        The larger of two views. From a fresh load sample: running and waiting as the worker
        counted them, less what this process had in flight then (other processes', other
        replicas' and any other client's requests). Requests this process dispatched or
        finished since are in ``in_flight`` already, so ``in_flight + others`` is the scrape
        plus the credit of what changed since (a stale scrape cannot over-admit). And, with
        shared state (:mod:`app.admission.shared`), what the fleet's other gateway processes have
        open here now, read within a sync or two: fresher than a scrape, but blind to clients that
        bypass the gateway. Neither alone undercounts what it sees.
        """
        fleet = self.fleet_others if now <= self.fleet_until else 0.0
        sample = self.load
        if sample is None or now - sample.at > max_age:
            return fleet
        return max(fleet, sample.running + sample.waiting - self.own_at_scrape)

    def set_fleet_others(
        self, others: float, now: float, fresh_s: float, tiers: dict[str, int]
    ) -> None:
        """The fleet's other gateway processes have ``others`` requests open here (read now).

        ``tiers``: how many of them per tier.
        """
        self.fleet_others = others
        self.fleet_tiers = tiers
        self.fleet_until = now + fresh_s

    def fleet_tier_in_flight(self, now: float) -> dict[str, int]:
        """The fleet's other processes' requests here per tier; empty when the reading is stale."""
        return self.fleet_tiers if now <= self.fleet_until else {}

    def saturated(self, now: float, max_age: float, kv_cache: float) -> bool:
        """Whether the worker says it is full (fresh figures only).

        It holds requests back for capacity (``held_back``), or its KV cache is at least
        ``kv_cache`` used.
        """
        sample = self.load
        if sample is None or now - sample.at > max_age:
            return False
        return self.held_back or sample.kv_cache_usage >= kv_cache

    def saw_load(self, sample: LoadSample, own: int, waiting: float, kv_full: float) -> bool:
        """Take ``sample`` as its load, ``own`` being this process's requests in it.

        Returns whether it now holds ``waiting`` or more requests back for capacity
        (:func:`app.fleet.loadsignals.held_back`, from this sample and the one before, with
        ``kv_full`` the KV-cache use that counts as full).
        """
        self.most_running = max(self.most_running, sample.running)
        self.held_back = held_back(self.load, sample, waiting, self.most_running, kv_full)
        self.load = sample
        self.own_at_scrape = own
        return self.held_back

    def kv_fit(self) -> float:
        """How many requests of the typical size (prompt + answer) the KV cache holds."""
        sample = self.load
        if sample is None or sample.kv_tokens is None or self.context_tokens <= 0:
            return math.inf
        return sample.kv_tokens / self.context_tokens

    @property
    def discovered(self) -> bool:
        """Whether ``/v1/models`` has been read from this worker at least once."""
        return bool(self.cards)

    def ejected(self, now: float) -> bool:
        """Whether passive health has taken the worker out of rotation at ``now``."""
        return self.ejected_until is not None and now < self.ejected_until

    def healthy(self, now: float) -> bool:
        """Whether new requests may go to this worker."""
        return self.up and not self.draining and not self.ejected(now)

    def current_load(self, now: float, max_age: float) -> tuple[WorkerLoad, bool]:
        """The load a request would meet here, and whether the worker's own figures are fresh.

        The gateway's own counts are exact for its traffic; the worker's scraped figures also
        cover other gateway replicas. The larger of the two is taken.
        """
        sample = self.load
        fresh = sample is not None and now - sample.at <= max_age
        running = float(self.in_flight)
        ahead = self.prefill_tokens_ahead
        waiting = 0.0
        if sample is not None and fresh:
            running = max(running, sample.running)
            waiting = sample.waiting
        return WorkerLoad(ahead, running, waiting), fresh


class WorkerPool:
    """All workers, kept current by probes over ``wire``, with passive health from requests."""

    def __init__(
        self,
        settings: Settings,
        wire: WireClient,
        metrics: GatewayMetrics,
        clock: Clock,
        resolver: Resolver,
    ) -> None:
        self.settings = settings
        self.workers: dict[str, Worker] = {}
        self._prober = Prober(wire)
        self._gauges = WorkerGauges(settings, metrics)
        self._metrics = metrics
        self._clock = clock
        self._resolver = resolver
        self.kv_events: KVEvents | None = None
        """The followers of the workers' KV cache events (``prefix_aware`` routing only)."""
        if settings.kv_events and settings.routing == "prefix_aware":
            self.kv_events = KVEvents(metrics)
        for spec in settings.workers:
            self._add(spec)

    @property
    def metrics(self) -> GatewayMetrics:
        """The metrics the pool exports its workers' state to."""
        return self._metrics

    # Membership ---------------------------------------------------------------------------

    def _add(self, spec: WorkerSpec) -> Worker:
        settings = self.settings
        most = settings.max_running_per_worker
        # Both limits start at what a worker can run at most and come down only on evidence
        # (latency over target, or the worker holding requests back): a low start turned
        # away bursts an idle worker would have served.
        limit = ConcurrencyLimit(initial=settings.initial_running_per_worker or most, maximum=most)
        prefill_limit = ConcurrencyLimit(initial=most, maximum=most)
        worker = Worker(spec, limit, prefill_limit)
        target = settings.strictest_tpot_s
        if target is not None:
            # A surge that slows every stream a quarter past the target is read within a second.
            worker.pace.alarm = _PACE_ALARM * target
        self.workers[worker.label] = worker
        self._gauges.added(worker.label, worker.models)
        log.info("worker %s added (%s)", worker.label, spec.base_url)
        return worker

    def _remove_drained(self) -> None:
        for label in [w.label for w in self.workers.values() if w.draining and not w.in_flight]:
            del self.workers[label]
            if self.kv_events is not None:
                self.kv_events.forget(label)
            self._gauges.removed(label)
            log.info("worker %s removed", label)

    async def rediscover(self) -> None:
        """Apply the current worker list: add new ones, drain the ones that left."""
        try:
            specs = await discover(self.settings, self._resolver)
        except OSError as exc:
            log.warning("worker discovery failed, keeping the current workers: %s", exc)
            return
        current = {spec.label: spec for spec in specs}
        for label, spec in current.items():
            worker = self.workers.get(label)
            if worker is None:
                self._add(spec)
            elif worker.draining:
                worker.draining = False
                log.info("worker %s is back in discovery", label)
        for label, worker in self.workers.items():
            if label not in current and not worker.draining:
                worker.draining = True
                log.info(
                    "worker %s left discovery: draining %d request(s)", label, worker.in_flight
                )
        self._remove_drained()

    # Queries ------------------------------------------------------------------------------

    def served_models(self) -> set[str]:
        """Every model some worker serves (or is configured to serve)."""
        return {model for worker in self.workers.values() for model in worker.models}

    def model_label(self, model: str) -> str:
        """``model`` if a worker serves it, else ``other``: keeps the label's values bounded."""
        for worker in self.workers.values():
            if model in worker.models:
                return model
        return OTHER_MODEL

    def model_cards(self) -> list[dict[str, Any]]:
        """The union of the workers' model cards, one per model id."""
        cards: dict[str, dict[str, Any]] = {}
        for worker in self.workers.values():
            for model_id, card in worker.cards.items():
                cards.setdefault(model_id, card)
            for model_id in worker.models:
                cards.setdefault(model_id, {"id": model_id, "object": "model", "owned_by": "vllm"})
        return sorted(cards.values(), key=lambda card: str(card.get("id")))

    def ready(self) -> bool:
        """Whether any worker is healthy."""
        now = self._clock()
        return any(worker.healthy(now) for worker in self.workers.values())

    def now(self) -> float:
        """The pool's clock."""
        return self._clock()

    def export(self) -> None:
        """Refresh the gauges that depend on time or on several figures (before an export)."""
        self._gauges.export(self.workers.values(), self._clock())

    def record_tokens(self, worker: Worker, prompt: int, completion: int) -> None:
        """Learn a worker's typical context length from a finished request's usage."""
        total = float(prompt + completion)
        old = worker.context_tokens
        worker.context_tokens = total if old == 0 else old + 0.05 * (total - old)

    # Passive health -----------------------------------------------------------------------

    def report_success(self, worker: Worker) -> None:
        """A request got its first byte from ``worker``."""
        worker.failures = 0
        now = self._clock()
        if (
            worker.last_ejected is not None
            and now - worker.last_ejected > self.settings.eject_max_s
        ):
            worker.ejections = 0

    def report_failure(self, worker: Worker, reason: str, sent_at: float | None = None) -> None:
        """A request sent at ``sent_at`` failed on ``worker`` before its first byte.

        A request sent before the worker's last ejection does not count: it failed of what
        ejected the worker, one fault however many requests were in flight (at 9,800 streams
        ramping up, connects that timed out together ejected four workers 2,180 times, each
        for the longest backoff).
        """
        last = worker.last_ejected
        if sent_at is not None and last is not None and sent_at <= last:
            return
        worker.failures += 1
        if worker.failures < self.settings.eject_after_failures:
            return
        now = self._clock()
        worker.failures = 0
        worker.ejections += 1
        # The exponent is capped: requests already in flight keep failing after an ejection and
        # count further ejections, and 2 ** 1,024 is no float (a 5,000-stream burst got there).
        backoff = min(
            self.settings.eject_max_s,
            self.settings.eject_base_s * 2.0 ** min(worker.ejections - 1, _MAX_DOUBLINGS),
        )
        worker.ejected_until = now + backoff
        worker.last_ejected = now
        self._metrics.worker_ejections.labels(worker.label).inc()
        self._gauges.state(worker.label, False, True)
        log.warning("worker %s ejected for %.1f s after repeated %s", worker.label, backoff, reason)

    # Probes: the prober runs them (app.fleet.probes); what their answers mean is the pool's.

    async def probe_models(self, worker: Worker) -> None:
        """Read ``/v1/models`` from ``worker``."""
        started = asyncio.get_running_loop().time()
        try:
            response = await self._prober.get(
                worker.spec, "/v1/models", self.settings.connect_timeout_s
            )
            payload = response.json()
            cards = {str(card["id"]): card for card in payload["data"] if isinstance(card, dict)}
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self._probe_failed(worker, exc, started)
            return
        worker.cards = cards
        worker.models = set(cards) | set(worker.spec.models)
        for model in worker.models:
            self._metrics.start_model(model)
        self.set_up(worker, True, None)
        if self.kv_events is not None:
            await self._follow_kv(worker, self.kv_events)

    async def _follow_kv(self, worker: Worker, events: KVEvents) -> None:
        """Follow the worker's KV cache events where it publishes them, until it no longer does."""
        timeout = self.settings.connect_timeout_s
        try:
            source = await find_source(worker.spec, self._prober.get, timeout)
        except SourceUnknown:
            return  # it cannot say now: what is followed is kept
        if source is None:
            events.forget(worker.label)
            worker.kv = None
            return
        if worker.kv is None:
            per_worker = self.settings.prefix_index_mb * 2**20 / KV_ENTRY_BYTES
            worker.kv = KVIndex(int(per_worker / max(1, len(self.workers))))
        events.follow(worker.label, source, worker.kv)

    async def probe_health(self, worker: Worker) -> None:
        """Probe ``/health``; a worker whose models are unknown also gets ``/v1/models`` read."""
        if not worker.discovered:
            await self.probe_models(worker)
            return
        started = asyncio.get_running_loop().time()
        try:
            await self._prober.get(worker.spec, "/health", self.settings.connect_timeout_s)
        except httpx.HTTPError as exc:
            self._probe_failed(worker, exc, started)
        else:
            self.set_up(worker, True, None)

    def _probe_failed(self, worker: Worker, error: BaseException, started: float) -> None:
        """A probe started at ``started`` (loop time) failed: the worker is down.

        Unless the probe timed out late, of the gateway's own busy loop
        (:meth:`app.fleet.probes.Prober.timed_out_late`): that says nothing of the worker.
        """
        timeout = self.settings.connect_timeout_s
        if not self._prober.timed_out_late(worker.label, error, started, timeout):
            self.set_up(worker, False, error)

    async def scrape_load(self, worker: Worker) -> None:
        """Read the worker's load from its ``/metrics``."""
        timeout = max(self.settings.load_interval_s, 0.25)
        own = worker.in_flight
        try:
            response = await self._prober.get(worker.spec, "/metrics", timeout)
            # Prometheus' text format is UTF-8: ``text`` would look for a charset each scrape.
            sample = parse_load(response.content.decode("utf-8", "replace"), self._clock())
        except (httpx.HTTPError, ValueError):
            return  # the sample ages and counts as busy; health is the probe's business
        before = worker.load
        s, own = self.settings, min(own, worker.in_flight)
        saturated = worker.saw_load(sample, own, s.saturation_waiting, s.saturation_kv_cache)
        # A worker that runs all it can and queues the rest: its limit is what it runs, which
        # both pages showed (app.fleet.loadsignals.held_back).
        ran = sample.running if before is None else max(before.running, sample.running)
        if saturated and worker.limit.hold(ran, sample.at):
            self._metrics.limit_cut(worker.label, LimitCut.WORKER_QUEUEING)
        self._metrics.record_load(
            worker.label, sample.running, sample.waiting, sample.kv_cache_usage, sample.at
        )

    def set_up(self, worker: Worker, up: bool, error: BaseException | None) -> None:
        """A probe's verdict on ``worker``: up, or not (``error`` says why).

        A worker back up after being unreachable starts with an empty prefix index: it may have
        restarted, and its cache with it.
        """
        if up and not worker.up:
            log.info("worker %s is up, serving %s", worker.label, sorted(worker.models))
            # Back from being unreachable, perhaps restarted: its cache and caps may be new.
            worker.prefixes.clear()
            worker.most_running = 0.0
            if self.kv_events is not None and worker.kv is not None:
                self.kv_events.restart(worker.label)  # its history read again, from 0
        elif not up and (worker.up or worker.last_seen is None):
            log.warning("worker %s is not answering: %s", worker.label, _describe(error))
        worker.up = up
        now = self._clock()
        if up:
            worker.last_seen = now
        ejected = worker.ejected(now)
        self._gauges.state(worker.label, up and not ejected, ejected)

    async def refresh(self) -> None:
        """Run discovery and read every worker's ``/v1/models`` once."""
        await self.rediscover()
        await asyncio.gather(*(self.probe_models(w) for w in list(self.workers.values())))

    async def start(self, first_wait: float) -> None:
        """Discover and probe every worker (waiting at most ``first_wait``), then keep going."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.refresh()), first_wait)
        s, prober = self.settings, self._prober
        prober.start(
            [
                ("discovery", s.discovery_interval_s, self.refresh),
                (
                    "health-probe",
                    s.probe_interval_s,
                    lambda: prober.each("health", self.workers.values(), self.probe_health),
                ),
                (
                    "load-scrape",
                    s.load_interval_s,
                    lambda: prober.each("load", self.workers.values(), self.scrape_load),
                ),
            ]
        )

    async def stop(self) -> None:
        """Stop the background tasks."""
        await self._prober.stop()
        if self.kv_events is not None:
            await self.kv_events.close()


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

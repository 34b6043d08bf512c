"""Room: whether a worker takes one more request of a tier now.

A worker has no room for a request when:

* the worker says it is full: it holds requests back for capacity, or its KV cache is nearly
  full (its ``/metrics``, scraped every half second; what this gateway sent or finished since
  the scrape is counted from its own books);
* or a limit learnt from latencies is reached (:mod:`app.fleet.limiter`): the running limit keeps
  the strictest TPOT target of the tiers in play, the prefill limit keeps the worker's own
  time to first token within half their strictest TTFT target (holding a prompt only while a
  higher tier's request prefills there or is likely to arrive). Both start at the hard cap
  and come down only on evidence;
* or the slots the tiers above are expected to need are all that is left
  (:mod:`app.admission.demand`);
* or, below a tier with recent requests, the prompts prefilling on the worker and this one
  would take longer than that tier's share of its TTFT target (the prefill budget);
* or, below a tier with a stream decoding on the worker, their prefill would stall that
  stream past its TPOT aim at its pace so far (the stall budget).

:mod:`app.admission.queue` asks it of every worker serving a request's model, and queues the request
while none has room.
"""

from __future__ import annotations

import itertools
import math

from app.admission.demand import TierDemand
from app.admission.limits import Limits
from app.fleet.workers import Worker
from app.observe.timing import Clock
from app.settings import Settings, TierSpec

# First tokens a worker's prefill rate must be learnt from before the prefill budget holds
# anything: the prior rate is a guess, and a budget from it held a cold burst on a worker
# that serves any number at once.
_MEASURED_PREFILLS = 8
# Higher-tier requests expected to arrive at a worker during a step before the prefill budget
# holds a lower tier's prompt out of it: below saturation they rarely come, and holding the
# prompt only queues it on a worker with room.
_LIKELY_ARRIVALS = 0.5


class Room:
    """Whether a worker has room for one more request of a tier, by the rules above."""

    def __init__(
        self, settings: Settings, limits: Limits, demand: TierDemand, clock: Clock
    ) -> None:
        self._settings = settings
        self.limits = limits
        self.demand = demand
        self._clock = clock
        self.priorities = {t.name: t.priority for t in settings.tiers}
        """Each tier's priority, by name (the lowest number is the top tier)."""
        self.top = min(self.priorities.values())
        """The top tier's priority: nobody goes ahead of its requests."""
        self._tpot_by_name = {t.name: t.tpot_slo_s for t in settings.tiers}
        self._ttft_by_priority: dict[int, float] = {}
        for t in settings.tiers:
            known = self._ttft_by_priority.get(t.priority, math.inf)
            self._ttft_by_priority[t.priority] = min(known, t.ttft_slo_s)
        self._strictest_above: dict[int, float] = {
            p: min((t for q, t in self._ttft_by_priority.items() if q < p), default=math.inf)
            for p in self._ttft_by_priority
        }
        """Per tier priority: the strictest TTFT target of the tiers above it (inf: none)."""

    def idle(self, worker: Worker, now: float) -> bool:
        """Whether ``worker`` runs nothing and says it is not full: then it has room for any tier.

        Every limit :meth:`full` reads is at least one request (a cut limit, the slots kept for
        higher tiers, the KV cache's fit all leave one), no prompt prefills and no stream
        decodes there to be delayed or stalled: :meth:`full` is False for it, whatever the tier,
        as long as no slot is yielded to other processes' queued requests.
        """
        return (
            not worker.prefilling
            and not worker.decoding
            and self.limits.occupied(worker, now) <= 0
            and not self.limits.saturated(worker, now)
        )

    def full(
        self,
        worker: Worker,
        tier: TierSpec | None = None,
        workers: int = 1,
        now: float | None = None,
        reserving: bool = True,
        tokens: float = 0.0,
        yielded: int = 0,
    ) -> bool:
        """Whether ``worker`` (one of ``workers`` serving the model) takes no more of ``tier``.

        The worker says it is full, or it runs at its limit, or (below the top tier) it prefills at
        its limit while a higher tier's request would wait (:meth:`_prefill_limit_holds`). While
        lower tiers' requests run on it, a tier may go past the running limit by as many: a running
        request cannot be preempted, so without that a slot handed to a lower tier while the pool
        had room would turn away a higher tier's request that pass-through would have served in
        time. The top tier's own requests alone count against the limit (up to
        :meth:`app.admission.limits.Limits.hard_cap`): when a cut leaves more running than the
        limit, those over it are lower tiers', which then wait until the batch is back under their
        limits; the top tier does not wait for the streams it would have gone ahead of, nor for a
        cut below the load the worker was seen to serve within the aim
        (:meth:`app.admission.limits.Limits.top_cap`). A middle tier goes past by as many, up to
        :meth:`app.admission.limits.Limits.stretched_cap`. When ``reserving`` (the pool is expected
        to saturate), the limits are lower below a tier that has had requests in the last seconds:
        the running slots that tier is expected to need
        (:meth:`app.admission.demand.TierDemand.kept_for_higher`) and one prefill slot are kept free
        for it, leaving a lower tier at least the last slot of an otherwise empty worker. They come
        out of :meth:`app.admission.limits.Limits.proven_cap`, without the stretch: while a higher
        tier is expected, a lower one does not take the batch past the aim. Below a tier with recent
        requests, a prompt of ``tokens`` uncached tokens also keeps to the prefill budget
        (:meth:`_prefill_over_budget`), and below a tier with a stream decoding here, to the stall
        budget (:meth:`_stalls_higher`). And ``yielded`` more slots stay free for the requests of
        higher tiers queued in other gateway processes
        (:meth:`app.admission.demand.TierDemand.queued_elsewhere`): the next slots are theirs, as
        they would be in one queue, even the last one.
        """
        now = self._clock() if now is None else now
        limits = self.limits
        if limits.saturated(worker, now):
            return True
        cap, prefill_cap = limits.cap(worker), limits.prefill_cap(worker)
        above = 0  # requests of the tiers above ``tier`` on the worker
        if tier is not None:
            priorities, mine = self.priorities, tier.priority
            below = 0
            # Every gateway process's: the top tier here goes past the limit by the lower
            # tiers' streams another process runs there, and what is kept for the tiers above
            # counts those they run there already.
            fleet = worker.fleet_tier_in_flight(now).items()
            for name, n in itertools.chain(worker.tier_in_flight.items(), fleet):
                priority = priorities.get(name)
                if priority is None:  # a tier of another configuration (mid-rollout)
                    continue
                if priority < mine:
                    above += n
                elif priority > mine:
                    below += n
            if mine == self.top:
                cap = min(limits.hard_cap(worker), limits.top_cap(worker) + below)
            elif below:
                cap = max(cap, min(limits.stretched_cap(worker), cap + below))
            demand = self.demand
            kept = demand.kept_for_higher(tier, workers, above, now) if reserving else 0
            if kept:
                # Kept from what the worker is known to serve, not from a limit no
                # measurement has set yet (the KV cache's fit): kept from that, the slots
                # left a lower tier are all the worker can run. It is at most the limit, so
                # the stretch above does not apply here.
                cap = limits.proven_cap(worker)
                cap -= min(cap - 1, kept)
                prefill_cap -= min(prefill_cap - 1, 1)
            cap -= yielded
        if limits.occupied(worker, now) >= cap:
            return True
        if (
            tier is not None
            and tokens
            and (
                self._prefill_over_budget(worker, tier, tokens, workers, now)
                # Only streams of the tiers above can be stalled past their aim.
                or (above and self._stalls_higher(worker, tier, tokens, now))
            )
        ):
            return True
        # The top tier is not held back for prefill room: nobody may go ahead of it, and among
        # its own requests the gateway's queue is first come, first served, as vLLM's is.
        if tier is not None and tier.priority == self.top:
            return False
        return worker.prefilling >= prefill_cap and (
            tier is None or self._prefill_limit_holds(worker, tier, tokens, workers, now)
        )

    def _prefill_limit_holds(
        self, worker: Worker, tier: TierSpec, tokens: float, workers: int, now: float
    ) -> bool:
        """Whether a prompt of ``tier`` waits for ``worker``, at its prefill limit.

        Only while a request of a tier above would wait for it: one prefills on ``worker``
        now, or one is likely to arrive there while the prompts ahead and this one prefill
        (``_LIKELY_ARRIVALS`` at those tiers' recent rate, shared over ``workers``, as for the
        prefill budget; before the worker's prefill rate is learnt, at the prior rate blended
        with what was seen). The limit is there for the first tokens of the tiers above; with
        none of them near, holding only queues a prompt on a worker with room (seen on a CPU
        worker whose prompts took 0.4-0.6 s alone, near the limit's 0.5 s target: at 0.75x of
        capacity, the limit cut to 1 queued 8 of 23 requests for up to 1 s, where none needed
        it).
        """
        priorities, mine = self.priorities, tier.priority
        if any(n and priorities[name] < mine for name, n in worker.tier_prefilling.items()):
            return True
        return self.higher_likely(tier, workers, worker.prefill_seconds(tokens), now)

    def higher_likely(self, tier: TierSpec, workers: int, seconds: float, now: float) -> bool:
        """Whether a request of a tier above ``tier`` is likely at a worker within ``seconds``.

        ``_LIKELY_ARRIVALS`` or more expected at those tiers' recent arrival rate, shared over
        ``workers``: the test by which the prefill limit and the prefill budget hold a prompt.
        """
        rate = sum(r for p, r in self.demand.arrival_rates(now).items() if p < tier.priority)
        return rate / max(workers, 1) * seconds >= _LIKELY_ARRIVALS

    def _prefill_over_budget(
        self, worker: Worker, tier: TierSpec, tokens: float, workers: int, now: float
    ) -> bool:
        """Whether a prompt of ``tier`` would queue too much prefill ahead of a higher tier.

        While a tier above had requests in the last seconds, a lower tier's prompt joins the
        prompts prefilling on ``worker`` only if, together, they take no longer than the
        headroom times half the strictest TTFT target of those tiers (the worker's share of
        it, as for the prefill limit), at the worker's learnt prefill rate; the first prompt
        always goes. vLLM schedules every waiting prompt it can into one step, and a higher
        tier's request arriving during that step waits for all of it before its own prefill
        (seen on a CPU worker: three standard prompts dispatched together made a 1.1 s step,
        and the four interactive requests arriving in it got their first tokens after
        1.4-2.3 s, against a 1 s target). ``tokens`` is the prompt's, less what the worker
        should have cached. Only once the rate was learnt from a few first tokens, and only
        while the tiers above arrive often enough that one of their requests is likely during
        that step (``_LIKELY_ARRIVALS`` at their recent rate, shared over ``workers``): below
        saturation the step usually passes with none, and the hold would only queue a prompt
        on a worker with room.
        """
        if not worker.prefilling or worker.latency.prefill.observed < _MEASURED_PREFILLS:
            return False
        seconds = worker.prefill_seconds(tokens)
        headroom = self._settings.ttft_headroom
        # Within the budget of the strictest tier above, the prompt is within any of them: the
        # tiers' recent arrivals (computed once per decision, but costly) are not needed.
        strictest = self._strictest_above.get(tier.priority, 0.0)
        if seconds <= headroom * strictest / 2:
            return False
        above = {p: r for p, r in self.demand.arrival_rates(now).items() if p < tier.priority}
        if not above:
            return False
        target = min(self._ttft_by_priority[p] for p in above)
        if seconds <= headroom * target / 2:
            return False
        return self.higher_likely(tier, workers, seconds, now)

    def _stalls_higher(self, worker: Worker, tier: TierSpec, tokens: float, now: float) -> bool:
        """Whether a prompt of ``tier`` would stall a higher tier's stream past its TPOT aim.

        vLLM runs a new prompt's prefill in the same steps as the running streams' decode, and
        each of them waits for it. A lower tier's prompt of ``tokens`` uncached tokens joins
        ``worker`` only if every stream of a higher tier decoding there can take the stall of it
        and the prompts prefilling ahead of it, at the worker's learnt prefill rate, and still
        end within ``stall_headroom`` of its TPOT target at its pace so far
        (:meth:`app.fleet.lease.Lease.stall_room`). Below saturation the streams run well within
        their targets and take a prompt's stall with room to spare.
        """
        if not worker.decoding or worker.latency.prefill.observed < _MEASURED_PREFILLS:
            return False
        priorities, mine = self.priorities, tier.priority
        stall = worker.prefill_seconds(tokens)
        headroom = self._settings.stall_headroom
        for lease in worker.decoding:
            priority = priorities[lease.tier]
            target = self._tpot_by_name[lease.tier]
            # A target out of the worker's reach is missed whatever waits: holding lower tiers
            # for it would only starve them (app.admission.limits.Limits.targets).
            if priority >= mine or target is None or not self.limits.reachable(worker, target):
                continue
            typical = self.demand.typical_decode(priority)
            if lease.stall_room(now, headroom * target, typical) < stall:
                return True
        return False

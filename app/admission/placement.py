"""Placement: the worker a request can run on now, if any has room for it.

Asks the room (:mod:`app.admission.room`) of every healthy worker serving the request's model,
with what the pool as a whole implies (whether it is expected to saturate, what other gateway
processes queue for higher tiers), and lets the router choose among those with room. It also
tells how long a request's first token takes at best, for admission's deadlines.
"""

from __future__ import annotations

import math

from app.admission.room import Room
from app.admission.ticket import Ticket
from app.fleet.lease import Choice
from app.fleet.routing import Router
from app.fleet.workers import Worker


class Placement:
    """Where a ticket runs now (:meth:`choose`), and its best case on the workers it may use."""

    def __init__(self, router: Router, room: Room) -> None:
        self._router = router
        self._room = room

    def choose(
        self, ticket: Ticket, now: float, workers: list[Worker] | None = None
    ) -> Choice | None:
        """The worker to run ``ticket`` on now (lowest predicted TTFT among those with room).

        None when every worker is full. The predicted TTFT picks the worker but does not hold
        a request back: under load the fitted prefill model was seen to overestimate, which
        kept interactive requests queued while the workers had room. The measured-latency
        limits and the workers' own signals are what keep TTFT and TPOT in bounds.
        """
        candidates = self._router.candidates(ticket.model) if workers is None else workers
        n = len(candidates)
        room = self._room
        # Only tiers below the top keep to the prefill budget: the top tier skips the lookup.
        top = ticket.tier.priority == room.top
        # Requests of higher tiers queued in other gateway processes, as this process's own
        # would be: ahead of this one, for the next slots of the workers they may run on.
        elsewhere = 0 if top else room.demand.queued_elsewhere(ticket.model, ticket.tier, now)
        yielded = math.ceil(elsewhere / max(n, 1))
        if not yielded and all(room.idle(w, now) for w in candidates):
            # No worker is full (Room.idle): the router's choice, without weighing each one.
            return self._router.choose(
                ticket.model, ticket.own_tokens, ticket.route, frozenset(), candidates
            )
        # Below saturation nothing is held back for higher tiers: see :meth:`reserving`. Its
        # slots are what the workers would run at the aim: the loads they were seen at are a
        # lower bound, which would read bursts below saturation as saturation. With no tier
        # above in play nothing is kept whatever it says: its figures are not computed.
        reserving = (
            not top
            and room.demand.higher_arrived(ticket.tier, now)
            and self.reserving(sum(room.limits.proven_cap(w, True) for w in candidates), now)
        )
        full = frozenset(
            w.label
            for w in candidates
            if room.full(
                w,
                ticket.tier,
                n,
                now,
                reserving,
                0.0 if top else self._uncached(ticket, w),
                yielded,
            )
        )
        if len(full) == n:
            return None
        return self._router.choose(ticket.model, ticket.own_tokens, ticket.route, full, candidates)

    def _uncached(self, ticket: Ticket, worker: Worker) -> float:
        """The prompt tokens of ``ticket`` that ``worker`` is not expected to have cached."""
        prefix, tokens = ticket.route.prefix, ticket.own_tokens
        if prefix is None:
            return tokens
        return tokens - self._router.cached_tokens(worker, prefix, tokens, ticket.route.tokens)

    def reserving(self, slots: int, now: float) -> bool:
        """Whether lower tiers must leave slots free for higher ones on workers of ``slots``.

        Only when the pool is expected to saturate: every tier's expected requests in, queued
        or running (Little's law over the waits and holds as measured,
        :meth:`app.admission.demand.TierDemand.expected_total`), add up to at least what the workers
        may run. Below that every request fits, whatever its tier, and holding slots back would
        only queue lower tiers on workers with room.
        """
        expected = self._room.demand.expected_total(now)
        return expected > 0 and expected >= slots

    def min_service(self, ticket: Ticket, workers: list[Worker]) -> float:
        """The prefill of the request's own prompt on the fastest worker: no wait shortens it.

        The tokens the worker is not expected to have cached, at the fitted cost per token:
        the line is learnt on those (routing predicts and records the uncached work), and a
        cached prefix costs no prefill (docs/admission.md). Without the fitted intercept: the
        line is learnt under load, where its intercept takes in the decode steps and queueing
        a request met, so it overestimates an idle worker's prefill; and refusing a prompt an
        idle worker would serve in time is the error that costs most (docs/admission.md).
        """
        best = math.inf
        for worker in workers:
            best = min(best, worker.latency.prefill.slope * self._uncached(ticket, worker))
        return best

    def start_margin(
        self, ticket: Ticket, fastest: float, now: float, workers: list[Worker]
    ) -> float:
        """Time to leave, between leaving the queue and the TTFT target, for the first token.

        On the best worker, the larger of the idle prefill (``fastest``) and its recent times
        to first token (:attr:`app.fleet.workers.Worker.recent_ttft`, those of the last 10 s): under
        load a request is prefilled behind others, and one dispatched later than this would
        likely miss its target while holding a slot for its whole answer.
        """
        return min(
            (max(fastest, worker.recent_ttft.value(now)) for worker in workers), default=fastest
        )

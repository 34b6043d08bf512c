"""Choosing a worker for a request.

Policies (``GATEWAY_ROUTING``):

* ``predicted_ttft`` (default): the healthy worker with the lowest predicted time to first
  token for *this* request: the prefill work already queued there, this prompt's length, the
  running batch, and the worker's learnt prefill speed. Workers whose load signals are stale
  count as busy: they rank behind every fresh worker by ``_STALE_PENALTY_S``. The prediction
  handed to admission leaves the penalty out (it rests on the gateway's own exact counts), so a
  worker whose /metrics cannot be read is still used, not treated as never able to meet an SLO.
* ``least_outstanding``: power of two choices on the gateway's in-flight count.
* ``round_robin``: for comparison.

With affinity (a session header or the ``user`` field), a session sticks to one worker, whose
prefix cache then holds its conversation, unless that worker is predicted to be slower than the
best one by more than ``affinity_slack_s``.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass

from app.errors import InvalidRequest, ModelNotFound, UpstreamUnavailable
from app.settings import Settings
from app.workers import Worker, WorkerPool

# Stale load signals make a worker rank this much slower, so fresh workers win.
_STALE_PENALTY_S = 5.0


@dataclass(frozen=True, slots=True)
class Choice:
    """The chosen worker and what the choice was based on."""

    worker: Worker
    predicted_ttft_s: float
    prefill_work: float


class Router:
    """Chooses a healthy worker for each request according to the configured policy."""

    def __init__(self, settings: Settings, pool: WorkerPool, rng: random.Random | None = None):
        self._settings = settings
        self._pool = pool
        self._rng = rng or random.Random()
        self._turn = itertools.count()

    def default_model(self) -> str:
        """The model of a request that names none: the only model the workers serve.

        vLLM serves its first model when ``model`` is missing, null or empty; a fleet serving
        several models has no such default, so that is a 400 naming them.
        """
        models = sorted(self._pool.served_models())
        if len(models) == 1:
            return models[0]
        if not models:
            raise UpstreamUnavailable("No worker has reported the models it serves yet.")
        raise InvalidRequest(
            "Missing required parameter: 'model' (the workers serve several models: "
            f"{', '.join(models[:8])}{', ...' if len(models) > 8 else ''}).",
            param="model",
            code="missing_required_parameter",
        )

    def candidates(self, model: str, exclude: frozenset[str] = frozenset()) -> list[Worker]:
        """Healthy workers serving ``model``, minus ``exclude``.

        Raises :class:`ModelNotFound` when no worker serves the model, and
        :class:`UpstreamUnavailable` when none of those that do is healthy.
        """
        now = self._pool.now()
        serving = False
        healthy = []
        for worker in self._pool.workers.values():
            if model not in worker.models:
                continue
            serving = True
            if worker.label not in exclude and worker.healthy(now):
                healthy.append(worker)
        if healthy:
            return healthy
        if serving or any(not w.discovered for w in self._pool.workers.values()):
            raise UpstreamUnavailable(f"No worker serving model '{model}' is reachable right now.")
        raise ModelNotFound(
            f"The model '{model}' does not exist.", param="model", code="model_not_found"
        )

    def predict(self, worker: Worker, own_tokens: float) -> tuple[float, float]:
        """``(predicted TTFT, prefill work)`` of a request of ``own_tokens`` on ``worker``.

        With stale load signals, the TTFT rests on the gateway's own counts for the worker.
        """
        ttft, work, _ = self._predict(worker, own_tokens)
        return ttft, work

    def rank(self, worker: Worker, own_tokens: float) -> float:
        """The routing score: predicted TTFT, plus a penalty when the load signals are stale."""
        ttft, _, fresh = self._predict(worker, own_tokens)
        return ttft if fresh else ttft + _STALE_PENALTY_S

    def _predict(self, worker: Worker, own_tokens: float) -> tuple[float, float, bool]:
        now = self._pool.now()
        load, fresh = worker.current_load(now, self._settings.load_max_age_s)
        work = worker.latency.prefill_work(own_tokens, load)
        ttft = worker.latency.predict_ttft(own_tokens, load)
        if load.waiting > 0:
            # Requests queued inside the worker (perhaps from other gateway replicas) each
            # need at least a prefill of their own before this one starts.
            ttft += load.waiting * worker.latency.prefill.intercept
        return ttft, work, fresh

    def choose(
        self,
        model: str,
        own_tokens: float,
        affinity_key: str | None = None,
        exclude: frozenset[str] = frozenset(),
    ) -> Choice:
        """The worker for a request of about ``own_tokens`` prompt tokens."""
        workers = self.candidates(model, exclude)
        policy = self._settings.routing
        if policy == "round_robin":
            worker = workers[next(self._turn) % len(workers)]
        elif policy == "least_outstanding":
            pair = workers if len(workers) < 3 else self._rng.sample(workers, 2)
            worker = min(pair, key=lambda w: w.in_flight)
        else:
            scored = [(self.rank(w, own_tokens), self._rng.random(), w) for w in workers]
            best_ttft, _, worker = min(scored, key=lambda item: (item[0], item[1]))
            if affinity_key:
                pinned = _rendezvous(affinity_key, workers)
                pinned_ttft = next(t for t, _, w in scored if w is pinned)
                if pinned_ttft <= best_ttft + self._settings.affinity_slack_s:
                    worker = pinned
            predicted, work = self.predict(worker, own_tokens)
            return Choice(worker, predicted, work)
        if affinity_key:
            worker = _rendezvous(affinity_key, workers)
        predicted, work = self.predict(worker, own_tokens)
        return Choice(worker, predicted, work)


def _rendezvous(key: str, workers: list[Worker]) -> Worker:
    """Highest-random-weight hashing: a key keeps its worker while that worker exists."""

    def weight(worker: Worker) -> bytes:
        return hashlib.blake2b(f"{key}\0{worker.label}".encode(), digest_size=8).digest()

    return max(workers, key=weight)

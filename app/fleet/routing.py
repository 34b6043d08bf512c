"""Choosing a worker for a request.

Policies (``GATEWAY_ROUTING``):

* ``predicted_ttft``: the healthy worker with the lowest predicted time to first
  token for *this* request: the prefill work already queued there, this prompt's length, the
  running batch, and the worker's learnt prefill speed. Workers whose load signals are stale
  count as busy: they rank behind every fresh worker by ``_STALE_PENALTY_S``. The prediction
  handed to admission leaves the penalty out (it rests on the gateway's own exact counts), so a
  worker whose /metrics cannot be read is still used, not treated as never able to meet an SLO.
* ``prefix_aware`` (default): the same prediction, less the prefill each worker is expected to skip
  because its prefix cache still holds the start of this prompt: the tokens of the longest
  prefix this gateway has recently routed there (:mod:`app.fleet.prefix`), over the worker's learnt
  prefill speed. A worker holding the prefix wins while the prefill it saves exceeds the
  extra wait in its queue; a hot prefix behind a long queue goes to an idle worker, which
  then holds it too.
* ``least_outstanding``: power of two choices on the gateway's in-flight count.
* ``round_robin``: for comparison.

With affinity (a session header or the ``user`` field), a session sticks to one worker, whose
prefix cache then holds its conversation, unless that worker is predicted to be slower than the
best one by more than ``affinity_slack_s``.

What routes a request besides its model and size, its session and (under ``prefix_aware``) its
prompt's prefix, is its :class:`RouteKey`, which reaches :meth:`Router.choose` through
admission's ticket.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import random
from dataclasses import dataclass

from app.api.errors import InvalidRequest, ModelNotFound, UpstreamUnavailable
from app.api.protocol import ParsedRequest
from app.fleet.lease import Choice
from app.fleet.prefix import BLOCK_CHARS, ENTRY_BYTES, PromptPrefix, prompt_prefix
from app.fleet.tokens import PromptTokens, Tokenizer
from app.fleet.workers import Worker, WorkerPool
from app.observe.metrics import GatewayMetrics
from app.settings import Settings

# Stale load signals make a worker rank this much slower, so fresh workers win.
_STALE_PENALTY_S = 5.0
# prefix_aware: a worker running this many more requests than the least loaded one, and this
# many times as many, gets no credit for its cache (as SGLang's router's balance thresholds).
# Each request there is predicted fine on its own (a cached prefill is short), but a hot
# prefix would pile every request onto the worker that first had it, slowing its decoding
# while another sits idle; the idle one then pays the prefix's prefill once and shares it.
_BALANCE_ABS = 4.0
_BALANCE_REL = 2.0
# A prompt routed to a worker counts as cached there for this long, or until its blocks' events
# come: they come once its prefill ran, which may wait in the worker's queue.
_ROUTED_S = 30.0


@dataclass(frozen=True, slots=True)
class RouteKey:
    """What routes a request besides its model and size."""

    session: str | None = None
    """Its session (a header or the body's ``user``): the session sticks to one worker."""
    prefix: PromptPrefix | None = None
    """Its prompt's prefix, read under ``prefix_aware`` only."""
    tokens: PromptTokens | None = None
    """Its prompt's tokens as the workers render them, when some worker's KV events are
    followed (:meth:`Router.tokenized`)."""


NO_KEY = RouteKey()


class Router:
    """Chooses a healthy worker for each request according to the configured policy."""

    def __init__(
        self,
        settings: Settings,
        pool: WorkerPool,
        rng: random.Random | None = None,
        metrics: GatewayMetrics | None = None,
        tokenizer: Tokenizer | None = None,
    ):
        self._settings = settings
        self._pool = pool
        self._rng = rng or random.Random()
        self._turn = itertools.count()
        self._metrics = metrics
        self._tokenizer = tokenizer

    def route_key(self, session: str | None, request: ParsedRequest) -> RouteKey:
        """What routes ``request``: its ``session``, and its prompt's prefix if the policy reads it.

        The prefix is read only under ``prefix_aware``; other policies route by the session only.
        """
        if self._settings.routing != "prefix_aware":
            return RouteKey(session)
        return RouteKey(session, prompt_prefix(request))

    async def tokenized(self, key: RouteKey, request: ParsedRequest) -> RouteKey:
        """``key`` with the prompt's tokens, if a healthy worker of its model follows KV events.

        The least busy of those workers is asked what is not known
        (:meth:`app.fleet.tokens.Tokenizer.tokens`). A prompt too short to fill a block of
        theirs, one that cannot be asked for (images, audio) or a failed answer leaves ``key``
        as it is: routed on the approximate index.
        """
        tokenizer, prefix = self._tokenizer, key.prefix
        if tokenizer is None or prefix is None:
            return key
        now = self._pool.now()
        followed = [
            w
            for w in self._pool.workers.values()
            if w.kv is not None and request.model in w.models and w.healthy(now)
        ]
        if not followed:
            return key
        sizes = {size for w in followed if (size := _block_size(w))}
        if not sizes or prefix.chars < min(sizes) // 2:
            return key  # too short for a whole block: nothing of it can be cached
        asked = min(followed, key=lambda w: w.in_flight).spec
        tokens, result = await tokenizer.tokens(request, sizes, asked)
        if self._metrics is not None and result is not None:
            self._metrics.prompt_tokenizations.labels(result).inc()
            self._metrics.prompt_tokens_cache_bytes.set(tokenizer.cached_bytes)  # as it grew
        return key if tokens is None else dataclasses.replace(key, tokens=tokens)

    async def close(self) -> None:
        """Stop what runs in the background (the tokenizer's asks)."""
        if self._tokenizer is not None:
            await self._tokenizer.close()

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
        key: RouteKey = NO_KEY,
        exclude: frozenset[str] = frozenset(),
        among: list[Worker] | None = None,
    ) -> Choice:
        """The worker for a request of about ``own_tokens`` prompt tokens, routed by ``key``.

        ``among``: :meth:`candidates` for ``model`` as the caller read them just now (read
        again when None, or when ``exclude`` leaves none of them).
        """
        workers = among if among is not None and not exclude else None
        if among is not None and exclude:
            workers = [w for w in among if w.label not in exclude] or None
        if workers is None:
            workers = self.candidates(model, exclude)
        policy = self._settings.routing
        if policy == "round_robin":
            worker = workers[next(self._turn) % len(workers)]
        elif policy == "least_outstanding":
            pair = workers if len(workers) < 3 else self._rng.sample(workers, 2)
            worker = min(pair, key=lambda w: w.in_flight)
        else:
            prefix = key.prefix
            now, max_age = self._pool.now(), self._settings.load_max_age_s
            crowded = _crowded(workers, now, max_age) if prefix is not None else ()
            scored = []
            for w in workers:
                cached = (
                    0.0 if prefix is None else self.cached_tokens(w, prefix, own_tokens, key.tokens)
                )
                # A crowded worker's cache does not count for the choice; if it is chosen all
                # the same, what it is expected to find cached does (prediction, lease).
                credit = 0.0 if w in crowded else cached
                scored.append((self.rank(w, own_tokens - credit), self._rng.random(), w, cached))
            best_ttft, _, worker, cached = min(scored, key=lambda item: (item[0], item[1]))
            slack = self._settings.affinity_slack_s
            if prefix is not None and prefix.blocks and not any(s[3] for s in scored):
                # A prefix no worker holds goes where the least is held (of the workers nearly
                # as fast): new prefixes spread over the caches instead of all filling the one
                # that happens to look fastest (as SGLang's router gives unmatched requests to
                # its smallest tree).
                near = [s for s in scored if s[0] <= best_ttft + slack]
                if key.tokens is not None:
                    # Under the events a prefix has one holder, and its traffic stays where
                    # it is placed: by the load of late, not the count of prefixes held.
                    _, _, worker, cached = min(
                        near, key=lambda s: (_ran_of_late(s[2], now, max_age), s[0])
                    )
                else:
                    _, _, worker, cached = min(near, key=lambda s: (len(s[2].prefixes), s[0]))
            elif prefix is not None:
                # Of the workers nearly as fast, one holding the prefix wins (the most held):
                # the prediction cannot tell such TTFTs apart, and the cache hit is real. Else
                # a worker that learnt a higher intercept from a few slow answers lost its own
                # prefix to an idle one that must prefill it all again. Of those holding as
                # much, the one with the least prefill work ahead, then the least loaded: on
                # learnt lines alone, one of two workers holding a shared system prompt took
                # most of its requests.
                held = [s for s in scored if s[3] and s[0] <= best_ttft + slack]
                held = [s for s in held if s[2] not in crowded]
                if held:
                    most = max(s[3] for s in held)
                    _, _, worker, cached = min(
                        (s for s in held if s[3] == most),
                        key=lambda s: (
                            s[2].prefill_tokens_ahead,
                            _running(s[2], now, max_age),
                            s[0],
                        ),
                    )
            else:
                # Predicted TTFTs this close are within what the prediction knows: the least
                # loaded worker wins. Else a worker whose prefix cache made its first answers
                # fast learnt a prefill speed no other could show without traffic, and took it
                # all (seen: every request of a warm-up on one of two workers, which then
                # flooded the other, at the hard cap, in the first surge).
                near = [s for s in scored if s[0] <= best_ttft + slack]
                if len(near) > 1:
                    _, _, worker, cached = min(
                        near, key=lambda s: (_running(s[2], now, max_age), s[0])
                    )
            if key.session:
                pinned = _rendezvous(key.session, workers)
                pinned_ttft, _, _, pinned_cached = next(s for s in scored if s[2] is pinned)
                if pinned_ttft <= best_ttft + slack:
                    worker, cached = pinned, pinned_cached
            if prefix is not None:
                self._remember(worker, key, prefix, own_tokens, cached)
            predicted, work = self.predict(worker, own_tokens - cached)
            return Choice(worker, predicted, work, cached)
        if key.session:
            worker = _rendezvous(key.session, workers)
        predicted, work = self.predict(worker, own_tokens)
        return Choice(worker, predicted, work)

    def cached_tokens(
        self,
        worker: Worker,
        prefix: PromptPrefix,
        own_tokens: float,
        tokens: PromptTokens | None = None,
    ) -> float:
        """Of a prompt of ``own_tokens``, the tokens ``worker`` is expected to have cached.

        With the prompt's ``tokens`` and the worker's KV events followed: the blocks its events
        say it holds (or that were just routed there, their events still to come), as a share
        of the prompt; while its index is incomplete (events were missed), the approximate
        index's guess where it says more. Otherwise the approximate guess alone: the longest
        prefix recently routed there, in tokens at this prompt's own ratio of tokens to
        characters, rounded down to whole KV-cache blocks of the worker (it reuses nothing
        smaller); none if the worker says its prefix caching is off.
        """
        index = worker.kv
        size = _block_size(worker) if index is not None else None
        if tokens is None or index is None or not size or not len(tokens):
            return self._approximate(worker, prefix, own_tokens)
        matched = index.match(tokens.blocks(size), self._pool.now())
        if tokens.whole:
            precise = own_tokens * min(1.0, matched * size / len(tokens))
        else:  # a leading part's: its tokens are a lower bound of the whole prompt's
            precise = min(own_tokens, float(matched * size))
        if index.complete:
            return precise
        return max(precise, self._approximate(worker, prefix, own_tokens))

    def _approximate(self, worker: Worker, prefix: PromptPrefix, own_tokens: float) -> float:
        matched = worker.prefixes.match(prefix.blocks)
        if not matched:
            return 0.0
        tokens = own_tokens * min(1.0, matched * BLOCK_CHARS / prefix.chars)
        sample = worker.load
        if sample is not None:
            if not sample.prefix_caching:
                return 0.0
            if sample.block_size:
                tokens -= tokens % sample.block_size
        return tokens

    def _remember(
        self, worker: Worker, key: RouteKey, prefix: PromptPrefix, own_tokens: float, cached: float
    ) -> None:
        """``worker`` will hold this prompt's prefix: index it, count the predicted hit.

        The memory cap is shared by every worker (an index holds up to one and a half times
        the blocks it remembers); a worker's share is also held to what its KV cache can keep
        (``cache_config_info``), beyond which it has evicted the oldest itself. An index
        remembers between half and all of its cap, so the KV-derived cap is a third over the
        cache: on average the index remembers as much as the cache holds.
        """
        entries = self._settings.prefix_index_mb * 2**20 / ENTRY_BYTES
        cap = int(entries / 1.5 / len(self._pool.workers))
        sample = worker.load
        if sample is not None and sample.kv_tokens and prefix.chars:
            tokens_per_block = own_tokens * BLOCK_CHARS / prefix.chars
            if tokens_per_block > 0:
                cap = min(cap, int(sample.kv_tokens * 4 / 3 / tokens_per_block))
        worker.prefixes.add(prefix.blocks, max(1, cap))
        index, tokens = worker.kv, key.tokens
        if index is not None and tokens is not None:
            size = _block_size(worker)
            if size:
                index.routed(tokens.blocks(size), self._pool.now() + _ROUTED_S)
        if self._metrics is not None:
            self._metrics.worker_prefix_queries.labels(worker.label).inc(own_tokens)
            self._metrics.worker_prefix_hits.labels(worker.label).inc(cached)


def _crowded(workers: list[Worker], now: float, max_age: float) -> list[Worker]:
    """Workers running far more requests than the least loaded one (no cache credit)."""
    loads = [_running(w, now, max_age) for w in workers]
    least = min(loads)
    return [
        w
        for w, load in zip(workers, loads, strict=True)
        if load - least > _BALANCE_ABS and load > _BALANCE_REL * least
    ]


def _running(worker: Worker, now: float, max_age: float) -> float:
    """Requests running on ``worker``: this gateway's, plus other clients' as scraped."""
    return worker.in_flight + worker.others(now, max_age)


def _ran_of_late(worker: Worker, now: float, max_age: float) -> float:
    """Requests run on ``worker`` of late: this gateway's mean, plus other clients' now."""
    return worker.recent_load(now) + worker.others(now, max_age)


def _block_size(worker: Worker) -> int | None:
    """The worker's KV cache block in tokens: as its events say, else its cache_config_info."""
    index = worker.kv
    if index is not None and index.block_size:
        return index.block_size
    sample = worker.load
    return int(sample.block_size) if sample is not None and sample.block_size else None


def _rendezvous(key: str, workers: list[Worker]) -> Worker:
    """Highest-random-weight hashing: a key keeps its worker while that worker exists."""

    def weight(worker: Worker) -> bytes:
        return hashlib.blake2b(f"{key}\0{worker.label}".encode(), digest_size=8).digest()

    return max(workers, key=weight)

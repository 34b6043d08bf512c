"""The workers the gateway knows: what each serves, whether it answers, how busy it is.

Each worker's ``/v1/models`` is read at start and every ``discovery_interval_s``; its model cards
are kept as the worker sent them (vLLM's ``root`` and ``max_model_len`` included), because
benchmark clients read them from the gateway's ``/v1/models``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx

from app.errors import ModelNotFound, UpstreamUnavailable
from app.metrics import OTHER_MODEL, GatewayMetrics
from app.settings import Settings, WorkerSpec
from app.timing import Clock

log = logging.getLogger(__name__)


class Worker:
    """One vLLM worker and what the gateway has learnt about it."""

    __slots__ = ("cards", "in_flight", "last_seen", "models", "spec", "up")

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.models: set[str] = set(spec.models)
        self.cards: dict[str, dict[str, Any]] = {}
        self.up = False
        self.last_seen: float | None = None
        self.in_flight = 0

    @property
    def label(self) -> str:
        """The worker's bounded metrics label."""
        return self.spec.label

    @property
    def discovered(self) -> bool:
        """Whether ``/v1/models`` has been read from this worker at least once."""
        return bool(self.cards)


class WorkerPool:
    """All configured workers, kept up to date by a background discovery task."""

    def __init__(
        self,
        settings: Settings,
        client: httpx.AsyncClient,
        metrics: GatewayMetrics,
        clock: Clock,
    ) -> None:
        self.workers = [Worker(spec) for spec in settings.workers]
        self._client = client
        self._metrics = metrics
        self._clock = clock
        self._interval = settings.discovery_interval_s
        self._probe_timeout = settings.connect_timeout_s
        self._task: asyncio.Task[None] | None = None

    def served_models(self) -> set[str]:
        """Every model some worker serves (or is configured to serve)."""
        return {model for worker in self.workers for model in worker.models}

    def model_label(self, model: str) -> str:
        """``model`` if a worker serves it, else ``other``: keeps the label's values bounded."""
        for worker in self.workers:
            if model in worker.models:
                return model
        return OTHER_MODEL

    def model_cards(self) -> list[dict[str, Any]]:
        """The union of the workers' model cards, one per model id."""
        cards: dict[str, dict[str, Any]] = {}
        for worker in self.workers:
            for model_id, card in worker.cards.items():
                cards.setdefault(model_id, card)
            for model_id in worker.models:
                cards.setdefault(model_id, {"id": model_id, "object": "model", "owned_by": "vllm"})
        return sorted(cards.values(), key=lambda card: str(card.get("id")))

    def ready(self) -> bool:
        """Whether any worker answered its last probe."""
        return any(worker.up for worker in self.workers)

    def pick(self, model: str) -> Worker:
        """The least busy reachable worker serving ``model``.

        Raises :class:`ModelNotFound` when no worker serves it, and :class:`UpstreamUnavailable`
        when those that do (or those whose models are still unknown) cannot be reached.
        """
        best: Worker | None = None
        serving = False
        for worker in self.workers:
            if model not in worker.models:
                continue
            serving = True
            if worker.up and (best is None or worker.in_flight < best.in_flight):
                best = worker
        if best is not None:
            return best
        if serving or any(not worker.discovered for worker in self.workers):
            raise UpstreamUnavailable(f"No worker serving model '{model}' is reachable right now.")
        raise ModelNotFound(
            f"The model '{model}' does not exist.", param="model", code="model_not_found"
        )

    def mark_down(self, worker: Worker) -> None:
        """Record that a request could not reach ``worker``; discovery brings it back."""
        worker.up = False
        self._metrics.worker_up.labels(worker.label).set(0)

    async def refresh(self) -> None:
        """Read every worker's ``/v1/models`` once, concurrently."""
        await asyncio.gather(*(self._probe(worker) for worker in self.workers))

    async def _probe(self, worker: Worker) -> None:
        headers = _auth_headers(worker.spec)
        try:
            response = await self._client.get(
                f"{worker.spec.base_url}/v1/models", headers=headers, timeout=self._probe_timeout
            )
            response.raise_for_status()
            payload = response.json()
            cards = {str(card["id"]): card for card in payload["data"] if isinstance(card, dict)}
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            if worker.up or worker.last_seen is None:
                log.warning("worker %s is not answering: %s", worker.label, _describe(exc))
            worker.up = False
        else:
            if not worker.up:
                log.info("worker %s is up, serving %s", worker.label, sorted(cards))
            worker.cards = cards
            worker.models = set(cards) | set(worker.spec.models)
            worker.up = True
            worker.last_seen = self._clock()
        self._metrics.worker_up.labels(worker.label).set(1 if worker.up else 0)

    async def start(self, first_wait: float) -> None:
        """Probe every worker (waiting at most ``first_wait``), then keep probing in background."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.refresh()), first_wait)
        self._task = asyncio.create_task(self._loop(), name="worker-discovery")

    async def _loop(self) -> None:
        while True:
            # A worker that is down is probed every second so it returns quickly once it is up.
            down = not all(worker.up for worker in self.workers)
            await asyncio.sleep(min(self._interval, 1.0) if down else self._interval)
            await self.refresh()

    async def stop(self) -> None:
        """Stop the background discovery."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def _auth_headers(spec: WorkerSpec) -> dict[str, str]:
    return {"authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}


def worker_headers(spec: WorkerSpec, request_id: str) -> dict[str, str]:
    """Headers for a request to ``spec``: its key (never the client's) and the request id."""
    headers = _auth_headers(spec)
    headers["x-request-id"] = request_id
    headers["content-type"] = "application/json"
    headers["accept-encoding"] = "identity"
    return headers


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

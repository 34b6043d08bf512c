"""Following each worker's KV cache events into its :class:`app.fleet.kvindex.KVIndex`.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``)
publishes, on a ZMQ PUB socket, three-part messages: a topic, an 8-byte big-endian sequence
number and a msgpack batch ``[ts, events, data_parallel_rank]`` whose events are maps tagged
by ``type``: ``BlockStored`` (block hashes, parent hash, token ids, block size),
``BlockRemoved`` and ``AllBlocksCleared``. With a ``replay_endpoint`` (a ROUTER socket) it
sends again, to whoever asks with a start sequence number, the batches it still buffers from
there, then an end marker of sequence -1. ``/kv_event_sources`` tells its configuration.

A follower subscribes, asks for the history from sequence 0 first (so an index started beside
a running worker knows what it cached before), applies the batches in order, replays a gap,
and reads a sequence that starts over as the worker restarted with an empty cache. What it
could not replay is lost: the index is emptied and marked incomplete
(:attr:`KVIndex.complete`), and routing reads the gateway's own approximate index beside it
until the worker's cache is emptied again. Every gateway process follows every worker itself:
no shared store is needed for this.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
import msgspec
import zmq
import zmq.asyncio

from app.fleet.kvindex import KVIndex
from app.settings import WorkerSpec

log = logging.getLogger(__name__)

END_SEQ = -1
"""The sequence number of a replay's end marker."""


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where a worker publishes its KV cache events."""

    endpoint: str
    """The PUB socket to connect to (``tcp://host:port``)."""
    replay: str | None = None
    """Its replay (ROUTER) socket, if it has one."""
    topic: str = ""


def source_from(config: Mapping[str, Any], host: str) -> EventSource | None:
    """A worker's event source from its ``/kv_event_sources`` entry; None if it has none.

    The publisher binds a wildcard address (``tcp://*:5557``), which stands for the worker's
    own ``host`` here. An endpoint the publisher connects to (any other ``tcp://`` address) is
    a subscriber's to bind, not one to connect to: such a worker is read as having none.
    """
    if not config.get("enable_kv_cache_events") or config.get("publisher") != "zmq":
        return None
    endpoint = _reachable(config.get("endpoint"), host)
    if endpoint is None:
        return None
    topic = config.get("topic")
    replay = _reachable(config.get("replay_endpoint"), host)
    return EventSource(endpoint, replay, topic if isinstance(topic, str) else "")


class SourceUnknown(Exception):
    """The worker could not say where it publishes its events (down, or an older vLLM)."""


async def find_source(
    spec: WorkerSpec,
    get: Callable[[WorkerSpec, str, float], Awaitable[httpx.Response]],
    timeout_s: float,
) -> EventSource | None:
    """Where the worker of ``spec`` publishes its KV cache events; None: it does not.

    As configured for it, else as its ``/kv_event_sources`` says (data-parallel ranks publish
    apart: the first rank's stands for the worker). Raises :class:`SourceUnknown` when that
    cannot be read (an older vLLM answers 404).
    """
    if spec.kv_events:
        return EventSource(spec.kv_events, spec.kv_replay)
    try:
        payload = (await get(spec, "/kv_event_sources", timeout_s)).json()
    except (httpx.HTTPError, ValueError) as exc:
        raise SourceUnknown(str(exc)) from exc
    config = payload.get("0") if isinstance(payload, dict) else None
    if not isinstance(config, dict):
        return None
    return source_from(config, spec.url.host or "127.0.0.1")


def _reachable(endpoint: object, host: str) -> str | None:
    if not isinstance(endpoint, str):
        return None
    if endpoint.startswith("tcp://"):
        address = urlsplit(endpoint).netloc
        name, _, port = address.rpartition(":")
        if name not in ("*", "0.0.0.0", "[::]", "::"):
            return None  # vLLM connects to such an endpoint rather than binding it
        if not port.isdigit():
            return None
        return f"tcp://{host}:{port}" if ":" not in host else f"tcp://[{host}]:{port}"
    if endpoint.startswith("ipc://"):
        return endpoint  # a worker on this machine
    return None


class EventCounts(Protocol):
    """What a follower counts (the gateway's metrics)."""

    def kv_events(self, worker: str, events: int, lag_s: float | None) -> None:
        """``events`` of a batch published ``lag_s`` ago were applied (None: replayed)."""
        ...

    def kv_events_lost(self, worker: str, batches: int) -> None:
        """``batches`` could not be replayed: the index starts over."""
        ...


Replay = Callable[[int], Awaitable[list[tuple[int, bytes]] | None]]
"""Asks the worker for its buffered batches from a sequence number on (None: no answer)."""


class EventFollower:
    """Applies one worker's batches to its index, in sequence order, replaying gaps.

    The ZMQ side is :meth:`run`'s; :meth:`start` and :meth:`receive` are the whole logic, so
    tests drive them with a scripted replay.
    """

    def __init__(self, label: str, index: KVIndex, replay: Replay | None, counts: EventCounts):
        self.label = label
        self.index = index
        self._replay = replay
        self._counts = counts
        self._next: int | None = None
        """The sequence number the next batch should have (None: none seen or replayed)."""
        self._replayed: dict[int, bytes] = {}
        """Batches a replay applied that the subscription may still deliver: skipped once."""

    async def start(self) -> None:
        """Catch up with the worker's buffered history, from its first batch if it has it."""
        batches = await self._ask(0)
        if batches is None:
            return  # no history: the first batch received decides
        first = batches[0][0] if batches else 0
        self.index.complete = first == 0  # nothing buffered: nothing stored yet
        self._apply_replayed(batches)
        if not batches:
            self._next = 0

    async def receive(self, seq: int, payload: bytes) -> None:
        """A batch from the subscription."""
        if self._replayed:
            if self._replayed.pop(seq, None) == payload:
                return  # a replay applied it already
            if seq >= max(self._replayed, default=seq):
                self._replayed.clear()
        expected = self._next
        if expected is not None and seq < expected:
            # Restarted, its cache empty: complete again once its batches from 0 are in.
            log.info("worker %s: its KV events started over (restarted): index emptied", self.label)
            self.index.clear()
            self.index.complete = True
            expected = 0
        if expected is None:
            self.index.complete = self.index.complete or seq == 0
        elif seq > expected:
            await self._fill(expected, seq)
        self._apply(seq, payload)

    async def _fill(self, start: int, seq: int) -> None:
        """Batches ``start`` to ``seq`` - 1 were not received: replay them or start over."""
        batches = await self._ask(start)
        wanted = [(s, p) for s, p in batches or () if start <= s < seq]
        if [s for s, _ in wanted] == list(range(start, seq)):
            for s, payload in wanted:
                self._apply(s, payload, live=False)
            return
        log.warning(
            "worker %s: %d KV event batch(es) lost: index emptied until its cache is",
            self.label, seq - start,
        )  # fmt: skip
        self._counts.kv_events_lost(self.label, seq - start)
        self.index.clear()
        self.index.complete = False

    def _apply_replayed(self, batches: list[tuple[int, bytes]]) -> None:
        for seq, payload in batches:
            if self._next is None or seq >= self._next:
                self._apply(seq, payload, live=False)
                self._replayed[seq] = payload

    async def _ask(self, start: int) -> list[tuple[int, bytes]] | None:
        if self._replay is None:
            return None
        return await self._replay(start)

    def _apply(self, seq: int, payload: bytes, *, live: bool = True) -> None:
        self._next = seq + 1
        try:
            batch = msgspec.msgpack.decode(payload)
            stamp, events = float(batch[0]), batch[1]
        except (ValueError, TypeError, IndexError, KeyError, msgspec.DecodeError):
            log.warning("worker %s: a KV event batch that is not vLLM's was skipped", self.label)
            return
        index = self.index
        applied = 0
        for event in events:
            if not isinstance(event, dict) or not _main_cache(event):
                continue
            kind = event.get("type")
            if kind == "BlockStored":
                index.stored(
                    event.get("block_hashes") or (),
                    event.get("parent_block_hash"),
                    event.get("token_ids") or (),
                    int(event.get("block_size") or 0),
                    event.get("extra_keys"),
                )
            elif kind == "BlockRemoved":
                index.removed(event.get("block_hashes") or ())
            elif kind == "AllBlocksCleared":
                index.clear()
                index.complete = True  # the cache is empty: every later block is in the events
            else:
                continue
            applied += 1
        # The worker's wall clock against this one's: a lag, not a duration measured here. A
        # replayed batch's age is the gap's, not the lag of the events as they flow.
        lag = max(0.0, time.time() - stamp) if live else None
        self._counts.kv_events(self.label, applied, lag)


def _main_cache(event: dict[str, Any]) -> bool:
    """Whether an event is of the worker's own KV cache (not an offloading tier, one group)."""
    return event.get("medium") in (None, "GPU") and event.get("group_idx") in (None, 0)


class KVEvents:
    """The followers of every worker that publishes its KV cache events.

    ``follow`` starts (or restarts, for a new source) a worker's; ``forget`` stops it; ``close``
    stops all. One ZMQ context per gateway process.
    """

    def __init__(self, counts: EventCounts, replay_timeout_s: float = 2.0) -> None:
        self._counts = counts
        self._replay_timeout_s = replay_timeout_s
        self._context: zmq.asyncio.Context | None = None
        self._running: dict[str, tuple[EventSource, asyncio.Task[None]]] = {}
        self._indexes: dict[str, KVIndex] = {}

    def following(self, label: str) -> EventSource | None:
        """The source followed for worker ``label`` (None: none)."""
        entry = self._running.get(label)
        return None if entry is None else entry[0]

    def follow(self, label: str, source: EventSource, index: KVIndex) -> None:
        """Follow ``source`` into ``index`` (emptied first) for worker ``label``."""
        entry = self._running.get(label)
        if entry is not None:
            if entry[0] == source and not entry[1].done():
                return
            entry[1].cancel()
        self._start(label, source, index)
        log.info("worker %s: following its KV cache events at %s", label, source.endpoint)

    def _start(self, label: str, source: EventSource, index: KVIndex) -> None:
        if self._context is None:
            self._context = zmq.asyncio.Context()
        index.clear()
        index.complete = False
        replay = None if source.replay is None else self._replayer(source.replay)
        follower = EventFollower(label, index, replay, self._counts)
        task = asyncio.create_task(self._run(follower, source), name=f"kv-events-{label}")
        self._running[label] = (source, task)
        self._indexes[label] = index

    def restart(self, label: str) -> None:
        """Follow worker ``label`` afresh: its index rebuilt from the history it buffers.

        A worker back from being unreachable may have restarted with an empty cache and
        published nothing since; its sequence alone would not say so until its next event.
        """
        entry = self._running.get(label)
        if entry is not None:
            entry[1].cancel()
            self._start(label, entry[0], self._indexes[label])

    def forget(self, label: str) -> None:
        """Stop following worker ``label``."""
        entry = self._running.pop(label, None)
        self._indexes.pop(label, None)
        if entry is not None:
            entry[1].cancel()

    async def close(self) -> None:
        """Stop every follower and the context."""
        tasks = [task for _, task in self._running.values()]
        self._running.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._context is not None:
            self._context.term()
            self._context = None

    async def _run(self, follower: EventFollower, source: EventSource) -> None:
        assert self._context is not None
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            sub.connect(source.endpoint)
            await follower.start()
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                await follower.receive(int.from_bytes(frames[1], "big", signed=True), frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:  # a follower must not die silently: the index would go stale
            log.exception("worker %s: following its KV events failed", follower.label)
            follower.index.clear()
            follower.index.complete = False
        finally:
            sub.close(linger=0)

    def _replayer(self, endpoint: str) -> Replay:
        async def replay(start: int) -> list[tuple[int, bytes]] | None:
            assert self._context is not None
            dealer = self._context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            batches: list[tuple[int, bytes]] = []
            try:
                dealer.connect(endpoint)
                await dealer.send_multipart([b"", start.to_bytes(8, "big")])
                async with asyncio.timeout(self._replay_timeout_s):
                    while True:
                        frames = await dealer.recv_multipart()
                        if len(frames) != 4 or len(frames[2]) != 8:
                            continue
                        seq = int.from_bytes(frames[2], "big", signed=True)
                        if seq == END_SEQ:
                            return batches
                        batches.append((seq, frames[3]))
            except (TimeoutError, zmq.ZMQError):
                return None
            finally:
                dealer.close(linger=0)

        return replay

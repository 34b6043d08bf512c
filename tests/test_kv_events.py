"""Routing on the workers' own KV cache events: the block index, the follower, the tokens.

The real worker's events are tested in tests/test_kv_events_real.py; here the logic, with
batches encoded as vLLM encodes them (msgpack maps tagged by ``type``).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import msgspec
import pytest

from app.api.protocol import Endpoint, ParsedRequest, parse_request
from app.fleet.kvevents import EventFollower, EventSource, KVEvents, source_from
from app.fleet.kvindex import KVIndex, chain
from app.fleet.routing import RouteKey
from app.fleet.tokens import PromptTokens, Tokenizer, given_tokens, tokenize_body
from app.fleet.wire import WireClient
from app.settings import WorkerSpec
from tests.fake_upstream import MODEL
from tests.test_prefix import _chat, _fleet, _prefix, _sample
from tests.wire_bridge import bridge

BS = 4  # tokens a block in these tests


def _stored(
    hashes: list[int], parent: int | None, tokens: list[int], **extra: Any
) -> dict[str, Any]:
    return {
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
        "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU",
        "lora_name": None, "extra_keys": [None] * len(hashes), "group_idx": 0, **extra,
    }  # fmt: skip


def _removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


def _batch(*events: dict[str, Any], ts: float = 0.0) -> bytes:
    return msgspec.msgpack.encode([ts, list(events), 0])


PROMPT = list(range(100, 114))  # 14 tokens: 3 whole blocks of 4, and 2 left over


def test_a_prompts_blocks_are_keyed_by_every_token_up_to_their_end() -> None:
    keys = chain(PROMPT, BS)
    assert len(keys) == 3  # the partial last block is not cached by a worker
    other = [*PROMPT[:8], 999, *PROMPT[9:]]
    assert chain(other, BS)[:2] == keys[:2]
    assert chain(other, BS)[2] != keys[2]
    # A block's key stands for its whole prefix: the same tokens after another start differ.
    assert chain([0, *PROMPT[1:]], BS)[1] != keys[1]


def test_the_index_holds_what_the_events_say_the_worker_holds() -> None:
    index = KVIndex(max_blocks=100)
    keys = chain(PROMPT, BS)
    assert index.match(keys, 0.0) == 0
    # Stored in two events, the second chained to the first by the worker's own hash.
    index.stored([11, 12], None, PROMPT[:8], BS)
    index.stored([13], 12, PROMPT[8:12], BS)
    assert index.block_size == BS
    assert index.match(keys, 0.0) == 3
    assert len(index) == 3
    # An evicted block ends the match there, whatever follows it.
    index.removed([12])
    assert index.match(keys, 0.0) == 1
    index.clear()
    assert index.match(keys, 0.0) == 0
    assert len(index) == 0


def test_blocks_keyed_by_more_than_tokens_or_after_an_unseen_parent_match_nothing() -> None:
    index = KVIndex(max_blocks=100)
    keys = chain(PROMPT, BS)
    # A LoRA adapter's, an image's or a salted block: the tokens alone do not say what it holds.
    index.stored([21, 22], None, PROMPT[:8], BS, extra_keys=[None, ("salt",)])
    assert index.match(keys, 0.0) == 1
    index.clear()
    # Its parent's event was never seen: nothing can be chained to it, nor to what follows.
    index.stored([31], 999, PROMPT[:4], BS)
    index.stored([32], 31, PROMPT[4:8], BS)
    assert index.match(keys, 0.0) == 0
    # Removing unkeyed blocks is harmless.
    index.removed([31, 32, 404])
    assert len(index) == 0


def test_a_routed_prompt_counts_as_held_until_its_events_come_or_it_lapses() -> None:
    index = KVIndex(max_blocks=100)
    keys = chain(PROMPT, BS)
    index.routed(keys, until=10.0)
    assert index.match(keys, 5.0) == 3
    assert index.match(keys, 10.5) == 0  # lapsed: its prefill never stored it
    index.routed(keys, until=20.0)
    # Its events came: from then on the index alone says, and an eviction is seen.
    index.stored([1, 2, 3], None, PROMPT[:12], BS)
    index.removed([2])
    assert index.match(keys, 5.0) == 1
    # At most max_blocks routed keys are kept, the oldest dropped first.
    small = KVIndex(max_blocks=2)
    small.routed(keys, until=10.0)
    assert small.match(keys, 0.0) == 0
    assert small.match(keys[1:], 0.0) == 2


def test_an_index_past_its_cap_missed_evictions_and_starts_over_incomplete() -> None:
    index = KVIndex(max_blocks=2)
    index.complete = True
    index.stored([1, 2, 3], None, PROMPT[:12], BS)
    assert len(index) == 0
    assert not index.complete


class _Counts:
    def __init__(self) -> None:
        self.events = 0
        self.lags: list[float] = []
        self.lost = 0

    def kv_events(self, worker: str, events: int, lag_s: float | None) -> None:
        self.events += events
        if lag_s is not None:
            self.lags.append(lag_s)

    def kv_events_lost(self, worker: str, batches: int) -> None:
        self.lost += batches


class _Worker:
    """A scripted publisher: its batches by sequence number, its replay buffer from ``kept``."""

    def __init__(self) -> None:
        self.batches: list[bytes] = []
        self.kept = 0
        self.replays: list[int] = []
        self.answers = True

    def publish(self, *events: dict[str, Any]) -> tuple[int, bytes]:
        self.batches.append(_batch(*events, ts=1.0))
        return len(self.batches) - 1, self.batches[-1]

    async def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        self.replays.append(start)
        if not self.answers:
            return None
        first = max(start, self.kept)
        return [(seq, self.batches[seq]) for seq in range(first, len(self.batches))]


def _follower(worker: _Worker, replay: bool = True) -> tuple[EventFollower, KVIndex, _Counts]:
    index, counts = KVIndex(max_blocks=100), _Counts()
    return EventFollower("w", index, worker.replay if replay else None, counts), index, counts


KEYS = chain(PROMPT, BS)


async def test_a_follower_catches_up_on_the_history_and_skips_it_when_it_arrives_again() -> None:
    worker = _Worker()
    first = worker.publish(_stored([1, 2], None, PROMPT[:8]))
    follower, index, counts = _follower(worker)
    await follower.start()
    assert index.complete  # the history from the first batch on
    assert index.match(KEYS, 0.0) == 2
    assert counts.lags == []  # a replayed batch's age is no lag
    # The subscription delivers the replayed batch too: applied once only.
    await follower.receive(*first)
    await follower.receive(*worker.publish(_stored([3], 2, PROMPT[8:12])))
    assert index.match(KEYS, 0.0) == 3
    assert counts.events == 2
    assert len(counts.lags) == 1


async def test_a_gap_is_replayed_and_what_cannot_be_is_lost_and_leaves_the_index_incomplete() -> (
    None
):
    worker = _Worker()
    follower, index, counts = _follower(worker)
    await follower.start()
    assert index.complete  # nothing published yet: an empty cache
    await follower.receive(*worker.publish(_stored([1], None, PROMPT[:4])))
    worker.publish(_stored([2], 1, PROMPT[4:8]))  # not delivered
    await follower.receive(*worker.publish(_stored([3], 2, PROMPT[8:12])))
    assert worker.replays == [0, 1]
    assert index.match(KEYS, 0.0) == 3
    assert index.complete
    assert counts.lost == 0
    # Two more missed, and the worker's buffer no longer holds them.
    worker.publish(_removed([3]))
    worker.publish(_removed([2]))
    worker.kept = len(worker.batches)
    await follower.receive(*worker.publish(_stored([9], None, PROMPT[:4])))
    assert counts.lost == 2
    assert not index.complete
    assert index.match(KEYS, 0.0) == 1  # emptied, then the batch that came applied


async def test_a_sequence_that_starts_over_is_a_restarted_worker_with_an_empty_cache() -> None:
    worker = _Worker()
    follower, index, _ = _follower(worker)
    await follower.start()
    for event in (_stored([1], None, PROMPT[:4]), _stored([2], 1, PROMPT[4:8])):
        await follower.receive(*worker.publish(event))
    assert index.match(KEYS, 0.0) == 2
    restarted = _Worker()
    await follower.receive(*restarted.publish(_stored([7], None, [5, 5, 5, 5])))
    assert index.match(KEYS, 0.0) == 0
    assert len(index) == 1
    assert index.complete


async def test_without_a_replay_endpoint_only_a_follower_there_from_the_start_is_complete() -> None:
    worker = _Worker()
    follower, index, _ = _follower(worker, replay=False)
    await follower.start()
    await follower.receive(*worker.publish(_stored([1], None, PROMPT[:4])))
    assert index.complete
    late, late_index, _ = _follower(worker, replay=False)
    await late.start()
    await late.receive(*worker.publish(_stored([2], 1, PROMPT[4:8])))
    assert not late_index.complete
    assert late_index.match(KEYS, 0.0) == 0  # its parent was never seen


async def test_a_cleared_cache_is_complete_and_other_tiers_and_garbage_are_ignored() -> None:
    worker = _Worker()
    follower, index, _ = _follower(worker, replay=False)
    await follower.start()
    await follower.receive(5, _batch(_stored([1], None, PROMPT[:4])))
    assert not index.complete
    await follower.receive(6, _batch({"type": "AllBlocksCleared"}))
    assert index.complete
    assert len(index) == 0
    await follower.receive(7, _batch(_stored([1], None, PROMPT[:4], medium="CPU")))
    await follower.receive(8, _batch(_stored([1], None, PROMPT[:4], group_idx=1)))
    await follower.receive(9, b"\xc1 not msgpack")
    assert len(index) == 0
    await follower.receive(10, _batch(_stored([1], None, PROMPT[:4])))
    assert len(index) == 1


def test_the_source_is_the_workers_host_for_a_wildcard_and_none_for_what_vllm_connects_to() -> None:
    config = {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558", "topic": "kv",
    }  # fmt: skip
    assert source_from(config, "10.0.0.7") == EventSource(
        "tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558", "kv"
    )
    assert source_from({**config, "replay_endpoint": None}, "h") == EventSource(
        "tcp://h:5557", None, "kv"
    )
    assert source_from({**config, "endpoint": "tcp://10.0.0.9:5557"}, "h") is None
    assert source_from({**config, "enable_kv_cache_events": False}, "h") is None
    assert source_from({**config, "publisher": "null"}, "h") is None


def _completion(prompt: Any) -> ParsedRequest:
    return parse_request(
        Endpoint.COMPLETIONS, json.dumps({"model": MODEL, "prompt": prompt}).encode()
    )


def test_what_is_asked_to_tokenize_is_what_the_template_sees() -> None:
    chat = _chat("hello", tools=[{"type": "function", "function": {"name": "f"}}])
    asked = tokenize_body(chat)
    assert asked is not None
    assert asked["messages"] == chat.body["messages"]
    assert asked["tools"] == chat.body["tools"]
    assert "max_tokens" not in asked
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    with_image = _chat("x")
    with_image.body["messages"].append({"role": "user", "content": [image]})
    assert tokenize_body(with_image) is None
    assert tokenize_body(_completion("hello")) == {"model": MODEL, "prompt": "hello"}
    given = given_tokens(_completion([[1, 2, 3], [4]]))
    assert given is not None
    assert list(given) == [1, 2, 3]
    assert given_tokens(_completion("hello")) is None


def _tokenizer(answer: Any, cache_bytes: int = 2**20) -> Tokenizer:
    """A tokenizer whose worker connections are answered by ``answer`` (an httpx handler)."""
    return Tokenizer(
        WireClient(5.0, connector=bridge(httpx.MockTransport(answer))), 1.0, cache_bytes
    )


async def test_the_tokenizer_asks_once_per_prompt_and_a_failure_is_no_tokens() -> None:
    asked: list[tuple[str, dict[str, Any]]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        asked.append((request.url.path, body))
        if "fail" in json.dumps(body):
            return httpx.Response(500)
        if "garbage" in json.dumps(body):
            return httpx.Response(200, json={"count": 3})
        return httpx.Response(200, json={"count": 8, "tokens": list(range(8))})

    tokenizer = _tokenizer(answer)
    spec = WorkerSpec.model_validate({"url": "http://w:1", "api_key": "k"})
    request = _chat("hello")
    known, body = tokenizer.cached(request, {4})
    assert known is None
    assert body is not None
    tokens = await tokenizer.ask(spec, MODEL, body, {4})
    assert tokens is not None
    assert asked[0][0] == "/tokenize"
    assert asked[0][1]["messages"] == request.body["messages"]
    assert len(tokens) == 8
    assert tokens.blocks(4) == chain(list(range(8)), 4)
    again, body_again = tokenizer.cached(_chat("hello"), {4})
    assert again is tokens
    assert body_again is None
    assert len(asked) == 1
    # A block size the answer was not chained for is asked again.
    assert tokenizer.cached(_chat("hello"), {4, 16})[1] is not None
    for word in ("fail", "garbage"):
        _, failing = tokenizer.cached(_chat(word), {4})
        assert failing is not None
        assert await tokenizer.ask(spec, MODEL, failing, {4}) is None
        assert tokenizer.cached(_chat(word), {4})[1] is not None  # a failure is not cached


async def test_the_tokenizers_cache_keeps_to_its_memory_cap() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"tokens": list(range(1000))})

    one = PromptTokens(list(range(1000)), {16}).nbytes()
    tokenizer = _tokenizer(answer, one * 2)
    spec = WorkerSpec.model_validate({"url": "http://w:1"})
    for i in range(5):
        _, body = tokenizer.cached(_chat(f"question {i}"), {16})
        assert body is not None
        assert await tokenizer.ask(spec, MODEL, body, {16}) is not None
    assert tokenizer.cached_bytes == one * 2
    assert tokenizer.cached(_chat("question 4"), {16})[0] is not None  # the newest kept
    assert tokenizer.cached(_chat("question 0"), {16})[0] is None  # the oldest dropped


@pytest.fixture
def fleet_with_events() -> tuple[Any, Any]:
    pool, router = _fleet()
    for worker in pool.workers.values():
        worker.kv = KVIndex(max_blocks=10_000)
        worker.kv.complete = True
    return pool, router


def _keyed(router: Any, request: ParsedRequest, tokens: list[int]) -> RouteKey:
    key = router.route_key(None, request)
    return RouteKey(key.session, key.prefix, PromptTokens(tokens, {128}))


LONG = list(range(1000, 1000 + 128 * 8))  # 8 blocks of a CPU worker's 128 tokens


def test_a_complete_index_is_believed_over_the_guess_an_evicted_prefix_is_not_cached(
    fleet_with_events: tuple[Any, Any],
) -> None:
    pool, router = fleet_with_events
    a, b = pool.workers["a:1"], pool.workers["b:2"]
    request = _chat("a question")
    key = _keyed(router, request, LONG)
    prefix = key.prefix
    assert prefix is not None
    own = 1024.0
    # The guess says A holds it all (it was routed there); A's events say it evicted it.
    a.prefixes.add(prefix.blocks, 10_000)
    assert router.cached_tokens(a, prefix, own) == pytest.approx(own, rel=0.2)
    assert router.cached_tokens(a, prefix, own, key.tokens) == 0.0
    # B's events say it holds the first half: half of the prompt is cached there.
    b.kv.stored(list(range(4)), None, LONG[: 128 * 4], 128)
    assert router.cached_tokens(b, prefix, own, key.tokens) == pytest.approx(own / 2)
    assert router.choose(MODEL, own, key).worker is b
    # Once events were lost, the guess counts where it says more.
    a.kv.complete = False
    assert router.cached_tokens(a, prefix, own, key.tokens) == pytest.approx(own, rel=0.2)


def test_a_prompt_just_routed_is_held_there_for_the_next_until_its_events_come(
    fleet_with_events: tuple[Any, Any],
) -> None:
    pool, router = fleet_with_events
    key = _keyed(router, _chat("a question"), LONG)
    first = router.choose(MODEL, 1024.0, key).worker
    follower = _keyed(router, _chat("a question"), [*LONG, 7, 7, 7])
    assert router.choose(MODEL, 1024.0, follower).worker is first
    assert _sample(pool, "gateway_worker_predicted_prefix_hit_tokens_total", worker=first.label) > 0


def test_under_the_events_a_prefix_nobody_holds_goes_where_fewest_requests_ran_of_late(
    fleet_with_events: tuple[Any, Any],
) -> None:
    pool, router = fleet_with_events
    a, b = pool.workers["a:1"], pool.workers["b:2"]
    now = pool.now()  # the fleet's fake clock: 1000
    # A ran 4 requests for the last 20 s, done a moment ago; B runs 1, sent just now. The
    # approximate index says B took more prompts.
    a.add_in_flight(4, now - 20.0)
    a.add_in_flight(-4, now - 0.1)
    b.add_in_flight(1, now - 0.1)
    b.prefixes.add(_prefix(router.route_key(None, _chat("other", system="x " * 900))).blocks, 10**4)
    assert a.in_flight < b.in_flight
    assert a.recent_load(now) > b.recent_load(now)
    request = _chat("a question")
    assert router.choose(MODEL, 1024.0, _keyed(router, request, LONG)).worker is b
    # Routed on the approximate index alone, the worker holding fewer prefixes takes it.
    other = router.route_key(None, _chat("a question", system="y " * 900))
    assert router.choose(MODEL, 1024.0, other).worker is a


async def test_only_a_fleet_following_events_asks_for_tokens() -> None:
    _pool, router = _fleet()
    request = _chat("a question")
    key = router.route_key(None, request)
    assert await router.tokenized(key, request) is key  # no tokenizer, no events followed


class _Publisher:
    """vLLM's publisher as its sockets behave: PUB of (topic, seq, batch), a ROUTER replaying
    its buffer from a start sequence and ending with sequence -1. For faults a real worker
    does not make on demand: a batch never sent, a buffer that no longer holds it."""

    def __init__(self, context: Any) -> None:
        import zmq

        self.pub = context.socket(zmq.PUB)
        self.router = context.socket(zmq.ROUTER)
        pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        router_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.source = EventSource(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{router_port}")
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0

    async def publish(self, *events: dict[str, Any], send: bool = True, keep: bool = True) -> None:
        payload = _batch(*events, ts=time.time())
        if keep:
            self.buffer.append((self.seq, payload))
        if send:
            await self.pub.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    async def serve_replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.router.send_multipart(
                        [client, b"", b"", seq.to_bytes(8, "big"), payload]
                    )
            end = (-1).to_bytes(8, "big", signed=True)
            await self.router.send_multipart([client, b"", b"", end, b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def _until(check: Any, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.01)


async def test_a_follower_over_zmq_catches_up_replays_a_gap_and_counts_what_is_lost() -> None:
    import zmq.asyncio

    context = zmq.asyncio.Context()
    publisher = _Publisher(context)
    replays = asyncio.create_task(publisher.serve_replays())
    counts = _Counts()
    events = KVEvents(counts)
    index = KVIndex(max_blocks=100)
    try:
        # Published before anyone followed: the history comes from the replay.
        await publisher.publish(_stored([1], None, PROMPT[:4]))
        events.follow("w", publisher.source, index)
        await _until(lambda: index.match(KEYS, 0.0) == 1)
        assert index.complete
        # The PUB socket drops what it sends before the subscription reaches it: a harmless
        # event (the removal of nothing) until one arrives live.
        deadline = time.monotonic() + 10
        while not counts.lags:
            assert time.monotonic() < deadline, "the subscription never received a batch"
            await publisher.publish(_removed([12345]))
            await asyncio.sleep(0.05)
        assert index.complete
        # A batch the subscriber never got is replayed from the buffer.
        await publisher.publish(_stored([2], 1, PROMPT[4:8]), send=False)
        await publisher.publish(_stored([3], 2, PROMPT[8:12]))
        await _until(lambda: index.match(KEYS, 0.0) == 3)
        assert counts.lost == 0
        # One that the buffer no longer holds is lost: the index starts over, incomplete.
        await publisher.publish(_removed([3]), send=False, keep=False)
        await publisher.publish(_stored([9], None, [7, 7, 7, 7]))
        await _until(lambda: counts.lost == 1)
        assert not index.complete
        assert index.match(KEYS, 0.0) == 0
        assert len(index) == 1
    finally:
        await events.close()
        replays.cancel()
        publisher.close()
        context.term()


def _conversation(*turns: str, system: str = "be brief") -> ParsedRequest:
    return _chat(*turns, system=system)


async def test_an_earlier_turns_tokens_route_the_next_and_the_whole_is_asked_behind() -> None:
    """A conversation's next turn begins with what its earlier turn rendered to."""
    asked: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        asked.append(body)
        # A template rendering message by message: each message two tokens of its own, then
        # the generation prompt's.
        ids = [t for m in body["messages"] for t in (len(m["role"]), len(m["content"]))]
        if body.get("add_generation_prompt", True):
            ids.append(99)
        return httpx.Response(200, json={"tokens": ids})

    tokenizer = _tokenizer(answer)
    spec = WorkerSpec.model_validate({"url": "http://w:1"})
    first = _conversation("hi")
    found = tokenizer.lookup(first, {2})
    assert found.tokens is None
    assert found.lead is None  # nothing known: the request waits for the whole
    assert found.ask is not None
    assert found.lead_ask is not None  # and its system prompt is asked for the next one
    assert await tokenizer.ask(spec, MODEL, found.ask, {2}) is not None
    tokenizer.prefetch(spec, MODEL, found.lead_ask, {2})
    await _settle(tokenizer)
    # Another user on the same system prompt: its system prompt's blocks are known at once.
    other = tokenizer.lookup(_conversation("hello"), {2})
    assert other.tokens is None
    assert other.lead is not None
    assert not other.lead.whole
    assert other.lead.blocks(2) == chain([6, 8], 2)
    # The next turn of the first conversation: the first turn's whole prompt leads it.
    second = tokenizer.lookup(_conversation("hi", "hello there", "and?"), {2})
    assert second.lead is not None
    assert len(second.lead) == 5
    assert second.ask is not None
    tokenizer.prefetch(spec, MODEL, second.ask, {2}, second.lead)
    await _settle(tokenizer)
    assert tokenizer.lookup(_conversation("hi", "hello there", "and?"), {2}).tokens is not None
    # Closing cancels what still runs in the background.
    third = tokenizer.lookup(_conversation("hi", "hello there", "and?", "so", "then?"), {2})
    assert third.ask is not None
    tokenizer.prefetch(spec, MODEL, third.ask, {2}, third.lead)
    assert tokenizer.asking == 1
    await tokenizer.close()
    assert tokenizer.asking == 0


async def _settle(tokenizer: Tokenizer) -> None:
    """Wait until the background asks are done."""
    deadline = time.monotonic() + 5
    while tokenizer.asking:
        assert time.monotonic() < deadline, "a background ask never ended"
        await asyncio.sleep(0.01)


async def test_a_template_that_does_not_render_turn_by_turn_is_asked_whole() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        # Each prompt's ids depend on its length: no earlier prompt begins a later one.
        n = len(body["messages"])
        return httpx.Response(200, json={"tokens": [n] * (4 * n)})

    tokenizer = _tokenizer(answer)
    spec = WorkerSpec.model_validate({"url": "http://w:1"})
    first = tokenizer.lookup(_conversation("hi"), {2})
    assert first.ask is not None
    await tokenizer.ask(spec, MODEL, first.ask, {2})
    second = tokenizer.lookup(_conversation("hi", "yes", "then?"), {2})
    assert second.lead is not None
    assert second.ask is not None
    tokenizer.prefetch(spec, MODEL, second.ask, {2}, second.lead)
    await _settle(tokenizer)
    third = tokenizer.lookup(_conversation("hi", "yes", "then?", "ok", "so?"), {2})
    assert third.lead is None  # the model's template was seen not to compose
    assert third.ask is not None

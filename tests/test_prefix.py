"""Prefix-aware routing: the prompt's text, the per-worker index, and the choice it drives."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from app.api.protocol import Endpoint, ParsedRequest, parse_request
from app.fleet.lease import Lease
from app.fleet.loadsignals import LoadSample, parse_load
from app.fleet.prefix import BLOCK_CHARS, PrefixIndex, PromptPrefix, prompt_text
from app.fleet.routing import RouteKey, Router
from app.fleet.wire import WireClient
from app.fleet.workers import Worker, WorkerPool
from app.observe.metrics import GatewayMetrics
from tests.conftest import FakeClock
from tests.fake_upstream import MODEL
from tests.servers import settings_for
from tests.test_pool import FakeResolver

SAMPLES = Path(__file__).parent / "data" / "vllm_samples"
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india")


def _words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


SYSTEM = _words(700, 1)  # ~4,200 characters: a shared system prompt


def _chat(*turns: str, system: str = SYSTEM, **extra: Any) -> ParsedRequest:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    body = {"model": MODEL, "messages": messages, **extra}
    return parse_request(Endpoint.CHAT, json.dumps(body).encode())


def _fleet(
    workers: str = "http://a:1,http://b:2", **overrides: object
) -> tuple[WorkerPool, Router]:
    clock = FakeClock()
    settings = settings_for(workers, routing="prefix_aware", **overrides)
    metrics = GatewayMetrics(settings)
    client = WireClient(1.0)  # never asked: these tests probe nothing
    pool = WorkerPool(settings, client, metrics, clock, FakeResolver())
    for worker in pool.workers.values():
        worker.up = True
        worker.models = {MODEL}
        worker.cards = {MODEL: {"id": MODEL}}
        # Fresh load figures: idle, a CPU worker's 128-token cache blocks.
        worker.load = LoadSample(0, 0, 0.0, clock.now, 0, 131072, 128)
    return pool, Router(settings, pool, random.Random(3), metrics)


def _sample(pool: WorkerPool, name: str, **labels: str) -> float:
    value = pool.metrics.registry.get_sample_value(name, labels)
    assert value is not None
    return value


def _key(router: Router, request: ParsedRequest, session: str | None = None) -> RouteKey:
    key = router.route_key(session, request)
    assert key.prefix is not None
    return key


def _prefix(key: RouteKey) -> PromptPrefix:
    assert key.prefix is not None
    return key.prefix


def _question_held_by_a(words: int, seed: int) -> tuple[WorkerPool, Router, RouteKey, float, float]:
    """Two idle workers, A holding a question of ``words`` words.

    ``(pool, router, the question's route key, its prompt tokens, the tokens A has cached)``.
    """
    pool, router = _fleet()
    request = _chat("a question: " + _words(words, seed))
    key = _key(router, request)
    own = _tokens(request)
    a = pool.workers["a:1"]
    a.prefixes.add(_prefix(key).blocks, 10_000)
    return pool, router, key, own, router.cached_tokens(a, _prefix(key), own)


def _tokens(request: ParsedRequest) -> float:
    return request.size / 4.0


def _route(router: Router, request: ParsedRequest, session: str | None = None) -> Worker:
    return router.choose(MODEL, _tokens(request), _key(router, request, session)).worker


def test_the_prompt_text_is_the_messages_in_order_and_stops_at_what_it_cannot_read() -> None:
    chat = _chat("hello", "hi there", "how are you")
    text = prompt_text(Endpoint.CHAT, chat.body)
    assert text.index(SYSTEM) < text.index("hello") < text.index("hi there")
    assert text.index("how are you") > text.index("hi there")
    # An earlier turn's prompt is a prefix of the next turn's: the conversation grows at the end.
    assert text.startswith(prompt_text(Endpoint.CHAT, _chat("hello").body))
    # Roles count: the same words from another role are another prompt.
    other = {"model": MODEL, "messages": [{"role": "user", "content": SYSTEM}]}
    assert not text.startswith(prompt_text(Endpoint.CHAT, other))
    # Text parts are read; an image stops the text there (what follows is not comparable).
    parts = {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look:"}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "user", "content": "after the image"},
        ],
    }
    assert "look:" in prompt_text(Endpoint.CHAT, parts)
    assert "after the image" not in prompt_text(Endpoint.CHAT, parts)
    # Tools come first in chat templates: their names are part of the prefix.
    with_tools = _chat("hello", tools=[{"type": "function", "function": {"name": "get_weather"}}])
    assert prompt_text(Endpoint.CHAT, with_tools.body).index("get_weather") < len(SYSTEM) // 2
    # Completions: the prompt, or the first of several; token ids give nothing to read.
    assert prompt_text(Endpoint.COMPLETIONS, {"prompt": "abc"}) == "abc"
    assert prompt_text(Endpoint.COMPLETIONS, {"prompt": ["abc", "def"]}) == "abc"
    assert prompt_text(Endpoint.COMPLETIONS, {"prompt": [1, 2, 3]}) == ""
    assert prompt_text(Endpoint.CHAT, {"messages": "not a list"}) == ""


def test_the_index_finds_the_longest_shared_prefix() -> None:
    _, router = _fleet()
    first = _key(router, _chat("the first user asks about " + _words(300, 2)))
    index = PrefixIndex()
    index.add(_prefix(first).blocks, cap=10_000)
    assert index.match(_prefix(first).blocks) == len(_prefix(first).blocks)
    # Another user with the same system prompt: shares the whole blocks of the system prompt.
    second = _key(router, _chat("a second user asks about " + _words(300, 3)))
    shared_chars = len(prompt_text(Endpoint.CHAT, _chat().body))
    assert index.match(_prefix(second).blocks) == shared_chars // BLOCK_CHARS
    # The first user's next turn: the whole of the first prompt is a prefix of it.
    follow_up = _chat("the first user asks about " + _words(300, 2), "an answer", "and then?")
    assert index.match(_prefix(_key(router, follow_up)).blocks) == len(_prefix(first).blocks)
    # A prompt that differs in its first block shares nothing, even with the same tail.
    assert index.match(_prefix(_key(router, _chat(system="x" + SYSTEM[1:]))).blocks) == 0
    # Another model's identical prompt is another prefix (a worker may serve several).
    other_model = {**follow_up.body, "model": "other-model"}
    other = parse_request(Endpoint.CHAT, json.dumps(other_model).encode())
    assert index.match(_prefix(_key(router, other)).blocks) == 0


def test_requests_sharing_a_prefix_go_where_it_was_sent_and_the_hit_is_predicted() -> None:
    pool, router = _fleet()
    first = _chat("user one: " + _words(60, 4))
    home = _route(router, first)
    # Other users of the same system prompt, with no session id, follow it there...
    for seed in range(5, 15):
        request = _chat(f"user {seed}: " + _words(60, seed))
        choice = router.choose(MODEL, _tokens(request), _key(router, request))
        assert choice.worker is home
        # ...predicted to find the system prompt's whole cache blocks there (128 tokens each).
        assert choice.cached_tokens > 0.6 * _tokens(request)
        assert choice.cached_tokens % 128 == 0
        # The prefill the worker is charged with is what is left.
        lease = Lease(choice, "standard", _tokens(request), 0.0, pool.metrics)
        assert home.prefill_tokens_ahead == _tokens(request) - choice.cached_tokens
        lease.first_output(0.1)
        lease.release(0.2)
    assert home.prefill_tokens_ahead == 0
    # The predicted hits are counted per worker, beside the prompt tokens routed there.
    hits = _sample(pool, "gateway_worker_predicted_prefix_hit_tokens_total", worker=home.label)
    queries = _sample(pool, "gateway_worker_prefix_query_tokens_total", worker=home.label)
    assert 0.5 * queries < hits < queries


def test_a_worker_with_the_prefix_but_a_long_queue_loses_to_an_idle_one() -> None:
    pool, router, key, own, saved = _question_held_by_a(40, 9)
    a, b = pool.workers["a:1"], pool.workers["b:2"]
    assert saved > 0.8 * own
    # A short queue on A costs less than the prefill A saves: A wins.
    a.prefill_tokens_ahead = 0.5 * saved
    assert router.choose(MODEL, own, key).worker is a
    # A queue a little longer than the saved prefill: too close to tell, the cache wins.
    a.prefill_tokens_ahead = 1.5 * saved
    assert router.choose(MODEL, own, key).worker is a
    # A queue costing more than the saved prefill and the slack: the idle worker wins, and
    # now holds it too (2,000 tokens at the prior 0.2 ms per token: 0.4 s).
    a.prefill_tokens_ahead = 1.5 * saved + 2_000
    assert router.choose(MODEL, own, key).worker is b
    assert b.prefixes.match(_prefix(key).blocks) == len(_prefix(key).blocks)
    # Requests queued inside the worker (other replicas' traffic) count as a queue as well.
    a.prefill_tokens_ahead = 0
    b.prefill_tokens_ahead = 0
    b.prefixes.clear()
    assert router.choose(MODEL, own, key).worker is a
    a.load = LoadSample(2, 40, 0.5, pool.now(), 0, 131072, 128)
    assert router.choose(MODEL, own, key).worker is b


def test_a_worker_that_learnt_a_slower_line_keeps_its_prefix_against_an_idle_one() -> None:
    # Seen on real workers: the prefix's holder had answered its first requests slowly (a busy
    # machine), the other quickly; on learnt lines alone the other, which must prefill the
    # whole prompt, was predicted a few milliseconds faster and took the prefix's request.
    pool, router, key, own, cached = _question_held_by_a(600, 21)
    a, b = pool.workers["a:1"], pool.workers["b:2"]
    for tokens, ttft in ((own, 0.30), (own / 2, 0.25), (own, 0.31)):
        a.latency.observe_ttft(tokens, ttft)
    for tokens, ttft in ((own, 0.04), (own / 2, 0.03), (own, 0.05)):
        b.latency.observe_ttft(tokens, ttft)
    assert cached > 0.8 * own
    assert router.rank(a, own - cached) > router.rank(b, own)
    assert router.choose(MODEL, own, key).worker is a


def test_of_workers_holding_a_prefix_alike_the_least_queued_then_least_loaded_wins() -> None:
    # Both hold the system prompt (every user's prompt starts with it). A learnt a faster
    # line from a few answers: on predictions alone it would take every request while it runs
    # fewer than B would need to look as fast.
    pool, router = _fleet()
    a, b = pool.workers["a:1"], pool.workers["b:2"]
    for tokens, ttft in ((400, 0.05), (200, 0.04), (400, 0.06)):
        a.latency.observe_ttft(tokens, ttft)
    for tokens, ttft in ((400, 0.15), (200, 0.12), (400, 0.16)):
        b.latency.observe_ttft(tokens, ttft)
    first = _chat("user one: " + _words(60, 31))
    for worker in (a, b):
        worker.prefixes.add(_prefix(_key(router, first)).blocks, 10_000)

    def route(user: int) -> Worker:
        # A new user each time: the chosen worker's index learns the whole prompt.
        request = _chat(f"user {user}: " + _words(60, user))
        key, own = _key(router, request), _tokens(request)
        assert router.cached_tokens(a, _prefix(key), own) > 0
        assert router.cached_tokens(a, _prefix(key), own) == router.cached_tokens(
            b, _prefix(key), own
        )
        assert router.rank(a, own) < router.rank(b, own)
        return router.choose(MODEL, own, key).worker

    a.in_flight = 2
    assert route(40) is b
    # As loaded: the faster prediction wins.
    b.in_flight = 2
    assert route(41) is a
    # Prefill work ahead comes first: a first token waits for it, not for decoding streams.
    a.in_flight, b.in_flight, b.prefill_tokens_ahead = 0, 3, 100
    assert route(42) is a
    a.in_flight, b.in_flight, a.prefill_tokens_ahead, b.prefill_tokens_ahead = 0, 3, 100, 0
    assert route(43) is b
    a.prefill_tokens_ahead = 0
    # One holding more of the prompt still wins over a less loaded one holding less.
    request = _chat("user 41: " + _words(60, 41))
    a.in_flight = 3
    assert router.choose(MODEL, _tokens(request), _key(router, request)).worker is a


def test_a_hot_prefix_does_not_pile_onto_the_worker_that_first_had_it() -> None:
    pool, router = _fleet()
    a, b = pool.workers["a:1"], pool.workers["b:2"]
    request = _chat("a question: " + _words(40, 15))
    key = _key(router, request)
    a.prefixes.add(_prefix(key).blocks, 10_000)
    # More requests on A than on B, within the balance thresholds: the cache wins.
    for on_a, on_b in ((4, 0), (5, 1), (10, 6), (11, 6)):
        a.in_flight, b.in_flight = on_a, on_b
        assert router.choose(MODEL, _tokens(request), key).worker is a, (on_a, on_b)
    # Over them (more than 4 more, and more than twice as many): B, which then holds it too.
    for on_a, on_b in ((5, 0), (7, 1), (13, 6)):
        b.prefixes.clear()
        a.in_flight, b.in_flight = on_a, on_b
        assert router.choose(MODEL, _tokens(request), key).worker is b, (on_a, on_b)
    # Chosen all the same (B is slower still), A is predicted to find the prefix cached.
    a.in_flight, b.in_flight = 5, 0
    b.prefill_tokens_ahead = 10 * _tokens(request)
    choice = router.choose(MODEL, _tokens(request), key)
    assert choice.worker is a
    assert choice.cached_tokens > 0.8 * _tokens(request)
    b.prefill_tokens_ahead = 0
    # Other replicas' requests count too (the worker's scraped running, less ours then).
    b.prefixes.clear()
    a.in_flight, b.in_flight = 0, 0
    a.load = LoadSample(8, 0, 0.1, pool.now(), 0, 131072, 128)
    assert router.choose(MODEL, _tokens(request), key).worker is b


def test_new_prefixes_go_to_the_worker_holding_the_least_unless_it_is_much_slower() -> None:
    pool, router = _fleet(affinity_slack_s=0.25)
    a, b = pool.workers["a:1"], pool.workers["b:2"]
    # A new prefix (held nowhere) goes to whichever holds less, alternating as they fill...
    for seed in range(10):
        request = _chat(f"user {seed}", system=_words(300, 200 + seed))
        _route(router, request)
        # Never more than one prompt's blocks apart.
        assert abs(len(a.prefixes) - len(b.prefixes)) <= len(_prefix(_key(router, request)).blocks)
    # ...within the slack: a much slower worker does not get it for its empty cache.
    b.prefixes.clear()
    b.prefill_tokens_ahead = 5000  # about a second of prefill ahead at the default speed
    request = _chat("user x", system=_words(300, 300))
    assert _route(router, request) is a


def test_a_worker_holding_the_prefix_is_never_chosen_when_it_is_not_healthy() -> None:
    pool, router = _fleet()
    a, b = pool.workers["a:1"], pool.workers["b:2"]
    request = _chat("a question: " + _words(40, 10))
    key = _key(router, request)
    a.prefixes.add(_prefix(key).blocks, 10_000)
    assert router.choose(MODEL, _tokens(request), key).worker is a
    unhealthy: list[tuple[str, object, object]] = [
        ("up", False, True),
        ("ejected_until", pool.now() + 5, None),
        ("draining", True, False),
    ]
    for attribute, bad, good in unhealthy:
        setattr(a, attribute, bad)
        assert {router.choose(MODEL, _tokens(request), key).worker for _ in range(10)} == {b}
        setattr(a, attribute, good)
    # Failover excludes it as well.
    assert router.choose(MODEL, _tokens(request), key, frozenset({"a:1"})).worker is b


def test_a_worker_with_prefix_caching_off_is_predicted_no_hit() -> None:
    pool, router = _fleet()
    a = pool.workers["a:1"]
    request = _chat("a question: " + _words(40, 11))
    key = _key(router, request)
    a.prefixes.add(_prefix(key).blocks, 10_000)
    assert router.cached_tokens(a, _prefix(key), _tokens(request)) > 0
    a.load = LoadSample(0, 0, 0.0, pool.now(), 0, 131072, 128, prefix_caching=False)
    assert router.cached_tokens(a, _prefix(key), _tokens(request)) == 0


def test_the_index_is_capped_in_memory_drops_the_least_recent_and_keeps_whole_prefixes() -> None:
    # 0.01 MiB over 2 workers: 34 entries remembered each, at most 52 held.
    pool, router = _fleet(prefix_index_mb=0.01)
    a = pool.workers["a:1"]
    first = _key(router, _chat("first: " + _words(200, 12), system=_words(400, 13)))
    a.prefixes.add(_prefix(first).blocks, 34)
    for seed in range(20, 40):
        request = _chat(f"other {seed}: " + _words(200, seed), system=_words(400, seed + 100))
        router.choose(MODEL, _tokens(request), _key(router, request), frozenset({"b:2"}))
        assert len(a.prefixes) <= 34
        # Blocks go tail first: what is left of the first prompt is always a whole prefix.
        held = sum(block in a.prefixes for block in _prefix(first).blocks)
        assert a.prefixes.match(_prefix(first).blocks) == held
    assert a.prefixes.match(_prefix(first).blocks) == 0
    # The most recent prompt is held from its start.
    assert a.prefixes.match(_prefix(_key(router, request)).blocks) > 0
    # The memory is exported, and stays under the cap.
    pool.export()
    assert 0 < _sample(pool, "gateway_prefix_index_bytes") <= 0.01 * 2**20


def test_a_prompt_used_within_the_last_half_of_the_cap_is_kept() -> None:
    index = PrefixIndex()
    prompts = [[seed * 100 + i for i in range(4)] for seed in range(1, 6)]
    for blocks in prompts[:3]:  # 12 blocks: the young generation (half of 20) is full
        index.add(blocks, cap=20)
    # The first two are old now, not gone; refreshing one keeps it through the next turnover.
    assert all(index.match(blocks) == 4 for blocks in prompts[:3])
    index.add(prompts[0], cap=20)
    for blocks in prompts[3:]:
        index.add(blocks, cap=20)
    assert index.match(prompts[0]) == 4
    assert index.match(prompts[1]) == 0
    assert len(index) <= 20


def test_the_index_holds_no_more_than_the_workers_kv_cache() -> None:
    pool, router = _fleet()
    a = pool.workers["a:1"]
    # A worker whose KV cache holds 1,024 tokens: about 16 blocks of 256 characters.
    a.load = LoadSample(0, 0, 0.0, pool.now(), 0, 1024, 16)
    for seed in range(30):
        request = _chat(f"user {seed}: " + _words(100, seed), system=_words(300, seed + 50))
        router.choose(MODEL, _tokens(request), _key(router, request), frozenset({"b:2"}))
    # It remembers between half and all of a third more than that, as its generations turn.
    assert 0 < len(a.prefixes) <= 4 / 3 * 1024 / (BLOCK_CHARS / 4.5)
    assert len(a.prefixes) >= 0.5 * 4 / 3 * 1024 / (BLOCK_CHARS / 3.5)


def test_sessions_still_stick_under_prefix_aware_routing() -> None:
    _, router = _fleet("http://a:1,http://b:2,http://c:3")
    # Short prompts (no whole block): the session key alone decides, as with predicted_ttft.
    short = _chat("hi", system="be brief")
    assert _prefix(_key(router, short)).blocks == []
    for session in ("s-1", "s-2", "s-3", "s-4"):
        assert len({_route(router, short, session) for _ in range(10)}) == 1
    assert len({_route(router, short, f"s-{i}") for i in range(30)}) > 1


def test_a_restarted_worker_forgets_its_prefixes() -> None:
    pool, router = _fleet()
    a = pool.workers["a:1"]
    request = _chat("a question: " + _words(40, 14))
    a.prefixes.add(_prefix(_key(router, request)).blocks, 10_000)
    pool.set_up(a, False, None)
    pool.set_up(a, True, None)
    assert len(a.prefixes) == 0


def test_other_policies_read_no_prefix() -> None:
    pool, _ = _fleet()
    for policy in ("predicted_ttft", "round_robin", "least_outstanding"):
        other = Router(settings_for("http://a:1,http://b:2", routing=policy), pool)
        assert other.route_key("s-1", _chat("x")) == RouteKey("s-1")
        assert other.route_key(None, _chat("x")) == RouteKey()


def test_the_cache_config_gives_block_size_and_whether_prefix_caching_is_on() -> None:
    page = (SAMPLES / "metrics_busy.txt").read_text()
    sample = parse_load(page, at=1.0)
    assert sample.block_size == 128
    assert sample.prefix_caching
    off = page.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"')
    assert not parse_load(off, at=1.0).prefix_caching

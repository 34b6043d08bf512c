"""The prefix workload of the routing benchmark: users in multi-turn chats over shared prompts.

``systems`` system prompts of about ``system_tokens`` tokens each are shared by ``users``
users (user ``u`` has prompt ``u % systems``). Each user holds a conversation of ``turns``
turns: turn ``k`` sends the system prompt, the ``k - 1`` earlier questions with the answers the
worker gave them (greedy, so the same under every policy), and a new question. Arrivals are a
Poisson process; the requests go out in rounds (every user's first turn in a random order,
then every user's second turn, ...), so a user's next turn comes long after its previous
answer; should it not have, it waits for that answer (its TTFT is counted from its send).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.live import BENCH_MODEL, Outcome, arrival_times

_TEXT = (
    "the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak tree "
    "and count the stars above the quiet river that runs past the sleeping town"
)
_WORDS = tuple(_TEXT.split())


def words(n: int, rng: random.Random) -> str:
    """``n`` words drawn at random (about 1.9 tokens each with the tiny tokenizer)."""
    return " ".join(rng.choice(_WORDS) for _ in range(n))


@dataclass
class User:
    """One user's conversation: its system prompt, its questions, the answers so far."""

    name: str
    system: str
    questions: list[str]
    history: list[dict[str, str]] = field(default_factory=list)
    done: asyncio.Event | None = None
    """Set when the user's latest request has finished (the next turn may go)."""

    def messages(self, turn: int) -> list[dict[str, str]]:
        """The messages of turn ``turn`` (0-based): system, the history, the new question."""
        return [
            {"role": "system", "content": self.system},
            *self.history,
            {"role": "user", "content": self.questions[turn]},
        ]


def make_users(users: int, systems: int, system_words: int, turns: int, seed: int) -> list[User]:
    """The workload's users, the same for a given ``seed`` (fresh conversation state)."""
    rng = random.Random(seed)
    prompts = [f"You are assistant {i}. " + words(system_words, rng) for i in range(systems)]
    return [
        User(
            name=f"user-{u}",
            system=prompts[u % systems],
            questions=[words(rng.randint(15, 30), rng) + "?" for _ in range(turns)],
        )
        for u in range(users)
    ]


def schedule(users: int, turns: int, rate: float, seed: int) -> list[tuple[float, int, int]]:
    """``(offset s, user, turn)`` of every request: Poisson arrivals, in rounds of turns."""
    rng = random.Random(seed)
    order: list[tuple[int, int]] = []
    for turn in range(turns):
        round_ = list(range(users))
        rng.shuffle(round_)
        order += [(u, turn) for u in round_]
    offsets: list[float] = []
    while len(offsets) < len(order):
        offsets = arrival_times(rate, len(order) / rate * 2, rng)
    return [(offsets[i], u, t) for i, (u, t) in enumerate(order)]


async def converse(
    client: httpx.AsyncClient,
    url: str,
    user: User,
    turn: int,
    max_tokens: int,
    headers: Mapping[str, str],
) -> Outcome:
    """Send ``user``'s turn ``turn`` (streamed); append its answer to the user's history."""
    body: dict[str, Any] = {
        "model": BENCH_MODEL,
        "messages": user.messages(turn),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # The request id names the user and turn in the gateway's access log.
    headers = {"x-request-id": f"{user.name}.turn-{turn}", **headers}
    sent = time.perf_counter()
    outcome = Outcome(tag=f"{user.name}/{turn}", sent=sent)
    answer: list[str] = []
    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=dict(headers)
        ) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                outcome.error = f"http {response.status_code}"
                return outcome
            last = sent
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    outcome.error = str(event["error"].get("type", "error"))
                    continue
                if event.get("usage"):
                    outcome.completion_tokens = int(event["usage"].get("completion_tokens") or 0)
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        last = time.perf_counter()
                        if outcome.ttft is None:
                            outcome.ttft = last - sent
                        answer.append(text)
            outcome.ended(done, last)
    except httpx.HTTPError as exc:
        outcome.error = type(exc).__name__
        outcome.lost = outcome.status == 0
    user.history += [
        {"role": "user", "content": user.questions[turn]},
        {"role": "assistant", "content": "".join(answer)},
    ]
    return outcome


async def run_open(
    url: str | Sequence[str],
    users: Sequence[User],
    plan: Sequence[tuple[float, int, int]],
    max_tokens: int,
    sessions: bool,
) -> tuple[list[Outcome], float]:
    """Send every request of ``plan`` at its time; the outcomes and the seconds they took.

    With ``sessions``, each user's requests carry its ``x-session-id``. Several URLs (gateway
    replicas behind a load balancer without affinity) take the requests in turn, in the
    plan's order.
    """
    urls = [url] if isinstance(url, str) else list(url)
    for user in users:
        user.history = []
        user.done = asyncio.Event()
        user.done.set()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()

        async def one(offset: float, index: int, turn: int, url: str) -> Outcome:
            user = users[index]
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            assert user.done is not None
            while not user.done.is_set():
                await user.done.wait()
            user.done.clear()
            try:
                headers = {"x-session-id": user.name} if sessions else {}
                return await converse(client, url, user, turn, max_tokens, headers)
            finally:
                user.done.set()

        # Turns of one user are created in order, so they queue on its event in order.
        outcomes = await asyncio.gather(
            *(one(o, u, t, urls[i % len(urls)]) for i, (o, u, t) in enumerate(plan))
        )
        return list(outcomes), time.perf_counter() - start


async def run_closed(
    url: str,
    users: Sequence[User],
    turns: int,
    concurrency: int,
    max_tokens: int,
    duration: float,
) -> list[Outcome]:
    """``concurrency`` clients sending the next (user, turn) as each is done, ``duration`` s.

    The most the fleet completes: used to measure capacity.
    """
    order = [(u, t) for t in range(turns) for u in range(len(users))]
    busy: set[int] = set()
    for user in users:
        user.history = []
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        end = time.perf_counter() + duration

        async def loop() -> None:
            while order and time.perf_counter() < end:
                pick = next((i for i, (u, _) in enumerate(order) if u not in busy), None)
                if pick is None:
                    await asyncio.sleep(0.01)
                    continue
                index, turn = order.pop(pick)
                busy.add(index)
                try:
                    outcomes.append(await converse(client, url, users[index], turn, max_tokens, {}))
                finally:
                    busy.discard(index)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return outcomes

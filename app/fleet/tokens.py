"""A prompt's tokens as the worker renders them, for routing on its KV cache events.

A worker's events name its cached blocks by the token ids they hold
(:mod:`app.fleet.kvindex`), so a request's prompt must be cut into the same tokens: the chat
template applied, the tools rendered, special tokens added, exactly as the worker will. Only
the worker knows all that for sure, so the worker is asked (vLLM's ``/tokenize``, which takes a
chat request's ``messages``, ``tools`` and template arguments, or a completion's ``prompt``).
A prompt given as token ids needs no asking. With the model's tokenizer files at hand
(``GATEWAY_TOKENIZERS``), the gateway renders and tokenizes the prompt itself
(:mod:`app.fleet.localtokens`) and asks the worker only what it cannot render; its first
answers per model are compared with the worker's, and a copy that differs is given up.

The block keys of the answers (not the tokens) are cached by the rendered request, least
recently used dropped first, within a memory cap: a prompt sent again (a benchmark's, a
retried request) costs a hash and a lookup. A prompt with parts that are not text (images,
audio) is not asked for: such blocks are keyed by more than their tokens, and routing keeps to
the approximate index for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

import msgspec

from app.api.protocol import Endpoint, ParsedRequest
from app.fleet.kvindex import chain
from app.fleet.localtokens import LocalTokenizer
from app.fleet.wire import WireClient, WireError
from app.settings import WorkerSpec

log = logging.getLogger(__name__)

# What vLLM's /tokenize takes of a chat request besides its messages: what the template sees.
_CHAT_FIELDS: Final = (
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
)
_COMPLETION_FIELDS: Final = ("add_special_tokens",)


class PromptTokens:
    """A prompt's length in tokens and its block keys, per block size the fleet uses.

    The keys of each block size are chained once, when the tokens come; the tokens themselves
    are not kept (a key a block holds what 16-128 token ids would).
    """

    __slots__ = ("_chains", "count", "whole")

    def __init__(
        self, tokens: Sequence[int], block_sizes: Iterable[int], *, whole: bool = True
    ) -> None:
        self.count = len(tokens)
        """Tokens in the prompt (or in its leading part, if not ``whole``)."""
        self.whole = whole
        """Whether these are the whole prompt's, or only a leading part's (an earlier turn's)."""
        self._chains = {size: chain(tokens, size) for size in set(block_sizes) if size > 0}

    def lead(self) -> PromptTokens:
        """The same keys, as a leading part of a longer prompt."""
        part = PromptTokens((), ())
        part.count, part.whole, part._chains = self.count, False, self._chains
        return part

    def starts(self, other: PromptTokens) -> bool:
        """Whether every chain of ``other`` (a leading part) begins these."""
        return all(
            keys == self._chains.get(size, [])[: len(keys)] for size, keys in other._chains.items()
        )

    def __len__(self) -> int:
        return self.count

    def same(self, other: PromptTokens) -> bool:
        """Whether ``other`` holds the same tokens, as far as the chains of both tell."""
        return self.count == other.count and all(
            keys == other._chains.get(size) for size, keys in self._chains.items()
        )

    def covers(self, block_sizes: Iterable[int]) -> bool:
        """Whether the keys of each of ``block_sizes`` are here."""
        return all(size in self._chains for size in block_sizes)

    def blocks(self, block_size: int) -> list[int]:
        """The key of each whole block of ``block_size`` tokens (none if not chained)."""
        return self._chains.get(block_size, [])

    def nbytes(self) -> int:
        """Memory held: the chains' lists and keys."""
        keys = sum(len(k) for k in self._chains.values())
        return sys.getsizeof(self._chains) + keys * _KEY_BYTES + 64 * len(self._chains) + 64


class _Answer(msgspec.Struct):
    """What is read of vLLM's ``/tokenize`` answer."""

    tokens: list[int]


_decode = msgspec.json.Decoder(_Answer).decode
_KEY_BYTES: Final = 8 + sys.getsizeof(1 << 62)


def tokenize_body(request: ParsedRequest) -> dict[str, Any] | None:
    """What to send to the worker's ``/tokenize`` for ``request``'s prompt; None: not asked.

    Chat with text parts only, or a completion's first prompt as text.
    """
    body = request.body
    if request.endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not _text_only(messages):
            return None
        asked = {"model": request.model, "messages": messages}
        asked.update((f, body[f]) for f in _CHAT_FIELDS if body.get(f) is not None)
        return asked
    if request.endpoint is Endpoint.COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None
        asked = {"model": request.model, "prompt": prompt}
        asked.update((f, body[f]) for f in _COMPLETION_FIELDS if body.get(f) is not None)
        return asked
    return None


def given_tokens(request: ParsedRequest) -> list[int] | None:
    """A completion's prompt given as token ids (the first, of several): no asking needed."""
    if request.endpoint is not Endpoint.COMPLETIONS:
        return None
    prompt = request.body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    return None


def _text_only(messages: list[Any]) -> bool:
    for message in messages:
        if not isinstance(message, dict):
            return False
        content = message.get("content")
        if isinstance(content, list) and any(
            not isinstance(part, dict) or part.get("type") != "text" for part in content
        ):
            return False
    return True


@dataclass(slots=True)
class Lookup:
    """What is known now of a prompt's tokens (:meth:`Tokenizer.lookup`), and what to ask."""

    tokens: PromptTokens | None = None
    """The whole prompt's, known now (given as ids, or seen before)."""
    ask: bytes | None = None
    """The body asking a worker for the whole prompt (None: known, or not to be asked)."""
    lead: PromptTokens | None = None
    """A leading part's, known now: an earlier turn of the conversation, or its messages but
    the last (the system prompt of a first turn)."""
    lead_ask: bytes | None = None
    """The body asking for the messages but the last, to be known for the next request."""


class Tokenizer:
    """Asks workers for prompts' tokens, keeping their block keys within ``cache_bytes``.

    Asked over the relay's own client (:class:`app.fleet.wire.WireClient`): an HTTP exchange
    through httpx costs the gateway several times the CPU, and the answer of a long prompt is
    decoded straight into its ids.
    """

    def __init__(
        self,
        wire: WireClient,
        timeout_s: float,
        cache_bytes: int,
        local: Mapping[str, LocalTokenizer] | None = None,
    ) -> None:
        self._wire = wire
        self._local = dict(local or {})
        self._unchecked = dict.fromkeys(self._local, _LOCAL_CHECKS)
        self._checking: set[asyncio.Task[None]] = set()
        # Long prompts are tokenized here off the event loop (the encoding lets go of the GIL).
        self._executor = ThreadPoolExecutor(1, "gateway-tokenize") if self._local else None
        self._timeout_s = timeout_s
        self._cap = cache_bytes
        self._cache: OrderedDict[tuple[str, int], PromptTokens] = OrderedDict()
        self._bytes = 0
        self._asking: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._not_composing: set[str] = set()
        """Models whose chat template was seen not to render turn by turn."""

    @property
    def cached_bytes(self) -> int:
        """Memory the caches hold: the prompts' block keys, and the gateway's own pieces."""
        return self._bytes + sum(local.cached_bytes for local in self._local.values())

    @property
    def asking(self) -> int:
        """Asks running in the background."""
        return len(self._asking)

    def cached(
        self, request: ParsedRequest, block_sizes: Collection[int]
    ) -> tuple[PromptTokens | None, bytes | None]:
        """The whole prompt's keys if known now, else the body to ask; both None: not asked."""
        found = self.lookup(request, block_sizes)
        return found.tokens, found.ask

    def lookup(
        self, request: ParsedRequest, block_sizes: Collection[int], leads: bool = True
    ) -> Lookup:
        """What is known now of ``request``'s prompt, with every one of ``block_sizes`` chained.

        A chat template renders a conversation message by message, so what an earlier turn (or
        the messages but the last, without the generation prompt) rendered to begins what this
        one renders to: its keys are a leading part known at once. That is checked on every
        answer asked after using one; a model whose template breaks it is not read so again.
        Without ``leads`` (the gateway tokenizes the model's prompts itself) none is looked for.
        """
        given = given_tokens(request)
        if given is not None:
            return Lookup(PromptTokens(given, block_sizes))
        asked = tokenize_body(request)
        if asked is None:
            return Lookup()
        body = _render(asked)
        hit = self._get(request.model, body, block_sizes)
        if hit is not None:
            return Lookup(hit)
        found = Lookup(ask=body)
        messages = asked.get("messages")
        if not leads or not isinstance(messages, list) or len(messages) < 2:
            return found
        if request.model in self._not_composing:
            return found
        if len(messages) >= 3:
            turn = _render({**asked, "messages": messages[:-2]})
            earlier = self._get(request.model, turn, block_sizes)
            if earlier is not None:
                found.lead = earlier.lead()
                return found
        # No earlier turn known (a first turn, or a conversation this gateway did not see
        # start): what its messages but the last render to, which other conversations on the
        # same system prompt share; asked for the next request if not known.
        head = _render({**asked, "messages": messages[:-1], "add_generation_prompt": False})
        leading = self._get(request.model, head, block_sizes)
        if leading is None:
            found.lead_ask = head
        else:
            found.lead = leading.lead()
        return found

    async def tokens(
        self, request: ParsedRequest, block_sizes: Collection[int], spec: WorkerSpec
    ) -> tuple[PromptTokens | None, str | None]:
        """The keys to route ``request`` on, asking the worker of ``spec`` what is not known.

        Known at once for a prompt given as ids or seen before (``cached``). Else, when an
        earlier turn's keys are known, those (``partial``), the whole prompt asked in the
        background for the next turn; else the request waits for the worker's answer
        (``asked``, or ``failed``: None). How is the second item; None: not to be asked.
        """
        model = request.model
        local = self._local.get(model)
        found = self.lookup(request, block_sizes, leads=local is None)
        ask = found.ask
        if found.tokens is not None or ask is None:
            return found.tokens, None if found.tokens is None else "cached"
        if local is not None:
            tokens = await self._tokenize_here(local, request, ask, block_sizes, spec)
            if tokens is not None:
                return tokens, "local"
            found = self.lookup(request, block_sizes)  # asked: a known earlier turn may lead
        if found.lead_ask is not None:
            self.prefetch(spec, model, found.lead_ask, block_sizes)
        if found.lead is not None:
            self.prefetch(spec, model, ask, block_sizes, found.lead)
            return found.lead, "partial"
        tokens = await self.ask(spec, model, ask, block_sizes)
        return tokens, "asked" if tokens is not None else "failed"

    async def _tokenize_here(
        self,
        local: LocalTokenizer,
        request: ParsedRequest,
        body: bytes,
        block_sizes: Collection[int],
        spec: WorkerSpec,
    ) -> PromptTokens | None:
        """The prompt tokenized by the gateway's copy of the model's tokenizer; None: ask.

        The first answers per model are also asked of the worker, in the background: a copy
        that differs from the worker is given up (the worker asked from then on).
        """
        asked = tokenize_body(request)
        if asked is None:
            return None
        if request.size > _INLINE_CHARS and self._executor is not None:
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self._executor, _local_ids, local, asked)
        else:
            ids = _local_ids(local, asked)
        model = request.model
        if ids is None or self._local.get(model) is not local:
            return None
        tokens = PromptTokens(ids, block_sizes)
        self._keep((model, hash(body)), tokens)
        if self._unchecked.get(model, 0) > 0:
            self._unchecked[model] -= 1
            task = asyncio.create_task(self._check(spec, model, body, block_sizes, tokens))
            self._checking.add(task)
            task.add_done_callback(self._checking.discard)
        return tokens

    async def _check(
        self,
        spec: WorkerSpec,
        model: str,
        body: bytes,
        block_sizes: Collection[int],
        mine: PromptTokens,
    ) -> None:
        theirs = await self.ask(spec, model, body, block_sizes)
        if theirs is None or theirs.same(mine):
            return
        if self._local.pop(model, None) is not None:
            log.warning(
                "model %s: the gateway's tokenizer (GATEWAY_TOKENIZERS) cut a prompt into %d "
                "tokens, the worker into %d: the worker is asked from now on",
                model, len(mine), len(theirs),
            )  # fmt: skip

    def _get(self, model: str, body: bytes, block_sizes: Collection[int]) -> PromptTokens | None:
        key = (model, hash(body))
        hit = self._cache.get(key)
        if hit is None or not hit.covers(block_sizes):
            return None
        self._cache.move_to_end(key)
        return hit

    def prefetch(
        self,
        spec: WorkerSpec,
        model: str,
        body: bytes,
        block_sizes: Collection[int],
        lead: PromptTokens | None = None,
    ) -> None:
        """Ask for ``body``'s tokens in the background, to be known for the next request.

        With ``lead``, the leading part used for this one: the answer must begin with it.
        At most a few at once; one already in flight is not asked again.
        """
        key = (model, hash(body))
        if key in self._asking or len(self._asking) >= _MAX_BACKGROUND:
            return
        task = asyncio.create_task(self._prefetch(spec, model, body, block_sizes, lead))
        self._asking[key] = task
        task.add_done_callback(lambda _: self._asking.pop(key, None))

    async def _prefetch(
        self,
        spec: WorkerSpec,
        model: str,
        body: bytes,
        block_sizes: Collection[int],
        lead: PromptTokens | None,
    ) -> None:
        found = await self.ask(spec, model, body, block_sizes)
        if found is not None and lead is not None and not found.starts(lead):
            if model not in self._not_composing:
                log.warning(
                    "model %s: an earlier turn's tokens do not begin the next turn's: its chat "
                    "template is not read turn by turn (each prompt is asked whole)", model,
                )  # fmt: skip
            self._not_composing.add(model)

    async def close(self) -> None:
        """Cancel the asks running in the background."""
        tasks = [*self._asking.values(), *self._checking]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def ask(
        self, spec: WorkerSpec, model: str, body: bytes, block_sizes: Collection[int]
    ) -> PromptTokens | None:
        """Ask the worker of ``spec`` for the tokens of ``body``'s prompt; None if it failed.

        The answer's keys are kept for the next request with the same prompt.
        """
        url = urlsplit(f"{spec.base_url}/tokenize")
        tls = url.scheme == "https"
        port = url.port or (443 if tls else 80)
        head = _HEAD % (url.path.encode(), url.netloc.encode(), len(body))
        if spec.api_key:
            head += b"authorization: Bearer %s\r\n" % spec.api_key.encode("latin-1")
        data = [head + b"\r\n" + body]
        try:
            async with asyncio.timeout(self._timeout_s):
                response = await self._wire.request(
                    url.hostname or "localhost", port, tls, lambda: data
                )
                try:
                    raw = await response.read(_MAX_ANSWER)
                    ok = response.status == 200 and response.complete
                finally:
                    response.close()
            if not ok:
                raise ValueError(f"status {response.status}")
            tokens = _decode(raw).tokens
        except (TimeoutError, WireError, ValueError, msgspec.DecodeError) as exc:
            log.debug("tokenizing a prompt on %s failed: %r", spec.label, exc)
            return None
        found = PromptTokens(tokens, block_sizes)
        self._keep((model, hash(body)), found)
        return found

    def _keep(self, key: tuple[str, int], tokens: PromptTokens) -> None:
        cache = self._cache
        old = cache.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes()
        size = tokens.nbytes()
        if size > self._cap:
            return
        cache[key] = tokens
        self._bytes += size
        while self._bytes > self._cap:
            _, dropped = cache.popitem(last=False)
            self._bytes -= dropped.nbytes()


def _local_ids(local: LocalTokenizer, asked: dict[str, Any]) -> list[int] | None:
    """``asked``'s prompt (a /tokenize body) tokenized by ``local``; None: not here."""
    if "messages" in asked:
        return local.chat(asked)
    prompt = asked.get("prompt")
    if not isinstance(prompt, str):
        return None
    return local.completion(prompt, bool(asked.get("add_special_tokens", True)))


def _render(asked: dict[str, Any]) -> bytes:
    return json.dumps(asked, ensure_ascii=False, separators=(",", ":")).encode()


# Background asks at once, at most: each is a /tokenize on a worker.
_MAX_BACKGROUND: Final = 8
# Prompts per model the gateway tokenized that are also asked of a worker, to compare.
_LOCAL_CHECKS: Final = 3
# A request body larger than this is tokenized off the event loop (a thread hop costs less
# than encoding a few thousand new characters: about a microsecond per token).
_INLINE_CHARS: Final = 4096
_HEAD: Final = (
    b"POST %s HTTP/1.1\r\nhost: %s\r\naccept-encoding: identity\r\n"
    b"content-type: application/json\r\ncontent-length: %d\r\n"
)
# An answer of a million tokens' ids, at most: more is not a tokenizer's answer.
_MAX_ANSWER: Final = 8 * 2**20

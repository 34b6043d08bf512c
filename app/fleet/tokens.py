"""A prompt's tokens as the worker renders them, for routing on its KV cache events.

A worker's events name its cached blocks by the token ids they hold
(:mod:`app.fleet.kvindex`), so a request's prompt must be cut into the same tokens: the chat
template applied, the tools rendered, special tokens added, exactly as the worker will. Only
the worker knows all that for sure, so the worker is asked (vLLM's ``/tokenize``, which takes a
chat request's ``messages``, ``tools`` and template arguments, or a completion's ``prompt``).
A prompt given as token ids needs no asking.

Answers are cached by the rendered request, least recently used dropped first, within a memory
cap: a prompt sent again (a benchmark's, a retried request, the same question to a shared
system prompt) costs a hash and a lookup. A prompt with parts that are not text (images,
audio) is not asked for: such blocks are keyed by more than their tokens, and routing keeps to
the approximate index for it.
"""

from __future__ import annotations

import json
import logging
import sys
from array import array
from collections import OrderedDict
from typing import Any, Final

import httpx

from app.api.protocol import Endpoint, ParsedRequest
from app.fleet.kvindex import chain
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
    """A prompt's token ids, and its block keys per block size (computed once each)."""

    __slots__ = ("_chains", "tokens")

    def __init__(self, tokens: array[int]) -> None:
        self.tokens = tokens
        self._chains: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def blocks(self, block_size: int) -> list[int]:
        """The key of each whole block of ``block_size`` tokens (:func:`.kvindex.chain`)."""
        keys = self._chains.get(block_size)
        if keys is None:
            keys = self._chains[block_size] = chain(self.tokens, block_size)
        return keys

    def nbytes(self) -> int:
        """Memory held, the chains to come included: fixed, for the cache's count to hold.

        A chain is a key of about 40 bytes a block: at 16 tokens a block, under a third of the
        tokens' 8 bytes each.
        """
        return sys.getsizeof(self.tokens) * 3 // 2 + 64


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


def given_tokens(request: ParsedRequest) -> array[int] | None:
    """A completion's prompt given as token ids (the first, of several): no asking needed."""
    if request.endpoint is not Endpoint.COMPLETIONS:
        return None
    prompt = request.body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return _tokens(prompt)
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


def _tokens(ids: list[Any]) -> array[int] | None:
    try:
        return array("l", ids)
    except (TypeError, OverflowError):
        return None


class Tokenizer:
    """Asks workers for prompts' tokens, and keeps the answers within ``cache_bytes``."""

    def __init__(self, client: httpx.AsyncClient, timeout_s: float, cache_bytes: int) -> None:
        self._client = client
        self._timeout_s = timeout_s
        self._cap = cache_bytes
        self._cache: OrderedDict[tuple[str, int], PromptTokens] = OrderedDict()
        self._bytes = 0

    @property
    def cached_bytes(self) -> int:
        """Memory the cache holds."""
        return self._bytes

    def cached(self, request: ParsedRequest) -> tuple[PromptTokens | None, bytes | None]:
        """The tokens of ``request``'s prompt if known now, else what to ask the worker.

        ``(tokens, None)``: known (given as ids, or cached); ``(None, body)``: ask ``body``;
        ``(None, None)``: this prompt is not asked for.
        """
        given = given_tokens(request)
        if given is not None:
            return PromptTokens(given), None
        asked = tokenize_body(request)
        if asked is None:
            return None, None
        body = json.dumps(asked, ensure_ascii=False, separators=(",", ":")).encode()
        key = (request.model, hash(body))
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit, None
        return None, body

    async def ask(self, spec: WorkerSpec, model: str, body: bytes) -> PromptTokens | None:
        """Ask the worker of ``spec`` for the tokens of ``body``'s prompt; None if it failed."""
        headers = {"content-type": "application/json"}
        if spec.api_key:
            headers["authorization"] = f"Bearer {spec.api_key}"
        try:
            response = await self._client.post(
                f"{spec.base_url}/tokenize", content=body, headers=headers, timeout=self._timeout_s
            )
            response.raise_for_status()
            ids = response.json().get("tokens")
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            log.debug("tokenizing a prompt on %s failed: %r", spec.label, exc)
            return None
        tokens = _tokens(ids) if isinstance(ids, list) else None
        if tokens is None:
            return None
        found = PromptTokens(tokens)
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

"""An approximate index of the prompt prefixes each worker has recently been sent.

A vLLM worker keeps the KV cache of the prompts it has served and skips the prefill of any
prefix it still holds. The ``prefix_aware`` routing policy (:mod:`app.fleet.routing`) estimates, for
each worker, how much of a request's prompt that worker has recently seen, from what this
gateway routed there; no worker is asked.

A prompt is read as text (:func:`prompt_text`): for chat, each message's role and text in
order; for completions, the prompt. The text is cut into blocks of :data:`BLOCK_CHARS`
characters, and each block's hash is chained to all the blocks before it
(:func:`prompt_prefix`), so one hash stands for a whole prefix and two prompts share a block
hash only where they share everything up to the end of that block. The last, partial block
is left out.

Each worker's :class:`PrefixIndex` holds the block hashes of prompts routed to it; the least
recently used are dropped first. A prompt's blocks are stored together, so a prefix is always
at least as recent as anything that extends it: the blocks held are always whole prefixes, and
the longest match is found by binary search (a handful of lookups for any prompt length).

Nothing here tokenizes. Matched characters become tokens at the request's own ratio of
estimated prompt tokens to characters.
"""

from __future__ import annotations

import sys
from typing import Any, Final

from app.api.protocol import Endpoint, ParsedRequest

BLOCK_CHARS: Final = 256
"""Characters per block, about 50-80 tokens: fine enough that a match misses at most a block of
a prefix thousands of tokens long, coarse enough that a 16,000-character prompt costs only 62
hashes (vLLM's own cache blocks are 16 tokens on GPUs, 128 on CPUs)."""

_KEY_BYTES: Final = sys.getsizeof(1 << 62)
"""Memory of one block hash (an int object of 64 bits); the index holds one per entry."""

ENTRY_BYTES: Final = 100
"""Memory of one entry (its hash and a dict slot), measured with tracemalloc: 88 bytes at
100,000 entries. Used to turn the memory cap into a number of entries."""


class PromptPrefix:
    """A prompt cut into chained block hashes, and its length in characters."""

    __slots__ = ("blocks", "chars")

    def __init__(self, blocks: list[int], chars: int) -> None:
        self.blocks = blocks
        """Hash of each whole block, chained to every block before it."""
        self.chars = chars
        """Characters of the prompt's text (the partial last block included)."""


def prompt_text(endpoint: Endpoint, body: dict[str, Any]) -> str:
    """The text a worker's prompt is made of, in order, as far as it can be read cheaply.

    Chat: the names of the tools (chat templates put their schemas first), then each
    message's role and text. The text stops at the first part that is not text (an image,
    audio): what follows it cannot be compared without reading that part. Completions: the
    prompt, or the first of a list of prompts; token-id prompts give no text. Any other
    endpoint: none.
    """
    if endpoint is Endpoint.COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else ""
    if endpoint is not Endpoint.CHAT:
        return ""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ""
    parts: list[str] = []
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        parts.append("\x02tools")
        for tool in tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            parts.append(f"\x1f{name}" if isinstance(name, str) else "\x1f?")
    for message in messages:
        if not isinstance(message, dict):
            break
        role = message.get("role")
        # Separators no client types keep "ab" + "c" apart from "a" + "bc".
        parts.append(f"\x1e{role}\x1f" if isinstance(role, str) else "\x1e?\x1f")
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if not isinstance(text, str):
                    return "".join(parts)
                parts.append(text)
        elif content is not None:
            break
    return "".join(parts)


def prompt_prefix(request: ParsedRequest) -> PromptPrefix:
    """The request's prompt as chained block hashes, seeded with its model.

    Hashes are Python's own (randomised per process): the index lives in this process only.
    """
    text = prompt_text(request.endpoint, request.body)
    end = len(text) - BLOCK_CHARS + 1
    h = hash(request.model)
    blocks = [h := hash((h, text[i : i + BLOCK_CHARS])) for i in range(0, end, BLOCK_CHARS)]
    return PromptPrefix(blocks, len(text))


class PrefixIndex:
    """The block hashes of prompts recently routed to one worker, in generations.

    New and refreshed blocks go into the young generation; when it is full (half the cap), it
    becomes the old one, and the old one is dropped. What was used within the last half-cap of
    insertions is always remembered, up to a cap's worth: least recently used first, at the
    grain of a generation, for the price of one dict store per block (an ordered dict's
    per-entry bookkeeping cost four times as much). A prompt's blocks always go in together,
    so the index holds whole prefixes only and the longest match is found by binary search.
    """

    __slots__ = ("_dropped", "_old", "_young")

    def __init__(self) -> None:
        self._young: dict[int, None] = {}
        self._old: dict[int, None] = {}
        self._dropped: dict[int, None] = {}
        """The generation dropped last, freed a little at each insertion: freeing tens of
        thousands of entries at once would stall the event loop for milliseconds."""

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def __contains__(self, block: int) -> bool:
        return block in self._young or block in self._old

    def match(self, blocks: list[int]) -> int:
        """How many leading ``blocks`` the index holds: the longest prefix seen here."""
        young, old = self._young, self._old
        if not blocks or (blocks[0] not in young and blocks[0] not in old):
            return 0  # the common case on most workers: nothing shared at all
        lo, hi = 1, len(blocks)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            block = blocks[mid - 1]
            if block in young or block in old:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def add(self, blocks: list[int], cap: int) -> None:
        """Mark ``blocks`` as just seen, remembering at most ``cap`` blocks.

        The memory held is at most one and a half times the cap's worth (the dropped generation
        until it is freed). Of a prompt longer than half the cap, its first half-cap blocks are
        kept.
        """
        half = max(1, cap // 2)
        blocks = blocks[:half]
        young = self._young
        if len(young) + len(blocks) > half:
            self._dropped = self._old
            self._old = young
            self._young = young = {}
        young.update(dict.fromkeys(blocks))
        # Twice as many freed as stored: the dropped generation is gone before the next drop.
        dropped = self._dropped
        for _ in range(min(len(dropped), 2 * len(blocks))):
            dropped.popitem()

    def clear(self) -> None:
        """Forget everything (the worker restarted: its cache is empty)."""
        self._young, self._old, self._dropped = {}, {}, {}

    def nbytes(self) -> int:
        """Memory held by the index: its tables and its keys, the dropped ones not yet freed."""
        tables = (self._young, self._old, self._dropped)
        return sum(sys.getsizeof(t) + len(t) * _KEY_BYTES for t in tables)

"""The KV cache blocks a worker holds, as its own KV cache events tell them.

A vLLM worker started with ``--kv-events-config`` publishes what its prefix cache stores and
evicts (:mod:`app.fleet.kvevents` follows them). A stored block comes with the token ids it
holds and the worker's hash of it, chained to its parent block's. The worker's hashes cannot be
recomputed here (their algorithm, seed and extra keys are the engine's), so each block is
keyed by the gateway's own chain instead: the hash of its parent's key and its own tokens
(:func:`chain`). A prompt's tokens, cut into the same blocks, then give the keys to look up,
and one key stands for a whole prefix: two prompts share a block's key only where they share
every token up to its end.

The index keeps, per worker hash, the key it stands for, and per key how many of the worker's
blocks hold it. A block keyed by more than its tokens (a LoRA adapter, an image, a cache salt:
the event's ``extra_keys``), or whose parent was never seen, is kept unkeyed, as are its
descendants: no prompt matches them.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from typing import Final

ROOT: Final = hash(("goodput-gateway", "kv-block"))
"""The key a prompt's first block is chained to."""

BlockHash = int | bytes
"""A worker's own hash of a block (vLLM sends a 64-bit integer or bytes)."""

_UNSEEN: Final = object()

ENTRY_BYTES: Final = 200
"""Memory of one block in the index (two dict slots, a worker hash and a key), measured with
tracemalloc: about 180 bytes at 100,000 blocks."""


def chain(tokens: Sequence[int], block_size: int) -> list[int]:
    """The key of each whole block of ``tokens``, chained to every block before it.

    The last, partial block is left out: a worker caches whole blocks only.
    """
    key = ROOT
    keys: list[int] = []
    append = keys.append
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = hash((key, tuple(tokens[start : start + block_size])))
        append(key)
    return keys


class KVIndex:
    """What one worker's prefix cache holds, block by block, from its events.

    ``complete``: every event since the worker's cache was last empty has been applied, so a
    block not here is not cached there. An index that missed events (it started following a
    running worker whose history is gone, or lost events it could not replay) is not complete
    until the worker's cache is emptied again. At most ``max_blocks`` are held: past that, events
    were lost (a worker holds at most its cache's blocks) and the index starts over, incomplete.
    """

    __slots__ = ("_held", "_keys", "_routed", "block_size", "complete", "max_blocks")

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.complete = False
        self.block_size: int | None = None
        """The worker's block size in tokens, from its events (None until the first)."""
        self._keys: dict[BlockHash, int | None] = {}
        self._held: dict[int, int] = {}
        self._routed: dict[int, float] = {}
        """Keys of prompts just routed to the worker, and until when they count as held."""

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._held

    def stored(
        self,
        hashes: Sequence[BlockHash],
        parent: BlockHash | None,
        tokens: Sequence[int],
        block_size: int,
        extra_keys: Sequence[object] | None = None,
    ) -> None:
        """The worker cached ``hashes``, consecutive blocks of ``tokens`` after ``parent``."""
        if block_size <= 0:
            return
        self.block_size = block_size
        key: int | None
        if parent is None:
            key = ROOT
        else:
            known = self._keys.get(parent, _UNSEEN)
            key = None if known is _UNSEEN else known  # type: ignore[assignment]
        keys, held = self._keys, self._held
        for i, block_hash in enumerate(hashes):
            block = tokens[i * block_size : (i + 1) * block_size]
            if key is None or len(block) != block_size or (extra_keys and extra_keys[i]):
                key = None
            else:
                key = hash((key, tuple(block)))
            if block_hash in keys:
                continue  # stored again without an eviction between: already counted
            keys[block_hash] = key
            if key is not None:
                held[key] = held.get(key, 0) + 1
                self._routed.pop(key, None)  # its event came: from now on the index says
        if len(keys) > self.max_blocks:
            self.clear()
            self.complete = False

    def removed(self, hashes: Iterable[BlockHash]) -> None:
        """The worker evicted ``hashes``."""
        keys, held = self._keys, self._held
        for block_hash in hashes:
            key = keys.pop(block_hash, None)
            if key is None:
                continue
            count = held[key] - 1
            if count:
                held[key] = count
            else:
                del held[key]

    def clear(self) -> None:
        """Forget every block (the worker's cache was emptied, or the index is rebuilt)."""
        self._keys = {}
        self._held = {}
        self._routed = {}

    def routed(self, keys: Sequence[int], until: float) -> None:
        """A prompt of ``keys`` was just sent to the worker: read them as held until ``until``.

        Its blocks are cached once its prefill runs, and their events come after that; until
        then (or ``until``) the next prompt sharing its prefix is still routed after it. At
        most ``max_blocks`` keys are kept, the oldest dropped first.
        """
        routed = self._routed
        held = self._held
        for key in keys:
            if key not in held:
                routed.pop(key, None)  # re-inserted last: the newest
                routed[key] = until
        for _ in range(len(routed) - self.max_blocks):
            del routed[next(iter(routed))]

    def match(self, keys: Sequence[int], now: float) -> int:
        """How many leading ``keys`` the worker holds (or was sent a moment before ``now``)."""
        held, routed = self._held, self._routed
        matched = 0
        for key in keys:
            if key not in held and routed.get(key, -math.inf) < now:
                break
            matched += 1
        return matched

    def nbytes(self) -> int:
        """Memory held: the two tables and their entries' keys."""
        tables = (self._keys, self._held, self._routed)
        entries = len(self._keys) + len(self._routed)
        return sum(sys.getsizeof(t) for t in tables) + entries * 2 * sys.getsizeof(1 << 62)

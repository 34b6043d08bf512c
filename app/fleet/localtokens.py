"""A model's prompts tokenized in the gateway, from the model's own tokenizer files.

Routing on a worker's KV cache events needs a prompt's tokens as the worker will cut them
(:mod:`app.fleet.tokens`). Asking the worker's ``/tokenize`` costs the worker: on a CPU worker
the API server tokenizes on the core its engine decodes on, and those asks slowed its decode
(docs/routing.md). With the model's ``tokenizer.json`` and ``tokenizer_config.json`` at hand
(``GATEWAY_TOKENIZERS``), the gateway renders and tokenizes the prompt itself, as vLLM does
through transformers: the chat template rendered by Jinja with transformers' environment and
variables, the text encoded by the same Rust tokenizer.

Only what can be rendered exactly is taken: chat messages of text, with the generation prompt
and template arguments; a completion's text prompt. Tools, documents, a chat template of the
request's own or a continued final message are asked of the worker, as before. A rendered
chat prompt is encoded piece by piece between its special tokens, each piece's ids kept
(least recently used dropped first, within a memory cap), so the turns of a conversation and
a shared system prompt are encoded once; the pieces are checked against a whole encoding on
the first prompts and given up for the model if they ever differ.
"""

from __future__ import annotations

import datetime
import json
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer

# What a chat request may carry for the template to be rendered here.
_CHAT_KEYS: Final = frozenset(
    {"model", "messages", "add_generation_prompt", "add_special_tokens", "chat_template_kwargs"}
)
_MESSAGE_KEYS: Final = frozenset({"role", "content", "name"})
_SPECIAL_NAMES: Final = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token")
# Whole encodings the pieces are checked against before they are trusted alone.
_CHECKS: Final = 4
# A template that loops over a message's content takes it as a list of parts (vLLM's
# "openai" content format); any other takes a string, parts joined by newlines.
_LOOPS_OVER_CONTENT: Final = re.compile(
    r"\{%-?\s*for\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]|\.content)"
)


class TokenizerFilesError(ValueError):
    """A model's tokenizer files are missing or cannot be read."""


class LocalTokenizer:
    """Renders and tokenizes one model's prompts in the gateway (rules in the module's text).

    :meth:`chat` and :meth:`completion` return the token ids, or None for a request that must
    be asked of the worker. ``cache_bytes`` caps the ids kept per piece of rendered text.
    """

    def __init__(self, directory: Path, cache_bytes: int = 8 * 2**20) -> None:
        try:
            self._rust = RustTokenizer.from_file(str(directory / "tokenizer.json"))
            config = json.loads((directory / "tokenizer_config.json").read_text())
        except Exception as exc:  # OSError, ValueError, or the tokenizer's own Exception
            raise TokenizerFilesError(f"{directory}: {exc}") from exc
        if not isinstance(config, dict):
            raise TokenizerFilesError(f"{directory}: tokenizer_config.json is not an object")
        template = _chat_template(config, directory)
        self._specials = _special_tokens(config)
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = None if template is None else env.from_string(template)
        except TemplateError as exc:
            raise TokenizerFilesError(f"{directory}: its chat template: {exc}") from exc
        self._parts = template is not None and _LOOPS_OVER_CONTENT.search(template) is not None
        added = {t.content: i for i, t in self._rust.get_added_tokens_decoder().items()}
        self._added = added
        names = sorted(added, key=len, reverse=True)
        self._split = re.compile("|".join(re.escape(n) for n in names)) if names else None
        # Ids kept as 4-byte arrays: a list holds 36 bytes a token (its pointer and the int).
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        self._lock = threading.Lock()  # the event loop's thread and one helper thread use it
        self._cap = cache_bytes
        self._bytes = 0
        self._checks = _CHECKS
        self.pieces = self._split is not None
        """Whether chat prompts are encoded piece by piece (until a check finds a difference)."""

    @property
    def cached_bytes(self) -> int:
        """Memory the pieces' ids hold."""
        return self._bytes

    def render(self, body: Mapping[str, Any]) -> str | None:
        """The chat prompt's text as the worker's template renders it; None: not here."""
        if self._template is None or not _CHAT_KEYS.issuperset(body):
            return None
        messages = body.get("messages")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(messages, list) or not isinstance(kwargs, dict):
            return None
        conversation = []
        for message in messages:
            turn = self._message(message)
            if turn is None:
                return None
            conversation.append(turn)
        variables = {
            **self._specials,
            **kwargs,
            "messages": conversation,
            "tools": None,
            "documents": None,
            "add_generation_prompt": body.get("add_generation_prompt", True),
        }
        try:
            return self._template.render(**variables)
        except (TemplateError, TypeError, ValueError, LookupError, AttributeError):
            # A template's own raise_exception, or its expressions failing on these messages:
            # the worker answers it, with its own error; routing never fails for it.
            return None

    def _message(self, message: Any) -> dict[str, Any] | None:
        if not isinstance(message, dict) or not _MESSAGE_KEYS.issuperset(message):
            return None
        content = message.get("content")
        if isinstance(content, str):
            texts = [content]
        elif isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            texts = [p["text"] for p in content]
        else:
            return None
        turn = dict(message)
        if self._parts:
            turn["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            turn["content"] = "\n".join(texts)
        return turn

    def chat(self, body: Mapping[str, Any]) -> list[int] | None:
        """The chat request's prompt ids, as the worker would tokenize it; None: not here."""
        text = self.render(body)
        if text is None:
            return None
        special = body.get("add_special_tokens", False)
        if special or not self.pieces:
            return self.encode(text, special=bool(special))
        ids = self._by_pieces(text)
        if self._checks > 0:
            self._checks -= 1
            if ids != self.encode(text, special=False):
                self.pieces = False
                return self.encode(text, special=False)
        return ids

    def completion(self, prompt: str, special: bool = True) -> list[int]:
        """A completion's text prompt's ids (special tokens added, as vLLM does by default)."""
        return self.encode(prompt, special=special)

    def encode(self, text: str, special: bool) -> list[int]:
        """``text`` encoded whole.

        By the tokenizer's ``encode_batch_fast``: the same ids as ``encode``, without the
        characters' offsets (23-47% less CPU at the lengths measured, 20 to 16,000
        characters), and it lets go of the GIL: a caller in another thread leaves the event
        loop running meanwhile.
        """
        ids: list[int] = self._rust.encode_batch_fast([text], add_special_tokens=special)[0].ids
        return ids

    def _by_pieces(self, text: str) -> list[int]:
        split = self._split
        assert split is not None
        out: list[int] = []
        start = 0
        for match in split.finditer(text):
            if match.start() > start:
                out += self._piece(text[start : match.start()])
            out.append(self._added[match.group()])
            start = match.end()
        if start < len(text):
            out += self._piece(text[start:])
        return out

    def _piece(self, text: str) -> Sequence[int]:
        cache = self._cache
        with self._lock:
            found = cache.get(text)
            if found is not None:
                cache.move_to_end(text)
                return found
        ids = array("I", self.encode(text, special=False))
        size = _size(text, ids)
        if size > self._cap:
            return ids
        with self._lock:
            if text not in cache:
                cache[text] = ids
                self._bytes += size
            while self._bytes > self._cap:
                old, dropped = cache.popitem(last=False)
                self._bytes -= _size(old, dropped)
        return ids


def _size(text: str, ids: array[int]) -> int:
    """Memory a cached piece holds: its text, its ids and the cache's entry."""
    return sys.getsizeof(text) + sys.getsizeof(ids) + 100


def load_tokenizers(directories: Mapping[str, Path], cache_bytes: int) -> dict[str, LocalTokenizer]:
    """One :class:`LocalTokenizer` per model, from ``GATEWAY_TOKENIZERS``' directories."""
    return {model: LocalTokenizer(path, cache_bytes) for model, path in directories.items()}


def _chat_template(config: Mapping[str, Any], directory: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    return template if isinstance(template, str) else None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, Any]:
    """The special tokens' strings a template sees (transformers' ``special_tokens_map``)."""
    found: dict[str, Any] = {}
    for name in _SPECIAL_NAMES:
        value = _token_text(config.get(name))
        if value is not None:
            found[name] = value
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        found["additional_special_tokens"] = [
            t for t in (_token_text(v) for v in extra) if t is not None
        ]
    return found


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: Sequence[str] | None = None, sort_keys: bool = False,
) -> str:  # fmt: skip
    # transformers' own filter: Jinja's would escape HTML characters.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent,
        separators=None if separators is None else (separators[0], separators[1]),
        sort_keys=sort_keys,
    )  # fmt: skip


def _raise(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


__all__ = ["LocalTokenizer", "TokenizerFilesError", "load_tokenizers"]

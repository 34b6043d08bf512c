"""Server-sent events from a worker: cut the byte stream into whole events and classify them.

This runs once per network read of every stream, so it scans bytes instead of parsing JSON:
only the usage chunk (once per request) is decoded. The patterns below are safe on vLLM's JSON
because generated text is JSON-escaped: a quote inside a string value is always ``\\"``, so
``"content":"`` can only match a real key.
"""

from __future__ import annotations

import json
import re
from enum import IntEnum
from typing import Any

# An event carries output when a text field is a non-empty string or tool calls start. The
# role-only opening chunk (``"content":""``) and a bare finish chunk (``"delta":{}``) do not.
_OUTPUT = re.compile(
    rb'"(?:content|text|reasoning_content|reasoning)":\s*"[^"]|"tool_calls":\s*\[\s*\{'
)
_EMPTY_CHOICES = re.compile(rb'"choices":\s*\[\s*\]')
_ERROR = re.compile(rb'^data:\s*\{\s*"error"|"object":\s*"error"')
_DONE = re.compile(rb"^data:\s*\[DONE\]")
# The Responses API's events: only ``response.*.delta`` events have a ``delta``, and one that
# is a non-empty string carries output (text, reasoning, a function call's arguments, ...).
_RESPONSE_OUTPUT = re.compile(rb'"delta":\s*"[^"]')
_RESPONSE_END = re.compile(rb'"type":\s*"response\.(?:completed|incomplete)"')
_RESPONSE_ERROR = re.compile(rb'"type":\s*"(?:response\.failed|error)"')


class EventKind(IntEnum):
    """What an SSE event means to the gateway."""

    OTHER = 0
    """Carries no output: the role-only opening chunk, a finish-only chunk, a comment."""
    OUTPUT = 1
    """Carries generated text or tool calls."""
    USAGE = 2
    """The usage-only chunk (``"choices":[]`` with ``usage``) sent before ``[DONE]``."""
    DONE = 3
    """``data: [DONE]``, the normal end of a stream."""
    ERROR = 4
    """An in-band error sent by the worker."""


def classify(event: bytes) -> EventKind:
    """Classify one whole event by scanning its bytes."""
    # vLLM writes compact JSON, so a token chunk's text key is found by a plain byte search,
    # three times faster than the pattern, which covers every other spelling and key.
    at = event.find(b'"content":"')
    end = at + 11
    if at < 0:
        at = event.find(b'"text":"')
        end = at + 8
    if at >= 0 and event[end : end + 1] != b'"':
        return EventKind.OUTPUT
    if _OUTPUT.search(event) is not None:
        return EventKind.OUTPUT
    if _DONE.match(event) is not None:
        return EventKind.DONE
    if b'"usage"' in event and _EMPTY_CHOICES.search(event) is not None:
        return EventKind.USAGE
    if _ERROR.search(event) is not None:
        return EventKind.ERROR
    return EventKind.OTHER


def classify_response(event: bytes) -> EventKind:
    """Classify one whole event of a Responses API stream by scanning its bytes.

    ``response.completed`` and ``response.incomplete`` (``max_output_tokens`` reached) end the
    stream and carry its usage: they are :attr:`EventKind.DONE`. ``response.failed`` and
    ``error`` are :attr:`EventKind.ERROR`.
    """
    if _RESPONSE_OUTPUT.search(event) is not None:
        return EventKind.OUTPUT
    if _RESPONSE_END.search(event) is not None:
        return EventKind.DONE
    if _RESPONSE_ERROR.search(event) is not None:
        return EventKind.ERROR
    return EventKind.OTHER


def event_data(event: bytes) -> bytes:
    """The payload of an event's ``data:`` lines, joined by newlines as the SSE spec says."""
    parts = []
    for line in event.splitlines():
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(parts)


def event_json(event: bytes) -> Any:
    """The decoded JSON payload of an event, or None if it is not JSON."""
    try:
        return json.loads(event_data(event))
    except ValueError:
        return None


# vLLM's usage and fingerprint as it writes them (compact, its keys in this order): read by a
# scan, which costs a tenth of decoding the chunk. Any other spelling is decoded.
_USAGE = re.compile(
    rb'"usage":\{"prompt_tokens":(\d+),"total_tokens":\d+,"completion_tokens":(\d+)[,}]'
)
_FINGERPRINT = re.compile(rb'"system_fingerprint":(?:"([^"\\]*)"|null)[,}]')


def parse_usage(event: bytes) -> tuple[int, int] | None:
    """``(prompt_tokens, completion_tokens)`` from a usage chunk, or None if it has none."""
    found = _USAGE.search(event)
    if found is not None:
        return int(found[1]), int(found[2])
    return usage_counts(event_json(event))


def event_fingerprint(event: bytes) -> bytes:
    """:func:`fingerprint_member` of an event's payload, found by a scan where it can be."""
    at = event.find(b'"system_fingerprint":')
    if at < 0:  # JSON escaping keeps the key from appearing inside any string
        return b""
    found = _FINGERPRINT.match(event, at)
    if found is None:
        return fingerprint_member(event_json(event))
    value = found[1]
    return b"" if value is None else b',"system_fingerprint":"' + value + b'"'


# A chunk that ends a choice: its finish reason is a string, not null.
FINISH = b'"finish_reason":"'


def fingerprint_member(payload: Any) -> bytes:
    """``,"system_fingerprint":"..."`` as vLLM writes it, from a chunk or response carrying it.

    Empty when the worker sends no fingerprint (vLLM's ``--fingerprint-mode none``).
    """
    value = payload.get("system_fingerprint") if isinstance(payload, dict) else None
    if not isinstance(value, str):
        return b""
    return b',"system_fingerprint":' + json.dumps(value, ensure_ascii=False).encode()


def with_fingerprint(event: bytes, member: bytes) -> bytes:
    """A finish chunk as vLLM sends it when no usage chunk follows: with the fingerprint last.

    vLLM (0.32) stamps ``system_fingerprint`` on each choice's finish chunk only when the
    client did not ask for ``include_usage``; otherwise the usage chunk carries it instead.
    """
    if not member or b'"system_fingerprint"' in event:
        return event
    end = event.rfind(b"}")
    return event[:end] + member + event[end:]


_CACHED = re.compile(rb'"cached_tokens":\s*(\d+)')


def cached_tokens(event: bytes) -> int | None:
    """The prompt tokens the worker found in its prefix cache, as a usage chunk's details say.

    vLLM tells them (``usage.prompt_tokens_details.cached_tokens``, the Responses API's
    ``input_tokens_details``) only when started with ``--enable-prompt-tokens-details``; None
    when the event does not. Found by a scan: JSON escaping keeps the key out of any string.
    """
    if b'"cached_tokens"' not in event:
        return None
    found = _CACHED.search(event)
    return None if found is None else int(found[1])


def usage_cached(payload: Any) -> int | None:
    """:func:`cached_tokens` of a decoded response, chunk or event (None: not told)."""
    usage = _usage(payload)
    if usage is None:
        return None
    details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def usage_counts(payload: Any) -> tuple[int, int] | None:
    """``(prompt_tokens, completion_tokens)`` from a decoded response, chunk or event.

    Reads chat and completions' ``prompt_tokens``/``completion_tokens``, the Responses API's
    ``input_tokens``/``output_tokens`` (also inside a ``response.completed`` event's
    ``response``), and a prefill-only answer's ``prompt_tokens`` alone (rerank sends no
    ``completion_tokens``: none were generated).
    """
    usage = _usage(payload)
    if usage is None:
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return prompt, completion


def _usage(payload: Any) -> dict[str, Any] | None:
    """A decoded answer's ``usage``, or the Responses API's inside its ``response``."""
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    if usage is None and isinstance(payload.get("response"), dict):
        usage = payload["response"].get("usage")
    return usage if isinstance(usage, dict) else None


class EventSplitter:
    """Cuts a stream of network reads into whole events, never merging or splitting them.

    ``feed`` returns the events completed by this read, each with its terminating blank line;
    a partial event is held until the rest of it arrives. The terminator is ``\\n\\n``, or
    ``\\r\\n\\r\\n`` when the stream's first line ends in CRLF.
    """

    __slots__ = ("_pending", "_sep")

    def __init__(self) -> None:
        self._pending = b""
        self._sep: bytes | None = None

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet terminated (what is left if the stream ends now)."""
        return self._pending

    def feed(self, data: bytes) -> list[bytes]:
        """Add one network read; return the events it completed, in order."""
        buf = self._pending + data if self._pending else data
        sep = self._sep
        if sep is None:
            newline = buf.find(b"\n")
            if newline < 0:
                self._pending = buf
                return []
            sep = self._sep = b"\r\n\r\n" if buf[newline - 1 : newline] == b"\r" else b"\n\n"
        end = buf.find(sep)
        if end < 0:
            self._pending = buf
            return []
        cut = end + len(sep)
        if cut == len(buf):  # the usual case: exactly one whole event in this read
            self._pending = b""
            return [buf]
        events = []
        start = 0
        while end >= 0:
            events.append(buf[start:cut])
            start = cut
            end = buf.find(sep, start)
            cut = end + len(sep)
        self._pending = buf[start:]
        return events

"""The SSE splitter and classifier, on byte streams cut every possible way."""

from __future__ import annotations

import pytest

from app.api.sse import (
    EventKind,
    EventSplitter,
    cached_tokens,
    classify,
    event_data,
    event_fingerprint,
    event_json,
    fingerprint_member,
    parse_usage,
    usage_cached,
    usage_counts,
)

ROLE = (
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":'
    b'[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    b'"finish_reason":null}]}\n\n'
)
TOKEN = (
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":'
    b'[{"index":0,"delta":{"content":" hi"},"logprobs":null,"finish_reason":null}]}\n\n'
)
QUOTE_TOKEN = (
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":'
    b'[{"index":0,"delta":{"content":"\\"content\\":\\""},"finish_reason":null}]}\n\n'
)
FINISH = (
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":'
    b'[{"index":0,"delta":{},"logprobs":null,"finish_reason":"length"}]}\n\n'
)
USAGE = (
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
    b'"usage":{"prompt_tokens":7,"total_tokens":12,"completion_tokens":5}}\n\n'
)
TEXT = (
    b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"x",'
    b'"logprobs":null,"finish_reason":null}]}\n\n'
)
EMPTY_TEXT = b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"","finish_reason":"stop"}]}\n\n'
TOOL = (
    b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"t",'
    b'"function":{"name":"f","arguments":""}}]}}]}\n\n'
)
ERROR = b'data: {"error": {"message": "boom", "type": "server_error", "code": 500}}\n\n'
OLD_ERROR = b'data: {"object":"error","message":"boom","type":"BadRequestError","code":400}\n\n'
DONE = b"data: [DONE]\n\n"
STREAM = [ROLE, TOKEN, TOKEN, FINISH, USAGE, DONE]


@pytest.mark.parametrize(
    ("event", "kind"),
    [
        (ROLE, EventKind.OTHER),
        (TOKEN, EventKind.OUTPUT),
        (QUOTE_TOKEN, EventKind.OUTPUT),
        (FINISH, EventKind.OTHER),
        (USAGE, EventKind.USAGE),
        (TEXT, EventKind.OUTPUT),
        (EMPTY_TEXT, EventKind.OTHER),
        (TOOL, EventKind.OUTPUT),
        (ERROR, EventKind.ERROR),
        (OLD_ERROR, EventKind.ERROR),
        (DONE, EventKind.DONE),
        (b": keep-alive\n\n", EventKind.OTHER),
        (b'data: {"choices": [{"delta": {"content": "spaced"}}]}\n\n', EventKind.OUTPUT),
        # The empty content the byte search finds first is not the end of the scan.
        (
            b'data: {"choices":[{"delta":{"content":"","reasoning_content":"r"}}]}\n\n',
            EventKind.OUTPUT,
        ),
    ],
)
def test_classify(event: bytes, kind: EventKind) -> None:
    assert classify(event) is kind


def test_escaped_key_in_text_is_not_output() -> None:
    # The generated text spells a key, but JSON escaping keeps it from matching.
    event = b'data: {"choices":[{"delta":{"content":""},"x":"\\"content\\":\\"y\\""}]}\n\n'
    assert classify(event) is EventKind.OTHER


def test_usage_is_parsed_once_from_the_usage_chunk() -> None:
    assert parse_usage(USAGE) == (7, 5)
    assert parse_usage(TOKEN) is None
    assert parse_usage(b"data: not json\n\n") is None


_USAGE_HEAD = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[],'


@pytest.mark.parametrize(
    "event",
    [
        USAGE,
        _USAGE_HEAD + b'"usage":{"prompt_tokens":10,"total_tokens":16,"completion_tokens":6,'
        b'"prompt_tokens_details":null},"system_fingerprint":"vllm-0.32.0-0a6f2450"}\n\n',
        _USAGE_HEAD + b'"usage":{"prompt_tokens":3,"total_tokens":3,"completion_tokens":0},'
        b'"system_fingerprint":null}\n\n',
        # Spellings the scan does not read: decoded instead.
        _USAGE_HEAD + b'"usage": {"completion_tokens": 2, "prompt_tokens": 4},'
        b' "system_fingerprint": "fp 1"}\n\n',
        _USAGE_HEAD + b'"usage":{"prompt_tokens":4,"total_tokens":6,"completion_tokens":2},'
        b'"system_fingerprint":"f\\"p\\u00e9"}\n\n',
        _USAGE_HEAD + b'"usage":{"prompt_tokens":4,"completion_tokens":2},'
        b'"system_fingerprint":"f\xc3\xa9"}\n\n',
        b'data: {"choices":[],"usage":null}\n\n',
        b"data: not json\n\n",
        TOKEN,
    ],
)
def test_the_usage_chunk_s_scan_reads_what_decoding_it_does(event: bytes) -> None:
    payload = event_json(event)
    assert parse_usage(event) == usage_counts(payload)
    assert event_fingerprint(event) == fingerprint_member(payload)


@pytest.mark.parametrize(
    ("event", "cached"),
    [
        # vLLM with --enable-prompt-tokens-details (0.32: exclude_none, these keys in order).
        (
            _USAGE_HEAD + b'"usage":{"prompt_tokens":900,"total_tokens":902,"completion_tokens":2,'
            b'"prompt_tokens_details":{"cached_tokens":768}}}\n\n',
            768,
        ),
        (
            _USAGE_HEAD + b'"usage":{"prompt_tokens":9,"total_tokens":11,"completion_tokens":2,'
            b'"prompt_tokens_details":{"cached_tokens":0,"created_cache_tokens":9}}}\n\n',
            0,
        ),
        # The Responses API's usage, at the end of its stream.
        (
            b'data: {"type":"response.completed","response":{"usage":{"input_tokens":5,'
            b'"output_tokens":2,"input_tokens_details":{"cached_tokens":4}}}}\n\n',
            4,
        ),
        # Not told: no details, details of nothing, or only the text spells the key.
        (USAGE, None),
        (
            _USAGE_HEAD + b'"usage":{"prompt_tokens":10,"total_tokens":16,"completion_tokens":6,'
            b'"prompt_tokens_details":null}}\n\n',
            None,
        ),
        (b'data: {"choices":[{"delta":{"content":"\\"cached_tokens\\":3"}}]}\n\n', None),
    ],
)
def test_the_cached_tokens_scan_reads_what_decoding_the_usage_does(
    event: bytes, cached: int | None
) -> None:
    assert cached_tokens(event) == cached
    assert usage_cached(event_json(event)) == cached


def test_vllm_s_usage_chunk_is_read_without_decoding_it() -> None:
    # Cut short, so that decoding it fails: what is read was read by the scan.
    cut = _USAGE_HEAD + b'"usage":{"prompt_tokens":7,"total_tokens":12,"completion_tokens":5},'
    assert parse_usage(cut) == (7, 5)
    assert event_fingerprint(cut + b'"system_fingerprint":"fp-1",') == (
        b',"system_fingerprint":"fp-1"'
    )


def test_event_data_joins_multiline_data() -> None:
    assert event_data(b"event: x\ndata: a\ndata:b\n\n") == b"a\nb"


def test_one_event_per_read_is_passed_through_unchanged() -> None:
    splitter = EventSplitter()
    for event in STREAM:
        out = splitter.feed(event)
        assert out == [event]
        assert out[0] is event  # no copy on the common path
    assert splitter.pending == b""


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 50, 97, 200, 1000])
def test_any_cutting_yields_the_same_whole_events(cut: int) -> None:
    stream = b"".join(STREAM)
    splitter = EventSplitter()
    events: list[bytes] = []
    for i in range(0, len(stream), cut):
        events.extend(splitter.feed(stream[i : i + cut]))
    assert events == STREAM
    assert splitter.pending == b""


def test_events_that_arrive_together_stay_separate_and_whole() -> None:
    splitter = EventSplitter()
    assert splitter.feed(ROLE + TOKEN + TOKEN[:10]) == [ROLE, TOKEN]
    assert splitter.pending == TOKEN[:10]
    assert splitter.feed(TOKEN[10:]) == [TOKEN]


def test_crlf_streams_are_split_on_crlf_blank_lines() -> None:
    a, b = b"data: 1\r\n\r\n", b"data: 2\r\n\r\n"
    splitter = EventSplitter()
    assert splitter.feed(a[:4]) == []
    assert splitter.feed(a[4:] + b) == [a, b]

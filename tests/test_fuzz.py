"""Property-based: whatever a client sends, the answer is a served request or a 4xx in OpenAI's
error shape, never a 5xx (the worker here always answers)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from starlette.testclient import TestClient

from app.api.errors import InvalidRequest
from app.api.protocol import (
    PLAIN_FIELDS,
    Endpoint,
    ParsedRequest,
    declared_values,
    endpoint_fields,
    parse_request,
    plain_values,
)
from app.gateway import create_app
from tests.fake_upstream import MODEL, FakeWorker
from tests.servers import settings_for
from tests.test_gateway_fake import _ok
from tests.wire_bridge import bridge

WORKER = "http://fake-worker:8100"

# JSON values with the edge cases that broke decoders: huge and negative integers, floats,
# lone surrogates, deep nesting, unicode.
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(["\ud800", "\udfff", "\U0001f600", MODEL, "", "0", "4"])
)
_json = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
_fields = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from([MODEL]) | _json,
        "messages": st.just([{"role": "user", "content": "hi"}]) | _json,
        "prompt": st.just("hi") | _json,
        "stream": st.booleans() | _json,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": _json}) | _json,
        "max_tokens": st.integers(min_value=-5, max_value=10**500) | _json,
        "max_completion_tokens": _json,
        "user": _json,
        "n": _json,
    },
)


def _body(fields: dict[str, Any]) -> bytes:
    # ensure_ascii escapes lone surrogates as \ud800, as a JSON client would send them.
    return json.dumps(fields).encode()


# The codes parse_request gives: a body that is not UTF-8, not a JSON object, or holds a lone
# surrogate; a field of the wrong type; chat without its messages.
_CODES = {
    "invalid_utf8",
    "invalid_json",
    "invalid_unicode",
    "invalid_type",
    "missing_required_parameter",
}


def _refusal(error: InvalidRequest) -> dict[str, Any]:
    """The error object the client is sent, read back from the error's own JSON."""
    # parse_request refuses as a 400; a subclass would mean a 404 or 413 for a body's content.
    assert type(error) is InvalidRequest, type(error)
    body = json.loads(error.to_json())
    assert set(body) == {"error"}
    refusal: dict[str, Any] = body["error"]
    assert set(refusal) == {"message", "type", "param", "code"}
    assert refusal["type"] == "invalid_request_error"
    assert refusal["code"] in _CODES, refusal
    assert isinstance(refusal["message"], str)
    assert refusal["message"].strip()
    assert refusal["param"] is None or isinstance(refusal["param"], str)
    return refusal


def _encodes(value: Any) -> bool:
    """Whether a decoded JSON value encodes back to UTF-8 (no lone surrogate in it)."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


@settings(max_examples=400, deadline=None)
@given(fields=_fields, endpoint=st.sampled_from(list(Endpoint)))
def test_any_request_object_parses_or_is_an_invalid_request(
    fields: dict[str, Any], endpoint: Endpoint
) -> None:
    result = _parse(endpoint, _body(fields))
    if endpoint is Endpoint.CHAT and not isinstance(fields.get("messages"), list):
        assert isinstance(result, InvalidRequest), "chat without a messages list was accepted"
    if not _encodes(fields):
        assert isinstance(result, InvalidRequest), "a lone surrogate was accepted"
    if isinstance(result, InvalidRequest):
        refusal = _refusal(result)
        if refusal["code"] == "missing_required_parameter":
            assert (endpoint, refusal["param"]) == (Endpoint.CHAT, "messages")
            assert "messages" not in fields
        elif refusal["code"] == "invalid_type":
            # The param named is one the client sent (``stream_options.include_usage``, say).
            assert refusal["param"] is not None
            assert refusal["param"].split(".")[0] in fields, (refusal, fields)
        else:  # the body is a JSON object: only a lone surrogate is refused as a whole
            assert refusal["code"] == "invalid_unicode"
            assert not _encodes(fields)
        return
    # Accepted: the worker is sent the client's request; only stream_options may be added to.
    assert result.endpoint is endpoint
    assert result.model == (fields.get("model") or "")
    upstream = json.loads(result.upstream_body())
    if endpoint is Endpoint.CHAT:
        assert upstream["messages"] == fields["messages"]
    if result.stream and not result.wants_usage:
        # The gateway asks for the final usage chunk (and never the per-chunk usage).
        asked = {**(fields.get("stream_options") or {}), "include_usage": True}
        asked.pop("continuous_usage_stats", None)
        assert upstream.pop("stream_options") == asked
        fields = {k: v for k, v in fields.items() if k != "stream_options"}
    assert upstream == fields


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200))
@example(raw=b"\xff{}")
@example(raw=b"{")
@example(raw=b"[1]")
@example(raw=b'{"messages": [], "x": "\\ud800"}')
@example(raw=b'{"model": 4}')
@example(raw=b"{}")
@example(raw=b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
def test_any_bytes_parse_or_are_an_invalid_request(raw: bytes) -> None:
    result = _parse(Endpoint.CHAT, raw)
    # What a reader of the bytes finds, worked out here without the parser.
    try:
        decoded: Any = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        expected = "invalid_utf8"
    except ValueError:  # not JSON (or a number too long to read)
        expected = "invalid_json"
    else:
        if not _encodes(decoded):
            expected = "invalid_unicode"
        elif not isinstance(decoded, dict):
            expected = "invalid_json"
        else:
            expected = "the fields' check"
    if isinstance(result, InvalidRequest):
        code = _refusal(result)["code"]
        if expected == "the fields' check":
            assert code in {"invalid_type", "missing_required_parameter"}
        else:
            assert code == expected
    else:
        assert expected == "the fields' check", f"accepted bytes that are {expected}"
        assert isinstance(decoded.get("messages"), list), "chat without a messages list"
        assert result.model == (decoded.get("model") or "")
        assert json.loads(result.upstream_body())["messages"] == decoded["messages"]


def _parse(endpoint: Endpoint, raw: bytes) -> ParsedRequest | InvalidRequest:
    """The parsed request, or the error it was refused with (any other exception escapes)."""
    try:
        return parse_request(endpoint, raw)
    except InvalidRequest as error:
        return error


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    transport = FakeWorker(_ok).transport
    app = create_app(settings_for(WORKER), transport=transport, connector=bridge(transport))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(fields=_fields, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_the_running_app_answers_every_body_without_a_5xx(
    client: TestClient, fields: dict[str, Any], path: str
) -> None:
    fields = {**fields, "stream": False} if fields.get("stream") is True else fields
    response = client.post(path, content=_body(fields))
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["code"], str)


def _read(request: ParsedRequest) -> tuple[Any, ...]:
    return (
        request.model, request.user, request.stream, request.max_tokens, request.n,
        request.wants_usage,
    )  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(fields=_fields, endpoint=st.sampled_from([e for e in Endpoint if not e.form]))
def test_well_typed_fields_read_without_the_model_as_the_model_reads_them(
    fields: dict[str, Any], endpoint: Endpoint
) -> None:
    """Whatever parse_request accepts, by the fast path or not, the model reads the same."""
    model = endpoint_fields(endpoint)
    assert set(model.model_fields) <= set(PLAIN_FIELDS)  # every field read has its check
    raw = _body(fields)
    try:
        fast = parse_request(endpoint, raw)
    except InvalidRequest:
        return  # refused: test_any_request_object_parses_or_is_an_invalid_request's case
    try:
        slow = ParsedRequest(endpoint, fields, declared_values(model.model_validate(fields)), raw)
    except ValidationError as exc:
        raise AssertionError(f"accepted what the model refuses: {exc}") from exc
    assert _read(fast) == _read(slow)


@pytest.mark.parametrize(
    ("fields", "plain"),
    [
        ({"model": MODEL, "messages": [], "stream": True, "max_tokens": 4, "n": 2}, True),
        ({"model": MODEL, "messages": [], "stream_options": {"include_usage": True}}, True),
        ({"model": MODEL, "messages": [], "max_tokens": "4"}, False),  # coerced by the model
        ({"model": MODEL, "messages": [], "max_tokens": 4.0}, False),
        ({"model": MODEL, "messages": [], "stream": 1}, False),
        ({"model": MODEL}, False),  # messages missing: the model's error
    ],
)
def test_only_plain_json_types_skip_the_model(fields: dict[str, Any], plain: bool) -> None:
    assert (plain_values(endpoint_fields(Endpoint.CHAT), fields) is not None) is plain


def test_what_the_gateway_adds_goes_in_front_of_the_clients_own_bytes() -> None:
    raw = b' {"model" :"m",  "messages":[], "stream":true}'
    request = parse_request(Endpoint.CHAT, raw)
    usage = b'"stream_options":{"include_usage":true},'
    assert request.upstream_body() == b" {" + usage + raw[2:]
    assert request.upstream_body(-1) == b" {" + usage + b'"priority":-1,' + raw[2:]
    # A member the client sent is changed where it is: the body is encoded again.
    own = parse_request(Endpoint.CHAT, b'{"messages":[],"stream":true,"priority":-5}')
    assert own.upstream_body(-1) == (
        b'{"messages":[],"stream":true,"priority":-1,"stream_options":{"include_usage":true}}'
    )  # the client's -5 would go ahead of its tier's -1
    assert own.upstream_body(-9) == b'{"stream_options":{"include_usage":true},' + own.raw[1:]

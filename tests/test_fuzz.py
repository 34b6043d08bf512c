"""Property-based: whatever a client sends, the answer is a served request or a 4xx in OpenAI's
error shape, never a 5xx (the worker here always answers)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from app.app import create_app
from app.errors import InvalidRequest
from app.protocol import Endpoint, ParsedRequest, parse_request
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


@settings(max_examples=400, deadline=None)
@given(fields=_fields, endpoint=st.sampled_from(list(Endpoint)))
def test_any_request_object_parses_or_is_an_invalid_request(
    fields: dict[str, Any], endpoint: Endpoint
) -> None:
    result = _parse(endpoint, _body(fields))
    if isinstance(result, InvalidRequest):
        assert result.status_code == 400
        assert isinstance(result.code, str)
    else:
        json.loads(result.upstream_body())  # what goes to the worker is JSON it can read


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200))
def test_any_bytes_parse_or_are_an_invalid_request(raw: bytes) -> None:
    result = _parse(Endpoint.CHAT, raw)
    assert not isinstance(result, InvalidRequest) or result.status_code == 400


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

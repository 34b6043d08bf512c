"""Request models of the OpenAI API, as far as the gateway needs to check them.

The models validate types and required fields only; unknown fields (vLLM extensions such as
``ignore_eos`` or ``top_k``) are allowed, and the body forwarded to the worker is the client's own
JSON, not a re-serialisation of these models.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from app.errors import InvalidRequest


class Endpoint(StrEnum):
    """The generation endpoints the gateway relays; the value is the metrics label."""

    CHAT = "chat"
    COMPLETIONS = "completions"

    @property
    def path(self) -> str:
        """The worker path for this endpoint."""
        return "/v1/chat/completions" if self is Endpoint.CHAT else "/v1/completions"


# Token counts beyond any context window (vLLM's limits are int32): a 400, never an overflow.
TokenCount = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]
# A JSON \u escape of a UTF-16 surrogate: the only way a decoded body can hold text that does
# not encode back to UTF-8 (a lone surrogate), which the worker's request would then fail on.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class StreamOptions(BaseModel):
    """``stream_options``: the gateway reads ``include_usage`` and keeps everything else."""

    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool | None = None


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    user: StrictStr | None = None


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


_MODELS: dict[Endpoint, type[_GenerationRequest]] = {
    Endpoint.CHAT: ChatCompletionRequest,
    Endpoint.COMPLETIONS: CompletionRequest,
}


class ParsedRequest:
    """A validated generation request: the client's JSON plus the fields the gateway uses."""

    __slots__ = ("body", "endpoint", "max_tokens", "model", "size", "stream", "user", "wants_usage")

    def __init__(
        self, endpoint: Endpoint, body: dict[str, Any], fields: _GenerationRequest, size: int
    ):
        self.endpoint = endpoint
        self.body = body
        self.size = size
        self.user = fields.user
        self.max_tokens = fields.max_completion_tokens or fields.max_tokens
        self.model = fields.model
        self.stream = bool(fields.stream)
        opts = fields.stream_options
        self.wants_usage = bool(opts is not None and opts.include_usage)

    def upstream_body(self) -> bytes:
        """The body to send the worker: the client's JSON, asking for usage when streaming.

        The gateway needs ``usage`` to count tokens; when the client did not ask for it, the
        relay drops the usage-only chunk so the client sees what vLLM would have sent it.
        """
        body = self.body
        if self.stream and not self.wants_usage:
            opts = dict(body.get("stream_options") or {})
            opts["include_usage"] = True
            body = {**body, "stream_options": opts}
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def parse_request(endpoint: Endpoint, raw: bytes) -> ParsedRequest:
    """Decode and check a request body; raise :class:`InvalidRequest` with the offending param."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(
            f"Request body is not valid UTF-8 (byte {exc.start}).", code="invalid_utf8"
        ) from exc
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"Request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno}).",
            code="invalid_json",
        ) from exc
    except RecursionError as exc:
        raise InvalidRequest(
            "Request body is nested too deeply to be read.", code="invalid_json"
        ) from exc
    except ValueError as exc:  # a number too long to convert (Python's int digit limit)
        raise InvalidRequest(
            f"Request body has a number out of range: {exc}.", code="invalid_json"
        ) from exc
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError as exc:
            raise InvalidRequest(
                "Request body has a lone UTF-16 surrogate escape (\\ud800-\\udfff) that is no "
                "character.",
                code="invalid_unicode",
            ) from exc
    if not isinstance(body, dict):
        raise InvalidRequest("Request body must be a JSON object.", code="invalid_json")
    try:
        fields = _MODELS[endpoint].model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from exc
    return ParsedRequest(endpoint, body, fields, len(raw))


def _validation_error(exc: ValidationError) -> InvalidRequest:
    first = exc.errors(include_url=False)[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "missing":
        return InvalidRequest(
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    return InvalidRequest(
        f"Invalid type for '{param}': {first['msg']}.", param=param, code="invalid_type"
    )

"""Request models of the OpenAI API, as far as the gateway needs to read them.

The gateway reads only the fields it acts on (``model``, ``stream``, ``stream_options``,
``max_tokens``, ``max_completion_tokens``, ``n``, ``user``) and checks that chat requests carry a
``messages`` list; everything else is the worker's to judge. The fields are typed as vLLM types
them (``vllm/entrypoints/openai/*/protocol.py``, pydantic's default lax mode), so the gateway
accepts whatever vLLM accepts: ``"max_tokens": 4.0`` or ``"4"``, ``"stream": "false"`` or ``0``,
``"include_usage": "yes"``, and a missing ``model`` (see :meth:`app.routing.Router.default_model`).
Unknown fields (vLLM extensions such as ``ignore_eos`` or ``top_k``) are allowed, and the body
forwarded to the worker is the client's own bytes, changed only as
:meth:`ParsedRequest.upstream_body` says.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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
# Lax like vLLM's ``int``: 4, 4.0 and "4" are all 4; 4.5 and "four" are not.
TokenCount = Annotated[int, Field(ge=0, le=2**31 - 1)]
# vLLM bounds its integer fields to int64 or less; beyond that no worker accepts them either.
_Count = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# A JSON \u escape of a UTF-16 surrogate: the only way a decoded body can hold text that does
# not encode back to UTF-8 (a lone surrogate), which the worker's request would then fail on.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class StreamOptions(BaseModel):
    """``stream_options``: the two flags that decide which chunks carry ``usage``."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    # vLLM serves its first model when ``model`` is missing, null or empty.
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    n: _Count | None = 1
    user: str | None = None


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[Any]


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions`` (vLLM also takes ``prompt_embeds`` instead of ``prompt``)."""


_MODELS: dict[Endpoint, type[_GenerationRequest]] = {
    Endpoint.CHAT: ChatCompletionRequest,
    Endpoint.COMPLETIONS: CompletionRequest,
}


class ParsedRequest:
    """A validated generation request: the client's JSON plus the fields the gateway uses.

    ``model`` is empty when the client named none; the route fills in the default.
    """

    __slots__ = (
        "body", "endpoint", "max_tokens", "model", "n", "raw", "size", "stream", "user",
        "wants_usage",
    )  # fmt: skip

    def __init__(
        self, endpoint: Endpoint, body: dict[str, Any], fields: _GenerationRequest, raw: bytes
    ):
        self.endpoint = endpoint
        self.body = body
        self.raw = raw
        self.size = len(raw)
        self.user = fields.user
        self.max_tokens = fields.max_completion_tokens or fields.max_tokens
        self.n = max(1, fields.n or 1)
        self.model = fields.model or ""
        self.stream = bool(fields.stream)
        opts = fields.stream_options
        self.wants_usage = bool(opts is not None and opts.include_usage)

    def upstream_body(self) -> bytes:
        """The body to send the worker: the client's own bytes, unless usage must be asked for.

        The gateway needs ``usage`` to count tokens. When a streaming client did not ask for it,
        the worker is asked for the final usage chunk only (``include_usage``, and never
        ``continuous_usage_stats``, which vLLM honours only together with ``include_usage``);
        the relay then gives the client the stream vLLM would have sent it
        (:mod:`app.relay`).
        """
        if not self.stream or self.wants_usage:
            return self.raw
        opts = dict(self.body.get("stream_options") or {})
        opts["include_usage"] = True
        opts.pop("continuous_usage_stats", None)
        body = {**self.body, "stream_options": opts}
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
    return ParsedRequest(endpoint, body, fields, raw)


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

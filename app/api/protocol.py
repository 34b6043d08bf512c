"""The endpoints the gateway relays by model, and the request fields it reads from each.

Every endpoint is described once, in :data:`_SPECS`: the paths it answers (vLLM's aliases
included), what it costs a worker (:class:`Cost`: a prefill and a decode, a prefill alone, or
nothing of the engine's), how its streamed output events are recognised (:class:`Events`), and
its body's format. The routes, the relay, admission's ticket and the recorder read these
properties; no endpoint has a handler of its own.

The gateway reads only the fields it acts on (``model``, ``stream``, ``stream_options``,
``max_tokens``, ``max_completion_tokens``, ``max_output_tokens``, ``n``, ``user``) and checks
that chat requests carry a ``messages`` list; everything else is the worker's to judge. The
fields are typed as vLLM types them (``vllm/entrypoints/openai/*/protocol.py``, pydantic's
default lax mode), so the gateway accepts whatever vLLM accepts: ``"max_tokens": 4.0`` or
``"4"``, ``"stream": "false"`` or ``0``, ``"include_usage": "yes"``, and a missing ``model``
(see :meth:`app.fleet.routing.Router.default_model`). Unknown fields (vLLM extensions such as
``ignore_eos`` or ``top_k``) are allowed, and the body forwarded to the worker is the client's
own bytes, changed only as :meth:`ParsedRequest.upstream_body` says.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from app.api.errors import InvalidRequest


class Cost(Enum):
    """What a request of an endpoint costs a worker's engine, as admission counts it."""

    DECODE = "decode"
    """A prefill, then a decode of up to ``max_tokens``: the generation endpoints."""
    PREFILL = "prefill"
    """A prefill and no decode: embeddings, score, rerank, pooling."""
    NONE = "none"
    """No engine work: the worker's tokenizer answers. Not admitted, queued or SLO-judged."""


class Events(Enum):
    """How a streamed answer's events are read (:mod:`app.api.sse`)."""

    CHAT = "chat"
    """OpenAI chunks (``choices[].delta``), a usage chunk, then ``data: [DONE]``."""
    RESPONSES = "responses"
    """The Responses API's typed events; output is a ``response.*.delta``, and the stream ends
    with ``response.completed`` (or ``incomplete``), which carries the usage."""


class Endpoint(StrEnum):
    """The endpoints the gateway relays by model; the value is the metrics label."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    RESPONSES = "responses"
    EMBEDDINGS = "embeddings"
    SCORE = "score"
    RERANK = "rerank"
    POOLING = "pooling"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    TRANSCRIPTIONS = "transcriptions"

    @property
    def path(self) -> str:
        """The endpoint's main path (the worker is sent the path the client used)."""
        return _SPECS[self].paths[0]

    @property
    def paths(self) -> tuple[str, ...]:
        """Every path of the endpoint: the main one, then vLLM's aliases."""
        return _SPECS[self].paths

    @property
    def cost(self) -> Cost:
        """What one request costs the worker's engine."""
        return _SPECS[self].cost

    @property
    def events(self) -> Events:
        """How its streamed events are recognised (only read when a request streams)."""
        return _SPECS[self].events

    @property
    def form(self) -> bool:
        """Whether its body is ``multipart/form-data`` (an upload) rather than JSON."""
        return _SPECS[self].form

    @property
    def judged(self) -> bool:
        """Whether its requests count towards the tiers' SLOs (``gateway_slo_requests_total``).

        Everything the engine works on: generation is judged on TTFT and TPOT (or its whole
        latency against the budget they allow), a prefill-only request on its whole latency
        against the TTFT target. The tokenizer's answers are not.
        """
        return _SPECS[self].cost is not Cost.NONE

    @property
    def prioritised(self) -> bool:
        """Whether vLLM reads a ``priority`` from its requests: every JSON engine endpoint."""
        spec = _SPECS[self]
        return not spec.form and spec.cost is not Cost.NONE

    @property
    def chunks(self) -> bool:
        """Whether its answers are chat or text completions (``system_fingerprint``, usage)."""
        return self is Endpoint.CHAT or self is Endpoint.COMPLETIONS


# Token counts beyond any context window (vLLM's limits are int32): a 400, never an overflow.
# Lax like vLLM's ``int``: 4, 4.0 and "4" are all 4; 4.5 and "four" are not.
TokenCount = Annotated[int, Field(ge=0, le=2**31 - 1)]
# vLLM bounds its integer fields to int64 or less; beyond that no worker accepts them either.
_Count = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
_PRIORITY: TypeAdapter[int] = TypeAdapter(_Count)
# A JSON \u escape of a UTF-16 surrogate: the only way a decoded body can hold text that does
# not encode back to UTF-8 (a lone surrogate), which the worker's request would then fail on.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class StreamOptions(BaseModel):
    """``stream_options``: the two flags that decide which chunks carry ``usage``."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Fields(BaseModel):
    """The fields every relayed request may carry."""

    model_config = ConfigDict(extra="allow")

    # vLLM serves its first model when ``model`` is missing, null or empty.
    model: str | None = None
    user: str | None = None


class _GenerationRequest(_Fields):
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    n: _Count | None = 1


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[Any]


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions`` (vLLM also takes ``prompt_embeds`` instead of ``prompt``)."""


class ResponsesRequest(_Fields):
    """``POST /v1/responses`` (its usage always comes with the answer: nothing is added)."""

    stream: bool | None = False
    max_output_tokens: TokenCount | None = None


class PoolingRequest(_Fields):
    """Embeddings, score, rerank, pooling, tokenize, detokenize: never streamed."""


class TranscriptionRequest(_Fields):
    """``POST /v1/audio/transcriptions``: its form's text fields (strings, read laxly)."""

    stream: bool | None = False


@dataclass(frozen=True, slots=True)
class _Spec:
    paths: tuple[str, ...]
    cost: Cost
    fields: type[_Fields]
    events: Events = Events.CHAT
    form: bool = False


# vLLM 0.32 serves score at /score and /v1/score, rerank at /rerank, /v1/rerank and /v2/rerank.
_SPECS: dict[Endpoint, _Spec] = {
    Endpoint.CHAT: _Spec(("/v1/chat/completions",), Cost.DECODE, ChatCompletionRequest),
    Endpoint.COMPLETIONS: _Spec(("/v1/completions",), Cost.DECODE, CompletionRequest),
    Endpoint.RESPONSES: _Spec(
        ("/v1/responses",), Cost.DECODE, ResponsesRequest, events=Events.RESPONSES
    ),
    Endpoint.EMBEDDINGS: _Spec(("/v1/embeddings",), Cost.PREFILL, PoolingRequest),
    Endpoint.SCORE: _Spec(("/v1/score", "/score"), Cost.PREFILL, PoolingRequest),
    Endpoint.RERANK: _Spec(("/v1/rerank", "/rerank", "/v2/rerank"), Cost.PREFILL, PoolingRequest),
    Endpoint.POOLING: _Spec(("/pooling",), Cost.PREFILL, PoolingRequest),
    Endpoint.TOKENIZE: _Spec(("/tokenize",), Cost.NONE, PoolingRequest),
    Endpoint.DETOKENIZE: _Spec(("/detokenize",), Cost.NONE, PoolingRequest),
    # Speech to text decodes text (streamed like chat chunks); its prompt is audio, which the
    # gateway does not size (:attr:`ParsedRequest.size` counts the form's text fields only).
    Endpoint.TRANSCRIPTIONS: _Spec(
        ("/v1/audio/transcriptions",), Cost.DECODE, TranscriptionRequest, form=True
    ),
}

ENDPOINT_PATHS: dict[str, Endpoint] = {
    path: endpoint for endpoint in Endpoint for path in endpoint.paths
}
"""Every path the gateway relays by model (``POST``), to its endpoint."""


class Upload:
    """A ``multipart/form-data`` body as the client sent it: its chunks, kept once, in order.

    Held (not joined) so that it is in memory once, and can be sent again on failover.
    """

    __slots__ = ("chunks", "content_type", "size")

    def __init__(self, chunks: list[bytes], content_type: str) -> None:
        self.chunks = chunks
        self.content_type = content_type
        self.size = sum(len(chunk) for chunk in chunks)


# Made once: json.dumps builds an encoder on every call given any option.
_COMPACT = json.JSONEncoder(separators=(",", ":"))
_COMPACT_UTF8 = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


@functools.lru_cache(maxsize=64)  # one entry per tier's priority, twice at most
def _added_members(usage: bool, priority: int | None) -> bytes:
    """The members :meth:`ParsedRequest.upstream_body` puts in front of a body lacking them."""
    changes: dict[str, Any] = {}
    if usage:
        changes["stream_options"] = {"include_usage": True}
    if priority is not None:
        changes["priority"] = priority
    return _COMPACT.encode(changes).encode()[1:-1]


class ParsedRequest:
    """A validated request: the client's body plus the fields the gateway uses.

    ``model`` is empty when the client named none; the route fills in the default. ``path`` is
    the path the client used (one of the endpoint's), which the worker is sent too.
    """

    __slots__ = (
        "body", "endpoint", "max_tokens", "model", "n", "path", "raw", "size", "stream",
        "upload", "user", "wants_usage",
    )  # fmt: skip

    def __init__(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        fields: Mapping[str, Any],
        raw: bytes,
        path: str | None = None,
        upload: Upload | None = None,
    ):
        """Read ``fields``: the declared fields' values (:func:`declared_values`).

        A field missing from ``fields`` reads as None.
        """
        self.endpoint = endpoint
        self.path = path or endpoint.path
        self.body = body
        self.raw = raw
        self.upload = upload
        # What the prompt's size is estimated from: the JSON body, or an upload's text fields.
        self.size = len(raw)
        get = fields.get
        self.user: str | None = get("user")
        self.model: str = get("model") or ""
        self.stream = bool(get("stream"))
        self.max_tokens: int | None = (
            get("max_completion_tokens") or get("max_tokens") or get("max_output_tokens")
        )
        self.n: int = max(1, get("n") or 1)
        # Only chat and text completions are asked for a usage chunk the client did not want;
        # every other stream goes to the client exactly as the worker sent it.
        self.wants_usage = not endpoint.chunks or bool(get("stream_options"))

    def upstream_body(self, priority: int | None = None) -> bytes:
        """The body to send the worker: the client's own bytes, unless something must change.

        The gateway needs ``usage`` to count tokens. When a streaming client did not ask for it,
        the worker is asked for the final usage chunk only (``include_usage``, and never
        ``continuous_usage_stats``, which vLLM honours only together with ``include_usage``);
        the relay then gives the client the stream vLLM would have sent it
        (:mod:`app.relay.serve`). ``priority`` is vLLM's for the request's tier
        (:meth:`app.settings.Settings.worker_priority_of`; None: left as the client sent it):
        a client's own ``priority`` may put its request later, never earlier, as its
        ``x-gateway-tier`` may only lower its tier. An upload (:attr:`upload`) goes as it came.
        """
        usage = self.stream and not self.wants_usage
        if priority is not None and not (self.endpoint.prioritised and self._overrides(priority)):
            priority = None
        if not usage and priority is None:
            return self.raw
        body = self.body
        if not (usage and "stream_options" in body) and not (
            priority is not None and "priority" in body
        ):
            # Members the client did not send go in front of its own, its bytes kept: the
            # same object to any JSON reader, without encoding the whole body again.
            start = self.raw.index(b"{") + 1
            added = _added_members(usage, priority)
            return b"%b%b%b%b" % (self.raw[:start], added, b"," if body else b"", self.raw[start:])
        changes: dict[str, Any] = {}
        if usage:
            opts = dict(body.get("stream_options") or {})
            opts["include_usage"] = True
            opts.pop("continuous_usage_stats", None)
            changes["stream_options"] = opts
        if priority is not None:
            changes["priority"] = priority
        return _COMPACT_UTF8.encode({**body, **changes}).encode()

    def _overrides(self, priority: int) -> bool:
        """Whether the tier's ``priority`` replaces the client's own ``priority`` field.

        It does when the client sent none and the tier's is not vLLM's default 0, or sent one
        earlier than its tier's, read as vLLM reads it (``"-5"`` and ``-5.0`` are -5: no
        spelling goes ahead of the tier); one vLLM cannot read as an integer is left for its
        own 400.
        """
        own = self.body.get("priority")
        if own is None:
            return priority != 0
        try:
            return priority > _PRIORITY.validate_python(own)
        except ValidationError:
            return False


def declared_values(fields: BaseModel) -> dict[str, Any]:
    """The values of the fields ``fields``' model declares: what :class:`ParsedRequest` reads.

    Never a same-named extra field; ``stream_options`` as its ``include_usage`` flag.
    """
    values = {name: getattr(fields, name) for name in type(fields).model_fields}
    opts = values.get("stream_options")
    if isinstance(opts, StreamOptions):
        values["stream_options"] = opts.include_usage
    return values


def _is_text(value: Any) -> bool:
    return value is None or type(value) is str


def _is_flag(value: Any) -> bool:
    return value is None or value is True or value is False


def _is_tokens(value: Any) -> bool:
    return value is None or (type(value) is int and 0 <= value <= 2**31 - 1)


def _is_count(value: Any) -> bool:
    return value is None or (type(value) is int and -(2**63) <= value <= 2**63 - 1)


def _is_options(value: Any) -> bool:
    return value is None or (
        type(value) is dict
        and _is_flag(value.get("include_usage"))
        and _is_flag(value.get("continuous_usage_stats"))
    )


PLAIN_FIELDS: dict[str, Callable[[Any], bool]] = {
    "model": _is_text,
    "user": _is_text,
    "stream": _is_flag,
    "stream_options": _is_options,
    "max_tokens": _is_tokens,
    "max_completion_tokens": _is_tokens,
    "max_output_tokens": _is_tokens,
    "n": _is_count,
    "messages": lambda value: type(value) is list,
}
"""Per field the gateway reads, whether a decoded JSON value is of the one plain type its model
validates to itself (no coercion): such values are taken as they are, without the model."""


_PLAIN_CHECKS: dict[type[BaseModel], tuple[tuple[str, bool, Callable[[Any], bool]], ...]] = {}
"""Per model, its fields' names, whether each is required and its plain-type check (made on
first use: the models' fields do not change)."""


def plain_values(fields: type[BaseModel], body: dict[str, Any]) -> dict[str, Any] | None:
    """The declared fields' values when every one in ``body`` is plain, else None.

    The model would accept each as it is and return it unchanged, so reading them straight
    from the body is the same as validating (and skips validation's cost on every request of
    a well-typed client); anything else (a coercion such as ``"4"``, a wrong type, a missing
    required field) goes to the model, for its value or its error.
    """
    checks = _PLAIN_CHECKS.get(fields)
    if checks is None:
        checks = _PLAIN_CHECKS[fields] = tuple(
            (name, field.is_required(), PLAIN_FIELDS[name])
            for name, field in fields.model_fields.items()
        )
    values: dict[str, Any] = {}
    for name, required, plain in checks:
        value = body.get(name)
        if value is None and required:
            return None
        if not plain(value):
            return None
        values[name] = value
    opts = values.get("stream_options")
    if opts is not None:
        values["stream_options"] = opts.get("include_usage")
    return values


def parse_form(
    endpoint: Endpoint, fields: dict[str, str], upload: Upload, path: str
) -> ParsedRequest:
    """Check an upload's text fields (strings, read as vLLM's form model reads them)."""
    try:
        parsed = endpoint_fields(endpoint).model_validate(fields)
    except ValidationError as exc:
        raise _validation_error(exc) from exc
    text = sum(len(name) + len(value) for name, value in fields.items())
    request = ParsedRequest(endpoint, dict(fields), declared_values(parsed), b"", path, upload)
    request.size = text
    return request


def endpoint_fields(endpoint: Endpoint) -> type[_Fields]:
    """The model of the fields the gateway reads from ``endpoint``'s requests."""
    return _SPECS[endpoint].fields


SLO_TTFT_HEADERS = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
"""Headers carrying a request's own TTFT target in milliseconds (llm-d's name first)."""
SLO_TPOT_HEADERS = ("x-llm-d-slo-tpot-ms", "x-slo-tpot-ms")
"""Headers carrying a request's own TPOT target in milliseconds (llm-d's name first)."""
FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-fairness-id")
"""Headers naming whose share of its tier a request runs in (llm-d's name first)."""
_FAIRNESS_ID = re.compile(r"[!-~]{1,128}")
_MS = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,6})?")
_MAX_TARGET_MS = 3_600_000.0  # an hour: beyond it a target is no target


@dataclass(frozen=True, slots=True)
class SloTargets:
    """A request's own latency targets, in seconds (None: its tier's)."""

    ttft_s: float | None = None
    tpot_s: float | None = None


NO_TARGETS = SloTargets()


def slo_targets(header: Callable[[str], str | None]) -> SloTargets:
    """The targets a request sent in its SLO headers, read through ``header`` (name -> value).

    inference-perf sends ``x-slo-ttft-ms`` / ``x-slo-tpot-ms``; the llm-d router reads those
    and its own ``x-llm-d-slo-*``, which win when both are sent. A value is a positive
    decimal number of milliseconds, at most an hour; anything else is an
    :class:`InvalidRequest` naming the header.
    """
    ttft, tpot = _target(header, SLO_TTFT_HEADERS), _target(header, SLO_TPOT_HEADERS)
    if ttft is None and tpot is None:
        return NO_TARGETS  # the usual case: a frozen dataclass costs a call per field to make
    return SloTargets(ttft, tpot)


def _target(header: Callable[[str], str | None], names: tuple[str, ...]) -> float | None:
    for name in names:
        value = header(name)
        if value is None:
            continue
        text = value.strip()
        ms = float(text) if _MS.fullmatch(text) else math.nan
        if not 0 < ms <= _MAX_TARGET_MS:
            raise InvalidRequest(
                f"Invalid value for header '{name}': {value[:32]!r} is not a number of "
                f"milliseconds between 0 and {_MAX_TARGET_MS:,.0f}.",
                param=name,
                code="invalid_header_value",
            )
        return ms / 1000.0
    return None


def fairness_id(header: Callable[[str], str | None]) -> str | None:
    """The fairness id a request sent (:data:`FAIRNESS_HEADERS`), or None.

    1 to 128 visible ASCII characters; anything else is an :class:`InvalidRequest` naming the
    header. Whether the caller may set one is the authenticator's business.
    """
    for name in FAIRNESS_HEADERS:
        value = header(name)
        if value is None:
            continue
        text = value.strip()
        if not _FAIRNESS_ID.fullmatch(text):
            raise InvalidRequest(
                f"Invalid value for header '{name}': a fairness id is 1 to 128 visible ASCII "
                "characters.",
                param=name,
                code="invalid_header_value",
            )
        return text
    return None


def parse_request(endpoint: Endpoint, raw: bytes, path: str | None = None) -> ParsedRequest:
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
    model = _SPECS[endpoint].fields
    fields = plain_values(model, body)
    if fields is None:
        try:
            fields = declared_values(model.model_validate(body))
        except ValidationError as exc:
            raise _validation_error(exc) from exc
    return ParsedRequest(endpoint, body, fields, raw, path)


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

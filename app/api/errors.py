"""The gateway's exception tree, each class mapped to an OpenAI-shaped error and a status code.

Every error a client can see is one of these; the most specific class is raised ``from`` its
cause so logs keep the chain while clients get a clean message.
"""

from __future__ import annotations

import json
import math
from typing import Any, ClassVar

from app.api.outcome import Outcome, Reason


class GatewayError(Exception):
    """Base of every error the gateway reports to a client."""

    status_code: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None
    outcome: ClassVar[Outcome] = Outcome.UPSTREAM_ERROR

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code  # type: ignore[misc]

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, self.error_type, self.param, self.code)

    def to_json(self) -> bytes:
        """The error object serialised for a response body."""
        return json.dumps(self.to_dict()).encode()

    def headers(self) -> dict[str, str]:
        """Extra response headers (Retry-After and the like)."""
        return {}


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """Build an OpenAI-shaped error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class InvalidRequest(GatewayError):
    """The request itself is wrong: bad JSON, bad UTF-8, wrong types, missing fields."""

    status_code = 400
    error_type = "invalid_request_error"
    code = "invalid_request"
    outcome = Outcome.INVALID_REQUEST


class ModelNotFound(InvalidRequest):
    """No worker serves the requested model."""

    status_code = 404
    code = "model_not_found"


class BodyTooLarge(InvalidRequest):
    """The body is over ``max_body_bytes``; the gateway stopped reading it."""

    status_code = 413
    code = "request_too_large"


class ClientStalled(GatewayError):
    """The client sent its request, or read its answer, too slowly: never a worker's fault.

    The connection is closed after the answer (if one can still be sent).
    """

    status_code = 408
    error_type = "invalid_request_error"
    code = "request_timeout"
    outcome = Outcome.CLIENT_STALLED

    def headers(self) -> dict[str, str]:
        """Close the connection: the rest of a slow body is not worth reading."""
        return {"connection": "close"}


class InternalError(GatewayError):
    """A fault in the gateway's own code: logged with its traceback, answered 500."""

    code = "internal_error"
    outcome = Outcome.INTERNAL_ERROR


class UpstreamError(GatewayError):
    """Something went wrong between the gateway and a worker."""

    status_code = 502
    code = "upstream_error"


class UpstreamInvalidResponse(UpstreamError):
    """The worker answered with something that is not a valid OpenAI response."""

    code = "upstream_invalid_response"


class UpstreamStatusError(UpstreamError):
    """The worker answered with a 5xx status."""

    code = "upstream_status_error"


class UpstreamUnavailable(UpstreamError):
    """No worker for the model could be reached."""

    status_code = 503
    code = Reason.NO_WORKER.value


class UpstreamTimeout(UpstreamError):
    """A worker did not answer (or stopped streaming) within its timeout."""

    status_code = 504
    code = "upstream_timeout"
    outcome = Outcome.TIMEOUT


class UpstreamClientError(GatewayError):
    """The worker refused the request (a 4xx): passed to the client with the worker's message."""

    error_type = "invalid_request_error"
    outcome = Outcome.INVALID_REQUEST

    def __init__(self, status_code: int, body: dict[str, Any]):
        err = body["error"]
        super().__init__(str(err.get("message", "")), param=err.get("param"))
        self.status_code = status_code  # type: ignore[misc]
        self.body = body

    def to_dict(self) -> dict[str, Any]:
        """The worker's own error object, unchanged."""
        return self.body


class AuthenticationFailed(GatewayError):
    """No API key, or one the gateway does not know (the key is never echoed)."""

    status_code = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"
    outcome = Outcome.INVALID_REQUEST


class TierNotAllowed(GatewayError):
    """The client asked for a tier above its key's."""

    status_code = 403
    error_type = "permission_error"
    code = "tier_not_allowed"
    outcome = Outcome.INVALID_REQUEST


class _RetryLater(GatewayError):
    """An error that tells the client when to come back (Retry-After, in s and ms)."""

    outcome = Outcome.REJECTED
    reason: ClassVar[Reason] = Reason.NONE
    """What admission counts the refusal as (the error's code, unless one is given)."""

    def __init__(self, message: str, retry_after_s: float, *, reason: Reason | None = None):
        why = reason or self.reason
        super().__init__(message, code=None if why is Reason.NONE else why.value)
        if reason is not None:
            self.reason = reason  # type: ignore[misc]
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        """``retry-after`` (whole seconds, rounded up) and ``retry-after-ms`` (the SDKs use it)."""
        seconds = max(1, math.ceil(self.retry_after_s))
        return {
            "retry-after": str(seconds),
            "retry-after-ms": str(round(self.retry_after_s * 1000)),
        }


class RateLimited(_RetryLater):
    """A key's concurrency or tokens-per-minute limit is reached: the client's own limit."""

    status_code = 429
    error_type = "rate_limit_error"
    outcome = Outcome.RATE_LIMITED
    reason = Reason.KEY_QUOTA


class Overloaded(_RetryLater):
    """Admission refused the request: it could not meet its SLO now (``reason`` says why)."""

    status_code = 429
    error_type = "rate_limit_error"
    reason = Reason.DEADLINE_UNREACHABLE


class QueueTimeout(_RetryLater):
    """The request waited in the admission queue until its deadline passed."""

    status_code = 503
    error_type = "server_error"
    reason = Reason.QUEUE_TIMEOUT


class Shed(_RetryLater):
    """A sheddable request was dropped from the queue to make room for a more urgent one."""

    status_code = 503
    error_type = "server_error"
    reason = Reason.SHED

    def headers(self) -> dict[str, str]:
        """Retry-After plus a header saying the request was shed."""
        return {**super().headers(), "x-gateway-shed": "true"}


class GatewaySaturated(_RetryLater):
    """The gateway's own limit (its connections to the workers) is reached: answered at once.

    Never blamed on a worker: it does not count against the worker's health.
    """

    status_code = 503
    error_type = "server_error"
    code = "gateway_saturated"
    outcome = Outcome.GATEWAY_SATURATED


class GatewayShutdown(GatewayError):
    """The gateway is shutting down and its grace period for running requests is over."""

    status_code = 503
    error_type = "server_error"
    code = "gateway_shutdown"
    outcome = Outcome.GATEWAY_SHUTDOWN

    def headers(self) -> dict[str, str]:
        """Another replica can take the request at once."""
        return {"retry-after": "1", "retry-after-ms": "0"}

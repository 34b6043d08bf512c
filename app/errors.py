"""The gateway's exception tree, each class mapped to an OpenAI-shaped error and a status code.

Every error a client can see is one of these; the most specific class is raised ``from`` its
cause so logs keep the chain while clients get a clean message.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar


class GatewayError(Exception):
    """Base of every error the gateway reports to a client."""

    status_code: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None
    outcome: ClassVar[str] = "upstream_error"

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
    outcome = "invalid_request"


class ModelNotFound(InvalidRequest):
    """No worker serves the requested model."""

    status_code = 404
    code = "model_not_found"


class BodyTooLarge(InvalidRequest):
    """The body is over ``max_body_bytes``; the gateway stopped reading it."""

    status_code = 413
    code = "request_too_large"


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
    code = "no_worker_available"


class UpstreamTimeout(UpstreamError):
    """A worker did not answer (or stopped streaming) within its timeout."""

    status_code = 504
    code = "upstream_timeout"
    outcome = "timeout"


class UpstreamClientError(GatewayError):
    """The worker refused the request (a 4xx): passed to the client with the worker's message."""

    error_type = "invalid_request_error"
    outcome = "invalid_request"

    def __init__(self, status_code: int, body: dict[str, Any]):
        err = body["error"]
        super().__init__(str(err.get("message", "")), param=err.get("param"))
        self.status_code = status_code  # type: ignore[misc]
        self.body = body

    def to_dict(self) -> dict[str, Any]:
        """The worker's own error object, unchanged."""
        return self.body

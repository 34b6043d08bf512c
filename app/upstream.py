"""Talking to a worker: one shared httpx client, and errors mapped onto the gateway's tree.

The network sits behind httpx's transport seam: tests pass an ``httpx.MockTransport`` (or an
ASGI app) for failures a real worker cannot produce on demand.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from app.errors import (
    GatewayError,
    UpstreamClientError,
    UpstreamError,
    UpstreamInvalidResponse,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from app.settings import Settings
from app.workers import Worker, worker_headers

# Error bodies are read to pass the worker's message on; a runaway one is cut here.
_MAX_ERROR_BODY = 64 * 1024


def make_client(
    settings: Settings, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """The client for every worker request.

    No read timeout: the relay enforces first-token and idle timeouts itself, because the
    first token can legitimately take far longer than the gap between two tokens.
    """
    return httpx.AsyncClient(
        transport=transport,
        timeout=httpx.Timeout(
            connect=settings.connect_timeout_s,
            read=None,
            write=settings.connect_timeout_s,
            pool=settings.connect_timeout_s,
        ),
        limits=httpx.Limits(
            max_connections=settings.max_upstream_connections,
            max_keepalive_connections=min(256, settings.max_upstream_connections),
        ),
        follow_redirects=False,
        trust_env=False,
    )


async def open_response(
    client: httpx.AsyncClient, worker: Worker, path: str, body: bytes, request_id: str
) -> httpx.Response:
    """Send a request to ``worker`` and return its response once the status line arrived.

    The body is not read (the caller streams it and must ``aclose`` it). A worker's 4xx is
    raised as :class:`UpstreamClientError` carrying the worker's own message; a 5xx, a broken
    connection or a response that is not OpenAI-shaped as the matching :class:`UpstreamError`.
    """
    request = client.build_request(
        "POST",
        f"{worker.spec.base_url}{path}",
        content=body,
        headers=worker_headers(worker.spec, request_id),
    )
    try:
        response = await client.send(request, stream=True)
    except httpx.TimeoutException as exc:
        if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
            raise UpstreamUnavailable(
                f"Worker {worker.label} could not be reached in time."
            ) from exc
        raise UpstreamTimeout(f"Worker {worker.label} did not answer in time.") from exc
    except httpx.ConnectError as exc:
        raise UpstreamUnavailable(f"Worker {worker.label} is not reachable.") from exc
    except httpx.TransportError as exc:
        raise UpstreamInvalidResponse(
            f"Worker {worker.label} closed the connection: {type(exc).__name__}."
        ) from exc
    if response.status_code < 400:
        return response
    try:
        raise await _status_error(worker, response)
    finally:
        await response.aclose()


async def _status_error(worker: Worker, response: httpx.Response) -> GatewayError:
    raw = response.content if response.is_stream_consumed else b""
    try:
        async for chunk in _unread(response):
            raw += chunk
            if len(raw) > _MAX_ERROR_BODY:
                break
    except httpx.TransportError:
        pass
    body = error_object(raw, response.status_code)
    if 400 <= response.status_code < 500:
        return UpstreamClientError(response.status_code, body)
    message = str(body["error"].get("message") or "")
    return UpstreamStatusError(
        f"Worker {worker.label} failed with status {response.status_code}: {message}"
    )


async def _unread(response: httpx.Response) -> AsyncIterator[bytes]:
    if not response.is_stream_consumed:
        async for chunk in response.aiter_raw():
            yield chunk


def error_object(raw: bytes, status: int) -> dict[str, Any]:
    """A worker's error body in the OpenAI shape, whatever shape vLLM's version sent it in."""
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict) and "message" in err:
            return {
                "error": {
                    "message": str(err.get("message")),
                    "type": err.get("type") or "invalid_request_error",
                    "param": err.get("param"),
                    "code": err.get("code", status),
                }
            }
        if "message" in payload:  # older vLLM: {"object": "error", "message", "type", ...}
            return {
                "error": {
                    "message": str(payload["message"]),
                    "type": payload.get("type") or "invalid_request_error",
                    "param": payload.get("param"),
                    "code": payload.get("code", status),
                }
            }
    text = raw.decode("utf-8", "replace").strip()[:500]
    return {
        "error": {
            "message": text or f"Worker returned status {status}.",
            "type": "invalid_request_error" if status < 500 else "server_error",
            "param": None,
            "code": status,
        }
    }


__all__ = ["UpstreamError", "error_object", "make_client", "open_response"]

"""Reading a request body: refused over the size limit before it is read, cut when it is slow."""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

from app.errors import BodyTooLarge, ClientStalled, InvalidRequest


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, or :class:`BodyTooLarge` as soon as it is known to exceed ``limit``.

    A declared ``content-length`` over the limit is refused without reading a byte; a chunked
    body is read only until it crosses the limit. A body not complete ``timeout_s`` after its
    headers is :class:`ClientStalled` (408): a client trickling its body would otherwise hold
    its connection, and the request's place, for as long as it likes.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(_too_large(limit))
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(_too_large(limit))
                chunks.append(chunk)
    except ClientDisconnect as exc:
        raise InvalidRequest("The client disconnected while sending the body.") from exc
    except TimeoutError as exc:
        raise ClientStalled(f"The request body did not arrive within {timeout_s:g} s.") from exc
    return b"".join(chunks)


def _too_large(limit: int) -> str:
    return f"Request body is larger than the gateway's limit of {limit} bytes."

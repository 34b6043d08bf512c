"""Reading a request body, refusing one over the size limit before reading it all."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from app.errors import BodyTooLarge, InvalidRequest


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or :class:`BodyTooLarge` as soon as it is known to exceed ``limit``.

    A declared ``content-length`` over the limit is refused without reading a byte; a chunked
    body is read only until it crosses the limit.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(_too_large(limit))
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(_too_large(limit))
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise InvalidRequest("The client disconnected while sending the body.") from exc
    return b"".join(chunks)


def _too_large(limit: int) -> str:
    return f"Request body is larger than the gateway's limit of {limit} bytes."

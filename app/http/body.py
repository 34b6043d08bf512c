"""Reading a request body: refused over the size limit before it is read, cut when it is slow.

A JSON body is read whole (:func:`read_body`); an upload (``multipart/form-data``) is kept as
its chunks while its text fields are parsed on the way (:func:`read_form`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from app.api.errors import BodyTooLarge, ClientStalled, InvalidRequest
from app.api.protocol import Upload

if TYPE_CHECKING:  # a typing-only name of python-multipart's
    from python_multipart.multipart import MultipartCallbacks


BODY_KEY = "gateway.body"
"""Scope key of the request's :class:`ArrivedBody`, when the server offers one."""


class ArrivedBody(Protocol):
    """A server's hold on a request's body: all of it at once, when all of it has arrived."""

    def arrived_body(self) -> bytes | None:
        """The whole body, taken, or None (more is to come, or some was received already)."""


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, or :class:`BodyTooLarge` as soon as it is known to exceed ``limit``.

    A declared ``content-length`` over the limit is refused without reading a byte; a chunked
    body is read only until it crosses the limit. A body not complete ``timeout_s`` after its
    headers is :class:`ClientStalled` (408): a client trickling its body would otherwise hold
    its connection, and the request's place, for as long as it likes.

    A body the server already holds whole (:data:`BODY_KEY`) is taken as it is: nothing is
    left to wait for.
    """
    source: ArrivedBody | None = request.scope.get(BODY_KEY)
    if source is not None:
        body = source.arrived_body()
        if body is not None:
            if len(body) > limit:
                raise BodyTooLarge(_too_large(limit))
            return body
    chunks: list[bytes] = []
    await _read(request, limit, timeout_s, chunks.append)
    return b"".join(chunks)


async def _read(
    request: Request, limit: int, timeout_s: float, take: Callable[[bytes], None]
) -> None:
    """Hand each chunk of the body to ``take``, within the limits of :func:`read_body`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(_too_large(limit))
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(_too_large(limit))
                if chunk:
                    take(chunk)
    except ClientDisconnect as exc:
        raise InvalidRequest("The client disconnected while sending the body.") from exc
    except TimeoutError as exc:
        raise ClientStalled(f"The request body did not arrive within {timeout_s:g} s.") from exc


def _too_large(limit: int) -> str:
    return f"Request body is larger than the gateway's limit of {limit} bytes."


# A text field the gateway reads (``model``, ``stream``) is never longer than this.
_MAX_FIELD_BYTES = 4096


async def read_form(
    request: Request, limit: int, timeout_s: float, wanted: frozenset[str]
) -> tuple[Upload, dict[str, str]]:
    """A ``multipart/form-data`` body, kept as it came, and its text fields named in ``wanted``.

    The body is held once, as the client's chunks (to be sent on, and again on failover), and
    parsed as it arrives by python-multipart's streaming parser: file parts are skipped where
    they lie, never copied, and only the ``wanted`` text fields are collected. Limits as
    :func:`read_body`.
    """
    content_type = request.headers.get("content-type", "")
    mime, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if mime != b"multipart/form-data" or not boundary:
        raise InvalidRequest(
            "Request body must be multipart/form-data with a boundary.",
            code="invalid_content_type",
        )
    fields = _FormFields(wanted)
    parser = MultipartParser(boundary, fields.callbacks())
    chunks: list[bytes] = []

    def take(chunk: bytes) -> None:
        chunks.append(chunk)
        parser.write(chunk)

    try:
        await _read(request, limit, timeout_s, take)
        parser.finalize()
    except FormParserError as exc:
        raise InvalidRequest(
            f"Request body is not valid multipart/form-data: {exc}.", code="invalid_form"
        ) from exc
    if not fields.complete:
        raise InvalidRequest(
            "Request body's multipart/form-data is cut short.", code="invalid_form"
        )
    return Upload(chunks, content_type), fields.values


class _FormFields:
    """Collects the wanted text fields of a multipart body from python-multipart's callbacks."""

    def __init__(self, wanted: frozenset[str]) -> None:
        self._wanted = wanted
        self.values: dict[str, str] = {}
        self.complete = False
        self._header = bytearray()
        self._value = bytearray()
        self._name: str | None = None
        self._data = bytearray()

    def callbacks(self) -> MultipartCallbacks:
        """The parser's callbacks."""
        return {
            "on_part_begin": self._begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value,
            "on_header_end": self._header_end,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }

    def _begin(self) -> None:
        self._name = None
        self._data.clear()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        if self._header.lower() == b"content-disposition":
            _, params = parse_options_header(bytes(self._value))
            name = params.get(b"name", b"").decode("utf-8", "replace")
            # A file's bytes are not the gateway's to read, whatever its part is called.
            if name in self._wanted and b"filename" not in params:
                self._name = name
        self._header.clear()
        self._value.clear()

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name is None:
            return
        self._data += data[start:end]
        if len(self._data) > _MAX_FIELD_BYTES:
            raise InvalidRequest(
                f"Form field '{self._name}' is longer than {_MAX_FIELD_BYTES} bytes.",
                param=self._name,
                code="invalid_value",
            )

    def _part_end(self) -> None:
        if self._name is not None:
            try:
                self.values[self._name] = self._data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidRequest(
                    f"Form field '{self._name}' is not valid UTF-8.",
                    param=self._name,
                    code="invalid_utf8",
                ) from exc
        self._name = None

    def _end(self) -> None:
        self.complete = True

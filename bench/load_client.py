"""The overhead benchmark's load client: several processes, each a lean asyncio Protocol.

One Python process reading SSE through asyncio streams topped out near 1,600 events/s on the
2-core development machine, so the client itself became what was measured. Here every client
process (a :class:`ClientPool` starts them, ``spawn``-ed) runs its share of the connections on
uvloop as bare :class:`asyncio.Protocol` objects that only parse HTTP/1.1 chunk framing,
timestamp each content event and count events: no streams API, no per-event coroutine, no JSON.

A *round* (:class:`RoundSpec`) gives every connection the same loop: wait for its start time,
then send the request, read the whole streamed response, and send the next one at once (after
``pause_s``), until ``stop_at``; the stream running then is finished. Times are
``time.perf_counter()``, which on Linux is CLOCK_MONOTONIC and so the same clock in every
process. Each process sends back a :class:`ShardResult` with its raw samples.

A *content event* is an SSE event whose bytes hold ``"content":"`` or ``"text":"`` followed by a
character other than a quote: vLLM's role-only chunk (``"content":""``), the usage chunk and
``[DONE]`` are not.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import re
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Final, cast

CONTENT_RE: Final = re.compile(rb'"(?:content|text)":\s?"[^"]')
_ERROR_BODY_KEEP: Final = 300


@dataclass(frozen=True, slots=True)
class RoundSpec:
    """What one client process does in one round (picklable)."""

    host: str
    ports: tuple[int, ...]
    """Connection ``k`` goes to ``ports[k % len(ports)]`` (several workers reached directly)."""
    path: str
    body: bytes
    first_index: int
    """Global index of this process's first connection (for the start stagger and the port)."""
    connections: int
    start_at: float
    """``perf_counter`` time at which connection 0 sends its first request."""
    spacing_s: float
    """Connection ``k`` starts ``k * spacing_s`` after connection 0."""
    stop_at: float
    """No request is sent after this time; the streams running then finish."""
    steady_from: float
    steady_to: float
    """Content events arriving in [steady_from, steady_to] are counted as the steady rate."""
    timeout_s: float
    """A stream still unfinished this long after ``stop_at`` counts as timed out."""
    pause_s: float = 0.0
    """Between one response's end and the connection's next request."""
    connect_rate: float = 0.0
    """Connections opened per second before the round (0: all at once)."""


@dataclass(slots=True)
class ShardResult:
    """One process's samples for one round."""

    ttft: array[float] = field(default_factory=lambda: array("d"))
    itl: array[float] = field(default_factory=lambda: array("d"))
    content_per_stream: dict[int, int] = field(default_factory=dict)
    """How many streams (value) carried each number of content events (key)."""
    max_content_per_http_chunk: int = 0
    """Most content events seen in one HTTP chunk: above 1, someone merged events."""
    sent: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    content_events: int = 0
    steady_events: int = 0
    first_sent: float = 0.0
    last_end: float = 0.0


class _Conn(asyncio.Protocol):
    """One keep-alive connection running requests back to back."""

    __slots__ = (
        "_body_left", "_buf", "_chunked", "_done", "_err", "_keep", "_last", "_n", "_pending",
        "_request", "_res", "_round", "_sent", "_state", "_status", "closed", "transport",
    )  # fmt: skip

    def __init__(self, rnd: _Round, request: bytes) -> None:
        self._round = rnd
        self._res = rnd.result
        self._request = request
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buf = b""
        self._state = 0  # 0 idle, 1 reading the head, 2 chunked body, 3 sized body
        self._sent = 0.0
        self._last = 0.0
        self._n = 0
        self._status = 0
        self._done = False
        self._keep = True
        self._chunked = False
        self._body_left = 0
        self._err = b""
        self._pending = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self._state != 0:
            self._fail("connection closed mid-response")
        self._close()

    def send(self) -> None:
        """Send the next request, unless the round is over."""
        transport = self.transport
        rnd = self._round
        if transport is None or transport.is_closing():
            self._close()
            return
        now = time.perf_counter()
        if now >= rnd.spec.stop_at:
            self._close()
            return
        res = self._res
        if not res.first_sent or now < res.first_sent:
            res.first_sent = now
        res.sent += 1
        self._state = 1
        self._n = 0
        self._status = 0
        self._done = False
        self._err = b""
        self._pending = b""
        self._sent = now
        transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self._buf:
            data = self._buf + data
            self._buf = b""
        pos = 0
        size_of = len(data)
        while pos < size_of:
            state = self._state
            if state == 2:
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(data[pos:eol].split(b";", 1)[0], 16)
                if size == 0:
                    if size_of < eol + 4:
                        break
                    pos = eol + 4
                    self._end(now)
                    continue
                end = eol + 2 + size
                if size_of < end + 2:
                    break
                self._payload(data[eol + 2 : end], now)
                pos = end + 2
            elif state == 1:
                end = data.find(b"\r\n\r\n", pos)
                if end < 0:
                    break
                self._head(data[pos:end])
                pos = end + 4
                if self._state == 3 and self._body_left == 0:
                    self._end(now)
            elif state == 3:
                take = min(self._body_left, size_of - pos)
                if len(self._err) < _ERROR_BODY_KEEP:
                    self._err += data[pos : pos + take]
                self._payload(data[pos : pos + take], now)
                self._body_left -= take
                pos += take
                if self._body_left == 0:
                    self._end(now)
            else:
                self._fail("unexpected bytes between responses")
                if self.transport is not None:
                    self.transport.close()
                return
        if pos < size_of:
            self._buf = data[pos:]

    def _head(self, head: bytes) -> None:
        lower = head.lower()
        try:
            self._status = int(head[9:12])
        except ValueError:
            self._status = -1
        self._keep = b"connection: close" not in lower
        self._chunked = b"transfer-encoding: chunked" in lower
        if self._chunked:
            self._state = 2
            return
        self._state = 3
        match = re.search(rb"content-length:\s*(\d+)", lower)
        self._body_left = int(match.group(1)) if match else 0

    def _payload(self, payload: bytes, now: float) -> None:
        if self._pending:
            payload = self._pending + payload
            self._pending = b""
        if payload.count(b"data:") == 1 and payload.endswith(b"\n\n"):
            if CONTENT_RE.search(payload) is not None:
                self._content(now)
                if self._res.max_content_per_http_chunk < 1:
                    self._res.max_content_per_http_chunk = 1
            elif b"[DONE]" in payload:
                self._done = True
            return
        events = payload.split(b"\n\n")
        self._pending = events.pop()
        in_chunk = 0
        for event in events:
            if CONTENT_RE.search(event) is not None:
                self._content(now)
                in_chunk += 1
            elif b"data: [DONE]" in event:
                self._done = True
        if in_chunk > self._res.max_content_per_http_chunk:
            self._res.max_content_per_http_chunk = in_chunk

    def _content(self, now: float) -> None:
        res = self._res
        if self._n:
            res.itl.append(now - self._last)
        else:
            res.ttft.append(now - self._sent)
        self._last = now
        self._n += 1
        res.content_events += 1
        spec = self._round.spec
        if spec.steady_from <= now <= spec.steady_to:
            res.steady_events += 1

    def _end(self, now: float) -> None:
        res = self._res
        self._state = 0
        res.content_per_stream[self._n] = res.content_per_stream.get(self._n, 0) + 1
        if now > res.last_end:
            res.last_end = now
        if self._status == 200 and self._done:
            res.ok += 1
        else:
            reason = f"HTTP {self._status}" + ("" if self._done else " (no [DONE])")
            if self._err:
                reason += ": " + self._err[:_ERROR_BODY_KEEP].decode("utf-8", "replace")
            res.errors[reason] = res.errors.get(reason, 0) + 1
        if not self._keep:
            if self.transport is not None:
                self.transport.close()
            return
        pause = self._round.spec.pause_s
        if pause > 0:
            self._round.loop.call_later(pause, self.send)
        else:
            self.send()

    def _fail(self, reason: str) -> None:
        if self._state == 0:
            return
        self._state = 0
        res = self._res
        res.errors[reason] = res.errors.get(reason, 0) + 1
        res.content_per_stream[self._n] = res.content_per_stream.get(self._n, 0) + 1

    def abort(self, reason: str) -> None:
        """Give up on this connection (the round timed out)."""
        self._fail(reason)
        if self.transport is not None:
            self.transport.abort()
        self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.transport is not None and self._state == 0:
            self.transport.close()
        self._round.closed_one()


class _Round:
    """One round in one process: connect, run, collect."""

    def __init__(self, spec: RoundSpec) -> None:
        self.spec = spec
        self.loop = asyncio.get_running_loop()
        self.result = ShardResult()
        self._open = 0
        self._connecting = True
        self._all_closed = self.loop.create_future()

    def closed_one(self) -> None:
        self._open -= 1
        if self._open == 0 and not self._connecting and not self._all_closed.done():
            self._all_closed.set_result(None)

    async def run(self) -> ShardResult:
        spec = self.spec
        loop = self.loop
        conns: list[_Conn] = []
        for i in range(spec.connections):
            k = spec.first_index + i
            port = spec.ports[k % len(spec.ports)]
            request = (
                f"POST {spec.path} HTTP/1.1\r\nhost: {spec.host}:{port}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(spec.body)}\r\n\r\n"
            ).encode() + spec.body
            conn = _Conn(self, request)
            try:
                await loop.create_connection(lambda c=conn: c, spec.host, port)  # type: ignore[misc]
            except OSError as exc:
                reason = f"connect: {type(exc).__name__}: {exc}"
                self.result.errors[reason] = self.result.errors.get(reason, 0) + 1
                continue
            conns.append(conn)
            self._open += 1
            if spec.connect_rate > 0 and i % 50 == 49:
                await asyncio.sleep(50 / spec.connect_rate)
        self._connecting = False
        if not conns or self._open == 0:
            return self.result
        for i, conn in enumerate(conns):
            k = spec.first_index + i
            delay = spec.start_at + k * spec.spacing_s - time.perf_counter()
            loop.call_later(max(0.0, delay), conn.send)
        wait = spec.stop_at + spec.timeout_s - time.perf_counter()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._all_closed), max(0.1, wait))
        for conn in conns:
            if not conn.closed:
                conn.abort("timed out")
        return self.result


async def _run_round(spec: RoundSpec) -> ShardResult:
    return await _Round(spec).run()


def _serve(pipe: multiprocessing.connection.Connection) -> None:
    """A client process: run each round the parent sends until it sends None."""
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        while True:
            spec = pipe.recv()
            if spec is None:
                return
            result = runner.run(_run_round(spec))
            pipe.send(result)


class ClientPool:
    """``processes`` client processes; :meth:`run` spreads a round's connections over them."""

    def __init__(self, processes: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._pipes: list[multiprocessing.connection.Connection] = []
        self.processes: list[Any] = []
        for _ in range(processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child,), daemon=True)
            proc.start()
            child.close()
            self._pipes.append(parent)
            self.processes.append(proc)

    @property
    def pids(self) -> list[int]:
        """Process ids of the client processes."""
        return [int(p.pid) for p in self.processes]

    def start(self, spec: RoundSpec, connections: int) -> None:
        """Start a round of ``connections`` connections (``spec.connections`` is ignored)."""
        n = len(self._pipes)
        first = 0
        for i, pipe in enumerate(self._pipes):
            share = connections // n + (1 if i < connections % n else 0)
            if share == 0:
                pipe.send(_idle(spec))
                continue
            pipe.send(_shard(spec, first, share))
            first += share

    def collect(self) -> list[ShardResult]:
        """Wait for every process's result of the round started last."""
        return [pipe.recv() for pipe in self._pipes]

    def run(self, spec: RoundSpec, connections: int) -> list[ShardResult]:
        """Run one round to the end."""
        self.start(spec, connections)
        return self.collect()

    def close(self) -> None:
        """Stop the client processes."""
        for pipe in self._pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for proc in self.processes:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


def _shard(spec: RoundSpec, first: int, share: int) -> RoundSpec:
    return RoundSpec(
        spec.host, spec.ports, spec.path, spec.body, first, share, spec.start_at,
        spec.spacing_s, spec.stop_at, spec.steady_from, spec.steady_to, spec.timeout_s,
        spec.pause_s, spec.connect_rate,
    )  # fmt: skip


def _idle(spec: RoundSpec) -> RoundSpec:
    return _shard(spec, 0, 0)


def merge(results: list[ShardResult]) -> ShardResult:
    """All processes' samples of one round as one."""
    out = ShardResult()
    for res in results:
        out.ttft.extend(res.ttft)
        out.itl.extend(res.itl)
        for k, v in res.content_per_stream.items():
            out.content_per_stream[k] = out.content_per_stream.get(k, 0) + v
        out.max_content_per_http_chunk = max(
            out.max_content_per_http_chunk, res.max_content_per_http_chunk
        )
        out.sent += res.sent
        out.ok += res.ok
        for k2, v2 in res.errors.items():
            out.errors[k2] = out.errors.get(k2, 0) + v2
        out.content_events += res.content_events
        out.steady_events += res.steady_events
        if res.first_sent and (not out.first_sent or res.first_sent < out.first_sent):
            out.first_sent = res.first_sent
        out.last_end = max(out.last_end, res.last_end)
    return out

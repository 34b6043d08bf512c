"""A minimal HTTP relay on uvloop and httptools: the floor a Python data plane can reach here.

``python -m bench.reference_relay --port P --workers http://h:p,...``

It does the work a gateway's data plane must do per request and per event, and nothing else (no
admission, no metrics): it parses each client request with httptools, sends it to the next
worker (round robin) on a kept-alive connection from a pool per worker, parses the worker's
chunked response with httptools, writes each worker chunk to the client as one chunk, and takes
``loop.time()`` for each. The client's connection pauses the worker's while it cannot take more
(``pause_writing``), and a client that goes away closes its worker connection. ``GET /health``
answers 200. ``make bench`` measures it beside the gateway and vllm-router.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import signal
from urllib.parse import urlsplit

import httptools
import uvloop


class Pools:
    """Idle worker connections per worker, and the round robin over the workers."""

    def __init__(self, workers: list[tuple[str, int]]) -> None:
        self.workers = workers
        self.idle: dict[tuple[str, int], collections.deque[WorkerSide]] = {
            w: collections.deque() for w in workers
        }
        self.turn = 0

    def next_worker(self) -> tuple[str, int]:
        """The next worker in turn."""
        self.turn = (self.turn + 1) % len(self.workers)
        return self.workers[self.turn]


class _Side(asyncio.Protocol):
    """One connection whose bytes an httptools parser reads; a malformed message ends it."""

    parser: httptools.HttpRequestParser | httptools.HttpResponseParser
    transport: asyncio.Transport | None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport."""
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        """Parse the bytes; a malformed message ends the connection."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.broken()

    def broken(self) -> None:
        """The peer sent what is not HTTP/1.1."""
        raise NotImplementedError


class WorkerSide(_Side):
    """One connection to a worker; relays the response of the request it carries."""

    parser: httptools.HttpResponseParser

    def __init__(self, pools: Pools, worker: tuple[str, int]) -> None:
        self.pools, self.worker = pools, worker
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: ClientSide | None = None
        self.chunk: list[bytes] = []
        self.last = 0.0

    def on_headers_complete(self) -> None:
        """Start the client's chunked response with the worker's status."""
        if self.client is not None:
            status = self.parser.get_status_code()
            self.client.write(
                b"HTTP/1.1 %d OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n" % status
            )

    def on_body(self, body: bytes) -> None:
        """Gather a piece of the current chunk."""
        self.chunk.append(body)

    def on_chunk_complete(self) -> None:
        """Write the whole worker chunk to the client as one chunk, timed."""
        data = b"".join(self.chunk)
        self.chunk.clear()
        if data and self.client is not None:
            self.last = asyncio.get_running_loop().time()
            self.client.write(b"%x\r\n%s\r\n" % (len(data), data))

    def on_message_complete(self) -> None:
        """End the client's body; put the connection back in the pool."""
        client, self.client = self.client, None
        if client is not None:
            client.write(b"0\r\n\r\n")
            client.worker = None
        self.parser = httptools.HttpResponseParser(self)
        if self.transport is not None and not self.transport.is_closing():
            self.pools.idle[self.worker].append(self)

    def broken(self) -> None:
        """A malformed response fails the stream."""
        self.fail()

    def fail(self) -> None:
        """Close this connection and the client's."""
        if self.transport is not None:
            self.transport.close()
        client, self.client = self.client, None
        if client is not None:
            client.close()

    def connection_lost(self, exc: Exception | None) -> None:
        """Leave the pool; a stream still relayed fails."""
        idle = self.pools.idle[self.worker]
        if self in idle:
            idle.remove(self)
        self.fail()


class ClientSide(_Side):
    """One client connection; requests on it are relayed one after another."""

    def __init__(self, pools: Pools) -> None:
        self.pools = pools
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.worker: WorkerSide | None = None
        self.url = b""
        self.body: list[bytes] = []

    def on_url(self, url: bytes) -> None:
        """Gather the request's target."""
        self.url += url

    def on_body(self, body: bytes) -> None:
        """Gather the request's body."""
        self.body.append(body)

    def on_message_complete(self) -> None:
        """Answer /health; relay anything else."""
        url, body = self.url, b"".join(self.body)
        self.url, self.body = b"", []
        if url == b"/health":
            self.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            return
        asyncio.get_running_loop().create_task(self.relay(url, body))

    async def relay(self, url: bytes, body: bytes) -> None:
        """Send the request to the next worker, on an idle connection if there is one."""
        worker = self.pools.next_worker()
        idle = self.pools.idle[worker]
        if idle:
            conn = idle.pop()
        else:
            loop = asyncio.get_running_loop()
            _, conn = await loop.create_connection(lambda: WorkerSide(self.pools, worker), *worker)
        conn.client, self.worker = self, conn
        assert conn.transport is not None
        conn.transport.write(
            b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (url, worker[0].encode(), worker[1], len(body), body)
        )

    def write(self, data: bytes) -> None:
        """Write to the client unless it is gone."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def pause_writing(self) -> None:
        """The client's buffer is full: stop reading the worker."""
        if self.worker is not None and self.worker.transport is not None:
            self.worker.transport.pause_reading()

    def resume_writing(self) -> None:
        """The client's buffer drained: read the worker again."""
        if self.worker is not None and self.worker.transport is not None:
            self.worker.transport.resume_reading()

    def broken(self) -> None:
        """A malformed request closes the connection."""
        self.close()

    def close(self) -> None:
        """Close the client's connection."""
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        """The client went away: close its worker connection."""
        worker, self.worker = self.worker, None
        if worker is not None and worker.client is self:
            worker.client = None
            if worker.transport is not None:
                worker.transport.close()  # the worker aborts the generation


async def serve(host: str, port: int, workers: list[tuple[str, int]]) -> None:
    """Serve until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    pools = Pools(workers)
    server = await loop.create_server(lambda: ClientSide(pools), host, port, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def main() -> None:
    """Command-line entry."""
    parser = argparse.ArgumentParser(prog="python -m bench.reference_relay")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", required=True, help="comma-separated worker base URLs")
    args = parser.parse_args()
    workers = []
    for url in args.workers.split(","):
        parts = urlsplit(url)
        workers.append((parts.hostname or "127.0.0.1", parts.port or 80))
    uvloop.run(serve(args.host, args.port, workers))


if __name__ == "__main__":
    main()

"""When a request arrived: the moment the HTTP server read its first byte.

A client's clock starts when it sends. uvicorn calls the ASGI app only once the request's
headers are parsed and a task was scheduled for it, and under load that task waits its turn on
the event loop; a timer started in the route handler misses that wait. The gateway's HTTP
protocol therefore reads the clock when httptools begins to parse a request, in the same
callback in which the bytes were read from the socket, and leaves it in the request's state
(``scope["state"]``), where :func:`arrival` finds it. What remains unseen is how long the bytes
lay in the socket before the loop read them: the event loop's lag
(``gateway_event_loop_lag_seconds``, :mod:`app.looplag`). docs/timing.md has the measurements.
"""

from __future__ import annotations

from starlette.requests import Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.state import STATE_KEY, GatewayState
from app.timing import Clock

FIRST_BYTE = "gateway.first_byte"
"""Key in the request state: the gateway clock's reading when the request's first byte was read."""


class FirstByteProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, noting on the gateway's clock when each request began."""

    def on_message_begin(self) -> None:
        """A new request's first bytes were read: note the time in its state."""
        super().on_message_begin()
        state = self.scope["state"]
        gateway = state.get(STATE_KEY)
        if isinstance(gateway, GatewayState):
            state[FIRST_BYTE] = gateway.clock()


def arrival(request: Request, clock: Clock) -> float:
    """When ``request``'s first byte was read; now, if the server did not say (another server)."""
    first_byte = request.scope.get("state", {}).get(FIRST_BYTE)
    return first_byte if isinstance(first_byte, float) else clock()

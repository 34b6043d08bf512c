"""When a request arrived: the moment the HTTP server read its first byte.

A client's clock starts when it sends. uvicorn calls the ASGI app only once the request's
headers are parsed and a task was scheduled for it, and under load that task waits its turn on
the event loop; a timer started in the route handler misses that wait. The gateway's HTTP
front end (:class:`app.http.front.FrontProtocol`) therefore reads the gateway's clock when
httptools begins to parse a request, in the same callback in which the bytes were read from the
socket, and leaves it in the request's scope, where :func:`arrival` finds it. What remains
unseen is how long the bytes lay in the socket before the loop read them: the event loop's lag
(``gateway_event_loop_lag_seconds``, :mod:`app.observe.looplag`). docs/timing.md has the
measurements.
"""

from __future__ import annotations

from starlette.requests import Request

from app.http.front import FIRST_BYTE_KEY
from app.observe.timing import Clock

__all__ = ["FIRST_BYTE_KEY", "arrival"]


def arrival(request: Request, clock: Clock) -> float:
    """When ``request``'s first byte was read; now, if the server did not say (another server)."""
    first_byte = request.scope.get(FIRST_BYTE_KEY)
    return first_byte if isinstance(first_byte, float) else clock()

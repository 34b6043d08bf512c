"""One relayed request end to end: attempts and failover, the stream, its end recorded.

Owns a request's life after its route: admission's answer, the worker request, every event
relayed and timed (:mod:`app.relay.serve`), the deadlines on the way
(:mod:`app.relay.deadline`), and its record (:mod:`app.relay.record`). May import every
package below it (:mod:`app.admission`, :mod:`app.fleet`, :mod:`app.http`,
:mod:`app.observe`, :mod:`app.api`); nothing below imports it.
"""

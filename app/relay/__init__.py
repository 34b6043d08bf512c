"""One relayed request end to end: attempts and failover, the stream, its end recorded.

Owns a request's life after its route: admission's answer, failover and errors
(:mod:`app.relay.serve`), one attempt on one worker (:mod:`app.relay.attempt`), the worker's
events cut, sent and timed (:mod:`app.relay.stream`) through what the client has been sent
(:mod:`app.relay.answer`), what a request teaches admission and the fleet
(:mod:`app.relay.feedback`), the deadlines on the way (:mod:`app.relay.deadline`), and its
record (:mod:`app.relay.record`). May import every package below it (:mod:`app.admission`,
:mod:`app.fleet`, :mod:`app.http`, :mod:`app.observe`, :mod:`app.api`); nothing below imports
it.
"""

"""Whether a request runs now, waits, or is turned away, and what each tier is owed.

Owns the priority queue (:mod:`app.admission.queue`) of tickets (:mod:`app.admission.ticket`),
where a ticket can run now (:mod:`app.admission.placement`), the room a worker has for a tier
(:mod:`app.admission.room`), the limits learnt from latencies (:mod:`app.admission.limits`),
each tier's expected demand and the queue's drain rate, the keys' quotas
(:mod:`app.admission.auth`) and the state shared between gateway processes through Redis
(:mod:`app.admission.shared`). May import :mod:`app.fleet` and everything below it.
"""

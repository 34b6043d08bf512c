"""The workers: who they are, how loaded and healthy, where a request goes, how to reach them.

Owns each worker's membership, discovery, load signals, health and probes
(:mod:`app.fleet.workers`), its latency models (:mod:`app.fleet.predictor`), the prefix index,
the routing choice (:mod:`app.fleet.routing`), the slot a request holds on a worker
(:mod:`app.fleet.lease`), and the HTTP client to the workers (:mod:`app.fleet.wire`,
:mod:`app.fleet.upstream`). May import :mod:`app.api`, :mod:`app.observe` and
:mod:`app.settings`.
"""

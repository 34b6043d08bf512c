"""The workers: who they are, how loaded and healthy, where a request goes, how to reach them.

Owns each worker's membership, discovery, load signals, health and probes
(:mod:`app.fleet.workers`, with :mod:`app.fleet.probes` running the probes and
:mod:`app.fleet.gauges` showing each worker in the metrics), its latency models
(:mod:`app.fleet.predictor`), the prefix index, the routing choice (:mod:`app.fleet.routing`),
the slot a request holds on a worker (:mod:`app.fleet.lease`), and the HTTP client to the
workers (:mod:`app.fleet.wire`, :mod:`app.fleet.upstream`). May import :mod:`app.api`,
:mod:`app.observe` and :mod:`app.settings`.
"""

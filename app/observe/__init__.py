"""What the gateway measures: per-request timing, event-loop lag, metrics, goodput.

Owns the clocks' definitions (:mod:`app.observe.timing`), every exported series
(:mod:`app.observe.metrics`) and the SLO verdict of a finished request
(:mod:`app.observe.goodput`). May import :mod:`app.api` and :mod:`app.settings` only: it
counts, it never decides.
"""

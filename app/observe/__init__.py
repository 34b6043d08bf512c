"""What the gateway measures: per-request timing, event-loop lag, metrics, goodput, logs.

Owns the clocks' definitions (:mod:`app.observe.timing`), every exported series
(:mod:`app.observe.metrics`), the SLO verdict of a finished request
(:mod:`app.observe.goodput`) and how log lines are written (:mod:`app.observe.logs`). May
import :mod:`app.api` and :mod:`app.settings` only: it counts, it never decides.
"""

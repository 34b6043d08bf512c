"""The closed vocabularies of a request's fate.

Outcomes, admission decisions and their reasons, and SLO results. Each value is also a metric
label value, so the label sets stay bounded.
"""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    """How a request ended, from the gateway's side (``gateway_requests_total{outcome}``)."""

    OK = "ok"
    CLIENT_CANCELLED = "client_cancelled"
    CLIENT_STALLED = "client_stalled"
    """The client stopped reading its stream, or sending its request, for too long: its own
    doing, never a worker's fault."""
    UPSTREAM_ERROR = "upstream_error"
    TIMEOUT = "timeout"
    REJECTED = "rejected"
    """Turned away by admission (the service could not take it now)."""
    RATE_LIMITED = "rate_limited"
    """Over its own key's quota: the client's limit, not a shortfall of the service."""
    GATEWAY_SHUTDOWN = "gateway_shutdown"
    """Cut by the gateway's shutdown after its grace period: the gateway's doing, never ok."""
    GATEWAY_SATURATED = "gateway_saturated"
    """The gateway's own resources (its connections to the workers) ran out: never a worker's
    fault, never a success."""
    INVALID_REQUEST = "invalid_request"
    INTERNAL_ERROR = "internal_error"
    """A fault in the gateway's own code (answered 500): never a worker's."""


class Decision(StrEnum):
    """What admission did with a request (``gateway_admission_decisions_total{decision}``)."""

    ADMITTED = "admitted"
    QUEUED = "queued"
    REJECTED = "rejected"
    SHED = "shed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


class Reason(StrEnum):
    """Why a request was turned away; the error body's ``code`` and a metric label value.

    ``none`` goes with the decisions that turn nobody away (admitted, queued, cancelled).
    """

    NONE = "none"
    DEADLINE_UNREACHABLE = "deadline_unreachable"
    """The work queued ahead will not have left in time for the tier's TTFT target."""
    QUEUE_FULL = "queue_full"
    PROMPT_TOO_LONG = "prompt_too_long"
    """Even an idle worker would miss the tier's TTFT target: only a lower tier helps."""
    KEY_QUOTA = "key_quota"
    NO_WORKER = "no_worker"
    QUEUE_TIMEOUT = "queue_timeout"
    """A queued request's deadline passed (decision ``expired``)."""
    SHED = "shed"
    """A sheddable queued request made room for a more urgent one (decision ``shed``)."""


class LimitCut(StrEnum):
    """Why a worker's admission limit fell (``gateway_worker_limit_cuts_total{cause}``)."""

    TPOT_MISS = "tpot_miss"
    """A finished stream's TPOT was over the TPOT target the limits keep (running limit)."""
    DECODE_PACE = "decode_pace"
    """The worker's running streams together advanced slower than that target (running limit)."""
    DECODE_LINE = "decode_line"
    """The worker's learnt decode line puts the TPOT aim below the limit (running limit)."""
    WORKER_QUEUEING = "worker_queueing"
    """The worker reported requests waiting for capacity (running limit)."""
    TTFT_MISS = "ttft_miss"
    """The worker's own time to first token was over its share of the TTFT target (prefill
    limit)."""


DECISION_REASONS: dict[Decision, tuple[Reason, ...]] = {
    Decision.ADMITTED: (Reason.NONE,),
    Decision.QUEUED: (Reason.NONE,),
    Decision.CANCELLED: (Reason.NONE,),
    Decision.REJECTED: (
        Reason.DEADLINE_UNREACHABLE,
        Reason.QUEUE_FULL,
        Reason.PROMPT_TOO_LONG,
        Reason.KEY_QUOTA,
        Reason.NO_WORKER,
    ),
    Decision.EXPIRED: (Reason.QUEUE_TIMEOUT,),
    Decision.SHED: (Reason.SHED,),
}
"""Every (decision, reason) pair that can be counted: exported at zero from the start."""


class SloResult(StrEnum):
    """A finished request's standing against its tier's SLOs (``gateway_slo_requests_total``).

    Goodput is ``met`` over every counted result. A request is counted when the service had its
    chance: answered, failed, turned away by admission, or given up on by its client after its
    TTFT target passed. Not counted: the client's own mistakes (4xx), its key's quota, and a
    client that left before its TTFT target with nothing missed yet.
    """

    MET = "met"
    MISSED_TTFT = "missed_ttft"
    MISSED_TPOT = "missed_tpot"
    MISSED_BOTH = "missed_both"
    MISSED_E2E = "missed_e2e"
    """A non-streamed answer that took longer than its tier's budget for its length."""
    REJECTED = "rejected"
    ERRORED = "errored"

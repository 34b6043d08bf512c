"""Who is calling: bearer keys, known only by their SHA-256, mapped to tiers and limits.

Keys never reach logs, metrics or error messages; only a key's configured ``name`` (or the
first 8 hex digits of its hash) is ever shown. Without keys configured, every request runs in
the default tier and the start-up log says so.

A key's limits hold across every process and replica when the gateway shares state through
Redis (:mod:`app.admission.shared`): one round trip checks and charges both. Without Redis each
process holds every key to its limits on its own (the token bucket and count below). While a
configured Redis does not answer, each process holds a key to its part of the concurrency
limit (split between the processes last seen) and to the whole tokens-per-minute limit; the
count and bucket are kept current either way, so a fallback starts from what this process
really runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from pydantic import TypeAdapter

from app.admission.shared import SharedState
from app.api.errors import AuthenticationFailed, RateLimited, TierNotAllowed
from app.observe.timing import Clock
from app.settings import ApiKeySpec, Settings, TierSpec

log = logging.getLogger(__name__)
_KEYS = TypeAdapter(list[ApiKeySpec])


class TokenBucket:
    """Tokens-per-minute allowance: refills continuously, may go into debt by one request.

    A request is charged its estimate when admitted and corrected with its real usage when it
    finishes, so a key cannot burst far past its limit with large generations.
    """

    __slots__ = ("_at", "_clock", "_level", "capacity", "rate")

    def __init__(self, per_minute: int, clock: Clock) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self._clock = clock
        self._level = self.capacity
        self._at = clock()

    @property
    def level(self) -> float:
        """Tokens available now (negative while in debt)."""
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
        self._at = now
        return self._level

    def wait(self) -> float:
        """Seconds until the bucket is out of debt (0 when it is not): when a charge may go."""
        level = self.level
        return 0.0 if level > 0 else (1.0 - level) / self.rate

    def charge(self, tokens: float) -> None:
        """Take ``tokens`` (negative to give back)."""
        self._level = self.level - tokens


class KeyState:
    """A configured key and its live usage."""

    __slots__ = ("bucket", "in_flight", "spec")

    def __init__(self, spec: ApiKeySpec, clock: Clock) -> None:
        self.spec = spec
        self.in_flight = 0
        per_minute = spec.tokens_per_minute
        self.bucket = TokenBucket(per_minute, clock) if per_minute else None

    def counts(self) -> tuple[int, int | None]:
        """Its requests running in this process, and its concurrency limit."""
        return self.in_flight, self.spec.max_concurrency

    @property
    def name(self) -> str:
        """What logs may show of the key."""
        return self.spec.name or f"key-{self.spec.sha256[:8]}"


@dataclass(frozen=True, slots=True)
class Identity:
    """The caller of one request: its key (if keys are on) and the tier it runs in."""

    key: KeyState | None
    tier: TierSpec
    fairness: str = ""
    """Whose share of the tier it runs in (:mod:`app.admission.fairshare`)."""
    weight: float = 1.0
    """That share's weight."""


def _keys_file(path: Path) -> list[ApiKeySpec]:
    """The keys ``path`` lists.

    A file that cannot be read or lists none is refused: it was configured to protect the
    gateway, and running without keys would leave it open.
    """
    try:
        keys = _KEYS.validate_python(json.loads(path.read_text()))
    except OSError as exc:
        raise ValueError(f"GATEWAY_API_KEYS_FILE {path} cannot be read: {exc}") from exc
    if not keys:
        raise ValueError(
            f"GATEWAY_API_KEYS_FILE {path} lists no API keys, so the gateway refuses to start "
            "rather than serve without them: list the SHA-256 of each client key in it (see "
            "docs/deploy.md, API keys), or unset GATEWAY_API_KEYS_FILE to run without keys"
        )
    return keys


class Authenticator:
    """Maps a request's ``Authorization`` header to an :class:`Identity`."""

    def __init__(self, settings: Settings, clock: Clock, shared: SharedState | None = None) -> None:
        self.tiers = {tier.name: tier for tier in settings.tiers}
        self._default = self.tiers[settings.default_tier]
        # Keys off, no fairness id: one identity per tier, made once (a frozen dataclass costs
        # a call per field to make).
        self._anonymous = {name: Identity(None, tier) for name, tier in self.tiers.items()}
        specs = list(settings.api_keys)
        if settings.api_keys_file is not None:
            specs += _keys_file(settings.api_keys_file)
        for spec in specs:
            if spec.tier not in self.tiers:
                raise ValueError(
                    f"API key {spec.name or spec.sha256[:8]}: unknown tier {spec.tier}"
                )
        self._keys = {spec.sha256: KeyState(spec, clock) for spec in specs}
        self._shared = shared
        if shared is not None:
            for key in self._keys.values():
                if key.spec.max_concurrency is not None:
                    shared.track_key(key.spec.sha256, key.counts)

    @property
    def enabled(self) -> bool:
        """Whether keys are required."""
        return bool(self._keys)

    def log_mode(self) -> None:
        """Say at start-up whether keys are enforced."""
        if self.enabled:
            log.info(
                "API keys: %d configured; requests without a known key get 401", len(self._keys)
            )
        else:
            log.warning(
                "no API keys configured: every request runs in tier '%s' (lower tiers can be "
                "asked for with the tier header)",
                self._default.name,
            )

    def identify(
        self, authorization: str | None, asked_tier: str | None, fairness: str | None = None
    ) -> Identity:
        """The caller and tier; raises 401 for a missing/unknown key, 403 for a higher tier.

        Its fairness id is the key's name, or ``fairness`` (a header's) when the key may set
        one (``sets_fairness_id``) or keys are off; a key that may not has it ignored, so a
        client cannot mint fresh shares. A key's weight goes with every id it sets.
        """
        key: KeyState | None = None
        tier = self._default
        if self._keys:
            scheme, _, token = (authorization or "").partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.")
            digest = hashlib.sha256(_header_bytes(token.strip())).hexdigest()
            key = self._keys.get(digest)
            if key is None:
                raise AuthenticationFailed("Incorrect API key provided.")
            tier = self.tiers[key.spec.tier]
        if asked_tier:
            wanted = self.tiers.get(asked_tier.strip().lower())
            if wanted is None:
                raise TierNotAllowed(
                    f"Unknown tier '{asked_tier[:32]}'; tiers are {sorted(self.tiers)}.",
                    param="x-gateway-tier",
                )
            if wanted.priority < tier.priority:
                raise TierNotAllowed(
                    f"This key may use tier '{tier.name}' or a lower one, not '{wanted.name}'.",
                    param="x-gateway-tier",
                )
            tier = wanted
        if key is None:
            if not fairness:
                return self._anonymous[tier.name]
            return Identity(None, tier, fairness)
        if fairness is None or not key.spec.sets_fairness_id:
            fairness = key.name
        return Identity(key, tier, fairness, key.spec.weight)

    async def acquire(self, identity: Identity, estimated_tokens: float) -> None:
        """Take one concurrency slot and the estimated tokens; raise 429 when over a limit.

        Fleet-wide through Redis when it answers within its budget, else this process's own.
        """
        key = identity.key
        if key is None:
            return
        spec = key.spec
        shared = self._shared
        if shared is not None and shared.up and (spec.max_concurrency or spec.tokens_per_minute):
            # Counted here before the round trip: another request of the key that this process
            # checks meanwhile then counts this one too.
            key.in_flight += 1
            try:
                verdict = await shared.acquire(
                    spec.sha256, key.in_flight, spec.max_concurrency, spec.tokens_per_minute,
                    estimated_tokens,
                )  # fmt: skip
            finally:
                key.in_flight -= 1
            if verdict is not None:
                if not verdict.ok:
                    raise _limited(spec, verdict.limit, verdict.wait_s)
                self._take(key, estimated_tokens)
                return
        limit = spec.max_concurrency
        if limit is not None and shared is not None:
            limit = shared.share(limit)  # Redis is down or slow: this process's part alone
        if limit is not None and key.in_flight >= limit:
            raise _limited(spec, "concurrency", 0.0)
        if key.bucket is not None:
            wait = key.bucket.wait()
            if wait > 0:
                raise _limited(spec, "tpm", wait)
        self._take(key, estimated_tokens)

    @staticmethod
    def _take(key: KeyState, estimated_tokens: float) -> None:
        if key.bucket is not None:
            key.bucket.charge(estimated_tokens)
        key.in_flight += 1

    def release(self, identity: Identity, estimated_tokens: float, used_tokens: int | None) -> None:
        """Give the slot back and correct the token charge with what was really used."""
        key = identity.key
        if key is None:
            return
        key.in_flight -= 1
        extra = 0.0 if used_tokens is None else used_tokens - estimated_tokens
        if key.bucket is not None:
            key.bucket.charge(extra)
        spec = key.spec
        if self._shared is not None and (spec.max_concurrency or spec.tokens_per_minute):
            self._shared.release(
                spec.sha256, key.in_flight, spec.max_concurrency, spec.tokens_per_minute, extra
            )


def _limited(spec: ApiKeySpec, limit: str, wait_s: float) -> RateLimited:
    """The 429 for a key over its ``concurrency`` or ``tpm`` limit."""
    if limit == "concurrency":
        return RateLimited(
            f"Concurrency limit of {spec.max_concurrency} requests reached for this key.",
            retry_after_s=1.0,
        )
    return RateLimited(
        f"Tokens-per-minute limit of {spec.tokens_per_minute} reached for this key; retry in "
        f"{math.ceil(wait_s)} s.",
        retry_after_s=wait_s,
    )


def _header_bytes(value: str) -> bytes:
    """The bytes the client sent for a header value.

    ASGI passes header values as bytes and Starlette decodes them as latin-1, so encoding back
    as latin-1 restores them: a key with non-ASCII characters is hashed on its UTF-8 bytes, as
    its configured SHA-256 was. A string that did not come from a header is encoded as UTF-8.
    """
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode()

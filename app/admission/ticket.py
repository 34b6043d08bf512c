"""A request's place in admission: its tier (with its own targets), model, size and deadline."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from app.fleet.lease import Lease
from app.fleet.routing import RouteKey
from app.settings import TierSpec


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's place in admission."""

    tier: TierSpec
    model: str
    own_tokens: float
    route: RouteKey
    arrival: float
    max_tokens: int | None = None
    own_ttft: bool = False
    """``tier``'s TTFT target is the request's own (its SLO header), not the tier's."""
    fairness: str = ""
    """Whose share of the tier it runs in (:mod:`app.admission.fairshare`): the key's name, or
    the fairness id its key may set; empty without keys."""
    weight: float = 1.0
    """The fairness id's weight: its share of the tier is in proportion to it."""
    running: bool = False
    """Admitted and not ended yet (counted in its fairness id's share)."""
    seq: int = 0
    deadline: float = math.inf
    future: asyncio.Future[Lease] | None = field(default=None, repr=False)

    @property
    def key(self) -> tuple[int, float, int]:
        """Queue order: tier priority, then earliest deadline, then arrival."""
        return (self.tier.priority, self.deadline, self.seq)

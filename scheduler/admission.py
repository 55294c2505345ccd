"""Admission control: bounded global and per-tenant queues.

A new request is admitted while the scheduler holds fewer than `max_live` live requests (queued,
running or preempted) and its tenant fewer than its own limit. Otherwise the answer is a
`Refused(reason, retry_after_s)` the gateway turns into an HTTP status with a Retry-After header:
a full tenant queue is that tenant's problem (429 Too Many Requests), a full scheduler is
everyone's (503 Service Unavailable). Admission never evicts: once admitted, a request leaves only
by finishing, being cancelled or failing, so nothing admitted is ever dropped.

Retry-After estimates when a place frees up: the places missing ÷ the rate at which requests
finish (`drain_per_s`, measured by the caller), clamped to [min_retry_after_s, max_retry_after_s].

>>> ac = AdmissionControl(AdmissionLimits(max_live=2, max_live_per_tenant=1))
>>> ac.admit("a"), ac.admit("b")
(Admitted(), Admitted())
>>> ac.admit("a", drain_per_s=0.5)
Refused(reason='tenant_queue_full', retry_after_s=2.0)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class AdmissionLimits:
    max_live: int = 4096
    max_live_per_tenant: int = 1024
    per_tenant: Mapping[str, int] = field(default_factory=dict)   # overrides by tenant
    min_retry_after_s: float = 1.0
    max_retry_after_s: float = 60.0

    def tenant_limit(self, tenant: str) -> int:
        return self.per_tenant.get(tenant, self.max_live_per_tenant)


@dataclass(frozen=True, slots=True)
class Admitted:
    pass


ADMITTED = Admitted()


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str               # "queue_full" (whole scheduler) or "tenant_queue_full"
    retry_after_s: float

    @property
    def http_status(self) -> int:
        return 429 if self.reason == "tenant_queue_full" else 503


def decide(limits: AdmissionLimits, tenant: str, live: int, live_tenant: int,
           drain_per_s: float | None = None) -> Admitted | Refused:
    """Pure decision for one arrival, given how many live requests there are now."""
    cap = limits.tenant_limit(tenant)
    if live_tenant >= cap:
        return Refused("tenant_queue_full", _retry(limits, live_tenant - cap + 1, drain_per_s))
    if live >= limits.max_live:
        return Refused("queue_full", _retry(limits, live - limits.max_live + 1, drain_per_s))
    return ADMITTED


def _retry(limits: AdmissionLimits, missing: int, drain_per_s: float | None) -> float:
    if not drain_per_s or drain_per_s <= 0:
        return limits.max_retry_after_s
    s = math.ceil(missing / drain_per_s)
    return float(min(max(s, limits.min_retry_after_s), limits.max_retry_after_s))


class AdmissionControl:
    """Counts live requests per tenant; `admit` when one arrives, `release` when one ends."""

    def __init__(self, limits: AdmissionLimits | None = None) -> None:
        self.limits = limits or AdmissionLimits()
        self.live = 0
        self.live_by_tenant: dict[str, int] = {}

    def admit(self, tenant: str, drain_per_s: float | None = None) -> Admitted | Refused:
        result = decide(self.limits, tenant, self.live, self.live_by_tenant.get(tenant, 0),
                        drain_per_s)
        if result is ADMITTED:
            self.live += 1
            self.live_by_tenant[tenant] = self.live_by_tenant.get(tenant, 0) + 1
        return result

    def restore(self, tenant: str) -> None:
        """Count a request admitted before a restart (recovered, never refused: it was admitted)."""
        self.live += 1
        self.live_by_tenant[tenant] = self.live_by_tenant.get(tenant, 0) + 1

    def release(self, tenant: str) -> None:
        n = self.live_by_tenant.get(tenant, 0)
        if n <= 0:
            raise ValueError(f"release for tenant {tenant!r} with no live request")
        self.live -= 1
        if n == 1:
            del self.live_by_tenant[tenant]
        else:
            self.live_by_tenant[tenant] = n - 1

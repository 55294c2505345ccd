"""Per-tenant rate limits (RPM, TPM) and concurrency caps, shared by every gateway replica.

A tenant is charged at two moments, by two owners:

    arrive    a request arriving at a front (REST, gRPC), once its key is known and before its
              body is read: one unit of the tenant's requests per minute, whatever becomes of the
              request (a body that does not parse, a prompt too large, a template that cannot
              render it are requests too: refusals are not free);
    acquire   its admission (gateway/service/admission.py), once its prompt is counted: its tokens
              (prompt + max_tokens) and a concurrency slot, all or nothing; `release` corrects the
              tokens to what was used and frees the slot.

The arithmetic is GCRA (gateway/tenancy/rates.py); the buckets live in process memory or in Redis
(gateway/tenancy/buckets.py: one atomic Lua call per charge, so two replicas enforce one limit).

Concurrency slots are leases: a grant counts against `max_concurrent` until it is released or until
its lease ends (`lease_s`, 30 s by default), so a gateway that dies holding grants frees them by
itself within a lease. A request that runs longer has its lease renewed while it runs
(`renew`, called by `gateway.tenancy.grants.GrantKeeper` every third of a lease). Expired grants
are dropped by the next `acquire` of that tenant.

Clocks: `now` comes from the injected clock (wall time by default), so replicas' clocks should agree
(NTP); a skew of s seconds lets a tenant through up to s × rate early.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Callable

from gateway.tenancy.buckets import MemoryBuckets, RedisBuckets
from gateway.tenancy.rates import (CONCURRENCY_RETRY_S, DEFAULT_LEASE_S, WINDOW_S, Grant,
                                   LimitExceeded, Usage, Verdict, arrival, check, gcra_adjust,
                                   gcra_take, refusal, tpm_closed_s)
from gateway.tenancy.records import Tenant
from gateway.tenancy.tenants import connect_store

__all__ = ["Limiter", "Grant", "LimitExceeded", "Usage", "Verdict", "arrival", "check",
           "gcra_adjust", "gcra_take", "WINDOW_S", "CONCURRENCY_RETRY_S", "DEFAULT_LEASE_S"]


class Limiter:
    """RPM, TPM and concurrency limits per tenant. `max_queued` is not checked here: it bounds the
    scheduler's queue (scheduler.admission, per-tenant limit)."""

    def __init__(self, store_url: str | None = None, prefix: str = "specgate:",
                 clock: Callable[[], float] = time.time, *, lease_s: float = DEFAULT_LEASE_S,
                 timeout_s: float | None = None) -> None:
        """`timeout_s`: what one store call may take (scheduler/store/redis_client.py)."""
        if lease_s <= 0:
            raise ValueError("lease_s must be > 0")
        client = connect_store(store_url, timeout_s)
        self._buckets = MemoryBuckets() if client is None else RedisBuckets(client, prefix)
        self._clock, self.lease_s = clock, lease_s
        # tenant name, rpm -> (when its next arrival can fit, the refusal's verdict): a tenant
        # over its rpm is refused from here until then, with no store call (`closed`)
        self._closed: dict[tuple[str, int], tuple[float, Verdict]] = {}

    @property
    def remote(self) -> bool:
        """Do the buckets live across the network (Redis), so that a call may wait on it?"""
        return isinstance(self._buckets, RedisBuckets)

    def arrive(self, tenant: Tenant) -> None:
        """Charge one request, arriving, to the tenant's requests per minute, or raise
        LimitExceeded ("rpm") charging nothing. A tenant without an rpm costs no store call."""
        if tenant.rpm is None:
            return
        if (closed := self.closed(tenant)) is not None:
            raise closed
        now = self._clock()
        verdict = self._buckets.arrive(tenant, now)
        if not verdict.allowed:
            self._closed[(tenant.name, tenant.rpm)] = (now + verdict.retry_after_s, verdict)
            raise refusal(tenant, 0, verdict)

    def closed(self, tenant: Tenant) -> LimitExceeded | None:
        """The refusal an arrival of `tenant` gets now without asking the store, or None: after
        the store refused one until t, nothing can fit before t (a refused arrival charges
        nothing, and other replicas' arrivals only push t later), so a flood of refused requests
        costs one store call per freed slot, not one each. Keyed by the tenant's rpm, so a
        changed limit asks the store again. Any thread; no I/O."""
        key = (tenant.name, tenant.rpm)
        entry = self._closed.get(key)
        if entry is None:
            return None
        until, verdict = entry
        wait = until - self._clock()
        if wait <= 0:
            self._closed.pop(key, None)
            return None
        return refusal(tenant, 0, replace(verdict, retry_after_s=wait))

    def acquire(self, tenant: Tenant, tokens: int, *, pool: str = "conc") -> Grant:
        """Admit one request that may use `tokens` tokens (prompt + max_tokens), charging those
        tokens and one slot of `pool` (against its `max_concurrent`; a follower's: "follow",
        gateway/followers.py), or nothing: raises LimitExceeded."""
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        grant_id = uuid.uuid4().hex
        verdict = self._buckets.acquire(tenant, tokens, self._clock(), grant_id, self.lease_s, pool)
        if not verdict.allowed:
            raise refusal(tenant, tokens, verdict)
        return Grant(tenant.name, grant_id, tokens, tenant.tpm, pool)

    def precheck(self, tenant: Tenant, tokens: int) -> None:
        """Raise LimitExceeded if a request of at least `tokens` tokens would be refused by
        `acquire` now; charges nothing. For what is known before a request's prompt is tokenized
        (its tenant, a lower bound on its tokens): a tenant over its limits is refused before that
        work is done. A tenant without a tpm or a concurrency cap costs no store call. A tpm
        refusal carries what holds for every request of the tenant (`LimitExceeded.closed_s`,
        `live`): the store was read for it anyway."""
        if tenant.tpm is None and tenant.max_concurrent is None:
            return
        now = self._clock()
        usage = self._buckets.usage(tenant, now)
        verdict = check(tenant, usage, now, tokens)
        if not verdict.allowed:
            exc = refusal(tenant, tokens, verdict)
            if verdict.kind == "tpm" and exc.retryable:     # what holds for any request of it
                exc.closed_s, exc.live = tpm_closed_s(tenant, usage.tpm_tat, now), usage.live
            raise exc

    def release(self, grant: Grant, used_tokens: int) -> None:
        """Free the grant's concurrency slot and correct its TPM charge to `used_tokens` (the
        actual prompt + completion tokens). Releasing twice, or after the lease ended, does
        nothing: a charge is corrected once."""
        if used_tokens < 0:
            raise ValueError("used_tokens must be >= 0")
        self._buckets.release(grant, used_tokens, self._clock())

    def correct(self, grant: Grant, used_tokens: int) -> None:
        """Correct the TPM charge of a grant whose holder died (a gateway killed while the
        request ran, recovered and ended by a new process) to `used_tokens`, and free its slot if
        its lease still holds it. Call once per orphaned grant: unlike `release`, it corrects
        even when the slot is gone (the lease ran out while the gateway was down)."""
        if used_tokens < 0:
            raise ValueError("used_tokens must be >= 0")
        self._buckets.release(grant, used_tokens, self._clock(), orphan=True)

    def renew(self, grant: Grant) -> bool:
        """Extend a live grant's lease by `lease_s` from now (for a very long stream). False if
        the grant was released or its lease already ended."""
        return self._buckets.renew(grant, self._clock(), self.lease_s)

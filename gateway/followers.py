"""Followers are requests: what following a stream may cost its tenant, decided before it starts.

A follower (`GET /v1/chat/completions/{id}/stream`, `GET /v1/responses/{id}?stream=true`, gRPC
`Resume`) asks for no generation, but it holds a connection, an ingress slot (Ray Serve's
`max_ongoing_requests`) and a wait on the state store for as long as the request it follows runs.
So each is charged as a request is, before any other work on it:

    enter   one request to the tenant's rpm (`Limiter.arrive`, as every request arriving at a
            front), then one of its follower slots while it streams (429 `rpm_exceeded` /
            `concurrency_exceeded` with Retry-After, as a generation over its limits gets);
            `leave` gives the slot back, on every path
    charge  one request to the tenant's rpm, no slot: a plain GET of a stored response, which
            is one read and ends at once

Why a cap of its own (`Settings.max_followers_per_tenant`) rather than `max_concurrent`: a
follower's own request usually holds one of its tenant's `max_concurrent` slots already (a
background response, a resumable stream whose client reconnects), so with `max_concurrent: 1`
a tenant could never follow its own running request; and what a follower holds is not verifier
work, which `max_concurrent` bounds, but a connection and an ingress slot, which this bounds, for
every tenant, limits configured or not.

The slots are the limiter's leases (gateway/tenancy/limits.py, a set of their own per tenant),
kept by a `GrantKeeper` (renewed while the follower streams, released however it ends, retried
while Redis does not answer): shared by every replica over one Redis, and a dead replica's free
themselves within a lease. Calls that may wait on Redis run on a worker thread.
"""
from __future__ import annotations

import asyncio
import dataclasses
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, TypeVar

from gateway import errors
from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics
from gateway.tenancy.grants import GrantKeeper
from gateway.tenancy.limits import CONCURRENCY_RETRY_S, Grant, LimitExceeded, Limiter
from gateway.tenancy.records import Tenant

FOLLOW_POOL = "follow"     # the limiter's set of a tenant's follower slots
DEFAULT_MAX_FOLLOWERS = 16
T = TypeVar("T")


class FollowerGate:
    def __init__(self, limiter: Limiter | None, max_per_tenant: int = DEFAULT_MAX_FOLLOWERS, *,
                 metrics: GatewayMetrics | None = None) -> None:
        """`limiter` None: nothing is charged (a deployment without limits, as the generation
        service without a limiter)."""
        if max_per_tenant < 1:
            raise ValueError("max_per_tenant must be >= 1")
        self.limiter = limiter
        self.max_per_tenant = max_per_tenant
        self.metrics = metrics
        self.keeper = GrantKeeper(limiter) if limiter is not None else None

    @asynccontextmanager
    async def held(self, tenant: Tenant) -> AsyncIterator[None]:
        """A follower slot of `tenant`'s while the block runs (`enter`, then `leave`)."""
        grant = await self.enter(tenant)
        try:
            yield
        finally:
            await self.leave(grant)

    async def enter(self, tenant: Tenant) -> Grant | None:
        """Charge one request to `tenant`'s rpm and take one of its follower slots, or raise the
        429 a generation over its limits gets. The slot is renewed until `leave`."""
        if self.limiter is None:
            return None
        grant = await self._call(self._enter, tenant)
        self.keeper.hold(grant)
        return grant

    def _enter(self, tenant: Tenant) -> Grant:
        """(Any thread.) The request charged, then a slot taken: two calls, one thread hop."""
        self.limiter.arrive(tenant)
        capped = dataclasses.replace(tenant, tpm=None, max_concurrent=self.max_per_tenant)
        return self.limiter.acquire(capped, 0, pool=FOLLOW_POOL)

    async def leave(self, grant: Grant | None) -> None:
        """Give a follower's slot back (retried in the background while Redis does not answer;
        the lease frees it at the latest)."""
        if grant is not None and self.keeper is not None:
            await asyncio.shield(asyncio.wrap_future(self.keeper.release(grant, 0)))

    async def charge(self, tenant: Tenant) -> None:
        """Charge one request to `tenant`'s rpm and nothing else (429 `rpm_exceeded` over it)."""
        if self.limiter is None or tenant.rpm is None:
            return
        await self._call(self.limiter.arrive, tenant)

    async def _call(self, fn: Callable[[Tenant], T], tenant: Tenant) -> T:
        """`fn(tenant)`, off the event loop when the limits live in Redis; a refusal as the
        client's 429, Redis down as its 503."""
        try:
            return await errors.store_call(self.limiter.remote, fn, tenant)
        except LimitExceeded as exc:
            raise self._refused(tenant, exc) from None

    def _refused(self, tenant: Tenant, exc: LimitExceeded) -> ApiError:
        """A limiter's refusal as the client's 429, counted (reason "followers" for the cap)."""
        reason = str(exc.kind)
        if exc.kind == "concurrency":
            reason, exc = "followers", cap_refusal(self.max_per_tenant)
        if self.metrics is not None:
            self.metrics.refused(tenant.name, reason, "rate_limited")
        return errors.rate_limited(exc.message, exc.retry_after_s, code=f"{exc.kind}_exceeded")


def cap_refusal(cap: int) -> LimitExceeded:
    """A follower refused past its tenant's `cap` follower slots, in words of the cap: the
    limiter's own would name `max_concurrent`, which is not what refused it. (The early refusal
    of a key past its cap gives the same: gateway/http/refusal_book.py.)"""
    return LimitExceeded("concurrency", CONCURRENCY_RETRY_S,
                         f"Too many streams followed at once: at most {cap}. Try again when one ends.")

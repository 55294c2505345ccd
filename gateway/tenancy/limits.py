"""Per-tenant rate limits (RPM, TPM) and concurrency caps, shared by every gateway replica.

The arithmetic is GCRA (the generic cell rate algorithm: a token bucket kept as one number). A
limit of `n` per minute charges each unit `60 / n` seconds of "theoretical arrival time" (TAT); a
charge is allowed when the new TAT is at most one window (60 s) ahead of now. So a tenant may burst
its whole minute's allowance at once and then continues at the steady rate, and a refused caller
learns exactly when to retry. The same functions (`gcra_take`, `gcra_adjust`, `check`) run in
process memory and, transcribed into one Lua script, in Redis: one EVALSHA per `acquire`, one per
`release`, atomic, so two replicas enforce one limit together.

Redis layout (`P` = prefix; tenant names come last, after a fixed kind):

    P rl:rpm:<tenant>   string  TAT of the request bucket (seconds, as text); expires when the
                                bucket is full again, so an idle tenant leaves nothing behind
    P rl:tpm:<tenant>   string  TAT of the token bucket, same
    P rl:<pool>:<tenant> zset   grant id -> lease expiry (seconds): the tenant's slots (`Grant.pool`)

Concurrency slots are leases: a grant counts against `max_concurrent` until it is released or until
its lease ends (`lease_s`, 30 s by default), so a gateway that dies holding grants frees them by
itself within a lease. A request that runs longer has its lease renewed while it runs
(`renew`, called by `gateway.tenancy.grants.GrantKeeper` every third of a lease). Expired grants
are dropped by the next `acquire` of that tenant.

Clocks: `now` comes from the injected clock (wall time by default), so replicas' clocks should agree
(NTP); a skew of s seconds lets a tenant through up to s × rate early.
"""
from __future__ import annotations

import math
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from gateway.tenancy.records import Tenant

from gateway.tenancy.tenants import connect_store

WINDOW_S = 60.0              # RPM and TPM are per minute
CONCURRENCY_RETRY_S = 1.0    # a slot frees when some request ends: we cannot know when
DEFAULT_LEASE_S = 30.0       # short, and renewed while a request runs: a dead gateway's slots free soon
_EPS = 1e-6                  # float slack: rpm=7 must allow 7 requests, not 6.999…


class LimitExceeded(Exception):
    """A refusal: `kind` is "rpm", "tpm" or "concurrency"; retry after `retry_after_s` seconds.
    `retryable` False: the request can never fit the limit (more tokens than the whole TPM), so
    waiting is useless and the client must change the request."""

    def __init__(self, kind: str, retry_after_s: float, message: str,
                 retryable: bool = True) -> None:
        super().__init__(message)
        self.kind, self.retry_after_s, self.message = kind, retry_after_s, message
        self.retryable = retryable

    @property
    def retry_after_header(self) -> str:
        """The value for an HTTP Retry-After header: whole seconds, at least 1."""
        return str(max(1, math.ceil(self.retry_after_s)))


@dataclass(frozen=True)
class Grant:
    """One admitted request: pass it back to `release` (on any replica) when the request ends."""
    tenant: str
    grant_id: str
    tokens: int                  # tokens charged to the TPM bucket at acquire
    tpm: int | None              # the TPM limit charged against (a later change does not matter)
    pool: str = "conc"           # whose slots it holds (only "conc" grants are kept: `to_list`)

    def to_list(self) -> list:
        """As plain JSON (kept with the request, so a restarted gateway can correct it)."""
        return [self.tenant, self.grant_id, self.tokens, self.tpm]

    @classmethod
    def from_list(cls, v: list) -> "Grant":
        tenant, grant_id, tokens, tpm = v
        return cls(str(tenant), str(grant_id), int(tokens), None if tpm is None else int(tpm))


# ---- pure arithmetic --------------------------------------------------------------------------------
def gcra_take(tat: float, now: float, cost: float, per_minute: int) -> tuple[float | None, float]:
    """Charge `cost` units to a bucket of `per_minute` units per minute whose TAT is `tat`.
    Returns (new TAT, 0.0) if allowed, else (None, seconds until it would be).

    rpm=5: each request costs 12 s. Five requests at t=0 take the TAT to 60 (allowed: 60 - 60 <= 0);
    a sixth would take it to 72, 12 s past the window, so it is refused with retry-after 12.
    >>> gcra_take(60.0, 0.0, 1, 5)
    (None, 12.0)
    >>> gcra_take(60.0, 12.0, 1, 5)
    (72.0, 0.0)
    """
    new_tat = max(tat, now) + cost * WINDOW_S / per_minute
    wait = new_tat - WINDOW_S - now
    return (new_tat, 0.0) if wait <= _EPS else (None, wait)


def gcra_adjust(tat: float, now: float, delta: float, per_minute: int) -> float:
    """The TAT after `delta` more units (negative: a refund). A refund never makes the bucket more
    than full (TAT below now).

    tpm=600 (0.1 s per token): 500 tokens charged at t=0 (TAT 50), 100 used: refund 400 -> TAT 10.
    >>> gcra_adjust(50.0, 0.0, -400, 600)
    10.0
    >>> gcra_adjust(50.0, 45.0, -400, 600)   # by t=45 the bucket has refilled past the refund
    45.0
    """
    return max(max(tat, now) + delta * WINDOW_S / per_minute, now)


@dataclass(frozen=True)
class Usage:
    """What the store holds for one tenant, as of `now`."""
    rpm_tat: float = 0.0
    tpm_tat: float = 0.0
    live: int = 0                # grants whose lease has not ended


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    rpm_tat: float               # the TATs to store when allowed
    tpm_tat: float
    kind: str | None = None      # when refused: the limit that frees last
    retry_after_s: float = 0.0


def check(tenant: Tenant, usage: Usage, now: float, tokens: int) -> Verdict:
    """Admit one request of `tokens` (estimated) tokens, or name the limit that refuses it. When
    several refuse, the one with the longest wait is named (retrying sooner would be useless); ties
    go to rpm, then tpm, then concurrency. A request larger than the whole TPM can never pass: it is
    refused as "tpm" with a full window's wait, which `refusal` marks not retryable."""
    if tenant.tpm is not None and tokens > tenant.tpm:
        return Verdict(False, usage.rpm_tat, usage.tpm_tat, "tpm", WINDOW_S)
    refusals: list[tuple[float, str]] = []
    rpm_tat, tpm_tat = usage.rpm_tat, usage.tpm_tat
    if tenant.rpm is not None:
        new, wait = gcra_take(usage.rpm_tat, now, 1, tenant.rpm)
        rpm_tat = new if new is not None else rpm_tat
        if new is None:
            refusals.append((wait, "rpm"))
    if tenant.tpm is not None:
        new, wait = gcra_take(usage.tpm_tat, now, tokens, tenant.tpm)
        tpm_tat = new if new is not None else tpm_tat
        if new is None:
            refusals.append((wait, "tpm"))
    if tenant.max_concurrent is not None and usage.live >= tenant.max_concurrent:
        refusals.append((CONCURRENCY_RETRY_S, "concurrency"))
    if refusals:
        wait, kind = max(refusals, key=lambda r: r[0])   # max keeps the first of equals
        return Verdict(False, usage.rpm_tat, usage.tpm_tat, kind, wait)
    return Verdict(True, rpm_tat, tpm_tat)


def refusal(tenant: Tenant, tokens: int, verdict: Verdict) -> LimitExceeded:
    """The exception for a refused verdict, in words a client can act on (its own limits only)."""
    wait = verdict.retry_after_s
    if verdict.kind == "rpm":
        text = f"Rate limit reached: {tenant.rpm} requests per minute. Try again in {wait:.1f}s."
    elif verdict.kind == "tpm" and tenant.tpm is not None and tokens > tenant.tpm:
        text = (f"Request too large: it may use {tokens} tokens (prompt + max_tokens), more than "
                f"the limit of {tenant.tpm} tokens per minute. Lower max_tokens or shorten the prompt.")
        return LimitExceeded("tpm", wait, text, retryable=False)
    elif verdict.kind == "tpm":
        text = f"Rate limit reached: {tenant.tpm} tokens per minute. Try again in {wait:.1f}s."
    else:
        text = (f"Too many concurrent requests: at most {tenant.max_concurrent} at a time. "
                f"Try again when one finishes.")
    return LimitExceeded(verdict.kind or "rpm", wait, text)


# ---- where the buckets live ------------------------------------------------------------------------
class _MemoryBuckets:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tats: dict[tuple[str, str], float] = {}           # (kind, tenant) -> TAT
        self._grants: dict[str, dict[str, float]] = {}   # "pool:tenant" -> grant id -> expiry

    def usage(self, tenant: Tenant, now: float) -> Usage:
        with self._lock:
            return self._usage(tenant.name, now)

    def _usage(self, name: str, now: float, pool: str = "conc") -> Usage:
        """The tenant's TATs and its grants still live at `now` (the caller holds the lock)."""
        live = sum(expiry > now for expiry in self._grants.get(f"{pool}:{name}", {}).values())
        return Usage(self._tats.get(("rpm", name), 0.0), self._tats.get(("tpm", name), 0.0), live)

    def acquire(self, tenant: Tenant, tokens: int, now: float, grant_id: str, lease_s: float, pool: str) -> Verdict:
        with self._lock:
            grants = self._grants.setdefault(f"{pool}:{tenant.name}", {})
            for gid in [g for g, expiry in grants.items() if expiry <= now]:
                del grants[gid]
            verdict = check(tenant, self._usage(tenant.name, now, pool), now, tokens)
            if verdict.allowed:
                self._tats[("rpm", tenant.name)] = verdict.rpm_tat
                self._tats[("tpm", tenant.name)] = verdict.tpm_tat
                grants[grant_id] = now + lease_s
            return verdict

    def release(self, grant: Grant, used_tokens: int, now: float, orphan: bool = False) -> bool:
        with self._lock:
            if self._grants.get(f"{grant.pool}:{grant.tenant}", {}).pop(grant.grant_id, None) is None and not orphan:
                return False
            if grant.tpm is not None and used_tokens != grant.tokens:
                key = ("tpm", grant.tenant)
                self._tats[key] = gcra_adjust(self._tats.get(key, 0.0), now,
                                              used_tokens - grant.tokens, grant.tpm)
            return True

    def renew(self, grant: Grant, now: float, lease_s: float) -> bool:
        with self._lock:
            grants = self._grants.get(f"{grant.pool}:{grant.tenant}", {})
            if grants.get(grant.grant_id, 0.0) <= now:
                return False
            grants[grant.grant_id] = now + lease_s
            return True


# `check` and `gcra_take` transcribed; keep the three in step (tests run both stores on one table).
# KEYS: rpm, tpm, conc.  ARGV: now, tokens, rpm, tpm, max_concurrent (0 = unlimited), grant id,
# lease_s, window, concurrency retry, eps.  Returns {1} or {0, kind, retry-after as text}.
_ACQUIRE_LUA = """
local now, tokens = tonumber(ARGV[1]), tonumber(ARGV[2])
local rpm, tpm, cap = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local lease, window, conc_retry, eps = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]),
                                       tonumber(ARGV[10])
local function fmt(x) return string.format('%.17g', x) end
if tpm > 0 and tokens > tpm then return {0, 'tpm', fmt(window)} end
local worst, worst_kind = -1, nil
local function take(key, cost, per_minute, kind)
  local v = redis.call('GET', key)
  local tat = v and tonumber(v) or 0
  local new = math.max(tat, now) + cost * window / per_minute
  local wait = new - window - now
  if wait > eps then
    if wait > worst then worst, worst_kind = wait, kind end
    return nil
  end
  return new
end
local new_rpm, new_tpm
if rpm > 0 then new_rpm = take(KEYS[1], 1, rpm, 'rpm') end
if tpm > 0 then new_tpm = take(KEYS[2], tokens, tpm, 'tpm') end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', fmt(now))
if cap > 0 and redis.call('ZCARD', KEYS[3]) >= cap and conc_retry > worst then
  worst, worst_kind = conc_retry, 'concurrency'
end
if worst_kind then return {0, worst_kind, fmt(worst)} end
local function store(key, tat)
  if tat then redis.call('SET', key, fmt(tat), 'PX', math.ceil((tat - now) * 1000) + 1000) end
end
store(KEYS[1], new_rpm)
store(KEYS[2], new_tpm)
redis.call('ZADD', KEYS[3], fmt(now + lease), ARGV[6])
redis.call('PEXPIRE', KEYS[3], math.ceil(lease * 1000) + 1000)
return {1}
"""

# `gcra_adjust` transcribed.  KEYS: tpm, conc.  ARGV: grant id, delta tokens, tpm (0 = none), now,
# window, orphan ('1': correct the charge even though the slot is gone).  Returns 1 if the grant was
# live (released now) or orphaned, 0 if it was released or expired before.
_RELEASE_LUA = """
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 and ARGV[6] ~= '1' then return 0 end
local delta, tpm, now, window = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]),
                                tonumber(ARGV[5])
if tpm > 0 and delta ~= 0 then
  local v = redis.call('GET', KEYS[1])
  local tat = v and tonumber(v) or 0
  tat = math.max(math.max(tat, now) + delta * window / tpm, now)
  if tat > now then
    redis.call('SET', KEYS[1], string.format('%.17g', tat), 'PX', math.ceil((tat - now) * 1000) + 1000)
  else
    redis.call('DEL', KEYS[1])
  end
end
return 1
"""

# KEYS: conc.  ARGV: grant id, now, new expiry, the key's TTL in ms.  Renews a live lease only,
# and keeps the set itself alive as long (its TTL was set at the last acquire: without this a
# renewed grant would vanish with the set a lease after the tenant's last acquire).
_RENEW_LUA = """
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expiry or tonumber(expiry) <= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[4]) then redis.call('PEXPIRE', KEYS[1], ARGV[4]) end
return 1
"""


class _RedisBuckets:
    def __init__(self, client, prefix: str) -> None:
        self._prefix = prefix + "rl:"
        self._client = client
        self._acquire = client.register_script(_ACQUIRE_LUA)
        self._release = client.register_script(_RELEASE_LUA)
        self._renew = client.register_script(_RENEW_LUA)

    def _key(self, kind: str, tenant: str) -> str:
        return f"{self._prefix}{kind}:{tenant}"

    def acquire(self, tenant: Tenant, tokens: int, now: float, grant_id: str, lease_s: float, pool: str) -> Verdict:
        name = tenant.name
        reply = self._acquire(
            keys=[self._key("rpm", name), self._key("tpm", name), self._key(pool, name)],
            args=[repr(now), tokens, tenant.rpm or 0, tenant.tpm or 0, tenant.max_concurrent or 0,
                  grant_id, repr(lease_s), repr(WINDOW_S), repr(CONCURRENCY_RETRY_S), repr(_EPS)])
        if int(reply[0]) == 1:
            return Verdict(True, 0.0, 0.0)          # TATs stay in Redis
        return Verdict(False, 0.0, 0.0, reply[1].decode(), float(reply[2]))

    def usage(self, tenant: Tenant, now: float) -> Usage:
        """Read only, one round trip: the TATs and the live grants."""
        name = tenant.name
        pipe = self._client.pipeline(transaction=False)
        pipe.get(self._key("rpm", name))
        pipe.get(self._key("tpm", name))
        pipe.zcount(self._key("conc", name), f"({now!r}", "+inf")
        rpm, tpm, live = pipe.execute()
        return Usage(float(rpm) if rpm else 0.0, float(tpm) if tpm else 0.0, int(live))

    def release(self, grant: Grant, used_tokens: int, now: float, orphan: bool = False) -> bool:
        return bool(self._release(
            keys=[self._key("tpm", grant.tenant), self._key(grant.pool, grant.tenant)],
            args=[grant.grant_id, used_tokens - grant.tokens, grant.tpm or 0, repr(now),
                  repr(WINDOW_S), "1" if orphan else "0"]))

    def renew(self, grant: Grant, now: float, lease_s: float) -> bool:
        return bool(self._renew(keys=[self._key(grant.pool, grant.tenant)],
                                args=[grant.grant_id, repr(now), repr(now + lease_s),
                                      math.ceil(lease_s * 1000) + 1000]))


# ---- the limiter ------------------------------------------------------------------------------------
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
        self._buckets = _MemoryBuckets() if client is None else _RedisBuckets(client, prefix)
        self._clock, self.lease_s = clock, lease_s

    @property
    def remote(self) -> bool:
        """Do the buckets live across the network (Redis), so that a call may wait on it?"""
        return isinstance(self._buckets, _RedisBuckets)

    def acquire(self, tenant: Tenant, tokens: int, *, pool: str = "conc") -> Grant:
        """Admit one request that may use `tokens` tokens (prompt + max_tokens), charging one
        request, those tokens and a slot of `pool` (its max_concurrent), or nothing: LimitExceeded."""
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        grant_id = uuid.uuid4().hex
        verdict = self._buckets.acquire(tenant, tokens, self._clock(), grant_id, self.lease_s, pool)
        if not verdict.allowed:
            raise refusal(tenant, tokens, verdict)
        return Grant(tenant.name, grant_id, tokens, tenant.tpm, pool)

    def precheck(self, tenant: Tenant, tokens: int) -> None:
        """Raise LimitExceeded if a request of at least `tokens` tokens would be refused now;
        charges nothing. For what is known before a request's prompt is tokenized (its tenant, a
        lower bound on its tokens): a tenant over its limits is refused before that work is done.
        A tenant without limits costs no store call."""
        if tenant.rpm is None and tenant.tpm is None and tenant.max_concurrent is None:
            return
        now = self._clock()
        verdict = check(tenant, self._buckets.usage(tenant, now), now, tokens)
        if not verdict.allowed:
            raise refusal(tenant, tokens, verdict)

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

"""Where the rate-limit buckets live: process memory, or Redis (one Lua call per charge, atomic,
so two replicas enforce one limit together). Both run gateway/tenancy/rates.py's arithmetic; the
Lua scripts transcribe it (keep them in step: tests run both stores on one table).

Redis layout (`P` = prefix; tenant names come last, after a fixed kind):

    P rl:rpm:<tenant>   string  TAT of the request bucket (seconds, as text); expires when the
                                bucket is full again, so an idle tenant leaves nothing behind
    P rl:tpm:<tenant>   string  TAT of the token bucket, same
    P rl:conc:<tenant>  zset    grant id -> lease expiry (seconds): the tenant's requests in flight
    P rl:<pool>:<tenant> zset   the same for another pool of slots (`Grant.pool`; gateway/followers.py)
"""
from __future__ import annotations

import math
import threading

from gateway.tenancy.rates import (CONCURRENCY_RETRY_S, EPS, WINDOW_S, Grant, Usage, Verdict,
                                   arrival, check, gcra_adjust)
from gateway.tenancy.records import Tenant


class MemoryBuckets:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tats: dict[tuple[str, str], float] = {}           # (kind, tenant) -> TAT
        self._grants: dict[str, dict[str, float]] = {}   # "pool:tenant" -> grant id -> expiry

    def arrive(self, tenant: Tenant, now: float) -> Verdict:
        with self._lock:
            verdict = arrival(tenant, self._tats.get(("rpm", tenant.name), 0.0), now)
            if verdict.allowed:
                self._tats[("rpm", tenant.name)] = verdict.tat
            return verdict

    def usage(self, tenant: Tenant, now: float) -> Usage:
        with self._lock:
            return self._usage(tenant.name, now)

    def _usage(self, name: str, now: float, pool: str = "conc") -> Usage:
        """The tenant's token TAT and its grants still live at `now` (the caller holds the lock)."""
        live = sum(expiry > now for expiry in self._grants.get(f"{pool}:{name}", {}).values())
        return Usage(self._tats.get(("tpm", name), 0.0), live)

    def acquire(self, tenant: Tenant, tokens: int, now: float, grant_id: str, lease_s: float,
                pool: str) -> Verdict:
        with self._lock:
            grants = self._grants.setdefault(f"{pool}:{tenant.name}", {})
            for gid in [g for g, expiry in grants.items() if expiry <= now]:
                del grants[gid]
            verdict = check(tenant, self._usage(tenant.name, now, pool), now, tokens)
            if verdict.allowed:
                self._tats[("tpm", tenant.name)] = verdict.tat
                grants[grant_id] = now + lease_s
            return verdict

    def release(self, grant: Grant, used_tokens: int, now: float, orphan: bool = False) -> bool:
        with self._lock:
            held = self._grants.get(f"{grant.pool}:{grant.tenant}", {})
            if held.pop(grant.grant_id, None) is None and not orphan:
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


# `arrival` transcribed.  KEYS: rpm.  ARGV: now, rpm, window, eps.
# Returns {1} or {0, retry-after as text}.
_ARRIVE_LUA = """
local now, rpm, window, eps = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
                              tonumber(ARGV[4])
local v = redis.call('GET', KEYS[1])
local tat = v and tonumber(v) or 0
local new = math.max(tat, now) + window / rpm
local wait = new - window - now
if wait > eps then return {0, string.format('%.17g', wait)} end
redis.call('SET', KEYS[1], string.format('%.17g', new), 'PX', math.ceil((new - now) * 1000) + 1000)
return {1}
"""

# `check` and `gcra_take` transcribed.  KEYS: tpm, conc.  ARGV: now, tokens, tpm,
# max_concurrent (0 = unlimited), grant id, lease_s, window, concurrency retry, eps.
# Returns {1} or {0, kind, retry-after as text}.
_ACQUIRE_LUA = """
local now, tokens = tonumber(ARGV[1]), tonumber(ARGV[2])
local tpm, cap = tonumber(ARGV[3]), tonumber(ARGV[4])
local lease, window, conc_retry, eps = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]),
                                       tonumber(ARGV[9])
local function fmt(x) return string.format('%.17g', x) end
if tpm > 0 and tokens > tpm then return {0, 'tpm', fmt(window)} end
local worst, worst_kind = -1, nil
local new_tpm
if tpm > 0 then
  local v = redis.call('GET', KEYS[1])
  local tat = v and tonumber(v) or 0
  local new = math.max(tat, now) + tokens * window / tpm
  local wait = new - window - now
  if wait > eps then worst, worst_kind = wait, 'tpm' else new_tpm = new end
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', fmt(now))
if cap > 0 and redis.call('ZCARD', KEYS[2]) >= cap and conc_retry > worst then
  worst, worst_kind = conc_retry, 'concurrency'
end
if worst_kind then return {0, worst_kind, fmt(worst)} end
if new_tpm then
  redis.call('SET', KEYS[1], fmt(new_tpm), 'PX', math.ceil((new_tpm - now) * 1000) + 1000)
end
redis.call('ZADD', KEYS[2], fmt(now + lease), ARGV[5])
redis.call('PEXPIRE', KEYS[2], math.ceil(lease * 1000) + 1000)
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


class RedisBuckets:
    def __init__(self, client, prefix: str) -> None:
        self._prefix = prefix + "rl:"
        self._client = client
        self._arrive = client.register_script(_ARRIVE_LUA)
        self._acquire = client.register_script(_ACQUIRE_LUA)
        self._release = client.register_script(_RELEASE_LUA)
        self._renew = client.register_script(_RENEW_LUA)

    def _key(self, kind: str, tenant: str) -> str:
        return f"{self._prefix}{kind}:{tenant}"

    def arrive(self, tenant: Tenant, now: float) -> Verdict:
        if tenant.rpm is None:
            return Verdict(True, 0.0)
        reply = self._arrive(keys=[self._key("rpm", tenant.name)],
                             args=[repr(now), tenant.rpm, repr(WINDOW_S), repr(EPS)])
        if int(reply[0]) == 1:
            return Verdict(True, 0.0)               # the TAT stays in Redis
        return Verdict(False, 0.0, "rpm", float(reply[1]))

    def acquire(self, tenant: Tenant, tokens: int, now: float, grant_id: str, lease_s: float,
                pool: str) -> Verdict:
        name = tenant.name
        reply = self._acquire(
            keys=[self._key("tpm", name), self._key(pool, name)],
            args=[repr(now), tokens, tenant.tpm or 0, tenant.max_concurrent or 0,
                  grant_id, repr(lease_s), repr(WINDOW_S), repr(CONCURRENCY_RETRY_S), repr(EPS)])
        if int(reply[0]) == 1:
            return Verdict(True, 0.0)               # the TAT stays in Redis
        return Verdict(False, 0.0, reply[1].decode(), float(reply[2]))

    def usage(self, tenant: Tenant, now: float) -> Usage:
        """Read only, one round trip: the token TAT and the live grants."""
        name = tenant.name
        pipe = self._client.pipeline(transaction=False)
        pipe.get(self._key("tpm", name))
        pipe.zcount(self._key("conc", name), f"({now!r}", "+inf")
        tpm, live = pipe.execute()
        return Usage(float(tpm) if tpm else 0.0, int(live))

    def release(self, grant: Grant, used_tokens: int, now: float, orphan: bool = False) -> bool:
        return bool(self._release(
            keys=[self._key("tpm", grant.tenant), self._key(grant.pool, grant.tenant)],
            args=[grant.grant_id, used_tokens - grant.tokens, grant.tpm or 0, repr(now),
                  repr(WINDOW_S), "1" if orphan else "0"]))

    def renew(self, grant: Grant, now: float, lease_s: float) -> bool:
        return bool(self._renew(keys=[self._key(grant.pool, grant.tenant)],
                                args=[grant.grant_id, repr(now), repr(now + lease_s),
                                      math.ceil(lease_s * 1000) + 1000]))

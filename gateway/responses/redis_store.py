"""Stored responses in Redis, under the shared prefix `P`, each tenant's counted as they come and go
(`T` = a tenant's id, `ID` = a response's):

    P resp:ID          hash    header   JSON: the Header (its tenant id included)
                               final    JSON: status, reason, text, output_ids, context,
                                        input_tokens, ended_at; written once it has ended
                               tenant   T: whose quota it counts against
                               (PEXPIRE: the tenant's TTL, from its creation)
    P resp_t:T         zset    the tenant's stored response ids, scored by when each expires
                               (ms, Redis's clock): ZCARD is its count
    P resp_b:T         hash    ID -> the bytes counted for it (header, then final); "#" -> their sum
    P resp_tenants     set     the tenants that may hold stored responses (the removal sweep's)

Keys expire in Redis; the tenant's sorted set and byte counts are trimmed of what has expired at
its next put (at most `TRIM` ids a put: each id is trimmed once, so this costs O(1) a put over
time). Every call is one EVALSHA, atomic, so two replicas never let a tenant past its quota.
A full Redis (`maxmemory`): a put is refused before it writes anything (its first command adds
data); a delete still frees (its first command deletes, so Redis runs the script to its end).
Keys are named inside the scripts from the response's tenant: a single Redis server (or a
replicated one), as the scheduler's store (scheduler/store/redis_store.py), not Redis Cluster.
"""
from __future__ import annotations

import json
from typing import Any

from gateway.responses.objects import Header, Stored
from gateway.responses.quota import KEPT, TAKEN, Kept, Quota, dumps, header_json

TRIM = 1000             # expired ids a put trims from its tenant's count at most
DROP_BATCH = 500        # responses a tenant's removal deletes per round trip

# KEYS: resp:ID, resp_t:T, resp_b:T, resp_tenants.  ARGV: header, TTL (ms), ID, T, max count,
# max bytes (-1: none), TRIM. Returns {1} kept, {0} the id is taken, {-1 count | -2 bytes, size,
# ms until the tenant's first response expires (-1: it has none)} over its quota: nothing kept.
# NOTE: HSETNX first: it adds data, so a full Redis refuses the script there, having written
# nothing (a script that has written cannot be stopped, and would then be let through).
_PUT_LUA = """
if redis.call('HSETNX', KEYS[1], 'header', ARGV[1]) == 0 then return {0} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, tonumber(ARGV[7]))
if #due > 0 then
  local freed = 0
  for _, size in ipairs(redis.call('HMGET', KEYS[3], unpack(due))) do
    freed = freed + (tonumber(size) or 0)
  end
  redis.call('ZREM', KEYS[2], unpack(due))
  redis.call('HDEL', KEYS[3], unpack(due))
  redis.call('HINCRBY', KEYS[3], '#', -freed)
end
local size = string.len(ARGV[1])
local over = 0
if tonumber(ARGV[5]) >= 0 and redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[5]) then
  over = -1
elseif tonumber(ARGV[6]) >= 0 and tonumber(redis.call('HGET', KEYS[3], '#') or '0') + size
    > tonumber(ARGV[6]) then
  over = -2
end
if over ~= 0 then
  redis.call('DEL', KEYS[1])
  local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  return {over, size, #first > 0 and (tonumber(first[2]) - now) or -1}
end
local ttl = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'tenant', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[3])
redis.call('HSET', KEYS[3], ARGV[3], size)
redis.call('HINCRBY', KEYS[3], '#', size)
for i = 2, 3 do                      -- the count outlives none of its responses, and no more
  if redis.call('PTTL', KEYS[i]) < ttl then redis.call('PEXPIRE', KEYS[i], ttl) end
end
redis.call('SADD', KEYS[4], ARGV[4])
return {1}
"""

# KEYS: resp:ID.  ARGV: final, P, ID. Writes only into a live key, so that a late final never
# recreates an expired or deleted response (without a TTL, for ever); recounts its bytes.
_FINALIZE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'final', ARGV[1])
local tenant = redis.call('HGET', KEYS[1], 'tenant')
if tenant then
  local counts = ARGV[2] .. 'resp_b:' .. tenant
  local was = redis.call('HGET', counts, ARGV[3])
  if was then
    local size = redis.call('HSTRLEN', KEYS[1], 'header') + string.len(ARGV[1])
    redis.call('HSET', counts, ARGV[3], size)
    redis.call('HINCRBY', counts, '#', size - tonumber(was))
  end
end
return 1
"""

# KEYS: resp:ID.  ARGV: P, ID.  NOTE: DEL first: it frees, so a full Redis runs it, and then the
# rest of the script (which adds nothing) with it.
_DELETE_LUA = """
local tenant = redis.call('HGET', KEYS[1], 'tenant')
local n = redis.call('DEL', KEYS[1])
if n == 1 and tenant then
  redis.call('ZREM', ARGV[1] .. 'resp_t:' .. tenant, ARGV[2])
  local counts = ARGV[1] .. 'resp_b:' .. tenant
  local size = redis.call('HGET', counts, ARGV[2])
  if size then
    redis.call('HDEL', counts, ARGV[2])
    redis.call('HINCRBY', counts, '#', -tonumber(size))
  end
end
return n
"""

# KEYS: resp_t:T, resp_b:T, resp_tenants.  ARGV: T. The tenant's last step out, once it holds
# nothing (else 0: a put came in meanwhile, and its removal goes on).
_FORGET_TENANT_LUA = """
if redis.call('ZCARD', KEYS[1]) > 0 then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('SREM', KEYS[3], ARGV[1])
return 1
"""


class RedisResponses:
    remote = True

    def __init__(self, client: Any, prefix: str, ttl_s: float) -> None:
        self._r = client
        self._prefix = prefix
        self.ttl_s = ttl_s
        self._tenants_key = prefix + "resp_tenants"
        self._put = client.register_script(_PUT_LUA)
        self._finalize = client.register_script(_FINALIZE_LUA)
        self._delete = client.register_script(_DELETE_LUA)
        self._forget_tenant = client.register_script(_FORGET_TENANT_LUA)

    def _key(self, response_id: str) -> str:
        return self._prefix + "resp:" + response_id

    def _tenant_keys(self, tenant_id: str) -> tuple[str, str]:
        return self._prefix + "resp_t:" + tenant_id, self._prefix + "resp_b:" + tenant_id

    def put(self, header: Header, quota: Quota | None = None) -> Kept:
        quota = quota if quota is not None else Quota(self.ttl_s)
        tid = header.tenant_id
        verdict = self._put(
            keys=[self._key(header.id), *self._tenant_keys(tid), self._tenants_key],
            args=[header_json(header), max(1, round(quota.ttl_s * 1000)), header.id, tid,
                  _cap(quota.max_count), _cap(quota.max_bytes), TRIM])
        if verdict[0] == 1:
            return KEPT
        if verdict[0] == 0:
            return TAKEN
        _, size, wait_ms = verdict
        return Kept(False, "count" if verdict[0] == -1 else "bytes", int(size),
                    None if wait_ms < 0 else max(wait_ms, 0) / 1000)

    def get(self, response_id: str) -> Stored | None:
        header, final = self._r.hmget(self._key(response_id), "header", "final")
        if header is None:
            return None
        return Stored(Header.from_dict(json.loads(header)), json.loads(final) if final else None)

    def finalize(self, response_id: str, final: dict[str, Any]) -> bool:
        return bool(self._finalize(keys=[self._key(response_id)],
                                   args=[dumps(final), self._prefix, response_id]))

    def delete(self, response_id: str) -> bool:
        return bool(self._delete(keys=[self._key(response_id)], args=[self._prefix, response_id]))

    def drop_tenant(self, tenant_id: str) -> int:
        ids_key, counts_key = self._tenant_keys(tenant_id)
        dropped = 0
        while True:
            ids = self._r.zrange(ids_key, 0, DROP_BATCH - 1)
            if not ids:
                if self._forget_tenant(keys=[ids_key, counts_key, self._tenants_key],
                                       args=[tenant_id]):
                    return dropped
                continue
            pipe = self._r.pipeline(transaction=False)
            pipe.delete(*[self._key(_text(i)) for i in ids])
            pipe.zrem(ids_key, *ids)
            dropped += pipe.execute()[0]

    def tenants(self) -> set[str]:
        return {_text(t) for t in self._r.smembers(self._tenants_key)}


def _cap(limit: int | None) -> int:
    return -1 if limit is None else int(limit)


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x

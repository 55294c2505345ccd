"""Where tenants and their keys are stored: in process memory or in Redis, with one semantics.

`gateway.tenancy.tenants.TenantRegistry` is the only user; it picks a backend by the store URL.
Each call of a backend is atomic (one lock, or one Lua script), so a key is never owned by two
tenants, nor by a tenant and the admins, even for a moment. Redis layout (`P` = prefix):

    P tenants:cfg      hash  tenant name -> tenant JSON (`tenant_to_dict` and the tenant's
                             immutable "id", first; no keys, no digests)
    P tenants:owner    hash  key digest -> tenant name          (what `authenticate` reads)
    P tenants:keys     hash  tenant name -> its key digests, space-separated (for remove/rotate)
    P tenants:expiry   hash  key digest -> Redis time (s) after which it stops working: a key
                             rotated out with a grace period (`rotate_key(name, grace_s)`)
    P tenants:admins   set   admin key digests
    P tenants:applied  hash  tenant name, or "@admins" -> fingerprint of the tenants-file entry
                             (of the configured admin keys) last applied (see `load_config`)

Grace deadlines are kept in Redis' own clock (TIME), so replicas whose clocks disagree still end
a rotated-out key at one moment.

A tenant's id is made by the `put` that creates it and kept by every later `put` of its name
(spliced into the stored JSON in the same atomic step); `remove` returns the removed JSON, id
included, so the caches keyed by it can be dropped.
"""
from __future__ import annotations

import json
import threading
import time

from gateway.tenancy.records import new_tenant_id

OK, NOT_EMPTY, NO_TENANT, KEY_CONFLICT, ADMIN_CONFLICT = 1, 0, -1, -2, -3   # what `put` answers
REVOKED, NOT_ADMIN, OWN_KEY, LAST_ADMIN = 1, -1, -2, -3            # what `revoke_admin` answers


def with_id(cfg: str, tenant_id: str) -> str:
    """The stored JSON: `cfg` (an object) with "id" put first, as `_PUT_LUA` does."""
    return '{"id":' + json.dumps(tenant_id) + "," + cfg[1:]


def stored_id(stored: str | None) -> str | None:
    if stored is None:
        return None
    tenant_id = json.loads(stored).get("id")
    return tenant_id if isinstance(tenant_id, str) else None


class MemoryBackend:
    """Same semantics as `RedisBackend`, for one process. One lock makes each call atomic."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cfg: dict[str, str] = {}
        self._owner: dict[str, str] = {}
        self._keys: dict[str, list[str]] = {}
        self._expiry: dict[str, float] = {}
        self._admins: set[str] = set()
        self._applied: dict[str, str] = {}

    def _owned(self, digest: str, now: float) -> str | None:
        """The tenant owning `digest` at `now` (a rotated-out key past its grace owns nothing)."""
        name = self._owner.get(digest)
        return name if name is not None and self._expiry.get(digest, now + 1) > now else None

    def lookup(self, digest: str) -> str | None:
        with self._lock:
            name = self._owned(digest, time.time())
            return self._cfg.get(name) if name else None

    def get(self, name: str) -> str | None:
        return self._cfg.get(name)

    def all(self) -> list[str]:
        with self._lock:
            return list(self._cfg.values())

    def put(self, name: str, cfg: str | None, digests: list[str] | None,
            only_if_empty: bool = False, grace_s: float = 0.0) -> int:
        with self._lock:
            now = time.time()
            if only_if_empty and self._cfg:
                return NOT_EMPTY
            if cfg is None and name not in self._cfg:
                return NO_TENANT
            if digests is not None:
                if any(self._owner.get(d, name) != name for d in digests):
                    return KEY_CONFLICT
                if any(d in self._admins for d in digests):
                    return ADMIN_CONFLICT
                kept = []
                for d in self._keys.pop(name, []):
                    if d in digests:
                        continue
                    if grace_s > 0 and self._owned(d, now):
                        self._expiry[d] = min(self._expiry.get(d, now + grace_s), now + grace_s)
                        kept.append(d)
                    else:
                        del self._owner[d]
                        self._expiry.pop(d, None)
                for d in digests:
                    self._owner[d] = name
                    self._expiry.pop(d, None)
                self._keys[name] = list(digests) + kept
            if cfg is not None:      # a tenant keeps its id; a new one gets a fresh one
                self._cfg[name] = with_id(cfg, stored_id(self._cfg.get(name)) or new_tenant_id())
            return OK

    def remove(self, name: str) -> str | None:
        with self._lock:
            cfg = self._cfg.pop(name, None)
            if cfg is None:
                return None
            for d in self._keys.pop(name, []):
                del self._owner[d]
                self._expiry.pop(d, None)
            return cfg

    def is_admin(self, digest: str) -> bool:
        return digest in self._admins

    def add_admins(self, digests: list[str]) -> None:
        with self._lock:
            self._admins |= set(digests)

    def replace_admins(self, digests: list[str]) -> int:
        with self._lock:
            now = time.time()
            for i, d in enumerate(digests):
                if self._owned(d, now):
                    return i
            self._admins = set(digests)
            return -1

    def revoke_admin(self, digest: str, caller: str) -> int:
        with self._lock:
            if digest not in self._admins:
                return NOT_ADMIN
            if digest == caller:
                return OWN_KEY
            if len(self._admins) <= 1:
                return LAST_ADMIN
            self._admins.discard(digest)
            return REVOKED

    def applied(self) -> dict[str, str]:
        return dict(self._applied)

    def mark_applied(self, name: str, fingerprint: str) -> None:
        self._applied[name] = fingerprint


# Every script below that reads expiry takes "now" from Redis (TIME), so that one clock decides.
_NOW_LUA = "local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1e6\n"

# KEYS: cfg, owner, keys, expiry, admins.  ARGV: name, config JSON ("" = keep; the tenant must
# exist), "1" to replace the tenant's keys with ARGV[7:] / "0" to keep them, "1" = only if no
# tenant exists, grace seconds for the keys replaced (0: they stop at once), the id a new tenant
# gets (an existing one keeps its own).
_PUT_LUA = _NOW_LUA + """
local name, cfg, replace, grace = ARGV[1], ARGV[2], ARGV[3] == '1', tonumber(ARGV[5])
if ARGV[4] == '1' and redis.call('HLEN', KEYS[1]) > 0 then return 0 end
if cfg == '' and redis.call('HEXISTS', KEYS[1], name) == 0 then return -1 end
if replace then
  local new = {}
  for i = 7, #ARGV do
    local owner = redis.call('HGET', KEYS[2], ARGV[i])
    if owner and owner ~= name then return -2 end
    if redis.call('SISMEMBER', KEYS[5], ARGV[i]) == 1 then return -3 end
    new[ARGV[i]] = true
  end
  local keep = {}
  local old = redis.call('HGET', KEYS[3], name)
  if old then
    for d in string.gmatch(old, '%S+') do
      if not new[d] then
        local exp = tonumber(redis.call('HGET', KEYS[4], d) or '')
        if grace > 0 and (not exp or exp > now) then
          local until_ = now + grace
          if exp and exp < until_ then until_ = exp end
          redis.call('HSET', KEYS[4], d, string.format('%.17g', until_))
          keep[#keep + 1] = d
        else
          redis.call('HDEL', KEYS[2], d)
          redis.call('HDEL', KEYS[4], d)
        end
      end
    end
  end
  local all = {}
  for i = 7, #ARGV do
    redis.call('HSET', KEYS[2], ARGV[i], name)
    redis.call('HDEL', KEYS[4], ARGV[i])
    all[#all + 1] = ARGV[i]
  end
  for _, d in ipairs(keep) do all[#all + 1] = d end
  redis.call('HSET', KEYS[3], name, table.concat(all, ' '))
end
if cfg ~= '' then
  local id, old = ARGV[6], redis.call('HGET', KEYS[1], name)
  if old then
    local ok, rec = pcall(cjson.decode, old)
    if ok and type(rec) == 'table' and type(rec['id']) == 'string' then id = rec['id'] end
  end
  redis.call('HSET', KEYS[1], name, '{"id":' .. cjson.encode(id) .. ',' .. string.sub(cfg, 2))
end
return 1
"""

# KEYS: cfg, owner, keys, expiry.  ARGV: name.  Returns the removed tenant's JSON, or nil.
_REMOVE_LUA = """
local cfg = redis.call('HGET', KEYS[1], ARGV[1])
if not cfg then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
local old = redis.call('HGET', KEYS[3], ARGV[1])
if old then
  for d in string.gmatch(old, '%S+') do
    redis.call('HDEL', KEYS[2], d)
    redis.call('HDEL', KEYS[4], d)
  end
end
redis.call('HDEL', KEYS[3], ARGV[1])
return cfg
"""

# KEYS: cfg, owner, expiry.  ARGV: digest.  The owning tenant's config JSON, or nil (also for a
# rotated-out key past its grace: it is dropped at the tenant's next key change).
_LOOKUP_LUA = _NOW_LUA + """
local name = redis.call('HGET', KEYS[2], ARGV[1])
if not name then return false end
local exp = redis.call('HGET', KEYS[3], ARGV[1])
if exp and tonumber(exp) <= now then return false end
return redis.call('HGET', KEYS[1], name)
"""

# KEYS: admins, owner, expiry.  ARGV: digests.  Replaces the admin set, unless a digest is a
# (live) tenant key: then nothing changes and its 0-based index is returned. -1 = replaced.
_REPLACE_ADMINS_LUA = _NOW_LUA + """
for i = 1, #ARGV do
  if redis.call('HEXISTS', KEYS[2], ARGV[i]) == 1 then
    local exp = redis.call('HGET', KEYS[3], ARGV[i])
    if not exp or tonumber(exp) > now then return i - 1 end
  end
end
redis.call('DEL', KEYS[1])
if #ARGV > 0 then redis.call('SADD', KEYS[1], unpack(ARGV)) end
return -1
"""

# KEYS: admins.  ARGV: digest to revoke, the caller's digest.
_REVOKE_ADMIN_LUA = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 0 then return -1 end
if ARGV[1] == ARGV[2] then return -2 end
if redis.call('SCARD', KEYS[1]) <= 1 then return -3 end
redis.call('SREM', KEYS[1], ARGV[1])
return 1
"""


class RedisBackend:
    def __init__(self, client, prefix: str) -> None:
        self._r = client
        p = prefix + "tenants:"
        self._cfg, self._owner, self._keys = p + "cfg", p + "owner", p + "keys"
        self._expiry, self._admins, self._applied = p + "expiry", p + "admins", p + "applied"
        self._put = client.register_script(_PUT_LUA)
        self._remove = client.register_script(_REMOVE_LUA)
        self._lookup = client.register_script(_LOOKUP_LUA)
        self._replace_admins = client.register_script(_REPLACE_ADMINS_LUA)
        self._revoke_admin = client.register_script(_REVOKE_ADMIN_LUA)

    def lookup(self, digest: str) -> str | None:
        v = self._lookup(keys=[self._cfg, self._owner, self._expiry], args=[digest])
        return v.decode() if v else None

    def get(self, name: str) -> str | None:
        v = self._r.hget(self._cfg, name)
        return v.decode() if v else None

    def all(self) -> list[str]:
        return [v.decode() for v in self._r.hvals(self._cfg)]

    def put(self, name: str, cfg: str | None, digests: list[str] | None,
            only_if_empty: bool = False, grace_s: float = 0.0) -> int:
        return int(self._put(keys=[self._cfg, self._owner, self._keys, self._expiry, self._admins],
                             args=[name, cfg or "", "0" if digests is None else "1",
                                   "1" if only_if_empty else "0", repr(float(grace_s)),
                                   new_tenant_id(), *(digests or ())]))

    def remove(self, name: str) -> str | None:
        v = self._remove(keys=[self._cfg, self._owner, self._keys, self._expiry], args=[name])
        return v.decode() if v else None

    def is_admin(self, digest: str) -> bool:
        return bool(self._r.sismember(self._admins, digest))

    def add_admins(self, digests: list[str]) -> None:
        if digests:
            self._r.sadd(self._admins, *digests)

    def replace_admins(self, digests: list[str]) -> int:
        return int(self._replace_admins(keys=[self._admins, self._owner, self._expiry], args=digests))

    def revoke_admin(self, digest: str, caller: str) -> int:
        return int(self._revoke_admin(keys=[self._admins], args=[digest, caller]))

    def applied(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self._r.hgetall(self._applied).items()}

    def mark_applied(self, name: str, fingerprint: str) -> None:
        self._r.hset(self._applied, name, fingerprint)

"""The Redis backend of the tenant store: one Lua script per call, so each is atomic across
replicas. Layout and semantics: `gateway.tenancy.tenant_store` (its `MemoryBackend` is the same
in one process)."""
from __future__ import annotations

from gateway.tenancy.records import new_tenant_id
from gateway.tenancy.tenant_store import LEGACY_PREFIX

# Every script below that reads expiry takes "now" from Redis (TIME), so that one clock decides.
_NOW_LUA = "local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1e6\n"

# A Lua function: store a tenant's config JSON under its name, the stored id first: the id it has,
# or `id` for a new tenant (as `with_id`).
_STORE_CFG_LUA = """
local function store_cfg(cfgs, name, cfg, id)
  local old = redis.call('HGET', cfgs, name)
  if old then
    local ok, rec = pcall(cjson.decode, old)
    if ok and type(rec) == 'table' and type(rec['id']) == 'string' then id = rec['id'] end
  end
  redis.call('HSET', cfgs, name, '{"id":' .. cjson.encode(id) .. ',' .. string.sub(cfg, 2))
end
"""

# A Lua function: the key stored as `old` is stored as `new` from now on: its owner, grace
# deadline, place in its tenant's list, admin membership (`MemoryBackend._rename`).
_RENAME_LUA = """
local function rename(owner, keys, expiry, admins, old, new)
  local name = redis.call('HGET', owner, old)
  if name then
    if redis.call('HEXISTS', owner, new) == 0 then
      redis.call('HSET', owner, new, name)
      local exp = redis.call('HGET', expiry, old)
      if exp then redis.call('HSET', expiry, new, exp) end
    end
    redis.call('HDEL', owner, old)
    redis.call('HDEL', expiry, old)
    local list, out, seen = redis.call('HGET', keys, name), {}, {}
    if list then
      for d in string.gmatch(list, '%S+') do
        if d == old then d = new end
        if not seen[d] then seen[d] = true; out[#out + 1] = d end
      end
      redis.call('HSET', keys, name, table.concat(out, ' '))
    end
  end
  if redis.call('SREM', admins, old) == 1 then redis.call('SADD', admins, new) end
end
"""

# KEYS: cfg, owner, keys, expiry, admins.  ARGV: name, config JSON ("" = keep; the tenant must
# exist), "1" to replace the tenant's keys with ARGV[7:] / "0" to keep them, "1" = only if no
# tenant exists, grace seconds for the keys replaced (0: they stop at once), the id a new tenant
# gets (an existing one keeps its own).
_PUT_LUA = _NOW_LUA + _STORE_CFG_LUA + """
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
if cfg ~= '' then store_cfg(KEYS[1], name, cfg, ARGV[6]) end
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

# KEYS: cfg, owner, expiry, keys, admins.  ARGV: digest, its legacy form ("" = none).  The owning
# tenant's config JSON, or nil (also for a rotated-out key past its grace: it is dropped at the
# tenant's next key change). A key found in its legacy form is stored in the new one from now on.
_LOOKUP_LUA = _NOW_LUA + _RENAME_LUA + """
local name = redis.call('HGET', KEYS[2], ARGV[1])
if not name and ARGV[2] ~= '' and redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then
  rename(KEYS[2], KEYS[4], KEYS[3], KEYS[5], ARGV[2], ARGV[1])
  name = redis.call('HGET', KEYS[2], ARGV[1])
end
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

# KEYS: admins.  ARGV: digest to revoke, the caller's digest, the first's legacy form ("" = none).
_REVOKE_ADMIN_LUA = """
local d = ARGV[1]
if redis.call('SISMEMBER', KEYS[1], d) == 0 and ARGV[3] ~= '' then d = ARGV[3] end
if redis.call('SISMEMBER', KEYS[1], d) == 0 then return -1 end
if d == ARGV[2] then return -2 end
if redis.call('SCARD', KEYS[1]) <= 1 then return -3 end
redis.call('SREM', KEYS[1], d)
return 1
"""

# KEYS: admins, owner, keys, expiry.  ARGV: digest, its legacy form ("" = none).  1 if an admin key.
_IS_ADMIN_LUA = _RENAME_LUA + """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 1 end
if ARGV[2] == '' or redis.call('SISMEMBER', KEYS[1], ARGV[2]) == 0 then return 0 end
rename(KEYS[2], KEYS[3], KEYS[4], KEYS[1], ARGV[2], ARGV[1])
return 1
"""

# KEYS: owner, keys, expiry, admins.  ARGV: old, new, old, new, ...: each key stored as old is
# stored as new from now on.
_MIGRATE_LUA = _RENAME_LUA + """
for i = 1, #ARGV, 2 do rename(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[i], ARGV[i + 1]) end
return 1
"""

# KEYS: cfg, owner, keys, expiry, admins.  ARGV: name, config JSON, the id a new tenant gets, the
# number k of the entry's keys, "1" if the keys the file gave before are known, then the k keys,
# then the keys the file gave before. See `MemoryBackend.apply_file`.
_APPLY_FILE_LUA = _STORE_CFG_LUA + """
local name, k = ARGV[1], tonumber(ARGV[4])
local is_new = redis.call('HEXISTS', KEYS[1], name) == 0
local give, take, listed, before = {}, {}, {}, {}
for i = 6 + k, #ARGV do before[ARGV[i]] = true end
for i = 6, 5 + k do
  listed[ARGV[i]] = true
  if is_new or ARGV[5] == '0' or not before[ARGV[i]] then give[#give + 1] = ARGV[i] end
end
if not is_new and ARGV[5] == '1' then
  for i = 6 + k, #ARGV do if not listed[ARGV[i]] then take[#take + 1] = ARGV[i] end end
end
local add = {}
for _, d in ipairs(give) do
  local owner = redis.call('HGET', KEYS[2], d)
  if owner ~= name then
    if owner then return -2 end
    if redis.call('SISMEMBER', KEYS[5], d) == 1 then return -3 end
    add[#add + 1] = d
  end
end
local dropped, held = {}, {}
for _, d in ipairs(take) do
  if redis.call('HGET', KEYS[2], d) == name and redis.call('HEXISTS', KEYS[4], d) == 0 then
    redis.call('HDEL', KEYS[2], d)
    dropped[d] = true
  end
end
local old = redis.call('HGET', KEYS[3], name)
if old then
  for d in string.gmatch(old, '%S+') do if not dropped[d] then held[#held + 1] = d end end
end
for _, d in ipairs(add) do
  redis.call('HSET', KEYS[2], d, name)
  held[#held + 1] = d
end
if #held > 0 then redis.call('HSET', KEYS[3], name, table.concat(held, ' '))
else redis.call('HDEL', KEYS[3], name) end
store_cfg(KEYS[1], name, ARGV[2], ARGV[3])
return 1
"""


class RedisBackend:
    def __init__(self, client, prefix: str) -> None:
        self._r = client
        p = prefix + "tenants:"
        self._cfg, self._owner, self._keys = p + "cfg", p + "owner", p + "keys"
        self._expiry, self._admins, self._applied = p + "expiry", p + "admins", p + "applied"
        self._pepper_key = p + "pepper"
        self._put = client.register_script(_PUT_LUA)
        self._apply_file = client.register_script(_APPLY_FILE_LUA)
        self._remove = client.register_script(_REMOVE_LUA)
        self._lookup = client.register_script(_LOOKUP_LUA)
        self._is_admin = client.register_script(_IS_ADMIN_LUA)
        self._replace_admins = client.register_script(_REPLACE_ADMINS_LUA)
        self._revoke_admin = client.register_script(_REVOKE_ADMIN_LUA)
        self._migrate = client.register_script(_MIGRATE_LUA)

    def lookup(self, digest: str, legacy: str | None = None) -> str | None:
        v = self._lookup(keys=[self._cfg, self._owner, self._expiry, self._keys, self._admins],
                         args=[digest, legacy or ""])
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

    def apply_file(self, name: str, cfg: str, keys: list[str], previous: list[str] | None) -> int:
        return int(self._apply_file(
            keys=[self._cfg, self._owner, self._keys, self._expiry, self._admins],
            args=[name, cfg, new_tenant_id(), len(keys), "0" if previous is None else "1",
                  *keys, *(previous or ())]))

    def remove(self, name: str) -> str | None:
        v = self._remove(keys=[self._cfg, self._owner, self._keys, self._expiry], args=[name])
        return v.decode() if v else None

    def is_admin(self, digest: str, legacy: str | None = None) -> bool:
        return bool(self._is_admin(keys=[self._admins, self._owner, self._keys, self._expiry],
                                   args=[digest, legacy or ""]))

    def add_admins(self, digests: list[str]) -> None:
        if digests:
            self._r.sadd(self._admins, *digests)

    def replace_admins(self, digests: list[str]) -> int:
        return int(self._replace_admins(keys=[self._admins, self._owner, self._expiry], args=digests))

    def revoke_admin(self, digest: str, caller: str, legacy: str | None = None) -> int:
        return int(self._revoke_admin(keys=[self._admins], args=[digest, caller, legacy or ""]))

    def legacy_digests(self) -> list[str]:
        found = [*self._r.hkeys(self._owner), *self._r.smembers(self._admins)]
        return [d.decode() for d in found if d.startswith(LEGACY_PREFIX.encode())]

    def migrate(self, pairs: list[tuple[str, str]]) -> None:
        if pairs:
            self._migrate(keys=[self._owner, self._keys, self._expiry, self._admins],
                          args=[d for pair in pairs for d in pair])

    def pepper_check(self, check: str | None) -> str | None:
        if check is not None:
            self._r.set(self._pepper_key, check, nx=True)
        v = self._r.get(self._pepper_key)
        return v.decode() if v else None

    def applied(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self._r.hgetall(self._applied).items()}

    def mark_applied(self, name: str, record: str) -> None:
        self._r.hset(self._applied, name, record)

"""Tenants: who owns an API key, and what that owner may do.

A tenant is the unit of quotas, fairness and isolation (DESIGN.md). Its record holds the scheduler's
view (weight and priority class), its limits (RPM, TPM, concurrent and queued requests), the models
it may use and its speculation policy. API keys are never stored: only `sha256:<hex>` digests are,
and a presented key is always hashed before it is looked up (so a leaked digest is not a key).

Where tenants live: `TenantRegistry(store_url, prefix)` keeps them in process memory (None or
"memory://") or in Redis ("redis://", "rediss://", "unix://"), where every gateway replica sees an
add, a removal or a key rotation on its next request: nothing is cached. Redis layout (`P` = prefix):

    P tenants:cfg      hash  tenant name -> tenant JSON (`tenant_to_dict`; no keys, no digests)
    P tenants:owner    hash  key digest -> tenant name          (what `authenticate` reads)
    P tenants:keys     hash  tenant name -> its key digests, space-separated (for remove/rotate)
    P tenants:expiry   hash  key digest -> Redis time (s) after which it stops working: a key
                             rotated out with a grace period (`rotate_key(name, grace_s)`)
    P tenants:admins   set   admin key digests
    P tenants:applied  hash  tenant name, or "@admins" -> fingerprint of the tenants-file entry
                             (of the configured admin keys) last applied (see `load_config`)

`authenticate` is one EVALSHA (owner lookup, expiry and config read in one step); add, replace,
remove and rotate are one EVALSHA each, so a key is never owned by two tenants, nor by a tenant
and the admins, even for a moment. Grace deadlines are kept in Redis' own clock (TIME), so
replicas whose clocks disagree still end a rotated-out key at one moment.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Sequence

from gateway.tenancy.config import load_tenants_file, parse_tenant
from gateway.tenancy.records import (Tenant, configured_digest, hash_key, new_api_key,
                                     presented_digest, tenant_to_dict)

if TYPE_CHECKING:
    from gateway.settings import Settings


log = logging.getLogger(__name__)

DEV_TENANT = "dev"
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


# ---- stored records ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _tenant_from_json(text: str) -> Tenant:
    # Stored records were validated on the way in; parsing again is cheap and cached by content.
    return parse_tenant(json.loads(text))[0]


def _to_json(t: Tenant) -> str:
    return json.dumps(tenant_to_dict(t), separators=(",", ":"), sort_keys=True)


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# ---- where tenants live ---------------------------------------------------------------------------
OK, NOT_EMPTY, NO_TENANT, KEY_CONFLICT, ADMIN_CONFLICT = 1, 0, -1, -2, -3   # what `put` answers
REVOKED, NOT_ADMIN, OWN_KEY, LAST_ADMIN = 1, -1, -2, -3            # what `revoke_admin` answers


class KeyConflict(ValueError):
    """A key given to a tenant is already someone's: another tenant's ("tenant"), an admin key
    ("admin") or the metrics key ("metrics"). The message never repeats the key."""

    def __init__(self, owner: str, message: str) -> None:
        super().__init__(message)
        self.owner = owner


def connect_store(store_url: str | None):
    """None or "memory://" -> None (in process); a Redis URL -> a redis-py client (connects on
    first use). Shared with `gateway.tenancy.limits`."""
    if store_url is None or store_url == "memory://":
        return None
    if store_url.startswith(_REDIS_SCHEMES):
        import redis
        return redis.Redis.from_url(store_url)
    raise ValueError(f"unknown state store URL {store_url!r}; expected memory:// or redis://…")


class _MemoryBackend:
    """Same semantics as `_RedisBackend`, for one process. One lock makes each call atomic."""

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
            if cfg is not None:
                self._cfg[name] = cfg
            return OK

    def remove(self, name: str) -> bool:
        with self._lock:
            if self._cfg.pop(name, None) is None:
                return False
            for d in self._keys.pop(name, []):
                del self._owner[d]
                self._expiry.pop(d, None)
            return True

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
# exist), "1" to replace the tenant's keys with ARGV[6:] / "0" to keep them, "1" = only if no
# tenant exists, grace seconds for the keys replaced (0: they stop at once).
_PUT_LUA = _NOW_LUA + """
local name, cfg, replace, grace = ARGV[1], ARGV[2], ARGV[3] == '1', tonumber(ARGV[5])
if ARGV[4] == '1' and redis.call('HLEN', KEYS[1]) > 0 then return 0 end
if cfg == '' and redis.call('HEXISTS', KEYS[1], name) == 0 then return -1 end
if replace then
  local new = {}
  for i = 6, #ARGV do
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
  for i = 6, #ARGV do
    redis.call('HSET', KEYS[2], ARGV[i], name)
    redis.call('HDEL', KEYS[4], ARGV[i])
    all[#all + 1] = ARGV[i]
  end
  for _, d in ipairs(keep) do all[#all + 1] = d end
  redis.call('HSET', KEYS[3], name, table.concat(all, ' '))
end
if cfg ~= '' then redis.call('HSET', KEYS[1], name, cfg) end
return 1
"""

# KEYS: cfg, owner, keys, expiry.  ARGV: name.  Returns 1 if the tenant existed.
_REMOVE_LUA = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
local old = redis.call('HGET', KEYS[3], ARGV[1])
if old then
  for d in string.gmatch(old, '%S+') do
    redis.call('HDEL', KEYS[2], d)
    redis.call('HDEL', KEYS[4], d)
  end
end
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
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


class _RedisBackend:
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
                                   *(digests or ())]))

    def remove(self, name: str) -> bool:
        return bool(self._remove(keys=[self._cfg, self._owner, self._keys, self._expiry],
                                 args=[name]))

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


# ---- the registry ---------------------------------------------------------------------------------
MAX_GRACE_S = 7 * 24 * 3600.0       # a rotated-out key's grace; longer is a second key, not a grace


class TenantRegistry:
    """Tenants and their keys in a state store. Every method but `load_config` is one store round
    trip, and nothing is cached, so what one replica changes the next request anywhere sees. Safe
    to share between threads. `reserved`: digests no tenant may have as a key (the metrics key)."""

    def __init__(self, store_url: str | None = None, prefix: str = "specgate:",
                 reserved: Sequence[str] = ()) -> None:
        client = connect_store(store_url)
        self._store = _MemoryBackend() if client is None else _RedisBackend(client, prefix)
        self._reserved = frozenset(reserved)

    @classmethod
    def from_file(cls, path, store_url: str | None = None,
                  prefix: str = "specgate:") -> "TenantRegistry":
        """A registry over the store, with the tenants file `path` (YAML) applied to it."""
        registry = cls(store_url, prefix)
        tenants, admins = load_tenants_file(path)
        registry.load_config(tenants, admins)
        return registry

    @classmethod
    def from_settings(cls, settings: "Settings") -> "TenantRegistry":
        """The registry a gateway serves with: over `settings`' store, with its tenants file
        applied, its admin keys (the file's and `admin_key`) configured and its `metrics_key`
        reserved. The one place every replica kind (embedded, Ray ingress, Ray scheduler) opens
        it, so they agree on the configured admin keys. ValueError if the metrics key is a
        tenant's key (as is, the tenant could read every tenant's figures)."""
        metrics = settings.metrics_key.get_secret_value() if settings.metrics_key else None
        registry = cls(settings.redis_url, settings.store_prefix,
                       reserved=[configured_digest(metrics)] if metrics else ())
        tenants, admins = (load_tenants_file(settings.tenants_file) if settings.tenants_file
                           else ([], []))
        if settings.admin_key is not None:
            admins = [*admins, configured_digest(settings.admin_key.get_secret_value())]
        registry.load_config(tenants, admins)
        if metrics and registry.authenticate(metrics) is not None:
            raise ValueError("metrics_key is a tenant's API key; choose another")
        return registry

    def load_config(self, tenants: Sequence[tuple[Tenant, Sequence[str]]],
                    admin_digests: Sequence[str]) -> None:
        """Apply the configuration: each tenant named in it is replaced (config and keys), and the
        admin keys become exactly `admin_digests` (the tenants file's and `admin_key`): every
        other stored admin key is revoked.

        NOTE: an entry is applied only when it differs from the one last applied. Without this,
        a replica restarting with the same configuration would undo what the admin API did
        since (bring back a tenant's rotated-out key, a removed tenant, a revoked admin key).
        Changing an entry (or the admin keys) applies it again at the next start. ValueError if
        an admin key is a tenant's key; the admin keys are then left as they were."""
        applied = self._store.applied()
        for tenant, digests in tenants:
            fp = _fingerprint([tenant_to_dict(tenant), sorted(digests)])
            if applied.get(tenant.name) != fp:
                self.put_digests(tenant, list(digests))
                self._store.mark_applied(tenant.name, fp)
                log.info("tenant %r applied from the tenants file", tenant.name)
        admins = sorted(set(admin_digests))
        fp = _fingerprint(admins)
        # "@admins", not the "@admin" of releases that only added: a store they wrote is
        # replaced once, which revokes the admin keys they accumulated.
        if applied.get("@admins") != fp:
            conflict = self._store.replace_admins(admins)
            if conflict >= 0:
                raise ValueError("a configured admin key is also a tenant's API key; an admin "
                                 "key must be used for nothing else")
            self._store.mark_applied("@admins", fp)
            log.info("admin keys replaced by the %d configured", len(admins))

    def ensure_dev_tenant(self) -> str | None:
        """If the store holds no tenant at all, create "dev" (no limits) with a random key and
        return that key: the one time it is ever seen. Otherwise None. Atomic across replicas."""
        key = new_api_key()
        created = self._store.put(DEV_TENANT, _to_json(Tenant(DEV_TENANT)), [presented_digest(key)],
                                  only_if_empty=True)
        return key if created == OK else None

    def authenticate(self, api_key: str | None) -> Tenant | None:
        """The tenant owning `api_key`, or None. Found by the key's digest, never by comparing keys."""
        if not api_key:
            return None
        cfg = self._store.lookup(presented_digest(api_key))
        return _tenant_from_json(cfg) if cfg else None

    def is_admin(self, api_key: str | None) -> bool:
        return bool(api_key) and self._store.is_admin(presented_digest(api_key))

    def get(self, name: str) -> Tenant | None:
        cfg = self._store.get(name)
        return _tenant_from_json(cfg) if cfg else None

    def list(self) -> list[Tenant]:
        return sorted((_tenant_from_json(c) for c in self._store.all()), key=lambda t: t.name)

    def put(self, tenant: Tenant, api_keys: Sequence[str] = ()) -> None:
        """Add or replace `tenant`. Given keys (plaintext or "sha256:" digests) replace the
        tenant's keys; with none, a replaced tenant keeps its keys (a new one has none until
        `rotate_key`). KeyConflict (a ValueError) if a key is another tenant's, an admin key or
        the metrics key; then nothing changes."""
        self.put_digests(tenant, [hash_key(k) for k in api_keys] or None)

    def put_digests(self, tenant: Tenant, digests: Sequence[str] | None) -> None:
        """`put` with key digests already computed; None keeps the tenant's keys."""
        _tenant_from_json(_to_json(tenant))       # validates a Tenant built by hand
        if digests is not None and self._reserved.intersection(digests):
            raise KeyConflict("metrics", f"an API key given for tenant {tenant.name!r} is the "
                                         "metrics key")
        result = self._store.put(tenant.name, _to_json(tenant),
                                 None if digests is None else list(dict.fromkeys(digests)))
        if result == KEY_CONFLICT:
            raise KeyConflict("tenant", f"an API key given for tenant {tenant.name!r} belongs to "
                                        "another tenant")
        if result == ADMIN_CONFLICT:
            raise KeyConflict("admin", f"an API key given for tenant {tenant.name!r} is an admin key")

    def remove(self, name: str) -> bool:
        """Remove a tenant; its keys stop working at once, on every replica. False if unknown."""
        removed = self._store.remove(name)
        if removed:
            log.info("tenant %r removed", name)
        return removed

    def rotate_key(self, name: str, grace_s: float = 0.0) -> str:
        """Give tenant `name` one new random key (returned, the one time it is seen). Its old
        keys keep working `grace_s` seconds more (on every replica: the deadline is stored), so
        clients can move to the new key without an outage; 0 ends them at once. A key already in
        its grace keeps the earlier deadline. KeyError if there is no such tenant."""
        if not 0 <= grace_s <= MAX_GRACE_S:
            raise ValueError(f"grace_s must be between 0 and {MAX_GRACE_S:g} seconds")
        key = new_api_key()
        if self._store.put(name, None, [presented_digest(key)], grace_s=grace_s) == NO_TENANT:
            raise KeyError(name)
        log.info("tenant %r: API key rotated (old keys end in %gs)", name, grace_s)
        return key

    def add_admin_key(self, api_key: str) -> None:
        """Add one admin key (the dev set-up's generated one). It lasts until revoked or until
        the configured admin keys change (`load_config`)."""
        self._store.add_admins([hash_key(api_key)])

    def revoke_admin_key(self, key_or_digest: str, caller_key: str) -> int:
        """Revoke one admin key, given as the key or its "sha256:<hex>" digest, on behalf of the
        admin holding `caller_key`. Returns REVOKED, NOT_ADMIN, OWN_KEY (an admin cannot revoke
        the key it calls with: it would lock itself out mid-call) or LAST_ADMIN (the store would
        be left with no admin key). One atomic step, so two admins revoking each other at once
        cannot leave none."""
        return self._store.revoke_admin(hash_key(key_or_digest), presented_digest(caller_key))

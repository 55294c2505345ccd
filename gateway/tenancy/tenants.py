"""Tenants: who owns an API key, and what that owner may do.

A tenant is the unit of quotas, fairness and isolation (DESIGN.md). Its record holds the scheduler's
view (weight and priority class), its limits (RPM, TPM, concurrent and queued requests), the models
it may use and its speculation policy. API keys are never stored: only `sha256:<hex>` digests are,
and a presented key is always hashed before it is looked up (so a leaked digest is not a key).

Where tenants live: `TenantRegistry(store_url, prefix)` keeps them in process memory (None or
"memory://") or in Redis ("redis://", "rediss://", "unix://"), where every gateway replica sees an
add, a removal or a key rotation on its next request: nothing is cached. Redis layout (`P` = prefix):

    P tenants:cfg      hash  tenant name -> tenant JSON (`tenant_to_dict` and the tenant's
                             immutable "id"; no keys, no digests)
    P tenants:owner    hash  key digest -> tenant name          (what `authenticate` reads)
    P tenants:keys     hash  tenant name -> its key digests, space-separated (for remove/rotate)
    P tenants:admins   set   admin key digests
    P tenants:applied  hash  tenant name, or "@admin" -> fingerprint of the tenants-file entry
                             last applied (see `load_config`)

`authenticate` is one EVALSHA (owner lookup and config read in one step); add, replace, remove and
rotate are one EVALSHA each, so a key is never owned by two tenants, even for a moment.

Tenant ids (`Tenant.id`): made by the store's `put` when it creates a tenant, kept by every later
put of the same name, gone with `remove`; so a tenant removed and created again gets a new one,
and the engine's caches, keyed by it, start empty (`GenerationService.forget_tenant` drops the old
one's). The id is spliced into the stored JSON inside the same atomic put.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from dataclasses import replace
from typing import Any, Sequence

from gateway.tenancy.config import load_tenants_file, parse_tenant
from gateway.tenancy.records import (Tenant, hash_key, new_api_key,
                                     new_tenant_id, presented_digest,
                                     tenant_to_dict)


log = logging.getLogger(__name__)

DEV_TENANT = "dev"
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


# ---- stored records ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _tenant_from_json(text: str) -> Tenant:
    # Stored records were validated on the way in; parsing again is cheap and cached by content.
    doc = json.loads(text)
    tenant_id = doc.pop("id", None)
    tenant = parse_tenant(doc)[0]
    # A record stored before tenants had ids gets one made from its name until its next put.
    return replace(tenant, id=tenant_id if isinstance(tenant_id, str) else f"legacy:{tenant.name}")


def _with_id(cfg: str, tenant_id: str) -> str:
    """The stored JSON: `cfg` (an object, `_to_json`) with "id" put first (as `_PUT_LUA` does)."""
    return '{"id":' + json.dumps(tenant_id) + "," + cfg[1:]


def _stored_id(stored: str | None) -> str | None:
    if stored is None:
        return None
    tenant_id = json.loads(stored).get("id")
    return tenant_id if isinstance(tenant_id, str) else None


def _to_json(t: Tenant) -> str:
    return json.dumps(tenant_to_dict(t), separators=(",", ":"), sort_keys=True)


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# ---- where tenants live ---------------------------------------------------------------------------
OK, NOT_EMPTY, NO_TENANT, KEY_CONFLICT = 1, 0, -1, -2      # what a backend's `put` answers


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
        self._admins: set[str] = set()
        self._applied: dict[str, str] = {}

    def lookup(self, digest: str) -> str | None:
        with self._lock:
            name = self._owner.get(digest)
            return self._cfg.get(name) if name else None

    def get(self, name: str) -> str | None:
        return self._cfg.get(name)

    def all(self) -> list[str]:
        with self._lock:
            return list(self._cfg.values())

    def put(self, name: str, cfg: str | None, digests: list[str] | None,
            only_if_empty: bool = False) -> int:
        with self._lock:
            if only_if_empty and self._cfg:
                return NOT_EMPTY
            if cfg is None and name not in self._cfg:
                return NO_TENANT
            if digests is not None:
                if any(self._owner.get(d, name) != name for d in digests):
                    return KEY_CONFLICT
                for d in self._keys.pop(name, []):
                    del self._owner[d]
                self._owner.update((d, name) for d in digests)
                self._keys[name] = list(digests)
            if cfg is not None:      # a tenant keeps its id; a new one gets a fresh one
                self._cfg[name] = _with_id(cfg, _stored_id(self._cfg.get(name)) or new_tenant_id())
            return OK

    def remove(self, name: str) -> str | None:
        with self._lock:
            cfg = self._cfg.pop(name, None)
            if cfg is None:
                return None
            for d in self._keys.pop(name, []):
                del self._owner[d]
            return cfg

    def is_admin(self, digest: str) -> bool:
        return digest in self._admins

    def add_admins(self, digests: list[str], replace: bool = False) -> None:
        with self._lock:
            self._admins = set(digests) | (set() if replace else self._admins)

    def applied(self) -> dict[str, str]:
        return dict(self._applied)

    def mark_applied(self, name: str, fingerprint: str) -> None:
        self._applied[name] = fingerprint


# KEYS: cfg, owner, keys.  ARGV: name, config JSON ("" = keep; the tenant must exist),
# "1" to replace the tenant's keys with ARGV[6:] / "0" to keep them, "1" = only if no tenant exists,
# the id a new tenant gets (an existing one keeps its own).
_PUT_LUA = """
local name, cfg, replace = ARGV[1], ARGV[2], ARGV[3] == '1'
if ARGV[4] == '1' and redis.call('HLEN', KEYS[1]) > 0 then return 0 end
if cfg == '' and redis.call('HEXISTS', KEYS[1], name) == 0 then return -1 end
if replace then
  for i = 6, #ARGV do
    local owner = redis.call('HGET', KEYS[2], ARGV[i])
    if owner and owner ~= name then return -2 end
  end
  local old = redis.call('HGET', KEYS[3], name)
  if old then
    for d in string.gmatch(old, '%S+') do redis.call('HDEL', KEYS[2], d) end
  end
  local new = {}
  for i = 6, #ARGV do
    redis.call('HSET', KEYS[2], ARGV[i], name)
    new[#new + 1] = ARGV[i]
  end
  redis.call('HSET', KEYS[3], name, table.concat(new, ' '))
end
if cfg ~= '' then
  local id, old = ARGV[5], redis.call('HGET', KEYS[1], name)
  if old then
    local ok, rec = pcall(cjson.decode, old)
    if ok and type(rec) == 'table' and type(rec['id']) == 'string' then id = rec['id'] end
  end
  redis.call('HSET', KEYS[1], name, '{"id":' .. cjson.encode(id) .. ',' .. string.sub(cfg, 2))
end
return 1
"""

# KEYS: cfg, owner, keys.  ARGV: name.  Returns the removed tenant's JSON, or nil.
_REMOVE_LUA = """
local cfg = redis.call('HGET', KEYS[1], ARGV[1])
if not cfg then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
local old = redis.call('HGET', KEYS[3], ARGV[1])
if old then
  for d in string.gmatch(old, '%S+') do redis.call('HDEL', KEYS[2], d) end
end
redis.call('HDEL', KEYS[3], ARGV[1])
return cfg
"""

# KEYS: cfg, owner.  ARGV: digest.  The owning tenant's config JSON, or nil.
_LOOKUP_LUA = """
local name = redis.call('HGET', KEYS[2], ARGV[1])
if not name then return false end
return redis.call('HGET', KEYS[1], name)
"""


class _RedisBackend:
    def __init__(self, client, prefix: str) -> None:
        self._r = client
        p = prefix + "tenants:"
        self._cfg, self._owner, self._keys = p + "cfg", p + "owner", p + "keys"
        self._admins, self._applied = p + "admins", p + "applied"
        self._put = client.register_script(_PUT_LUA)
        self._remove = client.register_script(_REMOVE_LUA)
        self._lookup = client.register_script(_LOOKUP_LUA)

    def lookup(self, digest: str) -> str | None:
        v = self._lookup(keys=[self._cfg, self._owner], args=[digest])
        return v.decode() if v else None

    def get(self, name: str) -> str | None:
        v = self._r.hget(self._cfg, name)
        return v.decode() if v else None

    def all(self) -> list[str]:
        return [v.decode() for v in self._r.hvals(self._cfg)]

    def put(self, name: str, cfg: str | None, digests: list[str] | None,
            only_if_empty: bool = False) -> int:
        return int(self._put(keys=[self._cfg, self._owner, self._keys],
                             args=[name, cfg or "", "0" if digests is None else "1",
                                   "1" if only_if_empty else "0", new_tenant_id(),
                                   *(digests or ())]))

    def remove(self, name: str) -> str | None:
        v = self._remove(keys=[self._cfg, self._owner, self._keys], args=[name])
        return v.decode() if v else None

    def is_admin(self, digest: str) -> bool:
        return bool(self._r.sismember(self._admins, digest))

    def add_admins(self, digests: list[str], replace: bool = False) -> None:
        pipe = self._r.pipeline(transaction=True)
        if replace:
            pipe.delete(self._admins)
        if digests:
            pipe.sadd(self._admins, *digests)
        pipe.execute()

    def applied(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self._r.hgetall(self._applied).items()}

    def mark_applied(self, name: str, fingerprint: str) -> None:
        self._r.hset(self._applied, name, fingerprint)


# ---- the registry ---------------------------------------------------------------------------------
class TenantRegistry:
    """Tenants and their keys in a state store. Every method but `load_config` is one store round
    trip, and nothing is cached, so what one replica changes the next request anywhere sees. Safe
    to share between threads."""

    def __init__(self, store_url: str | None = None, prefix: str = "specgate:") -> None:
        client = connect_store(store_url)
        self._store = _MemoryBackend() if client is None else _RedisBackend(client, prefix)

    @classmethod
    def from_file(cls, path, store_url: str | None = None,
                  prefix: str = "specgate:") -> "TenantRegistry":
        """A registry over the store, with the tenants file `path` (YAML) applied to it."""
        registry = cls(store_url, prefix)
        tenants, admins = load_tenants_file(path)
        registry.load_config(tenants, admins)
        return registry

    def load_config(self, tenants: Sequence[tuple[Tenant, Sequence[str]]],
                    admin_digests: Sequence[str]) -> None:
        """Apply a parsed tenants file: each tenant named in it is replaced (config and keys), and
        the admin keys become the file's.

        NOTE: an entry is applied only when it differs from the one last applied from a file.
        Without this, a replica restarting with the same file would undo what the admin API did
        since (bring back a tenant's rotated-out key, or a removed tenant). Editing an entry in the
        file applies it again at the next start."""
        applied = self._store.applied()
        for tenant, digests in tenants:
            fp = _fingerprint([tenant_to_dict(tenant), sorted(digests)])
            if applied.get(tenant.name) != fp:
                self.put_digests(tenant, list(digests))
                self._store.mark_applied(tenant.name, fp)
                log.info("tenant %r applied from the tenants file", tenant.name)
        fp = _fingerprint(sorted(admin_digests))
        if applied.get("@admin") != fp:
            self._store.add_admins(list(admin_digests), replace=True)
            self._store.mark_applied("@admin", fp)

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
        `rotate_key`). ValueError if a key belongs to another tenant; then nothing changes.
        `tenant.id` is ignored: a replaced tenant keeps its stored id, a new one gets a fresh one
        (module docstring), so no caller can give a tenant someone else's id."""
        self.put_digests(tenant, [hash_key(k) for k in api_keys] or None)

    def put_digests(self, tenant: Tenant, digests: Sequence[str] | None) -> None:
        """`put` with key digests already computed; None keeps the tenant's keys."""
        _tenant_from_json(_to_json(tenant))       # validates a Tenant built by hand
        result = self._store.put(tenant.name, _to_json(tenant),
                                 None if digests is None else list(dict.fromkeys(digests)))
        if result == KEY_CONFLICT:
            raise ValueError(f"an API key given for tenant {tenant.name!r} belongs to another tenant")

    def remove(self, name: str) -> Tenant | None:
        """Remove a tenant; its keys stop working at once, on every replica. Returns the removed
        record (its id names the caches to drop: `GenerationService.forget_tenant`); None if
        unknown."""
        removed = self._store.remove(name)
        if removed is None:
            return None
        log.info("tenant %r removed", name)
        return _tenant_from_json(removed)

    def rotate_key(self, name: str) -> str:
        """Give tenant `name` one new random key (returned, the one time it is seen); its old keys
        stop working at once. KeyError if there is no such tenant."""
        key = new_api_key()
        if self._store.put(name, None, [presented_digest(key)]) == NO_TENANT:
            raise KeyError(name)
        log.info("tenant %r: API key rotated", name)
        return key

    def add_admin_key(self, api_key: str) -> None:
        self._store.add_admins([hash_key(api_key)])


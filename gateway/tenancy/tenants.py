"""Tenants: who owns an API key, and what that owner may do.

A tenant is the unit of quotas, fairness and isolation (docs/design.md). Its record holds the scheduler's
view (weight and priority class), its limits (RPM, TPM, concurrent and queued requests), the models
it may use and its speculation policy. API keys are never stored: a key is known by its digest
("sha256:<hex>", `hash_key`), and what rests in the store is that digest's HMAC under the server's
pepper (`key_pepper`; `gateway.tenancy.records.rest_digest`), so neither a leaked digest nor a
copy of the store is a key, nor a way to test guesses of one. A presented key is always hashed
before it is looked up: one lookup, whatever the number of tenants. Without a pepper a store in
Redis holds the plain digests (as releases before it did), and a warning says so at start; a
store written that way is peppered as soon as a pepper is set (`load_config`), and until then
each key in it still works, and is peppered at its first use.

Where tenants live: `TenantRegistry(store_url, prefix)` keeps them in process memory (None or
"memory://") or in Redis ("redis://", "rediss://", "unix://"), where every gateway replica sees an
add, a removal, a key rotation or an admin key's revocation on its next request: nothing is
cached. The backends and the Redis layout: `gateway.tenancy.tenant_store`. `authenticate` is one
EVALSHA (owner lookup, grace deadline and config read in one step); add, replace, remove, rotate
and revoke are one EVALSHA each.

Tenant ids (`Tenant.id`): made by the store's `put` when it creates a tenant, kept by every later
put of the same name, gone with `remove`; so a tenant removed and created again gets a new one,
and the engine's caches, keyed by it, start empty (`GenerationService.forget_tenant` drops the old
one's). The id is spliced into the stored JSON inside the same atomic put (tenant_store).
"""
from __future__ import annotations

import functools
import json
import logging
import secrets
from dataclasses import replace
from pathlib import Path
from typing import Protocol, Sequence

from gateway.tenancy import applied
from gateway.tenancy.config import load_tenants_file, parse_tenant
from gateway.tenancy.records import (Tenant, configured_digest, hash_key, new_api_key,
                                     presented_digest, rest_digest, tenant_to_dict)
from gateway.tenancy.tenant_redis import RedisBackend
from gateway.tenancy.tenant_store import (ADMIN_CONFLICT, KEY_CONFLICT, NO_TENANT, OK,
                                          MemoryBackend)
from scheduler.store.redis_client import redis_client

log = logging.getLogger(__name__)

DEV_TENANT = "dev"
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


class Secret(Protocol):
    def get_secret_value(self) -> str: ...


class TenancySettings(Protocol):
    """What `TenantRegistry.from_settings` reads of a gateway's settings (`gateway.settings.
    Settings` has it all; declared here so that tenancy needs nothing above it)."""
    redis_url: str | None
    store_prefix: str
    redis_timeout_s: float
    tenants_file: Path | None
    admin_key: Secret | None
    metrics_key: Secret | None
    key_pepper: Secret | None


# ---- stored records ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _tenant_from_json(text: str) -> Tenant:
    # Stored records were validated on the way in; parsing again is cheap and cached by content.
    doc = json.loads(text)
    tenant_id = doc.pop("id", None)
    tenant = parse_tenant(doc)[0]
    # A record stored before tenants had ids gets one made from its name until its next put.
    return replace(tenant, id=tenant_id if isinstance(tenant_id, str) else f"legacy:{tenant.name}")



def _to_json(t: Tenant) -> str:
    return json.dumps(tenant_to_dict(t), separators=(",", ":"), sort_keys=True)


# ---- where tenants live ---------------------------------------------------------------------------
class KeyConflict(ValueError):
    """A key given to a tenant is already someone's: another tenant's ("tenant"), an admin key
    ("admin") or the metrics key ("metrics"). The message never repeats the key."""

    def __init__(self, owner: str, message: str) -> None:
        super().__init__(message)
        self.owner = owner


def _check_reserved(reserved: frozenset[str], tenant: Tenant, digests: Sequence[str]) -> None:
    if reserved.intersection(digests):
        raise KeyConflict("metrics", f"an API key given for tenant {tenant.name!r} is the metrics key")


def _raise_conflict(tenant: Tenant, result: int) -> None:
    """A store's answer to a put, as the KeyConflict it means (nothing changed then)."""
    if result == KEY_CONFLICT:
        raise KeyConflict("tenant", f"an API key given for tenant {tenant.name!r} belongs to "
                                    "another tenant")
    if result == ADMIN_CONFLICT:
        raise KeyConflict("admin", f"an API key given for tenant {tenant.name!r} is an admin key")


def connect_store(store_url: str | None, timeout_s: float | None = None):
    """None or "memory://" -> None (in process); a Redis URL -> a redis-py client (connects on
    first use), each call bounded by `timeout_s` (default `REDIS_TIMEOUT_S`, see
    scheduler/store/redis_client.py). Shared with `gateway.tenancy.limits`."""
    if store_url is None or store_url == "memory://":
        return None
    if store_url.startswith(_REDIS_SCHEMES):
        return redis_client(store_url) if timeout_s is None else redis_client(store_url, timeout_s)
    raise ValueError(f"unknown state store URL {store_url!r}; expected memory:// or redis://…")


# ---- the registry ---------------------------------------------------------------------------------
MAX_GRACE_S = 7 * 24 * 3600.0       # a rotated-out key's grace; longer is a second key, not a grace


class TenantRegistry:
    """Tenants and their keys in a state store. Every method but `load_config` is one store round
    trip, and nothing is cached, so what one replica changes the next request anywhere sees. Safe
    to share between threads. `reserved`: digests no tenant may have as a key (the metrics key).
    `pepper`: the server secret keys rest under (module docstring); in memory, where nothing
    rests, a random one when none is given."""

    def __init__(self, store_url: str | None = None, prefix: str = "specgate:",
                 reserved: Sequence[str] = (), *, timeout_s: float | None = None,
                 pepper: str | None = None) -> None:
        client = connect_store(store_url, timeout_s)
        self._store = MemoryBackend() if client is None else RedisBackend(client, prefix)
        self._reserved = frozenset(reserved)
        self._pepper = (pepper.encode() if pepper
                        else secrets.token_bytes(32) if client is None else None)

    @property
    def remote(self) -> bool:
        """Do the tenants live across the network (Redis), so that a lookup may wait on it?"""
        return isinstance(self._store, RedisBackend)

    @property
    def peppered(self) -> bool:
        """Do keys rest as HMACs under a pepper (not as plain SHA-256 digests)?"""
        return self._pepper is not None

    def _rest(self, digest: str) -> str:
        return rest_digest(digest, self._pepper)

    def _legacy(self, digest: str) -> str | None:
        """The form a peppered store may still hold a key in (written before the pepper)."""
        return digest if self._pepper is not None else None

    @classmethod
    def from_file(cls, path, store_url: str | None = None, prefix: str = "specgate:", *,
                  timeout_s: float | None = None, pepper: str | None = None) -> "TenantRegistry":
        """A registry over the store, with the tenants file `path` (YAML) applied to it; its
        admin keys become the admin keys. A gateway opens it with `from_settings` instead (the
        file's admin keys and `admin_key`): mixing the two over one store would have each start
        replace the other's admin keys."""
        registry = cls(store_url, prefix, timeout_s=timeout_s, pepper=pepper)
        tenants, admins = load_tenants_file(path)
        registry.load_config(tenants, admins)
        return registry

    @classmethod
    def from_settings(cls, settings: TenancySettings, *, configure: bool = True) -> "TenantRegistry":
        """The registry a gateway serves with: over `settings`' store, keys under its
        `key_pepper`, with its tenants file applied, its admin keys (the file's and `admin_key`)
        configured and its `metrics_key` reserved. The one place every replica kind (embedded,
        Ray ingress) opens it, so they agree on the configured admin keys. `configure=False`:
        the store alone, nothing applied (Ray mode's scheduler replica, which authenticates no
        one and holds no key: configuring with none would revoke the admin keys). ValueError if
        the metrics key is a tenant's key (as is, the tenant could read every tenant's figures)."""
        metrics = settings.metrics_key.get_secret_value() if settings.metrics_key else None
        metrics_digest = configured_digest(metrics) if metrics else None
        pepper = settings.key_pepper.get_secret_value() if settings.key_pepper else None
        registry = cls(settings.redis_url, settings.store_prefix,
                       reserved=[metrics_digest] if metrics_digest else (),
                       timeout_s=settings.redis_timeout_s, pepper=pepper)
        if not configure:
            return registry
        if registry.remote and not registry.peppered:
            log.warning("API keys rest in Redis as unsalted SHA-256 digests: set SPECGATE_KEY_PEPPER "
                        "(docs/deployment.md, \"Tenants and keys\")")
        tenants, admins = (load_tenants_file(settings.tenants_file) if settings.tenants_file
                           else ([], []))
        if settings.admin_key is not None:
            admins = [*admins, configured_digest(settings.admin_key.get_secret_value())]
        registry.load_config(tenants, admins)
        if metrics_digest and registry._owner_of(metrics_digest) is not None:
            raise ValueError("metrics_key is a tenant's API key; choose another")
        return registry

    def load_config(self, tenants: Sequence[tuple[Tenant, Sequence[str]]],
                    admin_digests: Sequence[str]) -> None:
        """Apply the configuration: each tenant named in it gets its config and keys, and the
        admin keys become exactly `admin_digests` (the tenants file's and `admin_key`): every
        other stored admin key is revoked. First, a store written before the pepper was set
        has its key digests peppered.

        NOTE: an entry is applied only when it differs from the one last applied, and its keys
        as a change against the keys the file gave last time (`gateway.tenancy.applied`):
        keys added to the entry are given, keys removed from it are taken (at once, unless in
        a grace period), and the keys the admin API gave or rotated out are left alone. Without
        this, a replica restarting with the same file, or an edit of another field, would undo
        what the admin API did since (bring back a tenant's rotated-out key, cut short its
        grace, bring back a removed tenant or a revoked admin key). ValueError if an admin key
        is a tenant's key (the admin keys are then left as they were), or if the store's keys
        rest under another pepper than this registry's (`_check_pepper`)."""
        self._check_pepper()
        self._migrate()
        records = self._store.applied()
        for tenant, digests in tenants:
            self._apply_entry(tenant, list(dict.fromkeys(digests)),
                              applied.read(records.get(tenant.name)))
        self._apply_admins(sorted(set(admin_digests)), applied.read(records.get(applied.ADMINS)))

    def _check_pepper(self) -> None:
        """Refuse a pepper other than the one the store's keys rest under (or none where they
        rest under one): started anyway, the gateway would answer every key with a 401. The
        store keeps an HMAC of a constant under the pepper, which says nothing of the pepper."""
        mine = None if self._pepper is None else applied.fingerprint("key pepper", self._pepper)
        stored = self._store.pepper_check(mine)
        if stored is not None and stored != mine:
            raise ValueError("the state store's API keys rest under another key pepper than "
                             "SPECGATE_KEY_PEPPER" if mine else "the state store's API keys rest "
                             "under a key pepper: set SPECGATE_KEY_PEPPER to it")

    def _migrate(self) -> None:
        if self._pepper is None:
            return
        legacy = self._store.legacy_digests()
        if legacy:
            self._store.migrate([(d, self._rest(d)) for d in legacy])
            log.info("%d stored key digest(s) now rest under the key pepper", len(legacy))

    def _apply_entry(self, tenant: Tenant, digests: list[str], record: applied.Applied | None) -> None:
        entry = applied.entry(tenant_to_dict(tenant), digests)
        rest = [self._rest(d) for d in digests]
        now = applied.Applied(applied.fingerprint(entry, self._pepper), tuple(rest))
        if applied.unchanged(record, entry, self._pepper):
            if record != now:                      # an older record: in today's form
                self._store.mark_applied(tenant.name, applied.write(now))
            return
        _check_reserved(self._reserved, tenant, digests)
        _raise_conflict(tenant, self._store.apply_file(
            tenant.name, _to_json(tenant), rest, applied.previous_keys(record, self._rest)))
        self._store.mark_applied(tenant.name, applied.write(now))
        log.info("tenant %r applied from the tenants file", tenant.name)

    def _apply_admins(self, admins: list[str], record: applied.Applied | None) -> None:
        rest = sorted({self._rest(d) for d in admins})
        now = applied.Applied(applied.fingerprint(admins, self._pepper), tuple(rest))
        if applied.unchanged(record, admins, self._pepper):
            if record != now:
                self._store.mark_applied(applied.ADMINS, applied.write(now))
            return
        # "@admins", not the "@admin" of releases that only added: a store they wrote is
        # replaced once, which revokes the admin keys they accumulated.
        if self._store.replace_admins(rest) >= 0:
            raise ValueError("a configured admin key is also a tenant's API key; an admin "
                             "key must be used for nothing else")
        self._store.mark_applied(applied.ADMINS, applied.write(now))
        log.info("admin keys replaced by the %d configured", len(admins))

    def ensure_dev_tenant(self) -> str | None:
        """If the store holds no tenant at all, create "dev" (no limits) with a random key and
        return that key: the one time it is ever seen. Otherwise None. Atomic across replicas."""
        key = new_api_key()
        created = self._store.put(DEV_TENANT, _to_json(Tenant(DEV_TENANT)),
                                  [self._rest(presented_digest(key))], only_if_empty=True)
        return key if created == OK else None

    def _owner_of(self, digest: str) -> str | None:
        """The config JSON of the tenant owning the key with this digest, or None."""
        return self._store.lookup(self._rest(digest), self._legacy(digest))

    def authenticate(self, api_key: str | None) -> Tenant | None:
        """The tenant owning `api_key`, or None. Found by the key's digest, never by comparing keys."""
        if not api_key:
            return None
        cfg = self._owner_of(presented_digest(api_key))
        return _tenant_from_json(cfg) if cfg else None

    def is_admin(self, api_key: str | None) -> bool:
        if not api_key:
            return False
        digest = presented_digest(api_key)
        return self._store.is_admin(self._rest(digest), self._legacy(digest))

    def get(self, name: str) -> Tenant | None:
        cfg = self._store.get(name)
        return _tenant_from_json(cfg) if cfg else None

    def list(self) -> list[Tenant]:
        return sorted((_tenant_from_json(c) for c in self._store.all()), key=lambda t: t.name)

    def put(self, tenant: Tenant, api_keys: Sequence[str] = ()) -> None:
        """Add or replace `tenant`. Given keys (plaintext or "sha256:" digests) replace the
        tenant's keys; with none, a replaced tenant keeps its keys (a new one has none until
        `rotate_key`). KeyConflict (a ValueError) if a key is another tenant's, an admin key or
        the metrics key; then nothing changes. `tenant.id` is ignored: a replaced tenant keeps
        its stored id, a new one gets a fresh one (module docstring), so no caller can give a
        tenant someone else's id."""
        self.put_digests(tenant, [hash_key(k) for k in api_keys] or None)

    def put_digests(self, tenant: Tenant, digests: Sequence[str] | None) -> None:
        """`put` with key digests already computed; None keeps the tenant's keys."""
        _tenant_from_json(_to_json(tenant))       # validates a Tenant built by hand
        if digests is not None:
            _check_reserved(self._reserved, tenant, digests)
        rest = None if digests is None else [self._rest(d) for d in dict.fromkeys(digests)]
        _raise_conflict(tenant, self._store.put(tenant.name, _to_json(tenant), rest))

    def remove(self, name: str) -> Tenant | None:
        """Remove a tenant; its keys stop working at once, on every replica. Returns the removed
        record (its id names the caches to drop: `GenerationService.forget_tenant`); None if
        unknown."""
        removed = self._store.remove(name)
        if removed is None:
            return None
        log.info("tenant %r removed", name)
        return _tenant_from_json(removed)

    def rotate_key(self, name: str, grace_s: float = 0.0) -> str:
        """Give tenant `name` one new random key (returned, the one time it is seen). Its old
        keys keep working `grace_s` seconds more (on every replica: the deadline is stored), so
        clients can move to the new key without an outage; 0 ends them at once. A key already in
        its grace keeps the earlier deadline. KeyError if there is no such tenant."""
        if not 0 <= grace_s <= MAX_GRACE_S:
            raise ValueError(f"grace_s must be between 0 and {MAX_GRACE_S:g} seconds")
        key = new_api_key()
        if self._store.put(name, None, [self._rest(presented_digest(key))],
                           grace_s=grace_s) == NO_TENANT:
            raise KeyError(name)
        log.info("tenant %r: API key rotated (old keys end in %gs)", name, grace_s)
        return key

    def add_admin_key(self, api_key: str) -> None:
        """Add one admin key (the dev set-up's generated one). It lasts until revoked or until
        the configured admin keys change (`load_config`)."""
        self._store.add_admins([self._rest(hash_key(api_key))])

    def revoke_admin_key(self, key_or_digest: str, caller_key: str) -> int:
        """Revoke one admin key, given as the key or its "sha256:<hex>" digest, on behalf of the
        admin holding `caller_key`. Returns one of `gateway.tenancy.tenant_store`'s REVOKED,
        NOT_ADMIN, OWN_KEY (an admin cannot revoke the key it calls with: it would lock itself
        out mid-call) or LAST_ADMIN (the store would be left with no admin key). One atomic
        step, so two admins revoking each other at once cannot leave none."""
        digest = hash_key(key_or_digest)
        return self._store.revoke_admin(self._rest(digest), self._rest(presented_digest(caller_key)),
                                        self._legacy(digest))

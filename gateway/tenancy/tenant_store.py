"""Where tenants and their keys are stored: in process memory or in Redis, with one semantics.

`gateway.tenancy.tenants.TenantRegistry` is the only user; it picks a backend by the store URL.
Each call of a backend is atomic (one lock, or one Lua script), so a key is never owned by two
tenants, nor by a tenant and the admins, even for a moment. Redis layout (`P` = prefix;
`gateway.tenancy.tenant_redis`):

    P tenants:cfg      hash  tenant name -> tenant JSON (`tenant_to_dict` and the tenant's
                             immutable "id", first; no keys, no digests)
    P tenants:owner    hash  key digest -> tenant name          (what `authenticate` reads)
    P tenants:keys     hash  tenant name -> its key digests, space-separated (for remove/rotate)
    P tenants:expiry   hash  key digest -> Redis time (s) after which it stops working: a key
                             rotated out with a grace period (`rotate_key(name, grace_s)`)
    P tenants:admins   set   admin key digests
    P tenants:applied  hash  tenant name, or "@admins" -> what the tenants file last applied
                             (`gateway.tenancy.applied`; see `load_config`)
    P tenants:pepper   string  an HMAC of a constant under the pepper the keys rest under (not
                             the pepper): a start with another one is refused

A "key digest" here is the form a key rests in (`gateway.tenancy.records.rest_digest`): an
HMAC under the server's pepper, or the key's "sha256:" digest where there is none. A store
written before the pepper was set holds "sha256:" digests: `lookup` and `is_admin` take that
form too (`legacy`) and, when it is what the store holds, replace it by the peppered one in the
same step; `migrate` replaces them all at once (at start).

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
LEGACY_PREFIX = "sha256:"          # a digest stored before the server had a pepper


def with_id(cfg: str, tenant_id: str) -> str:
    """The stored JSON: `cfg` (an object) with "id" put first, as `_PUT_LUA` does."""
    return '{"id":' + json.dumps(tenant_id) + "," + cfg[1:]


def stored_id(stored: str | None) -> str | None:
    if stored is None:
        return None
    tenant_id = json.loads(stored).get("id")
    return tenant_id if isinstance(tenant_id, str) else None


def file_key_changes(keys: list[str], previous: list[str] | None,
                     is_new: bool) -> tuple[list[str], list[str]]:
    """(keys to give, keys to take) when a tenants-file entry's keys are applied: a new tenant
    gets all of them; an existing one the keys added since the file last gave `previous`, and
    loses the ones removed since (all of them added and none taken when `previous` is unknown).
    Keys the API gave or rotated out are the API's: the file neither takes nor revives them."""
    if is_new or previous is None:
        return list(keys), []
    return [d for d in keys if d not in previous], [d for d in previous if d not in keys]


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
        self._pepper_check: str | None = None

    def _owned(self, digest: str, now: float) -> str | None:
        """The tenant owning `digest` at `now` (a rotated-out key past its grace owns nothing)."""
        name = self._owner.get(digest)
        return name if name is not None and self._expiry.get(digest, now + 1) > now else None

    def _rename(self, old: str, new: str) -> None:
        """The same key, stored in its new form: owner, grace deadline and admin set."""
        name = self._owner.pop(old, None)
        expiry = self._expiry.pop(old, None)
        if name is not None:
            if new not in self._owner:
                self._owner[new] = name
                if expiry is not None:
                    self._expiry[new] = expiry
            held = self._keys.get(name, [])
            self._keys[name] = list(dict.fromkeys(new if d == old else d for d in held))
        if old in self._admins:
            self._admins.discard(old)
            self._admins.add(new)

    def lookup(self, digest: str, legacy: str | None = None) -> str | None:
        with self._lock:
            if legacy and digest not in self._owner and legacy in self._owner:
                self._rename(legacy, digest)
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

    def apply_file(self, name: str, cfg: str, keys: list[str], previous: list[str] | None) -> int:
        """A tenants-file entry: its config, and its keys as a change (`file_key_changes`). A
        key the tenant holds is left as it is, so a key rotated out keeps its grace deadline
        (the file never revives it); a key taken stops at once, unless it is in a grace
        period, which it keeps."""
        with self._lock:
            give, take = file_key_changes(keys, previous, name not in self._cfg)
            give = [d for d in give if self._owner.get(d) != name]
            if any(d in self._owner for d in give):
                return KEY_CONFLICT
            if any(d in self._admins for d in give):
                return ADMIN_CONFLICT
            held = self._keys.setdefault(name, [])
            for d in take:
                if self._owner.get(d) == name and d not in self._expiry:
                    del self._owner[d]
                    held.remove(d)
            for d in give:
                self._owner[d] = name
                held.append(d)
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

    def is_admin(self, digest: str, legacy: str | None = None) -> bool:
        with self._lock:
            if legacy and digest not in self._admins and legacy in self._admins:
                self._rename(legacy, digest)
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

    def revoke_admin(self, digest: str, caller: str, legacy: str | None = None) -> int:
        with self._lock:
            if digest not in self._admins and legacy in self._admins:
                digest = legacy
            if digest not in self._admins:
                return NOT_ADMIN
            if digest == caller:
                return OWN_KEY
            if len(self._admins) <= 1:
                return LAST_ADMIN
            self._admins.discard(digest)
            return REVOKED

    def legacy_digests(self) -> list[str]:
        """The "sha256:" digests stored (tenants' keys and admin keys), for `migrate`."""
        with self._lock:
            return [d for d in [*self._owner, *self._admins] if d.startswith(LEGACY_PREFIX)]

    def migrate(self, pairs: list[tuple[str, str]]) -> None:
        """Each (old, new): the key stored as `old` is stored as `new` from now on."""
        with self._lock:
            for old, new in pairs:
                self._rename(old, new)

    def pepper_check(self, check: str | None) -> str | None:
        """The check value of the pepper the keys rest under, storing `check` if there is none."""
        with self._lock:
            if self._pepper_check is None:
                self._pepper_check = check
            return self._pepper_check

    def applied(self) -> dict[str, str]:
        return dict(self._applied)

    def mark_applied(self, name: str, record: str) -> None:
        self._applied[name] = record

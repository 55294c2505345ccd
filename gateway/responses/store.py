"""Stored responses: each one's owner and what it asked (`Header`), and once it has ended its
final output, kept for its tenant's TTL from its creation, then gone (a GET is a 404, as for an id
never made). In memory (the embedded default) or in Redis (gateway/responses/redis_store.py), so
that any gateway replica, or a restarted one, can answer for any response.

Each tenant's stored responses are counted as they are kept, deleted and expire, so a put is
measured against the tenant's quota (gateway/responses/quota.py) in O(1), however many it keeps;
and they go with their tenant (`drop_tenant`). The request's tokens, while it runs, are the
scheduler's (its state store, `StateStore.tail`): a final copy is kept here because the
scheduler's record of an ended request expires sooner.

The calls measure or copy a response (work that grows with it): callers on an event loop make
them on a worker thread, in memory too (gateway/responses/service.py).
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from gateway.responses.objects import Header, Stored
from gateway.responses.quota import KEPT, TAKEN, Kept, Quota, dumps, header_json, over


class ResponseStore(Protocol):
    remote: bool

    def put(self, header: Header, quota: Quota | None = None) -> Kept:
        """Keep a new response for `quota.ttl_s` if its tenant (`header.tenant_id`) stays within
        `quota` (None: the store's TTL, no caps); false (`Kept.ok`) if its id is taken or the
        quota would be passed (`Kept.over`)."""

    def get(self, response_id: str) -> Stored | None:
        """A response that has not expired, whoever owns it (callers check `tenant_id`)."""

    def finalize(self, response_id: str, final: dict[str, Any]) -> bool:
        """Keep an ended response's output (idempotent), counted against its tenant; False if
        it is gone (expired, deleted): a final is never written without its header."""

    def delete(self, response_id: str) -> bool:
        """Forget a response; False if there was none."""

    def drop_tenant(self, tenant_id: str) -> int:
        """Forget every response of a tenant (removed); returns how many. O(its responses)."""

    def tenants(self) -> set[str]:
        """The ids of the tenants that may hold stored responses (what a sweep checks against
        the tenants that exist)."""


@dataclass(slots=True)
class _Held:
    header: Header
    final: str | None            # JSON, as Redis holds it: a caller never holds the store's objects
    ttl_s: float
    expires_at: float
    size: int                    # bytes counted against its tenant: header and final


class MemoryResponses:
    """In this process. Expiry does work only for what is due: ids are kept per TTL in the order
    they expire (within one TTL, the order they were put), so each call looks at the due ones and
    at one more per TTL in use, never at the rest."""
    remote = False

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._held: dict[str, _Held] = {}
        self._due: dict[float, dict[str, None]] = {}          # TTL -> ids, first to expire first
        self._tenants: dict[str, dict[str, None]] = {}        # tenant id -> its ids, oldest first
        self._bytes: dict[str, int] = {}                      # tenant id -> bytes counted
        self._lock = threading.Lock()

    def put(self, header: Header, quota: Quota | None = None) -> Kept:
        quota = quota if quota is not None else Quota(self.ttl_s)
        size, tid = len(header_json(header)), header.tenant_id
        with self._lock:
            now = self._clock()
            self._expire(now)
            if header.id in self._held:
                return TAKEN
            ids = self._tenants.get(tid, {})
            passed = over(quota, len(ids), self._bytes.get(tid, 0), size)
            if passed is not None:
                first = self._held[next(iter(ids))].expires_at - now if ids else None
                return Kept(False, passed, size, first)
            self._held[header.id] = _Held(header, None, quota.ttl_s, now + quota.ttl_s, size)
            self._due.setdefault(quota.ttl_s, {})[header.id] = None
            self._tenants.setdefault(tid, {})[header.id] = None
            self._bytes[tid] = self._bytes.get(tid, 0) + size
            return KEPT

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            self._expire(self._clock())
            held = self._held.get(response_id)
            if held is None:
                return None
            return Stored(held.header, None if held.final is None else json.loads(held.final))

    def finalize(self, response_id: str, final: dict[str, Any]) -> bool:
        text = dumps(final)
        with self._lock:
            self._expire(self._clock())
            held = self._held.get(response_id)
            if held is None:
                return False
            size = held.size - len(held.final or "") + len(text)
            tid = held.header.tenant_id
            self._bytes[tid] += size - held.size
            held.final, held.size = text, size
            return True

    def delete(self, response_id: str) -> bool:
        with self._lock:
            self._expire(self._clock())
            return self._forget(response_id) is not None

    def drop_tenant(self, tenant_id: str) -> int:
        with self._lock:
            ids = list(self._tenants.get(tenant_id, ()))
            for rid in ids:
                self._forget(rid)
            return len(ids)

    def tenants(self) -> set[str]:
        with self._lock:
            return set(self._tenants)

    def _expire(self, now: float) -> None:
        """Forget what is due: per TTL, from the first to expire until one that is not."""
        for ttl_s, ids in list(self._due.items()):
            while ids:
                rid = next(iter(ids))
                if self._held[rid].expires_at > now:
                    break
                self._forget(rid)

    def _forget(self, response_id: str) -> _Held | None:
        held = self._held.pop(response_id, None)
        if held is None:
            return None
        due = self._due[held.ttl_s]
        del due[response_id]
        if not due:
            del self._due[held.ttl_s]
        tid = held.header.tenant_id
        ids = self._tenants[tid]
        del ids[response_id]
        self._bytes[tid] -= held.size
        if not ids:
            del self._tenants[tid], self._bytes[tid]
        return held


def open_responses(redis_url: str | None, prefix: str, ttl_s: float, timeout_s: float) -> ResponseStore:
    if not redis_url or redis_url == "memory://":
        return MemoryResponses(ttl_s)
    from gateway.responses.redis_store import RedisResponses   # redis-py only when Redis is used
    from scheduler.store.redis_client import redis_client
    return RedisResponses(redis_client(redis_url, timeout_s), prefix, ttl_s)

"""This replica's memory of API keys whose tenant is over a limit: a refusal it can give again
without authenticating the key or asking the state store.

A closed-loop client over its limits sends its next request the moment the last is refused, so
what a refusal costs the gateway (its event loop, its GIL: every tenant's streams and the step
loop) is what that client takes from everyone. The full path of a refusal is the HTTP request,
FastAPI's dependencies, a thread hop and a Redis round trip to authenticate, the limiter's own
checks, a body read and parsed; `gateway.http.early_refusal` answers a key this book holds a
verdict for before any of it.

What a verdict is, and why it can only refuse what the shared limiter would refuse too:

    rpm          noted when the limiter refused the key's tenant an arrival: nothing can fit
                 before its next slot (a refused arrival charges nothing, and other replicas'
                 arrivals only push the slot later), so the verdict lasts until then;
    concurrency  noted only when this replica itself holds at least the tenant's
                 `max_concurrent` slots (`GrantKeeper.held`): the shared count is at least ours,
                 so the limiter refuses too, until one of those requests ends here, which ends
                 the verdict at once. Slots held on other replicas free where this one cannot
                 see it, so a refusal while some are held elsewhere is not noted.

Every verdict also ends `max_age_s` after it was noted, whatever its kind, because it was noted
for a key and a tenant record as they were: a key revoked or rotated out, or a limit raised by
the admin API, takes effect on this path within that bound (until then the key is refused with
a 429, never admitted). Nothing here ever admits: a key without a verdict takes the full path.

Keyed by the presented key's digest, so a verdict is reached only by someone holding the key;
every presented key is hashed and looked up alike, so a lookup's cost says nothing of other
keys. At most `max_keys` verdicts (expired ones are swept when full; past that a new one is not
noted, which costs speed, not correctness). Event-loop only: no lock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from gateway.tenancy.rates import CONCURRENCY_RETRY_S, LimitExceeded, Verdict, refusal
from gateway.tenancy.records import Tenant

MAX_AGE_S = 1.0        # what a stale verdict may delay: a revocation's 401, a raised limit
MAX_KEYS = 4096
KINDS = ("rpm", "concurrency")


@dataclass(frozen=True)
class _Verdict:
    tenant: Tenant           # as it was when refused: the limits the refusal names
    kind: str
    ends: float              # the book's clock: gone from then on
    retry_at: float          # rpm: when its next slot fits (the Retry-After counts down to it)


class RefusalBook:
    def __init__(self, held: Callable[[str], int], *, clock: Callable[[], float] = time.monotonic,
                 max_age_s: float = MAX_AGE_S, max_keys: int = MAX_KEYS) -> None:
        """`held(tenant name)`: the concurrency slots this replica's requests of that tenant
        hold now (`GrantKeeper.held`)."""
        if max_age_s <= 0 or max_keys < 1:
            raise ValueError("max_age_s must be > 0 and max_keys >= 1")
        self._held, self._clock = held, clock
        self.max_age_s, self.max_keys = max_age_s, max_keys
        self._verdicts: dict[str, _Verdict] = {}

    def __len__(self) -> int:
        return len(self._verdicts)

    def refusal(self, digest: str) -> tuple[str, LimitExceeded] | None:
        """The refusal a request with this key digest gets now without asking anyone, and its
        tenant's name; or None (then it takes the full path). Its words and Retry-After are
        the limiter's own."""
        v = self._verdicts.get(digest)
        if v is None:
            return None
        now = self._clock()
        if now >= v.ends or not self._still(v):
            del self._verdicts[digest]
            return None
        wait = v.retry_at - now if v.kind == "rpm" else CONCURRENCY_RETRY_S
        return v.tenant.name, refusal(v.tenant, 0, Verdict(False, 0.0, v.kind, wait))

    def note(self, digest: str, tenant: Tenant, kind: str, retry_after_s: float) -> bool:
        """The full path refused the key with this digest, of `tenant`, for `kind` ("rpm" or
        "concurrency"; others are not noted), retry after `retry_after_s`: remember it if it is
        sure to hold (module docstring). Returns whether it was noted."""
        now = self._clock()
        if kind == "rpm" and tenant.rpm is not None:
            retry_at = now + max(0.0, retry_after_s)
            ends = min(retry_at, now + self.max_age_s)
        elif kind == "concurrency" and tenant.max_concurrent is not None:
            retry_at = ends = now + self.max_age_s
        else:
            return False
        v = _Verdict(tenant, kind, ends, retry_at)
        if ends <= now or not self._still(v):
            return False
        if digest not in self._verdicts and len(self._verdicts) >= self.max_keys:
            self._sweep(now)
            if len(self._verdicts) >= self.max_keys:
                return False
        self._verdicts[digest] = v
        return True

    def _still(self, v: _Verdict) -> bool:
        """A concurrency verdict holds while this replica alone fills the tenant's slots."""
        return v.kind != "concurrency" or self._held(v.tenant.name) >= (v.tenant.max_concurrent or 0)

    def _sweep(self, now: float) -> None:
        for digest in [d for d, v in self._verdicts.items() if now >= v.ends or not self._still(v)]:
            del self._verdicts[digest]

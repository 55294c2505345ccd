"""This replica's memory of API keys whose tenant is over a limit: a refusal it can give again
without authenticating the key or asking the state store.

A closed-loop client over its limits sends its next request the moment the last is refused, so
what a refusal costs the gateway (its event loop, its GIL: every tenant's streams and the step
loop) is what that client takes from everyone. The full path of a refusal is the request (HTTP
or gRPC), authentication's thread hop and Redis round trip, the limiter's own checks, a body or
message parsed; `gateway.http.early_refusal` answers a key this book holds a verdict for before
any of it, on either front.

What a verdict is, and why it can only refuse what the shared limiter would refuse too:

    rpm          noted when the limiter refused the key's tenant an arrival (a generation's or a
                 follower's: they share one bucket): nothing can fit before its next slot (a
                 refused arrival charges nothing, and other replicas' arrivals only push the slot
                 later), so the verdict lasts until then;
    concurrency  noted only when this replica itself holds at least the tenant's
                 `max_concurrent` slots (`GrantKeeper.held`): the shared count is at least ours,
                 so the limiter refuses too, until one of those requests ends here, which ends
                 the verdict at once. Slots held on other replicas free where this one cannot
                 see it, so a refusal while some are held elsewhere is not noted;
    followers    the same for the tenant's follower slots (gateway/followers.py), against the
                 followers' cap, which is a deployment's, not a tenant's;
    tpm          a tpm refusal depends on its request's tokens, so it is noted only for what is
                 true of any request of the key: that not even one token fits the tenant's
                 window (`Closed`, which admission's precheck gives when it can be sure of it:
                 gateway/service/admission.py). The window only moves later with time and with
                 charges, unless a charge is refunded: noted only when every grant the store
                 counted live for the tenant is held here, so a refund is a release here, which
                 `GrantKeeper.refunds` counts and which ends the verdict at once; otherwise it
                 lasts until one token fits, when the full path would next admit a request. Its
                 Retry-After is that wait, the soonest any request of the key could fit. A
                 charge never takes the window past a minute ahead, so that is at most one
                 token's share of the minute: this spares the full path to a flood against a
                 small tpm; against a large one a refusal is its own request's size, which the
                 gate cannot know without reading the body, and is not noted.

A key holds one verdict of each kind; a route asks only for the kinds its own full path checks
(`refusal(digest, kinds)`): a follower is never refused for its tenant's generations' slots.

Every verdict also ends `max_age_s` after it was noted, whatever its kind, because it was noted
for a key and a tenant record as they were: a key revoked or rotated out, or a limit raised by
the admin API, takes effect on this path within that bound (until then the key is refused with
a 429, never admitted). Nothing here ever admits: a key without a verdict takes the full path.

Keyed by the presented key's digest, so a verdict is reached only by someone holding the key;
every presented key is hashed and looked up alike, so a lookup's cost says nothing of other
keys. At most `max_keys` keys (expired verdicts are swept when full; past that a new key is not
noted, which costs speed, not correctness). The event loop's, which serves both fronts: no lock
(a removal tolerates another's, for tests that serve the fronts on two loops).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

from gateway.followers import cap_refusal
from gateway.tenancy.rates import CONCURRENCY_RETRY_S, Closed, LimitExceeded, Verdict, refusal
from gateway.tenancy.records import Tenant

MAX_AGE_S = 1.0        # what a stale verdict may delay: a revocation's 401, a raised limit
MAX_KEYS = 4096
KINDS = ("rpm", "tpm", "concurrency", "followers")


@dataclass(frozen=True)
class _Verdict:
    tenant: Tenant           # as it was when refused: the limits the refusal names
    kind: str
    ends: float              # the book's clock: gone from then on
    retry_at: float          # rpm, tpm: when its next slot fits (the Retry-After counts down to it)
    refunds: int = 0         # tpm: the tenant's refunds here when it was read (`GrantKeeper.refunds`)


class RefusalBook:
    def __init__(self, held: Callable[[str], int], *, clock: Callable[[], float] = time.monotonic,
                 max_age_s: float = MAX_AGE_S, max_keys: int = MAX_KEYS,
                 follower_held: Callable[[str], int] = lambda _tenant: 0,
                 follower_cap: int | None = None,
                 refunds: Callable[[str], int] = lambda _tenant: 0) -> None:
        """`held(tenant name)`: the concurrency slots this replica's requests of that tenant
        hold now (`GrantKeeper.held`); `follower_held`, the same of its follower slots, whose
        cap is `follower_cap` (None: follower refusals are not noted); `refunds`, the refunds
        of its tokens this replica has seen (`GrantKeeper.refunds`)."""
        if max_age_s <= 0 or max_keys < 1:
            raise ValueError("max_age_s must be > 0 and max_keys >= 1")
        self._held, self._clock = held, clock
        self._follower_held, self.follower_cap = follower_held, follower_cap
        self._refunds = refunds
        self.max_age_s, self.max_keys = max_age_s, max_keys
        self._verdicts: dict[str, dict[str, _Verdict]] = {}

    def __len__(self) -> int:
        return len(self._verdicts)

    def refusal(self, digest: str, kinds: Iterable[str]) -> tuple[str, str, LimitExceeded] | None:
        """The refusal a request with this key digest gets now without asking anyone, for the
        first of `kinds` (the limits its route checks, in the order its full path checks them)
        that holds a verdict: its tenant's name, the verdict's kind and the limiter's refusal
        (its words and Retry-After); or None (then it takes the full path)."""
        verdicts = self._verdicts.get(digest)
        if verdicts is None:
            return None
        now = self._clock()
        found = None
        for kind in kinds:
            v = verdicts.get(kind)
            if v is None:
                continue
            if now >= v.ends or not self._still(v):
                verdicts.pop(kind, None)
                continue
            found = v
            break
        if not verdicts:
            self._verdicts.pop(digest, None)
        if found is None:
            return None
        return found.tenant.name, found.kind, self._refusal(found, now)

    def _refusal(self, v: _Verdict, now: float) -> LimitExceeded:
        if v.kind == "followers":
            return cap_refusal(self.follower_cap or 0)
        wait = CONCURRENCY_RETRY_S if v.kind == "concurrency" else v.retry_at - now
        return refusal(v.tenant, 0, Verdict(False, 0.0, v.kind, wait))

    def note(self, digest: str, tenant: Tenant, kind: str, retry_after_s: float,
             closed: Closed | None = None) -> bool:
        """The full path refused the key with this digest, of `tenant`, for `kind` (one of
        `KINDS`; others are not noted), retry after `retry_after_s`, and, for tpm, said what
        holds for all its requests (`closed`; without it a tpm refusal is not noted): remember
        it if it is sure to hold (module docstring). Returns whether it was noted."""
        now = self._clock()
        refunds = 0
        if kind == "rpm" and tenant.rpm is not None:
            retry_at = now + max(0.0, retry_after_s)
            ends = min(retry_at, now + self.max_age_s)
        elif kind == "tpm" and tenant.tpm is not None and closed is not None:
            # `until` is on the monotonic clock the refusal read, the book's may be another
            retry_at = now + (closed.until - time.monotonic())
            ends, refunds = min(retry_at, now + self.max_age_s), closed.refunds
        elif ((kind == "concurrency" and tenant.max_concurrent is not None)
              or (kind == "followers" and self.follower_cap is not None)):
            retry_at = ends = now + self.max_age_s
        else:
            return False
        v = _Verdict(tenant, kind, ends, retry_at, refunds)
        if ends <= now or not self._still(v):
            return False
        if digest not in self._verdicts and len(self._verdicts) >= self.max_keys:
            self._sweep(now)
            if len(self._verdicts) >= self.max_keys:
                return False
        self._verdicts.setdefault(digest, {})[kind] = v
        return True

    def _still(self, v: _Verdict) -> bool:
        """A slots verdict holds while this replica alone fills the tenant's slots; a tpm one
        until this replica sees a refund."""
        if v.kind == "tpm":
            return self._refunds(v.tenant.name) == v.refunds
        if v.kind == "concurrency":
            return self._held(v.tenant.name) >= (v.tenant.max_concurrent or 0)
        if v.kind == "followers":
            return self._follower_held(v.tenant.name) >= (self.follower_cap or 0)
        return True

    def _sweep(self, now: float) -> None:
        for digest, verdicts in list(self._verdicts.items()):
            for kind, v in list(verdicts.items()):
                if now >= v.ends or not self._still(v):
                    verdicts.pop(kind, None)
            if not verdicts:
                self._verdicts.pop(digest, None)

"""No tenant starved of the resident slots: who may start in place of whom when `max_resident`
are held.

With `max_resident` started requests live, a request that has not started waits for one of them
to end (planner.py). Left at that, a tenant whose long requests started first holds every slot,
and every other tenant's new requests wait for them to finish (or for aging's bound): the steps
are shared fairly among tenants, the right to be in a step is not. So a tenant that holds no
started request may start one in place of a started request of the tenant furthest over its
weighted share (max_resident × its weight ÷ the summed weights of the tenants with live
requests): that tenant's least recently served request not in this step, evicted and prefilled
again when next planned, so the cost of holding more than a share falls on the tenant that holds
it. Only a tenant holding none displaces: every tenant makes progress, and ordinary load, where
counts above and below the shares come and go, does not churn (displacing whenever a tenant was
under its share re-prefilled 576 times in the simulator's bursty chunked run under LAS, doubling
its mean latency).

Tiers come before tenants (scheduler/tiers.py): a request that has not started takes the place of
a started request of a lower service tier first, whoever's tenant holds what: the lowest tier's
least recently served request not in this step. Otherwise the tier served first waits for a
lower tier's requests to end whenever they hold every slot (as aging's promotions make them do
under overload), and its objective is lost to the residency, not the order. A deployment whose
requests are all one tier never displaces so.

Pure bookkeeping over the plan's view of the state; one `ResidentShares` per plan, counting the
started requests only when a start first meets a full house.
"""
from __future__ import annotations

from typing import Callable, Collection, Mapping

from scheduler.request import RequestStats
from scheduler.tiers import TIERS, tier_of

_RANK = {t: i for i, t in enumerate(TIERS)}


class ResidentShares:
    """One plan's per-tenant count of started requests and who may displace whom (module
    docstring)."""

    def __init__(self, requests: Mapping[str, RequestStats], started: set[str], cap: int,
                 weight: Callable[[str], float], live_tenants: Callable[[], Collection[str]]) -> None:
        self.requests, self.started, self.cap = requests, started, cap
        self.weight, self.live_tenants = weight, live_tenants
        self._held: dict[str, list[str]] | None = None    # tenant -> its started requests
        self._total = 0.0                                  # live tenants' summed weights
        self._out: set[str] = set()                        # displaced in this plan

    def share(self, tenant: str) -> float:
        """The started requests `tenant` is entitled to now."""
        self._count()
        return self.cap * self.weight(tenant) / self._total if self._total else float(self.cap)

    def displaceable(self, s: RequestStats, taken: Collection[str]) -> str | None:
        """A started request that `s` (not started) may take the place of, none of `taken` (this
        step's batch): one of a lower tier, else the least recently served of the tenant furthest
        over its share, when `s`'s tenant holds none. None: `s` waits for a slot."""
        below = self._lower_tier(s, taken)
        if below is not None:
            return below
        held = self._count()
        if held.get(s.tenant):                  # it holds one already: it is making progress
            return None
        over = [(len(ids) / self.weight(t), t) for t, ids in held.items()
                if t != s.tenant and len(ids) > self.share(t)]
        for _, tenant in sorted(over, reverse=True):
            free = [r for r in held[tenant] if r not in taken]
            if free:
                # ties (served in the same step) go to the latest arrival, then the id: never
                # to the started set's own order, which string hashing makes run-dependent
                return min(free, key=lambda r: (self.requests[r].last_served_s,
                                                -self.requests[r].arrival_s, r))
        return None

    def _lower_tier(self, s: RequestStats, taken: Collection[str]) -> str | None:
        """A started request of a tier served after `s`'s, none of `taken`: the lowest such
        tier's least recently served (module docstring, tiers). None: there is none."""
        rank = _RANK[tier_of(s.tier)]
        if rank == len(TIERS) - 1:              # the last tier outranks nobody
            return None
        best, key = None, None
        for rid in self.started:
            r = self.requests.get(rid)
            if r is None or rid in taken or rid in self._out:
                continue
            other = _RANK[tier_of(r.tier)]
            if other <= rank:
                continue
            k = (-other, r.last_served_s, -r.arrival_s, rid)
            if key is None or k < key:
                best, key = rid, k
        return best

    def displace(self, out: str, s: RequestStats) -> None:
        """`s` starts in `out`'s place (`displaceable`'s answer): the counts follow."""
        held = self._count()
        self._out.add(out)
        held[self.requests[out].tenant].remove(out)
        held.setdefault(s.tenant, []).append(s.request_id)

    def _count(self) -> dict[str, list[str]]:
        if self._held is None:
            self._held = {}
            for rid in self.started:
                s = self.requests.get(rid)
                if s is not None:
                    self._held.setdefault(s.tenant, []).append(rid)
            self._total = sum(self.weight(t) for t in self.live_tenants())
        return self._held

"""The queues the batch planner chooses from: live requests ranked by the policy's key, one heap
per (planning class, tenant), tenants merged under weighted fair sharing (fairness.py). A
request's planning class is its service tier, then its tenant's priority class
(`RequestStats.plan_class`, scheduler/tiers.py); the planner chooses band by band (`choose`'s
`tiers`).

Speed: keys change only when a request is served, so each (class, tenant) queue is a heap of
(key, seq, id) and a served request whose key changed gets a new entry; an entry whose seq is no
longer its request's live seq is stale and dropped when it reaches the top. Choosing looks at the
top few entries only: O(batch · log n), not O(n log n). Served requests are only marked dirty
(`served`), and re-ranked (`rekey`) when a plan must choose.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Collection

from scheduler.policies.fairness import TenantFairness
from scheduler.policies.ordering import Ordering
from scheduler.request import RequestStats
from scheduler.state import SchedulerState
from scheduler.tiers import TIERS, class_tier

Entry = tuple[float, int, str]   # (key, seq, request id)
Candidate = tuple[float, float, int, str, str]   # (key, tenant's virtual time, seq, id, tenant)
Back = list[tuple[list[Entry], Entry]]   # taken entries popped while choosing, pushed back after
Admit = Callable[[str], bool]   # whether the plan can start this request (room, KV)


class RequestQueues:
    """Live requests by (planning class, tenant), ranked by `ordering` (module docstring)."""

    def __init__(self, ordering: Ordering, fairness: TenantFairness, nominal_cost: float) -> None:
        """`nominal_cost`: the tree tokens a request that has not run yet is charged to its
        tenant's virtual time while a plan merges tenants."""
        self.ordering, self.fairness, self.nominal_cost = ordering, fairness, nominal_cost
        self.reset()

    def reset(self) -> None:
        self._queues: dict[int, dict[str, list[Entry]]] = {}
        self._counts: dict[int, dict[str, int]] = {}
        self._classes: list[int] = []
        self._live: dict[str, int] = {}       # request id -> seq of its live heap entry
        self._keys: dict[str, float] = {}
        self._seq = itertools.count()
        self._dirty: set[str] = set()         # served since last ranked

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def tenants(self) -> set[str]:
        """The tenants with live requests, in any planning class."""
        return {t for counts in self._counts.values() for t in counts}

    def rank(self, request_id: str) -> float:
        """The request's key when it was last ranked (0 for one not queued)."""
        return self._keys.get(request_id, 0.0)

    # ---- membership --------------------------------------------------------------------------
    def add(self, state: SchedulerState, s: RequestStats) -> None:
        cls, tenant = s.plan_class, s.tenant
        if cls not in self._queues:
            self._queues[cls], self._counts[cls] = {}, {}
            self._classes = sorted(self._queues)
        counts = self._counts[cls]
        counts[tenant] = counts.get(tenant, 0) + 1
        self._queues[cls].setdefault(tenant, [])
        if counts[tenant] == 1:
            self.fairness.activate(state, cls, tenant, counts)
        self.ordering.refresh(state, s)
        self._push(s, self.ordering.key(s))

    def remove(self, s: RequestStats) -> None:
        rid = s.request_id
        self._dirty.discard(rid)
        del self._live[rid], self._keys[rid]
        cls = s.plan_class
        counts = self._counts[cls]
        counts[s.tenant] -= 1
        if counts[s.tenant] == 0:
            del counts[s.tenant]
            del self._queues[cls][s.tenant]   # its entries are all stale now
            if not counts:                    # its class's last: a class with no tenant left
                del self._counts[cls], self._queues[cls]   # has none to be fair between
                self._classes.remove(cls)

    def touch(self, request_id: str) -> None:
        """Rank a live request again before the next choice (it was served, or its stats
        changed between steps)."""
        if request_id in self._live:
            self._dirty.add(request_id)

    def served(self, request_ids: set[str]) -> None:
        self._dirty |= request_ids

    def rekey(self, state: SchedulerState) -> None:
        """Refresh and re-key every request touched since it was last ranked."""
        requests, keys = state.requests, self._keys
        # bound once: this loop runs for every request served since the last ranking
        refresh, key_of, push = self.ordering.refresh, self.ordering.key, self._push
        # in the order they were last ranked: equal new keys keep their old order, and a set's
        # own order (string hashes, PYTHONHASHSEED) never breaks a tie
        for rid in sorted(self._dirty, key=self._live.__getitem__):
            s = requests[rid]
            refresh(state, s)
            key = key_of(s)
            if key != keys[rid]:
                push(s, key)
        self._dirty.clear()

    def _push(self, s: RequestStats, key: float) -> None:
        rid, seq, cls = s.request_id, next(self._seq), s.plan_class
        heap = self._queues[cls][s.tenant]
        heapq.heappush(heap, (key, seq, rid))
        self._live[rid], self._keys[rid] = seq, key
        if len(heap) > 2 * self._counts[cls][s.tenant] + 32:
            live = self._live
            heap[:] = [e for e in heap if live.get(e[2]) == e[1]]
            heapq.heapify(heap)

    # ---- choosing ----------------------------------------------------------------------------
    def choose(self, state: SchedulerState, chosen: list[str], taken: set[str], limit: int,
               admit: Admit, tiers: Collection[str] = TIERS) -> None:
        """Append the best requests of `tiers` to `chosen` until it holds `limit`: planning
        classes in order (lowest first), inside a class tenants merged under fair sharing; a
        request `admit` refuses (no room to start it) is skipped, marked `taken`."""
        for cls in self._classes:
            if len(chosen) >= limit:
                break
            if class_tier(cls) in tiers:
                self._pick_class(state, cls, chosen, taken, limit, admit)

    def _pick_class(self, state: SchedulerState, cls: int, chosen: list[str], taken: set[str],
                    limit: int, admit: Admit) -> None:
        """Append this class's best requests to `chosen`, tenants merged under fair sharing."""
        queues, counts = self._queues[cls], self._counts[cls]
        if not counts:                           # every request of the class has left
            return
        back: Back = []
        cand: list[Candidate] = []
        if len(counts) == 1:                     # one tenant: nobody to be fair to
            (tenant,) = counts
            heap = queues[tenant]
            while len(chosen) < limit and self._offer(heap, tenant, taken, back, cand):
                rid = heapq.heappop(cand)[3]
                _take(rid, chosen, taken, admit)
        else:
            self._merge_tenants(state, cls, chosen, taken, limit, admit, back, cand)
        for heap, entry in back:
            heapq.heappush(heap, entry)

    def _merge_tenants(self, state: SchedulerState, cls: int, chosen: list[str], taken: set[str],
                       limit: int, admit: Admit, back: Back, cand: list[Candidate]) -> None:
        """Tenants within `fair_lag_tokens` of the least served compete by key; a tenant that
        ran ahead is deferred, and offered only when nobody eligible is left (work conserving).
        Equal keys go to the tenant with less virtual time (this plan's picks included), not to
        the earlier arrival: fresh requests all share one key under LAS and LAPS, and a tenant
        that queued many (each costing little verified work, but a prefill and a slot) would
        otherwise start every one of them before another tenant's single request."""
        queues, counts = self._queues[cls], self._counts[cls]
        vt, cap = self.fairness.split(state, cls, counts)
        deferred: list[str] = []
        for tenant in counts:
            if vt[tenant] <= cap:
                self._offer(queues[tenant], tenant, taken, back, cand, vt[tenant])
            else:
                deferred.append(tenant)
        requests, nominal, weight = state.requests, self.nominal_cost, self.fairness.weight
        offer, pop = self._offer, heapq.heappop      # bound once: one round per chosen request
        fair_phase = True
        while len(chosen) < limit:
            if not cand:
                if not (fair_phase and deferred):
                    return
                fair_phase = False              # work conserving: tenants that ran ahead
                for tenant in deferred:
                    self._offer(queues[tenant], tenant, taken, back, cand, vt[tenant])
                continue
            _, _, _, rid, tenant = pop(cand)
            if not _take(rid, chosen, taken, admit):    # no room to start it: look further
                offer(queues[tenant], tenant, taken, back, cand, vt[tenant])
                continue
            s = requests[rid]
            vt[tenant] += (s.attained / s.n_steps if s.n_steps else nominal) / weight(tenant)
            if not fair_phase or vt[tenant] <= cap:
                offer(queues[tenant], tenant, taken, back, cand, vt[tenant])
            else:
                deferred.append(tenant)

    def _offer(self, heap: list[Entry], tenant: str, taken: set[str], back: Back,
               cand: list[Candidate], served: float = 0.0) -> bool:
        """Put the tenant's best live, untaken entry into the candidate heap (it stays on top of
        the tenant's heap; taken entries are popped into `back`, stale ones dropped); `served`:
        the tenant's virtual time, which breaks ties between equal keys."""
        live = self._live
        while heap:
            key, seq, rid = heap[0]
            if live.get(rid) != seq:
                heapq.heappop(heap)             # stale: dropped for good
            elif rid in taken:
                back.append((heap, heapq.heappop(heap)))
            else:
                heapq.heappush(cand, (key, served, seq, rid, tenant))
                return True
        return False


def _take(rid: str, chosen: list[str], taken: set[str], admit: Admit) -> bool:
    """Choose `rid`, unless `admit` refuses it (then it is only marked taken, so that the rest
    of the plan skips it)."""
    taken.add(rid)
    if not admit(rid):
        return False
    chosen.append(rid)
    return True

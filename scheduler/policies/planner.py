"""The batch planner: every policy's machinery, around the one thing a policy is (its `Ordering`).

    plan(state, now):   1.-2. band by band (service tiers, scheduler/tiers.py `BANDS`: the
                           priority tier, then default and flex): the band's requests about to
                           pass their tier's aging bound, oldest first (aging.py, per tier), then
                           its planning classes in order (tier, then tenant class; lowest
                           first); inside a class, tenants' queues merged by key under weighted
                           fair sharing (queues.py, fairness.py);
                        3. up to max_batch requests, one root token each within token_budget;
                        4. with chunked prefill (`prefill_chunk_tokens`), the step's prefill
                           budget: chosen requests whose context still needs KV get chunks of
                           it in plan order (one left without budget waits), what is left
                           prefills requests admitted ahead of their turn (`prefilling`), and
                           trees get the token budget less roots and chunks (step_budget.py);
                        5. each chosen request's tree budget (sizing.py: its α estimate, its
                           drafting time and cap, the step's measured cost); a request whose
                           chunk does not complete its context gets none (it has no root yet).
                        With `max_resident` set (the step loop's KV limit), a request that has
                        not started is started only while fewer than max_resident started
                        requests are live, so the loop never has to evict and re-prefill;
                        except that a tenant holding none of those slots starts in place of a
                        request of the tenant furthest over its weighted share (shares.py).
                        With a KV budget, a start is planned only where its KV fits, and
                        residents' growth is made room for (`KVBudget`, scheduler/kv_budget.py);
                        the budget is one (`kv_budget_tokens`) or one per home
                        (`SchedulerState.kv_budgets`, Ray mode's verifier replicas), the same
                        rules applied home by home.
    update(state, records, now, step_s):
                        record each request's step (τ, attained service, wait), charge its
                        tenant, retire finished ones, let the ordering move the others (`refresh`:
                        levels, perceptible, predicted remaining time) and re-key them; requests
                        that ran last step and not this one are preempted.

Both are pure bookkeeping: no I/O, no clock (time comes in as arguments), no randomness. What one
plan works out (KV room and homes, how many more may start) lives in objects made for that call
(`KVBudget`, `_Starts`); the planner keeps only what outlives a step: the queues, aging, which
requests have started or are prefilling ahead of their turn, and the tenants' drafter priors.
Requests whose stream's reader fell behind are paused (`pauses`, pauses.py): out of the state's
live requests and of every index until resumed, so no plan sees them.
While every live request fits in one batch nobody needs ranking: the plan takes them all (in
admission order within each planning class, which decides only who starts when KV is short),
and served requests are re-ranked by the first plan that must choose.
"""
from __future__ import annotations

from typing import Collection, Iterable, Mapping

from scheduler.alpha import AlphaEstimate, DrafterPrior, pool
from scheduler.kv_budget import KVBudget
from scheduler.policies.aging import TierAging
from scheduler.policies.fairness import TenantFairness, prefill_weight
from scheduler.policies.ordering import Ordering
from scheduler.policies.pauses import Pauses
from scheduler.policies.plan import Plan, PolicyConfig
from scheduler.policies.queues import RequestQueues
from scheduler.policies.shares import ResidentShares
from scheduler.policies.step_budget import StepBudget
from scheduler.request import RequestStats, Status, StepRecord
from scheduler.state import SchedulerState
from scheduler.tiers import BANDS, TIERS


class _Starts:
    """One plan's room for requests that have not started: at most `left` more of them
    (max_resident; None: no cap), their KV within the budget, and, with no room left, a start in
    place of another tenant's request for a tenant holding none (shares.py)."""

    def __init__(self, requests: Mapping[str, RequestStats], started: set[str], kv: KVBudget,
                 left: int | None, shares: ResidentShares | None = None,
                 chosen: Collection[str] = ()) -> None:
        self.requests, self.started, self.kv, self.left = requests, started, kv, left
        self.shares, self.chosen = shares, chosen
        self.displaced: list[str] = []

    def admit(self, rid: str, *, force: bool = False) -> bool:
        """Whether `rid` can start (or run) this step, taking its room if so; `force`: an aged
        request, placed whether or not its KV fits (`KVBudget.fit` makes room)."""
        starts = self.left is not None and (rid not in self.started or rid in self.displaced)
        out = None
        if starts and self.left <= 0:
            if self.shares is None:
                return False
            out = self.shares.displaceable(self.requests[rid], self.chosen)
            if out is None:
                return False
        if not self.kv.allocate(self.requests[rid], force=force):
            return False
        if out is not None:
            self.shares.displace(out, self.requests[rid])
            self.displaced.append(out)
        elif starts:
            self.left -= 1
        return True


class BatchPlanner:
    """Plans each step for one ordering (module docstring); what the step loop holds."""

    def __init__(self, ordering: Ordering, config: PolicyConfig | None = None) -> None:
        c = self.config = config or PolicyConfig()
        c.check()
        self.ordering = ordering
        self.fairness = TenantFairness(c.tenant_weights, c.fair_lag_tokens)
        self._prefill_weight = (prefill_weight(c.step_cost, c.max_batch, c.token_budget)
                                if c.fair_prefill_weight is None else c.fair_prefill_weight)
        ages = ordering.ages                  # the strict baseline holds no request to a bound
        self.aging = TierAging(c.aging_bound_s if ages else None, c.aging_margin_steps,
                               c.total_wait_bound_s if ages else None,
                               c.tier_wait_s if ages else {t: None for t in TIERS})
        self.queues = RequestQueues(ordering, self.fairness, c.token_budget / c.max_batch)
        self.budget = StepBudget(c, ordering.node_urgency, self.fairness.weight)
        self._limit = min(c.max_batch, c.token_budget)   # one root token per request at least
        # What each (tenant, drafter)'s requests have shown the planner (alpha.DrafterPrior): soft
        # state, relearned after a restart; a rebuild keeps it, and a caller may carry it over.
        self.priors: dict[tuple[str, str | None], DrafterPrior] = {}
        self._started: set[str] = set()       # live requests that have had a step (hold KV)
        self._warming: dict[str, None] = {}   # admitted ahead of their turn, oldest first
        # held out of every plan while their stream's reader catches up (pauses.py)
        self.pauses = Pauses(self.queues, self.aging, self._started, self._warming)

    @property
    def name(self) -> str:
        return self.ordering.name

    # ---- lifecycle ---------------------------------------------------------------------------
    def add(self, state: SchedulerState, s: RequestStats) -> None:
        """Admit a request into the state and the queues. A request with no evidence of its own
        starts from what its tenant's earlier requests showed of its drafter."""
        if self.config.learn_priors and s.n_steps == 0 and s.estimate == AlphaEstimate():
            prior = self.priors.get((s.cache_tenant, s.drafter))
            if prior is not None:
                s.estimate = prior.start()
        state.requests[s.request_id] = s
        self._index(state, s)

    def drop_tenant(self, tenant_id: str) -> None:
        """A tenant was removed: forget what its requests showed (`RequestStats.cache_tenant`)."""
        for key in [k for k in self.priors if k[0] == tenant_id]:
            del self.priors[key]

    def prefilling(self, request_id: str) -> None:
        """The loop admitted a request ahead of its turn with context left to prefill: steps
        prefill it with the prefill budget their chosen requests leave (oldest first), so that
        its length is predicted before it is first served."""
        if request_id in self.queues:
            self._warming[request_id] = None

    def kv_fits(self, state: SchedulerState, s: RequestStats) -> bool:
        """Whether starting `s` now keeps the KV held within the budget (`kv_place`)."""
        return self.kv_place(state, s)[0]

    def kv_place(self, state: SchedulerState, s: RequestStats) -> tuple[bool, str | None]:
        """Whether starting `s` now keeps the KV held within the budget (always, without one),
        and the home it starts on (`most_room`; None: the one budget's): the loop asks before
        prefilling an arrival ahead of its turn, and prefills it there."""
        return self._kv(state).place(s)

    def touch(self, request_id: str) -> None:
        """A live request's stats changed between steps (a length prediction came in): rank it
        again at the next plan."""
        self.queues.touch(request_id)

    def remove(self, state: SchedulerState, request_id: str, status: Status,
               cause: str | None, now: float) -> RequestStats | None:
        """End a live request early (cancelled, failed), paused or not. Returns it, or None
        if not live."""
        s = state.requests.get(request_id)
        if s is not None:
            self._retire(state, s, status, cause, now)
        elif (s := self.pauses.end(state, request_id)) is not None:
            s.end(status, cause, now)
        return s

    def rebuild(self, state: SchedulerState) -> None:
        """Recreate the queues from `state` alone (e.g. after a restart)."""
        self.queues.reset()
        self._started.clear()
        self._warming.clear()
        self.aging.clear()
        self.ordering.reset()
        for s in state.requests.values():
            self._index(state, s)
        self.aging.rebuild(state.requests.values())

    # ---- the two calls of the step loop ------------------------------------------------------
    def plan(self, state: SchedulerState, now: float) -> Plan:
        c, requests = self.config, state.requests
        kv = self._kv(state)
        chosen, aged, evict = self._choose_batch(state, now, kv)    # evict: started in place of
        if kv.limited:
            chosen, freed = kv.fit(chosen, self.queues.rank)
            evict = evict + freed
        self._started.difference_update(evict)
        for rid in evict:
            self._warming.pop(rid, None)
        if c.prefill_chunk_tokens:
            plan, stale = self.budget.chunked(requests, chosen, aged, self._warming)
            for rid in stale:
                del self._warming[rid]
            first_warm = len(plan) - plan.warm    # a chunk of its context: it holds KV from now
            self._started.update(r for r, k in zip(plan.request_ids[:first_warm], plan.prefill) if k)
            self.fairness.charge_prefill(state, self._prefill_weight,
                                         zip(plan.request_ids, plan.prefill))
        else:
            fresh = [(r, requests[r].unprefilled) for r in chosen if r not in self._started]
            plan = Plan(chosen, self.budget.trees([requests[r] for r in chosen]), aged)
            self.fairness.charge_prefill(state, self._prefill_weight, fresh)
        plan.evict = evict
        plan.homes = kv.planned_homes(plan.request_ids)
        return plan

    def update(self, state: SchedulerState, records: Iterable[StepRecord], now: float,
               step_s: float) -> list[RequestStats]:
        """Record one step that ended at `now` and took `step_s`. Returns the finished requests."""
        a = self.config.step_s_smoothing
        state.step_s = step_s if state.step_s is None else (1 - a) * state.step_s + a * step_s
        state.step_s_max = max(state.step_s_max, step_s)
        start = now - step_s
        requests, served, finished = state.requests, set(), []
        vt, weight = state.virtual_time, self.fairness.weight
        # hoisted: this loop runs once per served request every step
        learn, priors, start_ = self.config.learn_priors, self.priors, self._started.add
        for rec in records:
            s = requests.get(rec.request_id)
            if s is None:                       # cancelled while its step ran
                continue
            s.record_step(rec, start, now)
            if rec.drafted and learn:
                key = (s.cache_tenant, s.drafter)
                prior = priors.get(key)
                priors[key] = pool(DrafterPrior() if prior is None else prior, rec.drafted,
                                   rec.accepted, rec.draft_s, rec.draft_depth)
            start_(rec.request_id)
            account = (s.plan_class, s.tenant)
            vt[account] = vt.get(account, 0.0) + rec.verified / weight(s.tenant)
            cause = rec.finish or ("length" if s.committed >= s.max_tokens else None)
            if cause is not None:
                self._retire(state, s, Status.FINISHED, cause, now)
                finished.append(s)
            else:
                served.add(rec.request_id)
        self.aging.served(served, requests)
        self.queues.served(served)
        if len(requests) > self._limit:
            self.queues.rekey(state)            # else: re-ranked by the next plan that must choose
        for rid in state.running - served:
            s = requests.get(rid)
            if s is not None:                   # left out of this step
                s.status = Status.PREEMPTED
        state.running = served
        self.ordering.finished(finished)
        return finished

    # ---- choosing ----------------------------------------------------------------------------
    def _kv(self, state: SchedulerState) -> KVBudget:
        c = self.config
        return KVBudget(state, c.kv_budget_tokens, block=c.kv_block, tree=c.kv_tree_tokens)

    def _choose_batch(self, state: SchedulerState, now: float,
                      kv: KVBudget) -> tuple[list[str], int, list[str]]:
        """The step's requests, best first (or all, when all fit: in admission order within
        each planning class), how many of them aging promoted, and the started requests they
        start in place of (shares.py)."""
        requests, limit = state.requests, self._limit
        if len(requests) <= limit:              # everyone fits: only KV room can still choose
            ids = sorted(requests, key=lambda r: requests[r].plan_class)    # stable
            return [r for r in ids if kv.allocate(requests[r])], 0, []
        self.queues.rekey(state)
        promoted = self._promotions(state, now, limit, kv)
        chosen, displaced = self._choose(state, promoted, limit, kv)
        longer = self.budget.prefill_step_s(state, chosen) if self.aging.bounded else None
        if longer is not None:                  # a prefill makes this step the longest yet
            again = self._promotions(state, now, limit, kv, longer)
            if again != promoted:
                promoted, (chosen, displaced) = again, self._choose(state, again, limit, kv)
        picked = set(chosen)
        return chosen, sum(1 for band in promoted for r in band if r in picked), displaced

    def _promotions(self, state: SchedulerState, now: float, limit: int, kv: KVBudget,
                    longest_step_s: float = 0.0) -> list[list[str]]:
        """Aging's promotions, one list per band (`BANDS`): in each, its tiers' gaps at risk of
        passing their bound, then requests past the total-wait bound (`TierAging.due`); less
        those there is no room to start (max_resident). Each is placed on a home
        (`KVBudget.allocate`, forced: aging's bound holds, `fit` makes room), its room taken
        again by `_choose`."""
        cap = self.config.max_resident
        room, out, total = (None if cap is None else cap - len(self._started)), [], 0
        with kv.rooms_kept():
            for tiers in BANDS:
                band = []
                for rid in self.aging.due(tiers, state, now, limit, longest_step_s)[:limit - total]:
                    if rid not in self._started and room is not None:
                        if room <= 0:
                            continue
                        room -= 1
                    kv.allocate(state.requests[rid], force=True)
                    band.append(rid)
                total += len(band)
                out.append(band)
        return out

    def _choose(self, state: SchedulerState, promoted: list[list[str]], limit: int,
                kv: KVBudget) -> tuple[list[str], list[str]]:
        """Band by band: its promoted requests, then its queues' best, up to `limit`, each with
        room to start (a band's promoted requests are placed after the bands above it chose)."""
        chosen: list[str] = []
        taken: set[str] = set()
        if kv.limited:                          # the room as the state holds it
            kv.reopen()
        cap, started = self.config.max_resident, self._started
        shares = None if cap is None else ResidentShares(
            state.requests, started, cap, self.fairness.weight, self.queues.tenants)
        starts = _Starts(state.requests, started, kv, None if cap is None else cap - len(started),
                         shares, chosen)
        for tiers, aged in zip(BANDS, promoted):
            for rid in aged:
                if len(chosen) < limit and starts.admit(rid, force=True):
                    chosen.append(rid)
                taken.add(rid)
            self.queues.choose(state, chosen, taken, limit, starts.admit, tiers)
        return chosen, starts.displaced

    # ---- membership --------------------------------------------------------------------------
    def _index(self, state: SchedulerState, s: RequestStats) -> None:
        self.queues.add(state, s)
        self.aging.add(s)
        if s.n_steps:
            self._started.add(s.request_id)

    def _retire(self, state: SchedulerState, s: RequestStats, status: Status,
                cause: str | None, now: float) -> None:
        rid = s.request_id
        s.end(status, cause, now)
        del state.requests[rid]
        state.running.discard(rid)
        self.queues.remove(s)
        self._started.discard(rid)
        self.aging.remove(rid)

"""The policy interface and the machinery every policy shares.

A policy is one number per request: `key(stats)`, lower served first. Everything else is shared:

    plan(state, now):   1. requests about to pass the aging bound, oldest first (aging.py);
                        2. priority classes in order (0 first); inside a class, tenants' queues
                           merged by key under weighted fair sharing (fairness.py);
                        3. up to max_batch requests, one root token each within token_budget;
                        4. with chunked prefill (`prefill_chunk_tokens`), the step's prefill
                           budget: chosen requests whose context still needs KV get chunks of
                           it in plan order (one left without budget waits), what is left
                           prefills requests admitted ahead of their turn (`prefilling`), and
                           trees get the token budget less roots and chunks (`_chunked`);
                        5. each chosen request's tree budget (sizing.py: its α estimate, its
                           drafting time and cap, the step's measured cost); a request whose
                           chunk does not complete its context gets none (it has no root yet).
                        With `max_resident` set (the step loop's KV limit), a request that has
                        not started is started only while fewer than max_resident started
                        requests are live, so the loop never has to evict and re-prefill.
                        With a KV budget, a start is planned only where its KV fits, and
                        residents' growth is made room for (`_kv_start`, `_fit_kv`); the budget
                        is one (`kv_budget_tokens`) or one per home (`SchedulerState.kv_budgets`,
                        Ray mode's verifier replicas), the same rules applied home by home.
    update(state, records, now, step_s):
                        record each request's step (τ, attained service, wait), charge its
                        tenant, retire finished ones, let the policy move the others (`refresh`:
                        levels, perceptible, predicted remaining time) and re-key them; requests
                        that ran last step and not this one are preempted.

Both are pure bookkeeping: no I/O, no clock (time comes in as arguments), no randomness.

Speed: keys change only when a request is served, so each (class, tenant) queue is a heap of
(key, seq, id) and `update` pushes a new entry for a served request whose key changed; an entry
whose seq is no longer its request's live seq is stale and dropped when it reaches the top.
`plan()` looks at the top few entries only: O(batch · log n), not O(n log n). While every live
request fits in one batch, nobody needs ranking: the plan takes them all (in admission order),
and served requests are only marked dirty, to be re-ranked by the first plan that must choose.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, NamedTuple

from scheduler.policies.aging import AgingIndex
from scheduler.kv_budget import growth_slots, kv_homes, kv_rooms, most_room, start_slots
from scheduler.policies.fairness import TenantFairness
from scheduler.request import RequestStats, Status, StepRecord
from scheduler.alpha import AlphaEstimate, DrafterPrior, pool
from scheduler.sizing import SizingConfig, TreeSizer
from scheduler.state import SchedulerState
from scheduler.step_cost import StepCost
from workers.contract import NO_SPECULATION, TreeBudget

BAND = 1e12   # keys of the form band · BAND + value order by band first (levels, perceptible)

Entry = tuple[float, int, str]   # (key, seq, request id)
IDLE_CHUNKS = 8   # a step in which no request decodes prefills up to this many chunks' tokens
# keys per row without a measured chunk fit: the order of the default model's on CPU (README,
# "Chunked prefill")
DEFAULT_KEYS_PER_ROW = 1000.0
# contexts up to this many tokens cost a tree node about what the step-cost profile says (it is
# measured at a few hundred); deeper, a node's attention makes it dearer (`_depth_weights`)
SHALLOW_CONTEXT = 512


def chunk_budget(per_request: int, token_budget: int, decoding: int, waiting: int) -> int:
    """Context tokens one step may prefill: `per_request` for each of the `waiting` chosen
    requests whose context still lacks KV, within the rows the `decoding` requests' roots leave
    of `token_budget`. A step in which nobody decodes has no stream to hold up and prefills up
    to IDLE_CHUNKS (or `waiting`, if more) chunks' worth.

    Why per waiting request: a batch slot whose request waits for its context produces nothing;
    with one chunk a step shared by all of them, a full batch past saturation starts requests
    no faster than one chunk a step, and prefill, not decoding, bounds its capacity. One long
    prompt beside running streams still gets `per_request` a step (the stall bound).

    Worked example, per_request 24, token_budget 64: 4 decoding, 1 waiting → 24; 5 decoding,
    3 waiting → 59 (64 − 5 roots); 0 decoding, 2 waiting → 192.
    """
    if not decoding:
        return per_request * max(IDLE_CHUNKS, waiting)
    return min(per_request * max(waiting, 1), token_budget - decoding)


@dataclass(frozen=True)
class PolicyConfig:
    max_batch: int = 8
    token_budget: int = 64                 # per step: Σ over chosen of (1 + tree nodes)
    aging_bound_s: float | None = 60.0     # None: no aging
    aging_margin_steps: float = 2.0
    total_wait_bound_s: float | None = None   # see aging.py, "Total wait"; None: no such bound
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    fair_lag_tokens: float = 256.0
    sizing: SizingConfig = SizingConfig()  # tree sizing: caps and gains (scheduler/sizing.py)
    # New requests start from their (tenant, drafter)'s learned prior (alpha.DrafterPrior); off,
    # every request starts from the fixed one, its sizing independent of what ran before it.
    learn_priors: bool = True
    step_cost: StepCost | None = None      # measured cost model for goodput-aware tree budgets
    step_s_smoothing: float = 0.1          # weight of the newest step in the step-duration average
    max_resident: int | None = None        # requests that may hold KV at once (see `plan`)
    # context tokens a step may prefill for each chosen request still waiting for its context,
    # in chunks beside the trees (`chunk_budget`); 0: the step loop prefills each request whole,
    # in a pass of its own, before its first step
    prefill_chunk_tokens: int = 0
    # attention over this many keys costs about what one row's linears do: a chunk of k tokens
    # after o tokens of context counts k × (1 + o / this) against prefill_chunk_tokens, so a
    # step with a chunk costs about the same early and late in a long prompt. None: the step
    # cost's measured chunk fit (`StepCost.keys_per_row`), else DEFAULT_KEYS_PER_ROW
    prefill_keys_per_row: float | None = None
    # KV slots every live request together may hold (the worker's KV budget in slots); None: no
    # byte limit. The planner defers starts and preempts by it (`_fit_kv`, scheduler/kv_budget.py),
    # with the verifier's block and tree sizes (a request's first allocation and growth). Where
    # the state carries one budget per home (`SchedulerState.kv_budgets`), those apply instead
    kv_budget_tokens: int | None = None
    kv_block: int = 256
    kv_tree_tokens: int = 65


class PlanEntry(NamedTuple):
    request_id: str
    budget: TreeBudget


@dataclass(slots=True)
class Plan:
    """One step's batch: request ids (best first, unless everyone fit) and their tree budgets;
    with chunked prefill, the context tokens each prefills this step, and how many at the end
    only prefill (admitted ahead of their turn: they commit nothing)."""
    request_ids: list[str]
    budgets: list[TreeBudget]
    aged: int = 0                          # how many of them were promoted by aging
    prefill: list[int] = field(default_factory=list)   # per request; empty: no chunks
    warm: int = 0                          # the last `warm` requests only prefill
    evict: list[str] = field(default_factory=list)     # free these requests' KV first (budget)
    # with a KV budget per home: the home each request that starts this step starts on (the
    # planner places, the worker prefills there)
    homes: dict[str, str | None] = field(default_factory=dict)

    @property
    def entries(self) -> list[PlanEntry]:
        return [PlanEntry(r, b) for r, b in zip(self.request_ids, self.budgets)]

    @property
    def tokens(self) -> int:
        """Σ over the batch of (1 root token + tree nodes): at most the token budget."""
        return len(self.request_ids) + sum(b.max_nodes for b in self.budgets)

    def __len__(self) -> int:
        return len(self.request_ids)


class Policy:
    name = "base"

    def __init__(self, config: PolicyConfig | None = None, **overrides) -> None:
        cfg = config or PolicyConfig()
        self.config = replace(cfg, **overrides) if overrides else cfg
        c = self.config
        if c.max_batch < 1 or c.token_budget < 1:
            raise ValueError("max_batch and token_budget must be ≥ 1")
        if c.max_resident is not None and c.max_resident < c.max_batch:
            raise ValueError("max_resident must hold at least one full batch")
        if c.prefill_chunk_tokens < 0:
            raise ValueError("prefill_chunk_tokens must be >= 0 (0: whole prefills)")
        if c.prefill_keys_per_row is not None and not c.prefill_keys_per_row > 0:
            raise ValueError("prefill_keys_per_row must be > 0")
        measured = c.step_cost.keys_per_row if c.step_cost is not None else None
        self.keys_per_row = c.prefill_keys_per_row or measured or DEFAULT_KEYS_PER_ROW
        self.fairness = TenantFairness(c.tenant_weights, c.fair_lag_tokens)
        self.aging = AgingIndex(c.aging_bound_s, c.aging_margin_steps, c.total_wait_bound_s)
        self.sizer = TreeSizer(c.step_cost, c.sizing)
        self._nominal_cost = c.token_budget / c.max_batch
        self._limit = min(c.max_batch, c.token_budget)   # one root token per request at least
        # What each (tenant, drafter)'s requests have shown the planner (alpha.DrafterPrior): soft
        # state, relearned after a restart; a rebuild keeps it, and a caller may carry it over.
        self.priors: dict[tuple[str, str | None], DrafterPrior] = {}
        self._reset()

    # ---- what a policy defines ---------------------------------------------------------------
    def key(self, s: RequestStats) -> float:
        raise NotImplementedError

    def node_urgency(self, stats: list[RequestStats]) -> list[float] | None:
        """Weights on the chosen requests' draft-node worths (scheduler/sizing.py `urgency`);
        None: nodes go by goodput alone."""
        return None

    def refresh(self, state: SchedulerState, s: RequestStats) -> None:
        """Move a request that was served since it was last ranked (levels, perceptible, predicted
        remaining time); called just before it is re-keyed."""

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
        if request_id in self._live:
            self._warming[request_id] = None

    def kv_fits(self, state: SchedulerState, s: RequestStats) -> bool:
        """Whether starting `s` now keeps the KV held within the budget (`kv_place`)."""
        return self.kv_place(state, s)[0]

    def kv_place(self, state: SchedulerState, s: RequestStats) -> tuple[bool, str | None]:
        """Whether starting `s` now keeps the KV held within the budget (always, without one),
        and the home it starts on (`most_room`; None: the one budget's): the loop asks before
        prefilling an arrival ahead of its turn, and prefills it there."""
        homes = kv_homes(state, self.config.kv_budget_tokens)
        if homes is None:
            return True, None
        c = self.config
        need = start_slots(s, block=c.kv_block, tree=c.kv_tree_tokens)
        rooms = kv_rooms(homes)
        home = most_room(rooms, {h: budget for h, (budget, _) in homes.items()}, self._home_loads(state))
        return rooms[home] >= need, home

    def touch(self, request_id: str) -> None:
        """A live request's stats changed between steps (a length prediction came in): rank it
        again at the next plan."""
        if request_id in self._live:
            self._dirty.add(request_id)

    def remove(self, state: SchedulerState, request_id: str, status: Status,
               cause: str | None, now: float) -> RequestStats | None:
        """End a live request early (cancelled, failed). Returns it, or None if not live."""
        s = state.requests.get(request_id)
        if s is not None:
            self._retire(state, s, status, cause, now)
        return s

    def rebuild(self, state: SchedulerState) -> None:
        """Recreate the queues from `state` alone (e.g. after a restart)."""
        self._reset()
        for s in state.requests.values():
            self._index(state, s)
        self.aging.rebuild(state.requests.values())

    # ---- the two calls of the step loop ------------------------------------------------------
    def plan(self, state: SchedulerState, now: float) -> Plan:
        c, limit = self.config, self._limit
        requests = state.requests
        self._kv_state = state
        self._kv_homes = kv_homes(state, c.kv_budget_tokens)
        self._kv_room = kv_rooms(self._kv_homes)
        self._kv_at = {}
        self._kv_loads = None                  # requests per home, once a start needs them
        if len(requests) <= limit:              # everyone fits: order cannot matter
            chosen, aged = [r for r in requests if self._kv_start(r)], 0
        else:
            if self._dirty:
                self._rekey(state)
            promoted = self._promotions(state, now, limit)
            chosen = self._choose(state, promoted, limit)
            longer = self._prefill_step_s(state, chosen)
            if longer is not None:              # a prefill makes this step the longest yet
                again = self._promotions(state, now, limit, longer)
                if again != promoted:
                    promoted, chosen = again, self._choose(state, again, limit)
            aged = len(promoted)
        evict: list[str] = []
        if self._kv_homes is not None:
            chosen, evict = self._fit_kv(state, chosen)
        if c.prefill_chunk_tokens:
            plan = self._chunked(state, chosen, aged)
        else:
            plan = Plan(chosen, self._budgets([requests[r] for r in chosen]), aged)
        plan.evict = evict
        if state.kv_budgets:                   # where each planned start goes (`_kv_start`)
            plan.homes = {r: self._kv_at[r] for r in plan.request_ids if r in self._kv_at}
        return plan

    def _fit_kv(self, state: SchedulerState, chosen: list[str]) -> tuple[list[str], list[str]]:
        """The chosen requests whose KV fits the budget this step, and the requests whose KV to
        free for them. Starts were only chosen where they fit (`_kv_start`); what may still
        overflow is residents' growth (scheduler/kv_budget.py). Then requests left out of the
        step give their KV up first (never served before served, then the worst ranked), then
        the chosen from the end of the plan wait (a resident one is preempted). The first
        chosen always runs. With a budget per home, each home is fitted on its own: its growth
        and starts against its budget, freeing only requests homed there, the first chosen
        there always running."""
        c, requests, homes = self.config, state.requests, self._kv_homes
        size = {"block": c.kv_block, "tree": c.kv_tree_tokens}
        at = self._home_of

        def adds(s: RequestStats) -> int:
            return growth_slots(s, **size) if s.kv_tokens else start_slots(s, **size)

        total = {home: held for home, (_, held) in homes.items()}
        for r in chosen:
            home = at(requests[r])
            if home in total:
                total[home] += adds(requests[r])
        over = {home for home, t in total.items() if t > homes[home][0]}
        if not over:
            return chosen, []
        kept = set(chosen)
        # untouched arrivals first (only their first allocation is lost), then prompts partly
        # prefilled, then requests served before; within each, the worst ranked first
        others = sorted((s for s in requests.values() if s.kv_tokens and s.request_id not in kept
                         and at(s) in over),
                        key=lambda s: (s.n_steps > 0, s.prefill_left != s.unprefilled_context,
                                       -self._keys.get(s.request_id, 0.0)))
        evict = []
        for s in others:
            home = at(s)
            if total[home] <= homes[home][0]:
                continue
            evict.append(s.request_id)
            total[home] -= s.kv_tokens
        keep, first = [], {}
        for r in chosen:                        # the first chosen on each home always runs
            first.setdefault(at(requests[r]), r)
        for r in reversed(chosen):
            s = requests[r]
            home = at(s)
            if home in over and total[home] > homes[home][0] and first[home] != r:
                total[home] -= adds(s) + s.kv_tokens
                if s.kv_tokens:
                    evict.append(r)
            else:
                keep.append(r)
        keep.reverse()
        self._started.difference_update(evict)
        for rid in evict:
            self._warming.pop(rid, None)
        return keep, evict

    @staticmethod
    def _home_loads(state: SchedulerState) -> dict[str | None, int]:
        """Requests holding KV, by home (what the router's `loads` count)."""
        loads: dict[str | None, int] = {}
        for s in state.requests.values():
            if s.kv_tokens:
                loads[s.kv_home] = loads.get(s.kv_home, 0) + 1
        return loads

    def _home_of(self, s: RequestStats) -> str | None:
        """Where `s`'s KV is (a resident) or is planned to start (`_kv_start`); None: the one
        budget's home."""
        if self._kv_state is None or not self._kv_state.kv_budgets:
            return None
        return s.kv_home if s.kv_tokens else self._kv_at.get(s.request_id)

    def _budgets(self, stats: list[RequestStats], nodes: int | None = None) -> list[TreeBudget]:
        """Tree budgets of the requests a step verifies (each has a root row), sharing `nodes`
        draft nodes (default: the token budget less their roots)."""
        if nodes is None:
            nodes = self.config.token_budget - len(stats)
        urgency = self.node_urgency(stats) if len(stats) > 1 else None
        deep = self._depth_weights(stats)
        if deep is not None:
            urgency = deep if urgency is None else [u * d for u, d in zip(urgency, deep)]
        return self.sizer([s.estimate.alpha for s in stats], max(nodes, 0),
                          draft_s=[s.estimate.draft_s for s in stats],
                          caps=[s.max_tree_tokens for s in stats], urgency=urgency)

    def _depth_weights(self, stats: list[RequestStats]) -> list[float] | None:
        """Weights on node worths for requests deep into a long context: each node's row attends
        over every key before it, so past SHALLOW_CONTEXT tokens a node costs about
        (keys_per_row + context) ÷ (keys_per_row + SHALLOW_CONTEXT) times what the step-cost
        profile (measured at short contexts) says, and must be worth that much more. None when
        every request is shallow (nothing to weigh)."""
        kpr = self.keys_per_row
        ctx = [s.prompt_len + s.committed for s in stats]
        if not ctx or max(ctx) <= SHALLOW_CONTEXT:
            return None
        return [min(1.0, (kpr + SHALLOW_CONTEXT) / (kpr + c)) for c in ctx]

    def _chunked(self, state: SchedulerState, chosen: list[str], aged: int) -> Plan:
        """The step's rows with chunked prefill: every decoding request's root, then prefill
        chunks in plan order within `chunk_budget`, then draft nodes in what is left of the
        token budget. Chunks and trees share one budget so that a step with a chunk costs about
        what a step without one does (a step past the fused kernels' row limit costs markedly
        more: README, "Chunked prefill"). A chunk deep into a long prompt costs more per token (its attention reads every earlier
        key), so it counts more against the budget (`prefill_keys_per_row`)."""
        c, requests = self.config, state.requests
        decoding = sum(1 for r in chosen if not requests[r].unprefilled)
        left = chunk_budget(c.prefill_chunk_tokens, c.token_budget, decoding, len(chosen) - decoding)
        ids, chunks, completes = [], [], []
        for rid in chosen:
            s = requests[rid]
            need = s.unprefilled
            take, cost = self._chunk(s, need, left)
            if need and not take:
                continue                        # no budget left: it waits, still ranked
            if need:
                self._started.add(rid)          # holds KV from this step on
            left -= cost
            ids.append(rid)
            chunks.append(take)
            completes.append(take == need)
        # a request whose chunk completes its context verifies its root alone: its tree's rows
        # would attend over the whole context in the step that already carries its deepest chunk
        trees = [done and not take for done, take in zip(completes, chunks)]
        roots = [requests[r] for r, tree in zip(ids, trees) if tree]
        sized = iter(self._budgets(roots, c.token_budget - sum(completes) - sum(chunks)) if roots else ())
        budgets = [next(sized) if tree else NO_SPECULATION for tree in trees]
        warm = self._warm(requests, set(ids), left)
        return Plan(ids + [r for r, _ in warm], budgets + [NO_SPECULATION] * len(warm), aged,
                    chunks + [n for _, n in warm], len(warm))

    def _chunk(self, s: RequestStats, need: int, left: float) -> tuple[int, float]:
        """(tokens, budget they cost) of a chunk of `s`'s `need` pending context tokens within
        `left`: each counts 1 + (context already computed) / prefill_keys_per_row, and at least
        one token is taken while any budget is left, however heavy: a prompt always advances."""
        weight = 1.0 + max(s.unprefilled_context - need, 0) / self.keys_per_row
        take = min(need, max(int(left / weight + 1e-9), 1 if left >= 1 else 0))
        return take, take * weight

    def _warm(self, requests: Mapping[str, RequestStats], chosen: set[str],
              left: float) -> list[tuple[str, int]]:
        """(request id, chunk) for requests admitted ahead of their turn, oldest first, within
        what is `left` of the budget; requests served, ended or fully prefilled since leave the
        list."""
        out = []
        for rid in list(self._warming):
            s = requests.get(rid)
            if s is None or s.n_steps or not s.prefill_left or not s.kv_tokens:
                del self._warming[rid]          # served, ended, ready, or no longer holding KV
                continue
            if rid in chosen:
                continue
            if left < 1:
                break
            take, cost = self._chunk(s, s.prefill_left, left)
            left -= cost
            out.append((rid, take))
        return out

    def update(self, state: SchedulerState, records: Iterable[StepRecord], now: float,
               step_s: float) -> list[RequestStats]:
        """Record one step that ended at `now` and took `step_s`. Returns the finished requests."""
        a = self.config.step_s_smoothing
        state.step_s = step_s if state.step_s is None else (1 - a) * state.step_s + a * step_s
        state.step_s_max = max(state.step_s_max, step_s)
        start = now - step_s
        requests, served, finished = state.requests, set(), []
        vt, weight = state.virtual_time, self.fairness.weight
        for rec in records:
            s = requests.get(rec.request_id)
            if s is None:                       # cancelled while its step ran
                continue
            s.record_step(rec, start, now)
            if rec.drafted and self.config.learn_priors:
                key = (s.cache_tenant, s.drafter)
                self.priors[key] = pool(self.priors.get(key, DrafterPrior()), rec.drafted,
                                         rec.accepted, rec.draft_s, rec.draft_depth)
            self._started.add(rec.request_id)
            account = (s.priority, s.tenant)
            vt[account] = vt.get(account, 0.0) + rec.verified / weight(s.tenant)
            cause = rec.finish or ("length" if s.committed >= s.max_tokens else None)
            if cause is not None:
                self._retire(state, s, Status.FINISHED, cause, now)
                finished.append(s)
            else:
                served.add(rec.request_id)
        self.aging.served(served, requests)
        self._dirty |= served
        if len(requests) > self._limit:
            self._rekey(state)                  # else: re-ranked by the next plan that must choose
        for rid in state.running - served:
            s = requests.get(rid)
            if s is not None:                   # left out of this step
                s.status = Status.PREEMPTED
        state.running = served
        return finished

    # ---- internals ---------------------------------------------------------------------------
    def _promotions(self, state: SchedulerState, now: float, limit: int,
                    longest_step_s: float = 0.0) -> list[str]:
        """Aging's promotions: gaps at risk of passing the bound first, then requests past the
        total-wait bound; less those there is no KV room to start."""
        ids = self.aging.overdue(state, now, limit, longest_step_s=longest_step_s)
        if len(ids) < limit and self.aging.total_bound_s is not None:
            seen = set(ids)
            late = [r for r in self.aging.past_total(now, limit, state.step_s or 0.0)
                    if r not in seen]
            ids = ids + late[:limit - len(ids)]
        return self._startable(ids)

    def _startable(self, promoted: list[str]) -> list[str]:
        """Aging's promotions, less the not-yet-started ones there is no KV room to start."""
        cap = self.config.max_resident
        kv_room = None if self._kv_room is None else dict(self._kv_room)
        room, out = (None if cap is None else cap - len(self._started)), []
        for rid in promoted:
            if rid not in self._started and room is not None:
                if room <= 0:
                    continue
                room -= 1
            self._kv_start(rid, force=True)     # aging's bound holds: _fit_kv makes room
            out.append(rid)
        self._kv_room = kv_room                 # _choose takes the promoted ones' room again
        return out

    def _choose(self, state: SchedulerState, promoted: list[str], limit: int) -> list[str]:
        chosen, taken = list(promoted), set(promoted)
        if self._kv_homes is not None:         # slots left once the promoted ones start
            self._kv_room = kv_rooms(self._kv_homes)
            for rid in promoted:
                self._kv_start(rid, force=True)
        cap = self.config.max_resident
        if cap is not None:                     # KV room for requests that have not started
            self._room = cap - len(self._started) - sum(
                1 for r in promoted if r not in self._started)
        for cls in self._classes:
            if len(chosen) >= limit:
                break
            self._pick_class(state, cls, chosen, taken, limit)
        return chosen

    def _prefill_step_s(self, state: SchedulerState, chosen: list[str]) -> float | None:
        """The estimated duration of a step that prefills prompts, if longer than any seen."""
        cost = self.config.step_cost
        if cost is None or self.aging.bound_s is None:
            return None
        requests = state.requests
        prompts = [requests[r].prompt_len for r in chosen if requests[r].n_steps == 0]
        if not prompts:
            return None
        # the step loop prefills each new request in a pass of its own (batch 1), then steps;
        # with chunks, a step prefills at most its budget
        chunk = self.config.prefill_chunk_tokens
        if chunk:
            decoding = sum(1 for r in chosen if not requests[r].unprefilled)
            most = min(sum(prompts), chunk_budget(chunk, self.config.token_budget, decoding,
                                                  len(chosen) - decoding))
            extra = cost.chunk(most, 0)
        else:
            extra = sum(cost.prefill(p) for p in prompts)
        est = cost(len(chosen), self.config.token_budget) + extra
        return est if est > state.step_s_max else None


    def _reset(self) -> None:
        self._queues: dict[int, dict[str, list[Entry]]] = {}
        self._counts: dict[int, dict[str, int]] = {}
        self._classes: list[int] = []
        self._live: dict[str, int] = {}       # request id -> seq of its live heap entry
        self._keys: dict[str, float] = {}
        self._seq = itertools.count()
        self._dirty: set[str] = set()         # served since last ranked
        self._started: set[str] = set()       # live requests that have had a step (hold KV)
        self._room: int | None = None         # while planning: how many more may start
        # while planning: each KV budget's (budget, slots held) by home, the slots starts may
        # still take there, and the home each planned start takes (see `kv_homes`)
        self._kv_homes: dict[str | None, tuple[int, int]] | None = None
        self._kv_room: dict[str | None, int] | None = None
        self._kv_at: dict[str, str | None] = {}
        self._kv_loads: dict[str | None, int] | None = None
        self._kv_state: SchedulerState | None = None
        self._warming: dict[str, None] = {}   # admitted ahead of their turn, oldest first
        self.aging.clear()

    def _index(self, state: SchedulerState, s: RequestStats) -> None:
        cls, tenant = s.priority, s.tenant
        if cls not in self._queues:
            self._queues[cls], self._counts[cls] = {}, {}
            self._classes = sorted(self._queues)
        counts = self._counts[cls]
        counts[tenant] = counts.get(tenant, 0) + 1
        self._queues[cls].setdefault(tenant, [])
        if counts[tenant] == 1:
            self.fairness.activate(state, cls, tenant, counts)
        self.refresh(state, s)
        self._push(s, self.key(s))
        self.aging.add(s)
        if s.n_steps:
            self._started.add(s.request_id)

    def _rekey(self, state: SchedulerState) -> None:
        requests, keys = state.requests, self._keys
        for rid in self._dirty:
            s = requests[rid]
            self.refresh(state, s)
            key = self.key(s)
            if key != keys[rid]:
                self._push(s, key)
        self._dirty.clear()

    def _push(self, s: RequestStats, key: float) -> None:
        rid, seq = s.request_id, next(self._seq)
        heap = self._queues[s.priority][s.tenant]
        heapq.heappush(heap, (key, seq, rid))
        self._live[rid], self._keys[rid] = seq, key
        if len(heap) > 2 * self._counts[s.priority][s.tenant] + 32:
            live = self._live
            heap[:] = [e for e in heap if live.get(e[2]) == e[1]]
            heapq.heapify(heap)

    def _retire(self, state: SchedulerState, s: RequestStats, status: Status,
                cause: str | None, now: float) -> None:
        rid = s.request_id
        s.end(status, cause, now)
        del state.requests[rid]
        state.running.discard(rid)
        self._dirty.discard(rid)
        self._started.discard(rid)
        self.aging.remove(rid)
        del self._live[rid], self._keys[rid]
        counts = self._counts[s.priority]
        counts[s.tenant] -= 1
        if counts[s.tenant] == 0:
            del counts[s.tenant]
            del self._queues[s.priority][s.tenant]   # its entries are all stale now

    def _pick_class(self, state: SchedulerState, cls: int, chosen: list[str], taken: set[str],
                    limit: int) -> None:
        """Append this class's best requests to `chosen`, tenants merged under fair sharing."""
        queues, counts = self._queues[cls], self._counts[cls]
        back: list[tuple[list[Entry], Entry]] = []
        cand: list[tuple[float, int, str, str]] = []
        if len(counts) == 1:                     # one tenant: nobody to be fair to
            (tenant,) = counts
            heap = queues[tenant]
            while len(chosen) < limit and self._offer(heap, tenant, taken, back, cand):
                rid = heapq.heappop(cand)[2]
                self._take(rid, chosen, taken)
        else:
            self._merge_tenants(state, cls, queues, counts, chosen, taken, limit, back, cand)
        for heap, entry in back:
            heapq.heappush(heap, entry)

    def _merge_tenants(self, state, cls, queues, counts, chosen, taken, limit, back,
                       cand) -> None:
        vt, cap = self.fairness.split(state, cls, counts)
        deferred: list[str] = []
        for tenant in counts:
            if vt[tenant] <= cap:
                self._offer(queues[tenant], tenant, taken, back, cand)
            else:
                deferred.append(tenant)
        requests, nominal, weight = state.requests, self._nominal_cost, self.fairness.weight
        fair_phase = True
        while len(chosen) < limit:
            if not cand:
                if not (fair_phase and deferred):
                    return
                fair_phase = False              # work conserving: tenants that ran ahead
                for tenant in deferred:
                    self._offer(queues[tenant], tenant, taken, back, cand)
                continue
            _, _, rid, tenant = heapq.heappop(cand)
            if not self._take(rid, chosen, taken):      # no KV room to start it: look further
                self._offer(queues[tenant], tenant, taken, back, cand)
                continue
            s = requests[rid]
            vt[tenant] += (s.attained / s.n_steps if s.n_steps else nominal) / weight(tenant)
            if not fair_phase or vt[tenant] <= cap:
                self._offer(queues[tenant], tenant, taken, back, cand)
            else:
                deferred.append(tenant)

    def _take(self, rid: str, chosen: list[str], taken: set[str]) -> bool:
        """Choose `rid`, unless it has not started and there is no KV room to start it (then it
        is only marked taken, so that the rest of the plan skips it)."""
        taken.add(rid)
        starts = self._room is not None and rid not in self._started
        if starts and self._room <= 0:
            return False
        if not self._kv_start(rid):
            return False
        if starts:
            self._room -= 1
        chosen.append(rid)
        return True

    def _kv_start(self, rid: str, force: bool = False) -> bool:
        """Whether `rid` holds KV or its start fits the KV budget's room (then taken from it).
        With nothing held and nothing taken yet, any start fits: a request larger than the
        budget still runs, alone. `force` (aging's promotions): it starts, taking the room even
        past the budget (`_fit_kv` then frees residents' KV for it), so a large request cannot
        be passed over past the aging bound by smaller ones that fit. With a budget per home,
        `most_room` picks the home, where it is planned (`_kv_at`, then `Plan.homes`: the
        worker prefills it there)."""
        rooms = self._kv_room
        if rooms is None:
            return True
        s = self._kv_state.requests[rid]
        if s.kv_tokens:
            return True
        c = self.config
        need = start_slots(s, block=c.kv_block, tree=c.kv_tree_tokens)
        if self._kv_loads is None:
            self._kv_loads = self._home_loads(self._kv_state)
        home = most_room(rooms, {h: budget for h, (budget, _) in self._kv_homes.items()},
                         self._kv_loads)
        room = rooms[home]
        if need > room and room < self._kv_homes[home][0] and not force:
            return False
        rooms[home] = room - need
        self._kv_at[rid] = home
        self._kv_loads[home] = self._kv_loads.get(home, 0) + 1
        return True

    def _offer(self, heap: list[Entry], tenant: str, taken: set[str],
               back: list[tuple[list[Entry], Entry]], cand: list) -> bool:
        """Put the tenant's best live, untaken entry into the candidate heap (it stays on top of
        the tenant's heap; taken entries are popped into `back`, stale ones dropped)."""
        live = self._live
        while heap:
            key, seq, rid = heap[0]
            if live.get(rid) != seq:
                heapq.heappop(heap)             # stale: dropped for good
            elif rid in taken:
                back.append((heap, heapq.heappop(heap)))
            else:
                heapq.heappush(cand, (key, seq, rid, tenant))
                return True
        return False

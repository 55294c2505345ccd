"""A step's token budget, row by row: one root per request that decodes, prefill chunks of
contexts that still lack KV, and the draft nodes of each chosen request's token tree.

The batch planner (planner.py) chooses the requests; this part gives each its rows. Tree sizes
come from the one sizing rule (scheduler/sizing.py, memoized in `TreeSizer`), weighted for
requests deep into long contexts; with chunked prefill (`PolicyConfig.prefill_chunk_tokens`),
chunks and trees share the budget (`chunked`).
"""
from __future__ import annotations

from typing import Callable, Mapping

from scheduler.policies.plan import Plan, PolicyConfig
from scheduler.request import RequestStats
from scheduler.policies.row_shares import RowShares
from scheduler.sizing import TreeSizer, cut_to
from scheduler.state import SchedulerState
from workers.contract import NO_SPECULATION, TreeBudget

IDLE_CHUNKS = 8   # a step in which no request decodes prefills up to this many chunks' tokens
# keys per row without a measured chunk fit: the order of the default model's on CPU (README,
# "Chunked prefill")
DEFAULT_KEYS_PER_ROW = 1000.0
# contexts up to this many tokens cost a tree node about what the step-cost profile says (it is
# measured at a few hundred); deeper, a node's attention makes it dearer (`_depth_weights`)
SHALLOW_CONTEXT = 512

Urgency = Callable[[list[RequestStats]], list[float] | None]   # Ordering.node_urgency


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


class StepBudget:
    """Rows of one step for the requests the planner chose (module docstring)."""

    def __init__(self, config: PolicyConfig, urgency: Urgency,
                 weight: Callable[[str], float] = lambda tenant: 1.0) -> None:
        """`urgency`: the ordering's weights on draft nodes (`Ordering.node_urgency`); `weight`:
        a tenant's fair-share weight (`TenantFairness.weight`), which its row share follows."""
        c = self.config = config
        self.weight = weight
        measured = c.step_cost.keys_per_row if c.step_cost is not None else None
        self.keys_per_row = c.prefill_keys_per_row or measured or DEFAULT_KEYS_PER_ROW
        self.sizer = TreeSizer(c.step_cost, c.sizing)
        self.urgency = urgency

    def shares(self, stats: list[RequestStats],
               streams: list[RequestStats] | None = None) -> RowShares | None:
        """The tenants' row shares of a step of `stats`, of which `streams` decode (default:
        all) (row_shares.py); None: not limited."""
        return RowShares.of(stats, stats if streams is None else streams, self.weight,
                            max(self.config.token_budget - len(stats), 0),
                            self.config.tenant_row_share)

    def trees(self, stats: list[RequestStats], nodes: int | None = None, *,
              shares: RowShares | None = None) -> list[TreeBudget]:
        """Tree budgets of the requests a step verifies (each has a root row), sharing `nodes`
        draft nodes (default: the token budget less their roots), each tenant's within its row
        share (`shares`: the step's, with what its chunks took; default: those of `stats`)."""
        if nodes is None:
            nodes = self.config.token_budget - len(stats)
            shares = self.shares(stats)
        urgency = self.urgency(stats) if len(stats) > 1 else None
        deep = self._depth_weights(stats)
        if deep is not None:
            urgency = deep if urgency is None else [u * d for u, d in zip(urgency, deep)]
        alphas = [s.estimate.alpha for s in stats]
        budgets = self.sizer(alphas, max(nodes, 0), draft_s=[s.estimate.draft_s for s in stats],
                             caps=[s.max_tree_tokens for s in stats], urgency=urgency)
        return budgets if shares is None else self._within_shares(stats, alphas, budgets, shares)

    def _within_shares(self, stats: list[RequestStats], alphas: list[float],
                       budgets: list[TreeBudget], shares: RowShares) -> list[TreeBudget]:
        """`budgets` with each tenant's nodes cut to the room its share has left, its requests of
        the higher tiers served first."""
        groups: dict[tuple[int, str], list[int]] = {}
        for i, s in enumerate(stats):
            groups.setdefault((shares.rank(s), s.tenant), []).append(i)
        out = list(budgets)
        for _, idx in sorted(groups.items(), key=lambda g: g[0][0]):
            room = shares.room(stats[idx[0]])
            if sum(budgets[i].max_nodes for i in idx) > room:
                cut = cut_to([budgets[i] for i in idx], [alphas[i] for i in idx], room,
                             self.config.sizing.max_depth)
                for i, b in zip(idx, cut):
                    out[i] = b
            shares.take(stats[idx[0]], sum(out[i].max_nodes for i in idx))
        return out

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

    def chunked(self, requests: Mapping[str, RequestStats], chosen: list[str], aged: int,
                warming: Mapping[str, None]) -> tuple[Plan, list[str]]:
        """The step's rows with chunked prefill, and the ids to drop from `warming` (served,
        ended, ready, or no longer holding KV): every decoding request's root, then prefill
        chunks in plan order within `chunk_budget`, then draft nodes in what is left of the
        token budget; then, in what is left of the chunk budget, chunks for requests admitted
        ahead of their turn (`warming`, oldest first), which only prefill.

        Chunks and trees share one budget so that a step with a chunk costs about what a step
        without one does (a step past the fused kernels' row limit costs markedly more: README,
        "Chunked prefill"). A chunk deep into a long prompt costs more per token (its attention
        reads every earlier key), so it counts more against the budget (`prefill_keys_per_row`).
        A chosen request left without budget waits, still ranked."""
        c = self.config
        decoding = sum(1 for r in chosen if not requests[r].unprefilled)
        left = chunk_budget(c.prefill_chunk_tokens, c.token_budget, decoding, len(chosen) - decoding)
        step = [requests[r] for r in chosen]
        shares = self.shares(step, [s for s in step if not s.unprefilled])
        ids, chunks, completes = [], [], []
        for rid in chosen:
            s = requests[rid]
            need = s.unprefilled
            take, cost = self._chunk(s, need, left if shares is None
                                     else min(left, shares.room(s)))
            if need and not take:
                continue                        # no budget left: it waits, still ranked
            if shares is not None:
                shares.take(s, take)
            left -= cost
            ids.append(rid)
            chunks.append(take)
            completes.append(take == need)
        # a request whose chunk completes its context verifies its root alone: its tree's rows
        # would attend over the whole context in the step that already carries its deepest chunk
        trees = [done and not take for done, take in zip(completes, chunks)]
        roots = [requests[r] for r, tree in zip(ids, trees) if tree]
        sized = iter(self.trees(roots, c.token_budget - sum(completes) - sum(chunks), shares=shares)
                     if roots else ())
        budgets = [next(sized) if tree else NO_SPECULATION for tree in trees]
        warm, stale = self._warm(requests, warming, set(ids), left, shares)
        plan = Plan(ids + [r for r, _ in warm], budgets + [NO_SPECULATION] * len(warm), aged,
                    chunks + [n for _, n in warm], len(warm))
        return plan, stale

    def _chunk(self, s: RequestStats, need: int, left: float) -> tuple[int, float]:
        """(tokens, budget they cost) of a chunk of `s`'s `need` pending context tokens within
        `left`: each counts 1 + (context already computed) / prefill_keys_per_row, and at least
        one token is taken while any budget is left, however heavy: a prompt always advances."""
        weight = 1.0 + max(s.unprefilled_context - need, 0) / self.keys_per_row
        take = min(need, max(int(left / weight + 1e-9), 1 if left >= 1 else 0))
        return take, take * weight

    def _warm(self, requests: Mapping[str, RequestStats], warming: Mapping[str, None],
              chosen: set[str], left: float,
              shares: RowShares | None) -> tuple[list[tuple[str, int]], list[str]]:
        """(request id, chunk) for requests admitted ahead of their turn, oldest first, within
        what is `left` of the budget and their tenant's row share; and those of them looked at
        that no longer wait so."""
        out, stale = [], []
        for rid in warming:
            s = requests.get(rid)
            if s is None or s.n_steps or not s.prefill_left or not s.kv_tokens:
                stale.append(rid)               # served, ended, ready, or no longer holding KV
                continue
            if rid in chosen:
                continue
            if left < 1:
                break
            take, cost = self._chunk(s, s.prefill_left,
                                     left if shares is None else min(left, shares.room(s)))
            if not take:
                continue                        # its tenant's share is spent this step
            if shares is not None:
                shares.take(s, take)
            left -= cost
            out.append((rid, take))
        return out, stale

    def prefill_step_s(self, state: SchedulerState, chosen: list[str]) -> float | None:
        """The estimated duration of a step that prefills prompts, if longer than any seen
        (aging asks again with it: planner.py)."""
        cost, c = self.config.step_cost, self.config
        if cost is None:
            return None
        requests = state.requests
        prompts = [requests[r].prompt_len for r in chosen if requests[r].n_steps == 0]
        if not prompts:
            return None
        # the step loop prefills each new request in a pass of its own (batch 1), then steps;
        # with chunks, a step prefills at most its budget
        if c.prefill_chunk_tokens:
            decoding = sum(1 for r in chosen if not requests[r].unprefilled)
            most = min(sum(prompts), chunk_budget(c.prefill_chunk_tokens, c.token_budget,
                                                  decoding, len(chosen) - decoding))
            extra = cost.chunk(most, 0)
        else:
            extra = sum(cost.prefill(p) for p in prompts)
        est = cost(len(chosen), c.token_budget) + extra
        return est if est > state.step_s_max else None

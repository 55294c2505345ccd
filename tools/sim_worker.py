"""The simulator's side of the step loop: a worker and a length predictor without a model.

The simulator (tools/sim.py) runs the real `scheduler.loop.StepLoop`: its planner, KV residency,
eviction, chunked prefill and commit. What it replaces is only what has a model behind it:

* `SimWorker`, the loop's `Worker`: it knows each request's ground truth (`SimRequest`: true α,
  output length, whether max_tokens cuts it) and answers the loop's calls as a verifier would,
  advancing a simulated clock by the measured step-cost profile instead of computing anything.
  A prefill the loop asks for costs a pass of its own at batch 1 over the context but the root
  (none with `defer`: the plan's chunks then compute it, each charged `StepCost.chunk` beside
  the step); a step costs profile(requests verified, their tree tokens) plus its chunks.
* `SimPredictor`, the loop's length learner: the predictor's belief about a request's remaining
  length, from the truth plus the measured error (`WorkloadSpec.repredict`), at each checkpoint
  the worker's features say the request has reached.

Acceptance in a step: a request with tree budget (n nodes, depth d) drafts width w = n ÷ d per
depth; each depth is accepted with p = 1 − (1 − α_t)^w (w = 1: p = α_t), α_t its true α mixed
with its opening α (workload_gen.py); accepted = consecutive successes (≤ d), τ = accepted + 1.
Each request draws from its own seeded RNG, so every policy sees the same acceptance luck per
request and step (common random numbers). A request that reaches its true length ends with a
stop token (or at its max_tokens, which the loop's own cut ends as "length").
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

from scheduler.length_learner import LengthLearner, better
from scheduler.request import RequestStats
from scheduler.step_cost import StepCost
from tools.workload_gen import SimRequest, WorkloadSpec
from workers.contract import Prefilled, SamplingParams, StepResult, WorkItem
from workers.fake_worker import FakeClock

TOKEN, STOP = 7, 2          # what every simulated output token is, and the stop token


@dataclass(slots=True)
class _Truth:
    req: SimRequest
    rng: random.Random
    steps: int = 0            # steps that verified it (its n_steps)
    committed: int = 0        # output tokens it has produced
    context: int = 0          # context tokens but the root, at its last prefill
    pending: int = 0          # of those, still without KV (chunked prefill)
    checkpoint: int = 0       # the predictor's latest checkpoint it has reported
    next_checkpoint: float = math.inf   # committed tokens at which the one after it is reached


class SimWorker:
    """The step loop's `Worker` over ground truth and a simulated clock (module docstring)."""

    context_limit = 1 << 30   # the workload's max_tokens are the only limit

    def __init__(self, cost: StepCost, clock: FakeClock, spec: WorkloadSpec) -> None:
        self.cost, self.clock, self.spec = cost, clock, spec
        self.charge_prefill = spec.prefill
        self.fade = [math.exp(-k / spec.early_steps) for k in range(int(12 * spec.early_steps))]
        self.truth: dict[str, _Truth] = {}
        self.busy_s = 0.0          # simulated time the engine worked: prefills and steps
        self.prefill_s = 0.0       # of which prefilling: passes of their own and chunks
        self.reprefills = 0        # prefills of requests that had been verified before (evicted)
        self.steps = 0
        self.batch_sum = 0         # requests verified, over all steps
        self.committed = 0         # output tokens produced, over all requests

    def expect(self, r: SimRequest) -> None:
        """`r` is about to be submitted: its truth, and its own acceptance stream."""
        self.truth[r.request_id] = _Truth(r, random.Random(r.seed),
                                          next_checkpoint=self._checkpoint_after(0))

    def _checkpoint_after(self, checkpoint: int) -> float:
        """Committed tokens from which `repredict_at` names a checkpoint past `checkpoint` (inf:
        never, or no re-prediction): a step reports features only then, so the steps between
        checkpoints need no table lookup."""
        table = self.spec.repredict
        if table is None:
            return math.inf
        if table[0][0] > checkpoint:       # repredict_at names none before its first
            return 0
        return next((c for c, _ in table if c > checkpoint), math.inf)

    def _spend(self, dt: float) -> None:
        self.clock.now += dt
        self.busy_s += dt

    # ---- the Worker calls ----------------------------------------------------------------------
    def prefill(self, request_id: str, token_ids: Sequence[int], *, prompt_len: int,
                sampling: SamplingParams, max_new_tokens: int, tenant: str = "default",
                drafter: str | None = None, defer: bool = False) -> Prefilled:
        t = self.truth[request_id]
        if t.steps:
            self.reprefills += 1
        t.context = len(token_ids) - 1
        t.pending = t.context if defer and self.charge_prefill else 0
        if self.charge_prefill and not defer:
            dt = self.cost.prefill(max(1, t.context))
            self.prefill_s += dt
            self._spend(dt)
        return Prefilled(pending=t.pending, kv_tokens=len(token_ids) + 1)

    def step(self, items: Sequence[WorkItem]) -> list[StepResult]:
        out, chunk_s, verified, tokens = [], 0.0, 0, 0
        for item in items:
            t = self.truth[item.request_id]
            k = min(item.prefill, t.pending)
            if k:
                chunk_s += self.cost.chunk(k, t.context - t.pending)
                t.pending -= k
            if t.pending or not item.decode:
                out.append(StepResult(item.request_id, (), 0, 0, prefilled=k, pending=t.pending,
                                      kv_tokens=t.context + 2))
                continue
            res = self._verify(t, item.budget.max_nodes, item.budget.max_depth, k)
            verified += 1
            tokens += res.tree_tokens
            out.append(res)
        self.prefill_s += chunk_s
        self._spend(self.cost(max(verified, 1), max(tokens, 1)) + chunk_s)
        self.steps += 1
        self.batch_sum += verified
        return out

    def release(self, request_id: str) -> None:
        self.truth.pop(request_id, None)

    def evict(self, request_id: str) -> None:
        """Its KV is gone; its truth stays (it is prefilled again when planned)."""
        t = self.truth[request_id]
        t.pending = 0

    def drop_tenant(self, tenant: str) -> None:
        pass                       # no caches to free

    # ---- one request's step ----------------------------------------------------------------------
    def _verify(self, t: _Truth, nodes: int, depth: int, prefilled: int) -> StepResult:
        """Sample how many of its drafts the target accepts (module docstring) and commit."""
        r = t.req
        accepted = 0
        if nodes and depth:
            k = t.steps
            fade = self.fade
            a = r.alpha if k >= len(fade) else r.alpha + fade[k] * (r.alpha_early - r.alpha)
            p = a if nodes <= depth else 1.0 - (1.0 - a) ** (nodes / depth)
            rng = t.rng
            while accepted < depth and rng.random() < p:
                accepted += 1
        else:
            nodes = depth = 0
        left = r.output_len - t.committed
        n = min(accepted + 1, left)
        ends = n == left
        toks = (TOKEN,) * (n - 1) + (STOP if ends and not r.hits_length else TOKEN,)
        t.steps += 1
        t.committed += n
        self.committed += n
        t.context += n
        features = None
        if t.committed >= t.next_checkpoint and not ends:   # a checkpoint past its last one
            at = self.spec.repredict_at(t.committed)[0]
            t.checkpoint, t.next_checkpoint = at, self._checkpoint_after(at)
            features = (float(at),)
        return StepResult(r.request_id, toks, accepted, nodes,
                          draft_depth=depth, features=features, prefilled=prefilled,
                          kv_tokens=t.context + 2)


class SimPredictor(LengthLearner):
    """The length predictor as the workload measured it (module docstring): the features a step
    reports are the checkpoint the request reached; its belief there is ln of its true remaining
    length plus the measured error at that checkpoint, replacing the one it holds only when at
    least as precise (`better`, as the real learner's). It learns nothing and keeps no weights, so
    the loop does not prefill requests on arrival to predict them."""

    def __init__(self, spec: WorkloadSpec, truth: dict[str, _Truth]) -> None:
        super().__init__()
        self.spec, self.truth = spec, truth

    def predict(self, s: RequestStats, features: Sequence[float], committed: int) -> None:
        t = self.truth.get(s.request_id)
        if t is None or not features:
            return
        new = belief(t.req, self.spec, int(features[0]))
        if better(new, s.length_belief):
            s.length_belief = new

    def finish(self, request_id: str, length: int, *, censored: bool = False) -> None:
        pass                       # nothing to learn: the error is the measured one

    def forget(self, request_id: str) -> None:
        pass


def belief(r: SimRequest, spec: WorkloadSpec, committed: int) -> tuple[float, float, int]:
    """The predictor's (μ, σ, committed) for `r` at a checkpoint: ln of the true remaining length
    (before any max_tokens cut) plus N(0, σ(c)²) error. At arrival the error is the one its
    `predicted_len` has; at each later checkpoint a fresh draw, from a stream of its own (so that
    acceptance luck stays the same across policies)."""
    at, sigma = spec.repredict_at(committed)
    z = r.pred_err if at == 0 else random.Random(r.seed * 1_000_003 + at).gauss(0.0, 1.0)
    return math.log(max(1, r.natural_len - at)) + sigma * z, sigma, at

"""The miss predictor's view of the live queue: per service tier, the backlog a newcomer of that
tier would wait behind (scheduler/miss.py), taken on the step loop's thread and read by
admission on any thread.

Taken every `refresh_s` (0.5 s) at most, after a step (`refresh`): the work of every live request is
its predicted remaining tokens (the planner's order's own belief, `Ordering.remaining_tokens`:
laps' calibrated length model, else the request's bounds) ÷ its tokens per step (its mean τ,
else the mean over the live requests that have stepped, else 1), plus the chunked-prefill steps
its prompt still needs. A tier's backlog is the work of its own tier and the tiers served before
it (scheduler/tiers.py), running requests first (they hold their slots), then by arrival. Why
not every step: it reads every live request, and a step's plan must stay cheap with thousands
queued; between two refreshes, each admitted request is added to the backlogs it is ahead in
(`admitted`), and the time passed is taken off (`miss.elapse`), so a burst is not judged
against the queue as it was before the burst.

The step's seconds are the measured average (`SchedulerState.step_s`): a waiting newcomer waits
behind a full batch, and the steps measured under a queue are full ones. A measured step holds
the prefills run in it, on average, so the prefills ahead are not counted again (only the
newcomer's own is). Before any step is measured, the step-cost model's full-batch step, and the
prefills ahead priced by it; with neither there is no prediction (admitted).

Off (`enabled` false: no objectives configured) it takes nothing and predicts nothing.
"""
from __future__ import annotations

import math
import threading
from typing import Mapping

from scheduler.miss import Backlog, OnMiss, Prediction, Work, backlogs, elapse, predict, push
from scheduler.policies.planner import BatchPlanner
from scheduler.request import RequestStats, Status
from scheduler.state import SchedulerState
from scheduler.tiers import TIERS, tier_of, ttft_objective_s


class MissForecast:
    """Per-tier backlogs of one step loop (module docstring)."""

    def __init__(self, planner: BatchPlanner, refresh_s: float = 0.5) -> None:
        self.planner = planner
        self.refresh_s = refresh_s
        # tier -> its TTFT objective (fixed part, prefill allowance) and what a predicted miss
        # does (`configure`); empty: off
        self.ttft_s: dict[str, tuple[float, float]] = {}
        self.on_miss: dict[str, OnMiss] = {}
        self._lock = threading.Lock()
        self._backlogs: dict[str, Backlog] = {}
        self._at: float | None = None          # when the backlogs were last brought to date
        self._taken: float | None = None       # when they were last taken from the state
        self._tau = 1.0

    @property
    def enabled(self) -> bool:
        return bool(self.ttft_s)

    def configure(self, ttft_s: Mapping[str, tuple[float, float]],
                  on_miss: Mapping[str, OnMiss]) -> None:
        """Each tier's TTFT objective as (fixed seconds, prefill allowance)
        (`scheduler.tiers.ttft_objective_s`), and what admission does with a predicted miss of it."""
        self.ttft_s, self.on_miss = dict(ttft_s), dict(on_miss)

    def objectives(self, prompt_len: int) -> dict[str, float]:
        """Each tier's TTFT objective for a request with a `prompt_len`-token prompt, priced by
        the planner's step-cost model (the one rule: `ttft_objective_s`)."""
        cost = self.planner.config.step_cost
        return {t: ttft_objective_s(fixed, allowance, prompt_len, cost)
                for t, (fixed, allowance) in self.ttft_s.items()}

    # ---- the loop's thread ---------------------------------------------------------------------
    def refresh(self, state: SchedulerState, now: float, *, force: bool = False) -> None:
        """Take the backlogs from the live requests, if `refresh_s` has passed (or `force`)."""
        if not self.enabled or (not force and self._taken is not None
                                and now - self._taken < self.refresh_s):
            return
        step_s = self._step_s(state)
        if step_s is None:
            return
        requests = list(state.requests.values())
        stepped = [s for s in requests if s.n_steps]
        tau = (sum(s.tau_sum for s in stepped) / sum(s.n_steps for s in stepped)) if stepped else 1.0
        rank = {t: i for i, t in enumerate(TIERS)}
        requests.sort(key=lambda s: (rank[tier_of(s.tier)], s.status is not Status.RUNNING,
                                     s.arrival_s))
        by_tier: dict[str, list[Work]] = {t: [] for t in TIERS}
        measured = state.step_s is not None     # its average holds the prefills (docstring)
        for s in requests:
            by_tier[tier_of(s.tier)].append(self._work(s, tau, measured))
        # each tier waits behind itself and those above
        taken = dict(zip(TIERS, backlogs((by_tier[t] for t in TIERS),
                                         self.planner.config.max_batch, step_s)))
        with self._lock:
            self._backlogs, self._at, self._taken, self._tau = taken, now, now, tau

    def _step_s(self, state: SchedulerState) -> float | None:
        if state.step_s is not None:
            return state.step_s
        c = self.planner.config
        if c.step_cost is None:
            return None
        return c.step_cost(c.max_batch, c.max_batch)

    def _work(self, s: RequestStats, tau: float, measured: bool) -> Work:
        """`measured`: the step time is measured, its prefills in it (no prefill pass counted).
        NOTE: asked afresh each time, not cached by request: laps' belief about a waiting
        request moves as its tenant's other requests finish (a cache went stale enough to
        break the calibration bound)."""
        per_step = s.tau_sum / s.n_steps if s.n_steps else tau
        steps = self.planner.ordering.remaining_tokens(s) / max(per_step, 1.0)
        first, prefill_s = self._prefill(s.prompt_len if s.n_steps == 0 and not s.kv_tokens else 0)
        return Work(s.tenant, steps + first - 1, 0.0 if measured else prefill_s)

    def _prefill(self, prompt_len: int) -> tuple[float, float]:
        """(steps until a first token, seconds of a prefill pass) for a prompt not yet holding KV
        (0 tokens: it holds its KV: one step, no pass). Chunked: a chunk a step; else a pass of
        its own, as the step-cost model prices it (none: counted free)."""
        c = self.planner.config
        if not prompt_len:
            return 1.0, 0.0
        if c.prefill_chunk_tokens:
            return float(max(1, math.ceil(prompt_len / c.prefill_chunk_tokens))), 0.0
        return 1.0, c.step_cost.prefill(prompt_len) if c.step_cost is not None else 0.0

    # ---- any thread ------------------------------------------------------------------------------
    def predict(self, tier: str, tenant: str, prompt_len: int, max_tokens: int,
                now: float) -> Prediction | None:
        """A newcomer's prediction in `tier`, from `now` (None: no backlog taken yet). Its own
        length is its max_tokens (nothing else is known of it before it runs): its completion
        time is an upper bound; its TTFT does not depend on it."""
        with self._lock:
            b = self._current(tier, now)
            tau = self._tau
        if b is None:
            return None
        first, prefill_s = self._prefill(prompt_len)
        return predict(b, tenant, steps=max_tokens / max(tau, 1.0), first_steps=first,
                       prefill_s=prefill_s)

    def admitted(self, s: RequestStats, now: float) -> None:
        """`s` was admitted since the backlogs were taken: it is ahead of every later newcomer of
        its tier and the tiers below it."""
        with self._lock:
            if not self._backlogs:
                return
            work = None
            for tier in TIERS[TIERS.index(tier_of(s.tier)):]:
                b = self._current(tier, now)
                if work is None:
                    first, prefill_s = self._prefill(s.prompt_len)
                    work = Work(s.tenant, self._tokens(s) / max(self._tau, 1.0) + first - 1,
                                prefill_s)
                self._backlogs[tier] = push(b, work)
            for tier in TIERS[:TIERS.index(tier_of(s.tier))]:
                self._backlogs[tier] = self._current(tier, now)
            self._at = now

    def _current(self, tier: str, now: float) -> Backlog | None:
        """A tier's backlog brought to `now` (call with the lock held)."""
        b = self._backlogs.get(tier)
        if b is None or self._at is None:
            return b
        return elapse(b, now - self._at)

    def _tokens(self, s: RequestStats) -> float:
        """A newcomer's remaining tokens as the order believes them (read-only on this thread:
        a stale belief costs a slightly wrong prediction, never a wrong state)."""
        return self.planner.ordering.remaining_tokens(s)

"""Predicting a miss: when a new request would get its first token, and when it would end, from
the work queued ahead of it; and what admission does about a predicted miss of its tier's TTFT
objective. Pure: plain data in, numbers out (the loop's side that feeds it is
scheduler/forecast.py).

The model. A step serves up to `batch` requests; the queue ahead of a new request (every live
request of its tier or a higher one: what the planner serves before it) holds the batch's slots
for the steps each still needs (its predicted remaining tokens ÷ its tokens per step). The slots
are handed out in the queue's order, each to the request ahead whose slot frees first; the new
request gets the first slot free after all of them. While a request waits the batch is full, so
every step it waits is a full batch's step (`step_s`). Prefills done in a pass of their own delay
every slot, so the pending prefills ahead add to the wait as a whole.

    start       = earliest slot free after the queue ahead + pending prefills ahead
    ttft        = start + own prefill + first_steps · step_s
    completion  = ttft + (steps − 1) · step_s

Why a size-blind queue: a length-aware order may serve a short newcomer before long requests
already queued, so for it this is an upper bound on the wait; for FCFS, strict priority and a
steady queue it is what happens (tests/unit/scheduler/test_miss_calibration.py bounds the error).

Worked example: batch 2, step 0.1 s; ahead, A 10 steps and B 4 steps, then C 3 steps. A and B
take the two slots (free at 1.0 s and 0.4 s); C takes B's (free at 0.7 s); a new request's slot
frees at 0.7 s and its first token comes one step later:

>>> b = backlog([Work("t", 10), Work("t", 4), Work("u", 3)], batch=2, step_s=0.1)
>>> [round(t, 3) for t in b.free_s]
[0.7, 1.0]
>>> p = predict(b, "u", steps=5)
>>> round(p.ttft_s, 3), round(p.completion_s, 3), round(p.tenant_share, 3)
(0.8, 1.2, 0.176)
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, Mapping

__all__ = ["Work", "Backlog", "Prediction", "Verdict", "backlog", "backlogs", "push", "elapse", "predict",
           "judge", "OnMiss"]

OnMiss = Literal["refuse", "flex", "admit"]    # what admission does with a predicted TTFT miss


@dataclass(frozen=True, slots=True)
class Work:
    """One request ahead: its tenant, the steps it still needs, and the seconds of prefill in a
    pass of its own that it will take before it starts (0: it holds its KV, or its prompt is
    prefilled in chunks inside its steps, counted in `steps`)."""
    tenant: str
    steps: float
    prefill_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Backlog:
    """The queue ahead, as a newcomer of one tier sees it (seconds from when it was taken):
    `free_s`, when each of the batch's slots frees, earliest first; `prefill_s`, the prefills
    still to run ahead; `by_tenant`, the slot-seconds of the work ahead by tenant."""
    free_s: tuple[float, ...]
    step_s: float
    prefill_s: float = 0.0
    by_tenant: Mapping[str, float] = field(default_factory=dict)

    @property
    def work_s(self) -> float:
        return sum(self.by_tenant.values())


@dataclass(frozen=True, slots=True)
class Prediction:
    """A newcomer's predicted times, in seconds from the backlog's moment: `wait_s` until it
    starts; `tenant_share`, the share of the work ahead that is its own tenant's."""
    wait_s: float
    ttft_s: float
    completion_s: float
    tenant_share: float


@dataclass(frozen=True, slots=True)
class Verdict:
    """What admission does: `admit` in `tier` (the one asked for, or `flex` when moved there),
    or `refuse` with `status` (429: its tenant's own requests make the wait; 503: everyone's)
    and `retry_after_s`, when the prediction says it would make its objective."""
    action: Literal["admit", "refuse"]
    tier: str
    predicted: Prediction | None = None
    status: int = 200
    retry_after_s: float = 0.0


def backlog(ahead: Iterable[Work], batch: int, step_s: float) -> Backlog:
    """The backlog of the queue `ahead`, in the order the planner serves it."""
    return backlogs([ahead], batch, step_s)[0]


def backlogs(bands: Iterable[Iterable[Work]], batch: int, step_s: float) -> list[Backlog]:
    """The backlog behind each of `bands` served in order (each band waits behind itself and
    every band before it): one pass over the whole queue, however many bands.

    >>> [b.free_s for b in backlogs([[Work("t", 2)], [Work("t", 3)]], batch=1, step_s=1.0)]
    [(2.0,), (5.0,)]
    """
    if batch < 1 or step_s < 0:
        raise ValueError("batch must be ≥ 1 and step_s ≥ 0")
    free = [0.0] * batch
    prefill, by_tenant, out = 0.0, {}, []
    pop_push = heapq.heapreplace
    for band in bands:
        for w in band:
            pop_push(free, free[0] + w.steps * step_s)
            prefill += w.prefill_s
            by_tenant[w.tenant] = by_tenant.get(w.tenant, 0.0) + w.steps * step_s
        out.append(Backlog(tuple(sorted(free)), step_s, prefill, dict(by_tenant)))
    return out


def push(b: Backlog, w: Work) -> Backlog:
    """`b` with `w` queued at its end (a request admitted since `b` was taken: it goes ahead of
    every later newcomer of its tier and the tiers below)."""
    free = list(b.free_s[1:])
    bisect.insort(free, b.free_s[0] + w.steps * b.step_s)
    by_tenant = dict(b.by_tenant)
    by_tenant[w.tenant] = by_tenant.get(w.tenant, 0.0) + w.steps * b.step_s
    return Backlog(tuple(free), b.step_s, b.prefill_s + w.prefill_s, by_tenant)


def elapse(b: Backlog, seconds: float) -> Backlog:
    """`b`, `seconds` later with nothing added: every slot that much nearer to free. The prefills
    ahead are kept whole (they run when their requests start, not before)."""
    if seconds <= 0:
        return b
    free = tuple(max(0.0, t - seconds) for t in b.free_s)
    by_tenant = {k: v * _shrink(b, seconds) for k, v in b.by_tenant.items()}
    return Backlog(free, b.step_s, b.prefill_s, by_tenant)


def _shrink(b: Backlog, seconds: float) -> float:
    """The share of the work ahead left after `seconds` of the whole batch serving it."""
    total = b.work_s
    if total <= 0:
        return 0.0
    return max(0.0, total - seconds * len(b.free_s)) / total


def predict(b: Backlog, tenant: str, *, steps: float, first_steps: float = 1.0,
            prefill_s: float = 0.0) -> Prediction:
    """A newcomer of `tenant` that needs `steps` decoding steps, the first token after
    `first_steps` (more than one when its prompt is prefilled in chunks inside steps) and
    `prefill_s` of prefill in a pass of its own (module docstring)."""
    start = b.free_s[0] + b.prefill_s
    ttft = start + prefill_s + first_steps * b.step_s
    total = b.work_s
    share = b.by_tenant.get(tenant, 0.0) / total if total > 0 else 0.0
    return Prediction(start, ttft, ttft + max(0.0, steps - 1) * b.step_s, share)


def judge(tier: str, forecast: Callable[[str], Prediction | None], ttft_s: Mapping[str, float],
          on_miss: Mapping[str, OnMiss], flex_allowed: bool) -> Verdict:
    """Admission's verdict on a newcomer asking for `tier`: `forecast(tier)` its prediction in a
    tier (None: no prediction yet, e.g. before the first step: admitted); `ttft_s`, `on_miss`:
    each tier's TTFT objective for this request (its prompt's allowance included:
    `scheduler.tiers.ttft_objective_s`, `MissForecast.objectives`) and what a predicted miss
    does; `flex_allowed`: its tenant may use `flex`.

    Only the wait is judged: a request that would miss on an empty queue (its own prefill and
    first step exceed the objective) is admitted, since waiting cannot help it. Retry-After is
    how much sooner its first token would have to come: the queue ahead drains by that much in
    that time, unless more work arrives ahead of it.

    >>> b = backlog([Work("t", 30)], batch=1, step_s=0.1)
    >>> f = lambda t: predict(b, "u", steps=4)
    >>> judge("default", f, {"default": 2.5, "flex": 30.0}, {"default": "flex"}, True).tier
    'flex'
    >>> v = judge("default", f, {"default": 2.5}, {"default": "refuse"}, True)
    >>> v.action, v.status, round(v.retry_after_s, 3)
    ('refuse', 503, 0.6)
    """
    p = forecast(tier)
    objective = ttft_s.get(tier)
    if p is None or objective is None or _makes_it(p, objective):
        return Verdict("admit", tier, p)
    action = on_miss.get(tier, "refuse")
    if action == "admit":
        return Verdict("admit", tier, p)
    if action == "flex" and flex_allowed and tier != "flex":
        q = forecast("flex")
        flex_s = ttft_s.get("flex")
        if q is not None and flex_s is not None and q.ttft_s <= flex_s:
            return Verdict("admit", "flex", q)
    return Verdict("refuse", tier, p, 429 if p.tenant_share >= 0.5 else 503,
                   p.ttft_s - objective)


def _makes_it(p: Prediction, objective: float) -> bool:
    """Met, or missed by its own size alone (waiting would not help); to within float rounding,
    so that a retry exactly `retry_after_s` later is admitted."""
    return p.ttft_s <= objective + 1e-9 or p.ttft_s - p.wait_s > objective

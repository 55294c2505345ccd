"""Service tiers in the simulator (`specgate sim --tiers priority=0.2,default=0.5,flex=0.3`):
which tier each simulated request is sold, and whether it met its tier's objectives.

The objectives are the gateway's (`gateway.tiers.DEFAULT_TIERS`): time to first token (its fixed
part plus the tier's allowance for the prompt's prefill, priced by the run's step-cost profile as
the gateway prices it by its own: `gateway.tiers.attainment`), time
between tokens (judged as the gateway's metrics judge it: a step's tokens share the gap since the
previous ones, and a request meets its TBT when at most 100 − percentile per cent of its gaps are
over the target, `gateway.tiers.attainment`) and the maximum wait the planner holds the tier to
(its `max_queue_wait_s`, else the aging bound). The planner gets the same bounds the gateway
gives it (`gateway.tiers.wait_bounds`).

Per policy: `slo_attainment` (tier → the fraction of its finished requests that met every
objective), `goodput_tok_s` (output tokens per second of the requests that met theirs) and
`per_tier_mean_ttft_s` (what the tiers' order of service buys each).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Mapping

from gateway.tiers import DEFAULT_TIERS, TierObjectives, attainment, wait_bounds
from scheduler.events import Delta, Event, Finished
from scheduler.request import RequestStats
from scheduler.step_cost import StepCost
from scheduler.tiers import TIERS


def parse_tiers(text: str) -> tuple[tuple[str, float], ...]:
    """`priority=0.2,default=0.5,flex=0.3` → ((tier, share), ...), shares summing to 1.

    >>> parse_tiers("priority=0.2,default=0.5,flex=0.3")
    (('priority', 0.2), ('default', 0.5), ('flex', 0.3))
    """
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, share = part.partition("=")
        if name not in TIERS:
            raise ValueError(f"unknown tier {name!r}; known: {', '.join(TIERS)}")
        out.append((name, float(share)))
    if not out or any(s < 0 for _, s in out) or abs(sum(s for _, s in out) - 1) > 1e-6:
        raise ValueError(f"tier shares must be >= 0 and sum to 1, got {text!r}")
    return tuple(out)


def assign_tiers(n: int, shares: tuple[tuple[str, float], ...], seed: int) -> list[str]:
    """Each of `n` requests' tier, drawn by share from a stream of its own (the workload's other
    draws stay what they were without tiers)."""
    rng = random.Random(seed * 7_919 + 104_729)
    names, weights = [t for t, _ in shares], [s for _, s in shares]
    return rng.choices(names, weights, k=n)


def tier_wait_s(tiers: Mapping[str, TierObjectives] = DEFAULT_TIERS) -> dict[str, float | None]:
    """`PolicyConfig.tier_wait_s` as the gateway sets it."""
    return wait_bounds(tiers)


@dataclass(slots=True)
class _Times:
    arrival_s: float
    tbt_s: float | None             # its tier's target between tokens (None: no tier objectives)
    last_s: float | None = None     # when its last tokens came (None: none yet)
    ttft_s: float | None = None
    gaps: int = 0
    slow_gaps: int = 0


class TierObjectivesMet:
    """Follows each request's tokens on the simulated clock, as the gateway's metrics follow
    them on the wall clock, and judges each finished request against its tier (module docstring)."""

    def __init__(self, clock, aging_bound_s: float | None,
                 tiers: Mapping[str, TierObjectives] = DEFAULT_TIERS,
                 cost: StepCost | None = None) -> None:
        """`cost`: the run's step-cost profile, which prices each prompt's TTFT allowance."""
        self.clock, self.tiers, self.cost = clock, tiers, cost
        self.wait_bound = {t: (o.max_queue_wait_s if o.max_queue_wait_s is not None
                               else aging_bound_s) for t, o in tiers.items()}
        self._times: dict[str, _Times] = {}
        self.requests: dict[str, int] = {t: 0 for t in tiers}
        self.met: dict[str, int] = {t: 0 for t in tiers}
        self.ttft_sum: dict[str, float] = {t: 0.0 for t in tiers}
        self.good_tokens = 0

    def arrived(self, s: RequestStats) -> None:
        o = self.tiers.get(s.tier)
        self._times[s.request_id] = _Times(s.arrival_s, o.tbt_s if o is not None else None)

    def event(self, event: Event) -> None:
        t = self._times.get(event.request_id)
        if t is None:
            return
        now = self.clock()
        if isinstance(event, Delta):
            n = len(event.token_ids)
            if t.last_s is None:
                t.ttft_s = now - t.arrival_s
            elif n:
                t.gaps += n
                if t.tbt_s is not None and (now - t.last_s) / n > t.tbt_s:
                    t.slow_gaps += n
            t.last_s = now
        elif isinstance(event, Finished):
            del self._times[event.request_id]
            self._judge(event.stats, t, now)

    def _judge(self, s: RequestStats, t: _Times, now: float) -> None:
        o = self.tiers.get(s.tier)
        if o is None:
            return
        met = attainment(o, t.ttft_s, t.gaps, t.slow_gaps, now - t.arrival_s, s.prompt_len,
                         self.cost)
        bound = self.wait_bound.get(s.tier)
        ok = all(met.values()) and (bound is None or s.max_wait_s <= bound)
        self.requests[s.tier] += 1
        self.ttft_sum[s.tier] += t.ttft_s if t.ttft_s is not None else now - t.arrival_s
        if ok:
            self.met[s.tier] += 1
            self.good_tokens += s.committed

    def summary(self, end_s: float) -> dict:
        return {"slo_attainment": {t: self.met[t] / n for t, n in self.requests.items() if n},
                "per_tier_mean_ttft_s": {t: self.ttft_sum[t] / n
                                         for t, n in self.requests.items() if n},
                "goodput_tok_s": self.good_tokens / end_s if end_s else 0.0}

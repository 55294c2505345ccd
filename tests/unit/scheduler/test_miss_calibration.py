"""The miss predictor against the real step loop: requests arrive at the batch's capacity on a
standing queue (the fake worker in simulated time, one token a step), each predicted at arrival
by the loop's forecast (scheduler/forecast.py) and measured at its first token. Stated bound: on
such a steady queue the mean predicted TTFT is within 15% of the mean measured one, and no
request's error is over a quarter of its TTFT plus two steps (the forecast's step average and
its prefills counted whole are the slack)."""
from __future__ import annotations

import pytest

from scheduler.loop import Delta, StepLoop
from scheduler.policies import make_policy
from scheduler.request import Request, RequestStats
from scheduler.step_cost import LinearStepCost
from workers.fake_worker import FakeClock, FakeWorker

STEP_S = 0.05
TOKENS = 12             # every request's length: one token a step, so 12 steps in a slot
BATCH = 2
WARMUP = 10             # arrivals left out of the comparison (`run`)


def run(policy: str, n: int = 45, backlog: int = 6) -> list[tuple[float, float]]:
    """(predicted, measured) TTFT of `n` requests after `backlog` queued at once."""
    clock = FakeClock(0.0)
    cost = LinearStepCost(fixed_s=STEP_S)
    worker = FakeWorker(alpha=0.0, clock=clock, step_cost=lambda b, t: STEP_S)
    planner = make_policy(policy, max_batch=BATCH, step_cost=cost)
    loop = StepLoop(planner, worker, clock=clock, max_resident=BATCH)
    loop.forecast.configure({"default": (1e9, 0.0)}, {})
    loop.forecast.refresh_s = 0.0                 # every step: no staleness in the measurement
    first: dict[str, float] = {}

    def sink(event):
        if isinstance(event, Delta):
            first.setdefault(event.request_id, clock.now)

    predicted: dict[str, float] = {}
    arrivals: dict[str, float] = {}
    every = TOKENS * STEP_S / BATCH               # the batch's capacity: a request per this
    next_at, i = 0.0, 0
    while len(first) < n + backlog:
        while i < n + backlog and (i < backlog or clock.now >= next_at):
            rid = f"r{i}"
            s = RequestStats(rid, "t", clock.now, prompt_len=4, max_tokens=TOKENS)
            p = loop.forecast.predict("default", "t", 4, TOKENS, clock.now)
            if p is not None:
                predicted[rid] = p.ttft_s
            arrivals[rid] = clock.now
            loop.submit(Request(s, prompt_ids=[5, 6, 7, 8], drafter="none"), sink)
            if i >= backlog:
                next_at += every
            else:
                next_at = clock.now + every
            i += 1
        loop.step()
    # from the backlog's end plus a warm-up: the step average starts from the first step,
    # which held the first prefills, and forgets it over some ten steps
    return [(predicted[r], first[r] - arrivals[r]) for r in predicted if r in first
            and int(r[1:]) >= backlog + WARMUP]


@pytest.mark.parametrize("policy", ["fcfs", "laps"])
def test_predicted_ttft_is_within_the_stated_bound_on_a_steady_queue(policy):
    pairs = run(policy)
    assert len(pairs) >= 25
    mean_p = sum(p for p, _ in pairs) / len(pairs)
    mean_m = sum(m for _, m in pairs) / len(pairs)
    assert mean_m > 5 * STEP_S                     # a queue stood: there was a wait to predict
    assert abs(mean_p - mean_m) <= 0.15 * mean_m, (mean_p, mean_m)
    worst = max(abs(p - m) - (0.25 * m + 2 * STEP_S) for p, m in pairs)
    assert worst <= 0, pairs

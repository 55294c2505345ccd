"""Service tiers as the gateway sells them: each tier's objectives (deployment-wide,
`SPECGATE_SERVICE_TIERS`), the bound the planner holds each tier's waits to, and whether a request
met its tier's objectives (what /metrics counts, `specgate_slo_requests_total`).

A tier (`priority`, `default`, `flex`: OpenAI's `service_tier`; the planner's order,
scheduler/tiers.py) has a time-to-first-token target (a fixed part, `ttft_s`, plus
`ttft_prefill_allowance` times the prompt's prefill as the step-cost profile prices it: one rule,
`scheduler.tiers.ttft_objective_s`, says why) and a time-between-tokens target, each to be
met by `percentile` per cent of its requests (the rest is the error budget the burn-rate alerts
watch), a maximum queue wait, and what the planner does about a request about to pass it
(`on_miss`): `promote` plans it ahead of its band (aging per tier: it waits no longer, at the
cost of the order the policy would have chosen), `count` leaves it where the order puts it (its
miss is only counted). With miss prediction on (`slo_admission`), a request predicted to miss
its TTFT target is refused early or moved to flex (`on_predicted_miss`). Which tiers a tenant may use, and its default for `auto`, are the
tenant's (`gateway.tenancy.records.Tenant`).
"""
from __future__ import annotations

from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field

from scheduler.step_cost import StepCost
from scheduler.tiers import TIERS, ttft_objective_s

REQUEST_TIERS = ("auto", *TIERS)        # what a request's `service_tier` may say
OBJECTIVES = ("ttft", "tbt")            # the objectives each tier has, as /metrics names them


class TierObjectives(BaseModel):
    """One tier's objectives (module docstring)."""
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    ttft_s: float = Field(gt=0)                 # time to first token, from arrival: fixed part
    # plus this many times the prompt's prefill pass as the step-cost profile prices it (0: the
    # fixed part alone; `scheduler.tiers.ttft_objective_s`)
    ttft_prefill_allowance: float = Field(default=0.0, ge=0)
    tbt_s: float = Field(gt=0)                  # time between tokens
    # the share of the tier's requests, in per cent, that must meet each target (95, 99): a
    # request meets the TBT target when this share of its own gaps is within it
    percentile: float = Field(ge=50, lt=100)
    # the longest a request of the tier waits for a step, from arrival or between steps; None:
    # the planner's aging bound (60 s)
    max_queue_wait_s: float | None = Field(default=None, gt=0)
    on_miss: Literal["promote", "count"] = "promote"
    # what admission does with a request predicted to miss the TTFT target (scheduler/miss.py;
    # with `SPECGATE_SLO_ADMISSION` on): refuse it (429/503 slo_unattainable, Retry-After),
    # move it to `flex` where its tenant may use flex and flex would make it, or admit it
    on_predicted_miss: Literal["refuse", "flex", "admit"] = "refuse"

    @property
    def objective(self) -> float:
        """The target share as a ratio (0.99): 1 − this is the error budget."""
        return self.percentile / 100

    def ttft_for(self, prompt_tokens: int, cost: StepCost | None) -> float:
        """The TTFT objective of a request of this tier with a `prompt_tokens`-token prompt, on
        the deployment whose step-cost profile is `cost` (`ttft_objective_s`)."""
        return ttft_objective_s(self.ttft_s, self.ttft_prefill_allowance, prompt_tokens, cost)


# The prefill allowances double tier by tier, as the fixed parts grow. Priority's is several
# passes' worth, not one: with chunked prefill (the gateway's default) each chunk rides in a step
# whose own cost (the batch's decoding) it shares, so a prompt prefilled in chunks takes a few
# times its whole pass; an allowance below that would make long prompts miss by construction
# again. The lower tiers get more room for the queue ahead of them.
DEFAULT_TIERS: dict[str, TierObjectives] = {
    "priority": TierObjectives(ttft_s=1.0, ttft_prefill_allowance=4.0, tbt_s=0.1, percentile=99),
    "default": TierObjectives(ttft_s=2.5, ttft_prefill_allowance=8.0, tbt_s=0.2, percentile=99,
                              on_predicted_miss="flex"),
    "flex": TierObjectives(ttft_s=30.0, ttft_prefill_allowance=16.0, tbt_s=0.5, percentile=95,
                           max_queue_wait_s=300.0),
}


def merged_tiers(given: Any) -> Any:
    """The settings' tiers: each tier named takes the fields given over its own defaults, the
    tiers not named keep theirs (so `{"flex": {"max_queue_wait_s": 600}}` changes one number).
    Anything but a mapping of mappings is left for validation to refuse."""
    if not isinstance(given, Mapping):
        return given
    out: dict[str, Any] = {t: o.model_dump() for t, o in DEFAULT_TIERS.items()}
    for tier, fields in given.items():
        if isinstance(fields, TierObjectives):
            fields = fields.model_dump()
        if tier in out and isinstance(fields, Mapping):
            out[tier] = {**out[tier], **fields}
        else:
            out[tier] = fields                  # an unknown tier or a non-mapping: refused
    return out


def wait_bounds(tiers: Mapping[str, TierObjectives]) -> dict[str, float | None]:
    """`PolicyConfig.tier_wait_s`: the bound aging holds each tier to (a tier left out: the
    planner's aging bound; None: none, `on_miss: count`)."""
    out: dict[str, float | None] = {}
    for tier, o in tiers.items():
        if o.on_miss == "count":
            out[tier] = None
        elif o.max_queue_wait_s is not None:
            out[tier] = o.max_queue_wait_s
    return out


def attainment(o: TierObjectives, ttft_s: float | None, gaps: int, slow_gaps: int,
               waited_s: float, prompt_tokens: int = 0,
               cost: StepCost | None = None) -> dict[str, bool]:
    """Which objectives an ended request met: objective -> met. `ttft_s`: its time to first
    token (None: it had none); `gaps`, `slow_gaps`: its gaps between tokens, and those over the
    tier's TBT target; `waited_s`: how long it lived; `prompt_tokens`, `cost`: its prompt and
    the deployment's step-cost profile, which its TTFT objective grows with (`o.ttft_for`).

    A request with no first token counts only if it lived past the TTFT target (a miss: its
    client waited that long for nothing); its TBT is not judged. A request's TBT is met when at
    most (100 − percentile) % of its gaps are over the target: its own percentile gap is within it.

    >>> o = TierObjectives(ttft_s=1.0, tbt_s=0.1, percentile=95)
    >>> attainment(o, 0.5, 100, 5, 9.0), attainment(o, 1.5, 100, 6, 9.0)
    ({'ttft': True, 'tbt': True}, {'ttft': False, 'tbt': False})
    >>> attainment(o, None, 0, 0, 0.2), attainment(o, None, 0, 0, 3.0)
    ({}, {'ttft': False})
    >>> from scheduler.step_cost import LinearStepCost
    >>> long = o.model_copy(update={"ttft_prefill_allowance": 2.0})
    >>> attainment(long, 1.5, 100, 5, 9.0, 1000, LinearStepCost(per_token_s=0.001))["ttft"]
    True
    """
    objective = o.ttft_for(prompt_tokens, cost)
    if ttft_s is None:
        return {"ttft": False} if waited_s > objective else {}
    return {"ttft": ttft_s <= objective,
            "tbt": slow_gaps <= gaps * (1 - o.objective) + 1e-9}

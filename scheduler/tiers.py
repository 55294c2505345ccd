"""Service tiers as the scheduler sees them: their names, the order they are served in, and the
class a request is planned in.

A tier is OpenAI's `service_tier` (`priority`, `default`, `flex`; the gateway turns `auto` into
the tenant's default before a request gets here). The planner serves classes in order, lowest
first (scheduler/policies/queues.py), and a request's class is its tier first, then its tenant's
own priority class (`Tenant.priority`) within the tier:

    priority tier   (tenant class 0, 1, …)   served first, never preempted by a lower tier
    default tier    (tenant class 0, 1, …)   the deployment's policy (laps) orders it
    flex tier       (tenant class 0, 1, …)   what is left, preempted first

Why the tier comes first: a tier is what a request was sold (a latency objective per request),
a tenant's class is how an operator ranks whole tenants; were the tenant's class first, a
high-class tenant's flex traffic would preempt a low-class tenant's `priority` requests, and the
priority tier's objectives could not be kept for anyone. Within a tier the tenant's class keeps
the meaning it had before tiers, so a deployment whose requests are all `default` plans exactly
as it did (`plan_class` is then the tenant's class itself: fairness accounts stored before tiers
keep their meaning too).

Aging (scheduler/policies/aging.py) holds each tier to its own maximum wait; what an overdue
request may go ahead of is the tier's band (`BANDS`). A request's TTFT objective is its tier's
fixed part plus an allowance for its prompt's prefill (`ttft_objective_s`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.step_cost import StepCost

TIERS = ("priority", "default", "flex")     # in the order they are served
DEFAULT_TIER = "default"

# One tier's classes span 2**54: a tenant's class is at most 2**53 (the tenants file's bound), so
# no tenant class reaches into the next tier's. Plain ints: fairness accounts stay (int, tenant).
_SPAN = 2**54
_OFFSET = {"priority": -_SPAN, "default": 0, "flex": _SPAN}

# Bands: the tiers whose overdue requests (aging) are planned ahead of the band's queues. The
# priority tier is a band of its own, so nothing of a lower tier is ever planned ahead of a
# priority request, aged or not (priority is never preempted by lower tiers). default and flex
# share one: a flex request about to pass its maximum wait goes ahead of default's queue (flex
# may be put off, never starved), while default's own overdue requests go first.
BANDS: tuple[tuple[str, ...], ...] = (("priority",), ("default", "flex"))


def tier_of(name: str | None) -> str:
    """A known tier's name; anything else (None, a record of a later version) is `default`."""
    return name if name in _OFFSET else DEFAULT_TIER


def plan_class(tier: str, priority: int) -> int:
    """The class a request of `tier` from a tenant of class `priority` is planned in (lower first).

    >>> plan_class("default", 2), plan_class("priority", 9) < plan_class("default", 0) < plan_class("flex", 0)
    (2, True)
    """
    return _OFFSET.get(tier, 0) + priority     # as _OFFSET[tier_of(tier)]: unknown is default's 0


def class_tier(cls: int) -> str:
    """The tier of a planning class (`plan_class`'s inverse, as to the tier).

    >>> [class_tier(plan_class(t, 7)) for t in TIERS]
    ['priority', 'default', 'flex']
    """
    if cls < -_SPAN // 2:
        return "priority"
    return "flex" if cls >= _SPAN // 2 else "default"


def ttft_objective_s(ttft_s: float, prefill_allowance: float, prompt_tokens: int,
                     cost: "StepCost | None") -> float:
    """A request's time-to-first-token objective: its tier's fixed part `ttft_s` plus
    `prefill_allowance` times the seconds its prompt's prefill takes in a pass of its own, as the
    deployment's step-cost profile prices it (`cost.prefill`). The one rule: the gateway's
    metrics, admission's miss prediction and the simulator's judge all ask it.

    Why it scales with the prompt: a prompt's prefill is work the client sizes, and it precedes
    the first token whatever the order of service; with a fixed objective, every prompt whose own
    prefill exceeds it misses by construction, which no scheduling can fix (and the tier's
    error budget then measures its prompt mix, not its service). Operators write TTFT objectives
    per prompt size for that reason.

    Why a multiple of the profiled prefill and not seconds per token: the same setting means the
    same on any machine and model (prefill speed differs by two orders of magnitude between a CPU
    and a GPU; a per-token allowance right for one is wrong for the other by that much), and it
    follows the prefill curve's shape (attention makes long prompts dearer per token). The whole
    pass is the yardstick, not the chunked cost: it is what the prompt costs the hardware; how the
    deployment spends it (chunks between other requests' steps, at a chunk size of its choosing)
    is the scheduler's business, which a multiple above 1 leaves room for (chunks share steps
    with the batch's decoding, so a chunked prefill takes a few passes' worth). The prompt is counted
    as sent: a prefix-cache hit is the deployment's gain, not a tighter promise. No profile
    (`cost` None) or no allowance: the fixed part alone.

    >>> from scheduler.step_cost import LinearStepCost
    >>> cost = LinearStepCost(per_token_s=0.001)          # a prompt's pass: 1 ms a token
    >>> ttft_objective_s(1.0, 2.0, 100, cost), ttft_objective_s(1.0, 2.0, 1000, cost)
    (1.2, 3.0)
    >>> ttft_objective_s(1.0, 0.0, 1000, cost), ttft_objective_s(1.0, 2.0, 1000, None)
    (1.0, 1.0)
    """
    if prefill_allowance <= 0 or prompt_tokens <= 0 or cost is None:
        return ttft_s
    return ttft_s + prefill_allowance * cost.prefill(prompt_tokens)

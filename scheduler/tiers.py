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
request may go ahead of is the tier's band (`BANDS`).
"""
from __future__ import annotations

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

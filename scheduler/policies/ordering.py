"""What one scheduling policy is: an order of service, and nothing else.

fcfs, sjf, las, srpt and laps differ only in how they rank live requests: a key per request
(lower served first), the refresh that moves a served request before it is re-keyed (levels,
perceptible, predicted remaining time), and, for laps, state of its own (the tenants' length
records, the wait credit's origin) and weights on draft nodes. Everything else, the queues,
aging, tenant fairness, KV, chunked prefill and tree sizing, is the batch planner's
(planner.py), the same for every policy.

`Ordering` declares the whole capability with defaults that are right for a policy without it,
so the planner never probes: `key` is required; `refresh`, `node_urgency`, `finished` and
`reset` default to nothing, `remaining_tokens` to the request's own bounds, and `ages` to true. An ordering is built from the planner's `PolicyConfig` and its own
options (`build`); one that reads the config (laps: the step cost) overrides `build`.
"""
from __future__ import annotations

from typing import ClassVar, Protocol

from scheduler.policies.plan import PolicyConfig
from scheduler.request import RequestStats
from scheduler.state import SchedulerState

BAND = 1e12   # keys of the form band · BAND + value order by band first (levels, perceptible)


class Ordering(Protocol):
    """A policy's order of service (module docstring)."""
    name: ClassVar[str]
    # whether the planner holds its requests to aging bounds (each service tier's maximum wait,
    # promoting overdue requests ahead of their band); the strict baseline (priority.py) does not
    ages: ClassVar[bool] = True

    @classmethod
    def build(cls, config: PolicyConfig, **options) -> Ordering:
        """The ordering for a planner with `config`, with the policy's own `options`."""
        return cls(**options)

    def key(self, s: RequestStats) -> float:
        """The request's rank: lower is served first. Called only when the request was added
        or served since it was last ranked, after `refresh`."""
        ...

    def refresh(self, state: SchedulerState, s: RequestStats) -> None:
        """Move a request that was served since it was last ranked (levels, perceptible, predicted
        remaining time); called just before it is re-keyed."""

    def remaining_tokens(self, s: RequestStats) -> float:
        """Output tokens the request is expected still to produce, as far as this order knows
        (what the miss predictor, scheduler/forecast.py, reads): without a length model of its
        own, its arrival prediction (else its max_tokens) less what it committed."""
        left = s.max_tokens - s.committed
        if s.predicted_len is not None:
            left = min(left, s.predicted_len - s.committed)
        return float(max(1, left))

    def node_urgency(self, stats: list[RequestStats]) -> list[float] | None:
        """Weights on the chosen requests' draft-node worths (scheduler/sizing.py `urgency`);
        None: nodes go by goodput alone."""
        return None

    def finished(self, requests: list[RequestStats]) -> None:
        """These requests finished this step (after the planner recorded it): an ordering that
        learns from whole requests (laps' length records) learns now."""

    def reset(self) -> None:
        """The planner's queues are rebuilt from the state (`BatchPlanner.rebuild`): forget what
        belonged to the old ranking."""

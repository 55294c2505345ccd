"""Request lifecycle: states, the per-request statistics a policy sees, and the full record.

A request moves through

    queued ──plan──▶ running ──not planned──▶ preempted ──plan──▶ running ─▶ … ─▶ finished
       └────────────────────────┴──────────────────────┴──▶ cancelled / failed

Preemption happens only at step boundaries: a request is *running* while it is in the current
step's batch and *preempted* when it was running and the next plan left it out.

Policies see `RequestStats` only (no prompt ids, no sampling parameters): a small record of
numbers, updated in one place (`RequestStats.record_step`) from what one step did for the request.
The full `Request` wraps the same `RequestStats` object and carries the model-side data.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from scheduler.alpha import AlphaEstimate, learn
from scheduler.tiers import DEFAULT_TIER, plan_class
from workers.contract import SamplingParams, StepResult
from workers.stopping import cut


class Status(str, enum.Enum):
    QUEUED = "queued"          # admitted, never served
    RUNNING = "running"        # in the current step's batch
    PREEMPTED = "preempted"    # served before, left out of the latest plan
    FINISHED = "finished"      # stop or length
    CANCELLED = "cancelled"    # the client went away or asked to stop
    FAILED = "failed"          # an error ended it

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({Status.FINISHED, Status.CANCELLED, Status.FAILED})

# Why a FINISHED request finished, as the step loop reports it → OpenAI `finish_reason`.
_FINISHED_REASONS = {
    "stop": "stop", "eos": "stop", "stop_string": "stop", "stop_token": "stop",
    "length": "length", "max_tokens": "length",
    "content_filter": "content_filter", "tool_calls": "tool_calls",
}


def finish_reason(status: Status, cause: str | None = None) -> str | None:
    """The one mapping from a request's state (and cause) to an OpenAI `finish_reason`.

    >>> finish_reason(Status.FINISHED, "eos"), finish_reason(Status.FINISHED, "max_tokens")
    ('stop', 'length')
    >>> finish_reason(Status.RUNNING) is None
    True

    NOTE: OpenAI has no reason for a cancelled or failed generation; like vLLM we report "abort"
    and "error" (clients that only know the standard values treat them as unknown, not as "stop").
    """
    if status is Status.FINISHED:
        if cause is None:
            return "stop"
        try:
            return _FINISHED_REASONS[cause]
        except KeyError:
            raise ValueError(f"unknown finish cause {cause!r}") from None
    if status is Status.CANCELLED:
        return "abort"
    if status is Status.FAILED:
        return "error"
    return None


class StepRecord(NamedTuple):
    """What one step did for one request, as the step loop reports it to `BatchPlanner.update`.

    verified:  tree tokens the verifier processed for it (1 root position + draft nodes), the unit
               of attained service: rejected drafts count, speculation that fails is not free.
    committed: τ, tokens committed (accepted + the bonus token; ≥ 1 unless the step failed).
    finish:    None, or the cause the request finished with ("stop", "eos", "length", …).
    tried:     draft tokens compared on the path the acceptance walk followed (accepted, plus one
               if it stopped at a rejection); None when unknown.
    drafted, accepted: draft nodes verified and accepted (before any cut at a stop or the
               limit): the evidence of the request's α estimate (scheduler/alpha.py).
    draft_s, draft_depth: seconds its drafter spent on this step's tree, and the tree's depth.
    """
    request_id: str
    verified: int
    committed: int
    finish: str | None = None
    tried: int | None = None
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    draft_depth: int = 0


@dataclass(slots=True, eq=False)
class RequestStats:
    """What a policy may look at for one request. Updated by `record_step` only."""
    request_id: str
    tenant: str
    arrival_s: float
    prompt_len: int
    max_tokens: int
    priority: int = 0                      # its tenant's priority class: 0 before 1 before 2 …
    predicted_len: int | None = None       # output tokens predicted at arrival (sjf ranks by
                                           # it); None when no predictor
    length_belief: tuple[float, float, int] | None = None   # (μ, σ) of ln(tokens still to come),
                                           # re-predicted as it runs, at (its 3rd) committed
                                           # tokens: scheduler/length_learner.py
    max_tree_tokens: int | None = None     # cap on its draft nodes per step (tenant or request;
                                           # 0: no speculation); None: the deployment's
    status: Status = Status.QUEUED
    cause: str | None = None               # why it ended (see finish_reason)
    committed: int = 0                     # output tokens committed so far
    attained: int = 0                      # attained service: tree tokens verified so far
    n_steps: int = 0
    tau_sum: float = 0.0
    tau_sq_sum: float = 0.0
    tau_history: list[int] = field(default_factory=list)   # τ per step
    accepted_sum: int = 0                  # draft tokens accepted, and compared, in all
    tried_sum: int = 0
    estimate: AlphaEstimate = AlphaEstimate()   # α and drafting time, for tree sizing
    level: int = 0                         # multi-level queue level (las, laps)
    perceptible: bool = False              # acceptance estimate stable enough to predict time
    predicted_remaining_s: float | None = None
    last_served_s: float = 0.0             # end of the last step it was in; arrival before that
    first_served_s: float | None = None    # start of its first step (time to first token)
    finished_s: float | None = None
    max_wait_s: float = 0.0                # longest gap between arrival/steps seen so far
    in_steps_s: float = 0.0                # time inside the steps it was in (prefills included):
                                           # latency − this is waiting, what an order can move
    paused_s: float = 0.0                  # time held out of the plan because its stream's
                                           # reader fell behind (scheduler/policies/pauses.py):
                                           # not waiting the scheduler caused, so no bound counts it
    prefill_left: int | None = None        # context tokens whose KV is still to compute, while
                                           # it holds KV (chunked prefill); None: holds none
    kv_tokens: int = 0                     # KV slots it holds (0: none), as the worker reports
    kv_home: str | None = None             # where they are (Ray mode: the verifier replica);
                                           # None: the one worker, or none held
    # The tenant's immutable id (gateway.tenancy.records.Tenant.id). `tenant` is its name, which
    # quotas, fairness weights and metrics go by; a name can be removed and given to another
    # tenant, an id never is, so whatever is cached per tenant goes by `cache_tenant`.
    tenant_id: str | None = None
    drafter: str | None = None             # its drafter's name (None: the deployment's default):
                                           # the planner's prior for it is learned per drafter
    tier: str = DEFAULT_TIER               # its service tier (scheduler/tiers.py): planned before
                                           # its tenant's class (`plan_class`)

    @property
    def plan_class(self) -> int:
        """The class the planner serves it in: its tier, then its tenant's class within the tier
        (scheduler/tiers.py `plan_class`); lower first."""
        return plan_class(self.tier, self.priority)

    @property
    def cache_tenant(self) -> str:
        """What per-tenant caches (the worker's prefix cache and drafters) key this request's
        tenant by: its id; its name only for requests made without one (offline tools, tests,
        records stored before ids)."""
        return self.tenant_id if self.tenant_id is not None else self.tenant

    def __post_init__(self) -> None:
        self.last_served_s = self.arrival_s

    @property
    def unprefilled_context(self) -> int:
        """Context tokens but the root: what a prefill from nothing computes."""
        return max(self.prompt_len + self.committed - 1, 0)

    @property
    def unprefilled(self) -> int:
        """Context tokens a prefill would still compute: what it has left while it holds KV,
        else its whole context but the root (the prefix cache may then skip some)."""
        if self.prefill_left is not None:
            return self.prefill_left
        return self.unprefilled_context

    @property
    def mean_tau(self) -> float | None:
        return self.tau_sum / self.n_steps if self.n_steps else None

    @property
    def tau_stderr(self) -> float:
        """Standard error of mean τ (inf below two steps)."""
        n = self.n_steps
        if n < 2:
            return math.inf
        var = (self.tau_sq_sum - self.tau_sum * self.tau_sum / n) / (n - 1)
        return math.sqrt(max(var, 0.0) / n)

    def wait_s(self, now: float) -> float:
        return now - self.last_served_s

    def record_step(self, rec: StepRecord, start_s: float, end_s: float) -> None:
        """Account one served step that ran from start_s to end_s."""
        gap = start_s - self.last_served_s
        if gap > self.max_wait_s:
            self.max_wait_s = gap
        if self.first_served_s is None:
            self.first_served_s = start_s
        tau = rec.committed
        self.committed += tau
        self.attained += rec.verified
        self.n_steps += 1
        self.tau_sum += tau
        self.tau_sq_sum += tau * tau
        self.tau_history.append(tau)
        if rec.tried is not None:
            self.accepted_sum += tau - 1 if tau > 1 else 0
            self.tried_sum += rec.tried
        self.estimate = learn(self.estimate, rec.drafted, rec.accepted, rec.draft_s, rec.draft_depth)
        self.last_served_s = end_s
        self.in_steps_s += end_s - start_s
        self.status = Status.RUNNING


    def requeue(self) -> None:
        """The loop that held it is gone (a restart, a dead replica): no batch runs it any more
        and it holds no KV; it is prefilled with prompt + committed output when next planned."""
        if self.status is Status.RUNNING:
            self.status = Status.PREEMPTED
        self.prefill_left = None
        self.kv_tokens, self.kv_home = 0, None

    def end(self, status: Status, cause: str | None, now: float) -> None:
        if not status.terminal:
            raise ValueError(f"{status} is not a terminal state")
        self.status, self.cause, self.finished_s = status, cause, now

    @property
    def finish_reason(self) -> str | None:
        return finish_reason(self.status, self.cause)


# weakref_slot: what the gateway holds for a request (its compiled grammar) is let go when the
# request object goes, on whatever path it ends (gateway/service/constraint.py `hold_for`)
@dataclass(slots=True, eq=False, weakref_slot=True)
class Request:
    """The full record: the policy's `stats` plus what the drafters and the verifier need.

    `output_ids` are the committed output tokens (a stop token included when one ended it);
    restart recovery re-prefills `prompt_ids + output_ids` and never re-sends `output_ids`.
    """
    stats: RequestStats
    prompt_ids: list[int] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()             # stop strings, never emitted (the step loop checks text)
    drafter: str | None = None             # None: the deployment's default; "none": no speculation
    output_ids: list[int] = field(default_factory=list)
    # What the gateway attaches to a request, opaque to the scheduler and persisted with it (once,
    # at admission): after a restart the gateway reads it back to know whether a recovered request
    # runs detached (a background response nobody needs to be connected for) and which limiter
    # grant to correct when it ends. Plain JSON values only.
    meta: dict = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        return self.stats.request_id

    def commit(self, res: StepResult, limit: int) -> tuple[list[int], StepRecord]:
        """Append the tokens a step committed for this request, cut at a stop token or at its
        output `limit` (`workers.stopping.cut`); returns them and the step's record."""
        out = self.output_ids
        tokens, cause = cut(res.tokens, produced=len(out), limit=limit,
                            stop_token_ids=self.stop_token_ids)
        out.extend(tokens)
        drafted, accepted = res.drafted, res.accepted
        # The path tried: accepted drafts, plus the one rejected where the walk stopped.
        tried = accepted + (1 if drafted > accepted else 0) if drafted else 0
        verified = drafted + 1 if res.tokens else 0              # res.tree_tokens
        return tokens, StepRecord(self.stats.request_id, verified, len(tokens), cause, tried,
                                  drafted, accepted, res.draft_s, res.draft_depth)

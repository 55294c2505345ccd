"""α and drafting time, as the planner knows them: the one estimator tree sizing reads.

- **α, one estimator** (`AlphaEstimate`, `observe`): a request's per-token acceptance, learned
  from its own steps. Every accepted token is a success; a step whose walk stopped before the
  end of its path is one failure (the geometric likelihood); counts decay (0.85 a step, ~7 steps
  of memory) so the estimate follows the text (prompt lookup is bursty: long copied runs, then
  free text), and start from a prior worth 4 steps' evidence. While a request drafts nothing
  there is no evidence, so its counts relax towards the prior and it probes again after a while;
  a probe that accepts nothing makes the next one wait twice as long. A step that proposed
  nothing is no evidence.
- **the prior, learned** (`DrafterPrior`, `pool`): what the same tenant's earlier requests showed
  of the same drafter, pooled over their steps (decayed per request-step, ~100 of memory): its α,
  and its drafting time. A new request starts from it (`DrafterPrior.start`) instead of from
  nothing: the prior α, and a drafting time the planner knows before the first probe. Until a
  tenant's requests have drafted, the prior is 3 : 1 (the n-gram drafter proposes only where its
  context matched, itself evidence of copying) and drafting is free. Why: with a fixed prior
  every new request probed a draft model whose acceptance on this traffic the planner had
  already measured, and under load (8 streams) those probes were what speculation cost over
  plain decoding (README, "SPIRe drafts").
- **drafting time** (`observe_draft_time`): seconds a request's drafter spends per tree level,
  a decayed average (~0 for n-gram and suffix drafters; a draft-model pass per level for a model
  drafter), so deep trees from a slow drafter are paid for (SPIRe's TM = τ ÷ ((k·t_draft +
  t_verify) ÷ t_target)).

The sizing rule that turns them into tree budgets is scheduler/sizing.py. Pure: no I/O, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from workers.frozen import fills_dict

__all__ = ["AlphaEstimate", "DrafterPrior", "PRIOR_FLOOR", "learn", "observe",
           "observe_draft_time", "pool"]

# The α estimator's constants (module docstring). On the copy and extract workloads a prior of
# 3 : 1 decoded faster than 2 : 1 (README, "Tree budgets").
PRIOR_ACCEPTED = 3.0
PRIOR_REJECTED = 1.0
PRIOR_WEIGHT = PRIOR_ACCEPTED + PRIOR_REJECTED   # a request's prior counts as this many steps
DECAY = 0.85          # weight kept by old evidence per step
IDLE_RELAX = 0.95     # per step without drafts, evidence relaxes towards the prior by this factor
POOL_DECAY = 0.99     # weight a tenant's pooled evidence keeps per request-step that drafted
# A learned prior never starts a request below an even chance: its own text may differ from its
# tenant's past (a copy-heavy request after chat), and a request that never drafts never learns
# otherwise. What keeps it from probing under load is the drafting time it starts knowing.
PRIOR_FLOOR = 0.5


@fills_dict       # a new one per request per step
@dataclass(frozen=True)
class AlphaEstimate:
    """Decayed evidence about one request's per-token acceptance (prior counts excluded)."""
    accepted: float = 0.0
    rejected: float = 0.0
    misses: int = 0           # drafting steps in a row that accepted nothing
    draft_s: float = 0.0      # measured drafting seconds per tree level (0: none measured yet)
    prior: float = PRIOR_ACCEPTED / PRIOR_WEIGHT   # the α it started from (`DrafterPrior`)

    @property
    def alpha(self) -> float:
        """α̂, the prior (worth PRIOR_WEIGHT steps) included.

        >>> AlphaEstimate().alpha, AlphaEstimate(accepted=3, rejected=1).alpha
        (0.75, 0.75)
        >>> AlphaEstimate(prior=0.25).alpha, AlphaEstimate(accepted=4, rejected=0, prior=0.25).alpha
        (0.25, 0.625)
        """
        return (self.accepted + self.prior * PRIOR_WEIGHT) / (self.accepted + self.rejected + PRIOR_WEIGHT)


@dataclass(frozen=True)
class DrafterPrior:
    """A tenant's evidence about one drafter, pooled over its requests' steps (prior excluded):
    where its new requests start (module docstring)."""
    accepted: float = 0.0
    rejected: float = 0.0
    draft_s: float = 0.0      # drafting seconds per tree level (0: none measured yet)

    @property
    def alpha(self) -> float:
        """The pooled α, the fixed prior included.

        >>> DrafterPrior().alpha, DrafterPrior(accepted=37, rejected=59).alpha
        (0.75, 0.4)
        """
        return (self.accepted + PRIOR_ACCEPTED) / (self.accepted + self.rejected + PRIOR_WEIGHT)

    def start(self) -> AlphaEstimate:
        """A new request's estimate: no evidence of its own yet; the pooled α, at least PRIOR_FLOOR.

        >>> DrafterPrior(accepted=37, rejected=59, draft_s=0.002).start().alpha
        0.5
        >>> DrafterPrior(accepted=77, rejected=19).start().alpha
        0.8
        """
        return AlphaEstimate(draft_s=self.draft_s, prior=max(self.alpha, PRIOR_FLOOR))


def pool(prior: DrafterPrior, drafted: int, accepted: int, draft_s: float,
         draft_depth: int) -> DrafterPrior:
    """The pooled evidence after one request-step: counted as `observe` counts a request's (every
    accepted token a success, a walk that stopped short one failure), and its drafting time
    blended as `observe_draft_time` blends it. A step that drafted nothing is no evidence.

    >>> p = pool(DrafterPrior(), 8, 3, 0.012, 3)
    >>> p.accepted, p.rejected, round(p.draft_s, 4)
    (3.0, 1.0, 0.004)
    >>> pool(p, 0, 0, 0.0, 0) == p
    True
    """
    if drafted <= 0:
        return prior
    failed = _failures(drafted, accepted)
    timed = (observe_draft_time(AlphaEstimate(draft_s=prior.draft_s), draft_s, draft_depth).draft_s
             if draft_s > 0 else prior.draft_s)                  # as `learn`: untimed steps keep it
    return DrafterPrior(prior.accepted * POOL_DECAY + accepted, prior.rejected * POOL_DECAY + failed, timed)


def _failures(drafted: int, accepted: int) -> float:
    """A step's failures: a path that ended because the tree ended (all accepted) is none;
    otherwise the target rejected the next draft, one. For a tree, `accepted == drafted` only
    when it was a chain."""
    return 0.0 if accepted == drafted else 1.0


def observe(est: AlphaEstimate, drafted: int, accepted: int) -> AlphaEstimate:
    """The estimate after a step that verified `drafted` draft nodes and accepted `accepted`.

    Worked example: from no evidence, a step that drafted 8 and accepted 3 adds 3 successes and
    1 failure: α̂ = (3 + 3) ÷ (4 + 4) = 0.75. A step that drafted nothing relaxes the evidence
    towards the prior instead.

    >>> e = observe(AlphaEstimate(), 8, 3)
    >>> e.alpha, e.misses
    (0.75, 0)
    >>> observe(e, 0, 0).accepted < e.accepted
    True
    """
    if drafted < 0 or not 0 <= accepted <= drafted:
        raise ValueError(f"need 0 <= accepted <= drafted, got drafted={drafted}, accepted={accepted}")
    if drafted == 0:  # nothing proposed, or speculation off: relax towards the prior
        # Each drafting step in a row that accepted nothing halves the relaxation speed, so probes
        # of a request whose text stays unpredictable grow exponentially rarer.
        relax = IDLE_RELAX ** (0.5 ** est.misses)
        return AlphaEstimate(est.accepted * relax, est.rejected * relax, est.misses, est.draft_s,
                             est.prior)
    failed = _failures(drafted, accepted)
    # built directly, not with dataclasses.replace: this runs once per request per step, and
    # replace's walk over the fields costs several times the constructor
    return AlphaEstimate(est.accepted * DECAY + accepted, est.rejected * DECAY + failed,
                         0 if accepted else est.misses + 1, est.draft_s, est.prior)


def observe_draft_time(est: AlphaEstimate, seconds: float, levels: int) -> AlphaEstimate:
    """The estimate after drafting `levels` tree levels took `seconds` (this request's share).

    >>> round(observe_draft_time(AlphaEstimate(), 0.012, 3).draft_s, 4)     # 4 ms a level
    0.004
    """
    if levels <= 0:
        return est
    measured = seconds / levels
    # The first measurement replaces the prior of 0; later ones blend in at the evidence decay.
    per_level = measured if est.draft_s == 0.0 else DECAY * est.draft_s + (1 - DECAY) * measured
    return AlphaEstimate(est.accepted, est.rejected, est.misses, per_level, est.prior)


def learn(est: AlphaEstimate, drafted: int, accepted: int, draft_s: float,
          draft_depth: int) -> AlphaEstimate:
    """The estimate after one step, from what the worker reported for the request: its
    acceptance, and its drafting time when drafting was timed.

    >>> learn(AlphaEstimate(), 8, 3, 0.012, 3) == observe_draft_time(observe(AlphaEstimate(), 8, 3), 0.012, 3)
    True
    """
    est = observe(est, drafted, accepted)
    return observe_draft_time(est, draft_s, draft_depth) if draft_s > 0 else est

"""What a step costs, as the planner asks it: the one declaration of a step-cost model.

`StepCost` is a Protocol with defaults: `__call__` (a verification step's seconds) is required;
`prefill`, `chunk` and `keys_per_row` have defaults that are right for a model measured without
them (a prefill costs what a batch-1 step over as many tokens does; a chunk costs its slope of
that; no measured chunk fit). Implementations derive from it, so every caller can use every
method and never probes: `scheduler.profile.StepCostModel` (the measured profile), and
`LinearStepCost` (a straight line, for tests and worked examples).

Pure: no I/O, no torch.
"""
from __future__ import annotations

from typing import Protocol

__all__ = ["MIN_STEP_S", "StepCost", "LinearStepCost"]

MIN_STEP_S = 1e-4   # no step or chunk is free: keeps rates finite where a curve reaches 0


class StepCost(Protocol):
    """Seconds of the work one step holds."""

    def __call__(self, batch: int, tokens: int, context: int | None = None) -> float:
        """Seconds of one step of `batch` requests verifying `tokens` tree tokens in all (roots
        included), each holding `context` tokens of KV (None: the model's reference context)."""
        ...

    def prefill(self, tokens: int) -> float:
        """Seconds to prefill a `tokens`-token context for one request, in a pass of its own.
        Default: a batch-1 step over as many tokens."""
        return self(1, tokens)

    def chunk(self, tokens: int, offset: int) -> float:
        """Seconds a prefill chunk of `tokens` context tokens, after `offset` tokens of its
        context already hold KV, adds to a step. Default: the prefill curve's slope over the
        chunk (a pass's fixed cost is the step's own)."""
        if tokens <= 0:
            return 0.0
        return max(self.prefill(offset + tokens) - self.prefill(offset), MIN_STEP_S)

    @property
    def keys_per_row(self) -> float | None:
        """Earlier keys whose attention costs what one chunk row's linears do (the planner weighs
        chunks deep into a prompt by it); None: not measured."""
        return None


class LinearStepCost(StepCost):
    """A step that costs `fixed_s`, plus `per_request_s` a request and `per_token_s` a tree
    token; prefill and chunks by the defaults.

    >>> cost = LinearStepCost(fixed_s=0.04, per_token_s=0.001)
    >>> round(cost(8, 40), 3), round(cost.prefill(100), 3), round(cost.chunk(10, 100), 3)
    (0.08, 0.14, 0.01)
    """

    def __init__(self, fixed_s: float = 0.0, per_request_s: float = 0.0,
                 per_token_s: float = 0.0) -> None:
        self.fixed_s, self.per_request_s, self.per_token_s = fixed_s, per_request_s, per_token_s

    def __call__(self, batch: int, tokens: int, context: int | None = None) -> float:
        return self.fixed_s + self.per_request_s * batch + self.per_token_s * tokens

    def __repr__(self) -> str:
        return (f"LinearStepCost(fixed_s={self.fixed_s}, per_request_s={self.per_request_s}, "
                f"per_token_s={self.per_token_s})")

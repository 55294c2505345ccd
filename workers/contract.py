"""The scheduler↔worker contract: plain data that crosses between the step loop and the workers.

No torch, no numpy: the scheduler, its policies and the gateway import these without loading any
device code (a test checks `sys.modules`), and in Ray mode they travel between processes as they
are. One step, as the types carry it:

    the planner hands each chosen request a `TreeBudget` (at most `max_nodes` draft nodes, no
    deeper than `max_depth`; the planner alone sizes trees, scheduler/sizing.py) as a `WorkItem`;
    the worker drafts within it (a drafter sees a `DraftContext`), verifies every tree in one
    pass and answers one `StepResult` per item: what it committed, how many draft nodes it
    verified and accepted, and how long drafting took, which is what the planner learns from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from workers.frozen import fills_dict

__all__ = ["SamplingParams", "TokenLogprob", "MAX_TOP_LOGPROBS", "TreeBudget", "NO_SPECULATION",
           "TapSpec", "TargetTaps", "DraftContext", "WorkItem", "StepResult", "ContextLengthError"]

MAX_TOP_LOGPROBS = 20        # OpenAI's bound on top_logprobs

# One committed token's log-probability and the top-k alternatives at its position, as
# (logprob, ((token id, logprob), ...)): plain tuples, so it crosses processes and stores as is.
TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True)
class SamplingParams:
    """How the target samples. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` are off.

    ``seed`` seeds the request's own RNG, so one request's output does not depend on its batch.

    What changes the target's logits before sampling (OpenAI's parameters), applied at every tree
    node from that node's own path (workers/speculation/processors.py), so speculation stays lossless:
    ``presence_penalty`` / ``frequency_penalty`` (subtracted once / per occurrence of a token in
    the output so far), ``logit_bias`` ((token id, bias) pairs, added), and ``constraint``, a JSON
    string the output must follow: ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "schema": {...}}`` (a response_format, or a forced tool call: gateway/tools.py), enforced by a
    grammar (workers/speculation/grammar.py).

    ``logprobs``: None = off; k = report, for every committed token, its log-probability and the
    k most likely tokens at its position (`StepResult.logprobs`), read from the verification
    pass's own logits (no extra pass).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: Optional[str] = None
    logprobs: Optional[int] = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:   # also rejects NaN
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        # stored records come back as lists (JSON): normalise to the hashable form
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        if any(t < 0 or not -100 <= b <= 100 for t, b in bias):
            raise ValueError("logit_bias takes token ids >= 0 with biases in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything changes the target's logits before sampling (workers/speculation/processors.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias or self.constraint)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TreeBudget:
    """How big a tree the planner allows this step: at most ``max_nodes`` nodes, depth ≤ ``max_depth``.

    ``max_nodes == 0`` means no speculation (the step is plain decoding: the bonus token only).
    """

    max_nodes: int
    max_depth: int

    def __post_init__(self) -> None:
        if self.max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {self.max_nodes}")
        if self.max_depth < 0:
            raise ValueError(f"max_depth must be >= 0, got {self.max_depth}")

    @property
    def speculates(self) -> bool:
        return self.max_nodes > 0 and self.max_depth > 0


NO_SPECULATION = TreeBudget(0, 0)


@dataclass(frozen=True)
class TapSpec:
    """Which of the target's activations a draft with feedback memory reads (SPIRe), and which
    positions it can still use, so the verifier returns no more than that.

    Tap 0 is the token embedding, tap j the output of the target's block ``layers[j - 1]``.
    A draft with sink ``sink`` and window ``window`` only ever reads memories at positions below
    ``sink`` or within ``window`` of the newest one (workers/drafters/neural/draft_model.py), so the verifier
    keeps only those rows: what crosses to the drafter stays bounded in the context's length.
    """
    layers: tuple[int, ...]
    sink: int = 0
    window: Optional[int] = None

    @property
    def taps(self) -> int:
        return 1 + len(self.layers)

    def keeps(self, position: int, newest: int) -> bool:
        """Whether a draft whose newest position is `newest` can still read `position`.

        >>> [p for p in range(10) if TapSpec((1,), sink=2, window=3).keeps(p, 9)]
        [0, 1, 7, 8, 9]
        """
        return self.window is None or position < self.sink or newest - position < self.window


@dataclass(frozen=True)
class TargetTaps:
    """The target's activations at some committed positions, as plain bytes (no torch here).

    ``data`` holds float32 values laid out [len(positions), taps, hidden], row-major, in the
    order of ``positions`` (workers/speculation/target_taps.py packs and reads it). Positions are absolute
    (0 = the prompt's first token) and need not be contiguous (the sink, then the window).
    """
    positions: tuple[int, ...]
    taps: int
    hidden: int
    data: bytes

    def __post_init__(self) -> None:
        if len(self.data) != 4 * len(self.positions) * self.taps * self.hidden:
            raise ValueError(f"{len(self.data)} bytes do not hold {len(self.positions)} rows of "
                             f"{self.taps} x {self.hidden} float32 values")


@dataclass
class DraftContext:
    """What a drafter sees of one request. ``tokens`` = prompt + committed output; the last is the root.

    For one ``request_id``, ``tokens`` only grows between calls, so drafters may keep incremental
    per-request state (and must drop it in ``release``). ``constraint``: the request's
    ``SamplingParams.constraint`` (what the grammar drafter drafts from), None without one.
    """

    request_id: str
    tenant: str
    tokens: Sequence[int]
    prompt_len: int
    constraint: Optional[str] = None
    # The target's activations at committed positions this drafter may not have seen yet
    # (`Drafter.target_taps`; the verifier computed them in its own passes, none extra).
    # Idempotent: a position sent twice carries the same values. None: none new.
    taps: Optional[TargetTaps] = None


@fills_dict       # one per request per step
@dataclass(frozen=True)
class WorkItem:
    """One request of a step, as the planner hands it to the worker.

    With chunked prefill a request is admitted with its context's KV still to compute
    (`Prefilled.pending`); each step computes up to `prefill` more of it, in the same forward
    pass as every other request's tree. Only a step that completes the context verifies the
    request's root and tree (and commits tokens), and only if `decode`: a request prefilled
    ahead of its turn (`decode=False`) just gets its KV ready.
    """
    request_id: str
    budget: TreeBudget        # the tree to draft for it this step (NO_SPECULATION: none)
    prefill: int = 0          # pending context tokens to compute this step
    decode: bool = True       # verify the root and tree once the context is complete


@fills_dict       # one per request per step
@dataclass(frozen=True)
class StepResult:
    """What one step did for one request, as the worker reports it."""
    request_id: str
    tokens: tuple[int, ...]   # committed by this step: accepted draft tokens, then the bonus
    accepted: int             # draft tokens accepted
    drafted: int              # tree nodes verified (after fitting the tree to the request's room)
    draft_s: float = 0.0      # this request's share of the step's drafting time
    draft_depth: int = 0      # depth of the tree its drafter proposed (levels drafted)
    # The target's final-normed hidden state where it read the last committed token before the
    # bonus (the first step: the prompt's last token), when the verifier is asked for features:
    # what a length predictor reads, at no extra pass. None otherwise.
    features: Optional[tuple[float, ...]] = None
    prefilled: int = 0        # pending context tokens whose KV this step computed
    pending: int = 0          # context tokens still without KV after this step
    kv_tokens: int = 0        # KV slots the request holds after this step (what it costs)
    home: Optional[str] = None   # where they are: the verifier replica in Ray mode, else None
    # One entry per committed token (same order as `tokens`) when the request asked for logprobs
    # (`SamplingParams.logprobs`), else None.
    logprobs: Optional[tuple[TokenLogprob, ...]] = None
    # The target's activations at this step's committed rows (the chunk, the root and the
    # accepted nodes; not the bonus, which no pass has read yet), when the verifier is asked for
    # taps (`TapSpec`): what a feedback-memory draft reads. The worker hands them to the
    # request's drafter (`DraftContext.taps`) and drops them from what goes to the scheduler.
    taps: Optional[TargetTaps] = None

    @property
    def tau(self) -> int:
        return len(self.tokens)

    @property
    def decoded(self) -> bool:
        """Whether the step verified this request's root (else it only prefilled)."""
        return bool(self.tokens)

    @property
    def tree_tokens(self) -> int:
        """Verifier work for this request in this step: the root row plus every tree node
        (none when the step only prefilled)."""
        return self.drafted + 1 if self.tokens else 0


@dataclass(frozen=True)
class Prefilled:
    """What admitting a request did, as the worker reports it."""
    cached: int = 0           # tokens whose KV came from the prefix cache
    # The target's final-normed hidden state at the context's last token (the prompt's last, or
    # the last committed one when re-admitted), when the verifier is asked for features: what a
    # length predictor reads before the request's first step. None otherwise.
    features: Optional[tuple[float, ...]] = None
    pending: int = 0          # context tokens left for steps to prefill (`WorkItem.prefill`)
    kv_tokens: int = 0        # KV slots the request holds now (the planner's KV budget counts them)
    home: Optional[str] = None   # where they are: the verifier replica in Ray mode, else None
    taps: Optional[TargetTaps] = None   # the context's target activations (`StepResult.taps`)


class ContextLengthError(ValueError):
    """A prompt (with what it has committed) that leaves no room in the model's context."""

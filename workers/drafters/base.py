"""The drafter protocol: anything that turns a request's context into a token tree.

A drafter is chosen by name from the registry (``workers.drafters.registry``) and configured per
deployment and per tenant; the engine only ever calls ``propose`` and ``release``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

from workers.tree import TokenTree

__all__ = ["TreeBudget", "NO_SPECULATION", "DraftContext", "Drafter", "NoneDrafter"]


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


@dataclass
class DraftContext:
    """What a drafter sees of one request. ``tokens`` = prompt + committed output; the last is the root.

    For one ``request_id``, ``tokens`` only grows between calls, so drafters may keep incremental
    per-request state (and must drop it in ``release``).
    """

    request_id: str
    tenant: str
    tokens: Sequence[int]
    prompt_len: int


@runtime_checkable
class Drafter(Protocol):
    """Proposes a token tree under a budget. ``propose`` must respect the budget."""

    name: str

    def propose(self, ctx: DraftContext, budget: TreeBudget) -> TokenTree: ...

    def release(self, request_id: str) -> None:
        """Forget per-request state: the request finished (or was cancelled). A drafter that learns
        from finished outputs may learn from it now. A drafter may also offer ``evict(request_id)``:
        forget the state of a request that is *not* finished (its KV was evicted; it will be
        prefilled again), learning nothing from it yet; without one, ``release`` is called."""
        ...


class NoneDrafter:
    """Never speculates: every step is plain decoding. The baseline, and a tenant-level off switch."""

    name = "none"

    def propose(self, ctx: DraftContext, budget: TreeBudget) -> TokenTree:
        return TokenTree.empty()

    def release(self, request_id: str) -> None:
        pass

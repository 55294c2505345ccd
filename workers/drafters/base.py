"""The drafter protocol: anything that turns a request's context into a token tree.

A drafter is chosen by name from the registry (``workers.drafters.registry``) and configured per
deployment and per tenant. Every drafter derives from ``Drafter``, which declares the whole
protocol: ``propose`` (required) and the optional capabilities, each with a default that is
right for a drafter without it, so callers never probe for methods:

- ``propose_batch``: trees for several requests in one call (a draft model shares its forward
  passes; a remote drafter makes one round trip); default, one ``propose`` each.
- ``prefetch_batch``: start drafting the next step's trees now (a remote drafter, while the
  step's results travel); default, nothing.
- ``release``: the request finished or was cancelled; forget it (a drafter that learns from
  finished outputs may learn from it now); default, nothing kept, nothing to do.
- ``evict``: the request's KV was evicted and it will be prefilled again; forget it without
  learning from it yet; default, ``release``.
- ``drop_tenant``: the tenant was removed; free what is kept for it across requests (a suffix
  cache of its outputs) and keep nothing more for it; default, nothing is kept per tenant.
  ``DraftContext.tenant`` is the tenant's immutable id, never reused, so a tenant created again
  under the same name never meets the old one's state.

``target_taps`` declares that the drafter reads the target's activations at committed positions
(a feedback-memory draft: workers/drafters/memory.py): the verifier returns them with each step
(`StepResult.taps`) and the worker hands them over in ``DraftContext.taps``; None (the default):
it reads tokens only, and no pass computes or sends more.

``batched`` says whether ``propose_batch`` drafts its requests together (one call's cost for the
whole step: a draft model, a remote drafter) rather than one ``propose`` each (the default).

``catch_up_s`` is the seconds the last ``propose``/``propose_batch`` call spent on one-off work:
feeding a draft model committed tokens beyond what a step of steady drafting feeds (a prompt, or
the text committed while the request did not draft). The worker leaves it out of the drafting
time it reports per tree level (`StepResult.draft_s`): the planner sizes the next trees by that
time, and a prompt's catch-up charged to the first tree's few levels made a cheap draft look
several times dearer than it is (README, "SPIRe drafts"). 0 for drafters without such work.
"""

from __future__ import annotations

from typing import Sequence

from workers.contract import DraftContext, TapSpec, TreeBudget
from workers.speculation.tree import TokenTree

__all__ = ["Drafter", "NoneDrafter"]

DraftItem = tuple[DraftContext, TreeBudget]


class Drafter:
    """Proposes a token tree under a budget. ``propose`` must respect the budget."""

    name: str = "drafter"
    batched: bool = False          # propose_batch shares one call's work among its requests
    target_taps: TapSpec | None = None   # the target activations it reads (module docstring)
    catch_up_s: float = 0.0        # one-off seconds of the last call (module docstring)

    def propose(self, ctx: DraftContext, budget: TreeBudget) -> TokenTree:
        raise NotImplementedError

    def propose_batch(self, items: Sequence[DraftItem]) -> list[TokenTree]:
        return [self.propose(ctx, budget) for ctx, budget in items]

    def prefetch_batch(self, items: Sequence[DraftItem]) -> None:
        return None

    def observe(self, ctx: DraftContext) -> None:
        """The request's context grew without a proposal (a prompt prefilled in chunks): a
        drafter with an index per request may extend it now, so that its first proposal does
        not index the whole prompt inside one step. `ctx.tokens` still only grows."""
        return None

    def release(self, request_id: str) -> None:
        return None

    def evict(self, request_id: str) -> None:
        self.release(request_id)

    def drop_tenant(self, tenant: str) -> None:
        return None


class NoneDrafter(Drafter):
    """Never speculates: every step is plain decoding. The baseline, and a tenant-level off switch."""

    name = "none"

    def propose(self, ctx: DraftContext, budget: TreeBudget) -> TokenTree:
        return TokenTree.empty()

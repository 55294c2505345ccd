"""Ray mode's draft workers, seen from a verifier replica: a drafter whose trees come from the
draft deployment, one call per step for all of the replica's requests that use it.

`RemoteDrafter` implements the drafter protocol plus `propose_batch`, which `BatchWorker` uses to
draft a whole step in one call (`workers.batch_worker.BatchWorker._draft`). Its calls carry an
`affinity` key (the verifier replica's id): the router sends a key's calls to one draft replica
(rendezvous hashing, `gateway.ray_routing.rank_replicas`), so each request's incremental drafter
state and each tenant's suffix cache stay on one draft replica while the set of replicas holds.

A draft replica that is lost, slow or failing costs speculation, never correctness: the step goes
on with empty trees (plain decoding for those requests) and the next step asks again.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

from workers.drafters.base import DraftContext, TreeBudget
from workers.tree import TokenTree

log = logging.getLogger(__name__)

FLUSH_RELEASES = 256          # pending releases sent on their own once this many pile up


class RemoteDrafter:
    def __init__(self, handle: Any, name: str, *, affinity: str, timeout_s: float = 5.0) -> None:
        self.handle = handle
        self.name = name
        self.affinity = affinity
        self.timeout_s = timeout_s
        self.failures = 0
        self._releases: list[str] = []

    def propose(self, ctx: DraftContext, budget: TreeBudget) -> TokenTree:
        return self.propose_batch([(ctx, budget)])[0]

    def propose_batch(self, items: Sequence[tuple[DraftContext, TreeBudget]]) -> list[TokenTree]:
        wire = [(DraftContext(c.request_id, c.tenant, list(c.tokens), c.prompt_len), b) for c, b in items]
        release, self._releases = self._releases, []
        try:
            trees = self.handle.propose.remote(wire, drafter=self.name, affinity=self.affinity,
                                               release=release).result(timeout_s=self.timeout_s)
        except Exception as e:                     # lost, timed out or failed: no speculation now
            self.failures += 1
            log.warning("draft workers unavailable (%s): this step verifies without drafts", type(e).__name__)
            return [TokenTree.empty() for _ in items]
        if len(trees) != len(items):
            return [TokenTree.empty() for _ in items]
        return list(trees)

    def release(self, request_id: str) -> None:
        self._releases.append(request_id)
        if len(self._releases) >= FLUSH_RELEASES:
            release, self._releases = self._releases, []
            try:
                self.handle.forget.remote(release, drafter=self.name, affinity=self.affinity)
            except Exception:                       # a lost replica's state is gone anyway
                pass


class DraftService:
    """The draft replica's side: the registry's drafters, one instance per name, shared by every
    request routed here (each keeps per-request state keyed by request id)."""

    def __init__(self) -> None:
        from workers.drafters.registry import create_drafter

        self._create = create_drafter
        self.drafters: dict[str, Any] = {}
        self.proposed = 0                              # trees proposed (a metric; tests)

    def propose(self, items: Sequence[tuple[DraftContext, TreeBudget]], drafter: str,
                release: Sequence[str] = ()) -> list[TokenTree]:
        d = self._drafter(drafter)
        self.forget(release, drafter)
        self.proposed += len(items)
        return [d.propose(ctx, budget) for ctx, budget in items]

    def forget(self, request_ids: Sequence[str], drafter: str) -> None:
        d = self._drafter(drafter)
        for rid in request_ids:
            d.release(rid)

    def _drafter(self, name: str) -> Any:
        if name not in self.drafters:
            self.drafters[name] = self._create(name)
        return self.drafters[name]

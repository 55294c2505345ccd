"""Ray mode's draft workers, seen from a verifier replica: a drafter whose trees come from the
draft deployment, one call per step for all of the replica's requests that use it.

`RemoteDrafter` is a `workers.drafters.base.Drafter` whose `propose_batch` drafts a whole step in
one call (`workers.batch_worker.BatchWorker._draft`). Its calls carry an
`affinity` key (the verifier replica's id): the router sends a key's calls to one draft replica
(rendezvous hashing, `gateway.ray_serve.routing.rank_replicas`), so each request's incremental drafter
state and each tenant's suffix cache stay on one draft replica while the set of replicas holds.

A draft replica that is lost, slow or failing costs speculation, never correctness: the step goes
on with empty trees (plain decoding for those requests) and the next step asks again.

Pipelining (keeping the RPC off the critical path): right after step t commits, `BatchWorker`
calls `prefetch_batch` with every request's new context, and the call for step t + 1's trees goes
out while the results travel back to the scheduler and it plans the next step. Step t + 1 then
takes the prefetched tree of each request whose context is unchanged and whose budget fits within
the prefetched one (the worker cuts it to the budget), and asks only for the rest. Every call is
made, and waited on, by one client thread per drafter: a Serve response is waited on in the thread
that made it.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

from gateway.ray_serve.releases import DroppedTenant, Evicted, Release, apply_releases, release_id
from workers.contract import DraftContext, TreeBudget
from workers.drafters.base import Drafter
from workers.drafters.registry import create_drafter, taps_of
from workers.speculation.tree import TokenTree

log = logging.getLogger(__name__)

FLUSH_RELEASES = 256          # pending releases sent on their own once this many pile up


class RemoteDrafter(Drafter):
    batched = True                 # propose_batch: one round trip for all requests

    def __init__(self, handle: Any, name: str, *, affinity: str, timeout_s: float = 5.0) -> None:
        self.handle = handle
        self.name = name
        # a feedback-memory draft on the draft replicas reads the target's activations: this
        # replica's verifier returns them, and each call carries them (DraftContext.taps)
        self.target_taps = taps_of(name)
        self.affinity = affinity
        self.timeout_s = timeout_s
        self.failures = 0
        self.calls = 0                 # calls made to the draft workers
        self.prefetch_hits = 0         # trees a step took from a prefetch
        self._releases: list[Release] = []
        self._client = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"draft-{name}")
        # request id -> (its context length, the budget, the call's future, its index in the call)
        self._prefetched: dict[str, tuple[int, TreeBudget, Future, int]] = {}

    def propose(self, ctx: DraftContext, budget: TreeBudget) -> TokenTree:
        return self.propose_batch([(ctx, budget)])[0]

    def propose_batch(self, items: Sequence[tuple[DraftContext, TreeBudget]]) -> list[TokenTree]:
        found: list[tuple[Future, int] | None] = []
        ask = []
        for ctx, budget in items:
            hit = self._prefetched.pop(ctx.request_id, None)
            if (hit is not None and hit[0] == len(ctx.tokens) and budget.max_nodes <= hit[1].max_nodes
                    and budget.max_depth <= hit[1].max_depth):
                found.append((hit[2], hit[3]))
                self.prefetch_hits += 1
            else:
                found.append(None)
                ask.append((ctx, budget))
        if ask:
            call = self._submit(ask)
            k = iter(range(len(ask)))
            found = [f if f is not None else (call, next(k)) for f in found]
        return [self._tree(fut, i) for fut, i in found]

    def prefetch_batch(self, items: Sequence[tuple[DraftContext, TreeBudget]]) -> None:
        """Ask now, without waiting, for the trees these requests' next step will want."""
        items = [(ctx, b) for ctx, b in items if b.speculates]
        if not items:
            return
        call = self._submit(items)
        for i, (ctx, budget) in enumerate(items):
            self._prefetched[ctx.request_id] = (len(ctx.tokens), budget, call, i)

    def _submit(self, items: Sequence[tuple[DraftContext, TreeBudget]]) -> Future:
        # A copy of each context: the worker extends its lists in place after this returns.
        wire = [(DraftContext(c.request_id, c.tenant, list(c.tokens), c.prompt_len, taps=c.taps), b)
                for c, b in items]
        release, self._releases = self._releases, []
        self.calls += 1
        return self._client.submit(self._call, wire, release)

    def _call(self, wire: list, release: list[Release]) -> list[TokenTree] | None:
        """On the client thread: one call to the draft workers; None when they fail."""
        try:
            trees = self.handle.propose.remote(wire, drafter=self.name, affinity=self.affinity,
                                               release=release).result(timeout_s=self.timeout_s)
        except Exception as e:                     # lost, timed out or failed: no speculation now
            self.failures += 1
            log.warning("draft workers unavailable (%s): this step verifies without drafts", type(e).__name__)
            return None
        return list(trees) if len(trees) == len(wire) else None

    def _tree(self, call: Future, i: int) -> TokenTree:
        try:
            trees = call.result(timeout=self.timeout_s + 1.0)
        except Exception:                           # the client thread itself failed: no drafts
            trees = None
        return trees[i] if trees is not None else TokenTree.empty()

    def release(self, request_id: str) -> None:
        self._forget(request_id)

    def evict(self, request_id: str) -> None:
        """Not finished (it will be prefilled again): the draft workers drop its state without
        learning from its output (`SuffixDrafter.evict`)."""
        self._forget(Evicted(request_id))

    def drop_tenant(self, tenant: str) -> None:
        """A removed tenant: the draft replica this one's calls go to frees its caches (a suffix
        cache of its outputs) now, not with the next draft call, which may never come."""
        self._releases.append(DroppedTenant(tenant))
        self._flush()

    def _forget(self, entry: Release) -> None:
        self._prefetched.pop(release_id(entry), None)
        self._releases.append(entry)
        if len(self._releases) >= FLUSH_RELEASES:
            self._flush()

    def _flush(self) -> None:
        release, self._releases = self._releases, []
        try:
            self.handle.forget.remote(release, drafter=self.name, affinity=self.affinity)
        except Exception:                           # a lost replica's state is gone anyway
            pass


class DraftService:
    """The draft replica's side: the registry's drafters, one instance per name, shared by every
    request routed here (each keeps per-request state keyed by request id)."""

    def __init__(self) -> None:
        self._create = create_drafter
        self.drafters: dict[str, Drafter] = {}
        self.proposed = 0                              # trees proposed (a metric; tests)

    def propose(self, items: Sequence[tuple[DraftContext, TreeBudget]], drafter: str,
                release: Sequence[Release] = ()) -> list[TokenTree]:
        d = self._drafter(drafter)
        self.forget(release, drafter)
        self.proposed += len(items)
        return [d.propose(ctx, budget) for ctx, budget in items]

    def forget(self, entries: Sequence[Release], drafter: str) -> None:
        apply_releases(self._drafter(drafter), entries)

    def _drafter(self, name: str) -> Drafter:
        if name not in self.drafters:
            self.drafters[name] = self._create(name)
        return self.drafters[name]

"""The step loop's worker in Ray mode: verifier replicas behind one deployment handle, with KV
affinity.

The scheduler's `StepLoop` drives this exactly as it drives an in-process `BatchWorker` (same
`prefill`/`step`/`release` calls, same results). Underneath:

- `prefill` goes to the replica with the largest share of its KV pool free, or without their reports to the one
  holding the fewest of this scheduler's requests (the call carries both;
  `gateway.ray_serve.routing.KVAffinityRouter` picks); the replica answers with its id, which
  becomes the request's **home** (`Prefilled.home`, and `StepResult.home` after a move).
- `step` splits the batch by home and sends each replica *one* call with all its requests' work
  items, all replicas at once; a step costs one round trip, however many requests it verifies.
- `release` and `evict` cost no call of their own: they ride along with the home's next step call,
  or, for a home with no work in a step, go out in one call that nobody waits for
  (`gateway.ray_serve.releases`: an evicted request is marked, so drafters do not learn from it yet).
- `drop_tenant` (a removed tenant) goes to every replica that has answered, at once, in such a
  call: each frees the tenant's prefix-cache blocks and has its remote drafters tell their draft
  replica to free the tenant's suffix cache (`RemoteDrafter.drop_tenant`).

Every call after the prefill names the home (`replica=`), and the router sends it there. A
constrained request's prefill carries its compiled grammar, serialized (`grammars`: the
scheduler's, which holds it while the request lives), so no replica compiles it.

Each prefill and step answer also carries the replica's prefix-cache usage (bytes held, capacity)
and its KV pool in slots (budget, held); the pool keeps the latest per live replica.
`prefix_cache_usage` sums the former for the scheduler's /metrics, as an in-process `BatchWorker`
reports its own; `kv_budgets` gives the latter to the step loop, whose planner keeps each
replica's requests within that replica's budget, and to the router (free slots). A replica Serve
retires (scale-down, a rolling update) just stops answering, so a report older than
`CACHE_REPORT_TTL_S` is left out (of the KV budgets only while some report is recent: a pool idle
that long still knows its replicas' budgets).

A replica that dies takes its requests' KV with it, never their tokens: the pool keeps each
request's committed context (prompt + every token a step returned), so a request whose home is
gone (the call fails, or a replacement answers that it does not hold the request) is prefilled
again on another replica from exactly what was committed, and its step is redone there. Clients
see no missing or repeated token: only results a replica returned were ever committed.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from typing import Any, Container, Sequence

from gateway.ray_serve.releases import DroppedTenant, Evicted, Release
from workers.contract import Prefilled, SamplingParams, StepResult, WorkItem

log = logging.getLogger(__name__)

MAX_REPLACEMENTS = 3      # re-prefill rounds within one step before the step fails
CACHE_REPORT_TTL_S = 300.0   # a replica silent this long no longer counts (cache gauges, KV budgets)


@dataclass
class _Placed:
    """What a prefill needs to rebuild a request anywhere: its committed context and settings."""
    token_ids: list[int]
    prompt_len: int
    sampling: SamplingParams
    max_new_tokens: int           # as first asked: the KV room is sized on prompt + this
    tenant: str
    drafter: str | None
    committed: int = 0            # tokens committed since the first prefill


class VerifierPool:
    def __init__(self, handle: Any, *, context_limit: int,
                 lost_errors: tuple[type[BaseException], ...] | None = None, grammars: Any = None) -> None:
        """`handle`: a Ray Serve DeploymentHandle of the verifier deployment (see
        `gateway.ray_serve.deployments.VerifierServer`); `lost_errors`: the exceptions that mean a replica is
        gone (default: Ray's actor-died and actor-unavailable errors); `grammars`: the
        compiled grammars to ship (workers.speculation.grammars.Grammars, `ships=True`)."""
        self.handle = handle
        self.grammars = grammars
        self.context_limit = context_limit
        self.home: dict[str, str] = {}                 # request id -> replica id holding its KV
        self.calls: Counter = Counter()                # replica id -> calls sent (a metric; tests)
        self.assigned: Counter = Counter()             # replica id -> requests ever prefilled there
        self.replaced = 0                              # requests re-prefilled after losing a home
        # replicas' time inside prefills and steps (a step's slowest replica): compute, the rest of
        # a step's wall time is orchestration (RPC, planning, persisting)
        self.busy_s = 0.0
        self.draft_s = 0.0                             # of which drafting (the slowest replica's)
        self.dead: set[str] = set()                    # replicas seen to die: never routed to again
        # replica id -> (when, (bytes held, capacity)): its latest prefix-cache report
        self._cache_usage: dict[str, tuple[float, tuple[int, int]]] = {}
        # replica id -> (when, (budget, held)): its latest KV pool report, in slots
        self._kv: dict[str, tuple[float, tuple[int, int]]] = {}
        self._placed: dict[str, _Placed] = {}
        self._releases: dict[str, list[Release]] = defaultdict(list)
        self._lock = threading.Lock()
        self._lost_errors = lost_errors if lost_errors is not None else _ray_lost_errors()

    # ---- the worker interface -----------------------------------------------------------------
    def prefill(self, request_id: str, token_ids: Sequence[int], *, prompt_len: int, sampling: SamplingParams,
                max_new_tokens: int, tenant: str = "default", drafter: str | None = None,
                defer: bool = False, home: str | None = None) -> Prefilled:
        """Reports the tokens whose KV the chosen replica's prefix cache held, and its features;
        `defer`: the replica's steps prefill the context in chunks (`BatchWorker.prefill`);
        `home`: the replica the planner placed it on (`Plan.homes`), else the router picks."""
        self._placed[request_id] = _Placed(list(token_ids), prompt_len, sampling, max_new_tokens,
                                           tenant, drafter)
        return self._place(request_id, defer, home)

    def step(self, items: Sequence[WorkItem]) -> list[StepResult]:
        by_id: dict[str, StepResult] = {}
        todo = list(items)
        for _ in range(MAX_REPLACEMENTS + 1):
            lost = self._step_once(todo, by_id)
            if not lost:
                break
            for rid in lost:                   # rebuilt elsewhere, then stepped again
                self._place(rid)
                self.replaced += 1
            todo = [item for item in todo if item.request_id in set(lost)]
        else:
            raise RuntimeError(f"verifier replicas kept failing for {len(todo)} request(s)")
        for r in by_id.values():
            placed = self._placed[r.request_id]
            placed.token_ids.extend(r.tokens)
            placed.committed += len(r.tokens)
        return [by_id[item.request_id] for item in items]

    def release(self, request_id: str) -> None:
        self._drop(request_id, request_id)

    def evict(self, request_id: str) -> None:
        """Free the KV of a request that is not finished (the step loop prefills it again later):
        its home drops it without its drafters learning from it (`BatchWorker.evict`)."""
        self._drop(request_id, Evicted(request_id))

    def _drop(self, request_id: str, entry: Release) -> None:
        self._placed.pop(request_id, None)
        home = self.home.pop(request_id, None)
        if home is not None:
            self._queue_release(home, entry)

    def drop_tenant(self, tenant: str) -> None:
        """A removed tenant (its immutable id): every replica that has answered frees its caches
        now (one call each, not waited for; a replica that never answered holds none of them)."""
        with self._lock:
            replicas = set(self._kv) | set(self._cache_usage) | set(self.assigned) | set(self.home.values())
            for replica in replicas - self.dead:
                self._releases[replica].append(DroppedTenant(tenant))
        self._flush_releases(skip=())

    def resident(self) -> list[str]:
        return list(self.home)

    def prefix_cache_usage(self, now: float | None = None) -> tuple[int, int] | None:
        """(bytes held, capacity) of the live replicas' prefix caches, from their latest answers
        within CACHE_REPORT_TTL_S of `now` (monotonic seconds); None when there is none."""
        now = time.monotonic() if now is None else now
        reports = [u for replica, (t, u) in list(self._cache_usage.items())
                   if replica not in self.dead and now - t <= CACHE_REPORT_TTL_S]
        if not reports:
            return None
        return sum(u[0] for u in reports), sum(u[1] for u in reports)

    def kv_budgets(self, now: float | None = None) -> dict[str, tuple[int, int]]:
        """Replica id -> (budget, held) in KV slots, from the live replicas' latest answers
        (within CACHE_REPORT_TTL_S of `now`, monotonic seconds, unless none is that recent);
        empty when no replica has reported a KV pool. What the step loop's planner budgets by
        (`StepLoop(kv_budgets=...)`)."""
        now = time.monotonic() if now is None else now
        live = [(replica, t, kv) for replica, (t, kv) in list(self._kv.items()) if replica not in self.dead]
        recent = [(replica, kv) for replica, t, kv in live if now - t <= CACHE_REPORT_TTL_S]
        return dict(recent or [(replica, kv) for replica, _, kv in live])

    def note(self, replica: str, answer: dict) -> None:
        """Keep what a replica's answer reports of itself: prefix-cache usage, KV pool."""
        now = time.monotonic()
        usage = answer.get("prefix_cache")
        if usage is not None:
            self._cache_usage[replica] = (now, (int(usage[0]), int(usage[1])))
        kv = answer.get("kv")
        if kv is not None:
            self._kv[replica] = (now, (int(kv[0]), int(kv[1])))

    # ---- calls ----------------------------------------------------------------------------------
    def _place(self, request_id: str, defer: bool = False, home: str | None = None) -> Prefilled:
        """Prefill `request_id` from its committed context on `home` where the planner placed
        it, else where the router ranks first (gateway/ray_serve/routing.py).
        A request re-placed after losing its home is prefilled whole (`defer` False): the step
        being redone may be one that verifies its root."""
        p = self._placed[request_id]
        old = self.home.pop(request_id, None)
        if old is not None and old not in self.dead:   # moving, not finished: free the old KV
            self._queue_release(old, Evicted(request_id))
        # Which replica the router picks is known only from the answer, so the call carries every
        # replica's pending releases and the chosen one applies its own (a re-prefill may land
        # where the request's old KV still is).
        with self._lock:
            pending = {home: list(ids) for home, ids in self._releases.items()}
        free = {replica: (budget - held) / max(budget, 1)        # share of its pool free
                for replica, (budget, held) in self.kv_budgets().items()}
        extra = {}
        if p.sampling.constraint and self.grammars is not None:
            extra["grammar"] = self.grammars.serialized(p.sampling.constraint)
        answer = self.handle.prefill.remote(
            request_id, list(p.token_ids), prompt_len=p.prompt_len, sampling=p.sampling,
            max_new_tokens=p.max_new_tokens - p.committed, tenant=p.tenant, drafter=p.drafter,
            replica=None, prefer=home, loads=Counter(self.home.values()), assigned=dict(self.assigned),
            avoid=sorted(self.dead), free=free or None, release=pending, defer=defer, **extra).result()
        replica = answer["replica"]
        self.busy_s += answer["busy_s"]
        self.note(replica, answer)
        with self._lock:
            done = set(pending.get(replica, ()))
            left = [r for r in self._releases.pop(replica, []) if r not in done]
            if left:
                self._releases[replica] = left
        self.home[request_id] = replica
        self.assigned[replica] += 1
        self.calls[replica] += 1
        features = answer.get("features")
        return Prefilled(int(answer.get("cached") or 0), None if features is None else tuple(features),
                         int(answer.get("pending") or 0), int(answer.get("kv_tokens") or 0), replica)

    def _step_once(self, items: Sequence[WorkItem], by_id: dict[str, StepResult]) -> list[str]:
        """One call per home, all at once; fills `by_id`; returns the requests whose home lost them."""
        by_home: dict[str, list[WorkItem]] = defaultdict(list)
        for item in items:
            by_home[self.home[item.request_id]].append(item)
        pending = {home: self.handle.step.remote(batch, replica=home, release=self._take_releases(home))
                   for home, batch in by_home.items()}
        for home in by_home:
            self.calls[home] += 1
        self._flush_releases(skip=by_home)
        lost: list[str] = []
        busy = draft = 0.0
        for home, response in pending.items():
            try:
                answer = response.result()
            except self._lost_errors:
                log.warning("verifier replica %s is gone; re-prefilling its %d request(s)",
                            home, len(by_home[home]))
                self.dead.add(home)
                lost += [item.request_id for item in by_home[home]]
                continue
            if answer["missing"]:              # a replacement, or a router that could not pin
                lost += answer["missing"]
                continue
            self.note(home, answer)
            if answer["busy_s"] >= busy:
                busy, draft = answer["busy_s"], answer.get("draft_s", 0.0)
            for r in answer["results"]:
                by_id[r.request_id] = r if r.home == home else replace(r, home=home)
        self.busy_s += busy
        self.draft_s += draft
        for rid in lost:
            self.home.pop(rid, None)
        return lost

    def _queue_release(self, home: str, entry: Release) -> None:
        with self._lock:
            self._releases[home].append(entry)

    def _flush_releases(self, skip: Container[str]) -> None:
        with self._lock:
            idle = {home: ids for home, ids in self._releases.items() if home not in skip}
            for home in idle:
                del self._releases[home]
        for home, ids in idle.items():
            if home not in self.dead:
                self.handle.release.remote(ids, replica=home)      # not awaited: off the step's path

    def _take_releases(self, home: str) -> list[Release]:
        """Releases to piggyback on a call to `home`."""
        with self._lock:
            return self._releases.pop(home, [])


def _ray_lost_errors() -> tuple[type[BaseException], ...]:
    try:
        from ray.exceptions import ActorUnavailableError, RayActorError
    except ImportError:                                # no Ray: nothing can be lost that way
        return ()
    return (RayActorError, ActorUnavailableError)

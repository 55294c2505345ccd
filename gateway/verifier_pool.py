"""The step loop's worker in Ray mode: verifier replicas behind one deployment handle, with KV
affinity.

The scheduler's `StepLoop` drives this exactly as it drives an in-process `BatchWorker` (same
`prefill`/`step`/`release` calls, same results). Underneath:

- `prefill` goes to the replica holding the fewest of this scheduler's requests (the call carries
  the counts; `gateway.ray_routing.KVAffinityRouter` picks); the replica answers with its id,
  which becomes the request's **home**.
- `step` splits the batch by home and sends each replica *one* call with all its requests' work
  items, all replicas at once; a step costs one round trip, however many requests it verifies.
- `release` costs no call of its own: releases ride along with the home's next step call, or, for
  a home with no work in a step, go out in one call that nobody waits for.

Every call after the prefill names the home (`replica=`), and the router sends it there.
"""
from __future__ import annotations

import threading
from collections import Counter, defaultdict
from typing import Any, Sequence

from workers.batch_worker import WorkItem
from workers.verifier import StepResult


class VerifierPool:
    def __init__(self, handle: Any, *, context_limit: int) -> None:
        """`handle`: a Ray Serve DeploymentHandle of the verifier deployment (methods `prefill`,
        `step`, `release`, each taking `replica=` and `release=`)."""
        self.handle = handle
        self.context_limit = context_limit
        self.home: dict[str, str] = {}                 # request id -> replica id holding its KV
        self.calls: Counter = Counter()                # replica id -> calls sent (a metric; tests)
        self.assigned: Counter = Counter()             # replica id -> requests ever prefilled there
        self._releases: dict[str, list[str]] = defaultdict(list)
        self._lock = threading.Lock()

    def prefill(self, request_id: str, token_ids: Sequence[int], *, prompt_len: int, sampling: Any,
                max_new_tokens: int, tenant: str = "default", drafter: str | None = None) -> None:
        old = self.home.pop(request_id, None)
        if old is not None:                            # re-prefill after eviction: free the old KV
            self._queue_release(old, request_id)
        # Which replica the router picks is known only from the answer, so the call carries every
        # replica's pending releases and the chosen one applies its own (a re-prefill may land
        # where the request's old KV still is).
        with self._lock:
            pending = {home: list(ids) for home, ids in self._releases.items()}
        replica = self.handle.prefill.remote(
            request_id, list(token_ids), prompt_len=prompt_len, sampling=sampling,
            max_new_tokens=max_new_tokens, tenant=tenant, drafter=drafter,
            replica=None, loads=Counter(self.home.values()), assigned=dict(self.assigned),
            release=pending).result()
        with self._lock:
            done = set(pending.get(replica, ()))
            left = [r for r in self._releases.pop(replica, []) if r not in done]
            if left:
                self._releases[replica] = left
        self.home[request_id] = replica
        self.assigned[replica] += 1
        self.calls[replica] += 1

    def step(self, items: Sequence[WorkItem]) -> list[StepResult]:
        by_home: dict[str, list[WorkItem]] = defaultdict(list)
        for item in items:
            by_home[self.home[item.request_id]].append(item)
        # All replicas verify at once: send every call before waiting for any.
        pending = [self.handle.step.remote(batch, replica=home, release=self._take_releases(home))
                   for home, batch in by_home.items()]
        for home in by_home:
            self.calls[home] += 1
        self._flush_releases(skip=by_home)
        by_id = {r.request_id: r for response in pending for r in response.result()}
        return [by_id[item.request_id] for item in items]

    def release(self, request_id: str) -> None:
        home = self.home.pop(request_id, None)
        if home is not None:
            self._queue_release(home, request_id)

    def resident(self) -> list[str]:
        return list(self.home)

    def _queue_release(self, home: str, request_id: str) -> None:
        with self._lock:
            self._releases[home].append(request_id)

    def _flush_releases(self, skip: Any) -> None:
        with self._lock:
            idle = {home: ids for home, ids in self._releases.items() if home not in skip}
            for home in idle:
                del self._releases[home]
        for home, ids in idle.items():
            self.handle.release.remote(ids, replica=home)          # not awaited: off the step's path

    def _take_releases(self, home: str) -> list[str]:
        """Releases to piggyback on a call to `home`."""
        with self._lock:
            return self._releases.pop(home, [])

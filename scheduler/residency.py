"""Which requests hold KV on the worker, as the step loop keeps them.

At most `max_resident` requests are resident at once; to make room for one the plan needs, the
loop evicts (`Worker.evict`: its KV is freed, it is prefilled again when planned) a request the
plan does not need: one never served first (prefilled on arrival: only that prefill is lost),
then the least recently served. A resident request's KV slots, and where they are (its home, in
Ray mode a verifier replica), are what the planner budgets by: `hold` keeps them in the state
(`RequestStats.kv_tokens`, `SchedulerState.kv_tokens`, `SchedulerState.kv_held`).

Loop thread only, like the worker it drives.
"""
from __future__ import annotations

import logging
from typing import Callable, Collection, Mapping, Sequence

from scheduler.request import Request, RequestStats
from scheduler.state import SchedulerState
from scheduler.worker import Worker
from workers.contract import Prefilled

log = logging.getLogger(__name__)

Failed = Callable[[str, Exception], None]             # (request id, what the worker raised)
Predict = Callable[[Request, Sequence[float], int], None]   # (request, features, committed)


class KVResidency:
    """The resident requests, least recently served first (module docstring)."""

    def __init__(self, worker: Worker, state: SchedulerState, requests: Mapping[str, Request],
                 limits: Mapping[str, int], max_resident: int, *, chunked: bool,
                 failed: Failed, predict: Predict) -> None:
        """`requests`, `limits`: the loop's live requests and their output token limits, by id
        (read only); `chunked`: prefills only claim the KV, and the plan's chunks compute it
        inside the steps. A prefill the worker fails is handed to `failed` (the loop ends the
        request); the features a prefill reports, to `predict`."""
        self.worker, self.state, self.requests, self.limits = worker, state, requests, limits
        self.max_resident, self.chunked = max_resident, chunked
        self.failed, self.predict = failed, predict
        self.resident: dict[str, None] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.resident

    def __len__(self) -> int:
        return len(self.resident)

    def ensure(self, request_id: str, keep: Collection[str], home: str | None = None) -> bool:
        """Make `request_id` hold KV (prefilled, or with chunks, its KV claimed), on `home` where
        the planner placed it (Ray mode's verifier replicas), evicting others first when
        `max_resident` are held, never one of `keep`; False if its prefill failed."""
        if request_id in self.resident:
            return True
        self._make_room(keep)
        req = self.requests[request_id]
        try:
            done = self._prefill(req, home, self.limits[request_id] - len(req.output_ids))
        except Exception as exc:
            log.warning("prefill of %s failed: %s", request_id, exc)
            self.failed(request_id, exc)
            return False
        if done.features is not None:
            self.predict(req, done.features, len(req.output_ids))
        return True

    def _make_room(self, keep: Collection[str]) -> None:
        """Evict until one more request may be resident, never one of `keep` (the plan's)."""
        while len(self.resident) >= self.max_resident:
            # never served first (prefilled on arrival: only that prefill is lost), then the
            # least recently served
            unserved = (r for r in self.resident if r not in keep and self._never_served(r))
            victim = next(unserved, None) or next((r for r in self.resident if r not in keep), None)
            if victim is None:
                break
            self.evict(victim)

    def _prefill(self, req: Request, home: str | None, max_new_tokens: int) -> Prefilled:
        """Prefill `req` on `home`. Raises what the worker raises; then nothing is held."""
        s = req.stats
        extra: dict = {"defer": True} if self.chunked else {}
        if home is not None:
            extra["home"] = home
        done = self.worker.prefill(s.request_id, [*req.prompt_ids, *req.output_ids],
                                   prompt_len=len(req.prompt_ids), sampling=req.sampling,
                                   max_new_tokens=max_new_tokens, tenant=s.cache_tenant,
                                   drafter=req.drafter, **extra)
        self.resident[s.request_id] = None
        s.prefill_left = done.pending
        self.hold(s, done.kv_tokens, done.home)
        return done

    def served(self, request_id: str) -> None:
        """The request was served a step: most recently served last."""
        self.resident[request_id] = self.resident.pop(request_id)

    def evict(self, request_id: str) -> None:
        """Free the KV of a request that is not finished: re-prefilled when planned again."""
        if request_id not in self.resident:
            return
        self.worker.evict(request_id)
        del self.resident[request_id]
        s = self.requests[request_id].stats
        s.prefill_left = None
        self.hold(s, 0)

    def release(self, s: RequestStats) -> None:
        """The request ended (the worker has freed its KV): it holds nothing any more."""
        self.resident.pop(s.request_id, None)
        self.hold(s, 0)

    def hold(self, s: RequestStats, kv_tokens: int, home: str | None = None) -> None:
        """Record the KV slots a request holds and where (and the totals the planner budgets
        by: in all, and per home)."""
        state = self.state
        state.kv_tokens += kv_tokens - s.kv_tokens
        held = state.kv_held
        if s.kv_home is not None:
            held[s.kv_home] -= s.kv_tokens
            if not held[s.kv_home]:
                del held[s.kv_home]
        s.kv_tokens, s.kv_home = kv_tokens, home if kv_tokens else None
        if s.kv_home is not None:
            held[s.kv_home] = held.get(s.kv_home, 0) + kv_tokens

    def _never_served(self, request_id: str) -> bool:
        s = self.state.requests.get(request_id)
        return s is not None and s.n_steps == 0

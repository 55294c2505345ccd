"""MemoryStore: the embedded default. State lives in this process and dies with it.

It keeps records in the codec's dict form, not the caller's objects, so it behaves like the Redis
store: `load` and `get` return fresh copies, and a caller mutating its own `RequestStats` changes
nothing here until the next `commit_step` says so. A lock makes each call atomic, as MULTI/EXEC
does for Redis: in the embedded app a gateway thread may `get` while the step loop commits. A
commit (and an `add`) wakes the followers of the requests it touched (`watch`), once it is in.
"""
from __future__ import annotations

import copy

import threading
import time
from dataclasses import dataclass, field
from contextlib import AbstractAsyncContextManager
from typing import Any, Callable, Sequence

from scheduler.request import Request, RequestStats
from scheduler.store.base import (DEFAULT_ENDED_TTL_S, Account, StepWrite, StoredState, Tail,
                                  Watch, check_step, model_version, params_to_dict,
                                  request_from_dict, stats_from_dict, stats_to_dict)
from scheduler.store.watch import Watchers, watching


@dataclass(slots=True)
class _Record:
    prompt_ids: list[int]
    params: dict[str, Any]                 # params_to_dict: written once, at add
    stats: dict[str, Any]                  # stats_to_dict without tau_history: rewritten per step
    tau_history: list[int]                 # appended per step, like Redis' list
    output_ids: list[int] = field(default_factory=list)
    expires_at: float = 0.0                # clock time after which an ended record is gone

    def request(self) -> Request:
        return request_from_dict({"prompt_ids": self.prompt_ids, **self.params,
                                  "stats": {**self.stats, "tau_history": self.tau_history},
                                  "output_ids": self.output_ids})


class MemoryStore:
    remote = False                         # every call is a dict operation under a lock

    def __init__(self, *, ended_ttl_s: float = DEFAULT_ENDED_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ended_ttl_s = ended_ttl_s
        self._clock = clock
        self._live: dict[str, _Record] = {}     # insertion order = admission order
        self._ended: dict[str, _Record] = {}    # insertion order = expiry order (one TTL for all)
        self._vt: dict[Account, float] = {}
        self._models: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._watchers = Watchers()

    def add(self, req: Request) -> None:
        rid = req.request_id
        rec = _Record(prompt_ids=[int(t) for t in req.prompt_ids], params=params_to_dict(req),
                      stats=stats_to_dict(req.stats, tau_history=False),
                      tau_history=[int(t) for t in req.stats.tau_history],
                      output_ids=[int(t) for t in req.output_ids])
        with self._lock:
            self._expire()
            if rid in self._live or rid in self._ended:
                raise ValueError(f"request {rid!r} is already stored")
            self._live[rid] = rec
        self._watchers.wake((rid,))

    def watch(self, request_id: str) -> AbstractAsyncContextManager[Watch]:
        return watching(self._watchers, request_id)

    def commit_step(self, step: StepWrite) -> None:
        with self._lock:
            self._commit(step)
        self._watchers.wake(step.touched())

    def _commit(self, step: StepWrite) -> None:
        check_step(step, self._live)            # before any write: all or nothing
        live = self._live
        for rid, tokens in step.appended.items():
            live[rid].output_ids.extend(int(t) for t in tokens)
        for rid, s in step.stats_by_id().items():
            rec = live[rid]
            rec.stats = stats_to_dict(s, tau_history=False)
            _sync_history(rec.tau_history, s.tau_history)
        if step.ended:
            expires_at = self._clock() + self.ended_ttl_s
            for s in step.ended:
                rec = live.pop(s.request_id)
                rec.expires_at = expires_at
                self._ended[s.request_id] = rec
        for account, value in step.virtual_time.items():
            self._vt[account] = float(value)
        self._expire()

    def end_requests(self, ended: Sequence[RequestStats]) -> None:
        """A dict is never full: as `commit_step`."""
        self.commit_step(StepWrite(ended=list(ended)))

    def load(self) -> StoredState:
        with self._lock:
            return StoredState([rec.request() for rec in self._live.values()], dict(self._vt))

    def get(self, request_id: str) -> Request | None:
        with self._lock:
            self._expire()
            rec = self._live.get(request_id) or self._ended.get(request_id)
            return rec.request() if rec is not None else None

    def tail(self, request_id: str, start: int, *, prompt: bool = False) -> Tail | None:
        with self._lock:
            self._expire()
            rec = self._live.get(request_id) or self._ended.get(request_id)
            if rec is None:
                return None
            return Tail([int(t) for t in rec.output_ids[start:]],
                        stats_from_dict({**rec.stats, "tau_history": rec.tau_history}),
                        dict(rec.params.get("meta") or {}),
                        list(rec.prompt_ids) if prompt else None)

    def save_model(self, name: str, doc: dict[str, Any]) -> bool:
        version = model_version(doc)
        with self._lock:
            held = self._models.get(name)
            if held is not None and held["version"] >= version:
                return False
            self._models[name] = copy.deepcopy(doc)
            return True

    def load_model(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            held = self._models.get(name)
            return None if held is None else copy.deepcopy(held)

    def close(self) -> None:
        pass

    def _expire(self) -> None:
        """Drop ended records past their TTL: oldest first, so this stops at the first keeper."""
        now, ended = self._clock(), self._ended
        while ended:
            rid = next(iter(ended))
            if ended[rid].expires_at > now:
                break
            del ended[rid]


def _sync_history(stored: list[int], current: list[int]) -> None:
    """Append the τ values `current` has beyond `stored` (the history only grows; if it shrank,
    someone reset it, and the stored copy follows)."""
    if len(current) < len(stored):
        stored.clear()
    stored.extend(int(t) for t in current[len(stored):])

"""The step loop: plan → draft → verify → record, one verification step per iteration.

    plan     the policy picks the batch and each request's tree budget (pure, no I/O);
    admit    planned requests without KV are prefilled (prompt + committed output), evicting the
             KV of preempted requests first when more than `max_resident` would be held; with
             chunked prefill (the policy's `prefill_chunk_tokens`) admission only claims the KV,
             and the plan's chunks compute it inside the steps, beside other requests' trees;
    step     the worker drafts every tree and verifies them all in one forward pass;
    predict  with a length predictor, the hidden state each prefill and step reports re-predicts
             the request's remaining length (scheduler/length_learner.py);
    commit   tokens are cut at a stop token or the length limit; the policy records the step;
    persist  the step's changes go to the state store in one round trip, *then* (a full store
             refuses them: that step's requests end, failed: scheduler/store/writer.py)
    stream   the new tokens go to each request's sink.

Persisting before streaming is what makes restart recovery exact: every token a client has seen
is in the store, so a new loop over the same store re-prefills prompt + committed tokens and only
ever streams what comes after them (none lost, none re-sent).

Threads: `submit`, `adopt`, `cancel`, `pause`, `set_tenant`, `drop_tenant` and `attach` may be called
from any thread (the gateway's); they only admit and enqueue (scheduler/intake.py), and the loop
applies them at the next step boundary, so the policy, the state and the worker are touched by
the loop's thread alone. A cancelled request's KV is freed at the next boundary: within one step.
Sinks are called on the loop's thread and must not block.

Construction (`StepLoop(...)`): `clock` must be wall time (not monotonic) when the store outlives
the process: arrival and service times are persisted and compared after a restart. `lengths`:
predict each request's length from the worker's features (the worker must make them) and learn
from finished ones; a request is then prefilled when it arrives if fewer than `max_resident −
max_batch` requests hold KV, so that it is ranked with a prediction while it waits (the prefill is
work its first step needs anyway). `kv_budgets`: where KV lives in several places (Ray mode:
verifier replicas), each one's (budget, slots held) in slots by home, as last reported; the loop
hands the budgets to the planner before every plan (`SchedulerState.kv_budgets`), and keeps what
each home's requests hold from the homes their prefills and steps report.

The loop's jobs, each in a module of its own: the plan (scheduler/policies), which requests hold
KV (scheduler/residency.py), a step's results as commits (scheduler/commit.py), the store write
that waits out an outage, never a full store (scheduler/store/writer.py), the other threads' side
(scheduler/intake.py), length prediction (scheduler/length_learner.py).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Mapping, Sequence

from scheduler.admission import Admitted, AdmissionControl, Refused
from scheduler.commit import commit_results, unstored
from scheduler.events import Delta, Event, Finished, Sink
from scheduler.forecast import MissForecast
from scheduler.intake import Intake
from scheduler.length_learner import LengthLearner
from scheduler.policies.planner import BatchPlanner
from scheduler.request import Request, RequestStats, Status
from scheduler.residency import KVResidency
from scheduler.state import SchedulerState
from scheduler.store import MemoryStore, StateStore, StepWrite
from scheduler.store.writer import StoreWriter
from scheduler.worker import Worker
from workers.contract import StepResult, WorkItem

__all__ = ["Delta", "Event", "Finished", "Sink", "StepLoop", "Worker"]

log = logging.getLogger(__name__)


class StepLoop:
    def __init__(self, policy: BatchPlanner, worker: Worker, store: StateStore | None = None, *,
                 admission: AdmissionControl | None = None, max_resident: int = 32,
                 clock: Callable[[], float] = time.time, lengths: LengthLearner | None = None,
                 kv_budgets: Callable[[], Mapping[str, tuple[int, int]]] | None = None):
        """`clock`, `lengths`, `kv_budgets`: the module docstring's "Construction"."""
        if max_resident < policy.config.max_batch:
            raise ValueError("max_resident must hold at least one full batch")
        self.policy = policy
        self.worker = worker
        self.admission = admission or AdmissionControl()
        self.max_resident = max_resident
        self.clock = clock
        self.lengths = lengths
        self.kv_budgets = kv_budgets
        self.chunked = policy.config.prefill_chunk_tokens > 0
        self.state = SchedulerState()
        self.steps = 0
        self.busy_s = 0.0              # wall time of the iterations that verified something
        self.aged = 0                  # requests planned because aging promoted them, in all
        self._requests: dict[str, Request] = {}
        self._limits: dict[str, int] = {}              # request id -> output token limit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        store = store if store is not None else MemoryStore()
        self.intake = Intake(worker, store, self.admission, clock, policy.fairness.weights)
        self.kv = KVResidency(worker, self.state, self._requests, self._limits, max_resident,
                              chunked=self.chunked, failed=self._prefill_failed,
                              predict=self._predict)
        self._writer = StoreWriter(store, self._stop)
        self.forecast = self.intake.forecast = MissForecast(policy)   # off until configured

    def submit(self, req: Request, sink: Sink | None = None) -> Admitted | Refused:
        """Admit a request or refuse it (`Intake.submit`)."""
        return self.intake.submit(req, sink)

    def adopt(self, requests: Sequence[Request]) -> list[str]:
        """Take over a dead replica's requests (`Intake.adopt`); returns the ids taken."""
        return self.intake.adopt(requests)

    def cancel(self, request_id: str, *, status: Status = Status.CANCELLED,
               cause: str | None = None) -> None:
        """End a request at the next step boundary (`Intake.cancel`)."""
        self.intake.cancel(request_id, status, cause)

    def pause(self, request_id: str, paused: bool = True) -> None:
        """Hold a request out of the plan, or (`paused=False`) put it back with its place, at
        the next step boundary (`Intake.pause`; scheduler/policies/pauses.py)."""
        self.intake.pause(request_id, paused)

    def set_tenant(self, tenant: str, *, weight: float, max_queued: int | None) -> None:
        """A tenant's fair-share weight and live-request cap, as they are now (`Intake.set_tenant`)."""
        self.intake.set_tenant(tenant, weight=weight, max_queued=max_queued)

    def drop_tenant(self, tenant_id: str) -> None:
        """A tenant was removed: free what the worker keeps for it (`Intake.drop_tenant`)."""
        self.intake.drop_tenant(tenant_id)

    def attach(self, request_id: str, sink: Sink) -> None:
        """Follow a request from now on (`Intake.attach`)."""
        self.intake.attach(request_id, sink)

    def start(self) -> threading.Thread:
        """Run the loop on a daemon thread until `stop()`."""
        self._stop.clear()
        if self.lengths is not None:
            self.lengths.start()
        self._thread = threading.Thread(target=self.run, name="specgate-step-loop", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float | None = 10.0) -> None:
        self._stop.set()
        self.intake.wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self.lengths is not None:
            self.lengths.stop()

    @property
    def store(self) -> StateStore:
        """The state store the intake adds to and the writer commits to (set for both)."""
        return self.intake.store

    @store.setter
    def store(self, store: StateStore) -> None:
        self.intake.store = self._writer.store = store

    @property
    def store_down_since(self) -> float | None:
        """Monotonic time the state store stopped taking writes; None while it takes them."""
        return self._writer.down_since

    def store_writing(self) -> bool:
        """False while the step loop cannot write to its state store (streams are paused)."""
        return self._writer.down_since is None

    def run(self) -> None:
        wake = self.intake.wake
        while not self._stop.is_set():
            if not self.step():
                wake.wait(0.05)
                wake.clear()

    def recover(self) -> list[str]:
        """Take over every live request from the store (after a restart; call before the first
        step); returns their ids. KV is rebuilt lazily (prompt + committed output, prefilled when
        first planned); requests admitted here while it waited to take over are left as they are."""
        stored = self.store.load()
        self.state.virtual_time.update(stored.virtual_time)
        stored.requests = [r for r in stored.requests if r.stats.request_id not in self._requests]
        for req in stored.requests:
            s = req.stats
            s.requeue()                                # no batch runs, no KV is held
            self._requests[s.request_id] = req
            self._limits[s.request_id] = self.intake.limit(req)
            self.state.requests[s.request_id] = s
            self.intake.restore(s.tenant)
        self.policy.rebuild(self.state)
        return [r.request_id for r in stored.requests]

    def step(self) -> bool:
        """One iteration. Returns False when there was nothing to do."""
        self._apply_inbox()
        if not self.state.requests:
            return False
        start = self.clock()
        t0 = time.perf_counter()
        if self.kv_budgets is not None:
            self.state.kv_budgets = {home: budget for home, (budget, _) in self.kv_budgets().items()}
        plan = self.policy.plan(self.state, start)
        self.aged += plan.aged
        for rid in plan.evict:                         # the KV budget: room for this step
            self.kv.evict(rid)
        if not plan.request_ids:
            return False                                # nothing runnable now: wait a little
        ids, first_warm = plan.request_ids, len(plan) - plan.warm
        resident = self.kv.resident
        if not all(rid in resident for rid in ids[:first_warm]):   # else no prefill to make
            keep = set(ids)
            for rid in ids[:first_warm]:
                self.kv.ensure(rid, keep, plan.homes.get(rid))
        # requests prefilled ahead of their turn are stepped only while they hold their KV
        if not any(rid in resident for rid in ids):
            return True
        chunks = plan.prefill or [0] * len(plan)
        items = [WorkItem(rid, b, chunk, i < first_warm)
                 for i, (rid, b, chunk) in enumerate(zip(ids, plan.budgets, chunks))
                 if rid in resident]
        try:
            results = self.worker.step(items)
        except Exception as exc:                       # a step failure ends its batch, not the loop
            log.exception("verification step failed")
            for item in items:
                self._end(item.request_id, Status.FAILED, "error", f"step failed: {exc}")
            return True
        now = self.clock()
        self.steps += 1
        self._record(results, now, now - start)
        self.forecast.refresh(self.state, now)         # the miss predictor's queue, if on
        self.busy_s += time.perf_counter() - t0        # plan, prefills, step, commit, persist
        return True

    # ---- internals --------------------------------------------------------------------------------
    def _record(self, results: list[StepResult], now: float, step_s: float) -> None:
        done = commit_results(results, self._requests, self._limits, self.kv, self._predict)
        appended = done.appended
        before = set(self.state.running)
        finished = self.policy.update(self.state, done.records, now, step_s)
        ended_ids = {s.request_id for s in finished}
        touched = (set(appended) | before) - ended_ids
        updated = [self.state.requests[r] for r in touched if r in self.state.requests]
        if not self._writer.commit(StepWrite(appended=appended, updated=updated, ended=finished,
                                             virtual_time=dict(self.state.virtual_time))):
            return self._refused(appended, finished)     # nothing stored: nothing streamed
        self.intake.stream(appended, done.logprobs)
        for s in finished:
            if self.lengths is not None:
                self.lengths.finish(s.request_id, s.committed, censored=s.finish_reason != "stop")
            self._forget(s)

    def _refused(self, appended: Mapping[str, Sequence[int]], finished: list[RequestStats]) -> None:
        """The store was full and refused the step's write (scheduler/store/writer.py): its
        tokens are not stored, so not streamed; the requests that made them end (`unstored`)."""
        now = self.clock()
        live = [self.policy.remove(self.state, rid, Status.FAILED, "error", now) for rid in appended]
        ended = unstored(appended, finished + [s for s in live if s is not None])
        self._writer.commit(StepWrite(ended=ended))
        for s in ended:
            self._forget(s, "the state store is full")

    def _predict(self, req: Request, features: Sequence[float], committed: int, *,
                 touch: bool = True) -> None:
        """Re-predict a request's remaining length (`LengthLearner.predict`); `touch`: between
        steps, so the planner ranks it again at the next plan (a step's `update` re-ranks what
        it served)."""
        if self.lengths is not None:
            self.lengths.predict(req.stats, features, committed)
        if touch:
            self.policy.touch(req.request_id)

    def _prefill_failed(self, request_id: str, exc: Exception) -> None:
        self._end(request_id, Status.FAILED, "error", str(exc))

    def _apply_inbox(self) -> None:
        self.intake.apply(self.policy, self._admit, self._end, self._pause)   # a cancel ends it

    def _pause(self, request_id: str, paused: bool) -> None:
        """Pause a live request, its KV freed (the planner budgets by nothing it cannot see),
        or resume a paused one; one that ended meanwhile is left as it is."""
        if not paused:
            self.policy.pauses.resume(self.state, request_id, self.clock())
        elif self.policy.pauses.pause(self.state, request_id, self.clock()) is not None:
            self.kv.evict(request_id)

    def _admit(self, req: Request) -> None:
        """A submitted (or adopted) request joins the plan. With a length predictor and KV room it
        is prefilled now (ranked from now); with chunks, once steps have prefilled it."""
        rid = req.request_id
        self._requests[rid] = req
        self._limits[rid] = self.intake.limit(req)
        self.policy.add(self.state, req.stats)
        fits, home = False, None
        if (self.lengths is not None and self.lengths.weights is not None
                and len(self.kv) < self.max_resident - self.policy.config.max_batch):
            fits, home = self.policy.kv_place(self.state, req.stats)
        if fits and self.kv.ensure(rid, set(), home) and req.stats.prefill_left:
            self.policy.prefilling(rid)

    def _end(self, request_id: str, status: Status, cause: str | None, error: str | None = None) -> None:
        s = self.policy.remove(self.state, request_id, status, cause, self.clock())
        if s is None:
            return
        self._writer.commit(StepWrite(ended=[s]))
        if self.lengths is not None and s.finish_reason == "stop":   # a stop string the gateway saw
            self.lengths.finish(request_id, s.committed)
        self._forget(s, error)

    def _forget(self, s: RequestStats, error: str | None = None) -> None:
        """`s` ended: free what it held, then tell its sink (`Finished`, with `error` if any)."""
        rid = s.request_id
        if self.lengths is not None:
            self.lengths.forget(rid)
        self.worker.release(rid)
        del self._requests[rid]
        self.kv.release(s)
        self._limits.pop(rid, None)
        self.intake.departed(s.tenant)
        self.intake.emit(Finished(rid, s.status, s.finish_reason, s, error))


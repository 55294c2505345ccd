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
    persist  the step's changes go to the state store in one round trip, *then*
    stream   the new tokens go to each request's sink.

Persisting before streaming is what makes restart recovery exact: every token a client has seen
is in the store, so a new loop over the same store re-prefills prompt + committed tokens and only
ever streams what comes after them (none lost, none re-sent).

Threads: `submit`, `cancel` and `attach` may be called from any thread (the gateway's); they only
enqueue, and the loop applies them at the next step boundary, so the policy, the state and the
worker are touched by the loop's thread alone. A cancelled request's KV is freed at the next
boundary: within one step. Sinks are called on the loop's thread and must not block.
"""
from __future__ import annotations

import collections
import logging
import math
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Protocol, Sequence, Union

from scheduler.admission import ADMITTED, Admitted, AdmissionControl, Refused
from scheduler.length_learner import LengthLearner, better
from scheduler.policies.planner import BatchPlanner
from scheduler.request import Request, RequestStats, Status, StepRecord
from scheduler.state import SchedulerState
from scheduler.store import MemoryStore, StateStore, StepWrite
from workers.contract import Prefilled, SamplingParams, StepResult, TokenLogprob, WorkItem
from workers.stopping import cut

log = logging.getLogger(__name__)


class Worker(Protocol):
    """What the loop drives: `workers.speculation.batch_worker.BatchWorker`, or a fake with the same calls.
    `step` drafts each item's tree within the budget it is given (the plan sizes them)."""
    context_limit: int

    def prefill(self, request_id: str, token_ids: Sequence[int], *, prompt_len: int,
                sampling: SamplingParams, max_new_tokens: int, tenant: str = "default",
                drafter: str | None = None, defer: bool = False) -> Prefilled:
        """Make a request resident; `defer`: compute none of its context's KV now (steps do,
        in the chunks `WorkItem.prefill` asks for; the loop passes it only when chunking)."""

    def step(self, items: Sequence[WorkItem]) -> list[StepResult]:
        """One result per item, in item order; a result without tokens only prefilled."""

    def release(self, request_id: str) -> None:
        """Free a finished request's KV and drafter state."""

    def evict(self, request_id: str) -> None:
        """Free the KV of a request that is not finished (it is prefilled again when planned)."""

    def drop_tenant(self, tenant: str) -> None:
        """Free what is kept for a removed tenant across requests (prefix cache, drafters'
        caches) and keep nothing more for it; `tenant` is its immutable id, as `prefill` got it."""


@dataclass(frozen=True)
class Delta:
    """Tokens a step committed for one request, in order (never re-sent), and their logprobs
    when the request asked (`SamplingParams.logprobs`): one entry per token.

    NOTE: logprobs are not persisted with the output: recovery never re-sends committed tokens
    (module docstring), so nothing would read them; tokens committed after a recovery have theirs
    (the request's `SamplingParams` are persisted)."""
    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class Finished:
    """The request ended; `stats` is its final record (τ history, attained service, …)."""
    request_id: str
    status: Status
    finish_reason: str | None      # OpenAI finish_reason ("stop", "length", "abort", "error")
    stats: RequestStats
    error: str | None = None       # a message for the client when status is FAILED


Event = Union[Delta, Finished]
Sink = Callable[[Event], None]


class StepLoop:
    def __init__(self, policy: BatchPlanner, worker: Worker, store: StateStore | None = None, *,
                 admission: AdmissionControl | None = None, max_resident: int = 32,
                 clock: Callable[[], float] = time.time, lengths: LengthLearner | None = None,
                 kv_budgets: Callable[[], Mapping[str, tuple[int, int]]] | None = None):
        """`clock` must be wall time (not monotonic) when the store outlives the process: arrival
        and service times are persisted and compared after a restart.

        `lengths`: predict each request's length from the worker's features (the worker must make
        them) and learn from finished ones. A request is then prefilled when it arrives if fewer
        than `max_resident − max_batch` requests hold KV, so that it is ranked with a prediction
        while it waits (the prefill is work its first step needs anyway).

        `kv_budgets`: where KV lives in several places (Ray mode: verifier replicas), each one's
        (budget, slots held) in slots by home, as last reported; the loop hands the budgets to
        the planner before every plan (`SchedulerState.kv_budgets`), and keeps what each home's
        requests hold from the homes their prefills and steps report."""
        if max_resident < policy.config.max_batch:
            raise ValueError("max_resident must hold at least one full batch")
        self.policy = policy
        self.worker = worker
        self.store = store if store is not None else MemoryStore()
        self.admission = admission or AdmissionControl()
        self.max_resident = max_resident
        self.clock = clock
        self.lengths = lengths
        self.kv_budgets = kv_budgets
        self.chunked = policy.config.prefill_chunk_tokens > 0
        self.state = SchedulerState()
        self.steps = 0
        self.busy_s = 0.0              # wall time of the iterations that verified something
        self._requests: dict[str, Request] = {}
        self._limits: dict[str, int] = {}              # request id -> output token limit
        self._sinks: dict[str, Sink] = {}
        self._resident: dict[str, None] = {}           # ids with KV, least recently served first
        self._finish_times: collections.deque = collections.deque(maxlen=64)
        self._inbox: collections.deque = collections.deque()
        self._lock = threading.Lock()                  # admission counts and limits, sinks
        self._tenant_caps: dict[str, int] = dict(self.admission.limits.per_tenant)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.store_down_since: float | None = None     # set by `_persist` while writes fail

    # ---- any thread ------------------------------------------------------------------------------
    def submit(self, req: Request, sink: Sink | None = None) -> Admitted | Refused:
        """Admit a request (or refuse it: queue full). Raises ValueError for a request that can
        never run (empty prompt, max_tokens < 1, prompt at or past the model's context)."""
        s = req.stats
        if not req.prompt_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        if s.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {s.max_tokens}")
        if req.drafter == "none":
            s.max_tree_tokens = 0                      # the planner sizes its trees to nothing
        s.drafter = req.drafter
        room = self.worker.context_limit - len(req.prompt_ids) - len(req.output_ids)
        if room < 1:
            raise ValueError(f"prompt has {len(req.prompt_ids)} tokens; the model's context is "
                             f"{self.worker.context_limit} tokens")
        with self._lock:
            verdict = self.admission.admit(s.tenant, self._drain_per_s())
            if verdict is not ADMITTED:
                return verdict
            if sink is not None:
                self._sinks[s.request_id] = sink
        try:
            self.store.add(req)                        # persisted before anyone is told "admitted"
        except Exception:
            with self._lock:
                self.admission.release(s.tenant)
                self._sinks.pop(s.request_id, None)
            raise
        self._inbox.append(("submit", req))
        self._wake.set()
        return ADMITTED

    def adopt(self, requests: Sequence[Request]) -> list[str]:
        """Take over requests another replica's loop held (it died and its lease ran out): each
        is written to this loop's store with what it committed, then queued as a recovered one
        is (no KV: it is prefilled with prompt + committed output when first planned). Requests
        already here are skipped. Returns the ids taken. Any thread."""
        taken = []
        for req in requests:
            s = req.stats
            if s.status.terminal:
                continue
            if s.status is Status.RUNNING:
                s.status = Status.PREEMPTED            # its batch died with its replica
            s.prefill_left = None
            s.kv_tokens, s.kv_home = 0, None
            try:
                self.store.add(req)
            except ValueError:                         # already stored here: adopted before
                continue
            with self._lock:
                self.admission.restore(s.tenant)
            self._inbox.append(("submit", req))
            taken.append(req.request_id)
        self._wake.set()
        return taken

    def cancel(self, request_id: str, *, status: Status = Status.CANCELLED,
               cause: str | None = None) -> None:
        """End a request at the next step boundary: cancelled (client gone), or finished early
        (`status=FINISHED, cause="stop_string"` when the gateway saw a stop string)."""
        if not status.terminal:
            raise ValueError(f"{status} is not a terminal state")
        self._inbox.append(("cancel", request_id, status, cause))
        self._wake.set()

    def set_tenant(self, tenant: str, *, weight: float, max_queued: int | None) -> None:
        """A tenant's fair-share weight and live-request cap, as they are now (tenants change at
        run time). The cap holds from the next `submit`; the weight from the next step."""
        if weight <= 0:
            raise ValueError("tenant weights must be > 0")
        with self._lock:
            caps = self._tenant_caps
            if caps.get(tenant) != max_queued:
                if max_queued is None:
                    caps.pop(tenant, None)
                else:
                    caps[tenant] = max_queued
                self.admission.limits = replace(self.admission.limits, per_tenant=dict(caps))
        if self.policy.fairness.weights.get(tenant) != weight:
            self._inbox.append(("tenant", tenant, weight))

    def drop_tenant(self, tenant_id: str) -> None:
        """A tenant was removed: the worker frees its caches (`Worker.drop_tenant`) at the next
        step boundary, on the loop's thread like every other worker call. `tenant_id` is the
        tenant's immutable id (`RequestStats.tenant_id`), never reused."""
        self._inbox.append(("drop_tenant", tenant_id))
        self._wake.set()

    def attach(self, request_id: str, sink: Sink) -> None:
        """Follow a request from now on (e.g. a recovered one): only tokens committed after this."""
        with self._lock:
            self._sinks[request_id] = sink

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
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self.lengths is not None:
            self.lengths.stop()

    # ---- the loop's thread -----------------------------------------------------------------------
    def run(self) -> None:
        while not self._stop.is_set():
            if not self.step():
                self._wake.wait(0.05)
                self._wake.clear()

    def recover(self) -> list[str]:
        """Take over every live request from the store (after a restart). Returns their ids.

        Call before the first step. Their KV is rebuilt lazily: a recovered request is prefilled
        with prompt + committed output when a plan first picks it. Requests this loop already
        holds (admitted here while it waited to take over) are left as they are."""
        stored = self.store.load()
        self.state.virtual_time.update(stored.virtual_time)
        stored.requests = [r for r in stored.requests if r.stats.request_id not in self._requests]
        for req in stored.requests:
            s = req.stats
            if s.status is Status.RUNNING:
                s.status = Status.PREEMPTED            # no batch is running any more
            s.prefill_left = None                      # no KV is held after a restart
            s.kv_tokens, s.kv_home = 0, None
            self._requests[s.request_id] = req
            self._limits[s.request_id] = self._limit(req)
            self.state.requests[s.request_id] = s
            with self._lock:
                self.admission.restore(s.tenant)
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
        for rid in plan.evict:                         # the KV budget: room for this step
            self._evict(rid)
        if not plan.request_ids:
            return False                                # nothing runnable now: wait a little
        keep = set(plan.request_ids)
        first_warm = len(plan) - plan.warm
        # requests prefilled ahead of their turn are stepped only while they hold their KV
        planned = [rid for i, rid in enumerate(plan.request_ids)
                   if (rid in self._resident if i >= first_warm
                       else self._ensure_resident(rid, keep, plan.homes.get(rid)))]
        if not planned:
            return True
        chunks = plan.prefill or [0] * len(plan)
        items = [WorkItem(rid, b, chunk, i < first_warm)
                 for i, (rid, b, chunk) in enumerate(zip(plan.request_ids, plan.budgets, chunks))
                 if rid in self._resident]
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
        self.busy_s += time.perf_counter() - t0        # plan, prefills, step, commit, persist
        return True

    # ---- internals --------------------------------------------------------------------------------
    def _record(self, results: list[StepResult], now: float, step_s: float) -> None:
        records, appended, logprobs = [], {}, {}
        for res in results:
            rid = res.request_id
            req = self._requests[rid]
            req.stats.prefill_left = res.pending
            self._hold(req.stats, res.kv_tokens, res.home)
            if not res.decoded:                        # only prefilled: nothing to commit
                if res.features is not None:           # ahead of its turn, now ready
                    self._predict(req, res.features, len(req.output_ids))
                    self.policy.touch(rid)
                continue
            if res.features is not None:
                # the features are of the row that read the last accepted token
                self._predict(req, res.features, len(req.output_ids) + res.accepted)
            tokens, cause = cut(res.tokens, produced=len(req.output_ids), limit=self._limits[rid],
                                stop_token_ids=req.stop_token_ids)
            req.output_ids.extend(tokens)
            appended[rid] = tokens
            if res.logprobs is not None:
                logprobs[rid] = res.logprobs[:len(tokens)]      # cut where the tokens were
            # The path tried: accepted drafts, plus the one rejected where the walk stopped.
            tried = res.accepted + (1 if res.drafted > res.accepted else 0) if res.drafted else 0
            records.append(StepRecord(rid, res.tree_tokens, len(tokens), cause, tried,
                                      res.drafted, res.accepted, res.draft_s, res.draft_depth))
            self._resident[rid] = self._resident.pop(rid)        # most recently served last
        before = set(self.state.running)
        finished = self.policy.update(self.state, records, now, step_s)
        ended_ids = {s.request_id for s in finished}
        touched = (set(appended) | before) - ended_ids
        updated = [self.state.requests[r] for r in touched if r in self.state.requests]
        self._persist(StepWrite(appended=appended, updated=updated, ended=finished,
                                virtual_time=dict(self.state.virtual_time)))
        for rid, tokens in appended.items():
            self._emit(Delta(rid, tuple(tokens), logprobs.get(rid)))
        for s in finished:
            if self.lengths is not None:
                self.lengths.finish(s.request_id, s.committed, censored=s.finish_reason != "stop")
            self._forget(s.request_id)
            self._emit(Finished(s.request_id, s.status, s.finish_reason, s))

    def _ensure_resident(self, request_id: str, keep: set[str], home: str | None = None) -> bool:
        """Make `request_id` hold KV (prefilled, or with chunks, its KV claimed), on `home` where
        the planner placed it (Ray mode's verifier replicas); False if its prefill failed."""
        if request_id in self._resident:
            return True
        while len(self._resident) >= self.max_resident:
            # never served first (prefilled on arrival: only that prefill is lost), then the least
            # recently served
            unserved = (r for r in self._resident if r not in keep and self._never_served(r))
            victim = next(unserved, None) or next((r for r in self._resident if r not in keep), None)
            if victim is None:
                break
            self._evict(victim)
        req = self._requests[request_id]
        extra: dict = {"defer": True} if self.chunked else {}
        if home is not None:
            extra["home"] = home
        try:
            done = self.worker.prefill(request_id, [*req.prompt_ids, *req.output_ids],
                                       prompt_len=len(req.prompt_ids), sampling=req.sampling,
                                       max_new_tokens=self._limits[request_id] - len(req.output_ids),
                                       tenant=req.stats.cache_tenant, drafter=req.drafter, **extra)
        except Exception as exc:
            log.warning("prefill of %s failed: %s", request_id, exc)
            self._end(request_id, Status.FAILED, "error", str(exc))
            return False
        self._resident[request_id] = None
        req.stats.prefill_left = done.pending
        self._hold(req.stats, done.kv_tokens, done.home)
        if done.features is not None:
            self._predict(req, done.features, len(req.output_ids))
            self.policy.touch(request_id)
        return True

    def _evict(self, request_id: str) -> None:
        """Free the KV of a request that is not finished: re-prefilled when planned again."""
        if request_id not in self._resident:
            return
        self.worker.evict(request_id)
        del self._resident[request_id]
        s = self._requests[request_id].stats
        s.prefill_left = None
        self._hold(s, 0)

    def _hold(self, s: RequestStats, kv_tokens: int, home: str | None = None) -> None:
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

    def _predict(self, req: Request, features: Sequence[float], committed: int) -> None:
        """Re-predict a request's remaining length from the features of its last committed token
        (`committed` tokens into its output); before its first step, also its length at arrival."""
        lengths, s = self.lengths, req.stats
        if lengths is None:
            return
        lengths.note(s.request_id, features, committed)
        belief = lengths.belief(features, committed)
        if not better(belief, s.length_belief):
            return
        s.length_belief = belief
        if s.predicted_len is None and s.n_steps == 0:
            mu, sigma, _ = belief
            s.predicted_len = committed + max(1, round(math.exp(mu + sigma * sigma / 2)))

    def _apply_inbox(self) -> None:
        while self._inbox:
            msg = self._inbox.popleft()
            if msg[0] == "tenant":
                self.policy.fairness.weights[msg[1]] = msg[2]
            elif msg[0] == "drop_tenant":
                self.worker.drop_tenant(msg[1])
                self.policy.drop_tenant(msg[1])
            elif msg[0] == "submit":
                req = msg[1]
                rid = req.request_id
                self._requests[rid] = req
                self._limits[rid] = self._limit(req)
                self.policy.add(self.state, req.stats)
                fits, home = False, None
                if (self.lengths is not None and self.lengths.weights is not None
                        and len(self._resident) < self.max_resident - self.policy.config.max_batch):
                    fits, home = self.policy.kv_place(self.state, req.stats)
                if fits:
                    # ranked with a prediction from now; with chunks, from when steps have
                    # prefilled it with what their chosen requests leave of the budget
                    if self._ensure_resident(rid, set(), home) and req.stats.prefill_left:
                        self.policy.prefilling(rid)
            else:
                _, rid, status, cause = msg
                if rid in self.state.requests:
                    self._end(rid, status, cause)

    def _end(self, request_id: str, status: Status, cause: str | None, error: str | None = None) -> None:
        s = self.policy.remove(self.state, request_id, status, cause, self.clock())
        if s is None:
            return
        self._persist(StepWrite(ended=[s]))
        if self.lengths is not None and s.finish_reason == "stop":   # a stop string the gateway saw
            self.lengths.finish(request_id, s.committed)
        self._forget(request_id)
        self._emit(Finished(request_id, s.status, s.finish_reason, s, error))

    def _persist(self, write: StepWrite) -> None:
        """Write a step's changes, waiting out a store outage (Redis down, restarting, or not
        answering within its client's timeout): nothing is streamed before it is stored, so the
        loop pauses rather than die or skip the write, and every stream resumes where it paused
        once the write goes through (a retried write is idempotent: RedisStore.commit_step).

        The outage is reported once (a warning when it starts, another when it ends, with its
        length) and is visible while it lasts: `store_down_since`, hence `store_writing()`
        (readiness and the `state_store_writes` component of `specgate_component_up`)."""
        delay = 0.01
        while True:
            try:
                self.store.commit_step(write)
                if self.store_down_since is not None:
                    log.warning("state store writes go through again after %.1f s; streams resume",
                                time.monotonic() - self.store_down_since)
                    self.store_down_since = None
                return
            except (ValueError, TypeError):            # a bad write, not an outage
                raise
            except Exception as exc:
                if self._stop.is_set():
                    raise
                if self.store_down_since is None:
                    self.store_down_since = time.monotonic()
                    log.warning("state store write failed (%s); streams pause, retrying with "
                                "backoff until it answers", exc)
                self._stop.wait(delay)
                delay = min(2 * delay, 0.5)

    def store_writing(self) -> bool:
        """False while the step loop cannot write to its state store (streams are paused)."""
        return self.store_down_since is None

    def _forget(self, request_id: str) -> None:
        self._finish_times.append(self.clock())
        if self.lengths is not None:
            self.lengths.forget(request_id)
        self.worker.release(request_id)
        self._resident.pop(request_id, None)
        req = self._requests.pop(request_id)
        self._hold(req.stats, 0)
        self._limits.pop(request_id, None)
        with self._lock:
            self.admission.release(req.stats.tenant)

    def _emit(self, event: Event) -> None:
        with self._lock:
            sink = self._sinks.get(event.request_id)
            if isinstance(event, Finished):
                self._sinks.pop(event.request_id, None)
        if sink is not None:
            try:
                sink(event)
            except Exception:                          # a broken consumer must not stop the loop
                log.exception("sink for %s failed", event.request_id)

    def _limit(self, req: Request) -> int:
        """Output tokens the request may have in all: max_tokens, capped by the context."""
        return min(req.stats.max_tokens, self.worker.context_limit - len(req.prompt_ids))

    def _drain_per_s(self) -> float | None:
        """Requests leaving per second over the last (up to) 64 departures, for Retry-After."""
        times = self._finish_times
        if len(times) < 2 or times[-1] <= times[0]:
            return None
        return (len(times) - 1) / (times[-1] - times[0])

"""The step loop's side that other threads touch: requests in, events out.

`submit`, `adopt`, `cancel`, `pause`, `set_tenant`, `drop_tenant` and `attach` may be called from any
thread (the gateway's). They admit (admission counts and limits, sinks: one lock), persist a new
request before anyone is told it was admitted, and enqueue a message; the loop applies the inbox
at its next step boundary (`Intake.apply`, called by `StepLoop.step`), so the policy, the state and the worker are
touched by the loop's thread alone. Events go out to each request's sink (`emit`), on the loop's
thread.

Inbox messages, applied in order: ("submit", Request), ("cancel", request id, status, cause),
("pause", request id, paused), ("tenant", tenant name, weight), ("drop_tenant", tenant id).
"""
from __future__ import annotations

import collections
import logging
import threading
from dataclasses import replace
from typing import Callable, Mapping, Sequence

from scheduler.admission import ADMITTED, Admitted, AdmissionControl, Refused
from scheduler.events import Delta, Event, Finished, FinishedOnly, Sink
from scheduler.forecast import MissForecast
from scheduler.policies.planner import BatchPlanner
from scheduler.request import Request, Status
from scheduler.store import StateStore
from scheduler.worker import Worker

log = logging.getLogger(__name__)


class Intake:
    """Admission, the inbox and the sinks of one step loop (module docstring)."""

    def __init__(self, worker: Worker, store: StateStore, admission: AdmissionControl,
                 clock: Callable[[], float], weights: Mapping[str, float]) -> None:
        """`weights`: the planner's tenant weights as they are now (read here only, to skip
        messages that change nothing; `apply` changes them on the loop's thread)."""
        self.worker, self.store, self.admission = worker, store, admission
        self.clock, self.weights = clock, weights
        self.inbox: collections.deque = collections.deque()
        self.wake = threading.Event()           # set when the inbox has something
        self._lock = threading.Lock()           # admission counts and limits, sinks
        self._sinks: dict[str, Sink] = {}
        self._tenant_caps: dict[str, int] = dict(admission.limits.per_tenant)
        self._finish_times: collections.deque = collections.deque(maxlen=64)
        # the miss predictor's queue (scheduler/forecast.py), told of each admission: set by the
        # step loop; None or off, told nothing
        self.forecast: MissForecast | None = None

    # ---- any thread --------------------------------------------------------------------------
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
        self._post(("submit", req))
        if self.forecast is not None and self.forecast.enabled:
            self.forecast.admitted(req.stats, self.clock())      # ahead of later newcomers
        return ADMITTED

    def adopt(self, requests: Sequence[Request]) -> list[str]:
        """Take over requests another replica's loop held (it died and its lease ran out): each
        is written to this loop's store with what it committed, then queued as a recovered one
        is (no KV: it is prefilled with prompt + committed output when first planned). Requests
        already here are skipped. Returns the ids taken."""
        taken = []
        for req in requests:
            s = req.stats
            if s.status.terminal:
                continue
            s.requeue()                                # its batch and KV died with its replica
            try:
                self.store.add(req)
            except ValueError:                         # already stored here: adopted before
                continue
            self.restore(s.tenant)
            self.inbox.append(("submit", req))
            taken.append(req.request_id)
        self.wake.set()
        return taken

    def cancel(self, request_id: str, status: Status, cause: str | None) -> None:
        """End a request at the next step boundary: cancelled (client gone), or finished early
        (`status=FINISHED, cause="stop_string"` when the gateway saw a stop string)."""
        if not status.terminal:
            raise ValueError(f"{status} is not a terminal state")
        self._post(("cancel", request_id, status, cause))

    def pause(self, request_id: str, paused: bool) -> None:
        """Hold a request out of the plan (`paused`), or put it back, from the next step
        boundary: its stream's reader fell behind, or caught up (scheduler/policies/pauses.py)."""
        self._post(("pause", request_id, paused))

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
        if self.weights.get(tenant) != weight:
            self.inbox.append(("tenant", tenant, weight))

    def drop_tenant(self, tenant_id: str) -> None:
        """A tenant was removed: the worker frees its caches (`Worker.drop_tenant`) at the next
        step boundary, on the loop's thread like every other worker call. `tenant_id` is the
        tenant's immutable id (`RequestStats.tenant_id`), never reused."""
        self._post(("drop_tenant", tenant_id))

    def attach(self, request_id: str, sink: Sink) -> None:
        """Follow a request from now on (e.g. a recovered one): only tokens committed after this."""
        with self._lock:
            self._sinks[request_id] = sink

    # ---- the loop's thread -------------------------------------------------------------------
    def apply(self, planner: BatchPlanner, admit: Callable[[Request], None],
              end: Callable[[str, Status, str | None], None],
              pause: Callable[[str, bool], None]) -> None:
        """Apply the queued messages in order: a tenant's weight and removal reach the planner
        and the worker here; `admit` takes each submitted request, `end` each cancellation,
        `pause` each pause and resume."""
        inbox = self.inbox
        while inbox:
            msg = inbox.popleft()
            if msg[0] == "pause":
                pause(msg[1], msg[2])
            elif msg[0] == "tenant":
                planner.fairness.weights[msg[1]] = msg[2]
            elif msg[0] == "drop_tenant":
                self.worker.drop_tenant(msg[1])
                planner.drop_tenant(msg[1])
            elif msg[0] == "submit":
                admit(msg[1])
            else:
                _, rid, status, cause = msg
                end(rid, status, cause)

    def limit(self, req: Request) -> int:
        """Output tokens the request may have in all: max_tokens, capped by the context."""
        return min(req.stats.max_tokens, self.worker.context_limit - len(req.prompt_ids))

    def restore(self, tenant: str) -> None:
        """A request admitted before (recovered, adopted) counts against its tenant again."""
        with self._lock:
            self.admission.restore(tenant)

    def departed(self, tenant: str) -> None:
        """A request left the loop: its tenant's count goes down, and the drain rate (for
        Retry-After) counts it."""
        self._finish_times.append(self.clock())
        with self._lock:
            self.admission.release(tenant)

    def emit(self, event: Event) -> None:
        with self._lock:
            sink = self._sinks.get(event.request_id)
            if isinstance(event, Finished):
                self._sinks.pop(event.request_id, None)
        if sink is not None:
            self._send(sink, event)

    def stream(self, appended: Mapping[str, Sequence[int]], logprobs: Mapping[str, list]) -> None:
        """A step's new tokens, a `Delta` to each request's sink (in `appended`'s order), their
        logprobs where there are any; none is built for a sink that follows only the end
        (`FinishedOnly`), nor for a request nobody follows."""
        with self._lock:                               # once a step, not once a request
            sinks = self._sinks
            to = [(rid, sink) for rid in appended
                  if (sink := sinks.get(rid)) is not None and type(sink) is not FinishedOnly]
        for rid, sink in to:
            self._send(sink, Delta(rid, tuple(appended[rid]), logprobs.get(rid)))

    def _send(self, sink: Sink, event: Event) -> None:
        try:
            sink(event)
        except Exception:                              # a broken consumer must not stop the loop
            log.exception("sink for %s failed", event.request_id)

    def _post(self, message: tuple) -> None:
        self.inbox.append(message)
        self.wake.set()

    def _drain_per_s(self) -> float | None:
        """Requests leaving per second over the last (up to) 64 departures, for Retry-After."""
        times = self._finish_times
        if len(times) < 2 or times[-1] <= times[0]:
            return None
        return (len(times) - 1) / (times[-1] - times[0])

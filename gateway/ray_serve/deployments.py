"""Ray Serve mode's deployment classes: the same gateway, scheduler and workers as the embedded
mode, each wrapped in a plain class that adds no logic of its own. The scheduler assembles the
embedded service (`gateway.assembly.serving.assemble`), its worker being a `VerifierPool`; a
verifier replica runs `gateway.assembly.target.batch_worker`; the ingress
(`gateway.ray_serve.ingress`, a module of its own: its replicas import no model code) builds the
app over a `RemoteService`. Which of them run, how many and where is decided by the Ray builder
alone (`gateway.builders.ray_app`).

Structured outputs: the scheduler compiles each distinct grammar once (its compile processes,
within the time limit: gateway/service/constraint.py) and ships it serialized with every prefill
of a constrained request (`VerifierPool`); a verifier replica reads it back before taking its
lock (`take_grammar`), so it never compiles one, and its steps never wait on one.

Draft workers (a CPU deployment, scaled on its own) propose the trees: a verifier replica asks
once per step for all its requests (`gateway.ray_serve.draft_pool.RemoteDrafter`); losing them
costs only speculation. With `draft: null` each verifier replica drafts for its own requests.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from typing import Any, Mapping, Sequence

from ray import serve

from gateway.assembly.replica import lease_key
from gateway.assembly.serving import Embedded, assemble
from gateway.assembly.target import (Target, batch_worker, freeze_heap, kv_budget,
                                     planner_step_cost, replica_kv_budget)
from gateway.ray_serve.releases import apply_releases
from gateway.ray_serve.remote import SchedulerEndpoint
from gateway.ray_serve.replica_secrets import READS_NONE, SCHEDULER_READS, settings_in_replica
from gateway.ray_serve.verifier_pool import VerifierPool
from gateway.service import GenerateInput
from scheduler.lease import Lease
from scheduler.store.redis_client import redis_client
from workers.contract import SamplingParams

log = logging.getLogger(__name__)

__all__ = ["VerifierServer", "DraftServer", "SchedulerServer"]

SCHEDULER, VERIFIER, INGRESS, DRAFT = "scheduler", "verifier", "ingress", "draft"
SERVED_KEPT = 10_000          # requests a verifier replica remembers serving (diagnostics)
LEASE_TTL_S = 10.0            # the scheduler lease: a crashed holder's is free after this


# ---- the deployments' classes (plain classes; `build` turns them into deployments) ---------------
class VerifierServer:
    """One verifier replica: the embedded mode's BatchWorker (drafter, lean forward, KV caches)."""

    def __init__(self, settings: dict[str, Any], torch_threads: int | None = None,
                 drafts: Any = None) -> None:
        """`drafts`: a handle to the draft deployment (None: the replica drafts itself)."""
        # the model code, torch and the drafters: in the replicas that run them, not in the Ray
        # driver or the scheduler replica, which import this module too
        import torch

        from gateway.ray_serve.draft_pool import RemoteDrafter
        from workers.runtime import load_runtime

        if torch_threads:              # and OMP_NUM_THREADS, see _deployment
            torch.set_num_threads(torch_threads)
        s = settings_in_replica(settings, READS_NONE)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # where the replica runs decides: its pod's own SPECGATE_DEVICE (the chart sets cuda on
        # GPU workers), else the deployment's setting (auto: the GPU Ray gave it, if any)
        device = os.environ.get("SPECGATE_DEVICE") or s.device
        self.runtime = load_runtime(s.model, dtype=s.dtype, device=device, attention=s.attention,
                                    progress=False)
        remote = {} if drafts is None else {
            name: RemoteDrafter(drafts, name, affinity=self.replica_id)
            for name in s.drafter_names if name != "none"}
        self.worker = batch_worker(s, self.runtime, drafters=remote)
        # this replica's step costs, for the scheduler's planner
        # (`gateway.assembly.target.planner_step_cost`)
        self.step_profile = None
        if s.step_profile is None:
            self.step_profile = self.runtime.step_profile(s.max_batch, s.max_tree_tokens)
        self._lock = threading.Lock()          # one call at a time touches the KV caches
        self._reniced: set[int] = set()
        # request id -> {"prefill": n, "step": n} calls served here (affinity is checked on it)
        self.served: dict[str, Counter] = defaultdict(Counter)
        freeze_heap()                          # the model and worker are here for good

    def describe(self, *, replica: str | None = None) -> dict[str, Any]:
        """What the scheduler builds its planner from: context, stop tokens, step costs, and this
        replica's KV pool (`kv`: budget and held, in slots; `kv_budget`: the policy's KV fields
        and start note, as `gateway.assembly.target.kv_budget` makes them)."""
        import torch                           # this replica's alone (see __init__)

        return {"context_limit": self.worker.context_limit, "kv": self.worker.kv_slots(),
                "kv_budget": kv_budget(self.worker.verifier),
                "stop_token_ids": sorted(self.runtime.stop_token_ids), "replica": self.replica_id,
                "vocab_size": self.runtime.forward.vocab_size,
                "step_profile": self.step_profile,
                "torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}

    def _on_critical_path(self) -> None:
        """Run this thread (and the OpenMP team it starts) at normal priority. Ray starts worker
        processes at nice 15, so on a small machine every other Ray process (controller, proxy,
        ingress) preempts a verifier thread, and one preempted OpenMP thread stalls its whole
        team (measured on 2 cores: a step is slower at nice 15 than at nice 0, and slower still
        than embedded; README.md, "Serving path and start-up times"). Best effort: lowering a
        nice value needs privileges."""
        tid = threading.get_native_id()
        if tid in self._reniced:
            return
        self._reniced.add(tid)
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)    # Linux: a thread id sets that thread
        except (OSError, AttributeError):
            pass

    def prefill(self, request_id: str, token_ids: list[int], *, prompt_len: int,
                sampling: SamplingParams, max_new_tokens: int, tenant: str, drafter: str | None,
                replica: str | None, loads: Mapping[str, int] | None = None,
                assigned: Mapping[str, int] | None = None, avoid: Sequence[str] | None = None,
                free: Mapping[str, float] | None = None, prefer: str | None = None,
                release: dict | None = None, defer: bool = False,
                grammar: str | None = None) -> dict[str, Any]:
        """`loads`, `assigned`, `avoid`, `free`, `prefer`: for the router
        (gateway/ray_serve/routing.py); `grammar`: the request's compiled grammar, serialized
        (read back here before the lock: steps never wait on it)."""
        self._on_critical_path()
        take_grammar(self.runtime.grammars, sampling, grammar)
        with self._lock:
            t0 = time.perf_counter()
            self._release((release or {}).get(self.replica_id, ()))   # see VerifierPool.prefill
            self.worker.release(request_id)     # a stale copy (a restarted scheduler's request)
            self._note(request_id, "prefill")
            done = self.worker.prefill(request_id, token_ids, prompt_len=prompt_len, sampling=sampling,
                                       max_new_tokens=max_new_tokens, tenant=tenant, drafter=drafter,
                                       defer=defer)
            return {"replica": self.replica_id, "busy_s": time.perf_counter() - t0,
                    "cached": done.cached, "features": done.features, "pending": done.pending,
                    "kv_tokens": done.kv_tokens, "kv": self.worker.kv_slots(),
                    "prefix_cache": self.worker.prefix_cache_usage()}

    def step(self, items: list, *, replica: str, release: list = ()) -> dict[str, Any]:
        """{"results": StepResults, "missing": request ids not held here, "busy_s": time spent}.
        A batch naming a request this replica does not hold (it was routed here because its home
        died) is not run at all: the pool re-prefills those requests and sends the batch again."""
        self._on_critical_path()
        t0 = time.perf_counter()
        with self._lock:
            self._release(release)
            held = set(self.worker.resident())
            missing = [item.request_id for item in items if item.request_id not in held]
            if missing:
                return {"results": [], "missing": missing, "busy_s": 0.0}
            for item in items:
                self._note(item.request_id, "step")
            d0 = self.worker.draft_s
            results = self.worker.step(items)
            draft_s = self.worker.draft_s - d0
            cache, kv = self.worker.prefix_cache_usage(), self.worker.kv_slots()
        return {"results": results, "missing": [], "busy_s": time.perf_counter() - t0, "draft_s": draft_s,
                "prefix_cache": cache, "kv": kv}

    def release(self, entries: list, *, replica: str) -> None:
        with self._lock:
            self._release(entries)

    def resident(self, *, replica: str | None = None) -> list[str]:
        with self._lock:
            return self.worker.resident()

    def tenant_blocks(self, tenant: str, *, replica: str | None = None) -> int:
        """Prefix-cache blocks this replica holds for a tenant id (a diagnostic: removal frees them)."""
        with self._lock:
            pc = self.worker.verifier.prefix_cache
            return 0 if pc is None else pc.tenant_len(tenant)

    def served_requests(self, *, replica: str | None = None) -> dict[str, dict[str, int]]:
        """What this replica has served, per request (call with `replica=` to ask a given one)."""
        with self._lock:
            return {rid: dict(c) for rid, c in self.served.items()}

    def _note(self, request_id: str, call: str) -> None:
        if request_id not in self.served and len(self.served) >= SERVED_KEPT:
            del self.served[next(iter(self.served))]            # the oldest: bounded memory
        self.served[request_id][call] += 1

    def _release(self, entries) -> None:
        apply_releases(self.worker, entries)


def take_grammar(grammars: Any, sampling: SamplingParams, grammar: str | None) -> None:
    """Keep a shipped grammar (workers.speculation.grammars.Grammars.install) where the prefill
    and the grammar drafter will look for it."""
    if grammar is not None and sampling.constraint:
        grammars.install(sampling.constraint, grammar)


class DraftServer:
    """One draft replica (CPU): the drafters, for the verifier replicas' steps."""

    def __init__(self) -> None:
        from gateway.ray_serve.draft_pool import DraftService     # the drafters: torch (see above)

        self.service = DraftService()
        self._lock = threading.Lock()

    def propose(self, items: list, *, drafter: str, affinity: str | None = None,
                release: list = ()) -> list:
        with self._lock:
            return self.service.propose(items, drafter, release)

    def forget(self, entries: list, *, drafter: str, affinity: str | None = None) -> None:
        with self._lock:
            self.service.forget(entries, drafter)

    def proposed(self) -> int:
        return self.service.proposed


class SchedulerServer:
    """The one scheduler replica: the embedded service and step loop, over the verifier replicas."""

    # Set by __init__; declared here so that __del__ knows what a failed __init__ left unset.
    embedded: Embedded | None = None
    lease: Lease | None = None
    lease_lost = False
    _stopping: threading.Event | None = None

    async def __init__(self, settings: dict[str, Any], verifier: Any) -> None:
        # the tokenizer's loader imports the model code (torch): this replica's alone
        from workers.model.loader import load_tokenizer, resolve_model

        s = settings_in_replica(settings, SCHEDULER_READS)     # the Redis URL, from its node
        info = await verifier.describe.remote()
        self._tokenizer = await asyncio.to_thread(
            load_tokenizer, str(resolve_model(s.model, progress=False)), progress=False)
        # the grammars this scheduler compiles (its compile processes) and ships to the verifier
        # replicas; cheap until the first constrained request
        from workers.speculation.grammars import Grammars

        grammars = Grammars.from_tokenizer(self._tokenizer, info["vocab_size"], info["stop_token_ids"],
                                           ships=True)
        self.pool = VerifierPool(verifier, context_limit=info["context_limit"], grammars=grammars)
        self.pool.note(info["replica"], info)           # the planner knows one budget from the start
        # each verifier replica's own KV budget, refreshed every step from their answers
        kv, kv_note = replica_kv_budget(*info.get("kv_budget") or ({}, None))
        target = Target(self._tokenizer, self.pool, frozenset(info["stop_token_ids"]),
                        planner_step_cost(s, None, info["step_profile"]), grammars=grammars, kv=kv,
                        kv_note=kv_note)
        # the ingress replicas apply the tenants file and the admin keys: this one holds no key
        self.embedded = await asyncio.to_thread(assemble, s, target, configure_tenants=False,
                                                kv_budgets=self.pool.kv_budgets if kv else None)
        self.endpoint = SchedulerEndpoint(self.embedded.service)
        freeze_heap()
        if self.embedded.kv_note:                      # as `specgate serve` prints it
            print(f"specgate: {self.embedded.kv_note}", file=sys.stderr)
        # Step only while holding the scheduler lease: during a rolling update or an unnoticed
        # crash Serve may run two scheduler replicas at once (scheduler/lease.py).
        holder = serve.get_replica_context().replica_id.unique_id
        self._redis = redis_client(s.redis_url, s.redis_timeout_s)   # timed out, as every client
        self.lease = Lease(self._redis, lease_key(s.store_prefix, s.replica_id), holder, LEASE_TTL_S)
        self.lease_lost = False
        self._stopping = threading.Event()
        threading.Thread(target=self._hold_lease, name="specgate-lease", daemon=True).start()

    def _hold_lease(self) -> None:
        """Wait for the lease, take over the stored requests, run the loop; stop if it is lost."""
        while not self._stopping.is_set() and not self._try(self.lease.try_acquire):
            self._stopping.wait(LEASE_TTL_S / 10)
        if self._stopping.is_set():
            return
        self.embedded.recovered = self.embedded.step_loop.recover()
        # background responses run on; requests whose clients went with the old replica are
        # cancelled (GenerationService.take_over)
        self.embedded.cancelled = self.embedded.service.take_over(self.embedded.recovered)
        self.embedded.start()
        while not self._stopping.wait(LEASE_TTL_S / 3):
            if not self._try(self.lease.renew):
                log.error("scheduler lease lost: stopping this replica's step loop")
                self.lease_lost = True
                self.embedded.step_loop.stop()
                return

    @staticmethod
    def _try(call) -> bool:
        try:
            return bool(call())
        except Exception:                          # Redis away: not ours (yet)
            return False

    async def generate(self, inp: GenerateInput) -> tuple:
        return await self.endpoint.generate(inp)

    async def stream(self, inp: GenerateInput):
        async for message in self.endpoint.stream(inp):
            yield message

    async def open_detached(self, inp: GenerateInput) -> tuple:
        return await self.endpoint.open_detached(inp)

    def cancel(self, request_id: str) -> None:
        self.endpoint.cancel(request_id)

    def ready(self) -> bool:
        return self.embedded.service.ready()

    def count_refusal(self, tenant: str, kind: str) -> None:
        """An ingress replica refused a request of `tenant` by its `kind` of rate limit (its
        rpm, as the request arrived): counted here, where /metrics reads from."""
        self.embedded.service.metrics.refused(tenant, kind, "rate_limited")

    def tokenizer(self) -> Any:
        """The tokenizer requests are tokenized with, for the ingress replicas (they load no
        model code of their own: gateway/ray_serve/ingress.py)."""
        return self._tokenizer

    async def forget_tenant(self, tenant_id: str, name: str) -> None:
        """A removed tenant: its caches on the verifier and draft replicas and its metric series
        go (`GenerationService.forget_tenant`; the verifier pool tells every replica)."""
        await self.embedded.service.forget_tenant(tenant_id, name)

    def homes(self) -> dict[str, str]:
        """Request id -> verifier replica for the requests resident now (a diagnostic)."""
        return dict(self.pool.home)

    def calls(self) -> dict[str, int]:
        return dict(self.pool.calls)

    def kv_budgets(self) -> dict[str, dict]:
        """The verifier replicas' KV pools as last reported (`reported`: replica -> (budget,
        held) in slots) and the budgets the planner last planned by (`planned`; a diagnostic)."""
        return {"reported": self.pool.kv_budgets(),
                "planned": dict(self.embedded.step_loop.state.kv_budgets)}

    def timing(self) -> dict[str, float]:
        """Where the scheduler's time went: `loop_s` (iterations that verified something, whole),
        `compute_s` (inside the verifier replicas' prefills and steps), `draft_s` (of that, drafting,
        draft workers' round trips included), `steps`."""
        return {"loop_s": self.embedded.step_loop.busy_s, "compute_s": self.pool.busy_s,
                "draft_s": self.pool.draft_s, "steps": self.embedded.step_loop.steps}

    def metrics(self) -> tuple[bytes, str]:
        """The Prometheus exposition of the service and step loop (the ingress serves it)."""
        return self.embedded.metrics.render()

    def replaced(self) -> int:
        """Requests prefilled again after their verifier replica was lost."""
        return self.pool.replaced

    def check_health(self) -> None:
        if self.lease_lost:
            raise RuntimeError("lost the scheduler lease to another replica")
        if self.embedded.thread is not None and not self.embedded.loop_alive():
            raise RuntimeError("the step loop has stopped")

    def __del__(self) -> None:
        """Serve's shutdown: stop stepping, then hand the lease over at once."""
        if self._stopping is not None:
            self._stopping.set()
        if self.embedded is not None and self.embedded.thread is not None:
            self.embedded.stop()
        if self.lease is not None and not self.lease_lost:
            try:
                self.lease.release()
            except Exception:
                pass


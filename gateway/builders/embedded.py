"""The embedded builder: everything one embedded gateway is made of, assembled in one place.

Start-up, in order: the target model (or the fake worker) and its step-cost profile → policy,
state store, step loop → recovery of the requests the store still holds → tenants, limiter,
service, app. `build_embedded` does everything but listen (`gateway.cli.serve` listens), so tests
and benchmarks assemble the same app; Ray mode's scheduler replica builds the same thing over
its verifier replicas (`gateway.builders.ray_app`).
"""
from __future__ import annotations

import gc
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from gateway.builders.replica import ReplicaLease, replica_prefix
from gateway.http.app import build_app
from gateway.metrics import GatewayMetrics
from gateway.service import GenerationService
from gateway.settings import Settings
from gateway.text import ToyTokenizer
from scheduler.admission import AdmissionControl, AdmissionLimits
from scheduler.loop import StepLoop
from scheduler.policies import make_policy
from scheduler.sizing import SizingConfig
from scheduler.length_learner import MODEL_NAME, LengthLearner, shipped_predictor
from scheduler.length_oracle import LengthOracle, true_remaining
from scheduler.store import open_store
from workers.fake_worker import PacedFakeWorker

log = logging.getLogger(__name__)


@dataclass
class Embedded:
    """Everything one embedded gateway is made of (`start`/`stop` run the step loop's thread)."""
    settings: Settings
    app: Any
    service: GenerationService
    step_loop: StepLoop
    tenants: Any
    limiter: Any
    metrics: GatewayMetrics
    dev_key: str | None = None          # the dev tenant's key, when one was created now
    admin_key: str | None = None        # an admin key generated now (dev set-up only)
    recovered: list[str] = field(default_factory=list)
    thread: Any = None
    kv_note: str | None = None          # the KV budget, as reported at start
    _sweeping: Any = None               # set to stop the tenant sweep (`_sweep_tenants`)
    replica: Any = None                 # the replica id's lease (gateway/builders/replica.py)
    responses: Any = None               # the Responses API (gateway/responses/service.py)
    cancelled: list[str] = field(default_factory=list)   # recovered, nobody left to receive them

    def start(self) -> None:
        self.thread = self.step_loop.start()
        if self.replica is not None:
            self.replica.hold(self.step_loop, on_lost=self.step_loop.stop, alive=self.loop_alive)
        every = self.settings.tenant_sweep_s
        if self.settings.redis_url and every > 0:      # in memory, every DELETE is heard here
            self._sweeping = threading.Event()
            threading.Thread(target=self._sweep_tenants, args=(self._sweeping, every),
                             name="specgate-tenant-sweep", daemon=True).start()

    def stop(self) -> None:
        if self._sweeping is not None:
            self._sweeping.set()
            self._sweeping = None
        self.step_loop.stop()
        self.thread = None
        if self.replica is not None:
            self.replica.release()
        self.step_loop.store.close()

    def _sweep_tenants(self, stopping: threading.Event, every_s: float) -> None:
        """A tenant removed through another replica (over the same Redis) is dropped here too:
        its caches and series (`GenerationService.sweep_tenants`)."""
        while not stopping.wait(every_s):
            try:
                self.service.sweep_tenants(self.tenants.list)
            except Exception as exc:                   # the store away: try again next time
                log.warning("tenant sweep failed: %s", exc)

    def loop_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


def responses_service(settings: Settings, service: Any, records: Any, tokenizer: Any, *,
                      local: bool = True) -> Any:
    """The Responses API over `service` (gateway/responses): stored responses under the shared
    prefix, so that any replica answers for any response; `records`: the scheduler's state store.
    `local`: the step loop runs in this process, so its detached requests are kept here when
    they end (Ray mode's ingress: False; its scheduler replica keeps them)."""
    from gateway.responses.service import ResponseService
    from gateway.responses.store import open_responses

    store = open_responses(settings.redis_url, settings.store_prefix, settings.responses_ttl_s,
                           settings.redis_timeout_s)
    responses = ResponseService(service, store, records, tokenizer)
    if local:
        service.detached_ended.append(responses.finalize)
    return responses


def scheduler_prefix(settings: Settings) -> str:
    """Where this replica's scheduler keeps its requests (tenants and limits are shared)."""
    return replica_prefix(settings.store_prefix, settings.replica_id)


def build_embedded(settings: Settings, *, progress: bool = True, runtime: Any = None,
                   target: tuple | None = None, recover: bool = True,
                   kv: tuple[dict[str, int], str | None] | None = None,
                   kv_budgets: Callable[[], Mapping[str, tuple[int, int]]] | None = None) -> Embedded:
    """Everything but the listening: `runtime` (a `workers.runtime.Runtime` already loaded, e.g.
    by a test or a benchmark) is used instead of loading `settings.model`; `target` (tokenizer,
    worker, stop token ids, step-cost model) replaces the model altogether (Ray mode's scheduler
    drives verifier replicas through `gateway.ray_serve.verifier_pool.VerifierPool`). `recover=False` leaves
    recovery from the store to the caller (Ray mode recovers once it holds the scheduler lease).
    `kv`: the policy's KV fields and start note when the caller knows them (Ray mode:
    `replica_kv_budget`), else from the worker (`kv_budget`); `kv_budgets`: a budget per home,
    which the step loop hands the planner every step (Ray mode: `VerifierPool.kv_budgets`)."""
    from gateway.tenancy.limits import Limiter
    from gateway.tenancy.records import new_api_key
    from gateway.tenancy.tenants import TenantRegistry

    # grammars: the worker's compiled constraints when it runs in this process, so the service
    # checks a schema with the same compile (None: the service compiles its own)
    tokenizer, worker, stop_ids, step_cost, grammars = (*target, None) if target else \
        _target(settings, progress, runtime)
    metrics = GatewayMetrics()
    max_resident = max(settings.max_resident, settings.max_batch)
    kv, kv_note = kv if kv is not None else kv_budget(worker)
    # The policy starts a new request only while KV room is left, so the loop never has to evict
    # (evict, re-prefill, fall further behind: the simulator's meltdown under bursts).
    oracle = LengthOracle.load(settings.length_oracle) if settings.length_oracle else None
    extra = {"oracle": true_remaining} if settings.policy == "srpt" else {}
    policy = make_policy(settings.policy, max_batch=settings.max_batch,
                         token_budget=settings.token_budget,
                         sizing=SizingConfig(max_tree_tokens=settings.max_tree_tokens),
                         step_cost=step_cost, max_resident=max_resident,
                         prefill_chunk_tokens=settings.prefill_chunk_tokens, **kv, **extra)
    admission = AdmissionControl(AdmissionLimits(
        max_live=settings.max_live, max_live_per_tenant=settings.max_live_per_tenant,
        per_tenant={}))                               # filled per tenant by the service
    timeout_s = settings.redis_timeout_s        # every Redis client: scheduler/store/redis_client.py
    store = open_store(settings.redis_url, scheduler_prefix(settings), ended_ttl_s=settings.ended_ttl_s,
                       timeout_s=timeout_s)
    lengths = None
    if settings.length_predictor and not settings.fake_worker:
        # weights are shared by every replica of this model: the shared prefix, not the replica's
        shipped = shipped_predictor(settings.model)
        lengths = LengthLearner(open_store(settings.redis_url, settings.store_prefix,
                                           timeout_s=timeout_s),
                                name=f"{MODEL_NAME}:{settings.model_id}",
                                initial=shipped[0] if shipped else None,
                                ridge=shipped[1] if shipped else 1.0)
    step_loop = StepLoop(policy, metrics.instrument(worker), store, admission=admission,
                         max_resident=max_resident, lengths=lengths, kv_budgets=kv_budgets)
    replica = None
    if recover and settings.redis_url:
        # one process per replica id: taken before recovery, so two never step the same requests
        from scheduler.store.redis_client import redis_client
        replica = ReplicaLease(redis_client(settings.redis_url, timeout_s), settings.store_prefix,
                               settings.replica_id, settings.replica_lease_s,
                               ended_ttl_s=settings.ended_ttl_s)
        replica.acquire()
    recovered = step_loop.recover() if recover else []
    tenants = TenantRegistry.from_settings(settings)   # the configured admin keys, too
    dev_key = tenants.ensure_dev_tenant()
    admin_key = None
    if settings.admin_key is None and dev_key is not None:   # a fresh dev set-up: an admin key too
        admin_key = new_api_key()
        tenants.add_admin_key(admin_key)
    limiter = Limiter(settings.redis_url, settings.store_prefix, timeout_s=timeout_s,
                      lease_s=settings.concurrency_lease_s)
    emb = Embedded(settings, None, None, step_loop, tenants, limiter, metrics, dev_key, admin_key,
                   recovered, kv_note=kv_note, replica=replica)
    if kv_note:
        log.info(kv_note)
    checks: list[Callable[[], bool]] = [emb.loop_alive]
    components: dict[str, Callable[[], bool]] = {"step_loop": emb.loop_alive}
    store_probe = None
    if settings.redis_url:
        from scheduler.store.redis_client import StoreProbe, redis_client
        # the store answers a ping (bounded, cached) and the loop's writes go through
        probe = StoreProbe(redis_client(settings.redis_url, timeout_s))
        checks += [probe, step_loop.store_writing]
        components["state_store"] = probe.last                # a scrape runs on the event loop
        components["state_store_writes"] = step_loop.store_writing
        store_probe = probe
    metrics.watch(step_loop, components)
    emb.service = GenerationService(step_loop, tokenizer, models=[settings.model_id],
                                    limiter=limiter, metrics=metrics, stop_token_ids=stop_ids,
                                    drafters=settings.drafter_names, ready_checks=checks,
                                    length_oracle=oracle, grammars=grammars)
    emb.app = build_app(settings, emb.service, tenants, limiter, metrics)
    emb.app.state.store_probe = store_probe       # new requests fail fast while Redis is away
    emb.app.state.responses = emb.responses = responses_service(settings, emb.service, store, tokenizer)
    # what the old process left running: background responses go on (and are kept when they
    # end); requests whose clients' connections died with it are cancelled; usage corrected
    emb.cancelled = emb.service.take_over(recovered)
    return emb


def kv_budget(worker: Any) -> tuple[dict[str, int], str | None]:
    """The policy's KV budget fields for a worker whose verifier has a KV pool, and the line
    reported at start; ({}, None) for workers without one (the fake worker, Ray mode's pool of
    verifier replicas: there each replica computes this for its own pool and the scheduler turns
    it into a budget per replica, `replica_kv_budget`)."""
    verifier = getattr(worker, "verifier", None)
    pool = getattr(verifier, "kv_pool_bytes", None)
    if pool is None:
        return {}, None
    per, slots = verifier.slot_bytes, verifier.kv_budget_slots
    note = (f"KV cache {pool / 2**20:,.0f} MiB: {slots:,} tokens at {per / 1024:.1f} KiB each "
            f"(requests and prefix cache; --kv-cache-mb)")
    return {"kv_budget_tokens": slots, "kv_block": verifier.kv_block,
            "kv_tree_tokens": verifier.max_tree_tokens + 1}, note


def freeze_heap() -> None:
    """Call once a serving process has loaded its model and built its app: collect, then move
    every object that survives into the collector's permanent generation (`gc.freeze`). A full
    collection walks every tracked object, and a loaded model and web stack are hundreds of
    thousands of them, all alive for good: walked, such a collection holds the GIL long enough
    to stall every stream for a step or more, at moments nobody chooses. Frozen, they are never
    walked again; collections see only what serving creates. Not for a process that builds and
    drops many apps (tests): what is frozen is never freed."""
    gc.collect()
    gc.freeze()


def replica_kv_budget(fields: dict[str, int], note: str | None) -> tuple[dict[str, int], str | None]:
    """Ray mode's policy KV fields and start note, from one verifier replica's `kv_budget` (what
    `kv_budget` gives for its worker): every replica has a budget of its own, which the planner
    gets per replica every step (`StepLoop(kv_budgets=...)`), so the policy keeps the block and
    tree sizes only. ({}, None) for replicas without a KV pool.

    >>> replica_kv_budget({"kv_budget_tokens": 4096, "kv_block": 256, "kv_tree_tokens": 65}, "KV cache 16 MiB")
    ({'kv_block': 256, 'kv_tree_tokens': 65}, 'KV cache 16 MiB per verifier replica; the planner keeps each replica within its own')
    """
    if not fields:
        return {}, None
    fields = {k: v for k, v in fields.items() if k != "kv_budget_tokens"}
    return fields, f"{note} per verifier replica; the planner keeps each replica within its own"


def default_kv_cache_mb(device: Any = None) -> float:
    """Half the memory available now (the model loaded) where the KV lives: what KV may take by
    default. On a GPU, its free memory; on the CPU, Linux's MemAvailable (free memory plus what
    caches would give back), else free pages."""
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        from workers.model.device import free_bytes

        return free_bytes(device) / 2 / 2**20
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 2 / 2**20
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2 / 2**20


def _target(settings: Settings, progress: bool, runtime: Any = None):
    """(tokenizer, worker, stop token ids, policy step-cost model, grammars or None) for the
    settings."""
    from workers.drafters.registry import drafter_names, is_drafter_name

    unknown = [d for d in settings.drafter_names if not is_drafter_name(d)]
    if unknown:
        raise ValueError(f"unknown drafter {unknown[0]!r}; available: {', '.join(drafter_names())}")
    if settings.fake_worker:
        tok = ToyTokenizer()
        worker = PacedFakeWorker(settings.fake_step_ms / 1000, context_limit=settings.fake_context)
        return tok, worker, {tok.eos_token_id}, None, None
    from workers.runtime import load_runtime

    rt = runtime or load_runtime(settings.model, dtype=settings.dtype, device=settings.device,
                                 attention=settings.attention,
                                 progress=progress)
    return (rt.tokenizer, batch_worker(settings, rt), rt.stop_token_ids, planner_step_cost(settings, rt),
            rt.grammars)


def planner_step_cost(settings: Settings, rt: Any, measured: dict | None = None) -> Any:
    """The step costs the planner sizes tree budgets by: `settings.step_profile` when set, else
    `measured` (a verifier replica's start-up profile, Ray mode), else measured now on `rt`."""
    from scheduler.profile import StepCostModel

    if settings.step_profile is not None:
        return StepCostModel.from_json(settings.step_profile)
    if measured is None:
        measured = rt.step_profile(settings.max_batch, settings.max_tree_tokens)
    return StepCostModel.from_doc(measured)


def batch_worker(settings: Settings, rt: Any, drafters: dict | None = None) -> Any:
    """The model worker for a loaded runtime: in process (embedded) or in a verifier replica (Ray,
    where `drafters` are the draft workers' remote drafters by name)."""
    from workers.speculation.batch_worker import BatchWorker

    kv_mb = settings.kv_cache_mb if settings.kv_cache_mb is not None else default_kv_cache_mb(rt.forward.device)
    verifier = rt.verifier(max_tree_tokens=max(64, settings.max_tree_tokens),
                           prefix_cache_mb=min(settings.prefix_cache_mb, kv_mb), kv_pool_mb=kv_mb,
                           prefix_cache_tenant_share=settings.prefix_cache_tenant_share)
    verifier.features = settings.length_predictor     # the length predictor reads them
    return BatchWorker(verifier, default_drafter=settings.drafter_names[0], drafters=drafters,
                       grammar=rt.grammar_drafter())

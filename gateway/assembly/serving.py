"""A serving gateway over a target: policy, state store, step loop, tenants, limiter, service,
app and the Responses API, assembled in one place.

`assemble` builds everything but the target (gateway/assembly/target.py), the recovery of stored
requests and the listening: the embedded builder (`gateway.builders.embedded`) adds a replica
lease and recovery over a target loaded in process; Ray mode's scheduler replica
(`gateway.ray_serve.deployments.SchedulerServer`) builds the same over its verifier replicas and
recovers once it holds the scheduler lease.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from gateway.assembly.fleet import CancelInbox, FleetRecords, owners_prefix
from gateway.assembly.replica import ReplicaLease, scheduler_prefix
from gateway.assembly.target import Target
from gateway.followers import FollowerGate
from gateway.http.app import build_app
from gateway.metrics import GatewayMetrics
from gateway.replay import Replayer
from gateway.responses.quota import Quota
from gateway.responses.service import ResponseService
from gateway.responses.store import open_responses
from gateway.service import GenerationService
from gateway.service.constraint import GrammarLimits
from gateway.service.stream import Backlog
from gateway.settings import Settings
from gateway.tenancy.limits import Limiter
from gateway.tenancy.records import new_api_key
from gateway.tenancy.tenants import TenantRegistry
from gateway.tiers import wait_bounds
from scheduler.admission import AdmissionControl, AdmissionLimits
from scheduler.length_learner import MODEL_NAME, LengthLearner, shipped_predictor
from scheduler.length_oracle import LengthOracle, true_remaining
from scheduler.loop import StepLoop
from scheduler.policies import make_policy
from scheduler.sizing import SizingConfig
from scheduler.store import open_store
from scheduler.store.base import RecordReader
from scheduler.store.redis_client import StoreProbe, redis_client
from scheduler.store.room import StoreRoom

log = logging.getLogger(__name__)


@dataclass
class Embedded:
    """Everything one gateway process's serving is made of (`start`/`stop` run the step loop's
    thread)."""
    settings: Settings
    app: Any
    service: GenerationService
    step_loop: StepLoop
    tenants: TenantRegistry
    limiter: Limiter
    metrics: GatewayMetrics
    dev_key: str | None = None          # the dev tenant's key, when one was created now
    admin_key: str | None = None        # an admin key generated now (dev set-up only)
    recovered: list[str] = field(default_factory=list)
    thread: Any = None
    kv_note: str | None = None          # the KV budget, as reported at start
    kernel_note: str | None = None      # which path runs the CPU kernels, as reported at start
    _sweeping: threading.Event | None = None    # set to stop the tenant sweep (`_sweep_tenants`)
    replica: ReplicaLease | None = None         # the replica id's lease (gateway/assembly/replica.py)
    responses: ResponseService | None = None    # the Responses API (gateway/responses/service.py)
    replayer: Replayer | None = None    # resumed streams (REST and gRPC) read the state store
    followers: FollowerGate | None = None   # what following a stream costs (REST and gRPC)
    cancelled: list[str] = field(default_factory=list)   # recovered, nobody left to receive them
    cancels: CancelInbox | None = None  # other replicas' cancels of this one's requests (Redis)

    def start(self) -> None:
        self.thread = self.step_loop.start()
        if self.replica is not None:
            self.replica.hold(self.step_loop, on_lost=self.step_loop.stop, alive=self.loop_alive)
        if self.cancels is not None:
            self.cancels.start()
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
        if self.cancels is not None:
            self.cancels.stop()
        if self.replica is not None:
            self.replica.release()
        self.step_loop.store.close()

    def _sweep_tenants(self, stopping: threading.Event, every_s: float) -> None:
        """A tenant removed through another replica (over the same Redis) is dropped here too:
        its caches and series (`GenerationService.sweep_tenants`); and stored responses of
        removed tenants that outlived their removal go (`ResponseService.sweep_tenants`)."""
        while not stopping.wait(every_s):
            try:
                self.service.sweep_tenants(self.tenants.list)
                if self.responses is not None:
                    self.responses.sweep_tenants(self.tenants.list)
            except Exception as exc:                   # the store away: try again next time
                log.warning("tenant sweep failed: %s", exc)

    def loop_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


def assemble(settings: Settings, target: Target, *, replica: ReplicaLease | None = None,
             kv_budgets: Callable[[], Mapping[str, tuple[int, int]]] | None = None,
             configure_tenants: bool = True) -> Embedded:
    """Everything over `target` but recovery and the listening. `replica`: the replica id's
    lease, already taken (embedded over Redis); `kv_budgets`: a budget per home, which the step
    loop hands the planner every step (Ray mode: `VerifierPool.kv_budgets`).
    `configure_tenants=False`: the tenant store as it is, no tenants file, admin keys or dev
    tenant applied (Ray mode's scheduler replica: its ingress replicas do that, with the keys
    it is not given)."""
    metrics = GatewayMetrics(tiers=settings.service_tiers)
    step_loop = _step_loop(settings, target, metrics, kv_budgets)
    # the configured admin keys, too
    tenants = TenantRegistry.from_settings(settings, configure=configure_tenants)
    dev_key = tenants.ensure_dev_tenant() if configure_tenants else None
    admin_key = None
    if settings.admin_key is None and dev_key is not None:   # a fresh dev set-up: an admin key too
        admin_key = new_api_key()
        tenants.add_admin_key(admin_key)
    limiter = Limiter(settings.redis_url, settings.store_prefix, timeout_s=settings.redis_timeout_s,
                      lease_s=settings.concurrency_lease_s)
    emb = Embedded(settings, None, None, step_loop, tenants, limiter, metrics, dev_key, admin_key,
                   kv_note=target.kv_note, kernel_note=target.kernel_note, replica=replica)
    if target.kv_note:
        log.info(target.kv_note)
    if target.kernel_path is not None:
        metrics.cpu_kernels(target.kernel_path)
    checks: list[Callable[[], bool]] = [emb.loop_alive]
    components: dict[str, Callable[[], bool]] = {"step_loop": emb.loop_alive}
    store_probe = store_room = None
    if settings.redis_url:
        # the store answers a ping (bounded, cached), the loop's writes go through, and it is
        # below its memory watermark (INFO memory, bounded, cached)
        store_probe = StoreProbe(redis_client(settings.redis_url, settings.redis_timeout_s))
        store_room = room_of(settings)
        checks += [store_probe, step_loop.store_writing, store_room.has_room]
        components["state_store"] = store_probe.last                # a scrape runs on the event loop
        components["state_store_writes"] = step_loop.store_writing
        components["state_store_room"] = store_room.has_room_now     # never waits either
    metrics.watch(step_loop, components)
    oracle = LengthOracle.load(settings.length_oracle) if settings.length_oracle else None
    emb.service = GenerationService(step_loop, target.tokenizer, models=[settings.model_id],
                                    limiter=limiter, metrics=metrics,
                                    stop_token_ids=target.stop_token_ids,
                                    drafters=settings.drafter_names, ready_checks=checks,
                                    length_oracle=oracle, grammars=target.grammars,
                                    grammar_limits=GrammarLimits.from_settings(settings),
                                    store_full=store_room.full if store_room else None,
                                    backlog=Backlog(settings.stream_backlog_tokens,
                                                    settings.stream_resume_tokens))
    records: RecordReader = step_loop.store
    cancel = None                   # the service's: this replica's step loop
    if settings.redis_url:          # any replica over this Redis answers for any request
        fleet = FleetRecords.from_url(settings.redis_url, settings.store_prefix,
                                      settings.replica_id, step_loop.store, step_loop.cancel,
                                      settings.redis_timeout_s)
        records, cancel = fleet, fleet.cancel
        emb.cancels = CancelInbox(settings.redis_url, settings.store_prefix, settings.replica_id,
                                  step_loop.cancel, settings.redis_timeout_s)
    emb.responses = responses_service(settings, emb.service, records, target.tokenizer,
                                      cancel=cancel)
    emb.replayer = Replayer(records, target.tokenizer)
    emb.followers = FollowerGate(limiter, settings.max_followers_per_tenant, metrics=metrics)
    # new requests fail fast while Redis is away (`store_probe`)
    emb.app = build_app(settings, emb.service, tenants, limiter, metrics, replayer=emb.replayer,
                        responses=emb.responses, store_probe=store_probe, store_room=store_room,
                        followers=emb.followers)
    return emb


def _step_loop(settings: Settings, target: Target, metrics: GatewayMetrics,
               kv_budgets: Callable[[], Mapping[str, tuple[int, int]]] | None) -> StepLoop:
    """The policy, admission, state store and length learner, and the step loop over them."""
    max_resident = max(settings.max_resident, settings.max_batch)
    # The policy starts a new request only while KV room is left, so the loop never has to evict
    # (evict, re-prefill, fall further behind: the simulator's meltdown under bursts).
    extra = {"oracle": true_remaining} if settings.policy == "srpt" else {}
    policy = make_policy(settings.policy, max_batch=settings.max_batch,
                         token_budget=settings.token_budget,
                         sizing=SizingConfig(max_tree_tokens=settings.max_tree_tokens),
                         step_cost=target.step_cost, max_resident=max_resident,
                         prefill_chunk_tokens=settings.prefill_chunk_tokens,
                         tenant_row_share=settings.tenant_row_share,
                         tier_wait_s=wait_bounds(settings.service_tiers), **target.kv, **extra)
    admission = AdmissionControl(AdmissionLimits(
        max_live=settings.max_live, max_live_per_tenant=settings.max_live_per_tenant,
        per_tenant={}))                               # filled per tenant by the service
    timeout_s = settings.redis_timeout_s        # every Redis client: scheduler/store/redis_client.py
    # each request's owner recorded, for the other replicas' readers (gateway/assembly/fleet.py)
    store = open_store(settings.redis_url, scheduler_prefix(settings), ended_ttl_s=settings.ended_ttl_s,
                       timeout_s=timeout_s,
                       owner=(owners_prefix(settings.store_prefix), settings.replica_id))
    lengths = None
    if settings.length_predictor and not settings.fake_worker:
        # weights are shared by every replica of this model: the shared prefix, not the replica's
        shipped = shipped_predictor(settings.model)
        lengths = LengthLearner(open_store(settings.redis_url, settings.store_prefix,
                                           timeout_s=timeout_s),
                                name=f"{MODEL_NAME}:{settings.model_id}",
                                initial=shipped[0] if shipped else None,
                                ridge=shipped[1] if shipped else 1.0)
    worker = metrics.instrument(target.worker)
    step_loop = StepLoop(policy, worker, store, admission=admission, max_resident=max_resident,
                         lengths=lengths, kv_budgets=kv_budgets)
    worker.follow(step_loop)
    if settings.slo_admission:                  # miss prediction: scheduler/forecast.py
        tiers = settings.service_tiers
        step_loop.forecast.configure({t: (o.ttft_s, o.ttft_prefill_allowance)
                                      for t, o in tiers.items()},
                                     {t: o.on_predicted_miss for t, o in tiers.items()})
    return step_loop


def responses_service(settings: Settings, service: Any, records: RecordReader, tokenizer: Any, *,
                      local: bool = True, cancel: Callable[[str], Any] | None = None) -> ResponseService:
    """The Responses API over `service` (gateway/responses): stored responses under the shared
    prefix, so that any replica answers for any response; `records`: the scheduler's state store.
    `local`: the step loop runs in this process, so its detached requests are kept here when
    they end (Ray mode's ingress: False; its scheduler replica keeps them). `cancel`: ends a
    request (default: the service's `cancel`; embedded over Redis: wherever it runs)."""
    store = open_responses(settings.redis_url, settings.store_prefix, settings.responses_ttl_s,
                           settings.redis_timeout_s)
    quota = Quota(settings.responses_ttl_s, settings.max_stored_responses,
                  settings.max_stored_response_bytes)
    responses = ResponseService(service, store, records, tokenizer, quota=quota, cancel=cancel)
    if local:
        service.detached_ended.append(responses.finalize)
    return responses


def room_of(settings: Settings) -> StoreRoom:
    """Redis's memory against `redis_memory_watermark` (scheduler/store/room.py): new requests
    are refused above it (503 store_full), and /ready says so."""
    return StoreRoom(redis_client(settings.redis_url, settings.redis_timeout_s),
                     settings.redis_memory_watermark)

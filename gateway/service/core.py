"""`GenerationService`: the façade REST, gRPC, the Responses API and Ray mode's scheduler replica
call. It holds the rooms together (prepare, admission, stream, tenant sync) and decides where
admission runs: on a worker thread, always.

NOTE: small requests were once admitted on the event loop (a thread hop costs more than
tokenizing a short prompt). Measured on the fake worker with the default model's tokenizer, that
bought no admissions per second and kept the loop from running anything else for as long as a
burst of them took; and what a request costs to prepare cannot be known without measuring it,
which for tools and schemas is itself work proportional to the request. So every request's
measure, templating, tokenizing and compiling happen off the loop, which only awaits them."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Sequence

from gateway import errors
from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics
from gateway.service.admission import Admission
from gateway.service.constraint import GrammarLimits
from gateway.service.prepare import RequestPreparer
from gateway.service.stream import Backlog, RequestStream, StreamParts
from gateway.service.tenant_sync import TenantSync
from gateway.service.types import GenerateInput, GenerateOutput, new_request_id
from gateway.takeover import take_over
from gateway.tenancy.grants import GrantKeeper
from gateway.tenancy.limits import Limiter
from gateway.tenancy.records import Tenant
from scheduler.length_oracle import LengthOracle
from scheduler.loop import StepLoop

log = logging.getLogger(__name__)


class GenerationService:
    def __init__(self, step_loop: StepLoop, tokenizer: Any, *, models: Sequence[str],
                 limiter: Limiter | None = None, metrics: GatewayMetrics | None = None,
                 stop_token_ids: Iterable[int] = (), drafters: Sequence[str] = ("ngram",),
                 ready_checks: Sequence[Callable[[], bool]] = (),
                 request_id: Callable[[str], str] = new_request_id,
                 length_oracle: LengthOracle | None = None, grammars: Any = None,
                 grammar_limits: GrammarLimits | None = None,
                 store_full: Callable[[], bool] | None = None, backlog: Backlog = Backlog()):
        """`models`: the ids served (the first is the target); `drafters`: the drafter names this
        deployment serves (a tenant's policy picks among them); `ready_checks`: each must return
        True (and not raise) for `ready()`; `request_id`, `length_oracle`, `grammars`,
        `grammar_limits`: the preparer's (gateway/service/prepare.py); `store_full`: is the state
        store above its memory watermark (`scheduler.store.room.StoreRoom.full`, never waiting):
        then new requests are refused as they arrive; `backlog`: when a stream whose reader
        fell behind is paused and resumed (gateway/service/stream.py)."""
        if not models:
            raise ValueError("a service needs at least one model id")
        self.step_loop = step_loop
        self.tokenizer = tokenizer
        self.models = list(models)
        self.metrics = metrics if metrics is not None else GatewayMetrics()
        self.stop_token_ids = tuple(sorted(stop_token_ids))
        self.drafters = tuple(drafters)
        self.ready_checks = tuple(ready_checks)
        self.store_full = store_full
        self.started_s = int(time.time())      # the models' "created" time
        self.preparer = RequestPreparer(tokenizer, models=models, stop_token_ids=self.stop_token_ids,
                                        drafters=drafters, request_id=request_id,
                                        length_oracle=length_oracle, grammars=grammars,
                                        grammar_limits=grammar_limits)
        self.tenants = TenantSync(step_loop, self.metrics)
        grants = GrantKeeper(limiter) if limiter is not None else None
        self.admission = Admission(step_loop, self.preparer, limiter=limiter, grants=grants,
                                   metrics=self.metrics, tenants=self.tenants)
        self._parts = StreamParts(tokenizer, self.metrics, grants, step_loop, self.adopt, backlog)
        # detached requests (`open_detached`): their draining tasks, and who hears they ended
        self._detached: set[asyncio.Task] = set()
        self.detached_ended: list[Callable[[str], None]] = []
        # recovered requests' ends are settled here (gateway/takeover.py): Redis calls, off the loop
        self.orphans = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specgate-orphans")

    @property
    def limiter(self) -> Limiter | None:
        return self.admission.limiter

    @property
    def grants(self) -> GrantKeeper | None:
        return self.admission.grants

    @property
    def template_tools(self) -> bool:
        return self.preparer.template_tools

    # ---- the interface ------------------------------------------------------------------------
    def ready(self) -> bool:
        for check in self.ready_checks:
            try:
                if not check():
                    return False
            except Exception:                          # an unreachable store is "not ready"
                return False
        return True

    async def generate(self, inp: GenerateInput) -> GenerateOutput:
        stream = await self.open_stream(inp)
        try:
            async for item in stream:
                if isinstance(item, GenerateOutput):
                    if item.finish_reason == "error":
                        raise ApiError(500, "generation failed; retry the request",
                                       code="generation_failed")
                    return item
        finally:
            await stream.aclose()
        raise AssertionError("a stream ends with its GenerateOutput")

    async def arrive(self, tenant: Tenant) -> None:
        """A request of `tenant` has arrived at a front (its key known, its body not yet read):
        charge it to the tenant's requests per minute, or refuse it (429 `rpm_exceeded`). The
        fronts call it first, so every later refusal of the request is charged too
        (gateway/tenancy/limits.py). Off the event loop when the limits live in Redis; a store
        that is down is a 503, and while the store is full (`store_full`) every arrival is a 503
        `store_full`, charged nothing: the store's state is no fault of the tenant's."""
        if self.store_full is not None and self.store_full():
            raise errors.store_full()
        if (refused := self.admission.refused_now(tenant)) is not None:
            raise refused
        await errors.store_call(self.admission.limits_remote, self.admission.arrive, tenant)

    async def open_stream(self, inp: GenerateInput) -> RequestStream:
        """`stream`, awaitable, with the checks, tokenization and the limiter on a worker thread
        (gateway/service/__init__.py): the call the routers make, so a remote service (Ray mode's
        `gateway.ray_serve.remote.RemoteService`) can admit the request over the network first."""
        t0 = time.perf_counter()
        if inp.tenant is None:
            raise errors.unauthorized()
        return await asyncio.to_thread(self._open, inp, inp.tenant, asyncio.get_running_loop(), t0)

    def stream(self, inp: GenerateInput) -> RequestStream:
        """Admit the request (raises ApiError) and return its event iterator. Call it on the
        event loop that will iterate it (the loop's thread posts events there)."""
        t0 = time.perf_counter()
        if inp.tenant is None:
            raise errors.unauthorized()
        return self._open(inp, inp.tenant, asyncio.get_running_loop(), t0)

    def _open(self, inp: GenerateInput, tenant: Tenant, aio: asyncio.AbstractEventLoop,
              t0: float) -> RequestStream:
        prep, grant = self.admission.admit(inp, tenant)
        stream = RequestStream(self._parts, prep, grant, aio, t0)
        self.admission.submit(stream)
        return stream

    # ---- detached requests ------------------------------------------------------------------------
    async def open_detached(self, inp: GenerateInput) -> str:
        """Admit a request that runs to its end whether or not anyone listens (a background
        response): refusals raise ApiError as `open_stream`'s do; returns its id. Readers follow
        it from the state store (gateway/responses). When it ends, each of `detached_ended` is
        called with its id, on a worker thread."""
        if not inp.detached:
            inp = replace(inp, detached=True)
        stream = await self.open_stream(inp)
        self.adopt(stream)
        return stream.request_id

    def adopt(self, stream: RequestStream) -> None:
        """Run a detached request's stream to its end with nobody listening (its grant released
        and `detached_ended` told when it ends): what `open_detached` does at once, and what a
        resumable chat stream's `close` does when its client goes away. The event loop's."""
        task = asyncio.get_running_loop().create_task(self._drain(stream))
        self._detached.add(task)
        task.add_done_callback(self._detached.discard)

    async def _drain(self, stream: RequestStream) -> None:
        try:
            async for _ in stream:
                pass
        finally:
            await stream.aclose()
        await asyncio.to_thread(self.tell_detached_ended, stream.request_id)

    def tell_detached_ended(self, request_id: str) -> None:
        for hear in self.detached_ended:
            try:
                hear(request_id)
            except Exception:
                log.exception("a listener of detached request %s failed", request_id)

    # ---- requests and tenants at run time ---------------------------------------------------------
    def cancel(self, request_id: str) -> None:
        """End a request at the next step boundary (a client's explicit cancel)."""
        self.step_loop.cancel(request_id)

    def take_over(self, request_ids: Iterable[str]) -> list[str]:
        """Look after requests a restarted step loop recovered (gateway/takeover.py): detached
        ones run on, the others are cancelled; usage corrected either way. Returns the ids
        cancelled."""
        return take_over(self, request_ids)

    async def forget_tenant(self, tenant_id: str, name: str) -> None:
        """A tenant was removed (the admin API's DELETE): the engine frees its caches, keyed by
        `tenant_id` (at the step loop's next boundary), and /metrics drops the series labelled
        `name`. Requests of it still running finish; what they add to the metrics afterwards
        shows again until the next removal of that name."""
        self.tenants.forget(tenant_id, name)

    def sweep_tenants(self, list_tenants: Callable[[], Iterable[Tenant]]) -> list[str]:
        """Forget every tenant this service has served that `list_tenants()` no longer holds
        (`TenantSync.sweep`): one removed through another gateway replica. Returns the ids."""
        return self.tenants.sweep(list_tenants)

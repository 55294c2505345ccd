"""Prometheus metrics, `specgate_*`, on a registry of their own (one per app, never the global one).

Four sources feed them:
  the service (event-loop side)   requests by tenant and outcome, TTFT and inter-token latency
                                  by tenant and service tier, whether each request met its tier's
                                  objectives (`RequestTimes`), end-to-end latency, tokens,
                                  rate-limit and queue refusals;
  each request's final stats      (delivered on the step loop's thread) queue time, time in
                                  steps, drafted and accepted tokens by tenant and drafter, τ
                                  per step;
  the step loop                   step duration and batch size, preemptions (`InstrumentedWorker`,
                                  a pass-through around the worker), and, read when scraped, live
                                  requests per level and status, and paused requests
                                  (gateway/collectors.py);
  the app's event loop            how late it runs a task (gateway/looplag.py).
prometheus-client's metrics are thread-safe, so both threads record directly.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from gateway.collectors import ObjectiveCollector, SchedulerCollector, ServedWorker
from gateway.looplag import LoopLag
from gateway.tiers import DEFAULT_TIERS, TierObjectives, attainment
from scheduler.loop import StepLoop
from scheduler.request import RequestStats
from scheduler.step_cost import StepCost
from workers.contract import StepResult, WorkItem

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
                         0.3, 0.5, 0.75, 1.0, 2.5)
# measured − predicted seconds: early and late alike (a histogram's sum ÷ count is the bias)
ERROR_BUCKETS = (-10.0, -5.0, -2.5, -1.0, -0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5,
                 1.0, 2.5, 5.0, 10.0)
TAU_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, *,
                 tiers: Mapping[str, TierObjectives] | None = None) -> None:
        """`tiers`: each service tier's objectives (gateway/tiers.py; default: its defaults),
        which requests are counted against and /metrics states (`specgate_slo_objective`)."""
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.tiers = dict(DEFAULT_TIERS if tiers is None else tiers)
        self.loop_lag = LoopLag(r)          # fed while an app over these metrics runs
        self.requests = Counter("specgate_requests", "Requests by tenant and outcome "
                                "(finished, cancelled, failed, rejected, rate_limited, "
                                "queue_full, overloaded)", ["tenant", "status"], registry=r)
        self.ttft = Histogram("specgate_time_to_first_token_seconds",
                              "From arrival at the gateway to the first output token",
                              ["tenant", "tier"], buckets=LATENCY_BUCKETS, registry=r)
        # measured − predicted TTFT of each request admission predicted (scheduler/miss.py)
        self.ttft_error = Histogram("specgate_ttft_prediction_error_seconds",
                                    "A request's measured minus predicted time to first token",
                                    ["tier"], buckets=ERROR_BUCKETS, registry=r)
        self.itl = Histogram("specgate_inter_token_latency_seconds",
                             "Gap between output tokens (a step that commits k tokens counts "
                             "its gap ÷ k, k times)", ["tenant", "tier"],
                             buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        # each request once per objective of its tier, when it ends (gateway/tiers.py
        # `attainment`): what the burn-rate alerts divide by the tier's error budget
        self.slo = Counter("specgate_slo_requests", "Requests by tenant, service tier, objective "
                           "(ttft, tbt) and result (met, missed) against the tier's target",
                           ["tenant", "tier", "objective", "result"], registry=r)
        self.e2e = Histogram("specgate_e2e_request_latency_seconds",
                             "From arrival at the gateway to the last token",
                             ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("specgate_queue_time_seconds",
                                    "From admission to the request's first step",
                                    ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        # end-to-end minus this is time spent waiting (queued, preempted), the part of latency
        # an order of service moves; `loadtest compare` reports the split per policy
        self.in_steps = Histogram("specgate_time_in_steps_seconds",
                                  "Time inside the verification steps a request was in, its "
                                  "own and its batch-mates' prefills included",
                                  ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specgate_prompt_tokens", "Prompt tokens of admitted requests",
                                     ["tenant"], registry=r)
        self.generation_tokens = Counter("specgate_generation_tokens",
                                         "Output tokens committed", ["tenant"], registry=r)
        self.drafted = Counter("specgate_drafted_tokens", "Draft tokens verified (tree nodes)",
                               ["tenant", "drafter"], registry=r)
        self.accepted = Counter("specgate_accepted_tokens", "Draft tokens accepted by the target",
                                ["tenant", "drafter"], registry=r)
        self.tau = Histogram("specgate_tau", "Tokens committed per step and request "
                             "(τ = accepted + 1)", ["tenant", "drafter"], buckets=TAU_BUCKETS,
                             registry=r)
        self.step_duration = Histogram("specgate_step_duration_seconds",
                                       "One verification step (draft + verify) of the batch",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("specgate_batch_size", "Requests per verification step",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.preemptions = Counter("specgate_preemptions",
                                   "Requests in one step's batch left out of the next "
                                   "while still live", registry=r)
        self.stream_paused = Counter("specgate_stream_pauses",
                                     "Streams paused in the scheduler because their reader fell "
                                     "behind (gateway/service/stream.py, backpressure)", registry=r)
        self.verified_tokens = Counter("specgate_verified_tokens",
                                       "Verifier work done for a tenant: per step and request, "
                                       "the root row plus every tree node", ["tenant"], registry=r)
        self.prefill_tokens = Counter("specgate_prefill_tokens",
                                      "Context tokens prefilled (prompts, and prompt + output when "
                                      "a request is prefilled again)", ["tenant"], registry=r)
        self.prefix_cache_hits = Counter("specgate_prefix_cache_hit_tokens",
                                         "Of the prefilled tokens, those whose KV came from the "
                                         "prefix cache", ["tenant"], registry=r)
        self.refusals = Counter("specgate_rate_limit_refusals",
                                "Requests refused by a tenant limit or a full queue",
                                ["tenant", "reason"], registry=r)
        # every metric with a tenant label: what `forget_tenant` clears
        self.by_tenant = (self.requests, self.ttft, self.itl, self.slo, self.e2e, self.queue_time,
                          self.in_steps, self.prompt_tokens, self.generation_tokens, self.drafted,
                          self.accepted, self.tau, self.verified_tokens, self.prefill_tokens,
                          self.prefix_cache_hits, self.refusals)
        r.register(ObjectiveCollector(self.tiers))

    def cpu_kernels(self, path: str) -> None:
        """Which path runs the model's CPU kernels (workers/model/small_gemm.py PATHS, "torch"
        for none), stated once at start: the speed of a CPU deployment depends on it."""
        Gauge("specgate_cpu_kernel_info", "The CPU kernel path the model runs (avx512_bf16, avx512f, "
              "avx2; torch: none)", ["path"], registry=self.registry).labels(path=path).set(1)

    # ---- the service ---------------------------------------------------------------------------
    def refused(self, tenant: str, reason: str, status: str) -> None:
        self.refusals.labels(tenant, reason).inc()
        self.requests.labels(tenant, status).inc()

    def forget_tenant(self, tenant: str) -> None:
        """Remove every series labelled with this tenant name (the tenant was removed): without
        this a removed tenant's series stay in /metrics for good, and a tenant created again
        under the name would continue the old one's counts."""
        for metric in self.by_tenant:
            metric.remove_by_labels({"tenant": tenant})     # every series with this tenant

    def rejected(self, tenant: str) -> None:
        """Refused before admission for a client error (invalid field, model, context)."""
        self.requests.labels(tenant, "rejected").inc()

    def admitted(self, tenant: str, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(tenant).inc(prompt_tokens)

    def times(self, tenant: str, tier: str, predicted_ttft_s: float | None = None,
              prompt_tokens: int = 0, step_cost: StepCost | None = None) -> "RequestTimes":
        """A new request's latencies, as its tokens come (`predicted_ttft_s`: admission's;
        `prompt_tokens`, `step_cost`: what its TTFT objective grows with, `TierObjectives.ttft_for`)."""
        return RequestTimes(self, tenant, tier, predicted_ttft_s, prompt_tokens, step_cost)

    def done(self, tenant: str, status: str, seconds: float, completion_tokens: int) -> None:
        self.requests.labels(tenant, status).inc()
        self.e2e.labels(tenant).observe(seconds)
        self.generation_tokens.labels(tenant).inc(completion_tokens)

    # ---- a request's final stats (step loop thread) ---------------------------------------------
    def request_stats(self, stats: RequestStats, drafter: str) -> None:
        """From `scheduler.request.RequestStats` at the end of a request."""
        tenant = stats.tenant
        if stats.first_served_s is not None:
            self.queue_time.labels(tenant).observe(max(0.0, stats.first_served_s - stats.arrival_s))
            self.in_steps.labels(tenant).observe(stats.in_steps_s)
        drafted = max(0, stats.attained - stats.n_steps)     # attained = Σ (1 root + tree nodes)
        if drafted:
            self.drafted.labels(tenant, drafter).inc(drafted)
            self.accepted.labels(tenant, drafter).inc(stats.accepted_sum)
        h = self.tau.labels(tenant, drafter)
        for tau in stats.tau_history:
            h.observe(tau)

    # ---- the step loop ----------------------------------------------------------------------------
    def instrument(self, worker: ServedWorker) -> "InstrumentedWorker":
        return InstrumentedWorker(worker, self)

    def watch(self, step_loop: StepLoop, components: dict[str, Callable[[], bool]] | None = None) -> None:
        """Report the loop's live requests (by level and status) and steps when scraped, and
        whether each of `components` (name -> check; e.g. the state store) is up."""
        self.registry.register(SchedulerCollector(step_loop, components or {}))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def exposition(self) -> tuple[bytes, str]:
        """What GET /metrics serves (Ray mode's ingress asks the scheduler replica instead)."""
        return self.render()


class RequestTimes:
    """One request's latencies as its tokens come (the consumer's event loop): its time to first
    token and its gaps go to the histograms by tenant and tier, and when it ends, whether it met
    its tier's objectives to `specgate_slo_requests_total` (`gateway.tiers.attainment`)."""

    def __init__(self, metrics: GatewayMetrics, tenant: str, tier: str,
                 predicted_ttft_s: float | None = None, prompt_tokens: int = 0,
                 step_cost: StepCost | None = None) -> None:
        self.metrics, self.tenant, self.tier = metrics, tenant, tier
        self.predicted_ttft_s = predicted_ttft_s
        self.prompt_tokens, self.step_cost = prompt_tokens, step_cost
        self.objectives = metrics.tiers.get(tier)
        self.ttft_s: float | None = None
        self.gaps = self.slow_gaps = 0

    def first_token(self, seconds: float) -> None:
        self.ttft_s = seconds
        self.metrics.ttft.labels(self.tenant, self.tier).observe(seconds)
        if self.predicted_ttft_s is not None:
            self.metrics.ttft_error.labels(self.tier).observe(seconds - self.predicted_ttft_s)

    def tokens(self, gap_s: float, n: int) -> None:
        """`n` tokens arrived `gap_s` after the previous ones (each counts gap ÷ n)."""
        if n <= 0:
            return
        per = gap_s / n
        h = self.metrics.itl.labels(self.tenant, self.tier)
        for _ in range(n):
            h.observe(per)
        self.gaps += n
        if self.objectives is not None and per > self.objectives.tbt_s:
            self.slow_gaps += n

    def ended(self, lived_s: float) -> None:
        """The request ended `lived_s` after it arrived: count its objectives, met or missed
        (both series exist once a tier and tenant have a request, so a rate reads 0, not none)."""
        if self.objectives is None:
            return
        met = attainment(self.objectives, self.ttft_s, self.gaps, self.slow_gaps, lived_s,
                         self.prompt_tokens, self.step_cost)
        for objective, ok in met.items():
            counts = self.metrics.slo
            counts.labels(self.tenant, self.tier, objective, "met").inc(1 if ok else 0)
            counts.labels(self.tenant, self.tier, objective, "missed").inc(0 if ok else 1)


class InstrumentedWorker:
    """The worker with each step timed and counted; the other calls of `ServedWorker` pass
    through (anything else is the inner `worker`'s, reached as such).

    Preemptions are counted here because this is where one step's batch meets the next: a
    request in the previous batch, absent from this one and still live, was preempted."""

    def __init__(self, worker: ServedWorker, metrics: GatewayMetrics) -> None:
        self.worker = worker
        self.metrics = metrics
        self._loop: StepLoop | None = None
        self._previous: set[str] = set()

    def follow(self, step_loop: StepLoop) -> None:
        """Read which requests are live, and their tenants, from the loop that drives this."""
        self._loop = step_loop

    def is_live(self, request_id: str) -> bool:
        return self._loop is not None and request_id in self._loop.state.requests

    def tenant_of(self, request_id: str) -> str | None:
        req = None if self._loop is None else self._loop.state.requests.get(request_id)
        return None if req is None else req.tenant

    @property
    def context_limit(self) -> int:
        return self.worker.context_limit

    def release(self, request_id: str) -> None:
        self.worker.release(request_id)

    def evict(self, request_id: str) -> None:
        self.worker.evict(request_id)

    def drop_tenant(self, tenant: str) -> None:
        self.worker.drop_tenant(tenant)

    def step(self, items: Sequence[WorkItem]) -> list[StepResult]:
        ids = {i.request_id for i in items}
        left_out = sum(1 for rid in self._previous - ids if self.is_live(rid))
        if left_out:
            self.metrics.preemptions.inc(left_out)
        self._previous = ids
        t0 = time.perf_counter()
        results = self.worker.step(items)
        self.metrics.step_duration.observe(time.perf_counter() - t0)
        self.metrics.batch_size.observe(len(items))
        work: dict[str, int] = {}
        for r in results:
            tenant = self.tenant_of(r.request_id)
            if tenant is not None:
                work[tenant] = work.get(tenant, 0) + r.tree_tokens
        for tenant, n in work.items():
            self.metrics.verified_tokens.labels(tenant).inc(n)
        return results

    def prefill(self, request_id: str, token_ids: Sequence[int], **kwargs: Any) -> Any:
        done = self.worker.prefill(request_id, token_ids, **kwargs)     # a Prefilled
        # labelled by the tenant's name, as every other series; the worker got its id
        tenant = self.tenant_of(request_id) or kwargs.get("tenant", "default")
        self.metrics.prefill_tokens.labels(tenant).inc(max(0, len(token_ids) - 1))   # the root: no KV
        if done.cached:
            self.metrics.prefix_cache_hits.labels(tenant).inc(done.cached)
        return done

    def prefix_cache_usage(self) -> tuple[int, int] | None:
        return self.worker.prefix_cache_usage()

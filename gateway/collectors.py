"""Collectors read when /metrics is scraped: the tiers' objectives (for alerts and dashboards) and
the step loop's live state (queue depth by level and status, KV held and budgeted, the prefix
cache, which components answer). Kept apart from `GatewayMetrics`, which records as things happen.
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.tiers import TierObjectives
from scheduler.loop import StepLoop
from scheduler.worker import Worker


class ServedWorker(Worker, Protocol):
    """The step loop's worker as the gateway serves it: `scheduler.worker.Worker` plus its prefix
    cache's (bytes held, capacity) for /metrics, None without one (`BatchWorker`, Ray mode's
    `VerifierPool`, `FakeWorker`)."""

    def prefix_cache_usage(self) -> tuple[int, int] | None: ...


class ObjectiveCollector:
    """`specgate_slo_objective`: each tier's target share per objective (0.99), and
    `specgate_slo_target_seconds`, its target: what the burn-rate alerts and the dashboards read,
    so that they follow the deployment's tiers without being edited."""

    def __init__(self, tiers: Mapping[str, TierObjectives]) -> None:
        self.tiers = dict(tiers)

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        share = GaugeMetricFamily("specgate_slo_objective", "Share of a service tier's requests "
                                  "that must meet each objective (1 − the error budget)",
                                  labels=["tier", "objective"])
        target = GaugeMetricFamily("specgate_slo_target_seconds", "A service tier's target for "
                                   "each objective", labels=["tier", "objective"])
        for tier, o in sorted(self.tiers.items()):
            for objective, seconds in (("ttft", o.ttft_s), ("tbt", o.tbt_s)):
                share.add_metric([tier, objective], o.objective)
                target.add_metric([tier, objective], seconds)
        yield share
        yield target


class SchedulerCollector:
    """Gauges read from the loop's state when scraped (a copy of the live set: the loop's thread
    may change it meanwhile; `dict.copy` of a plain dict is atomic under the GIL)."""

    def __init__(self, step_loop: StepLoop, components: dict[str, Callable[[], bool]] | None = None) -> None:
        self.step_loop = step_loop
        self.components = dict(components or {})

    def describe(self) -> Iterable:
        return []                                   # collected lazily; no names to pre-check

    def collect(self) -> Iterable:
        live = list(self.step_loop.state.requests.copy().values())
        depth = GaugeMetricFamily("specgate_queue_depth", "Live requests by scheduler level "
                                  "and status (queued, running, preempted)", labels=["level", "status"])
        # Every live status has a series even when idle (level 0 at zero), so "how deep is the
        # queue" is answered with 0, not with no data.
        counts: dict[tuple[str, str], int] = {("0", st): 0 for st in ("queued", "running", "preempted")}
        perceptible = 0
        for s in live:
            key = (str(s.level), s.status.value)
            counts[key] = counts.get(key, 0) + 1
            perceptible += bool(s.perceptible)
        for (level, status), n in sorted(counts.items()):
            depth.add_metric([level, status], n)
        yield depth
        g = GaugeMetricFamily("specgate_perceptible_requests",
                              "Live requests whose acceptance estimate is stable (LAPS-SD)")
        g.add_metric([], perceptible)
        yield g
        yield from _prefix_cache_gauges(self.step_loop.worker)
        paused = GaugeMetricFamily("specgate_paused_requests", "Live requests held out of the plan "
                                   "because their stream's reader fell behind (backpressure)")
        paused.add_metric([], float(len(self.step_loop.state.paused.copy())))
        yield paused
        held = GaugeMetricFamily("specgate_kv_tokens", "KV slots (tokens) the resident requests hold")
        held.add_metric([], float(self.step_loop.state.kv_tokens))
        yield held
        budget = self.step_loop.policy.config.kv_budget_tokens
        per_home = self.step_loop.state.kv_budgets      # Ray mode: one per verifier replica
        if per_home:
            budget = sum(per_home.values())
        if budget is not None:
            g = GaugeMetricFamily("specgate_kv_budget_tokens", "KV slots (tokens) the planner "
                                  "keeps resident requests within (--kv-cache-mb; in Ray mode, "
                                  "summed over the verifier replicas)")
            g.add_metric([], float(budget))
            yield g
        steps = CounterMetricFamily("specgate_steps", "Verification steps run by the loop")
        steps.add_metric([], self.step_loop.steps)
        yield steps
        up = GaugeMetricFamily("specgate_component_up", "1 while a component answers (step_loop, "
                               "state_store, ...), else 0", labels=["component"])
        for name, check in sorted(self.components.items()):
            try:
                ok = bool(check())
            except Exception:                          # an unreachable store is "down", not an error
                ok = False
            up.add_metric([name], 1.0 if ok else 0.0)
        yield up


def _prefix_cache_gauges(worker: ServedWorker) -> Iterable:
    """The prefix cache's bytes held and capacity: an in-process worker's own, or in Ray mode the
    sum the verifier replicas last reported (`VerifierPool`); none for the fake worker. Summed
    over tenants: one tenant's share would tell another what it sends."""
    try:
        got = worker.prefix_cache_usage()
    except Exception:                                  # a scrape never fails on a figure
        got = None
    if got is None:
        return
    for name, help_text, value in (
            ("specgate_prefix_cache_bytes", "KV bytes the prefix cache holds", got[0]),
            ("specgate_prefix_cache_capacity_bytes", "KV bytes the prefix cache may hold", got[1])):
        g = GaugeMetricFamily(name, help_text)
        g.add_metric([], float(value))
        yield g

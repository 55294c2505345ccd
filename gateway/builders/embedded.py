"""The embedded builder: one gateway process, its model (or the fake worker) in process.

Start-up, in order: the target model (or the fake worker) and its step-cost profile → over Redis,
the replica id's lease (one process per id) → policy, state store, step loop, tenants, limiter,
service, app (`gateway.assembly.serving.assemble`) → recovery of the requests the store still
holds. `build_embedded` does everything but listen (`gateway.cli.serve` listens), so tests and
benchmarks assemble the same app; Ray mode's scheduler replica assembles the same thing over its
verifier replicas (`gateway.ray_serve.deployments`).
"""
from __future__ import annotations

from typing import Any

from gateway.assembly.replica import ReplicaLease
from gateway.assembly.serving import Embedded, assemble
from gateway.assembly.target import Target, local_target
from gateway.settings import Settings
from scheduler.store.redis_client import redis_client


def build_embedded(settings: Settings, *, progress: bool = True, runtime: Any = None,
                   target: Target | None = None) -> Embedded:
    """Everything but the listening: `runtime` (a `workers.runtime.Runtime` already loaded, e.g.
    by a test or a benchmark) is used instead of loading `settings.model`; `target` replaces the
    model altogether (gateway/assembly/target.py)."""
    target = target if target is not None else local_target(settings, progress, runtime)
    replica = None
    if settings.redis_url:
        # one process per replica id: taken before recovery, so two never step the same requests
        replica = ReplicaLease(redis_client(settings.redis_url, settings.redis_timeout_s),
                               settings.store_prefix, settings.replica_id, settings.replica_lease_s,
                               ended_ttl_s=settings.ended_ttl_s)
        replica.acquire()
    emb = assemble(settings, target, replica=replica)
    emb.recovered = emb.step_loop.recover()
    # what the old process left running: background responses go on (and are kept when they
    # end); requests whose clients' connections died with it are cancelled; usage corrected
    emb.cancelled = emb.service.take_over(emb.recovered)
    return emb

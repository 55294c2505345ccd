"""The step loop's and the metrics' view of tenants, kept in step with the tenant registry:
tenants change at run time (the admin API, another gateway replica)."""
from __future__ import annotations

import logging
from typing import Callable, Iterable

from gateway.metrics import GatewayMetrics
from gateway.tenancy.records import Tenant
from scheduler.loop import StepLoop

log = logging.getLogger(__name__)


class TenantSync:
    def __init__(self, step_loop: StepLoop, metrics: GatewayMetrics) -> None:
        self.step_loop = step_loop
        self.metrics = metrics
        # tenant id -> name, of every tenant submitted for: what `sweep` checks against the
        # store (a few dozen bytes a tenant)
        self._seen: dict[str, str] = {}

    def sync(self, tenant: Tenant) -> None:
        """Bring the scheduler's view of a tenant up to date (its weight and queue bound)."""
        self._seen[tenant.id] = tenant.name
        self.step_loop.set_tenant(tenant.name, weight=float(tenant.weight), max_queued=tenant.max_queued)

    def forget(self, tenant_id: str, name: str) -> None:
        """A tenant was removed: the engine frees its caches, keyed by `tenant_id` (at the step
        loop's next boundary), and /metrics drops the series labelled `name`."""
        self._seen.pop(tenant_id, None)
        self.step_loop.drop_tenant(tenant_id)
        self.metrics.forget_tenant(name)

    def sweep(self, list_tenants: Callable[[], Iterable[Tenant]]) -> list[str]:
        """Forget every tenant served here that `list_tenants()` (the store's tenants now) no
        longer holds: one removed through another gateway replica, which alone heard the
        DELETE. A name that is live again (the tenant created anew) keeps its series. Any
        thread. Returns the ids forgotten.

        NOTE: the tenants served are read *before* the store: a tenant created and served
        between the two reads would otherwise look removed, and its id be dropped for good."""
        seen = list(self._seen.items())
        live = list(list_tenants())
        ids, names = {t.id for t in live}, {t.name for t in live}
        gone = [(i, n) for i, n in seen if i not in ids]
        for tenant_id, name in gone:
            self._seen.pop(tenant_id, None)
            self.step_loop.drop_tenant(tenant_id)
            if name not in names:
                self.metrics.forget_tenant(name)
            log.info("tenant %r was removed elsewhere: its caches and series dropped here", name)
        return [i for i, _ in gone]

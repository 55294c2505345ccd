"""Admission: a request counted against the tenant's limits, prepared, and into the step loop.

    arrive    (the front calls it, through `GenerationService.arrive`, before the request's body
              is read) one unit of the tenant's requests per minute, whatever becomes of the
              request: a refusal after this has cost the tenant a request (429 if none is left);
    precheck  the tenant's token and concurrency limits as they stand (429 with Retry-After),
              before any work on its prompt: a tenant over its limits costs no tokenization;
    prepare   gateway/service/prepare.py (400, 403, 404, 413);
    predict   with miss prediction on (`slo_admission`, scheduler/miss.py): a request predicted
              to miss its tier's TTFT target is refused (429 when its tenant's own requests make
              the wait, else 503; `slo_unattainable`, Retry-After when it would make it), or moved
              to `flex` where its tier and its tenant allow; charged nothing but the request;
    acquire   the tenant's token and concurrency limits, charged (429 with Retry-After; 400 for a
              request larger than the tenant's whole TPM, which waiting cannot help);
    submit    to the step loop, with the tenant's priority, weight and speculation policy
              (a full queue: 429 for the tenant's own queue, 503 for the scheduler's).

A concurrency grant acquired here is kept by `gateway.tenancy.grants.GrantKeeper` once the
request is in the loop (renewed while it runs), and released at once if the loop refuses it.
The limiter's and the state store's calls may wait on the network (`remote`): the service runs
admission on a worker thread then.
"""
from __future__ import annotations

import time
from dataclasses import replace

from gateway import errors
from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics
from gateway.service import fields
from gateway.service.prepare import RequestPreparer
from gateway.service.stream import RequestStream
from gateway.service.tenant_sync import TenantSync
from gateway.service.types import GenerateInput, Prepared
from gateway.tenancy.grants import GrantKeeper
from gateway.tenancy.limits import Grant, LimitExceeded, Limiter
from gateway.tenancy.rates import Closed
from gateway.tenancy.records import Tenant
from scheduler.admission import ADMITTED
from scheduler.loop import StepLoop
from scheduler.miss import judge


class Admission:
    def __init__(self, step_loop: StepLoop, preparer: RequestPreparer, *, limiter: Limiter | None,
                 grants: GrantKeeper | None, metrics: GatewayMetrics, tenants: TenantSync) -> None:
        self.step_loop = step_loop
        self.preparer = preparer
        self.limiter = limiter
        self.grants = grants
        self.metrics = metrics
        self.tenants = tenants

    @property
    def remote(self) -> bool:
        """Whether admitting may wait on the network (a limiter or state store in Redis)."""
        return self.limits_remote or self.step_loop.store.remote

    @property
    def limits_remote(self) -> bool:
        """Whether the limiter's calls may wait on the network (its buckets in Redis)."""
        return self.limiter is not None and self.limiter.remote

    def arrive(self, tenant: Tenant) -> None:
        """Charge an arriving request to the tenant's requests per minute (module docstring):
        any thread; raises ApiError (429) charging nothing when none is left."""
        if self.limiter is None:
            return
        try:
            self.limiter.arrive(tenant)
        except LimitExceeded as exc:
            raise self._refused(tenant.name, exc) from None

    def refused_now(self, tenant: Tenant) -> ApiError | None:
        """The 429 an arrival of `tenant` gets without asking the store (`Limiter.closed`), or
        None: cheap enough for the event loop, so a flood of refused requests costs no thread
        and no store call each."""
        if self.limiter is None:
            return None
        exc = self.limiter.closed(tenant)
        return None if exc is None else self._refused(tenant.name, exc)

    def admit(self, inp: GenerateInput, tenant: Tenant) -> tuple[Prepared, Grant | None]:
        """precheck, prepare, acquire (module docstring): any thread; raises ApiError."""
        self._precheck(inp, tenant)
        try:
            prep = self.preparer.prepare(inp, tenant, context=self.step_loop.worker.context_limit,
                                         now=self.step_loop.clock())
        except ApiError:
            self.metrics.rejected(tenant.name)
            raise
        prep = self._predict(prep)
        return prep, self._acquire(prep)

    def submit(self, stream: RequestStream) -> None:
        """Hand the stream's request to the step loop (raises ApiError if it refuses): its grant
        is then held, or released at once (retried if the store does not answer)."""
        grant = stream.grant
        try:
            self._submit(stream)
        except BaseException:
            if self.grants is not None and grant is not None:
                self.grants.release(grant, 0)
            raise
        if self.grants is not None and grant is not None:
            self.grants.hold(grant)                   # renewed while the request runs

    def _predict(self, prep: Prepared) -> Prepared:
        """The request's predicted TTFT and admission's verdict on it (module docstring:
        predict): raises ApiError for a refusal; returns `prep` with the prediction, and with
        its tier moved to flex if it was."""
        forecast = self.step_loop.forecast
        if not forecast.enabled:
            return prep
        s, now = prep.request.stats, self.step_loop.clock()
        objectives = forecast.objectives(s.prompt_len)    # this request's, by tier
        verdict = judge(s.tier, lambda tier: forecast.predict(tier, s.tenant, s.prompt_len,
                                                              s.max_tokens, now),
                        objectives, forecast.on_miss, prep.tenant.allows_tier("flex"))
        p = verdict.predicted
        if verdict.action == "refuse":
            self.metrics.refused(s.tenant, "slo_unattainable",
                                 "rate_limited" if verdict.status == 429 else "overloaded")
            raise errors.slo_unattainable(verdict.status, s.tier, objectives[s.tier],
                                          p.ttft_s, verdict.retry_after_s)
        s.tier = verdict.tier                     # flex, if moved: echoed as the tier it ran in
        return replace(prep, predicted_ttft_s=p.ttft_s) if p is not None else prep

    def _precheck(self, inp: GenerateInput, tenant: Tenant) -> None:
        """429 now if the tenant's limits would refuse even the least this request can cost.
        Charges nothing. A tpm refusal says, where it can, what holds for every request of the
        tenant (`_closed`)."""
        if self.limiter is None:
            return
        # before the store is read: a refund landing after the read counts after this
        seen = (time.monotonic(), *self.grants.snapshot(tenant.name)) if self.grants else None
        try:
            self.limiter.precheck(tenant, fields.least_tokens(inp, self.step_loop.worker.context_limit))
        except LimitExceeded as exc:
            err = self._refused(tenant.name, exc)
            err.closed = _closed(exc, seen)
            raise err from None

    def _acquire(self, prep: Prepared) -> Grant | None:
        if self.limiter is None:
            return None
        s = prep.request.stats
        try:
            return self.limiter.acquire(prep.tenant, s.prompt_len + s.max_tokens)
        except LimitExceeded as exc:
            raise self._refused(s.tenant, exc) from None

    def _refused(self, tenant: str, exc: LimitExceeded) -> ApiError:
        """A limiter's refusal as the client's answer (`limit_refusal`), counted."""
        if not exc.retryable:
            self.metrics.rejected(tenant)
        else:
            self.metrics.refused(tenant, str(exc.kind), "rate_limited")
        return limit_refusal(exc)

    def _submit(self, stream: RequestStream) -> None:
        prep, grant = stream.prep, stream.grant
        self.tenants.sync(prep.tenant)
        req = prep.request
        if grant is not None:
            req.meta["grant"] = grant.to_list()    # a restarted gateway corrects its charge
        # NOTE: what the loop's submit refuses with ValueError (empty prompt, no room in the
        # context) was refused above; a ValueError here is a server fault, not the client's.
        verdict = self.step_loop.submit(req, stream.sink)
        if verdict is not ADMITTED:
            tenant = req.stats.tenant
            if verdict.http_status == 429:
                self.metrics.refused(tenant, verdict.reason, "queue_full")
                raise errors.rate_limited("too many requests of this API key are waiting; "
                                          "retry later", verdict.retry_after_s,
                                          code="tenant_queue_full")
            self.metrics.refused(tenant, verdict.reason, "overloaded")
            raise errors.overloaded(retry_after_s=verdict.retry_after_s, code="queue_full")
        self.metrics.admitted(req.stats.tenant, req.stats.prompt_len)
        stream.admitted = True


def _closed(exc: LimitExceeded, seen: tuple[float, int, int] | None) -> Closed | None:
    """What a tpm refusal says of every request of its tenant (`Closed`), given (the time, this
    replica's slots held for the tenant, its refunds) taken before the store was read: only
    when no request could fit whatever its size (`closed_s`), and every grant the store
    counted live for the tenant is one of those held here. Then only a release here can refund
    tokens (a grant charged elsewhere later would have needed room the store had not), and it
    counts a refund here. The one exception: a grant of ours whose lease ran out in a store
    outage (renewals failing for a lease) leaves room in the count for one charged elsewhere,
    whose refund this replica does not see; the book's age bound covers that."""
    if seen is None or exc.closed_s <= 0 or exc.live is None:
        return None
    at, held, refunds = seen
    return Closed(at + exc.closed_s, refunds) if exc.live <= held else None


def limit_refusal(exc: LimitExceeded) -> ApiError:
    """A limiter's refusal as the client's 429, or, for one that can never pass (more tokens than
    the tenant's whole TPM), a 400 naming the limit: retrying it after Retry-After would only be
    refused again."""
    if not exc.retryable:
        return errors.invalid(exc.message, "max_tokens", code=f"request_exceeds_{exc.kind}")
    return errors.rate_limited(exc.message, exc.retry_after_s,
                               code=f"{exc.kind}_exceeded" if exc.kind else "rate_limit_exceeded")

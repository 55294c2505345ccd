"""Rate limits and concurrency caps: the pure arithmetic on hand-worked cases, then the Limiter in
memory and in a real Redis, where two Limiter objects (two replicas) must enforce one limit. A
request's rpm is charged as it arrives (`arrive`), its tokens and slot at admission (`acquire`)."""
from __future__ import annotations

import threading
import time

import pytest
import redis

from gateway.tenancy.limits import (CONCURRENCY_RETRY_S, WINDOW_S, Grant, LimitExceeded, Limiter,
                                    Usage, arrival, check, gcra_adjust, gcra_take)
from gateway.tenancy.records import Tenant

T0 = 1_000_000.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---- pure arithmetic --------------------------------------------------------------------------------
def test_gcra_take_rpm5_burst_then_steady():
    tat, now = 0.0, T0
    for i in range(5):                                  # a full bucket takes a burst of 5
        tat, wait = gcra_take(tat, now, 1, 5)
        assert (tat, wait) == (now + 12.0 * (i + 1), 0.0)
    assert gcra_take(tat, now, 1, 5) == (None, 12.0)    # the 6th: one interval too early
    assert gcra_take(tat, now + 11.0, 1, 5) == (None, 1.0)
    assert gcra_take(tat, now + 12.0, 1, 5) == (now + 72.0, 0.0)


@pytest.mark.parametrize("per_minute", [3, 7, 11, 13, 600, 999])
def test_gcra_take_allows_exactly_the_limit_per_window(per_minute):
    tat, allowed = 0.0, 0
    while True:
        new, _ = gcra_take(tat, T0, 1, per_minute)
        if new is None:
            break
        tat, allowed = new, allowed + 1
    assert allowed == per_minute                        # float rounding does not cost one


def test_gcra_take_idle_bucket_refills_but_never_beyond_full():
    # TAT long past: the bucket is full, and only full (no credit saved up).
    assert gcra_take(T0 - 3600, T0, 5, 5) == (T0 + 60.0, 0.0)
    assert gcra_take(T0 - 3600, T0, 6, 5) == (None, 12.0)


def test_gcra_adjust():
    # tpm=600: 0.1 s per token.
    assert gcra_adjust(T0 + 50, T0, -400, 600) == pytest.approx(T0 + 10)   # refund
    assert gcra_adjust(T0 + 50, T0, +100, 600) == pytest.approx(T0 + 60)   # used more than charged
    assert gcra_adjust(T0 + 50, T0 + 45, -400, 600) == T0 + 45             # no more than full
    assert gcra_adjust(T0 - 10, T0, +100, 600) == pytest.approx(T0 + 10)   # from a full bucket


def test_check_names_the_limit_that_frees_last():
    t = Tenant("t", rpm=60, tpm=600, max_concurrent=2)
    ok = check(t, Usage(), T0, 100)
    assert ok.allowed and ok.tat == pytest.approx(T0 + 10)
    full = Usage(tpm_tat=T0 + 55)                           # tpm frees in 5 s
    v = check(t, full, T0, 100)
    assert (v.allowed, v.kind, v.retry_after_s) == (False, "tpm", pytest.approx(5.0))
    assert v.tat == full.tpm_tat                             # a refusal charges nothing
    busy = Usage(live=2)
    assert check(t, busy, T0, 1).kind == "concurrency"
    assert check(t, busy, T0, 1).retry_after_s == CONCURRENCY_RETRY_S
    # tpm refusal of 0.5 s and a full concurrency cap: concurrency (1 s) is the longer wait.
    v = check(t, Usage(tpm_tat=T0 + 59.95, live=2), T0, 1)
    assert (v.kind, v.retry_after_s) == ("concurrency", CONCURRENCY_RETRY_S)


def test_arrival_takes_one_request_or_names_the_wait():
    t = Tenant("t", rpm=60)
    ok = arrival(t, 0.0, T0)
    assert ok.allowed and ok.tat == T0 + 1
    v = arrival(t, T0 + 60, T0)                              # a full minute's requests taken
    assert (v.allowed, v.kind, v.retry_after_s, v.tat) == (False, "rpm", 1.0, T0 + 60)
    assert arrival(Tenant("free"), T0 + 1e6, T0).allowed


def test_check_request_larger_than_tpm_never_fits():
    v = check(Tenant("t", tpm=1000), Usage(), T0, 1001)
    assert (v.allowed, v.kind, v.retry_after_s) == (False, "tpm", WINDOW_S)
    assert check(Tenant("t", tpm=1000), Usage(), T0, 1000).allowed


def test_check_unlimited_tenant():
    assert check(Tenant("t"), Usage(tpm_tat=T0 + 1e6, live=10**6), T0, 10**9).allowed


# ---- the Limiter, in memory and in Redis --------------------------------------------------------------
def _limiter(store, clock: Clock, **kw) -> Limiter:
    url, prefix = store
    return Limiter(url, prefix, clock=clock, **kw)


def _refused(limiter: Limiter, tenant: Tenant, tokens: int = 1) -> LimitExceeded:
    with pytest.raises(LimitExceeded) as err:
        limiter.acquire(tenant, tokens)
    return err.value


def _rpm_refused(limiter: Limiter, tenant: Tenant) -> LimitExceeded:
    with pytest.raises(LimitExceeded) as err:
        limiter.arrive(tenant)
    return err.value


def test_rpm(store):
    clock = Clock()
    limiter = _limiter(store, clock)
    t = Tenant("acme", rpm=5)
    for _ in range(5):
        limiter.arrive(t)
    err = _rpm_refused(limiter, t)
    assert err.kind == "rpm" and err.retry_after_s == pytest.approx(12.0)
    assert err.retry_after_header == "12" and "5 requests per minute" in err.message
    clock.now += 11.9
    assert _rpm_refused(limiter, t).retry_after_s == pytest.approx(0.1)
    clock.now += 0.1                                      # the window moves with the clock
    limiter.arrive(t)
    _rpm_refused(limiter, t)
    clock.now += 60
    for _ in range(5):
        limiter.arrive(t)
    _rpm_refused(limiter, t)
    limiter.release(limiter.acquire(t, 10), 10)           # admission takes no request of its own


def test_a_tenant_over_its_rpm_is_refused_without_a_store_call_until_a_slot_frees(store):
    # a flood of refused requests must not cost a store round trip each (one per freed slot)
    clock = Clock()
    limiter = _limiter(store, clock)
    calls = []
    ask = limiter._buckets.arrive
    limiter._buckets.arrive = lambda *a: calls.append(a) or ask(*a)
    t = Tenant("acme", rpm=5)
    for _ in range(5):
        limiter.arrive(t)
    assert _rpm_refused(limiter, t).retry_after_s == pytest.approx(12.0)
    assert len(calls) == 6
    clock.now += 4.0
    for _ in range(50):
        err = _rpm_refused(limiter, t)
    assert len(calls) == 6                                 # answered here, not by the store
    assert err.kind == "rpm" and err.retry_after_s == pytest.approx(8.0)
    assert limiter.closed(t) is not None and limiter.closed(Tenant("other", rpm=5)) is None
    clock.now += 8.0                                       # the slot is free: the store decides
    limiter.arrive(t)
    assert len(calls) == 7
    _rpm_refused(limiter, t)
    assert len(calls) == 8
    assert limiter.closed(Tenant("acme", rpm=6)) is None   # a changed limit asks the store again


@pytest.mark.parametrize("rpm", [3, 7, 11, 13, 999])
def test_rpm_allows_exactly_the_limit(store, rpm):
    limiter = _limiter(store, Clock())
    t = Tenant("acme", rpm=rpm)
    for _ in range(rpm):
        limiter.arrive(t)
    assert _rpm_refused(limiter, t).kind == "rpm"


def test_tpm_and_release_correction(store):
    clock = Clock()
    limiter = _limiter(store, clock)
    t = Tenant("acme", tpm=1000)                          # 0.06 s per token
    first = limiter.acquire(t, 600)
    err = _refused(limiter, t, 600)
    assert err.kind == "tpm" and err.retry_after_s == pytest.approx(12.0)   # 200 tokens short
    limiter.release(first, 100)                           # used 100: 500 back
    second = limiter.acquire(t, 600)                      # 700 charged now
    err = _refused(limiter, t, 400)
    assert err.retry_after_s == pytest.approx(6.0)        # 100 tokens short
    limiter.release(second, 900)                          # used more than estimated: charged too
    assert _refused(limiter, t, 100).retry_after_s == pytest.approx(6.0)
    limiter.release(second, 0)                            # a second release corrects nothing
    assert _refused(limiter, t, 100).retry_after_s == pytest.approx(6.0)
    clock.now += 6
    limiter.acquire(t, 100)


def test_request_larger_than_tpm_is_refused(store):
    limiter = _limiter(store, Clock())
    err = _refused(limiter, Tenant("acme", tpm=1000), 1001)
    assert err.kind == "tpm" and "Request too large" in err.message
    assert not err.retryable                    # waiting cannot help: the service answers 400
    limiter.acquire(Tenant("acme", tpm=1000), 1000)
    assert _refused(limiter, Tenant("acme", tpm=1000), 1).retryable     # this one only waits


def test_concurrency_and_release(store):
    limiter = _limiter(store, Clock())
    t = Tenant("acme", max_concurrent=2)
    a, b = limiter.acquire(t, 1), limiter.acquire(t, 1)
    err = _refused(limiter, t)
    assert err.kind == "concurrency" and err.retry_after_s == CONCURRENCY_RETRY_S
    limiter.release(a, 1)
    c = limiter.acquire(t, 1)
    limiter.release(a, 1)                                 # twice: does not free another slot
    _refused(limiter, t)
    limiter.release(b, 1)
    limiter.release(c, 1)
    limiter.acquire(t, 1), limiter.acquire(t, 1)


def test_a_refused_request_charges_nothing(store):
    limiter = _limiter(store, Clock())
    t = Tenant("acme", rpm=2, tpm=100, max_concurrent=1)
    g = limiter.acquire(t, 50)
    assert _refused(limiter, t, 50).kind == "concurrency"   # refused: no tokens taken
    limiter.release(g, 50)
    limiter.acquire(t, 50)                                   # so the second 50 tokens still fit
    assert _refused(limiter, t, 1).kind == "concurrency"
    limiter.arrive(t), limiter.arrive(t)
    _rpm_refused(limiter, t)                                 # refused: no request taken …
    _rpm_refused(limiter, t)                                 # … so the wait does not grow
    assert _rpm_refused(limiter, t).retry_after_s == pytest.approx(30.0)


def test_precheck_refuses_what_acquire_would_and_charges_nothing(store):
    """Before a prompt is tokenized: a tenant over its tokens per minute, its concurrency, or
    asking for more than its tpm at all is refused as `acquire` would refuse it; a precheck that
    passes takes nothing, so the request after it still fits. Requests per minute are not its:
    they were charged as the request arrived."""
    clock = Clock()
    limiter = _limiter(store, clock)
    t = Tenant("acme", rpm=1, tpm=100, max_concurrent=1)
    limiter.arrive(t)
    for _ in range(5):
        limiter.precheck(t, 50)                              # nothing charged: 5 × 50 > 100
    g = limiter.acquire(t, 50)
    with pytest.raises(LimitExceeded) as err:
        limiter.precheck(t, 1)
    assert err.value.kind == "concurrency"
    limiter.release(g, 50)
    limiter.precheck(t, 50)
    limiter.release(limiter.acquire(t, 50), 50)
    limiter.release(limiter.acquire(Tenant("other", tpm=1), 1), 1)   # others' buckets apart
    with pytest.raises(LimitExceeded) as err:
        limiter.precheck(t, 1)                               # 101 tokens of tpm=100
    assert err.value.kind == "tpm" and err.value.retry_after_s == pytest.approx(0.6)
    with pytest.raises(LimitExceeded, match="Request too large"):
        limiter.precheck(Tenant("acme2", tpm=100), 101)
    clock.now += 1
    limiter.precheck(t, 1)


def test_an_unlimited_tenant_needs_no_store():
    """A tenant without limits is never refused, so neither its arrival nor its precheck makes a
    store call: even a store that is down costs it nothing."""
    limiter = Limiter(None, clock=Clock())

    class Down:
        def usage(self, tenant, now):
            raise ConnectionError("down")

        def arrive(self, tenant, now):
            raise ConnectionError("down")
    limiter._buckets = Down()
    limiter.precheck(Tenant("free", rpm=5), 10**9)
    limiter.arrive(Tenant("free", tpm=5, max_concurrent=1))
    with pytest.raises(ConnectionError):
        limiter.precheck(Tenant("metered", tpm=5), 1)
    with pytest.raises(ConnectionError):
        limiter.arrive(Tenant("metered", rpm=5))


def test_an_orphaned_grant_is_corrected_after_its_lease_ran_out(store):
    """A gateway died while its request ran (the slot's lease ended with it); the process that
    recovered and ended the request corrects the charge, from the grant kept with the request."""
    clock = Clock()
    limiter = _limiter(store, clock, lease_s=5)
    t = Tenant("acme", tpm=1000, max_concurrent=1)        # 0.06 s per token
    orphan = limiter.acquire(t, 600)
    assert _refused(limiter, t, 1).kind == "concurrency"
    clock.now += 6                                         # the lease ran out: the slot is free
    err = _refused(limiter, t, 600)
    assert err.kind == "tpm" and err.retry_after_s == pytest.approx(6.0)   # the charge stays
    limiter.release(orphan, 100)                           # a release finds no slot: no correction
    assert _refused(limiter, t, 600).retry_after_s == pytest.approx(6.0)
    limiter.correct(Grant.from_list(orphan.to_list()), 100)    # as kept with the request: 500 back
    limiter.release(limiter.acquire(t, 700), 700)
    assert _refused(limiter, t, 400).retry_after_s == pytest.approx(6.0)   # 100 + 700 + 400 > 1000


def test_a_dead_gateways_slots_expire(store):
    clock = Clock()
    limiter = _limiter(store, clock, lease_s=30)
    t = Tenant("acme", max_concurrent=1)
    held = limiter.acquire(t, 1)                           # never released: its gateway died
    clock.now += 29
    _refused(limiter, t)
    assert limiter.renew(held)                             # a long stream renews its lease
    clock.now += 29
    _refused(limiter, t)
    clock.now += 1.5
    limiter.acquire(t, 1)
    assert not limiter.renew(held)


def test_tenants_are_isolated(store):
    limiter = _limiter(store, Clock())
    a = Tenant("a", rpm=1, tpm=10, max_concurrent=1)
    b = Tenant("b", rpm=1, tpm=10, max_concurrent=1)
    limiter.arrive(a)
    limiter.acquire(a, 10)
    for kind_tokens in (1, 10, 0):
        _refused(limiter, a, kind_tokens)
    _rpm_refused(limiter, a)
    limiter.arrive(b)                                      # b is untouched by a's exhaustion
    grant = limiter.acquire(b, 10)
    assert grant.tenant == "b"
    _refused(limiter, b)
    _rpm_refused(limiter, b)


def test_grant_records_what_was_charged(store):
    grant = _limiter(store, Clock()).acquire(Tenant("acme", tpm=500), 42)
    assert isinstance(grant, Grant) and (grant.tenant, grant.tokens, grant.tpm) == ("acme", 42, 500)


def test_negative_tokens_rejected(store):
    limiter = _limiter(store, Clock())
    with pytest.raises(ValueError):
        limiter.acquire(Tenant("acme"), -1)


# ---- two replicas over one Redis ----------------------------------------------------------------------
def _pair(redis_url: str, redis_prefix: str, clock: Clock) -> tuple[Limiter, Limiter]:
    return (Limiter(redis_url, redis_prefix, clock=clock),
            Limiter(redis_url, redis_prefix, clock=clock))


@pytest.mark.parametrize("sixth_on", [0, 1])
def test_two_limiters_share_rpm(redis_url, redis_prefix, sixth_on):
    limiters = _pair(redis_url, redis_prefix, Clock())
    t = Tenant("acme", rpm=5)
    for i in range(5):
        limiters[i % 2].arrive(t)
    err = _rpm_refused(limiters[sixth_on], t)
    assert err.kind == "rpm" and err.retry_after_s == pytest.approx(12.0)
    _rpm_refused(limiters[1 - sixth_on], t)


def test_two_limiters_share_tpm_and_concurrency(redis_url, redis_prefix):
    one, two = _pair(redis_url, redis_prefix, Clock())
    t = Tenant("acme", tpm=1000, max_concurrent=1)
    grant = one.acquire(t, 700)
    assert _refused(two, t, 1).kind == "concurrency"
    two.release(grant, 700)                                # a grant is released on any replica
    assert _refused(two, t, 400).kind == "tpm"
    two.acquire(t, 300)


def test_concurrency_is_atomic_across_replicas(redis_url, redis_prefix):
    limiters = _pair(redis_url, redis_prefix, Clock())
    t = Tenant("acme", max_concurrent=3)
    granted, refused = [], []
    barrier = threading.Barrier(12)

    def worker(i: int) -> None:
        barrier.wait()
        try:
            granted.append(limiters[i % 2].acquire(t, 1))
        except LimitExceeded:
            refused.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert (len(granted), len(refused)) == (3, 9)


def test_redis_keys_expire_and_sit_under_the_prefix(redis_url, redis_prefix):
    limiter = Limiter(redis_url, redis_prefix, clock=Clock(), lease_s=30)
    acme = Tenant("acme", rpm=60, tpm=600, max_concurrent=4)
    limiter.arrive(acme)
    limiter.acquire(acme, 100)
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        keys = sorted(r.scan_iter(match=redis_prefix + "*"))
        assert keys == [redis_prefix + "rl:conc:acme", redis_prefix + "rl:rpm:acme",
                        redis_prefix + "rl:tpm:acme"]
        # rpm: TAT 1 s ahead (+1 s slack); tpm: 10 s ahead; conc: the lease (+1 s).
        assert 0 < r.pttl(redis_prefix + "rl:rpm:acme") <= 2000
        assert 9000 < r.pttl(redis_prefix + "rl:tpm:acme") <= 11000
        assert 29000 < r.pttl(redis_prefix + "rl:conc:acme") <= 31000
        assert float(r.get(redis_prefix + "rl:rpm:acme")) == T0 + 1


def test_a_renewed_grant_outlives_the_ttl_its_set_got_at_acquire(redis_url, redis_prefix):
    """The concurrency set's TTL is set at the tenant's last acquire (the lease + 1 s); renewing
    must keep the set alive too, or a renewed grant vanishes with it (real time: Redis expires it)."""
    limiter = Limiter(redis_url, redis_prefix, lease_s=1.0)
    t = Tenant("acme", max_concurrent=1)
    held = limiter.acquire(t, 1)
    for _ in range(4):                                     # 2.8 s: past the set's first 2 s TTL
        time.sleep(0.7)
        assert limiter.renew(held)
    _refused(limiter, t)
    limiter.release(held, 1)
    limiter.release(limiter.acquire(t, 1), 1)

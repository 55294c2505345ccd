"""GrantKeeper (gateway/tenancy/grants.py): a held grant outlives its lease while renewed, a
released one frees its slot, and the keeper's thread ends when it has nothing to keep. The
store-outage path (releases retried while Redis does not answer) runs against a paused real
Redis in tests/integration/test_redis_faults.py."""
from __future__ import annotations

import time

import pytest

from gateway.tenancy.grants import GrantKeeper
from gateway.tenancy.limits import LimitExceeded, Limiter
from gateway.tenancy.records import Tenant

LEASE_S = 0.3


@pytest.fixture(params=["memory", "redis"])
def limiter(request):
    if request.param == "memory":
        return Limiter(None, lease_s=LEASE_S)
    url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")
    return Limiter(url, prefix, lease_s=LEASE_S)


def test_a_held_grant_is_renewed_past_its_lease_and_freed_by_release(limiter):
    keeper = GrantKeeper(limiter)
    solo = Tenant("solo", max_concurrent=1)
    grant = limiter.acquire(solo, 1)
    keeper.hold(grant)
    time.sleep(3 * LEASE_S)                     # three leases: alive only if renewed
    with pytest.raises(LimitExceeded):
        limiter.acquire(solo, 1)
    assert keeper.release(grant, 1).result(timeout=5) is True
    assert keeper.pending() == 0
    limiter.release(limiter.acquire(solo, 1), 1)            # the slot is free at once
    deadline = time.monotonic() + 5
    while keeper._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert keeper._thread is None               # nothing to keep: no thread left running


def test_a_grant_not_held_expires_with_its_lease(limiter):
    solo = Tenant("solo", max_concurrent=1)
    limiter.acquire(solo, 1)                    # its gateway died: nobody renews it
    time.sleep(LEASE_S + 0.1)
    limiter.acquire(solo, 1)

"""The scheduler lease on a real Redis: one holder at a time, renewal, hand-over, expiry."""
from __future__ import annotations

import time

import redis

from scheduler.lease import Lease


def test_one_holder_at_a_time_and_hand_over(redis_url, redis_prefix):
    client = redis.Redis.from_url(redis_url)
    key = redis_prefix + "lease"
    old, new = Lease(client, key, "old", ttl_s=5), Lease(client, key, "new", ttl_s=5)
    assert old.try_acquire() and old.try_acquire()          # taken, and still ours
    assert not new.try_acquire() and not new.renew()        # the newcomer waits
    assert old.renew() and old.holder_now() == "old"
    new.release()                                           # not its lease: no effect
    assert old.holder_now() == "old"
    old.release()
    assert new.try_acquire() and new.holder_now() == "new"
    assert not old.renew()                                  # the old holder knows it lost it
    client.close()


def test_a_dead_holder_loses_the_lease_when_its_ttl_runs_out(redis_url, redis_prefix):
    client = redis.Redis.from_url(redis_url)
    key = redis_prefix + "lease"
    assert Lease(client, key, "crashed", ttl_s=0.2).try_acquire()
    waiting = Lease(client, key, "next", ttl_s=5)
    assert not waiting.try_acquire()
    time.sleep(0.35)
    assert waiting.try_acquire()
    client.close()

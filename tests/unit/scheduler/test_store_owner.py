"""A Redis store with an `owner` records which writer holds each request (gateway/assembly/fleet.py
reads it to find another replica's request): set at `add`, moved by an adopter's `add`, and
expiring with the record however it ends."""
from __future__ import annotations

import redis

from scheduler.request import Request, RequestStats, Status
from scheduler.store.base import StepWrite
from scheduler.store.redis_store import RedisStore
from workers.contract import SamplingParams


def request(rid: str) -> Request:
    return Request(RequestStats(rid, "acme", 0.0, prompt_len=2, max_tokens=8), [5, 6],
                   SamplingParams())


def ended(rid: str) -> RequestStats:
    s = RequestStats(rid, "acme", 0.0, prompt_len=2, max_tokens=8)
    s.status = Status.CANCELLED
    return s


def test_the_owner_is_set_at_add_moved_by_an_adopter_and_expires_with_the_record(redis_url, redis_prefix):
    client = redis.Redis.from_url(redis_url)
    owners = redis_prefix + "owner:"
    a = RedisStore(client, redis_prefix + "a:", ended_ttl_s=60, owner=(owners, "a"))
    b = RedisStore(client, redis_prefix + "b:", ended_ttl_s=60, owner=(owners, "b"))
    plain = RedisStore(client, redis_prefix + "c:")
    a.add(request("r1"))
    a.add(request("r2"))
    plain.add(request("r3"))
    assert client.get(owners + "r1") == b"a" and client.ttl(owners + "r1") == -1   # while live
    assert client.get(owners + "r3") is None                  # a store without an owner records none
    b.add(a.get("r1"))                                         # adopted: its owner moves
    a.hand_over(["r1"])
    assert client.get(owners + "r1") == b"b" and client.ttl(owners + "r1") == -1
    b.commit_step(StepWrite(ended=[ended("r1")]))              # ended by a step
    assert 0 < client.ttl(owners + "r1") <= 60
    a.end_requests([ended("r2")])                              # ended as a full store takes it
    assert 0 < client.ttl(owners + "r2") <= 60
    assert b.tail("r1", 0).stats.status is Status.CANCELLED

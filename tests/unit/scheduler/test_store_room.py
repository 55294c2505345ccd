"""A Redis at `maxmemory` (noeviction) under the step loop, on a redis-server of the test's own:
a step's write it refuses is not retried for ever (which would stop every stream); the requests
that made the step's tokens end, failed, with exactly what they had stored and streamed, their
records ended in the store all the same; the loop goes on, and serves again once there is room.
And the store's own pieces: the full store's refusal named, the end it still takes."""
from __future__ import annotations

import threading
import time

import pytest
import redis

from redis_server import private_redis_server, unique_prefix
from scheduler.request import Status
from scheduler.store import StepWrite, open_store
from scheduler.store.base import StoreFull
from test_step_loop import Collector, make_loop, request, run_to_end, truth


@pytest.fixture
def own_url():
    with private_redis_server() as url:
        yield url


def fill_up(client: redis.Redis) -> None:
    """Redis full from now on: a limit below what it uses."""
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)


def test_a_write_refused_by_a_full_redis_ends_its_requests_and_the_loop_goes_on(own_url):
    store = open_store(own_url, unique_prefix())
    client = redis.Redis.from_url(own_url)
    loop, sink = make_loop("fcfs", store, max_batch=2), Collector()
    for rid in ("a", "b"):
        loop.submit(request(rid, max_tokens=500), sink)
    for _ in range(3):
        loop.step()
    sent = {rid: list(tokens) for rid, tokens in sink.tokens.items()}
    assert set(sent) == {"a", "b"} and all(sent.values())
    fill_up(client)
    stepping = threading.Thread(target=loop.step, daemon=True)
    stepping.start()
    stepping.join(20)
    stalled = stepping.is_alive()
    if stalled:
        loop.stop()                                    # ends the writer's retries
    assert not stalled, "the step loop waits on a full store"
    for rid in ("a", "b"):
        end = sink.finished[rid]
        assert end.status is Status.FAILED and "full" in end.error
        assert sink.tokens[rid] == sent[rid] == truth(rid, len(sent[rid]))    # nothing unstored
    assert loop.store_writing() and loop.admission.live == 0 and loop.worker.resident() == []
    # (a full Redis refuses even reads inside MULTI: the store is read once there is room)
    client.config_set("maxmemory", 0)
    for rid in ("a", "b"):
        rec = store.get(rid)                           # ended in the store, with what was sent
        assert rec.stats.status is Status.FAILED and rec.output_ids == sent[rid]
        assert rec.stats.committed == len(sent[rid])
        assert client.pttl(store.prefix + "rec:" + rid) > 0    # expiring as ended records do
    assert store.load().requests == []
    loop.submit(request("c", max_tokens=30), sink)
    run_to_end(loop)
    assert sink.tokens["c"] == truth("c", 30) and sink.finished["c"].status is Status.FINISHED
    client.close()


def test_a_full_redis_refuses_a_step_by_name_and_still_takes_the_end_of_requests(own_url):
    store = open_store(own_url, unique_prefix())
    client = redis.Redis.from_url(own_url)
    loop, sink = make_loop("fcfs", store, max_batch=1), Collector()
    loop.submit(request("a", max_tokens=500), sink)
    loop.step()
    fill_up(client)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("more", "data")
    s = loop.state.requests["a"]
    with pytest.raises(StoreFull):
        store.commit_step(StepWrite(appended={"a": [1, 2]}, updated=[s]))
    s.status, s.cause = Status.CANCELLED, "client"
    store.end_requests([s])
    assert client.pttl(store.prefix + "rec:a") > 0       # it expires as an ended request does
    client.config_set("maxmemory", 0)
    assert store.get("a").stats.status is Status.CANCELLED and store.load().requests == []
    client.close()
    loop.stop()
